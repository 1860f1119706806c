//! Range allocator: hands out disjoint, aligned extents of one address range.
//!
//! The master keeps one per (segment, master shard): each shard allocates only
//! in its own range of every segment, so an allocation never crosses shards.
//! Best fit over a size-ordered set of free extents, with coalescing on free;
//! both operations are O(log n) in the number of free extents. Overhead is
//! per free extent, not per allocation.

use std::collections::{BTreeMap, BTreeSet};

/// An allocator over `[base, base + len)`.
#[derive(Debug, Clone)]
pub struct RangeAllocator {
    base: u64,
    len: u64,
    align: u64,
    /// Free extents by offset -> length.
    by_offset: BTreeMap<u64, u64>,
    /// Free extents by (length, offset), for best fit.
    by_size: BTreeSet<(u64, u64)>,
    used: u64,
}

impl RangeAllocator {
    /// An allocator over `[base, base + len)`, handing out multiples of
    /// `align` (a power of two) at offsets that are multiples of `align`.
    /// The range is shrunk inward to aligned bounds.
    pub fn new(base: u64, len: u64, align: u64) -> Self {
        assert!(align.is_power_of_two(), "alignment must be a power of two");
        let start = base.next_multiple_of(align);
        let end = (base + len) & !(align - 1);
        let (start, len) = if end > start {
            (start, end - start)
        } else {
            (start, 0)
        };
        let mut a = Self {
            base: start,
            len,
            align,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            used: 0,
        };
        if len > 0 {
            a.insert_free(start, len);
        }
        a
    }

    pub fn base(&self) -> u64 {
        self.base
    }

    /// Usable bytes in the range.
    pub fn capacity(&self) -> u64 {
        self.len
    }

    /// Bytes handed out (rounded up to the alignment).
    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn free(&self) -> u64 {
        self.len - self.used
    }

