//! Pool cache models on the synthetic trace, including the reference check.

use crate::support;

use kvpool_conductor::cache::{CachePolicy, Capacity};
use kvpool_sim::cache_sim::simulate_cache;
use support::load_trace;

#[test]
fn lru_reference_hit_ratios() {
    let trace = load_trace();
    assert_eq!(trace.len(), 3_993);
    for (cap, want) in [
        (Capacity::Blocks(1_000), 0.0825),
        (Capacity::Blocks(10_000), 0.4235),
        (Capacity::Unbounded, 0.6396),
    ] {
        let r = simulate_cache(&trace, CachePolicy::Lru, cap);
        assert!(
            (r.prefix_hit_ratio - want).abs() <= 0.0005,
            "LRU at {cap}: {} (want {want} +- 0.0005)",
            r.prefix_hit_ratio
        );
        assert_eq!(r.total_blocks, trace.total_blocks());
    }
}

#[test]
fn every_policy_reaches_the_same_ceiling_and_grows_with_capacity() {
    let trace = load_trace();
    let ceiling = simulate_cache(&trace, CachePolicy::Lru, Capacity::Unbounded).prefix_hit_ratio;
    for policy in CachePolicy::ALL {
        let mut last = -1.0;
        for cap in [1_000, 10_000, 30_000, 50_000] {
            let r = simulate_cache(&trace, policy, Capacity::Blocks(cap));
            assert!(
                r.prefix_hit_ratio >= last,
                "{policy} at {cap}: not monotone"
            );
            assert!(r.prefix_hit_ratio <= ceiling + 1e-12);
            last = r.prefix_hit_ratio;
        }
        let inf = simulate_cache(&trace, policy, Capacity::Unbounded);
        assert_eq!(inf.prefix_hit_ratio, ceiling, "{policy}");
        assert_eq!(inf.evictions, 0);
    }
}

#[test]
fn length_aware_beats_plain_lfu_on_prefix_hits() {
    // Plain LFU breaks ties by block recency and so evicts a request's first
    // blocks before its last ones; length-aware does the opposite.
    let trace = load_trace();
    for cap in [1_000, 10_000] {
        let lfu = simulate_cache(&trace, CachePolicy::Lfu, Capacity::Blocks(cap));
        let la = simulate_cache(&trace, CachePolicy::LengthAware, Capacity::Blocks(cap));
        assert!(
            la.prefix_hit_ratio > lfu.prefix_hit_ratio,
            "{cap}: {la:?} vs {lfu:?}"
        );
    }
}
