//! The transfer engine: moves object bytes between a client's memory and
//! storage nodes' segments.
//!
//! ```text
//!  batch of Transfer {Read|Write, buffer, replicas}  -- one deadline, cancellable
//!     |  per transfer: replicas in order (same host first)
//!     |-- shm  (same host): memcpy to/from the mapped memfd segment
//!     '-- tcp: object cut into slices (tcp_slice_bytes); slices spread over
//!              the node's shard ports and several connections ("lanes");
//!              each slice holds one permit of max_in_flight (back-pressure);
//!              a failed slice is retried on another lane, then the whole
//!              transfer moves to the next replica.
//! ```
//!
//! Buffers are the caller's: a read lands straight in the destination slice,
//! a write is sent straight from the source; the engine allocates nothing per
//! byte. Dropping a batch's future (deadline, cancel) drops its in-flight
//! slices; their connections close instead of going back to a pool, so
//! nothing is left half-read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt, TryStreamExt};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::data_conn::prove_data;
use crate::nic::{Nic, NicDataPath, NicOp, RdmaBuffer};
use crate::pool::{ConnPool, Stream};
use crate::read::{self, marks_unreachable, Prefer, ReplicaRead, Step, Suspects};
use crate::shm::ShmMap;
use crate::stats::EngineStats;
use kvpool_wire::checksum;
use kvpool_wire::error::{ErrorCode, KvError};
use kvpool_wire::frame::{self, check_answer, FrameKind};
use kvpool_wire::proto::{DataRequest, DataResponse, Endpoint, ReplicaDesc, SegmentId, Tier};

/// Which data path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory for same-host replicas, TCP otherwise.
    Auto,
    /// TCP only.
    Tcp,
    /// Shared memory only (a replica on another host is an error).
    Shm,
    /// RDMA for every DRAM replica whose node supports it (same host
    /// included); TCP, with a logged reason, for a node that does not.
    Rdma,
}

impl TransportChoice {
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Tcp => "tcp",
            Self::Shm => "shm",
            Self::Rdma => "rdma",
        }
    }
}

/// Settings of a [`TransferEngine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub transport: TransportChoice,
    /// A TCP transfer larger than this is cut into slices of this size.
    pub tcp_slice_bytes: u64,
    /// Slices of one transfer in flight at once (over distinct connections).
    pub lanes: usize,
    /// A TCP transfer of a DRAM replica starts on this engine's own shard
    /// of the node (chosen at random when the engine starts) instead of the shard
    /// whose slice holds the offset.
    pub shard_affinity: bool,
    /// Slices in flight over the whole engine; more wait (back-pressure).
    pub max_in_flight: usize,
    /// Connections kept per storage shard port.
    pub max_connections_per_endpoint: usize,
    pub connect_timeout: Duration,
    pub max_frame_bytes: u32,
    /// This machine, for picking same-host replicas.
    pub host_id: String,
    /// Check every read against the object's checksum (when it has one): a
    /// mismatch is `Corrupt` and the next replica is tried.
    pub verify_checksums: bool,
    /// Fill the page tables of a whole same-host segment in the background
    /// as soon as it is mapped (besides each chunk's on first use).
    pub shm_populate_at_map: bool,
    /// The cluster secret: each new data connection proves it holds it
    /// ([`crate::data_conn::prove_data`]) before its first request.
    pub key: Option<kvpool_wire::auth::ClusterKey>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            transport: TransportChoice::Auto,
            tcp_slice_bytes: 2 << 20,
            lanes: 4,
            shard_affinity: false,
            max_in_flight: 64,
            max_connections_per_endpoint: 16,
            connect_timeout: Duration::from_secs(2),
            max_frame_bytes: 64 << 20,
            host_id: String::new(),
            verify_checksums: true,
            shm_populate_at_map: false,
            key: None,
        }
    }
}

