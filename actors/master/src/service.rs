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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::net::TcpStream;
use kvpool_runtime::hash::{ShardMap, VSHARDS};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardCtx, ShardHandle};
use kvpool_wire::auth::ClusterKey;
use kvpool_wire::frame::{self, FrameHeader, FrameKind};
use kvpool_wire::proto::call::{self, Call};
use kvpool_wire::proto::{ClusterMap, MasterRequest, MasterResponse, MasterShardAddr, Shipped};
use kvpool_wire::{ErrorCode, KvError};

use super::coord::{CommandResult, CoordState, Decision, ShardCommand};
use super::core::check_batch;
use super::journal::{self, LogWriter};
use super::state::{GrantSigner, ShardConfig, ShardState, SnapshotCursor, EVICT_STEP_VICTIMS};
use crate::clock::now_ms;
use crate::fence::Fence;
use crate::metrics::MasterMetrics;
use crate::ship::{self, Shipping, Standby};
use kvpool_config::MasterConfig;
use kvpool_config::NodeError;
use kvpool_wire::route::{self, merge_batch, split_batch, Target};
use kvpool_wire::server::{self, ConnState, Handler, Next, RefusalLog, ServerLimits};

mod conn;
use conn::*;

mod follow;
use follow::*;

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
    /// HA: this master won the election. The shard stops following the
    /// old leader and takes the copy of its state it was shipped
    /// (docs/architecture/ha.md, "Log shipping") as a restarted master takes
    /// its state directory; answered with the objects it recovered.
    TakeOver(tokio::sync::oneshot::Sender<Result<usize, String>>),
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
    /// HA, per shard: a standby's, 1 when its copy of the leader's shard is
    /// in sync; a leader's, how many standbys are in sync with it.
    ship_gauge: Arc<[AtomicU32]>,
    /// Per shard, as a standby: the term and session its copy is in sync
    /// at (0: none).
    synced_terms: Arc<[AtomicU64]>,
    synced_sessions: Arc<[AtomicU64]>,
    /// As a leader: dropped standby sessions to record in etcd before
    /// replies go out without them (the election task records them).
    drops: (flume::Sender<DropNote>, flume::Receiver<DropNote>),
}

/// Standby sessions a leader shard dropped while they were in sync: the
/// election task records them in etcd (so those standbys no longer stand
/// for election) and answers `done`; until then the shard's replies wait.
pub struct DropNote {
    pub sessions: Vec<u64>,
    pub done: tokio::sync::oneshot::Sender<Result<(), String>>,
}

