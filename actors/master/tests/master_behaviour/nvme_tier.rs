//! The NVMe tier: demotion, promotion, write-through, tier reports, owed
//! Drops, listed tiers and copies that must not come back.

use super::*;

// ---- NVMe tier ------------------------------------------------------------------

pub(super) const NVME: SegmentId = 0x4e56_4d45;

/// One shard; a 10 KiB DRAM segment whose node has an NVMe tier.
pub(super) fn tiered(write_through: bool) -> (M, SegmentId) {
    let mut c = cfg();
    c.promote_after_reads = 2;
    let mut m = M::with(1, c);
    let id = mount_node(&mut m, write_through);
    (m, id)
}

/// `NODE` mounts its NVMe tier and its DRAM segment "dram" (the tier
/// attached); returns the DRAM segment's id.
pub(super) fn mount_node(m: &mut M, write_through: bool) -> SegmentId {
    if !m.live.contains(&NODE) {
        m.live.push(NODE);
    }
    mount_tier(m);
    mount_tiered_dram(m, "dram", write_through)
}

pub(super) fn mount_tier(m: &mut M) {
    let mut nv = spec("nvme:host-a:/dev/x", 1 << 30, "host-a");
    nv.tier = Tier::Nvme;
    let r = m
        .call(Q::MountSegment {
            client_id: NODE,
            spec: nv,
        })
        .unwrap();
    assert!(
        matches!(r, A::Mounted { segment_id } if segment_id == kvpool_wire::proto::segment_id_for("nvme:host-a:/dev/x"))
    );
}

/// The tier's report of a copy of `key` at `loc` (no checksum).
pub(super) fn recovered(key: &str, loc: u64) -> NvmeUpdate {
    NvmeUpdate::Recovered {
        version: 0,
        key: key.as_bytes().to_vec(),
        nvme: nvme_id(),
        loc,
        len: 100,
        sum: 0,
    }
}

/// The tier's report that it evicted its copy of `key` at `loc`.
pub(super) fn evicted(key: &str, loc: u64) -> NvmeUpdate {
    NvmeUpdate::Evicted {
        version: 0,
        key: key.as_bytes().to_vec(),
        nvme: nvme_id(),
        loc,
    }
}

/// Mounts a 10 KiB DRAM segment `name` of `NODE` with the tier attached.
pub(super) fn mount_tiered_dram(m: &mut M, name: &str, write_through: bool) -> SegmentId {
    let mut dram = spec(name, 10 * KIB, "host-a");
    dram.nvme = Some(NvmeAttach {
        segment_id: nvme_id(),
        write_through,
    });
    match m
        .call(Q::MountSegment {
            client_id: NODE,
            spec: dram,
        })
        .unwrap()
    {
        A::Mounted { segment_id } => segment_id,
        other => panic!("{other:?}"),
    }
}

pub(super) fn nvme_id() -> SegmentId {
    let _ = NVME;
    kvpool_wire::proto::segment_id_for("nvme:host-a:/dev/x")
}

pub(super) fn tasks(m: &mut M, seg: SegmentId) -> Vec<NodeTask> {
    match m
        .call(Q::NodeTasks {
            client_id: NODE,
            shard: 0,
            segments: vec![seg, nvme_id()],
            max: 100,
        })
        .unwrap()
    {
        A::Tasks(t) => t,
        other => panic!("{other:?}"),
    }
}

pub(super) fn update(m: &mut M, u: NvmeUpdate) -> Result<(), KvError> {
    match m
        .call(Q::NvmeUpdates {
            client_id: NODE,
            updates: vec![u],
        })
        .unwrap()
    {
        A::BatchDone(mut v) => Result::from(v.remove(0)),
        other => panic!("{other:?}"),
    }
}

/// The node's report of a copy at `loc` made for a Persist task (as the
/// task named it, its version too), without a checksum of its own to offer.
pub(super) fn stored(task: &NodeTask, loc: u64) -> NvmeUpdate {
    let NodeTask::Persist(PersistTask {
        key,
        dram,
        offset,
        len,
        demote,
        version,
        ..
    }) = task.clone()
    else {
        panic!("not a Persist task: {task:?}")
    };
    NvmeUpdate::Stored {
        version,
        key,
        nvme: nvme_id(),
        loc,
        len,
        dram,
        offset,
        demote,
        sum: 0,
    }
}

#[test]
fn eviction_demotes_to_the_nodes_nvme_tier_instead_of_dropping() {
    let (mut m, dram) = tiered(false);
    fill(&mut m, "k", 10, opts(1)); // 100%: the last put schedules demotions
    let t = tasks(&mut m, dram);
    assert!(!t.is_empty(), "demotions were asked for");
    let NodeTask::Persist(PersistTask {
        key,
        offset,
        len,
        demote,
        version,
        ..
    }) = t[0].clone()
    else {
        panic!("{t:?}")
    };
    assert!(demote);
    assert_eq!(key, b"k0", "oldest first");
    let used = m.used();
    assert!(m.exist("k0"), "still there while the copy is made");
    update(
        &mut m,
        NvmeUpdate::Stored {
            version,
            key: key.clone(),
            nvme: nvme_id(),
            loc: 7,
            len,
            dram,
            offset,
            demote: true,
            sum: 0,
        },
    )
    .unwrap();
    assert!(m.used() < used, "the DRAM copy's space came back");
    let r = m.get("k0").unwrap();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].tier, Tier::Nvme);
    assert_eq!(r[0].offset, 7);
    assert!(m.stat().demotions >= 1);
}

/// Runs the write-through Persist task the master asks for first (it must
/// be one, not a demotion) as a node would: reports the copy `Stored` at `loc`.
pub(super) fn write_through_copy(m: &mut M, dram: SegmentId, loc: u64) {
    let t = tasks(m, dram);
    let Some(NodeTask::Persist(PersistTask {
        key,
        offset,
        len,
        demote,
        version,
        ..
    })) = t.first().cloned()
    else {
        panic!("{t:?}")
    };
    assert!(!demote);
    update(
        m,
        NvmeUpdate::Stored {
            version,
            key,
            nvme: nvme_id(),
            loc,
            len,
            dram,
            offset,
            demote: false,
            sum: 0,
        },
    )
    .unwrap();
}

