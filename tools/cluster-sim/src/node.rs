//! A storage node as a state machine: the calls and I/O of
//! `actors/storage-node` as a MODEL (`node.rs` for the DRAM segment, mounts
//! and pings; `nvme_tier.rs` for the tier's rounds), following the same
//! protocol, around the node's REAL rules: when it mounts, reports and
//! pings ([`Lane`]), what a tier task does with the copies it finds
//! ([`task`]) and what a round reports and removes ([`round`]).
//!
//! * DRAM: the segment's ranges as written (offset -> length and value); a
//!   write over part of a range leaves bytes of no value there. A restart
//!   makes a new segment (the real name carries a random part), so the
//!   master never takes the new memory for the old.
//! * The control lane, every [`PING_MS`]: the calls [`Lane`] asks for
//!   (mount the DRAM segment, mount the tier and report every copy it holds,
//!   `Recovered`, index flushed first; then a ping naming both segments, and
//!   what its answer says the master does not know mounted again); a call
//!   without an answer by its deadline counts as failed. Where the real
//!   node's start fails (its tier's first mount or report), this one goes
//!   on retrying at each tick, as a supervisor's restart would.
//! * The round lane, at the node's own pace ([`Pace`]: the next round at
//!   once after one that ran tasks, [`ROUND_MS`] after an idle one, at
//!   least `round::FAILED_PAUSE` after a failed one), in the node's own order of steps
//!   ([`Steps`]): `NodeTasks` from every master shard, each task decided
//!   by [`task`] (Persist: the DRAM bytes checked against the object's
//!   checksum, then written unless that very copy is there; Promote:
//!   refused into another node's segment or with other bytes; Drop: only
//!   its key's copy at its version); the index flushed before the master
//!   hears of a copy (a copy not in its place after it, and on a failed
//!   flush the round's fresh copies, are `PersistFailed`); copies the master refuses are
//!   removed; then the tier evicts past its high watermark down to its low
//!   one, in its order (FIFO on even nodes, LRU on odd ones, reads of
//!   clients and promotions counted), both the real tier's rules:
//!   `Evicted` reported first, the copies removed after (while the report
//!   is out they read as gone and no whole-tier report names them, as the
//!   real tier's marks do; a report that fails takes the marks back). A
//!   copy is named by its location (a slot) and the write that made it, as
//!   the real tier names it. A Persist that finds no room has the tier evict what it
//!   needs ([`PersistRule::room`]) in the middle of the round's tasks,
//!   `Evicted` reported first, then tries once more (the real node's
//!   `persist`; a report that fails keeps the copies).
//! * The tier: the real tier's index ([`TierIndex`]) over a simulated disk.
//!   The index picks each copy's slot and extent (header and value in
//!   blocks, as the tier lays them out), so a write finds no slot or no
//!   extent large enough, or its key's copy still there, as the tier would;
//!   it names copies by write number, ranks reads for LRU and keeps the
//!   eviction marks. A tier write, flush or removal (its tombstone's write:
//!   the copy stays, marks and all; a real write that errs may have reached
//!   the device, which the model never has) fails at random (a removal
//!   after `Evicted` that fails is owed and tried again at the next
//!   eviction, as on the real node); a crash loses
//!   DRAM and every index record not flushed (that write is torn), and the
//!   index after the restart is what the real recovery makes of the
//!   records left, newest first.
//!
//! Every call the node makes has the client's deadline: a lane whose answer
//! does not come by then gives up and starts over on its next timer.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use kvpool_storage::nvme::{self, Eviction, NvmeConfig, NvmeLoc, BLOCK};
use kvpool_storage::tier_index::{Found, Record, Refused, SlotCopy, TierIndex};
use kvpool_storage_node::control::{Ask, Lane, Outcome};
use kvpool_storage_node::fetch::FETCH_DEADLINE;
use kvpool_storage_node::gate::NvmeRead;
use kvpool_storage_node::round::{self, Pace, Round, Step, Steps};
use kvpool_storage_node::task::{self, DropRule, FetchRule, PersistRule, PromoteRule};
use kvpool_transport::read::{self as read_rules, Prefer, ReplicaRead, Suspects};
use kvpool_wire::proto::{
    segment_id_for, DataRequest, Endpoint, FetchTask, ItemResult, MasterRequest, MasterResponse,
    NodeTask, NvmeAttach, NvmeUpdate, PersistTask, SegmentId, SegmentSpec, Tier,
};
use kvpool_wire::{ErrorCode, KvError};
use rand::Rng;

use crate::{
    sum_of, Addr, Body, Content, Ctx, Msg, NodeGate, Timer, CLIENT_TIMEOUT_MS, DRAM_BYTES, PING_MS,
    ROUND_MS, SHARDS,
};

/// The tier's bytes (one region of the real tier's index: its allocator
/// hands out the extents) and its slots: a write finds no slot or no extent
/// large enough and is `NoSpace`, as on the real tier.
const TIER_BYTES: u64 = 96 << 10;
const TIER_SLOTS: u32 = 12;
/// Its watermarks (fractions of its bytes), lower than the tier's defaults
/// so that the values the clients put (1 byte to 9000: extents of 4 to
/// 16 KiB) evict a few at a time.
const TIER_HIGH: f64 = 0.8;
const TIER_LOW: f64 = 0.6;

/// A copy on the simulated disk: its header's key, what its slot record
/// says, its value (a tag), and whether the record is on the device.
#[derive(Debug, Clone)]
struct OnDisk {
    key: Vec<u8>,
    record: Record,
    content: Content,
    durable: bool,
}

/// The NVMe tier: the real tier's index ([`TierIndex`]: slots, extents,
/// which copy a key names, write numbers, the read clock, eviction marks,
/// recovery) over the simulated disk.
struct TierModel {
    seg: SegmentId,
    spec: SegmentSpec,
    index: TierIndex,
    /// What the disk holds, by slot.
    disk: BTreeMap<u32, OnDisk>,
    /// Its watermarks and what it evicts first, run by the real tier's
    /// rules ([`NvmeConfig::bytes_to_evict`], [`TierIndex::mark_victims`]);
    /// even nodes FIFO (the default), odd ones LRU.
    cfg: NvmeConfig,
}

