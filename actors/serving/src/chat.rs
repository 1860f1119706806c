//! `kvpool chat "..."`: one chat turn against the front, streamed to the
//! terminal as it is generated.

use std::io::Write;
use std::time::Duration;

use axum::body::Bytes;
use hyper::Method;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::api;
use crate::http;
use crate::sse;

/// `kvpool chat`.
#[derive(Debug, Clone, clap::Args)]
pub struct ChatArgs {
    /// What to say.
    pub message: String,
    /// The conductor's front (default: `serving.conductor.listen`).
    #[arg(long, value_name = "HOST:PORT")]
    pub front: Option<String>,
    /// A system message before it.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens of the answer.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u64,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Seed of the sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// The model to ask for (default: whatever the front serves).
    #[arg(long)]
    pub model: Option<String>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
}

/// What a chat turn produced.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOutcome {
    /// The answer's text.
    pub text: String,
    /// Why it ended.
    pub finish_reason: String,
    /// The request id the front used.
    pub request_id: String,
}

/// Sends the turn to `front` and writes the answer to `out` as it streams.
pub async fn run_chat(
    front: &str,
    args: &ChatArgs,
    out: &mut dyn Write,
) -> Result<ChatOutcome, String> {
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(json!({"role": "system", "content": s}));
    }
    messages.push(json!({"role": "user", "content": args.message}));
    let mut body = json!({"messages": messages, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "stream": true});
    if let Some(s) = args.seed {
        body["seed"] = json!(s);
    }
    if let Some(m) = &args.model {
        body["model"] = json!(m);
    }
    let rid = api::new_request_id();
    let deadline = Instant::now() + Duration::from_secs(args.timeout_s);
    let mut a = http::send(
        front,
        Method::POST,
        "/v1/chat/completions",
        &[(api::REQUEST_ID, rid.as_str())],
        Some(Bytes::from(body.to_string())),
        Duration::from_secs(5),
        deadline,
    )
    .await
    .map_err(|e| e.to_string())?;
    let rid = a.header(api::REQUEST_ID).unwrap_or(&rid).to_string();
    if !a.status().is_success() {
        let status = a.status();
        let body = a.bytes(1 << 20).await.map_err(|e| e.to_string())?;
        let e = api::ApiError::from_upstream(status, &body, "the front");
        return Err(format!("{status}: {}", e.message));
    }
    let mut reader = sse::Reader::new();
    let mut events = Vec::new();
    let mut text = String::new();
    let mut finish = None;
    loop {
        let Some(chunk) = a.chunk(None).await.map_err(|e| e.to_string())? else {
            return Err("the answer ended without [DONE]".into());
        };
        events.clear();
        reader
            .feed(&chunk, &mut events)
            .map_err(|e| e.to_string())?;
        for ev in events.drain(..) {
            let data = match ev {
                sse::Event::Done => {
                    let _ = writeln!(out);
                    let _ = out.flush();
                    return Ok(ChatOutcome {
                        text,
                        finish_reason: finish.unwrap_or_else(|| "stop".into()),
                        request_id: rid,
                    });
                }
                sse::Event::Data(d) => d,
            };
            let v: Value = serde_json::from_str(&data).map_err(|e| format!("bad event: {e}"))?;
            if let Some((message, _)) = api::event_error(&v) {
                let _ = writeln!(out);
                return Err(message);
            }
            let c = &v["choices"][0];
            if let Some(d) = c["delta"]["content"].as_str() {
                text.push_str(d);
                let _ = out.write_all(d.as_bytes());
                let _ = out.flush();
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
}
