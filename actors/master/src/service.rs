//! The master as it runs: one metadata shard per glommio shard.
//!
//! ```text
//!  client --TCP--> shard i port (base+i)
//!                    | key owned by i?  yes -> ShardState (local, no channel)
//!                    |                  no  -> inbox of owner (flume, bounded) -> reply
//!                    | batch: split by owner, local part here, others by inbox, merged in order
//!                    | admin op (mount, unmount, drain, stat, remove_all, ping)
//!                    +-> coordinator on shard 0 (one op at a time) -> every inbox -> acks
//!  every shard: tick every tick_ms (stale puts, due frees, ranges past the watermark)
//!  every shard: an eviction task, woken when a range is owed an episode, that
//!               evicts EVICT_STEP_VICTIMS at a time and lets requests run between
//!  coordinator: liveness every tick_ms (silent owners unmounted, writers revoked)
//!  actor / HTTP (tokio) --MasterHandle::call--> same inboxes and coordinator
//! ```
//!
//! Admin operations go through one coordinator so that every shard sees
//! mounts and unmounts in the same order. No lock guards metadata: each
//! shard's state lives in its own thread and is reached by message. The
//! decisions are made by the same pure pieces [`super::core::MasterCore`]
//! composes for tests ([`CoordState`], [`ShardState`], the batch helpers).

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::net::TcpStream;
use kvpool_runtime::hash::{ShardMap, VSHARDS};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardCtx, ShardHandle};
use kvpool_transport::auth::ClusterKey;
use kvpool_transport::frame::{self, FrameHeader, FrameKind};
use kvpool_transport::proto::call::{self, Call};
use kvpool_transport::proto::{ClusterMap, MasterRequest, MasterResponse, MasterShardAddr};
use kvpool_transport::{ErrorCode, KvError};

use super::coord::{CommandResult, CoordState, Decision, ShardCommand};
use super::core::check_batch;
use super::journal::{self, LogWriter};
use super::state::{GrantSigner, ShardConfig, ShardState, SnapshotCursor, EVICT_STEP_VICTIMS};
use crate::clock::now_ms;
use crate::fence::Fence;
use crate::metrics::MasterMetrics;
use kvpool_config::MasterConfig;
use kvpool_config::NodeError;
use kvpool_transport::route::{self, merge_batch, split_batch, Target};
use kvpool_transport::server::{self, ConnState, Handler, Next, RefusalLog, ServerLimits};

/// A reply sink for a request routed to a shard; called exactly once.
pub type Reply = Box<dyn FnOnce(Result<MasterResponse, KvError>) + Send>;

/// Messages a master shard's inbox takes.
enum ShardMsg {
    /// A key or batch request forwarded from another shard or the actor side.
    Request { req: MasterRequest, reply: Reply },
    /// A coordinator command.
    Command {
        cmd: ShardCommand,
        done: tokio::sync::oneshot::Sender<CommandResult>,
    },
    /// Health: answered at once by a shard that is serving its inbox.
    Probe(tokio::sync::oneshot::Sender<()>),
    // HA (docs/ARCHITECTURE.md, "HA on etcd"): a standby's shards run but
    // serve nothing (the fence refuses every request). When the leader ships
    // its state log, a standby applies each record to the owning shard's
    // state through this inbox, in log order, as a message of its own here.
}

struct AdminMsg {
    req: MasterRequest,
    reply: Reply,
}

/// A handle to the running master: usable from any thread or runtime.
#[derive(Clone)]
pub struct MasterHandle {
    inner: Arc<HandleInner>,
}

struct HandleInner {
    inboxes: Vec<flume::Sender<ShardMsg>>,
    admin: flume::Sender<AdminMsg>,
    map: ShardMap,
    cluster: ClusterMap,
    addr: SocketAddr,
    max_batch: usize,
    metrics: MasterMetrics,
    /// Whether this master may answer (HA: only the leader, within its
    /// lease); every request path checks it.
    fence: Fence,
}

fn unavailable() -> KvError {
    KvError::new(ErrorCode::Unavailable, "the master is shutting down")
}

impl MasterHandle {
    /// The base RPC address (shard 0).
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    pub fn cluster_map(&self) -> &ClusterMap {
        &self.inner.cluster
    }

