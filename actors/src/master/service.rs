//! The master as it runs: one metadata shard per glommio shard.
//!
//! ```text
//!  client --TCP--> shard i port (base+i)
//!                    | key owned by i?  yes -> ShardState (local, no channel)
//!                    |                  no  -> inbox of owner (flume, bounded) -> reply
//!                    | admin op (mount, unmount, stat, remove_all, ping)
//!                    +-> coordinator on shard 0 (one op at a time) -> every inbox -> acks
//!  actor / HTTP (tokio) --MasterHandle::call--> same inboxes and coordinator
//! ```
//!
//! Admin operations go through one coordinator so that every shard sees
//! mounts and unmounts in the same order. No lock guards metadata: each
//! shard's state lives in its own thread and is reached by message.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use glommio::net::TcpStream;
use kvpool_runtime::hash::{ShardMap, VSHARDS};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardCtx, ShardHandle};
use kvpool_transport::frame::{self, FrameHeader, FrameKind};
use kvpool_transport::proto::{
    segment_id_for, ClientId, ClusterMap, MasterRequest, MasterResponse, MasterShardAddr, PoolStat,
    SegmentId, SegmentSpec, SegmentStat,
};
use kvpool_transport::{ErrorCode, KvError};

use super::state::{Limits, ShardStat, ShardState};
use crate::clock::now_ms;
use crate::config::MasterConfig;
use crate::metrics::MasterMetrics;
use crate::server::{self, Handler, Next, ServerLimits};
use crate::NodeError;

/// A reply sink for a request routed to a shard; called exactly once.
pub type Reply = Box<dyn FnOnce(Result<MasterResponse, KvError>) + Send>;

/// Messages a master shard's inbox takes.
enum ShardMsg {
    /// A key request forwarded from another shard or the actor side.
    Key { req: MasterRequest, reply: Reply },
    AddSegment {
        id: SegmentId,
        spec: Arc<SegmentSpec>,
        done: tokio::sync::oneshot::Sender<()>,
    },
    RemoveSegment {
        id: SegmentId,
        done: tokio::sync::oneshot::Sender<u64>,
    },
    Stat {
        done: tokio::sync::oneshot::Sender<ShardStat>,
    },
    RemoveAll {
        done: tokio::sync::oneshot::Sender<u64>,
    },
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
    metrics: MasterMetrics,
}

impl MasterHandle {
    /// The base RPC address (shard 0).
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    pub fn cluster_map(&self) -> &ClusterMap {
        &self.inner.cluster
    }

    /// Routes a request to the shard that owns it; `reply` gets the answer.
    /// Waits only for room in the target queue (back-pressure).
    pub async fn submit(&self, req: MasterRequest, reply: Reply) {
        let unavailable = || KvError::new(ErrorCode::Unavailable, "the master is shutting down");
        if let MasterRequest::Hello { .. } = req {
            reply(Ok(MasterResponse::Hello {
                cluster: self.inner.cluster.clone(),
            }));
            return;
        }
        match req.key() {
            Some(key) => {
                let shard = self.inner.map.shard_of(key) as usize;
                if let Err(flume::SendError(ShardMsg::Key { reply, .. })) = self.inner.inboxes
                    [shard]
                    .send_async(ShardMsg::Key { req, reply })
                    .await
                {
                    reply(Err(unavailable()));
                }
            }
            None => {
                if let Err(flume::SendError(m)) =
                    self.inner.admin.send_async(AdminMsg { req, reply }).await
                {
                    (m.reply)(Err(unavailable()));
                }
            }
        }
    }

    /// Brings the pool gauges (keys, segment capacity and use) up to date;
    /// called before `/metrics` is rendered.
    pub async fn refresh_gauges(&self) -> Result<(), KvError> {
        let MasterResponse::Stat(stat) = self.call(MasterRequest::Stat).await? else {
            return Err(KvError::new(
                ErrorCode::Internal,
                "stat answered with something else",
            ));
        };
        let m = &self.inner.metrics;
        m.keys.set(stat.keys as i64);
        m.segments.set(stat.segments.len() as i64);
        m.segment_capacity.clear();
        m.segment_used.clear();
        for s in &stat.segments {
            let l = crate::metrics::SegmentLabels {
                segment: s.name.clone(),
            };
            m.segment_capacity.get_or_create(&l).set(s.capacity as i64);
            m.segment_used.get_or_create(&l).set(s.used as i64);
        }
        Ok(())
    }

