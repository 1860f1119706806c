//! The prefill and decode proxies: one per engine, in front of it, the way
//! vLLM's disaggregated proxy drives its instances.
//!
//! ```text
//!  conductor --POST /v1/completions--> PrefillProxy --max_tokens 1, stream false,--> prefill engine
//!            <-- answer with kv_transfer_params --    kv_transfer_params {do_remote_decode}
//!  conductor --same request + those params--> DecodeProxy --stream true,--> decode engine
//!            <====== SSE, relayed event by event ======    return_token_ids
//! ```
//!
//! Each proxy is a ractor actor ([`PrefillProxy`], [`DecodeProxy`]) that
//! owns what it knows of its engine: the requests in flight through it
//! (prompt tokens, the prefill time the conductor predicted, tokens
//! streamed so far), the engine's health (a probe of `GET /health`,
//! `/metrics` and `/v1/models` every `probe_interval_ms`; a refused
//! connection or a stream that breaks marks it down at once, the next
//! good probe brings it back), and the engine's model and KV naming (from
//! `/v1/models`). The HTTP exchanges themselves run in tasks the actor
//! spawns, so the actor only keeps books; the tasks tell it when they end.
//! Its report ([`ProxyReport`], `GET /v1/load`) is what the conductor's
//! scheduler sees of the instance.
//!
//! It speaks to its engine only through the engine's HTTP API (the
//! OpenAI-compatible routes, `/tokenize`, `/health`, `/metrics`,
//! `/v1/models`), so it fronts our engine or a vLLM instance with a KV
//! connector alike.
//!
//! A decode stream whose engine fails under it (the connection breaks, or
//! the body ends without `[DONE]`) ends with an error event of type
//! [`api::ENGINE_FAILED`] and then `[DONE]`,
//! never by being cut: the conductor continues such a stream on another
//! engine or passes the error on.
//!
//! Bounds: the actor's mailbox ([`MailboxGate`], `mailbox_bound`), requests
//! in flight (`max_in_flight`, then 503), one stream's events (a channel of
//! [`STREAM_EVENTS`]), bodies (`max_body_bytes`), every exchange under the
//! request's deadline.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvpool_conductor::mailbox::{GateError, MailboxGate};
use kvpool_config::ProxyConfig;
use kvpool_runtime::metrics::MetricsRegistry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::api::{self, ApiError};
use crate::http::{self, HttpError};
use crate::sse;

/// Events of one decode stream buffered between the engine and the
/// conductor; a slow reader slows the proxy's reads from the engine (whose
/// own per-request buffer never blocks it).
pub const STREAM_EVENTS: usize = 64;

/// Largest non-streamed answer read from an engine.
pub const MAX_ANSWER_BYTES: usize = 16 << 20;

/// Which side of the disaggregated pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProxyRole {
    /// Runs prompts (max_tokens 1) and leaves their KV in the pool.
    Prefill,
    /// Loads the KV and streams the answer.
    Decode,
}

impl ProxyRole {
    /// `prefill` / `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyRole::Prefill => "prefill",
            ProxyRole::Decode => "decode",
        }
    }
}

pub use kvpool_http::openai::KvNaming;
use kvpool_http::openai::ModelList;

/// What a proxy learned of its engine from `/v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineInfo {
    /// The served model's name.
    pub model: String,
    /// Its context length, when the engine says.
    pub max_model_len: Option<u64>,
    /// Its KV naming, when it is a kvpool engine.
    pub kv: Option<KvNaming>,
}

/// A proxy's report on its engine (`GET /v1/load`): what the conductor's
/// scheduler sees of the instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProxyReport {
    /// Prefill or decode.
    pub role: ProxyRole,
    /// The engine's address.
    pub engine: String,
    /// Whether the engine answers.
    pub up: bool,
    /// Why it was last marked down, if it was.
    pub last_error: Option<String>,
    /// Requests in flight through this proxy.
    pub in_flight: usize,
    /// Prefill: requests waiting behind the oldest.
    pub queued_requests: usize,
    /// Prefill: predicted time to finish everything in flight, ms.
    pub queued_ms: f64,
    /// Decode: streams that have produced a token.
    pub active_seqs: usize,
    /// Decode: context tokens (prompt + generated) of those.
    pub active_tokens: u64,
    /// Decode: streams waiting for their first token.
    pub waiting_seqs: usize,
    /// Decode: prompt tokens of those.
    pub waiting_tokens: u64,
    /// The engine's own count of running sequences, from its /metrics
    /// (ours or vLLM's gauge), at the last probe.
    pub engine_running: Option<f64>,
    /// The engine's own count of waiting sequences.
    pub engine_waiting: Option<f64>,
    /// What `/v1/models` said.
    pub info: Option<EngineInfo>,
    /// Requests answered.
    pub served: u64,
    /// Requests whose engine failed under them.
    pub failed: u64,
}

/// Why a proxy could not serve a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    /// The engine is marked down (refused connections or failed probes).
    #[error("the engine at {engine} is down: {reason}")]
    EngineDown {
        /// Its address.
        engine: String,
        /// Why.
        reason: String,
    },
    /// The engine failed during the exchange.
    #[error("the engine failed: {0}")]
    EngineFailed(HttpError),
    /// `max_in_flight` requests or `mailbox_bound` messages already.
    #[error("the proxy is busy: {0}")]
    Busy(String),
    /// No answer from the actor in time.
    #[error("the proxy did not answer: {0}")]
    Actor(String),
    /// This proxy does not serve that role.
    #[error("this is a {0} proxy")]
    WrongRole(&'static str),
}

