//! A shard's bounds, in one place: each book the shard keeps is held to one
//! of these, and what happens past it is said beside it.

/// Tasks queued for one segment's node, at most.
pub const MAX_TASKS_PER_SEGMENT: usize = 16_384;

/// Copies one shard remembers of NVMe tiers unmounted as dead, at most:
/// beyond that, such a tier's copies are refused when it comes back (lost
/// from the cache, never stale).
pub const MAX_DETACHED_COPIES: usize = 262_144;

/// Objects whose reads one window counts; reads of others are not counted
/// until the window turns.
pub const MAX_COUNTED_READS: usize = 65_536;

/// Fills (promotions and fetches) whose report is awaited; more are not
/// watched (their replica waits for its report, as before the watch).
pub const MAX_FILLS_WATCHED: usize = 65_536;

/// Replicas one eviction step takes at most (`ShardState::evict_step`): the
/// longest the shard's off-path eviction holds it before serving requests
/// again.
pub const EVICT_STEP_VICTIMS: usize = 64;
