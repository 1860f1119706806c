//! This crate as `kvpool_transport::nic`'s implementation: [`install`] makes
//! it the process's RDMA.

use std::any::Any;
use std::sync::Arc;

use kvpool_transport::nic::{
    self, Nic, NicDataPath, NicPassive, NicProvider, NicRegion, OpenError, RdmaConfig, RdmaMemory,
};
use kvpool_wire::auth::ClusterKey;
use kvpool_wire::error::{ErrorCode, KvError};
use kvpool_wire::rdma_wire::{RdmaCaps, RdmaConnectReply, RdmaConnectRequest};

use crate::path::RdmaPath;
use crate::{PassiveConnection, RdmaContext, RdmaError, Registration};

/// ibverbs, through rdma-core's libibverbs.
struct Verbs;

static VERBS: Verbs = Verbs;

/// Makes ibverbs the process's RDMA: every client and storage node opened
/// after this call asks it for devices (their settings permitting).
pub fn install() {
    nic::install(&VERBS);
}

impl NicProvider for Verbs {
    fn open(&self, cfg: RdmaConfig) -> Result<Arc<dyn Nic>, OpenError> {
        match RdmaContext::open(cfg) {
            Ok(ctx) => Ok(ctx),
            Err(RdmaError::NoDevice(reason)) => Err(OpenError::NoDevice(reason.to_string())),
            Err(e) => Err(OpenError::Failed(e.to_string())),
        }
    }
}

impl Nic for RdmaContext {
    fn device_names(&self) -> Vec<String> {
        RdmaContext::device_names(self)
    }

    fn caps(&self) -> RdmaCaps {
        RdmaContext::caps(self)
    }

    fn register(&self, mem: Arc<dyn RdmaMemory>) -> Result<Arc<dyn NicRegion>, KvError> {
        let region: Arc<dyn NicRegion> = RdmaContext::register(self, mem)?;
        Ok(region)
    }

    fn unregister(&self, addr: usize, len: usize) -> bool {
        RdmaContext::unregister(self, addr, len)
    }

    fn accept(
        self: Arc<Self>,
        req: &RdmaConnectRequest,
        region: &Arc<dyn NicRegion>,
    ) -> Result<(RdmaConnectReply, Box<dyn NicPassive>), KvError> {
        let region = region
            .clone()
            .into_any()
            .downcast::<Registration>()
            .map_err(|_| {
                KvError::new(
                    ErrorCode::Internal,
                    "an RDMA region registered elsewhere than with this NIC",
                )
            })?;
        let (reply, passive) = RdmaContext::accept(&self, req, &region)?;
        Ok((reply, Box::new(passive)))
    }

    fn data_path(self: Arc<Self>, key: Option<ClusterKey>) -> Arc<dyn NicDataPath> {
        Arc::new(RdmaPath::new(self, key))
    }
}

impl NicRegion for Registration {
    fn addr(&self) -> usize {
        Registration::addr(self)
    }

    fn len(&self) -> usize {
        Registration::len(self)
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

impl NicPassive for PassiveConnection {
    fn lanes(&self) -> usize {
        PassiveConnection::lanes(self)
    }
}
