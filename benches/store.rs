//! Store latency and throughput: put and get of 4 KiB .. 16 MiB values from
//! this process (the client) to a `kvpool run` process (master + storage)
//! over loopback TCP. Prints p50/p99/p99.9/max and GB/s per size, beside
//! loopback TCP (iperf3) and memcpy measured in the same run. Then repeated
//! 4 KiB gets of a few hot keys, with the client's location cache and
//! without, beside redis-benchmark's GET (one client), in alternating
//! rounds, and batch gets of those keys with the cache and without. Last,
//! the location cache's inserts once its table is full of live leases.
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
    // KVPOOL_BENCH_ONLY=repeated runs the repeated small gets alone,
    // KVPOOL_BENCH_ONLY=nvme the gets served from the NVMe tier alone,
    // KVPOOL_BENCH_ONLY=locations the location cache's inserts alone.
    let only = std::env::var("KVPOOL_BENCH_ONLY").unwrap_or_default();
    if only == "locations" {
        location_inserts(full);
        return;
    }

    // Production setting: the segment's pages are committed at start, so the
    // data path never takes a page fault (see docs/benchmarks/store.md). 4 GiB:
    // the objects of one size, read (leased) and then removed, keep their
    // space for a lease; the next size's must fit beside them unevicted.
    let cfg = std::env::temp_dir().join(format!("kvpool-bench-store-{}.toml", std::process::id()));
    std::fs::write(&cfg, "[storage]\nprefault = true\n").expect("bench config");
    let node = support::start_pool(&cfg, "4GiB", &[]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let client = rt
        .block_on(Client::connect(&node.addr, ClientConfig::default()))
        .expect("connect");

    if only == "nvme" {
        drop(node);
        let _ = std::fs::remove_file(&cfg);
        nvme_gets(&rt, full);
        return;
    }
    let only_repeated = only == "repeated";
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
    nvme_gets(&rt, full);
    location_inserts(full);
}

/// What the client's location cache costs a get that misses it once the
/// table is full of live leases (as many distinct keys read within a lease
/// as it holds, 65,536 by default): the answer's insert, which must make
/// room, per key, beside inserting the same keys and replica lists into a
/// plain `HashMap` of the same bound, emptied when full (the reference);
/// each round runs both, the table first. Both are filled before the
/// first round.
fn location_inserts(full: bool) {
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::Duration;

    use kvpool_client::locations::Locations;
    use kvpool_wire::proto::{Endpoint, ReplicaDesc, Tier};

    const ENTRIES: usize = 65_536;
    let (rounds, n) = if full { (6, 400_000) } else { (1, 2 * ENTRIES) };
    let replicas: Arc<[ReplicaDesc]> = vec![ReplicaDesc {
        segment_id: 1,
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 1,
            nr_shards: 1,
        },
        slice_bytes: 1 << 30,
        host_id: "bench".into(),
        offset: 0,
        len: 4 << 10,
        tier: Tier::Dram,
        checksum: Some(1),
        grant: Default::default(),
    }]
    .into();
    let table: Locations = Locations::new(ENTRIES);
    let mut plain = HashMap::with_capacity(ENTRIES);
    let now = Instant::now();
    let until = now + Duration::from_secs(10);
    for i in 0..ENTRIES {
        let k = format!("warm-{i:016x}").into_bytes();
        table.put(&k, replicas.clone(), until, table.generation(&k), now);
        plain.insert(k, (until, replicas.clone()));
    }
    println!("location cache inserts, table of {ENTRIES} live leases, {n} keys a round:");
    for round in 0..rounds {
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|i| format!("chunk-{round}-{i:016x}").into_bytes())
            .collect();
        let t = Instant::now();
        for k in &keys {
            table.put(k, replicas.clone(), until, table.generation(k), now);
        }
        let ours = t.elapsed().as_secs_f64() * 1e9 / n as f64;
        let t = Instant::now();
        for k in &keys {
            if plain.len() >= ENTRIES {
                plain.clear();
            }
            plain.insert(k.clone(), (until, replicas.clone()));
        }
        let reference = t.elapsed().as_secs_f64() * 1e9 / n as f64;
        assert!(table.get(keys.last().expect("keys"), now).is_some());
        println!(
            "  round {round}: {ours:.0} ns an insert, plain HashMap {reference:.0} ns, ratio {:.2}",
            ours / reference
        );
    }
}

