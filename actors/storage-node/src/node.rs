//! A storage node: owns a DRAM segment, serves reads and writes of it over
//! TCP (one port per shard), mounts it at the master and pings the master.
//!
//! ```text
//!  shard i (port base+i): Write{seg,off,len} + len bytes -> read_exact straight into segment
//!                         Read{seg,off,len} -> Data{len} + write_all straight from segment
//!                                              (up to 16 KiB: copied behind the frame, one write)
//!  StorageNode actor (tokio): mount at start, Ping every ping_interval (crate::control's
//!                             rules), Unmount on request
//! ```
//!
//! The segment is cut into per-shard slices (`slice_bytes` each); clients send
//! a request to the shard whose slice holds its offset. Any shard can serve any
//! offset (the memory is shared by the process), so a request that reaches
//! another shard is served there rather than refused.

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::net::TcpStream;
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardCtx, ShardHandle};
use kvpool_storage::Segment;
use kvpool_wire::auth::{ClusterKey, GrantClock};
use kvpool_wire::frame::{self, FrameHeader, FrameKind};
use kvpool_wire::proto::{
    segment_id_for, DataRequest, DataResponse, Endpoint, NvmeAttach, SegmentId, SegmentSpec, Tier,
};
use kvpool_wire::{ErrorCode, KvError, RdmaCaps, RdmaRequest, RdmaResponse};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::control::{Ask, Lane, Outcome};
use crate::gate::{DataGate, Handshake};
use crate::metrics::StorageMetrics;
use kvpool_client::Client;
use kvpool_config::NodeError;
use kvpool_config::StorageConfig;
use kvpool_wire::server::{self, ConnState, Handler, Next, RefusalLog, ServerLimits};

/// A started storage node's data plane.
pub struct StorageService {
    pub spec: SegmentSpec,
    pub segment_id: SegmentId,
    pub addr: SocketAddr,
    pub segment: Arc<Segment>,
    /// The NVMe tier, when configured.
    pub nvme: Option<Arc<crate::nvme_tier::NodeNvme>>,
    /// RDMA: the registered segment, or why clients get TCP.
    pub rdma: crate::rdma::NodeRdma,
    /// The cluster secret: data requests and shm mappings need grants.
    pub key: Option<ClusterKey>,
    pub skew_ms: u64,
    /// The newest master term seen in an admitted grant (HA: grants of
    /// older terms come from a deposed leader and are refused).
    pub term: Arc<std::sync::atomic::AtomicU64>,
    /// What the node exports on `/metrics`.
    pub metrics: StorageMetrics,
    /// The data listeners, to stop listening once the shards ended (an
    /// embedded node that starts again on its ports).
    pub listening: Arc<kvpool_runtime::net::Listening>,
}

/// Creates the segment and starts serving it on every shard. With `key`
/// (the cluster secret), every data request needs a grant the master
/// signed; `skew_ms` is how long after its expiry one is still accepted.
/// Where the kernel says whether shared memory gets transparent huge pages.
const SHMEM_THP: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// Whether the kernel setting at `path` (its current choice in brackets, e.g.
/// `always within_size [advise] never deny force`) gives the segment, which
/// asks for huge pages, huge pages. `None` when it cannot be read.
pub fn shmem_huge_pages(path: &str) -> Option<bool> {
    let text = std::fs::read_to_string(path).ok()?;
    let chosen = text.split('[').nth(1)?.split(']').next()?;
    Some(!matches!(chosen, "never" | "deny"))
}

/// Says once, at start, that same-host clients will map the segment in 4 KiB
/// pages: each fresh client pays a page-table fill per page it first touches
/// (docs/benchmarks/transfer-engine.md: a fresh client's 16 MiB shm put 3.8 vs 6.1 GB/s).
fn warn_without_shmem_huge_pages(path: &str) {
    if shmem_huge_pages(path) == Some(false) {
        tracing::warn!(
            "shared memory gets no transparent huge pages here ({path} is never or deny): \
             same-host clients map the segment in 4 KiB pages, which slows their first \
             writes to each region; `echo advise > {path}` (as root) lets the segment use \
             huge pages"
        );
    }
}

