//! RC connections: set-up (both sides), and the client's transfer engine
//! (slicing, bounded posting, polling, retry, deadlines).
//!
//! ```text
//!  RdmaConnection (client side; Send + Sync, clone = same connection)
//!   Mutex<ConnState>
//!     requests: fixed table (max_requests_per_connection) + FIFO of ids with work left
//!     lanes[i]: RC QP, <= max_outstanding_per_lane WRs in flight, slot table of them
//!     cqs: one per local device used, sized to that device's lanes' WR bound
//!   progress() = drain CQs -> enforce deadlines -> post slices (one doorbell per lane)
//!   Nothing runs in the background: whoever polls or waits drives it.
//!
//!  PassiveConnection (node side): the QPs a client connected to; they serve
//!  one-sided READ/WRITE of the node's registration without any CPU work.
//! ```

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

use kvpool_wire::error::{ErrorCode, KvError};
use kvpool_wire::rdma_wire::{
    RdmaCaps, RdmaConnectReply, RdmaConnectRequest, RdmaLaneRequest, RdmaLinkLayer, RdmaQpEndpoint,
    RdmaRegion,
};

use super::device::{RdmaContext, RdmaDevice};
use super::error::{classify_wc, wc_status_name, RdmaError, WcClass};
use super::memory::{LocalSlice, Registration};
use super::verbs::{empty_wc, rdma_wr, Cq, Qp, RtrParams, RtsParams};

/// Completions popped per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;
/// `wait` yields this many times between polls before it starts sleeping.
const SPIN_POLLS: u32 = 64;
/// First and largest sleep of `wait`'s backoff.
const BACKOFF_MIN: Duration = Duration::from_micros(20);
const BACKOFF_MAX: Duration = Duration::from_millis(1);

/// The direction of a one-sided transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// RDMA READ: remote -> local (a get).
    Read,
    /// RDMA WRITE: local -> remote (a put).
    Write,
}

/// One transfer: `local.len()` bytes between `local` and the peer's region
/// at `remote_offset`, finished (successfully or not) by `deadline`.
#[derive(Debug, Clone)]
pub struct TransferSpec {
    pub op: Op,
    pub local: LocalSlice,
    pub remote_offset: u64,
    pub deadline: Instant,
}

static PSN_SEED: AtomicU64 = AtomicU64::new(0);

/// A random 24-bit packet sequence number.
fn random_psn(qpn: u32) -> u32 {
    let t = Instant::now().elapsed().as_nanos() as u64
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
    let n = PSN_SEED.fetch_add(1, Ordering::Relaxed);
    (xxhash_rust::xxh3::xxh3_64_with_seed(&t.to_le_bytes(), n ^ qpn as u64) & 0x00ff_ffff) as u32
}

fn endpoint(dev: &RdmaDevice, device: usize, qp: &Qp, psn: u32) -> RdmaQpEndpoint {
    RdmaQpEndpoint {
        device: device as u16,
        qpn: qp.qpn(),
        psn,
        lid: dev.info.lid,
        gid: dev.info.gid,
        mtu: dev.info.active_mtu,
        max_dest_rd_atomic: dev.max_dest_rd_atomic,
    }
}

/// RESET -> INIT -> RTR -> RTS of one local QP against the peer's endpoint.
fn connect_qp(
    dev: &RdmaDevice,
    cfg_timeout: u8,
    cfg_retry: u8,
    qp: &Qp,
    local_psn: u32,
    remote: &RdmaQpEndpoint,
    init_done: bool,
) -> Result<(), RdmaError> {
    if !init_done {
        qp.to_init(dev.info.port)?;
    }
    let global = dev.info.link_layer == RdmaLinkLayer::Ethernet;
    qp.to_rtr(&RtrParams {
        port: dev.info.port,
        path_mtu: dev.info.active_mtu.min(remote.mtu) as u32,
        dest_qpn: remote.qpn,
        rq_psn: remote.psn,
        max_dest_rd_atomic: dev.max_dest_rd_atomic,
        dlid: remote.lid,
        dgid: remote.gid,
        global,
        sgid_index: dev.info.gid_index,
    })?;
    qp.to_rts(&RtsParams {
        sq_psn: local_psn,
        timeout: cfg_timeout,
        retry_cnt: cfg_retry,
        max_rd_atomic: dev.max_rd_atomic.min(remote.max_dest_rd_atomic.max(1)),
    })
}

/// A CQ per local device, created on first use.
struct CqSet {
    per_device: Vec<Option<Arc<Cq>>>,
}

impl CqSet {
    fn get(&mut self, ctx: &RdmaContext, dev: usize, entries: usize) -> Result<Arc<Cq>, RdmaError> {
        if self.per_device[dev].is_none() {
            self.per_device[dev] = Some(Arc::new(Cq::new(&ctx.devices[dev].handle, entries)?));
        }
        Ok(self.per_device[dev].clone().expect("just set"))
    }
}