/// A write-through pool filled to 100%: the Persist tasks of k0 the node
/// fetched, its write-through copy's and its demotion's (queued by the
/// eviction of the last put, before the write-through copy landed).
pub(super) fn write_through_and_demotion_of_k0() -> (M, NodeTask, NodeTask) {
    let (mut m, dram) = tiered(true);
    fill(&mut m, "k", 10, opts(1));
    let t = tasks(&mut m, dram);
    let persist_of = |demote: bool| {
        t.iter()
            .find(|t| {
                matches!(t, NodeTask::Persist(PersistTask { key, demote: d, .. }) if key == b"k0" && *d == demote)
            })
            .cloned()
            .unwrap_or_else(|| panic!("a Persist of k0 with demote {demote}: {t:?}"))
    };
    (m, persist_of(false), persist_of(true))
}

/// Puts that need room, their leases over: they evict.
pub(super) fn puts_that_evict(m: &mut M, each: impl Fn(&str, &[ReplicaDesc])) {
    m.advance(60_000);
    for i in 0..20 {
        let key = format!("new{i}");
        let Ok(r) = m.start(&key, KIB) else {
            continue;
        };
        m.end(&key).unwrap();
        each(&key, &r);
    }
}

/// Found by the cluster simulation (seed 798 with `KVPOOL_SIM_UNSUMMED=1`,
/// and seed 132 of an earlier build): a demotion is queued, then the
/// write-through copy of the same object lands (`Stored`, demote false).
/// The node still holds the demotion's Persist task, which reads the DRAM
/// range, so that range must not go to another put before the demotion
/// reports (before the fix the replica became Ready again, the next
/// eviction freed it at once because the object had an NVMe copy, and a
/// put got the range: the node copied that put's bytes as the object's).
#[test]
fn a_range_a_queued_demotion_reads_is_not_given_to_a_put_before_the_demotion_reports() {
    let (mut m, through, demotion) = write_through_and_demotion_of_k0();
    let NodeTask::Persist(PersistTask { offset, .. }) = demotion else {
        unreachable!()
    };
    // The write-through copy lands; the demotion is still with the node.
    update(&mut m, stored(&through, 3)).unwrap();
    puts_that_evict(&mut m, |key, r| {
        assert!(
            r.iter().all(|r| r.offset != offset),
            "put {key} got k0's range at {offset}, which the node's demotion still reads"
        );
    });
    // Once the demotion reports, the range is k0's no more.
    update(&mut m, stored(&demotion, 3)).unwrap();
    assert_eq!(m.get("k0").unwrap().len(), 1, "k0 is on NVMe only");
}

/// The same race with the write-through copy failing: the demotion under
/// way goes on (before, the replica became Ready again and the next
/// eviction asked for a second demotion of it while the first ran).
#[test]
fn a_failed_write_through_copy_does_not_end_a_demotion_under_way() {
    let (mut m, _, demotion) = write_through_and_demotion_of_k0();
    let NodeTask::Persist(PersistTask { dram, offset, .. }) = demotion.clone() else {
        unreachable!()
    };
    update(
        &mut m,
        NvmeUpdate::PersistFailed {
            key: b"k0".to_vec(),
            dram,
            offset,
            demote: false,
        },
    )
    .unwrap();
    puts_that_evict(&mut m, |_, _| {});
    let again: Vec<NodeTask> = tasks(&mut m, dram)
        .into_iter()
        .filter(|t| matches!(t, NodeTask::Persist(PersistTask { key, .. }) if key == b"k0"))
        .collect();
    assert!(again.is_empty(), "k0 demoted a second time: {again:?}");
    update(&mut m, stored(&demotion, 3)).unwrap();
    assert_eq!(m.get("k0").unwrap().len(), 1, "k0 is on NVMe only");
}

/// Found by the cluster simulation (seed 671 with `KVPOOL_SIM_UNSUMMED=1`,
/// once the restarted master kept its state directory): an object put
/// without a checksum took a node's recovered NVMe copy of an earlier
/// object under the key, of the same size, as its own replica, and readers
/// got the earlier bytes. Without a checksum the master takes a recovered
/// copy only when it lists that very replica already.
#[test]
fn a_recovered_copy_is_not_taken_for_an_object_without_a_checksum_it_cannot_be_matched_with() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100); // no checksum
    let rec = |loc| NvmeUpdate::Recovered {
        version: 0,
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc,
        len: 100,
        sum: 0x1234,
    };
    let e = update(&mut m, rec(9)).unwrap_err();
    assert_eq!(
        e.code,
        ErrorCode::ObjectAlreadyExists,
        "the node removes it"
    );
    assert_eq!(m.get("k").unwrap().len(), 1, "only the DRAM replica");
    // The copy the master took for this object comes back as it was.
    write_through_copy(&mut m, dram, 3);
    update(&mut m, rec(3)).unwrap();
    let r = m.get("k").unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!((r[1].tier, r[1].offset), (Tier::Nvme, 3));
}

/// Found by the cluster simulation (seed 671 with `KVPOOL_SIM_UNSUMMED=1`,
/// with the master's state directory): a demotion queued for a node that
/// was away; the object was removed and the key came back from the node's
/// tier; the node then ran the old demotion on whatever lay in the range
/// and replaced the key's copy, the one the master listed, with it. A
/// Persist task whose object no longer holds its range is not handed out.
#[test]
fn a_demotion_of_a_removed_object_is_not_handed_out() {
    let (mut m, dram) = tiered(false);
    fill(&mut m, "k", 10, opts(1)); // k0's demotion queued, not yet fetched
    m.remove("k0", true).unwrap();
    let t = tasks(&mut m, dram);
    assert!(
        !t.iter()
            .any(|t| matches!(t, NodeTask::Persist(PersistTask { key, .. }) if key == b"k0")),
        "{t:?}"
    );
}

