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
//!                   |  \--PutRevoke (writer) --> gone, space free at once
//!                   \---- stale (put_timeout) or writer dead --> gone,
//!                         space quarantined for stale_put_grace
//!  Complete: GetReplicaList extends the read lease; space of a removed
//!  object is freed only when its lease has ended (forced removal defers it).
//!
//!  Replace (PutStart with `replace` of a complete key): the new object is
//!  Processing beside the complete one, which readers still get; its PutEnd
//!  retires the old object as a forced Remove would and puts the new one in
//!  its place in the same step; a revoked or stale replace leaves the old.
//! ```
//!
//! Processing objects live in their own (small) map, so the housekeeping
//! sweep for stale puts scans only puts in flight, not the whole pool. A
//! key may be in both maps at once only while a replace of it is Processing.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
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
use std::hash::{BuildHasher, Hasher};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Hashes keys with one-shot xxh3 (a key is hashed by a single `write`),
/// seeded per shard at random so clients cannot aim at collisions.
#[derive(Debug, Clone, Copy)]
pub struct KeyHashBuilder(u64);

/// See [`KeyHashBuilder`].
pub struct KeyHasher(u64);

impl BuildHasher for KeyHashBuilder {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(self.0)
    }
}

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxh3_64_with_seed(bytes, self.0);
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (self.0 ^ n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

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
}

/// Tasks queued for one segment's node, at most.
pub const MAX_TASKS_PER_SEGMENT: usize = 16_384;

/// Signs data-plane grants (when the cluster has a secret).
#[derive(Debug, Clone)]
pub struct GrantSigner {
    pub key: ClusterKey,
    /// Unix time (ms) at `now_ms == 0` of the clock the state is driven by:
    /// grants expire in Unix time, which storage nodes can check.
    pub unix_at_zero_ms: u64,
}

impl GrantSigner {
    fn sign(&self, op: GrantOp, r: &ReplicaDesc, expires_now_ms: u64) -> Grant {
        self.key.grant(
            op,
            r.segment_id,
            r.offset,
            r.len,
            self.unix_at_zero_ms.saturating_add(expires_now_ms),
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
}

impl SegmentSlot {
    fn tier(&self) -> Tier {
        self.spec.tier
    }
}

/// Where one replica lies: a slot index (into `ShardState::slots`) and offset.
#[derive(Debug, Clone, Copy)]
struct Replica {
    slot: u32,
    state: ReplicaState,
    /// DRAM: offset in the segment. NVMe: the packed location.
    offset: u64,
}

/// A replica's life: `Promoting -> Ready` (or dropped if the copy failed),
/// `Ready -> Demoting -> dropped` (once its NVMe copy is in, or the copy
/// failed and the eviction goes ahead without it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum ReplicaState {
    /// Readable; may be evicted.
    Ready,
    /// A promotion is copying the bytes in from NVMe: not readable yet.
    Promoting,
    /// An eviction is copying the bytes out to NVMe: readable, not evicted
    /// again; its space counts as on its way out.
    Demoting,
}

impl Replica {
    fn dram(slot: u32, offset: u64) -> Self {
        Self::ready(slot, offset)
    }

    fn ready(slot: u32, offset: u64) -> Self {
        Self {
            slot,
            state: ReplicaState::Ready,
            offset,
        }
    }
}

/// Debug builds check the space invariants after every tick of a shard
/// with at most this many objects (the check is O(objects)).
#[cfg(debug_assertions)]
const DEBUG_CHECK_MAX_KEYS: u64 = 100_000;

const HARD_PIN: u8 = 1;
/// `Object::sum` holds the writer's checksum.
const HAS_SUM: u8 = 2;
/// Processing: the put was started with `replace` (it may stand beside a
/// complete object of the same key, which its PutEnd retires).
const REPLACE: u8 = 4;

/// One object's metadata. Kept small: the master holds tens of millions.
#[derive(Debug)]
struct Object {
    size: u64,
    /// Processing: when the put started. Complete: when the read lease ends
    /// (the completion time until the first GetReplicaList); eviction takes
    /// the smallest first ("oldest lease first").
    t: u64,
    /// Processing: the writer. Complete: when the soft pin ends (0: none).
    aux: u64,
    /// Soft-pin TTL asked for at PutStart, applied at PutEnd.
    soft_pin_ttl_ms: u32,
    flags: u8,
    /// Reads served from NVMe only since the last promotion decision.
    nvme_reads: u16,
    /// xxh3-64 of the value (when `HAS_SUM`): set by the writer at PutEnd,
    /// or by the tier's index for a recovered object.
    sum: u64,
    replicas: SmallVec<[Replica; 1]>,
}

/// `t` and `aux` hold different things while the object is Processing (in
/// `ShardState::processing`) and once Complete (in `complete`); the map an
/// object is in is its state, and these name each reading (an enum would add
/// 8 bytes to every object).
impl Object {
    /// Processing: when the put started.
    fn started_ms(&self) -> u64 {
        self.t
    }

