//! One master shard's metadata, as a pure state machine.
//!
//! No I/O and no clock: every call that depends on time takes `now_ms`, so
//! the same code runs under the live service and under tests with a simulated
//! clock. A shard owns the keys that hash to it and one range of every mounted
//! segment (`[size*s/n, size*(s+1)/n)` for shard `s` of `n`), with its own
//! allocator: an allocation never leaves the shard.
//!
//! Object lifecycle:
//!
//! ```text
//!  PutStart --> Processing --PutEnd--> Complete --Remove/evict--> gone
//!                   |  \--PutRevoke (writer) --> gone,
//!                   \---- stale (put_timeout) or writer dead --> gone,
//!                         space quarantined for stale_put_grace (all three)
//!  PutEnd/PutRevoke name the placement (`put_id`): a late one of an earlier
//!  placement of the key does not touch a later one.
//!  Complete: GetReplicaList extends the read lease; space of a removed
//!  object is freed only when its lease has ended (forced removal defers it).
//!
//!  Replace (PutStart with `replace` of a complete key): the new object is
//!  Processing beside the complete one, which readers still get; its PutEnd
//!  retires the old object as a forced Remove would and puts the new one in
//!  its place in the same step; a revoked or stale replace leaves the old.
//! ```
//!
//! Objects are stored once, in [`super::objects::Objects`]: a slab with a
//! table of complete objects and one of puts in flight (so the housekeeping
//! sweep for stale puts scans only puts in flight, not the whole pool; a key
//! is in both only while a replace of it is Processing), and per DRAM range
//! an index of the replicas eviction may take, in eviction order.
//!
//! Eviction runs off the request path: a put that takes a range past
//! `high_watermark` owes the range an episode (`eviction_ratio` of it), which
//! the driver pays in bounded steps ([`ShardState::evict_step`]) between
//! requests. Only a put that finds no room evicts in its own call, and only
//! until it fits (at most the ratio); the rest of the ratio is owed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use kvpool_storage::alloc::RangeAllocator;
use kvpool_storage::segment::SEGMENT_ALIGN;
use kvpool_transport::auth::{ClusterKey, Grant, GrantOp};
use kvpool_transport::proto::{
    ClientId, ItemResult, MasterRequest, MasterResponse, NodeTask, NvmeUpdate, ObjectInfo, PutItem,
    PutOptions, ReplicaDesc, SegmentId, SegmentSpec, Tier,
};
use kvpool_transport::{ErrorCode, KvError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smallvec::SmallVec;

use super::journal::{self, Hold, Image, ObjectRec};
use super::objects::{
    Complete, Id, KeyHashBuilder, Object, Objects, Phase, Processing, Replica, ReplicaState,
};

use kvpool_config::{MasterConfig, Placement};

/// What one shard enforces, sized from the config at start.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    pub max_key_bytes: usize,
    pub max_value_bytes: u64,
    /// Objects this shard may hold (the pool's `max_keys` split over shards).
    pub max_keys: u64,
    pub lease_ttl_ms: u64,
    pub put_timeout_ms: u64,
    pub stale_put_grace_ms: u64,
    pub high_watermark: f64,
    pub eviction_ratio: f64,
    pub placement: Placement,
    /// Reads of an NVMe-only object after which it is copied back to DRAM
    /// (0: never).
    pub promote_after_reads: u16,
    /// How long an NVMe tier this shard does not list yet may go without a
    /// report before it is listed (`client_ttl_ms`: a node silent that long
    /// is dead anyway).
    pub tier_quiet_ms: u64,
}

/// A segment's queue of node tasks, with an index of the Drops in it: a
/// `Recovered` report asks whether its copy's Drop is queued, and a node
/// that reports its whole tier again asks that for every copy, so it is one
/// lookup, not a scan of up to [`MAX_TASKS_PER_SEGMENT`] tasks per copy.
#[derive(Debug, Default)]
pub(crate) struct TaskQueue {
    q: VecDeque<NodeTask>,
    /// (key, loc) of each queued Drop, and how many such Drops wait.
    drops: HashMap<(Vec<u8>, u64), u32>,
}

impl TaskQueue {
    pub fn len(&self) -> usize {
        self.q.len()
    }

    pub fn push_back(&mut self, t: NodeTask) {
        self.index(&t);
        self.q.push_back(t);
    }

    /// Queues `t` before every task waiting.
    pub fn push_front(&mut self, t: NodeTask) {
        self.index(&t);
        self.q.push_front(t);
    }

    /// Counts `t` in the index of Drops, if it is one.
    fn index(&mut self, t: &NodeTask) {
        if let NodeTask::Drop { key, loc } = t {
            *self.drops.entry((key.clone(), *loc)).or_default() += 1;
        }
    }

    pub fn pop_front(&mut self) -> Option<NodeTask> {
        let t = self.q.pop_front()?;
        if let NodeTask::Drop { key, loc } = &t {
            let k = (key.clone(), *loc);
            match self.drops.get_mut(&k) {
                Some(n) if *n > 1 => *n -= 1,
                _ => {
                    self.drops.remove(&k);
                }
            }
        }
        Some(t)
    }

    /// Whether a Drop of the copy of `key` at `loc` waits in the queue.
    pub fn has_drop(&self, key: &[u8], loc: u64) -> bool {
        !self.drops.is_empty() && self.drops.contains_key(&(key.to_vec(), loc))
    }
}

/// Tasks queued for one segment's node, at most.
pub const MAX_TASKS_PER_SEGMENT: usize = 16_384;

/// A copy on an NVMe tier: (key, packed location).
type CopyAt = (Box<[u8]>, u64);

/// What a copy an NVMe tier reports is to the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unlisted {
    /// An object lists it.
    Listed,
    /// Of a tier not listed yet: taken on its word.
    Adopted,
    /// Its object's when its tier was unmounted as dead, and still.
    Detached,
    /// An old copy: refused.
    Old,
}

/// Copies one shard remembers of NVMe tiers unmounted as dead, at most:
/// beyond that, such a tier's copies are refused when it comes back (lost
/// from the cache, never stale).
pub const MAX_DETACHED_COPIES: usize = 262_144;

/// Recovered replicas not back yet: (segment, offset).
type Waiting = SmallVec<[(SegmentId, u64); 2]>;

/// A Drop owed (true) or settled (false): (owed, tier, key, location).
type DropRecord = (bool, SegmentId, Box<[u8]>, u64);

/// How long a Drop handed out to a node is remembered: the node runs it in
/// the round it fetched it in, but may report the copy (`Recovered`, from a
/// report of its whole tier running beside its task rounds) meanwhile.
const SENT_DROP_MS: u64 = 10_000;

/// The Drops one NVMe tier's node is owed (removed or replaced objects'
/// copies), and those handed out lately: the node may report such a copy
/// (`Recovered`) after it was handed the Drop and before it ran it.
#[derive(Debug, Default)]
struct TierDrops {
    owed: HashSet<CopyAt>,
    /// Handed out, until when remembered ([`SENT_DROP_MS`]); at most
    /// [`MAX_TASKS_PER_SEGMENT`], oldest first in `sent_order`.
    sent: HashMap<CopyAt, u64>,
    sent_order: VecDeque<(CopyAt, u64)>,
}

impl TierDrops {
    fn is_dropped(&self, c: &CopyAt, now_ms: u64) -> bool {
        self.owed.contains(c) || self.sent.get(c).is_some_and(|&until| until > now_ms)
    }

    /// The Drop of `c` went out at `now_ms`: remembered a while. Whether it
    /// was owed.
    fn sent(&mut self, c: CopyAt, now_ms: u64) -> bool {
        let owed = self.owed.remove(&c);
        let until = now_ms.saturating_add(SENT_DROP_MS);
        self.sent.insert(c.clone(), until);
        self.sent_order.push_back((c, until));
        while let Some((old, at)) = self.sent_order.front() {
            if self.sent_order.len() <= MAX_TASKS_PER_SEGMENT && *at > now_ms {
                break;
            }
            // Only the newest sending of a copy forgets it.
            if self.sent.get(old) == Some(at) {
                self.sent.remove(old);
            }
            self.sent_order.pop_front();
        }
        owed
    }

    /// `c` is an object's copy again: forgotten. Whether it was owed.
    fn forget(&mut self, c: &CopyAt) -> bool {
        self.sent.remove(c);
        self.owed.remove(c)
    }

    fn is_empty(&self) -> bool {
        self.owed.is_empty() && self.sent.is_empty()
    }
}

/// Signs data-plane grants (when the cluster has a secret).
#[derive(Debug, Clone)]
pub struct GrantSigner {
    pub key: ClusterKey,
    /// Unix time (ms) at `now_ms == 0` of the clock the state is driven by:
    /// grants expire in Unix time, which storage nodes can check.
    pub unix_at_zero_ms: u64,
}

impl GrantSigner {
    fn sign(&self, op: GrantOp, r: &ReplicaDesc, expires_now_ms: u64, term: u64) -> Grant {
        self.key.grant(
            op,
            r.segment_id,
            (r.offset, r.len),
            self.unix_at_zero_ms.saturating_add(expires_now_ms),
            term,
        )
    }
}

/// What a list of replica descriptors is for: which grants it carries.
#[derive(Debug, Clone, Copy)]
enum Access {
    /// The admin view: no grants.
    Describe,
    /// PutStart: write grants until `until_ms`.
    Write { until_ms: u64 },
    /// GetReplicaList: read grants until `until_ms` (the lease's end).
    Read { until_ms: u64 },
}

impl ShardConfig {
    pub fn from_master(cfg: &MasterConfig, nr_shards: u32) -> Self {
        Self {
            max_key_bytes: cfg.max_key_bytes,
            max_value_bytes: cfg.max_value_bytes.get(),
            max_keys: cfg.max_keys.div_ceil(nr_shards as u64),
            lease_ttl_ms: cfg.lease_ttl_ms,
            put_timeout_ms: cfg.put_timeout_ms,
            stale_put_grace_ms: cfg.stale_put_grace_ms,
            high_watermark: cfg.high_watermark,
            eviction_ratio: cfg.eviction_ratio,
            placement: cfg.placement,
            promote_after_reads: cfg.promote_after_reads,
            tier_quiet_ms: cfg.client_ttl_ms,
        }
    }
}

/// A segment as one shard sees it: its spec and this shard's range of it.
#[derive(Debug)]
struct SegmentSlot {
    id: SegmentId,
    spec: Arc<SegmentSpec>,
    /// DRAM: this shard's range. NVMe: empty (the node manages that space).
    alloc: RangeAllocator,
    draining: bool,
    /// The client (storage node) that mounted it: only it may report on it
    /// or take its tasks.
    owner: ClientId,
    /// A client could not reach its node: no new replicas go there until the
    /// owner's next ping.
    suspect: bool,
    /// Bytes of this segment's `Demoting` replicas (space on its way out),
    /// kept as they change so a put need not count them.
    demoting: u64,
    /// Bytes the off-path eviction still owes this range (an episode under
    /// way; 0: none).
    evict_owed: u64,
}

impl SegmentSlot {
    fn tier(&self) -> Tier {
        self.spec.tier
    }
}

/// Debug builds check the space invariants after every tick of a shard
/// with at most this many objects (the check is O(objects)).
#[cfg(debug_assertions)]
const DEBUG_CHECK_MAX_KEYS: u64 = 100_000;

/// Replicas one eviction step takes at most (`ShardState::evict_step`): the
/// longest the shard's off-path eviction holds it before serving requests
/// again.
pub const EVICT_STEP_VICTIMS: usize = 64;

/// Space to free once `at_ms` has passed (lease or quarantine).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct PendingFree {
    at_ms: u64,
    segment: SegmentId,
    slot: u32,
    offset: u64,
    size: u64,
}

/// What a shard reports for `Stat`.
#[derive(Debug, Clone, Default)]
pub struct ShardStat {
    pub keys: u64,
    /// (segment, capacity of this shard's range, used in it)
    pub segments: Vec<(SegmentId, u64, u64)>,
    pub evictions: u64,
    pub evicted_bytes: u64,
    pub demotions: u64,
    pub promotions: u64,
}

/// What one housekeeping pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TickReport {
    pub stale_discarded: u64,
    pub freed_bytes: u64,
    /// Puts placed with fewer replicas than they asked for (too few
    /// segments with room) since the last tick.
    pub fewer_replicas: u64,
}

/// One master shard's state.
#[derive(Debug)]
pub struct ShardState {
    shard: u32,
    nr_shards: u32,
    cfg: ShardConfig,
    slots: Vec<Option<SegmentSlot>>,
    by_id: HashMap<SegmentId, u32>,
    objs: Objects,
    pending: BinaryHeap<Reverse<PendingFree>>,
    rng: ChaCha8Rng,
    evictions: u64,
    evicted_bytes: u64,
    /// Puts placed with fewer replicas than asked since the last tick.
    fewer_replicas: u64,
    /// Work for storage nodes, by the segment whose node does it.
    tasks: HashMap<SegmentId, TaskQueue>,
    /// The NVMe copies (key, location) of removed or replaced objects whose
    /// Drop has not gone out to their node yet, by tier. Kept apart from the
    /// task queues, which go with their DRAM segment: a node that comes back
    /// (or a restarted master, from its state directory) is owed them still,
    /// and a `Recovered` report of such a copy is refused.
    owed_drops: HashMap<SegmentId, TierDrops>,
    /// NVMe tiers every live copy of which this shard lists (an object's
    /// replica, a copy detached with its tier, or one owed a Drop): a copy
    /// such a tier reports that none of these names is an old one (its
    /// object removed or replaced, its Drop lost with the node or handed out
    /// before a restart) and is refused. Recorded (`TierListed`).
    listed_tiers: HashSet<SegmentId>,
    /// NVMe tiers mounted that this shard does not list yet (new to it, or
    /// any tier after a restart without a state directory): the copies they
    /// report are taken as they come, until `tier_quiet_ms` passed with no
    /// report (the `now_ms` here); then the tier is listed.
    adopting: HashMap<SegmentId, u64>,
    /// Copies on listed tiers unmounted as dead (their node was cut off):
    /// the master forgot them as replicas, but a tier that comes back may
    /// report them and they are taken, unless their object was removed or
    /// replaced since (then they are owed a Drop). By tier, then key.
    detached: HashMap<SegmentId, HashMap<Box<[u8]>, u64>>,
    /// Copies in `detached`.
    detached_len: usize,
    demotions: u64,
    promotions: u64,
    /// Signs data-plane grants; `None` in an open cluster.
    signer: Option<GrantSigner>,
    /// The leader term grants carry (HA: set by the election, read at each
    /// signing; 0 without one). Shared with the master's fence.
    term: Arc<AtomicU64>,
    /// What the state directory needs (`None`: the master keeps no state
    /// directory).
    durable: Option<Box<Durable>>,
}

