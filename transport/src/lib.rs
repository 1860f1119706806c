//! kvpool's wire protocol and transports.
//!
//! * [`frame`]: the framing of every control message,
//!   `magic | version | kind | flags | request_id | len | payload`, with the
//!   payload an rkyv archive that is validated (bytecheck) before use.
//! * [`proto`]: the messages: master RPC, data-plane requests, errors.
//! * [`error`]: the stable error codes, the same on the wire and in Rust.
//!
//! Payload bytes of a put or get never go through rkyv: on TCP they follow the
//! control frame and are read straight into the destination buffer.

pub mod error;
pub mod frame;
pub mod proto;

pub use error::{ErrorCode, KvError};
pub use frame::{FrameError, FrameHeader, FrameKind};
