//! The HTTP side of every role: `GET /healthz`, `GET /metrics` (Prometheus
//! text), and the master's admin routes.

use std::net::SocketAddr;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::Shutdown;
use kvpool_transport::proto::{MasterRequest, MasterResponse, ReplicaDesc, Tier};
use kvpool_transport::{ErrorCode, KvError};
use serde_json::{json, Value};

use crate::master::MasterHandle;
use crate::NodeError;

#[derive(Clone)]
pub struct HttpState {
    pub metrics: MetricsRegistry,
    pub master: Option<MasterHandle>,
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
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/api/v1/keys/{key}", get(describe_key))
        .route("/api/v1/segments", get(segments))
        .route("/api/v1/remove_all", post(remove_all))
        .with_state(state);
    tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.wait().await })
            .await;
        if let Err(e) = r {
            tracing::error!("HTTP server failed: {e}");
        }
    });
    Ok(bound)
}

async fn healthz() -> &'static str {
    "ok\n"
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
async fn admin_call(st: &HttpState, req: MasterRequest) -> Result<MasterResponse, Response> {
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

/// `GET /api/v1/keys/{key}`: replicas, state, lease and pins of one object.
async fn describe_key(State(st): State<HttpState>, Path(key): Path<String>) -> Response {
    let req = MasterRequest::Describe {
        key: key.into_bytes(),
    };
    match admin_call(&st, req).await {
        Ok(MasterResponse::Described(i)) => Json(json!({
            "key": String::from_utf8_lossy(&i.key),
            "state": if i.complete { "complete" } else { "processing" },
            "size": i.size,
            "replicas": i.replicas.iter().map(replica_json).collect::<Vec<_>>(),
            "lease_remaining_ms": i.lease_remaining_ms,
            "soft_pin_remaining_ms": i.soft_pin_remaining_ms,
            "hard_pin": i.hard_pin,
        }))
        .into_response(),
        Ok(other) => error_response(&KvError::new(
            ErrorCode::Internal,
            format!("unexpected answer {other:?}"),
        )),
        Err(r) => r,
    }
}

/// `GET /api/v1/segments`: every mounted segment with its use.
async fn segments(State(st): State<HttpState>) -> Response {
    match admin_call(&st, MasterRequest::Stat).await {
        Ok(MasterResponse::Stat(s)) => Json(json!({
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
        Ok(other) => error_response(&KvError::new(
            ErrorCode::Internal,
            format!("unexpected answer {other:?}"),
        )),
        Err(r) => r,
    }
}

/// `POST /api/v1/remove_all`: removes every object without a live lease.
async fn remove_all(State(st): State<HttpState>) -> Response {
    match admin_call(&st, MasterRequest::RemoveAll).await {
        Ok(MasterResponse::Removed(n)) => Json(json!({ "removed": n })).into_response(),
        Ok(other) => error_response(&KvError::new(
            ErrorCode::Internal,
            format!("unexpected answer {other:?}"),
        )),
        Err(r) => r,
    }
}
