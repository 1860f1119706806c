//! The serving roles as processes: `kvpool run --role conductor`, `--role
//! prefill-proxy`, `--role decode-proxy`, and the serving half of role
//! `all` (started inside the pool's process, for two engines it runs).
//!
//! Each prints `kvpool <role> listening on HOST:PORT` once it serves, and
//! stops on SIGINT/SIGTERM (or the process's shutdown signal).

use std::net::SocketAddr;

use axum::Router;
use kvpool_config::{NodeConfig, ProxyConfig};
use kvpool_http::{self as http, HttpLimits};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::Shutdown;

use crate::front::{Front, FrontOptions};
use crate::proxy::{self, ProxyHandle, ProxyRole};
use crate::ServeError;

/// Binds `addr` and serves `app` on it until `shutdown`; returns the bound
/// address.
pub async fn serve_http(
    addr: &str,
    what: &str,
    app: Router,
    limits: HttpLimits,
    shutdown: Shutdown,
) -> Result<SocketAddr, ServeError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| ServeError::Start(format!("{what}: cannot listen on {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| ServeError::Start(format!("{what}: {e}")))?;
    let what = what.to_string();
    tokio::spawn(async move {
        http::serve(listener, app, limits, async move { shutdown.wait().await }).await;
        tracing::debug!("{what}: HTTP server stopped");
    });
    Ok(bound)
}

fn runtime(cfg: &NodeConfig, name: &str) -> Result<tokio::runtime::Runtime, ServeError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.runtime.actor_threads.max(1))
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| ServeError::Start(format!("cannot start the runtime: {e}")))
}

/// Prints a role's ready line (stdout, flushed: scripts wait for it).
pub fn ready(role: &str, addr: impl std::fmt::Display) {
    use std::io::Write;
    println!("kvpool {role} listening on {addr}");
    let _ = std::io::stdout().flush();
}

/// Waits for SIGINT/SIGTERM or `shutdown`, then triggers `shutdown`.
async fn wait_then_stop(role: &str, shutdown: &Shutdown) {
    tokio::select! {
        sig = kvpool_runtime::wait_for_signal() => match sig {
            Ok(sig) => tracing::info!("{sig}: stopping the {role}"),
            Err(e) => tracing::error!("cannot wait for signals: {e}"),
        },
        _ = shutdown.wait() => {}
    }
    shutdown.trigger();
}

/// Starts a proxy actor for `cfg` and serves its HTTP routes on
/// `cfg.listen`; returns the handle and the bound address.
pub async fn start_proxy(
    role: ProxyRole,
    cfg: ProxyConfig,
    limits: HttpLimits,
    registry: &MetricsRegistry,
    shutdown: Shutdown,
) -> Result<(ProxyHandle, SocketAddr), ServeError> {
    let listen = cfg.listen.clone();
    let body = cfg.max_body_bytes.get() as usize;
    let (handle, _join) = ProxyHandle::spawn(role, cfg, registry)
        .await
        .map_err(|e| ServeError::Start(e.to_string()))?;
    let app = proxy::router(handle.clone(), registry.clone(), body);
    let what = format!("{}-proxy", role.as_str());
    let bound = serve_http(&listen, &what, app, limits, shutdown).await?;
    Ok((handle, bound))
}

/// `kvpool run --role prefill-proxy` / `decode-proxy`: the proxy in front
/// of `serving.<role>_proxy.engine`, on `serving.<role>_proxy.listen`.
pub fn run_proxy(role: ProxyRole, cfg: NodeConfig, shutdown: Shutdown) -> Result<(), ServeError> {
    cfg.validate().map_err(ServeError::Config)?;
    let pcfg = match role {
        ProxyRole::Prefill => cfg.serving.prefill_proxy.clone(),
        ProxyRole::Decode => cfg.serving.decode_proxy.clone(),
    };
    let name = format!("{}-proxy", role.as_str());
    let rt = runtime(&cfg, "kvpool-proxy")?;
    let r = rt.block_on(async {
        let registry = MetricsRegistry::new();
        let (handle, bound) = start_proxy(
            role,
            pcfg.clone(),
            cfg.runtime.http_limits(),
            &registry,
            shutdown.clone(),
        )
        .await?;
        tracing::info!("{name} in front of the engine at {}", pcfg.engine);
        ready(&name, bound);
        wait_then_stop(&name, &shutdown).await;
        handle.stop();
        Ok(())
    });
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    r
}