pub async fn start(
    shards: &ShardHandle,
    cfg: &StorageConfig,
    key: Option<ClusterKey>,
    skew_ms: u64,
    metrics: &MetricsRegistry,
) -> Result<StorageService, NodeError> {
    let n = shards.nr_shards();
    let (addr, listeners) = kvpool_runtime::net::bind_sharded(&cfg.listen, n)?;
    let listening = kvpool_runtime::net::Listening::of(&listeners)
        .map_err(|e| NodeError::Start(format!("listeners: {e}")))?;
    let host_id = if cfg.host_id.is_empty() {
        kvpool_client::local_host_id()
    } else {
        cfg.host_id.clone()
    };
    let host = if !cfg.advertise_host.is_empty() {
        cfg.advertise_host.clone()
    } else if addr.ip().is_unspecified() {
        kvpool_client::local_host_id()
    } else {
        addr.ip().to_string()
    };
    let size = cfg.segment_size.get();
    let name = format!("{host_id}:{}:{:016x}", addr.port(), rand::random::<u64>());
    let segment = Arc::new(
        Segment::new_dram(&name, size, cfg.prefault)
            .map_err(|e| NodeError::Start(format!("segment: {e}")))?,
    );
    let slice_bytes = size.div_ceil(n as u64);
    let endpoint = Endpoint {
        host,
        port: addr.port(),
        nr_shards: n as u16,
    };
    let segment_id = segment_id_for(&name);
    if cfg.shm {
        warn_without_shmem_huge_pages(SHMEM_THP);
    }
    let rdma = crate::rdma::NodeRdma::start(&cfg.rdma, &segment).map_err(NodeError::Start)?;
    let m = StorageMetrics::register(metrics);
    let nvme = if cfg.nvme.path.is_empty() {
        None
    } else {
        Some(Arc::new(
            crate::nvme_tier::open(
                shards,
                &cfg.nvme,
                &host_id,
                endpoint.clone(),
                segment.clone(),
                segment_id,
                m.clone(),
            )
            .await?,
        ))
    };
    let spec = SegmentSpec {
        name,
        size,
        endpoint,
        slice_bytes,
        host_id,
        tier: Tier::Dram,
        nvme: nvme.as_ref().map(|t| NvmeAttach {
            segment_id: t.segment_id,
            write_through: cfg.nvme.policy == kvpool_config::OffloadPolicy::WriteThrough,
        }),
    };
    let limits = ServerLimits {
        max_connections: cfg.max_connections,
        idle_timeout: Duration::from_millis(cfg.idle_timeout_ms),
        io_timeout: Duration::from_millis(cfg.io_timeout_ms),
        first_frame_timeout: Duration::from_millis(cfg.first_frame_timeout_ms),
        max_frame_bytes: cfg.max_frame_bytes.get() as u32,
        frame_budget: kvpool_wire::frame::FrameBudget::new(cfg.max_frame_memory.get()),
        // With a secret, a connection proves it holds it before anything
        // else (gate::handshake), within first_frame_timeout; each data
        // request also carries a grant for what it touches.
        require_auth: key.is_some(),
    };
    m.segment_bytes.set(size as i64);
    let nvme_id = nvme.as_ref().map(|t| t.segment_id);
    let term = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut ready = Vec::with_capacity(n);
    for (i, listener) in listeners.into_iter().enumerate() {
        let segment = segment.clone();
        let term = term.clone();
        let metrics = m.clone();
        let rdma = rdma.clone();
        let key = key.clone();
        let limits = limits.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        ready.push(rx);
        shards
            .spawn_on(i, move |ctx: ShardCtx| async move {
                let handler = Rc::new(DataConn {
                    shard: ctx.id() as u32,
                    requests: metrics.shard_requests(ctx.id() as u32),
                    shutdown: ctx.shutdown().clone(),
                    rdma,
                    segment,
                    segment_id,
                    nvme_id,
                    metrics,
                    key,
                    skew_ms,
                    term,
                    io_timeout: limits.io_timeout,
                    refusals: RefusalLog::default(),
                });
                let listener = server::into_glommio(listener);
                let _ = tx.send(());
                server::serve(ctx, listener, limits, "storage", handler).await;
            })
            .await?;
    }
    for r in ready {
        r.await
            .map_err(|_| NodeError::Start("a storage shard failed to start".into()))?;
    }
    Ok(StorageService {
        spec,
        segment_id,
        addr,
        segment,
        nvme,
        rdma,
        key,
        skew_ms,
        term,
        metrics: m,
        listening: Arc::new(listening),
    })
}

