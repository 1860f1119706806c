//! The RDMA transport: one-sided RDMA READ (get) and WRITE (put) over
//! ibverbs RC queue pairs, set up over kvpool's own control channel.
//!
//! Built only with the `rdma` feature (empty otherwise: a fresh machine has
//! no rdma-core build tools). It implements `kvpool_transport::nic`'s
//! traits; [`install`] makes it the process's RDMA, which the binary and the
//! Python module call at start. Nothing above the transfer engine names this
//! crate, so a build with RDMA compiles this crate and the binary again, not
//! the client, the storage node or the fronts.
//!
//! ```text
//!  process
//!  +----------------------------------------------------------------------+
//!  | RdmaContext (Arc, shared by all shards/tasks)                        |
//!  |   devices: context + one PD each (config names them, or all active)  |
//!  |   MR cache: Registration = memory owner + one MR per device          |
//!  |                                                                      |
//!  |  client task/shard                         storage node shard        |
//!  |   RdmaConnection (per peer)  --rkyv TCP-->  accept(): PassiveConnection|
//!  |     lanes: RC QPs (INIT->RTR->RTS)          QPs live as long as the   |
//!  |     request table (bounded)                 control connection       |
//!  |     poll(): CQ -> deadlines -> post                                  |
//!  |        ==== RDMA READ / WRITE, 64 KiB slices ====>  segment MR       |
//!  +----------------------------------------------------------------------+
//! ```
//!
//! * Set-up: [`RdmaContext::open`] (or [`RdmaError::NoDevice`] with the
//!   reason), [`RdmaContext::caps`] to advertise, [`RdmaContext::connect`] +
//!   [`PendingConnection::complete`] on the client, [`RdmaContext::accept`] on
//!   the node; the messages are [`kvpool_wire::rdma_wire`]'s.
//! * Memory: [`RdmaContext::register`] (cached, keyed by address range),
//!   [`RdmaContext::lookup`] for a sub-range of a registered buffer.
//! * Transfers: [`RdmaConnection::try_submit`] / [`RdmaConnection::submit`]
//!   return a [`Transfer`]; [`Transfer::wait`] polls with the caller's sleep
//!   function until the final status; [`RdmaConnection::poll`] is the
//!   non-blocking progress call.
//!
//! Design decisions and their reasons: `docs/architecture/rdma.md`.

// The links above name items that exist only with the feature; without it
// the crate is empty and its documentation is this page alone.
#![cfg_attr(not(feature = "rdma"), allow(rustdoc::broken_intra_doc_links))]
#![cfg(feature = "rdma")]

mod connection;
mod device;
mod error;
mod memory;
mod nic;
mod path;
mod verbs;

pub use connection::{
    ConnStats, LaneStats, Op, PassiveConnection, PendingConnection, RdmaConnection, Transfer,
    TransferSpec,
};
pub use device::RdmaContext;
pub use error::{NoDeviceReason, RdmaError};
pub use kvpool_transport::nic::{
    RdmaConfig, DEFAULT_LANES_PER_PEER, DEFAULT_MAX_OUTSTANDING_PER_LANE,
    DEFAULT_MAX_REQUESTS_PER_CONNECTION, DEFAULT_SLICE_BYTES, MAX_RD_ATOMIC, MAX_SLICE_BYTES,
};
pub use memory::{LocalSlice, MrCacheStats, RawMemory, RdmaBuffer, RdmaMemory, Registration};
pub use nic::install;