/// How long a shard waits for a drop to be recorded before its master
/// stops leading (it could not tell etcd; its lease is in doubt as well).
const RECORD_TIMEOUT: Duration = Duration::from_secs(5);

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
        parts: Vec<kvpool_wire::route::BatchPart>,
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

    /// HA, per shard: as a standby, 1 when its copy of the leader's shard
    /// is in sync (else 0); as a leader, how many standbys are in sync with
    /// the shard (its replies wait for them).
    pub fn ship_status(&self) -> Vec<u32> {
        self.inner
            .ship_gauge
            .iter()
            .map(|v| v.load(Ordering::Relaxed))
            .collect()
    }

    /// HA, as a standby: the term every shard's copy is in sync at, and
    /// each shard's session, if every shard is in sync at one term.
    pub fn synced_copy(&self) -> Option<(u64, Vec<u64>)> {
        let mut terms = self
            .inner
            .synced_terms
            .iter()
            .map(|t| t.load(Ordering::Relaxed));
        let first = terms.next()?;
        if first == 0 || !terms.all(|t| t == first) {
            return None;
        }
        let sessions: Vec<u64> = self
            .inner
            .synced_sessions
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .collect();
        sessions
            .iter()
            .all(|&s| s != 0)
            .then_some((first, sessions))
    }

    /// HA, as a leader: the standby sessions its shards dropped while they
    /// were in sync, to be recorded in etcd ([`DropNote`]).
    pub fn drop_notes(&self) -> flume::Receiver<DropNote> {
        self.inner.drops.1.clone()
    }

    /// HA, once this master has won the election and before its fence
    /// opens: every shard loads the state the old leader shipped it
    /// (no deadline of its own: the election bounds it by the lease).
    /// Returns the objects recovered.
    pub async fn take_over(&self) -> Result<usize, String> {
        let mut total = 0;
        for (i, tx) in self.inner.inboxes.iter().enumerate() {
            let (done, rx) = tokio::sync::oneshot::channel();
            tx.send_async(ShardMsg::TakeOver(done))
                .await
                .map_err(|_| format!("master shard {i} has stopped"))?;
            total += rx
                .await
                .map_err(|_| format!("master shard {i} dropped the take-over"))??;
        }
        Ok(total)
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
        m.hot_copies.set(stat.hot_copies as i64);
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

/// Master shards when `master.shards` is 0: at most this many, the first
/// of the process's shards. Measured on a 16-core host (docs/benchmarks/many-core.md,
/// "Shard layout"): a key's master shard is a different core per key, and a
/// core that parks between requests costs ~40 us to wake; with 16 master
/// shards one client's 4 KiB get took 119 us, with 4 74 us (1: 75 us), and
/// 16 clients' gets/s grew more with 4 (76.6k) than with 16 (50.2k).
pub const AUTO_SHARDS: usize = 4;

/// Starts the master on its shards (`master.shards`: the first of the
/// process's). Returns once every shard listens.
/// With `key` (the cluster secret), every connection must authenticate
/// before its first request, and grants are signed for the data plane.
pub async fn start(
    shards: &ShardHandle,
    cfg: &MasterConfig,
    key: Option<ClusterKey>,
    metrics: &MetricsRegistry,
) -> Result<MasterHandle, NodeError> {
    let n = match cfg.shards {
        0 => shards.nr_shards().min(AUTO_SHARDS),
        k if k <= shards.nr_shards() => k,
        k => {
            return Err(NodeError::Config(format!(
                "key `master.shards`: {k} is more than the process's {} shards ([runtime] shards)",
                shards.nr_shards()
            )))
        }
    };
    tracing::info!(
        "master: keys on {n} of the process's {} shards (master.shards = {})",
        shards.nr_shards(),
        cfg.shards
    );
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
        hot_replicas: cfg.hot_replicas,
        max_batch: u32::try_from(cfg.max_batch).unwrap_or(u32::MAX),
        max_value_bytes: cfg.max_value_bytes.get(),
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
            ship_gauge: (0..n).map(|_| AtomicU32::new(0)).collect(),
            synced_terms: (0..n).map(|_| AtomicU64::new(0)).collect(),
            synced_sessions: (0..n).map(|_| AtomicU64::new(0)).collect(),
            drops: flume::bounded(64),
        }),
    };
    let shard_cfg = ShardConfig::from_master(cfg, n as u32);
    let server_limits = ServerLimits {
        max_connections: cfg.max_connections,
        idle_timeout: Duration::from_millis(cfg.idle_timeout_ms),
        io_timeout: Duration::from_millis(cfg.io_timeout_ms),
        first_frame_timeout: Duration::from_millis(cfg.first_frame_timeout_ms),
        max_frame_bytes: cfg.max_frame_bytes.get() as u32,
        frame_budget: kvpool_wire::frame::FrameBudget::new(cfg.max_frame_memory.get()),
        require_auth: key.is_some(),
    };
    let unix_at_zero_ms = kvpool_wire::auth::unix_ms().saturating_sub(now_ms());
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
    let ha = !cfg.ha.is_empty();
    let takeover_wait_ms = cfg.client_ttl_ms.saturating_add(cfg.io_timeout_ms);
    // Below the I/O timeout the reply is sent within, whatever the config
    // said (it is checked there only when `ha` was set in it).
    let sync_timeout = Duration::from_millis(cfg.ha_sync_timeout_ms.min(cfg.io_timeout_ms / 2));
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
                if ha || state_dir.is_some() {
                    st = st.with_durability(unix_at_zero_ms);
                }
                let mut log = None;
                let mut standby = Standby::default();
                if let Some(dir) = &state_dir {
                    // Replayed here, on the shard's own thread: every shard
                    // replays its log at once.
                    let started = Instant::now();
                    let sdir = journal::shard_dir(dir, i as u32);
                    match journal::open_shard(&sdir, sync) {
                        Ok(r) if ha => {
                            // A standby leads with what its directory
                            // holds only if no leader ships it a newer
                            // state before it wins.
                            tracing::info!(
                                shard = i,
                                objects = r.image.objects.len(),
                                dir = %sdir.display(),
                                "master state read; kept until this standby follows a leader"
                            );
                            standby.image = r.image;
                            log = Some(r.log);
                        }
                        Ok(r) => {
                            let objects = r.image.objects.len();
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
                    ha,
                    sync_timeout,
                    ship: RefCell::new(Shipping::default()),
                    ship_data: tokio::sync::Notify::new(),
                    ship_acked: tokio::sync::Notify::new(),
                    standby: RefCell::new(standby),
                    waiting: Cell::new(0),
                    takeover_wait_ms,
                    ship_gauge: handle.inner.ship_gauge.clone(),
                    synced_terms: handle.inner.synced_terms.clone(),
                    synced_sessions: handle.inner.synced_sessions.clone(),
                    fence: handle.inner.fence.clone(),
                    drops: handle.inner.drops.0.clone(),
                    ship_drops: tokio::sync::Notify::new(),
                    index: i,
                });
                glommio::spawn_local(inbox_loop(ctx.clone(), state.clone(), rx, metrics.clone()))
                    .detach();
                if ha {
                    glommio::spawn_local(record_drops(state.clone())).detach();
                    glommio::spawn_local(follow_loop(
                        ctx.clone(),
                        state.clone(),
                        FollowSetup {
                            shard: i as u32,
                            shards: n as u32,
                            map: ShardMap::new(n as u32).expect("checked above"),
                            fence: handle.inner.fence.clone(),
                            key: key.clone(),
                            io_timeout: server_limits.io_timeout,
                            max_frame: server_limits.max_frame_bytes,
                        },
                    ))
                    .detach();
                }
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
    /// HA: the shard ships its records to the standbys (as leader) or
    /// follows the leader's (as standby).
    ha: bool,
    /// How long a reply waits for the standbys in sync.
    sync_timeout: Duration,
    /// The sessions of the standbys that follow this shard (leader).
    ship: RefCell<Shipping>,
    /// Rung when records are appended to the sessions.
    ship_data: tokio::sync::Notify,
    /// Rung when a standby acknowledges, or a session is dropped.
    ship_acked: tokio::sync::Notify,
    /// The leader's state as shipped to this shard (standby).
    standby: RefCell<Standby>,
    /// Replies of forwarded requests waiting for the standbys.
    waiting: Cell<usize>,
    /// How long objects taken over wait for their segments: a node whose
    /// call hangs on a stalled old leader finds the new one only after that
    /// call's deadline, so longer than after a restart.
    takeover_wait_ms: u64,
    /// Where this shard's shipping state is shown ([`MasterHandle::ship_status`]).
    ship_gauge: Arc<[AtomicU32]>,
    synced_terms: Arc<[AtomicU64]>,
    synced_sessions: Arc<[AtomicU64]>,
    /// This master's fence (a leader that cannot record a drop stops).
    fence: Fence,
    /// Where dropped sessions go to be recorded, and the bell of
    /// [`record_drops`].
    drops: flume::Sender<DropNote>,
    ship_drops: tokio::sync::Notify,
    index: usize,
}

