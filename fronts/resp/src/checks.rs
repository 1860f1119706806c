//! What a key and a value must be for the pool to hold them, and the error
//! replies that the pool's errors and a type clash become: shared by the
//! string commands (`exec`, `keyspace`) and the collections, which
//! otherwise do not import each other.

use kvpool_wire::{ErrorCode, KvError};

/// The pool's longest key.
pub(crate) use kvpool_wire::limits::MAX_KEY_BYTES;

/// A key the pool can hold, or the error reply saying why not.
pub(crate) fn check_key(k: &[u8]) -> Result<(), String> {
    if k.is_empty() {
        return Err("ERR kvpool keys cannot be empty".into());
    }
    if k.len() > MAX_KEY_BYTES {
        return Err(format!(
            "ERR the key is {} bytes; the pool's keys are at most {MAX_KEY_BYTES} bytes",
            k.len()
        ));
    }
    Ok(())
}

/// A value the pool can hold, or the error reply saying why not.
pub(crate) fn check_value(v: &[u8]) -> Result<(), String> {
    if v.is_empty() {
        return Err("ERR kvpool cannot store an empty value".into());
    }
    Ok(())
}

/// The error reply for a pool error: `OOM` when the pool has no space (as
/// Redis at maxmemory), `ERR` with the pool's code and message otherwise.
pub(crate) fn pool_error(e: &KvError) -> String {
    match e.code {
        ErrorCode::NoSpace => format!("OOM command not allowed: the pool has no space ({e})"),
        _ => format!("ERR {e}"),
    }
}

/// A missing key, or one whose first put has not finished.
pub(crate) fn is_miss(e: &KvError) -> bool {
    matches!(
        e.code,
        ErrorCode::ObjectNotFound | ErrorCode::ReplicaNotReady
    )
}

/// Redis's reply to a command on a key of another type.
pub(crate) const WRONGTYPE: &str =
    "WRONGTYPE Operation against a key holding the wrong kind of value";