    /// Sends a request and waits for its answer (no deadline of its own: the
    /// caller wraps it in its runtime's timeout).
    pub async fn call(&self, req: MasterRequest) -> Result<MasterResponse, KvError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(
            req,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        )
        .await;
        rx.await.unwrap_or_else(|_| {
            Err(KvError::new(
                ErrorCode::Unavailable,
                "the master shard stopped before answering",
            ))
        })
    }
}

/// Starts the master on every shard. Returns once every shard listens.
pub async fn start(
    shards: &ShardHandle,
    cfg: &MasterConfig,
    metrics: &MetricsRegistry,
) -> Result<MasterHandle, NodeError> {
    let n = shards.nr_shards();
    let (addr, listeners) = kvpool_runtime::net::bind_sharded(&cfg.listen, n)?;
    let map = ShardMap::new(n as u32)
        .ok_or_else(|| NodeError::Config(format!("{n} shards is more than {VSHARDS}")))?;
    let host = if addr.ip().is_unspecified() {
        // Clients reach the shards on the host they reached the master on.
        String::new()
    } else {
        addr.ip().to_string()
    };
    let cluster = ClusterMap {
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
            metrics: master_metrics.clone(),
        }),
    };
    let limits = Limits {
        max_key_bytes: cfg.max_key_bytes,
        max_value_bytes: cfg.max_value_bytes.get(),
        max_keys: cfg.max_keys.div_ceil(n as u64),
    };
    let server_limits = ServerLimits {
        max_connections: cfg.max_connections,
        idle_timeout: Duration::from_millis(cfg.idle_timeout_ms),
        io_timeout: Duration::from_millis(cfg.io_timeout_ms),
        max_frame_bytes: cfg.max_frame_bytes.get() as u32,
    };
    let mut admin_rx = Some(admin_rx);
    let mut ready = Vec::with_capacity(n);
    for (i, (listener, rx)) in listeners.into_iter().zip(inbox_rx).enumerate() {
        let handle = handle.clone();
        let limits = limits.clone();
        let admin_rx = admin_rx.take();
        let metrics = master_metrics.clone();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
        ready.push(ready_rx);
        shards
            .spawn_on(i, move |ctx: ShardCtx| async move {
                let state = Rc::new(RefCell::new(ShardState::new(i as u32, n as u32, limits)));
                glommio::spawn_local(inbox_loop(ctx.clone(), state.clone(), rx, metrics.clone()))
                    .detach();
                if let Some(admin_rx) = admin_rx {
                    glommio::spawn_local(coordinator(ctx.clone(), handle.clone(), admin_rx))
                        .detach();
                }
                let listener = server::into_glommio(listener);
                let handler = Rc::new(MasterConn {
                    shard: i as u32,
                    state,
                    handle,
                    io_timeout: server_limits.io_timeout,
                    max_frame: server_limits.max_frame_bytes,
                    metrics,
                });
                let _ = ready_tx.send(());
                server::serve(ctx, listener, server_limits, "master", handler).await;
            })
            .await?;
    }
    for r in ready {
        r.await
            .map_err(|_| NodeError::Start("a master shard failed to start".into()))?;
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

/// Applies forwarded requests and cross-shard commands to this shard's state.
async fn inbox_loop(
    ctx: ShardCtx,
    state: Rc<RefCell<ShardState>>,
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
            ShardMsg::Key { req, reply } => {
                let op = req.op_name();
                let started = std::time::Instant::now();
                let res = state.borrow_mut().apply(req, now_ms());
                metrics.observe(op, res.is_ok(), started.elapsed());
                reply(res);
            }
            ShardMsg::AddSegment { id, spec, done } => {
                state.borrow_mut().add_segment(id, spec);
                let _ = done.send(());
            }
            ShardMsg::RemoveSegment { id, done } => {
                let _ = done.send(state.borrow_mut().remove_segment(id));
            }
            ShardMsg::Stat { done } => {
                let _ = done.send(state.borrow().stat());
            }
            ShardMsg::RemoveAll { done } => {
                let _ = done.send(state.borrow_mut().remove_all(now_ms()));
            }
        }
    }
}