/// Repeated 4 KiB gets of 16 hot keys: over TCP with the client's location
/// cache (one round trip, to the node) and without (two: master, then
/// node), over shared memory with it, and redis-benchmark GET -c 1, in
/// alternating rounds; p50s and their ratios to Redis. Then batch gets of
/// all 16 keys over TCP with and without the cache, alternating.
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
    // Batches of all 16 keys (an engine loading a prefix's chunks): through
    // the location cache, and asking the master every time (the client
    // without a cache, as every batch get did before batch gets followed
    // the get protocol), in alternating rounds.
    let run_batch = |c: &Client| -> f64 {
        let mut lat = Lat::new();
        let mut bufs = vec![vec![0u8; SIZE]; keys.len()];
        rt.block_on(async {
            for _ in 0..n / keys.len() {
                let mut items: Vec<(&[u8], &mut [u8])> = keys
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|(k, b)| (k.as_bytes(), &mut b[..]))
                    .collect();
                let t = Instant::now();
                for r in c.batch_get_into(&mut items).await.expect("batch get") {
                    r.expect("a key of the batch");
                }
                lat.record(t.elapsed(), (SIZE * keys.len()) as u64);
            }
        });
        assert!(
            bufs.iter().all(|b| *b == value),
            "the bytes read are the bytes written"
        );
        lat.us(0.5)
    };
    println!();
    println!(
        "repeated batch gets of the 16 keys, {} per round, p50 us:",
        n / keys.len()
    );
    println!(
        "{:<6} {:>11} {:>13} {:>15}",
        "round", "tcp_cached", "tcp_uncached", "cached/uncached"
    );
    for r in 0..rounds {
        let a = run_batch(&tcp_cached);
        let b = run_batch(&tcp_uncached);
        println!("{r:<6} {a:>11.1} {b:>13.1} {:>15.2}", a / b);
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

/// Gets served from the NVMe tier, beside gets of DRAM replicas of the same
/// size from the same pool and client, and fio's random reads of that size
/// at queue depth 1 on the same file system, in alternating rounds (ours,
/// then fio). The pool is `kvpool run` with a 64 MiB DRAM segment and a
/// write-through tier (its file under the target directory); each value is
/// put, waits for its NVMe copy, and then loses its DRAM replica to 1 MiB
/// fillers (oldest first), so its gets read the tier. The client's location
/// cache is off and the transport TCP (no shared memory): every get is the
/// master's lookup, then a request to the node, on both sides, so the
/// difference is the node's read of the tier. No promotion
/// (`promote_after_reads = 0`).
fn nvme_gets(rt: &tokio::runtime::Runtime, full: bool) {
    use kvpool_wire::proto::Tier;
    const DRAM: u64 = 64 << 20;
    const FILLER: usize = 1 << 20;
    let cases: [(usize, usize); 3] = if full {
        [(4 << 10, 2000), (64 << 10, 500), (1 << 20, 150)]
    } else {
        [(4 << 10, 20), (64 << 10, 10), (1 << 20, 4)]
    };
    let rounds = if full { 3 } else { 1 };
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("store-nvme-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench dir");
    let cfg = dir.join("pool.toml");
    std::fs::write(
        &cfg,
        format!(
            "[master]\npromote_after_reads = 0\nlease_ttl_ms = 1000\n\
             [storage]\nprefault = true\n\
             [storage.nvme]\npath = \"{}\"\ncapacity = \"2 GiB\"\npolicy = \"write_through\"\n\
             avg_object_bytes = \"64 KiB\"\nsync_writes = false\ntask_poll_ms = 20\n",
            dir.join("tier.kvnv").display()
        ),
    )
    .expect("bench config");
    let node = support::start_pool(&cfg, "64MiB", &[]);
    let c = rt
        .block_on(Client::connect(
            &node.addr,
            ClientConfig {
                location_cache_entries: 0,
                transport: kvpool_config::Transport::Tcp,
                ..Default::default()
            },
        ))
        .expect("connect");
    let on = |key: &str, tier: Tier| {
        let info = rt.block_on(c.describe(key.as_bytes())).expect("describe");
        info.replicas.iter().any(|r| r.tier == tier)
    };
    println!();
    println!(
        "gets from the NVMe tier (write-through, DRAM replica evicted; location cache off), \
         {rounds} round(s), beside DRAM gets and fio randread at queue depth 1 (io_uring, \
         direct), us:"
    );
    println!(
        "{:<6} {:>6} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11}",
        "size",
        "round",
        "keys",
        "nvme_p50",
        "nvme_p99",
        "dram_p50",
        "fio_p50",
        "fio_p99",
        "fio_mean",
        "tier_p50",
        "node_read",
        "tier/fio"
    );
    for (size, n) in cases {
        let value =
            |i: usize| -> Vec<u8> { (0..size).map(|j| ((i * 7 + j) % 251) as u8).collect() };
        let keys: Vec<String> = (0..n).map(|i| format!("nv-{size}-{i}")).collect();
        rt.block_on(async {
            for (i, k) in keys.iter().enumerate() {
                c.put(k.as_bytes(), &value(i)).await.expect("put");
            }
        });
        // Each value's write-through copy lands before the fillers push
        // its DRAM replica out (else the eviction demotes it, the same end
        // but later).
        let deadline = Instant::now() + std::time::Duration::from_secs(120);
        for k in &keys {
            while !on(k, Tier::Nvme) {
                assert!(
                    Instant::now() < deadline,
                    "{k} has no NVMe copy after 120 s"
                );
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        // Twice the DRAM segment of fillers (a put leases nothing: the
        // oldest go first).
        let fill: Vec<u8> = vec![0x5a; FILLER];
        let fillers = (2 * DRAM as usize) / FILLER;
        rt.block_on(async {
            for j in 0..fillers {
                c.put(format!("fill-{size}-{j}").as_bytes(), &fill)
                    .await
                    .expect("filler put");
            }
        });
        let nvme_only: Vec<usize> = (0..n).filter(|&i| !on(&keys[i], Tier::Dram)).collect();
        // DRAM replicas of the same size, put last: the newest, not evicted.
        // A quarter of the segment at most, so they all stay.
        let dram_n = n.min(DRAM as usize / 4 / size);
        let dram_keys: Vec<String> = (0..dram_n).map(|i| format!("dr-{size}-{i}")).collect();
        rt.block_on(async {
            for (i, k) in dram_keys.iter().enumerate() {
                c.put(k.as_bytes(), &value(i)).await.expect("put");
            }
        });
        let fio_file = dir.join(format!("fio-{size}"));
        let fio_bytes = (n * size).max(64 << 20);
        std::fs::write(&fio_file, vec![0xa5u8; fio_bytes]).expect("fio file");
        let mut order = nvme_only.clone();
        let mut buf = vec![0u8; size];
        for r in 0..rounds {
            shuffle(&mut order, (r as u64 + 1) * size as u64);
            let mut nv = Lat::new();
            let read0 = nvme_read_seconds(&node.http);
            rt.block_on(async {
                for &i in &order {
                    let t = Instant::now();
                    let got = c.get_into(keys[i].as_bytes(), &mut buf).await.expect("get");
                    nv.record(t.elapsed(), size as u64);
                    assert_eq!(got, size);
                    assert!(buf == value(i), "an NVMe get returned other bytes");
                }
            });
            let read1 = nvme_read_seconds(&node.http);
            // The node's own read of the tier (its histogram's mean over
            // the round): the device read and the tier's checks.
            let node_read = match (read0, read1) {
                (Some(a), Some(b)) if b.1 > a.1 => (b.0 - a.0) / (b.1 - a.1) * 1e6,
                _ => f64::NAN,
            };
            let mut dr = Lat::new();
            rt.block_on(async {
                for (i, k) in dram_keys.iter().enumerate() {
                    let t = Instant::now();
                    c.get_into(k.as_bytes(), &mut buf).await.expect("get");
                    dr.record(t.elapsed(), size as u64);
                    assert!(buf == value(i), "a DRAM get returned other bytes");
                }
            });
            let fio = fio_read_lat(&fio_file, size, fio_bytes, order.len().max(100));
            let (np, dp) = (nv.us(0.5), dr.us(0.5));
            match fio {
                Some((f50, f99, fmean)) => println!(
                    "{:<6} {r:>6} {:>5} {np:>9.1} {:>9.1} {dp:>9.1} {f50:>9.1} {f99:>9.1} \
                     {fmean:>9.1} {:>9.1} {node_read:>9.1} {:>11.2}",
                    size_name(size),
                    order.len(),
                    nv.us(0.99),
                    np - dp,
                    (np - dp) / f50
                ),
                None => println!(
                    "{:<6} {r:>6} {:>5} {np:>9.1} {:>9.1} {dp:>9.1} (skip: reference fio not \
                     found or failed)",
                    size_name(size),
                    order.len(),
                    nv.us(0.99)
                ),
            }
        }
        if order.len() < n {
            println!(
                "  ({} of {n} keys kept a DRAM replica and were not read)",
                n - order.len()
            );
        }
        rt.block_on(async {
            for k in keys.iter().chain(&dram_keys) {
                let _ = c.remove_with(k.as_bytes(), true).await;
            }
            for j in 0..fillers {
                let _ = c
                    .remove_with(format!("fill-{size}-{j}").as_bytes(), true)
                    .await;
            }
        });
        let _ = std::fs::remove_file(&fio_file);
    }
    println!(
        "  tier_p50 = nvme_p50 - dram_p50 (the tier's part of a get); node_read = the node's \
         mean read of the tier (device read and checks), beside fio's mean; tier/fio = tier_p50 over \
         fio's p50 read"
    );
    drop(node);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The node's `storage_nvme_read_seconds` histogram: (sum, count).
fn nvme_read_seconds(http: &str) -> Option<(f64, f64)> {
    let text = support::metrics_text(http)?;
    let find = |suffix: &str| {
        text.lines().find_map(|l| {
            let (name, v) = l.split_once(' ')?;
            (name.ends_with(&format!("storage_nvme_read_seconds_{suffix}")))
                .then(|| v.trim().parse::<f64>().ok())?
        })
    };
    Some((find("sum")?, find("count")?))
}

/// A seeded Fisher-Yates shuffle (xorshift64*).
fn shuffle(v: &mut [usize], seed: u64) {
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let j = (x.wrapping_mul(0x2545_f491_4f6c_dd1d) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// fio's random reads of `bs` bytes at queue depth 1 (io_uring, O_DIRECT)
/// over `file`: (p50, p99, mean) of the whole read's latency, us.
fn fio_read_lat(
    file: &std::path::Path,
    bs: usize,
    bytes: usize,
    ios: usize,
) -> Option<(f64, f64, f64)> {
    let out = std::process::Command::new("fio")
        .args([
            "--name=ref",
            &format!("--filename={}", file.display()),
            "--rw=randread",
            &format!("--bs={bs}"),
            &format!("--size={bytes}"),
            "--ioengine=io_uring",
            "--direct=1",
            "--iodepth=1",
            "--numjobs=1",
            &format!("--number_ios={ios}"),
            "--lat_percentiles=1",
            "--output-format=json",
        ])
        .output()
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let lat = &v["jobs"][0]["read"]["lat_ns"];
    let p = &lat["percentile"];
    Some((
        p["50.000000"].as_f64()? / 1000.0,
        p["99.000000"].as_f64()? / 1000.0,
        lat["mean"].as_f64()? / 1000.0,
    ))
}