/// One copy: its location (a slot of region 0) and the number of the write
/// that made it.
type CopyRef = (u64, u64);

/// The slot a location names (the tier has one region).
fn slot_of(loc: u64) -> Option<u32> {
    let l = NvmeLoc::unpack(loc);
    (l.region == 0).then_some(l.slot)
}

impl TierModel {
    fn new_index() -> TierIndex {
        TierIndex::new(0, TIER_BYTES, BLOCK, TIER_SLOTS)
    }

    /// The location of `key`'s copy (not one being evicted).
    fn lookup(&self, key: &[u8]) -> Option<u64> {
        self.index.lookup(key).map(u64::from)
    }

    /// The copy at `loc`, evicting or not.
    fn copy(&self, loc: u64) -> Option<&SlotCopy> {
        self.index.copy(slot_of(loc)?)
    }

    /// The copy at `loc` as a reference.
    fn copy_ref(&self, loc: u64) -> Option<CopyRef> {
        self.copy(loc).map(|c| (loc, c.record.seq))
    }

    /// Whether location `c.0` holds copy `c` (the very copy: a location
    /// reused since holds one of a later write).
    fn holds(&self, c: CopyRef) -> bool {
        slot_of(c.0).is_some_and(|s| self.index.holds(s, c.1))
    }

    /// A write of a copy, the real tier's order: a slot and an extent (or
    /// the index's refusal), then the bytes, which fail when `fails` (the
    /// place is given back).
    fn write(
        &mut self,
        key: &[u8],
        (len, sum, version): (u64, u64, u64),
        content: Content,
        fails: impl FnOnce() -> bool,
    ) -> Result<Option<CopyRef>, Refused> {
        let r = self.index.reserve(key, nvme::extent(key.len(), len))?;
        if fails() {
            self.index.unreserve(r);
            return Ok(None);
        }
        let record = r.record(len, sum, version);
        self.index.insert(r.slot, key, record);
        let copy = OnDisk {
            key: key.to_vec(),
            record,
            content,
            durable: false,
        };
        self.disk.insert(r.slot, copy);
        Ok(Some((u64::from(r.slot), r.seq)))
    }

    /// Removes the copy at `loc`: its tombstone written (durable at once),
    /// then its place freed; whether it went. The write fails when `fails`
    /// says so: the copy stays, on the disk and in the index (marks and
    /// all), as on the real tier, whose `remove` frees nothing then.
    fn take(&mut self, loc: u64, fails: impl FnOnce() -> bool) -> bool {
        let Some(slot) = slot_of(loc) else {
            return false;
        };
        if self.index.tombstone(slot).is_none() {
            return false;
        }
        if fails() {
            self.index.removal_failed(slot);
            return false;
        }
        self.index.free(slot);
        self.disk.remove(&slot);
        true
    }

    /// A read of the copy at `loc` if `wanted` says so of its key and
    /// version (a client's, or a promotion's; not a copy being evicted):
    /// its length and value, the copy LRU now ranks last.
    fn read(
        &mut self,
        loc: u64,
        wanted: impl FnOnce(&[u8], u64) -> bool,
    ) -> Option<(u64, Content)> {
        let slot = slot_of(loc)?;
        let len = self.index.read(slot, wanted)?.record.len;
        Some((len, self.disk.get(&slot)?.content))
    }

    /// Removes copy `c` if its location still holds it (see
    /// [`TierModel::take`]; a failed removal leaves it, as the node's
    /// `remove_copy` does, with a warning).
    fn remove_copy(&mut self, c: CopyRef, fails: impl FnOnce() -> bool) {
        if self.holds(c) {
            self.take(c.0, fails);
        }
    }

    /// The copy of `key` the tier holds, as a task sees it.
    fn held(&self, key: &[u8]) -> Option<(u64, task::Held)> {
        let l = self.lookup(key)?;
        let c = self.copy(l)?;
        Some((
            l,
            task::Held {
                len: c.record.len,
                sum: c.record.sum,
                version: c.record.version,
            },
        ))
    }

    /// Every index record goes to the device.
    fn flushed(&mut self) {
        for c in self.disk.values_mut() {
            c.durable = true;
        }
    }

    /// A crash: the records not on the device are lost (those writes are
    /// torn), and the index is what the real tier's recovery makes of the
    /// rest, newest write first.
    fn crash(&mut self) {
        self.disk.retain(|_, c| c.durable);
        let mut found: Vec<(u32, &OnDisk)> = self.disk.iter().map(|(&s, c)| (s, c)).collect();
        found.sort_by_key(|(_, c)| std::cmp::Reverse(c.record.seq));
        let mut index = Self::new_index();
        let dropped: Vec<u32> = found
            .into_iter()
            .filter(|(s, c)| index.recover(*s, Some(&c.key), c.record) != Found::Kept)
            .map(|(s, _)| s)
            .collect();
        index.recovered();
        for s in dropped {
            self.disk.remove(&s);
        }
        self.index = index;
    }
}

/// What the master has of a node again after a message: its DRAM segment
/// mounted, or its whole tier reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Back {
    Nothing,
    Dram,
    Tier,
}

pub struct NodeModel {
    pub idx: usize,
    pub up: bool,
    incarnation: u64,
    client_id: u64,
    host: String,
    dram_seg: SegmentId,
    dram_spec: SegmentSpec,
    dram: BTreeMap<u64, (u64, Content)>,
    tier: Option<TierModel>,
    write_through: bool,
    /// When to mount, report and ping: the node's own rules.
    lane: Lane,
    /// The control lane's call out: (request id, deadline, the copies a
    /// tier report names).
    ping: Option<(u64, u64, Vec<CopyRef>)>,
    /// Where the tier's round is (the node's own order of steps).
    steps: Steps,
    /// When the next round starts (the node's own pace, on the simulated
    /// clock as a `Duration` since zero).
    pace: Pace<Duration>,
    /// The tasks the round under way ran so far.
    round_tasks: usize,
    /// The round's call out: (request id, deadline).
    round: Option<(u64, u64)>,
    /// The reports of the round's tasks, until the master answered them.
    ran: Round<CopyRef>,
    /// The copies an `Evicted` report out names (place, write number),
    /// removed once it is answered.
    evicting: Vec<(u64, u64)>,
    /// The `Tasks` step's tasks not run yet.
    todo: VecDeque<NodeTask>,
    /// A Persist that found no room, while the `Evicted` report that makes
    /// room for it is out (the copies it names are in `evicting`): tried
    /// once more when it is answered or fails.
    making_room: Option<PersistTask>,
    /// A Fetch under way: its read of another node's replica.
    fetching: Option<Fetching>,
    /// Segments its reads could not reach (its client's engine's list).
    suspects: Suspects,
    /// The newest master term its gate has seen in a grant (this process's).
    term: AtomicU64,
}

