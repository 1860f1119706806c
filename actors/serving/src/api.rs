//! What the front and the proxies share of the HTTP API: request ids, the
//! OpenAI error shape, the kvpool headers between conductor and proxies.

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// The header that names a request end to end (OpenAI's and vLLM's).
pub const REQUEST_ID: &str = "x-request-id";
/// Conductor -> prefill proxy: the prefill time the scheduler predicted, ms.
pub const PREDICTED_PREFILL_MS: &str = "x-kvpool-predicted-prefill-ms";
/// Conductor -> proxies: prompt tokens of the request.
pub const PROMPT_TOKENS: &str = "x-kvpool-prompt-tokens";

/// The error type a decode proxy gives the event that ends a stream whose
/// engine failed under it (the conductor continues such a stream elsewhere).
pub const ENGINE_FAILED: &str = "engine_failed";

/// The request's `X-Request-Id` when it is 1 to 128 visible ASCII
/// characters (anything else counts as absent).
pub fn request_id(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(REQUEST_ID)?.to_str().ok()?;
    let ok = !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic());
    ok.then(|| v.to_string())
}

/// A fresh request id.
pub fn new_request_id() -> String {
    format!("kvp-{:016x}", rand::random::<u64>())
}

/// An error as OpenAI writes it: `{"error": {"message", "type", "param",
/// "code"}}`, with `Retry-After` on a 503.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable reason.
    pub message: String,
    /// `type`: `invalid_request_error`, `server_error`, ...
    pub kind: &'static str,
    /// `code`: a short machine-readable reason, if any.
    pub code: Option<String>,
    /// Seconds for `Retry-After`.
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    /// 400.
    pub fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// Any status; `kind` is the OpenAI `type`.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code: None,
            retry_after_s: None,
        }
    }

    /// 503 with `Retry-After`.
    pub fn unavailable(message: impl Into<String>, code: &str, retry_after_s: u64) -> Self {
        Self {
            code: Some(code.to_string()),
            retry_after_s: Some(retry_after_s),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
        }
    }

    /// With a `code`.
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// The body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": null,
            "code": self.code}})
    }

    /// An error from an upstream answer's status and body: its message
    /// (OpenAI's `{"error": {"message"}}` or vLLM's `{"message"}`) is kept,
    /// or the body's text when it is neither.
    pub fn from_upstream(status: StatusCode, body: &[u8], who: &str) -> Self {
        let v: Option<Value> = serde_json::from_slice(body).ok();
        let message = v
            .as_ref()
            .and_then(|v| {
                v["error"]["message"]
                    .as_str()
                    .or_else(|| v["message"].as_str())
                    .map(str::to_string)
            })
            .unwrap_or_else(|| {
                let t = String::from_utf8_lossy(body);
                format!(
                    "{who} answered {status}: {}",
                    t.chars().take(300).collect::<String>()
                )
            });
        let kind = if status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        let mut e = Self::new(status, kind, message);
        if status == StatusCode::NOT_FOUND {
            e.code = Some("model_not_found".into());
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            e.retry_after_s = Some(1);
        }
        e
    }
}

/// A path the API does not have: 404 in OpenAI's error shape (not an empty
/// body, which clients and load generators report as a parse error).
pub async fn no_route(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("there is no route {method} {}", uri.path()),
    )
}

/// A method the path does not take: 405 in OpenAI's error shape.
pub async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} does not take {method}", uri.path()),
    )
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// `GET /metrics`: `registry` as Prometheus text.
pub fn metrics_response(registry: &kvpool_runtime::metrics::MetricsRegistry) -> Response {
    (
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        registry.render(),
    )
        .into_response()
}

/// `resp` with `X-Request-Id: id`.
pub fn with_request_id(mut resp: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    resp
}

/// The error inside an SSE event's JSON (`{"error": {...}}`), if it is one.
pub fn event_error(v: &Value) -> Option<(String, String)> {
    let e = v.get("error")?;
    let message = e["message"].as_str().unwrap_or("error").to_string();
    let kind = e["type"].as_str().unwrap_or("server_error").to_string();
    Some((message, kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_checked_and_errors_are_openai_shaped() {
        let mut h = HeaderMap::new();
        assert_eq!(request_id(&h), None);
        h.insert(REQUEST_ID, "abc".parse().unwrap());
        assert_eq!(request_id(&h).as_deref(), Some("abc"));
        h.insert(REQUEST_ID, "a b".parse().unwrap());
        assert_eq!(request_id(&h), None);
        assert!(new_request_id().starts_with("kvp-"));

        let e = ApiError::unavailable("full", "queues_full", 2);
        assert_eq!(e.body()["error"]["code"], "queues_full");
        let r = e.into_response();
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["retry-after"], "2");

        let vllm =
            br#"{"object":"error","message":"bad prompt","type":"BadRequestError","code":400}"#;
        let e = ApiError::from_upstream(StatusCode::BAD_REQUEST, vllm, "engine");
        assert_eq!(e.message, "bad prompt");
        assert_eq!(e.kind, "invalid_request_error");
        let oa = br#"{"error":{"message":"no such model"}}"#;
        let e = ApiError::from_upstream(StatusCode::NOT_FOUND, oa, "engine");
        assert_eq!(e.message, "no such model");
        assert_eq!(e.code.as_deref(), Some("model_not_found"));
        let e = ApiError::from_upstream(StatusCode::BAD_GATEWAY, b"oops", "proxy");
        assert!(e.message.contains("oops"), "{}", e.message);
    }
}
