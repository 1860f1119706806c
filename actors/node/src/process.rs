//! One kvpool process: starts the shards, the tokio runtime and the roles it
//! was asked for; prints `kvpool <role> listening on HOST:PORT` when each is
//! ready; on SIGINT/SIGTERM unmounts its segment, lets in-flight requests
//! finish (or fail) within the drain deadline, and returns.

use std::time::Duration;

use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardHandle, ShardPool, Shutdown};
use ractor::{call, Actor, ActorRef};

use crate::http::{self, HttpState};
use kvpool_config::NodeConfig;
use kvpool_config::NodeError;
use kvpool_master::{Master, MasterArgs, MasterHandle, MasterMsg};
use kvpool_storage_node as storage_node;

/// Which roles a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Master and one storage node in one process.
    All,
    Master,
    Storage,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::All => "all",
            Role::Master => "master",
            Role::Storage => "storage",
        }
    }

    fn has_master(self) -> bool {
        matches!(self, Role::All | Role::Master)
    }

    fn has_storage(self) -> bool {
        matches!(self, Role::All | Role::Storage)
    }
}

/// How long a storage node keeps trying to reach the master at start.
const MOUNT_DEADLINE: Duration = Duration::from_secs(30);

/// Runs `role` until SIGINT or SIGTERM (or `shutdown`), then stops cleanly.
pub fn run(role: Role, cfg: NodeConfig, shutdown: Shutdown) -> Result<(), NodeError> {
    cfg.validate().map_err(NodeError::Config)?;
    let pool = ShardPool::start(&cfg.runtime.shard_pool(), shutdown.clone())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.runtime.actor_threads)
        .thread_name("kvpool-actor")
        .enable_all()
        .build()?;
    let res = rt.block_on(run_roles(role, &cfg, pool.handle(), shutdown.clone()));
    shutdown.trigger();
    rt.shutdown_timeout(Duration::from_secs(2));
    let joined = pool.shutdown_and_join();
    res?;
    joined?;
    tracing::info!(role = role.name(), "stopped");
    Ok(())
}

/// Says loudly, on stderr and in the log, that a cluster without a secret
/// listens beyond loopback: anyone who reaches its ports may write, remove
/// and mount.
fn warn_if_open(role: Role, cfg: &NodeConfig) {
    if !cfg.security.secret.is_empty() {
        return;
    }
    let wide = cfg.wide_listens(role.has_master(), role.has_storage());
    if wide.is_empty() {
        return;
    }
    let msg = format!(
        "THIS CLUSTER IS OPEN: no cluster secret is set and kvpool listens on {} \
         (beyond loopback). Anyone who can reach these ports can read, write, \
         remove and mount. Set {} (or [security] secret) on every role, or \
         listen on 127.0.0.1 only.",
        wide.join(", "),
        kvpool_config::SECRET_ENV
    );
    eprintln!("kvpool: WARNING: {msg}");
    tracing::warn!("{msg}");
}

async fn run_roles(
    role: Role,
    cfg: &NodeConfig,
    shards: ShardHandle,
    shutdown: Shutdown,
) -> Result<(), NodeError> {
    let metrics = MetricsRegistry::new();
    let key = cfg.cluster_key().map_err(NodeError::Config)?;
    warn_if_open(role, cfg);
    let mut master: Option<(ActorRef<MasterMsg>, MasterHandle)> = None;
    if role.has_master() {
        let args = MasterArgs {
            shards: shards.clone(),
            config: cfg.master.clone(),
            key: key.clone(),
            metrics: metrics.clone(),
        };
        let (actor, _) = Actor::spawn(Some("master".into()), Master, args)
            .await
            .map_err(|e| NodeError::Start(format!("master: {e}")))?;
        let handle = call!(actor, MasterMsg::Handle)
            .map_err(|e| NodeError::Start(format!("master: {e}")))?;
        master = Some((actor, handle));
    }

    let mut storage: Option<storage_node::MountedNode> = None;
    if role.has_storage() {
        let master_addr = match &master {
            Some((_, h)) => h.addr().to_string(),
            None => cfg.storage.master.clone(),
        };
        let opts = storage_node::MountOptions {
            master: master_addr,
            client: cfg.client_config(),
            key: key.clone(),
            skew_ms: cfg.security.clock_skew_ms,
            deadline: MOUNT_DEADLINE,
            actor_name: Some("storage".into()),
        };
        let node =
            storage_node::start_mounted(&shards, &cfg.storage, &opts, &metrics, shutdown.clone())
                .await?;
        storage = Some(node);
    }

    let http_addr = match role {
        Role::Storage => &cfg.storage.http,
        _ => &cfg.master.http,
    };
    let http_bound = http::serve(
        http_addr,
        HttpState {
            metrics: metrics.clone(),
            master: master.as_ref().map(|(_, h)| h.clone()),
            shards: shards.clone(),
            secret: cfg.security.secret.clone(),
        },
        shutdown.clone(),
    )
    .await?;
    // Ready: every listener is up. The HTTP line comes first, so a script
    // that waits for the role's line has seen it too.
    println!("kvpool http listening on {http_bound}");
    if let Some((_, h)) = &master {
        println!("kvpool master listening on {}", h.addr());
    }
    if let Some(node) = &storage {
        println!("kvpool storage listening on {}", node.addr());
    }
    if role == Role::All {
        let (_, h) = master.as_ref().expect("role all runs a master");
        println!("kvpool all listening on {}", h.addr());
    }

    tokio::select! {
        sig = kvpool_runtime::wait_for_signal() => {
            let sig = sig?;
            tracing::info!("{sig}: shutting down");
        }
        _ = shutdown.wait() => {}
    }

    if let Some(node) = storage {
        node.leave().await;
    }
    shutdown.trigger();
    if let Some((actor, _)) = master {
        actor.stop(None);
    }
    Ok(())
}