impl ProxyError {
    /// The HTTP error a proxy answers with.
    pub fn api(&self) -> ApiError {
        match self {
            ProxyError::EngineDown { .. } => {
                ApiError::new(StatusCode::BAD_GATEWAY, "server_error", self.to_string())
                    .with_code("engine_down")
            }
            ProxyError::EngineFailed(HttpError::Timeout { .. }) => ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "server_error",
                self.to_string(),
            )
            .with_code(api::ENGINE_FAILED),
            ProxyError::EngineFailed(_) => {
                ApiError::new(StatusCode::BAD_GATEWAY, "server_error", self.to_string())
                    .with_code(api::ENGINE_FAILED)
            }
            ProxyError::Busy(_) | ProxyError::Actor(_) => {
                ApiError::unavailable(self.to_string(), "proxy_busy", 1)
            }
            ProxyError::WrongRole(_) => ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                self.to_string(),
            ),
        }
    }
}

impl From<GateError> for ProxyError {
    fn from(e: GateError) -> Self {
        match e {
            GateError::Full { bound } => {
                ProxyError::Busy(format!("{bound} messages already waiting"))
            }
            other => ProxyError::Actor(other.to_string()),
        }
    }
}

/// An engine's answer, read whole.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// Its status.
    pub status: StatusCode,
    /// Its body.
    pub body: Bytes,
}

/// A decode answer: a stream of SSE bytes (events relayed, the last one
/// `[DONE]`), or the engine's refusal as it was.
#[derive(Debug)]
pub enum DecodeAnswer {
    /// The engine answered 200: its events, as they come.
    Stream(mpsc::Receiver<Bytes>),
    /// The engine answered something else.
    Refused(Upstream),
}

/// What a request through the proxy carries besides its body.
#[derive(Debug, Clone)]
pub struct RequestMeta {
    /// The route (`/v1/completions` or `/v1/chat/completions`).
    pub path: String,
    /// `X-Request-Id`.
    pub request_id: String,
    /// Prompt tokens, when the sender knows.
    pub prompt_tokens: Option<u64>,
    /// Prefill time the conductor predicted, ms.
    pub predicted_ms: Option<f64>,
}

/// Messages of the proxy actors.
#[derive(Debug)]
pub enum ProxyMsg {
    /// Prefill (prefill proxy): the request with `max_tokens: 1`, `stream:
    /// false`, `kv_transfer_params: {do_remote_decode: true}`; the reply is
    /// the engine's answer.
    Prefill {
        /// The client's request.
        body: Value,
        /// Route, id, sizes.
        meta: RequestMeta,
        /// Where the answer goes.
        reply: RpcReplyPort<Result<Upstream, ProxyError>>,
    },
    /// Decode (decode proxy): the request (with the prefill's
    /// `kv_transfer_params`) streamed; the reply comes once the engine's
    /// answer starts.
    Decode {
        /// The request.
        body: Value,
        /// Route, id, sizes.
        meta: RequestMeta,
        /// Where the answer goes.
        reply: RpcReplyPort<Result<DecodeAnswer, ProxyError>>,
    },
    /// Any other route of the engine, passed through (`/tokenize`,
    /// `/v1/models`).
    Forward {
        /// GET or POST.
        method: Method,
        /// Route.
        path: String,
        /// Body, for a POST.
        body: Option<Bytes>,
        /// Where the answer goes.
        reply: RpcReplyPort<Result<Upstream, ProxyError>>,
    },
    /// The proxy's report.
    Report {
        /// Where it goes.
        reply: RpcReplyPort<ProxyReport>,
    },
    /// Probe the engine now (the timer sends this).
    Probe,
    /// A probe's result.
    Probed(ProbeOutcome),
    /// A request's exchange ended.
    Finished {
        /// Its slot.
        slot: u64,
        /// How.
        outcome: Outcome,
    },
}

/// How a request's exchange with the engine ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The engine answered (any status).
    Answered {
        /// Time from sending to the end of the answer.
        elapsed: Duration,
    },
    /// The caller went away first.
    Abandoned,
    /// The engine failed under it.
    Failed(HttpError),
}

/// A probe's result.
#[derive(Debug, Clone)]
pub struct ProbeOutcome {
    /// `GET /health` answered 200.
    pub healthy: Result<(), String>,
    /// `/v1/models`, when asked and answered.
    pub info: Option<EngineInfo>,
    /// Running / waiting gauges from `/metrics`.
    pub gauges: Option<(Option<f64>, Option<f64>)>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    route: &'static str,
    result: &'static str,
}

/// The proxy's metrics (`kvpool_proxy_*`).
#[derive(Clone)]
struct ProxyMetrics {
    requests: Family<ResultLabel, Counter>,
    in_flight: Gauge,
    engine_up: Gauge,
    engine_failures: Counter,
    tokens_streamed: Counter,
}

