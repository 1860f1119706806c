//! One kvpool process: starts the shards, the tokio runtime and the roles it
//! was asked for; prints `kvpool <role> listening on HOST:PORT` when each is
//! ready; on SIGINT/SIGTERM unmounts its segment, lets in-flight requests
//! finish (or fail) within the drain deadline, and returns.

use std::time::Duration;

use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardHandle, ShardPool, Shutdown};
use kvpool_transport::ErrorCode;
use ractor::{call, Actor, ActorRef};

use crate::http::{self, HttpState};
use kvpool_client::Client;
use kvpool_config::NodeConfig;
use kvpool_config::NodeError;
use kvpool_master::{Master, MasterArgs, MasterHandle, MasterMsg};
use kvpool_storage_node::{self as storage_node, StorageNode, StorageNodeArgs, StorageNodeMsg};

/// Which roles a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Master and one storage node in one process.
    All,
    Master,
    Storage,
    /// A pool client and the RESP front only (`[resp]`, `--master`).
    Gateway,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::All => "all",
            Role::Master => "master",
            Role::Storage => "storage",
            Role::Gateway => "gateway",
        }
    }

    fn has_master(self) -> bool {
        matches!(self, Role::All | Role::Master)
    }

    fn has_storage(self) -> bool {
        matches!(self, Role::All | Role::Storage)
    }

    /// Roles with a pool client of their own may serve RESP.
    fn may_serve_resp(self) -> bool {
        matches!(self, Role::All | Role::Storage | Role::Gateway)
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
    if let Some(l) = cfg.resp.listen_addr(role == Role::Gateway) {
        if role.may_serve_resp()
            && cfg.resp.requirepass.is_empty()
            && !kvpool_config::is_loopback(&l)
        {
            let msg = format!(
                "THE RESP FRONT IS OPEN: it listens on {l} without a password \
                 (resp.protected_mode = false). Anyone who can reach it can read, write and \
                 FLUSHALL the pool. Set resp.requirepass."
            );
            eprintln!("kvpool: WARNING: {msg}");
            tracing::warn!("{msg}");
        }
    }
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

    let mut storage: Option<ActorRef<StorageNodeMsg>> = None;
    let mut storage_addr = None;
    let mut nvme: Option<(kvpool_client::Client, kvpool_transport::proto::SegmentId)> = None;
    if role.has_storage() {
        let svc = storage_node::start(
            &shards,
            &cfg.storage,
            key.clone(),
            cfg.security.clock_skew_ms,
            &metrics,
        )
        .await?;
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
            nvme: svc.nvme.clone(),
            ping_interval: Duration::from_millis(cfg.storage.ping_interval_ms),
            mount_deadline: MOUNT_DEADLINE,
        };
        let node_client = args.client.clone();
        // The actor mounts the segment and the tier (reporting what
        // survived on it) before it counts as started.
        let (actor, _) = Actor::spawn(Some("storage".into()), StorageNode, args)
            .await
            .map_err(|e| NodeError::Start(format!("storage: {e}")))?;
        if let Some(tier) = &svc.nvme {
            tier.clone()
                .spawn_loop(node_client.clone(), shutdown.clone());
            nvme = Some((node_client, tier.segment_id));
        }
        storage_addr = Some(svc.addr);
        storage = Some(actor);
    }

    let mut resp = None;
    if let Some(listen) = cfg
        .resp
        .listen_addr(role == Role::Gateway)
        .filter(|_| role.may_serve_resp())
    {
        let master_addr = match (&master, role) {
            (Some((_, h)), _) => h.addr().to_string(),
            (None, Role::Gateway) => cfg.resp.master.clone(),
            (None, _) => cfg.storage.master.clone(),
        };
        let threads = match cfg.resp.threads {
            0 => shards.nr_shards(),
            n => n,
        };
        let server = kvpool_resp::start(kvpool_resp::RespOptions {
            cfg: cfg.resp.clone(),
            listen,
            master: master_addr,
            client: cfg.client_config(),
            threads,
            metrics: metrics.clone(),
            shutdown: shutdown.clone(),
        })
        .await
        .map_err(|e| NodeError::Start(e.to_string()))?;
        resp = Some(server);
    }

    let http_addr = match role {
        Role::Storage => &cfg.storage.http,
        Role::Gateway => &cfg.resp.http,
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
    if let Some(a) = storage_addr {
        println!("kvpool storage listening on {a}");
    }
    if let Some(r) = &resp {
        println!("kvpool resp listening on {}", r.addr());
        if role == Role::Gateway {
            println!("kvpool gateway listening on {}", r.addr());
        }
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
    if let Some(r) = resp {
        // Its threads see the signal, close their connections and end.
        let _ = tokio::task::spawn_blocking(move || r.join(Duration::from_secs(2))).await;
    }
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
        match Client::connect_as(master, cfg.client_config(), id, host_id.to_string()).await {
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