/// Hands the segment's memfd to same-host clients that connect to its
/// abstract unix socket (the shm transport), until `shutdown`: a challenge,
/// the client's request with its proof of the secret (with one), then one
/// small `sendmsg`. Each client is served by a task of its own within
/// `SHM_EXCHANGE`; at most `SHM_CLIENTS` at once (more are closed), so a
/// client that connects and says nothing delays nobody.
pub fn spawn_shm_server(
    svc: &StorageService,
    shutdown: kvpool_runtime::Shutdown,
) -> Result<(), NodeError> {
    let std_listener = kvpool_transport::shm::listen(svc.segment_id).map_err(|e| {
        NodeError::Start(format!(
            "shm: cannot listen on {}: {e}",
            kvpool_transport::shm::socket_name(svc.segment_id)
        ))
    })?;
    std_listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(std_listener)?;
    let server = Arc::new(ShmServer {
        segment: svc.segment.clone(),
        id: svc.segment_id,
        key: svc.key.clone(),
        skew_ms: svc.skew_ms,
        term: svc.term.clone(),
        refusals: std::sync::Mutex::new(RefusalCount::default()),
    });
    let slots = Arc::new(tokio::sync::Semaphore::new(SHM_CLIENTS));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = shutdown.wait() => break,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!("shm accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::debug!("shm: {SHM_CLIENTS} clients in their exchange; one closed");
                continue;
            };
            let server = server.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let _ = tokio::time::timeout(SHM_EXCHANGE, server.serve(stream)).await;
            });
        }
    });
    Ok(())
}

/// Most clients in their shm exchange at once (a mapping is made once per
/// segment and client process).
const SHM_CLIENTS: usize = 64;

/// Deadline of one client's shm exchange, from its connect to the segment.
const SHM_EXCHANGE: Duration = Duration::from_secs(1);

/// What the shm socket's tasks share.
struct ShmServer {
    segment: Arc<Segment>,
    id: kvpool_wire::proto::SegmentId,
    key: Option<ClusterKey>,
    skew_ms: u64,
    term: Arc<std::sync::atomic::AtomicU64>,
    refusals: std::sync::Mutex<RefusalCount>,
}

impl ShmServer {
    /// One client: challenge, request and proof, then the segment or a
    /// close. No deadline of its own (the caller's).
    async fn serve(&self, mut stream: tokio::net::UnixStream) {
        use kvpool_transport::shm;
        let Ok(ns) = shm::send_challenge(&mut stream).await else {
            return;
        };
        let req = match shm::read_request(&mut stream).await {
            Ok(r) if r.segment_id == self.id => r,
            Ok(r) => {
                tracing::debug!("shm: a client asked for segment {:016x}", r.segment_id);
                return;
            }
            Err(_) => return,
        };
        let checked = shm::check_proof(self.key.as_ref(), &ns, &req)
            .and_then(|()| match &self.key {
                Some(k) => {
                    k.check_segment_access(&req.grant, self.id, GrantClock::now(self.skew_ms))
                }
                None => Ok(()),
            })
            .and_then(|()| crate::gate::check_term(&self.term, &req.grant, self.key.as_ref()));
        if let Err(e) = checked {
            let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
            r.refused(&e);
            return;
        }
        let sent = stream.into_std().and_then(|s| {
            s.set_nonblocking(false)?;
            s.set_write_timeout(Some(SHM_EXCHANGE))?;
            shm::send_segment(&s, self.id, self.segment.len(), self.segment.fd())
        });
        if let Err(e) = sent {
            tracing::warn!("shm: could not hand the segment to a client: {e}");
        }
    }
}

/// Refused shm requests, logged at most once a second.
#[derive(Default)]
struct RefusalCount {
    last: Option<Instant>,
    since: u64,
}

impl RefusalCount {
    fn refused(&mut self, e: &KvError) {
        self.since += 1;
        if self
            .last
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        tracing::warn!(
            refused = self.since,
            "shm: refused a mapping: {}",
            e.message
        );
        self.since = 0;
        self.last = Some(Instant::now());
    }
}

