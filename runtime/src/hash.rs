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

/// The checksum of a value: xxh3-64, no seed, of its bytes. Every writer
/// computes it and every reader and tier checks it, so it is the hottest
/// loop of the data path after the copies. It runs through `twox-hash`,
/// which picks its AVX2 loop at run time where the CPU has it (xxhash-rust,
/// used for keys and frames, takes only what the build targets: SSE2). The
/// digest is the same xxh3-64 either way (a test below holds them equal):
/// checksums stored or sent by an older build still match.
#[inline]
pub fn value_sum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// [`value_sum`] over pieces given in order: equals `value_sum` of their
/// concatenation.
pub struct ValueSum(twox_hash::XxHash3_64);

impl ValueSum {
    pub fn new() -> Self {
        Self(twox_hash::XxHash3_64::new())
    }

    pub fn update(&mut self, piece: &[u8]) {
        std::hash::Hasher::write(&mut self.0, piece);
    }

    pub fn digest(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

impl Default for ValueSum {
    fn default() -> Self {
        Self::new()
    }
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
    fn the_value_sum_is_xxh3_64_whole_or_in_pieces() {
        // Values stored or sent by builds that hashed with xxhash-rust must
        // still check: both crates must give the same digest, below and
        // above xxh3's 240-byte and stripe boundaries, whole or in pieces.
        assert_eq!(value_sum(b""), 0x2d06_8005_38d3_94c2, "xxh3-64 of nothing");
        let v: Vec<u8> = (0..(1usize << 20) + 4099)
            .map(|i| (i * 31 + i / 257) as u8)
            .collect();
        for len in [
            0,
            1,
            3,
            4,
            8,
            9,
            16,
            17,
            128,
            129,
            240,
            241,
            1024,
            1025,
            4096,
            100_000,
            v.len(),
        ] {
            let want = xxhash_rust::xxh3::xxh3_64(&v[..len]);
            assert_eq!(value_sum(&v[..len]), want, "len {len}");
            for piece in [1, 63, 64, 240, 4096, 65_536] {
                let mut s = ValueSum::new();
                v[..len].chunks(piece).for_each(|p| s.update(p));
                assert_eq!(s.digest(), want, "len {len} in pieces of {piece}");
            }
        }
    }

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
