//! One shard's objects: each stored once, found by key, ranked for eviction.
//!
//! * A slab (a `Vec` of slots, `u32` ids, a free list) holds every object's
//!   key and metadata once.
//! * Two hash tables of ids find an object by key: one for complete
//!   objects, one for puts in flight (a key is in both only while a replace
//!   of it is Processing). They hash and compare through the slab, with the
//!   shard's randomly seeded key hasher. An object's phase names its table.
//! * Per DRAM range (a segment slot of the shard) an index of the replicas
//!   eviction may take, in eviction order: extra replicas of hot objects
//!   (`Replica::extra`) first, then unpinned before soft-pinned, then
//!   the oldest rank, then the id. The rank is the end of the last read
//!   lease; in a range without an NVMe tier (where eviction drops the only
//!   copy) it is at least a lease after the put too: a put is a use, so a
//!   value is not dropped before its writer could read it back. A replica is indexed when it is `Ready`, in a DRAM range, of a
//!   complete object that is not hard-pinned. A running lease does not take
//!   it out: a walk stops at the first entry whose lease has not ended.
//! * Soft pins end with time, not with an event: pinned objects are also
//!   kept ordered by pin end, and [`Objects::sweep_pins`] moves those whose
//!   pin has ended to the unpinned side before a walk. Choosing victims costs
//!   O(victims + pins that ended), never O(objects) or O(pinned objects).
//!
//! Every change to an object goes through [`Objects::insert`],
//! [`Objects::update`] or [`Objects::remove`], which take the object's index
//! entries out before the change and put them back after (when they differ),
//! so no caller can leave the index behind; [`Objects::check`] recounts it.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, Hasher};

use hashbrown::HashTable;
use kvpool_wire::proto::ClientId;
use smallvec::SmallVec;
use xxhash_rust::xxh3::xxh3_64_with_seed;

mod key;
pub(crate) use key::Key;

/// Hashes keys with one-shot xxh3 (a key is hashed by a single `write`),
/// seeded per shard at random so clients cannot aim at collisions.
#[derive(Debug, Clone, Copy)]
pub struct KeyHashBuilder(u64);

impl KeyHashBuilder {
    /// A builder whose hashes are seeded by `seed`.
    pub fn with_seed(seed: u64) -> Self {
        Self(seed)
    }
}

/// The seed of the state's other maps and sets ([`Map`], [`Set`]): random
/// once per process, unless [`fix_hash_seed`] fixed it first.
static HASH_SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

impl Default for KeyHashBuilder {
    /// Seeded with the process's seed.
    fn default() -> Self {
        Self(*HASH_SEED.get_or_init(rand::random))
    }
}

/// Fixes the seed of the state's maps and sets for this process, before
/// any state is made: a simulation then iterates them in the same order in
/// every run, and a seed replays exactly. Production leaves it random
/// (clients cannot aim at collisions). False if another seed was fixed or
/// drawn already.
pub fn fix_hash_seed(seed: u64) -> bool {
    HASH_SEED.get_or_init(|| seed) == &seed
}

/// A map of the master's state: keyed xxh3, seeded per process.
pub(crate) type Map<K, V> = std::collections::HashMap<K, V, KeyHashBuilder>;
/// A set of the master's state, as [`Map`].
pub(crate) type Set<K> = std::collections::HashSet<K, KeyHashBuilder>;

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

/// An object's slot in the slab.
pub(crate) type Id = u32;

/// Where one replica lies: a slot index (into the shard's segment slots),
/// its life, and its offset.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Replica {
    pub slot: u32,
    pub state: ReplicaState,
    /// DRAM: offset in the segment. NVMe: the packed location.
    pub offset: u64,
    /// An extra DRAM replica of a hot object (state/hot.rs): evicted before
    /// any other replica in its range, never demoted. Memory only: recorded
    /// as a plain replica.
    pub extra: bool,
}

/// A replica's life: `Promoting -> Ready` (or dropped if the copy failed;
/// an extra replica of a hot object is `Promoting` while its node fetches it),
/// `Ready -> Demoting -> dropped` (once its NVMe copy is in, or the copy
/// failed and the eviction goes ahead without it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum ReplicaState {
    /// Readable; may be evicted.
    Ready,
    /// A promotion is copying the bytes in from NVMe: not readable yet.
    Promoting,
    /// An eviction is copying the bytes out to NVMe: readable, not evicted
    /// again; its space counts as on its way out.
    Demoting,
}

