//! Store latency and throughput: put and get of 4 KiB .. 16 MiB values from
//! this process (the client) to a `kvpool run` process (master + storage)
//! over loopback TCP. Prints p50/p99/p99.9/max and GB/s per size, beside
//! loopback TCP (iperf3) and memcpy measured in the same run. Then repeated
//! 4 KiB gets of a few hot keys, with the client's location cache and
//! without, beside redis-benchmark's GET (one client), in alternating
//! rounds.
//!
//!     cargo bench --bench store          # full run
//!     cargo test --release --bench store # small run (also part of the suite)

mod support;

use std::time::Instant;

use kvpool_client::Client;
use kvpool_config::ClientConfig;
use support::{full_mode, header, row, size_name, Lat};

pub fn main() {
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
    // data path never takes a page fault (see docs/BENCHMARKS.md). 4 GiB:
    // the objects of one size, read (leased) and then removed, keep their
    // space for a lease; the next size's must fit beside them unevicted.
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
            "4GiB",
        ],
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let client = rt
        .block_on(Client::connect(&node.addr, ClientConfig::default()))
        .expect("connect");

    // KVPOOL_BENCH_ONLY=repeated runs the repeated small gets alone.
    let only_repeated = std::env::var("KVPOOL_BENCH_ONLY").is_ok_and(|v| v == "repeated");
    header();
    for (size, n) in sizes.into_iter().filter(|_| !only_repeated) {
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

    repeated_gets(&rt, &node.addr, full);
    if only_repeated {
        let _ = std::fs::remove_file(&cfg);
        return;
    }

    let memcpy = support::memcpy_gbps(16 << 20, if full { 200 } else { 10 });
    println!("reference memcpy 16MiB single thread: {memcpy:.2} GB/s");
    match support::iperf3_gbps(if full { 5 } else { 1 }) {
        Some(g) => println!("reference iperf3 loopback TCP (-l 1M): {g:.2} GB/s"),
        None => println!("skip: reference iperf3 not found (apt-get install iperf3)"),
    }
    drop(node);
    let _ = std::fs::remove_file(&cfg);
}

/// Repeated 4 KiB gets of 16 hot keys: over TCP with the client's location
/// cache (one round trip, to the node) and without (two: master, then
/// node), over shared memory with it, and redis-benchmark GET -c 1, in
/// alternating rounds; p50s and their ratios to Redis.
fn repeated_gets(rt: &tokio::runtime::Runtime, master: &str, full: bool) {
    use kvpool_config::Transport;
    const SIZE: usize = 4 << 10;
    let (rounds, n) = if full { (6, 20_000) } else { (1, 500) };
    let value: Vec<u8> = (0..SIZE).map(|i| (i % 253) as u8).collect();
    let keys: Vec<String> = (0..16).map(|i| format!("hot-{i}")).collect();
    let connect = |transport, entries: usize| {
        let cfg = ClientConfig {
            transport,
            location_cache_entries: entries,
            ..Default::default()
        };
        rt.block_on(Client::connect(master, cfg)).expect("connect")
    };
    let tcp_cached = connect(Transport::Tcp, 65_536);
    let tcp_uncached = connect(Transport::Tcp, 0);
    let shm_cached = connect(Transport::Shm, 65_536);
    rt.block_on(async {
        for k in &keys {
            tcp_cached.put(k.as_bytes(), &value).await.expect("put");
        }
    });
    let run = |c: &Client| -> f64 {
        let mut lat = Lat::new();
        let mut buf = vec![0u8; SIZE];
        rt.block_on(async {
            for i in 0..n {
                let k = &keys[i % keys.len()];
                let t = Instant::now();
                c.get_into(k.as_bytes(), &mut buf).await.expect("get");
                lat.record(t.elapsed(), SIZE as u64);
            }
        });
        assert_eq!(buf, value, "the bytes read are the bytes written");
        lat.us(0.5)
    };
    println!();
    println!("repeated 4KiB gets of 16 keys, {n} per round, {rounds} round(s), p50 us:");
    println!(
        "{:<6} {:>11} {:>13} {:>11} {:>10} {:>11} {:>13} {:>11}",
        "round",
        "tcp_cached",
        "tcp_uncached",
        "shm_cached",
        "redis_get",
        "tcp_c/redis",
        "tcp_unc/redis",
        "shm_c/redis"
    );
    let mut ratios: Vec<[f64; 3]> = Vec::new();
    for r in 0..rounds {
        let a = run(&tcp_cached);
        let redis = support::redis_benchmark(&[SIZE], n)
            .and_then(|v| v.into_iter().next())
            .map(|f| f.get_p50_ms * 1000.0);
        let b = run(&tcp_uncached);
        let c = run(&shm_cached);
        match redis {
            Some(rp) => {
                let q = [a / rp, b / rp, c / rp];
                println!(
                    "{r:<6} {a:>11.1} {b:>13.1} {c:>11.1} {rp:>10.1} {:>11.2} {:>13.2} {:>11.2}",
                    q[0], q[1], q[2]
                );
                ratios.push(q);
            }
            None => println!(
                "{r:<6} {a:>11.1} {b:>13.1} {c:>11.1} (skip: reference redis-server not found)"
            ),
        }
    }
    if !ratios.is_empty() {
        let median = |j: usize| {
            let mut v: Vec<f64> = ratios.iter().map(|q| q[j]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "median p50 / redis GET p50: tcp cached {:.2}, tcp uncached {:.2}, shm cached {:.2}",
            median(0),
            median(1),
            median(2)
        );
    }
    println!(
        "location cache hits: tcp {}, shm {}",
        tcp_cached.location_hits(),
        shm_cached.location_hits()
    );
    rt.block_on(async {
        for k in &keys {
            let _ = tcp_cached.remove_with(k.as_bytes(), true).await;
        }
    });
}
