//! Hot-object replication: a hot object gets an extra DRAM replica on
//! another node, fetched by that node; reads spread over the replicas; an
//! extra replica goes first under eviction.

use super::*;

/// The second storage node.
const NODE_B: u64 = 101;
const SUM: u64 = 0x5eed;

/// One shard, hot replication on (2 replicas after 4 reads in a window),
/// node `NODE` with 10 KiB segment "a" and `NODE_B` with "b".
fn two_nodes(budget: f64) -> (M, SegmentId, SegmentId) {
    let mut c = cfg();
    c.hot_replicas = 2;
    c.hot_reads = 4;
    c.hot_window_ms = 10_000;
    c.hot_budget = budget;
    let mut m = M::with(1, c);
    let a = m.mount_as(NODE, "a", 10 * KIB, "host-a");
    let b = m.mount_as(NODE_B, "b", 10 * KIB, "host-b");
    (m, a, b)
}

/// Puts `key` with a checksum (what a fetch checks the bytes against).
fn put_summed(m: &mut M, key: &str, len: u64) -> Vec<ReplicaDesc> {
    let r = m.start(key, len).expect("put_start");
    m.call(Q::PutEnd {
        client_id: WRITER,
        put_id: 0,
        key: key.into(),
        checksum: Some(SUM),
    })
    .expect("put_end");
    r
}

/// The tasks `node` is handed for segment `seg` alone.
pub(super) fn node_tasks(m: &mut M, node: u64, seg: SegmentId) -> Vec<NodeTask> {
    match m
        .call(Q::NodeTasks {
            client_id: node,
            shard: 0,
            segments: vec![seg],
            max: 100,
        })
        .unwrap()
    {
        A::Tasks(t) => t,
        other => panic!("{other:?}"),
    }
}

fn report(m: &mut M, node: u64, u: NvmeUpdate) -> Result<(), KvError> {
    match m
        .call(Q::NvmeUpdates {
            client_id: node,
            updates: vec![u],
        })
        .unwrap()
    {
        A::BatchDone(mut v) => Result::from(v.remove(0)),
        other => panic!("{other:?}"),
    }
}

fn reads(m: &mut M, key: &str, n: usize) -> Vec<Vec<ReplicaDesc>> {
    (0..n).map(|_| m.get(key).expect("get")).collect()
}

/// Makes `key` (on `a`) hot and answers the Fetch task `b` gets with `ok`;
/// returns the task.
fn replicate(m: &mut M, key: &str, b: SegmentId, ok: bool) -> NodeTask {
    reads(m, key, 4);
    let mut t = node_tasks(m, NODE_B, b);
    assert_eq!(t.len(), 1, "one fetch for the hot object: {t:?}");
    let task = t.remove(0);
    let NodeTask::Fetch(FetchTask {
        key: k,
        dram,
        offset,
        ..
    }) = task.clone()
    else {
        panic!("not a Fetch: {task:?}")
    };
    report(
        m,
        NODE_B,
        NvmeUpdate::Promoted {
            key: k,
            dram,
            offset,
            ok,
        },
    )
    .expect("the fetching node's report");
    task
}

/// Found by the cluster simulation's grants (13 per 1,000 seeds): a Fetch
/// task its node took after the lease it was queued with had ended named
/// its sources with expired read grants (refused at the source node), and
/// the source could have been evicted under the fetch's read. The lease and
/// the grants run from when the node takes the task.
#[test]
fn a_fetch_task_taken_late_carries_a_lease_and_grants_from_when_it_is_taken() {
    use kvpool_master::state::GrantSigner;
    use kvpool_wire::auth::{ClusterKey, GrantClock, GrantOp};
    let key = ClusterKey::new(b"grant-test-secret-0123").unwrap();
    let (mut m, a, b) = two_nodes(0.5);
    m.m = m.m.with_signer(Some(GrantSigner {
        key: key.clone(),
        unix_at_zero_ms: 0,
    }));
    let put = put_summed(&mut m, "k", 1000);
    reads(&mut m, "k", 4); // hot: a Fetch waits in b's queue
    let queued_lease = m.now + m.cfg.lease_ttl_ms;
    // b takes it well after that lease (within the fill's deadline).
    m.advance(m.cfg.lease_ttl_ms + 5_000);
    assert!(m.now > queued_lease);
    let t = node_tasks(&mut m, NODE_B, b);
    let [NodeTask::Fetch(FetchTask { from, .. })] = &t[..] else {
        panic!("one Fetch: {t:?}")
    };
    assert_eq!(from.len(), 1);
    assert_eq!((from[0].segment_id, from[0].offset), (a, put[0].offset));
    let lease_end = m.now + m.cfg.lease_ttl_ms;
    assert_eq!(
        from[0].grant.expires_ms, lease_end,
        "a grant from the handout"
    );
    key.check_grant(
        &from[0].grant,
        GrantOp::Read,
        a,
        (from[0].offset, 1000),
        GrantClock {
            now_ms: m.now,
            skew_ms: 0,
        },
    )
    .expect("the node's read of the source is granted");
    // The object's read lease covers the fetch (its sources stay).
    assert_eq!(code(m.remove("k", false)), ErrorCode::ObjectHasLease);
}

