//! The conductor's OpenAI-compatible front: the live scheduler in front of
//! the prefill and decode proxies.
//!
//! ```text
//!  client --POST /v1/(chat/)completions--> front
//!     1. admit (max_in_flight, else 503 + Retry-After)
//!     2. tokenize: token-id prompts as they are; text and messages through
//!        a prefill proxy's engine (POST /tokenize), so the tokens are the
//!        engine's own (chat template included)
//!     3. chunk hashes (engine.chunk_tokens), one batch exists on their pool
//!        keys -> how many leading chunks the pool holds
//!     4. Conductor::schedule (the simulator's Scheduler) -> (prefill, decode)
//!        or a rejection (503 + Retry-After, before any engine work)
//!     5. prefill proxy: max_tokens 1 -> kv_transfer_params
//!     6. decode proxy: the request + those params, streamed back event by
//!        event (or gathered, for stream: false)
//!  proxies' GET /v1/load every load_poll_ms -> load reports, up/down
//! ```
//!
//! Failover: a prefill whose proxy or engine fails (connection refused,
//! `engine_down`, `engine_failed`) marks that instance down and is
//! scheduled again (at most `max_failovers` times). A decode that fails
//! before its first event moves to the least loaded decode instance that is
//! up, with the same `kv_transfer_params` (the KV is in the pool). One that
//! fails mid-stream (the proxy's `engine_failed` event, a broken or silent
//! stream) is continued there: the prompt plus the tokens already sent
//! become a token-id prompt for the rest (the engine loads the prompt's
//! chunks from the pool and computes the tail). The client sees one
//! answer, or an error event and `[DONE]`: never a stream cut without one.
//!
//! `X-Request-Id` is taken from the request (or made), sent to the proxies
//! and engines, and returned; the answer's id is `cmpl-<it>`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvpool_client::Client;
use kvpool_conductor::actor::{
    ConductorArgs, ConductorHandle, InstanceKind, InstanceLoad, ScheduleRequest,
};
use kvpool_conductor::chunk_hash::{chunk_hashes, ChunkHash, StoreKey};
use kvpool_conductor::cost::CostModel;
use kvpool_conductor::scheduler::{Decision, Policy, Slo};
use kvpool_config::{ClientConfig, ConductorConfig};
use kvpool_runtime::metrics::{latency_histogram, MetricsRegistry};
use kvpool_runtime::Shutdown;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::api::{self, ApiError};
use crate::http::{self, Answer, HttpError};
use crate::proxy::{KvNaming, ProxyReport};
use crate::sse;
use crate::ServeError;
use kvpool_http::openai::{PrefillAnswer, POOL_PREFIX, PROMPT_TOKEN_IDS, RESUME};

mod routes;
use routes::*;

mod answer;
use answer::*;

mod decode;
use decode::*;

/// Deadline of one call to the conductor actor.
const ACTOR_TIMEOUT: Duration = Duration::from_secs(5);
/// Pieces buffered between a request's generation task and its answer.
const PIECES: usize = 64;
/// Longest wait at start for every proxy's first report.
const FIRST_POLL_WAIT: Duration = Duration::from_secs(5);

