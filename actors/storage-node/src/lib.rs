//! A kvpool storage node: gives a DRAM segment (and optionally an NVMe tier)
//! to the pool and serves it.
//!
//! * [`node`]: the data plane on every shard (TCP, shm, RDMA set-up) and the
//!   `StorageNode` actor that mounts, pings and mounts again.
//! * [`control`]: when the node mounts, reports its tier, pings and mounts
//!   again, without I/O (the actor and the simulation drive it).
//! * [`nvme_tier`]: the NVMe tier at work (demotions, promotions, eviction,
//!   recovery reports).
//! * [`round`]: one NVMe round's reports without I/O (which copies the
//!   master hears of, which the node removes), shared with the simulation.
//! * [`task`]: one tier task's decisions without I/O (what a Persist does
//!   with the copy it finds, which Promote is refused, which copy a Drop
//!   takes), shared with the simulation.
//! * [`fetch`]: extra replicas of hot objects, copied from other nodes.
//! * [`gate`]: the checks on a data request before the shard acts on it
//!   (segment, range, grant, NVMe region).
//! * [`metrics`]: what the node exports on `/metrics`.
//! * [`mounted`]: a node started and mounted at a master as one value (the
//!   storage role, and a process that embeds a node).

pub mod control;
pub mod fetch;
pub mod gate;
pub mod metrics;
pub mod mounted;
pub mod node;
pub mod nvme_tier;
pub mod rdma;
pub mod round;
pub mod task;

// The storage crate's own bounds (its segment and the tier's on-disk index)
// against the protocol's (`kvpool_wire::limits`): every key the protocol
// allows fits the tier's index, and every segment the node can make is one
// the master mounts.
const _: () = assert!(kvpool_storage::nvme::MAX_KEY_BYTES >= kvpool_wire::limits::MAX_KEY_BYTES);
const _: () =
    assert!(kvpool_storage::segment::MAX_SEGMENT_BYTES <= kvpool_wire::limits::MAX_SEGMENT_BYTES);

pub use mounted::{start_mounted, MountOptions, MountedNode};
pub use node::{
    spawn_shm_server, start, StorageNode, StorageNodeArgs, StorageNodeMsg, StorageService,
};
