//! Memory the NIC may touch: owners, registrations, and the MR cache.
//!
//! * [`RdmaMemory`] is anything that owns a fixed range of memory (a storage
//!   node's memfd segment, a client's [`RdmaBuffer`], or a caller-vouched
//!   [`RawMemory`]).
//! * A [`Registration`] registers one such range on every opened device (one
//!   MR per protection domain) and *owns* the memory: it keeps the owner
//!   alive, and deregisters before releasing it.
//! * Every work request in flight holds an `Arc` of its registration, so a
//!   buffer lent to the NIC can be neither deregistered nor freed until its
//!   completion has been polled, whatever happens to the request, the cache
//!   entry or the caller's handles.
//! * The cache is keyed by address range: a registered range that covers a
//!   requested range is reused; it is bounded in entries and bytes, and evicts
//!   the least recently used entry that nobody else holds.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvpool_wire::error::{ErrorCode, KvError};

pub use kvpool_transport::nic::{RawMemory, RdmaBuffer, RdmaMemory};

use super::verbs::Mr;

/// Counters of the MR cache.
#[derive(Debug, Default)]
pub(crate) struct MrCounters {
    pub registrations: AtomicU64,
    pub deregistrations: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
}

/// A snapshot of the MR cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MrCacheStats {
    /// Ranges registered (each on every device) since start.
    pub registrations: u64,
    /// Registrations released (all their MRs deregistered) since start.
    pub deregistrations: u64,
    /// Lookups or registrations served by an existing covering range.
    pub hits: u64,
    pub misses: u64,
    /// Entries dropped from the cache to make room.
    pub evictions: u64,
    /// Entries in the cache now.
    pub entries: usize,
    /// Bytes the cache holds registered now.
    pub bytes: u64,
}

/// A range registered on every device of a context. It owns the memory: the
/// MRs are deregistered before the owner is released.
pub struct Registration {
    // Field order matters: `mrs` drops (deregisters) before `mem` (frees).
    mrs: Vec<Mr>,
    mem: Arc<dyn RdmaMemory>,
    addr: usize,
    len: usize,
    counters: Arc<MrCounters>,
}

