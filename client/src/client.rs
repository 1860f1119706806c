//! The store client: what embedders, the CLI and storage nodes use.
//!
//! `put` = master `PutStart` (allocates) -> write the bytes straight into each
//! replica's segment -> `PutEnd`. `get` = master `GetReplicaList` (grants a
//! read lease) -> read the best replica (same host first), the next on
//! failure. Bytes move through the [`TransferEngine`]: shared memory when the
//! replica is on this host, TCP lanes otherwise. Every call runs under one
//! deadline (`client.timeout_ms`); connections are pooled and bounded.
//!
//! The client runs on tokio (it is what embedders have); requests go straight
//! to the master shard that owns the key, using the cluster map from `Hello`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvpool_wire::KvError> {
//! use kvpool_client::Client;
//! use kvpool_client::ClientConfig;
//!
//! let client = Client::connect("127.0.0.1:7070", ClientConfig::default()).await?;
//! client.put(b"model@0123@fp16@256", b"kv bytes").await?;
//! assert_eq!(client.get(b"model@0123@fp16@256").await?, b"kv bytes");
//! let mut buf = vec![0u8; 64];
//! let n = client.get_into(b"model@0123@fp16@256", &mut buf).await?;
//! assert_eq!(&buf[..n], b"kv bytes");
//! client.remove_with(b"model@0123@fp16@256", true).await?;
//! # Ok(()) }
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use kvpool_runtime::hash::{vshard_of, ShardMap};
use kvpool_transport::engine::{EngineConfig, Transfer, TransferEngine, TransportChoice};
use kvpool_transport::pool::{ConnPool, Stream};
use kvpool_transport::shm::ShmMap;
use kvpool_wire::auth::{self, ClusterKey};
use kvpool_wire::frame::{self, FrameKind};
use kvpool_wire::proto::call::{self, Call};
use kvpool_wire::proto::{
    ClientId, ClusterMap, Endpoint, MasterRequest, MasterResponse, ObjectInfo, PoolStat,
    PutOptions, ReplicaDesc, SegmentId, SegmentSpec, Tier,
};
use kvpool_wire::{ErrorCode, KvError};

use crate::get::{within_bound, Answers, GetProtocol, Step, READ_MARGIN};
use crate::leader::{leader_may_have_moved, MasterSource};
use crate::locations::OnDrop;
use crate::put::{Action, PlaceIds, PutIds, PutProtocol};
use kvpool_config::ClientConfig;
use kvpool_wire::route::{self, merge_batch, split_batch_pieces, Target};

mod buffers;
use buffers::*;
pub use buffers::{MemoryRegistration, ReadView, RegisteredBuffer};

mod batch;

/// The master as this client knows it: its cluster map and a connection
/// pool per master shard. Replaced as a whole when the client follows a new
/// leader.
struct View {
    cluster: ClusterMap,
    map: ShardMap,
    master_pools: Vec<Arc<ConnPool>>,
    /// The leader's address this view was opened on.
    addr: String,
}

struct Inner {
    id: ClientId,
    cfg: ClientConfig,
    /// Where the master is: a fixed address, or a source that follows the
    /// leader (HA).
    source: Arc<dyn MasterSource>,
    view: std::sync::RwLock<Arc<View>>,
    /// One re-resolution at a time; the others wait for its view.
    following: tokio::sync::Mutex<()>,
    /// A call ran out of time on this view's master: the next call looks
    /// for the leader first (a stalled leader accepts connections but
    /// answers nothing).
    stale: std::sync::atomic::AtomicBool,
    engine: TransferEngine,
    req_ids: AtomicU64,
    /// Names each placement of a put (`PutOptions::put_id`); never 0.
    put_ids: PutIds,
    host_id: String,
    /// The cluster secret: master connections authenticate with it.
    key: Option<ClusterKey>,
    /// Replica lists under this client's read leases (repeated gets).
    locations: crate::locations::Locations,
    /// Gets served from `locations` without asking the master.
    location_hits: AtomicU64,
}

/// A connection to a kvpool pool. Cheap to clone; share one per process.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

/// The master shard that owns `key`, by the view's cluster map ranges.
fn shard_in(view: &View, key: &[u8]) -> usize {
    let v = vshard_of(key);
    view.cluster
        .shards
        .iter()
        .position(|s| (s.vshard_start..s.vshard_end).contains(&v))
        .unwrap_or_else(|| view.map.shard_of(key) as usize)
}

fn host_of(addr: &str) -> String {
    match addr.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']').to_string(),
        None => addr.to_string(),
    }
}

/// Keys per master request of a batch call, at most: a larger batch (an
/// engine's chunks times layer groups of a long prompt; a client's own) goes
/// to its shard in pieces side by side, of this many keys or of the
/// master's `max_batch` (told in its cluster map) where that is smaller.
/// Within it a batch is one request per shard; each piece's keys answer (and
/// retry) on their own.
const BATCH_PIECE: usize = 4096;

/// Pause between two looks for the leader while none answers (a failover
/// under way); the caller's deadline bounds the whole search.
const FOLLOW_PAUSE: Duration = Duration::from_millis(100);