/// Found by the cluster simulation (seed 63, with the master's state
/// directory): a removal queued a Drop of the key's NVMe copy for a node
/// whose tier was away; the tier came back and reported the copy, which
/// the master took (the key was free); the node then ran the Drop and
/// removed the copy the master listed. The report is refused now (see
/// `a_recovered_copy_whose_drop_is_queued_is_refused`): the key stays
/// removed and the Drop goes out. (A Drop of a copy the key's object lists
/// is still never handed out.)
#[test]
fn a_copy_reported_again_after_its_removal_is_refused_and_its_drop_goes_out() {
    let (mut m, dram) = tiered(false);
    let rec = NvmeUpdate::Recovered {
        version: 0,
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 9,
        len: 100,
        sum: 0x1234,
    };
    update(&mut m, rec.clone()).unwrap();
    m.remove("k", true).unwrap(); // queues Drop k at 9
    let e = update(&mut m, rec).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    let t = tasks(&mut m, dram);
    assert!(
        t.iter()
            .any(|t| matches!(t, NodeTask::Drop(DropTask { loc: 9, .. }))),
        "{t:?}"
    );
}

#[test]
fn write_through_asks_for_a_copy_at_put_end_and_keeps_the_dram_replica() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    let r = m.get("k").unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].tier, Tier::Dram, "DRAM first");
    assert_eq!(r[1].tier, Tier::Nvme);
}

#[test]
fn a_stored_report_for_an_object_removed_meanwhile_is_refused_so_the_node_deletes_its_copy() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    let copy = tasks(&mut m, dram).remove(0);
    m.remove("k", false).unwrap();
    let e = update(&mut m, stored(&copy, 3)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectNotFound);
}

#[test]
fn an_nvme_eviction_report_drops_that_replica_and_an_object_left_without_one() {
    let (mut m, _) = tiered(false);
    update(
        &mut m,
        NvmeUpdate::Recovered {
            version: 0,
            key: b"only-nvme".to_vec(),
            nvme: nvme_id(),
            loc: 9,
            len: 500,
            sum: 0,
        },
    )
    .unwrap();
    assert!(m.exist("only-nvme"));
    update(&mut m, evicted("only-nvme", 9)).unwrap();
    assert!(!m.exist("only-nvme"));
}

#[test]
fn recovered_objects_come_back_and_stale_copies_are_refused() {
    let (mut m, _) = tiered(false);
    update(
        &mut m,
        NvmeUpdate::Recovered {
            version: 0,
            key: b"back".to_vec(),
            nvme: nvme_id(),
            loc: 1,
            len: 4096,
            sum: 0,
        },
    )
    .unwrap();
    let r = m.get("back").unwrap();
    assert_eq!((r[0].tier, r[0].len), (Tier::Nvme, 4096));
    // A newer object under a key the device still has: the device copy is stale.
    m.put("newer", 100);
    let e = update(
        &mut m,
        NvmeUpdate::Recovered {
            version: 0,
            key: b"newer".to_vec(),
            nvme: nvme_id(),
            loc: 2,
            len: 555,
            sum: 0,
        },
    )
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists);
}

#[test]
fn reads_of_an_nvme_only_object_promote_it_back_to_dram() {
    let (mut m, dram) = tiered(false);
    update(
        &mut m,
        NvmeUpdate::Recovered {
            version: 0,
            key: b"hot".to_vec(),
            nvme: nvme_id(),
            loc: 5,
            len: 1000,
            sum: 0,
        },
    )
    .unwrap();
    m.get("hot").unwrap();
    assert!(tasks(&mut m, dram).is_empty(), "one read is not enough");
    m.get("hot").unwrap();
    let t = tasks(&mut m, dram);
    let Some(NodeTask::Promote(PromoteTask {
        key,
        loc,
        dram: d,
        offset,
        ..
    })) = t.first().cloned()
    else {
        panic!("{t:?}")
    };
    assert_eq!((key.as_slice(), loc, d), (b"hot".as_slice(), 5, dram));
    // Until the node reports the copy, readers still get NVMe only.
    assert_eq!(m.get("hot").unwrap().len(), 1);
    update(
        &mut m,
        NvmeUpdate::Promoted {
            key,
            dram,
            offset,
            ok: true,
        },
    )
    .unwrap();
    let r = m.get("hot").unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].tier, Tier::Dram);
    assert_eq!(m.stat().promotions, 1);
}

#[test]
fn a_failed_persist_of_a_demotion_evicts_the_dram_copy_anyway() {
    let (mut m, dram) = tiered(false);
    fill(&mut m, "k", 10, opts(1));
    let Some(NodeTask::Persist(PersistTask { key, offset, .. })) =
        tasks(&mut m, dram).first().cloned()
    else {
        panic!()
    };
    update(
        &mut m,
        NvmeUpdate::PersistFailed {
            key: key.clone(),
            dram,
            offset,
            demote: true,
        },
    )
    .unwrap();
    assert!(!m.exist(std::str::from_utf8(&key).unwrap()));
}

#[test]
fn an_nvme_tier_mounted_again_after_a_restart_keeps_its_replicas() {
    let (mut m, _) = tiered(false);
    update(
        &mut m,
        NvmeUpdate::Recovered {
            version: 0,
            key: b"kept".to_vec(),
            nvme: nvme_id(),
            loc: 4,
            len: 100,
            sum: 0,
        },
    )
    .unwrap();
    let mut nv = spec("nvme:host-a:/dev/x", 1 << 30, "host-a");
    nv.tier = Tier::Nvme;
    nv.endpoint.port = 9999; // the restarted node's new port
    m.call(Q::MountSegment {
        client_id: NODE + 5,
        spec: nv,
    })
    .unwrap();
    let r = m.get("kept").unwrap();
    assert_eq!(r[0].endpoint.port, 9999);
}