impl ProxyMetrics {
    fn new(reg: &MetricsRegistry) -> Self {
        let m = Self {
            requests: Family::default(),
            in_flight: Gauge::default(),
            engine_up: Gauge::default(),
            engine_failures: Counter::default(),
            tokens_streamed: Counter::default(),
        };
        reg.register(
            "proxy_requests",
            "Requests through the proxy by route and result",
            m.requests.clone(),
        );
        reg.register(
            "proxy_in_flight",
            "Requests in flight to the engine",
            m.in_flight.clone(),
        );
        reg.register(
            "proxy_engine_up",
            "1 while the engine answers, 0 while it is marked down",
            m.engine_up.clone(),
        );
        reg.register(
            "proxy_engine_failures",
            "Exchanges the engine failed under (refused, broken, timed out)",
            m.engine_failures.clone(),
        );
        reg.register(
            "proxy_tokens_streamed",
            "Tokens relayed from the decode engine",
            m.tokens_streamed.clone(),
        );
        m
    }
}

/// Start arguments of a proxy actor.
#[derive(Clone)]
pub struct ProxyArgs {
    /// Its settings (engine address, deadlines, bounds).
    pub cfg: ProxyConfig,
    /// Where its metrics go.
    pub registry: MetricsRegistry,
    gate: MailboxGate,
}

/// One request in flight.
#[derive(Debug)]
struct Slot {
    started: Instant,
    prompt_tokens: Option<u64>,
    predicted_ms: Option<f64>,
    counters: Arc<StreamCounters>,
}

/// What a decode stream's task updates as tokens pass.
#[derive(Debug, Default)]
struct StreamCounters {
    first_token: AtomicBool,
    generated: AtomicU64,
}

/// State of a proxy actor.
pub struct ProxyState {
    role: ProxyRole,
    cfg: ProxyConfig,
    gate: MailboxGate,
    up: bool,
    fails_in_row: u32,
    last_error: Option<String>,
    info: Option<EngineInfo>,
    gauges: (Option<f64>, Option<f64>),
    probing: bool,
    probes: u64,
    slots: HashMap<u64, Slot>,
    next_slot: u64,
    /// Moving mean of prefill time per prompt token, ms, for requests that
    /// came without a prediction.
    ms_per_token: f64,
    served: u64,
    failed: u64,
    metrics: ProxyMetrics,
}

impl std::fmt::Debug for ProxyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyState")
            .field("role", &self.role)
            .field("engine", &self.cfg.engine)
            .field("up", &self.up)
            .field("in_flight", &self.slots.len())
            .finish_non_exhaustive()
    }
}

/// Our engine's and vLLM's names for the running / waiting gauges.
const RUNNING_GAUGES: [&str; 2] = [
    "kvpool_engine_running_sequences",
    "vllm:num_requests_running",
];
const WAITING_GAUGES: [&str; 2] = [
    "kvpool_engine_waiting_sequences",
    "vllm:num_requests_waiting",
];

/// The value of the first of `names` found in Prometheus text.
fn gauge(text: &str, names: &[&str]) -> Option<f64> {
    for line in text.lines() {
        for n in names {
            if let Some(rest) = line.strip_prefix(n) {
                // `name value` or `name{labels} value`.
                let rest = match rest.strip_prefix('{') {
                    Some(r) => r.split_once('}').map(|(_, v)| v)?,
                    None if rest.starts_with(' ') => rest,
                    None => continue,
                };
                if let Ok(v) = rest.trim().parse::<f64>() {
                    return Some(v);
                }
            }
        }
    }
    None
}

/// `EngineInfo` from a `/v1/models` answer (the first model).
fn engine_info(v: &Value) -> Option<EngineInfo> {
    let m = serde_json::from_value::<ModelList>(v.clone())
        .ok()?
        .data
        .into_iter()
        .next()?;
    Some(EngineInfo {
        model: m.id,
        max_model_len: m.max_model_len,
        kv: m.kvpool,
    })
}

/// The prefill request vLLM's proxy sends: one token, no stream, and the
/// KV left for a remote decode.
pub fn prefill_body(mut body: Value) -> Value {
    if let Some(o) = body.as_object_mut() {
        o.insert("max_tokens".into(), json!(1));
        if o.contains_key("max_completion_tokens") {
            o.insert("max_completion_tokens".into(), json!(1));
        }
        o.insert("stream".into(), json!(false));
        o.remove("stream_options");
        o.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true}),
        );
    }
    body
}

/// The decode request: streamed, with token ids (the conductor counts and,
/// after a failure, continues from them).
pub fn decode_body(mut body: Value) -> Value {
    if let Some(o) = body.as_object_mut() {
        o.insert("stream".into(), json!(true));
        o.insert("return_token_ids".into(), json!(true));
        o.remove("stream_options");
    }
    body
}

impl ProxyState {
    fn report(&self) -> ProxyReport {
        let now = Instant::now();
        let mut r = ProxyReport {
            role: self.role,
            engine: self.cfg.engine.clone(),
            up: self.up,
            last_error: self.last_error.clone(),
            in_flight: self.slots.len(),
            queued_requests: self.slots.len().saturating_sub(1),
            queued_ms: 0.0,
            active_seqs: 0,
            active_tokens: 0,
            waiting_seqs: 0,
            waiting_tokens: 0,
            engine_running: self.gauges.0,
            engine_waiting: self.gauges.1,
            info: self.info.clone(),
            served: self.served,
            failed: self.failed,
        };
        match self.role {
            ProxyRole::Prefill => {
                // The engine prefills in arrival order: the oldest request
                // has been running since it started, the rest wait.
                let oldest = self.slots.values().map(|s| s.started).min();
                let mut total = 0.0;
                for s in self.slots.values() {
                    let est = s
                        .predicted_ms
                        .unwrap_or_else(|| s.prompt_tokens.unwrap_or(0) as f64 * self.ms_per_token);
                    total += est;
                }
                if let Some(o) = oldest {
                    total -= now.duration_since(o).as_secs_f64() * 1000.0;
                }
                r.queued_ms = total.max(0.0);
            }
            ProxyRole::Decode => {
                for s in self.slots.values() {
                    let prompt = s.prompt_tokens.unwrap_or(0);
                    let generated = s.counters.generated.load(Ordering::Relaxed);
                    if s.counters.first_token.load(Ordering::Relaxed) {
                        r.active_seqs += 1;
                        r.active_tokens += prompt + generated;
                    } else {
                        r.waiting_seqs += 1;
                        r.waiting_tokens += prompt;
                    }
                }
            }
        }
        r
    }

