//! `kvpool run --role engine`: the subset of vLLM's OpenAI-compatible HTTP
//! API that the prefill and decode proxies use.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/completions` | prompt (text or token ids) -> completion; `stream: true` sends SSE |
//! | `POST /v1/chat/completions` | messages -> assistant message; `stream: true` sends SSE |
//! | `GET /v1/models` | the served model |
//! | `POST /tokenize` | prompt (or messages) -> token ids |
//! | `GET /health`, `GET /healthz` | 200 while serving |
//! | `GET /metrics` | Prometheus text |
//!
//! `X-Request-Id` (1 to 128 visible ASCII characters) names a request as
//! vLLM does: the answer's `id` is `cmpl-<it>` (`chatcmpl-<it>`), the header
//! comes back with the answer, and the log lines name it. `/v1/models`
//! carries a `kvpool` object (`chunk_tokens`, `key_model`, `key_format`,
//! `pool`) from which a conductor names this engine's KV chunks in the pool
//! (`key_model@hash@key_format@chunk_tokens`).
//!
//! `kv_transfer_params` (vLLM's P/D fields): a request with
//! `do_remote_decode: true` is a prefill for another engine: its new chunks
//! are in the pool before the answer, which carries `do_remote_prefill: true`
//! with our fields `chunk_keys` (the prompt's leading chunks now in the pool),
//! `num_tokens`, `chunk_tokens` and `pool` (the master address). A request
//! with `do_remote_prefill: true` and those fields loads the named chunks
//! and computes only the rest of the prompt.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use kvpool_client::Client;
use kvpool_config::{EngineConfig, NodeConfig};
use kvpool_runtime::chunk_hash::{chunk_hashes, ChunkHash};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_wire::ErrorCode;
use prometheus_client::metrics::histogram::Histogram;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use crate::error::EngineError;
use crate::kv::{KvLayout, SeqKv};
use crate::loader::LoadedModel;
use crate::metrics::EngineMetrics;
use crate::pool::KvPool;
use crate::sampling::SamplingParams;
use crate::scheduler::{self, Event, Finish, LoopConfig, Request};
use crate::tokenizer::Tokenizer;

mod text;
use text::*;

/// What `kvpool run --role engine` was asked for.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// A model folder, `builtin:tiny` or `builtin:small`.
    pub model: String,
    /// HTTP listen address.
    pub listen: String,
    /// The pool's master; `None` runs without a pool.
    pub master: Option<String>,
    pub config: NodeConfig,
}

/// Loads the model, connects to the pool and serves until SIGINT/SIGTERM.
/// Prints `kvpool engine listening on HOST:PORT` once it serves.
///
/// A panic anywhere in the process aborts it (after the usual message):
/// the model thread dying would otherwise leave an engine that answers
/// `/health` but fails every request, and a handler task's panic would cut
/// its connection silently while the rest goes on.
pub fn run(opts: ServeOptions) -> Result<(), EngineError> {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
    opts.config.engine.validate().map_err(EngineError::Start)?;
    let threads = opts.config.runtime.actor_threads.max(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("kvpool-engine-io")
        .enable_all()
        .build()
        .map_err(|e| EngineError::Start(format!("cannot start the runtime: {e}")))?;
    let t0 = Instant::now();
    let model = crate::loader::load(&opts.model)?;
    let c = model.model.config();
    tracing::info!(
        "loaded {} ({} parameters, {} layers, fingerprint {:016x}) in {:?}",
        model.name,
        c.parameters(),
        c.num_hidden_layers,
        model.fingerprint,
        t0.elapsed()
    );
    rt.block_on(async move {
        let registry = MetricsRegistry::new();
        let engine = Engine::start(model, &opts.config, opts.master.as_deref(), &registry).await?;
        let listener = tokio::net::TcpListener::bind(&opts.listen)
            .await
            .map_err(|e| EngineError::Start(format!("cannot listen on {}: {e}", opts.listen)))?;
        let bound: SocketAddr = listener
            .local_addr()
            .map_err(|e| EngineError::Start(format!("listen address: {e}")))?;
        let app = engine.router(registry);
        println!("kvpool engine listening on {bound}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        kvpool_http::serve(listener, app, opts.config.runtime.http_limits(), async {
            match kvpool_runtime::wait_for_signal().await {
                Ok(sig) => tracing::info!("{sig}: stopping the engine"),
                Err(e) => tracing::error!("cannot wait for signals: {e}"),
            }
        })
        .await;
        Ok(())
    })
}