#[test]
fn removing_an_object_asks_its_node_to_drop_the_nvme_copy_before_a_new_put_of_the_key() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    let old = super::versions::version(&m, "k");
    m.remove("k", true).unwrap();
    // The same key, put again: its copy must not be confused with the old one.
    m.put("k", 100);
    drop_then_copy(&mut m, dram, "k", 3, old);
}

/// The node's next tasks: drop the old object's NVMe copy of `key` at
/// `loc` (that incarnation's, `old`), then copy the new object of `key`
/// (named by its own version), in that order, and no others.
pub(super) fn drop_then_copy(m: &mut M, dram: SegmentId, key: &str, loc: u64, old: u64) {
    let t = tasks(m, dram);
    assert_eq!(
        t.first(),
        Some(&NodeTask::Drop(DropTask {
            key: key.as_bytes().to_vec(),
            loc,
            version: Some(old),
        })),
        "the old object's NVMe copy is dropped first: {t:?}"
    );
    let new = super::versions::version(m, key);
    assert_ne!(new, old);
    assert!(
        matches!(t.get(1), Some(NodeTask::Persist(PersistTask { key: k, demote: false, version, .. }))
            if k == key.as_bytes() && *version == new),
        "then the new object's copy is made: {t:?}"
    );
    assert_eq!(t.len(), 2, "{t:?}");
}

#[test]
fn a_replace_drops_the_old_objects_nvme_copy_before_the_new_object_is_copied() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    let old = super::versions::version(&m, "k");
    m.replace_as(WRITER, "k", 100).unwrap();
    assert_eq!(m.get("k").unwrap().len(), 2, "the old object, both copies");
    assert!(tasks(&mut m, dram).is_empty(), "nothing until the put ends");
    m.end("k").unwrap();
    drop_then_copy(&mut m, dram, "k", 3, old);
    let r = m.get("k").unwrap();
    assert_eq!((r.len(), r[0].tier), (1, Tier::Dram), "no copy listed yet");
    m.check();
}

/// Found by the cluster simulation with batch puts (unsummed seed 2380):
/// the node ran a replace's Drop of the old copy and wrote the new
/// object's copy in the freed slot; its whole-tier report (after a remount)
/// named that copy before its `Stored`. Refused as the old copy (its Drop
/// still owed), the node deleted it, and the `Stored` that followed listed
/// an empty slot. A copy with the new object's checksum is now left to its
/// `Stored` (refused as not now: the node keeps it), which lists it; the
/// old object's copy is still refused.
#[test]
fn a_new_copy_in_the_slot_a_drop_freed_reported_before_its_stored_is_kept() {
    const OLD: u64 = 0x01d;
    const NEW: u64 = 0x2e2;
    let (mut m, dram) = tiered(true);
    let stored_as = |task: &NodeTask, sum: u64| {
        let mut s = stored(task, 3);
        if let NvmeUpdate::Stored { sum: s, .. } = &mut s {
            *s = sum;
        }
        s
    };
    m.start("k", 100).unwrap();
    super::trust::end_with_sum(&mut m, "k", OLD);
    let first = tasks(&mut m, dram).remove(0);
    update(&mut m, stored_as(&first, OLD)).unwrap();
    m.replace_as(WRITER, "k", 100).unwrap();
    super::trust::end_with_sum(&mut m, "k", NEW);
    let t = tasks(&mut m, dram);
    assert!(
        matches!(t.first(), Some(NodeTask::Drop(DropTask { loc: 3, .. }))),
        "{t:?}"
    );
    let persist = t[1].clone();
    assert!(
        matches!(
            persist,
            NodeTask::Persist(PersistTask { demote: false, .. })
        ),
        "{t:?}"
    );
    let at3 = |sum| NvmeUpdate::Recovered {
        version: 0,
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 100,
        sum,
    };
    // The old copy, its Drop not run yet: refused, the node deletes it.
    let e = update(&mut m, at3(OLD)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    // The Drop ran and the new copy took the slot; the report comes first.
    let e = update(&mut m, at3(NEW)).unwrap_err();
    assert_eq!(
        e.code,
        ErrorCode::TryAgain,
        "refused as stale, the node would delete the new copy: {e}"
    );
    update(&mut m, stored_as(&persist, NEW)).unwrap();
    let r = m.get("k").unwrap();
    assert!(
        r.iter().any(|r| r.tier == Tier::Nvme && r.offset == 3),
        "{r:?}"
    );
    m.check();
}

/// The unsummed case of seed 2380, closed by copy versions (issue 32):
/// without checksums the new object's copy in the slot the old copy's Drop
/// freed is told from the old copy by the version it carries. Reported
/// before its `Stored`, it is the object's; the old copy is still refused.
#[test]
fn an_unsummed_new_copy_in_a_freed_slot_is_told_from_the_old_one_by_its_version() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100); // no checksum
    let first = tasks(&mut m, dram).remove(0);
    update(&mut m, stored(&first, 3)).unwrap();
    let old = super::versions::version(&m, "k");
    m.replace_as(WRITER, "k", 100).unwrap();
    m.end("k").unwrap();
    let new = super::versions::version(&m, "k");
    let t = tasks(&mut m, dram);
    assert!(
        matches!(t.first(), Some(NodeTask::Drop(DropTask { loc: 3, version: Some(v), .. })) if *v == old),
        "{t:?}"
    );
    let persist = t[1].clone();
    let at3 = |version| NvmeUpdate::Recovered {
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 100,
        sum: 0,
        version,
    };
    // The old copy, its Drop not run yet: refused, the node deletes it.
    let e = update(&mut m, at3(old)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    // The Drop ran and the new copy took the slot; the report comes first.
    update(&mut m, at3(new)).expect("the new object's copy is kept");
    update(&mut m, stored(&persist, 3)).unwrap();
    let r = m.get("k").unwrap();
    assert!(
        r.iter().any(|r| r.tier == Tier::Nvme && r.offset == 3),
        "{r:?}"
    );
    // A Stored of the old incarnation's copy is refused.
    let mut late = stored(&persist, 3);
    if let NvmeUpdate::Stored { version, .. } = &mut late {
        *version = old;
    }
    let e = update(&mut m, late).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectNotFound, "{e}");
    m.check();
}

