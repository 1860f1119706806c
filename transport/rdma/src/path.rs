//! The transfer engine's RDMA path (`NicDataPath`): one RDMA connection per
//! (client, segment), set up over a TCP control connection to the segment's
//! node; RDMA READ for gets, RDMA WRITE for puts.
//!
//! * Set-up: `DataRequest::Rdma(Caps)`, then `Connect`; the node's queue
//!   pairs live as long as that TCP connection, which the engine keeps open
//!   beside the connection. A node that cannot do RDMA (no device, built
//!   without the feature, handshake failure) is refused for a while and the
//!   engine logs one line with the reason and uses TCP for it.
//! * Buffers: a caller's buffer inside memory registered with the engine's
//!   context ([`RdmaPath::alloc`]) is the RDMA source or destination itself
//!   (zero copy). Any other buffer goes through a registered bounce buffer
//!   (one memcpy), counted in `rdma_staged_bytes`, because the engine cannot
//!   keep a borrowed buffer alive past a cancelled transfer while the NIC may
//!   still write it.
//! * Failure: a transfer that fails on a connection drops that connection
//!   (the next call sets up a new one); the error goes to the caller, whose
//!   read tries its next replica.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::{
    LocalSlice, Op, RdmaBuffer, RdmaConnection, RdmaContext, RdmaMemory, Registration, TransferSpec,
};
use kvpool_transport::nic::{Nic, NicDataPath, NicFuture, NicOp};
use kvpool_transport::pool::{Conn, ConnPool};
use kvpool_transport::stats::EngineStats;
use kvpool_wire::error::{ErrorCode, KvError};
use kvpool_wire::frame::{self, FrameKind};
use kvpool_wire::proto::{DataRequest, DataResponse, ReplicaDesc, SegmentId};
use kvpool_wire::rdma_wire::{RdmaRequest, RdmaResponse};

/// How long a node that refused RDMA stays on TCP before the engine asks again.
const RDMA_RETRY: Duration = Duration::from_secs(10);
/// Bounce buffers in use at once (more transfers wait for one).
const STAGING_SLOTS: usize = 16;
/// Smallest bounce buffer; sizes are powers of two from here.
const STAGING_MIN: usize = 64 << 10;
/// Bounce buffers larger than this are registered per use, not kept.
const STAGING_KEEP_MAX: usize = 64 << 20;

/// A live RDMA connection to one segment and the TCP connection that keeps
/// the node's side of it alive.
struct Peer {
    conn: RdmaConnection,
    _control: Conn,
}

enum Entry {
    Up(Arc<Peer>),
    Refused { until: Instant },
}

/// The engine's RDMA state.
pub(crate) struct RdmaPath {
    ctx: Arc<RdmaContext>,
    /// `ctx`, as the engine sees it.
    nic: Arc<dyn Nic>,
    /// The cluster secret: a new control connection proves it first.
    key: Option<kvpool_wire::auth::ClusterKey>,
    peers: Mutex<HashMap<SegmentId, Entry>>,
    /// Free bounce buffers (registered, owned by their registration).
    staging: Mutex<Vec<Arc<Registration>>>,
    staging_slots: Semaphore,
}

/// A bounce buffer lent to one transfer; back to the free list only when
/// the transfer finished (a cancelled one may still be written by the NIC).
struct Staged<'a> {
    path: &'a RdmaPath,
    reg: Option<Arc<Registration>>,
    finished: bool,
    _slot: tokio::sync::SemaphorePermit<'a>,
}

impl Staged<'_> {
    fn reg(&self) -> &Arc<Registration> {
        self.reg.as_ref().expect("present until drop")
    }

    /// The buffer's first `len` bytes.
    ///
    /// # Safety
    /// No transfer on this buffer may be in flight.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, len: usize) -> &mut [u8] {
        let reg = self.reg();
        assert!(len <= reg.len());
        // SAFETY: in bounds; the registration owns the memory; per the
        // caller, the NIC is not using it.
        unsafe { std::slice::from_raw_parts_mut(reg.memory().as_ptr(), len) }
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        let Some(reg) = self.reg.take() else { return };
        if self.finished && reg.len() <= STAGING_KEEP_MAX {
            let mut free = self.path.lock_staging();
            if free.len() < STAGING_SLOTS {
                free.push(reg);
            }
        }
        // Otherwise the registration (and its memory) goes when the last
        // work request holding it completes.
    }
}

