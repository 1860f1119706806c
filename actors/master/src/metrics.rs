//! The master's metrics on `GET /metrics` (names in README.md).

use std::time::Duration;

use kvpool_runtime::metrics::prometheus_client::metrics::counter::Counter;
use kvpool_runtime::metrics::prometheus_client::metrics::family::Family;
use kvpool_runtime::metrics::prometheus_client::metrics::gauge::Gauge;
use kvpool_runtime::metrics::prometheus_client::metrics::histogram::Histogram;
use kvpool_runtime::metrics::{
    latency_histogram, HistFamily, MetricsRegistry, OpLabels, OpOnly, SegmentLabels,
};

/// Master metrics: per-call counts and latency, pool gauges.
#[derive(Clone)]
pub struct MasterMetrics {
    calls: Family<OpLabels, Counter>,
    latency: HistFamily,
    pub keys: Gauge,
    pub segment_capacity: Family<SegmentLabels, Gauge>,
    pub segment_used: Family<SegmentLabels, Gauge>,
    pub segments: Gauge,
    pub evictions: Gauge,
    pub evicted_bytes: Gauge,
    pub demotions: Gauge,
    pub promotions: Gauge,
    pub hot_copies: Gauge,
    pub stale_puts: Counter,
    /// Puts acknowledged with fewer replicas than they asked for.
    pub fewer_replicas: Counter,
    /// Requests refused for want of the cluster secret.
    pub auth_refusals: Counter,
}

impl MasterMetrics {
    pub fn register(reg: &MetricsRegistry) -> Self {
        let m = Self {
            calls: Family::default(),
            latency: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            keys: Gauge::default(),
            segment_capacity: Family::default(),
            segment_used: Family::default(),
            segments: Gauge::default(),
            evictions: Gauge::default(),
            evicted_bytes: Gauge::default(),
            demotions: Gauge::default(),
            promotions: Gauge::default(),
            hot_copies: Gauge::default(),
            stale_puts: Counter::default(),
            fewer_replicas: Counter::default(),
            auth_refusals: Counter::default(),
        };
        reg.register(
            "master_puts_fewer_replicas",
            "Puts acknowledged with fewer replicas than they asked for (too few segments with room)",
            m.fewer_replicas.clone(),
        );
        reg.register(
            "master_auth_refusals",
            "Requests or connections refused for want of the cluster secret",
            m.auth_refusals.clone(),
        );
        reg.register(
            "master_calls",
            "Master calls by operation and result (ok or error)",
            m.calls.clone(),
        );
        reg.register(
            "master_call_seconds",
            "Master call latency inside the shard, by operation",
            m.latency.clone(),
        );
        reg.register("master_keys", "Objects in the pool", m.keys.clone());
        reg.register("master_segments", "Mounted segments", m.segments.clone());
        reg.register(
            "master_evictions",
            "Replicas evicted since the master started",
            m.evictions.clone(),
        );
        reg.register(
            "master_evicted_bytes",
            "Bytes evicted since the master started",
            m.evicted_bytes.clone(),
        );
        reg.register(
            "master_demotions",
            "Objects moved from DRAM to NVMe by eviction since start",
            m.demotions.clone(),
        );
        reg.register(
            "master_promotions",
            "Objects copied back from NVMe to DRAM since start",
            m.promotions.clone(),
        );
        reg.register(
            "master_hot_copies",
            "Extra DRAM replicas of hot objects fetched since start",
            m.hot_copies.clone(),
        );
        reg.register(
            "master_stale_puts",
            "Puts discarded after put_timeout_ms",
            m.stale_puts.clone(),
        );
        reg.register(
            "master_segment_capacity_bytes",
            "Capacity of each mounted segment",
            m.segment_capacity.clone(),
        );
        reg.register(
            "master_segment_used_bytes",
            "Bytes allocated in each mounted segment",
            m.segment_used.clone(),
        );
        m
    }

    pub fn observe(&self, op: &'static str, ok: bool, took: Duration) {
        let result = if ok { "ok" } else { "error" };
        self.calls.get_or_create(&OpLabels { op, result }).inc();
        self.latency
            .get_or_create(&OpOnly { op })
            .observe(took.as_secs_f64());
    }
}