/// A Fetch task's read (the transfer engine's read rules over the task's
/// replicas, under the node's `FETCH_DEADLINE`).
struct Fetching {
    task: FetchTask,
    read: ReplicaRead,
    /// The replica read out: its index, the read's id, its share.
    reading: Option<(usize, u64, Duration)>,
    /// Its deadline (sim ms).
    deadline: u64,
}

/// What running a task came to.
enum Ran {
    /// The update to report (if any), the copy's location and whether this
    /// task wrote it.
    Done(Option<(NvmeUpdate, Option<CopyRef>, bool)>),
    /// A Persist found no room: the node evicts [`PersistRule::room`]
    /// bytes for it, then tries once more (the real node's `persist`).
    NoRoom(PersistTask),
    /// A Fetch: its bytes are read from another node first.
    Fetch(FetchTask),
}

fn endpoint(i: usize) -> Endpoint {
    Endpoint {
        host: format!("10.0.0.{}", i + 1),
        port: 7300,
        nr_shards: 1,
    }
}

impl NodeModel {
    pub fn new(idx: usize, ctx: &mut Ctx) -> Self {
        let host = format!("host-{idx}");
        let has_tier = idx == 0 || ctx.rng.random_ratio(3, 4);
        let tier = has_tier.then(|| {
            let name = format!("nvme:{host}:/dev/nvme0");
            let seg = segment_id_for(&name);
            ctx.seg_node.insert(seg, idx);
            TierModel {
                seg,
                spec: SegmentSpec {
                    name,
                    size: 1 << 30,
                    endpoint: endpoint(idx),
                    slice_bytes: 0,
                    host_id: host.clone(),
                    tier: Tier::Nvme,
                    nvme: None,
                },
                index: TierModel::new_index(),
                disk: BTreeMap::new(),
                cfg: NvmeConfig {
                    high_watermark: TIER_HIGH,
                    low_watermark: TIER_LOW,
                    eviction: if idx.is_multiple_of(2) {
                        Eviction::Fifo
                    } else {
                        Eviction::Lru
                    },
                    ..NvmeConfig::default()
                },
            }
        });
        let mut n = Self {
            idx,
            up: false,
            incarnation: 0,
            client_id: 0,
            host,
            dram_seg: 0,
            dram_spec: SegmentSpec {
                name: String::new(),
                size: 0,
                endpoint: endpoint(idx),
                slice_bytes: 0,
                host_id: String::new(),
                tier: Tier::Dram,
                nvme: None,
            },
            dram: BTreeMap::new(),
            tier,
            write_through: ctx.rng.random_ratio(1, 3),
            lane: Lane::new(has_tier),
            ping: None,
            steps: Steps::default(),
            pace: Pace::new(Duration::from_millis(ROUND_MS)),
            round_tasks: 0,
            round: None,
            ran: Round::default(),
            evicting: Vec::new(),
            todo: VecDeque::new(),
            making_room: None,
            fetching: None,
            suspects: Suspects::default(),
            term: AtomicU64::new(0),
        };
        n.restart(ctx);
        n
    }

    fn me(&self) -> Addr {
        Addr::Node(self.idx)
    }

    /// The process dies: DRAM is gone, and so is every tier copy whose
    /// index record was not flushed.
    pub fn crash(&mut self, _ctx: &mut Ctx) {
        self.up = false;
        self.dram.clear();
        if let Some(t) = self.tier.as_mut() {
            t.crash();
        }
        self.ping = None;
        self.round = None;
        self.steps = Steps::default();
        self.todo.clear();
        self.making_room = None;
        self.evicting.clear();
        self.fetching = None;
    }

    /// A new process: a new client id and DRAM segment; the tier as the
    /// disk kept it.
    pub fn restart(&mut self, ctx: &mut Ctx) {
        self.up = true;
        self.incarnation += 1;
        self.client_id = ctx.rng.random::<u64>().max(1);
        let name = format!("{}:7300:{:016x}", self.host, ctx.rng.random::<u64>());
        self.dram_seg = segment_id_for(&name);
        ctx.seg_node.insert(self.dram_seg, self.idx);
        self.dram_spec = SegmentSpec {
            name,
            size: DRAM_BYTES,
            endpoint: endpoint(self.idx),
            slice_bytes: DRAM_BYTES,
            host_id: self.host.clone(),
            tier: Tier::Dram,
            nvme: self.tier.as_ref().map(|t| NvmeAttach {
                segment_id: t.seg,
                write_through: self.write_through,
            }),
        };
        self.dram.clear();
        self.term = AtomicU64::new(0);
        self.pace = Pace::new(Duration::from_millis(ROUND_MS));
        self.lane = Lane::new(self.tier.is_some());
        self.ping = None;
        self.round = None;
        self.steps = Steps::default();
        self.todo.clear();
        self.making_room = None;
        self.evicting.clear();
        self.fetching = None;
        let first = self.lane.tick();
        self.drive(first, ctx);
        let inc = self.incarnation;
        ctx.timer(self.me(), PING_MS, Timer::NodePing(inc));
        ctx.timer(self.me(), ROUND_MS, Timer::NodeRound(inc));
    }

    /// The node's gate on a data request ([`Ctx::admit`]).
    fn admit(&self, req: &DataRequest, ctx: &mut Ctx) -> Result<(), ErrorCode> {
        let gate = NodeGate {
            dram: self.dram_seg,
            nvme: self.tier.as_ref().map(|t| t.seg),
            term: &self.term,
        };
        ctx.admit(gate, req)
    }

