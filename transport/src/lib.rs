//! kvpool's transfer engine: moving a value's bytes between a client's
//! buffer and a storage node's segment.
//!
//! * [`engine`]: batches of reads and writes over shm, TCP or RDMA lanes,
//!   with deadlines, back-pressure and replica failover.
//! * [`data_conn`]: a data connection's proof of the cluster secret.
//! * [`stats`]: the engine's counters.
//! * [`read`]: the rules of a read without I/O (replica order, shares of
//!   the deadline, unreachable nodes), shared with the cluster simulation.
//! * [`pool`], [`shm`]: client TCP connection pools; the shared-memory
//!   transport (memfd passed over a unix socket).
//! * [`nic`]: RDMA as traits, implemented by `kvpool-rdma` (the verbs
//!   layer: devices, memory registration, RC queue pairs, one-sided
//!   READ/WRITE) and installed at start by a build with the `rdma` feature.
//!
//! What goes over the sockets (frames, messages, error codes, limits) is
//! `kvpool-wire`'s. Payload bytes of a put or get never go through rkyv: on
//! TCP they follow the control frame and are read straight into the
//! destination buffer.

pub mod data_conn;
pub mod engine;
pub mod nic;
pub mod pool;
pub mod read;
pub mod shm;
pub mod stats;
