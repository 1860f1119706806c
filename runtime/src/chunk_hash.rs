//! Prefix-chained chunk hashing and store keys.
//!
//! A prompt is cut into fixed chunks of `chunk_tokens` tokens. Chunk `i` is
//! identified by
//!
//! ```text
//! hash_i = xxh3_64_with_seed(le_bytes(hash_{i-1}) ++ le_bytes(token_0) ++ ... , CHUNK_HASH_SEED)
//! hash_{-1} = CHAIN_ROOT (0)
//! ```
//!
//! so a hash names the whole prefix up to and including its chunk: two
//! prompts share chunk `i`'s hash only if they share every token up to the end
//! of chunk `i`. The function and seed are fixed constants, so every process
//! and every run computes the same hashes.
//!
//! Only full chunks are hashed: a trailing partial chunk is never cacheable,
//! because its KV would be recomputed (and extended) by the next request that
//! shares the prefix anyway, and caching it would make the key depend on where
//! the prompt happens to end.
//!
//! Traces in the Mooncake format already carry prefix-chained block ids
//! (`hash_ids`); the simulator uses those ids directly as [`ChunkHash`]
//! values instead of re-hashing them.

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Default chunk size in tokens (LMCache's default).
pub const DEFAULT_CHUNK_TOKENS: usize = 256;
/// Chunk size of the Mooncake traces (one `hash_ids` entry per 512 tokens).
pub const MOONCAKE_CHUNK_TOKENS: usize = 512;
/// Seed of the chunk hash. Changing it invalidates every stored key.
pub const CHUNK_HASH_SEED: u64 = 0x6b76_706f_6f6c_0007;
/// The value standing for `hash_{-1}`: the chain of the first chunk starts here.
pub const CHAIN_ROOT: u64 = 0;

/// The hash of one chunk together with its whole prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ChunkHash(pub u64);

impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Errors of chunk hashing and store-key handling.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkHashError {
    /// `chunk_tokens` was zero.
    #[error("chunk size must be at least one token")]
    ZeroChunkTokens,
    /// A chunk handed to [`ChunkHasher::push`] did not have exactly `chunk_tokens` tokens.
    #[error("chunk has {got} tokens, expected exactly {expected} (only full chunks are hashed)")]
    PartialChunk { got: usize, expected: usize },
    /// A store key did not have the form `model@hash@format@ntokens`.
    #[error("store key {key:?} is malformed: {reason}")]
    BadStoreKey { key: String, reason: &'static str },
    /// A model or format name was empty or contained `@`.
    #[error("{field} {value:?} must be non-empty and must not contain '@'")]
    BadKeyPart { field: &'static str, value: String },
}

/// Incremental prefix-chained hasher: feed full chunks in order.
///
/// The byte buffer is reused between chunks, so hashing a prompt allocates
/// once per hasher, not once per chunk.
#[derive(Debug, Clone)]
pub struct ChunkHasher {
    chunk_tokens: usize,
    prev: u64,
    buf: Vec<u8>,
}

impl ChunkHasher {
    /// A hasher for chunks of `chunk_tokens` tokens, starting a new chain.
    pub fn new(chunk_tokens: usize) -> Result<Self, ChunkHashError> {
        if chunk_tokens == 0 {
            return Err(ChunkHashError::ZeroChunkTokens);
        }
        Ok(Self {
            chunk_tokens,
            prev: CHAIN_ROOT,
            buf: Vec::with_capacity(8 + 4 * chunk_tokens),
        })
    }

    /// Chunk size in tokens.
    pub fn chunk_tokens(&self) -> usize {
        self.chunk_tokens
    }

    /// Hashes the next chunk of the chain. `chunk` must be a full chunk.
    pub fn push(&mut self, chunk: &[u32]) -> Result<ChunkHash, ChunkHashError> {
        if chunk.len() != self.chunk_tokens {
            return Err(ChunkHashError::PartialChunk {
                got: chunk.len(),
                expected: self.chunk_tokens,
            });
        }
        self.buf.clear();
        self.buf.extend_from_slice(&self.prev.to_le_bytes());
        for token in chunk {
            self.buf.extend_from_slice(&token.to_le_bytes());
        }
        self.prev = xxh3_64_with_seed(&self.buf, CHUNK_HASH_SEED);
        Ok(ChunkHash(self.prev))
    }
}

/// Hashes every full chunk of `tokens`; a trailing partial chunk is ignored.
///
/// ```
/// use kvpool_runtime::chunk_hash::chunk_hashes;
/// let tokens: Vec<u32> = (0..600).collect();
/// let hashes = chunk_hashes(&tokens, 256).unwrap();
/// assert_eq!(hashes.len(), 2); // 600 = 2 * 256 + 88; the last 88 tokens are not hashed
/// // A prompt that shares the first 512 tokens shares both hashes.
/// let other: Vec<u32> = (0..512).chain(9000..9100).collect();
/// assert_eq!(chunk_hashes(&other, 256).unwrap(), hashes);
/// ```
pub fn chunk_hashes(tokens: &[u32], chunk_tokens: usize) -> Result<Vec<ChunkHash>, ChunkHashError> {
    let mut hasher = ChunkHasher::new(chunk_tokens)?;
    let mut out = Vec::with_capacity(tokens.len() / chunk_tokens);
    for chunk in tokens.chunks_exact(chunk_tokens) {
        out.push(hasher.push(chunk)?);
    }
    Ok(out)
}

/// A store key, `model@hash@format@ntokens` (LMCache style), where `hash` is
/// the chunk hash as 16 lower-case hex digits and `ntokens` the number of
/// tokens the chunk holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StoreKey {
    model: String,
    hash: ChunkHash,
    format: String,
    ntokens: u32,
}

fn check_part(field: &'static str, value: &str) -> Result<(), ChunkHashError> {
    if value.is_empty() || value.contains('@') {
        return Err(ChunkHashError::BadKeyPart {
            field,
            value: value.to_string(),
        });
    }
    Ok(())
}

impl StoreKey {
    /// Builds a key; `model` and `format` must be non-empty and free of `@`.
    pub fn new(
        model: &str,
        hash: ChunkHash,
        format: &str,
        ntokens: u32,
    ) -> Result<Self, ChunkHashError> {
        check_part("model", model)?;
        check_part("format", format)?;
        Ok(Self {
            model: model.to_string(),
            hash,
            format: format.to_string(),
            ntokens,
        })
    }
    /// Model name.
    pub fn model(&self) -> &str {
        &self.model
    }
    /// Chunk hash.
    pub fn hash(&self) -> ChunkHash {
        self.hash
    }
    /// KV format name (e.g. `bf16-paged`).
    pub fn format(&self) -> &str {
        &self.format
    }
    /// Tokens in the chunk.
    pub fn ntokens(&self) -> u32 {
        self.ntokens
    }
}

impl fmt::Display for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}@{:016x}@{}@{}",
            self.model, self.hash.0, self.format, self.ntokens
        )
    }
}

