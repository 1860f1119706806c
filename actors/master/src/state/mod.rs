//! One master shard's metadata, as a pure state machine.
//!
//! Here: the shard, its segments and the object calls. Beside it: `space`
//! (placement, deferred frees, eviction), `tier` (node tasks, NVMe tier
//! reports, owed Drops, listed tiers), `durable` (the state directory's
//! records, snapshots, recovery), `tests`. One `ShardState`, impl blocks by
//! subject.
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
use kvpool_wire::auth::{ClusterKey, Grant, GrantOp};
use kvpool_wire::proto::{
    ClientId, ItemResult, MasterRequest, MasterResponse, NodeTask, NvmeUpdate, ObjectInfo, PutItem,
    PutOptions, ReplicaDesc, SegmentId, SegmentSpec, Tier,
};
use kvpool_wire::{ErrorCode, KvError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smallvec::SmallVec;

use super::journal::{self, Hold, Image, ObjectRec};
use super::objects::{
    Complete, Id, KeyHashBuilder, Object, Objects, Phase, Processing, Replica, ReplicaState,
};

use kvpool_config::{MasterConfig, Placement};

mod durable;
mod hot;
mod space;
mod tier;

pub use durable::SnapshotCursor;
use durable::*;
use tier::*;
pub use tier::{MAX_DETACHED_COPIES, MAX_TASKS_PER_SEGMENT};

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
    /// Hot-object replication (`hot.rs`): most DRAM replicas of a hot
    /// object (< 2: off), reads per window that make it hot, the window,
    /// and the fraction of the shard's DRAM extra replicas may hold.
    pub hot_replicas: u16,
    pub hot_reads: u16,
    pub hot_window_ms: u64,
    pub hot_budget: f64,
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
            hot_replicas: cfg.hot_replicas,
            hot_reads: cfg.hot_reads,
            hot_window_ms: cfg.hot_window_ms,
            hot_budget: cfg.hot_budget,
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

    /// A DRAM range placement may use for `size` bytes now: not draining,
    /// not suspect, a free extent that fits.
    fn takes(&self, size: u64) -> bool {
        self.tier() == Tier::Dram
            && !self.draining
            && !self.suspect
            && self.alloc.largest_free() >= self.alloc.rounded(size)
    }

    /// The fraction of this shard's range that is free.
    fn free_ratio(&self) -> f64 {
        self.alloc.free() as f64 / self.alloc.capacity().max(1) as f64
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
    /// Extra replicas of hot objects fetched (in place and readable).
    pub hot_copies: u64,
}

/// What one housekeeping pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TickReport {
    pub stale_discarded: u64,
    pub freed_bytes: u64,
    /// Puts placed with fewer replicas than they asked for (too few
    /// segments with room) since the last tick.
    pub fewer_replicas: u64,
    /// Promotions and fetches whose node did not report within
    /// `put_timeout_ms`: their ranges were given up.
    pub fills_expired: u64,
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
    /// Reads of complete objects in the current window (hot.rs).
    reads: hot::ReadCounts,
    /// Ranges being filled by a node (promotions, fetches), with the time
    /// their report is due by (hot.rs).
    filling: hot::Filling,
    /// Extra replicas fetched since start.
    hot_copies: u64,
    /// Turns the DRAM replicas of a read of an object whose reads are not
    /// counted (hot replication on, the window's map full).
    spread: u32,
    /// Signs data-plane grants; `None` in an open cluster.
    signer: Option<GrantSigner>,
    /// The leader term grants carry (HA: set by the election, read at each
    /// signing; 0 without one). Shared with the master's fence.
    term: Arc<AtomicU64>,
    /// What the state directory needs (`None`: the master keeps no state
    /// directory).
    durable: Option<Box<Durable>>,
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

pub use kvpool_wire::proto::show_key;

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
            reads: hot::ReadCounts::default(),
            filling: hot::Filling::default(),
            hot_copies: 0,
            spread: 0,
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

    // ---- object calls (space and eviction: `space.rs`; node tasks and tier
    // reports: `tier.rs`; the state directory: `durable.rs`) -----------------------------------------------------

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
            let mut descs = describe(
                &self.slots,
                obj,
                self.signer.as_ref(),
                Access::Read {
                    until_ms: obj.stored().lease_end_ms,
                },
                self.term(),
            );
            if descs.first().is_some_and(|d| d.tier == Tier::Nvme) {
                self.count_nvme_read(id, now_ms);
            }
            if self.cfg.hot_replicas >= 2 {
                let n = self.count_read(id, now_ms);
                self.spread_reads(&mut descs, n);
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
        report.fills_expired = self.expire_fills(now_ms);
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
            hot_copies: self.hot_copies,
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
mod tests;