/// A running engine: the model thread, the store task and what the HTTP
/// handlers share.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    tokenizer: Tokenizer,
    layout: KvLayout,
    cfg: EngineConfig,
    max_model_len: usize,
    vocab_size: usize,
    eos: Vec<u32>,
    /// The pool client's deadline per call (bounds a streamed group's read).
    client_timeout_ms: u64,
    submit: flume::Sender<Request>,
    /// Requests in flight (see [`admit`]).
    admission: Arc<Semaphore>,
    /// The pool's master (`--master`), if any.
    master: Option<String>,
    /// The pool, once reached; empty while it is down (requests are then
    /// computed whole and nothing is stored).
    pool: Arc<OnceLock<Arc<KvPool>>>,
    metrics: EngineMetrics,
    ids: AtomicU64,
    created: u64,
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Engine {
    /// Starts the model thread and, with a `master`, the pool client and
    /// the store task. Must run inside a tokio runtime. A pool that cannot
    /// be reached does not stop the engine: it serves without it (computing
    /// every prompt whole) and keeps trying to connect in the background.
    pub async fn start(
        model: LoadedModel,
        node: &NodeConfig,
        master: Option<&str>,
        registry: &MetricsRegistry,
    ) -> Result<Self, EngineError> {
        let cfg = node.engine.clone();
        cfg.validate().map_err(EngineError::Start)?;
        let metrics = EngineMetrics::new(registry);
        let mc = model.model.config().clone();
        let layout = KvLayout {
            chunk_tokens: cfg.chunk_tokens,
            layers: mc.num_hidden_layers,
            kv_heads: mc.num_key_value_heads,
            head_dim: mc.head_dim(),
            fingerprint: model.fingerprint,
            group_layers: KvLayout::group_layers_for(mc.num_hidden_layers, cfg.kv_layer_groups),
        };
        layout.check().map_err(EngineError::Start)?;
        let max_model_len = match cfg.max_model_len {
            0 => mc.max_position_embeddings,
            n => n.min(mc.max_position_embeddings),
        };
        let pool = Arc::new(OnceLock::new());
        let store_tx = match master {
            Some(m) => {
                let first = match Client::connect(m, node.client_config()).await {
                    Ok(c) => Some(c),
                    // A refused configuration (e.g. RDMA required and absent)
                    // is a start-up error; an unreachable pool is not.
                    Err(e)
                        if matches!(
                            e.code,
                            ErrorCode::Unsupported
                                | ErrorCode::InvalidParams
                                | ErrorCode::Unauthenticated
                        ) =>
                    {
                        return Err(EngineError::Start(format!(
                            "cannot use the pool at {m}: {e}"
                        )));
                    }
                    Err(e) => {
                        tracing::warn!(
                            "cannot reach the pool at {m} ({e}): serving without it, computing \
                             every prompt, and retrying in the background"
                        );
                        None
                    }
                };
                let (tx, rx) = flume::bounded(cfg.store_queue_depth);
                match first {
                    // Published before the engine serves: its first request
                    // sees the pool (a spawned task might not have run yet).
                    Some(c) => {
                        let p = Arc::new(KvPool::new(c, m.to_string(), metrics.clone()));
                        let _ = pool.set(p.clone());
                        tokio::spawn(p.run_store(rx));
                    }
                    None => {
                        tokio::spawn(connect_and_store(
                            m.to_string(),
                            node.client_config(),
                            pool.clone(),
                            metrics.clone(),
                            rx,
                        ));
                    }
                }
                Some(tx)
            }
            None => {
                tracing::info!("no --master: the engine runs without a pool");
                None
            }
        };
        let (submit, rx) = flume::bounded(cfg.max_waiting);
        let loop_cfg = LoopConfig {
            chunk_tokens: cfg.chunk_tokens,
            max_num_seqs: cfg.max_num_seqs,
            stream_store: cfg.kv_stream,
        };
        let LoadedModel {
            name,
            model,
            tokenizer,
            ..
        } = model;
        metrics.register_vllm_names(registry, &name);
        let model = Arc::new(model);
        let m2 = metrics.clone();
        std::thread::Builder::new()
            .name("kvpool-engine".into())
            .spawn(move || scheduler::run(model, loop_cfg, rx, store_tx, m2))
            .map_err(|e| EngineError::Start(format!("cannot start the engine thread: {e}")))?;
        let admission = Arc::new(Semaphore::new(cfg.max_num_seqs + cfg.max_waiting));
        Ok(Self {
            inner: Arc::new(Inner {
                name,
                tokenizer,
                layout,
                cfg,
                max_model_len,
                vocab_size: mc.vocab_size,
                eos: mc.eos_token_ids.clone(),
                client_timeout_ms: node.client.timeout_ms,
                submit,
                admission,
                master: master.map(str::to_string),
                pool,
                metrics,
                ids: AtomicU64::new(1),
                created: now_s(),
            }),
        })
    }

    /// The HTTP routes, serving `registry` on `/metrics`. The POST routes
    /// are admitted first (`admit`): at most `engine.max_num_seqs +
    /// engine.max_waiting` of them at once, the rest get 503.
    pub fn router(&self, registry: MetricsRegistry) -> Router {
        let body_limit = self.inner.cfg.max_body_bytes.get() as usize;
        let state = AppState {
            engine: self.clone(),
            registry,
        };
        let admitted = Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/tokenize", post(tokenize))
            .route_layer(axum::middleware::from_fn_with_state(state.clone(), admit));
        Router::new()
            .merge(admitted)
            .route("/v1/models", get(models))
            .route(TOKENIZER_JSON, get(tokenizer_json))
            .route(TOKENIZER_CONFIG, get(tokenizer_config))
            .route("/health", get(health))
            .route("/healthz", get(health))
            .route("/metrics", get(metrics_route))
            .layer(DefaultBodyLimit::max(body_limit))
            .with_state(state)
    }

    /// Runs a request: imports the prompt's cached KV, hands it to the model
    /// thread and returns the event stream.
    pub async fn generate(&self, g: GenRequest) -> Result<Generation, ApiError> {
        let arrived = Instant::now();
        let e = &self.inner;
        let prompt = g.prompt;
        if prompt.is_empty() {
            return Err(ApiError::bad("the prompt is empty"));
        }
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= e.vocab_size) {
            return Err(ApiError::bad(format!(
                "prompt token {t} is outside the vocabulary of {}",
                e.vocab_size
            )));
        }
        g.params.validate().map_err(ApiError::bad)?;
        if prompt.len() >= e.max_model_len {
            return Err(ApiError::bad(format!(
                "the prompt has {} tokens; this model's context is {} tokens",
                prompt.len(),
                e.max_model_len
            )));
        }
        let mut params = g.params;
        params.max_tokens = params.max_tokens.min(e.max_model_len - prompt.len());
        let chunk = e.cfg.chunk_tokens;
        let hashes = chunk_hashes(&prompt, chunk).map_err(|x| ApiError::internal(x.to_string()))?;
        // At least the last prompt token is computed (its logits start the
        // generation), so at most (len - 1) / chunk chunks are loaded.
        let loadable = (prompt.len() - 1) / chunk;
        let kvp = g.kv_transfer.unwrap_or_default();
        let pool = e.pool.get().cloned();
        // Chunks to load: whole (awaited here) or streamed (while the piece runs).
        let mut load: Option<(usize, bool)> = None;
        if kvp.do_remote_prefill {
            if let Some(n) = kvp.num_tokens {
                if n != prompt.len() {
                    return Err(ApiError::bad(format!(
                        "kv_transfer_params.num_tokens is {n}, the prompt has {} tokens",
                        prompt.len()
                    )));
                }
            }
            for (i, key) in kvp.chunk_keys.iter().enumerate() {
                let want = hashes.get(i).map(|h| e.layout.key(*h));
                if want.as_deref() != Some(key.as_str()) {
                    return Err(ApiError::bad(format!(
                        "kv_transfer_params.chunk_keys[{i}] {key:?} is not chunk {i} of this prompt for this model (expected {want:?})"
                    )));
                }
            }
            if let (Some(m), Some(named)) = (&e.master, kvp.pool.as_deref()) {
                if named != m {
                    return Err(ApiError::bad(format!(
                        "kv_transfer_params.pool {named:?} is not this engine's pool {m:?}"
                    )));
                }
            }
            match &pool {
                Some(_) => load = Some((kvp.chunk_keys.len().min(loadable), false)),
                None => tracing::warn!(
                    "do_remote_prefill without a pool (no --master, or it is down): \
                     computing the whole prompt"
                ),
            }
        } else if pool.is_some() && e.cfg.load_from_pool {
            load = Some(match g.pool_prefix {
                // The sender looked the prompt up (the front, which routed
                // by it): read that many chunks, no lookup of our own. The
                // reads are checked and a missing chunk ends the run, so a
                // wrong hint costs reads or recomputation, never other KV.
                Some(n) => (n.min(loadable), false),
                None => (loadable, true),
            });
        }
        let (kv, pending, refused) = match (&pool, load) {
            (Some(p), Some((n, probe))) if e.cfg.kv_stream => {
                // Each group's read has the client's deadline; the model
                // thread waits for the last one at most that long per group.
                let groups = e.layout.groups() as u32;
                let deadline =
                    Instant::now() + Duration::from_millis(e.client_timeout_ms) * (groups + 1);
                let (n, pending) = p
                    .load_streamed(&e.layout, &hashes[..n], probe, deadline)
                    .await;
                (SeqKv::with_pending(e.layout, n), pending, 0)
            }
            (Some(p), Some((n, probe))) => {
                let loaded = p.load_prefix(&e.layout, &hashes[..n], probe).await;
                (
                    SeqKv::with_loaded(e.layout, loaded.segs),
                    None,
                    loaded.refused,
                )
            }
            _ => (SeqKv::new(e.layout), None, 0),
        };
        let loaded_tokens = kv.len();
        let remote_decode = kvp.do_remote_decode;
        let (store, stored) = if pool.is_some() && (e.cfg.store_to_pool || remote_decode) {
            if remote_decode {
                let (tx, rx) = oneshot::channel();
                (Some(Some(tx)), Some(rx))
            } else {
                (Some(None), None)
            }
        } else {
            (None, None)
        };
        let (tx, rx) = mpsc::channel(params.max_tokens + 2);
        let req = Request {
            prompt: prompt.clone(),
            hashes: hashes.clone(),
            kv,
            params,
            eos: e.eos.clone(),
            max_len: e.max_model_len,
            store,
            pending,
            events: tx,
        };
        e.submit.try_send(req).map_err(|err| match err {
            flume::TrySendError::Full(_) => ApiError::busy(format!(
                "{} requests are already waiting (engine.max_waiting)",
                e.cfg.max_waiting
            )),
            flume::TrySendError::Disconnected(_) => ApiError::internal("the engine thread is gone"),
        })?;
        e.metrics.requests.inc();
        e.metrics.prompt_tokens.inc_by(prompt.len() as u64);
        e.metrics.prompt_tokens_loaded.inc_by(loaded_tokens as u64);
        Ok(Generation {
            arrived,
            first_token: true,
            time_to_first_token: e.metrics.time_to_first_token.clone(),
            e2e_latency: e.metrics.e2e_latency.clone(),
            id: e.ids.fetch_add(1, Ordering::Relaxed),
            prompt,
            hashes,
            loaded_tokens,
            refused,
            remote_decode,
            stored,
            events: rx,
            deadline: tokio::time::Instant::now() + Duration::from_millis(e.cfg.request_timeout_ms),
            admission: None,
        })
    }

    /// The `kv_transfer_params` of a prefill answer: the leading chunks now in the pool.
    async fn transfer_params(&self, g: &mut Generation) -> Value {
        let e = &self.inner;
        let Some(master) = &e.master else {
            return json!({"do_remote_prefill": true, "do_remote_decode": false, "chunk_keys": [],
                "num_tokens": g.prompt.len(), "chunk_tokens": e.cfg.chunk_tokens, "pool": null});
        };
        let present = match g.stored.take() {
            Some(rx) => match tokio::time::timeout_at(g.deadline, rx).await {
                Ok(Ok(n)) => n,
                _ => g.loaded_tokens / e.cfg.chunk_tokens,
            },
            None => g.loaded_tokens / e.cfg.chunk_tokens,
        };
        let keys: Vec<String> = g.hashes[..present.min(g.hashes.len())]
            .iter()
            .map(|h| e.layout.key(*h))
            .collect();
        json!({"do_remote_prefill": true, "do_remote_decode": false, "chunk_keys": keys,
            "num_tokens": g.prompt.len(), "chunk_tokens": e.cfg.chunk_tokens, "pool": master})
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.tokenizer
    }
}

