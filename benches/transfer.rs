//! The transfer engine across processes: put and get of 4 KiB .. 16 MiB,
//! single and batched (32), over TCP and shared memory, from this process to
//! a `kvpool run` process; with memcpy, loopback TCP (iperf3) and Redis
//! (redis-benchmark) measured in the same run.
//!
//!     cargo bench --bench transfer           # full run
//!     cargo test --release --bench transfer  # small run (part of the suite)
//!
//! RDMA mode (`--rdma`, a build with `--features rdma`, where a device is):
//! TCP and RDMA rows through the client, and perftest's `ib_write_bw` /
//! `ib_read_bw` on the same device in the same run as the reference. On the
//! soft-RoCE guest:
//!
//!     cargo bench --features rdma --bench transfer --no-run   # prints the binary
//!     RXE_VM_TIMEOUT=1200 ../shared/tools/rxe-vm/run.sh target/release/deps/transfer-* --bench --rdma

mod support;

use kvpool_node::bench::{self, TransferBench};

pub fn main() {
    let full = support::full_mode();
    if std::env::args().any(|a| a == "--rdma") {
        rdma_mode(full);
        return;
    }
    println!(
        "kvpool transfer bench ({} mode)",
        if full { "full" } else { "small" }
    );
    println!("machine: {}", support::machine());
    let cfg =
        std::env::temp_dir().join(format!("kvpool-bench-transfer-{}.toml", std::process::id()));
    // Prefaulted segment (production setting); short leases, so the space of
    // each case's objects, read and then removed, is free for the next case.
    std::fs::write(
        &cfg,
        "[storage]\nprefault = true\n[master]\nlease_ttl_ms = 1000\n",
    )
    .expect("bench config");
    let node = support::start_pool(&cfg, if full { "4GiB" } else { "2GiB" }, &[]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let b = TransferBench::standard(full);
    bench::print_header();
    rt.block_on(bench::run_transfer(&node.addr, &b, print))
        .expect("transfer bench");
    drop(node);
    let _ = std::fs::remove_file(&cfg);

    let memcpy = support::memcpy_gbps(16 << 20, if full { 200 } else { 10 });
    println!("reference memcpy 16MiB single thread, same buffers (cache-warm): {memcpy:.2} GB/s");
    let cold = support::memcpy_cold_gbps(
        16 << 20,
        if full { 1 << 30 } else { 256 << 20 },
        if full { 200 } else { 20 },
    );
    println!("reference memcpy 16MiB single thread, source rotating over DRAM: {cold:.2} GB/s");
    match support::iperf3_gbps(if full { 5 } else { 1 }) {
        Some(g) => println!("reference iperf3 loopback TCP (-l 1M): {g:.2} GB/s"),
        None => println!("skip: reference iperf3 not found (apt-get install iperf3)"),
    }
    let requests = if full { 20_000 } else { 500 };
    match support::redis_benchmark(&[4 << 10, 64 << 10, 1 << 20], requests) {
        Some(figs) => {
            for f in figs {
                println!(
                    "reference redis-benchmark -c 1 {:>7}: SET {:>8.0} req/s p50 {:.3} ms ({:.3} GB/s), GET {:>8.0} req/s p50 {:.3} ms ({:.3} GB/s)",
                    support::size_name(f.size),
                    f.set_rps,
                    f.set_p50_ms,
                    f.set_rps * f.size as f64 / 1e9,
                    f.get_rps,
                    f.get_p50_ms,
                    f.get_rps * f.size as f64 / 1e9,
                );
            }
        }
        None => println!(
            "skip: reference redis-benchmark not found (apt-get install redis-server redis-tools)"
        ),
    }
}

/// Rows on stdout, progress on stderr.
fn print(p: bench::Progress<'_>) {
    match p {
        bench::Progress::Row(r) => bench::print_row(r),
        p => bench::print_progress(&p),
    }
}

/// TCP and RDMA through the client against a node serving its segment over
/// RDMA, beside perftest on the same device (RDMA_DEVICE, default: the first
/// device, used by the node and the client too; RDMA_GID_INDEX, perftest's
/// GID index, default 1: the soft-RoCE guest's RoCE v2 IPv4 GID).
#[cfg(feature = "rdma")]
fn rdma_mode(full: bool) {
    use kvpool_config::Transport;
    use kvpool_rdma::{RdmaConfig, RdmaContext};
    // The in-process client's RDMA (the binary installs its own).
    kvpool_rdma::install();
    println!("machine: {}", support::machine());
    let dev = match RdmaContext::open(RdmaConfig::default()) {
        Ok(ctx) => std::env::var("RDMA_DEVICE")
            .unwrap_or_else(|_| ctx.device_names().first().cloned().unwrap_or_default()),
        Err(e) => {
            println!("skip: no RDMA device ({e})");
            return;
        }
    };
    let gid: u8 = std::env::var("RDMA_GID_INDEX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    println!("rdma device {dev}, gid index {gid}");
    let cfg = std::env::temp_dir().join(format!("kvpool-bench-rdma-{}.toml", std::process::id()));
    // The node, the client and perftest all use the one device `dev`.
    std::fs::write(
        &cfg,
        format!(
            "[master]\nlease_ttl_ms = 1000\n[storage.rdma]\nenabled = \"required\"\n\
             devices = [\"{dev}\"]\n"
        ),
    )
    .expect("bench config");
    let node = support::start(
        "all",
        &[
            "--config",
            cfg.to_str().expect("utf-8 path"),
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--segment-size",
            "512MiB",
        ],
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut b = TransferBench::standard(full);
    b.transports = vec![Transport::Tcp, Transport::Rdma];
    b.client.rdma.devices = vec![dev.clone()];
    b.sizes = vec![4 << 10, 64 << 10, 1 << 20, 16 << 20];
    b.batches = vec![1, 32];
    b.bytes_per_case = if full { 128 << 20 } else { 16 << 20 };
    b.max_calls = if full { 2000 } else { 100 };
    bench::print_header();
    rt.block_on(bench::run_transfer(&node.addr, &b, print))
        .expect("transfer bench");
    drop(node);
    let _ = std::fs::remove_file(&cfg);
    let moved: usize = if full { 128 << 20 } else { 16 << 20 };
    for op in ["write", "read"] {
        for size in [64usize << 10, 1 << 20, 16 << 20] {
            let iters = (moved / size).max(8);
            let depth = ((4 << 20) / size).clamp(2, 64);
            match support::perftest_gbps(op, &dev, gid, size, iters, depth) {
                Some(g) => println!(
                    "reference ib_{op}_bw {:>7} depth {depth:>2}: {g:.3} GB/s",
                    support::size_name(size)
                ),
                None => println!(
                    "skip: reference ib_{op}_bw {}: failed or not found (perftest)",
                    support::size_name(size)
                ),
            }
        }
    }
}

#[cfg(not(feature = "rdma"))]
fn rdma_mode(_full: bool) {
    println!("skip: this bench was built without the rdma feature (cargo bench --features rdma)");
}
