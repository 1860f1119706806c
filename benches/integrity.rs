//! What end-to-end checksums cost: put and get of 4 KiB, 1 MiB and 16 MiB
//! values with `client.checksums` on and off, over shared memory and over
//! loopback TCP, in alternating rounds against one `kvpool run` process.
//! The writer hashes a value as it sends it, the reader hashes what it
//! read; the reference is the value checksum (xxh3-64) alone over the same bytes.
//!
//!     cargo bench --bench integrity          # full run (6 rounds)
//!     cargo test --release --bench integrity # small run (part of the suite)

mod support;

use std::time::Instant;

use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};
use support::{full_mode, size_name, Lat};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn main() {
    let full = full_mode();
    let sizes: [(usize, usize); 3] = if full {
        [(4 << 10, 2_000), (1 << 20, 200), (16 << 20, 16)]
    } else {
        [(4 << 10, 50), (1 << 20, 5), (16 << 20, 2)]
    };
    let rounds = if full { 6 } else { 2 };
    println!(
        "kvpool integrity bench ({} mode): checksums on vs off, {rounds} alternating rounds",
        if full { "full" } else { "small" }
    );
    println!("machine: {}", support::machine());
    let cfg = std::env::temp_dir().join(format!("kvpool-bench-integ-{}.toml", std::process::id()));
    // Short leases: a value just read and removed gives its space back soon
    // (a removal under a lease waits for it), so rounds do not fill the pool.
    std::fs::write(
        &cfg,
        "[storage]\nprefault = true\n[master]\nlease_ttl_ms = 300\n",
    )
    .expect("bench config");
    let node = support::start_pool(&cfg, "1GiB", &[]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let connect = |transport, checksums| {
        let c = ClientConfig {
            transport,
            checksums,
            ..Default::default()
        };
        rt.block_on(Client::connect(&node.addr, c))
            .expect("connect")
    };
    println!(
        "{:<5} {:>6} {:<4} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "path", "size", "op", "p50_off_us", "p50_on_us", "gbps_off", "gbps_on", "on/off"
    );
    for (transport, path) in [(Transport::Shm, "shm"), (Transport::Tcp, "tcp")] {
        let clients = [connect(transport, false), connect(transport, true)];
        for (size, n) in sizes {
            let value: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
            let mut buf = vec![0u8; size];
            // [checksums off, on] x [put, get]
            let mut lat = [[Lat::new(), Lat::new()], [Lat::new(), Lat::new()]];
            let mut ratio_put = Vec::new();
            let mut ratio_get = Vec::new();
            for round in 0..rounds {
                let mut p50 = [[0f64; 2]; 2];
                // Who goes first alternates: the machine drifts.
                let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
                for which in order {
                    let c = &clients[which];
                    let mut put = Lat::new();
                    let mut get = Lat::new();
                    rt.block_on(async {
                        for i in 0..n {
                            let k = format!("integ-{path}-{size}-{which}-{round}-{i}");
                            let t = Instant::now();
                            c.put(k.as_bytes(), &value).await.expect("put");
                            put.record(t.elapsed(), size as u64);
                            let t = Instant::now();
                            let got = c.get_into(k.as_bytes(), &mut buf).await.expect("get");
                            get.record(t.elapsed(), size as u64);
                            assert_eq!(got, size);
                            c.remove_with(k.as_bytes(), true).await.expect("rm");
                        }
                    });
                    assert_eq!(buf, value, "the bytes read are the bytes written");
                    p50[which] = [put.us(0.5), get.us(0.5)];
                    lat[which][0].add(&put);
                    lat[which][1].add(&get);
                }
                ratio_put.push(p50[1][0] / p50[0][0]);
                ratio_get.push(p50[1][1] / p50[0][1]);
            }
            for (op, i, ratios) in [("put", 0, &ratio_put), ("get", 1, &ratio_get)] {
                println!(
                    "{:<5} {:>6} {:<4} {:>10.1} {:>10.1} {:>10.2} {:>10.2} {:>8.3}",
                    path,
                    size_name(size),
                    op,
                    lat[0][i].us(0.5),
                    lat[1][i].us(0.5),
                    lat[0][i].gbps(),
                    lat[1][i].gbps(),
                    median(ratios.clone())
                );
            }
        }
    }
    // The reference: xxh3-64 alone, over a warm 16 MiB buffer.
    let data: Vec<u8> = (0..16 << 20).map(|i| (i % 253) as u8).collect();
    let reps = if full { 100 } else { 5 };
    let t = Instant::now();
    let mut h = 0u64;
    for _ in 0..reps {
        h = h.wrapping_add(kvpool_runtime::hash::value_sum(std::hint::black_box(&data)));
    }
    let gbps = (reps * data.len()) as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("reference xxh3-64 over 16MiB (warm): {gbps:.2} GB/s (digest {h:x})");
    println!("on/off: median over rounds of p50(checksums on) / p50(checksums off)");
    drop(node);
    let _ = std::fs::remove_file(&cfg);
}