    /// This master's fence: its role in the election, its term, whether it
    /// may answer now. The election (`kvpool-ha`) moves it.
    pub fn fence(&self) -> &Fence {
        &self.inner.fence
    }

    async fn to_shard(&self, shard: usize, req: MasterRequest, reply: Reply) {
        if let Err(flume::SendError(ShardMsg::Request { reply, .. })) = self.inner.inboxes[shard]
            .send_async(ShardMsg::Request { req, reply })
            .await
        {
            reply(Err(unavailable()));
        }
    }

    /// Routes a request to the shard that owns it (or the coordinator);
    /// `reply` gets the answer. Waits only for room in the target queue
    /// (back-pressure). A batch whose keys span shards is split and merged.
    pub async fn submit(&self, req: MasterRequest, reply: Reply) {
        if let Err(e) = self.inner.fence.admit() {
            return reply(Err(e));
        }
        let map = &self.inner.map;
        let target = match route::target(&req, |k| map.shard_of(k), self.inner.inboxes.len()) {
            Ok(t) => t,
            Err(e) => return reply(Err(e)),
        };
        match target {
            Target::Connection => match req {
                MasterRequest::Hello { .. } => reply(Ok(MasterResponse::Hello {
                    cluster: self.inner.cluster.clone(),
                })),
                other => reply(Err(KvError::new(
                    ErrorCode::InvalidParams,
                    format!("{} belongs to a connection's handshake", other.op_name()),
                ))),
            },
            Target::Shard(s) => self.to_shard(s, req, reply).await,
            Target::Batch => {
                match check_batch(&req, self.inner.max_batch) {
                    Err(e) => return reply(Err(e)),
                    Ok(Some(empty)) => return reply(Ok(empty)),
                    Ok(None) => {}
                }
                let mut parts = split_batch(req, map);
                if parts.len() == 1 {
                    let p = parts.pop().expect("one part");
                    return self.to_shard(p.shard as usize, p.req, reply).await;
                }
                let n = parts.iter().map(|p| p.positions.len()).sum();
                let answers = self.forward_parts(parts).await;
                reply(merge_batch(n, answers))
            }
            Target::Coordinator => {
                if let Err(flume::SendError(m)) =
                    self.inner.admin.send_async(AdminMsg { req, reply }).await
                {
                    (m.reply)(Err(unavailable()));
                }
            }
        }
    }

    /// Sends each part to its shard; the answers, with their positions.
    async fn forward_parts(
        &self,
        parts: Vec<kvpool_transport::route::BatchPart>,
    ) -> Vec<(Vec<usize>, Result<MasterResponse, KvError>)> {
        let mut waits = Vec::with_capacity(parts.len());
        for p in parts {
            let (tx, rx) = tokio::sync::oneshot::channel();
            self.to_shard(
                p.shard as usize,
                p.req,
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            )
            .await;
            waits.push((p.positions, rx));
        }
        let mut answers = Vec::with_capacity(waits.len());
        for (pos, rx) in waits {
            answers.push((pos, rx.await.unwrap_or_else(|_| Err(unavailable()))));
        }
        answers
    }

    /// A typed call: sends it and reads its answer (no deadline of its own:
    /// the caller wraps it in its runtime's timeout).
    pub async fn call<C: Call>(&self, c: C) -> Result<C::Reply, KvError> {
        C::reply(self.request(c.into()).await?)
    }