#[test]
fn a_copy_made_from_the_replaced_objects_range_is_never_listed_for_the_new_one() {
    // Same size, no checksums: only the DRAM range tells the two apart.
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    let copy = tasks(&mut m, dram).remove(0);
    // Replaced while the node is still copying the old object out.
    let used = m.used();
    m.replace_as(WRITER, "k", 100).unwrap();
    m.end("k").unwrap();
    assert_eq!(
        m.used(),
        2 * used,
        "the range the node is reading is not handed out again yet"
    );
    let e = update(&mut m, stored(&copy, 3)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectNotFound, "{e}");
    let r = m.get("k").unwrap();
    assert_eq!((r.len(), r[0].tier), (1, Tier::Dram), "{r:?}");
    // Once a node can no longer be copying it, the range comes back.
    m.advance(m.cfg.stale_put_grace_ms.max(m.cfg.lease_ttl_ms));
    assert_eq!(m.used(), used);
    m.check();
}

#[test]
fn a_restarted_node_reporting_the_copy_of_an_object_being_replaced_keeps_it() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.replace_as(WRITER, "k", 100).unwrap();
    // The node restarts and reports what its tier holds: the copy is the
    // complete object's, which readers still get (the node deletes copies
    // the master refuses).
    update(
        &mut m,
        NvmeUpdate::Recovered {
            version: 0,
            key: b"k".to_vec(),
            nvme: nvme_id(),
            loc: 3,
            len: 100,
            sum: 0,
        },
    )
    .unwrap();
    let r = m.get("k").unwrap();
    assert_eq!((r.len(), r[1].tier, r[1].offset), (2, Tier::Nvme, 3));
    // A copy under a key that is only being put is still refused.
    m.start("fresh", 100).unwrap();
    let e = update(
        &mut m,
        NvmeUpdate::Recovered {
            version: 0,
            key: b"fresh".to_vec(),
            nvme: nvme_id(),
            loc: 4,
            len: 100,
            sum: 0,
        },
    )
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists);
    m.check();
}

