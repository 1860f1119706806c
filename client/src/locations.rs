//! Where recently read objects lie, for as long as this client's read lease
//! on them lasts.
//!
//! A `GetReplicaList` answer grants a read lease: until it ends the master
//! neither frees nor reuses the object's space (a forced removal waits for
//! it, eviction skips it). Within that time the replica list is as good as a
//! new one, so a repeated get can skip the master and read the node at once.
//! An entry is trusted until the lease's end as this process measured it
//! (from before the request was sent) less a margin for clock skew and for
//! the read itself; a read through an entry that fails drops the entry and
//! asks the master again. Bounded: a full table first sheds expired entries,
//! then arbitrary ones until an eighth of it is free ([`make_room`]: one
//! scan per `entries / 8` inserts, not one per insert).
//!
//! An answer must not outlive this client's own change of the key: a get
//! whose `GetReplicaList` was answered before this client's put, upsert or
//! remove of the key ended must not store that (old) answer after the
//! change forgot the key, or a later get of this client would read the old
//! value. So `forget` moves the key's generation on, a get notes the
//! generation before it asks the master, and `put` keeps the answer only
//! if the generation has not moved since.
//!
//! The table takes its clock as an argument (`Instant` in the client), so
//! the cluster simulation (`tools/cluster-sim`) runs these rules, and
//! [`cacheable`], on its simulated clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvpool_wire::proto::{ReplicaDesc, Tier};

/// Independent locks, so concurrent gets of different keys rarely meet.
const PARTS: usize = 16;
/// Generation counters, keys spread over them by hash: a change of one key
/// only rarely stops an answer about another from being kept.
const GENERATIONS: usize = 1024;

type Entry<T> = (T, Arc<[ReplicaDesc]>);

/// The table: key -> (until when it may be read, its replicas), in time
/// `T` (an `Instant`, or a simulated clock).
pub struct Locations<T = Instant> {
    parts: Vec<Mutex<HashMap<Vec<u8>, Entry<T>>>>,
    per_part: usize,
    generations: Box<[AtomicU64]>,
}

/// Runs its closure when dropped: a change forgets its keys when it is
/// over, whether it returned or its future was dropped midway.
pub(crate) struct OnDrop<F: FnMut()>(pub(crate) F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// A key's generation when a get asked the master (see [`Locations::put`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Generation(u64);

/// The replicas of a `GetReplicaList` answer worth remembering: only what
/// the read lease protects and the checksum proves, DRAM replicas (the
/// master frees no leased DRAM space; an NVMe tier evicts on its own and
/// reuses locations) of an object with a checksum this client checks
/// (`checksums`: a master restarted meanwhile knows no leases, and its new
/// puts may land where the object was).
/// When every replica is worth it (DRAM only, with a checksum: the common
/// answer), the answer itself is shared, not copied.
pub fn cacheable(replicas: &Arc<[ReplicaDesc]>, checksums: bool) -> Arc<[ReplicaDesc]> {
    let kept = |d: &ReplicaDesc| checksums && d.tier == Tier::Dram && d.checksum.is_some();
    if replicas.iter().all(kept) {
        return replicas.clone();
    }
    replicas.iter().filter(|d| kept(d)).cloned().collect()
}

/// Makes room in `map`, a full part of a table bounded at `most` entries:
/// drops the entries `live` says are over, then arbitrary ones until an
/// eighth of `most` is free, so the scan over the part is paid once per
/// `most / 8` inserts, not at each (at each, a table full of live leases
/// cost a scan of the whole part per insert: ~10 us at 4,096 entries).
/// The RESP front's view cache keeps its table by the same rule.
pub fn make_room<K, V>(map: &mut HashMap<K, V>, most: usize, mut live: impl FnMut(&V) -> bool) {
    map.retain(|_, v| live(v));
    let mut over = map.len().saturating_sub(most - most.div_ceil(8));
    if over > 0 {
        map.retain(|_, _| {
            if over == 0 {
                return true;
            }
            over -= 1;
            false
        });
    }
}

fn hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key)
}

