//! Trust: owners of segments, checksums, suspects, signed grants (issue 12).

use super::*;

// ---- trust: owners, checksums, suspects, grants (issue 12) -------------------

pub(super) fn update_as(m: &mut M, client: u64, u: NvmeUpdate) -> Result<(), KvError> {
    match m
        .call(Q::NvmeUpdates {
            client_id: client,
            updates: vec![u],
        })
        .unwrap()
    {
        A::BatchDone(mut v) => Result::from(v.remove(0)),
        other => panic!("{other:?}"),
    }
}

pub(super) fn end_with_sum(m: &mut M, key: &str, sum: u64) {
    m.call(Q::PutEnd {
        client_id: WRITER,
        put_id: 0,
        key: key.into(),
        checksum: Some(sum),
    })
    .unwrap();
}

#[test]
fn nvme_reports_from_a_client_that_does_not_own_the_tier_change_nothing() {
    let (mut m, dram) = tiered(false);
    let forged = NvmeUpdate::Recovered {
        version: 0,
        key: b"forged".to_vec(),
        nvme: nvme_id(),
        loc: 1,
        len: 100,
        sum: 0,
    };
    assert_eq!(
        code(update_as(&mut m, OTHER, forged)),
        ErrorCode::IllegalClient
    );
    assert!(!m.exist("forged"));
    // The owner may not name its DRAM segment as a tier (the report that
    // once reached an allocator assert), nor a region the tier lacks.
    let as_tier = NvmeUpdate::Recovered {
        version: 0,
        key: b"forged".to_vec(),
        nvme: dram,
        loc: 1 << 40,
        len: 100,
        sum: 0,
    };
    assert_eq!(code(update(&mut m, as_tier)), ErrorCode::InvalidParams);
    let far = NvmeUpdate::Recovered {
        version: 0,
        key: b"forged".to_vec(),
        nvme: nvme_id(),
        loc: 5 << 32,
        len: 100,
        sum: 0,
    };
    assert_eq!(code(update(&mut m, far)), ErrorCode::InvalidParams);
    assert!(!m.exist("forged"));
    // Removing whatever a forged report could have named is harmless.
    assert_eq!(code(m.remove("forged", true)), ErrorCode::ObjectNotFound);
    m.put("after", 100);
}

#[test]
fn only_the_owner_takes_a_segments_tasks_or_unmounts_it() {
    let (mut m, dram) = tiered(false);
    let r = m.call(Q::NodeTasks {
        client_id: OTHER,
        shard: 0,
        segments: vec![dram],
        max: 10,
    });
    assert_eq!(code(r), ErrorCode::IllegalClient);
    let r = m.call(Q::UnmountSegment {
        client_id: OTHER,
        segment_id: dram,
    });
    assert_eq!(code(r), ErrorCode::IllegalClient);
    assert_eq!(m.stat().segments.len(), 2);
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: dram,
    })
    .unwrap();
    assert_eq!(m.stat().segments.len(), 1);
}

#[test]
fn a_promotion_lands_in_the_dram_segment_of_the_node_that_holds_the_copy() {
    let (mut m, dram) = tiered(false);
    // A larger, emptier segment on another node: placement would prefer it.
    let other = m.mount_as(OTHER, "elsewhere", 1 << 20, "host-b");
    update(
        &mut m,
        NvmeUpdate::Recovered {
            version: 0,
            key: b"cold".to_vec(),
            nvme: nvme_id(),
            loc: 4,
            len: 1000,
            sum: 77,
        },
    )
    .unwrap();
    m.get("cold").unwrap();
    m.get("cold").unwrap();
    let t = tasks(&mut m, dram);
    let Some(NodeTask::Promote(PromoteTask {
        dram: target,
        checksum,
        ..
    })) = t.iter().find(|t| matches!(t, NodeTask::Promote(_)))
    else {
        panic!("no promotion: {t:?}")
    };
    assert_eq!(*target, dram, "not the emptier segment {other:016x}");
    assert_eq!(*checksum, Some(77), "the node checks the bytes it copies");
}