/// Most replies of forwarded requests one shard holds for the standbys at
/// once; beyond, its inbox waits (back-pressure).
const MAX_SHIP_WAITERS: usize = 4096;

/// The log is compacted once it is past this size...
const COMPACT_MIN_LOG_BYTES: u64 = 64 << 20;
/// ...and this many times the last snapshot.
const COMPACT_LOG_RATIO: u64 = 4;
/// Objects one step of a compaction snapshot writes before requests run
/// again (a standby's snapshot steps by `ship::SHIP_STEP_OBJECTS`).
const COMPACT_STEP_OBJECTS: usize = 4096;

impl Shard {
    /// Writes the records of every change since the last commit to the
    /// log. Called after each request, command, tick and eviction step,
    /// before any reply goes out. A master that cannot write its log
    /// stops: answering would promise what a restart forgets.
    fn commit(&self) {
        let mut buf = self.buf.borrow_mut();
        buf.clear();
        self.state.borrow_mut().take_records(&mut buf);
        if buf.is_empty() {
            return;
        }
        if let Some(log) = self.log.borrow_mut().as_mut() {
            if let Err(e) = log.append(&buf) {
                tracing::error!("the master cannot write its state log ({e}): stopping");
                eprintln!("error: the master cannot write its state log ({e}): stopping");
                std::process::exit(70);
            }
        }
        if self.ha {
            let dropped = self.ship.borrow_mut().append_live(&buf);
            for s in dropped {
                tracing::warn!(
                    session = format!("{s:x}"),
                    "a standby fell {} MiB behind: dropped; it starts again from a snapshot",
                    ship::FOLLOWER_BUFFER_BYTES >> 20
                );
            }
            self.ship_data.notify_waiters();
            self.ship_acked.notify_waiters();
            self.publish_ship();
        }
    }