/// The front's options from the config file.
pub fn front_options(cfg: &NodeConfig) -> FrontOptions {
    let c = &cfg.serving.conductor;
    FrontOptions {
        cfg: c.clone(),
        prefill: c.prefill.clone(),
        decode: c.decode.clone(),
        pool: (!c.pool.is_empty()).then(|| c.pool.clone()),
        client: cfg.client_config(),
        chunk_tokens: cfg.engine.chunk_tokens,
        http: cfg.runtime.http_limits(),
        api_key: cfg.serving.api_key.clone(),
    }
}

/// Starts the front with `opts` and serves it on `opts.cfg.listen`.
pub async fn start_front(
    opts: FrontOptions,
    registry: &MetricsRegistry,
    shutdown: Shutdown,
) -> Result<(Front, SocketAddr), ServeError> {
    let listen = opts.cfg.listen.clone();
    let http = opts.http;
    let front = Front::start(opts, registry, shutdown.clone()).await?;
    let bound = serve_http(&listen, "conductor", front.router(), http, shutdown).await?;
    Ok((front, bound))
}

/// `kvpool run --role conductor`: the OpenAI-compatible front and the live
/// scheduler on `serving.conductor.listen`, in front of the proxies named
/// by `serving.conductor.prefill` / `.decode`, with the pool at
/// `serving.conductor.pool`.
pub fn run_conductor(cfg: NodeConfig, shutdown: Shutdown) -> Result<(), ServeError> {
    cfg.validate().map_err(ServeError::Config)?;
    let rt = runtime(&cfg, "kvpool-conductor")?;
    let r = rt.block_on(async {
        let registry = MetricsRegistry::new();
        let (front, bound) = start_front(front_options(&cfg), &registry, shutdown.clone()).await?;
        ready("conductor", bound);
        wait_then_stop("conductor", &shutdown).await;
        front.conductor().stop();
        Ok(())
    });
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    r
}

/// `host:0` for an address, when `ephemeral`: role all on `--listen
/// HOST:0` puts every listener on a free port.
pub fn maybe_ephemeral(addr: &str, ephemeral: bool) -> String {
    if !ephemeral {
        return addr.to_string();
    }
    match addr.rsplit_once(':') {
        Some((host, _)) => format!("{host}:0"),
        None => format!("{addr}:0"),
    }
}

/// Role all's serving half, in the running process: a prefill and a decode
/// proxy in front of the engines at `prefill_engine` and `decode_engine`,
/// and the front for them with the pool at `master`. Returns the ready
/// lines to print (proxies, then the conductor).
pub async fn start_all(
    cfg: &NodeConfig,
    master: &str,
    prefill_engine: &str,
    decode_engine: &str,
    ephemeral: bool,
    shutdown: Shutdown,
) -> Result<Vec<String>, ServeError> {
    let mut lines = Vec::new();
    let proxy_addr = |role, base: &ProxyConfig, engine: &str| {
        let mut p = base.clone();
        p.engine = engine.to_string();
        p.listen = maybe_ephemeral(&p.listen, ephemeral);
        (role, p)
    };
    let proxies = [
        proxy_addr(
            ProxyRole::Prefill,
            &cfg.serving.prefill_proxy,
            prefill_engine,
        ),
        proxy_addr(ProxyRole::Decode, &cfg.serving.decode_proxy, decode_engine),
    ];
    let mut bound = Vec::new();
    for (role, p) in proxies {
        // Each part its own registry: each serves its own /metrics.
        let registry = MetricsRegistry::new();
        let limits = cfg.runtime.http_limits();
        let (_, addr) = start_proxy(role, p, limits, &registry, shutdown.clone()).await?;
        lines.push(format!(
            "kvpool {}-proxy listening on {addr}",
            role.as_str()
        ));
        bound.push(addr.to_string());
    }
    let mut opts = front_options(cfg);
    opts.cfg.listen = maybe_ephemeral(&opts.cfg.listen, ephemeral);
    opts.prefill = vec![bound[0].clone()];
    opts.decode = vec![bound[1].clone()];
    opts.pool = Some(master.to_string());
    let (_front, addr) = start_front(opts, &MetricsRegistry::new(), shutdown).await?;
    lines.push(format!("kvpool conductor listening on {addr}"));
    Ok(lines)
}