/// Serves the data plane on one shard.
struct DataConn {
    shard: u32,
    /// Ends the wait of an RDMA control connection at shutdown.
    shutdown: kvpool_runtime::Shutdown,
    rdma: crate::rdma::NodeRdma,
    segment: Arc<Segment>,
    segment_id: SegmentId,
    nvme_id: Option<SegmentId>,
    metrics: StorageMetrics,
    /// `storage_shard_requests` of this shard.
    requests: kvpool_runtime::metrics::prometheus_client::metrics::counter::Counter,
    /// The cluster secret: every request needs a grant.
    key: Option<ClusterKey>,
    skew_ms: u64,
    /// The node's newest master term (see [`StorageService::term`]).
    term: Arc<std::sync::atomic::AtomicU64>,
    io_timeout: Duration,
    refusals: RefusalLog,
}

impl DataConn {
    /// A frame and the payload after it, both within `io_timeout`. A small
    /// payload goes out in the same write as its frame (one segment, so
    /// the reader wakes once), a large one straight from its memory.
    async fn send_two(&self, stream: &mut TcpStream, head: &[u8], body: &[u8]) -> Next {
        /// Payloads up to this size are copied behind their frame.
        const COALESCE: usize = 16 * 1024;
        match glommio::timer::timeout(self.io_timeout, async {
            let r = async {
                if body.len() <= COALESCE {
                    let mut one = Vec::with_capacity(head.len() + body.len());
                    one.extend_from_slice(head);
                    one.extend_from_slice(body);
                    frame::write_all(stream, &one).await
                } else {
                    frame::write_all(stream, head).await?;
                    frame::write_all(stream, body).await
                }
            }
            .await;
            Ok(r)
        })
        .await
        {
            Ok(Ok(())) => Next::Continue,
            _ => Next::Close,
        }
    }
}

