//! RDMA failure paths on a real device: the peer's QPs torn down while reads
//! are in flight, a deadline that passes with work requests in flight, and a
//! lane that dies (its slices are retried on another lane). Every request
//! must end within its deadline (plus the time a reset lane takes to flush),
//! and a fresh connection must work afterwards.
#![cfg(feature = "rdma")]

#[allow(dead_code)] // each test binary uses part of the helpers
mod rdma_common;

use std::time::{Duration, Instant};

use kvpool_rdma::{Op, RdmaConfig, TransferSpec};
use kvpool_wire::ErrorCode;
use rdma_common::*;

const MIB: usize = 1 << 20;
/// What a reset lane may take to flush, on top of a deadline.
const FLUSH_GRACE: Duration = Duration::from_secs(1);

async fn read_back_works(ctx: &std::sync::Arc<kvpool_rdma::RdmaContext>, node: &Node) {
    let (conn, _control) = connect(ctx, node.addr).await;
    let (dst, reg) = buffer(ctx, MIB);
    let t = conn
        .try_submit(TransferSpec {
            op: Op::Read,
            local: reg.whole(),
            remote_offset: 0,
            deadline: secs(60),
        })
        .unwrap();
    t.wait(tokio::time::sleep).await.unwrap();
    // SAFETY: the read has completed; the segment is not written.
    unsafe {
        assert_eq!(
            checksum(dst.bytes(0, MIB)),
            checksum(node.segment.bytes(0, MIB))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_qps_torn_down_mid_transfer_fail_within_the_deadline_then_a_new_connection_works() {
    let t = "peer_qps_torn_down_mid_transfer_fail_within_the_deadline_then_a_new_connection_works";
    let Some(node_ctx) = open_or_skip(RdmaConfig::default(), t) else {
        return;
    };
    // A small WR bound: submitting the batch posts at most 64 x 2 lanes x 4
    // slices (32 MiB), so half the batch is still to go when the peer leaves
    // (soft-RoCE loopback runs a WR inside ibv_post_send; only WRs posted to
    // a peer that stopped answering stay in flight there).
    let ctx = open_or_skip(
        RdmaConfig {
            max_outstanding_per_lane: 4,
            ..Default::default()
        },
        t,
    )
    .expect("opened once already");
    const N: usize = 64;
    let node = Node::start(node_ctx, N * MIB).await;
    // SAFETY: no connection yet.
    fill(unsafe { node.segment.bytes_mut(0, N * MIB) }, 3);
    let (conn, control) = connect(&ctx, node.addr).await;
    assert_eq!(node.connections(), 1);
    let (_dst, reg) = buffer(&ctx, N * MIB);

    let deadline = secs(8);
    let mut transfers: Vec<_> = (0..N)
        .map(|i| {
            conn.try_submit(TransferSpec {
                op: Op::Read,
                local: reg.slice(i * MIB, MIB).unwrap(),
                remote_offset: (i * MIB) as u64,
                deadline,
            })
            .unwrap()
        })
        .collect();
    // Let the first read finish, then the peer goes away mid-batch.
    let first = transfers.remove(0);
    first.wait(tokio::time::sleep).await.unwrap();
    let torn_at = Instant::now();
    assert_eq!(node.drop_connections(), 1);

    let (mut ok, mut failed) = (1, 0);
    for tr in transfers {
        match tr.wait(tokio::time::sleep).await {
            Ok(()) => ok += 1,
            Err(e) => {
                assert!(
                    matches!(e.code, ErrorCode::Unavailable | ErrorCode::Timeout),
                    "{e}"
                );
                failed += 1;
            }
        }
        assert!(
            Instant::now() <= deadline + FLUSH_GRACE,
            "a request ended {:?} after its deadline",
            Instant::now() - deadline
        );
    }
    println!(
        "peer gone: {ok} reads done, {failed} failed, all ended {:?} after the teardown",
        torn_at.elapsed()
    );
    assert!(failed >= N / 2, "the teardown hit the unfinished half");
    let st = conn.stats();
    assert_eq!(st.healthy_lanes(), 0, "{st:?}");
    assert_eq!(st.active_requests, 0);
    assert!(st.lanes.iter().all(|l| l.outstanding == 0), "{st:?}");
    // New requests on the dead connection fail at once, with the reason.
    let e = conn
        .try_submit(TransferSpec {
            op: Op::Read,
            local: reg.slice(0, 4096).unwrap(),
            remote_offset: 0,
            deadline: secs(5),
        })
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Unavailable);
    assert!(e.message.contains("lane"), "{e}");
    println!("next request on the dead connection: {e}");
    drop((conn, control));

    // The client's next call reconnects and succeeds.
    read_back_works(&ctx, &node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_passing_with_work_in_flight_resets_the_lanes_and_reports_timeout() {
    let t = "a_deadline_passing_with_work_in_flight_resets_the_lanes_and_reports_timeout";
    let Some(node_ctx) = open_or_skip(RdmaConfig::default(), t) else {
        return;
    };
    let ctx = open_or_skip(RdmaConfig::default(), t).expect("opened once already");
    let node = Node::start(node_ctx, 4 * MIB).await;
    let (conn, _control) = connect(&ctx, node.addr).await;
    let (_dst, reg) = buffer(&ctx, MIB);

    // The peer stops answering: posted WRs stay in flight (the transport
    // retries for 7 x 67 ms before giving up), and the deadline comes first.
    node.drop_connections();
    let deadline = Instant::now() + Duration::from_millis(150);
    let tr = conn
        .try_submit(TransferSpec {
            op: Op::Read,
            local: reg.whole(),
            remote_offset: 0,
            deadline,
        })
        .unwrap();
    assert!(conn.stats().lanes.iter().any(|l| l.outstanding > 0));
    let e = tr.wait(tokio::time::sleep).await.unwrap_err();
    let late = Instant::now().saturating_duration_since(deadline);
    assert_eq!(e.code, ErrorCode::Timeout, "{e}");
    assert!(late <= FLUSH_GRACE, "ended {late:?} after the deadline");
    println!("timed out {late:?} after the deadline: {e}");
    let st = conn.stats();
    let reset: Vec<_> = st
        .lanes
        .iter()
        .filter_map(|l| l.broken_reason.as_deref())
        .collect();
    assert!(
        !reset.is_empty() && reset.iter().all(|r| r.contains("deadline")),
        "{st:?}"
    );
    assert!(
        st.lanes.iter().all(|l| l.outstanding == 0),
        "flushed: {st:?}"
    );
    read_back_works(&ctx, &node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_of_a_dead_lane_are_retried_on_another_lane() {
    let t = "slices_of_a_dead_lane_are_retried_on_another_lane";
    let Some(node_ctx) = open_or_skip(RdmaConfig::default(), t) else {
        return;
    };
    let ctx = open_or_skip(RdmaConfig::default(), t).expect("opened once already");
    let node = Node::start(node_ctx, 16 * MIB).await;
    // SAFETY: no connection yet.
    fill(unsafe { node.segment.bytes_mut(0, 16 * MIB) }, 11);
    let (dst, reg) = buffer(&ctx, 16 * MIB);
    let read_all = |conn: &kvpool_rdma::RdmaConnection| {
        conn.try_submit(TransferSpec {
            op: Op::Read,
            local: reg.whole(),
            remote_offset: 0,
            deadline: secs(30),
        })
        .unwrap()
    };
    let verify = || {
        // SAFETY: called after the read completed; the segment is only read.
        unsafe {
            assert_eq!(
                checksum(dst.bytes(0, 16 * MIB)),
                checksum(node.segment.bytes(0, 16 * MIB))
            );
            dst.bytes_mut(0, 16 * MIB).fill(0);
        }
    };

    // 1. The peer's QP of lane 0 disappears: lane 0's slices time out in the
    //    transport (retries exhausted) and run again on lane 1.
    let (conn, _control) = connect(&ctx, node.addr).await;
    node.destroy_lane(0);
    let started = Instant::now();
    read_all(&conn).wait(tokio::time::sleep).await.unwrap();
    verify();
    let st = conn.stats();
    println!(
        "peer lane gone: read done in {:?}; {st:?}",
        started.elapsed()
    );
    assert!(st.retried_slices > 0, "{st:?}");
    assert!(!st.lanes[0].healthy && st.lanes[1].healthy, "{st:?}");
    let why = st.lanes[0].broken_reason.clone().unwrap();
    assert!(why.contains("IBV_WC_"), "{why}");

    // 2. Our own lane 1 is reset while a read is in flight: its work
    //    requests flush and run on lane 0.
    let (conn, _control) = connect(&ctx, node.addr).await;
    let tr = read_all(&conn);
    conn.poll();
    conn.reset_lane(1);
    tr.wait(tokio::time::sleep).await.unwrap();
    verify();
    let st = conn.stats();
    assert!(st.lanes[0].healthy && !st.lanes[1].healthy, "{st:?}");
    assert_eq!(st.failed, 0);
}