#[test]
fn a_hot_object_gets_a_replica_on_another_node_readable_once_that_node_fetched_it() {
    let (mut m, a, b) = two_nodes(0.5);
    let put = put_summed(&mut m, "k", 1000);
    assert_eq!(put[0].segment_id, a);
    // Three reads: not hot yet.
    reads(&mut m, "k", 3);
    assert!(node_tasks(&mut m, NODE_B, b).is_empty());
    // The fourth makes it hot: node b is asked to fetch it from a.
    m.get("k").unwrap();
    let t = node_tasks(&mut m, NODE_B, b);
    let [NodeTask::Fetch(FetchTask {
        key,
        from,
        dram,
        offset,
        len,
        checksum,
    })] = &t[..]
    else {
        panic!("one Fetch: {t:?}")
    };
    assert_eq!(
        (&key[..], *dram, *len, *checksum),
        (&b"k"[..], b, 1000, SUM)
    );
    assert_eq!(from.len(), 1);
    assert_eq!((from[0].segment_id, from[0].offset), (a, put[0].offset));
    // Until the node says it is done, readers see only the first replica,
    // and no second fetch is asked for however hot it stays.
    for r in reads(&mut m, "k", 8) {
        assert_eq!(r.len(), 1, "{r:?}");
    }
    assert!(node_tasks(&mut m, NODE_B, b).is_empty());
    // Only b's node may report on b's range.
    let done = NvmeUpdate::Promoted {
        key: b"k".to_vec(),
        dram: b,
        offset: *offset,
        ok: true,
    };
    assert_eq!(
        code(report(&mut m, NODE, done.clone())),
        ErrorCode::IllegalClient
    );
    report(&mut m, NODE_B, done).unwrap();
    let r = m.get("k").unwrap();
    let mut segs: Vec<SegmentId> = r.iter().map(|d| d.segment_id).collect();
    segs.sort_unstable();
    let mut want = vec![a, b];
    want.sort_unstable();
    assert_eq!(segs, want, "two replicas, one per node");
    assert_eq!(m.stat().hot_copies, 1);
    // At hot_replicas it gets no third one.
    reads(&mut m, "k", 8);
    assert!(node_tasks(&mut m, NODE, a).is_empty());
    assert!(node_tasks(&mut m, NODE_B, b).is_empty());
}

#[test]
fn reads_of_a_replicated_object_start_at_each_replica_in_turn() {
    let (mut m, a, b) = two_nodes(0.5);
    put_summed(&mut m, "k", 1000);
    replicate(&mut m, "k", b, true);
    let firsts: Vec<SegmentId> = reads(&mut m, "k", 6)
        .iter()
        .map(|r| r[0].segment_id)
        .collect();
    assert_eq!(firsts.iter().filter(|&&s| s == a).count(), 3, "{firsts:?}");
    assert_eq!(firsts.iter().filter(|&&s| s == b).count(), 3, "{firsts:?}");
}

#[test]
fn a_failed_fetch_frees_its_range_and_the_object_can_be_replicated_later() {
    let (mut m, _a, b) = two_nodes(0.5);
    put_summed(&mut m, "k", 1000);
    let before = m.used();
    replicate(&mut m, "k", b, false);
    assert_eq!(m.get("k").unwrap().len(), 1);
    assert_eq!(m.used(), before, "the range the fetch was to fill is free");
    assert_eq!(m.stat().hot_copies, 0);
    replicate(&mut m, "k", b, true);
    assert_eq!(m.get("k").unwrap().len(), 2);
}

#[test]
fn an_object_read_less_than_hot_reads_per_window_is_not_replicated() {
    let (mut m, _a, b) = two_nodes(0.5);
    put_summed(&mut m, "k", 1000);
    for _ in 0..5 {
        reads(&mut m, "k", 3);
        m.advance(10_000);
    }
    assert!(node_tasks(&mut m, NODE_B, b).is_empty());
}

