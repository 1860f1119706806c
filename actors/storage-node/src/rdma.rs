//! A storage node's side of RDMA: its segment registered with the NIC, or
//! the reason clients get TCP. Opening the devices is the client crate's
//! `rdma::open` (the one place that decides "rdma, or tcp and why").

use std::sync::Arc;

use kvpool_client::rdma::{open, Opened};
use kvpool_config::{RdmaMode, RdmaSettings};
use kvpool_transport::nic::{Nic, NicRegion, RdmaMemory};

/// A storage node's DRAM segment, as memory to register with the NIC.
pub struct SegmentMemory(pub Arc<kvpool_storage::Segment>);

// SAFETY: the segment is one fixed mapping that lives as long as the Arc;
// the registration holds this value, so the mapping outlives every memory
// region made from it and every work request that uses one.
unsafe impl RdmaMemory for SegmentMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.0.as_ptr()
    }
    fn len(&self) -> usize {
        self.0.len() as usize
    }
}

/// What a storage node's data plane knows about RDMA.
#[derive(Clone)]
pub enum NodeRdma {
    On {
        nic: Arc<dyn Nic>,
        region: Arc<dyn NicRegion>,
    },
    /// Clients asking for RDMA are told this reason and use TCP.
    Off(String),
}

impl NodeRdma {
    /// Opens RDMA for the node and registers `segment`.
    pub fn start(
        s: &RdmaSettings,
        segment: &Arc<kvpool_storage::Segment>,
    ) -> Result<NodeRdma, String> {
        match open(s, false, "storage")? {
            Opened::Tcp(why) => Ok(NodeRdma::Off(why)),
            Opened::Rdma(nic) => match nic.register(Arc::new(SegmentMemory(segment.clone()))) {
                Ok(region) => Ok(NodeRdma::On { nic, region }),
                Err(e) => {
                    let why = format!("registering the segment with the NIC failed: {e}");
                    if s.enabled == RdmaMode::Required {
                        return Err(format!("storage: rdma is required but {why}"));
                    }
                    tracing::warn!("no rdma: {why}; serving over tcp");
                    Ok(NodeRdma::Off(why))
                }
            },
        }
    }

    pub fn is_on(&self) -> bool {
        !matches!(self, NodeRdma::Off(_))
    }
}
