//! Choosing and opening the RDMA transport for a role, from its
//! [`RdmaSettings`]: the one place that decides "rdma, or tcp and why".
//!
//! * Built without the `rdma` feature (no RDMA installed in the process,
//!   `kvpool_transport::nic::provider`): `auto` serves/uses TCP (the reason
//!   is "built without the rdma feature"); `required` is a start-up error.
//! * Built with it: the devices are opened; no device (listing devices fails
//!   with ENOSYS on a machine without RDMA, or the named device is missing)
//!   under `auto` is one log line (info for a node, debug for a client) and
//!   TCP; under `required` a start-up error.

use std::sync::Arc;

use kvpool_config::{RdmaMode, RdmaSettings};
use kvpool_transport::nic::{self, Nic, OpenError, RdmaConfig};

/// The outcome of opening RDMA for a role.
pub enum Opened {
    Rdma(Arc<dyn Nic>),
    /// TCP, and why (for the log line and the node's advertised caps).
    Tcp(String),
}

/// Opens RDMA for `role` as `s` says; `Err` when `required` cannot be met.
pub fn open(s: &RdmaSettings, required: bool, role: &str) -> Result<Opened, String> {
    let required = required || s.enabled == RdmaMode::Required;
    if s.enabled == RdmaMode::Off && !required {
        return Ok(Opened::Tcp(format!("rdma is off ({role}.rdma.enabled)")));
    }
    let opened = open_devices(s);
    match opened {
        Ok(o) => Ok(o),
        Err(why) if required => Err(format!("{role}: rdma is required but {why}")),
        Err(why) => {
            // A node serving TCP only is worth a line in its log; every
            // client (each CLI command) saying so is noise: debug.
            if role == "client" {
                tracing::debug!(role, "no rdma: {why}; using tcp");
            } else {
                tracing::info!(role, "no rdma: {why}; using tcp");
            }
            Ok(Opened::Tcp(why))
        }
    }
}

fn open_devices(s: &RdmaSettings) -> Result<Opened, String> {
    let Some(provider) = nic::provider() else {
        return Err("this kvpool was built without the rdma feature".into());
    };
    let cfg = RdmaConfig {
        devices: s.devices.clone(),
        port: s.port,
        gid_index: u8::try_from(s.gid_index).ok(),
        lanes_per_peer: s.lanes,
        slice_bytes: s.slice_bytes.get() as usize,
        max_outstanding_per_lane: s.max_outstanding_per_lane,
        max_requests_per_connection: s.max_requests_per_connection,
        ..RdmaConfig::default()
    };
    match provider.open(cfg) {
        Ok(nic) => {
            tracing::info!(devices = ?nic.device_names(), "rdma devices opened");
            Ok(Opened::Rdma(nic))
        }
        Err(OpenError::NoDevice(reason)) => Err(format!("no RDMA device ({reason})")),
        Err(OpenError::Failed(e)) => Err(format!("opening the RDMA devices failed: {e}")),
    }
}
