//! kvpool's Python package, native half (`kvpool._native`).
//!
//! ```text
//!  kvpool.Client ------------------+                 (client.rs)
//!  kvpool.mooncake.MooncakeDistributedStore          (mooncake.py: setup's forms)
//!     '- _MooncakeStore -----------+                 (mooncake.rs: every other method)
//!                                  |  GIL released, block_on
//!                                  v
//!            one tokio runtime per process (runtime.rs) -> kvpool_client::Client
//!            embedded storage node, unpinned shards (node.rs), when
//!            global_segment_size > 0
//! ```
//!
//! Errors: `KvpoolError` (kvpool's codes) for `kvpool.Client`; Mooncake's
//! negative codes for the store, through the one table in `codes.rs`.
//!
//! Everything is behind the `python` feature (maturin turns it on): without
//! it the crate is empty, so the workspace builds without a Python.
#![cfg(feature = "python")]

use pyo3::prelude::*;

mod client;
mod codes;
mod config;
mod cuda;
mod memory;
mod mooncake;
mod node;
mod runtime;
mod staged;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Built with RDMA: every client and embedded node the module opens may
    // use it (their settings permitting).
    #[cfg(feature = "rdma")]
    kvpool_rdma::install();
    m.add_class::<client::PyClient>()?;
    m.add_class::<mooncake::Store>()?;
    m.add_class::<mooncake::ReplicateConfig>()?;
    m.add_class::<mooncake::SoftPinAction>()?;
    m.add_class::<mooncake::ObjectDataType>()?;
    m.add_class::<memory::HostMemAllocator>()?;
    m.add_function(wrap_pyfunction!(codes::mooncake_code_table, m)?)?;
    m.add("ERROR_CODES", codes::error_codes())?;
    m.add("CONFIG_ENV", config::CONFIG_ENV)?;
    m.add("RDMA", cfg!(feature = "rdma"))?;
    Ok(())
}
