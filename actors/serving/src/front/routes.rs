//! The front's small routes: models, the tokenizer file, health, metrics, status.

use super::*;
use kvpool_http::openai::{Model, ModelList};

pub(super) async fn models(State(f): State<Front>, headers: HeaderMap) -> Response {
    if let Err(e) = check_api_key(&f, &headers) {
        return e.into_response();
    }
    let max_model_len = f.max_model_len();
    let mut names: Vec<String> = Vec::new();
    for l in f.inner.prefill.iter().chain(&f.inner.decode) {
        if let Some(m) = l
            .lock()
            .report
            .as_ref()
            .and_then(|r| r.info.as_ref())
            .map(|i| i.model.clone())
        {
            if !names.contains(&m) {
                names.push(m);
            }
        }
    }
    let data: Vec<Model> = names
        .into_iter()
        .map(|n| Model {
            max_model_len,
            ..Model::new(n, now_s())
        })
        .collect();
    Json(ModelList::new(data)).into_response()
}

/// The served model's tokenizer files (`tokenizer.json`,
/// `tokenizer_config.json`), from the first instance that is up, so a load
/// generator counts tokens as the engines do.
pub(super) async fn tokenizer_file(
    State(f): State<Front>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Response {
    if let Err(e) = check_api_key(&f, &headers) {
        return e.into_response();
    }
    let Some(link) = f
        .inner
        .prefill
        .iter()
        .chain(&f.inner.decode)
        .find(|l| l.up())
    else {
        return ApiError::unavailable("no instance is up to give its tokenizer", "no_instance", 1)
            .into_response();
    };
    let timeout = Duration::from_secs(10);
    match http::get(
        &link.addr,
        uri.path(),
        crate::proxy::MAX_ANSWER_BYTES,
        timeout,
    )
    .await
    {
        Ok((s, body)) if s.is_success() => (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Ok((s, body)) => ApiError::from_upstream(s, &body, &link.addr).into_response(),
        Err(e) => {
            ApiError::unavailable(format!("{}: {e}", link.addr), "upstream", 1).into_response()
        }
    }
}

pub(super) async fn healthz(State(f): State<Front>) -> Response {
    let p = f.inner.prefill.iter().filter(|l| l.up()).count();
    let d = f.inner.decode.iter().filter(|l| l.up()).count();
    if p > 0 && d > 0 {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("prefill instances up: {p}, decode instances up: {d}\n"),
        )
            .into_response()
    }
}

pub(super) async fn metrics_route(State(f): State<Front>) -> Response {
    api::metrics_response(&f.inner.registry)
}

pub(super) async fn status(State(f): State<Front>) -> Response {
    let links = |ls: &[Arc<Link>]| -> Vec<LinkStatus> {
        ls.iter()
            .map(|l| {
                let s = l.lock();
                LinkStatus {
                    addr: l.addr.clone(),
                    up: s.up,
                    error: s.error.clone(),
                    report: s.report.clone(),
                }
            })
            .collect()
    };
    let snap = f.inner.conductor.snapshot(ACTOR_TIMEOUT).await.ok();
    Json(
        json!({"conductor": snap, "chunk_tokens": f.inner.chunk_tokens,
        "pool": f.inner.pool.get().is_some(),
        "prefill": links(&f.inner.prefill), "decode": links(&f.inner.decode)}),
    )
    .into_response()
}