/// A removed object's NVMe copy is owed a Drop; if its node reports the
/// copy (it restarted, or mounted its tier again) before it ran the Drop,
/// taking the report would bring the removed object back (found by the
/// cluster simulation, seed 618 of 3db89c7: the Drop then ran, the tier
/// reused the slot, and the master listed another version's bytes there).
#[test]
fn a_recovered_copy_whose_drop_is_queued_is_refused() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.remove("k", true).unwrap();
    let rec = NvmeUpdate::Recovered {
        version: 0,
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 100,
        sum: 0,
    };
    let e = update(&mut m, rec.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    // Handed its Drop, the node may still report the copy before it runs
    // it: still refused (a later put's copy in the reused slot is listed
    // once its Stored is taken, and a listed copy is never refused).
    let t = tasks(&mut m, dram);
    assert!(
        t.iter()
            .any(|t| matches!(t, NodeTask::Drop(DropTask { loc: 3, .. }))),
        "{t:?}"
    );
    let e = update(&mut m, rec.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    // Long after, too (issue 32: the node died before it ran the Drop, and
    // reports its tier when it is back). Before, the master had forgotten
    // the Drop after 10 s and took the copy: the removed key came back. The
    // tier is listed by then (no report for `client_ttl_ms`): a copy no
    // object lists is an old one. (A later put's copy in the reused slot
    // whose Stored report was lost is refused too: that object keeps its
    // DRAM replica.)
    m.advance(11_000);
    let e = update(&mut m, rec).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    m.check();
}

/// A fresh scratch directory for a master's state.
pub(super) fn state_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpool-mb-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A master on `dir` whose node's tier holds write-through copies of "k"
/// (at 3) and "kept" (at 4), and is listed (`client_ttl_ms` without a
/// report); returns it and the node's DRAM segment.
pub(super) fn listed_tier_with_k_and_kept(dir: &std::path::Path) -> (M, SegmentId) {
    let mut m = on_state_dir(dir, 1_000);
    let dram = mount_node(&mut m, true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.put("kept", 100);
    write_through_copy(&mut m, dram, 4);
    m.advance(m.cfg.client_ttl_ms + 1_000);
    (m, dram)
}

/// After a restart, `NODE` mounts again and reports its tier: the copy of
/// the removed "k" is refused, the listed copy of "kept" comes back.
pub(super) fn old_copy_refused_listed_copy_back(m: &mut M) {
    mount_node(m, true);
    let e = update(m, recovered("k", 3)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    update(m, recovered("kept", 4)).unwrap();
    assert!(m.get("kept").unwrap().iter().any(|r| r.offset == 4));
    m.check();
}

/// Issue 32, copy identity: a removed object's Drop went out to its node,
/// which died before it ran it; the master restarted on its state
/// directory; the node came back and reported its tier. The old copy is
/// refused and the key stays removed; the copy the master lists comes back.
/// Before, the restarted master had forgotten the Drop (it remembered
/// handed-out Drops 10 s, in memory) and adopted the copy of a key its
/// image did not hold: the removed key came back.
#[test]
fn a_removed_key_does_not_come_back_from_a_copy_whose_drop_was_handed_out_before_a_restart() {
    let dir = state_dir("handed-out-drop");
    let (mut m, dram) = listed_tier_with_k_and_kept(&dir);
    m.remove("k", true).unwrap();
    let t = tasks(&mut m, dram);
    assert!(
        t.iter().any(
            |t| matches!(t, NodeTask::Drop(DropTask { version: _, key, loc: 3 }) if key == b"k")
        ),
        "{t:?}"
    );
    drop(m); // the master goes; the node dies before it runs the Drop
    old_copy_refused_listed_copy_back(&mut on_state_dir(&dir, 60_000));
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 32, copy identity: a key removed while the restarted master waited
/// for its node (the object was recovered, its segments not back), then a
/// second restart before the node came back. Before, what the removal owed
/// the node's tier was in memory only; the second master adopted the copy
/// and the removed key came back.
#[test]
fn a_key_removed_while_its_node_was_away_stays_removed_across_a_second_restart() {
    let dir = state_dir("removed-parked");
    let (m, _) = listed_tier_with_k_and_kept(&dir);
    drop(m);
    let mut m = on_state_dir(&dir, 60_000); // the node stays away
    m.remove("k", true).unwrap();
    drop(m);
    old_copy_refused_listed_copy_back(&mut on_state_dir(&dir, 70_000));
    std::fs::remove_dir_all(&dir).ok();
}

/// Found by the cluster simulation (seed 4 with `KVPOOL_SIM_UNSUMMED=1`,
/// once tier removals could fail): after a restart an object came back
/// through its DRAM replica while its NVMe copy still waited for its tier;
/// losing that replica (there an eviction, here its segment unmounted) took
/// the object and the record of its waiting copy, and the tier's report was
/// refused as an old copy. Without a restart the object would have kept its
/// copy; it now waits for it again, as right after the restart.
#[test]
fn a_recovered_object_that_loses_its_dram_replica_waits_for_its_nvme_copy() {
    let dir = state_dir("replicaless");
    let (m, _) = listed_tier_with_k_and_kept(&dir);
    drop(m);
    let mut m = on_state_dir(&dir, 60_000);
    let dram = mount_tiered_dram(&mut m, "dram", true); // the tier stays away
    let r = m.get("k").unwrap();
    assert!(r.iter().all(|r| r.tier == Tier::Dram), "{r:?}");
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: dram,
    })
    .unwrap();
    assert_eq!(
        code(m.get("k")),
        ErrorCode::ReplicaNotReady,
        "waiting again"
    );
    mount_tier(&mut m);
    for (key, loc) in [("k", 3), ("kept", 4)] {
        let r = m.get(key).unwrap();
        assert!(
            r.iter().any(|r| r.tier == Tier::Nvme && r.offset == loc),
            "{key}: {r:?}"
        );
    }
    m.check();
    std::fs::remove_dir_all(&dir).ok();
}

/// Found by the cluster simulation (seed 4317 with `KVPOOL_SIM_UNSUMMED=1`,
/// on a state directory): an object recovered after a restart came back
/// through its DRAM replica, its NVMe copy still waiting for its tier, and
/// was replaced (no checksum). After a second restart (the new object
/// recovered, its DRAM segment not back) the node's tier, never listed,
/// mounted and reported the replaced object's copy: it was taken as the
/// key's object, and its record named the new object's waiting DRAM replica
/// beside it, under the old version. Once that segment mounted (after a
/// third restart) the master listed the new bytes for the old object. A
/// recovered object not back yet takes a copy only if it is its own.
#[test]
fn an_adopted_tier_does_not_bring_back_a_replaced_copy_under_the_recovered_object() {
    let dir = state_dir("adopted-replaced-copy");
    let mut m = on_state_dir(&dir, 1_000);
    let dram = mount_node(&mut m, true);
    m.put("k", 100); // no checksum
    write_through_copy(&mut m, dram, 3);
    let old = super::versions::version(&m, "k");
    drop(m); // before the tier is listed
    let mut m = on_state_dir(&dir, 2_000);
    mount_tiered_dram(&mut m, "dram", true); // the tier stays away
    let new = m.put_with(
        "k",
        100,
        PutOptions {
            replace: true,
            ..opts(1)
        },
    );
    let v = super::versions::version(&m, "k");
    drop(m);
    let mut m = on_state_dir(&dir, 3_000);
    mount_tier(&mut m); // adopted: never listed
    let report = update(
        &mut m,
        NvmeUpdate::Recovered {
            version: old,
            key: b"k".to_vec(),
            nvme: nvme_id(),
            loc: 3,
            len: 100,
            sum: 0,
        },
    );
    drop(m); // a third restart: the record of "k" comes back
    let mut m = on_state_dir(&dir, 4_000);
    mount_tier(&mut m);
    mount_tiered_dram(&mut m, "dram", true);
    let r = m.get("k").unwrap();
    assert_eq!(r.len(), 1, "only the new object's replica: {r:?}");
    assert_eq!((r[0].tier, r[0].offset), (Tier::Dram, new[0].offset));
    assert_eq!(super::versions::version(&m, "k"), v);
    assert_eq!(
        report.map_err(|e| e.code),
        Err(ErrorCode::ObjectAlreadyExists),
        "the node removes the old copy"
    );
    m.check();
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 32, copy identity: a tier unmounted as dead (its node was cut off)
/// takes back, when it mounts again, the copies of objects nobody removed
/// or replaced meanwhile, with or without other replicas, checksum or not;
/// a copy of a key removed meanwhile is refused and owed a Drop. Before, a
/// copy of a key the master no longer held was adopted: the key removed
/// while its tier was away came back.
#[test]
fn a_tier_that_comes_back_takes_back_its_copies_but_not_those_of_keys_removed_meanwhile() {
    let (mut m, dram) = tiered(true);
    m.put("both", 100); // a DRAM and an NVMe replica
    write_through_copy(&mut m, dram, 3);
    let both = super::versions::version(&m, "both");
    // NVMe-only objects (reported by the tier while it is adopted).
    for (k, loc) in [("only", 5), ("removed", 6), ("replaced", 7)] {
        update(&mut m, recovered(k, loc)).unwrap();
    }
    m.advance(m.cfg.client_ttl_ms + 1_000); // the tier is listed
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: nvme_id(),
    })
    .unwrap();
    assert_eq!(code(m.get("only")), ErrorCode::ObjectNotFound);
    assert_eq!(code(m.remove("removed", true)), ErrorCode::ObjectNotFound);
    m.put("replaced", 100);
    mount_tier(&mut m);
    for k in ["removed", "replaced"] {
        let loc = if k == "removed" { 6 } else { 7 };
        let e = update(&mut m, recovered(k, loc)).unwrap_err();
        assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{k}: {e}");
    }
    assert_eq!(code(m.get("removed")), ErrorCode::ObjectNotFound);
    assert_eq!(
        m.get("replaced").unwrap().len(),
        1,
        "only the new DRAM replica"
    );
    update(&mut m, recovered("only", 5)).unwrap();
    // A copy detached at one version is not another's (the node's copy
    // carries its object's).
    let mut at = |version| {
        let mut r = recovered("both", 3);
        if let NvmeUpdate::Recovered { version: v, .. } = &mut r {
            *v = version;
        }
        update(&mut m, r)
    };
    assert_eq!(
        at(both + 1).map_err(|e| e.code),
        Err(ErrorCode::ObjectAlreadyExists)
    );
    at(both).unwrap();
    assert_eq!(m.get("both").unwrap().len(), 2);
    assert_eq!(m.get("only").unwrap()[0].offset, 5);
    let t = tasks(&mut m, dram);
    for (k, loc) in [(&b"removed"[..], 6), (b"replaced", 7)] {
        assert!(
            t.iter().any(
                |t| matches!(t, NodeTask::Drop(DropTask { version: _, key, loc: l }) if key == k && *l == loc)
            ),
            "{t:?}"
        );
    }
    m.check();
}

/// The Drop a removed object's NVMe copy is owed outlives its node's DRAM
/// segment: a node that dies (its segment unmounted, its task queue gone)
/// and comes back with a new DRAM segment and the same tier still gets the
/// Drop, and its report of the copy meanwhile is refused. Before, the queue
/// went with the segment and the report brought the removed object back.
#[test]
fn a_drop_owed_to_a_node_that_came_back_with_a_new_segment_still_goes_out() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.remove("k", true).unwrap(); // Drop k at 3 queued for `dram`
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: dram,
    })
    .unwrap();
    let dram2 = mount_tiered_dram(&mut m, "dram-after-restart", true);
    let recovered = NvmeUpdate::Recovered {
        version: 0,
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 100,
        sum: 0,
    };
    let e = update(&mut m, recovered.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    let t = tasks(&mut m, dram2);
    assert!(
        t.iter().any(
            |t| matches!(t, NodeTask::Drop(DropTask { version: _, key, loc: 3 }) if key == b"k")
        ),
        "the new segment's node is asked to drop the copy: {t:?}"
    );
    // Gone out, and the node may report the copy before it runs it: still
    // refused.
    let e = update(&mut m, recovered).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    m.check();
}

