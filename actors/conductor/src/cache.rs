//! Block caches modelling the KV pool: LRU, LFU and length-aware, with a
//! capacity in blocks (or unbounded).
//!
//! The unit is one block (one chunk hash). A request *touches* its blocks in
//! prefix order, first to last; a touch inserts a missing block or refreshes
//! a present one. A request's hit is the longest prefix of its blocks that is
//! cached *before* its touch ([`PrefixIndex::prefix_len`]). This is the
//! accounting of the reference check (`kvpool_sim::cache_sim`): a global LRU on
//! the synthetic trace hits 0.0825 / 0.4235 / 0.6396 of all blocks at 1,000 /
//! 10,000 / unbounded blocks.
//!
//! A new block is always admitted: when the cache is full, the victim is
//! chosen among the blocks already present, then the new one goes in.
//!
//! - LRU evicts the least recently touched block.
//! - LFU evicts the block touched the fewest times, the least recently
//!   touched among equals.
//! - Length-aware is LFU whose tie-break among blocks of equal count is the
//!   *request* that last touched them (least recent request first) and then
//!   the block's index in that request, latest first. This follows the
//!   Mooncake paper's description ("similar to LFU but prioritizing eviction
//!   of cache blocks occurring later in requests"): a late block is only
//!   useful if every block before it is cached too, so it is the cheapest to
//!   lose. Plain LFU breaks ties by the block's own last touch, and since a
//!   request touches its blocks first to last, it evicts a request's *first*
//!   blocks before its last ones, cutting the prefix short.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::chunk_hash::{ChunkHash, IdHashBuilder, IdMap};

/// Cache capacity in blocks, or unbounded (`inf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Capacity {
    /// At most this many blocks.
    Blocks(usize),
    /// No limit.
    Unbounded,
}

impl Capacity {
    /// The limit, `None` when unbounded.
    pub fn limit(self) -> Option<usize> {
        match self {
            Capacity::Blocks(n) => Some(n),
            Capacity::Unbounded => None,
        }
    }
}

impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Capacity::Blocks(n) => write!(f, "{n}"),
            Capacity::Unbounded => f.write_str("inf"),
        }
    }
}

/// Error of parsing a [`Capacity`] or a [`CachePolicy`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseCacheError(String);

impl FromStr for Capacity {
    type Err = ParseCacheError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("inf") || t.eq_ignore_ascii_case("unbounded") {
            return Ok(Capacity::Unbounded);
        }
        let digits: String = t.chars().filter(|c| *c != '_').collect();
        digits.parse::<usize>().map(Capacity::Blocks).map_err(|_| {
            ParseCacheError(format!(
                "cache capacity {s:?} is neither a number of blocks nor \"inf\""
            ))
        })
    }
}

impl Serialize for Capacity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Capacity::Blocks(n) => s.serialize_u64(*n as u64),
            Capacity::Unbounded => s.serialize_str("inf"),
        }
    }
}

impl<'de> Deserialize<'de> for Capacity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Capacity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of blocks or \"inf\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Capacity, E> {
                usize::try_from(v)
                    .map(Capacity::Blocks)
                    .map_err(|_| E::custom("capacity too large"))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Capacity, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom("capacity must not be negative"))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Capacity, E> {
                v.parse().map_err(|e: ParseCacheError| E::custom(e.0))
            }
        }
        d.deserialize_any(V)
    }
}

/// Eviction policy of a block cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum CachePolicy {
    /// Least recently used.
    #[value(name = "lru")]
    Lru,
    /// Least frequently used (ties: least recent).
    #[value(name = "lfu")]
    Lfu,
    /// LFU that evicts blocks later in their request first among equals.
    #[value(name = "length_aware")]
    LengthAware,
}

impl CachePolicy {
    /// Every policy, in a fixed order.
    pub const ALL: [CachePolicy; 3] =
        [CachePolicy::Lru, CachePolicy::Lfu, CachePolicy::LengthAware];

    /// The name used on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            CachePolicy::Lru => "lru",
            CachePolicy::Lfu => "lfu",
            CachePolicy::LengthAware => "length_aware",
        }
    }
}

impl fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CachePolicy {
    type Err = ParseCacheError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CachePolicy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                ParseCacheError(format!(
                    "unknown cache policy {s:?} (expected lru, lfu or length_aware)"
                ))
            })
    }
}

/// Something that can say how long a cached prefix is.
pub trait PrefixIndex {
    /// Whether `hash` is present.
    fn contains(&self, hash: ChunkHash) -> bool;

