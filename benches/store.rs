//! Store latency and throughput: put and get of 4 KiB .. 16 MiB values from
//! this process (the client) to a `kvpool run` process (master + storage)
//! over loopback TCP. Prints p50/p99/p99.9/max and GB/s per size, beside
//! loopback TCP (iperf3) and memcpy measured in the same run.
//!
//!     cargo bench --bench store          # full run
//!     cargo test --release --bench store # small run (also part of the suite)

mod support;

use std::time::Instant;

use kvpool_client::Client;
use kvpool_config::ClientConfig;
use support::{full_mode, header, row, size_name, Lat};

fn main() {
    let full = full_mode();
    let sizes: [(usize, usize); 4] = if full {
        [
            (4 << 10, 20_000),
            (64 << 10, 5_000),
            (1 << 20, 1_000),
            (16 << 20, 100),
        ]
    } else {
        [(4 << 10, 200), (64 << 10, 50), (1 << 20, 10), (16 << 20, 3)]
    };
    println!(
        "kvpool store bench ({} mode)",
        if full { "full" } else { "small" }
    );
    println!("machine: {}", support::machine());

    // Production setting: the segment's pages are committed at start, so the
    // data path never takes a page fault (see docs/BENCHMARKS.md).
    let cfg = std::env::temp_dir().join(format!("kvpool-bench-store-{}.toml", std::process::id()));
    std::fs::write(&cfg, "[storage]\nprefault = true\n").expect("bench config");
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
            "2GiB",
        ],
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let client = rt
        .block_on(Client::connect(&node.addr, ClientConfig::default()))
        .expect("connect");

    header();
    for (size, n) in sizes {
        let value: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let keys: Vec<String> = (0..n).map(|i| format!("bench-{size}-{i}")).collect();
        let mut put = Lat::new();
        let mut get = Lat::new();
        let mut buf = vec![0u8; size];
        rt.block_on(async {
            // Warm the connections and the segment's pages.
            client.put(b"warm", &value).await.expect("warm put");
            client.get_into(b"warm", &mut buf).await.expect("warm get");
            client.remove_with(b"warm", true).await.expect("warm rm");
            for k in &keys {
                let t = Instant::now();
                client.put(k.as_bytes(), &value).await.expect("put");
                put.record(t.elapsed(), size as u64);
            }
            for k in &keys {
                let t = Instant::now();
                let got = client.get_into(k.as_bytes(), &mut buf).await.expect("get");
                get.record(t.elapsed(), size as u64);
                assert_eq!(got, size);
            }
            assert_eq!(buf, value, "the bytes read are the bytes written");
            // Just read, so leased: removal needs force.
            for k in &keys {
                client.remove_with(k.as_bytes(), true).await.expect("rm");
            }
        });
        row("put", &size_name(size), &put);
        row("get", &size_name(size), &get);
    }

    let memcpy = support::memcpy_gbps(16 << 20, if full { 200 } else { 10 });
    println!("reference memcpy 16MiB single thread: {memcpy:.2} GB/s");
    match support::iperf3_gbps(if full { 5 } else { 1 }) {
        Some(g) => println!("reference iperf3 loopback TCP (-l 1M): {g:.2} GB/s"),
        None => println!("reference iperf3: not installed (apt install iperf3)"),
    }
    drop(node);
    let _ = std::fs::remove_file(&cfg);
}