impl RdmaContext {
    /// Client side, step 1: creates `lanes_per_peer` QPs (INIT) paired with
    /// the peer's devices, and the request to send. Step 2 is
    /// [`PendingConnection::complete`] with the peer's reply.
    pub fn connect(
        self: &Arc<Self>,
        remote: &RdmaCaps,
        segment_id: u64,
    ) -> Result<PendingConnection, RdmaError> {
        if !remote.is_available() {
            return Err(RdmaError::PeerUnsupported(
                if remote.unavailable_reason.is_empty() {
                    "the peer advertises no RDMA device".into()
                } else {
                    remote.unavailable_reason.clone()
                },
            ));
        }
        let n = self.cfg.lanes_per_peer;
        // Pair lane i with local device i % L and a peer device of the same
        // link layer, spreading lanes over both sides' devices.
        let mut pairs = Vec::with_capacity(n);
        for i in 0..n {
            let local = i % self.devices.len();
            let link = self.devices[local].info.link_layer;
            let peers: Vec<usize> = remote
                .devices
                .iter()
                .enumerate()
                .filter(|(_, d)| d.link_layer == link)
                .map(|(j, _)| j)
                .collect();
            if peers.is_empty() {
                return Err(RdmaError::PeerUnsupported(format!(
                    "no device of the peer uses {link:?} like our {}",
                    self.devices[local].info.device
                )));
            }
            pairs.push((local, peers[i % peers.len()]));
        }
        let max_out = self.cfg.max_outstanding_per_lane;
        let mut cqs = CqSet {
            per_device: vec![None; self.devices.len()],
        };
        let mut lanes = Vec::with_capacity(n);
        for &(local, remote_dev) in &pairs {
            let dev = &self.devices[local];
            let per_lane = max_out.min(dev.max_qp_wr);
            let on_dev = pairs.iter().filter(|p| p.0 == local).count();
            let entries = (per_lane as usize * on_dev + 1).min(dev.max_cqe as usize);
            let cq = cqs.get(self, local, entries)?;
            if cq.entries() < per_lane as usize * on_dev {
                return Err(KvError::new(
                    ErrorCode::InvalidParams,
                    format!(
                        "rdma: {} lanes x {per_lane} WRs exceed device {}'s CQ limit {}",
                        on_dev, dev.info.device, dev.max_cqe
                    ),
                )
                .into());
            }
            let qp = Qp::new_rc(&dev.handle, &cq, per_lane)?;
            qp.to_init(dev.info.port)?;
            let psn = random_psn(qp.qpn());
            lanes.push(PendingLane {
                qp,
                device: local,
                remote_device: remote_dev as u16,
                psn,
                max_outstanding: per_lane,
            });
        }
        let request = RdmaConnectRequest {
            segment_id,
            lanes: lanes
                .iter()
                .map(|l| RdmaLaneRequest {
                    local: endpoint(&self.devices[l.device], l.device, &l.qp, l.psn),
                    remote_device: l.remote_device,
                })
                .collect(),
        };
        Ok(PendingConnection {
            ctx: self.clone(),
            request,
            lanes,
            cqs,
        })
    }

    /// Node side: validates the client's request (untrusted input), creates
    /// and connects one QP per requested lane, and answers with their
    /// endpoints and `region`'s address and key on every device used. Keep
    /// the returned [`PassiveConnection`] for as long as the control
    /// connection lasts; dropping it tears the QPs down.
    pub fn accept(
        self: &Arc<Self>,
        req: &RdmaConnectRequest,
        region: &Arc<Registration>,
    ) -> Result<(RdmaConnectReply, PassiveConnection), RdmaError> {
        req.validate(self.devices.len())?;
        let mut cqs = CqSet {
            per_device: vec![None; self.devices.len()],
        };
        let mut qps = Vec::with_capacity(req.lanes.len());
        let mut lanes = Vec::with_capacity(req.lanes.len());
        let mut used = vec![false; self.devices.len()];
        for lane in &req.lanes {
            let d = lane.remote_device as usize;
            let dev = &self.devices[d];
            if lane.local.lid == 0 && dev.info.link_layer == RdmaLinkLayer::Infiniband {
                return Err(KvError::new(
                    ErrorCode::InvalidParams,
                    "an InfiniBand lane needs the client's LID",
                )
                .into());
            }
            // This side never posts: a one-entry CQ and send queue suffice.
            let cq = cqs.get(self, d, 1)?;
            let qp = Qp::new_rc(&dev.handle, &cq, 1)?;
            let psn = random_psn(qp.qpn());
            connect_qp(
                dev,
                self.cfg.qp_timeout,
                self.cfg.qp_retry_count,
                &qp,
                psn,
                &lane.local,
                false,
            )?;
            lanes.push(endpoint(dev, d, &qp, psn));
            used[d] = true;
            qps.push(Some(qp));
        }
        let regions = used
            .iter()
            .enumerate()
            .filter(|(_, u)| **u)
            .map(|(d, _)| RdmaRegion {
                device: d as u16,
                addr: region.addr() as u64,
                len: region.len() as u64,
                rkey: region.rkey(d),
            })
            .collect();
        Ok((
            RdmaConnectReply { lanes, regions },
            PassiveConnection {
                qps,
                _cqs: cqs.per_device.into_iter().flatten().collect(),
                _region: region.clone(),
            },
        ))
    }
}

struct PendingLane {
    qp: Qp,
    device: usize,
    remote_device: u16,
    psn: u32,
    max_outstanding: u32,
}

/// A client connection between [`RdmaContext::connect`] and the peer's reply.
pub struct PendingConnection {
    ctx: Arc<RdmaContext>,
    request: RdmaConnectRequest,
    lanes: Vec<PendingLane>,
    cqs: CqSet,
}