    /// Sends a request and waits for its answer as it came (no deadline of
    /// its own: the caller wraps it in its runtime's timeout).
    pub async fn request(&self, req: MasterRequest) -> Result<MasterResponse, KvError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(
            req,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        )
        .await;
        let answer = rx.await.unwrap_or_else(|_| {
            Err(KvError::new(
                ErrorCode::Unavailable,
                "the master shard stopped before answering",
            ))
        });
        // A leader whose lease ran out while the request was served answers
        // nothing it decided (its grants may hand out space a new leader
        // also hands out).
        answer.and_then(|r| self.inner.fence.admit().map(|()| r))
    }

    /// Whether every master shard is serving its inbox (no deadline of its
    /// own: the caller bounds it). The error names the shard that is not.
    pub async fn probe(&self) -> Result<(), String> {
        for (i, tx) in self.inner.inboxes.iter().enumerate() {
            let (done, rx) = tokio::sync::oneshot::channel();
            tx.send_async(ShardMsg::Probe(done))
                .await
                .map_err(|_| format!("master shard {i} has stopped"))?;
            rx.await
                .map_err(|_| format!("master shard {i} dropped the probe"))?;
        }
        Ok(())
    }

    /// Brings the pool gauges (keys, segment capacity and use) up to date;
    /// called before `/metrics` is rendered.
    pub async fn refresh_gauges(&self) -> Result<(), KvError> {
        let stat = self.call(call::Stat).await?;
        let m = &self.inner.metrics;
        m.keys.set(stat.keys as i64);
        m.segments.set(stat.segments.len() as i64);
        m.evictions.set(stat.evictions as i64);
        m.evicted_bytes.set(stat.evicted_bytes as i64);
        m.demotions.set(stat.demotions as i64);
        m.promotions.set(stat.promotions as i64);
        m.segment_capacity.clear();
        m.segment_used.clear();
        for s in &stat.segments {
            let l = kvpool_runtime::metrics::SegmentLabels {
                segment: s.name.clone(),
            };
            m.segment_capacity.get_or_create(&l).set(s.capacity as i64);
            m.segment_used.get_or_create(&l).set(s.used as i64);
        }
        Ok(())
    }
}