impl<T: Copy + Ord> Locations<T> {
    /// A table of at most `entries` keys (0: nothing is kept).
    pub fn new(entries: usize) -> Self {
        Self {
            parts: (0..PARTS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_part: entries.div_ceil(PARTS),
            generations: (0..GENERATIONS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn generation_of(&self, key: &[u8]) -> &AtomicU64 {
        // The part index uses the hash's low bits; these use higher ones.
        &self.generations[((hash(key) >> 16) % GENERATIONS as u64) as usize]
    }

    /// The key's generation now: taken before asking the master.
    pub fn generation(&self, key: &[u8]) -> Generation {
        Generation(self.generation_of(key).load(Ordering::SeqCst))
    }

    fn part(&self, key: &[u8]) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, Entry<T>>> {
        let i = (hash(key) % PARTS as u64) as usize;
        // Nothing under the lock can leave a part half-updated (a panic there
        // is an allocation failure inside one HashMap call), so a poisoned
        // lock's map is still sound to use.
        self.parts[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The replicas of `key` and until when they may be read, if a lease on
    /// them is known to last past `now`.
    pub fn get(&self, key: &[u8], now: T) -> Option<(T, Arc<[ReplicaDesc]>)> {
        if self.per_part == 0 {
            return None;
        }
        let mut part = self.part(key);
        match part.get(key) {
            Some((until, reps)) if now < *until => Some((*until, reps.clone())),
            Some(_) => {
                part.remove(key);
                None
            }
            None => None,
        }
    }

    /// Remembers `replicas` of `key` until `until` (it is `now`), unless
    /// this client changed the key since `seen` (then the answer may be of
    /// the object before the change).
    pub fn put(
        &self,
        key: &[u8],
        replicas: impl Into<Arc<[ReplicaDesc]>>,
        until: T,
        seen: Generation,
        now: T,
    ) {
        let replicas = replicas.into();
        if self.per_part == 0 || replicas.is_empty() || until <= now {
            return;
        }
        let mut part = self.part(key);
        // Under the part's lock: a `forget` that moved the generation
        // before this load is seen here; one after it removes the entry.
        if self.generation(key) != seen {
            return;
        }
        if part.len() >= self.per_part && !part.contains_key(key) {
            make_room(&mut part, self.per_part, |(u, _)| *u > now);
        }
        part.insert(key.to_vec(), (until, replicas));
    }

    /// Forgets `key` (this client removed or rewrote it, or a read through
    /// the entry failed), and any answer about it asked for before now.
    pub fn forget(&self, key: &[u8]) {
        if self.per_part > 0 {
            self.generation_of(key).fetch_add(1, Ordering::SeqCst);
            self.part(key).remove(key);
        }
    }

    /// Forgets every key, and every answer asked for before now.
    pub fn clear(&self) {
        for g in self.generations.iter() {
            g.fetch_add(1, Ordering::SeqCst);
        }
        for p in &self.parts {
            p.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.parts
            .iter()
            .map(|p| p.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kvpool_wire::auth::Grant;
    use kvpool_wire::proto::Endpoint;
    use std::time::Duration;

    /// A DRAM replica at `offset` (10 bytes, no checksum).
    pub(crate) fn rep(offset: u64) -> ReplicaDesc {
        ReplicaDesc {
            segment_id: 1,
            endpoint: Endpoint {
                host: "h".into(),
                port: 1,
                nr_shards: 1,
            },
            slice_bytes: 1 << 20,
            host_id: "h".into(),
            offset,
            len: 10,
            tier: Tier::Dram,
            checksum: None,
            grant: Grant::default(),
        }
    }

    #[test]
    fn an_entry_lasts_until_its_lease_and_no_longer() {
        let l = Locations::new(8);
        let g = |k: &[u8]| l.generation(k);
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        l.put(b"a", [rep(64)], ms(50), g(b"a"), t0);
        assert_eq!(l.get(b"a", ms(49)).unwrap().1[0].offset, 64);
        assert!(l.get(b"a", ms(50)).is_none(), "the lease has ended");
        assert!(l.get(b"a", ms(1)).is_none(), "and the entry went");
        l.put(b"b", [rep(1)], ms(10), g(b"b"), ms(10));
        assert!(l.get(b"b", ms(0)).is_none(), "an ended lease is not kept");
        l.put(b"c", [rep(1)], ms(5_000), g(b"c"), t0);
        l.forget(b"c");
        assert!(l.get(b"c", t0).is_none());
    }

    #[test]
    fn only_checked_dram_replicas_are_remembered() {
        let mut summed = rep(1);
        summed.checksum = Some(7);
        let mut nvme = summed.clone();
        nvme.tier = Tier::Nvme;
        let all: Arc<[ReplicaDesc]> = [rep(0), summed.clone(), nvme].into();
        assert_eq!(*cacheable(&all, true), [summed]);
        assert_eq!(*cacheable(&all, false), [], "a client that checks nothing");
    }

    /// The common answer (DRAM replicas with a checksum) is shared with
    /// the table, not copied; one with a replica not worth keeping is
    /// filtered; without checksums nothing is.
    #[test]
    fn an_answer_worth_keeping_whole_is_shared_not_copied() {
        let summed = |offset| ReplicaDesc {
            checksum: Some(7),
            ..rep(offset)
        };
        let all: Arc<[ReplicaDesc]> = vec![summed(1), summed(2)].into();
        assert!(Arc::ptr_eq(&cacheable(&all, true), &all));
        let mixed: Arc<[ReplicaDesc]> = vec![summed(1), rep(2)].into();
        assert_eq!(cacheable(&mixed, true).len(), 1);
        assert!(cacheable(&all, false).is_empty());
    }

    #[test]
    fn an_answer_asked_for_before_a_forget_is_not_kept() {
        let l = Locations::new(8);
        let now = Instant::now();
        let until = now + Duration::from_secs(5);
        // A get asks the master; meanwhile this client rewrites the key.
        let asked = l.generation(b"k");
        l.forget(b"k");
        l.put(b"k", [rep(1)], until, asked, now);
        assert!(l.get(b"k", now).is_none(), "the old answer came back");
        // An answer asked for after the change is kept.
        l.put(b"k", [rep(2)], until, l.generation(b"k"), now);
        assert_eq!(l.get(b"k", now).unwrap().1[0].offset, 2);
        // remove_all: every answer asked for before it is stale.
        let asked = l.generation(b"other");
        l.clear();
        l.put(b"other", [rep(3)], until, asked, now);
        assert!(l.get(b"other", now).is_none());
    }

    /// A full part makes room for an eighth of itself at once: expired
    /// entries first, then arbitrary ones, so the scan over the part is
    /// paid once per eighth of its inserts (it was paid at every insert
    /// into a table full of live leases, ~10 us a get that missed).
    #[test]
    fn a_full_part_sheds_expired_entries_then_an_eighth_of_itself() {
        let now = Instant::now();
        let until = now + Duration::from_secs(5);
        let soon = now + Duration::from_millis(1);
        let later = soon + Duration::from_millis(1);
        // Keys of part 0 only.
        let keys = || {
            (0u32..)
                .map(|i| i.to_le_bytes().to_vec())
                .filter(|k| hash(k).is_multiple_of(PARTS as u64))
        };
        let part0 = |l: &Locations| l.parts[0].lock().unwrap().len();
        let put = |l: &Locations, k: &[u8], until| l.put(k, [rep(1)], until, l.generation(k), now);
        // Full of live leases: one more key leaves 14 of them and itself.
        let l = Locations::new(16 * PARTS); // 16 entries a part
        let mut ks = keys();
        for k in ks.by_ref().take(16) {
            put(&l, &k, until);
        }
        assert_eq!(part0(&l), 16);
        let k = ks.next().unwrap();
        put(&l, &k, until);
        assert_eq!(part0(&l), 15, "an eighth of the part shed at once");
        assert!(l.get(&k, now).is_some(), "the new entry is kept");
        // Full, three entries expired: they go, and no live one.
        let l = Locations::new(16 * PARTS);
        let all: Vec<Vec<u8>> = keys().take(17).collect();
        for (i, k) in all[..16].iter().enumerate() {
            put(&l, k, if i < 3 { soon } else { until });
        }
        assert_eq!(part0(&l), 16);
        l.put(&all[16], [rep(1)], until, l.generation(&all[16]), later);
        assert_eq!(part0(&l), 14, "the 13 live entries and the new one");
        assert!(all[3..].iter().all(|k| l.get(k, later).is_some()));
    }

    #[test]
    fn the_table_is_bounded_and_zero_keeps_nothing() {
        let l = Locations::new(32);
        let now = Instant::now();
        let until = now + Duration::from_secs(5);
        for i in 0..10_000u32 {
            let k = i.to_le_bytes();
            l.put(&k, [rep(i as u64)], until, l.generation(&k), now);
        }
        assert!(l.len() <= 32, "{}", l.len());
        l.clear();
        assert_eq!(l.len(), 0);
        let off = Locations::new(0);
        off.put(b"a", [rep(1)], until, off.generation(b"a"), now);
        assert!(off.get(b"a", now).is_none());
    }
}