impl FromStr for StoreKey {
    type Err = ChunkHashError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason| ChunkHashError::BadStoreKey {
            key: s.to_string(),
            reason,
        };
        let mut parts = s.split('@');
        let (Some(model), Some(hash), Some(format), Some(ntokens), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(bad("expected exactly four '@'-separated parts"));
        };
        if hash.len() != 16 {
            return Err(bad("hash must be 16 hex digits"));
        }
        let hash = u64::from_str_radix(hash, 16).map_err(|_| bad("hash must be 16 hex digits"))?;
        let ntokens = ntokens
            .parse::<u32>()
            .map_err(|_| bad("ntokens must be an unsigned integer"))?;
        Self::new(model, ChunkHash(hash), format, ntokens)
    }
}

/// Hasher for maps keyed by [`ChunkHash`] (or other `u64` ids): one
/// multiply-xorshift round (the splitmix64 finaliser) instead of SipHash.
///
/// Keys come from the cluster's own components (proxies, the pool, traces),
/// not from clients, so hash flooding is not a concern here; the maps are on
/// the simulator's hot path, where SipHash would dominate.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdHashBuilder;

/// The [`Hasher`] made by [`IdHashBuilder`].
#[derive(Debug, Clone, Copy, Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        let mut z = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

impl BuildHasher for IdHashBuilder {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(0)
    }
}

/// A `HashMap` keyed by ids, hashed with [`IdHashBuilder`].
pub type IdMap<K, V> = std::collections::HashMap<K, V, IdHashBuilder>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_values_do_not_drift() {
        // Any change of function, seed, root or byte layout changes these and
        // invalidates every key in every deployed pool: bump deliberately.
        let tokens: Vec<u32> = (0..512).collect();
        let h = chunk_hashes(&tokens, 256).unwrap();
        assert_eq!(h.len(), 2);
        let again = chunk_hashes(&tokens, 256).unwrap();
        assert_eq!(h, again);
        let mut buf = Vec::new();
        buf.extend_from_slice(&CHAIN_ROOT.to_le_bytes());
        for t in 0u32..256 {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(h[0].0, xxh3_64_with_seed(&buf, CHUNK_HASH_SEED));
        assert_eq!(format!("{}", h[0]).len(), 16);
        assert_eq!(h[0].0, GOLDEN_0);
        assert_eq!(h[1].0, GOLDEN_1);
    }

    const GOLDEN_0: u64 = 0xad41_487f_0a6d_d463;
    const GOLDEN_1: u64 = 0x5c77_4797_bde6_2022;

    #[test]
    fn partial_chunk_is_rejected_by_push_and_skipped_by_chunk_hashes() {
        let mut h = ChunkHasher::new(4).unwrap();
        assert_eq!(
            h.push(&[1, 2, 3]),
            Err(ChunkHashError::PartialChunk {
                got: 3,
                expected: 4
            })
        );
        assert_eq!(chunk_hashes(&[1, 2, 3], 4).unwrap(), vec![]);
        assert_eq!(
            ChunkHasher::new(0).unwrap_err(),
            ChunkHashError::ZeroChunkTokens
        );
    }

    #[test]
    fn store_key_round_trips_and_rejects_bad_input() {
        let key = StoreKey::new("llama3-70b", ChunkHash(0xabc), "bf16", 256).unwrap();
        let text = key.to_string();
        assert_eq!(text, "llama3-70b@0000000000000abc@bf16@256");
        assert_eq!(text.parse::<StoreKey>().unwrap(), key);
        assert!("a@b@c".parse::<StoreKey>().is_err());
        assert!("m@0000000000000abc@f@x".parse::<StoreKey>().is_err());
        assert!("m@zz00000000000abc@f@1".parse::<StoreKey>().is_err());
        assert!("@0000000000000abc@f@1".parse::<StoreKey>().is_err());
        assert!(StoreKey::new("a@b", ChunkHash(1), "f", 1).is_err());
    }

    #[test]
    fn id_hasher_spreads_sequential_ids() {
        let b = IdHashBuilder;
        let a = b.hash_one(1u64);
        let c = b.hash_one(2u64);
        assert_ne!(a, c);
        assert_ne!(a >> 57, c >> 57);
    }
}
