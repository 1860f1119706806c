//! RDMA as the transfer engine sees it: what a NIC does for kvpool, as
//! traits, and the one place a build with RDMA installs its implementation.
//!
//! The verbs code (devices, memory regions, queue pairs, the engine's RDMA
//! path) is the `kvpool-rdma` crate, built only with the `rdma` feature of
//! the binary or the Python module, which call its `install()` at start.
//! Everything above the transfer engine (client, storage node, fronts) is
//! compiled once, the same with RDMA or without: it asks [`provider`] at
//! run time. No provider installed is "built without the rdma feature".
//!
//! * [`NicProvider::open`]: the devices a role's settings name, as a [`Nic`].
//! * [`Nic`]: caps to advertise, memory registration ([`NicRegion`]), the
//!   node side of a connection ([`Nic::accept`]), the engine's data path
//!   ([`Nic::data_path`]).
//! * [`NicDataPath`]: reads and writes of one replica over RDMA, per
//!   segment connections, bounce buffers; `None` from a read or write means
//!   "use TCP for this node".
//! * [`RdmaMemory`], [`RdmaBuffer`], [`RawMemory`], [`RdmaConfig`]: plain
//!   memory and settings, no verbs.

mod config;
mod memory;

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvpool_wire::auth::ClusterKey;
use kvpool_wire::error::KvError;
use kvpool_wire::proto::{ReplicaDesc, SegmentId};
use kvpool_wire::rdma_wire::{RdmaCaps, RdmaConnectReply, RdmaConnectRequest};

pub use config::{
    RdmaConfig, DEFAULT_LANES_PER_PEER, DEFAULT_MAX_OUTSTANDING_PER_LANE,
    DEFAULT_MAX_REQUESTS_PER_CONNECTION, DEFAULT_SLICE_BYTES, MAX_RD_ATOMIC, MAX_SLICE_BYTES,
};
pub use memory::{RawMemory, RdmaBuffer, RdmaMemory};

use crate::pool::ConnPool;
use crate::stats::EngineStats;

/// Why [`NicProvider::open`] gave no NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// No usable device (none on the machine, the named one missing or its
    /// port down); the reason says which.
    NoDevice(String),
    /// The devices are there but opening them failed.
    Failed(String),
}

/// Opens RDMA devices: installed once per process by a build with RDMA.
pub trait NicProvider: Send + Sync + 'static {
    fn open(&self, cfg: RdmaConfig) -> Result<Arc<dyn Nic>, OpenError>;
}

static PROVIDER: OnceLock<&'static dyn NicProvider> = OnceLock::new();

/// Installs the process's RDMA implementation (the first call wins; a second
/// is ignored: there is one verbs library per process).
pub fn install(p: &'static dyn NicProvider) {
    let _ = PROVIDER.set(p);
}

/// The installed RDMA implementation; `None`: built without RDMA.
pub fn provider() -> Option<&'static dyn NicProvider> {
    PROVIDER.get().copied()
}

/// Opened RDMA devices.
pub trait Nic: Send + Sync + 'static {
    fn device_names(&self) -> Vec<String>;
    /// What a storage node advertises to clients.
    fn caps(&self) -> RdmaCaps;
    /// Registers `mem` on every device (cached by address range). The
    /// region owns `mem` and keeps it alive while any work request uses it.
    fn register(&self, mem: Arc<dyn RdmaMemory>) -> Result<Arc<dyn NicRegion>, KvError>;
    /// Lets the cache go of the region at `addr..addr + len`; it goes when
    /// its last holder does. Whether one was cached.
    fn unregister(&self, addr: usize, len: usize) -> bool;
    /// The node's side of a client's connection to `region` (a region this
    /// NIC registered); the connection lives as long as the returned value.
    fn accept(
        self: Arc<Self>,
        req: &RdmaConnectRequest,
        region: &Arc<dyn NicRegion>,
    ) -> Result<(RdmaConnectReply, Box<dyn NicPassive>), KvError>;
    /// The transfer engine's RDMA path over this NIC; `key`: the cluster
    /// secret its control connections prove.
    fn data_path(self: Arc<Self>, key: Option<ClusterKey>) -> Arc<dyn NicDataPath>;
}

/// Memory registered with a [`Nic`]. Every work request in flight holds an
/// `Arc` of it, so `Arc::strong_count` counts them (plus the NIC's cache and
/// the caller's handle).
pub trait NicRegion: Send + Sync + 'static {
    fn addr(&self) -> usize;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// For the NIC that made it, to get its own type back (the same
    /// allocation: the count of holders stays right).
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

/// A node's side of one client connection (its queue pairs).
pub trait NicPassive: Send + 'static {
    fn lanes(&self) -> usize;
}

/// The result of an RDMA read or write: `None` means "this node is on TCP".
pub type NicFuture<'a> = Pin<Box<dyn Future<Output = Option<Result<(), KvError>>> + Send + 'a>>;

/// What a read or write of one replica needs from the engine.
pub struct NicOp<'a> {
    pub replica: &'a ReplicaDesc,
    pub deadline: Instant,
    /// The TCP pool of the replica's node and shard: the control connection
    /// that sets up and holds the RDMA connection comes from it.
    pub pool: Arc<ConnPool>,
    pub connect_timeout: Duration,
    pub max_frame: u32,
    pub stats: &'a EngineStats,
}

/// The transfer engine's RDMA path.
pub trait NicDataPath: Send + Sync + 'static {
    fn nic(&self) -> &Arc<dyn Nic>;
    /// Reads `op.replica` into `dst`.
    fn read<'a>(&'a self, op: NicOp<'a>, dst: &'a mut [u8]) -> NicFuture<'a>;
    /// Writes `src` to `op.replica`.
    fn write<'a>(&'a self, op: NicOp<'a>, src: &'a [u8]) -> NicFuture<'a>;
    /// Forgets every connection to `segment` (it went away).
    fn forget_segment(&self, segment: SegmentId);
    /// A zeroed buffer of `len` bytes registered with the NIC: transfers into
    /// or out of it are zero copy.
    fn alloc(&self, len: usize) -> Result<Arc<RdmaBuffer>, KvError>;
}