    /// Processing: the client writing it.
    fn writer(&self) -> ClientId {
        self.aux
    }

    /// Complete: when the last read lease ends (the completion time until
    /// the first read).
    fn lease_end_ms(&self) -> u64 {
        self.t
    }

    /// Complete: when the soft pin ends (0: none).
    fn pin_end_ms(&self) -> u64 {
        self.aux
    }

    /// Processing -> Complete at `now_ms`: no lease yet, the soft pin asked
    /// for at PutStart starts now.
    fn complete_at(&mut self, now_ms: u64) {
        self.t = now_ms;
        self.aux = if self.soft_pin_ttl_ms > 0 {
            now_ms + self.soft_pin_ttl_ms as u64
        } else {
            0
        };
    }

    /// Complete: a read lease until at least `until_ms`.
    fn extend_lease(&mut self, until_ms: u64) {
        self.t = self.t.max(until_ms);
    }

    fn hard_pinned(&self) -> bool {
        self.flags & HARD_PIN != 0
    }

    fn checksum(&self) -> Option<u64> {
        (self.flags & HAS_SUM != 0).then_some(self.sum)
    }
}

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
    pub evicted: u64,
}

/// One master shard's state.
#[derive(Debug)]
pub struct ShardState {
    shard: u32,
    nr_shards: u32,
    cfg: ShardConfig,
    slots: Vec<Option<SegmentSlot>>,
    by_id: HashMap<SegmentId, u32>,
    complete: HashMap<Box<[u8]>, Object, KeyHashBuilder>,
    processing: HashMap<Box<[u8]>, Object, KeyHashBuilder>,
    pending: BinaryHeap<Reverse<PendingFree>>,
    rng: ChaCha8Rng,
    evictions: u64,
    evicted_bytes: u64,
    /// Work for storage nodes, by the segment whose node does it.
    tasks: HashMap<SegmentId, VecDeque<NodeTask>>,
    demotions: u64,
    promotions: u64,
    /// Signs data-plane grants; `None` in an open cluster.
    signer: Option<GrantSigner>,
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
                    (Access::Write { until_ms }, _) => s.sign(GrantOp::Write, &d, until_ms),
                    (Access::Read { until_ms }, Tier::Dram) => s.sign(GrantOp::Read, &d, until_ms),
                    (Access::Read { until_ms }, Tier::Nvme) => {
                        s.sign(GrantOp::ReadNvme, &d, until_ms)
                    }
                };
            }
            d
        })
        .collect();
    v.sort_by_key(|r| r.tier == Tier::Nvme);
    v
}

/// Whether `obj` has a readable NVMe replica.
/// The space a demotion frees: the object's extent as segments round it.
fn demoting_extent(size: u64) -> u64 {
    size.max(1).next_multiple_of(SEGMENT_ALIGN)
}

fn has_nvme(slots: &[Option<SegmentSlot>], obj: &Object) -> bool {
    obj.replicas.iter().any(|r| {
        r.state != ReplicaState::Promoting
            && slots[r.slot as usize]
                .as_ref()
                .is_some_and(|s| s.tier() == Tier::Nvme)
    })
}

/// Candidates with the same class and lease end go together; a total order
/// over (class, lease end) picks victims.
type EvictRank = (u8, u64);