/// Asks `source` where the leader is and opens a view on it. A source that
/// follows the leader is asked again (after [`FOLLOW_PAUSE`]) while the
/// master it names is not the leader or does not answer, each try bounded by
/// `connect_timeout_ms`; a fixed address is tried once. No deadline of its
/// own: callers bound it.
async fn find_leader(
    source: &dyn MasterSource,
    cfg: &ClientConfig,
    key: Option<&ClusterKey>,
    id: ClientId,
) -> Result<View, KvError> {
    if !source.follows() {
        let addr = source.resolve().await?;
        return open_view(&addr, cfg, key, id).await;
    }
    let attempt = Duration::from_millis(cfg.connect_timeout_ms);
    loop {
        let tried = tokio::time::timeout(attempt, async {
            let addr = source.resolve().await?;
            open_view(&addr, cfg, key, id).await
        })
        .await
        .unwrap_or_else(|_| {
            Err(KvError::new(
                ErrorCode::Timeout,
                format!("the leader of {} did not answer", source.describe()),
            ))
        });
        match tried {
            Err(e) if leader_may_have_moved(&e) => {
                tracing::debug!("looking for the leader of {}: {e}", source.describe());
                tokio::time::sleep(FOLLOW_PAUSE).await;
            }
            r => return r,
        }
    }
}

/// Connects to the master at `addr`, authenticates, and learns its cluster
/// map (`Hello`). No deadline of its own.
async fn open_view(
    addr: &str,
    cfg: &ClientConfig,
    key: Option<&ClusterKey>,
    id: ClientId,
) -> Result<View, KvError> {
    let connect_timeout = Duration::from_millis(cfg.connect_timeout_ms);
    let max_frame = cfg.max_frame_bytes.get() as u32;
    let boot = ConnPool::new(addr.to_string(), 1);
    let mut conn = boot.get(connect_timeout).await?;
    if let Some(k) = key {
        authenticate(conn.stream(), k, id, 2, max_frame)
            .await
            .map_err(|e| KvError::new(e.code, format!("{addr}: {}", e.message)))?;
    }
    let hello = call::Hello { client_id: id };
    let resp = rpc(conn.stream(), 1, &hello.into(), max_frame)
        .await
        .map_err(|e| KvError::new(e.code, format!("{addr}: {}", e.message)))??;
    let cluster = call::Hello::reply(resp)?;
    drop(conn);
    if cluster.shards.is_empty() {
        return Err(KvError::new(
            ErrorCode::Internal,
            "master sent an empty cluster map",
        ));
    }
    let map = ShardMap::new(cluster.shards.len() as u32)
        .ok_or_else(|| KvError::new(ErrorCode::Unsupported, "cluster map has too many shards"))?;
    let master_host = host_of(addr);
    let max = cfg.max_connections_per_endpoint;
    let master_pools: Vec<Arc<ConnPool>> = cluster
        .shards
        .iter()
        .map(|s| {
            let host = if s.host.is_empty() {
                master_host.clone()
            } else {
                s.host.clone()
            };
            let ep = Endpoint {
                host,
                port: s.port,
                nr_shards: 1,
            };
            ConnPool::new(ep.shard_addr(0), max)
        })
        .collect();
    Ok(View {
        cluster,
        map,
        master_pools,
        addr: addr.to_string(),
    })
}

impl Client {
    /// Connects to the master at `master` (`host:port` of its shard 0, or
    /// `scheme://...` of a registered [`MasterSource`], e.g. the leader of
    /// masters on etcd) and learns the cluster map.
    pub async fn connect(master: &str, cfg: ClientConfig) -> Result<Self, KvError> {
        Self::connect_as(master, cfg, rand::random::<u64>().max(1), local_host_id()).await
    }

    /// Like [`Client::connect`] with a chosen client id and host id (a
    /// storage node uses its own, so its pings keep its segment alive).
    pub async fn connect_as(
        master: &str,
        cfg: ClientConfig,
        id: ClientId,
        host_id: String,
    ) -> Result<Self, KvError> {
        let source = crate::leader::source_for(master)?;
        Self::connect_to(source, cfg, id, host_id).await
    }

