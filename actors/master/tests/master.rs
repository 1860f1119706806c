//! The master's integration tests, one binary: each file of this folder is
//! a module (`cargo test -p kvpool-master --test master behaviour::` runs
//! tests/master_behaviour.rs). They were four binaries, each linking the
//! master, the transport and the runtime again.

#[path = "master_behaviour.rs"]
mod behaviour;
#[path = "master_live.rs"]
mod live;
#[path = "master_model.rs"]
mod model;
#[path = "master_tier_model.rs"]
mod tier_model;
