//! kvpool's roles: the master, storage nodes, the store client, and the
//! process that runs them (`node`).
//!
//! * [`master`]: metadata, allocation and liveness, sharded per core.
//! * [`storage_node`]: a DRAM segment served over TCP (and RDMA, feature
//!   `rdma`), mounted at the master.
//! * [`rdma`]: whether a role uses RDMA, and why not.
//! * [`client`]: `put`/`get`/`exists`/`remove` for embedders and the CLI.
//! * [`conductor`]: cache-aware scheduling with early rejection, and the
//!   trace-replay simulator (`kvpool sim`).
//! * [`node`]: starts the roles of one process and stops them on a signal.

pub mod bench;
pub mod client;
pub mod clock;
pub mod conductor;
pub mod config;
pub mod http;
pub mod master;
pub mod metrics;
pub mod node;
pub mod nvme_tier;
pub mod rdma;
pub mod server;
pub mod storage_node;

pub use kvpool_transport::{ErrorCode, KvError};

/// Why a role could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("config: {0}")]
    Config(String),
    #[error("{0}")]
    Start(String),
    #[error(transparent)]
    Runtime(#[from] kvpool_runtime::RuntimeError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}
