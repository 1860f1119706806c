//! The transfer engine across processes: put and get of 4 KiB .. 16 MiB,
//! single and batched (32), over TCP and shared memory, from this process to
//! a `kvpool run` process; with memcpy, loopback TCP (iperf3) and Redis
//! (redis-benchmark) measured in the same run.
//!
//!     cargo bench --bench transfer           # full run
//!     cargo test --release --bench transfer  # small run (part of the suite)

mod support;

use kvpool_actors::bench::{self, TransferBench};

fn main() {
    let full = support::full_mode();
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
            if full { "4GiB" } else { "2GiB" },
        ],
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let b = TransferBench::standard(full);
    bench::print_header();
    rt.block_on(bench::run_transfer(&node.addr, &b, bench::print_row))
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
        None => println!("reference iperf3: not installed (apt install iperf3)"),
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
            "reference redis-benchmark: not installed (apt install redis-server redis-tools)"
        ),
    }
}