/// Starts the master on every shard. Returns once every shard listens.
/// With `key` (the cluster secret), every connection must authenticate
/// before its first request, and grants are signed for the data plane.
pub async fn start(
    shards: &ShardHandle,
    cfg: &MasterConfig,
    key: Option<ClusterKey>,
    metrics: &MetricsRegistry,
) -> Result<MasterHandle, NodeError> {
    let n = shards.nr_shards();
    let (addr, listeners) = kvpool_runtime::net::bind_sharded(&cfg.listen, n)?;
    let fence = if cfg.ha.is_empty() {
        Fence::single()
    } else {
        Fence::standby()
    };
    let map = ShardMap::new(n as u32)
        .ok_or_else(|| NodeError::Config(format!("{n} shards is more than {VSHARDS}")))?;
    let host = if addr.ip().is_unspecified() {
        // Clients reach the shards on the host they reached the master on.
        String::new()
    } else {
        addr.ip().to_string()
    };
    let cluster = ClusterMap {
        lease_ttl_ms: cfg.lease_ttl_ms,
        shards: (0..n as u32)
            .map(|i| {
                let (start, end) = vshard_range(&map, i);
                MasterShardAddr {
                    host: host.clone(),
                    port: addr.port() + i as u16,
                    vshard_start: start,
                    vshard_end: end,
                }
            })
            .collect(),
    };
    let mut inbox_tx = Vec::with_capacity(n);
    let mut inbox_rx = Vec::with_capacity(n);
    for _ in 0..n {
        let (tx, rx) = flume::bounded(cfg.inbox_depth);
        inbox_tx.push(tx);
        inbox_rx.push(rx);
    }
    let (admin_tx, admin_rx) = flume::bounded(cfg.inbox_depth);
    let master_metrics = MasterMetrics::register(metrics);
    let handle = MasterHandle {
        inner: Arc::new(HandleInner {
            inboxes: inbox_tx,
            admin: admin_tx,
            map,
            cluster,
            addr,
            max_batch: cfg.max_batch,
            metrics: master_metrics.clone(),
            fence: fence.clone(),
        }),
    };
    let shard_cfg = ShardConfig::from_master(cfg, n as u32);
    let server_limits = ServerLimits {
        max_connections: cfg.max_connections,
        idle_timeout: Duration::from_millis(cfg.idle_timeout_ms),
        io_timeout: Duration::from_millis(cfg.io_timeout_ms),
        first_frame_timeout: Duration::from_millis(cfg.first_frame_timeout_ms),
        max_frame_bytes: cfg.max_frame_bytes.get() as u32,
        frame_budget: kvpool_transport::frame::FrameBudget::new(cfg.max_frame_memory.get()),
        require_auth: key.is_some(),
    };
    let unix_at_zero_ms = kvpool_transport::auth::unix_ms().saturating_sub(now_ms());
    let signer = key.as_ref().map(|k| GrantSigner {
        key: k.clone(),
        unix_at_zero_ms,
    });
    let state_dir = (!cfg.state_dir.is_empty()).then(|| PathBuf::from(&cfg.state_dir));
    if let Some(d) = &state_dir {
        journal::check_meta(d, n as u32)
            .map_err(|e| NodeError::Config(format!("[master] state_dir: {e}")))?;
    }
    let sync = match cfg.state_sync {
        kvpool_config::StateSync::None => journal::Sync::None,
        kvpool_config::StateSync::Always => journal::Sync::Always,
    };
    let recover_wait_ms = cfg.client_ttl_ms;
    let tick = Duration::from_millis(cfg.tick_ms);
    let client_ttl_ms = cfg.client_ttl_ms;
    let seed: u64 = rand::random();
    let mut admin_rx = Some(admin_rx);
    let mut ready = Vec::with_capacity(n);
    for (i, (listener, rx)) in listeners.into_iter().zip(inbox_rx).enumerate() {
        let handle = handle.clone();
        let shard_cfg = shard_cfg.clone();
        let admin_rx = admin_rx.take();
        let metrics = master_metrics.clone();
        let signer = signer.clone();
        let key = key.clone();
        let server_limits = server_limits.clone();
        let term = fence.term_cell();
        let state_dir = state_dir.clone();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
        ready.push(ready_rx);
        shards
            .spawn_on(i, move |ctx: ShardCtx| async move {
                let (wake_tx, wake_rx) = flume::bounded(1);
                let mut st = ShardState::new(i as u32, n as u32, shard_cfg, seed)
                    .with_signer(signer)
                    .with_term(term);
                let mut log = None;
                if let Some(dir) = &state_dir {
                    // Replayed here, on the shard's own thread: every shard
                    // replays its log at once.
                    let started = Instant::now();
                    let sdir = journal::shard_dir(dir, i as u32);
                    match journal::open_shard(&sdir, sync) {
                        Ok(r) => {
                            let objects = r.image.objects.len();
                            st = st.with_durability(unix_at_zero_ms);
                            st.recover(r.image, now_ms(), recover_wait_ms);
                            tracing::info!(
                                shard = i,
                                objects,
                                torn_tail_cut = r.torn,
                                ms = started.elapsed().as_millis() as u64,
                                dir = %sdir.display(),
                                "master state recovered; objects wait for their segments to mount again"
                            );
                            log = Some(r.log);
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(format!("[master] state_dir: {e}")));
                            return;
                        }
                    }
                }
                let state = Rc::new(Shard {
                    state: RefCell::new(st),
                    evict_wake: wake_tx,
                    log: RefCell::new(log),
                    buf: RefCell::new(Vec::new()),
                    compacting: Arc::new(AtomicBool::new(false)),
                    snapshot_bytes: Cell::new(0),
                });
                glommio::spawn_local(inbox_loop(ctx.clone(), state.clone(), rx, metrics.clone()))
                    .detach();
                glommio::spawn_local(tick_loop(ctx.clone(), state.clone(), tick, metrics.clone()))
                    .detach();
                glommio::spawn_local(evict_loop(ctx.clone(), state.clone(), wake_rx)).detach();
                if let Some(admin_rx) = admin_rx {
                    let coord = CoordState::new(client_ttl_ms);
                    glommio::spawn_local(coordinator(
                        ctx.clone(),
                        handle.clone(),
                        coord,
                        admin_rx,
                        tick,
                    ))
                    .detach();
                }
                let listener = server::into_glommio(listener);
                let handler = Rc::new(MasterConn {
                    shard: i as u32,
                    state,
                    handle,
                    io_timeout: server_limits.io_timeout,
                    metrics,
                    key,
                    refusals: RefusalLog::default(),
                });
                let _ = ready_tx.send(Ok(()));
                server::serve(ctx, listener, server_limits, "master", handler).await;
            })
            .await?;
    }
    for r in ready {
        r.await
            .map_err(|_| NodeError::Start("a master shard failed to start".into()))?
            .map_err(NodeError::Config)?;
    }
    Ok(handle)
}

