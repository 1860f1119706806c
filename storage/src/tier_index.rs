//! The NVMe tier's index, without I/O: which slot and extent each copy of a
//! region has, which copy a key names, the write sequence that tells copies
//! in one slot apart, the read clock LRU ranks by, the copies marked for
//! eviction, and what recovery keeps of the records it finds.
//!
//! [`crate::nvme::NvmeShard`] keeps one per region and does the I/O around
//! it (a write reserves here, writes its bytes, then inserts; a removal
//! takes a tombstone here, writes it, then frees, or says it failed); the
//! cluster simulation runs its tiers on the same index over a simulated
//! disk. Its callers give places as slots; `nvme` makes them `NvmeLoc`s.

use std::collections::HashMap;

use crate::alloc::RangeAllocator;

/// How the tier picks what to evict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// Oldest write first.
    Fifo,
    /// Least recently read first.
    Lru,
}

impl Eviction {
    /// Copies in the order this policy evicts them: each given as (its
    /// place, its write's sequence number, the tier's read clock at its last
    /// read, 0 for never), oldest write first (FIFO) or least recently read
    /// first (LRU: a copy never read counts as read at the first tick, so
    /// with the first read copy), ties by place.
    pub fn order<T: Ord>(self, copies: impl IntoIterator<Item = (T, u64, u64)>) -> Vec<T> {
        let mut ranked: Vec<(u64, T)> = copies
            .into_iter()
            .map(|(at, seq, last_read)| {
                let rank = match self {
                    Eviction::Fifo => seq,
                    Eviction::Lru => last_read.max(seq.min(1)),
                };
                (rank, at)
            })
            .collect();
        ranked.sort_unstable();
        ranked.into_iter().map(|(_, at)| at).collect()
    }

    /// The copies to evict to free `want` bytes: [`Eviction::order`] over
    /// copies given as (place, write sequence, last read, extent bytes),
    /// taken until their extents reach `want`.
    pub fn victims<T: Ord>(
        self,
        copies: impl IntoIterator<Item = (T, u64, u64, u64)>,
        want: u64,
    ) -> Vec<T> {
        let mut left = want;
        self.order(
            copies
                .into_iter()
                .map(|(at, seq, last_read, extent)| ((at, extent), seq, last_read)),
        )
        .into_iter()
        .map_while(|(at, extent)| {
            (left > 0).then(|| {
                left = left.saturating_sub(extent);
                at
            })
        })
        .collect()
    }
}

/// A region's space as the tier's eviction rule sees it
/// (`NvmeConfig::bytes_to_evict`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space {
    /// Bytes of the region's extents in use.
    pub used: u64,
    /// The region's bytes.
    pub capacity: u64,
    /// Bytes of copies on their way out: marked evicting (their report is
    /// out) or being removed.
    pub evicting: u64,
    /// The largest free extent.
    pub largest_free: u64,
    /// No slot of the region is free.
    pub short_of_slots: bool,
}

/// What a slot record on the device says of its copy (all but the key,
/// which its extent's header holds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Its extent (header and value, in blocks) in the region.
    pub offset: u64,
    pub extent: u64,
    /// The value's length and checksum.
    pub len: u64,
    pub sum: u64,
    /// The write that made it: a slot freed and reused holds a copy with a
    /// higher number (the numbers only grow while the index lives).
    pub seq: u64,
    /// The incarnation it is a copy of (the writer's name for it).
    pub version: u64,
}

/// One copy in a slot.
#[derive(Debug, Clone)]
pub struct SlotCopy {
    pub key: Box<[u8]>,
    pub record: Record,
    /// The read clock at its last read (0: never read).
    pub last_read: u64,
    /// Marked for eviction: not found, not read, its space not yet free.
    pub evicting: bool,
    /// Its removal is under way (a tombstone taken, not yet freed or
    /// failed): no second removal and no eviction mark until it ends.
    pub removing: bool,
}

/// A write's place, taken by [`TierIndex::reserve`]: given back by
/// [`TierIndex::unreserve`] when the write fails, filled by
/// [`TierIndex::insert`] when its bytes are on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    pub slot: u32,
    pub offset: u64,
    pub extent: u64,
    pub seq: u64,
}