    /// Whether this process serves DRAM segment `seg` (or has tier `seg`).
    pub fn serves(&self, seg: SegmentId) -> bool {
        self.up && (seg == self.dram_seg || self.tier.as_ref().is_some_and(|t| t.seg == seg))
    }

    /// The DRAM segment this process mounts.
    pub fn dram_segment(&self) -> SegmentId {
        self.dram_seg
    }

    pub fn tier_segment(&self) -> Option<SegmentId> {
        self.tier.as_ref().map(|t| t.seg)
    }

    /// What the DRAM range holds, when `seg` is this process's segment.
    pub fn dram_read(&self, seg: SegmentId, offset: u64, len: u64) -> Option<Content> {
        if !self.up || seg != self.dram_seg {
            return None;
        }
        Some(match self.dram.get(&offset) {
            Some(&(l, c)) if l == len => c,
            _ => None,
        })
    }

    fn dram_write(&mut self, offset: u64, len: u64, content: Content) {
        let end = offset + len.max(1);
        // Every range this write touches now holds bytes of no value,
        // unless it is exactly this range.
        let touched: Vec<u64> = self
            .dram
            .range(..end)
            .filter(|(&o, &(l, _))| o + l.max(1) > offset)
            .map(|(&o, _)| o)
            .collect();
        for o in touched {
            let (l, _) = self.dram[&o];
            self.dram.insert(o, (l, None));
        }
        self.dram.insert(offset, (len, content));
    }

    /// Whether the tier durably holds `key`'s copy at `loc`.
    pub fn tier_holds(&self, seg: SegmentId, loc: u64, key: &[u8]) -> bool {
        self.tier.as_ref().is_some_and(|t| {
            t.seg == seg
                && t.copy(loc).is_some_and(|c| &*c.key == key)
                && slot_of(loc).is_some_and(|s| t.disk.get(&s).is_some_and(|d| d.durable))
        })
    }

    /// The copy at `loc` as a reader gets it (the real tier checks the
    /// key in the slot's header).
    pub fn tier_content(&self, loc: u64, key: &[u8]) -> Content {
        let t = self.tier.as_ref()?;
        let d = t.disk.get(&slot_of(loc)?)?;
        if d.key != key {
            return None;
        }
        d.content
    }

    /// Tier copies marked evicting that nothing will free: neither named
    /// by the `Evicted` report out nor owed a release (a release that
    /// failed and was forgotten holds its space and its key until a
    /// restart).
    pub fn forgotten_marks(&self) -> Vec<u32> {
        let Some(t) = self.tier.as_ref().filter(|_| self.up) else {
            return Vec::new();
        };
        t.index
            .marked_not_owed()
            .filter(|&s| !self.evicting.iter().any(|&(l, _)| slot_of(l) == Some(s)))
            .collect()
    }

