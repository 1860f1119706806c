//! The conductor's integration tests, one binary: each file of this folder
//! is a module. They were two binaries.

#[path = "conductor_actor.rs"]
mod actor;
#[path = "conductor_hash.rs"]
mod hash;
