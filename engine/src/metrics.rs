//! The engine's metrics (Prometheus text on `GET /metrics`).

use std::sync::atomic::AtomicU64;

use kvpool_runtime::metrics::{latency_histogram, MetricsRegistry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::metrics::histogram::Histogram;

/// Handles to every engine metric; clones share the values.
#[derive(Clone)]
pub struct EngineMetrics {
    pub requests: Counter,
    /// Prompts this engine ran its tokenizer on (a request's text or
    /// messages, or `/tokenize`); a prompt whose token ids came with the
    /// request (`kvpool_prompt_token_ids`, or a token-id prompt) is not.
    pub prompts_tokenized: Counter,
    /// Lookups of a prompt's chunks in the pool this engine made itself
    /// (one batch exists each); none for a request that came with the
    /// front's count (`kvpool_pool_prefix`) or with `kv_transfer_params`.
    pub pool_lookups: Counter,
    pub prompt_tokens_computed: Counter,
    pub prompt_tokens_loaded: Counter,
    pub generated_tokens: Counter,
    pub chunks_loaded: Counter,
    pub chunks_refused: Counter,
    pub chunks_stored: Counter,
    pub chunks_store_failed: Counter,
    pub kv_load_seconds: Histogram,
    /// Time a prefill piece waited for streamed KV groups.
    pub kv_stream_wait_seconds: Histogram,
    pub prefill_seconds: Counter<f64, AtomicU64>,
    pub decode_seconds: Counter<f64, AtomicU64>,
    pub prefill_tokens_per_second: Gauge<f64, AtomicU64>,
    pub decode_tokens_per_second: Gauge<f64, AtomicU64>,
    pub running: Gauge,
    pub waiting: Gauge,
    pub cancelled: Counter,
    /// Prompt tokens of accepted requests (computed or loaded).
    pub prompt_tokens: Counter,
    /// Arrival at the engine to its first token.
    pub time_to_first_token: Histogram,
    /// Arrival at the engine to its last token.
    pub e2e_latency: Histogram,
}

/// Request-scale seconds: 1 ms to about 35 minutes.
fn request_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 22))
}

