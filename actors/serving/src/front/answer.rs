//! Answers to the client: a stream of server-sent events or one JSON body,
//! relayed from the decode instance's pieces.

use super::*;

/// A stand-in answer that fails at once (an instance that could not be
/// opened): the relay loop treats it like a broken stream.
pub(super) fn answer_failed(link: &Link, why: String) -> Answer {
    Answer::failed(&link.addr, why)
}

pub(super) fn empty_served() -> Served {
    Served {
        rid: String::new(),
        prompt: Vec::new(),
        prefill: 0,
        decode: 0,
        cached_tokens: 0,
        computed_tokens: None,
        failovers: 0,
        arrived: Instant::now(),
        deadline: Instant::now(),
        engine_ids: (None, None),
        model: None,
    }
}

pub(super) fn usage(s: &Served, completion: u64) -> Value {
    let prompt = s.prompt.len() as u64;
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens}})
}

pub(super) fn kvpool_block(s: &Served) -> Value {
    json!({"prefill": s.prefill, "decode": s.decode, "failovers": s.failovers,
        "prompt_tokens_loaded": s.cached_tokens, "prompt_tokens_computed": s.computed_tokens,
        "prefill_answer_id": s.engine_ids.0, "decode_answer_id": s.engine_ids.1})
}

/// A streamed answer: OpenAI's chunks, the usage chunk when asked, then
/// `[DONE]`; an error after the 200 is an error event and `[DONE]`.
pub(super) fn stream_answer(
    rx: mpsc::Receiver<Piece>,
    req: &Req,
    rid: &str,
    model: &str,
) -> Response {
    struct S {
        rx: mpsc::Receiver<Piece>,
        id: String,
        model: String,
        created: u64,
        chat: bool,
        want_ids: bool,
        include_usage: bool,
        /// Per sequence: no chunk sent yet (a chat's first names the role).
        first: Vec<bool>,
        ids: u64,
        /// Sequences that ended.
        ended: usize,
        /// Every sequence's books, for the usage chunk.
        books: Option<Box<Served>>,
        done: bool,
        /// Per sequence, the prompt, sent with its first chunk (`echo`).
        echo: Vec<Option<String>>,
    }
    let s = S {
        rx,
        id: format!("{}-{rid}", if req.chat { "chatcmpl" } else { "cmpl" }),
        model: model.to_string(),
        created: now_s(),
        chat: req.chat,
        want_ids: req.want_ids,
        include_usage: req.include_usage,
        first: vec![true; req.n],
        ids: 0,
        ended: 0,
        books: None,
        done: false,
        echo: vec![req.echo.clone(); req.n],
    };
    pub(super) fn chunk(
        s: &mut S,
        index: usize,
        text: &str,
        ids: &[u32],
        finish: Option<&str>,
        lp: Value,
    ) -> Value {
        let text = match s.echo.get_mut(index).and_then(Option::take) {
            Some(e) => format!("{e}{text}"),
            None => text.to_string(),
        };
        let first = s.first.get_mut(index).map(std::mem::take).unwrap_or(false);
        let mut choice = if s.chat {
            let mut d = json!({"content": text});
            if first {
                d["role"] = json!("assistant");
            }
            json!({"index": index, "delta": d, "logprobs": lp, "finish_reason": finish})
        } else {
            json!({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
        };
        if s.want_ids {
            choice["token_ids"] = json!(ids);
        }
        json!({"id": s.id, "object": if s.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": s.created, "model": s.model, "choices": [choice]})
    }
    let stream = futures_util::stream::unfold(s, |mut s| async move {
        if s.done {
            return None;
        }
        let piece = s.rx.recv().await;
        let out: Bytes = match piece {
            Some(Piece::Text {
                index,
                text,
                ids,
                logprobs,
            }) => {
                s.ids += ids.len() as u64;
                let v = chunk(&mut s, index, &text, &ids, None, logprobs);
                sse::event(&v)
            }
            Some(Piece::End {
                index,
                result: Ok((finish, served)),
            }) => {
                s.ended += 1;
                s.books.get_or_insert(served);
                let v = chunk(&mut s, index, "", &[], Some(&finish), Value::Null);
                let mut out = sse::event(&v).to_vec();
                if s.ended == s.first.len() {
                    // Every sequence ended: the usage chunk, then [DONE].
                    s.done = true;
                    if let (true, Some(b)) = (s.include_usage, &s.books) {
                        let u = json!({"id": s.id, "object": if s.chat { "chat.completion.chunk" } else { "text_completion" },
                            "created": s.created, "model": s.model, "choices": [],
                            "usage": usage(b, s.ids)});
                        out.extend_from_slice(&sse::event(&u));
                    }
                    out.extend_from_slice(&sse::done());
                }
                Bytes::from(out)
            }
            Some(Piece::End { result: Err(e), .. }) => {
                s.done = true;
                error_events(&e)
            }
            None => {
                // The generation task ended without a last piece.
                s.done = true;
                error_events(&ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "the request's generation ended without an answer",
                ))
            }
        };
        Some((Ok::<Bytes, std::convert::Infallible>(out), s))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(axum::http::header::CONTENT_TYPE, "text/event-stream")
        .header(axum::http::header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            )
            .into_response()
        })
}

/// Appends a piece's `logprobs` to the answer's (an engine that continues
/// an answer counts `text_offset` from the answer's start: `kvpool_resume`).
pub(super) fn append_logprobs(acc: &mut Value, mut more: Value, chat: bool) {
    if more.is_null() {
        return;
    }
    if acc.is_null() {
        *acc = more;
        return;
    }
    let fields: &[&str] = if chat {
        &["content"]
    } else {
        &["tokens", "token_logprobs", "top_logprobs", "text_offset"]
    };
    for f in fields {
        if let (Some(a), Value::Array(m)) = (acc[*f].as_array_mut(), more[*f].take()) {
            a.extend(m);
        }
    }
}

/// `data: {"error": ...}` then `data: [DONE]`.
pub(super) fn error_events(e: &ApiError) -> Bytes {
    let mut v = e.body();
    v["error"]["code"] = json!(e.status.as_u16());
    let mut out = sse::event(&v).to_vec();
    out.extend_from_slice(&sse::done());
    Bytes::from(out)
}

/// A non-streamed answer, gathered from the pieces of its sequences.
pub(super) async fn whole_answer(
    mut rx: mpsc::Receiver<Piece>,
    req: &Req,
    rid: &str,
    model: &str,
) -> Result<Response, ApiError> {
    /// One sequence's answer so far: its text, ids, logprobs (null when
    /// none came) and, once ended, its choice.
    struct Seq {
        text: String,
        ids: Vec<u32>,
        lps: Value,
        choice: Option<Value>,
    }
    let mut seqs: Vec<Seq> = (0..req.n)
        .map(|_| Seq {
            text: req.echo.clone().unwrap_or_default(),
            ids: Vec::new(),
            lps: Value::Null,
            choice: None,
        })
        .collect();
    let mut books: Option<Box<Served>> = None;
    let mut ended = 0;
    while ended < req.n {
        match rx.recv().await {
            Some(Piece::Text {
                index,
                text: t,
                ids: i,
                logprobs,
            }) => {
                let Some(q) = seqs.get_mut(index) else {
                    continue;
                };
                q.text.push_str(&t);
                q.ids.extend(i);
                append_logprobs(&mut q.lps, logprobs, req.chat);
            }
            Some(Piece::End {
                index,
                result: Ok((finish, served)),
            }) => {
                let Some(q) = seqs.get_mut(index) else {
                    continue;
                };
                let text = std::mem::take(&mut q.text);
                let lps = std::mem::take(&mut q.lps);
                let mut choice = if req.chat {
                    json!({"index": index, "message": {"role": "assistant", "content": text},
                        "logprobs": lps, "finish_reason": finish})
                } else {
                    json!({"index": index, "text": text, "logprobs": lps, "finish_reason": finish})
                };
                if req.want_ids {
                    choice["token_ids"] = json!(q.ids);
                    choice["prompt_token_ids"] = json!(served.prompt);
                }
                q.choice = Some(choice);
                books.get_or_insert(served);
                ended += 1;
            }
            Some(Piece::End { result: Err(e), .. }) => return Err(e),
            None => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "the request's generation ended without an answer",
                ))
            }
        }
    }
    let generated: u64 = seqs.iter().map(|q| q.ids.len() as u64).sum();
    let choices: Vec<Value> = seqs.into_iter().filter_map(|q| q.choice).collect();
    let served = books.unwrap_or_else(|| Box::new(empty_served()));
    let prefix = if req.chat { "chatcmpl" } else { "cmpl" };
    let body = json!({"id": format!("{prefix}-{rid}"),
        "object": if req.chat { "chat.completion" } else { "text_completion" },
        "created": now_s(), "model": model, "choices": choices,
        "usage": usage(&served, generated),
        "kvpool": kvpool_block(&served)});
    Ok(Json(body).into_response())
}