    fn mark_down(&mut self, why: String) {
        if self.up {
            tracing::warn!(engine = %self.cfg.engine, "engine marked down: {why}");
        }
        self.up = false;
        self.last_error = Some(why);
        self.metrics.engine_up.set(0);
    }

    fn mark_up(&mut self) {
        if !self.up {
            tracing::info!(engine = %self.cfg.engine, "engine answers again");
        }
        self.up = true;
        self.fails_in_row = 0;
        self.metrics.engine_up.set(1);
    }

    /// A slot for a new request, or why there is none.
    fn admit(&mut self, meta: &RequestMeta) -> Result<(u64, Arc<StreamCounters>), ProxyError> {
        if !self.up {
            return Err(ProxyError::EngineDown {
                engine: self.cfg.engine.clone(),
                reason: self
                    .last_error
                    .clone()
                    .unwrap_or_else(|| "not probed yet".into()),
            });
        }
        if self.slots.len() >= self.cfg.max_in_flight {
            return Err(ProxyError::Busy(format!(
                "{} requests already in flight to the engine",
                self.cfg.max_in_flight
            )));
        }
        self.next_slot += 1;
        let counters = Arc::new(StreamCounters::default());
        self.slots.insert(
            self.next_slot,
            Slot {
                started: Instant::now(),
                prompt_tokens: meta.prompt_tokens,
                predicted_ms: meta.predicted_ms,
                counters: counters.clone(),
            },
        );
        self.metrics.in_flight.set(self.slots.len() as i64);
        Ok((self.next_slot, counters))
    }

    fn finished(&mut self, slot: u64, outcome: Outcome) {
        let Some(s) = self.slots.remove(&slot) else {
            return;
        };
        self.metrics.in_flight.set(self.slots.len() as i64);
        match outcome {
            Outcome::Answered { elapsed } => {
                self.served += 1;
                if self.role == ProxyRole::Prefill {
                    if let Some(n) = s.prompt_tokens.filter(|&n| n > 0) {
                        let per = elapsed.as_secs_f64() * 1000.0 / n as f64;
                        self.ms_per_token = 0.8 * self.ms_per_token + 0.2 * per;
                    }
                }
            }
            Outcome::Abandoned => {}
            Outcome::Failed(e) => {
                self.failed += 1;
                self.metrics.engine_failures.inc();
                // A timeout may be a slow engine; a refused or broken
                // connection is a dead one.
                if !matches!(e, HttpError::Timeout { .. }) {
                    self.mark_down(e.to_string());
                }
            }
        }
    }

    fn probed(&mut self, p: ProbeOutcome) {
        self.probing = false;
        match p.healthy {
            Ok(()) => self.mark_up(),
            Err(why) => {
                self.fails_in_row += 1;
                if self.fails_in_row >= self.cfg.probe_failures || why.starts_with("cannot connect")
                {
                    self.mark_down(format!("health probe: {why}"));
                }
            }
        }
        if let Some(info) = p.info {
            self.info = Some(info);
        }
        if let Some(g) = p.gauges {
            self.gauges = g;
        }
    }
}

/// Probes `engine`: health always, `/metrics` always, `/v1/models` when
/// `models` (its answer changes only with a restart).
async fn probe(engine: String, timeout: Duration, models: bool) -> ProbeOutcome {
    let healthy = match http::get(&engine, "/health", 4096, timeout).await {
        Ok((s, _)) if s.is_success() => Ok(()),
        Ok((s, _)) => Err(format!("GET /health answered {s}")),
        Err(e) => Err(e.to_string()),
    };
    if healthy.is_err() {
        return ProbeOutcome {
            healthy,
            info: None,
            gauges: None,
        };
    }
    let gauges = match http::get(&engine, "/metrics", 4 << 20, timeout).await {
        Ok((s, b)) if s.is_success() => {
            let t = String::from_utf8_lossy(&b);
            Some((gauge(&t, &RUNNING_GAUGES), gauge(&t, &WAITING_GAUGES)))
        }
        _ => None,
    };
    let info = if models {
        match http::get(&engine, "/v1/models", 1 << 20, timeout).await {
            Ok((s, b)) if s.is_success() => serde_json::from_slice::<Value>(&b)
                .ok()
                .and_then(|v| engine_info(&v)),
            _ => None,
        }
    } else {
        None
    };
    ProbeOutcome {
        healthy,
        info,
        gauges,
    }
}

/// The prefill proxy actor.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillProxy;

/// The decode proxy actor.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecodeProxy;

