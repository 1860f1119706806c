//! Metrics: one Prometheus registry per process, rendered as text on
//! `GET /metrics`. Metric handles are atomics shared by clone, so shards
//! update them without locks; only registration and rendering take the lock.

use std::sync::{Arc, Mutex};

pub use prometheus_client;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

/// The process's metrics registry.
#[derive(Clone, Default)]
pub struct MetricsRegistry {
    inner: Arc<Mutex<Registry>>,
}

impl MetricsRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `metric` under `kvpool_<name>`.
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        let mut reg = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        reg.sub_registry_with_prefix("kvpool")
            .register(name, help, metric);
    }

    /// Registers `metric` under `name` as given, with the constant label
    /// `model_name="<model>"`: the names other tools' dashboards and load
    /// generators read (vLLM's `vllm:` metrics), beside our own names for
    /// the same handles.
    pub fn register_for_model(&self, model: &str, name: &str, help: &str, metric: impl Metric) {
        let mut reg = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        reg.sub_registry_with_label(("model_name".into(), model.to_string().into()))
            .register(name, help, metric);
    }

    /// The Prometheus text exposition of every registered metric.
    pub fn render(&self) -> String {
        let reg = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
        out
    }
}

/// A latency histogram in seconds with buckets from 1 us to ~16 s.
pub fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-6, 2.0, 25))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[test]
    fn registered_metrics_render_with_prefix() {
        let reg = MetricsRegistry::new();
        let c: Counter = Counter::default();
        reg.register("things", "Things seen", c.clone());
        c.inc_by(3);
        let h = latency_histogram();
        reg.register("op_seconds", "Op latency", h.clone());
        h.observe(0.000_05);
        let text = reg.render();
        assert!(text.contains("kvpool_things_total 3"), "{text}");
        assert!(text.contains("kvpool_op_seconds_count 1"), "{text}");
        reg.register_for_model("m", "vllm:generation_tokens", "Tokens", c.clone());
        let text = reg.render();
        assert!(
            text.contains("vllm:generation_tokens_total{model_name=\"m\"} 3"),
            "{text}"
        );
    }
}

/// Labels of a per-operation counter: the operation and its result.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct OpLabels {
    pub op: &'static str,
    pub result: &'static str,
}

/// Labels of a per-shard series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ShardLabels {
    pub shard: u32,
}

/// Labels of a per-operation histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct OpOnly {
    pub op: &'static str,
}

/// Labels of a per-segment gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct SegmentLabels {
    pub segment: String,
}

/// Latency histograms by operation.
pub type HistFamily = prometheus_client::metrics::family::Family<
    OpOnly,
    prometheus_client::metrics::histogram::Histogram,
    fn() -> prometheus_client::metrics::histogram::Histogram,
>;