impl Handler for DataConn {
    async fn handle(
        &self,
        hdr: FrameHeader,
        payload: kvpool_wire::frame::AlignedVec,
        stream: &mut TcpStream,
        conn: &mut ConnState,
    ) -> Next {
        let Some(req) = server::open_request::<DataRequest>(
            stream,
            &hdr,
            &payload,
            FrameKind::DataRequest,
            "storage",
        )
        .await
        else {
            return Next::Close;
        };
        drop(payload);
        let started = Instant::now();
        match crate::gate::handshake(self.key.as_ref(), &req, conn) {
            Handshake::Pass => {}
            Handshake::Answer(a) => {
                let answer = frame::encode(FrameKind::DataResponse, hdr.request_id, &a);
                return server::answer_within(stream, &answer, self.io_timeout).await;
            }
            Handshake::Refuse(refused) => {
                let what = crate::gate::op_name(&req);
                if refused.auth {
                    self.metrics.auth_refusals.inc();
                    self.refusals.refused("storage", what, &refused.error);
                }
                // Answer, then close: a refused Write's payload follows
                // unread, and a connection that failed its handshake gets
                // no second try.
                let _ =
                    server::answer(stream, &frame::encode_error(hdr.request_id, &refused.error))
                        .await;
                return Next::Close;
            }
        }
        if matches!(
            req,
            DataRequest::Write { .. } | DataRequest::Read { .. } | DataRequest::ReadNvme { .. }
        ) {
            self.requests.inc();
        }
        let gate = DataGate {
            segment_len: self.segment.len(),
            segment_id: self.segment_id,
            nvme_id: self.nvme_id,
            shard: self.shard,
            key: self.key.as_ref(),
            term: &self.term,
        };
        if let Err(refused) = gate.admit(&req, GrantClock::now(self.skew_ms)) {
            let what = crate::gate::op_name(&req);
            let op = match &req {
                DataRequest::Write { .. } => Some("write"),
                DataRequest::Read { .. } => Some("read"),
                DataRequest::ReadNvme { .. } => Some("read_nvme"),
                _ => None,
            };
            if refused.auth {
                self.metrics.auth_refusals.inc();
                self.refusals.refused("storage", what, &refused.error);
            }
            if let Some(op) = op {
                self.metrics.observe(op, false, started.elapsed());
            }
            let next =
                server::answer(stream, &frame::encode_error(hdr.request_id, &refused.error)).await;
            // A refused write's payload follows unread: answer, then close.
            return match req {
                DataRequest::Write { .. } => Next::Close,
                _ => next,
            };
        }
        match req {
            DataRequest::Write { offset, len, .. } => {
                // SAFETY: the range is inside the segment (the gate checked), and
                // the master gave it to this writer alone between PutStart and
                // PutEnd (with a cluster secret, the grant the gate checked says
                // so); no reader is directed to it before PutEnd.
                let dst = unsafe { self.segment.slice_mut(offset, len) };
                let read = glommio::timer::timeout(self.io_timeout, async {
                    Ok(futures_lite::AsyncReadExt::read_exact(stream, dst).await)
                })
                .await;
                if !matches!(read, Ok(Ok(()))) {
                    self.metrics.observe("write", false, started.elapsed());
                    return Next::Close;
                }
                self.metrics.bytes_written.inc_by(len);
                self.metrics.observe("write", true, started.elapsed());
                let ok = frame::encode(
                    FrameKind::DataResponse,
                    hdr.request_id,
                    &DataResponse::Written,
                );
                server::answer_within(stream, &ok, self.io_timeout).await
            }
            DataRequest::Read { offset, len, .. } => {
                let head = frame::encode(
                    FrameKind::DataResponse,
                    hdr.request_id,
                    &DataResponse::Data { len },
                );
                // SAFETY: in bounds (the gate checked); the reader holds the
                // object's replica list, and the master does not hand its
                // space to a writer while the object exists (and, with
                // leases, while any lease on it is live).
                let src = unsafe { self.segment.slice(offset, len) };
                let next = self.send_two(stream, &head, src).await;
                let ok = matches!(next, Next::Continue);
                if ok {
                    self.metrics.bytes_read.inc_by(len);
                }
                self.metrics.observe("read", ok, started.elapsed());
                next
            }
            DataRequest::ReadNvme {
                loc, len, ref key, ..
            } => {
                let loc = kvpool_storage::nvme::NvmeLoc::unpack(loc);
                // The key's copy only, at its length (the rule's docs say why).
                let rule = crate::gate::NvmeRead { key, len };
                let value =
                    crate::nvme_tier::read_local(loc, &self.metrics, |k, v| rule.wants(k, v))
                        .await
                        .and_then(|v| rule.fits(v.len() as u64).map(|()| v));
                let v = match value {
                    Ok(v) => v,
                    Err(e) => {
                        self.metrics.observe("read_nvme", false, started.elapsed());
                        return server::answer(stream, &frame::encode_error(hdr.request_id, &e))
                            .await;
                    }
                };
                let head = frame::encode(
                    FrameKind::DataResponse,
                    hdr.request_id,
                    &DataResponse::Data { len },
                );
                let next = self.send_two(stream, &head, &v).await;
                let ok = matches!(next, Next::Continue);
                if ok {
                    self.metrics.bytes_read.inc_by(len);
                }
                self.metrics.observe("read_nvme", ok, started.elapsed());
                next
            }
            DataRequest::Rdma { req, .. } => self.rdma(req, hdr.request_id, stream).await,
            // The handshake answered these, or the gate refused them.
            DataRequest::AuthBegin { .. } | DataRequest::AuthProve { .. } => Next::Close,
        }
    }
}

