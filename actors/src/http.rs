//! The HTTP side of every role: `GET /healthz`, `GET /metrics` (Prometheus
//! text), and the master's admin routes.

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::Shutdown;

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