impl std::fmt::Debug for PendingConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingConnection")
            .field("lanes", &self.lanes.len())
            .finish()
    }
}

impl PendingConnection {
    /// The request to send to the peer.
    pub fn request(&self) -> &RdmaConnectRequest {
        &self.request
    }

    /// Validates the peer's reply (untrusted input) and moves every QP to
    /// RTS. The connection is ready to transfer.
    pub fn complete(self, reply: &RdmaConnectReply) -> Result<RdmaConnection, RdmaError> {
        reply.validate(&self.request)?;
        let cfg = &self.ctx.cfg;
        let mut lanes = Vec::with_capacity(self.lanes.len());
        let mut remote_len = u64::MAX;
        for (i, (p, remote)) in self.lanes.into_iter().zip(&reply.lanes).enumerate() {
            let dev = &self.ctx.devices[p.device];
            connect_qp(
                dev,
                cfg.qp_timeout,
                cfg.qp_retry_count,
                &p.qp,
                p.psn,
                remote,
                true,
            )?;
            let region = reply.region(remote.device).expect("validated");
            remote_len = remote_len.min(region.len);
            lanes.push(Lane::new(i, p, dev.info.device.clone(), region));
        }
        let cqs: Vec<Arc<Cq>> = self.cqs.per_device.into_iter().flatten().collect();
        let n = cfg.max_requests_per_connection;
        let retry_cap = lanes
            .iter()
            .map(|l: &Lane| l.max_outstanding as usize)
            .sum::<usize>();
        let state = ConnState {
            lanes,
            cqs,
            slots: (0..n)
                .map(|_| ReqSlot {
                    gen: 0,
                    req: None,
                    retry: Vec::with_capacity(retry_cap),
                })
                .collect(),
            free: (0..n as u32).rev().collect(),
            queue: VecDeque::with_capacity(n),
            rr: 0,
            slice_bytes: cfg.slice_bytes as u64,
            drain_timeout: cfg.drain_timeout,
            wcs: vec![empty_wc(); POLL_BATCH],
            stats: Counters::default(),
        };
        Ok(RdmaConnection {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                remote_len,
                _ctx: self.ctx,
            }),
        })
    }
}

/// The node's side of one client connection. Dropping it destroys the QPs
/// (the client's in-flight requests then fail and it reconnects).
pub struct PassiveConnection {
    // Field order: QPs before their CQs before the registration.
    qps: Vec<Option<Qp>>,
    _cqs: Vec<Arc<Cq>>,
    _region: Arc<Registration>,
}

impl PassiveConnection {
    pub fn lanes(&self) -> usize {
        self.qps.len()
    }

    /// Destroys lane `i`'s QP now (the peer QP of that lane is gone for the
    /// client). For tests and for shedding a misbehaving lane.
    pub fn destroy_lane(&mut self, i: usize) {
        if let Some(slot) = self.qps.get_mut(i) {
            slot.take();
        }
    }
}

impl std::fmt::Debug for PassiveConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PassiveConnection")
            .field("lanes", &self.qps.len())
            .finish()
    }
}

/// A work request in flight. It holds its memory's registration, so the
/// buffer stays registered and alive until the completion is polled.
struct Inflight {
    req: u32,
    gen: u32,
    /// Offset of the slice inside its request.
    offset: u64,
    len: u32,
    reg: Arc<Registration>,
}

#[derive(Debug, Clone)]
enum Health {
    Healthy,
    Broken(String),
}

struct Lane {
    index: usize,
    qp: Qp,
    device: usize,
    device_name: String,
    remote_addr: u64,
    rkey: u32,
    max_outstanding: u32,
    slots: Vec<Option<Inflight>>,
    free: Vec<u32>,
    /// Slots filled in this pass, posted together (one doorbell).
    batch: Vec<u32>,
    wrs: Vec<ffi::ibv_send_wr>,
    sges: Vec<ffi::ibv_sge>,
    health: Health,
    posted: u64,
    completed: u64,
    failed: u64,
    doorbells: u64,
    max_seen: u32,
}

impl Lane {
    fn new(index: usize, p: PendingLane, device_name: String, region: &RdmaRegion) -> Self {
        let m = p.max_outstanding as usize;
        Self {
            index,
            qp: p.qp,
            device: p.device,
            device_name,
            remote_addr: region.addr,
            rkey: region.rkey,
            max_outstanding: p.max_outstanding,
            slots: (0..m).map(|_| None).collect(),
            free: (0..m as u32).rev().collect(),
            batch: Vec::with_capacity(m),
            wrs: Vec::with_capacity(m),
            sges: Vec::with_capacity(m),
            health: Health::Healthy,
            posted: 0,
            completed: 0,
            failed: 0,
            doorbells: 0,
            max_seen: 0,
        }
    }

    fn outstanding(&self) -> u32 {
        self.max_outstanding - self.free.len() as u32
    }

    fn healthy(&self) -> bool {
        matches!(self.health, Health::Healthy)
    }
}

fn wr_id(lane: usize, slot: u32) -> u64 {
    ((lane as u64) << 32) | slot as u64
}

fn wr_lane_slot(id: u64) -> (usize, u32) {
    ((id >> 32) as usize, id as u32)
}

