//! The decode side of a request: opening an instance, relaying its stream,
//! failing over to another.

use super::*;

pub(super) enum DecodeOpen {
    /// The instance failed: try another.
    Failed(String),
    /// The engine refused the request: the client's answer.
    Refused(ApiError),
}

/// Whether a proxy's error answer says its engine is down or failed (the
/// request should move), rather than refusing the request.
pub(super) fn is_engine_failure(status: StatusCode, body: &[u8]) -> bool {
    if !(status == StatusCode::BAD_GATEWAY || status == StatusCode::GATEWAY_TIMEOUT) {
        return false;
    }
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    matches!(
        v["error"]["code"].as_str(),
        Some("engine_down") | Some(api::ENGINE_FAILED)
    )
}

/// One request's decode: relays the stream's pieces to the answer,
/// continuing on another decode instance when the one serving it fails.
pub(super) struct DecodeRun {
    pub(super) front: Front,
    /// Which of the request's sequences (`n`) this is.
    pub(super) index: usize,
    pub(super) req_body: Value,
    /// A chat's answer (its continuation is a completion that answers
    /// logprobs in the chat form).
    pub(super) chat: bool,
    pub(super) max_tokens: Option<u64>,
    pub(super) served: Served,
    pub(super) tx: mpsc::Sender<Piece>,
}

/// How a stream from a decode proxy ended.
pub(super) enum StreamEnd {
    /// `[DONE]` after a finish reason (or without one: "stop").
    Finished(String),
    /// The engine failed under it: continue elsewhere.
    Failed(String),
    /// The engine sent an error of its own.
    Error(String),
    /// The client went away.
    Gone,
}

impl DecodeRun {
    pub(super) async fn pump(mut self, first: Answer, _permit: Arc<OwnedSemaphorePermit>) {
        let m = self.front.inner.metrics.clone();
        m.in_flight.inc();
        let r = self.run(first).await;
        m.in_flight.dec();
        match r {
            Ok(Some((finish, generated))) => {
                let tokens = generated;
                let _ = self.front.inner.conductor.decode_finished(
                    self.served.decode,
                    tokens.clamp(1, u64::from(u32::MAX)) as u32,
                );
                let served = std::mem::replace(&mut self.served, empty_served());
                let end = Piece::End {
                    index: self.index,
                    result: Ok((finish, Box::new(served))),
                };
                let _ = self.send_by(end, None).await;
            }
            Ok(None) => {}
            Err(mut e) => {
                tracing::warn!(
                    request_id = self.served.rid,
                    "request failed: {}",
                    e.message
                );
                e.message = self.front.scrub(&e.message);
                let end = Piece::End {
                    index: self.index,
                    result: Err(e),
                };
                let _ = self.send_by(end, None).await;
            }
        }
    }

    /// Hands `piece` to the answer; false if the client went away or took
    /// nothing for `stall_timeout_ms` (or past the request's deadline). A
    /// streaming client that stops reading fills the answer's buffers and
    /// then this channel: without this deadline its run, its admission
    /// place and its engine sequence would be held for as long as it keeps
    /// the socket open.
    pub(super) async fn send(&self, piece: Piece) -> bool {
        self.send_by(piece, Some(self.served.deadline)).await
    }

    /// [`Self::send`], also bounded by `deadline` when given (the last
    /// piece, which may say the deadline passed, gets `stall_timeout_ms`).
    pub(super) async fn send_by(&self, piece: Piece, deadline: Option<Instant>) -> bool {
        let stall = Duration::from_millis(self.front.inner.cfg.stall_timeout_ms);
        let until = Instant::now() + stall;
        let until = deadline.map_or(until, |d| d.min(until));
        match tokio::time::timeout_at(until, self.tx.send(piece)).await {
            Ok(Ok(())) => true,
            Ok(Err(_)) => false,
            Err(_) => {
                self.front.inner.metrics.clients_stalled.inc();
                tracing::warn!(
                    request_id = self.served.rid,
                    "the client took no part of its answer within {} ms; dropping the request",
                    stall.as_millis()
                );
                false
            }
        }
    }

