//! A storage node started and mounted at a master, as one value.
//!
//! This is what `kvpool run --role storage` runs beside its HTTP side, and
//! what a process that gives its own DRAM to the pool runs inside itself
//! without a master or HTTP (the Python package's `global_segment_size`):
//!
//! ```text
//!  start_mounted: start (data plane on every shard) -> shm server
//!                 -> client to the master (retried until the deadline)
//!                 -> StorageNode actor (mounts the segment and tier, pings)
//!  leave:         Unmount at the master -> stop the actor -> unmount the tier
//! ```
//!
//! The caller owns the shards, the tokio runtime (the actor and the shm
//! server run on it) and the shutdown signal; `leave` does not trigger it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvpool_client::{Client, ClientConfig};
use kvpool_config::{NodeError, StorageConfig};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardHandle, Shutdown};
use kvpool_wire::auth::ClusterKey;
use kvpool_wire::proto::{SegmentId, SegmentSpec};
use kvpool_wire::ErrorCode;
use ractor::{call, Actor, ActorRef};

use crate::node::{self, StorageNode, StorageNodeArgs, StorageNodeMsg};

/// How a [`MountedNode`] reaches its master.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// The master's address (`host:port` of its shard 0).
    pub master: String,
    /// The node's own client (its secret included).
    pub client: ClientConfig,
    /// The cluster secret, keyed: data requests then need master grants.
    pub key: Option<ClusterKey>,
    /// How long after its expiry a grant is still accepted.
    pub skew_ms: u64,
    /// How long to keep trying to reach the master, and to mount, at start.
    pub deadline: Duration,
    /// The actor's registered name (`None`: unnamed; several nodes in one
    /// process must not share a name).
    pub actor_name: Option<String>,
}

/// A started, mounted storage node. Drop without [`MountedNode::leave`]
/// leaves the segment mounted until the master declares the node dead.
pub struct MountedNode {
    actor: ActorRef<StorageNodeMsg>,
    addr: SocketAddr,
    spec: SegmentSpec,
    /// The NVMe tier's segment, unmounted by its node's client on leave.
    nvme: Option<(Client, SegmentId)>,
    listening: Arc<kvpool_runtime::net::Listening>,
}

/// Starts a storage node on `shards` with `cfg` and mounts it at the master
/// of `opts`; returns once the segment (and its tier) are mounted.
pub async fn start_mounted(
    shards: &ShardHandle,
    cfg: &StorageConfig,
    opts: &MountOptions,
    metrics: &MetricsRegistry,
    shutdown: Shutdown,
) -> Result<MountedNode, NodeError> {
    let svc = node::start(shards, cfg, opts.key.clone(), opts.skew_ms, metrics).await?;
    if cfg.shm {
        node::spawn_shm_server(&svc, shutdown.clone())?;
    }
    let client = connect_with_retry(opts, &svc.spec.host_id).await?;
    let args = StorageNodeArgs {
        client: client.clone(),
        spec: svc.spec.clone(),
        nvme: svc.nvme.clone(),
        ping_interval: Duration::from_millis(cfg.ping_interval_ms),
        mount_deadline: opts.deadline,
    };
    // The actor mounts the segment and the tier (reporting what survived on
    // it) before it counts as started.
    let (actor, _) = Actor::spawn(opts.actor_name.clone(), StorageNode, args)
        .await
        .map_err(|e| NodeError::Start(format!("storage: {e}")))?;
    let nvme = svc.nvme.as_ref().map(|tier| {
        tier.clone().spawn_loop(client.clone(), shutdown.clone());
        (client.clone(), tier.segment_id)
    });
    if nvme.is_none() && client.cluster_map().hot_replicas >= 2 {
        // Hot-object replication is on: this node may be asked to fetch
        // extra replicas (a node with a tier runs them in the tier's loop).
        crate::fetch::FetchTarget {
            dram: svc.segment.clone(),
            dram_id: svc.segment_id,
            metrics: svc.metrics.clone(),
        }
        .spawn_loop(
            client.clone(),
            Duration::from_millis(cfg.nvme.task_poll_ms),
            shutdown.clone(),
        );
    }
    Ok(MountedNode {
        actor,
        addr: svc.addr,
        spec: svc.spec,
        nvme,
        listening: svc.listening,
    })
}

impl MountedNode {
    /// The data plane's base address (shard i on port + i).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its data listeners: [`Listening::stop`](kvpool_runtime::net::Listening::stop)
    /// them once the shards ended, to bind the same ports again at once.
    pub fn listening(&self) -> Arc<kvpool_runtime::net::Listening> {
        self.listening.clone()
    }

    /// What the node mounted.
    pub fn spec(&self) -> &SegmentSpec {
        &self.spec
    }

    /// Leaves gracefully: the master stops placing data here at once; the
    /// NVMe tier is unmounted (its objects come back when a node restarts
    /// on the same path). Failures are logged: the node goes either way.
    pub async fn leave(self) {
        match call!(self.actor, StorageNodeMsg::Unmount) {
            Ok(Ok(())) => tracing::info!("segment unmounted"),
            Ok(Err(e)) => tracing::warn!("unmount at the master failed: {e}"),
            Err(e) => tracing::warn!("unmount did not complete: {e}"),
        }
        self.actor.stop(None);
        if let Some((client, id)) = self.nvme {
            if let Err(e) = client.unmount_segment(id).await {
                tracing::warn!("NVMe tier unmount failed: {e}");
            }
        }
    }
}

async fn connect_with_retry(opts: &MountOptions, host_id: &str) -> Result<Client, NodeError> {
    let deadline = tokio::time::Instant::now() + opts.deadline;
    let id = rand::random::<u64>().max(1);
    let master = &opts.master;
    loop {
        match Client::connect_as(master, opts.client.clone(), id, host_id.to_string()).await {
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
