//! kvpool's wire protocol and transports.
//!
//! * [`frame`]: the framing of every control message,
//!   `magic | version | kind | flags | request_id | len | payload`, with the
//!   payload an rkyv archive that is validated (bytecheck) before use.
//! * [`proto`]: the messages: master RPC, data-plane requests, errors.
//! * [`route`]: which master shard a request goes to; batches split by
//!   owning shard and merged back in order.
//! * `server` (feature `server`): the shard-side TCP server loop (glommio)
//!   of the master and storage nodes.
//! * [`checksum`]: the value checksum, computed piece by piece while in cache.
//! * [`auth`]: the cluster secret: connection proofs and data-plane grants.
//! * [`error`]: the stable error codes, the same on the wire and in Rust.
//! * [`engine`]: the transfer engine (batches of reads and writes over shm
//!   or TCP lanes, with deadlines and back-pressure).
//! * [`pool`], [`shm`]: client TCP connection pools; the shared-memory
//!   transport (memfd passed over a unix socket).
//! * [`rdma_wire`]: the RDMA connection set-up messages (always compiled, so
//!   the protocol does not depend on the `rdma` feature).
//! * `rdma` (feature `rdma`): the verbs layer: devices, memory registration,
//!   RC queue pairs, one-sided READ/WRITE with slicing, lanes and retry.
//!
//! Payload bytes of a put or get never go through rkyv: on TCP they follow the
//! control frame and are read straight into the destination buffer.

pub mod auth;
pub mod checksum;
pub mod engine;
#[cfg(feature = "rdma")]
mod engine_rdma;
pub mod error;
pub mod frame;
pub mod pool;
pub mod proto;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod rdma_wire;
pub mod route;
#[cfg(feature = "server")]
pub mod server;
pub mod shm;

pub use error::{ErrorCode, KvError};
pub use frame::{FrameError, FrameHeader, FrameKind};
pub use rdma_wire::{
    RdmaCaps, RdmaConnectReply, RdmaConnectRequest, RdmaLaneRequest, RdmaLinkLayer, RdmaPortInfo,
    RdmaQpEndpoint, RdmaRegion, RdmaRequest, RdmaResponse,
};
