//! The transfer engine's counters, shared by the TCP/shm engine and its RDMA
//! path.

use std::sync::atomic::{AtomicU64, AtomicUsize};

/// Counters of the engine (for metrics, tests and leak checks).
#[derive(Debug, Default)]
pub struct EngineStats {
    pub in_flight: AtomicUsize,
    pub max_in_flight_seen: AtomicUsize,
    pub slices: AtomicU64,
    pub slice_retries: AtomicU64,
    pub replica_failovers: AtomicU64,
    pub shm_bytes: AtomicU64,
    pub tcp_bytes: AtomicU64,
    /// Bytes moved by RDMA READ/WRITE (zero copy or staged).
    pub rdma_bytes: AtomicU64,
    /// Of those, bytes that went through a registered bounce buffer because
    /// the caller's buffer was not registered.
    pub rdma_staged_bytes: AtomicU64,
    /// RDMA connections set up.
    pub rdma_connects: AtomicU64,
    /// Nodes put on TCP because RDMA could not be set up (each logged).
    pub rdma_fallbacks: AtomicU64,
    /// Reads whose bytes did not match the object's checksum.
    pub corrupt_reads: AtomicU64,
}