/// Longest wait between two attempts to reach a pool that is down.
const POOL_RETRY_MAX: Duration = Duration::from_secs(30);

/// Connects to a pool that was down at start, retrying with backoff until
/// it answers, publishes it in `slot`, then runs the store task. Until then,
/// store jobs are not queued (requests see no pool).
async fn connect_and_store(
    master: String,
    cfg: kvpool_config::ClientConfig,
    slot: Arc<OnceLock<Arc<KvPool>>>,
    metrics: EngineMetrics,
    rx: flume::Receiver<scheduler::StoreJob>,
) {
    let mut wait = Duration::from_millis(500);
    let client = loop {
        tokio::time::sleep(wait).await;
        match Client::connect(&master, cfg.clone()).await {
            Ok(c) => {
                tracing::info!("reached the pool at {master}: loading and storing KV");
                break c;
            }
            Err(e) => {
                tracing::warn!("pool at {master} still unreachable: {e}");
                wait = (wait * 2).min(POOL_RETRY_MAX);
            }
        }
        if rx.is_disconnected() {
            return;
        }
    };
    let pool = Arc::new(KvPool::new(client, master, metrics));
    let _ = slot.set(pool.clone());
    pool.run_store(rx).await;
}

/// A generation request, after parsing.
#[derive(Clone)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub kv_transfer: Option<KvTransferParams>,
    /// Leading chunks of the prompt the sender found in the pool
    /// (`kvpool_pool_prefix`, the front's lookup): read without a lookup of
    /// the engine's own. `None`: the engine looks them up.
    pub pool_prefix: Option<usize>,
}

