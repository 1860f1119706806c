//! The store client: what embedders, the CLI and storage nodes use.
//!
//! `put` = master `PutStart` (allocates) -> write the bytes straight into each
//! replica's storage node -> `PutEnd`. `get` = master `GetReplicaList` ->
//! read the best replica (same host first), the next on failure. Every call
//! runs under one deadline (`client.timeout_ms`); connections are pooled per
//! endpoint and bounded (`client.max_connections_per_endpoint`).
//!
//! The client runs on tokio (it is what embedders have); requests go straight
//! to the master shard that owns the key, using the cluster map from `Hello`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvpool_transport::KvError> {
//! use kvpool_actors::client::Client;
//! use kvpool_actors::config::ClientConfig;
//!
//! let client = Client::connect("127.0.0.1:7070", ClientConfig::default()).await?;
//! client.put(b"model@0123@fp16@256", b"kv bytes").await?;
//! assert_eq!(client.get(b"model@0123@fp16@256").await?, b"kv bytes");
//! client.remove(b"model@0123@fp16@256").await?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvpool_runtime::hash::{vshard_of, ShardMap};
use kvpool_transport::frame::{self, FrameKind};
use kvpool_transport::proto::{
    ClientId, ClusterMap, DataRequest, DataResponse, MasterRequest, MasterResponse, ObjectInfo,
    PoolStat, PutItem, PutOptions, ReplicaDesc, SegmentId, SegmentSpec,
};
use kvpool_transport::{ErrorCode, KvError};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::compat::{Compat, TokioAsyncReadCompatExt};

use crate::config::ClientConfig;
use crate::master::coord::{merge_batch, split_batch_by};

type Stream = Compat<TcpStream>;

/// Payloads up to this size go out in the same write as their frame.
const COALESCE_BYTES: usize = 16 * 1024;

/// A connection pool to one address, bounded by a semaphore.
struct Pool {
    addr: String,
    idle: Mutex<Vec<Stream>>,
    slots: Arc<Semaphore>,
}

/// A connection taken from a pool; dropped (closed) unless released.
struct Conn {
    stream: Option<Stream>,
    pool: Arc<Pool>,
    _slot: OwnedSemaphorePermit,
}

impl Conn {
    fn stream(&mut self) -> &mut Stream {
        self.stream.as_mut().expect("present until release")
    }

    /// Returns a healthy connection to its pool.
    fn release(mut self) {
        if let Some(s) = self.stream.take() {
            self.pool
                .idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(s);
        }
    }
}

impl Pool {
    fn new(addr: String, max: usize) -> Self {
        Self {
            addr,
            idle: Mutex::new(Vec::new()),
            slots: Arc::new(Semaphore::new(max)),
        }
    }

    async fn get(self: &Arc<Self>, connect_timeout: Duration) -> Result<Conn, KvError> {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| KvError::new(ErrorCode::Internal, "connection pool closed"))?;
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let stream = match idle {
            Some(s) => s,
            None => {
                let s = tokio::time::timeout(connect_timeout, TcpStream::connect(&self.addr))
                    .await
                    .map_err(|_| {
                        KvError::new(
                            ErrorCode::Timeout,
                            format!("connecting to {} took over {connect_timeout:?}", self.addr),
                        )
                    })?
                    .map_err(|e| {
                        KvError::new(
                            ErrorCode::Unavailable,
                            format!("cannot connect to {}: {e}", self.addr),
                        )
                    })?;
                let _ = s.set_nodelay(true);
                s.compat()
            }
        };
        Ok(Conn {
            stream: Some(stream),
            pool: self.clone(),
            _slot: slot,
        })
    }
}

struct Inner {
    id: ClientId,
    cfg: ClientConfig,
    cluster: ClusterMap,
    map: ShardMap,
    master_pools: Vec<Arc<Pool>>,
    data_pools: Mutex<HashMap<String, Arc<Pool>>>,
    req_ids: AtomicU64,
    host_id: String,
}