struct Req {
    op: Op,
    local: LocalSlice,
    remote_offset: u64,
    len: u64,
    /// Next byte not yet handed to a lane.
    next: u64,
    outstanding: u32,
    done: u64,
    deadline: Instant,
    /// Set once the request can no longer succeed; it finishes with this
    /// error when its last WR has completed.
    error: Option<KvError>,
    aborted_at: Option<Instant>,
    last_failure: Option<String>,
    result: Option<Result<(), KvError>>,
    /// Its `Transfer` was dropped: nobody takes the result.
    detached: bool,
    queued: bool,
}

struct ReqSlot {
    gen: u32,
    req: Option<Req>,
    /// Slices to post again, kept with the slot so it is allocated once.
    retry: Vec<(u64, u32)>,
}

#[derive(Default)]
struct Counters {
    submitted: u64,
    succeeded: u64,
    failed: u64,
    retried_slices: u64,
    max_active: usize,
}

struct ConnState {
    // Field order: lanes (QPs) drop before the CQs.
    lanes: Vec<Lane>,
    cqs: Vec<Arc<Cq>>,
    slots: Vec<ReqSlot>,
    free: Vec<u32>,
    queue: VecDeque<u32>,
    rr: usize,
    slice_bytes: u64,
    drain_timeout: Duration,
    wcs: Vec<ffi::ibv_wc>,
    stats: Counters,
}

// SAFETY: the only non-Send parts are the raw pointers inside the WR and SGE
// scratch vectors (`Lane::wrs`, `Lane::sges`); they point into those same
// vectors, are rebuilt before every post, and are never dereferenced by Rust
// code outside `flush_lane`, which runs under the connection's lock. The
// verbs owners (QP, CQ) are Send + Sync.
unsafe impl Send for ConnState {}