/// What the front is started with.
#[derive(Debug, Clone)]
pub struct FrontOptions {
    /// `[serving.conductor]`.
    pub cfg: ConductorConfig,
    /// Prefill proxies (`host:port`), in instance order.
    pub prefill: Vec<String>,
    /// Decode proxies, in instance order.
    pub decode: Vec<String>,
    /// The pool's master, for prefix lookups (`None`: no lookups).
    pub pool: Option<String>,
    /// The pool client's settings.
    pub client: ClientConfig,
    /// Tokens per KV chunk: the engines' `engine.chunk_tokens`.
    pub chunk_tokens: usize,
    /// The front's HTTP listener's limits (`[runtime] http_*`).
    pub http: kvpool_http::HttpLimits,
    /// `serving.api_key` ("" = open): the `/v1` routes then need
    /// `Authorization: Bearer <key>`.
    pub api_key: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteResult {
    route: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Phase {
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InstanceLabel {
    kind: &'static str,
    instance: String,
}

/// The front's metrics (`kvpool_conductor_*`).
#[derive(Clone)]
struct FrontMetrics {
    requests: Family<RouteResult, Counter>,
    rejected: Family<Reason, Counter>,
    failovers: Family<Phase, Counter>,
    in_flight: Gauge,
    clients_stalled: Counter,
    instance_up: Family<InstanceLabel, Gauge>,
    tokenize_seconds: Histogram,
    pool_lookup_seconds: Histogram,
    schedule_seconds: Histogram,
    first_token_seconds: Histogram,
}

impl FrontMetrics {
    fn new(reg: &MetricsRegistry) -> Self {
        let m = Self {
            requests: Family::default(),
            rejected: Family::default(),
            failovers: Family::default(),
            in_flight: Gauge::default(),
            clients_stalled: Counter::default(),
            instance_up: Family::default(),
            tokenize_seconds: latency_histogram(),
            pool_lookup_seconds: latency_histogram(),
            schedule_seconds: latency_histogram(),
            first_token_seconds: latency_histogram(),
        };
        reg.register(
            "conductor_requests",
            "Generation requests by route and result (ok, rejected, client_error, error)",
            m.requests.clone(),
        );
        reg.register(
            "conductor_rejected",
            "Requests refused before any engine work, by reason",
            m.rejected.clone(),
        );
        reg.register(
            "conductor_failovers",
            "Requests moved to another engine after one failed, by phase",
            m.failovers.clone(),
        );
        reg.register(
            "conductor_in_flight",
            "Requests being served",
            m.in_flight.clone(),
        );
        reg.register(
            "conductor_clients_stalled",
            "Streamed answers dropped because the client took nothing for stall_timeout_ms",
            m.clients_stalled.clone(),
        );
        reg.register(
            "conductor_instance_up",
            "1 while an instance's proxy and engine answer",
            m.instance_up.clone(),
        );
        reg.register(
            "conductor_tokenize_seconds",
            "Tokenizing a prompt through an engine",
            m.tokenize_seconds.clone(),
        );
        reg.register(
            "conductor_pool_lookup_seconds",
            "One batch exists on a prompt's chunk keys",
            m.pool_lookup_seconds.clone(),
        );
        reg.register(
            "conductor_schedule_seconds",
            "A scheduling decision, the actor's round trip included",
            m.schedule_seconds.clone(),
        );
        reg.register(
            "conductor_first_token_seconds",
            "Arrival to the first token sent to the client",
            m.first_token_seconds.clone(),
        );
        m
    }
}

/// The conductor's link to one proxy.
struct Link {
    kind: InstanceKind,
    index: usize,
    addr: String,
    state: Mutex<LinkState>,
}

#[derive(Default)]
struct LinkState {
    up: bool,
    polled: bool,
    report: Option<ProxyReport>,
    error: Option<String>,
}

/// A link as `/kvpool/v1/status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct LinkStatus {
    /// The proxy.
    pub addr: String,
    /// Whether the scheduler may use it.
    pub up: bool,
    /// Why not, if it may not.
    pub error: Option<String>,
    /// Its last report.
    pub report: Option<ProxyReport>,
}

impl Link {
    fn kind_str(&self) -> &'static str {
        match self.kind {
            InstanceKind::Prefill => "prefill",
            InstanceKind::Decode => "decode",
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn up(&self) -> bool {
        self.lock().up
    }
}

/// A running front.
#[derive(Clone)]
pub struct Front {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: ConductorConfig,
    conductor: ConductorHandle,
    prefill: Vec<Arc<Link>>,
    decode: Vec<Arc<Link>>,
    pool: Arc<OnceLock<Client>>,
    chunk_tokens: usize,
    admission: Arc<Semaphore>,
    metrics: FrontMetrics,
    registry: MetricsRegistry,
    tokenize_next: AtomicUsize,
    connect_timeout: Duration,
    api_key: String,
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The scheduler's policy, cost model and SLOs from `[serving.conductor]`.
pub fn scheduler_settings(
    cfg: &ConductorConfig,
    chunk_tokens: usize,
) -> Result<(Policy, CostModel, Slo), ServeError> {
    let policy: Policy = cfg
        .policy
        .parse()
        .map_err(|e| ServeError::Config(format!("key `serving.conductor.policy`: {e}")))?;
    let mut cost = if cfg.cost_model.is_empty() {
        CostModel::default()
    } else {
        CostModel::load(std::path::Path::new(&cfg.cost_model))
            .map_err(|e| ServeError::Config(format!("key `serving.conductor.cost_model`: {e}")))?
    };
    // The scheduler counts blocks of the engines' chunk size.
    cost.block_tokens = u32::try_from(chunk_tokens)
        .map_err(|_| ServeError::Config("key `engine.chunk_tokens`: too large".into()))?;
    cost.validate()
        .map_err(|e| ServeError::Config(format!("key `serving.conductor.cost_model`: {e}")))?;
    let slo = Slo {
        ttft_ms: cfg.ttft_slo_ms,
        tbt_ms: cfg.tbt_slo_ms,
    };
    Ok((policy, cost, slo))
}

impl Front {
    /// Starts the conductor actor, the pool client (in the background), and
    /// a poller per proxy; waits (at most 5 s) for every proxy's first
    /// report, so that a request sent once this returns finds them.
    pub async fn start(
        opts: FrontOptions,
        registry: &MetricsRegistry,
        shutdown: Shutdown,
    ) -> Result<Self, ServeError> {
        let cfg = opts.cfg;
        if opts.prefill.is_empty() || opts.decode.is_empty() {
            return Err(ServeError::Config(
                "keys `serving.conductor.prefill` and `serving.conductor.decode`: the conductor needs at least one prefill and one decode proxy".into(),
            ));
        }
        let (policy, cost, slo) = scheduler_settings(&cfg, opts.chunk_tokens)?;
        let mut args = ConductorArgs::new(policy, cost, slo, opts.prefill.len(), opts.decode.len());
        args.seed = cfg.seed;
        if !cfg.decision_log.is_empty() {
            args.decision_log = Some(cfg.decision_log.clone().into());
        }
        let (conductor, _join) = ConductorHandle::spawn(args)
            .await
            .map_err(|e| ServeError::Start(e.to_string()))?;
        let links = |kind, addrs: &[String]| -> Vec<Arc<Link>> {
            addrs
                .iter()
                .enumerate()
                .map(|(index, a)| {
                    Arc::new(Link {
                        kind,
                        index,
                        addr: http::host_port(a).to_string(),
                        state: Mutex::new(LinkState::default()),
                    })
                })
                .collect()
        };
        let metrics = FrontMetrics::new(registry);
        let inner = Arc::new(Inner {
            prefill: links(InstanceKind::Prefill, &opts.prefill),
            decode: links(InstanceKind::Decode, &opts.decode),
            conductor,
            pool: Arc::new(OnceLock::new()),
            chunk_tokens: opts.chunk_tokens,
            admission: Arc::new(Semaphore::new(cfg.max_in_flight)),
            metrics,
            registry: registry.clone(),
            tokenize_next: AtomicUsize::new(0),
            connect_timeout: Duration::from_secs(2),
            api_key: opts.api_key.clone(),
            cfg,
        });
        // Nothing is up until its proxy has reported.
        for l in inner.prefill.iter().chain(&inner.decode) {
            let _ = inner.conductor.set_available(l.kind, l.index, false);
            tokio::spawn(poll_link(inner.clone(), l.clone(), shutdown.clone()));
        }
        if let Some(master) = opts.pool {
            tokio::spawn(connect_pool(
                master,
                opts.client,
                inner.pool.clone(),
                shutdown.clone(),
            ));
        }
        // Ready once every proxy has answered (or failed) a poll and each
        // that is up has named its engine's model and KV naming (learnt on
        // the proxy's first probe): the first requests then get the
        // answer's model, `/v1/models` and pool lookups like later ones.
        let end = Instant::now() + FIRST_POLL_WAIT;
        let known = |l: &Link| {
            let s = l.lock();
            s.polled && (!s.up || s.report.as_ref().is_some_and(|r| r.info.is_some()))
        };
        while Instant::now() < end && !inner.prefill.iter().chain(&inner.decode).all(|l| known(l)) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(Self { inner })
    }

    /// The HTTP routes: `POST /v1/completions`, `POST /v1/chat/completions`,
    /// `GET /v1/models`, `GET /health` (vLLM's name, what probes and load
    /// generators ask) and `/healthz`, `GET /metrics`, `GET
    /// /kvpool/v1/status`; any other path is 404, a wrong method 405, both
    /// with OpenAI error bodies.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route(crate::proxy::TOKENIZER_JSON, get(tokenizer_file))
            .route(crate::proxy::TOKENIZER_CONFIG, get(tokenizer_file))
            .route("/health", get(healthz))
            .route("/healthz", get(healthz))
            .route("/metrics", get(metrics_route))
            .route("/kvpool/v1/status", get(status))
            .fallback(crate::api::no_route)
            .method_not_allowed_fallback(crate::api::wrong_method)
            .layer(DefaultBodyLimit::max(
                self.inner.cfg.max_body_bytes.get() as usize
            ))
            .with_state(self.clone())
    }

    /// The conductor actor's handle.
    pub fn conductor(&self) -> &ConductorHandle {
        &self.inner.conductor
    }
}

/// Connects the pool client, retrying with backoff (0.5 s doubling to
/// 30 s) until the pool answers; prefix lookups start then.
async fn connect_pool(
    master: String,
    cfg: ClientConfig,
    slot: Arc<OnceLock<Client>>,
    shutdown: Shutdown,
) {
    let mut wait = Duration::from_millis(500);
    loop {
        match Client::connect(&master, cfg.clone()).await {
            Ok(c) => {
                let _ = slot.set(c);
                tracing::info!("conductor: reached the pool at {master}");
                return;
            }
            Err(e) => tracing::warn!("conductor: pool at {master} unreachable ({e}); retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.wait() => return,
        }
        wait = (wait * 2).min(Duration::from_secs(30));
    }
}

/// Fetches a proxy's report every `load_poll_ms` and tells the conductor
/// its load and whether it is up.
async fn poll_link(inner: Arc<Inner>, link: Arc<Link>, shutdown: Shutdown) {
    let every = Duration::from_millis(inner.cfg.load_poll_ms);
    let timeout = (every * 5).max(Duration::from_secs(1));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait() => return,
        }
        let r = match http::get(&link.addr, "/v1/load", 1 << 20, timeout).await {
            Ok((s, body)) if s.is_success() => serde_json::from_slice::<ProxyReport>(&body)
                .map_err(|e| format!("GET /v1/load: {e}")),
            Ok((s, _)) => Err(format!("GET /v1/load answered {s}")),
            Err(e) => Err(e.to_string()),
        };
        let (up, error, report) = match r {
            Ok(rep) => {
                let want = match link.kind {
                    InstanceKind::Prefill => crate::proxy::ProxyRole::Prefill,
                    InstanceKind::Decode => crate::proxy::ProxyRole::Decode,
                };
                let naming = rep.info.as_ref().and_then(|i| i.kv.as_ref());
                let error = if rep.role != want {
                    Some(format!(
                        "{} is a {} proxy, configured as {}",
                        link.addr,
                        rep.role.as_str(),
                        want.as_str()
                    ))
                } else if let Some(n) = naming.filter(|n| n.chunk_tokens != inner.chunk_tokens) {
                    Some(format!(
                        "its engine's chunks hold {} tokens, the conductor's engine.chunk_tokens is {}",
                        n.chunk_tokens, inner.chunk_tokens
                    ))
                } else if !rep.up {
                    Some(format!(
                        "engine {} down: {}",
                        rep.engine,
                        rep.last_error.clone().unwrap_or_default()
                    ))
                } else {
                    None
                };
                let load = match link.kind {
                    InstanceKind::Prefill => InstanceLoad::Prefill {
                        queued_requests: rep.queued_requests,
                        queued_ms: rep.queued_ms,
                    },
                    InstanceKind::Decode => InstanceLoad::Decode {
                        active_seqs: rep.active_seqs,
                        active_tokens: rep.active_tokens,
                        waiting_seqs: rep.waiting_seqs,
                        waiting_tokens: rep.waiting_tokens,
                    },
                };
                let _ = inner.conductor.report_load(link.index, load);
                (error.is_none(), error, Some(rep))
            }
            Err(e) => (false, Some(e), None),
        };
        set_up(&inner, &link, up, error, report);
    }
}

/// Records whether `link` is up, telling the conductor when it changes.
fn set_up(
    inner: &Inner,
    link: &Link,
    up: bool,
    error: Option<String>,
    report: Option<ProxyReport>,
) {
    let changed = {
        let mut s = link.lock();
        let changed = !s.polled || s.up != up;
        s.up = up;
        s.polled = true;
        if up {
            s.error = None;
        } else if error.is_some() {
            s.error = error.clone();
        }
        if report.is_some() {
            s.report = report;
        }
        changed
    };
    if changed {
        if up {
            tracing::info!(
                "{} instance {} ({}) is up",
                link.kind_str(),
                link.index,
                link.addr
            );
        } else {
            tracing::warn!(
                "{} instance {} ({}) is down: {}",
                link.kind_str(),
                link.index,
                link.addr,
                error.unwrap_or_default()
            );
        }
        // Sent again on the next change if the mailbox is full now.
        if inner
            .conductor
            .set_available(link.kind, link.index, up)
            .is_err()
        {
            link.lock().polled = false;
        }
    }
    inner
        .metrics
        .instance_up
        .get_or_create(&InstanceLabel {
            kind: link.kind_str(),
            instance: link.index.to_string(),
        })
        .set(i64::from(up));
}

/// The length of a token-id `prompt` in a request body, counted without
/// building it: a 16 MiB body of ids is 8 M of them, 256 MiB as JSON
/// values, so a prompt longer than the model's context is refused before
/// that. `None` when the body has no list prompt (or is not a JSON object:
/// the full parse then says what is wrong).
fn token_prompt_len(body: &[u8]) -> Option<usize> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
    struct Count(Option<usize>);
    struct Counter;
    impl<'de> Visitor<'de> for Counter {
        type Value = Count;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a prompt")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Count, A::Error> {
            let mut n = 0;
            while seq.next_element::<IgnoredAny>()?.is_some() {
                n += 1;
            }
            Ok(Count(Some(n)))
        }
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Count, E> {
            Ok(Count(None))
        }
    }
    impl<'de> serde::Deserialize<'de> for Count {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(Counter)
        }
    }
    // Every "prompt" key is counted (JSON allows one twice; the full parse
    // keeps the last): the longest stands.
    struct Probe(Option<usize>);
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Probe;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Probe, A::Error> {
            let mut longest = None;
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if key == "prompt" {
                    let Count(n) = map.next_value()?;
                    longest = longest.max(n);
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(Probe(longest))
        }
    }
    impl<'de> serde::Deserialize<'de> for Probe {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_map(Keys)
        }
    }
    serde_json::from_slice::<Probe>(body).ok()?.0
}