/// A connection to a kvpool pool. Cheap to clone; share one per process.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

fn unexpected(op: &str, resp: &MasterResponse) -> KvError {
    KvError::new(
        ErrorCode::Internal,
        format!("master answered {op} with an unexpected {resp:?}"),
    )
}

fn host_of(addr: &str) -> String {
    match addr.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']').to_string(),
        None => addr.to_string(),
    }
}

impl Client {
    /// Connects to the master at `master` (`host:port` of its shard 0) and
    /// learns the cluster map.
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
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let boot = Arc::new(Pool::new(master.to_string(), 1));
        let (cluster, boot_conn) = tokio::time::timeout(timeout, async {
            let mut conn = boot
                .get(Duration::from_millis(cfg.connect_timeout_ms))
                .await?;
            let resp = rpc(
                conn.stream(),
                1,
                &MasterRequest::Hello { client_id: id },
                cfg.max_frame_bytes.get() as u32,
            )
            .await??;
            match resp {
                MasterResponse::Hello { cluster } => Ok((cluster, conn)),
                other => Err(unexpected("hello", &other)),
            }
        })
        .await
        .map_err(|_| {
            KvError::new(
                ErrorCode::Timeout,
                format!("master {master} did not answer within {timeout:?}"),
            )
        })??;
        if cluster.shards.is_empty() {
            return Err(KvError::new(
                ErrorCode::Internal,
                "master sent an empty cluster map",
            ));
        }
        let map = ShardMap::new(cluster.shards.len() as u32).ok_or_else(|| {
            KvError::new(ErrorCode::Unsupported, "cluster map has too many shards")
        })?;
        let master_host = host_of(master);
        let max = cfg.max_connections_per_endpoint;
        let master_pools: Vec<Arc<Pool>> = cluster
            .shards
            .iter()
            .map(|s| {
                let host = if s.host.is_empty() {
                    master_host.clone()
                } else {
                    s.host.clone()
                };
                let ep = kvpool_transport::proto::Endpoint {
                    host,
                    port: s.port,
                    nr_shards: 1,
                };
                Arc::new(Pool::new(ep.shard_addr(0), max))
            })
            .collect();
        // Keep the bootstrap connection if it is shard 0's.
        if master_pools[0].addr == boot.addr {
            if let Some(s) = { boot_conn }.stream.take() {
                master_pools[0]
                    .idle
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(s);
            }
        }
        let ping_ms = cfg.ping_interval_ms;
        let client = Self {
            inner: Arc::new(Inner {
                id,
                cfg,
                cluster,
                map,
                master_pools,
                data_pools: Mutex::new(HashMap::new()),
                req_ids: AtomicU64::new(1),
                host_id,
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

    pub fn cluster_map(&self) -> &ClusterMap {
        &self.inner.cluster
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
            Err(KvError::new(
                ErrorCode::Timeout,
                format!("{what} did not finish within {t:?}"),
            ))
        })
    }

    /// One master call on the shard that owns `req`'s key (shard 0 otherwise).
    /// The master shard that owns `key`, by the cluster map's ranges.
    fn shard_of(&self, key: &[u8]) -> usize {
        let v = vshard_of(key);
        self.inner
            .cluster
            .shards
            .iter()
            .position(|s| (s.vshard_start..s.vshard_end).contains(&v))
            .unwrap_or_else(|| self.inner.map.shard_of(key) as usize)
    }

    async fn master(&self, req: &MasterRequest) -> Result<MasterResponse, KvError> {
        let shard = req.key().map(|k| self.shard_of(k)).unwrap_or(0);
        self.master_on(shard, req).await
    }

    /// A batch request: one sub-batch per owning shard, sent at once, merged
    /// back in the order of the keys.
    async fn master_batch(&self, req: MasterRequest) -> Result<MasterResponse, KvError> {
        let n = req.batch_keys().map(|k| k.len()).unwrap_or(0);
        let parts = split_batch_by(req, |k| self.shard_of(k) as u32);
        let calls = parts.into_iter().map(|p| async move {
            let res = self.master_on(p.shard as usize, &p.req).await;
            (p.positions, res)
        });
        let answers = futures_util::future::join_all(calls).await;
        merge_batch(n, answers)
    }

    async fn master_on(
        &self,
        shard: usize,
        req: &MasterRequest,
    ) -> Result<MasterResponse, KvError> {
        let pool = &self.inner.master_pools[shard];
        let mut conn = pool
            .get(Duration::from_millis(self.inner.cfg.connect_timeout_ms))
            .await?;
        let id = self.inner.req_ids.fetch_add(1, Ordering::Relaxed);
        // A transport failure drops the connection; an answer (even an
        // error) leaves it usable.
        let answer = rpc(conn.stream(), id, req, self.max_frame())
            .await
            .map_err(|e| with_peer(e, &pool.addr))?;
        conn.release();
        answer
    }

    fn data_pool(&self, addr: String) -> Arc<Pool> {
        let mut pools = self
            .inner
            .data_pools
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        pools
            .entry(addr.clone())
            .or_insert_with(|| {
                Arc::new(Pool::new(addr, self.inner.cfg.max_connections_per_endpoint))
            })
            .clone()
    }

    /// Stores `value` under `key` with one replica.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        self.put_with(key, value, &PutOptions::default()).await
    }