impl EngineMetrics {
    /// Creates the metrics and registers them in `reg`.
    pub fn new(reg: &MetricsRegistry) -> Self {
        let m = Self {
            requests: Counter::default(),
            prompts_tokenized: Counter::default(),
            pool_lookups: Counter::default(),
            prompt_tokens_computed: Counter::default(),
            prompt_tokens_loaded: Counter::default(),
            generated_tokens: Counter::default(),
            chunks_loaded: Counter::default(),
            chunks_refused: Counter::default(),
            chunks_stored: Counter::default(),
            chunks_store_failed: Counter::default(),
            kv_load_seconds: latency_histogram(),
            kv_stream_wait_seconds: latency_histogram(),
            prefill_seconds: Counter::default(),
            decode_seconds: Counter::default(),
            prefill_tokens_per_second: Gauge::default(),
            decode_tokens_per_second: Gauge::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            cancelled: Counter::default(),
            prompt_tokens: Counter::default(),
            time_to_first_token: request_histogram(),
            e2e_latency: request_histogram(),
        };
        reg.register(
            "engine_prompt_tokens",
            "Prompt tokens of accepted requests (computed or loaded from the pool)",
            m.prompt_tokens.clone(),
        );
        reg.register(
            "engine_time_to_first_token_seconds",
            "A request's arrival at the engine to its first token",
            m.time_to_first_token.clone(),
        );
        reg.register(
            "engine_e2e_request_latency_seconds",
            "A request's arrival at the engine to its last token",
            m.e2e_latency.clone(),
        );
        reg.register(
            "engine_requests_cancelled",
            "Sequences stopped because their caller went away (a client that disconnected, a \
             request past its deadline); their KV is freed before any more work",
            m.cancelled.clone(),
        );
        reg.register(
            "engine_requests",
            "Generation requests accepted",
            m.requests.clone(),
        );
        reg.register(
            "engine_prompts_tokenized",
            "Prompts run through the tokenizer (text or messages, and /tokenize)",
            m.prompts_tokenized.clone(),
        );
        reg.register(
            "engine_pool_lookups",
            "Lookups of a prompt's chunks in the pool made by this engine (one batch exists each)",
            m.pool_lookups.clone(),
        );
        reg.register(
            "engine_prompt_tokens_computed",
            "Prompt tokens run through the model",
            m.prompt_tokens_computed.clone(),
        );
        reg.register(
            "engine_prompt_tokens_loaded",
            "Prompt tokens whose KV was loaded from the pool",
            m.prompt_tokens_loaded.clone(),
        );
        reg.register(
            "engine_generated_tokens",
            "Tokens generated",
            m.generated_tokens.clone(),
        );
        reg.register(
            "engine_chunks_loaded",
            "KV chunks loaded from the pool and used",
            m.chunks_loaded.clone(),
        );
        reg.register(
            "engine_chunks_refused",
            "KV chunks read from the pool whose header or checksum did not match (recomputed)",
            m.chunks_refused.clone(),
        );
        reg.register(
            "engine_chunks_stored",
            "KV chunks stored in the pool",
            m.chunks_stored.clone(),
        );
        reg.register(
            "engine_chunks_store_failed",
            "KV objects (a chunk's layer groups) that could not be stored (logged; the request \
             went on)",
            m.chunks_store_failed.clone(),
        );
        reg.register(
            "engine_kv_load_seconds",
            "Time to look up and load a prompt's cached chunks (streamed: until the last group \
             arrived)",
            m.kv_load_seconds.clone(),
        );
        reg.register(
            "engine_kv_stream_wait_seconds",
            "Time a prefill piece waited for streamed KV groups of its loaded prefix (per piece \
             of a request loading one)",
            m.kv_stream_wait_seconds.clone(),
        );
        reg.register(
            "engine_prefill_seconds",
            "Time spent in prefill forward passes",
            m.prefill_seconds.clone(),
        );
        reg.register(
            "engine_decode_seconds",
            "Time spent in decode steps",
            m.decode_seconds.clone(),
        );
        reg.register(
            "engine_prefill_tokens_per_second",
            "Prompt tokens per second of the last prefill piece",
            m.prefill_tokens_per_second.clone(),
        );
        reg.register(
            "engine_decode_tokens_per_second",
            "Tokens per second of the last decode step (all running sequences)",
            m.decode_tokens_per_second.clone(),
        );
        reg.register(
            "engine_running_sequences",
            "Sequences being prefilled or decoded",
            m.running.clone(),
        );
        reg.register(
            "engine_waiting_sequences",
            "Requests admitted and waiting to run",
            m.waiting.clone(),
        );
        m
    }

    /// The same handles under vLLM's names, labelled `model_name` as vLLM
    /// labels them, so dashboards and tools written for vLLM read ours.
    pub fn register_vllm_names(&self, reg: &MetricsRegistry, model: &str) {
        reg.register_for_model(
            model,
            "vllm:num_requests_running",
            "Requests running (vLLM's name for kvpool_engine_running_sequences)",
            self.running.clone(),
        );
        reg.register_for_model(
            model,
            "vllm:num_requests_waiting",
            "Requests waiting (vLLM's name for kvpool_engine_waiting_sequences)",
            self.waiting.clone(),
        );
        reg.register_for_model(
            model,
            "vllm:prompt_tokens",
            "Prompt tokens (vLLM's name for kvpool_engine_prompt_tokens)",
            self.prompt_tokens.clone(),
        );
        reg.register_for_model(
            model,
            "vllm:generation_tokens",
            "Generated tokens (vLLM's name for kvpool_engine_generated_tokens)",
            self.generated_tokens.clone(),
        );
        reg.register_for_model(
            model,
            "vllm:time_to_first_token_seconds",
            "Time to first token (vLLM's name for kvpool_engine_time_to_first_token_seconds)",
            self.time_to_first_token.clone(),
        );
        reg.register_for_model(
            model,
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency (vLLM's name for kvpool_engine_e2e_request_latency_seconds)",
            self.e2e_latency.clone(),
        );
    }
}
