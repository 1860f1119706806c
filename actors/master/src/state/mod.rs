//! One master shard's metadata, as a pure state machine.
//!
//! Here: `ShardState`, the gets, removals, ticks and the request dispatch,
//! coordinating its parts, each with its own invariant check:
//! `segments` (the mounted segments' slots, mounts and unmounts), `puts`
//! (a put's start, end and revoke), `space` (placement, deferred frees,
//! eviction, the extents' accounting), `copies` (the copy book of NVMe
//! tiers: owed Drops, listed and adopted tiers, detached copies), `tier`
//! (node tasks, NVMe tier reports), `hot` (extra replicas of hot objects),
//! `durable` (the state directory's records, snapshots, recovery), and the
//! object store itself (`objects::Objects`). One `ShardState`,
//! impl blocks by subject; `tests`.
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
//! Objects are stored once, in `objects::Objects`: a slab with a
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
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use kvpool_storage::alloc::RangeAllocator;
use kvpool_storage::segment::SEGMENT_ALIGN;
use kvpool_wire::auth::{ClusterKey, Grant, GrantOp};
use kvpool_wire::proto::{
    ClientId, DropTask, ItemResult, MasterRequest, MasterResponse, NodeTask, NvmeUpdate,
    ObjectInfo, PersistTask, PromoteTask, PutItem, PutOptions, ReplicaDesc, SegmentId, SegmentSpec,
    Tier,
};
use kvpool_wire::{ErrorCode, KvError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smallvec::SmallVec;

use super::journal::{self, Hold, Image, ObjectRec, Record, SegmentState};
use super::objects::{
    Complete, Id, KeyHashBuilder, Map, Object, Objects, Phase, Processing, Replica, ReplicaState,
};

use kvpool_config::{MasterConfig, Placement};

mod copies;
mod durable;
mod hot;
mod limits;
mod puts;
mod segments;
mod space;
mod tier;

use segments::SegmentSlot;

pub use durable::SnapshotCursor;
use durable::*;
pub use limits::*;
use tier::*;

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

/// Debug builds check the space invariants after every tick of a shard
/// with at most this many objects (the check is O(objects)).
#[cfg(debug_assertions)]
const DEBUG_CHECK_MAX_KEYS: u64 = 100_000;

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
    /// (segment, capacity of this shard's range, used in it, draining)
    pub segments: Vec<(SegmentId, u64, u64, bool)>,
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
    by_id: Map<SegmentId, u32>,
    objs: Objects,
    pending: BinaryHeap<Reverse<PendingFree>>,
    rng: ChaCha8Rng,
    evictions: u64,
    evicted_bytes: u64,
    /// Puts placed with fewer replicas than asked since the last tick.
    fewer_replicas: u64,
    /// Work for storage nodes, by the segment whose node does it.
    tasks: Map<SegmentId, TaskQueue>,
    /// The copy book of NVMe tiers: owed Drops, listed and adopted tiers,
    /// copies detached with a tier (copies.rs).
    copies: copies::Copies,
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
    /// The epoch of the versions this shard hands out (below 2^32, never
    /// 0): drawn at random, or the one after the state directory's.
    epoch: u64,
    /// Versions handed out in this epoch.
    versions: u32,
    /// The earliest epoch of this shard's lineage (its state directory's
    /// first, or its own without one): versions of epochs
    /// `first_epoch..=epoch` were handed out by this shard or a master
    /// before it on its directory.
    first_epoch: u64,
}

/// The highest epoch drawn at random (by a shard without a state directory
/// or on an empty one): half the range is left for the epochs after it.
const FIRST_EPOCH_MAX: u64 = 1 << 31;

/// Mixed into the shard's seed for its first epoch.
const EPOCH_SEED: u64 = 0x6570_6f63_6873_6565;

