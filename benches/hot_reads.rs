//! Skewed reads over four storage nodes, with hot-object replication off
//! (`master.hot_replicas = 0`, the reference) and on (2), in alternating
//! rounds of the same run: readers pick keys by a Zipf law (s = 1.1), the
//! way requests share popular prefixes. Prints get p50/p99 and ops/s, and
//! how evenly the nodes served the bytes (busiest node's bytes over the
//! mean; 1.0 = even).
//!
//!
//! Then the same pool under engines: two `--role engine` processes
//! (builtin:tiny, pool client over TCP) answer one-token completions whose
//! prompts are one of a set of three-chunk prefixes, picked by the same Zipf
//! law, plus a suffix of their own; the prefixes' chunks are in the pool
//! (put by a first pass, waited for until the engines count them stored),
//! so each request loads three chunks and computes
//! the suffix. Prints TTFT p50/p99 per setting and the nodes' byte spread.
//! The engines run with `client.location_cache_entries = 0`: with the cache,
//! an engine's repeated reads of a chunk do not reach the master, which then
//! never sees them as hot.
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
    let (prefixes, clients, requests) = if full { (32, 4, 40) } else { (8, 2, 6) };
    println!(
        "engines: {prefixes} prefixes of 3 chunks (Zipf s = {ZIPF_S}) + 32-token suffixes, \
         2 builtin:tiny engines, {clients} clients x {requests} one-token completions"
    );
    println!(
        "{:<14} {:>8} {:>8} {:>12} {:>11}",
        "hot_replicas", "p50_ms", "p99_ms", "busiest/mean", "hot_copies"
    );
    for _ in 0..rounds {
        for hot in [0u16, 2] {
            let r = ttft_round(hot, prefixes, clients, requests);
            println!(
                "{:<14} {:>8.1} {:>8.1} {:>12.2} {:>11}",
                hot, r.p50_ms, r.p99_ms, r.skew, r.hot_copies
            );
        }
    }
}

/// TTFT of engine requests over Zipf-popular prefixes; see the file's head.
struct TtftRound {
    p50_ms: f64,
    p99_ms: f64,
    skew: f64,
    hot_copies: u64,
}

fn ttft_round(hot: u16, prefixes: usize, clients: usize, requests: usize) -> TtftRound {
    const SUFFIX: usize = 32;
    let (master, nodes) = start_pool(hot);
    wait_mounted(&master.addr);
    let cfg = std::env::temp_dir().join(format!(
        "kvpool-bench-hot-engine-{}-{hot}.toml",
        std::process::id()
    ));
    std::fs::write(
        &cfg,
        "[client]\ntransport = \"tcp\"\nlocation_cache_entries = 0\n",
    )
    .expect("engine config");
    let cfg = cfg.to_str().expect("utf-8 path").to_string();
    let engines: Vec<support::Node> = (0..2)
        .map(|_| {
            support::start(
                "engine",
                &[
                    "--model",
                    "builtin:tiny",
                    "--listen",
                    "127.0.0.1:0",
                    "--master",
                    &master.addr,
                    "--config",
                    &cfg,
                ],
            )
        })
        .collect();
    let prompt = |prefix: usize, seed: u32| -> Vec<u32> {
        let mut p = support::byte_prompt(3 * 256, prefix as u32 + 1);
        p.extend(support::byte_prompt(SUFFIX + 1, seed).into_iter().skip(1));
        p
    };
    let ask = |engine: &support::Node, p: Vec<u32>| {
        let body = serde_json::json!({"model": "builtin:tiny", "prompt": p, "max_tokens": 1,
            "temperature": 0, "ignore_eos": true});
        support::completion(&engine.addr, &body)
    };
    for k in 0..prefixes {
        ask(&engines[k % 2], prompt(k, 1_000_000 + k as u32));
    }
    // An engine answers before its chunks are stored (stores run behind the
    // answer): wait until every prefix chunk is in the pool, so that each
    // measured request can load its whole prefix.
    let engine_metric = |name: &str| -> u64 {
        engines
            .iter()
            .map(|e| support::metric(&e.addr, name).unwrap_or(0))
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine_metric("kvpool_engine_chunks_stored") < 3 * prefixes as u64 {
        assert_eq!(
            engine_metric("kvpool_engine_chunks_store_failed"),
            0,
            "a prefix chunk was not stored"
        );
        assert!(
            Instant::now() < deadline,
            "the prefix chunks were not stored within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let served = || -> Vec<u64> {
        nodes
            .iter()
            .map(|n| support::metric(&n.http, "kvpool_storage_read_bytes").unwrap_or(0))
            .collect()
    };
    let cdf = zipf_cdf(prefixes, ZIPF_S);
    let before = served();
    let ttfts: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                let (cdf, engines, ask, prompt) = (&cdf, &engines, &ask, &prompt);
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(c as u64);
                    (0..requests)
                        .map(|i| {
                            let u: f64 = rng.random();
                            let k = cdf.partition_point(|&p| p < u).min(cdf.len() - 1);
                            let p = prompt(k, (c * requests + i) as u32 + 7);
                            let t = Instant::now();
                            let out = ask(&engines[(c + i) % 2], p);
                            let ms = t.elapsed().as_secs_f64() * 1e3;
                            assert_eq!(
                                out["kvpool"]["prompt_tokens_loaded"], 768,
                                "the prefix came from the pool: {out}"
                            );
                            ms
                        })
                        .collect::<Vec<f64>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("client"))
            .collect()
    });
    let after = served();
    let bytes: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let mean = bytes.iter().sum::<u64>() as f64 / NODES as f64;
    let mut sorted = ttfts;
    sorted.sort_by(f64::total_cmp);
    let q = |f: f64| sorted[((sorted.len() - 1) as f64 * f).round() as usize];
    TtftRound {
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        skew: *bytes.iter().max().unwrap_or(&0) as f64 / mean.max(1.0),
        hot_copies: support::metric(&master.http, "kvpool_master_hot_copies").unwrap_or(0),
    }
}

/// Waits until the four storage nodes have mounted their segments.
fn wait_mounted(master: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let client = Client::connect(master, ClientConfig::default())
            .await
            .expect("connect");
        let deadline = Instant::now() + Duration::from_secs(10);
        while client.stat().await.map_or(0, |s| s.segments.len()) < NODES {
            assert!(Instant::now() < deadline, "storage nodes did not mount");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// A master with `hot_replicas = hot` and four storage nodes of one shard.
fn start_pool(hot: u16) -> (support::Node, Vec<support::Node>) {
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
    (master, nodes)
}

fn round(hot: u16, keys: usize, size: usize, readers: usize, reads: usize) -> Round {
    let (master, nodes) = start_pool(hot);
    wait_mounted(&master.addr);
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