async fn start(
    role: ProxyRole,
    myself: ActorRef<ProxyMsg>,
    args: ProxyArgs,
) -> Result<ProxyState, ActorProcessingErr> {
    let metrics = ProxyMetrics::new(&args.registry);
    // The timer: a probe every probe_interval_ms, through the gate (a full
    // mailbox skips one), until the actor is gone.
    let every = Duration::from_millis(args.cfg.probe_interval_ms);
    let gate = args.gate.clone();
    let me = myself.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match gate.cast(&me, ProxyMsg::Probe) {
                Ok(()) | Err(GateError::Full { .. }) => {}
                Err(_) => return,
            }
        }
    });
    Ok(ProxyState {
        role,
        gate: args.gate,
        // Up until something says otherwise: the first probe runs at once.
        up: true,
        fails_in_row: 0,
        last_error: None,
        info: None,
        gauges: (None, None),
        probing: false,
        probes: 0,
        slots: HashMap::new(),
        next_slot: 0,
        ms_per_token: 0.5,
        served: 0,
        failed: 0,
        metrics,
        cfg: args.cfg,
    })
}

async fn handle(
    role: ProxyRole,
    myself: ActorRef<ProxyMsg>,
    msg: ProxyMsg,
    state: &mut ProxyState,
) -> Result<(), ActorProcessingErr> {
    state.gate.handled();
    let connect = Duration::from_millis(state.cfg.connect_timeout_ms);
    let deadline = Instant::now() + Duration::from_millis(state.cfg.request_timeout_ms);
    let engine = state.cfg.engine.clone();
    match msg {
        ProxyMsg::Prefill { body, meta, reply } => {
            let Some((slot, _, reply)) = begin(state, role, ProxyRole::Prefill, &meta, reply)
            else {
                return Ok(());
            };
            let m = state.metrics.clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                let body = Bytes::from(prefill_body(body).to_string());
                let headers = [(api::REQUEST_ID, meta.request_id.as_str())];
                let call = exchange(
                    &engine,
                    Method::POST,
                    &meta.path,
                    &headers,
                    Some(body),
                    (connect, deadline),
                );
                // A caller that goes away (its client left the front) ends
                // the engine call: dropping it closes the engine's
                // connection, and the engine drops the sequence.
                let gone = async {
                    while !reply.is_closed() {
                        tokio::time::sleep(CALLER_POLL).await;
                    }
                };
                let r = tokio::select! {
                    r = call => r,
                    () = gone => {
                        m.requests
                            .get_or_create(&ResultLabel { route: "prefill", result: "abandoned" })
                            .inc();
                        let _ = myself.cast(ProxyMsg::Finished { slot, outcome: Outcome::Abandoned });
                        return;
                    }
                };
                let outcome = match &r {
                    Ok(_) => Outcome::Answered {
                        elapsed: t0.elapsed(),
                    },
                    Err(e) => Outcome::Failed(e.clone()),
                };
                let result = if r.is_ok() { "ok" } else { "engine_failed" };
                m.requests
                    .get_or_create(&ResultLabel {
                        route: "prefill",
                        result,
                    })
                    .inc();
                let _ = reply.send(r.map_err(ProxyError::EngineFailed));
                // Not through the gate: every admitted request must be
                // booked out, and there are at most max_in_flight of them.
                let _ = myself.cast(ProxyMsg::Finished { slot, outcome });
            });
        }
        ProxyMsg::Decode { body, meta, reply } => {
            let Some((slot, counters, reply)) = begin(state, role, ProxyRole::Decode, &meta, reply)
            else {
                return Ok(());
            };
            let m = state.metrics.clone();
            tokio::spawn(async move {
                let outcome =
                    relay_decode(engine, body, meta, connect, deadline, reply, counters, &m).await;
                let _ = myself.cast(ProxyMsg::Finished { slot, outcome });
            });
        }
        ProxyMsg::Forward {
            method,
            path,
            body,
            reply,
        } => {
            tokio::spawn(async move {
                let r = exchange(&engine, method, &path, &[], body, (connect, deadline)).await;
                let _ = reply.send(r.map_err(ProxyError::EngineFailed));
            });
        }
        ProxyMsg::Report { reply } => {
            let _ = reply.send(state.report());
        }
        ProxyMsg::Probe => {
            if !state.probing {
                state.probing = true;
                state.probes += 1;
                // /v1/models until known, then every 20th probe.
                let models = state.info.is_none() || state.probes.is_multiple_of(20);
                let timeout = connect.max(Duration::from_millis(500));
                tokio::spawn(async move {
                    let p = probe(engine, timeout, models).await;
                    let _ = myself.cast(ProxyMsg::Probed(p));
                });
            }
        }
        ProxyMsg::Probed(p) => state.probed(p),
        ProxyMsg::Finished { slot, outcome } => state.finished(slot, outcome),
    }
    Ok(())
}

/// How often a prefill's engine call checks whether its caller is gone.
const CALLER_POLL: Duration = Duration::from_millis(50);

/// One request to the engine, its answer read whole; `limits` are the
/// connect timeout and the deadline.
async fn exchange(
    engine: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Bytes>,
    limits: (Duration, Instant),
) -> Result<Upstream, HttpError> {
    let a = http::send(engine, method, path, headers, body, limits.0, limits.1).await?;
    let status = a.status();
    Ok(Upstream {
        status,
        body: a.bytes(MAX_ANSWER_BYTES).await?,
    })
}

