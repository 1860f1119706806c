//! The HTTP side of every role: `GET /healthz` (answered only when every
//! shard answers), `GET /metrics` (Prometheus text), and the master's admin
//! routes. With a cluster secret, routes that change state need
//! `Authorization: Bearer <secret>`.

use std::net::SocketAddr;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::Shutdown;
use kvpool_wire::proto::call::{self, Call};
use kvpool_wire::proto::{ReplicaDesc, Tier};
use kvpool_wire::{ErrorCode, KvError};
use serde_json::{json, Value};

use kvpool_config::NodeError;
use kvpool_master::{FenceRole, MasterHandle};

#[derive(Clone)]
pub struct HttpState {
    pub metrics: MetricsRegistry,
    pub master: Option<MasterHandle>,
    /// The process's shards: `/healthz` asks each of them.
    pub shards: kvpool_runtime::ShardHandle,
    /// The cluster secret ("" = open): writing admin routes need it.
    pub secret: String,
    /// The listener's limits (`[runtime] http_*`).
    pub limits: kvpool_http::HttpLimits,
}

/// How long `/healthz` waits for each shard.
const HEALTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Refusals of the admin routes, logged at most once a second.
static ADMIN_REFUSALS: std::sync::Mutex<(Option<std::time::Instant>, u64)> =
    std::sync::Mutex::new((None, 0));

/// With a secret: the request must carry `Authorization: Bearer <secret>`.
fn authorize(st: &HttpState, headers: &HeaderMap, route: &str) -> Result<(), KvError> {
    if st.secret.is_empty() {
        return Ok(());
    }
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if kvpool_wire::auth::constant_time_eq(given.as_bytes(), st.secret.as_bytes()) {
        return Ok(());
    }
    {
        let mut r = ADMIN_REFUSALS.lock().unwrap_or_else(|p| p.into_inner());
        r.1 += 1;
        let now = std::time::Instant::now();
        if r.0
            .is_none_or(|t| now.duration_since(t) >= std::time::Duration::from_secs(1))
        {
            tracing::warn!(
                route,
                refused = r.1,
                "admin HTTP: refused a request without the cluster secret"
            );
            *r = (Some(now), 0);
        }
    }
    Err(KvError::new(
        ErrorCode::Unauthenticated,
        "this route needs the cluster secret: Authorization: Bearer <secret>",
    ))
}

/// Binds `addr` and serves until `shutdown`; returns the bound address.
pub async fn serve(
    addr: &str,
    state: HttpState,
    shutdown: Shutdown,
) -> Result<SocketAddr, NodeError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| NodeError::Start(format!("cannot serve HTTP on {addr}: {e}")))?;
    let bound = listener.local_addr()?;
    let limits = state.limits;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/api/v1/keys/{key}", get(describe_key))
        .route("/api/v1/segments", get(segments))
        .route("/get_all_segments", get(all_segment_names))
        .route("/api/v1/remove_all", post(remove_all))
        .with_state(state);
    tokio::spawn(kvpool_http::serve(listener, app, limits, async move {
        shutdown.wait().await
    }));
    Ok(bound)
}

/// `ok` only when every shard (and, with a master, every master shard's
/// inbox) answers within a deadline; 503 naming the one that did not.
async fn healthz(State(st): State<HttpState>) -> Response {
    for i in 0..st.shards.nr_shards() {
        let probe = st.shards.run_on(i, |_| async {});
        match tokio::time::timeout(HEALTH_TIMEOUT, probe).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return unhealthy(format!("shard {i}: {e}")),
            Err(_) => {
                return unhealthy(format!(
                    "shard {i} did not answer within {HEALTH_TIMEOUT:?}"
                ))
            }
        }
    }
    if let Some(m) = &st.master {
        if let Err(e) = tokio::time::timeout(HEALTH_TIMEOUT, m.probe())
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "the master did not answer within {HEALTH_TIMEOUT:?}"
                ))
            })
        {
            return unhealthy(e);
        }
        // A master in an election says its role; a deposed one is unhealthy
        // (it refuses everything until restarted).
        match master_role(m.fence(), &m.ship_status()) {
            Some(Ok(text)) => return (StatusCode::OK, text).into_response(),
            Some(Err(why)) => return unhealthy(why),
            None => {}
        }
    }
    (StatusCode::OK, "ok\n").into_response()
}

