//! A kvpool storage node: gives a DRAM segment (and optionally an NVMe tier)
//! to the pool and serves it.
//!
//! * [`node`]: the data plane on every shard (TCP, shm, RDMA set-up) and the
//!   `StorageNode` actor that mounts, pings and mounts again.
//! * [`nvme_tier`]: the NVMe tier at work (demotions, promotions, eviction,
//!   recovery reports).
//! * [`metrics`]: what the node exports on `/metrics`.

pub mod metrics;
pub mod node;
pub mod nvme_tier;
pub mod rdma;

pub use node::{
    spawn_shm_server, start, StorageNode, StorageNodeArgs, StorageNodeMsg, StorageService,
};
