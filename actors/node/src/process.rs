//! One kvpool process: starts the shards, the tokio runtime and the roles it
//! was asked for; prints `kvpool <role> listening on HOST:PORT` when each is
//! ready; on SIGINT/SIGTERM unmounts its segment, lets in-flight requests
//! finish (or fail) within the drain deadline, and returns.

use std::time::Duration;

use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardHandle, ShardPool, Shutdown};
use ractor::{call, Actor, ActorRef};

use crate::http::{self, HttpState};
use kvpool_config::NodeError;
use kvpool_config::{NodeConfig, Role};
use kvpool_master::{Master, MasterArgs, MasterHandle, MasterMsg};
use kvpool_storage_node as storage_node;

/// How long a storage node keeps trying to reach the master at start.
const MOUNT_DEADLINE: Duration = Duration::from_secs(30);

/// Role all's serving path, run inside the pool's process (see
/// `start_serving`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Serving {
    /// Every serving listener on a free port (role all on `--listen
    /// HOST:0`).
    pub ephemeral: bool,
}

/// Runs `role` until SIGINT or SIGTERM (or `shutdown`), then stops cleanly.
pub fn run(role: Role, cfg: NodeConfig, shutdown: Shutdown) -> Result<(), NodeError> {
    run_with(role, cfg, shutdown, None)
}

/// [`run`], with role all's serving path started once the pool serves.
pub fn run_with(
    role: Role,
    cfg: NodeConfig,
    shutdown: Shutdown,
    serving: Option<Serving>,
) -> Result<(), NodeError> {
    if !role.is_pool() {
        return Err(NodeError::Start(format!(
            "role {role} is not run by the pool process (all, master, storage, gateway)"
        )));
    }
    cfg.validate().map_err(NodeError::Config)?;
    let pool = ShardPool::start(&cfg.runtime.shard_pool(), shutdown.clone())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.runtime.actor_threads)
        .thread_name("kvpool-actor")
        .enable_all()
        .build()?;
    let res = rt.block_on(run_roles(
        role,
        &cfg,
        pool.handle(),
        shutdown.clone(),
        serving,
    ));
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
        // Only a front that will start (check_exposure lets it) with no
        // password beyond loopback; the others refuse to start, saying why.
        let starts = cfg
            .resp
            .check_exposure(&l, !cfg.security.secret.is_empty())
            .is_ok();
        if role.may_serve_resp()
            && starts
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
    let wide = cfg.wide_listens(role.runs_master(), role.runs_storage());
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

/// The master address this process's own roles use when it runs a master:
/// its own, or with HA the etcd URL (so they follow whichever master leads).
fn own_master(
    cfg: &NodeConfig,
    master: &Option<(ActorRef<MasterMsg>, MasterHandle)>,
) -> Option<String> {
    let (_, h) = master.as_ref()?;
    Some(if cfg.master.ha.is_empty() {
        h.addr().to_string()
    } else {
        cfg.master.ha.clone()
    })
}

/// Campaigns for this master on etcd (`master.ha`): it refuses requests as
/// a standby until it leads. The addresses it publishes are its RPC address
/// (the host name when it listens on every interface) and `master.http` as
/// configured.
fn start_election(
    cfg: &NodeConfig,
    handle: &MasterHandle,
    shutdown: Shutdown,
) -> Result<(), NodeError> {
    let url = kvpool_ha::EtcdUrl::parse(&cfg.master.ha)
        .map_err(|e| NodeError::Config(format!("key `master.ha`: {e}")))?;
    let addr = handle.addr();
    let rpc = if addr.ip().is_unspecified() {
        format!("{}:{}", kvpool_client::local_host_id(), addr.port())
    } else {
        addr.to_string()
    };
    let election = kvpool_ha::ElectionConfig {
        url,
        id: master_identity(&cfg.master.state_dir)?,
        ttl: Duration::from_secs(cfg.master.ha_lease_ttl_s),
        margin: Duration::from_millis(cfg.master.ha_fence_margin_ms),
        me: kvpool_ha::Published {
            rpc,
            http: cfg.master.http.clone(),
        },
    };
    kvpool_ha::spawn_election(handle.clone(), election, shutdown);
    Ok(())
}

/// This master's identity in the election's state key: kept in
/// `<state_dir>/master-id` (made on first use) so a restart on the same
/// directory is the same master; random without a state directory.
fn master_identity(state_dir: &str) -> Result<String, NodeError> {
    let fresh = || {
        kvpool_wire::auth::nonce()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    if state_dir.is_empty() {
        return Ok(fresh());
    }
    let dir = std::path::Path::new(state_dir);
    let path = dir.join("master-id");
    let bad = |e: std::io::Error| {
        NodeError::Config(format!("key `master.state_dir`: {}: {e}", path.display()))
    };
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let id = s.trim();
            if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(NodeError::Config(format!(
                    "key `master.state_dir`: {} holds {s:?}, not a master identity (hex)",
                    path.display()
                )));
            }
            Ok(id.to_string())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).map_err(bad)?;
            let id = fresh();
            let tmp = dir.join("master-id.tmp");
            {
                use std::io::Write;
                let mut f = std::fs::File::create(&tmp).map_err(bad)?;
                f.write_all(format!("{id}\n").as_bytes()).map_err(bad)?;
                f.sync_all().map_err(bad)?;
            }
            std::fs::rename(&tmp, &path).map_err(bad)?;
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(bad)?;
            Ok(id)
        }
        Err(e) => Err(bad(e)),
    }
}

