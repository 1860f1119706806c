//! A kvpool process: starts the roles it was asked for on one set of shards,
//! serves HTTP (`/healthz`, `/metrics`, the master's admin routes), and
//! measures a running pool (`kvpool bench transfer`).
//!
//! * [`launch`](mod@launch): the one dispatch of every role (`kvpool run --role`).
//! * [`process`]: the pool's process: `run(role, config, shutdown)` for
//!   master, storage node, gateway, and role all with its serving path.
//! * [`http`]: the HTTP side of every role.
//! * [`bench`](mod@bench): the transfer bench behind `kvpool bench transfer`.

pub mod bench;
pub mod http;
pub mod launch;
pub mod process;

pub use kvpool_config::Role;
pub use launch::{launch, Launch};
pub use process::run;