impl Reserved {
    /// The record of a copy written here.
    pub fn record(&self, len: u64, sum: u64, version: u64) -> Record {
        Record {
            offset: self.offset,
            extent: self.extent,
            len,
            sum,
            seq: self.seq,
            version,
        }
    }
}

/// Why a write found no place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The key has a copy in the region (evicting or not).
    KeyStored,
    /// Every slot holds a copy.
    NoSlot,
    /// No free extent is that large.
    NoExtent,
}

/// What recovery makes of a record it found live on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Kept: the copy is in the index again.
    Kept,
    /// Its header is torn or does not match the record.
    Torn,
    /// A newer copy of its key was kept (records come newest first).
    Older,
    /// Its extent overlaps a copy already kept.
    Overlaps,
}

/// The index of one region.
pub struct TierIndex {
    alloc: RangeAllocator,
    free_slots: Vec<u32>,
    slots: Vec<Option<SlotCopy>>,
    by_key: HashMap<Box<[u8]>, u32>,
    seq: u64,
    clock: u64,
    /// Copies whose eviction the master took but whose removal failed:
    /// (slot, the copy's write), at most one entry a slot.
    owed: Vec<(u32, u64)>,
}

impl TierIndex {
    /// An empty index of `slots` slots over a data area of `data_bytes`
    /// from `data_offset`, allocated in `block`s. Slots are handed out
    /// lowest first, a freed one next.
    pub fn new(data_offset: u64, data_bytes: u64, block: u64, slots: u32) -> Self {
        Self {
            alloc: RangeAllocator::new(data_offset, data_bytes, block),
            free_slots: (0..slots).rev().collect(),
            slots: (0..slots).map(|_| None).collect(),
            by_key: HashMap::new(),
            seq: 0,
            clock: 0,
            owed: Vec::new(),
        }
    }

    /// A place for a new copy of `key` taking `extent` bytes, and its write
    /// sequence number.
    pub fn reserve(&mut self, key: &[u8], extent: u64) -> Result<Reserved, Refused> {
        if self.by_key.contains_key(key) {
            return Err(Refused::KeyStored);
        }
        let slot = self.free_slots.pop().ok_or(Refused::NoSlot)?;
        let Some(offset) = self.alloc.alloc(extent) else {
            self.free_slots.push(slot);
            return Err(Refused::NoExtent);
        };
        self.seq += 1;
        Ok(Reserved {
            slot,
            offset,
            extent,
            seq: self.seq,
        })
    }

    /// Gives back a place whose write failed (nothing points at it).
    pub fn unreserve(&mut self, r: Reserved) {
        self.alloc.dealloc(r.offset, r.extent);
        self.free_slots.push(r.slot);
    }

    /// The copy of `key` written in `slot` (a place [`TierIndex::reserve`]
    /// took) is on the device: the index names it.
    pub fn insert(&mut self, slot: u32, key: &[u8], record: Record) {
        self.by_key.insert(key.into(), slot);
        self.slots[slot as usize] = Some(SlotCopy {
            key: key.into(),
            record,
            last_read: 0,
            evicting: false,
            removing: false,
        });
    }

    /// The copy in `slot`, evicting or not.
    pub fn copy(&self, slot: u32) -> Option<&SlotCopy> {
        self.slots.get(slot as usize)?.as_ref()
    }

    /// Whether a removal of `key`'s copy is under way.
    pub fn removal_under_way(&self, key: &[u8]) -> bool {
        self.by_key
            .get(key)
            .and_then(|&slot| self.copy(slot))
            .is_some_and(|c| c.removing)
    }

    /// The slot of `key`'s copy, unless it is evicting.
    pub fn lookup(&self, key: &[u8]) -> Option<u32> {
        let slot = *self.by_key.get(key)?;
        self.copy(slot).filter(|c| !c.evicting).map(|_| slot)
    }

    /// Whether `slot` still holds the copy written with sequence `seq`.
    pub fn holds(&self, slot: u32, seq: u64) -> bool {
        self.copy(slot).is_some_and(|c| c.record.seq == seq)
    }

    /// A read of the copy in `slot` if it is not evicting and `wanted` says
    /// so of its key and version: the copy, its last read now (for LRU).
    pub fn read(
        &mut self,
        slot: u32,
        wanted: impl FnOnce(&[u8], u64) -> bool,
    ) -> Option<&SlotCopy> {
        self.clock += 1;
        let clock = self.clock;
        let c = self
            .slots
            .get_mut(slot as usize)?
            .as_mut()
            .filter(|c| !c.evicting && wanted(&c.key, c.record.version))?;
        c.last_read = clock;
        Some(c)
    }