impl Replica {
    pub fn ready(slot: u32, offset: u64) -> Self {
        Self {
            slot,
            state: ReplicaState::Ready,
            offset,
            extra: false,
        }
    }

    /// A range a node is filling (a promotion, or an extra replica's fetch).
    pub fn filling(slot: u32, offset: u64, extra: bool) -> Self {
        Self {
            slot,
            state: ReplicaState::Promoting,
            offset,
            extra,
        }
    }
}

/// A put in flight.
#[derive(Debug)]
pub(crate) struct Processing {
    pub started_ms: u64,
    pub writer: ClientId,
    /// Soft-pin TTL asked for at PutStart, applied at PutEnd.
    pub soft_pin_ttl_ms: u32,
    pub hard_pin: bool,
    /// Started with `replace`: it may stand beside a complete object of the
    /// same key, which its PutEnd retires.
    pub replace: bool,
    /// The writer's name for this placement (`PutOptions::put_id`).
    pub put_id: u16,
}

/// A stored object.
#[derive(Debug)]
pub(crate) struct Complete {
    /// When the last read lease ends (the completion time until the first
    /// read).
    pub lease_end_ms: u64,
    /// Put and not read since (`lease_end_ms` is then the completion
    /// time): a range without an NVMe tier ranks it a lease later, as if
    /// its writer had read it (a put is a use).
    pub unread: bool,
    /// When the soft pin ends (0: none).
    pub pin_end_ms: u64,
    /// xxh3-64 of the value (when `has_sum`): set by the writer at PutEnd,
    /// or by the tier's index for a recovered object.
    pub sum: u64,
    pub has_sum: bool,
    pub hard_pin: bool,
    /// Reads served from NVMe only since the last promotion decision.
    pub nvme_reads: u16,
    /// This incarnation's version (`epoch << 32 | n`, handed out at PutEnd;
    /// 0: unknown, an object recovered from records or copies before
    /// versions were), which its copies carry.
    pub version: u64,
}

/// An object's state; it names the table the object is found in.
#[derive(Debug)]
pub(crate) enum Phase {
    Processing(Processing),
    Complete(Complete),
}

/// One object's metadata. Kept small: the master holds tens of millions.
#[derive(Debug)]
pub(crate) struct Object {
    pub size: u64,
    pub phase: Phase,
    pub replicas: SmallVec<[Replica; 1]>,
}

impl Object {
    pub fn processing(&self) -> Option<&Processing> {
        match &self.phase {
            Phase::Processing(p) => Some(p),
            Phase::Complete(_) => None,
        }
    }

    pub fn complete(&self) -> Option<&Complete> {
        match &self.phase {
            Phase::Complete(c) => Some(c),
            Phase::Processing(_) => None,
        }
    }

    /// The state of an object found in the complete table.
    pub fn stored(&self) -> &Complete {
        self.complete()
            .expect("an object in the complete table is Complete")
    }

    /// The state of an object found in the complete table, to change.
    pub fn stored_mut(&mut self) -> &mut Complete {
        match &mut self.phase {
            Phase::Complete(c) => c,
            Phase::Processing(_) => panic!("an object in the complete table is Complete"),
        }
    }

    /// The state of an object found in the processing table.
    pub fn put(&self) -> &Processing {
        self.processing()
            .expect("an object in the processing table is Processing")
    }

    pub fn hard_pinned(&self) -> bool {
        match &self.phase {
            Phase::Processing(p) => p.hard_pin,
            Phase::Complete(c) => c.hard_pin,
        }
    }

    pub fn checksum(&self) -> Option<u64> {
        self.complete().filter(|c| c.has_sum).map(|c| c.sum)
    }

    /// Processing -> Complete at `now_ms` with the writer's checksum and
    /// the incarnation's `version`: no lease yet (unread), the soft pin
    /// asked for at PutStart starts now.
    pub fn complete_at(&mut self, now_ms: u64, checksum: Option<u64>, version: u64) {
        let p = self.put();
        let pin_end_ms = if p.soft_pin_ttl_ms > 0 {
            now_ms + p.soft_pin_ttl_ms as u64
        } else {
            0
        };
        self.phase = Phase::Complete(Complete {
            lease_end_ms: now_ms,
            unread: true,
            pin_end_ms,
            sum: checksum.unwrap_or(0),
            has_sum: checksum.is_some(),
            hard_pin: p.hard_pin,
            nvme_reads: 0,
            version,
        });
    }