/// A prompt of `n` tokens fits a context of `max` (with room for one
/// generated token), or the request is refused as the engine would.
fn check_context(n: usize, max: u64) -> Result<(), ApiError> {
    if n as u64 >= max {
        return Err(ApiError::bad(format!(
            "the prompt has {n} tokens; this model's context is {max} tokens"
        )));
    }
    Ok(())
}

/// A prompt of `n` tokens and `max_tokens` more fit a context of `max`, or
/// the request is refused before any work, in vLLM's words (a `max_tokens`
/// of 10^9 is refused here too).
fn check_total(n: usize, max_tokens: u64, max: u64) -> Result<(), ApiError> {
    let total = (n as u64).saturating_add(max_tokens);
    if total > max {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {max} tokens. However, you requested \
             {total} tokens ({n} in the messages, {max_tokens} in the completion). Please \
             reduce the length of the messages or completion."
        ))
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// Most sequences one request may ask for (`n`), as the engines allow.
const MAX_N: u64 = 16;

/// A parsed generation request.
#[derive(Clone)]
struct Req {
    body: Value,
    chat: bool,
    path: &'static str,
    stream: bool,
    include_usage: bool,
    want_ids: bool,
    /// `max_tokens`, as the engine will apply it (completions default 16).
    max_tokens: Option<u64>,
    /// A completion's `echo`: the prompt string the answer starts with
    /// (served here; engines get no `echo`, so the text the front relays
    /// and counts for a continuation is the generated text only).
    echo: Option<String>,
    /// Sequences asked for (`n`): one decode each, after one prefill.
    n: usize,
}