    /// Like [`Client::connect_as`], finding the master through `source`.
    pub async fn connect_to(
        source: Arc<dyn MasterSource>,
        cfg: ClientConfig,
        id: ClientId,
        host_id: String,
    ) -> Result<Self, KvError> {
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let connect_timeout = Duration::from_millis(cfg.connect_timeout_ms);
        let max_frame = cfg.max_frame_bytes.get() as u32;
        let key = if cfg.secret.is_empty() {
            None
        } else {
            Some(
                ClusterKey::new(cfg.secret.expose().as_bytes())
                    .map_err(|e| KvError::new(ErrorCode::InvalidParams, e))?,
            )
        };
        let view = tokio::time::timeout(timeout, find_leader(&*source, &cfg, key.as_ref(), id))
            .await
            .map_err(|_| {
                KvError::new(
                    ErrorCode::Timeout,
                    format!(
                        "master {} did not answer within {timeout:?}",
                        source.describe()
                    ),
                )
            })??;
        let max = cfg.max_connections_per_endpoint;
        #[allow(unused_mut)]
        let mut engine = TransferEngine::new(EngineConfig {
            transport: transport_choice(cfg.transport),
            tcp_slice_bytes: cfg.tcp_slice_bytes.get(),
            lanes: cfg.lanes,
            shard_affinity: cfg.shard_affinity,
            max_in_flight: cfg.max_in_flight,
            max_connections_per_endpoint: max,
            connect_timeout,
            max_frame_bytes: max_frame,
            host_id: host_id.clone(),
            verify_checksums: cfg.checksums,
            shm_populate_at_map: cfg.shm_populate == kvpool_config::ShmPopulate::AtMap,
            key: key.clone(),
        });
        let rdma_required = cfg.transport == kvpool_config::Transport::Rdma;
        if rdma_required || matches!(cfg.transport, kvpool_config::Transport::Auto) {
            match crate::rdma::open(&cfg.rdma, rdma_required, "client")
                .map_err(|why| KvError::new(ErrorCode::Unsupported, why))?
            {
                crate::rdma::Opened::Rdma(nic) => engine.enable_rdma(nic),
                crate::rdma::Opened::Tcp(_) => {}
            }
        }
        let ping_ms = cfg.ping_interval_ms;
        let location_entries = cfg.location_cache_entries;
        let client = Self {
            inner: Arc::new(Inner {
                id,
                cfg,
                source,
                view: std::sync::RwLock::new(Arc::new(view)),
                following: tokio::sync::Mutex::new(()),
                stale: std::sync::atomic::AtomicBool::new(false),
                engine,
                req_ids: AtomicU64::new(1),
                put_ids: PutIds::default(),
                host_id,
                key,
                locations: crate::locations::Locations::new(location_entries),
                location_hits: AtomicU64::new(0),
            }),
        };
        if ping_ms > 0 {
            client.spawn_pings(Duration::from_millis(ping_ms));
        }
        Ok(client)
    }

