//! The `kvpool` package's integration tests, one module per file of this
//! folder, in one test binary: each file used to be a binary of its own,
//! and compiling and linking 21 of them (each with its own copy of the
//! client, the runtime and `common`) was half of CI's build. A test is
//! named by its file: `cargo test --release --test suite resp::` runs
//! tests/resp.rs, `... --test suite resp::name` one test.
//!
//! The benches' small modes are tests here too (`bench_small.rs`: each
//! bench file a module, its `main` a test).
//!
//! `cli.rs`, `rdma.rs` and `transfer_kill.rs` stay binaries of their own:
//! the first two are what the RDMA build runs (with `--features rdma`, also
//! inside the soft-RoCE guest), and `transfer_kill` counts its own
//! process's file descriptors, which other tests in the process would
//! change.

mod common;

mod admin;
mod bench_small;
mod bench_transfer;
mod cluster;
mod durability;
mod engine;
mod failures;
mod faults;
mod fuzz_corpus;
mod ha;
mod hostile;
mod hot_replicas;
mod layout;
mod liveness;
mod location_cache;
mod mailboxes;
mod malformed;
mod nvme_tier;
mod resp;
mod security;
mod serving;
mod shards;
mod transfer;
mod upsert;
