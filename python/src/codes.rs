//! Errors as Python sees them: `kvpool.KvpoolError` for `kvpool.Client`, and the
//! one table that turns kvpool's error codes into Mooncake's negative codes
//! for `kvpool.mooncake`.

use kvpool_wire::{ErrorCode, KvError};
use pyo3::prelude::*;

/// Mooncake's codes that the shim returns without a kvpool error behind them.
pub const OK: i64 = 0;
pub const INTERNAL_ERROR: i64 = -1;
pub const INVALID_PARAMS: i64 = -600;

/// kvpool's error code -> Mooncake's code and name (`mooncake-store`'s
/// `ErrorCode`). The only place the two meet; README lists it.
pub const TABLE: [(ErrorCode, i64, &str); 19] = [
    (ErrorCode::InvalidParams, -600, "INVALID_PARAMS"),
    (ErrorCode::ObjectNotFound, -704, "OBJECT_NOT_FOUND"),
    (
        ErrorCode::ObjectAlreadyExists,
        -705,
        "OBJECT_ALREADY_EXISTS",
    ),
    (ErrorCode::ReplicaNotReady, -703, "REPLICA_IS_NOT_READY"),
    (ErrorCode::ObjectHasLease, -706, "OBJECT_HAS_LEASE"),
    (ErrorCode::IllegalClient, -601, "ILLEGAL_CLIENT"),
    (ErrorCode::NoSpace, -200, "NO_AVAILABLE_HANDLE"),
    (ErrorCode::SegmentNotFound, -101, "SEGMENT_NOT_FOUND"),
    (ErrorCode::Timeout, -901, "RPC_TIMEOUT"),
    (ErrorCode::Malformed, -900, "RPC_FAIL"),
    (ErrorCode::Unsupported, -1012, "NOT_SUPPORTED"),
    (ErrorCode::TooLarge, -600, "INVALID_PARAMS"),
    (ErrorCode::Unavailable, -900, "RPC_FAIL"),
    (ErrorCode::ResourceExhausted, -200, "NO_AVAILABLE_HANDLE"),
    (ErrorCode::Internal, -1, "INTERNAL_ERROR"),
    (ErrorCode::Corrupt, -801, "CHECKSUM_MISMATCH"),
    (ErrorCode::Unauthenticated, -601, "ILLEGAL_CLIENT"),
    (ErrorCode::TryAgain, -1010, "UNAVAILABLE_IN_CURRENT_STATUS"),
    // A master that is not the leader (HA): a failed RPC to retry, as
    // Mooncake reports a call to a master that is gone.
    (ErrorCode::NotLeader, -900, "RPC_FAIL"),
];

/// Mooncake's code for a kvpool error.
pub fn mooncake_code(e: &KvError) -> i64 {
    TABLE
        .iter()
        .find(|(c, _, _)| *c == e.code)
        .map(|t| t.1)
        .unwrap_or(INTERNAL_ERROR)
}

/// The table as `[(kvpool_code, kvpool_name, mooncake_code, mooncake_name)]`.
#[pyfunction]
pub fn mooncake_code_table() -> Vec<(u16, &'static str, i64, &'static str)> {
    TABLE
        .iter()
        .map(|(c, m, n)| (c.code(), c.name(), *m, *n))
        .collect()
}

/// The Python exception for a kvpool error: `kvpool.KvpoolError(code, name,
/// message)`, a Python class (`kvpool/_errors.py`): under the stable ABI a
/// native class may subclass `Exception` only from Python 3.12 on.
fn kvpool_error<'py>(py: Python<'py>, e: &KvError) -> PyResult<Bound<'py, PyAny>> {
    static CLASS: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> = pyo3::sync::PyOnceLock::new();
    CLASS.import(py, "kvpool._errors", "KvpoolError")?.call1((
        e.code.code(),
        e.code.name(),
        e.message.clone(),
    ))
}

/// The Python exception for a kvpool error.
pub fn to_py(py: Python<'_>, e: &KvError) -> PyErr {
    match kvpool_error(py, e) {
        Ok(v) => PyErr::from_value(v),
        Err(err) => err,
    }
}

/// The error as a Python value (for per-item batch results).
pub fn to_py_value(py: Python<'_>, e: &KvError) -> PyResult<Py<PyAny>> {
    Ok(kvpool_error(py, e)?.unbind())
}

/// `kvpool.ERROR_CODES`: every kvpool error name and its code.
pub fn error_codes() -> Vec<(&'static str, u16)> {
    ErrorCode::ALL
        .iter()
        .map(|c| (c.name(), c.code()))
        .collect()
}