impl DataConn {
    /// RDMA set-up. After `Connect`, the node's queue pairs live as long as
    /// this TCP connection: the handler holds them until the client closes
    /// it (or the node shuts down), then closes it too.
    async fn rdma(&self, req: RdmaRequest, id: u64, stream: &mut TcpStream) -> Next {
        let reply =
            |r: RdmaResponse| frame::encode(FrameKind::DataResponse, id, &DataResponse::Rdma(r));
        match req {
            RdmaRequest::Caps => {
                let caps = match &self.rdma {
                    crate::rdma::NodeRdma::On { nic, .. } => nic.caps(),
                    crate::rdma::NodeRdma::Off(why) => RdmaCaps::unavailable(why.clone()),
                };
                server::answer(stream, &reply(RdmaResponse::Caps(caps))).await
            }
            RdmaRequest::Connect(req) => {
                // The gate checked the grant and the segment.
                match &self.rdma {
                    crate::rdma::NodeRdma::On { nic, region } => {
                        match nic.clone().accept(&req, region) {
                            Ok((r, passive)) => {
                                if let Next::Close =
                                    server::answer(stream, &reply(RdmaResponse::Connected(r))).await
                                {
                                    return Next::Close;
                                }
                                self.metrics.rdma_connections.inc();
                                tracing::debug!(lanes = passive.lanes(), "rdma peer connected");
                                self.hold_until_closed(stream).await;
                                drop(passive);
                                self.metrics.rdma_connections.dec();
                                Next::Close
                            }
                            Err(e) => {
                                tracing::warn!("rdma connect from a client failed: {e}");
                                server::answer(stream, &frame::encode_error(id, &e)).await
                            }
                        }
                    }
                    crate::rdma::NodeRdma::Off(why) => {
                        drop(req);
                        let e = KvError::new(
                            ErrorCode::Unsupported,
                            format!("this node has no RDMA: {why}"),
                        );
                        server::answer(stream, &frame::encode_error(id, &e)).await
                    }
                }
            }
        }
    }

    /// Waits until the peer closes `stream` (anything it sends is
    /// ignored) or the node shuts down.
    async fn hold_until_closed(&self, stream: &mut TcpStream) {
        let _ = stream.set_read_timeout(None);
        futures_lite::future::or(
            async {
                let mut b = [0u8; 256];
                while let Ok(n) = futures_lite::AsyncReadExt::read(stream, &mut b).await {
                    if n == 0 {
                        break;
                    }
                }
            },
            self.shutdown.wait(),
        )
        .await;
    }
}

/// Messages of the [`StorageNode`] actor.
pub enum StorageNodeMsg {
    /// Internal: time to ping the master.
    Tick,
    /// The segment's id and spec.
    Info(RpcReplyPort<(SegmentId, SegmentSpec)>),
    /// Unmounts the segment at the master (graceful leave).
    Unmount(RpcReplyPort<Result<(), KvError>>),
}

/// Start-up arguments of the [`StorageNode`] actor.
pub struct StorageNodeArgs {
    pub client: Client,
    pub spec: SegmentSpec,
    /// The node's NVMe tier: mounted after the DRAM segment, its objects
    /// reported, and both mounted again whenever the master forgets them.
    pub nvme: Option<Arc<crate::nvme_tier::NodeNvme>>,
    pub ping_interval: Duration,
    /// How long to keep trying the first mount (the master may start later).
    pub mount_deadline: Duration,
}

/// The control side of a storage node: mounts its segment (and NVMe tier)
/// at the master, keeps them alive with pings that name them, mounts them
/// again when a ping's answer says the master does not know them (it
/// restarted, or declared the node dead), unmounts on request.
pub struct StorageNode;

pub struct StorageNodeState {
    client: Client,
    spec: SegmentSpec,
    segment_id: SegmentId,
    nvme: Option<Arc<crate::nvme_tier::NodeNvme>>,
    /// When to mount, report and ping (the rules, without I/O).
    lane: Lane,
    ping_interval: Duration,
}

impl StorageNodeState {
    fn owned(&self) -> Vec<SegmentId> {
        let mut v = vec![self.segment_id];
        v.extend(self.nvme.as_ref().map(|t| t.segment_id));
        v
    }

    /// Makes the call the lane asks for.
    async fn call(&self, ask: Ask) -> Result<Outcome, KvError> {
        match (ask, &self.nvme) {
            (Ask::MountDram, _) => {
                self.client.mount_segment(self.spec.clone()).await?;
            }
            (Ask::MountTier, Some(tier)) => {
                self.client.mount_segment(tier.spec.clone()).await?;
            }
            (Ask::ReportTier, Some(tier)) => tier.report_all(&self.client).await?,
            (Ask::MountTier | Ask::ReportTier, None) => {
                return Err(KvError::new(
                    ErrorCode::Internal,
                    "the lane asked for the tier of a node without one",
                ))
            }
            (Ask::Ping, _) => {
                let unknown = self.client.ping_segments(&self.owned()).await?;
                if !unknown.is_empty() {
                    tracing::warn!(
                        segments = ?unknown.iter().map(|s| format!("{s:016x}")).collect::<Vec<_>>(),
                        "the master does not know this node's segments (it restarted, or declared the node dead): mounting again"
                    );
                }
                return Ok(Outcome::Pong {
                    dram_unknown: unknown.contains(&self.segment_id),
                    tier_unknown: self
                        .nvme
                        .as_ref()
                        .is_some_and(|t| unknown.contains(&t.segment_id)),
                });
            }
        }
        Ok(Outcome::Done)
    }

