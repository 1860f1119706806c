//! The simulator's integration tests, one binary: each file of this folder
//! is a module (`cargo test -p kvpool-sim --test simulator sweep::` runs
//! tests/sweep.rs). They were four binaries.

mod support;

mod cache;
mod cli;
mod sim;
mod sweep;