/// The epoch after `e`, in `1..2^32` (wrapping after 2^32 - 1 epochs).
fn following_epoch(e: u64) -> u64 {
    e % u64::from(u32::MAX) + 1
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
        // Its own generator: placement's draws stay as they were.
        let epoch = ChaCha8Rng::seed_from_u64(seed ^ EPOCH_SEED ^ shard as u64)
            .random_range(1..=FIRST_EPOCH_MAX);
        Self {
            shard,
            nr_shards,
            cfg,
            slots: Vec::new(),
            by_id: Map::default(),
            objs: Objects::new(hash),
            pending: BinaryHeap::new(),
            rng,
            evictions: 0,
            evicted_bytes: 0,
            fewer_replicas: 0,
            tasks: Map::default(),
            copies: copies::Copies::default(),
            demotions: 0,
            promotions: 0,
            reads: hot::ReadCounts::default(),
            filling: hot::Filling::default(),
            hot_copies: 0,
            spread: 0,
            signer: None,
            term: Arc::new(AtomicU64::new(0)),
            durable: None,
            epoch,
            versions: 0,
            first_epoch: epoch,
        }
    }

    /// Begins `epoch`: versions count from 1 again, and a durable shard
    /// records it.
    fn begin_epoch(&mut self, epoch: u64) {
        debug_assert!((1..=u64::from(u32::MAX)).contains(&epoch));
        self.epoch = epoch;
        self.versions = 0;
        if let Some(d) = self.durable.as_mut() {
            d.epoch = Some(epoch);
        }
    }

    /// Whether `version` was handed out by this shard's lineage (this
    /// master, or one before it on its state directory): a copy carrying it
    /// that no object holds is an old one (its object was removed or
    /// replaced), not one to adopt.
    pub(super) fn issued(&self, version: u64) -> bool {
        let (e, n) = (version >> 32, version & u64::from(u32::MAX));
        n != 0
            && (self.first_epoch..=self.epoch).contains(&e)
            && (e < self.epoch || n <= u64::from(self.versions))
    }

    /// The version of a new object incarnation: `epoch << 32 | n`, never 0,
    /// never handed out before by this shard (a restart on the state
    /// directory begins a later epoch; without one, a random epoch).
    fn next_version(&mut self) -> u64 {
        if self.versions == u32::MAX {
            self.begin_epoch(following_epoch(self.epoch));
        }
        self.versions += 1;
        self.epoch << 32 | u64::from(self.versions)
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

    /// Extends object `id`'s read lease to at least `now + lease_ttl`; its
    /// replicas, with read grants to the lease's end.
    pub(super) fn lease_for_read(&mut self, id: Id, now_ms: u64) -> Vec<ReplicaDesc> {
        let until_ms = now_ms + self.cfg.lease_ttl_ms;
        if self.objs.get(id).stored().lease_end_ms < until_ms {
            self.objs.update(id, |o| o.extend_lease(until_ms));
        }
        let obj = self.objs.get(id);
        describe(
            &self.slots,
            obj,
            self.signer.as_ref(),
            Access::Read {
                until_ms: obj.stored().lease_end_ms,
            },
            self.term(),
        )
    }

    /// The object's replicas; grants a read lease until `now + lease_ttl`.
    pub fn get_replica_list(
        &mut self,
        key: &[u8],
        now_ms: u64,
    ) -> Result<Vec<ReplicaDesc>, KvError> {
        self.check_key(key)?;
        if let Some(id) = self.objs.complete_id(key) {
            let mut descs = self.lease_for_read(id, now_ms);
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
        for k in self.copies.detached_keys() {
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

    /// The version (incarnation) of `key`'s complete object, if it has one
    /// (the cluster simulation checks a removed one never comes back).
    pub fn version_of(&self, key: &[u8]) -> Option<u64> {
        let id = self.objs.complete_id(key)?;
        Some(self.objs.get(id).stored().version)
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
        for t in self.copies.quiet(now_ms) {
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
        self.copies.check()?;
        if let Some(d) = &self.durable {
            d.check(|seg| self.by_id.contains_key(&seg))?;
        }
        self.check_segments()?;
        self.check_puts()?;
        self.check_space()
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
                .map(|s| (s.id, s.alloc.capacity(), s.alloc.used(), s.draining))
                .collect(),
            evictions: self.evictions,
            evicted_bytes: self.evicted_bytes,
            demotions: self.demotions,
            promotions: self.promotions,
            hot_copies: self.hot_copies,
        }
    }

    // ---- dispatch ---------------------------------------------------------

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
