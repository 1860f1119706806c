//! `kvpool sim cache`: a trace replayed through one global block cache
//! (the conductor's [`Cache`]), counting prefix hits.

use serde::Serialize;

use kvpool_conductor::cache::{BlockCache, Cache, CachePolicy, Capacity, HitCounter, PrefixIndex};

use crate::trace::Trace;

/// Result of [`simulate_cache`]; one JSON line of `kvpool sim cache --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheSimReport {
    /// Eviction policy.
    pub cache_policy: CachePolicy,
    /// Capacity in blocks (`"inf"` when unbounded).
    pub cache_blocks: Capacity,
    /// Requests replayed.
    pub requests: u64,
    /// Blocks asked for.
    pub total_blocks: u64,
    /// Blocks found in the longest cached prefix of each request.
    pub hit_blocks: u64,
    /// `hit_blocks / total_blocks`.
    pub prefix_hit_ratio: f64,
    /// Blocks evicted.
    pub evictions: u64,
}

/// Replays `trace` through one global cache: each request hits its longest
/// cached prefix, then touches all its blocks in prefix order.
pub fn simulate_cache(trace: &Trace, policy: CachePolicy, capacity: Capacity) -> CacheSimReport {
    let mut cache = Cache::new(policy, capacity);
    let mut hits = HitCounter::default();
    for (_, blocks) in trace.iter() {
        let hit = cache.prefix_len(blocks);
        hits.record(hit, blocks.len());
        cache.touch(blocks);
    }
    CacheSimReport {
        cache_policy: policy,
        cache_blocks: capacity,
        requests: trace.len() as u64,
        total_blocks: hits.total_blocks,
        hit_blocks: hits.hit_blocks,
        prefix_hit_ratio: hits.ratio(),
        evictions: cache.evictions(),
    }
}
