//! kvpool's tools around the conductor: the trace-replay simulator that
//! drives the conductor's scheduling code against a modelled cluster, the
//! workload generator, plots, and `kvpool bench serve` (a trace against the
//! live front). The serving roles do not link this crate (plotting, progress
//! bars); the `kvpool` binary does, for `kvpool sim` and `kvpool bench serve`.
//!
//! Layout:
//! - [`trace`]: Mooncake-format request traces.
//! - [`gen`]: seeded workload generator (`kvpool sim gen`).
//! - [`cache_sim`]: a trace through one global block cache (`kvpool sim cache`).
//! - [`sim`]: the discrete-event simulator and its report.
//! - [`error`]: [`error::SimError`], of the simulator and its command line.
//! - [`cli`]: `kvpool sim` argument structs and runners.
//! - [`plot`]: TTFT CDF and load plots (PNG).
//! - [`serve_bench`]: `kvpool bench serve`.

pub mod cache_sim;
pub mod cli;
pub mod error;
pub mod gen;
pub mod plot;
pub mod serve_bench;
pub mod sim;
pub mod trace;