/// A slot for a request to a `role` proxy that needs `want`, or `None`
/// once `reply` has been told why not.
#[allow(clippy::type_complexity)]
fn begin<T>(
    state: &mut ProxyState,
    role: ProxyRole,
    want: ProxyRole,
    meta: &RequestMeta,
    reply: RpcReplyPort<Result<T, ProxyError>>,
) -> Option<(
    u64,
    Arc<StreamCounters>,
    RpcReplyPort<Result<T, ProxyError>>,
)> {
    let r = if role == want {
        state.admit(meta)
    } else {
        Err(ProxyError::WrongRole(role.as_str()))
    };
    match r {
        Ok((slot, counters)) => Some((slot, counters, reply)),
        Err(e) => {
            let _ = reply.send(Err(e));
            None
        }
    }
}

/// The error event that ends a stream whose engine failed, then `[DONE]`.
fn failed_events(why: &str) -> [Bytes; 2] {
    [
        sse::event(
            &json!({"error": {"message": why, "type": api::ENGINE_FAILED,
            "param": null, "code": 502}}),
        ),
        sse::done(),
    ]
}

/// Runs one decode exchange: sends the request, answers `reply` when the
/// engine's answer starts, then relays its events until `[DONE]`.
#[allow(clippy::too_many_arguments)]
async fn relay_decode(
    engine: String,
    body: Value,
    meta: RequestMeta,
    connect: Duration,
    deadline: Instant,
    reply: RpcReplyPort<Result<DecodeAnswer, ProxyError>>,
    counters: Arc<StreamCounters>,
    m: &ProxyMetrics,
) -> Outcome {
    let count = |result: &'static str| {
        m.requests
            .get_or_create(&ResultLabel {
                route: "decode",
                result,
            })
            .inc();
    };
    let t0 = Instant::now();
    let body = Bytes::from(decode_body(body).to_string());
    let headers = [(api::REQUEST_ID, meta.request_id.as_str())];
    let mut a = match http::send(
        &engine,
        Method::POST,
        &meta.path,
        &headers,
        Some(body),
        connect,
        deadline,
    )
    .await
    {
        Ok(a) => a,
        Err(e) => {
            count("engine_failed");
            let _ = reply.send(Err(ProxyError::EngineFailed(e.clone())));
            return Outcome::Failed(e);
        }
    };
    if a.status() != StatusCode::OK {
        let status = a.status();
        let r = a.bytes(MAX_ANSWER_BYTES).await;
        count("refused");
        return match r {
            Ok(body) => {
                let _ = reply.send(Ok(DecodeAnswer::Refused(Upstream { status, body })));
                Outcome::Answered {
                    elapsed: t0.elapsed(),
                }
            }
            Err(e) => {
                let _ = reply.send(Err(ProxyError::EngineFailed(e.clone())));
                Outcome::Failed(e)
            }
        };
    }
    let (tx, rx) = mpsc::channel(STREAM_EVENTS);
    if reply.send(Ok(DecodeAnswer::Stream(rx))).is_err() {
        return Outcome::Abandoned;
    }
    let mut reader = sse::Reader::new();
    let mut events = Vec::new();
    loop {
        let chunk = match a.chunk(None).await {
            Ok(Some(c)) => c,
            Ok(None) => {
                // The body ended without [DONE]: the engine went away.
                let e = HttpError::Broken {
                    addr: engine.clone(),
                    reason: "the stream ended without [DONE]".into(),
                };
                return fail_stream(&tx, e, &engine, &meta, deadline, count).await;
            }
            Err(e) => return fail_stream(&tx, e, &engine, &meta, deadline, count).await,
        };
        events.clear();
        if reader.feed(&chunk, &mut events).is_err() {
            let e = HttpError::Broken {
                addr: engine.clone(),
                reason: "an event longer than the limit".into(),
            };
            return fail_stream(&tx, e, &engine, &meta, deadline, count).await;
        }
        for ev in events.drain(..) {
            let (bytes, done) = match ev {
                sse::Event::Done => (sse::done(), true),
                sse::Event::Data(d) => {
                    if let Ok(v) = serde_json::from_str::<Value>(&d) {
                        let n = v["choices"][0]["token_ids"]
                            .as_array()
                            .map_or(0, |a| a.len() as u64);
                        if n > 0 {
                            counters.generated.fetch_add(n, Ordering::Relaxed);
                            counters.first_token.store(true, Ordering::Relaxed);
                            m.tokens_streamed.inc_by(n);
                        }
                    }
                    (Bytes::from(format!("data: {d}\n\n")), false)
                }
            };
            // A client that stops reading (its connection full) is given
            // up at the request's deadline, not waited for without end.
            if !matches!(
                tokio::time::timeout_at(deadline, tx.send(bytes)).await,
                Ok(Ok(()))
            ) {
                // The conductor went away: dropping the answer closes the
                // engine's connection and ends the sequence there.
                count("abandoned");
                return Outcome::Abandoned;
            }
            if done {
                count("ok");
                return Outcome::Answered {
                    elapsed: t0.elapsed(),
                };
            }
        }
    }
}