    /// Pings the master every `every` while any clone of this client lives.
    fn spawn_pings(&self, every: Duration) {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                let client = Client { inner };
                if let Err(e) = client.ping().await {
                    tracing::debug!("ping to the master failed: {e}");
                }
            }
        });
    }

    pub fn id(&self) -> ClientId {
        self.inner.id
    }

    /// The cluster map of the master this client speaks to now.
    pub fn cluster_map(&self) -> ClusterMap {
        self.view().cluster.clone()
    }

    /// The address of the master (the leader) this client speaks to now.
    pub fn master_addr(&self) -> String {
        self.view().addr.clone()
    }

    fn view(&self) -> Arc<View> {
        self.inner
            .view
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Looks for the leader again, unless another call already replaced
    /// `seen` meanwhile (then that view). No deadline of its own.
    async fn follow(&self, seen: &Arc<View>) -> Result<Arc<View>, KvError> {
        let _one = self.inner.following.lock().await;
        let now = self.view();
        if !Arc::ptr_eq(&now, seen) {
            return Ok(now);
        }
        let i = &self.inner;
        let view = Arc::new(find_leader(&*i.source, &i.cfg, i.key.as_ref(), i.id).await?);
        if view.addr != seen.addr {
            tracing::info!(
                "following the leader of {}: {} (was {})",
                i.source.describe(),
                view.addr,
                seen.addr
            );
        }
        *i.view.write().unwrap_or_else(|p| p.into_inner()) = view.clone();
        i.stale.store(false, Ordering::Relaxed);
        Ok(view)
    }

    /// The transfer engine (its counters, and batches of raw transfers).
    pub fn engine(&self) -> &TransferEngine {
        &self.inner.engine
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.inner.cfg.timeout_ms)
    }

    fn max_frame(&self) -> u32 {
        self.inner.cfg.max_frame_bytes.get() as u32
    }

    async fn deadline<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = Result<T, KvError>>,
    ) -> Result<T, KvError> {
        let t = self.timeout();
        tokio::time::timeout(t, f).await.unwrap_or_else(|_| {
            if self.inner.source.follows() {
                // Perhaps a stalled leader: the next call looks again.
                self.inner.stale.store(true, Ordering::Relaxed);
            }
            Err(KvError::new(
                ErrorCode::Timeout,
                format!("{what} did not finish within {t:?}"),
            ))
        })
    }

    /// Sends `req` where [`route::target`] says: a key's request to the
    /// shard that owns the key, a batch split by owning shard and merged back
    /// in order, a node's task request to its shard, anything else to the
    /// coordinator (shard 0). No deadline of its own.
    ///
    /// Following a leader (HA): a master that answers `NotLeader`, cannot be
    /// reached or did not answer in time, or that the source says another
    /// master has replaced (a call waiting for it ends then), sends the
    /// client looking for the leader; the request goes again to the new one
    /// when that is safe (the old one said `NotLeader`, so did nothing that
    /// counts, or the request is idempotent). Otherwise its error is
    /// returned, and the next call goes to the new leader.
    async fn send(&self, req: MasterRequest) -> Result<MasterResponse, KvError> {
        if !self.inner.source.follows() {
            return self.send_on(&self.view(), req).await;
        }
        let source = &*self.inner.source;
        let mut view = self.view();
        let replaced = source.moved_from(&view.addr).now_or_never().is_some();
        if replaced || self.inner.stale.load(Ordering::Relaxed) {
            view = self.follow(&view).await?;
        }
        let moved = source.moved_from(&view.addr);
        let again = req.clone();
        // A call to a leader that etcd has since replaced (it stalled, or
        // lost its lease) ends at the election, not at the deadline.
        let sent = tokio::select! {
            biased;
            r = self.send_on(&view, req) => r,
            () = moved => Err(KvError::new(
                ErrorCode::Unavailable,
                format!(
                    "{} stopped leading {} while the call waited for it",
                    view.addr,
                    source.describe()
                ),
            )),
        };
        match sent {
            Err(e) if leader_may_have_moved(&e) => {
                let safe = e.code == ErrorCode::NotLeader || again.is_idempotent();
                let view = self.follow(&view).await?;
                if safe {
                    self.send_on(&view, again).await
                } else {
                    Err(KvError::new(
                        e.code,
                        format!(
                            "{} (the master may have failed over: the call was not sent again; \
                             the leader is now {})",
                            e.message, view.addr
                        ),
                    ))
                }
            }
            r => r,
        }
    }

    async fn send_on(&self, view: &View, req: MasterRequest) -> Result<MasterResponse, KvError> {
        let shards = view.master_pools.len();
        match route::target(&req, |k| shard_in(view, k) as u32, shards)? {
            Target::Shard(s) => self.master_on(view, s, &req).await,
            Target::Batch => self.master_batch(view, req).await,
            Target::Connection | Target::Coordinator => self.master_on(view, 0, &req).await,
        }
    }

    /// A typed call without a deadline of its own (for calls made inside
    /// an operation that has one).
    async fn ask<C: Call>(&self, c: C) -> Result<C::Reply, KvError> {
        C::reply(self.send(c.into()).await?)
    }

    /// A batch request: one sub-batch per owning shard (cut into pieces of
    /// [`BATCH_PIECE`] keys or the master's `max_batch`), sent at once,
    /// merged back in the order of the keys.
    async fn master_batch(
        &self,
        view: &View,
        req: MasterRequest,
    ) -> Result<MasterResponse, KvError> {
        let n = req.batch_keys().map(|k| k.len()).unwrap_or(0);
        let piece = BATCH_PIECE.min(view.cluster.max_batch.max(1) as usize);
        let parts = split_batch_pieces(req, |k| shard_in(view, k) as u32, piece);
        let calls = parts.into_iter().map(|p| async move {
            let res = self.master_on(view, p.shard as usize, &p.req).await;
            (p.positions, res)
        });
        let answers = futures_util::future::join_all(calls).await;
        merge_batch(n, answers)
    }

    async fn master_on(
        &self,
        view: &View,
        shard: usize,
        req: &MasterRequest,
    ) -> Result<MasterResponse, KvError> {
        match self.master_once(view, shard, req).await {
            // A pooled connection the master closed while it sat idle (the
            // master restarted, or timed it out): once more on a new one,
            // for requests that may safely be sent twice.
            Err((e, true))
                if req.is_idempotent()
                    && matches!(e.code, ErrorCode::Unavailable | ErrorCode::Timeout) =>
            {
                tracing::debug!("a pooled master connection was stale ({e}); retrying");
                self.master_once(view, shard, req).await.map_err(|(e, _)| e)
            }
            r => r.map_err(|(e, _)| e),
        }
    }

    /// One try; the error says whether it broke a reused connection.
    async fn master_once(
        &self,
        view: &View,
        shard: usize,
        req: &MasterRequest,
    ) -> Result<MasterResponse, (KvError, bool)> {
        let pool = &view.master_pools[shard];
        let mut conn = pool
            .get(Duration::from_millis(self.inner.cfg.connect_timeout_ms))
            .await
            .map_err(|e| (e, false))?;
        let reused = !conn.is_new();
        if !reused {
            if let Some(k) = &self.inner.key {
                let id = self.inner.req_ids.fetch_add(2, Ordering::Relaxed);
                authenticate(conn.stream(), k, self.inner.id, id, self.max_frame())
                    .await
                    .map_err(|e| {
                        let e = KvError::new(e.code, format!("{}: {}", pool.addr(), e.message));
                        (e, false)
                    })?;
            }
        }
        let id = self.inner.req_ids.fetch_add(1, Ordering::Relaxed);
        // A transport failure drops the connection; an answer (even an
        // error) leaves it usable.
        let answer = rpc(conn.stream(), id, req, self.max_frame())
            .await
            .map_err(|e| {
                let e = KvError::new(e.code, format!("{}: {}", pool.addr(), e.message));
                (e, reused)
            })?;
        conn.release();
        answer.map_err(|e| (e, false))
    }

    /// A typed master call under the client's deadline, routed by
    /// [`route::target`]: `client.call(call::Exist { key }).await?` is a
    /// `bool`. Every method below that speaks to the master goes through it
    /// (`put`/`get` then move the data).
    pub async fn call<C: Call>(&self, c: C) -> Result<C::Reply, KvError> {
        self.deadline(C::OP, self.ask(c)).await
    }

    /// A raw master request under the client's deadline, routed as
    /// [`Client::call`]; the answer as it came (for tools and benches that
    /// hold a `MasterRequest`).
    pub async fn request(&self, req: MasterRequest) -> Result<MasterResponse, KvError> {
        self.deadline(req.op_name(), self.send(req)).await
    }

    /// Gets served from remembered locations, without the master.
    pub fn location_hits(&self) -> u64 {
        self.inner.location_hits.load(Ordering::Relaxed)
    }

    fn call_deadline(&self) -> Instant {
        Instant::now() + self.timeout()
    }

    /// A zeroed buffer of `len` bytes for [`Client::put_from`] and
    /// [`Client::get_into_registered`]: registered with the NIC when this
    /// client has RDMA (zero-copy transfers), ordinary memory otherwise
    /// (see [`RegisteredBuffer`]). RDMA registration pins the
    /// pages; a full MR cache is `ResourceExhausted`.
    pub fn register_buffer(&self, len: usize) -> Result<RegisteredBuffer, KvError> {
        if len == 0 {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                "cannot register an empty buffer",
            ));
        }
        if let Some(nic) = self.inner.engine.rdma_nic() {
            let buf = Arc::new(kvpool_transport::nic::RdmaBuffer::new(len));
            let reg = nic.register(buf.clone())?;
            return Ok(RegisteredBuffer {
                mem: BufferMem::Nic {
                    buf,
                    reg,
                    nic: nic.clone(),
                },
                len,
            });
        }
        Ok(RegisteredBuffer {
            mem: BufferMem::Host(vec![0u8; len].into_boxed_slice()),
            len,
        })
    }

    /// Registers memory the caller owns, `addr..addr + len`, for transfers:
    /// with RDMA on, the NIC gets a memory region for it, so that
    /// [`Client::get_into`] into it and puts from it are zero copy (other
    /// memory is staged through a bounce buffer); without RDMA nothing is
    /// needed and the range is only recorded. An empty or null range is
    /// `InvalidParams`; a full MR cache is `ResourceExhausted`.
    ///
    /// # Safety
    /// The range must be mapped, writable memory that stays valid, at the
    /// same address, until the returned value is dropped and every transfer
    /// on it has ended (a transfer abandoned at its deadline may still be
    /// written by the NIC for a moment after its call returned).
    pub unsafe fn register_memory(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<MemoryRegistration, KvError> {
        if len == 0 || addr == 0 || addr.checked_add(len).is_none() {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                format!("cannot register {len} bytes at {addr:#x}"),
            ));
        }
        if let Some(nic) = self.inner.engine.rdma_nic() {
            // SAFETY: the range's validity until the registration is gone
            // is this function's own contract, passed on.
            let raw = unsafe { kvpool_transport::nic::RawMemory::new(addr as *mut u8, len) }
                .ok_or_else(|| KvError::new(ErrorCode::InvalidParams, "null address"))?;
            let reg = nic.register(Arc::new(raw))?;
            return Ok(MemoryRegistration {
                addr,
                len,
                nic: Some((reg, nic.clone())),
            });
        }
        Ok(MemoryRegistration {
            addr,
            len,
            nic: None,
        })
    }

    /// Stores `value` under `key` with one replica. A key that is stored
    /// already is `ObjectAlreadyExists` (objects are written once; see
    /// [`Client::upsert`] to replace one).
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        self.put_with(key, value, &PutOptions::default()).await
    }

    /// Stores `value` under `key` with one replica, replacing the value
    /// stored there if there is one (or storing it, if there is none): the
    /// atomic replace. A get returns the old value until the master has
    /// ended the put, the new one from then on (a get this client starts
    /// after the call returned always does); never a mix of the two, and
    /// never "not found" in between. Another client that read the old value
    /// shortly before may read it again from where it lies until its read
    /// lease ends (the old bytes stay in place that long; see
    /// [`ClientConfig::location_cache_entries`]). Two clients replacing one
    /// key at once both succeed, one after the other (the later end wins):
    /// the second waits for the first within its deadline. Options
    /// (replicas, pins) through [`Client::put_with`] with
    /// [`PutOptions::replace`].
    pub async fn upsert(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        let opts = PutOptions {
            replace: true,
            ..PutOptions::default()
        };
        self.put_with(key, value, &opts).await
    }

    /// Stores the first `len` bytes of `buf` under `key`, sent straight from
    /// the buffer (zero copy over RDMA; TCP and shared memory copy from it as
    /// from any buffer). `len` past the buffer is `InvalidParams`.
    pub async fn put_from(
        &self,
        key: &[u8],
        buf: &RegisteredBuffer,
        len: usize,
    ) -> Result<(), KvError> {
        self.put_from_with(key, buf, len, &PutOptions::default())
            .await
    }

    /// [`Client::put_from`] with `opts` (replicas, pins, `replace`).
    pub async fn put_from_with(
        &self,
        key: &[u8],
        buf: &RegisteredBuffer,
        len: usize,
        opts: &PutOptions,
    ) -> Result<(), KvError> {
        if len > buf.len() {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                format!(
                    "{len} bytes asked from a registered buffer of {}",
                    buf.len()
                ),
            ));
        }
        self.put_with(key, &buf.bytes()?[..len], opts).await
    }

    /// Reads the value under `key` into `buf` (zero copy over RDMA); returns
    /// its length. A value longer than the buffer is `InvalidParams`.
    pub async fn get_into_registered(
        &self,
        key: &[u8],
        buf: &mut RegisteredBuffer,
    ) -> Result<usize, KvError> {
        let dst = buf.bytes_mut()?;
        self.get_into(key, dst).await
    }

    /// Stores `value` under `key` with `opts` (replicas, pins; `replace` for
    /// the atomic replace of [`Client::upsert`]). Within the call's
    /// deadline, a put that meets space still being freed (demotions to
    /// NVMe), a key still being recovered by a restarted master, or a
    /// replace that meets another client's put of the key, waits for it,
    /// and one whose node turns out unreachable is reported to the
    /// master and placed again elsewhere.
    pub async fn put_with(
        &self,
        key: &[u8],
        value: &[u8],
        opts: &PutOptions,
    ) -> Result<(), KvError> {
        // Forgotten once the put is over (returned or dropped): a get of
        // this client that asked the master before the put ended must not
        // leave the old object's replicas behind for the next get.
        let _forget = OnDrop(|| self.inner.locations.forget(key));
        let start = Instant::now();
        let deadline = start + self.timeout();
        let ids = &self.inner.put_ids;
        let mut put = PutProtocol::new(
            self.inner.id,
            key.to_vec(),
            value.len() as u64,
            self.with_host(opts),
            self.timeout(),
        );
        let res = self
            .deadline("put", async {
                let mut action = put.begin(ids);
                loop {
                    action = match action {
                        Action::Ask(req) => {
                            let res = self.send(req).await;
                            put.answered(start.elapsed(), ids, res)
                        }
                        Action::Write { replicas, by } => {
                            let by = start + by;
                            let engine = &self.inner.engine;
                            // The checksum is computed as the bytes go out
                            // (each piece while it is in cache), not in a
                            // pass of its own.
                            let written = if self.inner.cfg.checksums {
                                engine.write_summed(&replicas, value, by).await.map(Some)
                            } else {
                                engine.write(&replicas, value, by).await.map(|()| None)
                            };
                            put.written(written)
                        }
                        Action::Sleep(pause) => {
                            tokio::time::sleep(pause).await;
                            put.woke(ids)
                        }
                        Action::ReportUnreachable => {
                            let n = self.report_unreachable().await;
                            put.reported(ids, n)
                        }
                        Action::ReadBack => {
                            let holds = self.holds(key, value, deadline).await;
                            put.held(ids, holds)
                        }
                        Action::Done(r) => return r,
                    }
                }
            })
            .await;
        if let Some(revoke) = res.as_ref().err().and_then(|e| put.revoke_after(e)) {
            // The put may be half done: give its space back, best effort,
            // under a deadline of its own.
            let me = self.clone();
            tokio::spawn(async move {
                let _ = me.deadline("put revoke", me.send(revoke)).await;
            });
        }
        res
    }

    /// A name for a new placement of a put (wraps, skipping 0).
    fn next_put_id(&self) -> u16 {
        self.inner.put_ids.next()
    }

    fn with_host(&self, opts: &PutOptions) -> PutOptions {
        let mut opts = opts.clone();
        if opts.preferred_host.is_empty() {
            opts.preferred_host = self.inner.host_id.clone();
        }
        opts
    }

    /// Tells the master about the segments the engine could not reach (it
    /// stops placing there until their node pings); how many there were.
    async fn report_unreachable(&self) -> usize {
        let segs = self.inner.engine.take_unreachable();
        for &segment_id in &segs {
            let r = self
                .ask(call::ReportUnreachable {
                    client_id: self.inner.id,
                    segment_id,
                })
                .await;
            if let Err(e) = r {
                tracing::debug!("could not report segment {segment_id:016x} unreachable: {e}");
            }
        }
        segs.len()
    }

    /// Reports unreachable segments in the background (after a read that
    /// failed over: other clients' puts should not go there).
    fn report_unreachable_later(&self) {
        if self.inner.engine.has_unreachable() {
            let me = self.clone();
            tokio::spawn(async move {
                let _ = me
                    .deadline("report_unreachable", async {
                        me.report_unreachable().await;
                        Ok(())
                    })
                    .await;
            });
        }
    }

    /// Whether the key's stored object holds exactly `value` (read back
    /// under `deadline`, its checksum checked as any read's); false on any
    /// error. For a put that cannot tell whether its own end took effect.
    async fn holds(&self, key: &[u8], value: &[u8], deadline: Instant) -> bool {
        let (mut get, step) = GetProtocol::start(key, &self.inner.locations, false, Instant::now());
        let Ok((replicas, until)) = self.to_read(key, &mut get, step).await else {
            return false;
        };
        if replicas.first().map(|r| r.len) != Some(value.len() as u64) {
            return false;
        }
        let mut buf = vec![0u8; value.len()];
        self.inner
            .engine
            .read(key, &replicas, &mut buf, deadline.min(until))
            .await
            .is_ok()
            && buf == value
    }

    /// Reads the value under `key`. A key this client read while its lease
    /// still lasts is read from its node at once (see
    /// [`ClientConfig::location_cache_entries`]).
    pub async fn get(&self, key: &[u8]) -> Result<Vec<u8>, KvError> {
        let deadline = self.call_deadline();
        let r = self
            .deadline("get", async {
                let locations = &self.inner.locations;
                let (mut get, mut step) = GetProtocol::start(key, locations, true, Instant::now());
                loop {
                    let (replicas, until) = self.to_read(key, &mut get, step).await?;
                    let mut buf = zeroed(replicas[0].len)?;
                    let read =
                        self.inner
                            .engine
                            .read(key, &replicas, &mut buf, deadline.min(until));
                    match read.await {
                        Ok(()) => return Ok(self.served(&get, buf)),
                        Err(e) => step = get.read_failed(key, locations, e, Instant::now())?,
                    }
                }
            })
            .await;
        self.report_unreachable_later();
        r
    }

    /// Reads the value under `key` straight into `buf`; returns its length.
    /// A value longer than `buf` is `InvalidParams` (nothing is read).
    pub async fn get_into(&self, key: &[u8], buf: &mut [u8]) -> Result<usize, KvError> {
        let deadline = self.call_deadline();
        let r = self
            .deadline("get", async {
                let locations = &self.inner.locations;
                let (mut get, mut step) = GetProtocol::start(key, locations, true, Instant::now());
                loop {
                    let (replicas, until) = self.to_read(key, &mut get, step).await?;
                    let len = replicas[0].len as usize;
                    let read = match buf.get_mut(..len) {
                        None => Err(too_small(len, buf.len())),
                        Some(into) => {
                            let until = deadline.min(until);
                            self.inner.engine.read(key, &replicas, into, until).await
                        }
                    };
                    match read {
                        Ok(()) => return Ok(self.served(&get, len)),
                        Err(e) => step = get.read_failed(key, locations, e, Instant::now())?,
                    }
                }
            })
            .await;
        self.report_unreachable_later();
        r
    }

    /// What `step` says to read and until when: a remembered entry's
    /// replicas, or the master's answer (asked now).
    async fn to_read(
        &self,
        key: &[u8],
        get: &mut GetProtocol<Instant>,
        step: Step<Instant>,
    ) -> Result<(Arc<[ReplicaDesc]>, Instant), KvError> {
        match step {
            Step::Read { replicas, until } => Ok((replicas, until)),
            Step::Ask => {
                let r = self.ask(call::GetReplicaList { key: key.to_vec() }).await?;
                let locations = &self.inner.locations;
                get.answered(key, locations, r, self.answers(), Instant::now())
            }
        }
    }

    /// What this client holds the master's replica lists to: the cluster
    /// map's lease and value bound, and its own checksum setting.
    fn answers(&self) -> Answers {
        let cluster = &self.view().cluster;
        Answers {
            lease: Duration::from_millis(cluster.lease_ttl_ms),
            checksums: self.inner.cfg.checksums,
            max_len: cluster.max_value_bytes,
        }
    }

    /// A get's value, counted as served from the location cache when it
    /// was.
    fn served<V>(&self, get: &GetProtocol<Instant>, value: V) -> V {
        if get.cached() {
            self.inner.location_hits.fetch_add(1, Ordering::Relaxed);
        }
        value
    }

    /// A view of the value under `key` in the memory of a storage node on
    /// this host, valid while its read lease lasts: one lookup, then reads
    /// that copy the bytes from shared memory and check the copy
    /// ([`ReadView::read_into`]: `Corrupt` if no same-host replica's copy
    /// matches). `Unavailable` when no DRAM replica is on this host or shared
    /// memory cannot be used.
    pub async fn get_view(&self, key: &[u8]) -> Result<ReadView, KvError> {
        self.deadline("get_view", async {
            let granted = Instant::now();
            let (mut get, step) = GetProtocol::start(key, &self.inner.locations, false, granted);
            let (replicas, _) = self.to_read(key, &mut get, step).await?;
            self.view_of(&replicas, granted).await
        })
        .await
    }

    /// A view of the same-host DRAM replicas of `replicas` that map, under
    /// the lease granted at `granted`. Reading it checks the bytes
    /// ([`ReadView::read_into`]).
    async fn view_of(
        &self,
        replicas: &[ReplicaDesc],
        granted: Instant,
    ) -> Result<ReadView, KvError> {
        // A view's `read` sizes its buffer by the length (batch views come
        // straight from the master's answer).
        within_bound(replicas, self.answers().max_len)?;
        let mut mapped = Vec::new();
        let local = replicas
            .iter()
            .filter(|r| r.tier == Tier::Dram && r.host_id == self.inner.host_id);
        for r in local {
            if let Some(map) = self.inner.engine.shm_map(r).await {
                mapped.push((map, r.clone()));
            }
        }
        let Some(len) = mapped.first().map(|(_, r)| r.len) else {
            return Err(KvError::new(
                ErrorCode::Unavailable,
                "no replica of this object can be mapped on this host",
            ));
        };
        let lease = Duration::from_millis(self.view().cluster.lease_ttl_ms);
        Ok(ReadView {
            replicas: mapped,
            len,
            valid_until: granted + lease.saturating_sub(READ_MARGIN),
            client: self.inner.clone(),
        })
    }

    /// True if a complete object is stored under `key`. Does not extend leases.
    pub async fn exists(&self, key: &[u8]) -> Result<bool, KvError> {
        self.call(call::Exist { key: key.to_vec() }).await
    }

    /// Removes the object under `key`.
    pub async fn remove(&self, key: &[u8]) -> Result<(), KvError> {
        self.remove_with(key, false).await
    }

    /// Removes the object under `key`; `force` removes it even under a lease.
    pub async fn remove_with(&self, key: &[u8], force: bool) -> Result<(), KvError> {
        let _forget = OnDrop(|| self.inner.locations.forget(key)); // as in `put_with`
        self.call(call::Remove {
            key: key.to_vec(),
            force,
        })
        .await
    }

    /// Removes every object that may be removed (none under a live
    /// lease); returns how many went.
    pub async fn remove_all(&self) -> Result<u64, KvError> {
        self.remove_all_with(false).await
    }

    /// [`Client::remove_all`]; with `force`, objects under a lease go too
    /// (their space waits for the lease).
    pub async fn remove_all_with(&self, force: bool) -> Result<u64, KvError> {
        let _forget = OnDrop(|| self.inner.locations.clear()); // as in `put_with`
        self.call(call::RemoveAll { force }).await
    }

    /// Segments, capacity, use and key count of the pool.
    pub async fn stat(&self) -> Result<PoolStat, KvError> {
        self.call(call::Stat).await
    }

    /// The metadata the master holds for `key` (no lease is granted).
    pub async fn describe(&self, key: &[u8]) -> Result<ObjectInfo, KvError> {
        self.call(call::Describe { key: key.to_vec() }).await
    }

    /// Stops new puts to a segment; its replicas stay readable.
    pub async fn drain_segment(&self, segment_id: SegmentId) -> Result<(), KvError> {
        self.call(call::DrainSegment { segment_id }).await
    }

    /// Tells the master this client is alive.
    pub async fn ping(&self) -> Result<(), KvError> {
        self.ping_segments(&[]).await.map(|_| ())
    }

    /// Tells the master this client (a storage node) is alive and owns
    /// `segments`; returns those the master does not know (it restarted,
    /// or declared the node dead): the node mounts them again.
    pub async fn ping_segments(&self, segments: &[SegmentId]) -> Result<Vec<SegmentId>, KvError> {
        self.call(call::Ping {
            client_id: self.inner.id,
            segments: segments.to_vec(),
        })
        .await
    }

    /// Mounts a segment owned by this client; returns its id.
    pub async fn mount_segment(&self, spec: SegmentSpec) -> Result<SegmentId, KvError> {
        self.call(call::MountSegment {
            client_id: self.inner.id,
            spec,
        })
        .await
    }

    /// Unmounts a segment this client mounted (idempotent).
    pub async fn unmount_segment(&self, segment_id: SegmentId) -> Result<(), KvError> {
        self.call(call::UnmountSegment {
            client_id: self.inner.id,
            segment_id,
        })
        .await
    }
}

