//! The conductor: KV-cache-aware request scheduling for disaggregated LLM
//! serving, with early rejection. The trace-replay simulator that drives the
//! same scheduling code against a modelled cluster is a tool
//! (`tools/sim`, crate `kvpool-sim`), not linked by the serving roles.
//!
//! Layout:
//! - [`chunk_hash`]: prefix-chained chunk hashes and store keys.
//! - [`cache`]: block caches (LRU, LFU, length-aware) used to model the pool.
//! - [`cost`]: the cluster cost model (TOML, with defaults).
//! - [`scheduler`]: the scheduling policies; pure logic, no I/O, no clock.
//! - [`actor`]: the live `Conductor` ractor actor.
//! - [`mailbox`]: a bound on an actor's (unbounded) ractor mailbox.
//! - [`record`]: decision logs, and their replay through the scheduler.

pub mod actor;
pub mod cache;
/// Prefix-chained chunk hashes (shared with the engine and the pool).
pub use kvpool_runtime::chunk_hash;
pub mod cost;
pub mod mailbox;
pub mod record;
pub mod scheduler;