async fn fail_stream(
    tx: &mpsc::Sender<Bytes>,
    e: HttpError,
    engine: &str,
    meta: &RequestMeta,
    deadline: Instant,
    count: impl Fn(&'static str),
) -> Outcome {
    tracing::warn!(
        request_id = meta.request_id,
        engine,
        "decode stream failed: {e}"
    );
    count("engine_failed");
    for b in failed_events(&format!("the decode engine failed mid-stream: {e}")) {
        // Taken at once by a client that reads; one that does not is not
        // waited for past the deadline.
        if !matches!(
            tokio::time::timeout_at(deadline, tx.send(b)).await,
            Ok(Ok(()))
        ) {
            break;
        }
    }
    Outcome::Failed(e)
}

/// The two actors differ only in the role they serve.
macro_rules! proxy_actor {
    ($actor:ty, $role:expr) => {
        impl Actor for $actor {
            type Msg = ProxyMsg;
            type State = ProxyState;
            type Arguments = ProxyArgs;

            async fn pre_start(
                &self,
                myself: ActorRef<ProxyMsg>,
                args: ProxyArgs,
            ) -> Result<ProxyState, ActorProcessingErr> {
                start($role, myself, args).await
            }

            async fn handle(
                &self,
                myself: ActorRef<ProxyMsg>,
                msg: ProxyMsg,
                state: &mut ProxyState,
            ) -> Result<(), ActorProcessingErr> {
                handle($role, myself, msg, state).await
            }
        }
    };
}

proxy_actor!(PrefillProxy, ProxyRole::Prefill);
proxy_actor!(DecodeProxy, ProxyRole::Decode);

/// A bounded handle to a running proxy actor.
#[derive(Debug, Clone)]
pub struct ProxyHandle {
    actor: ActorRef<ProxyMsg>,
    gate: MailboxGate,
    role: ProxyRole,
    request_timeout: Duration,
}

impl ProxyHandle {
    /// Starts a [`PrefillProxy`] or [`DecodeProxy`] in front of
    /// `cfg.engine`, its metrics in `registry`.
    pub async fn spawn(
        role: ProxyRole,
        cfg: ProxyConfig,
        registry: &MetricsRegistry,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ProxyError> {
        let gate = MailboxGate::new(cfg.mailbox_bound);
        let request_timeout = Duration::from_millis(cfg.request_timeout_ms);
        let args = ProxyArgs {
            cfg,
            registry: registry.clone(),
            gate: gate.clone(),
        };
        let spawned = match role {
            ProxyRole::Prefill => Actor::spawn(None, PrefillProxy, args).await,
            ProxyRole::Decode => Actor::spawn(None, DecodeProxy, args).await,
        };
        let (actor, join) = spawned.map_err(|e| ProxyError::Actor(e.to_string()))?;
        Ok((
            Self {
                actor,
                gate,
                role,
                request_timeout,
            },
            join,
        ))
    }

    /// Prefill or decode.
    pub fn role(&self) -> ProxyRole {
        self.role
    }

    /// Runs the prefill of `body`.
    pub async fn prefill(&self, body: Value, meta: RequestMeta) -> Result<Upstream, ProxyError> {
        self.gate
            .call(
                &self.actor,
                |reply| ProxyMsg::Prefill { body, meta, reply },
                self.request_timeout,
            )
            .await?
    }

    /// Starts the decode of `body`.
    pub async fn decode(&self, body: Value, meta: RequestMeta) -> Result<DecodeAnswer, ProxyError> {
        self.gate
            .call(
                &self.actor,
                |reply| ProxyMsg::Decode { body, meta, reply },
                self.request_timeout,
            )
            .await?
    }

    /// Passes a request to another route of the engine.
    pub async fn forward(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<Upstream, ProxyError> {
        let path = path.to_string();
        self.gate
            .call(
                &self.actor,
                |reply| ProxyMsg::Forward {
                    method,
                    path,
                    body,
                    reply,
                },
                self.request_timeout,
            )
            .await?
    }

    /// The proxy's report.
    pub async fn report(&self) -> Result<ProxyReport, ProxyError> {
        Ok(self
            .gate
            .call(
                &self.actor,
                |reply| ProxyMsg::Report { reply },
                Duration::from_secs(5),
            )
            .await?)
    }

    /// Stops the actor.
    pub fn stop(&self) {
        self.actor.stop(None);
    }
}

#[derive(Clone)]
struct ProxyApp {
    proxy: ProxyHandle,
    registry: MetricsRegistry,
}

/// The proxy's HTTP routes: the two generation routes (prefill or decode,
/// by role), `/tokenize`, `/v1/models` and the tokenizer files passed through, `/v1/load` (the
/// report), `/healthz` (200 while the engine answers, 503 naming why not),
/// `/metrics`.
pub fn router(proxy: ProxyHandle, registry: MetricsRegistry, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/completions", post(generate))
        .route("/v1/chat/completions", post(generate))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route(TOKENIZER_JSON, get(tokenizer_file))
        .route(TOKENIZER_CONFIG, get(tokenizer_file))
        .route("/v1/load", get(load))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(ProxyApp { proxy, registry })
}

fn upstream_response(u: Upstream) -> Response {
    (
        u.status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        u.body,
    )
        .into_response()
}

async fn generate(
    State(app): State<ProxyApp>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let rid = api::request_id(&headers).unwrap_or_else(api::new_request_id);
    let r = async {
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad(format!("invalid body: {e}")))?;
        let num = |name: &str| {
            headers
                .get(name)
                .and_then(|h| h.to_str().ok())
                .and_then(|s| s.parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0)
        };
        let meta = RequestMeta {
            path: uri.path().to_string(),
            request_id: rid.clone(),
            prompt_tokens: num(api::PROMPT_TOKENS).map(|v| v as u64),
            predicted_ms: num(api::PREDICTED_PREFILL_MS),
        };
        Ok::<_, ApiError>(match app.proxy.role() {
            ProxyRole::Prefill => match app.proxy.prefill(v, meta).await {
                Ok(u) => upstream_response(u),
                Err(e) => e.api().into_response(),
            },
            ProxyRole::Decode => match app.proxy.decode(v, meta).await {
                Ok(DecodeAnswer::Stream(rx)) => {
                    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                        rx.recv()
                            .await
                            .map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
                    });
                    Response::builder()
                        .status(StatusCode::OK)
                        .header(axum::http::header::CONTENT_TYPE, "text/event-stream")
                        .header(axum::http::header::CACHE_CONTROL, "no-cache")
                        .body(Body::from_stream(stream))
                        .unwrap_or_else(|e| {
                            ApiError::new(
                                StatusCode::INTERNAL_SERVER_ERROR,
                                "server_error",
                                e.to_string(),
                            )
                            .into_response()
                        })
                }
                Ok(DecodeAnswer::Refused(u)) => upstream_response(u),
                Err(e) => e.api().into_response(),
            },
        })
    }
    .await;
    api::with_request_id(r.unwrap_or_else(IntoResponse::into_response), &rid)
}