    /// One tick of the lane: its calls, until it asks for none.
    async fn tick(&mut self) {
        let mut next = self.lane.tick();
        while let Some(ask) = next {
            let outcome = match self.call(ask).await {
                Ok(o) => {
                    if ask == Ask::ReportTier {
                        tracing::info!("NVMe tier mounted again and its objects reported");
                    }
                    o
                }
                Err(e) => {
                    match ask {
                        Ask::Ping => tracing::warn!("ping to the master failed: {e}"),
                        Ask::MountDram => {
                            tracing::warn!("mounting the DRAM segment again failed: {e}")
                        }
                        Ask::MountTier | Ask::ReportTier => {
                            tracing::warn!("NVMe tier not mounted and reported yet (retrying): {e}")
                        }
                    }
                    Outcome::Failed
                }
            };
            next = self.lane.answered(outcome);
        }
    }
}

impl Actor for StorageNode {
    type Msg = StorageNodeMsg;
    type State = StorageNodeState;
    type Arguments = StorageNodeArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: StorageNodeArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut lane = Lane::new(args.nvme.is_some());
        let first = lane.tick();
        debug_assert_eq!(first, Some(Ask::MountDram));
        // The first mount is retried while the master is not up yet.
        let deadline = Instant::now() + args.mount_deadline;
        let segment_id = loop {
            match args.client.mount_segment(args.spec.clone()).await {
                Ok(id) => break id,
                Err(e) if Instant::now() < deadline && e.code == ErrorCode::Unavailable => {
                    tracing::warn!("mount failed, retrying: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(format!("cannot mount segment: {e}").into()),
            }
        };
        let mut state = StorageNodeState {
            client: args.client,
            spec: args.spec,
            segment_id,
            nvme: args.nvme,
            lane,
            ping_interval: args.ping_interval,
        };
        // The tier is mounted (or mounted again, after a restart) and what
        // it holds is reported back before the node counts as started.
        let mut next = state.lane.answered(Outcome::Done);
        while let Some(ask) = next {
            let outcome = state
                .call(ask)
                .await
                .map_err(|e| format!("NVMe tier: {e}"))?;
            next = state.lane.answered(outcome);
        }
        debug_assert!(state.lane.started());
        // One tick at a time: each handled tick schedules the next, so a
        // tick slower than the interval (the master down, a long remount)
        // cannot pile ticks up in the mailbox, as `send_interval` would.
        myself.send_after(state.ping_interval, || StorageNodeMsg::Tick);
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            StorageNodeMsg::Tick => {
                myself.send_after(state.ping_interval, || StorageNodeMsg::Tick);
                state.tick().await;
            }
            StorageNodeMsg::Info(reply) => {
                let _ = reply.send((state.segment_id, state.spec.clone()));
            }
            StorageNodeMsg::Unmount(reply) => {
                let r = state.client.unmount_segment(state.segment_id).await;
                if r.is_ok() {
                    state.lane.unmounted();
                }
                let _ = reply.send(r);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::shmem_huge_pages;

    #[test]
    fn the_kernels_shmem_huge_page_choice_is_read_from_its_brackets() {
        let dir = std::env::temp_dir().join(format!("kvpool-thp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("shmem_enabled");
        let f = f.to_str().unwrap();
        for (text, want) in [
            (
                "always within_size advise [never] deny force\n",
                Some(false),
            ),
            (
                "always within_size advise never [deny] force\n",
                Some(false),
            ),
            ("always within_size [advise] never deny force\n", Some(true)),
            ("[always] within_size advise never deny force\n", Some(true)),
            ("garbage\n", None),
        ] {
            std::fs::write(f, text).unwrap();
            assert_eq!(shmem_huge_pages(f), want, "{text}");
        }
        assert_eq!(shmem_huge_pages("/nonexistent/kvpool/thp"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