    /// Complete: a read lease until at least `until_ms`.
    pub fn extend_lease(&mut self, until_ms: u64) {
        if let Phase::Complete(c) = &mut self.phase {
            c.lease_end_ms = c.lease_end_ms.max(until_ms);
            c.unread = false;
        }
    }
}

#[derive(Debug)]
struct Entry {
    key: Key,
    obj: Object,
}

/// Bytes of one slab slot (a key's pointer and its object).
#[cfg(test)]
pub(crate) fn slab_slot_bytes() -> usize {
    std::mem::size_of::<Option<Entry>>()
}

/// The evictable replicas of one DRAM range, by (rank, id).
#[derive(Debug, Default)]
struct RangeIndex {
    /// Extra replicas of hot objects, pinned or not.
    extra: BTreeSet<(u64, Id)>,
    unpinned: BTreeSet<(u64, Id)>,
    pinned: BTreeSet<(u64, Id)>,
    /// What an unread object's rank adds to its completion time: a lease
    /// in a range without an NVMe tier (eviction there drops the only
    /// copy), 0 where eviction demotes.
    keep_ms: u64,
}

impl RangeIndex {
    fn side(&mut self, pinned: bool, extra: bool) -> &mut BTreeSet<(u64, Id)> {
        if extra {
            &mut self.extra
        } else if pinned {
            &mut self.pinned
        } else {
            &mut self.unpinned
        }
    }
}

/// What the index holds of one object: its rank, and the ranges it can be
/// evicted from. `None` for an object eviction never takes (Processing,
/// hard-pinned).
#[derive(Debug, PartialEq, Eq)]
struct Entries {
    lease_end_ms: u64,
    unread: bool,
    pin_end_ms: u64,
    pinned: bool,
    /// (range, whether the replica there is an extra one)
    slots: SmallVec<[(u32, bool); 2]>,
}

impl Entries {
    /// The object's rank in a range whose unread objects rank `keep_ms`
    /// after their completion: its last lease's end, or for an unread one
    /// its completion plus `keep_ms` (a read's lease would end then).
    fn rank(&self, keep_ms: u64) -> u64 {
        if self.unread {
            self.lease_end_ms.saturating_add(keep_ms)
        } else {
            self.lease_end_ms
        }
    }
}

/// See the module doc.
pub(crate) struct Objects {
    slab: Vec<Option<Entry>>,
    free: Vec<Id>,
    complete: HashTable<Id>,
    processing: HashTable<Id>,
    hasher: KeyHashBuilder,
    /// By slot index: `Some` for a mounted DRAM range.
    ranges: Vec<Option<RangeIndex>>,
    /// (pin end, id) of every indexable object whose soft pin is counted
    /// as running: exactly those with `(pin_end, id) > pin_cursor`.
    pins: BTreeSet<(u64, Id)>,
    /// How far pins have been swept: a pin at or below it has ended.
    pin_cursor: (u64, Id),
    /// Keys whose complete object changed in a way the state directory
    /// records (appeared, went, gained or lost a readable replica), since
    /// the shard last took them; `None`: not tracked (no state directory).
    dirty: Option<Vec<Box<[u8]>>>,
    /// Bytes of the extra replicas (`Replica::extra`) in each slot (index:
    /// the slot), in any state.
    extra_in: Vec<u64>,
}

/// `o`'s extra replicas, in any state: (slot, bytes).
fn extra_of(o: &Object) -> SmallVec<[(u32, u64); 2]> {
    o.replicas
        .iter()
        .filter(|r| r.extra)
        .map(|r| (r.slot, o.size))
        .collect()
}

/// What the state directory records of an object: whether it is complete,
/// and its readable replicas.
fn durable_sig(o: &Object) -> (bool, SmallVec<[(u32, u64); 2]>) {
    match o.phase {
        Phase::Processing(_) => (false, SmallVec::new()),
        Phase::Complete(_) => (
            true,
            o.replicas
                .iter()
                .filter(|r| r.state != ReplicaState::Promoting)
                .map(|r| (r.slot, r.offset))
                .collect(),
        ),
    }
}

impl std::fmt::Debug for Objects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Objects")
            .field("complete", &self.complete.len())
            .field("processing", &self.processing.len())
            .field("pins", &self.pins.len())
            .field("pin_cursor", &self.pin_cursor)
            .finish_non_exhaustive()
    }
}

