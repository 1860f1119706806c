//! Choosing and opening the RDMA transport for a role, from its
//! [`RdmaSettings`]: the one place that decides "rdma, or tcp and why".
//!
//! * Built without the `rdma` feature: `auto` serves/uses TCP (the reason
//!   is "built without the rdma feature"); `required` is a start-up error.
//! * Built with it: the devices are opened; no device (listing devices fails
//!   with ENOSYS on a machine without RDMA, or the named device is missing)
//!   under `auto` is one log line (info for a node, debug for a client) and
//!   TCP; under `required` a start-up error.

#[cfg(feature = "rdma")]
use std::sync::Arc;

use kvpool_config::{RdmaMode, RdmaSettings};

#[cfg(feature = "rdma")]
pub use kvpool_transport::rdma::RdmaContext;

/// The outcome of opening RDMA for a role.
pub enum Opened {
    #[cfg(feature = "rdma")]
    Rdma(Arc<RdmaContext>),
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

#[cfg(not(feature = "rdma"))]
fn open_devices(_s: &RdmaSettings) -> Result<Opened, String> {
    Err("this kvpool was built without the rdma feature".into())
}

#[cfg(feature = "rdma")]
fn open_devices(s: &RdmaSettings) -> Result<Opened, String> {
    use kvpool_transport::rdma::{RdmaConfig, RdmaError};
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
    match RdmaContext::open(cfg) {
        Ok(ctx) => {
            tracing::info!(devices = ?ctx.device_names(), "rdma devices opened");
            Ok(Opened::Rdma(ctx))
        }
        Err(RdmaError::NoDevice(reason)) => Err(format!("no RDMA device ({reason})")),
        Err(e) => Err(format!("opening the RDMA devices failed: {e}")),
    }
}