impl ConnState {
    fn active(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn healthy_lanes(&self) -> usize {
        self.lanes.iter().filter(|l| l.healthy()).count()
    }

    fn broken_reasons(&self) -> String {
        self.lanes
            .iter()
            .filter_map(|l| match &l.health {
                Health::Broken(r) => Some(format!("lane {}: {r}", l.index)),
                Health::Healthy => None,
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn break_lane(&mut self, lane: usize, reason: String, reset: bool) {
        let l = &mut self.lanes[lane];
        if !l.healthy() {
            return;
        }
        tracing::warn!(
            "rdma: lane {lane} ({}) out of service: {reason}",
            l.device_name
        );
        l.health = Health::Broken(reason);
        if reset {
            if let Err(e) = l.qp.to_error() {
                tracing::error!("rdma: lane {lane}: cannot reset its QP: {e}");
            }
        }
    }

    fn enqueue(&mut self, id: u32) {
        let req = self.slots[id as usize]
            .req
            .as_mut()
            .expect("enqueue of a live request");
        if !req.queued {
            req.queued = true;
            self.queue.push_back(id);
        }
    }

    fn has_work(&self, id: u32) -> bool {
        let s = &self.slots[id as usize];
        match &s.req {
            Some(r) => r.error.is_none() && (!s.retry.is_empty() || r.next < r.len),
            None => false,
        }
    }

    fn free_slot(&mut self, id: u32) {
        let s = &mut self.slots[id as usize];
        s.req = None;
        s.retry.clear();
        s.gen = s.gen.wrapping_add(1);
        self.free.push(id);
    }

    /// Records the final result once the request has nothing in flight.
    fn maybe_finish(&mut self, id: u32) {
        let s = &mut self.slots[id as usize];
        let Some(r) = s.req.as_mut() else { return };
        if r.result.is_some() || r.outstanding > 0 {
            return;
        }
        let result = match &r.error {
            Some(e) => Err(e.clone()),
            None if r.done == r.len => Ok(()),
            None => return,
        };
        if result.is_ok() {
            self.stats.succeeded += 1;
        } else {
            self.stats.failed += 1;
        }
        let detached = r.detached;
        r.result = Some(result);
        if detached {
            self.free_slot(id);
        }
    }

    fn drain_cqs(&mut self) -> usize {
        let mut total = 0;
        for c in 0..self.cqs.len() {
            loop {
                let n = match self.cqs[c].poll(&mut self.wcs) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::error!("rdma: {e}");
                        0
                    }
                };
                for i in 0..n {
                    let wc = self.wcs[i];
                    self.on_completion(&wc);
                }
                total += n;
                if n < self.wcs.len() {
                    break;
                }
            }
        }
        total
    }

    fn on_completion(&mut self, wc: &ffi::ibv_wc) {
        let (li, slot) = wr_lane_slot(wc.wr_id());
        let status = wc
            .error()
            .map_or(ffi::ibv_wc_status::IBV_WC_SUCCESS, |e| e.0);
        let class = classify_wc(status);
        let Some(lane) = self.lanes.get_mut(li) else {
            tracing::error!("rdma: completion for unknown lane {li}");
            return;
        };
        let Some(inf) = lane.slots.get_mut(slot as usize).and_then(Option::take) else {
            tracing::error!("rdma: completion for an empty slot {slot} of lane {li}");
            return;
        };
        lane.free.push(slot);
        lane.completed += 1;
        let mut failure = None;
        if class != WcClass::Success {
            lane.failed += 1;
            let vendor = wc.error().map_or(0, |e| e.1);
            let what = format!(
                "{} (vendor {vendor:#x}) on lane {li} ({})",
                wc_status_name(status),
                lane.device_name
            );
            if class != WcClass::Flushed || lane.healthy() {
                // The hardware has moved the QP to ERR already.
                self.break_lane(li, what.clone(), false);
            }
            failure = Some(what);
        }
        let s = &mut self.slots[inf.req as usize];
        let live = s.gen == inf.gen && s.req.is_some();
        if live {
            let r = s.req.as_mut().expect("checked");
            r.outstanding -= 1;
            match class {
                WcClass::Success => r.done += inf.len as u64,
                WcClass::Flushed | WcClass::Transport => {
                    if class == WcClass::Transport {
                        r.last_failure = failure;
                    }
                    if r.error.is_none() {
                        s.retry.push((inf.offset, inf.len));
                        self.stats.retried_slices += 1;
                        self.enqueue(inf.req);
                    }
                }
                WcClass::Request => {
                    let op = r.op;
                    r.error.get_or_insert_with(|| {
                        KvError::new(
                            ErrorCode::InvalidParams,
                            format!(
                                "rdma {op:?} of {} bytes at remote offset {} refused: {}",
                                r.len,
                                r.remote_offset,
                                failure.unwrap_or_default()
                            ),
                        )
                    });
                }
            }
            self.maybe_finish(inf.req);
        }
        // `inf` (and its hold on the registration) is released here, after
        // the NIC is done with the buffer.
        drop(inf);
    }

    /// Fails requests past their deadline. One with WRs in flight resets the
    /// lanes carrying them (the only way to take a buffer back from the NIC
    /// early); it finishes once the flushed completions are in.
    fn enforce_deadlines(&mut self, now: Instant) {
        if self.active() == 0 {
            return;
        }
        let drain = self.drain_timeout;
        for id in 0..self.slots.len() as u32 {
            let Some(r) = self.slots[id as usize].req.as_mut() else {
                continue;
            };
            if r.result.is_some() {
                continue;
            }
            if r.error.is_none() && now >= r.deadline {
                r.error = Some(KvError::new(
                    ErrorCode::Timeout,
                    format!(
                        "rdma {:?} of {} bytes missed its deadline ({} bytes done)",
                        r.op, r.len, r.done
                    ),
                ));
                r.aborted_at = Some(now);
                if r.outstanding > 0 {
                    let gen = self.slots[id as usize].gen;
                    for li in 0..self.lanes.len() {
                        let carries = self.lanes[li]
                            .slots
                            .iter()
                            .flatten()
                            .any(|i| i.req == id && i.gen == gen);
                        if carries {
                            self.break_lane(
                                li,
                                "reset: a request's deadline passed with its work requests \
                                 in flight"
                                    .into(),
                                true,
                            );
                        }
                    }
                }
            }
            let r = self.slots[id as usize].req.as_mut().expect("present");
            if r.outstanding > 0 {
                if let Some(at) = r.aborted_at {
                    if now.duration_since(at) > drain {
                        // The device did not flush. The WRs keep their
                        // registrations (never freed under the NIC); the
                        // caller gets an answer.
                        tracing::error!(
                            "rdma: {} work requests not flushed after {drain:?}; \
                             their buffers stay registered",
                            r.outstanding
                        );
                        r.error = Some(KvError::new(
                            ErrorCode::Internal,
                            format!(
                                "rdma device did not flush {} work requests within {drain:?}",
                                r.outstanding
                            ),
                        ));
                        r.outstanding = 0;
                    }
                }
            }
            self.maybe_finish(id);
        }
    }

    /// Picks a healthy lane with a free slot, round robin.
    fn pick_lane(&mut self) -> Option<usize> {
        let n = self.lanes.len();
        for k in 0..n {
            let i = (self.rr + k) % n;
            if self.lanes[i].healthy() && !self.lanes[i].free.is_empty() {
                self.rr = i + 1;
                return Some(i);
            }
        }
        None
    }

    /// Hands queued slices to lanes, then posts each lane's batch.
    fn post(&mut self) {
        if self.queue.is_empty() {
            return;
        }
        if self.healthy_lanes() == 0 {
            let why = self.broken_reasons();
            while let Some(id) = self.queue.pop_front() {
                let Some(r) = self.slots[id as usize].req.as_mut() else {
                    continue;
                };
                r.queued = false;
                if r.error.is_none() {
                    let last = r
                        .last_failure
                        .as_deref()
                        .map(|f| format!(" (last failure: {f})"))
                        .unwrap_or_default();
                    r.error = Some(KvError::new(
                        ErrorCode::Unavailable,
                        format!("rdma: no healthy lane to the peer{last}: {why}"),
                    ));
                }
                self.maybe_finish(id);
            }
            return;
        }
        'requests: while let Some(&id) = self.queue.front() {
            if !self.has_work(id) {
                self.queue.pop_front();
                if let Some(r) = self.slots[id as usize].req.as_mut() {
                    r.queued = false;
                }
                self.maybe_finish(id);
                continue;
            }
            loop {
                let Some(li) = self.pick_lane() else {
                    break 'requests;
                };
                let slice = self.slice_bytes;
                let s = &mut self.slots[id as usize];
                let gen = s.gen;
                let r = s.req.as_mut().expect("has work");
                let (offset, len) = match s.retry.pop() {
                    Some(x) => x,
                    None => {
                        let len = slice.min(r.len - r.next) as u32;
                        let off = r.next;
                        r.next += len as u64;
                        (off, len)
                    }
                };
                r.outstanding += 1;
                let reg = r.local.reg.clone();
                let lane = &mut self.lanes[li];
                let slot = lane.free.pop().expect("picked lane has a free slot");
                lane.slots[slot as usize] = Some(Inflight {
                    req: id,
                    gen,
                    offset,
                    len,
                    reg,
                });
                lane.batch.push(slot);
                if !self.has_work(id) {
                    self.queue.pop_front();
                    self.slots[id as usize]
                        .req
                        .as_mut()
                        .expect("present")
                        .queued = false;
                    continue 'requests;
                }
            }
        }
        for li in 0..self.lanes.len() {
            if !self.lanes[li].batch.is_empty() {
                self.flush_lane(li);
            }
        }
    }

    /// Posts lane `li`'s batch as one chain. Slices the provider refuses go
    /// back to their requests, and the lane is taken out of service.
    fn flush_lane(&mut self, li: usize) {
        let lane = &mut self.lanes[li];
        lane.sges.clear();
        lane.wrs.clear();
        for &slot in &lane.batch {
            let inf = lane.slots[slot as usize].as_ref().expect("batched slot");
            let r = self.slots[inf.req as usize]
                .req
                .as_ref()
                .expect("batched request");
            let local = r.local.addr() as u64 + inf.offset;
            lane.sges.push(ffi::ibv_sge {
                addr: local,
                length: inf.len,
                lkey: inf.reg.lkey(lane.device),
            });
        }
        for (k, &slot) in lane.batch.iter().enumerate() {
            let inf = lane.slots[slot as usize].as_ref().expect("batched slot");
            let r = self.slots[inf.req as usize]
                .req
                .as_ref()
                .expect("batched request");
            // SAFETY: `k` < sges.len(); the vector is not resized while the
            // chain is built and posted.
            let sge = unsafe { lane.sges.as_mut_ptr().add(k) };
            lane.wrs.push(rdma_wr(
                wr_id(li, slot),
                sge,
                r.op == Op::Write,
                lane.remote_addr + r.remote_offset + inf.offset,
                lane.rkey,
            ));
        }
        let n = lane.wrs.len();
        let base = lane.wrs.as_mut_ptr();
        for k in 0..n.saturating_sub(1) {
            // SAFETY: `k` and `k + 1` < wrs.len(); no resize until posted.
            unsafe { (*base.add(k)).next = base.add(k + 1) };
        }
        // SAFETY: a valid chain of `n` WRs over SGEs of memory registered on
        // this lane's device (each `Inflight` holds its registration until
        // the completion is polled, so the memory outlives the WR).
        let posted = match unsafe { lane.qp.post_send(base) } {
            Ok(()) => n,
            Err((errno, posted)) => {
                let why = format!(
                    "ibv_post_send refused a work request: {}",
                    std::io::Error::from_raw_os_error(errno)
                );
                let refused: Vec<u32> = lane.batch[posted..].to_vec();
                lane.posted += posted as u64;
                lane.batch.clear();
                for slot in refused {
                    let inf = self.lanes[li].slots[slot as usize]
                        .take()
                        .expect("refused slot");
                    self.lanes[li].free.push(slot);
                    let s = &mut self.slots[inf.req as usize];
                    if let Some(r) = s.req.as_mut() {
                        r.outstanding -= 1;
                        if r.error.is_none() {
                            s.retry.push((inf.offset, inf.len));
                            self.stats.retried_slices += 1;
                            self.enqueue(inf.req);
                        }
                    }
                }
                self.break_lane(li, why, true);
                return;
            }
        };
        lane.posted += posted as u64;
        lane.doorbells += 1;
        lane.batch.clear();
        let out = lane.outstanding();
        lane.max_seen = lane.max_seen.max(out);
        debug_assert!(out <= lane.max_outstanding);
    }

    fn progress(&mut self) -> usize {
        let n = self.drain_cqs();
        self.enforce_deadlines(Instant::now());
        self.post();
        n
    }

    fn outstanding(&self) -> u32 {
        self.lanes.iter().map(Lane::outstanding).sum()
    }
}

impl Drop for ConnState {
    fn drop(&mut self) {
        if self.outstanding() == 0 {
            return;
        }
        // Take the buffers back from the NIC before anything is released:
        // reset every lane with work in flight and wait for the flushes.
        for li in 0..self.lanes.len() {
            if self.lanes[li].outstanding() > 0 {
                if let Err(e) = self.lanes[li].qp.to_error() {
                    tracing::error!("rdma: lane {li}: cannot reset its QP: {e}");
                }
            }
        }
        let until = Instant::now() + self.drain_timeout;
        while self.outstanding() > 0 && Instant::now() < until {
            if self.drain_cqs() == 0 {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        if self.outstanding() > 0 {
            tracing::error!(
                "rdma: {} work requests not flushed within {:?}; leaking their \
                 registrations so the NIC never writes freed memory",
                self.outstanding(),
                self.drain_timeout
            );
            for lane in &mut self.lanes {
                for inf in lane.slots.iter_mut().filter_map(Option::take) {
                    std::mem::forget(inf.reg);
                }
            }
        }
    }
}

struct Shared {
    state: Mutex<ConnState>,
    remote_len: u64,
    _ctx: Arc<RdmaContext>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A client's connection to one peer's region: several RC lanes, a bounded
/// request table, and the posting/polling logic. `Send + Sync`; clones share
/// the connection. Progress happens only when someone calls [`poll`]
/// (directly or through a [`Transfer`]'s `wait`): call it from the shard or
/// task that waits, no background thread is involved.
///
/// [`poll`]: RdmaConnection::poll
#[derive(Clone)]
pub struct RdmaConnection {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RdmaConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaConnection")
            .field("remote_len", &self.shared.remote_len)
            .finish()
    }
}

/// Counters of one lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneStats {
    pub device: String,
    pub healthy: bool,
    /// Why the lane is out of service.
    pub broken_reason: Option<String>,
    pub outstanding: u32,
    pub max_outstanding: u32,
    /// Most WRs ever in flight at once (never above `max_outstanding`).
    pub max_outstanding_seen: u32,
    pub posted_wrs: u64,
    pub completed_wrs: u64,
    pub failed_wrs: u64,
    /// `ibv_post_send` calls (each posts a chain).
    pub doorbells: u64,
}

/// Counters of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnStats {
    pub lanes: Vec<LaneStats>,
    /// Requests in the table now (queued, in flight, or finished and not
    /// yet taken).
    pub active_requests: usize,
    /// The table's fixed size.
    pub request_capacity: usize,
    pub max_active_requests_seen: usize,
    pub submitted: u64,
    pub succeeded: u64,
    pub failed: u64,
    /// Slices posted again after a failure or flush of their lane.
    pub retried_slices: u64,
}

impl ConnStats {
    /// Lanes still in service.
    pub fn healthy_lanes(&self) -> usize {
        self.lanes.iter().filter(|l| l.healthy).count()
    }
}

impl RdmaConnection {
    /// Bytes of the peer's region.
    pub fn remote_len(&self) -> u64 {
        self.shared.remote_len
    }