fn too_small(len: usize, have: usize) -> KvError {
    KvError::new(
        ErrorCode::InvalidParams,
        format!("value of {len} bytes does not fit a buffer of {have}"),
    )
}

/// One request and its answer. Outer error: the connection failed (or the
/// master refused the connection itself, e.g. at its connection cap, with
/// that error's code); inner: the master's answer.
async fn rpc(
    s: &mut Stream,
    id: u64,
    req: &MasterRequest,
    max_frame: u32,
) -> Result<Result<MasterResponse, KvError>, KvError> {
    frame::write_all(s, &frame::encode(FrameKind::MasterRequest, id, req)).await?;
    let (rid, answer) =
        frame::read_reply::<MasterResponse, _>(s, FrameKind::MasterResponse, max_frame).await?;
    kvpool_wire::frame::check_answer(rid, id, answer)
}

/// Proves to the master that this connection holds the cluster secret, and
/// checks the master's proof in turn (a master without the secret is not
/// trusted with this client's requests). Uses request ids `id` and `id + 1`.
async fn authenticate(
    s: &mut Stream,
    key: &ClusterKey,
    client_id: ClientId,
    id: u64,
    max_frame: u32,
) -> Result<(), KvError> {
    let nc = auth::nonce();
    let begin = call::AuthBegin {
        client_id,
        nonce: nc,
    };
    let ns = match rpc(s, id, &begin.into(), max_frame).await? {
        Ok(resp) => call::AuthBegin::reply(resp)?,
        Err(e) if e.code == ErrorCode::Unsupported => {
            return Err(KvError::new(
                ErrorCode::Unauthenticated,
                format!(
                    "this client has a cluster secret but the master has none ({}); \
                     refusing to trust it",
                    e.message
                ),
            ))
        }
        Err(e) => return Err(e),
    };
    let prove = call::AuthProve {
        proof: key.client_proof(client_id, &nc, &ns),
    };
    let proof = call::AuthProve::reply(rpc(s, id + 1, &prove.into(), max_frame).await??)?;
    key.verify_server_proof(client_id, &nc, &ns, &proof)
        .map_err(|_| {
            KvError::new(
                ErrorCode::Unauthenticated,
                "the master could not prove it holds the cluster secret",
            )
        })
}

/// This machine's name, for same-host decisions.
pub fn local_host_id() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// The transfer engine's data path for the configured one.
fn transport_choice(t: kvpool_config::Transport) -> TransportChoice {
    use kvpool_config::Transport;
    match t {
        Transport::Auto => TransportChoice::Auto,
        Transport::Tcp => TransportChoice::Tcp,
        Transport::Shm => TransportChoice::Shm,
        Transport::Rdma => TransportChoice::Rdma,
    }
}