impl Req {
    fn parse(body: &[u8], chat: bool) -> Result<Self, ApiError> {
        let body: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad(format!("invalid body: {e}")))?;
        if !body.is_object() {
            return Err(ApiError::bad("the body must be a JSON object"));
        }
        let n = match body.get("n") {
            None | Some(Value::Null) => 1,
            Some(v) => match v.as_u64() {
                Some(n) if (1..=MAX_N).contains(&n) => n as usize,
                _ => return Err(ApiError::bad(format!("n must be from 1 to {MAX_N}"))),
            },
        };
        if chat {
            if body["messages"].as_array().is_none_or(|m| m.is_empty()) {
                return Err(ApiError::bad("messages must be a non-empty array"));
            }
        } else {
            match &body["prompt"] {
                Value::String(_) => {}
                Value::Array(a) if a.iter().all(|t| t.is_u64()) && !a.is_empty() => {}
                Value::Array(_) => {
                    return Err(ApiError::bad(
                        "prompt must be a string or one list of token ids (a batch of prompts is not supported)",
                    ))
                }
                _ => return Err(ApiError::bad("prompt must be a string or a list of token ids")),
            }
        }
        let echo = match body.get("echo") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) if chat => {
                return Err(ApiError::bad("`echo` is a completion field, not a chat one"))
            }
            Some(Value::Bool(true))
                if !matches!(&body["logprobs"], Value::Null | Value::Bool(false)) =>
            {
                return Err(ApiError::bad(
                    "`echo` with `logprobs` is not supported: the prompt's logprobs are not computed",
                ))
            }
            Some(Value::Bool(true)) => match &body["prompt"] {
                Value::String(p) => Some(p.clone()),
                _ => {
                    return Err(ApiError::bad(
                        "`echo` needs a string prompt here (a token-id prompt is not echoed)",
                    ))
                }
            },
            Some(_) => return Err(ApiError::bad("`echo` is true or false")),
        };
        let mut body = body;
        if let Some(o) = body.as_object_mut() {
            o.remove("echo");
            // Each decode generates one sequence.
            o.remove("n");
        }
        let max = |k: &str| body.get(k).and_then(Value::as_u64);
        let max_tokens = if chat {
            max("max_completion_tokens").or_else(|| max("max_tokens"))
        } else {
            Some(max("max_tokens").unwrap_or(16))
        };
        Ok(Self {
            chat,
            path: if chat {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            },
            stream: body["stream"].as_bool().unwrap_or(false),
            include_usage: body["stream_options"]["include_usage"]
                .as_bool()
                .unwrap_or(false),
            want_ids: body["return_token_ids"].as_bool().unwrap_or(false),
            max_tokens,
            echo,
            n,
            body,
        })
    }

    fn model(&self) -> Option<&str> {
        self.body["model"].as_str()
    }
}

