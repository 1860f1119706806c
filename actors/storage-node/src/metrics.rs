//! A storage node's metrics on `GET /metrics` (names in README.md).

use std::time::Duration;

use kvpool_runtime::metrics::prometheus_client::metrics::counter::Counter;
use kvpool_runtime::metrics::prometheus_client::metrics::family::Family;
use kvpool_runtime::metrics::prometheus_client::metrics::gauge::Gauge;
use kvpool_runtime::metrics::prometheus_client::metrics::histogram::Histogram;
use kvpool_runtime::metrics::{
    latency_histogram, HistFamily, MetricsRegistry, OpLabels, OpOnly, ShardLabels,
};

/// Storage node metrics: data-plane requests and bytes.
#[derive(Clone)]
pub struct StorageMetrics {
    requests: Family<OpLabels, Counter>,
    shard_requests: Family<ShardLabels, Counter>,
    pub bytes_read: Counter,
    pub bytes_written: Counter,
    latency: HistFamily,
    pub segment_bytes: Gauge,
    pub nvme_capacity: Gauge,
    pub nvme_used: Gauge,
    pub nvme_objects: Gauge,
    pub nvme_evictions: Counter,
    pub nvme_demotions: Counter,
    pub nvme_promotions: Counter,
    pub nvme_drops: Counter,
    /// Extra replicas of hot objects fetched from other nodes.
    pub hot_fetches: Counter,
    pub nvme_read_seconds: Histogram,
    pub nvme_write_seconds: Histogram,
    /// Live RDMA peer connections (queue-pair sets) to this node's segment.
    pub rdma_connections: Gauge,
    /// Data-plane requests refused: no valid grant from the master.
    pub auth_refusals: Counter,
    /// Copies (demotion, write-through, promotion, fetch) refused because the
    /// bytes did not match the object's checksum.
    pub checksum_mismatches: Counter,
}

impl StorageMetrics {
    pub fn register(reg: &MetricsRegistry) -> Self {
        let m = Self {
            requests: Family::default(),
            shard_requests: Family::default(),
            bytes_read: Counter::default(),
            bytes_written: Counter::default(),
            latency: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            segment_bytes: Gauge::default(),
            nvme_capacity: Gauge::default(),
            nvme_used: Gauge::default(),
            nvme_objects: Gauge::default(),
            nvme_evictions: Counter::default(),
            nvme_demotions: Counter::default(),
            nvme_promotions: Counter::default(),
            nvme_drops: Counter::default(),
            hot_fetches: Counter::default(),
            nvme_read_seconds: latency_histogram(),
            nvme_write_seconds: latency_histogram(),
            rdma_connections: Gauge::default(),
            auth_refusals: Counter::default(),
            checksum_mismatches: Counter::default(),
        };
        reg.register(
            "storage_auth_refusals",
            "Data-plane requests refused for want of a valid grant",
            m.auth_refusals.clone(),
        );
        reg.register(
            "storage_checksum_mismatches",
            "Demotions, promotions and hot-object fetches refused: bytes did not match the object's checksum",
            m.checksum_mismatches.clone(),
        );
        reg.register(
            "storage_rdma_connections",
            "Live RDMA peer connections to this node's segment",
            m.rdma_connections.clone(),
        );
        reg.register(
            "storage_requests",
            "Data-plane requests by operation and result",
            m.requests.clone(),
        );
        reg.register(
            "storage_read_bytes",
            "Payload bytes served to readers",
            m.bytes_read.clone(),
        );
        reg.register(
            "storage_written_bytes",
            "Payload bytes written by writers",
            m.bytes_written.clone(),
        );
        reg.register(
            "storage_request_seconds",
            "Data-plane request latency, by operation",
            m.latency.clone(),
        );
        reg.register(
            "storage_segment_bytes",
            "Size of this node's DRAM segment",
            m.segment_bytes.clone(),
        );
        reg.register(
            "storage_nvme_capacity_bytes",
            "Bytes of the NVMe tier (0: none)",
            m.nvme_capacity.clone(),
        );
        reg.register(
            "storage_nvme_used_bytes",
            "Bytes of the NVMe tier in use",
            m.nvme_used.clone(),
        );
        reg.register(
            "storage_nvme_objects",
            "Objects on the NVMe tier",
            m.nvme_objects.clone(),
        );
        reg.register(
            "storage_nvme_evictions",
            "Objects the NVMe tier evicted",
            m.nvme_evictions.clone(),
        );
        reg.register(
            "storage_nvme_demotions",
            "Objects moved from DRAM to NVMe by eviction",
            m.nvme_demotions.clone(),
        );
        reg.register(
            "storage_hot_fetches",
            "Extra replicas of hot objects fetched from other nodes",
            m.hot_fetches.clone(),
        );
        reg.register(
            "storage_nvme_promotions",
            "Objects copied back from NVMe to DRAM",
            m.nvme_promotions.clone(),
        );
        reg.register(
            "storage_nvme_drops",
            "NVMe copies dropped because their object was removed",
            m.nvme_drops.clone(),
        );
        reg.register(
            "storage_nvme_read_seconds",
            "NVMe object read latency",
            m.nvme_read_seconds.clone(),
        );
        reg.register(
            "storage_nvme_write_seconds",
            "NVMe object write latency (data on the device)",
            m.nvme_write_seconds.clone(),
        );
        reg.register(
            "storage_shard_requests",
            "Data requests (reads, writes, NVMe reads) that reached each shard's port",
            m.shard_requests.clone(),
        );
        // Every series exists from the start (at 0), so dashboards and alerts
        // see them before the first request.
        for op in ["read", "write"] {
            for result in ["ok", "error"] {
                let _ = m.requests.get_or_create(&OpLabels { op, result });
            }
        }
        m
    }

    /// The request counter of `shard` (one lookup: the shard's connections
    /// keep it).
    pub fn shard_requests(&self, shard: u32) -> Counter {
        self.shard_requests
            .get_or_create(&ShardLabels { shard })
            .clone()
    }

    pub fn observe(&self, op: &'static str, ok: bool, took: Duration) {
        let result = if ok { "ok" } else { "error" };
        self.requests.get_or_create(&OpLabels { op, result }).inc();
        self.latency
            .get_or_create(&OpOnly { op })
            .observe(took.as_secs_f64());
    }
}