async fn tokenize(State(app): State<ProxyApp>, body: Bytes) -> Response {
    match app
        .proxy
        .forward(Method::POST, "/tokenize", Some(body))
        .await
    {
        Ok(u) => upstream_response(u),
        Err(e) => e.api().into_response(),
    }
}

async fn models(State(app): State<ProxyApp>) -> Response {
    match app.proxy.forward(Method::GET, "/v1/models", None).await {
        Ok(u) => upstream_response(u),
        Err(e) => e.api().into_response(),
    }
}

/// Where an engine serves its tokenizer as a Hugging Face `tokenizer.json`
/// (`kvpool tokenizer` writes the same files); proxies and the front pass
/// both files on under the same paths.
pub const TOKENIZER_JSON: &str = "/kvpool/v1/tokenizer.json";
/// ... and the `tokenizer_config.json` that goes beside it.
pub const TOKENIZER_CONFIG: &str = "/kvpool/v1/tokenizer_config.json";

async fn tokenizer_file(State(app): State<ProxyApp>, uri: axum::http::Uri) -> Response {
    match app.proxy.forward(Method::GET, uri.path(), None).await {
        Ok(u) => upstream_response(u),
        Err(e) => e.api().into_response(),
    }
}

async fn load(State(app): State<ProxyApp>) -> Response {
    match app.proxy.report().await {
        Ok(r) => Json(r).into_response(),
        Err(e) => e.api().into_response(),
    }
}

async fn healthz(State(app): State<ProxyApp>) -> Response {
    match app.proxy.report().await {
        Ok(r) if r.up => (StatusCode::OK, "ok\n").into_response(),
        Ok(r) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "engine {} is down: {}\n",
                r.engine,
                r.last_error.unwrap_or_default()
            ),
        )
            .into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
    }
}

async fn metrics(State(app): State<ProxyApp>) -> Response {
    api::metrics_response(&app.registry)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_and_decode_bodies_are_vllms() {
        let client = json!({"model": "m", "prompt": "hi", "max_tokens": 50, "stream": true,
            "stream_options": {"include_usage": true}, "temperature": 0});
        let p = prefill_body(client.clone());
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none());
        assert_eq!(p["kv_transfer_params"], json!({"do_remote_decode": true}));
        assert_eq!(p["temperature"], 0);
        let chat = json!({"messages": [], "max_completion_tokens": 9});
        assert_eq!(prefill_body(chat)["max_completion_tokens"], 1);
        let d = decode_body(client);
        assert_eq!(d["stream"], true);
        assert_eq!(d["return_token_ids"], true);
        assert_eq!(d["max_tokens"], 50);
        assert!(d.get("stream_options").is_none());
    }

    #[test]
    fn gauges_are_read_from_ours_and_vllms_metrics() {
        let ours =
            "# HELP x\nkvpool_engine_running_sequences 3\nkvpool_engine_waiting_sequences 1\n";
        assert_eq!(gauge(ours, &RUNNING_GAUGES), Some(3.0));
        assert_eq!(gauge(ours, &WAITING_GAUGES), Some(1.0));
        let vllm = "vllm:num_requests_running{model_name=\"m\"} 2.0\n";
        assert_eq!(gauge(vllm, &RUNNING_GAUGES), Some(2.0));
        assert_eq!(gauge(vllm, &WAITING_GAUGES), None);
        assert_eq!(
            gauge("kvpool_engine_running_sequences_total 5\n", &RUNNING_GAUGES),
            None
        );
    }

    #[test]
    fn engine_info_reads_models_with_and_without_kv_naming() {
        let ours = json!({"data": [{"id": "builtin:tiny", "max_model_len": 32768,
            "kvpool": {"chunk_tokens": 256, "key_model": "m01", "key_format": "kv1", "pool": null}}]});
        let i = engine_info(&ours).unwrap();
        assert_eq!(i.model, "builtin:tiny");
        assert_eq!(i.kv.unwrap().chunk_tokens, 256);
        let vllm = json!({"data": [{"id": "meta-llama/Llama-3"}]});
        let i = engine_info(&vllm).unwrap();
        assert_eq!((i.max_model_len, i.kv), (None, None));
        assert!(engine_info(&json!({"data": []})).is_none());
    }
}
