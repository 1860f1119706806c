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
//! then arbitrary ones.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvpool_transport::proto::ReplicaDesc;

/// Independent locks, so concurrent gets of different keys rarely meet.
const PARTS: usize = 16;

type Entry = (Instant, Arc<[ReplicaDesc]>);

pub(crate) struct Locations {
    parts: Vec<Mutex<HashMap<Vec<u8>, Entry>>>,
    per_part: usize,
}

impl Locations {
    /// A table of at most `entries` keys (0: nothing is kept).
    pub(crate) fn new(entries: usize) -> Self {
        Self {
            parts: (0..PARTS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_part: entries.div_ceil(PARTS),
        }
    }

    fn part(&self, key: &[u8]) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, Entry>> {
        let i = (xxhash_rust::xxh3::xxh3_64(key) % PARTS as u64) as usize;
        // Nothing under the lock can leave a part half-updated (a panic there
        // is an allocation failure inside one HashMap call), so a poisoned
        // lock's map is still sound to use.
        self.parts[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The replicas of `key`, if a lease on them is known to last past now.
    pub(crate) fn get(&self, key: &[u8]) -> Option<Arc<[ReplicaDesc]>> {
        if self.per_part == 0 {
            return None;
        }
        let mut part = self.part(key);
        match part.get(key) {
            Some((until, reps)) if Instant::now() < *until => Some(reps.clone()),
            Some(_) => {
                part.remove(key);
                None
            }
            None => None,
        }
    }

    /// Remembers `replicas` of `key` until `until`.
    pub(crate) fn put(&self, key: &[u8], replicas: &[ReplicaDesc], until: Instant) {
        if self.per_part == 0 || replicas.is_empty() || until <= Instant::now() {
            return;
        }
        let mut part = self.part(key);
        if part.len() >= self.per_part && !part.contains_key(key) {
            let now = Instant::now();
            part.retain(|_, (u, _)| *u > now);
            if part.len() >= self.per_part {
                if let Some(k) = part.keys().next().cloned() {
                    part.remove(&k);
                }
            }
        }
        part.insert(key.to_vec(), (until, replicas.into()));
    }

    /// Forgets `key` (this client removed or rewrote it, or a read through
    /// the entry failed).
    pub(crate) fn forget(&self, key: &[u8]) {
        if self.per_part > 0 {
            self.part(key).remove(key);
        }
    }

    /// Forgets every key.
    pub(crate) fn clear(&self) {
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
mod tests {
    use super::*;
    use kvpool_transport::auth::Grant;
    use kvpool_transport::proto::{Endpoint, Tier};
    use std::time::Duration;

    fn rep(offset: u64) -> ReplicaDesc {
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
        l.put(b"a", &[rep(64)], Instant::now() + Duration::from_millis(50));
        assert_eq!(l.get(b"a").unwrap()[0].offset, 64);
        std::thread::sleep(Duration::from_millis(60));
        assert!(l.get(b"a").is_none(), "the lease has ended");
        l.put(b"b", &[rep(1)], Instant::now() - Duration::from_millis(1));
        assert!(l.get(b"b").is_none(), "an ended lease is not kept");
        l.put(b"c", &[rep(1)], Instant::now() + Duration::from_secs(5));
        l.forget(b"c");
        assert!(l.get(b"c").is_none());
    }

    #[test]
    fn the_table_is_bounded_and_zero_keeps_nothing() {
        let l = Locations::new(32);
        let until = Instant::now() + Duration::from_secs(5);
        for i in 0..10_000u32 {
            l.put(&i.to_le_bytes(), &[rep(i as u64)], until);
        }
        assert!(l.len() <= 32, "{}", l.len());
        l.clear();
        assert_eq!(l.len(), 0);
        let off = Locations::new(0);
        off.put(b"a", &[rep(1)], until);
        assert!(off.get(b"a").is_none());
    }
}
