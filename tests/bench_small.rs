//! The benches of `benches/` in their small mode, as tests of this binary:
//! each bench file is a module here, and its `main` runs once (small mode:
//! no `--bench` argument). `cargo bench --bench <name>` still builds each as
//! a binary of its own and runs it in full. They were nine test binaries,
//! each linking its own client, runtime and support code.
//!
//! `benches/nvme.rs` stays a binary (`test = true`): it installs a global
//! allocator, which would become every test's here.

// Each bench file declares `mod support;` (it is a crate root under `cargo
// bench`), so `benches/support/mod.rs` is a module of each of them here.
#![allow(clippy::duplicate_mod)]

#[path = "../benches/engine.rs"]
mod engine;
#[path = "../benches/hot_reads.rs"]
mod hot_reads;
#[path = "../benches/integrity.rs"]
mod integrity;
#[path = "../benches/kv_stream.rs"]
mod kv_stream;
#[path = "../benches/master.rs"]
mod master;
#[path = "../benches/master_ship.rs"]
mod master_ship;
#[path = "../benches/master_state.rs"]
mod master_state;
#[path = "../benches/resp.rs"]
mod resp;
#[path = "../benches/store.rs"]
mod store;
#[path = "../benches/transfer.rs"]
mod transfer;

#[test]
fn engine_bench() {
    engine::main();
}

#[test]
fn hot_reads_bench() {
    hot_reads::main();
}

#[test]
fn integrity_bench() {
    integrity::main();
}

#[test]
fn kv_stream_bench() {
    kv_stream::main();
}

#[test]
fn master_bench() {
    master::main();
}

#[test]
fn master_ship_bench() {
    master_ship::main();
}

#[test]
fn master_state_bench() {
    master_state::main();
}

#[test]
fn resp_bench() {
    resp::main();
}

#[test]
fn store_bench() {
    store::main();
}

#[test]
fn transfer_bench() {
    transfer::main();
}