    /// Stores `value` under `key` with `opts` (replicas, pins).
    pub async fn put_with(
        &self,
        key: &[u8],
        value: &[u8],
        opts: &PutOptions,
    ) -> Result<(), KvError> {
        let res = self.deadline("put", self.put_inner(key, value, opts)).await;
        if let Err(e) = &res {
            if e.code == ErrorCode::Timeout {
                // The put may be half done: give its space back, best effort,
                // under a deadline of its own.
                let me = self.clone();
                let key = key.to_vec();
                tokio::spawn(async move {
                    let _ = me
                        .deadline(
                            "put revoke",
                            me.master(&MasterRequest::PutRevoke {
                                client_id: me.inner.id,
                                key,
                            }),
                        )
                        .await;
                });
            }
        }
        res
    }

    async fn put_inner(&self, key: &[u8], value: &[u8], opts: &PutOptions) -> Result<(), KvError> {
        let mut opts = opts.clone();
        if opts.preferred_host.is_empty() {
            opts.preferred_host = self.inner.host_id.clone();
        }
        let resp = self
            .master(&MasterRequest::PutStart {
                client_id: self.inner.id,
                key: key.to_vec(),
                len: value.len() as u64,
                opts,
            })
            .await?;
        let replicas = match resp {
            MasterResponse::Replicas(r) => r,
            other => return Err(unexpected("put_start", &other)),
        };
        let writes = replicas.iter().map(|r| self.write_replica(r, value));
        match futures_util::future::try_join_all(writes).await {
            Ok(_) => {
                self.master(&MasterRequest::PutEnd {
                    client_id: self.inner.id,
                    key: key.to_vec(),
                })
                .await?;
                Ok(())
            }
            Err(e) => {
                let _ = self
                    .master(&MasterRequest::PutRevoke {
                        client_id: self.inner.id,
                        key: key.to_vec(),
                    })
                    .await;
                Err(e)
            }
        }
    }

