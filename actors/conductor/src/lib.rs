//! The conductor: KV-cache-aware request scheduling for disaggregated LLM
//! serving, with early rejection, and a trace-replay simulator that drives
//! the same scheduling code against a modelled cluster.
//!
//! Layout:
//! - [`chunk_hash`]: prefix-chained chunk hashes and store keys.
//! - [`trace`]: Mooncake-format request traces.
//! - [`gen`]: seeded workload generator (`kvpool sim gen`).
//! - [`cache`]: block caches (LRU, LFU, length-aware) used to model the pool.
//! - [`cost`]: the cluster cost model (TOML, with defaults).
//! - [`scheduler`]: the scheduling policies; pure logic, no I/O, no clock.
//! - [`sim`]: the discrete-event simulator and its report.
//! - [`actor`]: the live `Conductor` ractor actor.
//! - [`mailbox`]: a bound on an actor's (unbounded) ractor mailbox.
//! - [`record`]: decision logs, and their replay through the scheduler.
//! - [`cli`]: `kvpool sim` / `kvpool sim cache` argument structs and runners.
//! - [`plot`]: TTFT CDF plot (PNG).

pub mod actor;
pub mod cache;
/// Prefix-chained chunk hashes (shared with the engine and the pool).
pub use kvpool_runtime::chunk_hash;
pub mod cli;
pub mod cost;
pub mod gen;
pub mod mailbox;
pub mod plot;
pub mod record;
pub mod scheduler;
pub mod sim;
pub mod trace;
