//! One kvpool process: starts the shards, the tokio runtime and the roles it
//! was asked for; prints `kvpool <role> listening on HOST:PORT` when each is
//! ready; on SIGINT/SIGTERM unmounts its segment, lets in-flight requests
//! finish (or fail) within the drain deadline, and returns.

use std::time::Duration;

use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardHandle, ShardPool, Shutdown};
use kvpool_transport::ErrorCode;
use ractor::{call, Actor, ActorRef};

use crate::client::Client;
use crate::config::NodeConfig;
use crate::http::{self, HttpState};
use crate::master::{Master, MasterArgs, MasterHandle, MasterMsg};
use crate::storage_node::{self, StorageNode, StorageNodeArgs, StorageNodeMsg};
use crate::NodeError;

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

async fn run_roles(
    role: Role,
    cfg: &NodeConfig,
    shards: ShardHandle,
    shutdown: Shutdown,
) -> Result<(), NodeError> {
    let metrics = MetricsRegistry::new();
    let mut master: Option<(ActorRef<MasterMsg>, MasterHandle)> = None;
    if role.has_master() {
        let args = MasterArgs {
            shards: shards.clone(),
            config: cfg.master.clone(),
            metrics: metrics.clone(),
        };
        let (actor, _) = Actor::spawn(Some("master".into()), Master, args)
            .await
            .map_err(|e| NodeError::Start(format!("master: {e}")))?;
        let handle = call!(actor, MasterMsg::Handle)
            .map_err(|e| NodeError::Start(format!("master: {e}")))?;
        master = Some((actor, handle));
    }

    let mut storage: Option<ActorRef<StorageNodeMsg>> = None;
    let mut storage_addr = None;
    let mut nvme: Option<(crate::client::Client, kvpool_transport::proto::SegmentId)> = None;
    if role.has_storage() {
        let svc = storage_node::start(&shards, &cfg.storage, &metrics).await?;
        if cfg.storage.shm {
            storage_node::spawn_shm_server(&svc, shutdown.clone())?;
        }
        let master_addr = match &master {
            Some((_, h)) => h.addr().to_string(),
            None => cfg.storage.master.clone(),
        };
        let client = connect_with_retry(&master_addr, cfg, &svc.spec.host_id).await?;
        let args = StorageNodeArgs {
            client,
            spec: svc.spec.clone(),
            ping_interval: Duration::from_millis(cfg.storage.ping_interval_ms),
            mount_deadline: MOUNT_DEADLINE,
        };
        let node_client = args.client.clone();
        let (actor, _) = Actor::spawn(Some("storage".into()), StorageNode, args)
            .await
            .map_err(|e| NodeError::Start(format!("storage: {e}")))?;
        if let Some(tier) = &svc.nvme {
            // The tier is mounted (or mounted again, after a restart), what
            // survived on it is reported back, then its work loop starts.
            node_client
                .mount_segment(tier.spec.clone())
                .await
                .map_err(|e| NodeError::Start(format!("NVMe tier: {e}")))?;
            tier.report_recovered(&node_client)
                .await
                .map_err(|e| NodeError::Start(format!("NVMe tier: {e}")))?;
            tier.clone()
                .spawn_loop(node_client.clone(), shutdown.clone());
            nvme = Some((node_client, tier.segment_id));
        }
        storage_addr = Some(svc.addr);
        storage = Some(actor);
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
    if let Some(a) = storage_addr {
        println!("kvpool storage listening on {a}");
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
        // Leave gracefully: the master stops placing data here at once.
        let r = call!(node, StorageNodeMsg::Unmount);
        match r {
            Ok(Ok(())) => tracing::info!("segment unmounted"),
            Ok(Err(e)) => tracing::warn!("unmount at the master failed: {e}"),
            Err(e) => tracing::warn!("unmount did not complete: {e}"),
        }
        node.stop(None);
    }
    if let Some((client, id)) = nvme {
        // Its objects come back when the node restarts on the same path.
        if let Err(e) = client.unmount_segment(id).await {
            tracing::warn!("NVMe tier unmount failed: {e}");
        }
    }
    shutdown.trigger();
    if let Some((actor, _)) = master {
        actor.stop(None);
    }
    Ok(())
}

async fn connect_with_retry(
    master: &str,
    cfg: &NodeConfig,
    host_id: &str,
) -> Result<Client, NodeError> {
    let deadline = tokio::time::Instant::now() + MOUNT_DEADLINE;
    let id = rand::random::<u64>().max(1);
    loop {
        match Client::connect_as(master, cfg.client.clone(), id, host_id.to_string()).await {
            Ok(c) => return Ok(c),
            Err(e)
                if tokio::time::Instant::now() < deadline
                    && matches!(e.code, ErrorCode::Unavailable | ErrorCode::Timeout) =>
            {
                tracing::warn!("master {master} not reachable yet, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                return Err(NodeError::Start(format!(
                    "cannot reach the master at {master}: {e}"
                )))
            }
        }
    }
}