    /// Lanes that can still carry work. A connection with none fails every
    /// request with `Unavailable`; make a new one.
    pub fn healthy_lanes(&self) -> usize {
        self.shared.lock().healthy_lanes()
    }

    pub fn lanes(&self) -> usize {
        self.shared.lock().lanes.len()
    }

    /// Makes progress without blocking: polls completions, enforces
    /// deadlines, posts queued slices. Returns the completions seen.
    pub fn poll(&self) -> usize {
        self.shared.lock().progress()
    }

    /// Puts lane `i` out of service now (its QP to ERR; its work requests
    /// flush and their slices run on other lanes). For tests and operators.
    pub fn reset_lane(&self, i: usize) {
        let mut st = self.shared.lock();
        if i < st.lanes.len() {
            st.break_lane(i, "reset on request".into(), true);
        }
    }

    pub fn stats(&self) -> ConnStats {
        let st = self.shared.lock();
        ConnStats {
            lanes: st
                .lanes
                .iter()
                .map(|l| LaneStats {
                    device: l.device_name.clone(),
                    healthy: l.healthy(),
                    broken_reason: match &l.health {
                        Health::Broken(r) => Some(r.clone()),
                        Health::Healthy => None,
                    },
                    outstanding: l.outstanding(),
                    max_outstanding: l.max_outstanding,
                    max_outstanding_seen: l.max_seen,
                    posted_wrs: l.posted,
                    completed_wrs: l.completed,
                    failed_wrs: l.failed,
                    doorbells: l.doorbells,
                })
                .collect(),
            active_requests: st.active(),
            request_capacity: st.slots.len(),
            max_active_requests_seen: st.stats.max_active,
            submitted: st.stats.submitted,
            succeeded: st.stats.succeeded,
            failed: st.stats.failed,
            retried_slices: st.stats.retried_slices,
        }
    }