/// A request handed to the model thread.
pub struct Generation {
    id: u64,
    prompt: Vec<u32>,
    hashes: Vec<ChunkHash>,
    /// Prompt tokens whose KV came from the pool.
    pub loaded_tokens: usize,
    /// Chunks read and refused.
    pub refused: usize,
    remote_decode: bool,
    stored: Option<oneshot::Receiver<usize>>,
    events: mpsc::Receiver<Event>,
    deadline: tokio::time::Instant,
    /// The request's admission, held as long as its events are read.
    admission: Option<Admission>,
    arrived: Instant,
    /// No token was read yet.
    first_token: bool,
    time_to_first_token: Histogram,
    e2e_latency: Histogram,
}

impl Generation {
    /// The next event, or an error at the request's deadline.
    pub async fn next(&mut self) -> Result<Option<Event>, ApiError> {
        match tokio::time::timeout_at(self.deadline, self.events.recv()).await {
            Ok(e) => {
                match &e {
                    Some(Event::Token(..)) if self.first_token => {
                        self.first_token = false;
                        let s = self.arrived.elapsed().as_secs_f64();
                        self.time_to_first_token.observe(s);
                    }
                    Some(Event::Done(_)) => self
                        .e2e_latency
                        .observe(self.arrived.elapsed().as_secs_f64()),
                    _ => {}
                }
                Ok(e)
            }
            Err(_) => Err(ApiError {
                status: StatusCode::GATEWAY_TIMEOUT,
                message: "the request ran past engine.request_timeout_ms".into(),
            }),
        }
    }
}

pub use kvpool_http::openai::KvTransferParams;
use kvpool_http::openai::{KvNaming, Model, ModelList, PromptKv};

/// An HTTP error in vLLM's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn bad(m: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: m.into(),
        }
    }
    fn busy(m: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: m.into(),
        }
    }
    fn internal(m: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: m.into(),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::BadRequest(m) => Self::bad(m),
            EngineError::Busy(m) => Self::busy(m),
            other => Self::internal(other.to_string()),
        }
    }
}

impl ApiError {
    /// The error object, as vLLM writes it.
    fn body(&self) -> Value {
        let kind = match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::PAYLOAD_TOO_LARGE => "PayloadTooLargeError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::GATEWAY_TIMEOUT => "TimeoutError",
            _ => "InternalServerError",
        };
        json!({"object": "error", "message": self.message, "type": kind,
            "param": null, "code": self.status.as_u16()})
    }

    /// The SSE event of a sequence that failed after the stream's 200 was
    /// sent: vLLM's `data: {"error": {...}}` (what OpenAI clients raise
    /// on); the stream's `data: [DONE]` follows when every sequence ended.
    fn sse_event(&self) -> Bytes {
        sse(&json!({"error": self.body()}))
    }
}

/// What a 503 of the engine tells a client to wait before trying again
/// (`Retry-After`, seconds): one prefill piece or decode step frees a place.
const RETRY_AFTER_S: &str = "1";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_S));
        }
        r
    }
}

#[derive(Clone)]
struct AppState {
    engine: Engine,
    registry: MetricsRegistry,
}

/// A request's place among those the engine holds at once: one of
/// `engine.max_num_seqs + engine.max_waiting` permits.
#[derive(Clone)]
struct Admission {
    _permit: Arc<OwnedSemaphorePermit>,
}

/// Admits a POST request before its body is read, or answers 503. The
/// permit goes with the request and is held until its answer is complete
/// (a stream holds it until its last event), so request bodies, prompts,
/// KV loaded from the pool and queued work are bounded by the engine's
/// limits, not by how many clients connect.
async fn admit(
    State(st): State<AppState>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let e = &st.engine.inner;
    match e.admission.clone().try_acquire_owned() {
        Ok(permit) => {
            req.extensions_mut().insert(Admission {
                _permit: Arc::new(permit),
            });
            next.run(req).await
        }
        Err(_) => ApiError::busy(format!(
            "{} requests are already in flight (engine.max_num_seqs + engine.max_waiting)",
            e.cfg.max_num_seqs + e.cfg.max_waiting
        ))
        .into_response(),
    }
}