    pub fn open_deadline(&self) -> Option<u64> {
        [
            self.ping.as_ref().map(|p| p.1),
            self.round.as_ref().map(|r| r.1),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn call_ping(&mut self, ctx: &mut Ctx, req: MasterRequest, copies: Vec<CopyRef>) {
        let id = ctx.ask(self.me(), req);
        self.ping = Some((id, ctx.now + CLIENT_TIMEOUT_MS, copies));
        ctx.timer(self.me(), CLIENT_TIMEOUT_MS, Timer::NodeDeadline(id));
    }

    fn call_round(&mut self, ctx: &mut Ctx, req: MasterRequest) {
        let id = ctx.ask(self.me(), req);
        self.round = Some((id, ctx.now + CLIENT_TIMEOUT_MS));
        ctx.timer(self.me(), CLIENT_TIMEOUT_MS, Timer::NodeDeadline(id));
    }

    /// Makes the calls the control lane asks for, until one is out or it
    /// asks for none.
    fn drive(&mut self, mut next: Option<Ask>, ctx: &mut Ctx) {
        while let Some(ask) = next {
            let client_id = self.client_id;
            let req = match ask {
                Ask::MountDram => MasterRequest::MountSegment {
                    client_id,
                    spec: self.dram_spec.clone(),
                },
                Ask::MountTier => MasterRequest::MountSegment {
                    client_id,
                    spec: self
                        .tier
                        .as_ref()
                        .expect("the lane mounts a tier")
                        .spec
                        .clone(),
                },
                Ask::ReportTier => match self.report_all(ctx) {
                    Ok(Some((req, copies))) => {
                        self.call_ping(ctx, req, copies);
                        return;
                    }
                    // Nothing to report, or the flush failed.
                    Ok(None) => {
                        next = self.lane.answered(Outcome::Done);
                        continue;
                    }
                    Err(()) => {
                        next = self.lane.answered(Outcome::Failed);
                        continue;
                    }
                },
                Ask::Ping => {
                    let mut segments = vec![self.dram_seg];
                    segments.extend(self.tier.as_ref().map(|t| t.seg));
                    MasterRequest::Ping {
                        client_id,
                        segments,
                    }
                }
            };
            self.call_ping(ctx, req, Vec::new());
            return;
        }
    }

    /// The report of every copy (its index flushed first) and the copies it
    /// names; `None` when the tier holds none; `Err` when the flush failed.
    fn report_all(&mut self, ctx: &mut Ctx) -> Result<Option<(MasterRequest, Vec<CopyRef>)>, ()> {
        let t = self.tier.as_mut().expect("the lane reports a tier");
        if ctx.rng.random_bool(ctx.faults.disk_fail) {
            ctx.stats.disk_failures += 1;
            return Err(());
        }
        t.flushed();
        // Not the copies being evicted or removed (the real tier's
        // `entries`).
        let copies: Vec<CopyRef> = t
            .index
            .entries()
            .map(|(s, c)| (u64::from(s), c.record.seq))
            .collect();
        let updates: Vec<NvmeUpdate> = t
            .index
            .entries()
            .map(|(s, c)| NvmeUpdate::Recovered {
                key: c.key.to_vec(),
                nvme: t.seg,
                loc: u64::from(s),
                len: c.record.len,
                sum: c.record.sum,
                version: c.record.version,
            })
            .collect();
        if updates.is_empty() {
            return Ok(None);
        }
        let req = MasterRequest::NvmeUpdates {
            client_id: self.client_id,
            updates,
        };
        Ok(Some((req, copies)))
    }

    pub fn on_timer(&mut self, t: Timer, ctx: &mut Ctx) {
        match t {
            // The call timed out: its lane starts over on its next timer.
            Timer::NodeDeadline(id) => {
                if self.ping.as_ref().is_some_and(|p| p.0 == id) {
                    // It may or may not have landed: asked again (a tier
                    // mount or report stays owed).
                    self.ping = None;
                    self.lane.answered(Outcome::Failed);
                }
                if self.round.as_ref().is_some_and(|r| r.0 == id) {
                    self.round = None;
                    if self.making_room.is_some() {
                        // The eviction's report failed: the round goes on.
                        let e = KvError::new(ErrorCode::Timeout, "no answer by the deadline");
                        self.on_round_answer(Err(e), ctx);
                    } else {
                        // A failed `Evicted` report takes its marks back.
                        self.keep_marked();
                        self.steps.failed();
                        self.round_ended(None, ctx);
                    }
                }
            }
            Timer::NodePing(inc) if inc == self.incarnation && self.up => {
                ctx.timer(self.me(), PING_MS, Timer::NodePing(inc));
                let next = self.lane.tick();
                self.drive(next, ctx);
            }
            Timer::NodeRound(inc) if inc == self.incarnation && self.up => {
                // A node without a tier runs rounds for its Fetch tasks
                // (the real node's fetch loop) when hot objects are
                // replicated.
                if !self.lane.started() || (self.tier.is_none() && !ctx.hot) {
                    ctx.timer(self.me(), ROUND_MS, Timer::NodeRound(inc));
                    return;
                }
                // Rounds are paced one after another: none is under way.
                if let Some(first) = self.steps.tick(SHARDS) {
                    self.round_tasks = 0;
                    self.drive_round(Some(first), ctx);
                }
            }
            Timer::NodeReadShare(id) if self.up => {
                let Some(f) = self.fetching.as_mut() else {
                    return;
                };
                let Some((i, _, share)) = f.reading.filter(|r| r.1 == id) else {
                    return;
                };
                let e = ReplicaRead::share_passed(&f.task.from[i], share);
                if let Some(ran) = self.fetch_failed(i, e, ctx) {
                    self.ran_one(ran);
                    self.run_todo(ctx);
                }
            }
            _ => {}
        }
    }

    fn ask_tasks(&mut self, ctx: &mut Ctx, shard: u32) {
        let mut segments = vec![self.dram_seg];
        segments.extend(self.tier.as_ref().map(|t| t.seg));
        let req = MasterRequest::NodeTasks {
            client_id: self.client_id,
            shard,
            segments,
            max: round::TASKS_PER_STEP,
        };
        self.call_round(ctx, req);
    }

    /// Handles a message; what the master has of this node again by it.
    pub fn on_msg(&mut self, m: Msg, ctx: &mut Ctx) -> Back {
        match m.body {
            Body::Write { id, req, content } => {
                let res = self.admit(&req, ctx).map(|()| {
                    if let DataRequest::Write { offset, len, .. } = req {
                        self.dram_write(offset, len, content);
                    }
                    None
                });
                ctx.send(self.me(), m.from, Body::Data { id, res });
                Back::Nothing
            }
            Body::Read { id, req } => {
                let res = self.admit(&req, ctx).and_then(|()| match req {
                    DataRequest::Read {
                        segment_id,
                        offset,
                        len,
                        ..
                    } => self
                        .dram_read(segment_id, offset, len)
                        .ok_or(ErrorCode::SegmentNotFound),
                    DataRequest::ReadNvme {
                        loc, len, ref key, ..
                    } => {
                        // The node's rule (the key's copy only, at its
                        // length), not a copy being evicted (the real tier's
                        // mark: no new read gets it).
                        let rule = NvmeRead { key, len };
                        match self.tier.as_mut() {
                            Some(t) => {
                                if t.copy(loc).is_some_and(|c| *c.key != **key) {
                                    ctx.stats.nvme_reads_of_reused_slots += 1;
                                }
                                match t.read(loc, |k, v| rule.wants(k, v)) {
                                    Some((l, content)) => {
                                        rule.fits(l).map(|()| content).map_err(|e| e.code)
                                    }
                                    None => Err(ErrorCode::ObjectNotFound),
                                }
                            }
                            // As the node's `tier()`.
                            None => Err(ErrorCode::Unavailable),
                        }
                    }
                    _ => Err(ErrorCode::InvalidParams),
                });
                ctx.send(self.me(), m.from, Body::Data { id, res });
                Back::Nothing
            }
            Body::Data { id, res }
                if self
                    .fetching
                    .as_ref()
                    .and_then(|f| f.reading)
                    .is_some_and(|r| r.1 == id) =>
            {
                if let Some(ran) = self.fetch_read(res, ctx) {
                    self.ran_one(ran);
                    self.run_todo(ctx);
                }
                Back::Nothing
            }
            Body::Resp { id, res } => {
                if self.ping.as_ref().is_some_and(|p| p.0 == id) {
                    let (_, _, copies) = self.ping.take().expect("checked");
                    return self.on_ping_answer(copies, res, ctx);
                }
                if self.round.as_ref().is_some_and(|r| r.0 == id) {
                    self.round = None;
                    self.on_round_answer(res, ctx);
                }
                Back::Nothing
            }
            _ => Back::Nothing,
        }
    }

    /// The answer to the control lane's call: what the lane does next is
    /// the node's rule ([`Lane`]).
    fn on_ping_answer(
        &mut self,
        copies: Vec<CopyRef>,
        res: Result<MasterResponse, KvError>,
        ctx: &mut Ctx,
    ) -> Back {
        let asked = self.lane.out().expect("a control call is out");
        let (outcome, back) = match (asked, res) {
            (Ask::MountDram, Ok(MasterResponse::Mounted { .. })) => (Outcome::Done, Back::Dram),
            (Ask::MountTier, Ok(MasterResponse::Mounted { .. })) => (Outcome::Done, Back::Nothing),
            (Ask::ReportTier, Ok(MasterResponse::BatchDone(results))) => {
                // Copies the master refuses as stale go (if still there: a
                // round may have put another copy in the location); others
                // stay.
                let t = self.tier.as_mut().expect("reported a tier");
                for (&c, r) in copies.iter().zip(results) {
                    match r {
                        ItemResult::Ok(()) => ctx.stats.recovered += 1,
                        ItemResult::Err(e) if round::stale(&KvError::from(e.clone())) => {
                            t.remove_copy(c, || ctx.disk_fails());
                        }
                        ItemResult::Err(_) => {}
                    }
                }
                (Outcome::Done, Back::Tier)
            }
            (Ask::Ping, Ok(MasterResponse::Pong { unknown })) => (
                Outcome::Pong {
                    dram_unknown: unknown.contains(&self.dram_seg),
                    tier_unknown: self.tier.as_ref().is_some_and(|t| unknown.contains(&t.seg)),
                },
                Back::Nothing,
            ),
            _ => (Outcome::Failed, Back::Nothing),
        };
        let next = self.lane.answered(outcome);
        self.drive(next, ctx);
        back
    }

    /// A round ended, having run `ran` tasks (`None`: it failed): the next
    /// starts at the node's pace ([`Pace`]: at once after a busy round).
    fn round_ended(&mut self, ran: Option<usize>, ctx: &mut Ctx) {
        let (wait, _log) = self.pace.after(ran, Duration::from_millis(ctx.now));
        let inc = self.incarnation;
        ctx.timer(self.me(), wait.as_millis() as u64, Timer::NodeRound(inc));
    }

    /// Makes the calls the round's steps ask for, until one is out or the
    /// round is over (`next` is `None`: it ran every step).
    fn drive_round(&mut self, mut next: Option<Step>, ctx: &mut Ctx) {
        while let Some(step) = next {
            match step {
                Step::Tasks(shard) => return self.ask_tasks(ctx, shard),
                Step::Report(_) => {
                    let mut ran = std::mem::take(&mut self.ran);
                    self.flush(&mut ran, ctx);
                    let req = MasterRequest::NvmeUpdates {
                        client_id: self.client_id,
                        updates: ran.take_updates(),
                    };
                    self.ran = ran;
                    return self.call_round(ctx, req);
                }
                Step::Evict => match self.evict_pick(0, ctx) {
                    Some((req, locs)) => {
                        self.evicting = locs;
                        return self.call_round(ctx, req);
                    }
                    None => next = self.steps.done(false),
                },
            }
        }
        self.round_ended(Some(self.round_tasks), ctx);
    }

    /// The answer to the round's call out.
    fn on_round_answer(&mut self, res: Result<MasterResponse, KvError>, ctx: &mut Ctx) {
        if let Some(p) = self.making_room.take() {
            // The copies go once the master has their `Evicted`; without
            // an answer they stay (the real tier takes its marks back).
            if let Ok(MasterResponse::BatchDone(results)) = res {
                self.evicted(results, ctx);
            }
            self.keep_marked();
            let ran = self.persist(p, false, ctx);
            self.ran_one(ran);
            return self.run_todo(ctx);
        }
        let next = match (self.steps.out(), res) {
            (Some(Step::Tasks(_)), Ok(MasterResponse::Tasks(tasks))) => {
                self.round_tasks += tasks.len();
                self.ran = Round::default();
                self.todo = tasks.into();
                return self.run_todo(ctx);
            }
            (Some(Step::Report(_)), Ok(MasterResponse::BatchDone(results))) => {
                // The copies the master no longer wants (the node's rule),
                // each while its location still holds it.
                let results: Vec<Result<(), KvError>> =
                    results.into_iter().map(Result::from).collect();
                if let Some(t) = self.tier.as_mut() {
                    for c in self.ran.refused(&results) {
                        t.remove_copy(c, || ctx.disk_fails());
                    }
                }
                self.steps.done(false)
            }
            (Some(Step::Evict), Ok(MasterResponse::BatchDone(results))) => {
                self.evicted(results, ctx);
                self.steps.done(false)
            }
            // A failed call: the round ends, and the next starts over at
            // the node's pace (a failed `Evicted` report takes its marks
            // back).
            _ => {
                self.keep_marked();
                self.steps.failed();
                return self.round_ended(None, ctx);
            }
        };
        self.drive_round(next, ctx);
    }

    /// Runs the `Tasks` step's tasks in order until one needs room made
    /// (its `Evicted` report goes out) or none is left (the step is done).
    fn run_todo(&mut self, ctx: &mut Ctx) {
        while let Some(task) = self.todo.pop_front() {
            let ran = match self.run_task(task, ctx) {
                Ran::NoRoom(p) => match self.evict_pick(p.room(), ctx) {
                    Some((req, locs)) => {
                        ctx.stats.room_made += 1;
                        self.evicting = locs;
                        self.making_room = Some(p);
                        return self.call_round(ctx, req);
                    }
                    None => self.persist(p, false, ctx),
                },
                Ran::Fetch(f) => match self.fetch_start(f, ctx) {
                    Some(ran) => ran,
                    None => return,
                },
                done => done,
            };
            self.ran_one(ran);
        }
        let next = self.steps.done(!self.ran.is_empty());
        self.drive_round(next, ctx);
    }

    /// A task's report, into the round's.
    fn ran_one(&mut self, ran: Ran) {
        match ran {
            Ran::Done(Some((u, loc, new))) => self.ran.ran(u, loc, new),
            Ran::Done(None) => {}
            Ran::NoRoom(_) => unreachable!("a second try does not evict"),
            Ran::Fetch(_) => unreachable!("a fetch ends in its report"),
        }
    }

    /// The copies an `Evicted` report named that did not go stay (their
    /// marks taken back, as the real tier's `keep`).
    fn keep_marked(&mut self) {
        let marked = std::mem::take(&mut self.evicting);
        if let Some(t) = self.tier.as_mut() {
            for s in marked.into_iter().filter_map(|(l, _)| slot_of(l)) {
                t.index.keep(s);
            }
        }
    }

    /// The master answered the `Evicted` report out: the copies it took
    /// go, those it refused stay (as the real node's `evict_region`).
    fn evicted(&mut self, results: Vec<ItemResult<()>>, ctx: &mut Ctx) {
        let t = self.tier.as_mut().expect("a tier evicts");
        let mut n = 0;
        let mut results = results.into_iter();
        for (l, seq) in std::mem::take(&mut self.evicting) {
            // Only a copy the master answered Ok for goes; the others stay
            // readable and are candidates again (the marks taken back).
            if results
                .next()
                .is_some_and(|r| Result::<(), KvError>::from(r).is_ok())
            {
                // Only that copy, still marked (the real tier's `release`):
                // a slot that no longer holds it has nothing to release. A
                // removal that fails leaves the copy marked: unread,
                // unreported, its release owed to the next eviction.
                let marked = slot_of(l)
                    .and_then(|s| t.index.copy(s))
                    .is_some_and(|c| c.evicting && c.record.seq == seq);
                if marked && !t.take(l, || ctx.disk_fails()) {
                    if let Some(s) = slot_of(l) {
                        t.index.owe_release(s);
                    }
                }
                n += 1;
            } else if let Some(s) = slot_of(l) {
                t.index.keep(s);
            }
        }
        match t.cfg.eviction {
            Eviction::Fifo => ctx.stats.fifo_evictions += n,
            Eviction::Lru => ctx.stats.lru_evictions += n,
        }
    }

    /// The tier's eviction past its watermark, or of `need` bytes a write
    /// did not find free, the real tier's rules: first the owed releases
    /// (as the real node's `evict_region`), then how many bytes, and which
    /// copies in its order: the `Evicted` report, and the copies it names.
    fn evict_pick(&mut self, need: u64, ctx: &mut Ctx) -> Option<(MasterRequest, Vec<(u64, u64)>)> {
        let t = self.tier.as_mut()?;
        // No await between taking them and their removal here: each still
        // holds its copy (the real node checks again, after its awaits).
        for (s, _) in t.index.owed_releases() {
            if t.take(u64::from(s), || ctx.disk_fails()) {
                ctx.stats.owed_releases_done += 1;
            } else {
                t.index.owe_release(s);
            }
        }
        let want = t.cfg.bytes_to_evict(t.index.space(), need);
        let pick: Vec<(u64, Vec<u8>, u64, u64)> = t
            .index
            .mark_victims(t.cfg.eviction, want)
            .into_iter()
            .filter_map(|s| {
                let c = t.index.copy(s)?;
                Some((u64::from(s), c.key.to_vec(), c.record.version, c.record.seq))
            })
            .collect();
        if pick.is_empty() {
            return None;
        }
        let updates = pick
            .iter()
            .map(|(loc, key, version, _)| NvmeUpdate::Evicted {
                key: key.clone(),
                nvme: t.seg,
                loc: *loc,
                version: *version,
            })
            .collect();
        let req = MasterRequest::NvmeUpdates {
            client_id: self.client_id,
            updates,
        };
        Some((
            req,
            pick.into_iter().map(|(l, _, _, seq)| (l, seq)).collect(),
        ))
    }

    /// The index records of this round's copies go to the device before
    /// the master hears of them; what a failed flush or a copy gone from
    /// its place means for the reports is the node's rule ([`Round`]).
    fn flush(&mut self, round: &mut Round<CopyRef>, ctx: &mut Ctx) {
        // Without a tier (Fetch reports only) there is nothing to flush.
        let Some(t) = self.tier.as_mut() else {
            return;
        };
        let ok = !ctx.rng.random_bool(ctx.faults.disk_fail);
        if ok {
            t.flushed();
        } else {
            ctx.stats.disk_failures += 1;
        }
        // A copy no longer in its place after the flush, failed or not, is
        // not reported (`flush_written` looks the key up: same location,
        // same copy); a failed flush loses the round's fresh copies.
        let check = round.stored(|_| true);
        let present: Vec<bool> = check
            .iter()
            .map(|(_, key, c)| t.lookup(key) == Some(c.0) && t.holds(*c))
            .collect();
        for c in round.flushed(|_| true, ok, &check, &present) {
            t.remove_copy(c, || ctx.disk_fails());
        }
    }

    /// Runs one task; the update to report, the copy's location and
    /// whether this task wrote it. What a task does with the copies it
    /// finds is the node's own rule ([`task`]); the I/O is the simulated
    /// disk's.
    fn run_task(&mut self, task: NodeTask, ctx: &mut Ctx) -> Ran {
        ctx.note(format!("node {} runs {}", self.idx, short_task(&task)));
        let Some(job) = task::job(task, self.dram_seg) else {
            return Ran::Done(None);
        };
        Ran::Done(match job {
            task::Job::Persist(p) => return self.persist(p, true, ctx),
            task::Job::Promote(p) => {
                let t = self.tier.as_mut().expect("tasks come to a tier");
                let copy = t.read(p.loc, |key, version| p.reads(key, version));
                let ok = match copy {
                    None => false,
                    Some((len, c)) => {
                        let refused = p.target(self.dram_seg).and_then(|()| {
                            p.check(len, DRAM_BYTES, || sum_of(c))
                                .map_err(|r| p.error(r))
                        });
                        if refused.is_err() {
                            false
                        } else {
                            // Into this node's own memory at that offset.
                            self.dram_write(p.offset, p.len, c);
                            ctx.stats.promoted += 1;
                            true
                        }
                    }
                };
                Some((p.promoted(ok), None, false))
            }
            task::Job::Drop(d) => {
                let t = self.tier.as_mut().expect("tasks come to a tier");
                if t.copy(d.loc)
                    .is_some_and(|c| d.takes(&c.key, c.record.version))
                {
                    // A failed removal keeps the copy (the node logs it).
                    t.take(d.loc, || ctx.disk_fails());
                }
                None
            }
            task::Job::Fetch(f) => return Ran::Fetch(f),
        })
    }

    /// A Persist on the simulated disk: the DRAM bytes checked and written
    /// unless that very copy is there (the node's rule, [`PersistRule`]).
    /// With no room and `may_evict`, [`Ran::NoRoom`] (the node evicts, then
    /// calls this again without it).
    fn persist(&mut self, p: PersistTask, may_evict: bool, ctx: &mut Ctx) -> Ran {
        let content = self.dram_read(p.dram, p.offset, p.len).flatten();
        let sum = sum_of(content);
        let t = self.tier.as_mut().expect("tasks come to a tier");
        let (loc, fresh) = match p.decide(sum, t.held(&p.key)) {
            Err(_) => return Ran::Done(Some((p.failed(), None, false))),
            Ok(task::Write::Found(l)) => (t.copy_ref(l).expect("held"), false),
            Ok(task::Write::Write { replace }) => {
                // The old copy goes first; failing, the Persist fails.
                if let Some(old) = replace {
                    if !t.take(old, || ctx.disk_fails()) {
                        return Ran::Done(Some((p.failed(), None, false)));
                    }
                }
                let fails = || ctx.rng.random_bool(ctx.faults.disk_fail);
                match t.write(&p.key, (p.len, sum, p.version), content, fails) {
                    Ok(Some(c)) => (c, true),
                    Ok(None) => {
                        ctx.stats.disk_failures += 1;
                        return Ran::Done(Some((p.failed(), None, false)));
                    }
                    // A copy of the key being evicted: the real tier
                    // refuses the write.
                    Err(Refused::KeyStored) => return Ran::Done(Some((p.failed(), None, false))),
                    Err(Refused::NoSlot | Refused::NoExtent) => {
                        ctx.stats.tier_full += 1;
                        if may_evict {
                            return Ran::NoRoom(p);
                        }
                        return Ran::Done(Some((p.failed(), None, false)));
                    }
                }
            }
        };
        ctx.stats.stored += 1;
        let seg = t.seg;
        Ran::Done(Some((p.stored(seg, loc.0, sum), Some(loc), fresh)))
    }

    /// A Fetch task: refused (the node's rule, [`FetchRule::target`]) or
    /// its first replica read sent; `Some` when it is over at once.
    fn fetch_start(&mut self, f: FetchTask, ctx: &mut Ctx) -> Option<Ran> {
        if f.target(self.dram_seg, DRAM_BYTES).is_err() {
            ctx.stats.hot_fetches_failed += 1;
            return Some(Ran::Done(Some((f.promoted(false), None, false))));
        }
        let prefer = Prefer {
            shm: false,
            host_id: &self.host,
        };
        let read = ReplicaRead::new(&f.from, f.len, prefer, &self.suspects, at(ctx))
            .expect("target() checked the replicas");
        self.fetching = Some(Fetching {
            task: f,
            read,
            reading: None,
            deadline: ctx.now + FETCH_DEADLINE.as_millis() as u64,
        });
        self.fetch_next(ctx)
    }

    /// Reads the replica the read rules name next; `Some` when the fetch
    /// is over (failed: no replica left, or no time).
    fn fetch_next(&mut self, ctx: &mut Ctx) -> Option<Ran> {
        let f = self.fetching.as_mut().expect("a fetch under way");
        let left = Duration::from_millis(f.deadline).saturating_sub(at(ctx));
        let (i, share, timed) = match f.read.next(left) {
            read_rules::Step::Try {
                index,
                share,
                timed,
                ..
            } => (index, share, timed),
            read_rules::Step::Failed(_) => {
                let f = self.fetching.take().expect("checked");
                ctx.stats.hot_fetches_failed += 1;
                return Some(Ran::Done(Some((f.task.promoted(false), None, false))));
            }
        };
        let id = match ctx.send_read(
            Addr::Node(self.idx),
            &f.task.from[i],
            &f.task.key,
            Duration::ZERO,
        ) {
            Ok(id) => id,
            Err(e) => return self.fetch_failed(i, e, ctx),
        };
        f.reading = Some((i, id, share));
        // The read's share, or what is left of the fetch's time: a read
        // with no answer by then has failed.
        let wait = if timed { share } else { left };
        let ms = wait.as_millis().try_into().unwrap_or(u64::MAX).max(1);
        ctx.timer(self.me(), ms, Timer::NodeReadShare(id));
        None
    }

    /// Replica `i` failed with `e` (its node noted when it could not be
    /// reached); the next one is tried.
    fn fetch_failed(&mut self, i: usize, e: KvError, ctx: &mut Ctx) -> Option<Ran> {
        let f = self.fetching.as_mut().expect("a fetch under way");
        f.reading = None;
        self.suspects.note(f.task.from[i].segment_id, &e, at(ctx));
        f.read.failed(e);
        self.fetch_next(ctx)
    }

    /// The answer to the fetch's read: the bytes go into this node's range
    /// only if they are the object's ([`FetchRule::check`]; the engine's
    /// check of the replica's checksum too: the next replica else).
    fn fetch_read(&mut self, res: Result<Content, ErrorCode>, ctx: &mut Ctx) -> Option<Ran> {
        let f = self.fetching.as_mut().expect("checked");
        let (i, _, _) = f.reading.take().expect("checked");
        let checked = res
            .map_err(|code| KvError::new(code, "the replica's node refused the read"))
            .and_then(|c| f.task.check(sum_of(c)).map(|()| c));
        match checked {
            Ok(content) => {
                let f = self.fetching.take().expect("checked");
                self.dram_write(f.task.offset, f.task.len, content);
                ctx.stats.hot_fetches += 1;
                Some(Ran::Done(Some((f.task.promoted(true), None, false))))
            }
            Err(e) => self.fetch_failed(i, e, ctx),
        }
    }
}

fn short_task(t: &NodeTask) -> String {
    let key = |k: &[u8]| String::from_utf8_lossy(k).into_owned();
    match t {
        NodeTask::Persist(p) => format!(
            "Persist {} from {} demote {}",
            key(&p.key),
            p.offset,
            p.demote
        ),
        NodeTask::Promote(p) => format!("Promote {} loc {} to {}", key(&p.key), p.loc, p.offset),
        NodeTask::Drop(d) => format!("Drop {} loc {}", key(&d.key), d.loc),
        NodeTask::Fetch(f) => format!("Fetch {} to {}", key(&f.key), f.offset),
    }
}

/// The simulated clock as the read rules take it.
fn at(ctx: &Ctx) -> Duration {
    Duration::from_millis(ctx.now)
}