/// Where a request stands while it is served.
#[derive(Clone)]
struct Served {
    rid: String,
    prompt: Vec<u32>,
    prefill: usize,
    decode: usize,
    cached_tokens: u64,
    computed_tokens: Option<u64>,
    failovers: u32,
    arrived: Instant,
    deadline: Instant,
    /// The `id` of the prefill engine's answer and of the (last) decode
    /// engine's first event: `cmpl-<X-Request-Id>` from engines that take
    /// the header (ours, vLLM).
    engine_ids: (Option<String>, Option<String>),
    /// The model the prefill engine's answer names (the proxies' reports
    /// may not have it yet just after start).
    model: Option<String>,
}

/// One step of a generation, from its task to the answer.
enum Piece {
    /// Text of sequence `index`, the token ids it came from and their
    /// logprobs (null when not asked for).
    Text {
        index: usize,
        text: String,
        ids: Vec<u32>,
        logprobs: Value,
    },
    /// The end of sequence `index`: a finish reason and its books, or an
    /// error.
    End {
        index: usize,
        result: Result<(String, Box<Served>), ApiError>,
    },
}

async fn completions(State(f): State<Front>, headers: HeaderMap, body: Bytes) -> Response {
    generate(f, headers, body, false).await
}

async fn chat_completions(State(f): State<Front>, headers: HeaderMap, body: Bytes) -> Response {
    generate(f, headers, body, true).await
}

/// With `serving.api_key` set, a `/v1` request must carry it as a bearer
/// token (compared in constant time): 401 in OpenAI's words otherwise.
fn check_api_key(f: &Front, headers: &HeaderMap) -> Result<(), ApiError> {
    let want = &f.inner.api_key;
    if want.is_empty() {
        return Ok(());
    }
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if kvpool_wire::auth::constant_time_eq(given.as_bytes(), want.as_bytes()) {
        return Ok(());
    }
    let message = if given.is_empty() {
        "You didn't provide an API key: send it as `Authorization: Bearer <key>`"
    } else {
        "Incorrect API key provided"
    };
    Err(
        ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
            .with_code("invalid_api_key"),
    )
}

/// A body the front reads as JSON must say so when it names a type: a form
/// or text body is 415, not parsed as JSON anyway. (No `Content-Type` is
/// taken as JSON.)
fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(ct) = headers.get(axum::http::header::CONTENT_TYPE) else {
        return Ok(());
    };
    let essence = ct
        .to_str()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if essence == "application/json" {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
        format!(
            "the body must be JSON (Content-Type: application/json), not {:?}",
            ct.to_str().unwrap_or("(not text)")
        ),
    ))
}

async fn generate(f: Front, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    let rid = api::request_id(&headers).unwrap_or_else(api::new_request_id);
    let route = if chat { "chat" } else { "completions" };
    let r = match check_api_key(&f, &headers).and_then(|()| check_content_type(&headers)) {
        Ok(()) => f.serve(&rid, &body, chat).await,
        Err(e) => Err(e),
    };
    let result = match &r {
        Ok(_) => "ok",
        Err(e) if e.status == StatusCode::SERVICE_UNAVAILABLE => "rejected",
        Err(e) if e.status.is_client_error() => "client_error",
        Err(_) => "error",
    };
    f.inner
        .metrics
        .requests
        .get_or_create(&RouteResult { route, result })
        .inc();
    let resp = r.unwrap_or_else(|mut e| {
        tracing::debug!(request_id = rid, "answered {}: {}", e.status, e.message);
        e.message = f.scrub(&e.message);
        e.into_response()
    });
    api::with_request_id(resp, &rid)
}

impl Front {
    /// `message` with every proxy's and engine's address replaced by the
    /// instance's name (`prefill instance 0`, `decode engine 1`): error
    /// answers go to clients, who have no business learning the cluster's
    /// inner addresses (the log keeps them).
    fn scrub(&self, message: &str) -> String {
        let mut names: Vec<(String, String)> = Vec::new();
        for (kind, links) in [
            ("prefill", &self.inner.prefill),
            ("decode", &self.inner.decode),
        ] {
            for (i, link) in links.iter().enumerate() {
                let engine = link.lock().report.as_ref().map(|r| r.engine.clone());
                if let Some(engine) = engine.filter(|e| !e.is_empty()) {
                    names.push((engine, format!("{kind} engine {i}")));
                }
                names.push((link.addr.clone(), format!("{kind} instance {i}")));
            }
        }
        // Longest first: one address may begin another ("h:80", "h:8000").
        names.sort_by_key(|(a, _)| std::cmp::Reverse(a.len()));
        let mut out = message.to_string();
        for (addr, name) in names {
            out = out.replace(&addr, &name);
        }
        out
    }