/// A prompt as text, or as token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    /// Several prompts (refused with a clear error; never read).
    #[allow(dead_code)]
    Batch(Vec<Value>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

/// A message's content: a string, or OpenAI's list of parts
/// (`[{"type": "text", "text": ...}]`, what guidellm and multimodal clients
/// send). Text parts are joined with a newline, as vLLM does; a part of
/// another kind (an image, audio) is refused, since the models served here
/// read text only.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

impl Content {
    fn text(&self) -> Result<std::borrow::Cow<'_, str>, ApiError> {
        match self {
            Content::Text(t) => Ok(t.into()),
            Content::Parts(parts) => {
                let mut texts = Vec::with_capacity(parts.len());
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => texts.push(t.as_str()),
                        ("text", None) => {
                            return Err(ApiError::bad("a content part of type text has no text"))
                        }
                        (other, _) => {
                            return Err(ApiError::bad(format!(
                                "content parts of type {other:?} are not supported: \
                                 this model reads text only"
                            )))
                        }
                    }
                }
                Ok(texts.join("\n").into())
            }
        }
    }
}

/// The fields both generation routes take.
#[derive(Debug, Deserialize)]
struct CommonFields {
    model: Option<String>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    return_token_ids: bool,
    kv_transfer_params: Option<KvTransferParams>,
    /// A stream continued on this engine after another one failed (the
    /// conductor's front sends it): see [`Resume`].
    kvpool_resume: Option<Resume>,
    /// The prompt's token ids, when the sender has them already (the
    /// conductor's front tokenized the prompt once): used as the prompt
    /// instead of tokenizing `prompt` or `messages` again. They are the
    /// request's own prompt, checked as a token-id prompt is (vocabulary,
    /// context); a vLLM engine ignores the field.
    kvpool_prompt_token_ids: Option<Vec<u32>>,
    /// Leading chunks of the prompt in the pool, as the sender's lookup
    /// found them (the conductor's front): see [`GenRequest::pool_prefix`].
    kvpool_pool_prefix: Option<usize>,
    /// Sequences to generate (1 to [`MAX_N`]), each its own choice.
    n: Option<usize>,
    /// A completion's count of alternatives, a chat's true or false
    /// (with `top_logprobs` in `rest`): [`crate::logprobs::asked`].
    logprobs: Option<Value>,
    /// Every other field: those of OpenAI's API this engine does not apply
    /// are refused when they ask for something ([`refuse_unsupported`]);
    /// others are ignored, as vLLM does.
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

/// OpenAI request fields this engine does not apply, refused (400) when
/// they ask for something other than their default: silently ignoring
/// `echo`, penalties, tools or a JSON response format would answer a
/// different request than the one sent (issue 30).
fn refuse_unsupported(rest: &serde_json::Map<String, Value>, chat: bool) -> Result<(), ApiError> {
    let asks = |k: &str, v: &Value| -> bool {
        match (k, v) {
            (_, Value::Null) => false,
            // A completion's echo is served ([`echo_of`]); a chat has none.
            ("echo", v) => chat && *v != Value::Bool(false),
            ("best_of", v) => v.as_u64() != Some(1),
            ("presence_penalty" | "frequency_penalty", v) => v.as_f64() != Some(0.0),
            ("repetition_penalty", v) => v.as_f64() != Some(1.0),
            ("logit_bias" | "functions" | "tools", v) => {
                !(v.as_object().is_some_and(|o| o.is_empty())
                    || v.as_array().is_some_and(|a| a.is_empty()))
            }
            ("suffix", v) => v.as_str() != Some(""),
            ("tool_choice" | "function_call", v) => v.as_str() != Some("none"),
            ("response_format", v) => v["type"].as_str() != Some("text"),
            _ => false,
        }
    };
    for (k, v) in rest {
        if asks(k, v) {
            return Err(ApiError::bad(format!(
                "`{k}` is not supported by this engine (it would be ignored, and the answer \
                 would not be the one asked for)"
            )));
        }
    }
    Ok(())
}

/// The tail of the prompt that an engine which failed mid-stream had
/// already generated: the last `generated_tokens` prompt tokens, of whose
/// text the client got the first `text_sent_bytes` bytes. The text they
/// still owe (an incomplete UTF-8 character, a possible stop-string prefix)
/// is sent before the new tokens' text, and stop strings see the whole
/// generated text, so the client reads what one engine would have sent.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
struct Resume {
    generated_tokens: usize,
    text_sent_bytes: usize,
    /// The answer is a chat's: `logprobs` / `top_logprobs` are read and
    /// answered in the chat form (the continuation itself is a completion).
    #[serde(default)]
    chat: bool,
}

#[derive(Debug, Deserialize)]
struct CompletionBody {
    prompt: Prompt,
    #[serde(flatten)]
    common: CommonFields,
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    #[serde(flatten)]
    common: CommonFields,
}

#[derive(Debug, Deserialize)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<Prompt>,
    messages: Option<Vec<Message>>,
}

/// The JSON body of a request; a body over `engine.max_body_bytes` (413) or
/// one that cannot be read gets an error in vLLM's shape too.
fn parse<T: for<'de> Deserialize<'de>>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|r| ApiError {
        status: r.status(),
        message: format!("request body: {}", r.body_text()),
    })?;
    serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("invalid request body: {e}")))
}

/// The chat template: `<|role|>\ncontent\n` per message, then
/// `<|assistant|>\n`. (Jinja chat templates of model folders are not run.)
fn chat_text(messages: &[Message]) -> Result<String, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages is empty"));
    }
    let mut s = String::new();
    for m in messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
            return Err(ApiError::bad(format!(
                "message role {:?} is not system, user or assistant",
                m.role
            )));
        }
        s.push_str(&format!("<|{}|>\n{}\n", m.role, m.content.text()?));
    }
    s.push_str("<|assistant|>\n");
    Ok(s)
}