impl Registration {
    /// Registers `mem` on each device in `devs`.
    pub(crate) fn new(
        devs: &[Arc<super::verbs::DeviceHandle>],
        mem: Arc<dyn RdmaMemory>,
        counters: Arc<MrCounters>,
    ) -> Result<Self, super::RdmaError> {
        let (addr, len) = (mem.as_ptr(), mem.len());
        if len == 0 {
            return Err(KvError::new(ErrorCode::InvalidParams, "cannot register 0 bytes").into());
        }
        let mut mrs = Vec::with_capacity(devs.len());
        for d in devs {
            // SAFETY: `mem` satisfies `RdmaMemory` (valid, fixed, mapped) and
            // is owned by this registration, which drops the MRs first.
            mrs.push(unsafe { Mr::register(d, addr, len)? });
        }
        counters.registrations.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            mrs,
            mem,
            addr: addr as usize,
            len,
            counters,
        })
    }

    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The owner of the memory.
    pub fn memory(&self) -> &Arc<dyn RdmaMemory> {
        &self.mem
    }

    /// The remote key peers use to reach this memory through device `dev`.
    pub fn rkey(&self, dev: usize) -> u32 {
        self.mrs[dev].rkey()
    }

    pub(crate) fn lkey(&self, dev: usize) -> u32 {
        self.mrs[dev].lkey()
    }

    /// `offset..offset+len` of this registration, for a transfer.
    pub fn slice(self: &Arc<Self>, offset: usize, len: usize) -> Result<LocalSlice, KvError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(LocalSlice {
                reg: self.clone(),
                offset,
                len,
            }),
            _ => Err(KvError::new(
                ErrorCode::InvalidParams,
                format!(
                    "local range {offset}+{len} is outside the registered {} bytes",
                    self.len
                ),
            )),
        }
    }

    /// The whole registration as one slice.
    pub fn whole(self: &Arc<Self>) -> LocalSlice {
        LocalSlice {
            reg: self.clone(),
            offset: 0,
            len: self.len,
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.counters
            .deregistrations
            .fetch_add(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("devices", &self.mrs.len())
            .finish()
    }
}

/// Part of a registration: the local side of a transfer (the destination of
/// a READ, the source of a WRITE). Holding it keeps the memory registered.
#[derive(Clone, Debug)]
pub struct LocalSlice {
    pub(crate) reg: Arc<Registration>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl LocalSlice {
    pub fn registration(&self) -> &Arc<Registration> {
        &self.reg
    }
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The slice's first byte's address.
    pub fn addr(&self) -> usize {
        self.reg.addr + self.offset
    }
}

/// Something with an address range, for [`RangeCache`].
pub(crate) trait CachedRange {
    fn range_start(&self) -> usize;
    fn range_len(&self) -> usize;
}

impl CachedRange for Registration {
    fn range_start(&self) -> usize {
        self.addr
    }
    fn range_len(&self) -> usize {
        self.len
    }
}

struct Slot<T> {
    item: Arc<T>,
    last_used: u64,
}

/// A bounded cache of ranges keyed by `(start, len)`. An entry is "in use"
/// while anyone besides the cache holds its `Arc`; only unused entries are
/// evicted (least recently used first).
pub(crate) struct RangeCache<T> {
    entries: BTreeMap<(usize, usize), Slot<T>>,
    tick: u64,
    bytes: u64,
    max_entries: usize,
    max_bytes: u64,
}

impl<T: CachedRange> RangeCache<T> {
    pub(crate) fn new(max_entries: usize, max_bytes: u64) -> Self {
        Self {
            entries: BTreeMap::new(),
            tick: 0,
            bytes: 0,
            max_entries,
            max_bytes,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// An entry covering `addr..addr+len`, marked recently used.
    pub(crate) fn lookup(&mut self, addr: usize, len: usize) -> Option<Arc<T>> {
        let end = addr.checked_add(len)?;
        self.tick += 1;
        let tick = self.tick;
        // Entries starting at or before `addr`, nearest first; bounded by
        // `max_entries`.
        let slot = self
            .entries
            .range_mut(..=(addr, usize::MAX))
            .rev()
            .map(|(_, s)| s)
            .find(|s| s.item.range_start() + s.item.range_len() >= end)?;
        slot.last_used = tick;
        Some(slot.item.clone())
    }

    /// Makes room for one more entry of `len` bytes by evicting unused
    /// entries (least recently used first). Returns the evicted entries (drop
    /// them outside any lock), or `Err` with them if room cannot be made.
    #[allow(clippy::type_complexity)] // (evicted, error) pair, local use only
    pub(crate) fn make_room(&mut self, len: u64) -> Result<Vec<Arc<T>>, (Vec<Arc<T>>, KvError)> {
        let mut evicted = Vec::new();
        if len > self.max_bytes {
            return Err((
                evicted,
                KvError::new(
                    ErrorCode::ResourceExhausted,
                    format!(
                        "registering {len} bytes exceeds the MR cache's {} bytes",
                        self.max_bytes
                    ),
                ),
            ));
        }
        while self.entries.len() >= self.max_entries || self.bytes + len > self.max_bytes {
            let victim = self
                .entries
                .iter()
                .filter(|(_, s)| Arc::strong_count(&s.item) == 1)
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| *k);
            let Some(key) = victim else {
                return Err((
                    evicted,
                    KvError::new(
                        ErrorCode::ResourceExhausted,
                        format!(
                            "MR cache full: {} entries / {} bytes registered, all in use \
                             (limits {} entries / {} bytes)",
                            self.entries.len(),
                            self.bytes,
                            self.max_entries,
                            self.max_bytes
                        ),
                    ),
                ));
            };
            let slot = self.entries.remove(&key).expect("victim is present");
            self.bytes -= key.1 as u64;
            evicted.push(slot.item);
        }
        Ok(evicted)
    }

    /// Inserts an entry (after `make_room`). An entry with the same range
    /// is replaced and returned.
    pub(crate) fn insert(&mut self, item: Arc<T>) -> Option<Arc<T>> {
        let key = (item.range_start(), item.range_len());
        self.tick += 1;
        let old = self.entries.insert(
            key,
            Slot {
                item,
                last_used: self.tick,
            },
        );
        if old.is_none() {
            self.bytes += key.1 as u64;
        }
        old.map(|s| s.item)
    }

    /// Removes the entry registered for exactly `addr..addr+len`.
    pub(crate) fn remove(&mut self, addr: usize, len: usize) -> Option<Arc<T>> {
        let slot = self.entries.remove(&(addr, len))?;
        self.bytes -= len as u64;
        Some(slot.item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(Debug)]
    struct R(usize, usize);
    impl CachedRange for R {
        fn range_start(&self) -> usize {
            self.0
        }
        fn range_len(&self) -> usize {
            self.1
        }
    }

    #[test]
    fn a_covering_range_is_reused() {
        let mut c = RangeCache::new(8, 1 << 30);
        assert!(c.make_room(100).unwrap().is_empty());
        c.insert(Arc::new(R(1000, 100)));
        let hit = c.lookup(1010, 50).unwrap();
        assert_eq!((hit.0, hit.1), (1000, 100));
        assert!(c.lookup(1000, 100).is_some());
        assert!(c.lookup(999, 2).is_none());
        assert!(c.lookup(1090, 11).is_none());
        assert!(c.lookup(usize::MAX, 2).is_none());
    }

    #[test]
    fn an_earlier_larger_range_covers_past_a_nearer_smaller_one() {
        let mut c = RangeCache::new(8, 1 << 30);
        c.insert(Arc::new(R(0, 10_000)));
        c.insert(Arc::new(R(5000, 10)));
        let hit = c.lookup(5005, 100).unwrap();
        assert_eq!((hit.0, hit.1), (0, 10_000));
    }

    #[test]
    fn only_unused_entries_are_evicted_lru_first() {
        let mut c = RangeCache::new(2, 1 << 30);
        c.insert(Arc::new(R(0, 10)));
        c.insert(Arc::new(R(100, 10)));
        c.lookup(0, 1); // 0 is now more recent than 100
        let ev = c.make_room(10).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].0, 100);
        c.insert(Arc::new(R(200, 10)));
        // Hold both: nothing can be evicted.
        let a = c.lookup(0, 1).unwrap();
        let b = c.lookup(200, 1).unwrap();
        let (ev, e) = c.make_room(10).unwrap_err();
        assert!(ev.is_empty());
        assert_eq!(e.code, ErrorCode::ResourceExhausted);
        drop(a);
        let ev = c.make_room(10).unwrap();
        assert_eq!(ev[0].0, 0);
        drop(b);
    }

    #[test]
    fn the_byte_bound_holds() {
        let mut c = RangeCache::new(100, 100);
        c.insert(Arc::new(R(0, 60)));
        let ev = c.make_room(50).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(c.bytes(), 0);
        assert!(c.make_room(101).is_err());
    }

    /// Random operations against a plain model: every entry the cache
    /// returns covers the asked range, the bounds always hold, and held
    /// entries are never evicted.
    #[test]
    fn random_operations_match_a_reference_model() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (max_entries, max_bytes) = (6, 4000);
        let mut c: RangeCache<R> = RangeCache::new(max_entries, max_bytes);
        let mut model: HashMap<(usize, usize), ()> = HashMap::new();
        let mut held: Vec<Arc<R>> = Vec::new();
        for step in 0..20_000 {
            match next() % 5 {
                0 | 1 => {
                    let start = (next() % 50) as usize * 100;
                    let len = 1 + (next() % 1000) as usize;
                    if c.lookup(start, len).is_some() {
                        continue;
                    }
                    match c.make_room(len as u64) {
                        Ok(ev) => {
                            for e in ev {
                                assert!(model.remove(&(e.0, e.1)).is_some());
                                assert!(
                                    !held.iter().any(|h| Arc::ptr_eq(h, &e)),
                                    "step {step}: evicted a held entry"
                                );
                            }
                            if c.insert(Arc::new(R(start, len))).is_none() {
                                model.insert((start, len), ());
                            }
                        }
                        Err((ev, _)) => {
                            for e in ev {
                                model.remove(&(e.0, e.1));
                            }
                        }
                    }
                }
                2 => {
                    let a = (next() % 5000) as usize;
                    let l = 1 + (next() % 300) as usize;
                    let want = model.keys().any(|&(s, n)| s <= a && s + n >= a + l);
                    let got = c.lookup(a, l);
                    assert_eq!(got.is_some(), want, "step {step}: lookup {a}+{l}");
                    if let Some(g) = got {
                        assert!(g.0 <= a && g.0 + g.1 >= a + l);
                        if next() % 2 == 0 && held.len() < 3 {
                            held.push(g);
                        }
                    }
                }
                3 => {
                    if !held.is_empty() {
                        let i = (next() as usize) % held.len();
                        held.swap_remove(i);
                    }
                }
                _ => {
                    if let Some(&(s, n)) = model.keys().next() {
                        assert!(c.remove(s, n).is_some());
                        model.remove(&(s, n));
                    }
                }
            }
            assert!(c.len() <= max_entries);
            assert!(c.bytes() <= max_bytes);
            assert_eq!(c.len(), model.len());
            assert_eq!(c.bytes(), model.keys().map(|k| k.1 as u64).sum::<u64>());
        }
    }
}