    fn reject(&self, message: String, code: &str) -> ApiError {
        self.inner
            .metrics
            .rejected
            .get_or_create(&Reason {
                reason: code.to_string(),
            })
            .inc();
        ApiError::unavailable(message, code, self.inner.cfg.retry_after_s)
    }

    /// The engines' context length in tokens (the first one reported).
    fn max_model_len(&self) -> Option<u64> {
        self.inner
            .prefill
            .iter()
            .chain(&self.inner.decode)
            .find_map(|l| l.lock().report.as_ref()?.info.as_ref()?.max_model_len)
    }

    /// The model name the engines serve (the first one reported).
    fn served_model(&self) -> Option<String> {
        self.inner
            .prefill
            .iter()
            .chain(&self.inner.decode)
            .find_map(|l| {
                l.lock()
                    .report
                    .as_ref()?
                    .info
                    .as_ref()
                    .map(|i| i.model.clone())
            })
    }

    /// The KV naming of the prefill engines, when they say.
    fn kv_naming(&self) -> Option<KvNaming> {
        self.inner.prefill.iter().find_map(|l| {
            let s = l.lock();
            let kv = s.report.as_ref()?.info.as_ref()?.kv.clone()?;
            (kv.chunk_tokens == self.inner.chunk_tokens).then_some(kv)
        })
    }

    fn mark_down(&self, link: &Link, why: String) {
        set_up(&self.inner, link, false, Some(why), None);
    }

