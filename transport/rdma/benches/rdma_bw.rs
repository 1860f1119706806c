//! Raw bandwidth of the RDMA layer: one-sided WRITE and READ of 64 KiB,
//! 1 MiB and 16 MiB between two `RdmaContext`s of this process on the same
//! device (a client connection and a node's passive side, set up in-process),
//! with several transfers in flight. Prints p50/p99/max per transfer and MB/s
//! over the wall time, and one `RESULT kvpool <op> <lanes> <bytes> <MB/s>`
//! line per case for scripts. `transport/rdma/benches/rdma-compare.sh` runs it
//! beside perftest's `ib_write_bw` / `ib_read_bw` in the same machine.
//!
//!     cargo bench -p kvpool-transport --features rdma --bench rdma_bw   # full
//!     cargo test  -p kvpool-transport --features rdma --bench rdma_bw   # small
//!
//! `RDMA_BENCH_MIB` sets the bytes moved per case (full: 128 MiB, small: 8).
//! Without a device it prints `skip: no RDMA device (<reason>)` and exits 0
//! (1 with `RDMA_TESTS_REQUIRE_DEVICE=1`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvpool_rdma::{
    Op, RdmaBuffer, RdmaConfig, RdmaConnection, RdmaContext, RdmaError, TransferSpec,
};

const MIB: usize = 1 << 20;

fn open(cfg: RdmaConfig) -> Option<Arc<RdmaContext>> {
    match RdmaContext::open(cfg) {
        Ok(c) => Some(c),
        Err(RdmaError::NoDevice(r)) => {
            println!("skip: no RDMA device ({r})");
            if std::env::var("RDMA_TESTS_REQUIRE_DEVICE").as_deref() == Ok("1") {
                std::process::exit(1);
            }
            None
        }
        Err(e) => panic!("opening RDMA: {e}"),
    }
}

fn size_name(n: usize) -> String {
    if n >= MIB {
        format!("{}MiB", n / MIB)
    } else {
        format!("{}KiB", n >> 10)
    }
}

/// Moves `total` bytes in `size` transfers, `depth` in flight at once.
fn run(
    conn: &RdmaConnection,
    local: &Arc<kvpool_rdma::Registration>,
    op: Op,
    size: usize,
    total: usize,
    depth: usize,
    remote_len: usize,
) -> (Histogram<u64>, Duration) {
    let count = (total / size).max(4);
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("histogram");
    let mut inflight: VecDeque<(kvpool_rdma::Transfer, Instant)> = VecDeque::new();
    let slots = remote_len / size;
    let started = Instant::now();
    let mut next = 0;
    while next < count || !inflight.is_empty() {
        while next < count && inflight.len() < depth {
            let slot = next % depth;
            let t0 = Instant::now();
            let t = conn
                .try_submit(TransferSpec {
                    op,
                    local: local.slice(slot * size, size).expect("local slot"),
                    remote_offset: ((next % slots) * size) as u64,
                    deadline: t0 + Duration::from_secs(120),
                })
                .expect("submit");
            inflight.push_back((t, t0));
            next += 1;
        }
        let (t, t0) = inflight.front_mut().expect("one in flight");
        match t.try_result() {
            Some(r) => {
                r.expect("transfer");
                h.saturating_record(t0.elapsed().as_nanos() as u64);
                inflight.pop_front();
            }
            None => std::hint::spin_loop(),
        }
    }
    (h, started.elapsed())
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let Some(node_ctx) = open(RdmaConfig::default()) else {
        return;
    };
    let total = std::env::var("RDMA_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(if full { 128 * MIB } else { 8 * MIB }, |m| m * MIB);
    let remote_len = 64 * MIB;
    let segment = Arc::new(RdmaBuffer::new(remote_len));
    let region = node_ctx
        .register(segment.clone())
        .expect("register segment");
    println!(
        "kvpool rdma_bw ({} mode), devices {:?}, {} MiB per case",
        if full { "full" } else { "small" },
        node_ctx.device_names(),
        total / MIB
    );
    println!(
        "{:<6} {:>5} {:>6} {:>6} {:>6} {:>10} {:>10} {:>10} {:>9}",
        "op", "lanes", "size", "depth", "n", "p50_us", "p99_us", "max_us", "MB/s"
    );
    for lanes in [1, 2] {
        let cfg = RdmaConfig {
            lanes_per_peer: lanes,
            ..Default::default()
        };
        let Some(ctx) = open(cfg) else { return };
        let pending = ctx.connect(&node_ctx.caps(), 1).expect("client QPs");
        let (reply, _passive) = node_ctx
            .accept(pending.request(), &region)
            .expect("node QPs");
        let conn = pending.complete(&reply).expect("connect");
        let buf = Arc::new(RdmaBuffer::new(16 * MIB * 2));
        let local = ctx.register(buf).expect("register local");
        for size in [64 << 10, MIB, 16 * MIB] {
            // About 4 MiB in flight, as the perftest runs it is compared with.
            let depth = (4 * MIB / size).clamp(2, 64);
            let depth = depth.min(local.len() / size);
            for (op, name) in [(Op::Write, "write"), (Op::Read, "read")] {
                let (h, wall) = run(&conn, &local, op, size, total, depth, remote_len);
                let mbs = (h.len() as usize * size) as f64 / wall.as_secs_f64() / 1e6;
                println!(
                    "{:<6} {:>5} {:>6} {:>6} {:>6} {:>10.1} {:>10.1} {:>10.1} {:>9.1}",
                    name,
                    lanes,
                    size_name(size),
                    depth,
                    h.len(),
                    h.value_at_quantile(0.5) as f64 / 1e3,
                    h.value_at_quantile(0.99) as f64 / 1e3,
                    h.max() as f64 / 1e3,
                    mbs
                );
                println!("RESULT kvpool {name} {lanes} {size} {mbs:.1}");
            }
        }
        let st = conn.stats();
        assert_eq!(st.failed, 0, "{st:?}");
    }
}
