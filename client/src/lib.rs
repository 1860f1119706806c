//! The kvpool store client: what embedders, the CLI, storage nodes and the
//! engine use to put and get values. It depends on the wire protocol and the
//! transfer engine only (no master, no HTTP, no plotting).
//!
//! * [`Client`]: `put`/`get`/`exists`/`remove`, their batch forms, borrowed
//!   views of same-host values; see the `client` module docs.
//! * [`put`]: a put's protocol as a state machine without I/O, which
//!   [`Client::put_with`] drives (and the cluster simulation too).
//! * [`get`]: a get's protocol (the location cache first, then the
//!   master; what an answer leaves there), which [`Client::get`] drives
//!   (and the cluster simulation too).
//! * [`locations`]: the location cache's rules (a get that skips the master
//!   while its read lease lasts), on a clock of the caller's (the cluster
//!   simulation runs them too).
//! * [`rdma`]: whether a role uses RDMA, and why not.
//! * [`leader`]: where the master is: a fixed address, or a registered
//!   source (`etcd://...`) that follows the leader of several masters.

mod client;
pub mod get;
pub mod leader;
pub mod locations;
pub mod put;
pub mod rdma;

pub use client::{local_host_id, Client, MemoryRegistration, ReadView, RegisteredBuffer};
pub use kvpool_config::ClientConfig;
pub use kvpool_wire::{ErrorCode, KvError};
pub use leader::{register_scheme, MasterSource};