    async fn serve(&self, rid: &str, body: &[u8], chat: bool) -> Result<Response, ApiError> {
        let arrived = Instant::now();
        let permit = self
            .inner
            .admission
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                self.reject(
                    format!(
                        "{} requests are already being served (serving.conductor.max_in_flight)",
                        self.inner.cfg.max_in_flight
                    ),
                    "queues_full",
                )
            })?;
        let max_len = self.max_model_len();
        let token_len = token_prompt_len(body);
        let token_prompt = token_len.is_some();
        if let (Some(n), Some(max)) = (token_len, max_len) {
            check_context(n, max)?;
        }
        let mut req = Req::parse(body, chat)?;
        if let (Some(want), Some(have)) = (req.model(), self.served_model()) {
            if want != have {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    format!("The model `{want}` does not exist."),
                )
                .with_code("model_not_found"));
            }
        }
        let deadline = arrived + Duration::from_millis(self.inner.cfg.request_timeout_ms);
        let prompt = self.tokenize(&req, rid, deadline).await?;
        // The engines take the tokens along instead of tokenizing the text
        // again. The front's own fields are not a client's to set: a
        // client's are not passed on.
        if let Some(fields) = req.body.as_object_mut() {
            fields.remove(PROMPT_TOKEN_IDS);
            fields.remove(RESUME);
            fields.remove(POOL_PREFIX);
            if !token_prompt {
                fields.insert(PROMPT_TOKEN_IDS.into(), json!(prompt));
            }
        }
        if let Some(max) = max_len {
            check_context(prompt.len(), max)?;
            if let Some(m) = req.max_tokens {
                check_total(prompt.len(), m, max)?;
            }
        }
        let chunks = chunk_hashes(&prompt, self.inner.chunk_tokens).map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            )
        })?;
        let pool_prefix = self.pool_prefix(&chunks).await;
        let mut served = Served {
            rid: rid.to_string(),
            prompt,
            prefill: 0,
            decode: 0,
            cached_tokens: 0,
            computed_tokens: None,
            failovers: 0,
            arrived,
            deadline,
            engine_ids: (None, None),
            model: None,
        };
        // The prefill engine reads the chunks this lookup found instead of
        // looking them up again; the decode engine is told its chunks by
        // `kv_transfer_params`, so its body goes without the count.
        let fields = req.body.as_object_mut();
        if let (Some(n), Some(fields)) = (pool_prefix, fields) {
            fields.insert(POOL_PREFIX.into(), json!(n));
        }
        let kv = self.prefill(&req, &chunks, pool_prefix, &mut served).await;
        if let Some(fields) = req.body.as_object_mut() {
            fields.remove(POOL_PREFIX);
        }
        let kv = kv?;
        // One decode per sequence, from the one prefill's KV; sequence i
        // samples with seed + i when a seed is given.
        let mut runs = Vec::with_capacity(req.n);
        for index in 0..req.n {
            let mut r = req.clone();
            if let Some(seed) = r.body.get("seed").and_then(Value::as_u64) {
                r.body["seed"] = json!(seed.wrapping_add(index as u64));
            }
            let mut sv = served.clone();
            let (answer, failed_over) = self.start_decode(&r, &kv, &mut sv).await?;
            if failed_over {
                self.count_failover("decode_start");
            }
            runs.push((r, sv, answer));
        }
        let model = runs[0]
            .1
            .model
            .clone()
            .or_else(|| self.served_model())
            .unwrap_or_default();
        let (tx, rx) = mpsc::channel(PIECES);
        // The admission place is held until the last sequence ends.
        let permit = Arc::new(permit);
        for (index, (r, sv, answer)) in runs.into_iter().enumerate() {
            let run = DecodeRun {
                front: self.clone(),
                index,
                req_body: r.body,
                chat: req.chat,
                max_tokens: req.max_tokens,
                served: sv,
                tx: tx.clone(),
            };
            tokio::spawn(run.pump(answer, permit.clone()));
        }
        drop(tx);
        if req.stream {
            Ok(stream_answer(rx, &req, rid, &model))
        } else {
            whole_answer(rx, &req, rid, &model).await
        }
    }

    fn count_failover(&self, phase: &'static str) {
        self.inner
            .metrics
            .failovers
            .get_or_create(&Phase { phase })
            .inc();
    }

    /// The prompt's tokens: as given, or from an engine's `/tokenize`
    /// through a prefill proxy that is up (the next one if it fails).
    async fn tokenize(
        &self,
        req: &Req,
        rid: &str,
        deadline: Instant,
    ) -> Result<Vec<u32>, ApiError> {
        if let Value::Array(a) = &req.body["prompt"] {
            return a
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| ApiError::bad("a prompt token id is not a u32"))
                })
                .collect();
        }
        let t0 = Instant::now();
        let mut ask = json!({});
        if req.chat {
            ask["messages"] = req.body["messages"].clone();
        } else {
            ask["prompt"] = req.body["prompt"].clone();
        }
        if let Some(m) = req.model() {
            ask["model"] = json!(m);
        }
        let ask = Bytes::from(ask.to_string());
        let links = &self.inner.prefill;
        let start = self.inner.tokenize_next.fetch_add(1, Ordering::Relaxed);
        let mut last = None;
        for k in 0..links.len() {
            let link = &links[(start + k) % links.len()];
            if !link.up() {
                continue;
            }
            let r = http::send(
                &link.addr,
                Method::POST,
                "/tokenize",
                &[(api::REQUEST_ID, rid)],
                Some(ask.clone()),
                self.inner.connect_timeout,
                deadline,
            )
            .await;
            let a = match r {
                Ok(a) => a,
                Err(e) => {
                    self.mark_down(link, e.to_string());
                    last = Some(e.to_string());
                    continue;
                }
            };
            let status = a.status();
            let body = match a.bytes(crate::proxy::MAX_ANSWER_BYTES).await {
                Ok(b) => b,
                Err(e) => {
                    last = Some(e.to_string());
                    continue;
                }
            };
            if status.is_client_error() {
                return Err(ApiError::from_upstream(status, &body, "the engine"));
            }
            if !status.is_success() {
                last = Some(format!("POST /tokenize answered {status}"));
                continue;
            }
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let tokens: Option<Vec<u32>> = v["tokens"].as_array().and_then(|a| {
                a.iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect()
            });
            match tokens {
                Some(t) if !t.is_empty() => {
                    self.inner
                        .metrics
                        .tokenize_seconds
                        .observe(t0.elapsed().as_secs_f64());
                    return Ok(t);
                }
                _ => last = Some("POST /tokenize answered no tokens".into()),
            }
        }
        Err(self.reject(
            format!(
                "no prefill engine could tokenize the prompt: {}",
                last.unwrap_or_else(|| "none is up".into())
            ),
            "no_instances",
        ))
    }

    /// Leading chunks of the prompt the pool holds: one batch exists on
    /// their keys. `None` without a pool or the engines' KV naming, or when
    /// the pool does not answer (the scheduler then uses its own mirror).
    async fn pool_prefix(&self, chunks: &[ChunkHash]) -> Option<usize> {
        let pool = self.inner.pool.get()?;
        let naming = self.kv_naming()?;
        if chunks.is_empty() {
            return Some(0);
        }
        let keys: Vec<String> = chunks
            .iter()
            .map(|h| {
                StoreKey::new(
                    &naming.key_model,
                    *h,
                    &naming.key_format,
                    naming.chunk_tokens as u32,
                )
                .map(|k| k.to_string())
            })
            .collect::<Result<_, _>>()
            .ok()?;
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let t0 = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(2), pool.batch_exists(&refs)).await;
        self.inner
            .metrics
            .pool_lookup_seconds
            .observe(t0.elapsed().as_secs_f64());
        match r {
            Ok(Ok(found)) => Some(found.iter().take_while(|r| matches!(r, Ok(true))).count()),
            Ok(Err(e)) => {
                tracing::debug!("pool lookup failed: {e}");
                None
            }
            Err(_) => None,
        }
    }

    /// Schedules the request and runs its prefill; a prefill instance that
    /// fails is marked down and the request scheduled again. Returns the
    /// `kv_transfer_params` for decode.
    async fn prefill(
        &self,
        req: &Req,
        chunks: &[ChunkHash],
        pool_prefix: Option<usize>,
        served: &mut Served,
    ) -> Result<Value, ApiError> {
        let id = rand::random::<u64>() >> 1;
        loop {
            let t0 = Instant::now();
            let decision = self
                .inner
                .conductor
                .schedule(
                    ScheduleRequest {
                        id,
                        input_tokens: served.prompt.len().min(u32::MAX as usize) as u32,
                        chunks: chunks.to_vec(),
                        pool_prefix_blocks: pool_prefix,
                    },
                    ACTOR_TIMEOUT,
                )
                .await
                .map_err(|e| self.reject(e.to_string(), "conductor_busy"))?;
            self.inner
                .metrics
                .schedule_seconds
                .observe(t0.elapsed().as_secs_f64());
            let (p, d, predicted) = match decision {
                Decision::Reject(r) => return Err(self.reject(r.to_string(), r.kind())),
                Decision::Route {
                    prefill,
                    decode,
                    predicted_prefill_ms,
                    ..
                } => (prefill, decode, predicted_prefill_ms),
            };
            served.prefill = p;
            served.decode = d;
            let link = &self.inner.prefill[p];
            let predicted = format!("{predicted:.3}");
            let tokens = served.prompt.len().to_string();
            let headers = [
                (api::REQUEST_ID, served.rid.as_str()),
                (api::PREDICTED_PREFILL_MS, predicted.as_str()),
                (api::PROMPT_TOKENS, tokens.as_str()),
            ];
            let r = http::send(
                &link.addr,
                Method::POST,
                req.path,
                &headers,
                Some(Bytes::from(req.body.to_string())),
                self.inner.connect_timeout,
                served.deadline,
            )
            .await;
            let failure = match r {
                Ok(a) => {
                    let status = a.status();
                    let body = a
                        .bytes(crate::proxy::MAX_ANSWER_BYTES)
                        .await
                        .map_err(|e| e.to_string());
                    match (status, body) {
                        (StatusCode::OK, Ok(body)) => {
                            let a: PrefillAnswer = serde_json::from_slice(&body).map_err(|e| {
                                ApiError::new(
                                    StatusCode::BAD_GATEWAY,
                                    "server_error",
                                    format!("the prefill answer is not a completion: {e}"),
                                )
                            })?;
                            served.cached_tokens = a.cached_tokens();
                            served.computed_tokens = a.kvpool.map(|k| k.prompt_tokens_computed);
                            served.engine_ids.0 = a.id;
                            served.model = a.model;
                            let Some(mut kv) = a.kv_transfer_params else {
                                return Ok(Value::Null);
                            };
                            kv.do_remote_prefill = true;
                            kv.do_remote_decode = false;
                            return Ok(serde_json::to_value(kv).unwrap_or(Value::Null));
                        }
                        (s, Ok(body)) if is_engine_failure(s, &body) => {
                            String::from_utf8_lossy(&body).into_owned()
                        }
                        (s, Ok(body)) => {
                            return Err(ApiError::from_upstream(s, &body, "the prefill engine"))
                        }
                        (_, Err(e)) => e,
                    }
                }
                Err(e) => e.to_string(),
            };
            self.mark_down(link, failure.clone());
            served.failovers += 1;
            if served.failovers > self.inner.cfg.max_failovers {
                return Err(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "server_error",
                    format!("prefill failed on every instance tried: {failure}"),
                ));
            }
            self.count_failover("prefill");
            tracing::warn!(
                request_id = served.rid,
                "prefill instance {p} failed ({failure}); scheduling again"
            );
        }
    }

    /// Starts the decode on the scheduled instance, moving to the least
    /// loaded one that is up when it fails before streaming. Returns the
    /// stream and whether it moved.
    async fn start_decode(
        &self,
        req: &Req,
        kv: &Value,
        served: &mut Served,
    ) -> Result<(Answer, bool), ApiError> {
        let mut body = req.body.clone();
        if kv.is_object() {
            body["kv_transfer_params"] = kv.clone();
        }
        let mut moved = false;
        loop {
            let link = &self.inner.decode[served.decode];
            match self.open_decode(link, req.path, &body, served).await {
                Ok(a) => return Ok((a, moved)),
                Err(DecodeOpen::Refused(e)) => return Err(e),
                Err(DecodeOpen::Failed(why)) => {
                    self.mark_down(link, why.clone());
                    served.failovers += 1;
                    let next = if served.failovers > self.inner.cfg.max_failovers {
                        None
                    } else {
                        self.pick_decode(served.prompt.len() as u64).await
                    };
                    match next {
                        Some(d) => {
                            tracing::warn!(
                                request_id = served.rid,
                                "decode instance {} failed ({why}); moving to {d}",
                                served.decode
                            );
                            served.decode = d;
                            moved = true;
                        }
                        None => {
                            return Err(ApiError::new(
                                StatusCode::BAD_GATEWAY,
                                "server_error",
                                format!("decode failed and no other decode instance is up: {why}"),
                            ))
                        }
                    }
                }
            }
        }
    }

    async fn pick_decode(&self, context_tokens: u64) -> Option<usize> {
        self.inner
            .conductor
            .pick_decode(context_tokens, ACTOR_TIMEOUT)
            .await
            .ok()
            .flatten()
    }

    async fn open_decode(
        &self,
        link: &Link,
        path: &str,
        body: &Value,
        served: &Served,
    ) -> Result<Answer, DecodeOpen> {
        let tokens = served.prompt.len().to_string();
        let headers = [
            (api::REQUEST_ID, served.rid.as_str()),
            (api::PROMPT_TOKENS, tokens.as_str()),
        ];
        let a = http::send(
            &link.addr,
            Method::POST,
            path,
            &headers,
            Some(Bytes::from(body.to_string())),
            self.inner.connect_timeout,
            served.deadline,
        )
        .await
        .map_err(|e| DecodeOpen::Failed(e.to_string()))?;
        if a.status() == StatusCode::OK {
            return Ok(a);
        }
        let status = a.status();
        let body = a
            .bytes(crate::proxy::MAX_ANSWER_BYTES)
            .await
            .map_err(|e| DecodeOpen::Failed(e.to_string()))?;
        if is_engine_failure(status, &body) {
            return Err(DecodeOpen::Failed(
                String::from_utf8_lossy(&body).into_owned(),
            ));
        }
        Err(DecodeOpen::Refused(ApiError::from_upstream(
            status,
            &body,
            "the decode engine",
        )))
    }
}

#[cfg(test)]
mod tests;