impl RdmaPath {
    pub(crate) fn new(ctx: Arc<RdmaContext>, key: Option<kvpool_wire::auth::ClusterKey>) -> Self {
        Self {
            nic: ctx.clone(),
            ctx,
            key,
            peers: Mutex::new(HashMap::new()),
            staging: Mutex::new(Vec::new()),
            staging_slots: Semaphore::new(STAGING_SLOTS),
        }
    }

    fn lock_peers(&self) -> std::sync::MutexGuard<'_, HashMap<SegmentId, Entry>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_staging(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Registration>>> {
        self.staging.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A zeroed buffer of `len` bytes registered with this engine's devices:
    /// transfers into or out of it are zero copy.
    fn alloc_buffer(&self, len: usize) -> Result<Arc<RdmaBuffer>, KvError> {
        let buf = Arc::new(RdmaBuffer::new(len));
        self.ctx.register(buf.clone())?;
        Ok(buf)
    }

    /// The connection for `r`'s segment: `None` means use TCP (the reason
    /// was logged when the node was refused).
    async fn peer(
        &self,
        r: &ReplicaDesc,
        pool: Arc<ConnPool>,
        connect_timeout: Duration,
        max_frame: u32,
        stats: &EngineStats,
    ) -> Option<Arc<Peer>> {
        match self.lock_peers().get(&r.segment_id) {
            Some(Entry::Up(p)) => return Some(p.clone()),
            Some(Entry::Refused { until }) if *until > Instant::now() => return None,
            _ => {}
        }
        let addr = pool.addr().to_string();
        let set_up = tokio::time::timeout(
            connect_timeout,
            self.connect(r.segment_id, &r.grant, pool, connect_timeout, max_frame),
        )
        .await
        .unwrap_or_else(|_| {
            Err(KvError::new(
                ErrorCode::Timeout,
                format!("handshake did not finish within {connect_timeout:?}"),
            ))
        });
        let mut peers = self.lock_peers();
        match set_up {
            Ok(peer) => {
                // Another task may have connected meanwhile: keep one.
                if let Some(Entry::Up(other)) = peers.get(&r.segment_id) {
                    return Some(other.clone());
                }
                let peer = Arc::new(peer);
                peers.insert(r.segment_id, Entry::Up(peer.clone()));
                stats.rdma_connects.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    segment = format!("{:016x}", r.segment_id),
                    node = addr,
                    lanes = peer.conn.lanes(),
                    "rdma connected: using RDMA READ/WRITE for this segment"
                );
                Some(peer)
            }
            Err(e) => {
                stats.rdma_fallbacks.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    segment = format!("{:016x}", r.segment_id),
                    node = addr,
                    "rdma unavailable for this node ({e}); using tcp"
                );
                peers.insert(
                    r.segment_id,
                    Entry::Refused {
                        until: Instant::now() + RDMA_RETRY,
                    },
                );
                None
            }
        }
    }

    async fn connect(
        &self,
        segment_id: SegmentId,
        grant: &kvpool_wire::auth::Grant,
        pool: Arc<ConnPool>,
        connect_timeout: Duration,
        max_frame: u32,
    ) -> Result<Peer, KvError> {
        let mut control = pool.get(connect_timeout).await?;
        if control.is_new() {
            if let Some(key) = &self.key {
                // Ids 1 and 2; the set-up's requests after it reuse them
                // (each answer is read before the next request).
                kvpool_transport::data_conn::prove_data(control.stream(), key, 1, max_frame)
                    .await?;
            }
        }
        let caps = match ask(&mut control, 1, RdmaRequest::Caps, grant, max_frame).await? {
            RdmaResponse::Caps(c) => c,
            other => {
                return Err(KvError::new(
                    ErrorCode::Internal,
                    format!("node answered Caps with {other:?}"),
                ))
            }
        };
        if !caps.is_available() {
            return Err(KvError::new(
                ErrorCode::Unsupported,
                format!("the node has no RDMA: {}", caps.unavailable_reason),
            ));
        }
        let pending = self.ctx.connect(&caps, segment_id)?;
        let reply = match ask(
            &mut control,
            2,
            RdmaRequest::Connect(pending.request().clone()),
            grant,
            max_frame,
        )
        .await?
        {
            RdmaResponse::Connected(r) => r,
            other => {
                return Err(KvError::new(
                    ErrorCode::Internal,
                    format!("node answered Connect with {other:?}"),
                ))
            }
        };
        let conn = pending.complete(&reply)?;
        Ok(Peer {
            conn,
            _control: control,
        })
    }

    /// Forgets `segment`'s connection after a failure on it.
    fn drop_peer(&self, segment: SegmentId, peer: &Arc<Peer>) {
        let mut peers = self.lock_peers();
        if matches!(peers.get(&segment), Some(Entry::Up(p)) if Arc::ptr_eq(p, peer)) {
            peers.remove(&segment);
        }
    }

    /// Forgets every connection to `segment` (the segment went away).
    fn forget(&self, segment: SegmentId) {
        self.lock_peers().remove(&segment);
    }

    async fn staged(&self, len: usize) -> Result<Staged<'_>, KvError> {
        let slot = self
            .staging_slots
            .acquire()
            .await
            .map_err(|_| KvError::new(ErrorCode::Internal, "engine closed"))?;
        let found = {
            let mut free = self.lock_staging();
            free.iter()
                .position(|r| r.len() >= len)
                .map(|i| free.swap_remove(i))
        };
        let reg = match found {
            Some(r) => r,
            None => {
                let size = len.max(STAGING_MIN).next_power_of_two();
                let buf: Arc<dyn RdmaMemory> = Arc::new(RdmaBuffer::new(size));
                self.ctx.register(buf)?
            }
        };
        Ok(Staged {
            path: self,
            reg: Some(reg),
            finished: false,
            _slot: slot,
        })
    }

    /// Reads `r` into `dst` over RDMA; `None`: this node is on TCP.
    #[allow(clippy::too_many_arguments)]
    async fn read_replica(
        &self,
        r: &ReplicaDesc,
        dst: &mut [u8],
        deadline: Instant,
        pool: Arc<ConnPool>,
        connect_timeout: Duration,
        max_frame: u32,
        stats: &EngineStats,
    ) -> Option<Result<(), KvError>> {
        let peer = self
            .peer(r, pool, connect_timeout, max_frame, stats)
            .await?;
        if dst.is_empty() {
            return Some(Ok(()));
        }
        let res = async {
            if let Some(local) = self.ctx.lookup(dst.as_ptr() as usize, dst.len()) {
                run(&peer, Op::Read, local, r.offset, deadline).await?;
                stats
                    .rdma_bytes
                    .fetch_add(dst.len() as u64, Ordering::Relaxed);
                return Ok(());
            }
            let mut stage = self.staged(dst.len()).await?;
            let local = stage.reg().slice(0, dst.len())?;
            run(&peer, Op::Read, local, r.offset, deadline).await?;
            stage.finished = true;
            // SAFETY: the READ has completed; the buffer is ours alone.
            dst.copy_from_slice(unsafe { stage.bytes_mut(dst.len()) });
            stats
                .rdma_bytes
                .fetch_add(dst.len() as u64, Ordering::Relaxed);
            stats
                .rdma_staged_bytes
                .fetch_add(dst.len() as u64, Ordering::Relaxed);
            Ok(())
        }
        .await;
        if res.is_err() {
            self.drop_peer(r.segment_id, &peer);
        }
        Some(res)
    }

    /// Writes `src` to `r` over RDMA; `None`: this node is on TCP.
    #[allow(clippy::too_many_arguments)]
    async fn write_replica(
        &self,
        r: &ReplicaDesc,
        src: &[u8],
        deadline: Instant,
        pool: Arc<ConnPool>,
        connect_timeout: Duration,
        max_frame: u32,
        stats: &EngineStats,
    ) -> Option<Result<(), KvError>> {
        let peer = self
            .peer(r, pool, connect_timeout, max_frame, stats)
            .await?;
        if src.is_empty() {
            return Some(Ok(()));
        }
        let res = async {
            if let Some(local) = self.ctx.lookup(src.as_ptr() as usize, src.len()) {
                run(&peer, Op::Write, local, r.offset, deadline).await?;
                stats
                    .rdma_bytes
                    .fetch_add(src.len() as u64, Ordering::Relaxed);
                return Ok(());
            }
            let mut stage = self.staged(src.len()).await?;
            // SAFETY: no transfer uses this bounce buffer (it was free).
            unsafe { stage.bytes_mut(src.len()) }.copy_from_slice(src);
            let local = stage.reg().slice(0, src.len())?;
            run(&peer, Op::Write, local, r.offset, deadline).await?;
            stage.finished = true;
            stats
                .rdma_bytes
                .fetch_add(src.len() as u64, Ordering::Relaxed);
            stats
                .rdma_staged_bytes
                .fetch_add(src.len() as u64, Ordering::Relaxed);
            Ok(())
        }
        .await;
        if res.is_err() {
            self.drop_peer(r.segment_id, &peer);
        }
        Some(res)
    }
}