    /// Shows this shard's shipping state: as a standby, whether its copy is
    /// in sync; as a leader, how many standbys are.
    fn publish_ship(&self) {
        let sb = self.standby.borrow();
        let v = if sb.stopped {
            self.ship.borrow().in_sync() as u32
        } else {
            u32::from(sb.synced)
        };
        self.ship_gauge[self.index].store(v, Ordering::Relaxed);
        let (term, session) = sb.synced_at().unwrap_or((0, 0));
        self.synced_terms[self.index].store(term, Ordering::Relaxed);
        self.synced_sessions[self.index].store(session, Ordering::Relaxed);
        if self.ship.borrow().drops_unrecorded() {
            self.ship_drops.notify_one();
        }
    }

    /// The live log's offset now (HA; compare after a request with
    /// [`Self::settle`]).
    fn mark(&self) -> u64 {
        if self.ha {
            self.ship.borrow().live()
        } else {
            0
        }
    }

    /// Waits until every standby in sync has the records committed since
    /// `from` (none: at once), for at most the sync timeout; the standbys
    /// that have not confirmed them by then are dropped from the sessions.
    async fn settle(&self, from: u64) {
        if !self.ha {
            return;
        }
        let mark = self.ship.borrow().live();
        if mark == from {
            return;
        }
        let deadline = Instant::now() + self.sync_timeout;
        // Past the deadline the lagging standbys are dropped; their drop
        // must then be recorded in etcd before the reply goes out.
        let hard = deadline + 2 * RECORD_TIMEOUT;
        let mut dropped = false;
        loop {
            let acked = self.ship_acked.notified();
            if self.ship.borrow().confirmed(mark) {
                return;
            }
            let now = Instant::now();
            if now >= hard {
                // Not recorded in time: answering would let a standby that
                // lacks these records lead. This master stops leading (its
                // replies are refused at the fence).
                tracing::error!(
                    "a dropped standby could not be recorded in etcd within {:?}: this master \
                     stops leading",
                    2 * RECORD_TIMEOUT
                );
                self.fence.depose();
                return;
            }
            let left = if dropped { hard } else { deadline }.saturating_duration_since(now);
            let woken = futures_lite::future::or(
                async {
                    acked.await;
                    true
                },
                async {
                    glommio::timer::sleep(left).await;
                    false
                },
            )
            .await;
            if !woken && !dropped && Instant::now() >= deadline {
                dropped = true;
                let lagging = self.ship.borrow_mut().drop_lagging(mark);
                for s in lagging {
                    tracing::warn!(
                        session = format!("{s:x}"),
                        "a standby did not confirm the log within {:?}: dropped; replies no \
                         longer wait for it, and it starts again from a snapshot",
                        self.sync_timeout
                    );
                }
                self.ship_acked.notify_waiters();
                self.publish_ship();
            }
        }
    }

    /// Writes the next step of a snapshot of the state (at most `budget`
    /// objects) to `w`; whether the snapshot is complete.
    fn snapshot_into(
        &self,
        cur: &mut SnapshotCursor,
        budget: usize,
        buf: &mut Vec<u8>,
        w: &mut journal::SnapshotWriter,
    ) -> Result<bool, journal::JournalError> {
        buf.clear();
        let done = self.state.borrow().snapshot_step(cur, budget, buf);
        w.write(buf)?;
        Ok(done)
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
        match shard.snapshot_into(&mut cur, COMPACT_STEP_OBJECTS, &mut buf, &mut w) {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                tracing::warn!("master snapshot: {e}; the logs stay");
                shard.compacting.store(false, Ordering::Release);
                return;
            }
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
            ShardMsg::Request { req, reply } => {
                let from = state.mark();
                let r = apply_local(&state, &metrics, req);
                reply_settled(&state, from, move || reply(r)).await;
            }
            ShardMsg::Command { cmd, done } => {
                let from = state.mark();
                let r = state.state.borrow_mut().command(&cmd, now_ms());
                state.commit();
                state.wake_eviction();
                reply_settled(&state, from, move || {
                    let _ = done.send(r);
                })
                .await;
            }
            ShardMsg::Probe(done) => {
                let _ = done.send(());
            }
            ShardMsg::TakeOver(done) => {
                let _ = done.send(take_over(&ctx, &state).await);
            }
        }
    }
}

/// Answers (`reply`) once the standbys have the records committed since
/// `from`: at once when there are none to wait for; otherwise from a task
/// of its own, so the inbox goes on (at most [`MAX_SHIP_WAITERS`] such
/// tasks; beyond, here).
async fn reply_settled(state: &Rc<Shard>, from: u64, reply: impl FnOnce() + 'static) {
    if !state.ha || state.mark() == from || state.ship.borrow().confirmed(state.mark()) {
        return reply();
    }
    if state.waiting.get() >= MAX_SHIP_WAITERS {
        state.settle(from).await;
        return reply();
    }
    state.waiting.set(state.waiting.get() + 1);
    let state = state.clone();
    glommio::spawn_local(async move {
        state.settle(from).await;
        state.waiting.set(state.waiting.get() - 1);
        reply();
    })
    .detach();
}