    async fn write_replica(&self, r: &ReplicaDesc, value: &[u8]) -> Result<(), KvError> {
        let addr = r.endpoint.shard_addr(r.data_shard());
        let mut conn = self
            .data_pool(addr)
            .get(Duration::from_millis(self.inner.cfg.connect_timeout_ms))
            .await?;
        let id = self.inner.req_ids.fetch_add(1, Ordering::Relaxed);
        let mut bytes = frame::encode(
            FrameKind::DataRequest,
            id,
            &DataRequest::Write {
                segment_id: r.segment_id,
                offset: r.offset,
                len: value.len() as u64,
            },
        );
        let s = conn.stream();
        if value.len() <= COALESCE_BYTES {
            bytes.extend_from_slice(value);
            frame::write_all(s, &bytes).await?;
        } else {
            frame::write_all(s, &bytes).await?;
            frame::write_all(s, value).await?;
        }
        let (rid, answer) =
            frame::read_reply::<DataResponse, _>(s, FrameKind::DataResponse, self.max_frame())
                .await
                .map_err(|e| with_peer(e.into(), &conn_addr(r)))?;
        check_id(rid, id)?;
        // A refused write may have left its payload unread: do not reuse.
        match answer? {
            DataResponse::Written => {
                conn.release();
                Ok(())
            }
            other => Err(KvError::new(
                ErrorCode::Internal,
                format!("storage answered a write with {other:?}"),
            )),
        }
    }

    async fn read_replica(&self, r: &ReplicaDesc, buf: &mut [u8]) -> Result<(), KvError> {
        let addr = r.endpoint.shard_addr(r.data_shard());
        let mut conn = self
            .data_pool(addr)
            .get(Duration::from_millis(self.inner.cfg.connect_timeout_ms))
            .await?;
        let id = self.inner.req_ids.fetch_add(1, Ordering::Relaxed);
        let req = frame::encode(
            FrameKind::DataRequest,
            id,
            &DataRequest::Read {
                segment_id: r.segment_id,
                offset: r.offset,
                len: r.len,
            },
        );
        let s = conn.stream();
        frame::write_all(s, &req).await?;
        let (rid, answer) =
            frame::read_reply::<DataResponse, _>(s, FrameKind::DataResponse, self.max_frame())
                .await
                .map_err(|e| with_peer(e.into(), &conn_addr(r)))?;
        check_id(rid, id)?;
        let resp = match answer {
            Ok(resp) => resp,
            Err(e) => {
                // The peer refused the read and sent nothing after: reusable.
                conn.release();
                return Err(e);
            }
        };
        match resp {
            DataResponse::Data { len } if len == buf.len() as u64 => {
                futures_lite::AsyncReadExt::read_exact(s, buf)
                    .await
                    .map_err(|e| with_peer(e.into(), &conn_addr(r)))?;
                conn.release();
                Ok(())
            }
            other => Err(KvError::new(
                ErrorCode::Internal,
                format!(
                    "storage answered a read of {} bytes with {other:?}",
                    buf.len()
                ),
            )),
        }
    }

    /// Replicas in the order to try: same host first, then the rest.
    fn read_order(&self, mut replicas: Vec<ReplicaDesc>) -> Vec<ReplicaDesc> {
        replicas.sort_by_key(|r| r.host_id != self.inner.host_id);
        replicas
    }

    /// Reads the value under `key`.
    pub async fn get(&self, key: &[u8]) -> Result<Vec<u8>, KvError> {
        self.deadline("get", async {
            let replicas = self.replicas(key).await?;
            let len = replicas[0].len as usize;
            let mut buf = vec![0u8; len];
            self.read_any(&replicas, &mut buf).await?;
            Ok(buf)
        })
        .await
    }

    /// Reads the value under `key` into `buf`; returns its length. A value
    /// longer than `buf` is `InvalidParams` (nothing is read).
    pub async fn get_into(&self, key: &[u8], buf: &mut [u8]) -> Result<usize, KvError> {
        self.deadline("get", async {
            let replicas = self.replicas(key).await?;
            let len = replicas[0].len as usize;
            if len > buf.len() {
                return Err(KvError::new(
                    ErrorCode::InvalidParams,
                    format!(
                        "value of {len} bytes does not fit a buffer of {}",
                        buf.len()
                    ),
                ));
            }
            self.read_any(&replicas, &mut buf[..len]).await?;
            Ok(len)
        })
        .await
    }

