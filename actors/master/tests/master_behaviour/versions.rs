//! Object versions: each incarnation of a key gets one of its own, and the
//! state directory keeps them and the epoch they were handed out in.

use super::*;

/// The version the state directory would record for `key`.
pub(super) fn version(m: &M, key: &str) -> u64 {
    m.m.shards
        .iter()
        .find_map(|s| s.durable_image().get(key.as_bytes()).map(|r| r.version))
        .unwrap_or_else(|| panic!("{key} is not recorded"))
}

fn epoch(v: u64) -> u64 {
    v >> 32
}

/// Issue 32, copy identity: the master names every object incarnation with
/// a version (`epoch << 32 | n`) at its PutEnd; the state directory keeps
/// it, and a master restarted on the directory, or one that compacted it
/// into a snapshot first, begins the next epoch, so no version is handed
/// out twice.
#[test]
fn every_put_gets_a_version_of_its_own_and_a_restart_hands_out_later_ones() {
    let dir = state_dir("versions");
    let mut m = on_state_dir(&dir, 1_000);
    m.mount("seg", 100 * KIB);
    m.put("a", KIB);
    m.put("b", KIB);
    let (a, b) = (version(&m, "a"), version(&m, "b"));
    assert!(a != 0 && b != 0 && a != b, "{a:x} {b:x}");
    assert_eq!(epoch(a), epoch(b), "one epoch");
    assert!(epoch(a) != 0 && epoch(a) < 1 << 32);
    m.remove("a", true).unwrap();
    m.put("a", KIB);
    let a2 = version(&m, "a");
    assert!(a2 != a && a2 != b, "a new incarnation, a new version");
    drop(m); // the master goes

    let mut m = on_state_dir(&dir, 120_000);
    m.mount("seg", 100 * KIB); // the objects come back with their versions
    assert_eq!(version(&m, "a"), a2);
    assert_eq!(version(&m, "b"), b);
    m.put("c", KIB);
    let c = version(&m, "c");
    assert_eq!(epoch(c), epoch(a) + 1, "a restart begins the next epoch");
    // The log compacted into a snapshot: the epoch is in it.
    while m.m.compact_step(2).unwrap() {}
    drop(m);

    let mut m = on_state_dir(&dir, 240_000);
    m.mount("seg", 100 * KIB);
    assert_eq!(version(&m, "c"), c);
    m.put("d", KIB);
    assert_eq!(epoch(version(&m, "d")), epoch(c) + 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// Without a state directory a master draws its epoch from its seed (a
/// random one in a process; a simulation's replays the same).
#[test]
fn a_master_without_a_state_directory_draws_its_epoch_from_its_seed() {
    let first_version = |seed: u64| {
        let cfg = cfg();
        let mut m = M {
            m: MasterCore::new(1, &cfg, seed),
            now: 1_000,
            cfg,
            live: Vec::new(),
        };
        m.mount("seg", 100 * KIB);
        m.put("a", KIB);
        version(&m, "a")
    };
    let (one, two) = (first_version(1), first_version(2));
    assert_eq!(one & 0xffff_ffff, 1, "the first version of an epoch");
    assert_ne!(epoch(one), epoch(two), "two seeds, two epochs");
    assert_eq!(first_version(1), one, "a seed replays");
}

/// A tier new to the master (adopted) brings its copies back as objects of
/// the version each copy carries (wire version 5: `Recovered` names it).
#[test]
fn an_adopted_copy_keeps_the_version_it_carries() {
    let (mut m, _) = tiered(false);
    let mut rec = recovered("old", 3);
    if let NvmeUpdate::Recovered { version, sum, .. } = &mut rec {
        *version = 5 << 32 | 9;
        *sum = 0x1234;
    }
    update(&mut m, rec).unwrap();
    assert_eq!(version(&m, "old"), 5 << 32 | 9);
}

/// Issue 32's old-copy test: a key removed while the node holding its copy
/// was away, on a tier the master had not listed yet (the first master went
/// within `tier_quiet_ms` of the tier's mount); then a second restart (on a
/// compacted directory), or `client_ttl_ms` without the node, before it
/// comes back. Its tier,
/// adopted, reports the copy: a version this directory's masters handed out
/// that no object holds is old, refused (the node deletes it), and the key
/// stays removed; the copy of a key nobody removed comes back. Before, a
/// tier not listed had every copy it reported adopted: the removed key came
/// back (what the removal owed the tier was in memory only).
#[test]
fn a_removed_key_does_not_come_back_from_a_tier_the_master_never_listed() {
    for restart_again in [true, false] {
        let dir = state_dir(&format!("removed-unlisted-{restart_again}"));
        let mut m = on_state_dir(&dir, 1_000);
        let dram = mount_node(&mut m, true);
        m.put("k", 100);
        write_through_copy(&mut m, dram, 3);
        m.put("kept", 100);
        write_through_copy(&mut m, dram, 4);
        let (k, kept) = (version(&m, "k"), version(&m, "kept"));
        drop(m); // before the tier is listed
        let mut m = on_state_dir(&dir, 2_000); // the node stays away
        m.remove("k", true).unwrap();
        if restart_again {
            // Compacted first: the snapshot names the first epoch too.
            while m.m.compact_step(2).unwrap() {}
            drop(m);
            m = on_state_dir(&dir, 3_000);
        } else {
            // The recovered replicas are given up.
            m.advance(m.cfg.client_ttl_ms + 1_000);
        }
        mount_node(&mut m, true);
        let copy = |key: &str, loc: u64, version: u64| NvmeUpdate::Recovered {
            version,
            key: key.as_bytes().to_vec(),
            nvme: nvme_id(),
            loc,
            len: 100,
            sum: 0,
        };
        let e = update(&mut m, copy("k", 3, k)).unwrap_err();
        assert_eq!(
            e.code,
            ErrorCode::ObjectAlreadyExists,
            "{restart_again}: {e}"
        );
        assert_eq!(
            code(m.get("k")),
            ErrorCode::ObjectNotFound,
            "{restart_again}"
        );
        update(&mut m, copy("kept", 4, kept)).unwrap_or_else(|e| panic!("{restart_again}: {e}"));
        assert!(
            m.get("kept").unwrap().iter().any(|r| r.offset == 4),
            "{restart_again}"
        );
        m.check();
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Issue 32, copy identity: a Drop handed out to a tier the master has not
/// listed yet (adopted: its copies written before versions, or of another
/// lineage, are taken on their word) stays owed until the tier is listed.
/// The node reports its whole tier beside its task rounds, so it may report
/// the copy after it was handed the Drop and before it ran it, however long
/// its round takes, and across a restart of the master: refused each time,
/// and the key stays removed. Once the tier is listed the copy is old, and
/// the Drop is owed no more (a restart does not hand it out again). Before,
/// a Drop handed out was remembered for 10 s, in memory only: past that, or
/// after a restart, the adopted tier brought the removed key back.
#[test]
fn a_drop_handed_to_a_tier_still_adopted_is_owed_until_the_tier_is_listed() {
    for restart in [false, true] {
        let dir = state_dir(&format!("handed-drop-{restart}"));
        let mut m = on_state_dir(&dir, 1_000);
        let dram = mount_node(&mut m, false);
        // Copies written before versions, on a tier new to the master.
        update(&mut m, recovered("old", 3)).unwrap();
        update(&mut m, recovered("x0", 4)).unwrap();
        m.remove("old", true).unwrap();
        let t = tasks(&mut m, dram);
        assert_eq!(drop_of(&t, "old"), Some(Some(0)), "{t:?}");
        if restart {
            drop(m); // before the tier is listed
            m = on_state_dir(&dir, 2_000);
            let dram = mount_node(&mut m, false);
            let t = tasks(&mut m, dram);
            assert_eq!(drop_of(&t, "old"), Some(Some(0)), "owed still: {t:?}");
        }
        // The node's round is slow; its tier's reports (of other copies)
        // keep the tier adopted while more than 10 s pass.
        for i in 1..=3 {
            m.advance(m.cfg.client_ttl_ms / 2);
            update(&mut m, recovered(&format!("x{i}"), 4 + i)).unwrap();
        }
        let e = update(&mut m, recovered("old", 3)).unwrap_err();
        assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{restart}: {e}");
        assert_eq!(code(m.get("old")), ErrorCode::ObjectNotFound, "{restart}");
        m.check();
        // No report for `tier_quiet_ms`: the tier is listed, the copy old.
        m.advance(m.cfg.client_ttl_ms + 1_000);
        let e = update(&mut m, recovered("old", 3)).unwrap_err();
        assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{restart}: {e}");
        assert!(m.get("x3").is_ok(), "{restart}");
        m.check();
        drop(m);
        let mut m = on_state_dir(&dir, 3_000);
        let dram = mount_node(&mut m, false);
        let t = tasks(&mut m, dram);
        assert_eq!(drop_of(&t, "old"), None, "{restart}: owed no more: {t:?}");
        assert_eq!(code(m.get("old")), ErrorCode::ObjectNotFound, "{restart}");
        m.check();
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// More removals of an adopted tier's copies than the tier may be owed
/// Drops (16 k): the tier is listed at that removal, so the copy it cannot
/// be owed a Drop of is refused when the tier reports it, and the key stays
/// removed. Before, the copy was left un-owed on a tier that still took
/// back any copy nothing named, and its next report brought the key back.
#[test]
fn a_removal_past_the_owed_bound_on_an_adopted_tier_lists_the_tier() {
    let mut c = cfg();
    c.max_keys = 20_000;
    let mut m = M::with(1, c);
    mount_node(&mut m, false);
    let n = 16_385u64;
    // Copies from before versions, on a tier new to the master: adopted.
    for i in 0..n {
        update(&mut m, recovered(&format!("k{i}"), i + 1)).unwrap();
    }
    for i in 0..n {
        m.remove(&format!("k{i}"), true).unwrap();
    }
    let last = format!("k{}", n - 1);
    let e = update(&mut m, recovered(&last, n)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get(&last)), ErrorCode::ObjectNotFound);
    // Copies of keys nothing removed, reported only now, are lost with it.
    let e = update(&mut m, recovered("late", n + 1)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    m.check();
}

/// The version the Drop of `key`'s copy among `t` names, if one is there.
fn drop_of(t: &[NodeTask], key: &str) -> Option<Option<u64>> {
    t.iter().find_map(|t| match t {
        NodeTask::Drop(DropTask {
            key: k, version, ..
        }) if k == key.as_bytes() => Some(*version),
        _ => None,
    })
}

/// Issue 32, copy identity: every Drop a node is handed names the version
/// of the copy it is to take: one owed while the node's DRAM segment was
/// gone and handed out at its next mount ("a"), one read back from the
/// state directory after a restart ("b"), one owed for a recovered copy
/// whose object was removed before its tier came back ("d"), one owed for
/// a copy detached with its tier ("c"). Before, only a Drop queued at once
/// named one: the others took whatever copy of the key sat in the slot on
/// the node, a later incarnation's included.
#[test]
fn every_drop_names_the_version_of_the_copy_it_takes() {
    let dir = state_dir("drop-versions");
    let mut m = on_state_dir(&dir, 1_000);
    let dram = mount_node(&mut m, true);
    let mut v = std::collections::HashMap::new();
    for (k, loc) in [("a", 3), ("b", 4), ("c", 5), ("d", 6)] {
        m.put(k, 100);
        write_through_copy(&mut m, dram, loc);
        v.insert(k, version(&m, k));
    }
    // "a": removed while the node's DRAM segment is gone.
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: dram,
    })
    .unwrap();
    m.remove("a", true).unwrap();
    let dram2 = mount_tiered_dram(&mut m, "dram2", true);
    let t = tasks(&mut m, dram2);
    assert_eq!(drop_of(&t, "a"), Some(Some(v["a"])), "{t:?}");
    // "b": removed, its Drop not fetched before the master goes.
    m.remove("b", true).unwrap();
    drop(m);
    let mut m = on_state_dir(&dir, 2_000); // the node is away
                                           // "d": removed while its recovered replicas wait for their segments.
    m.remove("d", true).unwrap();
    let dram = mount_node(&mut m, true);
    let t = tasks(&mut m, dram);
    assert_eq!(drop_of(&t, "b"), Some(Some(v["b"])), "{t:?}");
    assert_eq!(drop_of(&t, "d"), Some(Some(v["d"])), "{t:?}");
    // "c": its copy detached with its tier, then removed.
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: nvme_id(),
    })
    .unwrap();
    // (Its only replica went with the tier: no object, but the copy is
    // its last object's.)
    assert_eq!(code(m.remove("c", true)), ErrorCode::ObjectNotFound);
    let t = super::hot::node_tasks(&mut m, NODE, dram);
    assert_eq!(drop_of(&t, "c"), Some(Some(v["c"])), "{t:?}");
    m.check();
    std::fs::remove_dir_all(&dir).ok();
}