    /// Returns the finish reason and the tokens generated, `None` if the
    /// client went away.
    pub(super) async fn run(&mut self, first: Answer) -> Result<Option<(String, u64)>, ApiError> {
        let mut answer = first;
        let mut generated: Vec<u32> = Vec::new();
        let mut ids_complete = true;
        let mut sent_any = false;
        // Bytes of text the client got: a continuation starts its text
        // there, so what the failed engine held back (part of a character,
        // a possible stop-string prefix) is not lost.
        let mut text_sent = 0usize;
        loop {
            let end = self
                .relay(
                    &mut answer,
                    &mut generated,
                    &mut ids_complete,
                    &mut sent_any,
                    &mut text_sent,
                )
                .await;
            let why = match end {
                StreamEnd::Finished(f) => return Ok(Some((f, generated.len() as u64))),
                StreamEnd::Gone => return Ok(None),
                StreamEnd::Error(e) => {
                    return Err(ApiError::new(StatusCode::BAD_GATEWAY, "server_error", e))
                }
                StreamEnd::Failed(why) => why,
            };
            let link = self.front.inner.decode[self.served.decode].clone();
            self.front.mark_down(&link, why.clone());
            self.served.failovers += 1;
            let remaining = self
                .max_tokens
                .map(|m| m.saturating_sub(generated.len() as u64));
            if remaining == Some(0) {
                return Ok(Some(("length".into(), generated.len() as u64)));
            }
            if !ids_complete || self.served.failovers > self.front.inner.cfg.max_failovers {
                return Err(ApiError::new(StatusCode::BAD_GATEWAY, "server_error", why));
            }
            let ctx = (self.served.prompt.len() + generated.len()) as u64;
            let Some(d) = self.front.pick_decode(ctx).await else {
                return Err(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "server_error",
                    format!("{why}; no other decode instance is up"),
                ));
            };
            self.front.count_failover("decode_stream");
            tracing::warn!(
                request_id = self.served.rid,
                "decode instance {} failed mid-stream after {} tokens ({why}); continuing on {d}",
                self.served.decode,
                generated.len()
            );
            self.served.decode = d;
            let body = self.continuation(&generated, text_sent, remaining);
            let link = self.front.inner.decode[d].clone();
            answer = match self
                .front
                .open_decode(&link, "/v1/completions", &body, &self.served)
                .await
            {
                Ok(a) => a,
                Err(DecodeOpen::Refused(e)) => return Err(e),
                Err(DecodeOpen::Failed(why)) => {
                    // The next round marks it down and tries another.
                    answer_failed(&link, why)
                }
            };
        }
    }

    /// The request that continues a stream: the prompt and the tokens sent
    /// so far as one token-id prompt, the rest of the budget, the same
    /// sampling settings, and how much of those tokens' text the client
    /// got (`kvpool_resume`: the engine sends the rest first).
    pub(super) fn continuation(
        &self,
        generated: &[u32],
        text_sent: usize,
        remaining: Option<u64>,
    ) -> Value {
        let mut prompt = self.served.prompt.clone();
        prompt.extend_from_slice(generated);
        let mut body = json!({"prompt": prompt});
        body[RESUME] = json!({"generated_tokens": generated.len(), "text_sent_bytes": text_sent,
            "chat": self.chat});
        for k in [
            "model",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "ignore_eos",
            "logprobs",
            "top_logprobs",
        ] {
            if let Some(v) = self.req_body.get(k) {
                body[k] = v.clone();
            }
        }
        let room = self
            .front
            .max_model_len()
            .map(|m| m.saturating_sub(prompt.len() as u64));
        if let Some(n) = remaining.or(room) {
            body["max_tokens"] = json!(n);
        }
        body
    }

    /// Relays one upstream stream's pieces until it ends.
    pub(super) async fn relay(
        &mut self,
        answer: &mut Answer,
        generated: &mut Vec<u32>,
        ids_complete: &mut bool,
        sent_any: &mut bool,
        text_sent: &mut usize,
    ) -> StreamEnd {
        let stall = Duration::from_millis(self.front.inner.cfg.stall_timeout_ms);
        let mut reader = sse::Reader::new();
        let mut events = Vec::new();
        let mut finish: Option<String> = None;
        loop {
            let until = (!generated.is_empty()).then(|| Instant::now() + stall);
            let chunk = match answer.chunk(until).await {
                Ok(Some(c)) => c,
                Ok(None) => {
                    return StreamEnd::Failed("the decode stream ended without [DONE]".into())
                }
                Err(HttpError::Timeout { .. }) if Instant::now() >= self.served.deadline => {
                    return StreamEnd::Error(
                        "the request ran past serving.conductor.request_timeout_ms".into(),
                    )
                }
                Err(HttpError::Timeout { .. }) => {
                    return StreamEnd::Failed(format!(
                        "the decode stream was silent for {} ms",
                        stall.as_millis()
                    ))
                }
                Err(e) => return StreamEnd::Failed(e.to_string()),
            };
            events.clear();
            if reader.feed(&chunk, &mut events).is_err() {
                return StreamEnd::Failed("an event of the decode stream is too long".into());
            }
            for ev in events.drain(..) {
                let data = match ev {
                    sse::Event::Done => {
                        return StreamEnd::Finished(finish.take().unwrap_or_else(|| "stop".into()))
                    }
                    sse::Event::Data(d) => d,
                };
                let Ok(v) = serde_json::from_str::<Value>(&data) else {
                    return StreamEnd::Failed(
                        "the decode stream sent an event that is not JSON".into(),
                    );
                };
                if let Some(id) = v["id"].as_str() {
                    self.served.engine_ids.1 = Some(id.to_string());
                }
                if let Some((message, kind)) = api::event_error(&v) {
                    return if kind == api::ENGINE_FAILED {
                        StreamEnd::Failed(message)
                    } else {
                        StreamEnd::Error(message)
                    };
                }
                let c = &v["choices"][0];
                let text = c["text"]
                    .as_str()
                    .or_else(|| c["delta"]["content"].as_str())
                    .unwrap_or("")
                    .to_string();
                let ids: Vec<u32> = match c["token_ids"].as_array() {
                    Some(a) => a
                        .iter()
                        .filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                        .collect(),
                    None => {
                        if !text.is_empty() {
                            *ids_complete = false;
                        }
                        Vec::new()
                    }
                };
                if let Some(f) = c["finish_reason"].as_str() {
                    finish = Some(f.to_string());
                }
                generated.extend_from_slice(&ids);
                if !text.is_empty() || !ids.is_empty() {
                    if !*sent_any {
                        *sent_any = true;
                        self.front
                            .inner
                            .metrics
                            .first_token_seconds
                            .observe(self.served.arrived.elapsed().as_secs_f64());
                    }
                    *text_sent += text.len();
                    let logprobs = c["logprobs"].clone();
                    if !self
                        .send(Piece::Text {
                            index: self.index,
                            text,
                            ids,
                            logprobs,
                        })
                        .await
                    {
                        return StreamEnd::Gone;
                    }
                }
            }
        }
    }
}