    /// Starts a transfer if the request table has room: `ResourceExhausted`
    /// when it is full (back-pressure: poll, let transfers finish, retry, or
    /// use [`submit`](Self::submit)), `Unavailable` when no lane is left,
    /// `InvalidParams` when the remote range is outside the peer's region.
    pub fn try_submit(&self, spec: TransferSpec) -> Result<Transfer, KvError> {
        let len = spec.local.len() as u64;
        match spec.remote_offset.checked_add(len) {
            Some(end) if end <= self.shared.remote_len => {}
            _ => {
                return Err(KvError::new(
                    ErrorCode::InvalidParams,
                    format!(
                        "remote range {}+{len} is outside the peer's {} bytes",
                        spec.remote_offset, self.shared.remote_len
                    ),
                ))
            }
        }
        let mut st = self.shared.lock();
        if st.healthy_lanes() == 0 {
            return Err(KvError::new(
                ErrorCode::Unavailable,
                format!(
                    "rdma connection has no healthy lane: {}",
                    st.broken_reasons()
                ),
            ));
        }
        let Some(id) = st.free.pop() else {
            return Err(KvError::new(
                ErrorCode::ResourceExhausted,
                format!(
                    "rdma connection has {} requests in its table (the bound)",
                    st.slots.len()
                ),
            ));
        };
        let gen = st.slots[id as usize].gen;
        st.slots[id as usize].req = Some(Req {
            op: spec.op,
            local: spec.local,
            remote_offset: spec.remote_offset,
            len,
            next: 0,
            outstanding: 0,
            done: 0,
            deadline: spec.deadline,
            error: None,
            aborted_at: None,
            last_failure: None,
            result: None,
            detached: false,
            queued: false,
        });
        st.stats.submitted += 1;
        let active = st.active();
        st.stats.max_active = st.stats.max_active.max(active);
        st.enqueue(id);
        st.progress();
        drop(st);
        Ok(Transfer {
            shared: self.shared.clone(),
            id,
            gen,
            deadline: spec.deadline,
            len,
            taken: false,
        })
    }