fn hash_key(hasher: &KeyHashBuilder, key: &[u8]) -> u64 {
    hasher.hash_one(key)
}

fn entry(slab: &[Option<Entry>], id: Id) -> &Entry {
    slab[id as usize]
        .as_ref()
        .expect("an id in a table or the index names a live slot")
}

fn find(table: &HashTable<Id>, slab: &[Option<Entry>], hash: u64, key: &[u8]) -> Option<Id> {
    table.find(hash, |&i| *entry(slab, i).key == *key).copied()
}

impl Objects {
    pub fn new(hasher: KeyHashBuilder) -> Self {
        Self {
            slab: Vec::new(),
            free: Vec::new(),
            complete: HashTable::new(),
            processing: HashTable::new(),
            hasher,
            ranges: Vec::new(),
            pins: BTreeSet::new(),
            pin_cursor: (0, Id::MAX),
            dirty: None,
            extra_in: Vec::new(),
        }
    }

    /// Bytes of every extra replica of a hot object.
    pub fn extra_bytes(&self) -> u64 {
        self.extra_in.iter().sum()
    }

    /// Bytes of the extra replicas in `slot`, in any state (one being
    /// fetched included).
    pub fn extra_bytes_in(&self, slot: u32) -> u64 {
        self.extra_in.get(slot as usize).copied().unwrap_or(0)
    }

    /// Counts `o`'s extra replicas in (`add`) or out of the per-slot sums.
    fn count_extra(&mut self, extra: &[(u32, u64)], add: bool) {
        for &(slot, bytes) in extra {
            let i = slot as usize;
            if self.extra_in.len() <= i {
                self.extra_in.resize(i + 1, 0);
            }
            let n = &mut self.extra_in[i];
            // Exact (`check` recounts it); saturating so that a miscount
            // could not wrap into a range that waits forever.
            *n = if add {
                *n + bytes
            } else {
                n.saturating_sub(bytes)
            };
        }
    }

    /// From now on, keys whose complete object changes durably are kept
    /// for [`Self::take_dirty`].
    pub fn track_changes(&mut self) {
        self.dirty.get_or_insert_with(Vec::new);
    }

    /// Marks `key` changed (when tracking).
    pub fn mark_dirty(&mut self, key: &[u8]) {
        if let Some(d) = &mut self.dirty {
            d.push(key.into());
        }
    }

    /// The keys changed since the last call (in order, maybe repeated).
    pub fn take_dirty(&mut self, out: &mut Vec<Box<[u8]>>) {
        if let Some(d) = &mut self.dirty {
            out.append(d);
        }
    }

    /// Slots in the slab, live or free: ids below it may name an object.
    pub fn slab_len(&self) -> usize {
        self.slab.len()
    }

    /// The object in slot `id`, if it is live.
    pub fn entry_at(&self, id: Id) -> Option<(&[u8], &Object)> {
        self.slab
            .get(id as usize)?
            .as_ref()
            .map(|e| (&*e.key, &e.obj))
    }

    pub fn complete_len(&self) -> usize {
        self.complete.len()
    }

    pub fn processing_len(&self) -> usize {
        self.processing.len()
    }

    /// Whether one more object has an id.
    pub fn has_room(&self) -> bool {
        !self.free.is_empty() || self.slab.len() < Id::MAX as usize
    }

    pub fn complete_id(&self, key: &[u8]) -> Option<Id> {
        find(&self.complete, &self.slab, hash_key(&self.hasher, key), key)
    }

    pub fn processing_id(&self, key: &[u8]) -> Option<Id> {
        find(
            &self.processing,
            &self.slab,
            hash_key(&self.hasher, key),
            key,
        )
    }

    pub fn get(&self, id: Id) -> &Object {
        &entry(&self.slab, id).obj
    }

    pub fn key(&self, id: Id) -> &[u8] {
        &entry(&self.slab, id).key
    }

