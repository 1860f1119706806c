//! The master: object metadata, space allocation on every mounted segment,
//! and node liveness. It never touches payload bytes.
//!
//! * [`state`]: one shard's metadata as a pure state machine (no I/O, the
//!   clock is an argument); its objects live in `objects` (a slab, key
//!   tables of ids, and the eviction index per DRAM range).
//! * [`coord`]: the coordinator's state (segments, liveness) and the routing
//!   rules for batches and cross-shard commands.
//! * [`core`]: all of it in one thread with a simulated clock (tests).
//! * [`service`]: the shards at work: RPC listeners, inboxes, the coordinator.
//! * [`actor`]: the `Master` actor, the API for embedders in the same process.
//! * [`ship`]: log shipping: the leader's records to its standbys, and
//!   a standby's copy it leads with once it wins (HA).
//! * [`fence`]: whether this master may answer (HA: the leader within its
//!   etcd lease) and the term its grants carry.

pub mod actor;
pub mod clock;
pub mod coord;
pub mod core;
pub mod fence;
pub mod journal;
pub mod metrics;
mod objects;
pub mod service;
pub mod ship;
pub mod state;

pub use actor::{call, Master, MasterArgs, MasterMsg};
pub use fence::{Fence, FenceRole};
pub use objects::fix_hash_seed;
pub use service::MasterHandle;