fn vshard_range(map: &ShardMap, shard: u32) -> (u32, u32) {
    let start = (0..VSHARDS)
        .find(|v| map.shard_of_vshard(*v) == shard)
        .unwrap_or(0);
    let end = (start..VSHARDS)
        .find(|v| map.shard_of_vshard(*v) != shard)
        .unwrap_or(VSHARDS);
    (start, end)
}

/// One master shard on its glommio shard: its state, and the bell of its
/// eviction task.
struct Shard {
    state: RefCell<ShardState>,
    /// Rung (a bounded queue of one: a ring while one is pending is lost,
    /// which is fine) when the state owes a range an eviction episode.
    evict_wake: flume::Sender<()>,
    /// The shard's log in the state directory (`None`: no state directory).
    log: RefCell<Option<LogWriter>>,
    /// Records on their way to the log.
    buf: RefCell<Vec<u8>>,
    /// A compaction is under way (its last part runs on a helper thread).
    compacting: Arc<AtomicBool>,
    /// Size of the last snapshot written.
    snapshot_bytes: Cell<u64>,
}

/// The log is compacted once it is past this size...
const COMPACT_MIN_LOG_BYTES: u64 = 64 << 20;
/// ...and this many times the last snapshot.
const COMPACT_LOG_RATIO: u64 = 4;
/// Objects one step of a snapshot writes before requests run again.
const SNAPSHOT_STEP_OBJECTS: usize = 4096;

impl Shard {
    /// Writes the records of every change since the last commit to the
    /// log. Called after each request, command, tick and eviction step,
    /// before any reply goes out. A master that cannot write its log
    /// stops: answering would promise what a restart forgets.
    fn commit(&self) {
        let mut log = self.log.borrow_mut();
        let Some(log) = log.as_mut() else { return };
        let mut buf = self.buf.borrow_mut();
        buf.clear();
        self.state.borrow_mut().take_records(&mut buf);
        if let Err(e) = log.append(&buf) {
            tracing::error!("the master cannot write its state log ({e}): stopping");
            eprintln!("error: the master cannot write its state log ({e}): stopping");
            std::process::exit(70);
        }
    }

    /// Starts a compaction if the log has grown past its bounds.
    fn maybe_compact(self: &Rc<Self>, ctx: &ShardCtx) {
        let bytes = match self.log.borrow().as_ref() {
            Some(l) => l.bytes,
            None => return,
        };
        if bytes < COMPACT_MIN_LOG_BYTES
            || bytes < COMPACT_LOG_RATIO.saturating_mul(self.snapshot_bytes.get())
            || self.compacting.swap(true, Ordering::AcqRel)
        {
            return;
        }
        glommio::spawn_local(compact(ctx.clone(), self.clone())).detach();
    }

    /// Wakes the eviction task if the state owes an episode.
    fn wake_eviction(&self) {
        if self.state.borrow().evicting() {
            let _ = self.evict_wake.try_send(());
        }
    }
}

/// Applies a request to this shard's state, with metrics.
fn apply_local(
    shard: &Shard,
    metrics: &MasterMetrics,
    req: MasterRequest,
) -> Result<MasterResponse, KvError> {
    let op = req.op_name();
    let started = Instant::now();
    let res = shard.state.borrow_mut().apply(req, now_ms());
    shard.commit();
    metrics.observe(op, res.is_ok(), started.elapsed());
    shard.wake_eviction();
    res
}

/// Evicts for the ranges of this shard that are owed an episode, off the
/// request path: a bounded step (`EVICT_STEP_VICTIMS` replicas), then a
/// pause that lets the executor poll its sockets and run the requests that
/// came in, then the next step, until nothing is owed; then it sleeps until
/// woken.
async fn evict_loop(ctx: ShardCtx, shard: Rc<Shard>, wake: flume::Receiver<()>) {
    loop {
        let woken = futures_lite::future::or(async { wake.recv_async().await.is_ok() }, async {
            ctx.shutdown().wait().await;
            false
        })
        .await;
        if !woken {
            break;
        }
        loop {
            let more = shard
                .state
                .borrow_mut()
                .evict_step(now_ms(), EVICT_STEP_VICTIMS);
            shard.commit();
            if !more {
                break;
            }
            // A timer, not a bare yield: a task that only yields stays in
            // its task queue until the preemption timer, without the
            // executor polling its sockets; a timer waits for that poll.
            glommio::timer::sleep(EVICT_PAUSE).await;
            if ctx.shutdown().is_triggered() {
                return;
            }
        }
    }
}