async fn run_roles(
    role: Role,
    cfg: &NodeConfig,
    shards: ShardHandle,
    shutdown: Shutdown,
    serving: Option<Serving>,
) -> Result<(), NodeError> {
    let metrics = MetricsRegistry::new();
    let key = cfg.cluster_key().map_err(NodeError::Config)?;
    warn_if_open(role, cfg);
    let mut master: Option<(ActorRef<MasterMsg>, MasterHandle)> = None;
    if role.runs_master() {
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
        if !cfg.master.ha.is_empty() {
            start_election(cfg, &handle, shutdown.clone())?;
        }
        master = Some((actor, handle));
    }

    let mut storage: Option<storage_node::MountedNode> = None;
    if role.runs_storage() {
        let master_addr = own_master(cfg, &master).unwrap_or_else(|| cfg.storage.master.clone());
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

    let mut resp = None;
    if let Some(listen) = cfg
        .resp
        .listen_addr(role == Role::Gateway)
        .filter(|_| role.may_serve_resp())
    {
        let master_addr = match (own_master(cfg, &master), role) {
            (Some(a), _) => a,
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
            limits: cfg.runtime.http_limits(),
        },
        shutdown.clone(),
    )
    .await?;
    let serving_lines = match serving {
        Some(Serving { ephemeral }) => {
            let master = own_master(cfg, &master).unwrap_or_else(|| cfg.storage.master.clone());
            start_serving(cfg, &master, ephemeral, shutdown.clone()).await?
        }
        None => Vec::new(),
    };
    // Ready: every listener is up. The HTTP and RESP lines come first, so a
    // script that waits for the role's line has seen them too.
    println!("kvpool http listening on {http_bound}");
    if let Some(r) = &resp {
        println!("kvpool resp listening on {}", r.addr());
    }
    if let Some((_, h)) = &master {
        println!("kvpool master listening on {}", h.addr());
    }
    if let Some(node) = &storage {
        println!("kvpool storage listening on {}", node.addr());
    }
    for line in serving_lines {
        println!("{line}");
    }
    if let (Some(r), Role::Gateway) = (&resp, role) {
        println!("kvpool gateway listening on {}", r.addr());
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
    if let Some(r) = resp {
        // Its threads see the signal, close their connections and end.
        let _ = tokio::task::spawn_blocking(move || r.join(Duration::from_secs(2))).await;
    }
    if let Some((actor, h)) = master {
        if h.fence().role() == kvpool_master::FenceRole::Leader {
            if let Ok(url) = kvpool_ha::EtcdUrl::parse(&cfg.master.ha) {
                // A standby takes over now instead of after the lease's TTL.
                h.fence().depose();
                let _ = tokio::time::timeout(Duration::from_secs(3), kvpool_ha::resign(&url)).await;
            }
        }
        actor.stop(None);
    }
    Ok(())
}

/// Role all's serving path, started inside the pool's process once the
/// master serves: two engines of `serving.model` (prefill and decode, on
/// `serving.prefill_proxy.engine` / `serving.decode_proxy.engine`), their
/// proxies, and the conductor's front, all using this process's pool.
/// Returns their ready lines (printed before `kvpool all listening on`).
async fn start_serving(
    cfg: &NodeConfig,
    master: &str,
    ephemeral: bool,
    shutdown: Shutdown,
) -> Result<Vec<String>, NodeError> {
    let err = |e: String| NodeError::Start(format!("serving: {e}"));
    let mut lines = Vec::new();
    let mut engines = Vec::new();
    // Both models load at once, off the runtime's threads.
    let loads: Vec<_> = (0..2)
        .map(|_| {
            let spec = cfg.serving.model.clone();
            tokio::task::spawn_blocking(move || kvpool_engine::loader::load(&spec))
        })
        .collect();
    let addrs = [
        ("prefill-engine", &cfg.serving.prefill_proxy.engine),
        ("decode-engine", &cfg.serving.decode_proxy.engine),
    ];
    for ((name, addr), load) in addrs.into_iter().zip(loads) {
        let model = load
            .await
            .map_err(|e| err(e.to_string()))?
            .map_err(|e| err(e.to_string()))?;
        let registry = kvpool_runtime::metrics::MetricsRegistry::new();
        let engine = kvpool_engine::serve::Engine::start(model, cfg, Some(master), &registry)
            .await
            .map_err(|e| err(e.to_string()))?;
        let listen = kvpool_serving::roles::maybe_ephemeral(addr, ephemeral);
        let bound = kvpool_serving::roles::serve_http(
            &listen,
            name,
            engine.router(registry),
            cfg.runtime.http_limits(),
            shutdown.clone(),
        )
        .await
        .map_err(|e| err(e.to_string()))?;
        lines.push(format!("kvpool {name} listening on {bound}"));
        engines.push(bound.to_string());
    }
    let more = kvpool_serving::roles::start_all(
        cfg,
        master,
        &engines[0],
        &engines[1],
        ephemeral,
        shutdown.clone(),
    )
    .await
    .map_err(|e| err(e.to_string()))?;
    lines.extend(more);
    Ok(lines)
}
