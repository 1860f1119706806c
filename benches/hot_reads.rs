//! Skewed reads over four storage nodes, with hot-object replication off
//! (`master.hot_replicas = 0`, the reference) and on (2), in alternating
//! rounds of the same run: readers pick keys by a Zipf law (s = 1.1), the
//! way requests share popular prefixes. Prints get p50/p99 and ops/s, and
//! how evenly the nodes served the bytes (busiest node's bytes over the
//! mean; 1.0 = even).
//!
//!     cargo bench --bench hot_reads          # full run
//!     cargo test --release --bench hot_reads # small run (also part of the suite)

mod support;

use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};
use rand::{Rng, SeedableRng};
use support::{full_mode, Lat};

const NODES: usize = 4;
const ZIPF_S: f64 = 1.1;

struct Round {
    lat: Lat,
    ops_per_s: f64,
    /// Busiest node's bytes served over the mean of the four.
    skew: f64,
    hot_copies: u64,
}

pub fn main() {
    let full = full_mode();
    let (keys, size, readers, reads) = if full {
        (256, 64 << 10, 8, 2_000)
    } else {
        (32, 16 << 10, 2, 100)
    };
    let rounds = if full { 2 } else { 1 };
    println!(
        "kvpool hot-reads bench ({} mode): {keys} keys of {} KiB, {NODES} storage nodes, \
         {readers} readers x {reads} gets, Zipf s = {ZIPF_S}, over TCP",
        if full { "full" } else { "small" },
        size >> 10
    );
    println!("machine: {}", support::machine());
    println!(
        "{:<14} {:>8} {:>8} {:>10} {:>12} {:>11}",
        "hot_replicas", "p50_us", "p99_us", "ops/s", "busiest/mean", "hot_copies"
    );
    for _ in 0..rounds {
        for hot in [0u16, 2] {
            let r = round(hot, keys, size, readers, reads);
            println!(
                "{:<14} {:>8.1} {:>8.1} {:>10.0} {:>12.2} {:>11}",
                hot,
                r.lat.us(0.5),
                r.lat.us(0.99),
                r.ops_per_s,
                r.skew,
                r.hot_copies
            );
        }
    }
}

fn round(hot: u16, keys: usize, size: usize, readers: usize, reads: usize) -> Round {
    let cfg = std::env::temp_dir().join(format!(
        "kvpool-bench-hot-{}-{hot}.toml",
        std::process::id()
    ));
    std::fs::write(
        &cfg,
        format!("[master]\nhot_replicas = {hot}\nhot_reads = 8\nhot_window_ms = 1000\n"),
    )
    .expect("bench config");
    let cfg = cfg.to_str().expect("utf-8 path").to_string();
    let master = support::start(
        "master",
        &[
            "--config",
            &cfg,
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ],
    );
    let nodes: Vec<support::Node> = (0..NODES)
        .map(|_| {
            support::start(
                "storage",
                &[
                    "--listen",
                    "127.0.0.1:0",
                    "--http",
                    "127.0.0.1:0",
                    "--shards",
                    "1",
                    "--master",
                    &master.addr,
                    "--segment-size",
                    "256MiB",
                ],
            )
        })
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let ccfg = ClientConfig {
        transport: Transport::Tcp,
        location_cache_entries: 0,
        ..Default::default()
    };
    let addr = master.addr.clone();
    let value = vec![7u8; size];
    let cdf = zipf_cdf(keys, ZIPF_S);
    let served = |nodes: &[support::Node]| -> Vec<u64> {
        nodes
            .iter()
            .map(|n| support::metric(&n.http, "kvpool_storage_read_bytes").unwrap_or(0))
            .collect()
    };
    let (lat, elapsed, before, after, hot_copies) = rt.block_on(async {
        let client = Client::connect(&addr, ccfg.clone()).await.expect("connect");
        let deadline = Instant::now() + Duration::from_secs(10);
        while client.stat().await.map_or(0, |s| s.segments.len()) < NODES {
            assert!(Instant::now() < deadline, "storage nodes did not mount");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for k in 0..keys {
            client
                .put(format!("chunk-{k}").as_bytes(), &value)
                .await
                .expect("put");
        }
        // A warm-up pass (replicas form), then the measured one.
        let mut out = Vec::new();
        for pass in 0..2 {
            if pass == 1 {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            let before = served(&nodes);
            let t0 = Instant::now();
            let tasks: Vec<_> = (0..readers)
                .map(|i| {
                    let (addr, ccfg, cdf) = (addr.clone(), ccfg.clone(), cdf.clone());
                    tokio::spawn(async move {
                        let c = Client::connect(&addr, ccfg).await.expect("connect");
                        let mut rng = rand::rngs::StdRng::seed_from_u64(i as u64);
                        let mut lat = Lat::new();
                        for _ in 0..reads {
                            let u: f64 = rng.random();
                            let k = cdf.partition_point(|&p| p < u).min(cdf.len() - 1);
                            let t = Instant::now();
                            let v = c.get(format!("chunk-{k}").as_bytes()).await.expect("get");
                            lat.record(t.elapsed(), v.len() as u64);
                        }
                        lat
                    })
                })
                .collect();
            let mut lat = Lat::new();
            for t in tasks {
                lat.add(&t.await.expect("reader"));
            }
            out = vec![(lat, t0.elapsed(), before, served(&nodes))];
        }
        let (lat, elapsed, before, after) = out.pop().expect("measured pass");
        let hot_copies = client.stat().await.map_or(0, |s| s.hot_copies);
        (lat, elapsed, before, after, hot_copies)
    });
    let bytes: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let mean = bytes.iter().sum::<u64>() as f64 / NODES as f64;
    let skew = *bytes.iter().max().unwrap_or(&0) as f64 / mean.max(1.0);
    Round {
        ops_per_s: lat.h.len() as f64 / elapsed.as_secs_f64(),
        lat,
        skew,
        hot_copies,
    }
}

/// The cumulative probabilities of a Zipf law over `n` ranks.
fn zipf_cdf(n: usize, s: f64) -> std::sync::Arc<Vec<f64>> {
    let w: Vec<f64> = (1..=n).map(|r| 1.0 / (r as f64).powf(s)).collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    std::sync::Arc::new(
        w.iter()
            .map(|x| {
                acc += x / total;
                acc
            })
            .collect(),
    )
}