/// A mounted segment as the coordinator knows it.
struct MountedSegment {
    id: SegmentId,
    spec: Arc<SegmentSpec>,
    owner: ClientId,
}

/// Runs admin operations one at a time, so every shard applies them in the
/// same order.
async fn coordinator(ctx: ShardCtx, handle: MasterHandle, rx: flume::Receiver<AdminMsg>) {
    let mut by_name: HashMap<String, MountedSegment> = HashMap::new();
    let mut last_ping: HashMap<ClientId, u64> = HashMap::new();
    loop {
        let msg = futures_lite::future::or(async { rx.recv_async().await.ok() }, async {
            ctx.shutdown().wait().await;
            None
        })
        .await;
        let Some(AdminMsg { req, reply }) = msg else {
            break;
        };
        let res = admin(&handle, &mut by_name, &mut last_ping, req).await;
        reply(res);
    }
}

async fn admin(
    handle: &MasterHandle,
    by_name: &mut HashMap<String, MountedSegment>,
    last_ping: &mut HashMap<ClientId, u64>,
    req: MasterRequest,
) -> Result<MasterResponse, KvError> {
    let inboxes = &handle.inner.inboxes;
    let gone = || KvError::new(ErrorCode::Unavailable, "a master shard stopped");
    match req {
        MasterRequest::Ping { client_id } => {
            last_ping.insert(client_id, now_ms());
            Ok(MasterResponse::Pong)
        }
        MasterRequest::MountSegment { client_id, spec } => {
            if spec.size == 0 || spec.name.is_empty() || spec.endpoint.nr_shards == 0 {
                return Err(KvError::new(
                    ErrorCode::InvalidParams,
                    format!(
                        "segment {:?}: size, name and shard count must be non-zero",
                        spec.name
                    ),
                ));
            }
            if let Some(m) = by_name.get(&spec.name) {
                if *m.spec == spec {
                    return Ok(MasterResponse::Mounted { segment_id: m.id });
                }
                return Err(KvError::new(
                    ErrorCode::InvalidParams,
                    format!(
                        "segment {:?} is mounted with another size or address",
                        spec.name
                    ),
                ));
            }
            let id = segment_id_for(&spec.name);
            if by_name.values().any(|m| m.id == id) {
                return Err(KvError::new(
                    ErrorCode::Internal,
                    format!(
                        "segment id collision for {:?}; mount it under another name",
                        spec.name
                    ),
                ));
            }
            let spec = Arc::new(spec);
            let mut acks = Vec::with_capacity(inboxes.len());
            for tx in inboxes {
                let (done, rx) = tokio::sync::oneshot::channel();
                tx.send_async(ShardMsg::AddSegment {
                    id,
                    spec: spec.clone(),
                    done,
                })
                .await
                .map_err(|_| gone())?;
                acks.push(rx);
            }
            for a in acks {
                a.await.map_err(|_| gone())?;
            }
            tracing::info!(
                segment = %spec.name,
                id,
                size = spec.size,
                endpoint = %spec.endpoint.shard_addr(0),
                "segment mounted"
            );
            last_ping.insert(client_id, now_ms());
            by_name.insert(
                spec.name.clone(),
                MountedSegment {
                    id,
                    spec,
                    owner: client_id,
                },
            );
            Ok(MasterResponse::Mounted { segment_id: id })
        }
        MasterRequest::UnmountSegment { segment_id } => {
            let Some(name) = by_name
                .iter()
                .find(|(_, m)| m.id == segment_id)
                .map(|(n, _)| n.clone())
            else {
                // Idempotent: an unknown or already unmounted segment is done.
                return Ok(MasterResponse::Done);
            };
            let mut acks = Vec::with_capacity(inboxes.len());
            for tx in inboxes {
                let (done, rx) = tokio::sync::oneshot::channel();
                tx.send_async(ShardMsg::RemoveSegment {
                    id: segment_id,
                    done,
                })
                .await
                .map_err(|_| gone())?;
                acks.push(rx);
            }
            let mut dropped = 0;
            for a in acks {
                dropped += a.await.map_err(|_| gone())?;
            }
            let m = by_name.remove(&name).expect("found above");
            tracing::info!(segment = %name, id = segment_id, owner = m.owner, objects_dropped = dropped, "segment unmounted");
            Ok(MasterResponse::Done)
        }
        MasterRequest::Stat => {
            let mut acks = Vec::with_capacity(inboxes.len());
            for tx in inboxes {
                let (done, rx) = tokio::sync::oneshot::channel();
                tx.send_async(ShardMsg::Stat { done })
                    .await
                    .map_err(|_| gone())?;
                acks.push(rx);
            }
            let mut keys = 0;
            let mut per_seg: HashMap<SegmentId, (u64, u64)> = HashMap::new();
            for a in acks {
                let s = a.await.map_err(|_| gone())?;
                keys += s.keys;
                for (id, cap, used) in s.segments {
                    let e = per_seg.entry(id).or_default();
                    e.0 += cap;
                    e.1 += used;
                }
            }
            let mut segments: Vec<SegmentStat> = by_name
                .values()
                .map(|m| {
                    let (capacity, used) = per_seg.get(&m.id).copied().unwrap_or_default();
                    SegmentStat {
                        id: m.id,
                        name: m.spec.name.clone(),
                        endpoint: m.spec.endpoint.clone(),
                        host_id: m.spec.host_id.clone(),
                        capacity,
                        used,
                        draining: false,
                    }
                })
                .collect();
            segments.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(MasterResponse::Stat(PoolStat {
                keys,
                capacity: segments.iter().map(|s| s.capacity).sum(),
                used: segments.iter().map(|s| s.used).sum(),
                segments,
            }))
        }
        MasterRequest::RemoveAll => {
            let mut acks = Vec::with_capacity(inboxes.len());
            for tx in inboxes {
                let (done, rx) = tokio::sync::oneshot::channel();
                tx.send_async(ShardMsg::RemoveAll { done })
                    .await
                    .map_err(|_| gone())?;
                acks.push(rx);
            }
            let mut n = 0;
            for a in acks {
                n += a.await.map_err(|_| gone())?;
            }
            Ok(MasterResponse::Removed(n))
        }
        other => Err(KvError::new(
            ErrorCode::Internal,
            format!("{} is not an admin request", other.op_name()),
        )),
    }
}

