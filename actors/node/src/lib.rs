//! A kvpool process: starts the roles it was asked for on one set of shards,
//! serves HTTP (`/healthz`, `/metrics`, the master's admin routes), and
//! measures a running pool (`kvpool bench transfer`).
//!
//! * [`process`]: `run(role, config, shutdown)`.
//! * [`http`]: the HTTP side of every role.
//! * [`bench`]: the transfer bench behind `kvpool bench transfer`.

pub mod bench;
pub mod http;
pub mod process;

pub use process::{run, Role};