/// This master won the election: stop following, and recover the shipped
/// state as a restarted master recovers its directory (objects wait for
/// their segments to mount again; holds keep their space). With a state
/// directory, the directory is then rewritten to that state (a new
/// snapshot), so a restart of this master remembers what it leads with.
async fn take_over(ctx: &ShardCtx, shard: &Rc<Shard>) -> Result<usize, String> {
    let image = {
        let mut sb = shard.standby.borrow_mut();
        if sb.stopped {
            return Ok(0);
        }
        sb.stopped = true;
        if sb.session != 0 && !sb.synced {
            tracing::warn!(
                shard = ctx.id(),
                "this standby had not received the leader's whole snapshot: it leads with part \
                 of the old leader's objects"
            );
        }
        std::mem::take(&mut sb.image)
    };
    shard.publish_ship();
    let objects = image.objects.len();
    shard
        .state
        .borrow_mut()
        .recover(image, now_ms(), shard.takeover_wait_ms);
    shard.commit();
    let w = shard.log.borrow_mut().as_mut().map(|l| l.rotate());
    if let Some(w) = w {
        let mut w = w.map_err(|e| format!("[master] state_dir: {e}"))?;
        let mut cur = SnapshotCursor::default();
        let mut buf = Vec::new();
        while !shard
            .snapshot_into(&mut cur, usize::MAX, &mut buf, &mut w)
            .map_err(|e| format!("[master] state_dir: {e}"))?
        {}
        w.finish().map_err(|e| format!("[master] state_dir: {e}"))?;
    }
    tracing::info!(
        shard = ctx.id(),
        objects,
        "took over the shipped state; objects wait for their segments to mount again"
    );
    Ok(objects)
}

/// Records the standby sessions this (leader) shard dropped while they were
/// in sync, through the election task, then lets the replies that waited
/// for them go; a master that cannot record them stops leading.
async fn record_drops(shard: Rc<Shard>) {
    loop {
        // Rung by `publish_ship`, which every drop is followed by (a ring
        // with nobody waiting is kept for the next wait).
        shard.ship_drops.notified().await;
        let sessions = shard.ship.borrow_mut().begin_recording();
        if sessions.is_empty() {
            continue;
        }
        let (done, rx) = tokio::sync::oneshot::channel();
        let note = DropNote {
            sessions: sessions.clone(),
            done,
        };
        let r = futures_lite::future::or(
            async {
                shard
                    .drops
                    .send_async(note)
                    .await
                    .map_err(|_| "no election task takes it".to_string())?;
                rx.await
                    .map_err(|_| "the election task dropped it".to_string())?
            },
            async {
                glommio::timer::sleep(RECORD_TIMEOUT).await;
                Err(format!("no answer within {RECORD_TIMEOUT:?}"))
            },
        )
        .await;
        if let Err(e) = r {
            tracing::error!(
                "the drop of standby sessions {sessions:x?} could not be recorded in etcd ({e}): \
                 this master stops leading"
            );
            shard.fence.depose();
        }
        // Recorded, or the fence refuses every reply from now on.
        shard.ship.borrow_mut().recorded(&sessions);
        shard.ship_acked.notify_waiters();
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
        if state.ha {
            // A standby that stopped asking is dropped (its polls come at
            // least every POLL_WAIT plus a round trip).
            let silent = Instant::now().checked_sub(state.sync_timeout + ship::POLL_WAIT * 2);
            let dropped = silent.map_or_else(Vec::new, |t| state.ship.borrow_mut().drop_silent(t));
            for s in dropped {
                tracing::warn!(
                    session = format!("{s:x}"),
                    "a standby stopped following: dropped"
                );
                state.ship_acked.notify_waiters();
            }
            state.publish_ship();
        }
        state.maybe_compact(&ctx);
        state.wake_eviction();
        if r.fewer_replicas > 0 {
            metrics.fewer_replicas.inc_by(r.fewer_replicas);
            tracing::warn!(
                shard = ctx.id(),
                puts = r.fewer_replicas,
                "puts acknowledged with fewer replicas than they asked for: too few \
                 segments with room (a node dead or full)"
            );
        }
        if r.fills_expired > 0 {
            tracing::warn!(
                shard = ctx.id(),
                fills = r.fills_expired,
                "promotions or fetches given up: their node did not report within put_timeout_ms"
            );
        }
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