    /// The largest extent an allocation could get right now.
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map(|(l, _)| *l).unwrap_or(0)
    }

    /// The size an allocation of `size` bytes really takes.
    pub fn rounded(&self, size: u64) -> u64 {
        size.max(1).next_multiple_of(self.align)
    }

    /// Allocates `size` bytes (rounded up to the alignment); returns the offset.
    pub fn alloc(&mut self, size: u64) -> Option<u64> {
        let need = self.rounded(size);
        let &(flen, foff) = self.by_size.range((need, 0)..).next()?;
        self.remove_free(foff, flen);
        if flen > need {
            self.insert_free(foff + need, flen - need);
        }
        self.used += need;
        Some(foff)
    }

    /// Allocates the extent at exactly `offset` (recovery: space recorded on a
    /// device is taken back). False if any of it is not free.
    pub fn alloc_at(&mut self, offset: u64, size: u64) -> bool {
        let need = self.rounded(size);
        if !offset.is_multiple_of(self.align) {
            return false;
        }
        let Some((&foff, &flen)) = self.by_offset.range(..=offset).next_back() else {
            return false;
        };
        if foff + flen < offset + need {
            return false;
        }
        self.remove_free(foff, flen);
        if offset > foff {
            self.insert_free(foff, offset - foff);
        }
        let end = offset + need;
        if foff + flen > end {
            self.insert_free(end, foff + flen - end);
        }
        self.used += need;
        true
    }

    /// Allocates whatever is free of `[offset, offset + len)` (clipped to
    /// the range, rounded out to the alignment); returns the extents taken,
    /// each to be freed by `dealloc` on its own. (Recovery: space someone
    /// may still write into is held, around what is already allocated.)
    pub fn alloc_free_within(&mut self, offset: u64, len: u64) -> Vec<(u64, u64)> {
        let lo = (offset / self.align * self.align).max(self.base);
        let hi = offset
            .saturating_add(len)
            .next_multiple_of(self.align)
            .min(self.base + self.len);
        let mut taken = Vec::new();
        if lo >= hi {
            return taken;
        }
        // Free extents that meet [lo, hi): the one starting at or before lo,
        // and those starting inside.
        let first = self
            .by_offset
            .range(..=lo)
            .next_back()
            .map(|(&o, &l)| (o, l));
        let inside: Vec<(u64, u64)> = self
            .by_offset
            .range(lo + 1..hi)
            .map(|(&o, &l)| (o, l))
            .collect();
        for (foff, flen) in first.into_iter().chain(inside) {
            let s = foff.max(lo);
            let e = (foff + flen).min(hi);
            if s >= e {
                continue;
            }
            let took = self.alloc_at(s, e - s);
            debug_assert!(took, "free space was free");
            taken.push((s, e - s));
        }
        taken
    }

    /// Returns the extent at `offset` of `size` bytes (as passed to `alloc`).
    ///
    /// # Panics
    /// If the extent is outside the range or overlaps free space: that is a
    /// double free, a bug in the caller.
    pub fn dealloc(&mut self, offset: u64, size: u64) {
        let len = self.rounded(size);
        assert!(
            offset >= self.base && offset + len <= self.base + self.len,
            "dealloc of {offset}+{len} outside [{}, {})",
            self.base,
            self.base + self.len
        );
        let mut start = offset;
        let mut total = len;
        // Merge with the free extent that ends where this one starts.
        if let Some((&poff, &plen)) = self.by_offset.range(..offset).next_back() {
            assert!(poff + plen <= offset, "double free at {offset}");
            if poff + plen == offset {
                self.remove_free(poff, plen);
                start = poff;
                total += plen;
            }
        }
        // Merge with the free extent that starts where this one ends.
        if let Some((&noff, &nlen)) = self.by_offset.range(offset..).next() {
            assert!(noff >= offset + len, "double free at {offset}");
            if noff == offset + len {
                self.remove_free(noff, nlen);
                total += nlen;
            }
        }
        self.insert_free(start, total);
        self.used -= len;
    }

    fn insert_free(&mut self, off: u64, len: u64) {
        self.by_offset.insert(off, len);
        self.by_size.insert((len, off));
    }

    fn remove_free(&mut self, off: u64, len: u64) {
        self.by_offset.remove(&off);
        self.by_size.remove(&(len, off));
    }

    /// Number of free extents (a fragmentation measure).
    pub fn free_extents(&self) -> usize {
        self.by_offset.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocations_are_aligned_disjoint_and_reusable() {
        let mut a = RangeAllocator::new(100, 1000, 64);
        assert_eq!(a.base(), 128);
        assert_eq!(
            a.capacity(),
            1088 - 128,
            "[100, 1100) shrinks to [128, 1088)"
        );
        let x = a.alloc(1).unwrap();
        let y = a.alloc(65).unwrap();
        assert_eq!(x % 64, 0);
        assert_eq!(y % 64, 0);
        assert!(x + 64 <= y || y + 128 <= x);
        assert_eq!(a.used(), 64 + 128);
        a.dealloc(x, 1);
        a.dealloc(y, 65);
        assert_eq!(a.used(), 0);
        assert_eq!(a.free_extents(), 1, "frees coalesce back into one extent");
        assert_eq!(a.largest_free(), a.capacity());
    }

    #[test]
    fn full_range_refuses_then_accepts_after_free() {
        let mut a = RangeAllocator::new(0, 256, 64);
        let offs: Vec<u64> = (0..4).map(|_| a.alloc(64).unwrap()).collect();
        assert!(a.alloc(1).is_none());
        a.dealloc(offs[2], 64);
        assert_eq!(a.alloc(64), Some(offs[2]));
    }

    #[test]
    fn best_fit_keeps_large_extents_whole() {
        let mut a = RangeAllocator::new(0, 64 * 10, 64);
        let p: Vec<u64> = (0..10).map(|_| a.alloc(64).unwrap()).collect();
        a.dealloc(p[1], 64); // hole of 1
        a.dealloc(p[4], 64);
        a.dealloc(p[5], 64);
        a.dealloc(p[6], 64); // hole of 3
        assert_eq!(a.alloc(64), Some(p[1]), "the 1-block hole fits best");
        assert_eq!(a.alloc(192), Some(p[4]));
    }

    #[test]
    fn alloc_at_claims_exact_extents_and_refuses_taken_ones() {
        let mut a = RangeAllocator::new(0, 64 * 10, 64);
        assert!(a.alloc_at(128, 128));
        assert!(!a.alloc_at(192, 64), "taken");
        assert!(!a.alloc_at(100, 64), "unaligned");
        assert!(a.alloc_at(0, 64));
        assert_eq!(a.used(), 192);
        // What is left is still allocatable around the claimed extents.
        assert_eq!(a.alloc(64), Some(64));
        a.dealloc(128, 128);
        assert_eq!(a.alloc(128), Some(128));
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_is_caught() {
        let mut a = RangeAllocator::new(0, 1024, 64);
        let x = a.alloc(64).unwrap();
        let _y = a.alloc(64).unwrap();
        a.dealloc(x, 64);
        a.dealloc(x, 64);
    }

    proptest! {
        /// Random alloc/free sequences against a plain model: no two live
        /// allocations overlap, accounting matches, everything coalesces.
        #[test]
        fn random_sequences_never_overlap(ops in proptest::collection::vec((any::<bool>(), 1u64..5000, any::<u16>()), 1..400)) {
            let mut a = RangeAllocator::new(0, 64 * 1024, 64);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (is_alloc, size, pick) in ops {
                if is_alloc || live.is_empty() {
                    if let Some(off) = a.alloc(size) {
                        let len = a.rounded(size);
                        for &(o, l) in &live {
                            let ol = a.rounded(l);
                            prop_assert!(off + len <= o || o + ol <= off, "overlap");
                        }
                        prop_assert!(off + len <= 64 * 1024);
                        live.push((off, size));
                    } else {
                        prop_assert!(a.largest_free() < a.rounded(size));
                    }
                } else {
                    let i = pick as usize % live.len();
                    let (o, l) = live.swap_remove(i);
                    a.dealloc(o, l);
                }
                let model_used: u64 = live.iter().map(|&(_, l)| a.rounded(l)).sum();
                prop_assert_eq!(a.used(), model_used);
            }
            for (o, l) in live.drain(..) {
                a.dealloc(o, l);
            }
            prop_assert_eq!(a.free_extents(), 1);
            prop_assert_eq!(a.used(), 0);
        }
    }
}