/// A shard's side of the state directory: the clock's wall time, the holds
/// to record, and what recovery brought back that waits for its segments.
#[derive(Debug, Default)]
struct Durable {
    /// Unix time (ms) at `now_ms == 0`: holds outlive the process, so they
    /// are recorded in wall time.
    unix_at_zero_ms: u64,
    /// Space handed to a writer (or a node) or kept for a reader, to record.
    holds: Vec<Hold>,
    /// Scratch for the keys taken from the object store.
    keys: Vec<Box<[u8]>>,
    /// Recovered replicas whose segments have not mounted again, by key.
    parked: HashMap<Box<[u8]>, Parked>,
    /// Recovered holds on segments that have not mounted again.
    parked_holds: HashMap<SegmentId, Vec<Hold>>,
    /// When replicas still parked are given up (`now_ms` clock), as an
    /// unmount would drop them.
    parked_until_ms: u64,
    /// Drops owed (true) or settled (false) since the last records, to
    /// record: (tier, key, location).
    drops: Vec<DropRecord>,
    /// Recovered replicas, still waiting for their segments, of objects
    /// removed or replaced since: a tier among those segments is owed a
    /// Drop of them when it mounts.
    removed_parked: HashMap<Box<[u8]>, Waiting>,
    /// Segments the recovered state names (replicas, holds) that have not
    /// mounted since: until `parked_until_ms`, a put that finds no room
    /// waits for them (`TryAgain`) instead of hearing `NoSpace`.
    expected: HashSet<SegmentId>,
    /// Tiers listed since the last records, to record.
    listed: Vec<SegmentId>,
}

/// A recovered object some of whose replicas wait for their segments.
#[derive(Debug)]
struct Parked {
    size: u64,
    sum: Option<u64>,
    hard_pin: bool,
    /// (segment, offset) of the replicas not back yet.
    waiting: SmallVec<[(SegmentId, u64); 2]>,
    /// Some replica came back: the object is in the store (and if it is
    /// not any more, it was removed since, and these go too).
    attached: bool,
}

/// Appends the record of a recovered object none of whose replicas is back.
fn encode_parked(key: &[u8], p: &Parked, out: &mut Vec<u8>) {
    journal::encode_object(
        out,
        key,
        p.size,
        p.sum,
        p.hard_pin,
        p.waiting.iter().copied(),
    );
}

/// Where a snapshot of a shard has got to (see [`ShardState::snapshot_step`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct SnapshotCursor {
    next_id: u32,
    done: bool,
}

fn err(code: ErrorCode, msg: impl Into<String>) -> KvError {
    KvError::new(code, msg)
}

fn not_found(key: &[u8]) -> KvError {
    err(
        ErrorCode::ObjectNotFound,
        format!("no object {}", show_key(key)),
    )
}

pub use kvpool_transport::proto::show_key;

/// The readable replicas of `obj` as clients need them (DRAM first, then
/// NVMe; replicas still being filled by a promotion are left out), with the
/// object's checksum and, when the cluster has a secret, the grants `access`
/// asks for.
fn describe(
    slots: &[Option<SegmentSlot>],
    obj: &Object,
    signer: Option<&GrantSigner>,
    access: Access,
    term: u64,
) -> Vec<ReplicaDesc> {
    let mut v: Vec<ReplicaDesc> = obj
        .replicas
        .iter()
        .filter(|r| r.state != ReplicaState::Promoting)
        .map(|r| {
            let slot = slots[r.slot as usize]
                .as_ref()
                .expect("replicas only point at mounted slots");
            let mut d = ReplicaDesc {
                segment_id: slot.id,
                endpoint: slot.spec.endpoint.clone(),
                slice_bytes: slot.spec.slice_bytes,
                host_id: slot.spec.host_id.clone(),
                offset: r.offset,
                len: obj.size,
                tier: slot.tier(),
                checksum: obj.checksum(),
                grant: Grant::default(),
            };
            if let Some(s) = signer {
                d.grant = match (access, d.tier) {
                    (Access::Describe, _) => Grant::default(),
                    (Access::Write { until_ms }, _) => s.sign(GrantOp::Write, &d, until_ms, term),
                    (Access::Read { until_ms }, Tier::Dram) => {
                        s.sign(GrantOp::Read, &d, until_ms, term)
                    }
                    (Access::Read { until_ms }, Tier::Nvme) => {
                        s.sign(GrantOp::ReadNvme, &d, until_ms, term)
                    }
                };
            } else {
                // An open cluster: no signature, but the term still fences
                // a deposed leader's grants at the nodes.
                d.grant.term = term;
            }
            d
        })
        .collect();
    v.sort_by_key(|r| r.tier == Tier::Nvme);
    v
}

/// The space a demotion frees: the object's extent as segments round it.
fn demoting_extent(size: u64) -> u64 {
    size.max(1).next_multiple_of(SEGMENT_ALIGN)
}

/// Whether `obj` has a readable NVMe replica.
fn has_nvme(slots: &[Option<SegmentSlot>], obj: &Object) -> bool {
    obj.replicas.iter().any(|r| {
        r.state != ReplicaState::Promoting
            && slots[r.slot as usize]
                .as_ref()
                .is_some_and(|s| s.tier() == Tier::Nvme)
    })
}

