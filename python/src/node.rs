//! A storage node inside the Python process: Mooncake's
//! `global_segment_size > 0` gives that much of the process's DRAM to the
//! pool.
//!
//! ```text
//!  Python process
//!   +- kvpool-py (tokio): the node's actor (mount, pings), shm server, clients
//!   +- kvpool-py-node-i (glommio, NOT pinned): data plane of shard i
//! ```
//!
//! The shards are never pinned to cores, whatever the config says: a
//! library must not change where its host process's threads run. No master
//! and no HTTP run here; the node mounts at the store's master.

use std::time::Duration;

use kvpool_config::{NodeConfig, NodeError};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardPool, Shutdown};
use kvpool_storage_node::{start_mounted, MountOptions, MountedNode};

use crate::runtime;

/// How long start-up keeps trying to reach the master and mount.
const MOUNT_DEADLINE: Duration = Duration::from_secs(10);
/// Shards of an embedded node unless `[runtime] shards` says otherwise.
const DEFAULT_SHARDS: usize = 1;

/// A running embedded node.
pub struct EmbeddedNode {
    pool: Option<ShardPool>,
    node: Option<MountedNode>,
    shutdown: Shutdown,
}

impl EmbeddedNode {
    /// Starts a node giving `segment_bytes` to the pool at `master`,
    /// listening on `listen` and telling clients to reach it at
    /// `advertise_host`. Blocks until the segment is mounted.
    pub fn start(
        cfg: &NodeConfig,
        master: &str,
        segment_bytes: u64,
        listen: String,
        advertise_host: String,
    ) -> Result<Self, String> {
        let mut cfg = cfg.clone();
        cfg.storage.segment_size = kvpool_runtime::config::Bytes(segment_bytes);
        cfg.storage.listen = listen;
        cfg.storage.advertise_host = advertise_host;
        cfg.storage.master = master.to_string();
        let mut pool_cfg = cfg.runtime.shard_pool();
        pool_cfg.pin = false;
        pool_cfg.name = "kvpool-py-node".into();
        if pool_cfg.shards == 0 {
            pool_cfg.shards = DEFAULT_SHARDS;
        }
        cfg.validate()?;
        let key = cfg.cluster_key()?;
        let shutdown = Shutdown::new();
        let pool = ShardPool::start(&pool_cfg, shutdown.clone()).map_err(|e| e.to_string())?;
        let opts = MountOptions {
            master: master.to_string(),
            client: cfg.client_config(),
            key,
            skew_ms: cfg.security.clock_skew_ms,
            deadline: MOUNT_DEADLINE,
            actor_name: None,
        };
        let metrics = MetricsRegistry::new();
        let handle = pool.handle();
        let started = runtime::block_on(async {
            start_mounted(&handle, &cfg.storage, &opts, &metrics, shutdown.clone()).await
        })
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e: NodeError| e.to_string()));
        match started {
            Ok(node) => Ok(Self {
                pool: Some(pool),
                node: Some(node),
                shutdown,
            }),
            Err(e) => {
                shutdown.trigger();
                let _ = pool.shutdown_and_join();
                Err(e)
            }
        }
    }

    /// The data plane's port.
    pub fn port(&self) -> u16 {
        self.node.as_ref().map(|n| n.addr().port()).unwrap_or(0)
    }

    /// Unmounts the segment at the master, then stops the shards (in-flight
    /// requests get the drain deadline).
    /// Once the shards ended, the ports are free at once (a `setup` on the
    /// same `local_hostname` port may follow): the listeners stop listening
    /// though the kernel may still be tearing the shards' rings down.
    pub fn stop(mut self) {
        let listening = self.node.as_ref().map(|n| n.listening());
        if let Some(node) = self.node.take() {
            let _ = runtime::block_on(node.leave());
        }
        self.shutdown.trigger();
        if let Some(pool) = self.pool.take() {
            match pool.shutdown_and_join() {
                Ok(()) => listening.iter().for_each(|l| l.stop()),
                Err(e) => tracing::warn!("embedded storage node: {e}"),
            }
        }
    }
}

impl Drop for EmbeddedNode {
    fn drop(&mut self) {
        // Not stopped by `stop` (an interpreter exiting): the shards end
        // with the signal; the master forgets the segment once its pings
        // stop.
        self.shutdown.trigger();
    }
}