/// But a copy the key's object lists is that object's, whatever Drop of
/// the place waits: a later put's copy took the slot (cluster simulation,
/// seed 422 with `KVPOOL_SIM_UNSUMMED=1`: refused, the node removed the
/// copy the master listed).
#[test]
fn a_recovered_copy_the_object_lists_is_kept_though_a_drop_of_its_place_waits() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.remove("k", true).unwrap(); // Drop k at 3 queued
    let b = m.put("k", 100);
    let v = super::versions::version(&m, "k");
    // The node copied the new object into the freed slot and reported it.
    let persist = NodeTask::Persist(PersistTask {
        version: v,
        key: b"k".to_vec(),
        dram,
        offset: b[0].offset,
        len: 100,
        demote: false,
        checksum: None,
    });
    update(&mut m, stored(&persist, 3)).unwrap();
    let rec = NvmeUpdate::Recovered {
        version: v,
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 100,
        sum: 0,
    };
    update(&mut m, rec).unwrap();
    let r = m.get("k").unwrap();
    assert!(
        r.iter().any(|r| r.tier == Tier::Nvme && r.offset == 3),
        "{r:?}"
    );
    m.check();
}

#[test]
fn replacing_an_object_under_demotion_keeps_the_demotion_accounting() {
    let (mut m, dram) = tiered(false);
    fill(&mut m, "k", 10, opts(1)); // full: the oldest are being demoted
    let demotion = tasks(&mut m, dram).remove(0);
    let NodeTask::Persist(PersistTask {
        key, demote: true, ..
    }) = &demotion
    else {
        panic!("{demotion:?}")
    };
    let name = String::from_utf8(key.clone()).unwrap();
    // Room for the replace: remove an object that is not being demoted.
    m.remove("k9", true).unwrap();
    m.replace_as(WRITER, &name, KIB).unwrap();
    m.end(&name).unwrap();
    m.check(); // the demoting bytes no longer count the replaced object
               // The node reports the old object's copy: not the new object's.
    let e = update(&mut m, stored(&demotion, 11)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectNotFound, "{e}");
    let r = m.get(&name).unwrap();
    assert_eq!((r.len(), r[0].tier), (1, Tier::Dram), "{r:?}");
    m.check();
}

/// A node reports its whole tier beside its task rounds, so the report of
/// a copy a demotion has just written (`Recovered`) may come before that
/// copy's own `Stored`. Found by the cluster simulation (seed 1462 of
/// 10,000, after the clients ran the real put protocol): on a listed tier
/// the copy was refused as an old one, the node deleted it, and the
/// `Stored` that followed listed a replica whose slot was empty. The copy
/// is now left to its `Stored` report (refused as not now: the node keeps
/// it), which lists it.
#[test]
fn the_tier_report_of_a_copy_whose_demotion_has_not_reported_does_not_delete_it() {
    let (mut m, dram) = tiered(false);
    // The tier reports one copy, then stays quiet: it is listed.
    update(&mut m, recovered("old", 1)).unwrap();
    m.advance(m.cfg.client_ttl_ms + 1_000);
    fill(&mut m, "k", 10, opts(1)); // 100%: the last put schedules demotions
    let t = tasks(&mut m, dram);
    let persist = t
        .iter()
        .find(|t| matches!(t, NodeTask::Persist(PersistTask { key, demote: true, .. }) if key == b"k0"))
        .unwrap_or_else(|| panic!("k0's demotion: {t:?}"))
        .clone();
    let NodeTask::Persist(PersistTask { len, .. }) = persist else {
        unreachable!()
    };
    // A copy of another object under the key (another size) is no copy
    // of this demotion: refused as old, so the node deletes it.
    let other = NvmeUpdate::Recovered {
        version: 0,
        key: b"k0".to_vec(),
        nvme: nvme_id(),
        loc: 9,
        len: len + 1,
        sum: 0,
    };
    let e = update(&mut m, other).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    // The copy is written at 7; the tier's report comes first.
    let early = NvmeUpdate::Recovered {
        version: 0,
        key: b"k0".to_vec(),
        nvme: nvme_id(),
        loc: 7,
        len,
        sum: 0,
    };
    let e = update(&mut m, early).unwrap_err();
    assert_ne!(
        e.code,
        ErrorCode::ObjectAlreadyExists,
        "refused as stale, the node would delete the copy: {e}"
    );
    update(&mut m, stored(&persist, 7)).unwrap();
    let r = m.get("k0").unwrap();
    assert_eq!((r.len(), r[0].tier, r[0].offset), (1, Tier::Nvme, 7));
    m.check();
}