impl AppState {
    fn check_model(&self, model: &Option<String>) -> Result<(), ApiError> {
        match model {
            Some(m) if *m != self.engine.inner.name => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("The model `{m}` does not exist."),
            }),
            _ => Ok(()),
        }
    }

    fn prompt_tokens(&self, p: Prompt) -> Result<Vec<u32>, ApiError> {
        match p {
            Prompt::Text(t) => {
                self.engine.inner.metrics.prompts_tokenized.inc();
                Ok(self.engine.tokenizer().encode(&t)?)
            }
            Prompt::Tokens(t) => Ok(t),
            Prompt::Batch(_) => Err(ApiError::bad(BATCH_REFUSED)),
        }
    }

    fn gen_request(
        &self,
        prompt: Vec<u32>,
        c: &CommonFields,
        default_max: Option<usize>,
        chat: bool,
    ) -> Result<GenRequest, ApiError> {
        if c.n.is_some_and(|n| n == 0 || n > MAX_N) {
            return Err(ApiError::bad(format!("n must be from 1 to {MAX_N}")));
        }
        let logprobs =
            crate::logprobs::asked(c.logprobs.as_ref(), c.rest.get("top_logprobs"), chat)
                .map_err(ApiError::bad)?;
        refuse_unsupported(&c.rest, chat)?;
        let e = &self.engine.inner;
        let room = e.max_model_len.saturating_sub(prompt.len());
        let max_tokens = c
            .max_tokens
            .or(c.max_completion_tokens)
            .or(default_max)
            .unwrap_or(room);
        Ok(GenRequest {
            prompt,
            params: SamplingParams {
                temperature: c.temperature.unwrap_or(1.0),
                top_p: c.top_p.unwrap_or(1.0),
                seed: c.seed,
                max_tokens,
                ignore_eos: c.ignore_eos,
                logprobs,
            },
            kv_transfer: c.kv_transfer_params.clone(),
            pool_prefix: c.kvpool_pool_prefix,
        })
    }
}

/// Header naming a request end to end (vLLM's and the conductor's).
const REQUEST_ID: &str = "x-request-id";

/// The request's `X-Request-Id`, if it is 1 to 128 visible ASCII characters
/// (anything else is ignored, as if absent).
fn request_id(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(REQUEST_ID)?.to_str().ok()?;
    let ok = !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic());
    ok.then(|| v.to_string())
}

/// `resp` with the request's id in its `X-Request-Id` header.
fn with_request_id(mut resp: Response, id: Option<&str>) -> Response {
    if let Some(v) = id.and_then(|id| HeaderValue::from_str(id).ok()) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    resp
}

async fn completions(
    State(st): State<AppState>,
    Extension(admission): Extension<Admission>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let rid = request_id(&headers);
    let r: Result<Response, ApiError> = async {
        let mut b: CompletionBody = parse(body)?;
        st.check_model(&b.common.model)?;
        let prompt = match (b.common.kvpool_prompt_token_ids.take(), b.prompt) {
            (_, Prompt::Batch(_)) => return Err(ApiError::bad(BATCH_REFUSED)),
            (Some(ids), _) => ids,
            (None, p) => st.prompt_tokens(p)?,
        };
        let chat_logprobs = b.common.kvpool_resume.is_some_and(|r| r.chat);
        let g = st.gen_request(prompt, &b.common, Some(16), chat_logprobs)?;
        let echo = echo_of(&st, &b.common, &g)?;
        respond(&st, g, b.common, false, echo, admission, rid.as_deref()).await
    }
    .await;
    with_request_id(
        r.unwrap_or_else(IntoResponse::into_response),
        rid.as_deref(),
    )
}

async fn chat_completions(
    State(st): State<AppState>,
    Extension(admission): Extension<Admission>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let rid = request_id(&headers);
    let r: Result<Response, ApiError> = async {
        let mut b: ChatBody = parse(body)?;
        st.check_model(&b.common.model)?;
        // The messages are checked even when their tokens came along.
        let text = chat_text(&b.messages)?;
        let prompt = match b.common.kvpool_prompt_token_ids.take() {
            Some(ids) => ids,
            None => {
                st.engine.inner.metrics.prompts_tokenized.inc();
                st.engine.tokenizer().encode(&text)?
            }
        };
        let g = st.gen_request(prompt, &b.common, None, true)?;
        respond(&st, g, b.common, true, None, admission, rid.as_deref()).await
    }
    .await;
    with_request_id(
        r.unwrap_or_else(IntoResponse::into_response),
        rid.as_deref(),
    )
}

/// A completion's `echo`: the prompt's text, which the answer starts with
/// (`None` unless asked). With logprobs it is refused: they would have to
/// cover the prompt's tokens, which this engine does not compute.
fn echo_of(st: &AppState, c: &CommonFields, g: &GenRequest) -> Result<Option<String>, ApiError> {
    match c.rest.get("echo") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
        Some(Value::Bool(true)) if g.params.logprobs.is_some() => Err(ApiError::bad(
            "`echo` with `logprobs` is not supported: the prompt's logprobs are not computed",
        )),
        Some(Value::Bool(true)) if c.kvpool_resume.is_some() => Err(ApiError::bad(
            "`echo` and `kvpool_resume` together: a continued answer does not start again",
        )),
        Some(Value::Bool(true)) => {
            let bytes = st.engine.tokenizer().decode_bytes(&g.prompt);
            Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
        }
        Some(_) => Err(ApiError::bad("`echo` is true or false")),
    }
}

/// The answer to a batch of prompts.
const BATCH_REFUSED: &str = "a batch of prompts is not supported: send one prompt per request";

/// Most sequences one request may ask for (`n`).
const MAX_N: usize = 16;

/// One sequence of an answer while it is generated: its generation, text,
/// logprobs and the prompt's text to start with (`echo`).
struct Seq {
    index: usize,
    gen: Generation,
    text: TextState,
    logprobs: Option<crate::logprobs::Builder>,
    echo: Option<String>,
}