    /// Like [`try_submit`](Self::try_submit), but waits (polling, with
    /// `sleep` between attempts) for room in the request table until the
    /// transfer's deadline.
    pub async fn submit<S, F>(&self, spec: TransferSpec, mut sleep: S) -> Result<Transfer, KvError>
    where
        S: FnMut(Duration) -> F,
        F: Future<Output = ()>,
    {
        let mut backoff = Backoff::new();
        loop {
            match self.try_submit(spec.clone()) {
                Err(e) if e.code == ErrorCode::ResourceExhausted => {}
                other => return other,
            }
            let now = Instant::now();
            if now >= spec.deadline {
                return Err(KvError::new(
                    ErrorCode::Timeout,
                    "rdma: no room in the connection's request table before the deadline",
                ));
            }
            if self.poll() == 0 {
                backoff.pause(&mut sleep, spec.deadline - now).await;
            }
        }
    }
}

/// Backoff of the polling helpers: a few yields, then sleeps growing from
/// `BACKOFF_MIN` to `BACKOFF_MAX`, never past the deadline.
struct Backoff {
    spins: u32,
    sleep: Duration,
}

impl Backoff {
    fn new() -> Self {
        Self {
            spins: 0,
            sleep: BACKOFF_MIN,
        }
    }

    async fn pause<S, F>(&mut self, sleep: &mut S, left: Duration)
    where
        S: FnMut(Duration) -> F,
        F: Future<Output = ()>,
    {
        if self.spins < SPIN_POLLS {
            self.spins += 1;
            futures_lite::future::yield_now().await;
            return;
        }
        // Sleep at least a little past the deadline so that the next poll
        // sees it passed, but no longer than the cap.
        let d = self.sleep.min(left + BACKOFF_MIN).max(BACKOFF_MIN);
        sleep(d).await;
        self.sleep = (self.sleep * 2).min(BACKOFF_MAX);
    }
}

/// One submitted transfer. Its final status comes from [`try_result`] or
/// [`wait`]; a final status means the NIC is done with the local buffer.
/// Dropping it unfinished cancels it: no new slices are posted, and the table
/// slot is released once the slices in flight have completed (the buffer
/// stays registered and alive until then).
///
/// [`try_result`]: Transfer::try_result
/// [`wait`]: Transfer::wait
pub struct Transfer {
    shared: Arc<Shared>,
    id: u32,
    gen: u32,
    deadline: Instant,
    len: u64,
    taken: bool,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("len", &self.len)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl Transfer {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Makes progress on the connection, then returns the final status if
    /// there is one (once; later calls return `None`).
    pub fn try_result(&mut self) -> Option<Result<(), KvError>> {
        if self.taken {
            return None;
        }
        let mut st = self.shared.lock();
        st.progress();
        let s = &mut st.slots[self.id as usize];
        debug_assert_eq!(s.gen, self.gen, "a transfer's slot is freed only by it");
        let result = s.req.as_mut().and_then(|r| r.result.take())?;
        st.free_slot(self.id);
        self.taken = true;
        Some(result)
    }

    /// Polls until the final status, pausing between polls with `sleep`
    /// (`tokio::time::sleep`, `glommio::timer::sleep`, ...) after a few
    /// yields. Returns at the latest shortly after the deadline (plus the
    /// time the NIC takes to flush a reset lane).
    pub async fn wait<S, F>(mut self, mut sleep: S) -> Result<(), KvError>
    where
        S: FnMut(Duration) -> F,
        F: Future<Output = ()>,
    {
        let mut backoff = Backoff::new();
        loop {
            if let Some(r) = self.try_result() {
                return r;
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            backoff.pause(&mut sleep, left).await;
        }
    }

    /// [`wait`](Self::wait) for threads that may block.
    pub fn wait_blocking(self) -> Result<(), KvError> {
        futures_lite::future::block_on(self.wait(|d| {
            std::thread::sleep(d);
            std::future::ready(())
        }))
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        let mut st = self.shared.lock();
        let s = &mut st.slots[self.id as usize];
        if s.gen != self.gen {
            return;
        }
        let Some(r) = s.req.as_mut() else { return };
        if r.result.is_some() {
            st.free_slot(self.id);
            return;
        }
        r.detached = true;
        r.error
            .get_or_insert_with(|| KvError::new(ErrorCode::Unavailable, "rdma transfer cancelled"));
        st.maybe_finish(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_round_trip() {
        for (l, s) in [(0usize, 0u32), (3, 17), (63, u32::MAX)] {
            assert_eq!(wr_lane_slot(wr_id(l, s)), (l, s));
        }
    }

    #[test]
    fn psns_fit_24_bits_and_vary() {
        let a: Vec<u32> = (0..64).map(random_psn).collect();
        assert!(a.iter().all(|p| *p <= 0x00ff_ffff));
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 60);
    }
}