/// Compacts this shard's log: starts a new log, writes a snapshot of the
/// state in bounded steps with requests served between them (each key's
/// record is its state at some time after the new log began, which the new
/// log brings up to date), then syncs it and drops the old files on a
/// helper thread.
async fn compact(ctx: ShardCtx, shard: Rc<Shard>) {
    let started = Instant::now();
    let w = shard.log.borrow_mut().as_mut().map(|l| l.rotate());
    let mut w = match w {
        Some(Ok(w)) => w,
        Some(Err(e)) => {
            tracing::warn!("compaction of the master log could not start: {e}");
            shard.compacting.store(false, Ordering::Release);
            return;
        }
        None => return,
    };
    let mut cur = SnapshotCursor::default();
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let done = shard
            .state
            .borrow()
            .snapshot_step(&mut cur, SNAPSHOT_STEP_OBJECTS, &mut buf);
        if let Err(e) = w.write(&buf) {
            tracing::warn!("master snapshot: {e}; the logs stay");
            shard.compacting.store(false, Ordering::Release);
            return;
        }
        if done {
            break;
        }
        glommio::timer::sleep(EVICT_PAUSE).await;
        if ctx.shutdown().is_triggered() {
            return;
        }
    }
    shard.snapshot_bytes.set(w.bytes);
    let flag = shard.compacting.clone();
    let shard_id = ctx.id();
    let bytes = w.bytes;
    std::thread::spawn(move || {
        match w.finish() {
            Ok(()) => tracing::info!(
                shard = shard_id,
                bytes,
                ms = started.elapsed().as_millis() as u64,
                "master log compacted"
            ),
            Err(e) => tracing::warn!("master snapshot: {e}; the logs stay"),
        }
        flag.store(false, Ordering::Release);
    });
}

/// The pause between two eviction steps (see `evict_loop`).
const EVICT_PAUSE: Duration = Duration::from_micros(1);