    /// Number of leading blocks of `blocks` that are all present. Does not
    /// change recency or counts.
    fn prefix_len(&self, blocks: &[ChunkHash]) -> usize {
        blocks.iter().take_while(|h| self.contains(**h)).count()
    }
}

/// A bounded block cache.
pub trait BlockCache: PrefixIndex {
    /// Touches `blocks` in order (index 0 first): inserts the missing ones,
    /// refreshes the present ones, evicting as needed.
    fn touch(&mut self, blocks: &[ChunkHash]);
    /// Removes one block; `true` if it was present.
    fn remove(&mut self, hash: ChunkHash) -> bool;
    /// Blocks held.
    fn len(&self) -> usize;
    /// Whether no block is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Capacity.
    fn capacity(&self) -> Capacity;
    /// Blocks evicted so far (not counting [`BlockCache::remove`]).
    fn evictions(&self) -> u64;
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct LruNode {
    hash: ChunkHash,
    prev: u32,
    next: u32,
}

/// LRU block cache: a hash map into a slab-allocated doubly linked list.
/// Touch, lookup and eviction are O(1); the slab slots of evicted blocks are
/// reused, so a warm cache does not allocate.
#[derive(Debug, Clone)]
pub struct LruCache {
    map: IdMap<ChunkHash, u32>,
    nodes: Vec<LruNode>,
    free: Vec<u32>,
    head: u32, // most recent
    tail: u32, // least recent
    capacity: Capacity,
    evictions: u64,
}

impl LruCache {
    /// An empty cache.
    pub fn new(capacity: Capacity) -> Self {
        let reserve = capacity.limit().unwrap_or(0).min(1 << 20);
        Self {
            map: IdMap::with_capacity_and_hasher(reserve, IdHashBuilder),
            nodes: Vec::with_capacity(reserve),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            capacity,
            evictions: 0,
        }
    }