/// `1,0,2`: one figure per master shard (log shipping's state in /healthz).
/// What `/healthz` says of a master in an election (`None` for a single
/// master): its role, or why it cannot serve. A leader whose lease deadline
/// has passed is not called leader, even before its election task deposes
/// it: a leader stopped (SIGSTOP) past its lease and resumed answers
/// `/healthz` before that task runs, and it refuses every request by then.
fn master_role(fence: &kvpool_master::Fence, ships: &[u32]) -> Option<Result<String, String>> {
    Some(match fence.role() {
        FenceRole::Single => return None,
        FenceRole::Leader if fence.remaining().is_zero() => Err(format!(
            "role=lapsed: this master's lease could not be renewed in time; it refuses every \
             request (the leader is {:?})",
            fence.leader()
        )),
        FenceRole::Leader => Ok(format!(
            "ok role=leader term={} standbys_in_sync={}\n",
            fence.term(),
            show_list(ships)
        )),
        FenceRole::Standby => Ok(format!(
            "ok role=standby leader={:?} synced={}\n",
            fence.leader(),
            show_list(ships)
        )),
        FenceRole::Deposed => Err(format!(
            "role=deposed: this master lost its lease; restart it (the leader is {:?})",
            fence.leader()
        )),
    })
}

fn show_list(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn unhealthy(why: String) -> Response {
    tracing::warn!("healthz: {why}");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("unhealthy: {why}\n"),
    )
        .into_response()
}

async fn metrics(State(st): State<HttpState>) -> Response {
    if let Some(m) = &st.master {
        let t = std::time::Duration::from_secs(2);
        match tokio::time::timeout(t, m.refresh_gauges()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("metrics: pool gauges not refreshed: {e}"),
            Err(_) => tracing::warn!("metrics: pool gauges not refreshed within {t:?}"),
        }
    }
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

/// Deadline of one admin call.
const ADMIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn error_response(e: &KvError) -> Response {
    let status = match e.code {
        ErrorCode::ObjectNotFound | ErrorCode::SegmentNotFound => StatusCode::NOT_FOUND,
        ErrorCode::InvalidParams => StatusCode::BAD_REQUEST,
        ErrorCode::Timeout => StatusCode::GATEWAY_TIMEOUT,
        ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (
        status,
        Json(json!({"error": e.code.name(), "code": e.code.code(), "message": e.message})),
    )
        .into_response()
}

/// Runs a master call for an admin route (404 when this role has no master).
async fn admin_call<C: Call>(st: &HttpState, req: C) -> Result<C::Reply, Response> {
    let Some(m) = &st.master else {
        return Err((StatusCode::NOT_FOUND, "this role has no master\n").into_response());
    };
    match tokio::time::timeout(ADMIN_TIMEOUT, m.call(req)).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(error_response(&e)),
        Err(_) => Err(error_response(&KvError::new(
            ErrorCode::Timeout,
            format!("the master did not answer within {ADMIN_TIMEOUT:?}"),
        ))),
    }
}

fn replica_json(r: &ReplicaDesc) -> Value {
    json!({
        "segment_id": format!("{:016x}", r.segment_id),
        "endpoint": r.endpoint.shard_addr(r.data_shard()),
        "host_id": r.host_id,
        "offset": r.offset,
        "len": r.len,
        "tier": match r.tier { Tier::Dram => "dram", Tier::Nvme => "nvme" },
    })
}

/// `GET /api/v1/keys/{key}`: replicas, state, lease and pins of one object
/// (with a secret, for its holders only: segment ids, offsets and endpoints
/// are what a forged data-plane request needs).
async fn describe_key(
    State(st): State<HttpState>,
    headers: HeaderMap,
    Path(key): Path<String>,
) -> Response {
    if let Err(e) = authorize(&st, &headers, "/api/v1/keys") {
        return error_response(&e);
    }
    let req = call::Describe {
        key: key.into_bytes(),
    };
    match admin_call(&st, req).await {
        Ok(i) => Json(json!({
            "key": String::from_utf8_lossy(&i.key),
            "state": if i.complete { "complete" } else { "processing" },
            "size": i.size,
            "replicas": i.replicas.iter().map(replica_json).collect::<Vec<_>>(),
            "lease_remaining_ms": i.lease_remaining_ms,
            "soft_pin_remaining_ms": i.soft_pin_remaining_ms,
            "hard_pin": i.hard_pin,
        }))
        .into_response(),
        Err(r) => r,
    }
}

/// `GET /api/v1/segments`: every mounted segment with its use (with a
/// secret, for its holders only).
async fn segments(State(st): State<HttpState>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&st, &headers, "/api/v1/segments") {
        return error_response(&e);
    }
    match admin_call(&st, call::Stat).await {
        Ok(s) => Json(json!({
            "segments": s.segments.iter().map(|g| json!({
                "id": format!("{:016x}", g.id),
                "name": g.name,
                "endpoint": g.endpoint.shard_addr(0),
                "shards": g.endpoint.nr_shards,
                "host_id": g.host_id,
                "capacity": g.capacity,
                "used": g.used,
                "draining": g.draining,
            })).collect::<Vec<_>>(),
            "capacity": s.capacity,
            "used": s.used,
            "keys": s.keys,
            "evictions": s.evictions,
            "evicted_bytes": s.evicted_bytes,
        }))
        .into_response(),
        Err(r) => r,
    }
}