async fn respond(
    st: &AppState,
    g: GenRequest,
    c: CommonFields,
    chat: bool,
    echo: Option<String>,
    admission: Admission,
    request_id: Option<&str>,
) -> Result<Response, ApiError> {
    let n = c.n.unwrap_or(1);
    if n > 1 && (g.kv_transfer.is_some() || c.kvpool_resume.is_some()) {
        return Err(ApiError::bad(
            "n > 1 with kv_transfer_params or kvpool_resume: send one request per sequence",
        ));
    }
    let prompt_ids = g.prompt.clone();
    let chat_logprobs = chat || c.kvpool_resume.is_some_and(|r| r.chat);
    let mut text = TextState::new(c.stop.clone());
    if let Some(r) = c.kvpool_resume {
        text.resume(&prompt_ids, r, st.engine.tokenizer())?;
    }
    // The sequences: the request's own sampling for the first, the next
    // seeds (when a seed is given) for the others.
    let mut seqs = Vec::with_capacity(n);
    let mut admission = Some(admission);
    for index in 0..n {
        let mut gi = g.clone();
        gi.params.seed = g.params.seed.map(|s| s.wrapping_add(index as u64));
        let mut gen = st.engine.generate(gi).await?;
        // One admission for the request: a whole answer's first sequence
        // holds it; a stream holds it until the body is dropped.
        if !c.stream {
            gen.admission = admission.take();
        }
        let logprobs = g.params.logprobs.map(|_| {
            let mut b = crate::logprobs::Builder::new(chat_logprobs);
            if let Some(r) = c.kvpool_resume {
                let from = prompt_ids.len().saturating_sub(r.generated_tokens);
                b.resume(st.engine.tokenizer(), &prompt_ids[from..]);
            }
            b
        });
        seqs.push(Seq {
            index,
            gen,
            text: text.clone(),
            logprobs,
            echo: echo.clone(),
        });
    }
    let name = st.engine.inner.name.clone();
    let prefix = if chat { "chatcmpl" } else { "cmpl" };
    let id = match request_id {
        Some(rid) => format!("{prefix}-{rid}"),
        None => format!("{prefix}-{}", seqs[0].gen.id),
    };
    if let Some(rid) = request_id {
        tracing::debug!(
            request_id = rid,
            prompt_tokens = prompt_ids.len(),
            loaded = seqs[0].gen.loaded_tokens,
            "request admitted"
        );
    }
    let created = now_s();
    if c.stream {
        let head = Arc::new(StreamHead {
            st: st.clone(),
            id,
            created,
            chat,
            token_ids: c.return_token_ids,
        });
        return Ok(stream_response(head, seqs, admission));
    }
    let mut choices = Vec::with_capacity(n);
    let mut completion_tokens = 0;
    let mut computed = 0;
    let mut kvp = Value::Null;
    for mut s in seqs {
        let finish;
        loop {
            match s.gen.next().await? {
                Some(Event::Prefilled {
                    computed: k,
                    refused,
                }) => {
                    if s.index == 0 {
                        computed = k;
                    }
                    // A streamed load that arrived short was computed instead.
                    s.gen.loaded_tokens = s.gen.loaded_tokens.min(s.gen.prompt.len() - k);
                    s.gen.refused += refused;
                }
                // Every token is in the ids (an end-of-sequence one too: its
                // text is empty), so the ids are the sequence the model made.
                Some(Event::Token(t, lp)) => {
                    if let (Some(b), Some(lp)) = (s.logprobs.as_mut(), lp) {
                        b.push(st.engine.tokenizer(), t, &lp);
                    }
                    if s.text.push(t, st.engine.tokenizer()) {
                        finish = Finish::Stop;
                        break;
                    }
                }
                Some(Event::Done(f)) => {
                    finish = f;
                    break;
                }
                Some(Event::Failed(m)) => return Err(ApiError::internal(m)),
                None => return Err(ApiError::internal("the engine dropped the request")),
            }
        }
        completion_tokens += s.text.own_ids().len();
        // The text not sent before (all of it, unless resumed).
        let mut out_text = s.text.delta(st.engine.tokenizer(), true);
        if let Some(e) = &s.echo {
            out_text.insert_str(0, e);
        }
        let logprobs = s.logprobs.as_mut().map_or(Value::Null, |b| b.take());
        if s.gen.remote_decode {
            kvp = st.engine.transfer_params(&mut s.gen).await;
        }
        let i = s.index;
        let mut choice = if chat {
            json!({"index": i, "message": {"role": "assistant", "content": out_text},
                "logprobs": logprobs, "finish_reason": finish.as_str()})
        } else {
            json!({"index": i, "text": out_text, "logprobs": logprobs, "finish_reason": finish.as_str()})
        };
        if c.return_token_ids {
            choice["token_ids"] = json!(s.text.own_ids());
            choice["prompt_token_ids"] = json!(prompt_ids);
        }
        choices.push((choice, s.gen.loaded_tokens, s.gen.refused));
    }
    let (loaded, refused) = (choices[0].1, choices[0].2);
    let body = json!({
        "id": id,
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": created,
        "model": name,
        "choices": choices.into_iter().map(|c| c.0).collect::<Vec<_>>(),
        "usage": {
            "prompt_tokens": prompt_ids.len(),
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_ids.len() + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": loaded},
        },
        "kv_transfer_params": kvp,
        "kvpool": PromptKv {
            prompt_tokens_computed: computed as u64,
            prompt_tokens_loaded: loaded as u64,
            chunks_refused: refused as u64,
        },
    });
    Ok(Json(body).into_response())
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// What every chunk of a streamed answer names.
struct StreamHead {
    st: AppState,
    id: String,
    created: u64,
    chat: bool,
    token_ids: bool,
}

/// One sequence of a streamed answer while it is sent.
struct StreamSeq {
    head: Arc<StreamHead>,
    seq: Seq,
    first: bool,
    done: bool,
}

/// The sequences' chunks as they come (each names its `index`), then
/// `data: [DONE]` once every sequence ended. A sequence that fails sends
/// its error event; the others go on.
fn stream_response(
    head: Arc<StreamHead>,
    seqs: Vec<Seq>,
    admission: Option<Admission>,
) -> Response {
    type S = StreamSeq;
    fn chunk(s: &mut S, delta: &str, ids: &[u32], finish: Option<Finish>) -> Value {
        let h = &s.head;
        let name = &h.st.engine.inner.name;
        let echo = s.seq.echo.take();
        let delta = match &echo {
            Some(e) => std::borrow::Cow::Owned(format!("{e}{delta}")),
            None => std::borrow::Cow::Borrowed(delta),
        };
        let lp = s.seq.logprobs.as_mut().map_or(Value::Null, |b| b.take());
        let i = s.seq.index;
        let mut choice = if h.chat {
            let mut d = json!({"content": delta});
            if s.first {
                d["role"] = json!("assistant");
            }
            json!({"index": i, "delta": d, "logprobs": lp, "finish_reason": finish.map(Finish::as_str)})
        } else {
            json!({"index": i, "text": delta, "logprobs": lp, "finish_reason": finish.map(Finish::as_str)})
        };
        if h.token_ids {
            choice["token_ids"] = json!(ids);
        }
        json!({"id": h.id, "object": if h.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": h.created, "model": name, "choices": [choice]})
    }
    let error = ApiError::sse_event;
    let one = move |s: S| {
        futures_util::stream::unfold(s, move |mut s| async move {
            if s.done {
                return None;
            }
            loop {
                let ev = match s.seq.gen.next().await {
                    Ok(ev) => ev,
                    Err(e) => {
                        s.done = true;
                        return Some((error(&e), s));
                    }
                };
                let head = s.head.clone();
                let tok = head.st.engine.tokenizer();
                // The last event's token ids (a stop string's last token).
                let mut last_ids: &[u32] = &[];
                let stop_token;
                let finish = match ev {
                    Some(Event::Prefilled { .. }) => continue,
                    // Every token's id is sent, an end-of-sequence one too
                    // (its text is empty): a client that continues the
                    // sequence elsewhere needs all of them.
                    Some(Event::Token(t, lp)) => {
                        if let (Some(b), Some(lp)) = (s.seq.logprobs.as_mut(), lp) {
                            b.push(tok, t, &lp);
                        }
                        if s.seq.text.push(t, tok) {
                            stop_token = [t];
                            last_ids = &stop_token;
                            Some(Finish::Stop)
                        } else {
                            let d = s.seq.text.delta(tok, false);
                            let v = chunk(&mut s, &d, &[t], None);
                            s.first = false;
                            return Some((sse(&v), s));
                        }
                    }
                    Some(Event::Done(f)) => Some(f),
                    Some(Event::Failed(m)) => {
                        s.done = true;
                        return Some((error(&ApiError::internal(m)), s));
                    }
                    // The engine let the request go without saying how it
                    // ended: that is an error, not a finished stream.
                    None => {
                        s.done = true;
                        let e = ApiError::internal("the engine dropped the request");
                        return Some((error(&e), s));
                    }
                };
                let d = s.seq.text.delta(tok, true);
                let v = chunk(&mut s, &d, last_ids, finish);
                s.done = true;
                return Some((sse(&v), s));
            }
        })
    };
    let streams = seqs.into_iter().map(|seq| {
        Box::pin(one(StreamSeq {
            head: head.clone(),
            seq,
            first: true,
            done: false,
        }))
    });
    let done = futures_util::stream::once(async { Bytes::from_static(b"data: [DONE]\n\n") });
    // The admission place goes with the body: held until the client has
    // read the last event and the stream is dropped.
    let stream = futures_util::stream::select_all(streams)
        .chain(done)
        .map(move |b| {
            let _held = &admission;
            Ok::<Bytes, Infallible>(b)
        });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| ApiError::internal(e.to_string()).into_response())
}

async fn models(State(st): State<AppState>) -> Response {
    let e = &st.engine.inner;
    let kv = KvNaming {
        chunk_tokens: e.cfg.chunk_tokens,
        key_model: e.layout.key_model().to_string(),
        key_format: e.layout.key_format().to_string(),
        pool: e.master.clone(),
    };
    let model = Model {
        root: Some(e.name.clone()),
        max_model_len: Some(e.max_model_len as u64),
        kvpool: Some(kv),
        ..Model::new(e.name.clone(), e.created)
    };
    Json(ModelList::new(vec![model])).into_response()
}

/// Where the engine serves its tokenizer as a Hugging Face `tokenizer.json`
/// (proxies and the conductor's front pass it on under the same path).
pub const TOKENIZER_JSON: &str = "/kvpool/v1/tokenizer.json";
/// ... and the `tokenizer_config.json` that goes beside it.
pub const TOKENIZER_CONFIG: &str = "/kvpool/v1/tokenizer_config.json";

async fn tokenizer_json(State(st): State<AppState>) -> Response {
    match st.engine.tokenizer().to_hf_json() {
        Ok(j) => ([(axum::http::header::CONTENT_TYPE, "application/json")], j).into_response(),
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

async fn tokenizer_config(State(st): State<AppState>) -> Response {
    let e = &st.engine.inner;
    let j = crate::tokenizer::hf_tokenizer_config(st.engine.tokenizer(), e.max_model_len);
    ([(axum::http::header::CONTENT_TYPE, "application/json")], j).into_response()
}

async fn tokenize(
    State(st): State<AppState>,
    Extension(_admission): Extension<Admission>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r: Result<Response, ApiError> = async {
        let b: TokenizeBody = parse(body)?;
        st.check_model(&b.model)?;
        let tokens = match (b.prompt, b.messages) {
            (Some(p), None) => st.prompt_tokens(p)?,
            (None, Some(m)) => {
                st.engine.inner.metrics.prompts_tokenized.inc();
                st.engine.tokenizer().encode(&chat_text(&m)?)?
            }
            _ => return Err(ApiError::bad("give exactly one of prompt and messages")),
        };
        Ok(Json(
            json!({"count": tokens.len(), "max_model_len": st.engine.inner.max_model_len,
            "tokens": tokens}),
        )
        .into_response())
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn metrics_route(State(st): State<AppState>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.registry.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests;
