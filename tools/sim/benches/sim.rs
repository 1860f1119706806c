//! Simulator speed on the whole synthetic trace: wall time per run and
//! requests simulated per second, per policy (and for the cache-only replay).
//!
//! `cargo bench --bench sim` (release profile). Latencies are recorded in an
//! hdrhistogram (µs) and printed as p50 / p99 / p99.9 / max.

use std::path::Path;
use std::time::Instant;

use hdrhistogram::Histogram;
use kvpool_conductor::cache::{CachePolicy, Capacity};
use kvpool_conductor::scheduler::Policy;
use kvpool_sim::cache_sim::simulate_cache;
use kvpool_sim::sim::{simulate, SimConfig};
use kvpool_sim::trace::Trace;

const TRACE_PATH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/data/synthetic_trace.jsonl"
);
/// Timed runs per line under `cargo bench`; `cargo test` runs each once (small
/// mode, so the bench cannot rot).
fn runs() -> usize {
    if std::env::args().any(|a| a == "--bench") {
        20
    } else {
        1
    }
}

fn report(name: &str, requests: usize, h: &Histogram<u64>) {
    let p50 = h.value_at_quantile(0.5);
    println!(
        "{name:<34} wall µs p50 {:>7} p99 {:>7} p99.9 {:>7} max {:>7}   {:>9.0} requests/s (at p50)",
        p50,
        h.value_at_quantile(0.99),
        h.value_at_quantile(0.999),
        h.max(),
        requests as f64 / (p50 as f64 / 1e6),
    );
}

fn time_runs(mut f: impl FnMut()) -> Histogram<u64> {
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("valid bounds");
    f(); // warm-up
    for _ in 0..runs() {
        let t = Instant::now();
        f();
        h.saturating_record(t.elapsed().as_micros() as u64);
    }
    h
}

fn main() {
    let t = Instant::now();
    let trace = match Trace::load(Path::new(TRACE_PATH)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cannot load {TRACE_PATH}: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "trace: {} requests, {} blocks, loaded in {:.1} ms; {} runs per line",
        trace.len(),
        trace.total_blocks(),
        t.elapsed().as_secs_f64() * 1e3,
        runs()
    );
    for (label, prefill, decode, speed) in [
        ("speed 1, 8P+2D", 8, 2, 1.0),
        ("speed 4, 16P+1D", 16, 1, 4.0),
    ] {
        println!("full simulation, {label}:");
        let mut all = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("valid bounds");
        for policy in Policy::ALL {
            let mut cfg = SimConfig::new(policy, prefill, decode);
            cfg.speed = speed;
            let h = time_runs(|| {
                let out = simulate(&trace, &cfg).expect("valid config");
                std::hint::black_box(out.report.slo_met);
            });
            report(&format!("  sim {policy}"), trace.len(), &h);
            all.add(&h).expect("same bounds");
        }
        report("  sim, all policies", trace.len(), &all);
    }
    println!("cache-only replay:");
    for policy in CachePolicy::ALL {
        for cap in [Capacity::Blocks(10_000), Capacity::Unbounded] {
            let h = time_runs(|| {
                std::hint::black_box(simulate_cache(&trace, policy, cap).hit_blocks);
            });
            report(&format!("  cache {policy} {cap}"), trace.len(), &h);
        }
    }
}