#[test]
fn the_writers_checksum_reaches_readers_and_every_copy_must_match_it() {
    let (mut m, dram) = tiered(true); // write-through: a Persist at PutEnd
    m.start("k", 500).unwrap();
    end_with_sum(&mut m, "k", 0xfeed);
    assert!(m
        .get("k")
        .unwrap()
        .iter()
        .all(|r| r.checksum == Some(0xfeed)));
    let Some(NodeTask::Persist(PersistTask {
        key,
        offset,
        len,
        checksum,
        version,
        ..
    })) = tasks(&mut m, dram).first().cloned()
    else {
        panic!()
    };
    assert_eq!(checksum, Some(0xfeed));
    let stored = |sum| NvmeUpdate::Stored {
        version,
        key: key.clone(),
        nvme: nvme_id(),
        loc: 3,
        len,
        dram,
        offset,
        demote: false,
        sum,
    };
    assert_eq!(code(update(&mut m, stored(0xbad))), ErrorCode::Corrupt);
    assert_eq!(m.get("k").unwrap().len(), 1, "the bad copy is not listed");
    update(&mut m, stored(0xfeed)).unwrap();
    assert_eq!(m.get("k").unwrap().len(), 2);
    // A recovered copy of another object under the key is stale.
    let rec = |sum| NvmeUpdate::Recovered {
        version: 0,
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 500,
        sum,
    };
    assert_eq!(
        code(update(&mut m, rec(0xbad))),
        ErrorCode::ObjectAlreadyExists
    );
    update(&mut m, rec(0xfeed)).unwrap();
}

#[test]
fn a_segment_reported_unreachable_gets_no_new_replicas_until_its_owner_pings() {
    let mut m = M::new(1);
    // Both empty: the first mounted wins the tie, so b is chosen first.
    let b = m.mount_as(OTHER, "b", 1 << 20, "host-b");
    let a = m.mount_as(NODE, "a", 64 * KIB, "host-a");
    assert_eq!(m.start("x", 100).unwrap()[0].segment_id, b);
    m.call(Q::ReportUnreachable {
        client_id: WRITER,
        segment_id: b,
    })
    .unwrap();
    assert!(m.stat().segments.iter().any(|s| s.id == b && s.suspect));
    assert_eq!(m.start("y", 100).unwrap()[0].segment_id, a);
    // Its replicas stay readable; only placement skips it.
    m.end("x").unwrap();
    assert_eq!(m.get("x").unwrap()[0].segment_id, b);
    // Another client's ping proves nothing; the owner's does.
    m.ping(WRITER);
    assert_eq!(m.start("z", 100).unwrap()[0].segment_id, a);
    let r = m
        .call(Q::Ping {
            client_id: OTHER,
            segments: vec![b],
        })
        .unwrap();
    assert!(matches!(r, A::Pong { unknown } if unknown.is_empty()));
    assert_eq!(m.start("w", 100).unwrap()[0].segment_id, b);
}

#[test]
fn a_ping_names_the_segments_the_master_does_not_know() {
    let mut m = M::new(2);
    let a = m.mount_as(NODE, "a", 64 * KIB, "host-a");
    let r = m
        .call(Q::Ping {
            client_id: NODE,
            segments: vec![a, 12345],
        })
        .unwrap();
    assert!(matches!(r, A::Pong { unknown } if unknown == vec![12345]));
}

#[test]
fn a_node_back_on_the_same_ports_takes_over_its_segments() {
    let mut m = M::new(1);
    let id = m.mount_as(NODE, "a", 64 * KIB, "host-a");
    m.put("kept", 100);
    // The node restarts with a new client id and the same spec.
    m.kill(NODE);
    let again = m.mount_as(OTHER, "a", 64 * KIB, "host-a");
    assert_eq!(again, id);
    m.advance(m.cfg.client_ttl_ms + 2_000);
    assert_eq!(m.stat().segments.len(), 1, "the old registration's expiry");
    assert!(m.exist("kept"));
}

#[test]
fn a_full_segment_whose_space_is_being_demoted_says_try_again() {
    let (mut m, _) = tiered(false);
    fill(&mut m, "k", 10, opts(1)); // full: demotions queued, nothing freed yet
    let e = m.start("one-more", KIB).unwrap_err();
    assert_eq!(e.code, ErrorCode::TryAgain, "{e}");
    // Without a tier the same fill is NoSpace (after eviction frees room,
    // a put fits: use a pinned fill so nothing can be evicted).
    let mut m = small_pool();
    let pinned = PutOptions {
        hard_pin: true,
        ..opts(1)
    };
    fill(&mut m, "p", 100, pinned);
    assert_eq!(code(m.start("one-more", KIB)), ErrorCode::NoSpace);
}