impl NicDataPath for RdmaPath {
    fn nic(&self) -> &Arc<dyn Nic> {
        &self.nic
    }

    fn read<'a>(&'a self, op: NicOp<'a>, dst: &'a mut [u8]) -> NicFuture<'a> {
        Box::pin(self.read_replica(
            op.replica,
            dst,
            op.deadline,
            op.pool,
            op.connect_timeout,
            op.max_frame,
            op.stats,
        ))
    }

    fn write<'a>(&'a self, op: NicOp<'a>, src: &'a [u8]) -> NicFuture<'a> {
        Box::pin(self.write_replica(
            op.replica,
            src,
            op.deadline,
            op.pool,
            op.connect_timeout,
            op.max_frame,
            op.stats,
        ))
    }

    fn forget_segment(&self, segment: SegmentId) {
        self.forget(segment);
    }

    fn alloc(&self, len: usize) -> Result<Arc<RdmaBuffer>, KvError> {
        self.alloc_buffer(len)
    }
}

async fn run(
    peer: &Peer,
    op: Op,
    local: LocalSlice,
    remote_offset: u64,
    deadline: Instant,
) -> Result<(), KvError> {
    let t = peer
        .conn
        .submit(
            TransferSpec {
                op,
                local,
                remote_offset,
                deadline,
            },
            tokio::time::sleep,
        )
        .await?;
    t.wait(tokio::time::sleep).await
}

async fn ask(
    control: &mut Conn,
    id: u64,
    req: RdmaRequest,
    grant: &kvpool_wire::auth::Grant,
    max_frame: u32,
) -> Result<RdmaResponse, KvError> {
    let s = control.stream();
    let req = DataRequest::Rdma { req, grant: *grant };
    frame::write_all(s, &frame::encode(FrameKind::DataRequest, id, &req))
        .await
        .map_err(KvError::from)?;
    let (rid, answer) =
        frame::read_reply::<DataResponse, _>(s, FrameKind::DataResponse, max_frame).await?;
    if rid != id {
        return Err(KvError::new(
            ErrorCode::Internal,
            format!("answer to request {rid}, expected {id}"),
        ));
    }
    match answer? {
        DataResponse::Rdma(r) => Ok(r),
        other => Err(KvError::new(
            ErrorCode::Internal,
            format!("node answered an RDMA request with {other:?}"),
        )),
    }
}
