//! Views of recently read values, shared by every RESP thread, kept while
//! their read lease lasts: a repeated GET is answered from the storage
//! node's memory without asking the master.
//!
//! Coherent for this front: its own SET, MSET, DEL and FLUSHALL drop the
//! entries they touch once the pool has taken them, and a lookup that was
//! under way meanwhile does not put its (possibly older) view back: every
//! part has an epoch, bumped by each such change, and a view is kept only if
//! its part's epoch is what it was before the lookup asked the master. A
//! value replaced or removed through another process can still be served
//! until the view's lease ends (less a margin), as the pool client's own
//! location cache does. Bounded: a full part sheds expired entries, then
//! arbitrary ones until an eighth of it is free (the client's rule,
//! [`kvpool_client::locations::make_room`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvpool_client::locations::make_room;
use kvpool_client::ReadView;

/// Independent locks.
const PARTS: usize = 16;
/// A view with less lease than this left is not served from the table (its
/// reply must still be written after it is found).
const MIN_LEFT: Duration = Duration::from_secs(1);

/// What the table keeps: something valid until a moment.
pub(crate) trait Leased {
    fn valid_until(&self) -> Instant;
}

impl Leased for ReadView {
    fn valid_until(&self) -> Instant {
        ReadView::valid_until(self)
    }
}

struct Part<V> {
    views: HashMap<Vec<u8>, Arc<V>>,
    epoch: u64,
}

pub(crate) struct ViewCache<V: Leased = ReadView> {
    parts: Vec<Mutex<Part<V>>>,
    per_part: usize,
}

/// A part's epoch, taken before a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Epoch(u64);

impl<V: Leased> ViewCache<V> {
    /// A table of at most `entries` keys (0: nothing is kept).
    pub(crate) fn new(entries: usize) -> Self {
        Self {
            parts: (0..PARTS)
                .map(|_| {
                    Mutex::new(Part {
                        views: HashMap::new(),
                        epoch: 0,
                    })
                })
                .collect(),
            per_part: entries.div_ceil(PARTS),
        }
    }

    fn part(&self, key: &[u8]) -> MutexGuard<'_, Part<V>> {
        let i = (kvpool_runtime::hash::vshard_of(key) as usize) % PARTS;
        // Nothing under the lock can leave a part half-updated (a panic there
        // is an allocation failure inside one HashMap call).
        self.parts[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A view of `key` with at least [`MIN_LEFT`] of lease left.
    pub(crate) fn get(&self, key: &[u8]) -> Option<Arc<V>> {
        if self.per_part == 0 {
            return None;
        }
        let mut part = self.part(key);
        let v = part.views.get(key)?;
        if v.valid_until() > Instant::now() + MIN_LEFT {
            return Some(v.clone());
        }
        part.views.remove(key);
        None
    }

    /// The epoch of `key`'s part, to give back to [`ViewCache::put`].
    pub(crate) fn epoch(&self, key: &[u8]) -> Epoch {
        Epoch(self.part(key).epoch)
    }

    /// Keeps `view` of `key` unless the part changed since `seen`.
    pub(crate) fn put(&self, key: &[u8], view: Arc<V>, seen: Epoch) {
        if self.per_part == 0 || view.valid_until() <= Instant::now() + MIN_LEFT {
            return;
        }
        let mut part = self.part(key);
        if part.epoch != seen.0 {
            return;
        }
        if part.views.len() >= self.per_part && !part.views.contains_key(key) {
            let soon = Instant::now() + MIN_LEFT;
            make_room(&mut part.views, self.per_part, |v| v.valid_until() > soon);
        }
        part.views.insert(key.to_vec(), view);
    }

    /// `key` changed (or may have): its view goes, and lookups under way
    /// keep theirs to themselves.
    pub(crate) fn forget(&self, key: &[u8]) {
        let mut part = self.part(key);
        part.epoch += 1;
        part.views.remove(key);
    }

    /// Every key may have changed.
    pub(crate) fn clear(&self) {
        for p in &self.parts {
            let mut part = p.lock().unwrap_or_else(|p| p.into_inner());
            part.epoch += 1;
            part.views.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(Instant);

    impl Leased for Fake {
        fn valid_until(&self) -> Instant {
            self.0
        }
    }

    fn lasting(s: u64) -> Arc<Fake> {
        Arc::new(Fake(Instant::now() + Duration::from_secs(s)))
    }

    #[test]
    fn a_lookup_overtaken_by_a_write_does_not_put_its_view_back() {
        let c: ViewCache<Fake> = ViewCache::new(100);
        // A lookup starts, a SET of the key ends, then the lookup answers
        // (with the old object): it must not be kept.
        let seen = c.epoch(b"k");
        c.forget(b"k");
        c.put(b"k", lasting(10), seen);
        assert!(c.get(b"k").is_none());
        // A lookup that started after the write is kept.
        let seen = c.epoch(b"k");
        c.put(b"k", lasting(10), seen);
        assert!(c.get(b"k").is_some());
        // Removed by a write, and by FLUSHALL for every key.
        c.forget(b"k");
        assert!(c.get(b"k").is_none());
        let seen = c.epoch(b"other");
        c.clear();
        c.put(b"other", lasting(10), seen);
        assert!(c.get(b"other").is_none());
    }

    /// The client's rule ([`make_room`]): a part full of lasting views
    /// sheds an eighth of itself at once, not one view per insert.
    #[test]
    fn a_full_part_sheds_an_eighth_of_itself_at_once() {
        let c: ViewCache<Fake> = ViewCache::new(16 * PARTS); // 16 a part
        let part0 = |c: &ViewCache<Fake>| c.parts[0].lock().unwrap().views.len();
        let keys = (0u32..)
            .map(|i| i.to_le_bytes().to_vec())
            .filter(|k| (kvpool_runtime::hash::vshard_of(k) as usize).is_multiple_of(PARTS));
        for k in keys.take(17) {
            let e = c.epoch(&k);
            c.put(&k, lasting(10), e);
        }
        assert_eq!(part0(&c), 15, "14 kept and the new view");
    }

    #[test]
    fn views_near_their_lease_end_are_not_served_and_the_table_is_bounded() {
        let c: ViewCache<Fake> = ViewCache::new(32);
        let e = c.epoch(b"short");
        c.put(b"short", Arc::new(Fake(Instant::now() + MIN_LEFT / 2)), e);
        assert!(c.get(b"short").is_none());
        for i in 0..1000u32 {
            let k = i.to_le_bytes();
            let e = c.epoch(&k);
            c.put(&k, lasting(10), e);
        }
        let kept = (0..1000u32)
            .filter(|i| c.get(&i.to_le_bytes()).is_some())
            .count();
        assert!(kept <= 32 && kept > 0, "{kept}");
        let off: ViewCache<Fake> = ViewCache::new(0);
        let e = off.epoch(b"k");
        off.put(b"k", lasting(10), e);
        assert!(off.get(b"k").is_none());
    }
}