#[test]
fn no_extra_replica_beyond_the_budget_nor_of_an_object_without_a_checksum() {
    // 5% of 20 KiB: room for one 1000-byte extra replica, not two.
    let (mut m, a, b) = two_nodes(0.05);
    put_summed(&mut m, "k1", 1000);
    put_summed(&mut m, "k2", 1000);
    m.put("plain", 1000);
    replicate(&mut m, "k1", b, true);
    reads(&mut m, "k2", 4);
    reads(&mut m, "plain", 4);
    assert!(node_tasks(&mut m, NODE_B, b).is_empty());
    assert!(node_tasks(&mut m, NODE, a).is_empty());
}

#[test]
fn an_extra_replica_is_evicted_before_older_replicas_of_its_range() {
    let (mut m, a, b) = two_nodes(0.5);
    // "k" on a (both empty: the first), then "old" on b (the emptier),
    // then k's extra replica on b: b is past the high watermark.
    assert_eq!(put_summed(&mut m, "k", 1024)[0].segment_id, a);
    assert_eq!(m.put("old", 8 * KIB + 512)[0].segment_id, b);
    replicate(&mut m, "k", b, true);
    assert_eq!(m.get("k").unwrap().len(), 2);
    // Every lease ends; "old" was never read, so it ranks before k's
    // replica by age. Eviction still takes the extra replica first.
    m.advance(60_000);
    assert!(m.exist("old"), "the older object stays");
    let r = m.get("k").unwrap();
    assert_eq!(r.len(), 1, "k's extra replica went: {r:?}");
    assert_eq!(r[0].segment_id, a);
}

/// An extra replica being fetched takes its range past the high watermark:
/// the off-path eviction waits for it (it goes first once fetched and its
/// lease ended), and never evicts an older object in its place.
#[test]
fn an_extra_replica_still_being_fetched_does_not_cost_an_older_object_its_place() {
    let (mut m, a, b) = two_nodes(0.5);
    assert_eq!(put_summed(&mut m, "k", 1024)[0].segment_id, a);
    assert_eq!(m.put("old", 8 * KIB + 512)[0].segment_id, b);
    reads(&mut m, "k", 4);
    let t = node_tasks(&mut m, NODE_B, b);
    let [NodeTask::Fetch(FetchTask { dram, offset, .. })] = t[..] else {
        panic!("one fetch: {t:?}")
    };
    // Past every lease and the older object's keep, the fetch not reported
    // yet (within put_timeout_ms).
    m.advance(m.cfg.lease_ttl_ms * 2);
    assert!(
        m.exist("old"),
        "the older object stays while the copy is fetched"
    );
    let fetched = NvmeUpdate::Promoted {
        key: b"k".to_vec(),
        dram,
        offset,
        ok: true,
    };
    report(&mut m, NODE_B, fetched).expect("the fetch's report");
    assert_eq!(m.get("k").unwrap().len(), 2);
    // Leased after that read: still the older object stays; then the extra
    // replica goes.
    m.advance(m.cfg.lease_ttl_ms / 2);
    assert!(
        m.exist("old"),
        "the older object stays while the copy is leased"
    );
    m.advance(m.cfg.lease_ttl_ms);
    assert!(m.exist("old"), "the older object stays");
    let r = m.get("k").unwrap();
    assert_eq!(
        (r.len(), r[0].segment_id),
        (1, a),
        "k's extra replica went: {r:?}"
    );
}

#[test]
fn a_fetch_whose_report_never_comes_is_given_up_and_asked_for_again() {
    let (mut m, _a, b) = two_nodes(0.5);
    put_summed(&mut m, "k", 1000);
    let single = m.used();
    reads(&mut m, "k", 4);
    assert_eq!(node_tasks(&mut m, NODE_B, b).len(), 1, "the fetch went out");
    // Its report is lost. Until put_timeout_ms the replica waits for it.
    m.advance(m.cfg.put_timeout_ms - 1_000);
    reads(&mut m, "k", 4);
    assert!(node_tasks(&mut m, NODE_B, b).is_empty());
    // Then it is given up: the object is replicated again (a new fetch)
    // and the first range comes back after the quarantine.
    m.advance(2_000);
    let t = {
        reads(&mut m, "k", 4);
        node_tasks(&mut m, NODE_B, b)
    };
    assert_eq!(t.len(), 1, "asked again: {t:?}");
    let NodeTask::Fetch(FetchTask { dram, offset, .. }) = t[0].clone() else {
        panic!("{t:?}")
    };
    report(
        &mut m,
        NODE_B,
        NvmeUpdate::Promoted {
            key: b"k".to_vec(),
            dram,
            offset,
            ok: true,
        },
    )
    .unwrap();
    assert_eq!(m.get("k").unwrap().len(), 2);
    m.advance(m.cfg.stale_put_grace_ms + m.cfg.lease_ttl_ms + 1_000);
    assert!(
        m.used() <= 2 * single,
        "the given-up range is free again: {} used, {single} per replica",
        m.used()
    );
}
