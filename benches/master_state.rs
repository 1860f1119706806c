//! What the master's state directory costs: one put (PutStart + PutEnd) on
//! the state machine as the shard runs it, with its records written to the
//! log (`write(2)` to the page cache, `state_sync = "none"`) against the
//! same without a state directory, in alternating rounds of the same run;
//! then the time to recover a shard set of 1 M objects (replay the log) and
//! to take them back when their segment mounts again.
//!
//!     cargo bench --bench master_state          # full run (1 M objects)
//!     cargo test --release --bench master_state # small run (part of the suite)
//!     KVPOOL_BENCH_OBJECTS=10000000 cargo bench --bench master_state

mod support;

use std::path::Path;
use std::time::Instant;

use kvpool_config::MasterConfig;
use kvpool_master::core::MasterCore;
use kvpool_wire::proto::{call, Endpoint, MasterRequest, PutOptions, SegmentSpec, Tier};
use support::{full_mode, Lat};

const SHARDS: u32 = 2;
const UNIX_AT_ZERO_MS: u64 = 1_700_000_000_000;

fn segment() -> SegmentSpec {
    SegmentSpec {
        name: "bench-dram".into(),
        size: 1 << 44,
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 1,
            nr_shards: 1,
        },
        slice_bytes: 1 << 44,
        host_id: "bench".into(),
        tier: Tier::Dram,
        nvme: None,
    }
}

fn cfg() -> MasterConfig {
    MasterConfig {
        max_keys: 50_000_000,
        client_ttl_ms: 1 << 40,
        ..Default::default()
    }
}

fn ask<C: call::Call>(m: &mut MasterCore, c: C, now: u64) -> C::Reply {
    let req: MasterRequest = c.into();
    C::reply(m.call(req, now).expect("call")).expect("reply")
}

fn mount(m: &mut MasterCore) {
    ask(
        m,
        call::MountSegment {
            client_id: 1,
            spec: segment(),
        },
        1,
    );
}

/// Puts keys `from..to` (4 KiB each); each put's time into `lat`.
fn puts(m: &mut MasterCore, from: u64, to: u64, lat: Option<&mut Lat>) {
    let mut lat = lat;
    for i in from..to {
        let key = format!("bench-object-{i:012}").into_bytes();
        let t = Instant::now();
        ask(
            m,
            call::PutStart {
                client_id: 2,
                key: key.clone(),
                len: 4096,
                opts: PutOptions::default(),
            },
            2,
        );
        ask(
            m,
            call::PutEnd {
                client_id: 2,
                put_id: 0,
                key,
                checksum: Some(i),
            },
            2,
        );
        if let Some(l) = lat.as_deref_mut() {
            l.record(t.elapsed(), 0);
        }
    }
}

fn fresh(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
}

pub fn main() {
    let full = full_mode();
    let base = std::env::temp_dir().join(format!("kvpool-bench-durability-{}", std::process::id()));
    let (rounds, per_round) = if full { (6, 50_000u64) } else { (2, 2_000) };
    println!("# machine: {}", support::machine());
    println!("## one put (PutStart + PutEnd) on the state machine, 2 shards, 4 KiB objects");
    let mut with = Lat::new();
    let mut without = Lat::new();
    let mut medians = (Vec::new(), Vec::new());
    for r in 0..rounds {
        // Alternate which goes first.
        for logged in [r % 2 == 0, r % 2 != 0] {
            let dir = base.join(format!("round-{r}"));
            fresh(&dir);
            let mut m = if logged {
                MasterCore::open(SHARDS, &cfg(), 7, &dir, 0, UNIX_AT_ZERO_MS).unwrap()
            } else {
                MasterCore::new(SHARDS, &cfg(), 7)
            };
            mount(&mut m);
            let mut l = Lat::new();
            puts(&mut m, 0, per_round, Some(&mut l));
            if logged {
                medians.0.push(l.us(0.5));
                with.add(&l);
            } else {
                medians.1.push(l.us(0.5));
                without.add(&l);
            }
            fresh(&dir);
        }
    }
    support::header();
    support::row("put+log", "4KiB", &with);
    support::row("put", "4KiB", &without);
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, b) = (med(&mut medians.0), med(&mut medians.1));
    println!(
        "median of round p50s: with the log {a:.2} us, without {b:.2} us, ratio {:.2}",
        a / b
    );

    let n: u64 = std::env::var("KVPOOL_BENCH_OBJECTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if full { 1_000_000 } else { 20_000 });
    println!("## recovery of {n} objects");
    let dir = base.join("recovery");
    fresh(&dir);
    {
        let mut m = MasterCore::open(SHARDS, &cfg(), 7, &dir, 0, UNIX_AT_ZERO_MS).unwrap();
        mount(&mut m);
        puts(&mut m, 0, n, None);
    }
    let log_bytes: u64 = walk_bytes(&dir);
    let t = Instant::now();
    let mut m = MasterCore::open(SHARDS, &cfg(), 7, &dir, 10, UNIX_AT_ZERO_MS).unwrap();
    let replay = t.elapsed();
    let t = Instant::now();
    mount(&mut m);
    let attach = t.elapsed();
    let keys: u64 = m.shards.iter().map(|s| s.key_count()).sum();
    assert_eq!(keys, n, "every object back");
    println!(
        "objects {n}  log {:.1} MiB  replay {:.3} s  mount again (objects readable) {:.3} s",
        log_bytes as f64 / (1 << 20) as f64,
        replay.as_secs_f64(),
        attach.as_secs_f64()
    );
    drop(m);
    fresh(&base);
}

fn walk_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            total += walk_bytes(&p);
        } else {
            total += e.metadata().map(|m| m.len()).unwrap_or(0);
        }
    }
    total
}