    fn unlink(&mut self, i: u32) {
        let (prev, next) = {
            let n = &self.nodes[i as usize];
            (n.prev, n.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, i: u32) {
        self.nodes[i as usize].prev = NIL;
        self.nodes[i as usize].next = self.head;
        if self.head != NIL {
            self.nodes[self.head as usize].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    fn touch_one(&mut self, hash: ChunkHash) {
        if let Some(&i) = self.map.get(&hash) {
            if self.head != i {
                self.unlink(i);
                self.push_front(i);
            }
            return;
        }
        if let Some(limit) = self.capacity.limit() {
            if limit == 0 {
                return;
            }
            if self.map.len() >= limit {
                let victim = self.tail;
                self.unlink(victim);
                let old = self.nodes[victim as usize].hash;
                self.map.remove(&old);
                self.free.push(victim);
                self.evictions += 1;
            }
        }
        let node = LruNode {
            hash,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(hash, i);
        self.push_front(i);
    }

    /// Blocks from most to least recent (for tests and debugging).
    pub fn iter_recent(&self) -> impl Iterator<Item = ChunkHash> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let n = &self.nodes[cur as usize];
            cur = n.next;
            Some(n.hash)
        })
    }
}

impl PrefixIndex for LruCache {
    fn contains(&self, hash: ChunkHash) -> bool {
        self.map.contains_key(&hash)
    }
}

impl BlockCache for LruCache {
    fn touch(&mut self, blocks: &[ChunkHash]) {
        for &b in blocks {
            self.touch_one(b);
        }
    }
    fn remove(&mut self, hash: ChunkHash) -> bool {
        match self.map.remove(&hash) {
            Some(i) => {
                self.unlink(i);
                self.free.push(i);
                true
            }
            None => false,
        }
    }
    fn len(&self) -> usize {
        self.map.len()
    }
    fn capacity(&self) -> Capacity {
        self.capacity
    }
    fn evictions(&self) -> u64 {
        self.evictions
    }
}

#[derive(Debug, Clone, Copy)]
struct FreqMeta {
    count: u64,
    /// Last touch: per block for LFU, per request for length-aware.
    tick: u64,
    /// Rank within one request: 0 for LFU, `u32::MAX - index` for
    /// length-aware (a later block ranks lower, so it goes first).
    rank: u32,
}

/// Frequency-based block cache (LFU and length-aware). Touch and eviction are
/// O(log n) through an ordered set of `(count, tick, rank, hash)`; with an
/// unbounded capacity the ordered set is not kept at all.
#[derive(Debug, Clone)]
pub struct FreqCache {
    map: IdMap<ChunkHash, FreqMeta>,
    order: BTreeSet<(u64, u64, u32, ChunkHash)>,
    capacity: Capacity,
    length_aware: bool,
    tick: u64,
    evictions: u64,
}

impl FreqCache {
    /// An empty LFU cache.
    pub fn lfu(capacity: Capacity) -> Self {
        Self::new(capacity, false)
    }

    /// An empty length-aware cache.
    pub fn length_aware(capacity: Capacity) -> Self {
        Self::new(capacity, true)
    }

    fn new(capacity: Capacity, length_aware: bool) -> Self {
        let reserve = capacity.limit().unwrap_or(0).min(1 << 20);
        Self {
            map: IdMap::with_capacity_and_hasher(reserve, IdHashBuilder),
            order: BTreeSet::new(),
            capacity,
            length_aware,
            tick: 0,
            evictions: 0,
        }
    }

    fn bounded(&self) -> bool {
        self.capacity.limit().is_some()
    }

    fn touch_one(&mut self, hash: ChunkHash, index: usize) {
        if !self.length_aware {
            self.tick += 1;
        }
        let rank = if self.length_aware {
            u32::MAX - (index.min(u32::MAX as usize - 1) as u32)
        } else {
            0
        };
        let bounded = self.bounded();
        if let Some(meta) = self.map.get_mut(&hash) {
            if bounded {
                self.order.remove(&(meta.count, meta.tick, meta.rank, hash));
            }
            meta.count += 1;
            meta.rank = rank;
            meta.tick = self.tick;
            if bounded {
                self.order.insert((meta.count, meta.tick, meta.rank, hash));
            }
            return;
        }
        if let Some(limit) = self.capacity.limit() {
            if limit == 0 {
                return;
            }
            if self.map.len() >= limit {
                if let Some(victim) = self.order.pop_first() {
                    self.map.remove(&victim.3);
                    self.evictions += 1;
                }
            }
        }
        let meta = FreqMeta {
            count: 1,
            rank,
            tick: self.tick,
        };
        self.map.insert(hash, meta);
        if bounded {
            self.order.insert((meta.count, meta.tick, meta.rank, hash));
        }
    }
}

impl PrefixIndex for FreqCache {
    fn contains(&self, hash: ChunkHash) -> bool {
        self.map.contains_key(&hash)
    }
}

impl BlockCache for FreqCache {
    fn touch(&mut self, blocks: &[ChunkHash]) {
        if self.length_aware {
            self.tick += 1;
        }
        for (i, &b) in blocks.iter().enumerate() {
            self.touch_one(b, i);
        }
    }
    fn remove(&mut self, hash: ChunkHash) -> bool {
        match self.map.remove(&hash) {
            Some(meta) => {
                if self.bounded() {
                    self.order.remove(&(meta.count, meta.tick, meta.rank, hash));
                }
                true
            }
            None => false,
        }
    }
    fn len(&self) -> usize {
        self.map.len()
    }
    fn capacity(&self) -> Capacity {
        self.capacity
    }
    fn evictions(&self) -> u64 {
        self.evictions
    }
}

/// A block cache of any policy (static dispatch).
#[derive(Debug, Clone)]
pub enum Cache {
    /// LRU.
    Lru(LruCache),
    /// LFU or length-aware.
    Freq(FreqCache),
}

impl Cache {
    /// An empty cache of `policy` holding at most `capacity` blocks.
    pub fn new(policy: CachePolicy, capacity: Capacity) -> Self {
        match policy {
            CachePolicy::Lru => Cache::Lru(LruCache::new(capacity)),
            CachePolicy::Lfu => Cache::Freq(FreqCache::lfu(capacity)),
            CachePolicy::LengthAware => Cache::Freq(FreqCache::length_aware(capacity)),
        }
    }
}

impl PrefixIndex for Cache {
    fn contains(&self, hash: ChunkHash) -> bool {
        match self {
            Cache::Lru(c) => c.contains(hash),
            Cache::Freq(c) => c.contains(hash),
        }
    }
    fn prefix_len(&self, blocks: &[ChunkHash]) -> usize {
        match self {
            Cache::Lru(c) => c.prefix_len(blocks),
            Cache::Freq(c) => c.prefix_len(blocks),
        }
    }
}

impl BlockCache for Cache {
    fn touch(&mut self, blocks: &[ChunkHash]) {
        match self {
            Cache::Lru(c) => c.touch(blocks),
            Cache::Freq(c) => c.touch(blocks),
        }
    }
    fn remove(&mut self, hash: ChunkHash) -> bool {
        match self {
            Cache::Lru(c) => c.remove(hash),
            Cache::Freq(c) => c.remove(hash),
        }
    }
    fn len(&self) -> usize {
        match self {
            Cache::Lru(c) => c.len(),
            Cache::Freq(c) => c.len(),
        }
    }
    fn capacity(&self) -> Capacity {
        match self {
            Cache::Lru(c) => c.capacity(),
            Cache::Freq(c) => c.capacity(),
        }
    }
    fn evictions(&self) -> u64 {
        match self {
            Cache::Lru(c) => c.evictions(),
            Cache::Freq(c) => c.evictions(),
        }
    }
}

/// Block-weighted hit counter: `hit_blocks / total_blocks`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HitCounter {
    /// Blocks served from the cache.
    pub hit_blocks: u64,
    /// Blocks asked for.
    pub total_blocks: u64,
}

impl HitCounter {
    /// Counts one request.
    pub fn record(&mut self, hit_blocks: usize, total_blocks: usize) {
        self.hit_blocks += hit_blocks as u64;
        self.total_blocks += total_blocks as u64;
    }
    /// The ratio, 0 when nothing was asked.
    pub fn ratio(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            self.hit_blocks as f64 / self.total_blocks as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(ids: &[u64]) -> Vec<ChunkHash> {
        ids.iter().map(|&i| ChunkHash(i)).collect()
    }

    #[test]
    fn capacity_parses_and_prints() {
        assert_eq!("inf".parse::<Capacity>().unwrap(), Capacity::Unbounded);
        assert_eq!(
            "10_000".parse::<Capacity>().unwrap(),
            Capacity::Blocks(10_000)
        );
        assert!("ten".parse::<Capacity>().is_err());
        assert_eq!(Capacity::Unbounded.to_string(), "inf");
        assert_eq!(serde_json::to_string(&Capacity::Blocks(5)).unwrap(), "5");
        assert_eq!(
            serde_json::to_string(&Capacity::Unbounded).unwrap(),
            "\"inf\""
        );
        assert_eq!(
            serde_json::from_str::<Capacity>("\"inf\"").unwrap(),
            Capacity::Unbounded
        );
        assert_eq!(
            serde_json::from_str::<Capacity>("7").unwrap(),
            Capacity::Blocks(7)
        );
        assert!(serde_json::from_str::<Capacity>("-7").is_err());
    }

    #[test]
    fn lru_evicts_least_recent_and_refreshes_on_touch() {
        let mut c = LruCache::new(Capacity::Blocks(3));
        c.touch(&h(&[1, 2, 3]));
        c.touch(&h(&[1]));
        c.touch(&h(&[4]));
        assert!(!c.contains(ChunkHash(2)));
        assert_eq!(c.iter_recent().collect::<Vec<_>>(), h(&[4, 1, 3]));
        assert_eq!(c.prefix_len(&h(&[1, 3, 2, 4])), 2);
        assert!(c.remove(ChunkHash(3)));
        assert!(!c.remove(ChunkHash(3)));
        c.touch(&h(&[5, 6]));
        assert_eq!(c.len(), 3);
        assert_eq!(c.evictions(), 2);
    }

    #[test]
    fn zero_capacity_holds_nothing() {
        for p in CachePolicy::ALL {
            let mut c = Cache::new(p, Capacity::Blocks(0));
            c.touch(&h(&[1, 2]));
            assert!(c.is_empty());
        }
    }

    #[test]
    fn lfu_evicts_least_frequent_then_least_recent() {
        let mut c = FreqCache::lfu(Capacity::Blocks(3));
        c.touch(&h(&[1, 2, 3]));
        c.touch(&h(&[1, 3]));
        c.touch(&h(&[4])); // 2 has count 1: evicted
        assert!(!c.contains(ChunkHash(2)));
        c.touch(&h(&[5])); // 4 has count 1, the only one: evicted
        assert!(!c.contains(ChunkHash(4)));
        assert!(c.contains(ChunkHash(1)) && c.contains(ChunkHash(3)) && c.contains(ChunkHash(5)));
    }

    #[test]
    fn length_aware_evicts_later_blocks_first_among_equals() {
        let mut c = FreqCache::length_aware(Capacity::Blocks(3));
        c.touch(&h(&[1, 2, 3])); // all count 1; 3 sat last
        c.touch(&h(&[9]));
        assert!(!c.contains(ChunkHash(3)));
        let mut lfu = FreqCache::lfu(Capacity::Blocks(3));
        lfu.touch(&h(&[1, 2, 3]));
        lfu.touch(&h(&[9]));
        assert!(!lfu.contains(ChunkHash(1)));
    }

    #[test]
    fn policies_parse() {
        for p in CachePolicy::ALL {
            assert_eq!(p.as_str().parse::<CachePolicy>().unwrap(), p);
        }
        assert!("fifo".parse::<CachePolicy>().is_err());
    }
}