/// Applies forwarded requests and coordinator commands to this shard's state.
async fn inbox_loop(
    ctx: ShardCtx,
    state: Rc<Shard>,
    rx: flume::Receiver<ShardMsg>,
    metrics: MasterMetrics,
) {
    loop {
        let msg = futures_lite::future::or(async { rx.recv_async().await.ok() }, async {
            ctx.shutdown().wait().await;
            None
        })
        .await;
        let Some(msg) = msg else { break };
        match msg {
            ShardMsg::Request { req, reply } => reply(apply_local(&state, &metrics, req)),
            ShardMsg::Command { cmd, done } => {
                let r = state.state.borrow_mut().command(&cmd, now_ms());
                state.commit();
                let _ = done.send(r);
                state.wake_eviction();
            }
            ShardMsg::Probe(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// Housekeeping of one shard every `tick`.
async fn tick_loop(ctx: ShardCtx, state: Rc<Shard>, tick: Duration, metrics: MasterMetrics) {
    loop {
        let stop = futures_lite::future::or(
            async {
                glommio::timer::sleep(tick).await;
                false
            },
            async {
                ctx.shutdown().wait().await;
                true
            },
        )
        .await;
        if stop {
            break;
        }
        let r = state.state.borrow_mut().tick(now_ms());
        state.commit();
        state.maybe_compact(&ctx);
        state.wake_eviction();
        if r.stale_discarded > 0 {
            metrics.stale_puts.inc_by(r.stale_discarded);
            tracing::info!(
                shard = ctx.id(),
                puts = r.stale_discarded,
                "discarded stale puts"
            );
        }
    }
}

/// Runs admin operations one at a time, so every shard applies them in the
/// same order; checks liveness every `tick`.
async fn coordinator(
    ctx: ShardCtx,
    handle: MasterHandle,
    mut coord: CoordState,
    rx: flume::Receiver<AdminMsg>,
    tick: Duration,
) {
    let mut next_tick = Instant::now() + tick;
    loop {
        let wait = next_tick.saturating_duration_since(Instant::now());
        let msg = futures_lite::future::or(
            async { Some(rx.recv_async().await.map_err(|_| ())) },
            futures_lite::future::or(
                async {
                    glommio::timer::sleep(wait).await;
                    None
                },
                async {
                    ctx.shutdown().wait().await;
                    Some(Err(()))
                },
            ),
        )
        .await;
        match msg {
            Some(Err(())) => break,
            Some(Ok(AdminMsg { req, reply })) => {
                let res = match coord.decide(req, now_ms()) {
                    Err(e) => Err(e),
                    Ok(Decision::Answer(r)) => Ok(r),
                    Ok(Decision::Broadcast { cmd, finish }) => {
                        match broadcast(&handle, cmd).await {
                            Ok(results) => Ok(coord.finish(finish, results)),
                            Err(e) => Err(e),
                        }
                    }
                };
                reply(res);
            }
            None => {}
        }
        if Instant::now() >= next_tick {
            next_tick = Instant::now() + tick;
            let expired = coord.expire(now_ms());
            for cmd in expired.commands {
                if let Err(e) = broadcast(&handle, cmd).await {
                    tracing::warn!("liveness: {e}");
                }
            }
        }
    }
}

async fn broadcast(
    handle: &MasterHandle,
    cmd: ShardCommand,
) -> Result<Vec<CommandResult>, KvError> {
    let inboxes = &handle.inner.inboxes;
    let mut acks = Vec::with_capacity(inboxes.len());
    for tx in inboxes {
        let (done, rx) = tokio::sync::oneshot::channel();
        tx.send_async(ShardMsg::Command {
            cmd: cmd.clone(),
            done,
        })
        .await
        .map_err(|_| unavailable())?;
        acks.push(rx);
    }
    let mut out = Vec::with_capacity(acks.len());
    for a in acks {
        out.push(a.await.map_err(|_| unavailable())?);
    }
    Ok(out)
}

/// Serves master RPC on one shard.
struct MasterConn {
    shard: u32,
    state: Rc<Shard>,
    handle: MasterHandle,
    io_timeout: Duration,
    metrics: MasterMetrics,
    /// The cluster secret: connections authenticate before anything else.
    key: Option<ClusterKey>,
    refusals: RefusalLog,
}

impl MasterConn {
    async fn dispatch(&self, req: MasterRequest) -> Result<MasterResponse, KvError> {
        let map = &self.handle.inner.map;
        let n = self.handle.inner.inboxes.len();
        match route::target(&req, |k| map.shard_of(k), n)? {
            // This shard's own keys and task queue: no channel hop.
            Target::Shard(s) if s == self.shard as usize => {
                apply_local(&self.state, &self.metrics, req)
            }
            Target::Batch => {
                if let Some(empty) = check_batch(&req, self.handle.inner.max_batch)? {
                    return Ok(empty);
                }
                let n = req.batch_keys().map(|k| k.len()).unwrap_or(0);
                let parts = split_batch(req, map);
                let mut answers = Vec::with_capacity(parts.len());
                let mut remote = Vec::new();
                for p in parts {
                    if p.shard == self.shard {
                        answers.push((p.positions, apply_local(&self.state, &self.metrics, p.req)));
                    } else {
                        remote.push(p);
                    }
                }
                if !remote.is_empty() {
                    answers.extend(self.handle.forward_parts(remote).await);
                }
                merge_batch(n, answers)
            }
            _ => self.handle.request(req).await,
        }
    }

    /// The handshake, and the gate in front of every other request. `Ok`:
    /// dispatch the request; `Err`: answer this instead (and whether to
    /// close the connection).
    fn admit(
        &self,
        req: &MasterRequest,
        conn: &mut ConnState,
    ) -> Result<(), (Result<MasterResponse, KvError>, bool)> {
        use kvpool_transport::auth;
        let refuse = |e: KvError| Err((Err(e), true));
        let Some(key) = &self.key else {
            return match req {
                MasterRequest::AuthBegin { .. } | MasterRequest::AuthProve { .. } => {
                    refuse(KvError::new(
                        ErrorCode::Unsupported,
                        "this master runs without a cluster secret: it cannot prove itself",
                    ))
                }
                _ => Ok(()),
            };
        };
        match req {
            MasterRequest::AuthBegin { client_id, nonce } => {
                if conn.authenticated || conn.challenge.is_some() {
                    return refuse(KvError::new(
                        ErrorCode::InvalidParams,
                        "a connection authenticates once",
                    ));
                }
                let ns = auth::nonce();
                conn.challenge = Some((*client_id, *nonce, ns));
                Err((Ok(MasterResponse::AuthChallenge { nonce: ns }), false))
            }
            MasterRequest::AuthProve { proof } => {
                let Some((id, nc, ns)) = conn.challenge.take() else {
                    return refuse(KvError::new(
                        ErrorCode::InvalidParams,
                        "AuthProve without AuthBegin",
                    ));
                };
                if let Err(e) = key.verify_client_proof(id, &nc, &ns, proof) {
                    self.metrics.auth_refusals.inc();
                    self.refusals.refused("master", "a connection's proof", &e);
                    return refuse(e);
                }
                conn.authenticated = true;
                conn.client_id = Some(id);
                Err((
                    Ok(MasterResponse::AuthOk {
                        proof: key.server_proof(id, &nc, &ns),
                    }),
                    false,
                ))
            }
            _ if !conn.authenticated => {
                let e = KvError::new(
                    ErrorCode::Unauthenticated,
                    format!(
                        "{} refused: this cluster requires the cluster secret \
                         (set KVPOOL_SECRET or [security] secret)",
                        req.op_name()
                    ),
                );
                self.metrics.auth_refusals.inc();
                self.refusals.refused(
                    "master",
                    &format!("an unauthenticated {}", req.op_name()),
                    &e,
                );
                refuse(e)
            }
            _ => match (req.client_id(), conn.client_id) {
                (Some(named), Some(own)) if named != own => Err((
                    Err(KvError::new(
                        ErrorCode::IllegalClient,
                        format!(
                            "{} names client {named:#x}; this connection is client {own:#x}",
                            req.op_name()
                        ),
                    )),
                    false,
                )),
                _ => Ok(()),
            },
        }
    }
}

impl Handler for MasterConn {
    async fn handle(
        &self,
        hdr: FrameHeader,
        payload: kvpool_transport::frame::AlignedVec,
        stream: &mut TcpStream,
        conn: &mut ConnState,
    ) -> Next {
        let Some(req) = server::open_request::<MasterRequest>(
            stream,
            &hdr,
            &payload,
            FrameKind::MasterRequest,
            "master",
        )
        .await
        else {
            return Next::Close;
        };
        drop(payload);
        let op = req.op_name();
        let fence = &self.handle.inner.fence;
        let (res, close) = match self.admit(&req, conn) {
            Err(answer) => answer,
            // Not the leader (a standby, or past its lease): nothing is
            // served, the caller is told who leads.
            Ok(()) => match fence.admit() {
                Err(e) => (Err(e), false),
                Ok(()) => {
                    let r = match glommio::timer::timeout(self.io_timeout, async {
                        Ok(self.dispatch(req).await)
                    })
                    .await
                    {
                        Ok(r) => r,
                        Err(_) => Err(KvError::new(
                            ErrorCode::Timeout,
                            format!("{op} was not answered within {:?}", self.io_timeout),
                        )),
                    };
                    // Checked again as the answer leaves: a leader stalled
                    // past its lease while serving sends nothing it decided.
                    (r.and_then(|r| fence.admit().map(|()| r)), false)
                }
            },
        };
        let bytes = match &res {
            Ok(resp) => frame::encode(FrameKind::MasterResponse, hdr.request_id, resp),
            Err(e) => frame::encode_error(hdr.request_id, e),
        };
        match server::answer_within(stream, &bytes, self.io_timeout).await {
            Next::Continue if !close => Next::Continue,
            _ => Next::Close,
        }
    }
}