    async fn replicas(&self, key: &[u8]) -> Result<Vec<ReplicaDesc>, KvError> {
        match self
            .master(&MasterRequest::GetReplicaList { key: key.to_vec() })
            .await?
        {
            MasterResponse::Replicas(r) if !r.is_empty() => Ok(self.read_order(r)),
            MasterResponse::Replicas(_) => Err(KvError::new(
                ErrorCode::ObjectNotFound,
                "the object has no readable replica",
            )),
            other => Err(unexpected("get_replica_list", &other)),
        }
    }

    async fn read_any(&self, replicas: &[ReplicaDesc], buf: &mut [u8]) -> Result<(), KvError> {
        let mut last = None;
        for r in replicas {
            match self.read_replica(r, buf).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::debug!(segment = r.segment_id, "replica read failed: {e}");
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least one replica"))
    }

    /// True if a complete object is stored under `key`. Does not extend leases.
    pub async fn exists(&self, key: &[u8]) -> Result<bool, KvError> {
        self.deadline("exists", async {
            match self
                .master(&MasterRequest::Exist { key: key.to_vec() })
                .await?
            {
                MasterResponse::Exists(b) => Ok(b),
                other => Err(unexpected("exist", &other)),
            }
        })
        .await
    }

    /// Removes the object under `key`.
    pub async fn remove(&self, key: &[u8]) -> Result<(), KvError> {
        self.remove_with(key, false).await
    }

    /// Removes the object under `key`; `force` removes it even under a lease.
    pub async fn remove_with(&self, key: &[u8], force: bool) -> Result<(), KvError> {
        self.deadline("remove", async {
            match self
                .master(&MasterRequest::Remove {
                    key: key.to_vec(),
                    force,
                })
                .await?
            {
                MasterResponse::Done => Ok(()),
                other => Err(unexpected("remove", &other)),
            }
        })
        .await
    }

    /// Removes every object that may be removed; returns how many went.
    pub async fn remove_all(&self) -> Result<u64, KvError> {
        self.deadline("remove_all", async {
            match self.master(&MasterRequest::RemoveAll).await? {
                MasterResponse::Removed(n) => Ok(n),
                other => Err(unexpected("remove_all", &other)),
            }
        })
        .await
    }

    /// Segments, capacity, use and key count of the pool.
    pub async fn stat(&self) -> Result<PoolStat, KvError> {
        self.deadline("stat", async {
            match self.master(&MasterRequest::Stat).await? {
                MasterResponse::Stat(s) => Ok(s),
                other => Err(unexpected("stat", &other)),
            }
        })
        .await
    }

    /// A raw master call, routed as the client routes its own: a key request
    /// to the shard that owns the key, a batch split by owning shard and
    /// merged back in order, anything else to shard 0. For tools and
    /// benches; `put`/`get` are the calls that move data.
    pub async fn call(&self, req: MasterRequest) -> Result<MasterResponse, KvError> {
        self.deadline(req.op_name(), async {
            if req.batch_keys().is_some() {
                self.master_batch(req).await
            } else {
                self.master(&req).await
            }
        })
        .await
    }

    /// Stores several values; one result per item, in order. Keys are
    /// grouped by owning master shard (one call per shard), values are
    /// written `client.batch_parallelism` at a time.
    pub async fn batch_put(
        &self,
        items: &[(&[u8], &[u8])],
        opts: &PutOptions,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        self.deadline("batch_put", async {
            let mut opts = opts.clone();
            if opts.preferred_host.is_empty() {
                opts.preferred_host = self.inner.host_id.clone();
            }
            let req = MasterRequest::BatchPutStart {
                client_id: self.inner.id,
                items: items
                    .iter()
                    .map(|(k, v)| PutItem {
                        key: k.to_vec(),
                        len: v.len() as u64,
                    })
                    .collect(),
                opts,
            };
            let started = match self.master_batch(req).await? {
                MasterResponse::BatchReplicas(v) => v,
                other => return Err(unexpected("batch_put_start", &other)),
            };
            // Per item: Ok(()) written; Err((e, true)) allocated but not
            // written (its space must go back); Err((e, false)) refused.
            let writes = started
                .into_iter()
                .zip(items)
                .map(|(r, (_, v))| async move {
                    let replicas: Vec<ReplicaDesc> = Result::from(r).map_err(|e| (e, false))?;
                    let all = replicas.iter().map(|r| self.write_replica(r, v));
                    futures_util::future::try_join_all(all)
                        .await
                        .map(|_| ())
                        .map_err(|e| (e, true))
                });
            let written: Vec<Result<(), (KvError, bool)>> =
                futures_util::stream::StreamExt::collect(
                    futures_util::stream::StreamExt::buffered(
                        futures_util::stream::iter(writes),
                        self.inner.cfg.batch_parallelism,
                    ),
                )
                .await;
            let keys_where = |pred: fn(&Result<(), (KvError, bool)>) -> bool| -> Vec<Vec<u8>> {
                written
                    .iter()
                    .zip(items)
                    .filter(|(w, _)| pred(w))
                    .map(|(_, (k, _))| k.to_vec())
                    .collect()
            };
            let ok_keys = keys_where(|w| w.is_ok());
            let failed_keys = keys_where(|w| matches!(w, Err((_, true))));
            if !failed_keys.is_empty() {
                let _ = self
                    .master_batch(MasterRequest::BatchPutRevoke {
                        client_id: self.inner.id,
                        keys: failed_keys,
                    })
                    .await;
            }
            let mut ended = if ok_keys.is_empty() {
                Vec::new().into_iter()
            } else {
                match self
                    .master_batch(MasterRequest::BatchPutEnd {
                        client_id: self.inner.id,
                        keys: ok_keys,
                    })
                    .await?
                {
                    MasterResponse::BatchDone(v) => v.into_iter(),
                    other => return Err(unexpected("batch_put_end", &other)),
                }
            };
            Ok(written
                .into_iter()
                .map(|w| match w {
                    Ok(()) => ended.next().map(Result::from).unwrap_or_else(|| {
                        Err(KvError::new(ErrorCode::Internal, "missing put_end result"))
                    }),
                    Err((e, _)) => Err(e),
                })
                .collect())
        })
        .await
    }

    /// Reads several values; one result per key, in order.
    pub async fn batch_get(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<Vec<u8>, KvError>>, KvError> {
        self.deadline("batch_get", async {
            let req = MasterRequest::BatchGet {
                keys: keys.iter().map(|k| k.to_vec()).collect(),
            };
            let lists = match self.master_batch(req).await? {
                MasterResponse::BatchReplicas(v) => v,
                other => return Err(unexpected("batch_get", &other)),
            };
            let reads = lists.into_iter().map(|r| async move {
                let replicas: Vec<ReplicaDesc> = Result::from(r)?;
                if replicas.is_empty() {
                    return Err(KvError::new(
                        ErrorCode::ObjectNotFound,
                        "no readable replica",
                    ));
                }
                let replicas = self.read_order(replicas);
                let mut buf = vec![0u8; replicas[0].len as usize];
                self.read_any(&replicas, &mut buf).await?;
                Ok(buf)
            });
            Ok(
                futures_util::stream::StreamExt::collect(
                    futures_util::stream::StreamExt::buffered(
                        futures_util::stream::iter(reads),
                        self.inner.cfg.batch_parallelism,
                    ),
                )
                .await,
            )
        })
        .await
    }

    /// Whether each key is stored; one result per key, in order.
    pub async fn batch_exists(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<bool, KvError>>, KvError> {
        self.deadline("batch_exists", async {
            let req = MasterRequest::BatchExist {
                keys: keys.iter().map(|k| k.to_vec()).collect(),
            };
            match self.master_batch(req).await? {
                MasterResponse::BatchExists(v) => Ok(v.into_iter().map(Result::from).collect()),
                other => Err(unexpected("batch_exist", &other)),
            }
        })
        .await
    }

    /// Removes several keys; one result per key, in order.
    pub async fn batch_remove(
        &self,
        keys: &[&[u8]],
        force: bool,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        self.deadline("batch_remove", async {
            let req = MasterRequest::BatchRemove {
                keys: keys.iter().map(|k| k.to_vec()).collect(),
                force,
            };
            match self.master_batch(req).await? {
                MasterResponse::BatchDone(v) => Ok(v.into_iter().map(Result::from).collect()),
                other => Err(unexpected("batch_remove", &other)),
            }
        })
        .await
    }

    /// The metadata the master holds for `key` (no lease is granted).
    pub async fn describe(&self, key: &[u8]) -> Result<ObjectInfo, KvError> {
        self.deadline("describe", async {
            match self
                .master(&MasterRequest::Describe { key: key.to_vec() })
                .await?
            {
                MasterResponse::Described(i) => Ok(i),
                other => Err(unexpected("describe", &other)),
            }
        })
        .await
    }

    /// Stops new puts to a segment; its replicas stay readable.
    pub async fn drain_segment(&self, segment_id: SegmentId) -> Result<(), KvError> {
        self.deadline("drain_segment", async {
            match self
                .master(&MasterRequest::DrainSegment { segment_id })
                .await?
            {
                MasterResponse::Done => Ok(()),
                other => Err(unexpected("drain_segment", &other)),
            }
        })
        .await
    }

    /// Tells the master this client is alive.
    pub async fn ping(&self) -> Result<(), KvError> {
        self.deadline("ping", async {
            match self
                .master(&MasterRequest::Ping {
                    client_id: self.inner.id,
                })
                .await?
            {
                MasterResponse::Pong => Ok(()),
                other => Err(unexpected("ping", &other)),
            }
        })
        .await
    }

    /// Mounts a segment owned by this client; returns its id.
    pub async fn mount_segment(&self, spec: SegmentSpec) -> Result<SegmentId, KvError> {
        self.deadline("mount_segment", async {
            match self
                .master(&MasterRequest::MountSegment {
                    client_id: self.inner.id,
                    spec,
                })
                .await?
            {
                MasterResponse::Mounted { segment_id } => Ok(segment_id),
                other => Err(unexpected("mount_segment", &other)),
            }
        })
        .await
    }

    /// Unmounts a segment (idempotent).
    pub async fn unmount_segment(&self, segment_id: SegmentId) -> Result<(), KvError> {
        self.deadline("unmount_segment", async {
            match self
                .master(&MasterRequest::UnmountSegment { segment_id })
                .await?
            {
                MasterResponse::Done => Ok(()),
                other => Err(unexpected("unmount_segment", &other)),
            }
        })
        .await
    }
}

fn conn_addr(r: &ReplicaDesc) -> String {
    r.endpoint.shard_addr(r.data_shard())
}

fn with_peer(e: KvError, addr: &str) -> KvError {
    if matches!(
        e.code,
        ErrorCode::Unavailable | ErrorCode::Timeout | ErrorCode::Internal
    ) && !e.message.contains(addr)
    {
        KvError::new(e.code, format!("{addr}: {}", e.message))
    } else {
        e
    }
}

fn check_id(got: u64, want: u64) -> Result<(), KvError> {
    if got == want {
        Ok(())
    } else {
        Err(KvError::new(
            ErrorCode::Malformed,
            format!("answer to request {got} arrived for request {want}"),
        ))
    }
}

/// One request and its answer. Outer error: the connection failed; inner:
/// the master's answer.
async fn rpc(
    s: &mut Stream,
    id: u64,
    req: &MasterRequest,
    max_frame: u32,
) -> Result<Result<MasterResponse, KvError>, KvError> {
    frame::write_all(s, &frame::encode(FrameKind::MasterRequest, id, req)).await?;
    let (rid, answer) =
        frame::read_reply::<MasterResponse, _>(s, FrameKind::MasterResponse, max_frame).await?;
    check_id(rid, id)?;
    Ok(answer)
}

/// This machine's name, for same-host decisions.
pub fn local_host_id() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}
