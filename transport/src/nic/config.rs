//! Settings of the RDMA transport, and every limit it sizes at start.

use std::time::Duration;

use kvpool_wire::error::{ErrorCode, KvError};
use kvpool_wire::rdma_wire::MAX_LANES_PER_CONNECTION;

/// Default slice: one work request moves at most this many bytes.
pub const DEFAULT_SLICE_BYTES: usize = 64 * 1024;
/// Default bound on work requests in flight per queue pair (lane).
pub const DEFAULT_MAX_OUTSTANDING_PER_LANE: u32 = 32;
/// Default lanes (RC queue pairs) per peer.
pub const DEFAULT_LANES_PER_PEER: usize = 2;
/// Default bound on requests a connection tracks (queued + in flight).
pub const DEFAULT_MAX_REQUESTS_PER_CONNECTION: usize = 256;
/// A slice never exceeds this (a verbs SGE length is 32 bits; keep room).
pub const MAX_SLICE_BYTES: usize = 1 << 30;
/// RDMA READs one QP keeps in flight as initiator, and accepts as responder,
/// at most (devices usually allow 16; the soft-RoCE one 128).
pub const MAX_RD_ATOMIC: u8 = 16;

/// Settings of the RDMA transport. Every field has a default; see
/// `docs/architecture/rdma.md` for why the defaults are what they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Devices to use, by name (`mlx5_0`). Empty: every device with an
    /// active port. A named device that is missing or whose port is down is
    /// an error (`NoDevice`), never silently skipped.
    pub devices: Vec<String>,
    /// Port number on every device (verbs ports count from 1).
    pub port: u8,
    /// Source GID index. `None`: on RoCE the first RoCE v2 GID holding an
    /// IPv4-mapped address, else the first RoCE v2 GID, else 0; on
    /// InfiniBand 0.
    pub gid_index: Option<u8>,
    /// Queue pairs per peer connection.
    pub lanes_per_peer: usize,
    /// Bytes per work request.
    pub slice_bytes: usize,
    /// Work requests in flight per queue pair; more wait in the connection.
    pub max_outstanding_per_lane: u32,
    /// Requests one connection tracks at once; more are refused
    /// (`ResourceExhausted`) by `try_submit`, or wait in `submit`.
    pub max_requests_per_connection: usize,
    /// Registrations the memory-region cache keeps.
    pub mr_cache_max_entries: usize,
    /// Bytes the memory-region cache keeps registered (pinned).
    pub mr_cache_max_bytes: u64,
    /// Local ACK timeout, verbs encoding: 4.096 us * 2^timeout (14: 67 ms).
    pub qp_timeout: u8,
    /// Transport retries before a work request fails with RETRY_EXC_ERR.
    /// 7 is the verbs maximum, but soft-RoCE (rxe) reads 7 as "retry
    /// forever", so the default is 6: finite on every device.
    pub qp_retry_count: u8,
    /// How long to wait for a reset queue pair to flush its work requests
    /// before its buffers are leaked on purpose (never freed under the NIC).
    pub drain_timeout: Duration,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            devices: Vec::new(),
            port: 1,
            gid_index: None,
            lanes_per_peer: DEFAULT_LANES_PER_PEER,
            slice_bytes: DEFAULT_SLICE_BYTES,
            max_outstanding_per_lane: DEFAULT_MAX_OUTSTANDING_PER_LANE,
            max_requests_per_connection: DEFAULT_MAX_REQUESTS_PER_CONNECTION,
            mr_cache_max_entries: 1024,
            mr_cache_max_bytes: 1 << 40,
            qp_timeout: 14,
            qp_retry_count: 6,
            drain_timeout: Duration::from_secs(2),
        }
    }
}

impl RdmaConfig {
    /// Checks every field; the message names the field.
    pub fn validate(&self) -> Result<(), KvError> {
        let bad = |field: &str, why: String| {
            Err(KvError::new(
                ErrorCode::InvalidParams,
                format!("rdma.{field}: {why}"),
            ))
        };
        if self.port == 0 {
            return bad("port", "verbs ports count from 1".into());
        }
        if self.lanes_per_peer == 0 || self.lanes_per_peer > MAX_LANES_PER_CONNECTION {
            return bad(
                "lanes_per_peer",
                format!(
                    "{} not in 1..={MAX_LANES_PER_CONNECTION}",
                    self.lanes_per_peer
                ),
            );
        }
        if self.slice_bytes == 0 || self.slice_bytes > MAX_SLICE_BYTES {
            return bad(
                "slice_bytes",
                format!("{} not in 1..={MAX_SLICE_BYTES}", self.slice_bytes),
            );
        }
        if self.max_outstanding_per_lane == 0 || self.max_outstanding_per_lane > 4096 {
            return bad(
                "max_outstanding_per_lane",
                format!("{} not in 1..=4096", self.max_outstanding_per_lane),
            );
        }
        if self.max_requests_per_connection == 0 || self.max_requests_per_connection > 1 << 16 {
            return bad(
                "max_requests_per_connection",
                format!("{} not in 1..=65536", self.max_requests_per_connection),
            );
        }
        if self.mr_cache_max_entries == 0 {
            return bad("mr_cache_max_entries", "must be at least 1".into());
        }
        if self.mr_cache_max_bytes == 0 {
            return bad("mr_cache_max_bytes", "must be at least 1".into());
        }
        if self.qp_timeout > 31 {
            return bad("qp_timeout", format!("{} not in 0..=31", self.qp_timeout));
        }
        if self.qp_retry_count > 7 {
            return bad(
                "qp_retry_count",
                format!("{} not in 0..=7", self.qp_retry_count),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_is_valid() {
        RdmaConfig::default().validate().unwrap();
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases: Vec<(&str, RdmaConfig)> = vec![
            (
                "rdma.port",
                RdmaConfig {
                    port: 0,
                    ..Default::default()
                },
            ),
            (
                "rdma.lanes_per_peer",
                RdmaConfig {
                    lanes_per_peer: 0,
                    ..Default::default()
                },
            ),
            (
                "rdma.slice_bytes",
                RdmaConfig {
                    slice_bytes: MAX_SLICE_BYTES + 1,
                    ..Default::default()
                },
            ),
            (
                "rdma.max_outstanding_per_lane",
                RdmaConfig {
                    max_outstanding_per_lane: 0,
                    ..Default::default()
                },
            ),
            (
                "rdma.max_requests_per_connection",
                RdmaConfig {
                    max_requests_per_connection: 0,
                    ..Default::default()
                },
            ),
            (
                "rdma.qp_timeout",
                RdmaConfig {
                    qp_timeout: 32,
                    ..Default::default()
                },
            ),
            (
                "rdma.qp_retry_count",
                RdmaConfig {
                    qp_retry_count: 8,
                    ..Default::default()
                },
            ),
        ];
        for (field, cfg) in cases {
            let e = cfg.validate().unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidParams);
            assert!(e.message.starts_with(field), "{field}: {e}");
        }
    }
}