impl ShardState {
    pub fn new(shard: u32, nr_shards: u32, cfg: ShardConfig, seed: u64) -> Self {
        assert!(shard < nr_shards);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (shard as u64).wrapping_mul(0x9e37_79b9));
        let hash = KeyHashBuilder::with_seed(rng.random());
        Self {
            shard,
            nr_shards,
            cfg,
            slots: Vec::new(),
            by_id: HashMap::new(),
            objs: Objects::new(hash),
            pending: BinaryHeap::new(),
            rng,
            evictions: 0,
            evicted_bytes: 0,
            fewer_replicas: 0,
            tasks: HashMap::new(),
            owed_drops: HashMap::new(),
            listed_tiers: HashSet::new(),
            adopting: HashMap::new(),
            detached: HashMap::new(),
            detached_len: 0,
            demotions: 0,
            promotions: 0,
            signer: None,
            term: Arc::new(AtomicU64::new(0)),
            durable: None,
        }
    }

    /// Records durable changes from now on, for [`Self::take_records`];
    /// `unix_at_zero_ms` is the wall time (ms) at `now_ms == 0`.
    pub fn with_durability(mut self, unix_at_zero_ms: u64) -> Self {
        self.objs.track_changes();
        self.durable = Some(Box::new(Durable {
            unix_at_zero_ms,
            ..Durable::default()
        }));
        self
    }

    /// Whether this shard records durable changes.
    pub fn is_durable(&self) -> bool {
        self.durable.is_some()
    }

    /// Takes the state directory's image back (at start, before any
    /// request): each object waits for its segments to mount again, and is
    /// readable from the first that does; what has not come back by
    /// `now_ms + wait_ms` is dropped as an unmount drops it. Space held at
    /// the crash (a put's grant, a leased removal) stays held until its
    /// time when its segment mounts.
    pub fn recover(&mut self, image: Image, now_ms: u64, wait_ms: u64) {
        let d = self
            .durable
            .as_mut()
            .expect("recover needs with_durability");
        let now_unix = d.unix_at_zero_ms.saturating_add(now_ms);
        d.parked_until_ms = now_ms.saturating_add(wait_ms);
        for (key, o) in image.objects {
            d.expected.extend(o.replicas.iter().map(|r| r.0));
            d.parked.insert(
                key.into_boxed_slice(),
                Parked {
                    size: o.size,
                    sum: o.sum,
                    hard_pin: o.hard_pin,
                    waiting: o.replicas.into_iter().collect(),
                    attached: false,
                },
            );
        }
        for h in image.holds {
            if h.until_unix_ms > now_unix {
                d.expected.insert(h.segment);
                d.parked_holds.entry(h.segment).or_default().push(h);
            }
        }
        self.listed_tiers.extend(image.listed_tiers);
        for (nvme, key, loc) in image.drops {
            self.owed_drops
                .entry(nvme)
                .or_default()
                .owed
                .insert((key.into_boxed_slice(), loc));
        }
    }

    /// Recovered objects still waiting for a segment (all their replicas,
    /// or some).
    pub fn parked_len(&self) -> usize {
        self.durable.as_ref().map_or(0, |d| d.parked.len())
    }

    /// A hold until `until_ms` on a DRAM replica's space, to record.
    fn hold(&mut self, slot: u32, offset: u64, size: u64, until_ms: u64) {
        let Some(d) = self.durable.as_mut() else {
            return;
        };
        let Some(Some(s)) = self.slots.get(slot as usize) else {
            return;
        };
        if s.tier() != Tier::Dram {
            return;
        }
        d.holds.push(Hold {
            segment: s.id,
            offset,
            len: s.alloc.rounded(size),
            until_unix_ms: d.unix_at_zero_ms.saturating_add(until_ms),
        });
    }

    /// How long a writer or a node may still write into space it was
    /// handed at `now_ms`: the put's deadline and the quarantine after it.
    fn write_hold_until(&self, now_ms: u64) -> u64 {
        now_ms
            .saturating_add(self.cfg.put_timeout_ms)
            .saturating_add(self.cfg.stale_put_grace_ms)
    }

    /// Appends to `out` the records of every durable change since the last
    /// call: the whole state of each key whose complete object changed,
    /// then the holds. The caller writes them to the log before it answers
    /// the requests that made them.
    pub fn take_records(&mut self, out: &mut Vec<u8>) {
        let Some(mut d) = self.durable.take() else {
            return;
        };
        // Drops first: a write the crash tore keeps a removal's DropOwed
        // rather than its Gone (an owed Drop of a copy the object still
        // lists is stale, and skipped), never the Gone without the DropOwed
        // (the copy would come back).
        for (owed, nvme, key, loc) in d.drops.drain(..) {
            journal::encode_drop(out, owed, nvme, &key, loc);
        }
        for nvme in d.listed.drain(..) {
            journal::encode_tier_listed(out, nvme);
        }
        self.objs.take_dirty(&mut d.keys);
        let mut keys = std::mem::take(&mut d.keys);
        for key in keys.drain(..) {
            self.encode_key(&mut d, &key, out);
        }
        d.keys = keys;
        for h in d.holds.drain(..) {
            journal::encode_hold(out, &h);
        }
        self.durable = Some(d);
    }

    /// The record of `key` as it stands.
    fn encode_key(&self, d: &mut Durable, key: &[u8], out: &mut Vec<u8>) {
        let parked = d.parked.get(key);
        if let Some(id) = self.objs.complete_id(key) {
            // An object whose only replica is a promotion still being
            // copied in (its NVMe copy evicted meanwhile) has nothing a
            // restart could read: it is recorded as gone.
            if !self.encode_complete(key, self.objs.get(id), parked, out) {
                journal::encode_gone(out, key);
            }
            return;
        }
        match parked {
            Some(p) if !p.attached && !p.waiting.is_empty() => encode_parked(key, p, out),
            _ => {
                // Removed (or evicted, or lost with its segments) since:
                // what still waited goes with it.
                d.parked.remove(key);
                journal::encode_gone(out, key);
            }
        }
    }

    /// The replicas of `o` a restart could read: its readable ones, and
    /// those recovered that still wait for their segment.
    fn durable_replicas(
        &self,
        o: &Object,
        parked: Option<&Parked>,
    ) -> SmallVec<[(SegmentId, u64); 2]> {
        o.replicas
            .iter()
            .filter(|r| r.state != ReplicaState::Promoting)
            .map(|r| (self.slot(r.slot).id, r.offset))
            .chain(parked.into_iter().flat_map(|p| p.waiting.iter().copied()))
            .collect()
    }

    /// Appends the record of complete object `o` under `key`; false (and
    /// nothing appended) when it has no replica a restart could read.
    fn encode_complete(
        &self,
        key: &[u8],
        o: &Object,
        parked: Option<&Parked>,
        out: &mut Vec<u8>,
    ) -> bool {
        let replicas = self.durable_replicas(o, parked);
        if replicas.is_empty() {
            return false;
        }
        journal::encode_object(
            out,
            key,
            o.size,
            o.checksum(),
            o.hard_pinned(),
            replicas.into_iter(),
        );
        true
    }

    /// Segment `id` mounted in slot `idx`: the recovered replicas on it are
    /// taken back (their space allocated again, their objects readable),
    /// then the recovered holds on it.
    fn attach_parked(&mut self, idx: u32, id: SegmentId, now_ms: u64) {
        let Some(mut d) = self.durable.take() else {
            return;
        };
        d.expected.remove(&id);
        let keys: Vec<Box<[u8]>> = d
            .parked
            .iter()
            .filter(|(_, p)| p.waiting.iter().any(|w| w.0 == id))
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let p = d.parked.get_mut(&key).expect("listed");
            let pos = p.waiting.iter().position(|w| w.0 == id).expect("listed");
            let (_, offset) = p.waiting.remove(pos);
            let (size, sum, hard_pin) = (p.size, p.sum, p.hard_pin);
            let taken = match self.slot(idx).tier() {
                Tier::Dram => {
                    let (lo, len) = (self.slot(idx).alloc.base(), self.slot(idx).alloc.capacity());
                    offset >= lo
                        && offset.saturating_add(size) <= lo + len
                        && self.slot_mut(idx).alloc.alloc_at(offset, size)
                }
                Tier::Nvme => self.check_loc(idx, offset).is_ok(),
            };
            let attached =
                taken && self.attach_replica(&key, idx, offset, size, sum, hard_pin, now_ms);
            if taken && !attached && self.slot(idx).tier() == Tier::Dram {
                self.slot_mut(idx).alloc.dealloc(offset, size);
            }
            if !attached {
                tracing::warn!(
                    key = %show_key(&key),
                    segment = format!("{id:016x}"),
                    offset,
                    "a recovered replica does not fit its segment as it mounted again: dropped"
                );
            }
            let p = d.parked.get_mut(&key).expect("listed");
            p.attached |= attached;
            // The record of this key no longer names the replica.
            self.objs.mark_dirty(&key);
            if p.waiting.is_empty() {
                d.parked.remove(&key);
            }
        }
        // Recovered copies on this tier of objects removed while they
        // waited: owed a Drop now (recorded with the next records).
        let mut drops = Vec::new();
        if self.slot(idx).tier() == Tier::Nvme && !d.removed_parked.is_empty() {
            d.removed_parked.retain(|key, waiting| {
                waiting.retain(|&mut (seg, loc)| {
                    if seg == id {
                        drops.push((key.clone(), loc));
                    }
                    seg != id
                });
                !waiting.is_empty()
            });
        }
        if let Some(holds) = d.parked_holds.remove(&id) {
            if self.slot(idx).tier() == Tier::Dram {
                for h in holds {
                    let at_ms = h.until_unix_ms.saturating_sub(d.unix_at_zero_ms);
                    if at_ms <= now_ms {
                        continue;
                    }
                    for (offset, size) in
                        self.slot_mut(idx).alloc.alloc_free_within(h.offset, h.len)
                    {
                        self.pending.push(Reverse(PendingFree {
                            at_ms,
                            segment: id,
                            slot: idx,
                            offset,
                            size,
                        }));
                        d.holds.push(Hold {
                            segment: id,
                            offset,
                            len: size,
                            until_unix_ms: h.until_unix_ms,
                        });
                    }
                }
            }
        }
        self.durable = Some(d);
        // First: the removals came before any task the node has waiting
        // (a put of the key since, whose copy the Drop must not take).
        for (key, loc) in drops {
            self.owe_and_queue_drop(id, &key, loc, true);
        }
    }

    /// Gives recovered object `key` a replica in slot `idx` (space taken);
    /// false when another object holds the key now.
    #[allow(clippy::too_many_arguments)]
    fn attach_replica(
        &mut self,
        key: &[u8],
        idx: u32,
        offset: u64,
        size: u64,
        sum: Option<u64>,
        hard_pin: bool,
        now_ms: u64,
    ) -> bool {
        if let Some(cid) = self.objs.complete_id(key) {
            let o = self.objs.get(cid);
            if o.size != size || o.checksum() != sum || o.replicas.iter().any(|r| r.slot == idx) {
                return false;
            }
            self.objs
                .update(cid, |o| o.replicas.push(Replica::ready(idx, offset)));
            return true;
        }
        if self.objs.processing_id(key).is_some() || !self.objs.has_room() {
            return false;
        }
        // Readers may hold leases the restarted master never saw: the
        // object counts as leased for one lease from now.
        self.objs.insert(
            key,
            Object {
                size,
                phase: Phase::Complete(Complete {
                    lease_end_ms: now_ms.saturating_add(self.cfg.lease_ttl_ms),
                    unread: false,
                    pin_end_ms: 0,
                    sum: sum.unwrap_or(0),
                    has_sum: sum.is_some(),
                    hard_pin,
                    nvme_reads: 0,
                }),
                replicas: smallvec::smallvec![Replica::ready(idx, offset)],
            },
        );
        true
    }

    /// Gives up the recovered replicas whose segments did not come back in
    /// time, as an unmount would.
    fn expire_parked(&mut self, now_ms: u64) {
        let Some(d) = self.durable.as_mut() else {
            return;
        };
        if (d.parked.is_empty() && d.parked_holds.is_empty() && d.removed_parked.is_empty())
            || now_ms < d.parked_until_ms
        {
            return;
        }
        d.removed_parked.clear();
        tracing::warn!(
            shard = self.shard,
            objects = d.parked.len(),
            "recovered replicas whose segments did not mount again in time: dropped"
        );
        d.parked_holds.clear();
        let parked: Vec<(Box<[u8]>, Parked)> = d.parked.drain().collect();
        for (k, p) in parked {
            self.objs.mark_dirty(&k);
            // A listed tier that comes back later still has these copies:
            // taken then, unless their object was removed or replaced.
            for (seg, loc) in p.waiting {
                self.detach(seg, &k, loc);
            }
        }
    }

    /// Whether `key` is a recovered object none of whose replicas is back.
    fn parked_only(&self, key: &[u8]) -> bool {
        self.durable
            .as_ref()
            .is_some_and(|d| d.parked.get(key).is_some_and(|p| !p.attached))
    }

    fn recovering(key: &[u8]) -> KvError {
        err(
            ErrorCode::ReplicaNotReady,
            format!(
                "key {} is being recovered: its segments have not mounted again yet",
                show_key(key)
            ),
        )
    }

    /// Appends to `out` the next part of a snapshot of this shard's durable
    /// state (at most `budget` objects); returns whether it is complete.
    /// The state may change between steps: each key's record is its state
    /// at some time after the log was rotated, and the new log, replayed
    /// over the snapshot, ends in the state as it is.
    pub fn snapshot_step(
        &self,
        cur: &mut SnapshotCursor,
        budget: usize,
        out: &mut Vec<u8>,
    ) -> bool {
        let Some(d) = self.durable.as_ref() else {
            return true;
        };
        if cur.done {
            return true;
        }
        let end = self.objs.slab_len();
        let mut n = 0;
        while (cur.next_id as usize) < end && n < budget {
            let id = cur.next_id;
            cur.next_id += 1;
            let Some((key, o)) = self.objs.entry_at(id) else {
                continue;
            };
            n += 1;
            match o.phase {
                Phase::Complete(_) => {
                    self.encode_complete(key, o, d.parked.get(key), out);
                }
                Phase::Processing(ref p) => {
                    let until = self.write_hold_until(p.started_ms);
                    for r in &o.replicas {
                        self.encode_hold(d, r.slot, r.offset, o.size, until, out);
                    }
                }
            }
            // A promotion's range is written by a node.
            for r in o
                .replicas
                .iter()
                .filter(|r| r.state == ReplicaState::Promoting)
            {
                let until = self.write_hold_until(o.complete().map_or(0, |c| c.lease_end_ms));
                self.encode_hold(d, r.slot, r.offset, o.size, until, out);
            }
        }
        if (cur.next_id as usize) < end {
            return false;
        }
        for (key, p) in &d.parked {
            if !p.attached && !p.waiting.is_empty() {
                encode_parked(key, p, out);
            }
        }
        for h in d.parked_holds.values().flatten() {
            journal::encode_hold(out, h);
        }
        for (&nvme, t) in &self.owed_drops {
            for (key, loc) in &t.owed {
                journal::encode_drop(out, true, nvme, key, *loc);
            }
        }
        for &nvme in &self.listed_tiers {
            journal::encode_tier_listed(out, nvme);
        }
        for Reverse(p) in &self.pending {
            if let Some(Some(s)) = self.slots.get(p.slot as usize) {
                if s.id == p.segment {
                    journal::encode_hold(
                        out,
                        &Hold {
                            segment: p.segment,
                            offset: p.offset,
                            len: s.alloc.rounded(p.size),
                            until_unix_ms: d.unix_at_zero_ms.saturating_add(p.at_ms),
                        },
                    );
                }
            }
        }
        cur.done = true;
        true
    }

    fn encode_hold(
        &self,
        d: &Durable,
        slot: u32,
        offset: u64,
        size: u64,
        until_ms: u64,
        out: &mut Vec<u8>,
    ) {
        let s = self.slot(slot);
        if s.tier() == Tier::Dram {
            journal::encode_hold(
                out,
                &Hold {
                    segment: s.id,
                    offset,
                    len: s.alloc.rounded(size),
                    until_unix_ms: d.unix_at_zero_ms.saturating_add(until_ms),
                },
            );
        }
    }

    /// The durable state as the state directory would record it: every
    /// complete object (with the replicas still waiting for their
    /// segments) and every recovered one not back yet. For tests.
    pub fn durable_image(&self) -> HashMap<Vec<u8>, ObjectRec> {
        let mut m = HashMap::new();
        let d = self.durable.as_deref();
        for id in self.objs.complete_ids() {
            let key = self.objs.key(id);
            let o = self.objs.get(id);
            let mut replicas = self
                .durable_replicas(o, d.and_then(|d| d.parked.get(key)))
                .to_vec();
            if replicas.is_empty() {
                continue;
            }
            replicas.sort_unstable();
            m.insert(
                key.to_vec(),
                ObjectRec {
                    size: o.size,
                    sum: o.checksum(),
                    hard_pin: o.hard_pinned(),
                    replicas,
                },
            );
        }
        for (key, p) in d.iter().flat_map(|d| d.parked.iter()) {
            if !p.attached {
                let mut replicas: Vec<_> = p.waiting.to_vec();
                replicas.sort_unstable();
                m.insert(
                    key.to_vec(),
                    ObjectRec {
                        size: p.size,
                        sum: p.sum,
                        hard_pin: p.hard_pin,
                        replicas,
                    },
                );
            }
        }
        m
    }

    /// Reads the term its grants carry from `term` (the fence's cell).
    pub fn with_term(mut self, term: Arc<AtomicU64>) -> Self {
        self.term = term;
        self
    }

    fn term(&self) -> u64 {
        self.term.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Signs data-plane grants with `signer` from now on (a cluster secret).
    pub fn with_signer(mut self, signer: Option<GrantSigner>) -> Self {
        self.signer = signer;
        self
    }

    pub fn key_count(&self) -> u64 {
        (self.objs.complete_len() + self.objs.processing_len()) as u64
    }

    /// This shard's range of a segment of `size` bytes.
    pub fn range_of(&self, size: u64) -> (u64, u64) {
        let lo = (size as u128 * self.shard as u128 / self.nr_shards as u128) as u64;
        let hi = (size as u128 * (self.shard as u128 + 1) / self.nr_shards as u128) as u64;
        (lo, hi - lo)
    }

    // ---- segments ---------------------------------------------------------

    /// Adds a segment (idempotent for the same id; a known NVMe tier that
    /// mounts again after its node restarted gets its new address and owner).
    pub fn add_segment(
        &mut self,
        id: SegmentId,
        spec: Arc<SegmentSpec>,
        owner: ClientId,
        now_ms: u64,
    ) {
        if let Some(&idx) = self.by_id.get(&id) {
            if let Some(slot) = self.slots[idx as usize].as_mut() {
                slot.spec = spec;
                slot.owner = owner;
                slot.suspect = false;
            }
            return;
        }
        let alloc = match spec.tier {
            Tier::Dram => {
                let (lo, len) = self.range_of(spec.size);
                RangeAllocator::new(lo, len, SEGMENT_ALIGN)
            }
            // The node manages NVMe space; the master only records replicas.
            Tier::Nvme => RangeAllocator::new(0, 0, SEGMENT_ALIGN),
        };
        let slot = SegmentSlot {
            id,
            alloc,
            spec,
            draining: false,
            owner,
            suspect: false,
            demoting: 0,
            evict_owed: 0,
        };
        let dram = slot.tier() == Tier::Dram;
        // A put is a use: where eviction drops the only copy (no NVMe
        // tier), an unread object ranks as if read at its completion.
        let keep_ms = if slot.spec.nvme.is_none() {
            self.cfg.lease_ttl_ms
        } else {
            0
        };
        let idx = match self.slots.iter().position(Option::is_none) {
            Some(i) => {
                self.slots[i] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        if dram {
            self.objs.mount_range(idx as u32, keep_ms);
        } else if !self.listed_tiers.contains(&id) {
            self.adopting
                .insert(id, now_ms.saturating_add(self.cfg.tier_quiet_ms));
        }
        self.by_id.insert(id, idx as u32);
        self.attach_parked(idx as u32, id, now_ms);
        self.queue_owed_drops(id);
    }

    /// Queues for the node of DRAM segment `dram` the Drops its NVMe tier is
    /// owed and that are not in its queue (its node came back with a new
    /// DRAM segment, or the master restarted): first, before any task the
    /// mount leads to.
    fn queue_owed_drops(&mut self, dram: SegmentId) {
        let Some(&idx) = self.by_id.get(&dram) else {
            return;
        };
        let Some(nvme) = self.slot(idx).spec.nvme.as_ref().map(|a| a.segment_id) else {
            return;
        };
        let Some(owed) = self.owed_drops.get(&nvme) else {
            return;
        };
        let q = self.tasks.entry(dram).or_default();
        for (key, loc) in &owed.owed {
            if q.len() >= MAX_TASKS_PER_SEGMENT {
                break; // the rest go out at the node's next mount
            }
            if !q.has_drop(key, *loc) {
                q.push_front(NodeTask::Drop {
                    key: key.to_vec(),
                    loc: *loc,
                });
            }
        }
    }

    /// Records that `nvme`'s copy of `key` at `loc` is owed a Drop; false
    /// when the tier is owed its maximum already.
    fn owe_drop(&mut self, nvme: SegmentId, key: &[u8], loc: u64) -> bool {
        let t = self.owed_drops.entry(nvme).or_default();
        if t.owed.len() >= MAX_TASKS_PER_SEGMENT {
            return false;
        }
        if t.owed.insert((key.into(), loc)) {
            if let Some(d) = self.durable.as_mut() {
                d.drops.push((true, nvme, key.into(), loc));
            }
        }
        true
    }

    /// `nvme`'s copy of `key` at `loc` is owed no Drop any more: it went out
    /// to the node (`sent` at that time: remembered a while, the node may
    /// report the copy before it runs the Drop), or the copy is an object's
    /// again.
    fn settle_drop(&mut self, nvme: SegmentId, key: &[u8], loc: u64, sent: Option<u64>) {
        let Some(t) = self.owed_drops.get_mut(&nvme) else {
            return;
        };
        let c: CopyAt = (key.into(), loc);
        let was_owed = match sent {
            Some(now_ms) => t.sent(c, now_ms),
            None => t.forget(&c),
        };
        if t.is_empty() {
            self.owed_drops.remove(&nvme);
        }
        if was_owed {
            if let Some(d) = self.durable.as_mut() {
                d.drops.push((false, nvme, key.into(), loc));
            }
        }
    }

    /// Removes a segment and every replica on it; objects left with no replica
    /// are removed. Returns how many objects went. Idempotent. O(objects).
    pub fn remove_segment(&mut self, id: SegmentId) -> u64 {
        let Some(idx) = self.by_id.remove(&id) else {
            return 0;
        };
        let mut gone = 0;
        // A tier that may come back: what it holds is remembered, and from
        // then on only that (a tier still adopted is listed now: copies it
        // had not reported yet are lost when it comes back, but a key
        // removed while it was away does not return).
        let detach = self.slot(idx).tier() == Tier::Nvme;
        if detach {
            self.list_tier(id);
        }
        for oid in self.objs.ids_with_replica_in(idx) {
            if detach {
                let key: Box<[u8]> = self.objs.key(oid).into();
                let locs: SmallVec<[u64; 2]> = self
                    .objs
                    .get(oid)
                    .replicas
                    .iter()
                    .filter(|r| r.slot == idx)
                    .map(|r| r.offset)
                    .collect();
                for loc in locs {
                    self.detach(id, &key, loc);
                }
            }
            let left = self.objs.update(oid, |o| {
                o.replicas.retain(|r| r.slot != idx);
                o.replicas.len()
            });
            if left == 0 {
                self.objs.remove(oid);
                gone += 1;
            }
        }
        self.objs.unmount_range(idx);
        self.slots[idx as usize] = None;
        self.tasks.remove(&id);
        // Extents that waited to be freed go with the mount: the same
        // segment mounted again (a node declared dead that joins again) has
        // a fresh allocator that never handed them out.
        self.pending.retain(|p| p.0.slot != idx);
        gone
    }

    /// Marks a segment suspect (a client could not reach its node) or clears
    /// the mark (its owner pinged): placement skips suspect segments.
    pub fn set_suspect(&mut self, id: SegmentId, suspect: bool) {
        if let Some(&idx) = self.by_id.get(&id) {
            if let Some(s) = self.slots[idx as usize].as_mut() {
                s.suspect = suspect;
            }
        }
    }

    /// Marks a segment draining: its replicas stay readable, no new puts go
    /// there. Returns false for an unknown segment.
    pub fn drain_segment(&mut self, id: SegmentId) -> bool {
        match self.by_id.get(&id) {
            Some(&idx) => {
                if let Some(s) = self.slots[idx as usize].as_mut() {
                    s.draining = true;
                }
                true
            }
            None => false,
        }
    }

    fn slot(&self, idx: u32) -> &SegmentSlot {
        self.slots[idx as usize]
            .as_ref()
            .expect("replicas only point at mounted slots")
    }

    fn slot_mut(&mut self, idx: u32) -> &mut SegmentSlot {
        self.slots[idx as usize]
            .as_mut()
            .expect("replicas only point at mounted slots")
    }

    // ---- space ------------------------------------------------------------

    /// A demotion's DRAM replica `r` (already taken off its object) is
    /// evicted: counted, and its space freed once the object's read lease
    /// (`lease_end`) is over, since a reader may still be copying it (the
    /// node is done with it: it reported).
    fn evict_dram_replica(&mut self, r: Replica, size: u64, lease_end: u64, now_ms: u64) {
        self.evictions += 1;
        self.evicted_bytes += demoting_extent(size);
        self.free_replica_at(&r, size, lease_end, now_ms);
    }

    /// Frees one replica's DRAM space (NVMe space is the node's).
    fn free_replica_now(&mut self, r: &Replica, size: u64) {
        let slot = self.slot_mut(r.slot);
        if slot.tier() == Tier::Dram {
            slot.alloc.dealloc(r.offset, size);
        }
    }

    /// Frees one replica's DRAM space at `at_ms` (now, if that has passed).
    fn free_replica_at(&mut self, r: &Replica, size: u64, at_ms: u64, now_ms: u64) {
        if at_ms <= now_ms {
            self.free_replica_now(r, size);
            return;
        }
        let slot = self.slot(r.slot);
        if slot.tier() == Tier::Dram {
            let segment = slot.id;
            self.hold(r.slot, r.offset, size, at_ms);
            self.pending.push(Reverse(PendingFree {
                at_ms,
                segment,
                slot: r.slot,
                offset: r.offset,
                size,
            }));
        }
    }

    /// The DRAM segment the NVMe tier `nvme` is attached to (its node's
    /// task queue), if it is mounted.
    fn dram_of_tier(&self, nvme: SegmentId) -> Option<SegmentId> {
        self.slots.iter().flatten().find_map(|d| {
            d.spec
                .nvme
                .as_ref()
                .is_some_and(|a| a.segment_id == nvme)
                .then_some(d.id)
        })
    }

    /// Whether `key`'s copy at `loc` of tier `nvme` is owed a Drop, or was
    /// handed one lately: that copy's object was removed or replaced.
    fn drop_owed(&self, nvme: SegmentId, key: &[u8], loc: u64, now_ms: u64) -> bool {
        self.owed_drops
            .get(&nvme)
            .is_some_and(|t| t.is_dropped(&(Box::<[u8]>::from(key), loc), now_ms))
    }

    /// Tells the nodes holding NVMe copies of a removed object to drop them.
    /// NVMe space is the node's: without this a copy would outlive its
    /// object, until NVMe eviction, and come back as `Recovered` when the
    /// node restarts. The task goes on the queue of the DRAM segment the
    /// tier is attached to, behind that node's Persist tasks, so the node
    /// sees the removal and a later put of the same key in the order they
    /// happened. The copy is owed its Drop until it goes out (`owed_drops`,
    /// recorded in the state directory): a node whose DRAM segment is gone
    /// meanwhile gets it when it mounts one again. With the tier owed its
    /// maximum, or that queue full, the copy stays (logged).
    fn drop_nvme_copies(&mut self, key: &[u8], obj: &Object) {
        for r in &obj.replicas {
            let s = self.slot(r.slot);
            if s.tier() == Tier::Nvme {
                self.owe_and_queue_drop(s.id, key, r.offset, false);
            }
        }
    }

    /// Owes tier `nvme`'s node a Drop of `key`'s copy at `loc` and queues it
    /// for the node's DRAM segment, if one is mounted (else it goes out at
    /// the node's next mount); `first`: before every task waiting (the
    /// removal it stands for came before them).
    fn owe_and_queue_drop(&mut self, nvme: SegmentId, key: &[u8], loc: u64, first: bool) {
        if !self.owe_drop(nvme, key, loc) {
            tracing::warn!(
                key = %show_key(key),
                "NVMe tier owed its maximum of Drops: the removed object's NVMe copy stays \
                 until evicted"
            );
            return;
        }
        let Some(dram) = self.dram_of_tier(nvme) else {
            return; // the node's DRAM segment is gone: it is asked at its next mount
        };
        let q = self.tasks.entry(dram).or_default();
        if q.len() < MAX_TASKS_PER_SEGMENT {
            let t = NodeTask::Drop {
                key: key.to_vec(),
                loc,
            };
            if first {
                q.push_front(t);
            } else {
                q.push_back(t);
            }
        } else {
            tracing::warn!(
                key = %show_key(key),
                "node task queue full: the removed object's Drop goes out when its node mounts \
                 again"
            );
        }
    }

    /// What a copy of `key` at `loc` that tier `nvme` reports and that no
    /// object lists is: `Adopted` while the tier is not listed yet (its
    /// report keeps it so for `tier_quiet_ms` more), `Detached` when it was
    /// detached with its tier and its object has been neither removed nor
    /// replaced since, else `Old`.
    fn unlisted_copy(&mut self, nvme: SegmentId, key: &[u8], loc: u64, now_ms: u64) -> Unlisted {
        if !self.listed_tiers.contains(&nvme) {
            let next = now_ms.saturating_add(self.cfg.tier_quiet_ms);
            let until = self.adopting.entry(nvme).or_insert(next);
            if now_ms < *until {
                *until = next;
                return Unlisted::Adopted;
            }
            self.list_tier(nvme);
        }
        let Some(t) = self.detached.get_mut(&nvme) else {
            return Unlisted::Old;
        };
        let Some(at) = t.remove(key) else {
            return Unlisted::Old;
        };
        self.detached_len -= 1;
        if t.is_empty() {
            self.detached.remove(&nvme);
        }
        if at == loc {
            Unlisted::Detached
        } else {
            Unlisted::Old
        }
    }

    /// From now on every live copy of tier `nvme` is one this shard lists.
    fn list_tier(&mut self, nvme: SegmentId) {
        self.adopting.remove(&nvme);
        if self.listed_tiers.insert(nvme) {
            if let Some(d) = self.durable.as_mut() {
                d.listed.push(nvme);
            }
            tracing::info!(
                shard = self.shard,
                tier = format!("{nvme:016x}"),
                "NVMe tier listed: a copy it reports that no object lists is refused"
            );
        }
    }

    /// Remembers `key`'s copy at `loc` of listed tier `nvme`, which the
    /// shard no longer counts as a replica (the tier is unmounted).
    fn detach(&mut self, nvme: SegmentId, key: &[u8], loc: u64) {
        if !self.listed_tiers.contains(&nvme) {
            return; // not a listed tier (or not a tier): it adopts on return
        }
        if self.detached_len >= MAX_DETACHED_COPIES {
            tracing::warn!(
                key = %show_key(key),
                "too many copies on tiers unmounted as dead: this one is refused if its tier \
                 comes back"
            );
            return;
        }
        if self
            .detached
            .entry(nvme)
            .or_default()
            .insert(key.into(), loc)
            .is_none()
        {
            self.detached_len += 1;
        }
    }

    /// `key`'s object was removed or replaced: its copies on tiers unmounted
    /// as dead are owed a Drop (refused if their tier reports them).
    fn retire_detached(&mut self, key: &[u8]) {
        if self.detached.is_empty() {
            return;
        }
        let mut owed = Vec::new();
        self.detached.retain(|&nvme, t| {
            if let Some(loc) = t.remove(key) {
                owed.push((nvme, loc));
            }
            !t.is_empty()
        });
        self.detached_len -= owed.len();
        for (nvme, loc) in owed {
            self.owe_and_queue_drop(nvme, key, loc, true);
        }
    }

    /// The recovered replicas of `key` still waiting for their segments
    /// belong to an object removed or replaced now: those on an NVMe tier
    /// are owed a Drop when the tier mounts again (until then nothing says
    /// which waiting segments are tiers).
    fn retire_parked(&mut self, key: &[u8]) {
        self.retire_detached(key);
        let Some(d) = self.durable.as_mut() else {
            return;
        };
        if let Some(p) = d.parked.remove(key) {
            if !p.waiting.is_empty() {
                d.removed_parked.insert(key.into(), p.waiting);
            }
        }
    }

    /// Whether a node may still be copying replica `r` of an object (which
    /// has an NVMe copy already if `on_nvme`): out to NVMe (a demotion, or
    /// the write-through copy asked for at PutEnd of an object that has no
    /// NVMe copy yet) or in from NVMe (a promotion).
    fn node_may_copy(&self, r: &Replica, on_nvme: bool) -> bool {
        match r.state {
            ReplicaState::Demoting | ReplicaState::Promoting => true,
            ReplicaState::Ready => {
                !on_nvme
                    && self
                        .slot(r.slot)
                        .spec
                        .nvme
                        .as_ref()
                        .is_some_and(|a| a.write_through)
            }
        }
    }

    /// Frees `obj`'s space at `at_ms` (now, if that has passed). A replica
    /// that a node may still be copying (`node_may_copy`) waits at least
    /// `stale_put_grace_ms`: the node reads or writes the range without
    /// asking the master, so no writer may be sent to it meanwhile.
    fn free_at(&mut self, obj: &Object, at_ms: u64, now_ms: u64) {
        let on_nvme = has_nvme(&self.slots, obj);
        for r in &obj.replicas {
            let at_ms = if self.node_may_copy(r, on_nvme) {
                at_ms.max(now_ms + self.cfg.stale_put_grace_ms)
            } else {
                at_ms
            };
            self.free_replica_at(r, obj.size, at_ms, now_ms);
        }
    }

    /// Frees every deferred extent whose time has come; returns the bytes.
    fn release_due(&mut self, now_ms: u64) -> u64 {
        let mut freed = 0;
        while self.pending.peek().is_some_and(|p| p.0.at_ms <= now_ms) {
            let Reverse(p) = self.pending.pop().expect("peeked");
            // The segment may have been unmounted (and the slot reused) since.
            if let Some(Some(slot)) = self.slots.get_mut(p.slot as usize) {
                if slot.id == p.segment {
                    slot.alloc.dealloc(p.offset, p.size);
                    freed += slot.alloc.rounded(p.size);
                }
            }
        }
        freed
    }

    /// Discards a Processing object nobody will finish; its space is
    /// quarantined, since a late writer may still be sending bytes into it.
    fn discard_processing(&mut self, id: Id, now_ms: u64) {
        let (_, obj) = self.objs.remove(id);
        let at = now_ms.saturating_add(self.cfg.stale_put_grace_ms);
        self.free_at(&obj, at, now_ms);
    }

    fn is_stale(&self, obj: &Object, now_ms: u64) -> bool {
        now_ms.saturating_sub(obj.put().started_ms) >= self.cfg.put_timeout_ms
    }

    /// Chooses up to `n` distinct segments with room for `size` bytes.
    fn place(&mut self, size: u64, n: usize, preferred_host: &str) -> SmallVec<[u32; 4]> {
        let mut cands: SmallVec<[(u32, f64, bool); 16]> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                let fits = s.tier() == Tier::Dram
                    && !s.draining
                    && !s.suspect
                    && s.alloc.largest_free() >= s.alloc.rounded(size);
                fits.then(|| {
                    let ratio = s.alloc.free() as f64 / s.alloc.capacity().max(1) as f64;
                    let local = !preferred_host.is_empty() && s.spec.host_id == preferred_host;
                    (i as u32, ratio, local)
                })
            })
            .collect();
        match self.cfg.placement {
            Placement::Random => {
                // Partial Fisher-Yates: the first n are a uniform sample.
                let k = n.min(cands.len());
                for i in 0..k {
                    let j = self.rng.random_range(i..cands.len());
                    cands.swap(i, j);
                }
                cands.truncate(k);
            }
            Placement::FreeRatioFirst => {
                cands.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            }
            Placement::LocalFirst => {
                cands.sort_by(|a, b| b.2.cmp(&a.2).then(b.1.total_cmp(&a.1)).then(a.0.cmp(&b.0)));
            }
        }
        cands.into_iter().take(n).map(|c| c.0).collect()
    }

    /// Whether segments may still mount again on a master that restarted
    /// on its state, or a standby that took over, before its recovered
    /// replicas are given up (`parked_until_ms`): none is mounted yet, or
    /// this shard's recovered state names some that are not (their nodes
    /// have not pinged it yet).
    fn awaiting_segments(&self, now_ms: u64) -> bool {
        self.durable.as_ref().is_some_and(|d| {
            now_ms < d.parked_until_ms
                && (!d.expected.is_empty()
                    || self.slots.iter().flatten().all(|s| s.tier() != Tier::Dram))
        })
    }

    /// Whether a DRAM segment that placement skips only because it is
    /// suspect has room for `size` bytes.
    fn room_while_suspect(&self, size: u64) -> bool {
        self.slots.iter().flatten().any(|s| {
            s.tier() == Tier::Dram
                && s.suspect
                && !s.draining
                && s.alloc.largest_free() >= s.alloc.rounded(size)
        })
    }

    // ---- eviction ---------------------------------------------------------

    /// Evicts the replica in slot `idx` that ranks first (see
    /// [`super::objects`]: complete, lease ended, not hard-pinned, `Ready`;
    /// unpinned before soft-pinned, oldest lease first). A victim with an
    /// NVMe copy loses its DRAM replica at once; one whose node has an NVMe
    /// tier is demoted (copied there first, its space on its way out);
    /// others are dropped, and an object left without a replica goes. A
    /// replica is never `Ready` while a demotion of it is under way (see
    /// the `Stored` and `PersistFailed` arms of `nvme_update`), so no
    /// queued demotion reads a range freed here. Returns the bytes it frees
    /// now or once its demotion lands; `None`
    /// when nothing in the range may be evicted. Pins must have been swept
    /// to `now_ms`.
    fn evict_next(&mut self, idx: u32, now_ms: u64) -> Option<u64> {
        let id = self.objs.first_victim(idx, now_ms)?;
        let (seg_id, tiered) = {
            let s = self.slot(idx);
            (s.id, s.spec.nvme.is_some())
        };
        let obj = self.objs.get(id);
        let size = obj.size;
        let pos = obj
            .replicas
            .iter()
            .position(|r| r.slot == idx && r.state == ReplicaState::Ready)
            .expect("indexed by a Ready replica in this range");
        let queue_room = self
            .tasks
            .get(&seg_id)
            .is_none_or(|q| q.len() < MAX_TASKS_PER_SEGMENT);
        if tiered && queue_room && !has_nvme(&self.slots, obj) {
            // Demote: the node copies it to NVMe, then the DRAM replica goes.
            let task = NodeTask::Persist {
                key: self.objs.key(id).to_vec(),
                dram: seg_id,
                offset: obj.replicas[pos].offset,
                len: size,
                demote: true,
                checksum: obj.checksum(),
            };
            self.objs
                .update(id, |o| o.replicas[pos].state = ReplicaState::Demoting);
            self.slot_mut(idx).demoting += demoting_extent(size);
            self.tasks.entry(seg_id).or_default().push_back(task);
            return Some(demoting_extent(size));
        }
        let (r, left) = self.objs.update(id, |o| {
            let r = o.replicas.remove(pos);
            (r, o.replicas.len())
        });
        if left == 0 {
            self.objs.remove(id);
        }
        let slot = self.slot_mut(idx);
        slot.alloc.dealloc(r.offset, size);
        let bytes = slot.alloc.rounded(size);
        self.evictions += 1;
        self.evicted_bytes += bytes;
        Some(bytes)
    }

    /// DRAM bytes of slot `idx` whose demotion to NVMe is under way.
    fn demoting_bytes(&self, idx: u32) -> u64 {
        self.slot(idx).demoting
    }

    /// A `Demoting` replica of an object of `size` bytes in slot `idx` stops
    /// being one (its copy landed or failed, or the object went).
    fn demotion_over(&mut self, idx: u32, size: u64) {
        if let Some(Some(s)) = self.slots.get_mut(idx as usize) {
            s.demoting = s.demoting.saturating_sub(demoting_extent(size));
        }
    }

    /// `obj` leaves the shard: its demotions under way no longer count.
    fn demotions_over(&mut self, obj: &Object) {
        for r in &obj.replicas {
            if r.state == ReplicaState::Demoting {
                self.demotion_over(r.slot, obj.size);
            }
        }
    }

    /// What one eviction episode frees in slot `idx`: `eviction_ratio` of
    /// the range.
    fn episode_bytes(&self, idx: u32) -> u64 {
        (self.cfg.eviction_ratio * self.slot(idx).alloc.capacity() as f64).ceil() as u64
    }

    /// If the range in slot `idx` is past the high watermark (space on its
    /// way out to NVMe counting as freed) and no episode is under way, the
    /// off-path eviction now owes it an episode.
    fn owe_if_high(&mut self, idx: u32) {
        let s = self.slot(idx);
        let cap = s.alloc.capacity();
        if s.evict_owed > 0 || cap == 0 {
            return;
        }
        let left = s.alloc.used().saturating_sub(s.demoting);
        if (left as f64) <= self.cfg.high_watermark * cap as f64 {
            return;
        }
        let owed = self.episode_bytes(idx);
        self.slot_mut(idx).evict_owed = owed;
    }

    /// Whether the off-path eviction owes some range an episode: the driver
    /// should run [`Self::evict_step`].
    pub fn evicting(&self) -> bool {
        self.slots.iter().flatten().any(|s| s.evict_owed > 0)
    }

    /// One bounded step of the off-path eviction at `now_ms`: at most
    /// `budget` replicas evicted, or pins swept, over the ranges owed an
    /// episode (an episode ends when its bytes are freed or nothing in its
    /// range may be evicted). Returns whether more is owed. The live shard
    /// runs steps in a task that yields between them; `MasterCore` runs
    /// them after every call.
    pub fn evict_step(&mut self, now_ms: u64, budget: usize) -> bool {
        if !self.evicting() {
            return false;
        }
        let mut left = budget.max(1);
        if !self.objs.sweep_pins(now_ms, &mut left) {
            return true;
        }
        for idx in 0..self.slots.len() as u32 {
            while left > 0 {
                let owed = match &self.slots[idx as usize] {
                    Some(s) if s.evict_owed > 0 => s.evict_owed,
                    _ => break,
                };
                left -= 1;
                self.slot_mut(idx).evict_owed = match self.evict_next(idx, now_ms) {
                    Some(bytes) => owed.saturating_sub(bytes),
                    None => 0,
                };
            }
        }
        self.evicting()
    }

    /// A put of `len` bytes found no room: evicts in the ranges that could
    /// hold it, in each until the object fits there (at most
    /// `max(eviction_ratio of the range, len)`), until `want` ranges fit;
    /// what is left of the ratio in a range it evicted in is owed to the
    /// off-path eviction. O(victims + pins that ended).
    fn evict_to_fit(&mut self, len: u64, want: usize, now_ms: u64) -> SmallVec<[u32; 4]> {
        let idxs: SmallVec<[u32; 4]> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                (s.tier() == Tier::Dram
                    && !s.draining
                    && !s.suspect
                    && s.alloc.capacity() >= s.alloc.rounded(len))
                .then_some(i as u32)
            })
            .collect();
        let mut unbounded = usize::MAX;
        self.objs.sweep_pins(now_ms, &mut unbounded);
        let fits = |s: &SegmentSlot| s.alloc.largest_free() >= s.alloc.rounded(len);
        let mut fitting = idxs.iter().filter(|&&i| fits(self.slot(i))).count();
        for &idx in &idxs {
            if fitting >= want {
                break;
            }
            if fits(self.slot(idx)) {
                continue;
            }
            let ratio = self.episode_bytes(idx);
            let bound = ratio.max(self.slot(idx).alloc.rounded(len));
            let mut done = 0;
            while done < bound && !fits(self.slot(idx)) {
                match self.evict_next(idx, now_ms) {
                    Some(bytes) => done += bytes,
                    None => break,
                }
            }
            if fits(self.slot(idx)) {
                fitting += 1;
            }
            if done > 0 && ratio > done {
                let s = self.slot_mut(idx);
                s.evict_owed = s.evict_owed.max(ratio - done);
            }
        }
        idxs
    }

    // ---- object calls -----------------------------------------------------

    fn check_key(&self, key: &[u8]) -> Result<(), KvError> {
        if key.is_empty() {
            return Err(err(ErrorCode::InvalidParams, "empty key"));
        }
        if key.len() > self.cfg.max_key_bytes {
            return Err(err(
                ErrorCode::InvalidParams,
                format!(
                    "key of {} bytes exceeds the maximum of {}",
                    key.len(),
                    self.cfg.max_key_bytes
                ),
            ));
        }
        Ok(())
    }

    fn describe_replicas(&self, obj: &Object) -> Vec<ReplicaDesc> {
        describe(&self.slots, obj, None, Access::Describe, 0)
    }

    pub fn put_start(
        &mut self,
        client: ClientId,
        key: &[u8],
        len: u64,
        opts: &PutOptions,
        now_ms: u64,
    ) -> Result<Vec<ReplicaDesc>, KvError> {
        self.check_key(key)?;
        if len == 0 {
            return Err(err(ErrorCode::InvalidParams, "value length is 0"));
        }
        if len > self.cfg.max_value_bytes {
            return Err(err(
                ErrorCode::InvalidParams,
                format!(
                    "value of {len} bytes exceeds the maximum of {}",
                    self.cfg.max_value_bytes
                ),
            ));
        }
        if opts.replicas == 0 {
            return Err(err(ErrorCode::InvalidParams, "replicas must be at least 1"));
        }
        if self.parked_only(key) {
            return Err(Self::recovering(key));
        }
        let exists = self.objs.complete_id(key).is_some();
        if exists && !opts.replace {
            return Err(err(
                ErrorCode::ObjectAlreadyExists,
                format!("key {} exists", show_key(key)),
            ));
        }
        if let Some(id) = self.objs.processing_id(key) {
            let o = self.objs.get(id);
            if !self.is_stale(o, now_ms) {
                // Two replaces by different writers: one waits for the other
                // to end, then replaces its object (the last PutEnd wins).
                // One writer's second put of a key it is putting is a bug.
                return Err(if opts.replace && o.put().writer != client {
                    err(
                        ErrorCode::TryAgain,
                        format!(
                            "another writer is putting key {}; try again when it is done",
                            show_key(key)
                        ),
                    )
                } else {
                    err(
                        ErrorCode::ObjectAlreadyExists,
                        format!("key {} is being put", show_key(key)),
                    )
                });
            }
            self.discard_processing(id, now_ms);
        }
        // A replace of a stored key adds no key in the end: the count does
        // not refuse it. Its Processing entry counts while it lasts (so at
        // most one replace per stored key stands beyond the limit).
        if (!exists && self.key_count() >= self.cfg.max_keys) || !self.objs.has_room() {
            return Err(err(
                ErrorCode::ResourceExhausted,
                format!(
                    "the pool holds its maximum of keys ({} on this shard)",
                    self.cfg.max_keys
                ),
            ));
        }
        self.release_due(now_ms);
        let want = opts.replicas as usize;
        let mut targets = self.place(len, want, &opts.preferred_host);
        if targets.is_empty() {
            // Allocation failed: evict until the object fits, then try once
            // more.
            let idxs = self.evict_to_fit(len, want, now_ms);
            targets = self.place(len, want, &opts.preferred_host);
            if targets.is_empty() {
                // Space on its way out to the NVMe tier (demotions under
                // way) that would make room: the writer waits for it. Space
                // held by leases or quarantine is not counted: it may stay
                // held for longer than a put's deadline.
                let coming = idxs.iter().any(|&idx| {
                    let s = self.slot(idx);
                    let demoting = self.demoting_bytes(idx);
                    demoting > 0 && s.alloc.free() + demoting >= s.alloc.rounded(len)
                });
                if coming {
                    return Err(err(
                        ErrorCode::TryAgain,
                        format!("no room for {len} bytes yet; demotions to NVMe are freeing space"),
                    ));
                }
            }
        }
        if targets.is_empty() {
            if self.room_while_suspect(len) {
                // A client could not reach the node of a segment with room
                // (a lossy link, a dead node): placement skips it until its
                // node pings again, or its lease ends and it goes. The
                // writer waits for that within its deadline instead of
                // hearing that there is no room.
                return Err(err(
                    ErrorCode::TryAgain,
                    format!(
                        "the segments with room for {len} bytes are suspected unreachable \
                         (a client could not reach their nodes); waiting for their next ping"
                    ),
                ));
            }
            if self.awaiting_segments(now_ms) {
                // A restarted master or a new leader: segments it knew of
                // have not mounted again yet (their nodes ping within a
                // second). The writer waits for them within its deadline.
                return Err(err(
                    ErrorCode::TryAgain,
                    format!(
                        "no room for {len} bytes yet: this master just took over and its \
                         storage nodes have not all mounted again"
                    ),
                ));
            }
            return Err(err(
                ErrorCode::NoSpace,
                format!("no segment has room for {len} bytes, even after eviction"),
            ));
        }
        if targets.len() < want {
            // Acknowledged all the same (a put that waited for a second
            // node could wait forever), and said: the tick reports it
            // (a metric and a log line).
            self.fewer_replicas += 1;
        }
        let mut replicas = SmallVec::new();
        for &idx in &targets {
            let offset = self
                .slot_mut(idx)
                .alloc
                .alloc(len)
                .expect("placement checked the largest free extent");
            replicas.push(Replica::ready(idx, offset));
            // The writer may write there until its grant runs out, even
            // past a restart of this master.
            let until = self.write_hold_until(now_ms);
            self.hold(idx, offset, len, until);
        }
        let obj = Object {
            size: len,
            phase: Phase::Processing(Processing {
                started_ms: now_ms,
                writer: client,
                soft_pin_ttl_ms: opts.soft_pin_ttl_ms.min(u32::MAX as u64) as u32,
                hard_pin: opts.hard_pin,
                replace: opts.replace,
                put_id: opts.put_id,
            }),
            replicas,
        };
        let descs = describe(
            &self.slots,
            &obj,
            self.signer.as_ref(),
            Access::Write {
                until_ms: now_ms + self.cfg.put_timeout_ms,
            },
            self.term(),
        );
        self.objs.insert(key, obj);
        for idx in targets {
            self.owe_if_high(idx);
        }
        Ok(descs)
    }

    /// The caller's own Processing object, of the placement `put_id` names
    /// (any, for 0); a stale one is discarded first.
    fn own_processing(
        &mut self,
        client: ClientId,
        key: &[u8],
        put_id: u16,
        now_ms: u64,
    ) -> Result<Id, KvError> {
        self.check_key(key)?;
        let Some(id) = self.objs.processing_id(key) else {
            return Err(if self.objs.complete_id(key).is_some() {
                err(
                    ErrorCode::ObjectAlreadyExists,
                    format!("key {} is already complete", show_key(key)),
                )
            } else {
                not_found(key)
            });
        };
        let obj = self.objs.get(id);
        if obj.put().writer != client {
            return Err(err(
                ErrorCode::IllegalClient,
                format!("key {} is being put by another client", show_key(key)),
            ));
        }
        if put_id != 0 && obj.put().put_id != put_id {
            // An end or revoke of an earlier placement that reached us after
            // the writer placed the key again: that placement is over.
            return Err(err(
                ErrorCode::ObjectNotFound,
                format!(
                    "put {put_id} of key {} is over (the writer placed the key again since)",
                    show_key(key)
                ),
            ));
        }
        if self.is_stale(obj, now_ms) {
            self.discard_processing(id, now_ms);
            return Err(err(
                ErrorCode::ObjectNotFound,
                format!(
                    "the put of {} took over put_timeout_ms ({}) and was discarded",
                    show_key(key),
                    self.cfg.put_timeout_ms
                ),
            ));
        }
        Ok(id)
    }

    /// Completes a put; `checksum` is what the writer computed over the
    /// bytes it wrote (readers check it).
    pub fn put_end(
        &mut self,
        client: ClientId,
        key: &[u8],
        put_id: u16,
        checksum: Option<u64>,
        now_ms: u64,
    ) -> Result<(), KvError> {
        let id = self.own_processing(client, key, put_id, now_ms)?;
        // Recovered replicas of the key still waiting for their segment are
        // the old object's: they go with it.
        self.retire_parked(key);
        // A replace: the object it replaces goes now, as a forced Remove
        // would take it (its space waits for its readers' lease, its NVMe
        // copies are dropped before the new object's copy is asked for).
        if let Some(old) = self.objs.complete_id(key) {
            debug_assert!(
                self.objs.get(id).put().replace,
                "only a replace meets a complete key"
            );
            let (k, old) = self.objs.remove(old);
            self.retire(&k, &old, now_ms);
        }
        self.objs.update(id, |o| o.complete_at(now_ms, checksum));
        // Write-through: the first replica on a node with an NVMe tier is
        // copied there now (the node does it when it next asks for work).
        let obj = self.objs.get(id);
        let through = obj.replicas.iter().find_map(|r| {
            let s = self.slot(r.slot);
            match &s.spec.nvme {
                Some(a) if a.write_through => Some((s.id, r.offset)),
                _ => None,
            }
        });
        if let Some((seg, offset)) = through {
            let (len, checksum) = (obj.size, obj.checksum());
            let q = self.tasks.entry(seg).or_default();
            if q.len() < MAX_TASKS_PER_SEGMENT {
                q.push_back(NodeTask::Persist {
                    key: key.to_vec(),
                    dram: seg,
                    offset,
                    len,
                    demote: false,
                    checksum,
                });
            }
        }
        Ok(())
    }

    /// Ends a put its writer gave up. Its space is quarantined for
    /// `stale_put_grace_ms`, not freed at once: the writer stopped, but
    /// bytes it had sent may still be on their way to a node (a write that
    /// failed on a deadline), and they must not land in another key's put.
    pub fn put_revoke(
        &mut self,
        client: ClientId,
        key: &[u8],
        put_id: u16,
        now_ms: u64,
    ) -> Result<(), KvError> {
        let id = self.own_processing(client, key, put_id, now_ms)?;
        self.discard_processing(id, now_ms);
        Ok(())
    }

    /// The object's replicas; grants a read lease until `now + lease_ttl`.
    pub fn get_replica_list(
        &mut self,
        key: &[u8],
        now_ms: u64,
    ) -> Result<Vec<ReplicaDesc>, KvError> {
        self.check_key(key)?;
        if let Some(id) = self.objs.complete_id(key) {
            let until_ms = now_ms + self.cfg.lease_ttl_ms;
            if self.objs.get(id).stored().lease_end_ms < until_ms {
                self.objs.update(id, |o| o.extend_lease(until_ms));
            }
            let obj = self.objs.get(id);
            let descs = describe(
                &self.slots,
                obj,
                self.signer.as_ref(),
                Access::Read {
                    until_ms: obj.stored().lease_end_ms,
                },
                self.term(),
            );
            if descs.first().is_some_and(|d| d.tier == Tier::Nvme) {
                self.count_nvme_read(id);
            }
            return Ok(descs);
        }
        if self.parked_only(key) {
            return Err(Self::recovering(key));
        }
        match self.objs.processing_id(key) {
            Some(id) if self.is_stale(self.objs.get(id), now_ms) => {
                self.discard_processing(id, now_ms);
                Err(not_found(key))
            }
            Some(_) => Err(err(
                ErrorCode::ReplicaNotReady,
                format!("key {} is still being put", show_key(key)),
            )),
            None => Err(not_found(key)),
        }
    }

    /// An NVMe-only object was read: after `promote_after_reads` reads, give
    /// it a DRAM replica (pending until its node has copied the bytes in).
    fn count_nvme_read(&mut self, id: Id) {
        let n = self.cfg.promote_after_reads;
        let reads = self.objs.update(id, |o| {
            let c = o.stored_mut();
            c.nvme_reads = c.nvme_reads.saturating_add(1);
            c.nvme_reads
        });
        let obj = self.objs.get(id);
        if n == 0
            || reads < n
            || obj
                .replicas
                .iter()
                .any(|r| r.state == ReplicaState::Promoting)
        {
            return;
        }
        self.objs.update(id, |o| o.stored_mut().nvme_reads = 0);
        let obj = self.objs.get(id);
        let size = obj.size;
        let Some(nvme) = obj
            .replicas
            .iter()
            .find(|r| {
                self.slots[r.slot as usize]
                    .as_ref()
                    .is_some_and(|s| s.tier() == Tier::Nvme)
            })
            .copied()
        else {
            return;
        };
        let nvme_seg = self.slot(nvme.slot).id;
        let owner = self.slot(nvme.slot).owner;
        // Only the DRAM segment the tier is attached to: the node copies
        // the bytes into its own memory, so the range must be in it.
        let Some(idx) = self.slots.iter().enumerate().find_map(|(i, s)| {
            let s = s.as_ref()?;
            let attached = s.tier() == Tier::Dram
                && s.owner == owner
                && s.spec
                    .nvme
                    .as_ref()
                    .is_some_and(|a| a.segment_id == nvme_seg);
            (attached && !s.draining && !s.suspect).then_some(i as u32)
        }) else {
            return;
        };
        let Some(offset) = self.slot_mut(idx).alloc.alloc(size) else {
            return;
        };
        let checksum = self.objs.get(id).checksum();
        let dram = self.slot(idx).id;
        let q = self.tasks.entry(nvme_seg).or_default();
        if q.len() >= MAX_TASKS_PER_SEGMENT {
            self.slot_mut(idx).alloc.dealloc(offset, size);
            return;
        }
        // The node writes the range when it gets to the task: held as a
        // put's grant is, from the read's lease end (no earlier than now).
        let until = self.write_hold_until(self.objs.get(id).stored().lease_end_ms);
        self.hold(idx, offset, size, until);
        let q = self.tasks.entry(nvme_seg).or_default();
        q.push_back(NodeTask::Promote {
            key: self.objs.key(id).to_vec(),
            loc: nvme.offset,
            dram,
            offset,
            len: size,
            checksum,
        });
        self.objs.update(id, |o| {
            o.replicas.push(Replica {
                slot: idx,
                state: ReplicaState::Promoting,
                offset,
            })
        });
    }

    /// The slot of segment `seg` if it is mounted, of tier `tier`, and owned
    /// by `client`: what a node may report on or take work for.
    fn owned_slot(&self, client: ClientId, seg: SegmentId, tier: Tier) -> Result<u32, KvError> {
        let idx = *self.by_id.get(&seg).ok_or_else(|| {
            err(
                ErrorCode::SegmentNotFound,
                format!("segment {seg:016x} is not mounted"),
            )
        })?;
        let s = self.slot(idx);
        if s.owner != client {
            return Err(err(
                ErrorCode::IllegalClient,
                format!("segment {seg:016x} belongs to another client"),
            ));
        }
        if s.tier() != tier {
            return Err(err(
                ErrorCode::InvalidParams,
                format!("segment {seg:016x} is not a {tier:?} segment"),
            ));
        }
        Ok(idx)
    }

    /// Checks that an NVMe location names a region the tier has.
    fn check_loc(&self, nslot: u32, loc: u64) -> Result<(), KvError> {
        let regions = self.slot(nslot).spec.endpoint.nr_shards.max(1) as u64;
        if loc >> 32 >= regions {
            return Err(err(
                ErrorCode::InvalidParams,
                format!("NVMe location {loc:#x} names a region the tier does not have"),
            ));
        }
        Ok(())
    }

    /// Up to `max` queued tasks for the given segments' node; every segment
    /// named must be mounted and owned by `client`.
    pub fn node_tasks(
        &mut self,
        client: ClientId,
        segments: &[SegmentId],
        max: usize,
        now_ms: u64,
    ) -> Result<Vec<NodeTask>, KvError> {
        for seg in segments {
            let idx = *self.by_id.get(seg).ok_or_else(|| {
                err(
                    ErrorCode::SegmentNotFound,
                    format!("segment {seg:016x} is not mounted"),
                )
            })?;
            if self.slot(idx).owner != client {
                return Err(err(
                    ErrorCode::IllegalClient,
                    format!("segment {seg:016x} belongs to another client"),
                ));
            }
        }
        let mut out = Vec::new();
        for seg in segments {
            let Some(mut q) = self.tasks.remove(seg) else {
                continue;
            };
            let tier = self
                .by_id
                .get(seg)
                .and_then(|&i| self.slot(i).spec.nvme.as_ref())
                .map(|a| a.segment_id);
            while out.len() < max {
                let Some(t) = q.pop_front() else {
                    break;
                };
                let stale = self.task_is_stale(*seg, &t);
                if let (NodeTask::Drop { key, loc }, Some(nvme)) = (&t, tier) {
                    // Out to the node (or stale: the copy is an object's
                    // again): owed no more, unless the same Drop waits again.
                    if !q.has_drop(key, *loc) {
                        self.settle_drop(nvme, key, *loc, (!stale).then_some(now_ms));
                    }
                }
                if !stale {
                    out.push(t);
                }
            }
            self.tasks.insert(*seg, q);
        }
        Ok(out)
    }

    /// Whether task `t` of segment `seg`'s queue no longer stands, and is
    /// dropped instead of handed out:
    /// * a Persist whose object no longer holds the DRAM range it names as
    ///   it did when the task was queued (removed, replaced, its replica
    ///   evicted; for a demotion, the replica no longer `Demoting`): nothing
    ///   waits for its report, and a node that ran it would copy whatever
    ///   lies in the range now and replace the key's copy on its tier
    ///   (maybe the one the current object lists) with it;
    /// * a Drop of a copy that the object under the key lists again (a
    ///   guard: a `Recovered` report of a copy whose Drop is queued is
    ///   refused, so the master should never list such a copy).
    fn task_is_stale(&self, seg: SegmentId, t: &NodeTask) -> bool {
        let (key, dram, offset, demote) = match t {
            NodeTask::Persist {
                key,
                dram,
                offset,
                demote,
                ..
            } => (key, dram, offset, demote),
            NodeTask::Drop { key, loc } => {
                let tier = self
                    .by_id
                    .get(&seg)
                    .and_then(|&i| self.slot(i).spec.nvme.as_ref())
                    .and_then(|a| self.by_id.get(&a.segment_id));
                return match (tier, self.objs.complete_id(key)) {
                    (Some(&nslot), Some(id)) => self
                        .objs
                        .get(id)
                        .replicas
                        .iter()
                        .any(|r| r.slot == nslot && r.offset == *loc),
                    _ => false,
                };
            }
            NodeTask::Promote { .. } => return false,
        };
        let (Some(&dslot), Some(id)) = (self.by_id.get(dram), self.objs.complete_id(key)) else {
            return true;
        };
        !self.objs.get(id).replicas.iter().any(|r| {
            r.slot == dslot
                && r.offset == *offset
                && if *demote {
                    r.state == ReplicaState::Demoting
                } else {
                    r.state != ReplicaState::Promoting
                }
        })
    }

    /// Applies one report of node `client` about its NVMe tier. Everything
    /// the report names is checked before anything changes: its segments
    /// must be mounted, of the right tier and the reporter's own; NVMe
    /// locations must name a region of the tier; DRAM ranges must be the
    /// ones the master itself handed out for that object.
    pub fn nvme_update(
        &mut self,
        client: ClientId,
        u: &NvmeUpdate,
        now_ms: u64,
    ) -> Result<(), KvError> {
        self.check_key(u.key())?;
        match u {
            NvmeUpdate::Stored {
                key,
                nvme,
                loc,
                len,
                dram,
                offset,
                demote,
                sum,
            } => {
                let nslot = self.owned_slot(client, *nvme, Tier::Nvme)?;
                self.check_loc(nslot, *loc)?;
                let dslot = match self.owned_slot(client, *dram, Tier::Dram) {
                    Ok(d) => Some(d),
                    // The DRAM segment went away meanwhile: the NVMe copy
                    // still counts.
                    Err(e) if e.code == ErrorCode::SegmentNotFound => None,
                    Err(e) => return Err(e),
                };
                let id = self
                    .objs
                    .complete_id(key)
                    .filter(|&id| self.objs.get(id).size == *len);
                let Some(id) = id else {
                    return Err(not_found(key));
                };
                let obj = self.objs.get(id);
                if obj.checksum().is_some_and(|s| s != *sum) {
                    return Err(err(
                        ErrorCode::Corrupt,
                        format!(
                            "the NVMe copy of {} does not match the object's checksum",
                            show_key(key)
                        ),
                    ));
                }
                let existing = obj
                    .replicas
                    .iter()
                    .find(|r| r.slot == nslot)
                    .map(|r| r.offset);
                let pos = dslot.and_then(|d| {
                    obj.replicas.iter().position(|r| {
                        r.slot == d && r.offset == *offset && r.state != ReplicaState::Promoting
                    })
                });
                match existing {
                    Some(l) if l != *loc => {
                        return Err(err(
                            ErrorCode::ObjectAlreadyExists,
                            "another NVMe copy is recorded",
                        ))
                    }
                    Some(_) => {}
                    // The copy was made from a DRAM range this object does
                    // not hold: the object it was asked for was replaced (or
                    // removed and put again) meanwhile, so these bytes may
                    // be another version's. (The range itself is not reused
                    // while a node may still read it: see `free_at`.)
                    None if dslot.is_some() && pos.is_none() => {
                        return Err(err(
                            ErrorCode::ObjectNotFound,
                            format!(
                                "the object under {} no longer holds the DRAM range the copy \
                                 was made from",
                                show_key(key)
                            ),
                        ))
                    }
                    None => self
                        .objs
                        .update(id, |o| o.replicas.push(Replica::ready(nslot, *loc))),
                }
                // The write-through copy of a replica whose demotion is
                // under way: the node still holds that demotion's Persist
                // task, which reads the range; its own report ends it. (Were
                // the replica Ready again, an eviction would free the range
                // at once, the object having an NVMe copy, and the node
                // would copy another put's bytes from it.)
                let pos = pos.filter(|&p| {
                    *demote || self.objs.get(id).replicas[p].state != ReplicaState::Demoting
                });
                if let Some(pos) = pos {
                    let obj = self.objs.get(id);
                    let was = (obj.replicas[pos].state == ReplicaState::Demoting)
                        .then_some((obj.replicas[pos].slot, obj.size));
                    if *demote {
                        let r = self.objs.update(id, |o| o.replicas.remove(pos));
                        let obj = self.objs.get(id);
                        let (size, lease_end) = (obj.size, obj.stored().lease_end_ms);
                        self.demotions += 1;
                        self.evict_dram_replica(r, size, lease_end, now_ms);
                    } else {
                        self.objs
                            .update(id, |o| o.replicas[pos].state = ReplicaState::Ready);
                    }
                    if let Some((idx, size)) = was {
                        self.demotion_over(idx, size);
                    }
                }
                // The copy is this object's: a Drop owed to an earlier
                // object's copy in the same place is stale.
                self.settle_drop(*nvme, key, *loc, None);
                Ok(())
            }
            NvmeUpdate::PersistFailed {
                key,
                dram,
                offset,
                demote,
            } => {
                let dslot = self.owned_slot(client, *dram, Tier::Dram)?;
                let id = self.objs.complete_id(key).ok_or_else(|| not_found(key))?;
                let obj = self.objs.get(id);
                let Some(pos) = obj.replicas.iter().position(|r| {
                    r.slot == dslot && r.offset == *offset && r.state == ReplicaState::Demoting
                }) else {
                    return Ok(());
                };
                let size = obj.size;
                if !*demote {
                    // A write-through copy failed while a demotion of the
                    // replica is under way: that demotion's own report
                    // ends it (its task still reads the range).
                    return Ok(());
                }
                // The eviction goes ahead without an NVMe copy.
                let (r, left) = self.objs.update(id, |o| {
                    let r = o.replicas.remove(pos);
                    (r, o.replicas.len())
                });
                let lease_end = self.objs.get(id).stored().lease_end_ms;
                if left == 0 {
                    self.objs.remove(id);
                }
                self.demotion_over(dslot, size);
                self.evict_dram_replica(r, size, lease_end, now_ms);
                Ok(())
            }
            NvmeUpdate::Promoted {
                key,
                dram,
                offset,
                ok,
            } => {
                let dslot = self.owned_slot(client, *dram, Tier::Dram)?;
                let id = self.objs.complete_id(key).ok_or_else(|| not_found(key))?;
                let obj = self.objs.get(id);
                let pos = obj
                    .replicas
                    .iter()
                    .position(|r| {
                        r.slot == dslot && r.offset == *offset && r.state == ReplicaState::Promoting
                    })
                    .ok_or_else(|| {
                        err(ErrorCode::ObjectNotFound, "no promotion under way there")
                    })?;
                if *ok {
                    self.objs
                        .update(id, |o| o.replicas[pos].state = ReplicaState::Ready);
                    self.promotions += 1;
                } else {
                    let size = obj.size;
                    let r = self.objs.update(id, |o| o.replicas.remove(pos));
                    self.free_replica_now(&r, size);
                }
                Ok(())
            }
            NvmeUpdate::Evicted { key, nvme, loc } => {
                let nslot = match self.owned_slot(client, *nvme, Tier::Nvme) {
                    Ok(n) => n,
                    // Unmounted meanwhile: nothing lists the copy any more.
                    Err(e) if e.code == ErrorCode::SegmentNotFound => return Ok(()),
                    Err(e) => return Err(e),
                };
                if let Some(id) = self.objs.complete_id(key) {
                    let left = self.objs.update(id, |o| {
                        o.replicas
                            .retain(|r| !(r.slot == nslot && r.offset == *loc));
                        o.replicas.len()
                    });
                    if left == 0 {
                        self.objs.remove(id);
                    }
                }
                Ok(())
            }
            NvmeUpdate::Recovered {
                key,
                nvme,
                loc,
                len,
                sum,
            } => {
                let nslot = self.owned_slot(client, *nvme, Tier::Nvme)?;
                self.check_loc(nslot, *loc)?;
                if *len == 0 || *len > self.cfg.max_value_bytes {
                    return Err(err(
                        ErrorCode::InvalidParams,
                        format!("a recovered object of {len} bytes"),
                    ));
                }
                let listed = self.objs.complete_id(key).is_some_and(|id| {
                    self.objs
                        .get(id)
                        .replicas
                        .iter()
                        .any(|r| r.slot == nslot && r.offset == *loc)
                });
                if !listed && self.drop_owed(*nvme, key, *loc, now_ms) {
                    // Reported before the node ran the Drop it is owed or
                    // was just handed (the node restarted, or reported its
                    // tier again; the master may have restarted too: what
                    // is owed is in its state directory): taking it would
                    // bring back a removed or replaced object. (A copy the
                    // key's object lists is that object's: a later put's
                    // copy took the slot, and the Drop is stale.)
                    return Err(err(
                        ErrorCode::ObjectAlreadyExists,
                        "this copy's object was removed or replaced: its Drop is owed",
                    ));
                }
                let unlisted = if listed {
                    Unlisted::Listed
                } else {
                    self.unlisted_copy(*nvme, key, *loc, now_ms)
                };
                if unlisted == Unlisted::Old {
                    // Every live copy of this tier is listed: this one is
                    // an old object's whose Drop was handed out (the node
                    // died before it ran it, or the master restarted), or
                    // of a key removed while its tier was away.
                    return Err(err(
                        ErrorCode::ObjectAlreadyExists,
                        "an old copy: no object lists it (its object was removed or replaced)",
                    ));
                }
                match self.objs.complete_id(key) {
                    Some(id) => {
                        let o = self.objs.get(id);
                        // Without a checksum nothing shows the copy is this
                        // object's and not an earlier one's of the same
                        // size, unless this very replica is listed already
                        // (its record came back from the state directory),
                        // or was this object's when its tier went.
                        let same = match o.checksum() {
                            Some(s) => s == *sum,
                            None => unlisted != Unlisted::Adopted,
                        };
                        if o.size != *len || !same {
                            return Err(err(
                                ErrorCode::ObjectAlreadyExists,
                                "a different object is stored under this key now",
                            ));
                        }
                        self.objs.update(id, |o| {
                            o.replicas.retain(|r| r.slot != nslot);
                            o.replicas.push(Replica::ready(nslot, *loc));
                        });
                        self.settle_drop(*nvme, key, *loc, None);
                        Ok(())
                    }
                    // A put of the key under way (a replace of a complete
                    // key is the arm above: its copy is the complete one's).
                    None if self.objs.processing_id(key).is_some() => {
                        Err(err(ErrorCode::ObjectAlreadyExists, "the key is being put"))
                    }
                    None => {
                        if self.key_count() >= self.cfg.max_keys || !self.objs.has_room() {
                            return Err(err(
                                ErrorCode::ResourceExhausted,
                                "the pool holds its maximum of keys",
                            ));
                        }
                        self.objs.insert(
                            key,
                            Object {
                                size: *len,
                                phase: Phase::Complete(Complete {
                                    lease_end_ms: now_ms,
                                    unread: false,
                                    pin_end_ms: 0,
                                    sum: *sum,
                                    has_sum: true,
                                    hard_pin: false,
                                    nvme_reads: 0,
                                }),
                                replicas: smallvec::smallvec![Replica::ready(nslot, *loc)],
                            },
                        );
                        Ok(())
                    }
                }
            }
        }
    }

    /// Whether a complete object is stored. Does not extend leases.
    pub fn exist(&self, key: &[u8], _now_ms: u64) -> Result<bool, KvError> {
        self.check_key(key)?;
        Ok(self.objs.complete_id(key).is_some())
    }

    pub fn remove(&mut self, key: &[u8], force: bool, now_ms: u64) -> Result<(), KvError> {
        self.check_key(key)?;
        if self.parked_only(key) {
            // A recovered object not back yet: it goes from the record (its
            // space was never taken back; its NVMe copies are dropped when
            // their tier mounts).
            self.retire_parked(key);
            self.objs.mark_dirty(key);
            return Ok(());
        }
        let Some(id) = self.objs.complete_id(key) else {
            // Copies of the key on tiers unmounted as dead are its last
            // object's: they must not come back with their tier.
            self.retire_detached(key);
            return Err(match self.objs.processing_id(key) {
                Some(id) if !self.is_stale(self.objs.get(id), now_ms) => err(
                    ErrorCode::ReplicaNotReady,
                    format!("key {} is still being put", show_key(key)),
                ),
                Some(id) => {
                    self.discard_processing(id, now_ms);
                    not_found(key)
                }
                None => not_found(key),
            });
        };
        let lease_end = self.objs.get(id).stored().lease_end_ms;
        if lease_end > now_ms && !force {
            return Err(err(
                ErrorCode::ObjectHasLease,
                format!(
                    "key {} is leased to a reader for {} ms more (remove with force to override)",
                    show_key(key),
                    lease_end - now_ms
                ),
            ));
        }
        let (k, obj) = self.objs.remove(id);
        self.retire(&k, &obj, now_ms);
        Ok(())
    }

    /// A complete object taken out of the shard (removed, or replaced by a
    /// new one) lets go of everything: its demotions under way stop
    /// counting, its NVMe copies are dropped, and its DRAM space is freed
    /// once its readers' lease is over (and any copy a node may be making
    /// of it, see `free_at`).
    fn retire(&mut self, key: &[u8], obj: &Object, now_ms: u64) {
        self.demotions_over(obj);
        self.drop_nvme_copies(key, obj);
        self.retire_parked(key);
        self.free_at(obj, obj.stored().lease_end_ms, now_ms);
    }

    /// Removes every complete object that has no live lease (with `force`,
    /// every complete object: a leased one's space is freed when its lease
    /// ends, as a forced remove does); returns the count. O(objects).
    pub fn remove_all(&mut self, now_ms: u64, force: bool) -> u64 {
        let ids: Vec<Id> = self
            .objs
            .complete_ids()
            .filter(|&id| force || self.objs.get(id).stored().lease_end_ms <= now_ms)
            .collect();
        for &id in &ids {
            let (k, obj) = self.objs.remove(id);
            self.retire(&k, &obj, now_ms);
        }
        let detached: Vec<Box<[u8]>> = self
            .detached
            .values()
            .flat_map(|t| t.keys().cloned())
            .collect();
        for k in detached {
            self.retire_detached(&k);
        }
        ids.len() as u64
    }

    /// Revokes every Processing put of a client that is gone.
    pub fn revoke_client(&mut self, client: ClientId, now_ms: u64) -> u64 {
        let ids: Vec<Id> = self
            .objs
            .processing_ids()
            .filter(|&id| self.objs.get(id).put().writer == client)
            .collect();
        for &id in &ids {
            self.discard_processing(id, now_ms);
        }
        ids.len() as u64
    }

    pub fn describe(&self, key: &[u8], now_ms: u64) -> Result<ObjectInfo, KvError> {
        self.check_key(key)?;
        if let Some(id) = self.objs.complete_id(key) {
            let o = self.objs.get(id);
            let c = o.stored();
            return Ok(ObjectInfo {
                key: key.to_vec(),
                complete: true,
                size: o.size,
                replicas: self.describe_replicas(o),
                lease_remaining_ms: c.lease_end_ms.saturating_sub(now_ms),
                soft_pin_remaining_ms: c.pin_end_ms.saturating_sub(now_ms),
                hard_pin: c.hard_pin,
            });
        }
        match self.objs.processing_id(key) {
            Some(id) => {
                let o = self.objs.get(id);
                Ok(ObjectInfo {
                    key: key.to_vec(),
                    complete: false,
                    size: o.size,
                    replicas: self.describe_replicas(o),
                    lease_remaining_ms: 0,
                    soft_pin_remaining_ms: 0,
                    hard_pin: o.hard_pinned(),
                })
            }
            None => Err(not_found(key)),
        }
    }

    /// Housekeeping: discards stale puts, frees what has waited long
    /// enough, and owes an eviction episode to every range past the high
    /// watermark (the driver runs [`Self::evict_step`] for it).
    pub fn tick(&mut self, now_ms: u64) -> TickReport {
        let mut report = TickReport {
            fewer_replicas: std::mem::take(&mut self.fewer_replicas),
            ..TickReport::default()
        };
        self.expire_parked(now_ms);
        let quiet: Vec<SegmentId> = self
            .adopting
            .iter()
            .filter(|&(_, &until)| until <= now_ms)
            .map(|(&t, _)| t)
            .collect();
        for t in quiet {
            self.list_tier(t);
        }
        let stale: Vec<Id> = self
            .objs
            .processing_ids()
            .filter(|&id| self.is_stale(self.objs.get(id), now_ms))
            .collect();
        for &id in &stale {
            self.discard_processing(id, now_ms);
        }
        report.stale_discarded = stale.len() as u64;
        report.freed_bytes = self.release_due(now_ms);
        for idx in 0..self.slots.len() as u32 {
            if self.slots[idx as usize].is_some() {
                self.owe_if_high(idx);
            }
        }
        #[cfg(debug_assertions)]
        if self.key_count() <= DEBUG_CHECK_MAX_KEYS {
            if let Err(e) = self.check_invariants() {
                panic!("master shard {}: {e}", self.shard);
            }
        }
        report
    }

    /// Checks the shard's space accounting and its object index; the first
    /// broken rule, named. For every DRAM segment: its allocator's used
    /// bytes equal the extents of the replicas (complete and processing
    /// objects, promotions being copied in, demotions under way) plus the
    /// extents waiting to be freed (leased removals, quarantined puts); no
    /// two of those extents overlap (so a leased object's space is never
    /// handed out again) and each lies in this shard's range; every replica
    /// points at a mounted segment; a key is both complete and Processing
    /// only while a replace of it is. The object store's tables and its
    /// eviction index match a recount (`Objects::check`), and the index has
    /// a range for exactly the mounted DRAM segments. O(objects): the model
    /// tests run it after every step, debug builds after every tick of a
    /// small shard.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.objs.check()?;
        let detached: usize = self.detached.values().map(HashMap::len).sum();
        if detached != self.detached_len || self.detached.values().any(HashMap::is_empty) {
            return Err(format!(
                "{detached} detached copies counted as {} (or an empty tier entry)",
                self.detached_len
            ));
        }
        if let Some(t) = self.adopting.keys().find(|t| self.listed_tiers.contains(t)) {
            return Err(format!("tier {t:016x} is listed and still being adopted"));
        }
        for (idx, slot) in self.slots.iter().enumerate() {
            let dram = slot.as_ref().is_some_and(|s| s.tier() == Tier::Dram);
            if self.objs.has_range(idx as u32) != dram {
                return Err(format!(
                    "slot {idx}: the eviction index has a range for it: {}, it is a mounted \
                     DRAM segment: {dram}",
                    !dram
                ));
            }
        }
        let mut extents: HashMap<u32, Vec<(u64, u64, String)>> = HashMap::new();
        let mut demoting: HashMap<u32, u64> = HashMap::new();
        for id in self.objs.complete_ids() {
            let o = self.objs.get(id);
            for r in &o.replicas {
                if r.state == ReplicaState::Demoting {
                    *demoting.entry(r.slot).or_default() += demoting_extent(o.size);
                }
            }
        }
        for id in self.objs.processing_ids() {
            let (k, o) = (self.objs.key(id), self.objs.get(id));
            if !o.put().replace && self.objs.complete_id(k).is_some() {
                return Err(format!(
                    "{} is complete and being put by a put that is not a replace",
                    show_key(k)
                ));
            }
        }
        for (state, ids) in [
            ("complete", self.objs.complete_ids().collect::<Vec<_>>()),
            ("processing", self.objs.processing_ids().collect()),
        ] {
            for id in ids {
                let (k, o) = (self.objs.key(id), self.objs.get(id));
                for r in &o.replicas {
                    let Some(Some(slot)) = self.slots.get(r.slot as usize) else {
                        return Err(format!(
                            "{state} object {} has a replica in unmounted slot {}",
                            show_key(k),
                            r.slot
                        ));
                    };
                    if slot.tier() == Tier::Dram {
                        extents.entry(r.slot).or_default().push((
                            r.offset,
                            slot.alloc.rounded(o.size),
                            format!("{state} {}", show_key(k)),
                        ));
                    }
                }
            }
        }
        for Reverse(p) in self.pending.iter() {
            if let Some(Some(slot)) = self.slots.get(p.slot as usize) {
                if slot.id == p.segment {
                    extents.entry(p.slot).or_default().push((
                        p.offset,
                        slot.alloc.rounded(p.size),
                        format!("a free due at {} ms", p.at_ms),
                    ));
                }
            }
        }
        for (idx, slot) in self.slots.iter().enumerate() {
            let Some(slot) = slot else { continue };
            if slot.tier() != Tier::Dram {
                continue;
            }
            let counted = demoting.get(&(idx as u32)).copied().unwrap_or(0);
            if slot.demoting != counted {
                return Err(format!(
                    "segment {:016x}: {} demoting bytes counted, {counted} in Demoting replicas",
                    slot.id, slot.demoting
                ));
            }
            let mut v = extents.remove(&(idx as u32)).unwrap_or_default();
            let sum: u64 = v.iter().map(|e| e.1).sum();
            if sum != slot.alloc.used() {
                return Err(format!(
                    "segment {:016x}: the allocator has {} bytes in use, the extents held \
                     add up to {sum}",
                    slot.id,
                    slot.alloc.used()
                ));
            }
            let (lo, len) = (slot.alloc.base(), slot.alloc.capacity());
            v.sort_unstable_by_key(|e| e.0);
            for e in &v {
                if e.0 < lo || e.0 + e.1 > lo + len {
                    return Err(format!(
                        "segment {:016x}: {} at {}+{} lies outside this shard's range \
                         {lo}+{len}",
                        slot.id, e.2, e.0, e.1
                    ));
                }
            }
            for w in v.windows(2) {
                if w[0].0 + w[0].1 > w[1].0 {
                    return Err(format!(
                        "segment {:016x}: {} at {}+{} overlaps {} at {}+{}",
                        slot.id, w[0].2, w[0].0, w[0].1, w[1].2, w[1].0, w[1].1
                    ));
                }
            }
        }
        Ok(())
    }

    /// Distinct keys: a key being replaced is in both tables, and counts
    /// once.
    fn distinct_keys(&self) -> u64 {
        let replacing = self
            .objs
            .processing_ids()
            .filter(|&id| self.objs.complete_id(self.objs.key(id)).is_some())
            .count();
        self.key_count() - replacing as u64
    }

    pub fn stat(&self) -> ShardStat {
        ShardStat {
            keys: self.distinct_keys(),
            segments: self
                .slots
                .iter()
                .flatten()
                .map(|s| (s.id, s.alloc.capacity(), s.alloc.used()))
                .collect(),
            evictions: self.evictions,
            evicted_bytes: self.evicted_bytes,
            demotions: self.demotions,
            promotions: self.promotions,
        }
    }

    // ---- dispatch ---------------------------------------------------------

    fn batch_put_start(
        &mut self,
        client: ClientId,
        items: &[PutItem],
        opts: &PutOptions,
        now_ms: u64,
    ) -> Vec<ItemResult<Vec<ReplicaDesc>>> {
        items
            .iter()
            .map(|i| self.put_start(client, &i.key, i.len, opts, now_ms).into())
            .collect()
    }

    /// Applies a key or batch request (the master's RPC dispatch). Batch
    /// requests are applied to every key given, whichever shard owns it: the
    /// caller routes.
    pub fn apply(&mut self, req: MasterRequest, now_ms: u64) -> Result<MasterResponse, KvError> {
        use MasterRequest as R;
        Ok(match req {
            R::PutStart {
                client_id,
                key,
                len,
                opts,
            } => MasterResponse::Replicas(self.put_start(client_id, &key, len, &opts, now_ms)?),
            R::PutEnd {
                client_id,
                key,
                put_id,
                checksum,
            } => {
                self.put_end(client_id, &key, put_id, checksum, now_ms)?;
                MasterResponse::Done
            }
            R::PutRevoke {
                client_id,
                key,
                put_id,
            } => {
                self.put_revoke(client_id, &key, put_id, now_ms)?;
                MasterResponse::Done
            }
            R::GetReplicaList { key } => {
                MasterResponse::Replicas(self.get_replica_list(&key, now_ms)?)
            }
            R::Exist { key } => MasterResponse::Exists(self.exist(&key, now_ms)?),
            R::Remove { key, force } => {
                self.remove(&key, force, now_ms)?;
                MasterResponse::Done
            }
            R::Describe { key } => MasterResponse::Described(self.describe(&key, now_ms)?),
            R::BatchPutStart {
                client_id,
                items,
                opts,
            } => MasterResponse::BatchReplicas(
                self.batch_put_start(client_id, &items, &opts, now_ms),
            ),
            R::BatchPutEnd {
                client_id,
                put_id,
                items,
            } => MasterResponse::BatchDone(
                items
                    .iter()
                    .map(|i| {
                        self.put_end(client_id, &i.key, put_id, i.checksum, now_ms)
                            .into()
                    })
                    .collect(),
            ),
            R::BatchPutRevoke {
                client_id,
                put_id,
                keys,
            } => MasterResponse::BatchDone(
                keys.iter()
                    .map(|k| self.put_revoke(client_id, k, put_id, now_ms).into())
                    .collect(),
            ),
            R::BatchGet { keys } => MasterResponse::BatchReplicas(
                keys.iter()
                    .map(|k| self.get_replica_list(k, now_ms).into())
                    .collect(),
            ),
            R::BatchExist { keys } => MasterResponse::BatchExists(
                keys.iter().map(|k| self.exist(k, now_ms).into()).collect(),
            ),
            R::BatchRemove { keys, force } => MasterResponse::BatchDone(
                keys.iter()
                    .map(|k| self.remove(k, force, now_ms).into())
                    .collect(),
            ),
            R::NodeTasks {
                client_id,
                segments,
                max,
                ..
            } => MasterResponse::Tasks(self.node_tasks(
                client_id,
                &segments,
                max as usize,
                now_ms,
            )?),
            R::NvmeUpdates { client_id, updates } => MasterResponse::BatchDone(
                updates
                    .iter()
                    .map(|u| self.nvme_update(client_id, u, now_ms).into())
                    .collect(),
            ),
            other => {
                return Err(err(
                    ErrorCode::Internal,
                    format!("{} is not a key request", other.op_name()),
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_queue_knows_which_drops_wait_in_it() {
        let drop = |k: &[u8], loc| NodeTask::Drop {
            key: k.to_vec(),
            loc,
        };
        let mut q = TaskQueue::default();
        q.push_back(drop(b"a", 7));
        q.push_back(NodeTask::Persist {
            key: b"a".to_vec(),
            dram: 1,
            offset: 0,
            len: 1,
            demote: false,
            checksum: None,
        });
        q.push_back(drop(b"a", 7));
        q.push_back(drop(b"b", 7));
        assert!(q.has_drop(b"a", 7) && q.has_drop(b"b", 7));
        assert!(!q.has_drop(b"a", 8) && !q.has_drop(b"c", 7));
        q.pop_front();
        assert!(
            q.has_drop(b"a", 7),
            "the second Drop of the copy still waits"
        );
        q.pop_front();
        q.pop_front();
        assert!(!q.has_drop(b"a", 7));
        assert!(q.has_drop(b"b", 7));
        q.pop_front();
        assert!(!q.has_drop(b"b", 7) && q.len() == 0 && q.pop_front().is_none());
    }

    #[test]
    fn an_object_stays_small() {
        // The master holds tens of millions of these: 200 bytes per object
        // beyond the key is the budget, map overhead included.
        assert!(
            std::mem::size_of::<Object>() <= 64,
            "{}",
            std::mem::size_of::<Object>()
        );
        assert_eq!(std::mem::size_of::<Replica>(), 16);
    }

    /// The id of the complete object under `key`.
    fn id(sh: &ShardState, key: &[u8]) -> Id {
        sh.objs.complete_id(key).expect("a complete object")
    }

    /// A shard with one DRAM segment of 1 MiB in slot 0.
    fn shard_with_a_segment() -> ShardState {
        let cfg = ShardConfig::from_master(&MasterConfig::default(), 1);
        let mut sh = ShardState::new(0, 1, cfg, 7);
        let spec = SegmentSpec {
            name: "n:1:1".into(),
            size: 1 << 20,
            endpoint: kvpool_transport::proto::Endpoint {
                host: "127.0.0.1".into(),
                port: 1,
                nr_shards: 1,
            },
            slice_bytes: 1 << 20,
            host_id: "n".into(),
            tier: Tier::Dram,
            nvme: None,
        };
        sh.add_segment(9, Arc::new(spec), 1, 0);
        sh
    }

    /// A put whose only segment with room is suspect (a client could not
    /// reach its node) waits for the mark to clear (`TryAgain`, which the
    /// client retries within its deadline) instead of failing with
    /// `NoSpace` (a fault test met that right after a lossy link healed).
    #[test]
    fn a_put_meeting_only_a_suspect_segment_is_told_to_try_again_not_no_space() {
        let mut sh = shard_with_a_segment();
        sh.set_suspect(9, true);
        let e = sh
            .put_start(1, b"k", 1000, &PutOptions::default(), 0)
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::TryAgain, "{e}");
        assert!(sh.objs.processing_id(b"k").is_none(), "nothing placed");
        // Too large for the segment even when it is reachable: no room.
        let e = sh
            .put_start(1, b"big", 2 << 20, &PutOptions::default(), 0)
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::NoSpace, "{e}");
        sh.set_suspect(9, false);
        sh.put_start(1, b"k", 1000, &PutOptions::default(), 0)
            .expect("placed once the node pinged");
        sh.check_invariants().expect("a consistent shard");
    }

    /// A put asking for two replicas where one segment has room is placed
    /// on that one, and the next tick says so.
    #[test]
    fn a_put_placed_with_fewer_replicas_than_asked_is_reported_by_the_tick() {
        let mut sh = shard_with_a_segment();
        let two = PutOptions {
            replicas: 2,
            ..PutOptions::default()
        };
        let descs = sh.put_start(1, b"k", 1000, &two, 0).unwrap();
        assert_eq!(descs.len(), 1, "placed on the one segment there is");
        sh.put_start(1, b"one", 1000, &PutOptions::default(), 0)
            .unwrap();
        assert_eq!(sh.tick(1).fewer_replicas, 1, "one put of the two");
        assert_eq!(sh.tick(2).fewer_replicas, 0, "counted once");
    }

    fn shard_with_objects() -> ShardState {
        let mut sh = shard_with_a_segment();
        for k in [&b"a"[..], b"b", b"c"] {
            sh.put_start(1, k, 1000, &PutOptions::default(), 0).unwrap();
            sh.put_end(1, k, 0, None, 0).unwrap();
        }
        // A leased removal: its extent waits in `pending`.
        sh.get_replica_list(b"c", 0).unwrap();
        sh.remove(b"c", true, 0).unwrap();
        sh.check_invariants().expect("a consistent shard");
        sh
    }

    #[test]
    fn space_accounting_that_does_not_add_up_is_reported() {
        let mut sh = shard_with_objects();
        // A replica's extent given back behind the object's back.
        let off = sh.objs.get(id(&sh, b"a")).replicas[0].offset;
        sh.slots[0].as_mut().unwrap().alloc.dealloc(off, 1000);
        let e = sh.check_invariants().unwrap_err();
        assert!(e.contains("in use"), "{e}");
    }

    #[test]
    fn two_objects_on_one_extent_are_reported() {
        let mut sh = shard_with_objects();
        let off_a = sh.objs.get(id(&sh, b"a")).replicas[0].offset;
        let b = id(&sh, b"b");
        let off_b = sh.objs.get(b).replicas[0].offset;
        // b now claims a's bytes; its own extent is released so the total
        // still adds up: only the overlap is wrong.
        sh.slots[0].as_mut().unwrap().alloc.dealloc(off_b, 1000);
        sh.objs.update(b, |o| o.replicas[0].offset = off_a);
        sh.slots[0].as_mut().unwrap().alloc.alloc(1000).unwrap();
        let e = sh.check_invariants().unwrap_err();
        assert!(e.contains("overlaps"), "{e}");
    }

    #[test]
    fn a_leased_removal_whose_extent_was_freed_early_is_reported() {
        let mut sh = shard_with_objects();
        let Reverse(p) = sh.pending.peek().unwrap();
        let (off, size) = (p.offset, p.size);
        sh.slots[0].as_mut().unwrap().alloc.dealloc(off, size);
        assert!(sh.check_invariants().is_err());
    }

    #[test]
    fn an_eviction_index_that_misses_a_lease_change_is_reported() {
        let mut sh = shard_with_objects();
        // A read lease set behind the index's back: the object now ranks
        // later than its entry says.
        let a = id(&sh, b"a");
        sh.objs.get_mut_unindexed(a).extend_lease(60_000);
        let e = sh.check_invariants().unwrap_err();
        assert!(e.contains("eviction index"), "{e}");
    }

    #[test]
    fn an_eviction_index_that_misses_a_replica_state_change_is_reported() {
        let mut sh = shard_with_objects();
        // A replica taken out of eviction's reach (Demoting) behind the
        // index's back: its entry stays.
        let a = id(&sh, b"a");
        sh.objs.get_mut_unindexed(a).replicas[0].state = ReplicaState::Demoting;
        sh.slots[0].as_mut().unwrap().demoting += demoting_extent(1000);
        let e = sh.check_invariants().unwrap_err();
        assert!(e.contains("eviction index"), "{e}");
    }

    #[test]
    fn an_eviction_index_that_misses_a_soft_pin_is_reported() {
        let mut sh = shard_with_objects();
        let a = id(&sh, b"a");
        sh.objs.get_mut_unindexed(a).stored_mut().pin_end_ms = 60_000;
        let e = sh.check_invariants().unwrap_err();
        assert!(e.contains("soft pins"), "{e}");
    }

    #[test]
    fn the_eviction_index_follows_changes_made_through_update() {
        let mut sh = shard_with_objects();
        let a = id(&sh, b"a");
        sh.objs.update(a, |o| o.extend_lease(60_000));
        sh.objs.update(a, |o| o.stored_mut().pin_end_ms = 90_000);
        sh.objs
            .update(a, |o| o.replicas[0].state = ReplicaState::Promoting);
        sh.check_invariants().expect("kept in step");
        sh.objs
            .update(a, |o| o.replicas[0].state = ReplicaState::Ready);
        sh.check_invariants().expect("kept in step");
    }

    #[test]
    fn victims_come_in_rank_order_and_ended_pins_move_over_when_swept() {
        let mut sh = shard_with_a_segment();
        let ttl = sh.cfg.lease_ttl_ms;
        let put = |sh: &mut ShardState, k: &[u8], pin_ms: u64, now: u64| {
            let opts = PutOptions {
                soft_pin_ttl_ms: pin_ms,
                ..PutOptions::default()
            };
            sh.put_start(1, k, 64, &opts, now).unwrap();
            sh.put_end(1, k, 0, None, now).unwrap();
        };
        put(&mut sh, b"pinned-long", 10 * ttl, 1);
        put(&mut sh, b"pinned-short", ttl + 100, 2);
        put(&mut sh, b"plain-late", 0, 5);
        put(&mut sh, b"plain-early", 0, 3);
        put(&mut sh, b"read", 0, 4);
        sh.get_replica_list(b"read", 6).unwrap(); // lease to 6 + lease_ttl
                                                  // A put is a use: within a lease of its put (or of a read) nothing
                                                  // is taken from a range without an NVMe tier.
        let mut budget = usize::MAX;
        sh.objs.sweep_pins(50, &mut budget);
        assert_eq!(sh.objs.first_victim(0, 50), None);
        let mut order = Vec::new();
        let now = 50 + ttl;
        let mut budget = usize::MAX;
        assert!(sh.objs.sweep_pins(now, &mut budget));
        while let Some(v) = sh.objs.first_victim(0, now) {
            order.push(sh.objs.key(v).to_vec());
            let r = sh.objs.update(v, |o| o.replicas.remove(0));
            sh.slots[0].as_mut().unwrap().alloc.dealloc(r.offset, 64);
            sh.objs.remove(v);
            sh.check_invariants().expect("kept in step");
        }
        // Unpinned by rank (a lease after the put, or after the read), then
        // soft-pinned by rank.
        let want: Vec<&[u8]> = vec![
            b"plain-early",
            b"plain-late",
            b"read",
            b"pinned-long",
            b"pinned-short",
        ];
        assert_eq!(order, want);

        // A pin that ends moves over only when swept, one per unit of budget.
        put(&mut sh, b"p1", 10, 100 + ttl);
        put(&mut sh, b"p2", 10, 100 + ttl);
        put(&mut sh, b"plain", 0, 150 + ttl);
        let now = 200 + 2 * ttl;
        let mut budget = 1;
        assert!(!sh.objs.sweep_pins(now, &mut budget), "two pins ended");
        sh.check_invariants().expect("kept in step");
        let mut budget = 1;
        assert!(sh.objs.sweep_pins(now, &mut budget));
        // Both pins ended: the two (ties by id) rank before the later put.
        let first = sh.objs.key(sh.objs.first_victim(0, now).unwrap());
        assert!(first == b"p1" || first == b"p2", "{first:?}");
    }
}