#[test]
fn free_space_in_pieces_too_small_with_no_demotion_under_way_is_no_space_not_try_again() {
    let mut m = M::new(1);
    m.mount("seg", 4 * KIB);
    let hard = PutOptions {
        hard_pin: true,
        ..opts(1)
    };
    for k in ["a", "b", "c", "d"] {
        m.put_with(k, KIB, hard.clone());
    }
    m.remove("b", false).unwrap();
    m.remove("d", false).unwrap();
    // 2 KiB free, in two 1 KiB holes, nothing to evict and nothing coming:
    // waiting would not help, so the writer must not be told to.
    assert_eq!(code(m.start("e", 2 * KIB)), ErrorCode::NoSpace);
}

#[test]
fn with_a_secret_the_master_signs_write_and_read_grants_for_each_replica() {
    use kvpool_master::state::{GrantSigner, ShardConfig, ShardState};
    use kvpool_wire::auth::{ClusterKey, GrantClock, GrantOp};
    let key = ClusterKey::new(b"grant-test-secret-0123").unwrap();
    let c = cfg();
    let mut s =
        ShardState::new(0, 1, ShardConfig::from_master(&c, 1), 1).with_signer(Some(GrantSigner {
            key: key.clone(),
            unix_at_zero_ms: 1_000_000,
        }));
    let seg = Arc::new(spec("a", 64 * KIB, "host-a"));
    let id = kvpool_wire::proto::segment_id_for("a");
    s.add_segment(id, seg, NODE, 0);
    let w = s.put_start(WRITER, b"k", 4096, &opts(1), 10).unwrap();
    let g = w[0].grant;
    let until = 1_000_000 + 10 + c.put_timeout_ms;
    assert_eq!(g.expires_ms, until);
    let at = |now_ms| GrantClock { now_ms, skew_ms: 0 };
    key.check_grant(&g, GrantOp::Write, id, (w[0].offset, 4096), at(until))
        .unwrap();
    assert!(key
        .check_grant(&g, GrantOp::Read, id, (w[0].offset, 4096), at(until))
        .is_err());
    s.put_end(WRITER, b"k", 0, Some(1), 20).unwrap();
    let r = s.get_replica_list(b"k", 30).unwrap();
    let lease_end = 1_000_000 + 30 + c.lease_ttl_ms;
    assert_eq!(r[0].grant.expires_ms, lease_end);
    key.check_grant(
        &r[0].grant,
        GrantOp::Read,
        id,
        (r[0].offset, 4096),
        at(lease_end),
    )
    .unwrap();
}

/// Found by the cluster simulation (seed 248): a node cut off past its
/// client TTL is declared dead (its segment removed), then joins again and
/// mounts the same segment. Extents that waited to be freed on the old
/// mount (a leased removal) must not be freed into the new mount's
/// allocator: it never handed them out, and a put placed there meanwhile
/// would have its range freed under it.
#[test]
fn a_segment_mounted_again_does_not_free_the_old_mounts_deferred_extents() {
    let mut m = M::new(1);
    let id = m.mount("seg", 64 * KIB);
    m.put("k", 4 * KIB);
    m.get("k").unwrap(); // a read lease
    m.remove("k", true).unwrap(); // its space waits for the lease
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: id,
    })
    .unwrap();
    assert_eq!(m.mount("seg", 64 * KIB), id);
    for (i, s) in m.m.shards.iter().enumerate() {
        s.check_invariants()
            .unwrap_or_else(|e| panic!("shard {i} after the remount: {e}"));
    }
    // A put lands in the fresh mount; the old lease's end frees nothing
    // of it.
    let r = m.put("k2", 4 * KIB);
    m.advance(cfg().lease_ttl_ms + 1);
    for (i, s) in m.m.shards.iter().enumerate() {
        s.check_invariants()
            .unwrap_or_else(|e| panic!("shard {i} after the old lease ended: {e}"));
    }
    assert_eq!(m.get("k2").unwrap()[0].offset, r[0].offset);
    assert!(m.used() >= 4 * KIB, "k2's space is still in use");
}
