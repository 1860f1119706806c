//! Errors of the RDMA transport's set-up, and how work-completion statuses
//! map onto kvpool's error codes.
//!
//! Set-up calls (`RdmaContext::open`, registration, connect/accept) return
//! [`RdmaError`], so a caller can tell "no device here" ([`RdmaError::NoDevice`],
//! serve over tcp and say why) from a real failure. Transfers end with a
//! [`KvError`], like every other data path.

use std::fmt;
use std::io;

use ibverbs_sys::ibv_wc_status as wcs;

use kvpool_wire::error::{ErrorCode, KvError};

/// Why there is no usable RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoDeviceReason {
    /// `ibv_get_device_list` failed. `ENOSYS` means the kernel has no RDMA
    /// support (no `ib_uverbs`): the normal case on a machine without a NIC.
    ListFailed { errno: i32, message: String },
    /// The kernel supports RDMA but lists no device.
    EmptyList,
    /// The configuration names devices that are not there.
    NamedMissing {
        missing: Vec<String>,
        present: Vec<String>,
    },
    /// Devices exist but none has a usable (active) port; `(device, why)`.
    NoActivePort { devices: Vec<(String, String)> },
}

impl NoDeviceReason {
    /// True for the "kernel has no RDMA support" case (`ENOSYS`).
    pub fn is_enosys(&self) -> bool {
        matches!(self, Self::ListFailed { errno, .. } if *errno == ENOSYS)
    }
}

const ENOSYS: i32 = 38;

/// The symbolic name of the errnos device listing and registration return.
pub(crate) fn errno_name(errno: i32) -> &'static str {
    match errno {
        1 => "EPERM",
        2 => "ENOENT",
        5 => "EIO",
        11 => "EAGAIN",
        12 => "ENOMEM",
        13 => "EACCES",
        14 => "EFAULT",
        16 => "EBUSY",
        19 => "ENODEV",
        22 => "EINVAL",
        28 => "ENOSPC",
        ENOSYS => "ENOSYS",
        95 => "EOPNOTSUPP",
        110 => "ETIMEDOUT",
        _ => "errno",
    }
}

impl fmt::Display for NoDeviceReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ListFailed { errno, message } => {
                write!(
                    f,
                    "listing RDMA devices failed with {} ({errno}): {message}",
                    errno_name(*errno)
                )?;
                if *errno == ENOSYS {
                    f.write_str(" -- the kernel has no RDMA support (no ib_uverbs)")?;
                }
                Ok(())
            }
            Self::EmptyList => f.write_str("the kernel lists no RDMA device"),
            Self::NamedMissing { missing, present } => write!(
                f,
                "configured device(s) {missing:?} not found (present: {present:?})"
            ),
            Self::NoActivePort { devices } => {
                f.write_str("no device has an active port:")?;
                for (d, why) in devices {
                    write!(f, " {d}: {why};")?;
                }
                Ok(())
            }
        }
    }
}

/// A failure of the RDMA transport's set-up.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// No usable device; the node serves over tcp and logs this reason.
    #[error("no RDMA device: {0}")]
    NoDevice(NoDeviceReason),
    /// A verbs call failed.
    #[error("{op} failed: {source}")]
    Verbs {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// The peer advertises no RDMA device (or none we can reach).
    #[error("peer cannot do RDMA: {0}")]
    PeerUnsupported(String),
    /// Anything else, with its kvpool error code.
    #[error(transparent)]
    Kv(#[from] KvError),
}

impl RdmaError {
    pub fn is_no_device(&self) -> bool {
        matches!(self, Self::NoDevice(_))
    }

    pub fn no_device_reason(&self) -> Option<&NoDeviceReason> {
        match self {
            Self::NoDevice(r) => Some(r),
            _ => None,
        }
    }

    /// A verbs call that failed with `errno` (0 or unknown: the thread's
    /// last OS error).
    pub(crate) fn verbs(op: &'static str, errno: i32) -> Self {
        let source = if errno > 0 {
            io::Error::from_raw_os_error(errno)
        } else {
            io::Error::last_os_error()
        };
        Self::Verbs { op, source }
    }

    pub(crate) fn verbs_last(op: &'static str) -> Self {
        Self::Verbs {
            op,
            source: io::Error::last_os_error(),
        }
    }

    /// The kvpool error code for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::NoDevice(_) => ErrorCode::Unavailable,
            Self::PeerUnsupported(_) => ErrorCode::Unsupported,
            Self::Verbs { source, .. } => match source.raw_os_error() {
                Some(11 | 12 | 28) => ErrorCode::ResourceExhausted,
                Some(22) => ErrorCode::InvalidParams,
                _ => ErrorCode::Internal,
            },
            Self::Kv(e) => e.code,
        }
    }
}

impl From<RdmaError> for KvError {
    fn from(e: RdmaError) -> Self {
        match e {
            RdmaError::Kv(k) => k,
            other => KvError::new(other.code(), other.to_string()),
        }
    }
}

/// What a work completion means for the slice it completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WcClass {
    Success,
    /// Flushed because the queue pair went to the error state: the slice did
    /// not run; it may run on another lane.
    Flushed,
    /// The path to the peer failed (retries exhausted, peer QP gone, fatal):
    /// the lane is dead; the slice may run on another lane.
    Transport,
    /// The request itself is wrong (remote key or range refused, local
    /// protection): retrying elsewhere would fail the same way.
    Request,
}