/// Found by the cluster simulation (seed 8407 with `KVPOOL_SIM_UNSUMMED=1`,
/// on a state directory): a node evicted a copy in the middle of a round
/// and reported it to a master that had just restarted, before its tier
/// mounted again. The master answered Ok ("not mounted: nothing lists it")
/// though the recovered object's replica waited for that tier; the node
/// freed the copy, and once the tier mounted the master listed an empty
/// slot. Refused now: the node keeps the copy, which stays the object's.
#[test]
fn an_eviction_reported_before_its_tier_mounts_again_is_refused() {
    let dir = state_dir("evicted-before-remount");
    let mut m = on_state_dir(&dir, 1_000);
    let dram = mount_node(&mut m, true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    drop(m);
    let mut m = on_state_dir(&dir, 2_000); // no segment back yet
    let e = update(&mut m, evicted("k", 3)).unwrap_err();
    assert_eq!(e.code, ErrorCode::SegmentNotFound, "{e}");
    // The node kept the copy; its tier mounts again and the copy is the
    // object's replica, as recorded.
    mount_node(&mut m, true);
    let r = m.get("k").unwrap();
    assert!(
        r.iter().any(|d| d.tier == Tier::Nvme && d.offset == 3),
        "{r:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A recovered object whose NVMe copy came back first (its tier reported
/// before its DRAM segment mounted again) and then left (the tier evicted
/// it) still waits for its DRAM replica, and is listed with it once the
/// segment mounts. Dropping the object there (the `Evicted` report's arm)
/// lost a replica that was coming back.
#[test]
fn a_recovered_object_whose_nvme_copy_is_evicted_waits_for_its_dram_replica() {
    let dir = state_dir("replicaless-evicted");
    let (mut m, _) = listed_tier_with_k_and_kept(&dir);
    let dram_offset = m
        .get("k")
        .unwrap()
        .iter()
        .find(|r| r.tier == Tier::Dram)
        .unwrap()
        .offset;
    drop(m);
    let mut m = on_state_dir(&dir, 60_000);
    m.live.push(NODE);
    mount_tier(&mut m); // the DRAM segment stays away
    update(&mut m, recovered("k", 3)).unwrap();
    let r = m.get("k").unwrap();
    assert_eq!((r.len(), r[0].tier, r[0].offset), (1, Tier::Nvme, 3));
    update(&mut m, evicted("k", 3)).unwrap();
    let r = waits_for_then_lists_k(&mut m, "dram", true);
    assert_eq!(
        (r.len(), r[0].tier, r[0].offset),
        (1, Tier::Dram, dram_offset)
    );
    m.check();
    std::fs::remove_dir_all(&dir).ok();
}

/// A recovered object with one of its two DRAM replicas back, whose
/// demotion from that replica's segment fails, still waits for the other
/// replica and is listed with it once its segment mounts. Dropping the
/// object there (the `PersistFailed` arm) lost a replica coming back.
#[test]
fn a_recovered_object_whose_demotion_fails_waits_for_its_other_replica() {
    let dir = state_dir("replicaless-demotion");
    // Leases end well inside the time a restarted master waits for its
    // segments (the client TTL, 10 s).
    let mut c = cfg();
    c.lease_ttl_ms = 1_000;
    let mut m = on_state_dir_with(&dir, 1_000, c.clone());
    let dram = mount_node(&mut m, false);
    let other = mount_tiered_dram(&mut m, "dram2", false);
    let r = m.put_with("k", 100, opts(2));
    assert_eq!(r.len(), 2, "{r:?}");
    drop(m);
    let mut m = on_state_dir_with(&dir, 60_000, c);
    // "dram2" stays away. Puts fill "dram" past its watermark: k, read
    // last at the take-over and its lease over, is demoted first.
    mount_node(&mut m, false);
    m.advance(m.cfg.lease_ttl_ms + 10);
    fill(&mut m, "f", 9, opts(1));
    let t = tasks(&mut m, dram);
    let Some(NodeTask::Persist(PersistTask { offset, .. })) = t
        .iter()
        .find(|t| matches!(t, NodeTask::Persist(p) if p.key == b"k" && p.demote))
        .cloned()
    else {
        panic!("a demotion of k: {t:?}")
    };
    update(
        &mut m,
        NvmeUpdate::PersistFailed {
            key: b"k".to_vec(),
            dram,
            offset,
            demote: true,
        },
    )
    .unwrap();
    let r = waits_for_then_lists_k(&mut m, "dram2", false);
    assert_eq!((r.len(), r[0].segment_id), (1, other), "{r:?}");
    m.check();
    std::fs::remove_dir_all(&dir).ok();
}

/// "k" lost the replicas that came back: it is not found while it waits
/// for the one on DRAM segment `name`, and listed once that mounts.
fn waits_for_then_lists_k(m: &mut M, name: &str, write_through: bool) -> Vec<ReplicaDesc> {
    assert_eq!(
        code(m.get("k")),
        ErrorCode::ReplicaNotReady,
        "waiting again for its replica on {name}"
    );
    mount_tiered_dram(m, name, write_through);
    m.get("k").unwrap()
}
