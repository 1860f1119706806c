//! kvpool's wire protocol: what crosses a socket between kvpool processes,
//! and the limits that bound it.
//!
//! * [`frame`]: the framing of every control message,
//!   `magic | version | kind | flags | request_id | len | payload`, with the
//!   payload an rkyv archive that is validated (bytecheck) before use.
//! * [`proto`]: the messages: master RPC, data-plane requests, errors.
//! * [`route`]: which master shard a request goes to; batches split by
//!   owning shard and merged back in order.
//! * [`checksum`]: the value checksum, computed piece by piece while in cache.
//! * [`auth`]: the cluster secret: connection proofs and data-plane grants.
//! * [`error`]: the stable error codes, the same on the wire and in Rust.
//! * [`rdma_wire`]: the RDMA connection set-up messages (always compiled, so
//!   the protocol does not depend on the `rdma` feature of the transfer
//!   engine).
//! * [`limits`]: every bound of the protocol in one place, the relations
//!   between them checked at compile time.
//! * `server` (feature `server`): the shard-side TCP server loop (glommio)
//!   of the master and storage nodes.
//!
//! Moving bytes (the transfer engine over shm, TCP and RDMA) is
//! `kvpool-transport`'s; this crate has no I/O but the server loop and the
//! frame reader/writer over any `AsyncRead`/`AsyncWrite`.

pub mod auth;
pub mod checksum;
pub mod error;
pub mod frame;
pub mod limits;
pub mod proto;
pub mod rdma_wire;
pub mod route;
#[cfg(feature = "server")]
pub mod server;

pub use error::{ErrorCode, KvError};
pub use frame::{FrameError, FrameHeader, FrameKind};
pub use rdma_wire::{
    RdmaCaps, RdmaConnectReply, RdmaConnectRequest, RdmaLaneRequest, RdmaLinkLayer, RdmaPortInfo,
    RdmaQpEndpoint, RdmaRegion, RdmaRequest, RdmaResponse,
};
