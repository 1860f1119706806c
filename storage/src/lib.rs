//! kvpool's storage layer: DRAM segments, the range allocators that carve
//! them, and the NVMe tier (O_DIRECT, io_uring through glommio).
//!
//! Nothing here talks to the network: the master uses the allocators to hand
//! out space, the storage node owns the segment memory that space refers to.

pub mod alloc;
mod fast_read;
pub mod nvme;
pub mod segment;
pub mod tier_index;

pub use alloc::RangeAllocator;
pub use segment::Segment;

/// Errors of the storage layer.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("invalid size: {0}")]
    InvalidSize(String),
    #[error("range {offset}+{len} is outside the segment of {size} bytes")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl From<rustix::io::Errno> for StorageError {
    fn from(e: rustix::io::Errno) -> Self {
        StorageError::Io(e.into())
    }
}