pub(crate) fn classify_wc(status: wcs::Type) -> WcClass {
    match status {
        wcs::IBV_WC_SUCCESS => WcClass::Success,
        wcs::IBV_WC_WR_FLUSH_ERR => WcClass::Flushed,
        wcs::IBV_WC_LOC_LEN_ERR
        | wcs::IBV_WC_LOC_PROT_ERR
        | wcs::IBV_WC_LOC_ACCESS_ERR
        | wcs::IBV_WC_REM_ACCESS_ERR
        | wcs::IBV_WC_REM_INV_REQ_ERR
        | wcs::IBV_WC_MW_BIND_ERR => WcClass::Request,
        _ => WcClass::Transport,
    }
}

/// The verbs name of a completion status (`IBV_WC_RETRY_EXC_ERR`).
pub(crate) fn wc_status_name(status: wcs::Type) -> &'static str {
    match status {
        wcs::IBV_WC_SUCCESS => "IBV_WC_SUCCESS",
        wcs::IBV_WC_LOC_LEN_ERR => "IBV_WC_LOC_LEN_ERR",
        wcs::IBV_WC_LOC_QP_OP_ERR => "IBV_WC_LOC_QP_OP_ERR",
        wcs::IBV_WC_LOC_EEC_OP_ERR => "IBV_WC_LOC_EEC_OP_ERR",
        wcs::IBV_WC_LOC_PROT_ERR => "IBV_WC_LOC_PROT_ERR",
        wcs::IBV_WC_WR_FLUSH_ERR => "IBV_WC_WR_FLUSH_ERR",
        wcs::IBV_WC_MW_BIND_ERR => "IBV_WC_MW_BIND_ERR",
        wcs::IBV_WC_BAD_RESP_ERR => "IBV_WC_BAD_RESP_ERR",
        wcs::IBV_WC_LOC_ACCESS_ERR => "IBV_WC_LOC_ACCESS_ERR",
        wcs::IBV_WC_REM_INV_REQ_ERR => "IBV_WC_REM_INV_REQ_ERR",
        wcs::IBV_WC_REM_ACCESS_ERR => "IBV_WC_REM_ACCESS_ERR",
        wcs::IBV_WC_REM_OP_ERR => "IBV_WC_REM_OP_ERR",
        wcs::IBV_WC_RETRY_EXC_ERR => "IBV_WC_RETRY_EXC_ERR",
        wcs::IBV_WC_RNR_RETRY_EXC_ERR => "IBV_WC_RNR_RETRY_EXC_ERR",
        wcs::IBV_WC_LOC_RDD_VIOL_ERR => "IBV_WC_LOC_RDD_VIOL_ERR",
        wcs::IBV_WC_REM_INV_RD_REQ_ERR => "IBV_WC_REM_INV_RD_REQ_ERR",
        wcs::IBV_WC_REM_ABORT_ERR => "IBV_WC_REM_ABORT_ERR",
        wcs::IBV_WC_INV_EECN_ERR => "IBV_WC_INV_EECN_ERR",
        wcs::IBV_WC_INV_EEC_STATE_ERR => "IBV_WC_INV_EEC_STATE_ERR",
        wcs::IBV_WC_FATAL_ERR => "IBV_WC_FATAL_ERR",
        wcs::IBV_WC_RESP_TIMEOUT_ERR => "IBV_WC_RESP_TIMEOUT_ERR",
        wcs::IBV_WC_GENERAL_ERR => "IBV_WC_GENERAL_ERR",
        _ => "IBV_WC_(unknown)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_reasons_say_why() {
        let r = NoDeviceReason::ListFailed {
            errno: 38,
            message: "Function not implemented".into(),
        };
        assert!(r.is_enosys());
        let s = r.to_string();
        assert!(s.contains("ENOSYS") && s.contains("no RDMA support"), "{s}");
        let e = RdmaError::NoDevice(r);
        assert!(e.is_no_device());
        let k = KvError::from(e);
        assert_eq!(k.code, ErrorCode::Unavailable);
        assert!(k.message.starts_with("no RDMA device: "), "{k}");

        let s = NoDeviceReason::NamedMissing {
            missing: vec!["mlx5_9".into()],
            present: vec!["rxe0".into()],
        }
        .to_string();
        assert!(s.contains("mlx5_9") && s.contains("rxe0"), "{s}");
        assert!(!NoDeviceReason::EmptyList.is_enosys());
    }

    #[test]
    fn completion_statuses_are_classified() {
        assert_eq!(classify_wc(wcs::IBV_WC_SUCCESS), WcClass::Success);
        assert_eq!(classify_wc(wcs::IBV_WC_WR_FLUSH_ERR), WcClass::Flushed);
        assert_eq!(classify_wc(wcs::IBV_WC_RETRY_EXC_ERR), WcClass::Transport);
        assert_eq!(classify_wc(wcs::IBV_WC_FATAL_ERR), WcClass::Transport);
        assert_eq!(classify_wc(wcs::IBV_WC_REM_ACCESS_ERR), WcClass::Request);
        assert_eq!(
            wc_status_name(wcs::IBV_WC_RETRY_EXC_ERR),
            "IBV_WC_RETRY_EXC_ERR"
        );
    }

    #[test]
    fn verbs_errnos_map_to_codes() {
        assert_eq!(
            RdmaError::verbs("ibv_reg_mr", 12).code(),
            ErrorCode::ResourceExhausted
        );
        assert_eq!(
            RdmaError::verbs("ibv_modify_qp", 22).code(),
            ErrorCode::InvalidParams
        );
        assert_eq!(RdmaError::verbs("x", 5).code(), ErrorCode::Internal);
    }
}