/// The bytes of one transfer.
pub enum Buf<'a> {
    /// Read into this buffer (its length is the object's).
    Read(&'a mut [u8]),
    /// Write this buffer.
    Write(&'a [u8]),
}

impl Buf<'_> {
    pub fn len(&self) -> usize {
        match self {
            Buf::Read(b) => b.len(),
            Buf::Write(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One request of a batch. A read tries the replicas in order until one
/// succeeds; a write goes to every replica.
pub struct Transfer<'a> {
    pub buf: Buf<'a>,
    pub replicas: &'a [ReplicaDesc],
    /// A read's key: a node reads an NVMe replica only while its slot holds
    /// this key's copy (empty for a write).
    pub key: &'a [u8],
    /// Set when the batch returns.
    pub status: Option<Result<(), KvError>>,
    /// A write made with [`Transfer::write_summed`]: the checksum of the
    /// bytes written ([`checksum::value_sum`]), set when it succeeded.
    pub sum: Option<u64>,
    want_sum: bool,
}

impl<'a> Transfer<'a> {
    /// A read of `key`'s object into `dst`.
    pub fn read(key: &'a [u8], dst: &'a mut [u8], replicas: &'a [ReplicaDesc]) -> Self {
        Self {
            buf: Buf::Read(dst),
            replicas,
            key,
            status: None,
            sum: None,
            want_sum: false,
        }
    }

    pub fn write(src: &'a [u8], replicas: &'a [ReplicaDesc]) -> Self {
        Self {
            buf: Buf::Write(src),
            replicas,
            key: &[],
            status: None,
            sum: None,
            want_sum: false,
        }
    }

    /// A write that also computes the checksum of `src` (into `sum`),
    /// piece by piece as the bytes go out, while each piece is in cache.
    pub fn write_summed(src: &'a [u8], replicas: &'a [ReplicaDesc]) -> Self {
        Self {
            want_sum: true,
            ..Self::write(src, replicas)
        }
    }
}

/// Why shm is not used for a segment, remembered for a while.
struct ShmRefused {
    until: Instant,
}

enum ShmEntry {
    Mapped(Arc<ShmMap>),
    Refused(ShmRefused),
}

/// How long a failed shm set-up keeps a segment on TCP before trying again.
const SHM_RETRY: Duration = Duration::from_secs(10);

/// Moves bytes to and from storage nodes. Cheap to share (`Arc`).
pub struct TransferEngine {
    cfg: EngineConfig,
    /// Connection pools by host, then port: found without allocating, one
    /// lock per transfer (not per slice).
    pools: Mutex<HashMap<String, HashMap<u32, Arc<ConnPool>>>>,
    shm: Mutex<HashMap<SegmentId, ShmEntry>>,
    permits: Arc<Semaphore>,
    req_ids: AtomicU64,
    stats: EngineStats,
    /// Segments whose node could not be reached: for the caller to report,
    /// and tried last by reads for a while ([`crate::read`]'s rules).
    suspects: Mutex<Suspects>,
    /// The origin of the time the read rules are given.
    epoch: Instant,
    /// This engine's own shard of every node, modulo the node's shards
    /// (with `shard_affinity`): random, so the clients of a host spread
    /// over a node's cores.
    home: u16,
    /// The RDMA path, when a NIC was opened (see [`crate::nic`]).
    rdma: Option<Arc<dyn NicDataPath>>,
}

impl TransferEngine {
    pub fn new(cfg: EngineConfig) -> Self {
        let permits = Arc::new(Semaphore::new(cfg.max_in_flight.max(1)));
        let home = {
            use std::hash::{BuildHasher, Hasher};
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish() as u16
        };
        Self {
            cfg,
            home,
            pools: Mutex::new(HashMap::new()),
            shm: Mutex::new(HashMap::new()),
            permits,
            req_ids: AtomicU64::new(1),
            stats: EngineStats::default(),
            suspects: Mutex::new(Suspects::default()),
            epoch: Instant::now(),
            rdma: None,
        }
    }

    /// Segments whose node this engine could not reach since the last call
    /// (connection refused, reset or timed out), each once.
    pub fn take_unreachable(&self) -> Vec<SegmentId> {
        self.suspects().take_unreachable()
    }

    /// Whether some segment was unreachable since the last `take_unreachable`.
    pub fn has_unreachable(&self) -> bool {
        self.suspects().has_unreachable()
    }

    fn suspects(&self) -> std::sync::MutexGuard<'_, Suspects> {
        self.suspects.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn note_unreachable(&self, segment: SegmentId, e: &KvError) {
        if marks_unreachable(e) {
            let now = self.epoch.elapsed();
            self.suspects().note(segment, e, now);
        }
    }

    /// Whether a read of `r` checks its bytes against the object's checksum.
    fn checks(&self, r: &ReplicaDesc) -> bool {
        r.checksum.is_some() && self.cfg.verify_checksums
    }

    /// Whether `dst` holds the bytes `r`'s object was written with (when
    /// checksums are checked and the object has one); `sum`: their checksum
    /// if the read computed it on the way. A mismatch is counted, logged and
    /// `Corrupt`.
    pub fn verify(&self, r: &ReplicaDesc, dst: &[u8], sum: Option<u64>) -> Result<(), KvError> {
        let Some(want) = r.checksum.filter(|_| self.cfg.verify_checksums) else {
            return Ok(());
        };
        if sum.unwrap_or_else(|| checksum::value_sum(dst)) == want {
            return Ok(());
        }
        self.stats.corrupt_reads.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            segment = format!("{:016x}", r.segment_id),
            offset = r.offset,
            len = r.len,
            "a replica's bytes do not match the object's checksum"
        );
        Err(KvError::new(
            ErrorCode::Corrupt,
            format!(
                "the bytes read from segment {:016x} at {} do not match the object's checksum",
                r.segment_id, r.offset
            ),
        ))
    }

    /// Uses RDMA (through `nic`) for DRAM replicas whose node supports it.
    pub fn enable_rdma(&mut self, nic: Arc<dyn Nic>) {
        self.rdma = Some(nic.data_path(self.cfg.key.clone()));
    }

    /// The RDMA devices, when RDMA is enabled.
    pub fn rdma_nic(&self) -> Option<&Arc<dyn Nic>> {
        self.rdma.as_ref().map(|r| r.nic())
    }

    /// A zeroed buffer registered with this engine's RDMA devices: gets into
    /// it and puts from it are zero copy. `Unsupported` without RDMA.
    pub fn alloc_rdma_buffer(&self, len: usize) -> Result<Arc<RdmaBuffer>, KvError> {
        match &self.rdma {
            Some(r) => r.alloc(len),
            None => Err(KvError::new(
                ErrorCode::Unsupported,
                "RDMA is not enabled in this client",
            )),
        }
    }

    /// Whether RDMA is enabled (built in and a device opened).
    pub fn rdma_enabled(&self) -> bool {
        self.rdma.is_some()
    }

    /// What an RDMA read or write of `r` needs from the engine.
    fn nic_op<'a>(&'a self, r: &'a ReplicaDesc, deadline: Instant) -> NicOp<'a> {
        NicOp {
            replica: r,
            deadline,
            pool: self.pools_for(&r.endpoint, r.data_shard(), 1).remove(0),
            connect_timeout: self.cfg.connect_timeout,
            max_frame: self.cfg.max_frame_bytes,
            stats: &self.stats,
        }
    }

    /// Reads a DRAM replica over RDMA; `None`: use TCP for it.
    async fn rdma_read(
        &self,
        r: &ReplicaDesc,
        dst: &mut [u8],
        deadline: Instant,
    ) -> Option<Result<(), KvError>> {
        let path = self.rdma.as_ref()?;
        if self.cfg.transport == TransportChoice::Tcp {
            return None;
        }
        path.read(self.nic_op(r, deadline), dst).await
    }

    /// Writes a DRAM replica over RDMA; `None`: use TCP for it.
    async fn rdma_write(
        &self,
        r: &ReplicaDesc,
        src: &[u8],
        deadline: Instant,
    ) -> Option<Result<(), KvError>> {
        let path = self.rdma.as_ref()?;
        if self.cfg.transport == TransportChoice::Tcp {
            return None;
        }
        path.write(self.nic_op(r, deadline), src).await
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Runs a batch until every transfer is done, the deadline passes, or
    /// `cancel` fires; every transfer's `status` is set on return.
    pub async fn run(
        &self,
        batch: &mut [Transfer<'_>],
        deadline: Instant,
        cancel: Option<&CancellationToken>,
    ) {
        let work = futures_util::future::join_all(batch.iter_mut().map(|t| async move {
            let r = match &mut t.buf {
                Buf::Read(dst) => self.read_any(t.key, t.replicas, dst, deadline).await,
                Buf::Write(src) => self
                    .write_all(t.replicas, src, deadline, t.want_sum)
                    .await
                    .map(|sum| t.sum = sum),
            };
            t.status = Some(r);
        }));
        let deadline = tokio::time::Instant::from_std(deadline);
        let stopped = match cancel {
            Some(c) => tokio::select! {
                r = tokio::time::timeout_at(deadline, work) => r.err().map(|_| ErrorCode::Timeout),
                _ = c.cancelled() => Some(ErrorCode::Unavailable),
            },
            None => tokio::time::timeout_at(deadline, work)
                .await
                .err()
                .map(|_| ErrorCode::Timeout),
        };
        if let Some(code) = stopped {
            let why = if code == ErrorCode::Timeout {
                "the transfer did not finish before its deadline"
            } else {
                "the transfer was cancelled"
            };
            for t in batch.iter_mut().filter(|t| t.status.is_none()) {
                t.status = Some(Err(KvError::new(code, why)));
            }
        }
    }

    /// Reads `key`'s object into `dst` from the first replica that answers.
    pub async fn read(
        &self,
        key: &[u8],
        replicas: &[ReplicaDesc],
        dst: &mut [u8],
        deadline: Instant,
    ) -> Result<(), KvError> {
        let mut t = [Transfer::read(key, dst, replicas)];
        self.run(&mut t, deadline, None).await;
        let [t] = t;
        t.status.expect("set by run")
    }

    /// Writes `src` to every replica.
    pub async fn write(
        &self,
        replicas: &[ReplicaDesc],
        src: &[u8],
        deadline: Instant,
    ) -> Result<(), KvError> {
        let mut t = [Transfer::write(src, replicas)];
        self.run(&mut t, deadline, None).await;
        let [t] = t;
        t.status.expect("set by run")
    }

    /// Writes `src` to every replica and returns its checksum
    /// ([`checksum::value_sum`]), computed piece by piece as the bytes go out.
    pub async fn write_summed(
        &self,
        replicas: &[ReplicaDesc],
        src: &[u8],
        deadline: Instant,
    ) -> Result<u64, KvError> {
        let mut t = [Transfer::write_summed(src, replicas)];
        self.run(&mut t, deadline, None).await;
        let [t] = t;
        t.status.expect("set by run")?;
        Ok(t.sum.expect("a summed write that succeeded has its sum"))
    }

    /// A connection from `pool`; a new one proves the cluster secret first
    /// when this engine has it.
    async fn data_conn(&self, pool: &Arc<ConnPool>) -> Result<crate::pool::Conn, KvError> {
        let mut conn = pool.get(self.cfg.connect_timeout).await?;
        if conn.is_new() {
            if let Some(key) = &self.cfg.key {
                let id = self.req_ids.fetch_add(2, Ordering::Relaxed);
                prove_data(conn.stream(), key, id, self.cfg.max_frame_bytes)
                    .await
                    .map_err(|e| peer(e, pool.addr()))?;
            }
        }
        Ok(conn)
    }

    /// Reads an NVMe replica of `key`'s object: the node reads it from its
    /// device (checksum verified, only while the slot holds `key`'s copy)
    /// and sends it like a DRAM read; one request, no slicing.
    async fn nvme_read(&self, r: &ReplicaDesc, key: &[u8], dst: &mut [u8]) -> Result<(), KvError> {
        let _p = self.permit().await?;
        let pool = self.pools_for(&r.endpoint, r.data_shard(), 1).remove(0);
        let addr = pool.addr();
        let mut conn = self.data_conn(&pool).await?;
        let id = self.req_ids.fetch_add(1, Ordering::Relaxed);
        let req = frame::encode(
            FrameKind::DataRequest,
            id,
            &read::data_request(r, key, 0, dst.len() as u64),
        );
        let s: &mut Stream = conn.stream();
        frame::write_all(s, &req)
            .await
            .map_err(|e| peer(e.into(), addr))?;
        let (rid, answer) = frame::read_reply::<DataResponse, _>(
            s,
            FrameKind::DataResponse,
            self.cfg.max_frame_bytes,
        )
        .await
        .map_err(|e| peer(e.into(), addr))?;
        let answer = check_answer(rid, id, answer)?;
        match answer {
            Ok(DataResponse::Data { len }) if len == dst.len() as u64 => {
                futures_lite::AsyncReadExt::read_exact(s, dst)
                    .await
                    .map_err(|e| peer(e.into(), addr))?;
                conn.release();
                self.stats
                    .tcp_bytes
                    .fetch_add(dst.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            Ok(other) => Err(KvError::new(
                ErrorCode::Internal,
                format!("{addr} answered an NVMe read with {other:?}"),
            )),
            Err(e) => {
                conn.release();
                Err(e)
            }
        }
    }

    /// Reads `dst` from one of `replicas`, by [`crate::read`]'s rules
    /// (order, shares of the time left, failover).
    async fn read_any(
        &self,
        key: &[u8],
        replicas: &[ReplicaDesc],
        dst: &mut [u8],
        deadline: Instant,
    ) -> Result<(), KvError> {
        let prefer = Prefer {
            shm: self.cfg.transport != TransportChoice::Tcp,
            host_id: &self.cfg.host_id,
        };
        let mut read = {
            let suspects = self.suspects();
            // No clock read while nothing is suspect.
            let now = if suspects.none_suspect() {
                Duration::ZERO
            } else {
                self.epoch.elapsed()
            };
            ReplicaRead::new(replicas, dst.len() as u64, prefer, &suspects, now)?
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (r, share, timed) = match read.next(left) {
                Step::Try {
                    index,
                    share,
                    timed,
                    failover,
                } => {
                    if failover {
                        self.stats.replica_failovers.fetch_add(1, Ordering::Relaxed);
                    }
                    (&replicas[index], share, timed)
                }
                Step::Failed(e) => return Err(e),
            };
            let attempt_deadline = Instant::now() + share;
            // The checksum is computed on the way where the path allows
            // (`Some`), else over `dst` afterwards.
            let summing = self.checks(r);
            let attempt = async {
                if r.tier == Tier::Nvme {
                    self.nvme_read(r, key, dst).await.map(|()| None)
                } else {
                    match self.shm_for(r).await {
                        Some(Ok(map)) => {
                            let res = if summing {
                                map.read_into_summed(r.offset, dst).map(Some)
                            } else {
                                map.read_into(r.offset, dst).map(|()| None)
                            };
                            if res.is_ok() {
                                self.stats
                                    .shm_bytes
                                    .fetch_add(dst.len() as u64, Ordering::Relaxed);
                            }
                            res
                        }
                        Some(Err(e)) => Err(e),
                        None => match self.rdma_read(r, dst, attempt_deadline).await {
                            Some(res) => res.map(|()| None),
                            None => self.tcp_read(r, dst, summing).await,
                        },
                    }
                }
            };
            let res = if timed {
                tokio::time::timeout(share, attempt)
                    .await
                    .unwrap_or_else(|_| Err(ReplicaRead::share_passed(r, share)))
            } else {
                attempt.await
            };
            match res.and_then(|sum| self.verify(r, dst, sum)) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::debug!(segment = r.segment_id, "read from replica failed: {e}");
                    self.note_unreachable(r.segment_id, &e);
                    read.failed(e);
                }
            }
        }
    }

    /// Writes `src` to every replica; with `summing`, also returns its
    /// checksum, computed on the way by the first replica's write where its
    /// path allows (shm, TCP), else over `src` afterwards.
    async fn write_all(
        &self,
        replicas: &[ReplicaDesc],
        src: &[u8],
        deadline: Instant,
        summing: bool,
    ) -> Result<Option<u64>, KvError> {
        if replicas.is_empty() {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                "no replica to write",
            ));
        }
        let writes = replicas.iter().enumerate().map(|(i, r)| async move {
            if r.len != src.len() as u64 {
                return Err(KvError::new(
                    ErrorCode::InvalidParams,
                    format!("{} bytes for an allocation of {}", src.len(), r.len),
                ));
            }
            let summing = summing && i == 0;
            let res = match self.shm_for(r).await {
                Some(Ok(map)) => {
                    let sum = if summing {
                        Some(map.write_from_summed(r.offset, src)?)
                    } else {
                        map.write_from(r.offset, src)?;
                        None
                    };
                    self.stats
                        .shm_bytes
                        .fetch_add(src.len() as u64, Ordering::Relaxed);
                    Ok(sum)
                }
                Some(Err(e)) => Err(e),
                None => match self.rdma_write(r, src, deadline).await {
                    Some(res) => res.map(|()| None),
                    // Timed here, not only by `run`, so that a node that fell
                    // silent is named (noted unreachable: the put is placed
                    // elsewhere next).
                    None => tokio::time::timeout_at(
                        tokio::time::Instant::from_std(deadline),
                        self.tcp_write(r, src, summing),
                    )
                    .await
                    .unwrap_or_else(|_| {
                        Err(KvError::new(
                            ErrorCode::Timeout,
                            format!(
                                "the write to segment {:016x} did not finish before its deadline",
                                r.segment_id
                            ),
                        ))
                    }),
                },
            };
            if let Err(e) = &res {
                self.note_unreachable(r.segment_id, e);
            }
            res
        });
        let sums = futures_util::future::try_join_all(writes).await?;
        Ok(summing.then(|| {
            sums.first()
                .copied()
                .flatten()
                .unwrap_or_else(|| checksum::value_sum(src))
        }))
    }

    /// The shm mapping to use for `r`: `None` means use TCP.
    async fn shm_for(&self, r: &ReplicaDesc) -> Option<Result<Arc<ShmMap>, KvError>> {
        let same_host = !self.cfg.host_id.is_empty() && r.host_id == self.cfg.host_id;
        match self.cfg.transport {
            TransportChoice::Tcp | TransportChoice::Rdma => return None,
            TransportChoice::Auto if !same_host => return None,
            TransportChoice::Shm if !same_host => {
                return Some(Err(KvError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "transport shm: replica on host {:?} is not on this host ({:?})",
                        r.host_id, self.cfg.host_id
                    ),
                )))
            }
            _ => {}
        }
        {
            let map = self.shm.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(&r.segment_id) {
                Some(ShmEntry::Mapped(m)) => return Some(Ok(m.clone())),
                Some(ShmEntry::Refused(f)) if f.until > Instant::now() => {
                    return if self.cfg.transport == TransportChoice::Shm {
                        Some(Err(KvError::new(
                            ErrorCode::Unavailable,
                            "shm unavailable for this segment",
                        )))
                    } else {
                        None
                    };
                }
                _ => {}
            }
        }
        let seg = r.segment_id;
        let grant = r.grant;
        let timeout = self.cfg.connect_timeout;
        let key = self.cfg.key.clone();
        let opened =
            tokio::task::spawn_blocking(move || ShmMap::open(seg, &grant, key.as_ref(), timeout))
                .await
                .unwrap_or_else(|e| {
                    Err(KvError::new(
                        ErrorCode::Internal,
                        format!("shm set-up: {e}"),
                    ))
                });
        let mut map = self.shm.lock().unwrap_or_else(|p| p.into_inner());
        match opened {
            Ok(m) => {
                let m = Arc::new(m);
                // Another task may have mapped it meanwhile: keep one mapping.
                let (kept, new) = match map.get(&seg) {
                    Some(ShmEntry::Mapped(other)) => (other.clone(), false),
                    _ => {
                        map.insert(seg, ShmEntry::Mapped(m.clone()));
                        tracing::info!(
                            segment = format!("{seg:016x}"),
                            "same-host segment mapped: using shm"
                        );
                        (m, true)
                    }
                };
                drop(map);
                if new && self.cfg.shm_populate_at_map {
                    // A weak handle: the fill stops once the mapping is
                    // forgotten or the engine dropped.
                    let whole = Arc::downgrade(&kept);
                    drop(tokio::task::spawn_blocking(move || {
                        ShmMap::populate_while_mapped(&whole)
                    }));
                }
                Some(Ok(kept))
            }
            Err(e) => {
                tracing::warn!(
                    segment = format!("{seg:016x}"),
                    "shm unavailable ({e}); using tcp for this segment"
                );
                map.insert(
                    seg,
                    ShmEntry::Refused(ShmRefused {
                        until: Instant::now() + SHM_RETRY,
                    }),
                );
                if self.cfg.transport == TransportChoice::Shm {
                    Some(Err(e))
                } else {
                    None
                }
            }
        }
    }

    /// The shm mapping of a segment, if one is open (for borrowed views).
    pub async fn shm_map(&self, r: &ReplicaDesc) -> Option<Arc<ShmMap>> {
        match self.shm_for(r).await {
            Some(Ok(m)) => Some(m),
            _ => None,
        }
    }

    /// Forgets a segment's mapping (the segment went away).
    pub fn forget_segment(&self, segment_id: SegmentId) {
        self.shm
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&segment_id);
        if let Some(r) = &self.rdma {
            r.forget_segment(segment_id);
        }
    }

    /// The pools of `count` consecutive shards of `ep`, starting at
    /// `first` and wrapping around its shards: one lock, and an address
    /// string made only for a pool seen for the first time. Keyed by host,
    /// then by the shard's port (several nodes may share a host).
    fn pools_for(&self, ep: &Endpoint, first: u16, count: usize) -> Vec<Arc<ConnPool>> {
        let nr = ep.nr_shards.max(1);
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        if !pools.contains_key(ep.host.as_str()) {
            pools.insert(ep.host.clone(), HashMap::new());
        }
        let by_port = pools.get_mut(ep.host.as_str()).expect("inserted above");
        (0..count)
            .map(|k| {
                let shard = ((u32::from(first) + k as u32) % u32::from(nr)) as u16;
                let port = u32::from(ep.port) + u32::from(shard);
                by_port
                    .entry(port)
                    .or_insert_with(|| {
                        ConnPool::new(ep.shard_addr(shard), self.cfg.max_connections_per_endpoint)
                    })
                    .clone()
            })
            .collect()
    }

    /// The pools a TCP transfer of `n` slices of replica `r` uses: slice
    /// `i` goes to `pools[i % len]` (slices rotate over the node's shards
    /// starting at the one that holds the offset), its retry to the next.
    fn slice_pools(&self, r: &ReplicaDesc, n: usize) -> Vec<Arc<ConnPool>> {
        let nr = r.endpoint.nr_shards.max(1);
        self.pools_for(
            &r.endpoint,
            self.first_shard(r, n),
            (nr as usize).min(n + 1),
        )
    }

    /// The node shard a TCP transfer of `r` in `n` slices starts on: this
    /// engine's own for a one-slice transfer of a DRAM replica with
    /// `shard_affinity` (any shard serves any offset), else the one whose
    /// slice holds the offset. A sliced transfer keeps starting at the
    /// offset's shard: waking a core is nothing beside a 2 MiB slice, and
    /// a batch of them started at one shard was slower still (16-core host,
    /// docs/benchmarks/many-core.md "Shard layout").
    fn first_shard(&self, r: &ReplicaDesc, n: usize) -> u16 {
        match r.tier {
            Tier::Dram if self.cfg.shard_affinity && n == 1 => {
                self.home % r.endpoint.nr_shards.max(1)
            }
            _ => r.data_shard(),
        }
    }

    fn slices(&self, len: usize) -> usize {
        let s = self.cfg.tcp_slice_bytes.max(1) as usize;
        len.div_ceil(s).max(1)
    }

    async fn permit(&self) -> Result<InFlight<'_>, KvError> {
        let p = self
            .permits
            .acquire()
            .await
            .map_err(|_| KvError::new(ErrorCode::Internal, "engine closed"))?;
        let now = self.stats.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.stats
            .max_in_flight_seen
            .fetch_max(now, Ordering::Relaxed);
        self.stats.slices.fetch_add(1, Ordering::Relaxed);
        Ok(InFlight {
            _permit: p,
            stats: &self.stats,
        })
    }

    /// Reads `dst` in slices over the lanes; with `summing`, also returns the
    /// checksum of what it read, each slice hashed as soon as the slices
    /// before it have landed (see [`checksum::Frontier`]).
    async fn tcp_read(
        &self,
        r: &ReplicaDesc,
        dst: &mut [u8],
        summing: bool,
    ) -> Result<Option<u64>, KvError> {
        let slice = self.cfg.tcp_slice_bytes.max(1) as usize;
        let n = self.slices(dst.len());
        let total = dst.len() as u64;
        let chunks: Vec<(usize, &mut [u8])> = if dst.is_empty() {
            Vec::new()
        } else {
            dst.chunks_mut(slice).enumerate().collect()
        };
        let pieces = chunks.len();
        let lanes = self.cfg.lanes.max(1).min(n);
        let pools = self.slice_pools(r, n);
        let pools = &pools;
        // The slices' futures are made up front (they start when polled): a
        // stream adaptor holding the closure would make the whole read's
        // future !Send for some callers (a higher-ranked lifetime).
        let slices: Vec<_> = chunks
            .into_iter()
            .map(|(i, chunk)| async move {
                let at = (i * slice) as u64;
                let _p = self.permit().await?;
                let first = self.read_slice(&pools[i % pools.len()], r, at, chunk).await;
                match first {
                    Ok(()) => {}
                    Err(e) if retryable(&e) => {
                        // Another lane: the next shard port, a fresh connection.
                        self.stats.slice_retries.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("slice {i} failed ({e}); retrying on another lane");
                        let pool = &pools[(i + 1) % pools.len()];
                        pool.clear();
                        self.read_slice(pool, r, at, chunk).await?;
                    }
                    Err(e) => return Err(e),
                }
                let piece: &[u8] = chunk;
                Ok::<_, KvError>((i, piece))
            })
            .collect();
        let mut landing = stream::iter(slices).buffer_unordered(lanes);
        let mut frontier = summing.then(|| checksum::Frontier::new(pieces));
        let mut landed: Vec<&[u8]> = vec![&[]; pieces];
        while let Some((i, piece)) = landing.try_next().await? {
            if let Some(f) = frontier.as_mut() {
                landed[i] = piece;
                f.landed(i, |j| landed[j]);
            }
        }
        self.stats.tcp_bytes.fetch_add(total, Ordering::Relaxed);
        Ok(match frontier {
            Some(_) if pieces == 0 => Some(checksum::value_sum(&[])),
            Some(f) => Some(f.digest().expect("every slice landed")),
            None => None,
        })
    }

    /// Writes `src` in slices over the lanes; with `summing`, also returns
    /// its checksum, each slice hashed just before it is sent.
    async fn tcp_write(
        &self,
        r: &ReplicaDesc,
        src: &[u8],
        summing: bool,
    ) -> Result<Option<u64>, KvError> {
        let slice = self.cfg.tcp_slice_bytes.max(1) as usize;
        let n = self.slices(src.len());
        let lanes = self.cfg.lanes.max(1).min(n);
        let pools = self.slice_pools(r, n);
        let pools = &pools;
        let mut hasher = summing.then(checksum::ValueSum::new);
        stream::iter(src.chunks(slice).enumerate().map(Ok::<_, KvError>))
            .try_for_each_concurrent(lanes, |(i, chunk)| {
                // Slices are taken in order: hashed here, the slice is in
                // cache when its write copies it into the socket.
                if let Some(h) = hasher.as_mut() {
                    h.update(chunk);
                }
                async move {
                    let off = r.offset + (i * slice) as u64;
                    let _p = self.permit().await?;
                    match self
                        .write_slice(&pools[i % pools.len()], r, off, chunk)
                        .await
                    {
                        Ok(()) => Ok(()),
                        Err(e) if retryable(&e) => {
                            self.stats.slice_retries.fetch_add(1, Ordering::Relaxed);
                            let pool = &pools[(i + 1) % pools.len()];
                            pool.clear();
                            self.write_slice(pool, r, off, chunk).await
                        }
                        Err(e) => Err(e),
                    }
                }
            })
            .await?;
        self.stats
            .tcp_bytes
            .fetch_add(src.len() as u64, Ordering::Relaxed);
        Ok(hasher.map(|h| h.digest()))
    }

    /// Reads `dst.len()` bytes of DRAM replica `r`, `at` bytes into it.
    async fn read_slice(
        &self,
        pool: &Arc<ConnPool>,
        r: &ReplicaDesc,
        at: u64,
        dst: &mut [u8],
    ) -> Result<(), KvError> {
        let addr = pool.addr();
        let mut conn = self.data_conn(pool).await?;
        let id = self.req_ids.fetch_add(1, Ordering::Relaxed);
        let req = frame::encode(
            FrameKind::DataRequest,
            id,
            &read::data_request(r, &[], at, dst.len() as u64),
        );
        let s: &mut Stream = conn.stream();
        frame::write_all(s, &req)
            .await
            .map_err(|e| peer(e.into(), addr))?;
        let (rid, answer) = frame::read_reply::<DataResponse, _>(
            s,
            FrameKind::DataResponse,
            self.cfg.max_frame_bytes,
        )
        .await
        .map_err(|e| peer(e.into(), addr))?;
        let answer = check_answer(rid, id, answer)?;
        match answer {
            Ok(DataResponse::Data { len }) if len == dst.len() as u64 => {
                futures_lite::AsyncReadExt::read_exact(s, dst)
                    .await
                    .map_err(|e| peer(e.into(), addr))?;
                conn.release();
                Ok(())
            }
            Ok(other) => Err(KvError::new(
                ErrorCode::Internal,
                format!(
                    "{addr} answered a read of {} bytes with {other:?}",
                    dst.len()
                ),
            )),
            Err(e) => {
                // Refused: nothing follows the answer, the connection is fine.
                conn.release();
                Err(e)
            }
        }
    }

    async fn write_slice(
        &self,
        pool: &Arc<ConnPool>,
        r: &ReplicaDesc,
        offset: u64,
        src: &[u8],
    ) -> Result<(), KvError> {
        /// Payloads up to this size go out in the same write as their frame.
        const COALESCE: usize = 16 * 1024;
        let addr = pool.addr();
        let mut conn = self.data_conn(pool).await?;
        let id = self.req_ids.fetch_add(1, Ordering::Relaxed);
        let mut bytes = frame::encode(
            FrameKind::DataRequest,
            id,
            &DataRequest::Write {
                segment_id: r.segment_id,
                offset,
                len: src.len() as u64,
                grant: r.grant,
            },
        );
        let s: &mut Stream = conn.stream();
        if src.len() <= COALESCE {
            bytes.extend_from_slice(src);
            frame::write_all(s, &bytes)
                .await
                .map_err(|e| peer(e.into(), addr))?;
        } else {
            frame::write_all(s, &bytes)
                .await
                .map_err(|e| peer(e.into(), addr))?;
            frame::write_all(s, src)
                .await
                .map_err(|e| peer(e.into(), addr))?;
        }
        let (rid, answer) = frame::read_reply::<DataResponse, _>(
            s,
            FrameKind::DataResponse,
            self.cfg.max_frame_bytes,
        )
        .await
        .map_err(|e| peer(e.into(), addr))?;
        // A refused write may have left its payload unread: never reuse.
        match check_answer(rid, id, answer)?? {
            DataResponse::Written => {
                conn.release();
                Ok(())
            }
            other => Err(KvError::new(
                ErrorCode::Internal,
                format!("{addr} answered a write with {other:?}"),
            )),
        }
    }
}

/// One slice in flight: holds a permit and keeps the gauge right on drop
/// (also when the slice's future is dropped by a deadline or cancel).
struct InFlight<'a> {
    _permit: tokio::sync::SemaphorePermit<'a>,
    stats: &'a EngineStats,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Failures worth another lane: the connection broke, not the request.
fn retryable(e: &KvError) -> bool {
    matches!(
        e.code,
        ErrorCode::Unavailable | ErrorCode::Timeout | ErrorCode::Malformed
    )
}

fn peer(e: KvError, addr: &str) -> KvError {
    if e.message.contains(addr) {
        e
    } else {
        KvError::new(e.code, format!("{addr}: {}", e.message))
    }
}