    /// The tombstone of the copy in `slot`: the copy under a new write
    /// sequence number, marked evicting. The caller writes its record,
    /// then calls [`TierIndex::free`], or [`TierIndex::removal_failed`]
    /// when the write fails. `None` while another removal of that copy is
    /// under way: two at once would both write a tombstone and free, and
    /// the later one could meet a new copy in the freed slot (overwrite its
    /// record, or free its space).
    pub fn tombstone(&mut self, slot: u32) -> Option<SlotCopy> {
        let c = self
            .slots
            .get_mut(slot as usize)?
            .as_mut()
            .filter(|c| !c.removing)?;
        c.removing = true;
        let (key, record) = (c.key.clone(), c.record);
        self.seq += 1;
        Some(SlotCopy {
            key,
            record: Record {
                seq: self.seq,
                ..record
            },
            last_read: 0,
            evicting: true,
            removing: true,
        })
    }

    /// The removal of the copy in `slot` failed (its tombstone did not
    /// reach the device): the copy stays as it was, and may be removed
    /// again.
    pub fn removal_failed(&mut self, slot: u32) {
        if let Some(c) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) {
            c.removing = false;
        }
    }

    /// Frees `slot` and its copy's extent (its tombstone is on the device).
    pub fn free(&mut self, slot: u32) -> bool {
        let Some(c) = self.slots.get_mut(slot as usize).and_then(Option::take) else {
            return false;
        };
        self.by_key.remove(&c.key);
        self.alloc.dealloc(c.record.offset, c.record.extent);
        self.free_slots.push(slot);
        true
    }

    /// Bytes of the data area in use, and its size.
    pub fn usage(&self) -> (u64, u64) {
        (self.alloc.used(), self.alloc.capacity())
    }

    /// Copies in the index, evicting ones included.
    pub fn objects(&self) -> usize {
        self.by_key.len()
    }

    /// Every copy neither evicting nor being removed, by slot.
    pub fn entries(&self) -> impl Iterator<Item = (u32, &SlotCopy)> {
        self.slots.iter().enumerate().filter_map(|(slot, c)| {
            Some((
                slot as u32,
                c.as_ref().filter(|c| !c.evicting && !c.removing)?,
            ))
        })
    }

    /// Whether a copy taking `extent` bytes would find a place now.
    pub fn fits(&self, extent: u64) -> bool {
        !self.free_slots.is_empty() && self.alloc.largest_free() >= extent
    }

    /// The space as the eviction rule sees it.
    pub fn space(&self) -> Space {
        Space {
            used: self.alloc.used(),
            capacity: self.alloc.capacity(),
            evicting: self
                .slots
                .iter()
                .flatten()
                .filter(|c| c.evicting || c.removing)
                .map(|c| c.record.extent)
                .sum(),
            largest_free: self.alloc.largest_free(),
            short_of_slots: self.free_slots.is_empty(),
        }
    }

    /// Marks the copies `order` evicts first until their extents reach
    /// `want` bytes (none evicting already, none being removed); their
    /// slots.
    pub fn mark_victims(&mut self, order: Eviction, want: u64) -> Vec<u32> {
        if want == 0 {
            return Vec::new();
        }
        let victims = order.victims(
            self.slots.iter().enumerate().filter_map(|(i, c)| {
                let c = c.as_ref().filter(|c| !c.evicting && !c.removing)?;
                Some((i as u32, c.record.seq, c.last_read, c.record.extent))
            }),
            want,
        );
        for &slot in &victims {
            if let Some(c) = self.slots[slot as usize].as_mut() {
                c.evicting = true;
            }
        }
        victims
    }

    /// Takes back the eviction mark of the copy in `slot` (the master still
    /// lists it); whether it was marked.
    pub fn keep(&mut self, slot: u32) -> bool {
        match self.slots.get_mut(slot as usize).and_then(Option::as_mut) {
            Some(c) if c.evicting => {
                c.evicting = false;
                true
            }
            _ => false,
        }
    }

    /// The master took the eviction of the copy in `slot` (its `Evicted`
    /// report was answered Ok) and its removal failed: the release is owed,
    /// and [`TierIndex::owed_releases`] hands it out again. Without this
    /// the copy would hold its space, and its key this region, until the
    /// node restarts. Whether `slot` holds a copy marked evicting.
    pub fn owe_release(&mut self, slot: u32) -> bool {
        let Some(seq) = self.copy(slot).filter(|c| c.evicting).map(|c| c.record.seq) else {
            return false;
        };
        self.owed.retain(|&(s, _)| s != slot);
        self.owed.push((slot, seq));
        true
    }

    /// Takes the owed releases whose copies still sit in their slots: each
    /// slot with its copy's write number, to remove now if the slot still
    /// [`TierIndex::holds`] that copy (a removal that fails again is owed
    /// again).
    pub fn owed_releases(&mut self) -> Vec<(u32, u64)> {
        let owed = std::mem::take(&mut self.owed);
        owed.into_iter()
            .filter(|&(slot, seq)| {
                self.copy(slot)
                    .is_some_and(|c| c.evicting && c.record.seq == seq)
            })
            .collect()
    }

    /// The slots of copies marked evicting whose release is not owed: their
    /// `Evicted` report is out (or about to go).
    pub fn marked_not_owed(&self) -> impl Iterator<Item = u32> + '_ {
        self.slots.iter().enumerate().filter_map(|(slot, c)| {
            let c = c.as_ref().filter(|c| c.evicting)?;
            let slot = slot as u32;
            (!self.owed.contains(&(slot, c.record.seq))).then_some(slot)
        })
    }

    /// Recovery, one record found live in `slot`, records given newest
    /// first: `key` is what its extent's header names (`None`: torn, or not
    /// the record's). What the index makes of it.
    pub fn recover(&mut self, slot: u32, key: Option<&[u8]>, r: Record) -> Found {
        let Some(key) = key else {
            return Found::Torn;
        };
        if self.by_key.contains_key(key) {
            return Found::Older;
        }
        if !self.alloc.alloc_at(r.offset, r.extent) {
            return Found::Overlaps;
        }
        self.seq = self.seq.max(r.seq);
        self.by_key.insert(key.into(), slot);
        self.slots[slot as usize] = Some(SlotCopy {
            key: key.into(),
            record: r,
            last_read: 0,
            evicting: false,
            removing: false,
        });
        Found::Kept
    }

    /// Recovery is over: every slot without a kept copy is free.
    pub fn recovered(&mut self) {
        let slots = &self.slots;
        self.free_slots = (0..slots.len() as u32)
            .rev()
            .filter(|s| slots[*s as usize].is_none())
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: u64 = 4096;

    #[test]
    fn a_write_takes_the_lowest_free_slot_and_a_freed_one_next() {
        let mut ix = TierIndex::new(B, 16 * B, B, 4);
        let a = ix.reserve(b"a", B).unwrap();
        ix.insert(a.slot, b"a", a.record(1, 11, 7));
        let b = ix.reserve(b"b", B).unwrap();
        ix.insert(b.slot, b"b", b.record(1, 12, 8));
        assert_eq!((a.slot, b.slot), (0, 1));
        assert!(b.seq > a.seq);
        assert_eq!(ix.reserve(b"a", B), Err(Refused::KeyStored));
        assert!(ix
            .tombstone(0)
            .is_some_and(|t| t.evicting && t.record.seq > b.seq));
        assert!(ix.free(0));
        assert_eq!(ix.lookup(b"a"), None);
        let c = ix.reserve(b"c", B).unwrap();
        assert_eq!(c.slot, 0, "the freed slot is reused");
        ix.unreserve(c);
        assert_eq!(ix.usage().0, B);
    }

    #[test]
    fn a_copy_whose_removal_is_under_way_is_not_removed_again_nor_marked() {
        let mut ix = TierIndex::new(B, 16 * B, B, 4);
        let a = ix.reserve(b"a", B).unwrap();
        ix.insert(a.slot, b"a", a.record(1, 0, 0));
        assert!(ix.tombstone(0).is_some());
        // A second removal while the first's tombstone is being written.
        assert!(ix.tombstone(0).is_none(), "one removal at a time");
        assert!(ix.mark_victims(Eviction::Fifo, 16 * B).is_empty());
        assert_eq!(ix.space().evicting, B, "its space is on its way out");
        // The write failed: the copy stays, and may be removed again.
        ix.removal_failed(0);
        assert_eq!(ix.lookup(b"a"), Some(0));
        assert_eq!(ix.space().evicting, 0, "back");
        assert!(ix.tombstone(0).is_some());
        assert!(ix.free(0));
        // The freed slot's next copy is a copy of its own, removable once.
        let b = ix.reserve(b"b", B).unwrap();
        assert_eq!(b.slot, 0);
        ix.insert(b.slot, b"b", b.record(1, 0, 0));
        assert!(ix.tombstone(0).is_some_and(|t| &*t.key == b"b"));
        assert!(ix.tombstone(0).is_none());
    }

    #[test]
    fn an_owed_release_is_handed_out_again_only_while_its_copy_sits_in_its_slot() {
        let mut ix = TierIndex::new(B, 16 * B, B, 4);
        for k in [&b"a"[..], b"b"] {
            let r = ix.reserve(k, B).unwrap();
            ix.insert(r.slot, k, r.record(1, 0, 0));
        }
        assert!(!ix.owe_release(0), "not marked evicting");
        assert_eq!(ix.mark_victims(Eviction::Fifo, 2 * B), vec![0, 1]);
        assert_eq!(ix.marked_not_owed().collect::<Vec<_>>(), vec![0, 1]);
        // Both removals failed after the master took the report.
        assert!(ix.owe_release(0) && ix.owe_release(1) && ix.owe_release(1));
        assert_eq!(ix.marked_not_owed().count(), 0);
        assert_eq!(ix.reserve(b"a", B), Err(Refused::KeyStored));
        // The copy in slot 1 went meanwhile and "c" took the slot: only slot
        // 0's release is handed out.
        assert!(ix.free(1));
        let c = ix.reserve(b"c", B).unwrap();
        assert_eq!(c.slot, 1);
        ix.insert(c.slot, b"c", c.record(1, 0, 0));
        // "c" marked evicting in turn: its report is out, nothing is owed.
        assert_eq!(ix.mark_victims(Eviction::Fifo, B), vec![1]);
        assert_eq!(ix.owed_releases(), vec![(0, 1)]);
        assert!(ix.owed_releases().is_empty(), "taken");
        assert_eq!(ix.marked_not_owed().collect::<Vec<_>>(), vec![0, 1]);
        // Released at last: the key can be stored again.
        assert!(ix.free(0));
        assert!(ix.reserve(b"a", B).is_ok());
    }

    #[test]
    fn a_copy_marked_evicting_is_neither_found_nor_read_until_kept() {
        let mut ix = TierIndex::new(B, 16 * B, B, 4);
        for k in [&b"a"[..], b"b"] {
            let r = ix.reserve(k, B).unwrap();
            ix.insert(r.slot, k, r.record(1, 0, 0));
        }
        assert_eq!(ix.mark_victims(Eviction::Fifo, 1), vec![0]);
        assert_eq!(ix.space().evicting, B);
        assert_eq!(ix.lookup(b"a"), None);
        assert!(ix.read(0, |_, _| true).is_none());
        assert_eq!(ix.reserve(b"a", B), Err(Refused::KeyStored));
        assert_eq!(ix.entries().count(), 1);
        assert!(ix.keep(0));
        assert_eq!(ix.lookup(b"a"), Some(0));
        assert!(ix.read(0, |k, _| k == b"a").is_some());
    }

    #[test]
    fn recovery_keeps_the_newest_copy_of_a_key_and_no_overlapping_extent() {
        let mut ix = TierIndex::new(B, 16 * B, B, 4);
        let copy = |offset, seq| Record {
            offset,
            extent: B,
            len: 1,
            sum: 0,
            seq,
            version: 0,
        };
        assert_eq!(ix.recover(2, Some(b"k"), copy(B, 9)), Found::Kept);
        assert_eq!(ix.recover(0, Some(b"k"), copy(2 * B, 5)), Found::Older);
        assert_eq!(ix.recover(1, Some(b"j"), copy(B, 4)), Found::Overlaps);
        assert_eq!(ix.recover(3, None, copy(3 * B, 3)), Found::Torn);
        ix.recovered();
        assert_eq!(ix.lookup(b"k"), Some(2));
        assert_eq!(ix.reserve(b"n", B).map(|r| (r.slot, r.seq)), Ok((0, 10)));
    }
}
