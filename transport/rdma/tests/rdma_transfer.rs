//! RDMA WRITE and READ between two endpoints in one process, connected by RC
//! queue pairs over a real TCP control connection (rkyv frames): sizes from
//! 1 B to 16 MiB, a batch of 64 reads, the MR cache, and the bounds on work
//! requests and requests. Real verbs; on a machine without an RDMA device
//! every test prints `skip: no RDMA device (<reason>)` and passes.
#![cfg(feature = "rdma")]

#[allow(dead_code)] // each test binary uses part of the helpers
mod rdma_common;

use std::sync::Arc;

use kvpool_rdma::{Op, RawMemory, RdmaBuffer, RdmaConfig, RdmaMemory, TransferSpec};
use kvpool_wire::{ErrorCode, RdmaCaps};
use rdma_common::*;

const MIB: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_read_of_every_size_is_verified_by_checksum() {
    let t = "write_then_read_of_every_size_is_verified_by_checksum";
    let Some(node_ctx) = open_or_skip(RdmaConfig::default(), t) else {
        return;
    };
    let ctx = open_or_skip(RdmaConfig::default(), t).expect("opened once already");
    let node = Node::start(node_ctx, 40 * MIB).await;
    let (conn, _control) = connect(&ctx, node.addr).await;
    assert_eq!(conn.remote_len(), 40 * MIB as u64);
    assert_eq!(conn.lanes(), 2);

    let (src, src_reg) = buffer(&ctx, 17 * MIB);
    let (dst, dst_reg) = buffer(&ctx, 17 * MIB);
    let sizes = [1, 4096, 65535, 65536, 65537, MIB, 16 * MIB];
    let mut remote = 3u64; // odd offsets on purpose
    for (i, &size) in sizes.iter().enumerate() {
        // SAFETY: no transfer is in flight on `src`.
        fill(unsafe { src.bytes_mut(0, size) }, i as u64 + 1);
        let want = checksum(unsafe { src.bytes(0, size) });

        let w = conn
            .try_submit(TransferSpec {
                op: Op::Write,
                local: src_reg.slice(0, size).unwrap(),
                remote_offset: remote,
                deadline: secs(60),
            })
            .unwrap();
        w.wait(tokio::time::sleep).await.unwrap();
        // The bytes are in the node's segment (not only on our side).
        // SAFETY: the write has completed; nothing else touches the range.
        let there = checksum(unsafe { node.segment.bytes(remote as usize, size) });
        assert_eq!(there, want, "size {size}: node's bytes after WRITE");

        // SAFETY: no transfer is in flight on `dst`.
        unsafe { dst.bytes_mut(0, size + 5) }.fill(0);
        let r = conn
            .try_submit(TransferSpec {
                op: Op::Read,
                local: dst_reg.slice(5, size).unwrap(), // unaligned local side too
                remote_offset: remote,
                deadline: secs(60),
            })
            .unwrap();
        r.wait(tokio::time::sleep).await.unwrap();
        // SAFETY: the read has completed.
        let got = checksum(unsafe { dst.bytes(5, size) });
        assert_eq!(got, want, "size {size}: READ back");
        println!("size {size}: write + read verified");
        remote += size as u64 + 1;
    }
    let st = conn.stats();
    assert_eq!(st.failed, 0);
    assert_eq!(st.retried_slices, 0);
    assert!(
        st.lanes.iter().all(|l| l.healthy && l.posted_wrs > 0),
        "{st:?}"
    );
    assert_eq!(st.active_requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_64_reads_lands_each_in_its_own_place() {
    let t = "a_batch_of_64_reads_lands_each_in_its_own_place";
    let Some(node_ctx) = open_or_skip(RdmaConfig::default(), t) else {
        return;
    };
    let ctx = open_or_skip(RdmaConfig::default(), t).expect("opened once already");
    const N: usize = 64;
    const LEN: usize = 100_000; // not a multiple of the slice
    const STRIDE: usize = 100_003;
    let node = Node::start(node_ctx, N * STRIDE + 4096).await;
    // SAFETY: no connection exists yet.
    fill(unsafe { node.segment.bytes_mut(0, N * STRIDE) }, 77);
    let (conn, _control) = connect(&ctx, node.addr).await;
    let (dst, dst_reg) = buffer(&ctx, N * LEN);

    let transfers: Vec<_> = (0..N)
        .map(|i| {
            conn.try_submit(TransferSpec {
                op: Op::Read,
                local: dst_reg.slice(i * LEN, LEN).unwrap(),
                remote_offset: (i * STRIDE) as u64,
                deadline: secs(60),
            })
            .unwrap()
        })
        .collect();
    assert_eq!(conn.stats().active_requests, N);
    for t in transfers {
        t.wait(tokio::time::sleep).await.unwrap();
    }
    for i in 0..N {
        // SAFETY: every read has completed; the segment is not written.
        let (got, want) = unsafe {
            (
                checksum(dst.bytes(i * LEN, LEN)),
                checksum(node.segment.bytes(i * STRIDE, LEN)),
            )
        };
        assert_eq!(got, want, "read {i}");
    }
    let st = conn.stats();
    assert_eq!(st.succeeded, N as u64);
    assert!(
        st.lanes.iter().all(|l| l.posted_wrs > 0),
        "both lanes used: {st:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mr_cache_reuses_covering_ranges_is_bounded_and_keeps_busy_memory() {
    let t = "the_mr_cache_reuses_covering_ranges_is_bounded_and_keeps_busy_memory";
    let Some(node_ctx) = open_or_skip(RdmaConfig::default(), t) else {
        return;
    };
    let ctx = open_or_skip(
        RdmaConfig {
            mr_cache_max_entries: 2,
            ..Default::default()
        },
        t,
    )
    .expect("opened once already");

    let a = Arc::new(RdmaBuffer::new(MIB));
    let reg_a = ctx.register(a.clone()).unwrap();
    let s0 = ctx.mr_cache_stats();
    assert_eq!((s0.registrations, s0.entries), (1, 1));

    // A sub-range of a registered range is served by it.
    let sub = ctx.lookup(reg_a.addr() + 4096, 8192).expect("covered");
    assert!(Arc::ptr_eq(sub.registration(), &reg_a));
    assert_eq!(sub.offset(), 4096);
    // SAFETY: points inside `a`, which the cache keeps alive.
    let inner = unsafe { RawMemory::new(RdmaMemory::as_ptr(&*a).add(65536), 4096) }.unwrap();
    let again = ctx.register(Arc::new(inner)).unwrap();
    assert!(Arc::ptr_eq(&again, &reg_a), "covered range reused");
    let s1 = ctx.mr_cache_stats();
    assert_eq!(s1.registrations, 1, "no new ibv_reg_mr for a covered range");
    assert!(s1.hits >= s0.hits + 2);
    drop((sub, again));

    // Bounded: two entries, both held -> a third is refused.
    let (_b, reg_b) = buffer(&ctx, MIB);
    let c = Arc::new(RdmaBuffer::new(MIB));
    let e = ctx.register(c.clone()).unwrap_err();
    assert_eq!(
        kvpool_wire::KvError::from(e).code,
        ErrorCode::ResourceExhausted
    );
    // Unheld -> evicted (least recently used) and deregistered.
    drop(reg_b);
    let reg_c = ctx.register(c.clone()).unwrap();
    let s2 = ctx.mr_cache_stats();
    assert_eq!(
        (s2.entries, s2.evictions, s2.deregistrations),
        (2, 1, 1),
        "{s2:?}"
    );

    // A registration used by a transfer stays registered after the cache
    // and the caller let go, and is released once the transfer is done.
    let node = Node::start(node_ctx, 2 * MIB).await;
    // SAFETY: no connection yet.
    fill(unsafe { node.segment.bytes_mut(0, MIB) }, 5);
    let (conn, _control) = connect(&ctx, node.addr).await;
    let tr = conn
        .try_submit(TransferSpec {
            op: Op::Read,
            local: reg_a.whole(),
            remote_offset: 0,
            deadline: secs(60),
        })
        .unwrap();
    assert!(ctx.unregister(reg_a.addr(), reg_a.len()));
    drop(reg_a);
    let before = ctx.mr_cache_stats().deregistrations;
    tr.wait(tokio::time::sleep).await.unwrap();
    // SAFETY: the read has completed.
    assert_eq!(
        checksum(unsafe { a.bytes(0, MIB) }),
        checksum(unsafe { node.segment.bytes(0, MIB) })
    );
    let after = ctx.mr_cache_stats().deregistrations;
    assert_eq!(after, before + 1, "released when the transfer let go");
    drop(reg_c);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outstanding_work_requests_and_requests_are_bounded() {
    let t = "outstanding_work_requests_and_requests_are_bounded";
    let Some(node_ctx) = open_or_skip(RdmaConfig::default(), t) else {
        return;
    };
    const WR_BOUND: u32 = 4;
    const REQS: usize = 16;
    // 16 slices each: one request alone has more slices than the lanes may
    // carry (2 x WR_BOUND), so its remaining slices wait in the connection.
    const LEN: usize = 1 << 20;
    let ctx = open_or_skip(
        RdmaConfig {
            max_outstanding_per_lane: WR_BOUND,
            max_requests_per_connection: REQS,
            ..Default::default()
        },
        t,
    )
    .expect("opened once already");
    let node = Node::start(node_ctx, 64 * LEN).await;
    // SAFETY: no connection yet.
    fill(unsafe { node.segment.bytes_mut(0, 64 * LEN) }, 9);
    let (conn, _control) = connect(&ctx, node.addr).await;
    let (dst, dst_reg) = buffer(&ctx, 32 * LEN);

    // More requests than the table holds: exactly REQS are taken, the next
    // is refused at once (back-pressure), nothing queues without bound.
    let mut held = Vec::new();
    let refused = loop {
        let i = held.len();
        match conn.try_submit(TransferSpec {
            op: Op::Read,
            local: dst_reg.slice(i * LEN, LEN).unwrap(),
            remote_offset: (i * LEN) as u64,
            deadline: secs(60),
        }) {
            Ok(t) => held.push(t),
            Err(e) => break e,
        }
        assert!(held.len() <= REQS);
    };
    assert_eq!(held.len(), REQS);
    assert_eq!(refused.code, ErrorCode::ResourceExhausted, "{refused}");
    let st = conn.stats();
    assert!(st.lanes.iter().all(|l| l.outstanding <= WR_BOUND), "{st:?}");
    assert!(
        st.lanes.iter().all(|l| l.max_outstanding_seen == WR_BOUND),
        "the bound was reached: {st:?}"
    );
    for t in held {
        t.wait(tokio::time::sleep).await.unwrap();
    }

    // Many tasks at once on one connection: `submit` waits for room.
    let tasks: Vec<_> = (0..32)
        .map(|task| {
            let (conn, dst, dst_reg) = (conn.clone(), dst.clone(), dst_reg.clone());
            let segment = node.segment.clone();
            tokio::spawn(async move {
                // Each task reads into its own destination range.
                let local = dst_reg.slice(task * LEN, LEN).unwrap();
                for round in 0..4 {
                    let i = (task * 4 + round) % 64;
                    let tr = conn
                        .submit(
                            TransferSpec {
                                op: Op::Read,
                                local: local.clone(),
                                remote_offset: (i * LEN) as u64,
                                deadline: secs(120),
                            },
                            tokio::time::sleep,
                        )
                        .await
                        .unwrap();
                    tr.wait(tokio::time::sleep).await.unwrap();
                    // SAFETY: this task's read has completed; the segment is
                    // only read.
                    let (got, want) = unsafe {
                        (
                            checksum(dst.bytes(task * LEN, LEN)),
                            checksum(segment.bytes(i * LEN, LEN)),
                        )
                    };
                    assert_eq!(got, want, "task {task} round {round}");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let st = conn.stats();
    assert_eq!(st.request_capacity, REQS, "the table never grows");
    assert!(st.max_active_requests_seen <= REQS, "{st:?}");
    for l in &st.lanes {
        assert!(l.max_outstanding_seen <= WR_BOUND, "{l:?}");
        assert_eq!(l.max_outstanding, WR_BOUND);
    }
    assert_eq!(st.succeeded, (REQS + 32 * 4) as u64);
    assert_eq!(st.failed, 0);
    assert_eq!(st.active_requests, 0);
    // Chained posting: fewer doorbells than work requests.
    let (wrs, bells): (u64, u64) = st
        .lanes
        .iter()
        .fold((0, 0), |a, l| (a.0 + l.posted_wrs, a.1 + l.doorbells));
    println!("posted {wrs} work requests with {bells} doorbells");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_and_unsupported_peers_are_refused_up_front() {
    let t = "out_of_range_and_unsupported_peers_are_refused_up_front";
    let Some(node_ctx) = open_or_skip(RdmaConfig::default(), t) else {
        return;
    };
    let ctx = open_or_skip(RdmaConfig::default(), t).expect("opened once already");
    let node = Node::start(node_ctx, MIB).await;
    let (conn, _control) = connect(&ctx, node.addr).await;
    let (_buf, reg) = buffer(&ctx, 4096);
    let e = conn
        .try_submit(TransferSpec {
            op: Op::Write,
            local: reg.slice(0, 4096).unwrap(),
            remote_offset: MIB as u64 - 100,
            deadline: secs(5),
        })
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidParams, "{e}");
    assert!(reg.slice(4000, 100).is_err());
    // A zero-length transfer completes at once.
    let z = conn
        .try_submit(TransferSpec {
            op: Op::Read,
            local: reg.slice(0, 0).unwrap(),
            remote_offset: 0,
            deadline: secs(5),
        })
        .unwrap();
    z.wait(tokio::time::sleep).await.unwrap();
    // A peer without RDMA: refused with its reason.
    let e = ctx
        .connect(
            &RdmaCaps::unavailable("no RDMA device (ENOSYS)"),
            SEGMENT_ID,
        )
        .unwrap_err();
    assert!(e.to_string().contains("ENOSYS"), "{e}");
    assert_eq!(kvpool_wire::KvError::from(e).code, ErrorCode::Unsupported);
    // The connection still works after all that.
    let ok = conn
        .try_submit(TransferSpec {
            op: Op::Write,
            local: reg.slice(0, 4096).unwrap(),
            remote_offset: 0,
            deadline: secs(30),
        })
        .unwrap();
    ok.wait(tokio::time::sleep).await.unwrap();
    assert_eq!(conn.healthy_lanes(), 2);
}