impl ShardState {
    pub fn new(shard: u32, nr_shards: u32, cfg: ShardConfig, seed: u64) -> Self {
        assert!(shard < nr_shards);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (shard as u64).wrapping_mul(0x9e37_79b9));
        let hash = KeyHashBuilder(rng.random());
        Self {
            shard,
            nr_shards,
            cfg,
            slots: Vec::new(),
            by_id: HashMap::new(),
            complete: HashMap::with_hasher(hash),
            processing: HashMap::with_hasher(hash),
            pending: BinaryHeap::new(),
            rng,
            evictions: 0,
            evicted_bytes: 0,
            tasks: HashMap::new(),
            demotions: 0,
            promotions: 0,
            signer: None,
        }
    }

    /// Signs data-plane grants with `signer` from now on (a cluster secret).
    pub fn with_signer(mut self, signer: Option<GrantSigner>) -> Self {
        self.signer = signer;
        self
    }

    pub fn key_count(&self) -> u64 {
        (self.complete.len() + self.processing.len()) as u64
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
    pub fn add_segment(&mut self, id: SegmentId, spec: Arc<SegmentSpec>, owner: ClientId) {
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
        self.by_id.insert(id, idx as u32);
    }

    /// Removes a segment and every replica on it; objects left with no replica
    /// are removed. Returns how many objects went. Idempotent.
    pub fn remove_segment(&mut self, id: SegmentId) -> u64 {
        let Some(idx) = self.by_id.remove(&id) else {
            return 0;
        };
        self.slots[idx as usize] = None;
        self.tasks.remove(&id);
        let mut gone = 0;
        for map in [&mut self.complete, &mut self.processing] {
            let before = map.len();
            map.retain(|_, o| {
                o.replicas.retain(|r| r.slot != idx);
                !o.replicas.is_empty()
            });
            gone += (before - map.len()) as u64;
        }
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

    fn free_now(&mut self, obj: &Object) {
        for r in &obj.replicas {
            self.free_replica_now(r, obj.size);
        }
    }

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
            self.pending.push(Reverse(PendingFree {
                at_ms,
                segment,
                slot: r.slot,
                offset: r.offset,
                size,
            }));
        }
    }

    /// Tells the nodes holding NVMe copies of a removed object to drop them.
    /// NVMe space is the node's: without this a copy would outlive its
    /// object, until NVMe eviction, and come back as `Recovered` when the
    /// node restarts. The task goes on the queue of the DRAM segment the
    /// tier is attached to, behind that node's Persist tasks, so the node
    /// sees the removal and a later put of the same key in the order they
    /// happened. With that queue full, the copy stays (logged).
    fn drop_nvme_copies(&mut self, key: &[u8], obj: &Object) {
        for r in &obj.replicas {
            let s = self.slot(r.slot);
            if s.tier() != Tier::Nvme {
                continue;
            }
            let nvme = s.id;
            let Some(dram) = self.slots.iter().flatten().find_map(|d| {
                d.spec
                    .nvme
                    .as_ref()
                    .is_some_and(|a| a.segment_id == nvme)
                    .then_some(d.id)
            }) else {
                continue; // the node's DRAM segment is gone: nobody to ask
            };
            let q = self.tasks.entry(dram).or_default();
            if q.len() < MAX_TASKS_PER_SEGMENT {
                q.push_back(NodeTask::Drop {
                    key: key.to_vec(),
                    loc: r.offset,
                });
            } else {
                tracing::warn!(
                    key = %show_key(key),
                    "node task queue full: the removed object's NVMe copy stays until evicted"
                );
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
    fn discard_processing(&mut self, key: &[u8], now_ms: u64) {
        if let Some(obj) = self.processing.remove(key) {
            let at = now_ms.saturating_add(self.cfg.stale_put_grace_ms);
            self.free_at(&obj, at, now_ms);
        }
    }

    fn is_stale(&self, obj: &Object, now_ms: u64) -> bool {
        now_ms.saturating_sub(obj.started_ms()) >= self.cfg.put_timeout_ms
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

    /// Evicts replicas in slot `idx` until `target` bytes are freed (or will
    /// be, once scheduled demotions land) or no candidate is left.
    /// Candidates: complete, lease ended, not hard-pinned, not already being
    /// demoted; unpinned before soft-pinned, oldest lease first. A victim
    /// with an NVMe copy loses its DRAM replica at once; one whose node has an
    /// NVMe tier is demoted (copied there first); others are dropped.
    /// Returns the bytes freed now.
    fn evict_slot(&mut self, idx: u32, target: u64, now_ms: u64) -> u64 {
        let rank = |o: &Object| -> Option<EvictRank> {
            if o.lease_end_ms() > now_ms
                || o.hard_pinned()
                || !o
                    .replicas
                    .iter()
                    .any(|r| r.slot == idx && r.state == ReplicaState::Ready)
            {
                return None;
            }
            Some((u8::from(o.pin_end_ms() > now_ms), o.lease_end_ms()))
        };
        // Pass 1: the rank below which enough bytes lie (no key copies).
        let mut ranked: Vec<(EvictRank, u64)> = self
            .complete
            .values()
            .filter_map(|o| rank(o).map(|r| (r, o.size)))
            .collect();
        if ranked.is_empty() {
            return 0;
        }
        ranked.sort_unstable_by_key(|(r, _)| *r);
        let align = SEGMENT_ALIGN;
        let mut acc = 0u64;
        let mut cut = ranked.len();
        for (i, (_, size)) in ranked.iter().enumerate() {
            acc += size.max(&1).next_multiple_of(align);
            if acc >= target {
                cut = i + 1;
                break;
            }
        }
        let threshold = ranked[cut - 1].0;
        let quota_at_threshold = ranked[..cut]
            .iter()
            .filter(|(r, _)| *r == threshold)
            .count();
        // Pass 2: the victims' keys (ties at the threshold by map order).
        let mut victims: Vec<Box<[u8]>> = Vec::with_capacity(cut);
        let mut at_threshold = 0;
        for (k, o) in &self.complete {
            match rank(o) {
                Some(r) if r < threshold => victims.push(k.clone()),
                Some(r) if r == threshold && at_threshold < quota_at_threshold => {
                    at_threshold += 1;
                    victims.push(k.clone());
                }
                _ => {}
            }
        }
        let (seg_id, attach) = {
            let s = self.slot(idx);
            (s.id, s.spec.nvme.clone())
        };
        let mut freed = 0;
        for k in victims {
            let obj = self.complete.get(&k).expect("collected above");
            let size = obj.size;
            let pos = obj
                .replicas
                .iter()
                .position(|r| r.slot == idx && r.state == ReplicaState::Ready)
                .expect("ranked by having a replica here");
            let on_nvme = has_nvme(&self.slots, obj);
            let queue_room = self
                .tasks
                .get(&seg_id)
                .is_none_or(|q| q.len() < MAX_TASKS_PER_SEGMENT);
            if !on_nvme && attach.is_some() && queue_room {
                // Demote: the node copies it to NVMe, then the DRAM replica goes.
                let offset = obj.replicas[pos].offset;
                let checksum = obj.checksum();
                self.complete.get_mut(&k).expect("present").replicas[pos].state =
                    ReplicaState::Demoting;
                self.slot_mut(idx).demoting += demoting_extent(size);
                self.tasks
                    .entry(seg_id)
                    .or_default()
                    .push_back(NodeTask::Persist {
                        key: k.to_vec(),
                        dram: seg_id,
                        offset,
                        len: size,
                        demote: true,
                        checksum,
                    });
                continue;
            }
            let obj = self.complete.get_mut(&k).expect("present");
            let r = obj.replicas.remove(pos);
            if obj.replicas.is_empty() {
                self.complete.remove(&k);
            }
            let slot = self.slot_mut(idx);
            slot.alloc.dealloc(r.offset, size);
            let bytes = slot.alloc.rounded(size);
            freed += bytes;
            self.evictions += 1;
            self.evicted_bytes += bytes;
        }
        freed
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

    /// Evicts `eviction_ratio` of the slot's range if its use is past the
    /// high watermark.
    fn evict_if_high(&mut self, idx: u32, now_ms: u64) -> u64 {
        let s = self.slot(idx);
        let cap = s.alloc.capacity();
        if cap == 0 || (s.alloc.used() as f64) <= self.cfg.high_watermark * cap as f64 {
            return 0;
        }
        let has_tier = s.spec.nvme.is_some();
        // Space already on its way out (demotions) counts as freed.
        if has_tier {
            let left = s.alloc.used().saturating_sub(self.demoting_bytes(idx));
            if (left as f64) <= self.cfg.high_watermark * cap as f64 {
                return 0;
            }
        }
        let target = (self.cfg.eviction_ratio * cap as f64).ceil() as u64;
        self.evict_slot(idx, target, now_ms)
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
        describe(&self.slots, obj, None, Access::Describe)
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
        let exists = self.complete.contains_key(key);
        if exists && !opts.replace {
            return Err(err(
                ErrorCode::ObjectAlreadyExists,
                format!("key {} exists", show_key(key)),
            ));
        }
        if let Some(o) = self.processing.get(key) {
            if !self.is_stale(o, now_ms) {
                // Two replaces by different writers: one waits for the other
                // to end, then replaces its object (the last PutEnd wins).
                // One writer's second put of a key it is putting is a bug.
                return Err(if opts.replace && o.writer() != client {
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
            self.discard_processing(key, now_ms);
        }
        // A replace of a stored key adds no key in the end: the count does
        // not refuse it. Its Processing entry counts while it lasts (so at
        // most one replace per stored key stands beyond the limit).
        if !exists && self.key_count() >= self.cfg.max_keys {
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
            // Allocation failed: evict in every range that could hold the
            // object, then try once more.
            let idxs: Vec<u32> = self
                .slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| {
                    let s = s.as_ref()?;
                    (s.tier() == Tier::Dram
                        && !s.draining
                        && s.alloc.capacity() >= s.alloc.rounded(len))
                    .then_some(i as u32)
                })
                .collect();
            for &idx in &idxs {
                let cap = self.slot(idx).alloc.capacity();
                let target = ((self.cfg.eviction_ratio * cap as f64).ceil() as u64)
                    .max(self.slot(idx).alloc.rounded(len));
                self.evict_slot(idx, target, now_ms);
            }
            targets = self.place(len, want, &opts.preferred_host);
            if targets.is_empty() {
                // Space on its way out to the NVMe tier (demotions under
                // way) that would make room: the writer waits for it. Space
                // held by leases or quarantine is not counted: it may stay
                // held for longer than a put's deadline.
                let coming = idxs.iter().any(|&idx| {
                    let s = self.slot(idx);
                    let demoting = self.demoting_bytes(idx);
                    !s.suspect && demoting > 0 && s.alloc.free() + demoting >= s.alloc.rounded(len)
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
            return Err(err(
                ErrorCode::NoSpace,
                format!("no segment has room for {len} bytes, even after eviction"),
            ));
        }
        let mut replicas = SmallVec::new();
        for &idx in &targets {
            let offset = self
                .slot_mut(idx)
                .alloc
                .alloc(len)
                .expect("placement checked the largest free extent");
            replicas.push(Replica::dram(idx, offset));
        }
        let obj = Object {
            size: len,
            t: now_ms,
            aux: client,
            soft_pin_ttl_ms: opts.soft_pin_ttl_ms.min(u32::MAX as u64) as u32,
            flags: if opts.hard_pin { HARD_PIN } else { 0 }
                | if opts.replace { REPLACE } else { 0 },
            nvme_reads: 0,
            sum: 0,
            replicas,
        };
        let descs = describe(
            &self.slots,
            &obj,
            self.signer.as_ref(),
            Access::Write {
                until_ms: now_ms + self.cfg.put_timeout_ms,
            },
        );
        self.processing.insert(key.into(), obj);
        for idx in targets {
            self.evict_if_high(idx, now_ms);
        }
        Ok(descs)
    }

    /// The caller's own Processing object; a stale one is discarded first.
    fn own_processing(&mut self, client: ClientId, key: &[u8], now_ms: u64) -> Result<(), KvError> {
        self.check_key(key)?;
        let Some(obj) = self.processing.get(key) else {
            return Err(if self.complete.contains_key(key) {
                err(
                    ErrorCode::ObjectAlreadyExists,
                    format!("key {} is already complete", show_key(key)),
                )
            } else {
                not_found(key)
            });
        };
        if obj.writer() != client {
            return Err(err(
                ErrorCode::IllegalClient,
                format!("key {} is being put by another client", show_key(key)),
            ));
        }
        if self.is_stale(obj, now_ms) {
            self.discard_processing(key, now_ms);
            return Err(err(
                ErrorCode::ObjectNotFound,
                format!(
                    "the put of {} took over put_timeout_ms ({}) and was discarded",
                    show_key(key),
                    self.cfg.put_timeout_ms
                ),
            ));
        }
        Ok(())
    }

    /// Completes a put; `checksum` is what the writer computed over the
    /// bytes it wrote (readers check it).
    pub fn put_end(
        &mut self,
        client: ClientId,
        key: &[u8],
        checksum: Option<u64>,
        now_ms: u64,
    ) -> Result<(), KvError> {
        self.own_processing(client, key, now_ms)?;
        let (k, mut obj) = self.processing.remove_entry(key).expect("checked above");
        if let Some(sum) = checksum {
            obj.sum = sum;
            obj.flags |= HAS_SUM;
        }
        obj.complete_at(now_ms);
        // A replace: the object it replaces goes now, as a forced Remove
        // would take it (its space waits for its readers' lease, its NVMe
        // copies are dropped before the new object's copy is asked for).
        if let Some(old) = self.complete.remove(&k) {
            debug_assert!(
                obj.flags & REPLACE != 0,
                "only a replace meets a complete key"
            );
            self.retire(&k, &old, now_ms);
        }
        obj.flags &= !REPLACE;
        // Write-through: the first replica on a node with an NVMe tier is
        // copied there now (the node does it when it next asks for work).
        let through = obj.replicas.iter().find_map(|r| {
            let s = self.slot(r.slot);
            match &s.spec.nvme {
                Some(a) if a.write_through => Some((s.id, r.offset)),
                _ => None,
            }
        });
        if let Some((seg, offset)) = through {
            let q = self.tasks.entry(seg).or_default();
            if q.len() < MAX_TASKS_PER_SEGMENT {
                q.push_back(NodeTask::Persist {
                    key: k.to_vec(),
                    dram: seg,
                    offset,
                    len: obj.size,
                    demote: false,
                    checksum: obj.checksum(),
                });
            }
        }
        self.complete.insert(k, obj);
        Ok(())
    }

    pub fn put_revoke(&mut self, client: ClientId, key: &[u8], now_ms: u64) -> Result<(), KvError> {
        self.own_processing(client, key, now_ms)?;
        let obj = self.processing.remove(key).expect("checked above");
        // The writer says it is done with the space: free it at once.
        self.free_now(&obj);
        Ok(())
    }

    /// The object's replicas; grants a read lease until `now + lease_ttl`.
    pub fn get_replica_list(
        &mut self,
        key: &[u8],
        now_ms: u64,
    ) -> Result<Vec<ReplicaDesc>, KvError> {
        self.check_key(key)?;
        if let Some(obj) = self.complete.get_mut(key) {
            obj.extend_lease(now_ms + self.cfg.lease_ttl_ms);
            let descs = describe(
                &self.slots,
                obj,
                self.signer.as_ref(),
                Access::Read {
                    until_ms: obj.lease_end_ms(),
                },
            );
            if descs.first().is_some_and(|d| d.tier == Tier::Nvme) {
                self.count_nvme_read(key, now_ms);
            }
            return Ok(descs);
        }
        match self.processing.get(key) {
            Some(o) if self.is_stale(o, now_ms) => {
                self.discard_processing(key, now_ms);
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
    fn count_nvme_read(&mut self, key: &[u8], now_ms: u64) {
        let n = self.cfg.promote_after_reads;
        let Some(obj) = self.complete.get_mut(key) else {
            return;
        };
        obj.nvme_reads = obj.nvme_reads.saturating_add(1);
        if n == 0
            || obj.nvme_reads < n
            || obj
                .replicas
                .iter()
                .any(|r| r.state == ReplicaState::Promoting)
        {
            return;
        }
        obj.nvme_reads = 0;
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
        let checksum = self.complete.get(key).and_then(Object::checksum);
        let dram = self.slot(idx).id;
        let q = self.tasks.entry(nvme_seg).or_default();
        if q.len() >= MAX_TASKS_PER_SEGMENT {
            self.slot_mut(idx).alloc.dealloc(offset, size);
            return;
        }
        q.push_back(NodeTask::Promote {
            key: key.to_vec(),
            loc: nvme.offset,
            dram,
            offset,
            len: size,
            checksum,
        });
        let obj = self.complete.get_mut(key).expect("present");
        obj.replicas.push(Replica {
            slot: idx,
            state: ReplicaState::Promoting,
            offset,
        });
        let _ = now_ms;
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
            let Some(q) = self.tasks.get_mut(seg) else {
                continue;
            };
            while out.len() < max {
                match q.pop_front() {
                    Some(t) => out.push(t),
                    None => break,
                }
            }
        }
        Ok(out)
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
                let obj = self
                    .complete
                    .get_mut(key.as_slice())
                    .filter(|o| o.size == *len);
                let Some(obj) = obj else {
                    return Err(not_found(key));
                };
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
                    None => obj.replicas.push(Replica {
                        slot: nslot,
                        state: ReplicaState::Ready,
                        offset: *loc,
                    }),
                }
                if let Some(pos) = pos {
                    let was = (obj.replicas[pos].state == ReplicaState::Demoting)
                        .then_some((obj.replicas[pos].slot, obj.size));
                    if *demote {
                        let r = obj.replicas.remove(pos);
                        let (size, lease_end) = (obj.size, obj.lease_end_ms());
                        self.demotions += 1;
                        self.evict_dram_replica(r, size, lease_end, now_ms);
                    } else {
                        obj.replicas[pos].state = ReplicaState::Ready;
                    }
                    if let Some((idx, size)) = was {
                        self.demotion_over(idx, size);
                    }
                }
                Ok(())
            }
            NvmeUpdate::PersistFailed {
                key,
                dram,
                offset,
                demote,
            } => {
                let dslot = self.owned_slot(client, *dram, Tier::Dram)?;
                let obj = self
                    .complete
                    .get_mut(key.as_slice())
                    .ok_or_else(|| not_found(key))?;
                let Some(pos) = obj.replicas.iter().position(|r| {
                    r.slot == dslot && r.offset == *offset && r.state == ReplicaState::Demoting
                }) else {
                    return Ok(());
                };
                let size = obj.size;
                if !*demote {
                    obj.replicas[pos].state = ReplicaState::Ready;
                    self.demotion_over(dslot, size);
                    return Ok(());
                }
                // The eviction goes ahead without an NVMe copy.
                let r = obj.replicas.remove(pos);
                let lease_end = obj.lease_end_ms();
                if obj.replicas.is_empty() {
                    self.complete.remove(key.as_slice());
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
                let obj = self
                    .complete
                    .get_mut(key.as_slice())
                    .ok_or_else(|| not_found(key))?;
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
                    obj.replicas[pos].state = ReplicaState::Ready;
                    self.promotions += 1;
                } else {
                    let r = obj.replicas.remove(pos);
                    let size = obj.size;
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
                if let Some(obj) = self.complete.get_mut(key.as_slice()) {
                    obj.replicas
                        .retain(|r| !(r.slot == nslot && r.offset == *loc));
                    if obj.replicas.is_empty() {
                        self.complete.remove(key.as_slice());
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
                match self.complete.get_mut(key.as_slice()) {
                    Some(o) if o.size != *len || o.checksum().is_some_and(|s| s != *sum) => {
                        Err(err(
                            ErrorCode::ObjectAlreadyExists,
                            "a different object is stored under this key now",
                        ))
                    }
                    Some(o) => {
                        o.replicas.retain(|r| r.slot != nslot);
                        o.replicas.push(Replica {
                            slot: nslot,
                            state: ReplicaState::Ready,
                            offset: *loc,
                        });
                        Ok(())
                    }
                    // A put of the key under way (a replace of a complete
                    // key is the arm above: its copy is the complete one's).
                    None if self.processing.contains_key(key.as_slice()) => {
                        Err(err(ErrorCode::ObjectAlreadyExists, "the key is being put"))
                    }
                    None => {
                        if self.key_count() >= self.cfg.max_keys {
                            return Err(err(
                                ErrorCode::ResourceExhausted,
                                "the pool holds its maximum of keys",
                            ));
                        }
                        self.complete.insert(
                            key.as_slice().into(),
                            Object {
                                size: *len,
                                t: now_ms,
                                aux: 0,
                                soft_pin_ttl_ms: 0,
                                flags: HAS_SUM,
                                nvme_reads: 0,
                                sum: *sum,
                                replicas: smallvec::smallvec![Replica {
                                    slot: nslot,
                                    state: ReplicaState::Ready,
                                    offset: *loc,
                                }],
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
        Ok(self.complete.contains_key(key))
    }

    pub fn remove(&mut self, key: &[u8], force: bool, now_ms: u64) -> Result<(), KvError> {
        self.check_key(key)?;
        let Some(obj) = self.complete.get(key) else {
            return Err(match self.processing.get(key) {
                Some(o) if !self.is_stale(o, now_ms) => err(
                    ErrorCode::ReplicaNotReady,
                    format!("key {} is still being put", show_key(key)),
                ),
                Some(_) => {
                    self.discard_processing(key, now_ms);
                    not_found(key)
                }
                None => not_found(key),
            });
        };
        if obj.lease_end_ms() > now_ms && !force {
            return Err(err(
                ErrorCode::ObjectHasLease,
                format!(
                    "key {} is leased to a reader for {} ms more (remove with force to override)",
                    show_key(key),
                    obj.lease_end_ms() - now_ms
                ),
            ));
        }
        let obj = self.complete.remove(key).expect("present");
        self.retire(key, &obj, now_ms);
        Ok(())
    }

    /// A complete object taken out of `complete` (removed, or replaced by a
    /// new one) lets go of everything: its demotions under way stop
    /// counting, its NVMe copies are dropped, and its DRAM space is freed
    /// once its readers' lease is over (and any copy a node may be making
    /// of it, see `free_at`).
    fn retire(&mut self, key: &[u8], obj: &Object, now_ms: u64) {
        self.demotions_over(obj);
        self.drop_nvme_copies(key, obj);
        self.free_at(obj, obj.lease_end_ms(), now_ms);
    }

    /// Removes every complete object that has no live lease (with `force`,
    /// every complete object: a leased one's space is freed when its lease
    /// ends, as a forced remove does); returns the count.
    pub fn remove_all(&mut self, now_ms: u64, force: bool) -> u64 {
        let keys: Vec<Box<[u8]>> = self
            .complete
            .iter()
            .filter(|(_, o)| force || o.lease_end_ms() <= now_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &keys {
            let obj = self.complete.remove(k).expect("present");
            self.retire(k, &obj, now_ms);
        }
        keys.len() as u64
    }

    /// Revokes every Processing put of a client that is gone.
    pub fn revoke_client(&mut self, client: ClientId, now_ms: u64) -> u64 {
        let keys: Vec<Box<[u8]>> = self
            .processing
            .iter()
            .filter(|(_, o)| o.writer() == client)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &keys {
            self.discard_processing(k, now_ms);
        }
        keys.len() as u64
    }

    pub fn describe(&self, key: &[u8], now_ms: u64) -> Result<ObjectInfo, KvError> {
        self.check_key(key)?;
        if let Some(o) = self.complete.get(key) {
            return Ok(ObjectInfo {
                key: key.to_vec(),
                complete: true,
                size: o.size,
                replicas: self.describe_replicas(o),
                lease_remaining_ms: o.lease_end_ms().saturating_sub(now_ms),
                soft_pin_remaining_ms: o.pin_end_ms().saturating_sub(now_ms),
                hard_pin: o.hard_pinned(),
            });
        }
        match self.processing.get(key) {
            Some(o) => Ok(ObjectInfo {
                key: key.to_vec(),
                complete: false,
                size: o.size,
                replicas: self.describe_replicas(o),
                lease_remaining_ms: 0,
                soft_pin_remaining_ms: 0,
                hard_pin: o.hard_pinned(),
            }),
            None => Err(not_found(key)),
        }
    }

    /// Housekeeping: frees what has waited long enough, discards stale puts,
    /// evicts in ranges past the high watermark.
    pub fn tick(&mut self, now_ms: u64) -> TickReport {
        let mut report = TickReport::default();
        let stale: Vec<Box<[u8]>> = self
            .processing
            .iter()
            .filter(|(_, o)| self.is_stale(o, now_ms))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &stale {
            self.discard_processing(k, now_ms);
        }
        report.stale_discarded = stale.len() as u64;
        report.freed_bytes = self.release_due(now_ms);
        let before = self.evictions;
        for idx in 0..self.slots.len() as u32 {
            if self.slots[idx as usize].is_some() {
                report.freed_bytes += self.evict_if_high(idx, now_ms);
            }
        }
        report.evicted = self.evictions - before;
        #[cfg(debug_assertions)]
        if self.key_count() <= DEBUG_CHECK_MAX_KEYS {
            if let Err(e) = self.check_invariants() {
                panic!("master shard {}: {e}", self.shard);
            }
        }
        report
    }

    /// Checks the shard's space accounting; the first broken rule, named.
    /// For every DRAM segment: its allocator's used bytes equal the extents
    /// of the replicas (complete and processing objects, promotions being
    /// copied in, demotions under way) plus the extents waiting to be freed
    /// (leased removals, quarantined puts); no two of those extents overlap
    /// (so a leased object's space is never handed out again) and each lies
    /// in this shard's range; every replica points at a mounted segment; a
    /// key is both complete and Processing only while a replace of it is.
    /// O(objects): the model test runs it after every step, debug builds
    /// after every tick of a small shard.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut extents: HashMap<u32, Vec<(u64, u64, String)>> = HashMap::new();
        let mut demoting: HashMap<u32, u64> = HashMap::new();
        for o in self.complete.values() {
            for r in &o.replicas {
                if r.state == ReplicaState::Demoting {
                    *demoting.entry(r.slot).or_default() += demoting_extent(o.size);
                }
            }
        }
        for (k, o) in &self.processing {
            if o.flags & REPLACE == 0 && self.complete.contains_key(k) {
                return Err(format!(
                    "{} is complete and being put by a put that is not a replace",
                    show_key(k)
                ));
            }
        }
        for (state, map) in [
            ("complete", &self.complete),
            ("processing", &self.processing),
        ] {
            for (k, o) in map.iter() {
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

    /// Distinct keys: a key being replaced is in both maps, and counts once.
    fn distinct_keys(&self) -> u64 {
        let replacing = self
            .processing
            .keys()
            .filter(|k| self.complete.contains_key(&k[..]))
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
                checksum,
            } => {
                self.put_end(client_id, &key, checksum, now_ms)?;
                MasterResponse::Done
            }
            R::PutRevoke { client_id, key } => {
                self.put_revoke(client_id, &key, now_ms)?;
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
            R::BatchPutEnd { client_id, items } => MasterResponse::BatchDone(
                items
                    .iter()
                    .map(|i| self.put_end(client_id, &i.key, i.checksum, now_ms).into())
                    .collect(),
            ),
            R::BatchPutRevoke { client_id, keys } => MasterResponse::BatchDone(
                keys.iter()
                    .map(|k| self.put_revoke(client_id, k, now_ms).into())
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
            } => MasterResponse::Tasks(self.node_tasks(client_id, &segments, max as usize)?),
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

    fn shard_with_objects() -> ShardState {
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
        sh.add_segment(9, Arc::new(spec), 1);
        for k in [&b"a"[..], b"b", b"c"] {
            sh.put_start(1, k, 1000, &PutOptions::default(), 0).unwrap();
            sh.put_end(1, k, None, 0).unwrap();
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
        let off = sh.complete.get(&b"a"[..]).unwrap().replicas[0].offset;
        sh.slots[0].as_mut().unwrap().alloc.dealloc(off, 1000);
        let e = sh.check_invariants().unwrap_err();
        assert!(e.contains("in use"), "{e}");
    }

    #[test]
    fn two_objects_on_one_extent_are_reported() {
        let mut sh = shard_with_objects();
        let off_a = sh.complete.get(&b"a"[..]).unwrap().replicas[0].offset;
        let off_b = sh.complete.get(&b"b"[..]).unwrap().replicas[0].offset;
        // b now claims a's bytes; its own extent is released so the total
        // still adds up: only the overlap is wrong.
        sh.slots[0].as_mut().unwrap().alloc.dealloc(off_b, 1000);
        sh.complete.get_mut(&b"b"[..]).unwrap().replicas[0].offset = off_a;
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
}