/// `GET /get_all_segments`: the mounted segments' names, one per line, as
/// Mooncake's master answers it (SGLang's `check_server` waits for a
/// non-empty answer before it uses the store); with a secret, for its
/// holders only.
async fn all_segment_names(State(st): State<HttpState>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&st, &headers, "/get_all_segments") {
        return error_response(&e);
    }
    match admin_call(&st, call::Stat).await {
        Ok(s) => {
            let names: String = s.segments.iter().map(|g| format!("{}\n", g.name)).collect();
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], names).into_response()
        }
        Err(r) => r,
    }
}

/// `POST /api/v1/remove_all`: removes every object without a live lease.
async fn remove_all(State(st): State<HttpState>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&st, &headers, "/api/v1/remove_all") {
        return error_response(&e);
    }
    match admin_call(&st, call::RemoveAll { force: false }).await {
        Ok(n) => Json(json!({ "removed": n })).into_response(),
        Err(r) => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_leader_past_its_lease_deadline_is_never_reported_leader() {
        let f = kvpool_master::Fence::standby();
        assert!(master_role(&f, &[])
            .unwrap()
            .unwrap()
            .starts_with("ok role=standby"));
        f.lead(7, Instant::now() + Duration::from_secs(60), "me:1");
        let ok = master_role(&f, &[1]).unwrap().unwrap();
        assert!(ok.starts_with("ok role=leader term=7"), "{ok}");
        // Stopped past its lease and resumed: still `Leader` until its
        // election task runs, but its deadline has passed.
        f.lead(8, Instant::now() - Duration::from_millis(1), "me:1");
        let why = master_role(&f, &[1]).unwrap().unwrap_err();
        assert!(why.starts_with("role=lapsed"), "{why}");
        f.depose();
        assert!(master_role(&f, &[1])
            .unwrap()
            .unwrap_err()
            .starts_with("role=deposed"));
        assert!(master_role(&kvpool_master::Fence::single(), &[]).is_none());
    }
}