    pub fn complete_ids(&self) -> impl Iterator<Item = Id> + '_ {
        self.complete.iter().copied()
    }

    pub fn processing_ids(&self) -> impl Iterator<Item = Id> + '_ {
        self.processing.iter().copied()
    }

    /// Objects with a replica in `slot` (a scan of every object).
    pub fn ids_with_replica_in(&self, slot: u32) -> Vec<Id> {
        self.slab
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let e = e.as_ref()?;
                e.obj
                    .replicas
                    .iter()
                    .any(|r| r.slot == slot)
                    .then_some(i as Id)
            })
            .collect()
    }

    /// Stores a new object under `key`, in the table its phase names. The
    /// caller checked `has_room` and that no object of that phase has `key`.
    pub fn insert(&mut self, key: &[u8], obj: Object) -> Id {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                assert!(self.has_room(), "the caller checks has_room");
                self.slab.push(None);
                (self.slab.len() - 1) as Id
            }
        };
        self.count_extra(&extra_of(&obj), true);
        self.slab[id as usize] = Some(Entry {
            key: Key::new(key),
            obj,
        });
        self.link(id);
        let e = self.entries(id);
        self.add_entries(id, &e);
        if self.dirty.is_some() && self.get(id).complete().is_some() {
            self.mark_dirty(key);
        }
        id
    }

    /// Takes an object out: out of the index, its table and the slab.
    pub fn remove(&mut self, id: Id) -> (Key, Object) {
        let e = self.entries(id);
        self.drop_entries(id, &e);
        let complete = self.get(id).complete().is_some();
        self.unlink(id, complete);
        let Entry { key, obj } = self.slab[id as usize].take().expect("a live slot");
        self.count_extra(&extra_of(&obj), false);
        self.free.push(id);
        if complete {
            self.mark_dirty(&key);
        }
        (key, obj)
    }

    /// Changes an object through `f`, keeping the index and the tables in
    /// step: its index entries are taken out before and put back after
    /// (when they differ), and a change of phase moves it to the other
    /// table (PutEnd: a complete object of the key must be gone by then).
    pub fn update<R>(&mut self, id: Id, f: impl FnOnce(&mut Object) -> R) -> R {
        let before = self.entries(id);
        let was_complete = self.get(id).complete().is_some();
        let sig = self.dirty.is_some().then(|| durable_sig(self.get(id)));
        let extra_before = extra_of(self.get(id));
        let r = f(&mut self.slab[id as usize].as_mut().expect("a live slot").obj);
        let extra_after = extra_of(self.get(id));
        if extra_before != extra_after {
            self.count_extra(&extra_before, false);
            self.count_extra(&extra_after, true);
        }
        if sig.is_some_and(|s| s != durable_sig(self.get(id))) {
            let key = Box::from(&*entry(&self.slab, id).key);
            if let Some(d) = &mut self.dirty {
                d.push(key);
            }
        }
        if self.get(id).complete().is_some() != was_complete {
            self.unlink(id, was_complete);
            self.link(id);
        }
        let after = self.entries(id);
        if before != after {
            self.drop_entries(id, &before);
            self.add_entries(id, &after);
        }
        r
    }

    /// Puts `id` in the table its phase names.
    fn link(&mut self, id: Id) {
        let e = entry(&self.slab, id);
        let hash = hash_key(&self.hasher, &e.key);
        let table = match e.obj.phase {
            Phase::Complete(_) => &mut self.complete,
            Phase::Processing(_) => &mut self.processing,
        };
        assert!(
            find(table, &self.slab, hash, &e.key).is_none(),
            "one object per key in each table"
        );
        let (slab, hasher) = (&self.slab, &self.hasher);
        table.insert_unique(hash, id, |&i| hash_key(hasher, &entry(slab, i).key));
    }

    /// Takes `id` out of the complete table (or the processing one).
    fn unlink(&mut self, id: Id, complete: bool) {
        let hash = hash_key(&self.hasher, &entry(&self.slab, id).key);
        let table = if complete {
            &mut self.complete
        } else {
            &mut self.processing
        };
        match table.find_entry(hash, |&i| i == id) {
            Ok(e) => {
                e.remove();
            }
            Err(_) => panic!("object {id} is missing from its table"),
        }
    }

    // ---- the eviction index ---------------------------------------------

    /// A DRAM range was mounted in `slot`: its index starts empty. An
    /// unread object ranks `keep_ms` after its completion there (see
    /// [`Complete::unread`]).
    pub fn mount_range(&mut self, slot: u32, keep_ms: u64) {
        let i = slot as usize;
        if self.ranges.len() <= i {
            self.ranges.resize_with(i + 1, || None);
        }
        self.ranges[i] = Some(RangeIndex {
            keep_ms,
            ..RangeIndex::default()
        });
    }

    /// The range in `slot` goes; the caller took every replica in it off
    /// its object first.
    pub fn unmount_range(&mut self, slot: u32) {
        if let Some(r) = self.ranges.get_mut(slot as usize).and_then(Option::take) {
            debug_assert!(r.unpinned.is_empty() && r.pinned.is_empty() && r.extra.is_empty());
        }
    }

    pub fn has_range(&self, slot: u32) -> bool {
        self.ranges.get(slot as usize).is_some_and(Option::is_some)
    }

    fn entries(&self, id: Id) -> Option<Entries> {
        let o = self.get(id);
        let c = o.complete().filter(|c| !c.hard_pin)?;
        Some(Entries {
            lease_end_ms: c.lease_end_ms,
            unread: c.unread,
            pin_end_ms: c.pin_end_ms,
            pinned: (c.pin_end_ms, id) > self.pin_cursor,
            slots: o
                .replicas
                .iter()
                .filter(|r| r.state == ReplicaState::Ready && self.has_range(r.slot))
                .map(|r| (r.slot, r.extra))
                .collect(),
        })
    }

    /// The side (extra, pinned or unpinned) of the index of the range in
    /// `slot` that holds `e`'s replica there, and the rank `e` has there.
    fn side(&mut self, slot: u32, extra: bool, e: &Entries) -> (&mut BTreeSet<(u64, Id)>, u64) {
        let r = self.ranges[slot as usize].as_mut().expect("indexed range");
        let rank = e.rank(r.keep_ms);
        (r.side(e.pinned, extra), rank)
    }

    fn add_entries(&mut self, id: Id, e: &Option<Entries>) {
        let Some(e) = e else { return };
        if e.pinned {
            let new = self.pins.insert((e.pin_end_ms, id));
            debug_assert!(new, "object {id} pinned twice");
        }
        for &(s, extra) in &e.slots {
            let (side, rank) = self.side(s, extra, e);
            let new = side.insert((rank, id));
            debug_assert!(new, "object {id} indexed twice in slot {s}");
        }
    }

    fn drop_entries(&mut self, id: Id, e: &Option<Entries>) {
        let Some(e) = e else { return };
        if e.pinned {
            let had = self.pins.remove(&(e.pin_end_ms, id));
            debug_assert!(had, "object {id} missing from the pins");
        }
        for &(s, extra) in &e.slots {
            let (side, rank) = self.side(s, extra, e);
            let had = side.remove(&(rank, id));
            debug_assert!(had, "object {id} missing from the index of slot {s}");
        }
    }

    /// Moves the objects whose soft pin ended by `now_ms` to the unpinned
    /// side, at most `budget` of them (each one counted off it). Returns
    /// whether it is done: only then does a walk see the ranks as of
    /// `now_ms`. (The master's clock is monotonic; a `now_ms` below an
    /// earlier sweep's sees pins ended at the later time.)
    pub fn sweep_pins(&mut self, now_ms: u64, budget: &mut usize) -> bool {
        while let Some(&(pin_end, id)) = self.pins.first() {
            if pin_end > now_ms {
                break;
            }
            if *budget == 0 {
                return false;
            }
            *budget -= 1;
            let before = self.entries(id);
            self.drop_entries(id, &before);
            self.pin_cursor = (pin_end, id);
            let after = self.entries(id);
            self.add_entries(id, &after);
        }
        self.pin_cursor = self.pin_cursor.max((now_ms, Id::MAX));
        true
    }

    /// The next replica to evict from the range in `slot` at `now_ms`: the
    /// first by rank whose lease has ended, extra replicas of hot objects
    /// first, then unpinned ones. Pins must have been swept to `now_ms`.
    pub fn first_victim(&self, slot: u32, now_ms: u64) -> Option<Id> {
        debug_assert!(self.pin_cursor.0 >= now_ms, "pins swept first");
        let r = self.ranges.get(slot as usize)?.as_ref()?;
        let due = |set: &BTreeSet<(u64, Id)>| set.first().filter(|e| e.0 <= now_ms).map(|e| e.1);
        due(&r.extra)
            .or_else(|| due(&r.unpinned))
            .or_else(|| due(&r.pinned))
    }

    /// Whether an extra replica in the range in `slot` may be evicted at
    /// `now_ms` (ready, its lease ended).
    pub fn extra_due(&self, slot: u32, now_ms: u64) -> bool {
        let Some(Some(r)) = self.ranges.get(slot as usize) else {
            return false;
        };
        r.extra.first().is_some_and(|e| e.0 <= now_ms)
    }

    /// Checks the tables and the index against a recount: every live slot
    /// is in the table its phase names and found there by its key, nothing
    /// else is in a table, and the index holds exactly the entries, with the
    /// ranks, the objects call for. O(objects).
    pub fn check(&self) -> Result<(), String> {
        let live = self.slab.iter().filter(|e| e.is_some()).count();
        let mut extra_in = vec![0u64; self.extra_in.len()];
        for e in self.slab.iter().flatten() {
            for (slot, bytes) in extra_of(&e.obj) {
                match extra_in.get_mut(slot as usize) {
                    Some(n) => *n += bytes,
                    None => return Err(format!("an extra replica in slot {slot} is not counted")),
                }
            }
        }
        if extra_in != self.extra_in {
            return Err(format!(
                "extra replicas per slot hold {extra_in:?}, counted as {:?}",
                self.extra_in
            ));
        }
        if live != self.complete.len() + self.processing.len() {
            return Err(format!(
                "{live} objects in the slab, {} + {} in the tables",
                self.complete.len(),
                self.processing.len()
            ));
        }
        for &f in &self.free {
            if self.slab.get(f as usize).is_none_or(Option::is_some) {
                return Err(format!("free id {f} names a live or missing slot"));
            }
        }
        if self.free.len() + live != self.slab.len() {
            return Err(format!(
                "{} free ids and {live} live objects in a slab of {}",
                self.free.len(),
                self.slab.len()
            ));
        }
        for (complete, table) in [(true, &self.complete), (false, &self.processing)] {
            for &id in table.iter() {
                let Some(Some(e)) = self.slab.get(id as usize) else {
                    return Err(format!("table entry {id} names no object"));
                };
                if e.obj.complete().is_some() != complete {
                    return Err(format!(
                        "{} is in the {} table in another phase",
                        kvpool_wire::proto::show_key(&e.key),
                        if complete { "complete" } else { "processing" }
                    ));
                }
                let hash = hash_key(&self.hasher, &e.key);
                if find(table, &self.slab, hash, &e.key) != Some(id) {
                    return Err(format!(
                        "{} is not found by its key",
                        kvpool_wire::proto::show_key(&e.key)
                    ));
                }
            }
        }
        let mut ranges: Vec<Option<RangeIndex>> = self
            .ranges
            .iter()
            .map(|r| {
                r.as_ref().map(|r| RangeIndex {
                    keep_ms: r.keep_ms,
                    ..RangeIndex::default()
                })
            })
            .collect();
        let mut pins = BTreeSet::new();
        for (i, e) in self.slab.iter().enumerate() {
            if e.is_none() {
                continue;
            }
            let Some(en) = self.entries(i as Id) else {
                continue;
            };
            if en.pinned {
                pins.insert((en.pin_end_ms, i as Id));
            }
            for &(s, extra) in &en.slots {
                let r = ranges[s as usize].as_mut().expect("has_range");
                let rank = en.rank(r.keep_ms);
                r.side(en.pinned, extra).insert((rank, i as Id));
            }
        }
        if pins != self.pins {
            return Err(format!(
                "the index has {} running soft pins, the objects {}",
                self.pins.len(),
                pins.len()
            ));
        }
        for (s, (want, have)) in ranges.iter().zip(&self.ranges).enumerate() {
            let (Some(want), Some(have)) = (want, have) else {
                continue;
            };
            for (side, w, h) in [
                ("extra", &want.extra, &have.extra),
                ("unpinned", &want.unpinned, &have.unpinned),
                ("soft-pinned", &want.pinned, &have.pinned),
            ] {
                if w != h {
                    let missing = w.difference(h).next();
                    let extra = h.difference(w).next();
                    return Err(format!(
                        "slot {s}: the eviction index's {side} side has {} entries, the \
                         objects call for {} (first missing (rank, id): {missing:?}, \
                         first not called for: {extra:?})",
                        h.len(),
                        w.len()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Changes an object without keeping the index in step (tests of
    /// `check`).
    #[cfg(test)]
    pub fn get_mut_unindexed(&mut self, id: Id) -> &mut Object {
        &mut self.slab[id as usize].as_mut().expect("a live slot").obj
    }
}