/// Serves master RPC on one shard.
struct MasterConn {
    shard: u32,
    state: Rc<RefCell<ShardState>>,
    handle: MasterHandle,
    io_timeout: Duration,
    max_frame: u32,
    metrics: MasterMetrics,
}

impl Handler for MasterConn {
    async fn handle(&self, hdr: FrameHeader, stream: &mut TcpStream) -> Next {
        if hdr.kind != FrameKind::MasterRequest {
            let e = frame::FrameError::UnexpectedKind {
                expected: FrameKind::MasterRequest,
                got: hdr.kind,
            };
            server::reject(stream, hdr.request_id, &e, "master").await;
            return Next::Close;
        }
        debug_assert!(hdr.len <= self.max_frame);
        let payload = match frame::read_payload(stream, &hdr).await {
            Ok(p) => p,
            Err(_) => return Next::Close,
        };
        let req: MasterRequest = match frame::decode(&payload) {
            Ok(r) => r,
            Err(e) => {
                server::reject(stream, hdr.request_id, &e, "master").await;
                return Next::Close;
            }
        };
        let op = req.op_name();
        let started = std::time::Instant::now();
        let local = req
            .key()
            .is_some_and(|k| self.handle.inner.map.shard_of(k) == self.shard);
        let res = if local {
            let r = self.state.borrow_mut().apply(req, now_ms());
            self.metrics.observe(op, r.is_ok(), started.elapsed());
            r
        } else {
            match glommio::timer::timeout(self.io_timeout, async {
                Ok(self.handle.call(req).await)
            })
            .await
            {
                Ok(r) => r,
                Err(_) => Err(KvError::new(
                    ErrorCode::Timeout,
                    format!("{op} was not answered within {:?}", self.io_timeout),
                )),
            }
        };
        let bytes = match &res {
            Ok(resp) => frame::encode(FrameKind::MasterResponse, hdr.request_id, resp),
            Err(e) => frame::encode_error(hdr.request_id, e),
        };
        server::answer(stream, &bytes).await
    }
}
