use super::{Stop, TextState};
use crate::tokenizer::Tokenizer;
use kvpool_config::NodeConfig;

fn bytes(s: &[u8]) -> Vec<u32> {
    s.iter().map(|&b| u32::from(b)).collect()
}

/// Fields the engine does not apply are refused when they ask for
/// something; their defaults, and fields it does not know, pass.
#[test]
fn unsupported_fields_are_refused_unless_they_ask_for_nothing() {
    let rest = |v: serde_json::Value| v.as_object().unwrap().clone();
    for asks in [
        serde_json::json!({"echo": true}),
        serde_json::json!({"presence_penalty": 0.5}),
        serde_json::json!({"tools": [{"type": "function"}]}),
        serde_json::json!({"response_format": {"type": "json_object"}}),
        serde_json::json!({"logit_bias": {"5": 10}}),
    ] {
        let e = super::refuse_unsupported(&rest(asks.clone()), true).unwrap_err();
        assert!(
            e.message.contains("is not supported"),
            "{asks}: {}",
            e.message
        );
    }
    let defaults = serde_json::json!({"echo": false, "frequency_penalty": 0, "tools": [],
        "response_format": {"type": "text"}, "tool_choice": "none", "user": "u1",
        "stream_options": {"include_usage": true}, "best_of": 1, "logit_bias": null});
    super::refuse_unsupported(&rest(defaults), true).unwrap();
}

/// OpenAI's content parts read as their texts joined by a newline, a
/// string as itself; a part that is not text is a 400.
#[test]
fn content_parts_are_text_and_other_kinds_are_refused() {
    let msgs = |v: serde_json::Value| -> Vec<super::Message> { serde_json::from_value(v).unwrap() };
    let parts = msgs(serde_json::json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]));
    assert_eq!(
        super::chat_text(&parts).unwrap(),
        "<|system|>\nbe brief\n<|user|>\na\nb\n<|assistant|>\n"
    );
    let image = msgs(serde_json::json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]));
    let e = super::chat_text(&image).unwrap_err();
    assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
    assert!(e.message.contains("\"image_url\""), "{}", e.message);
}

#[test]
fn invalid_utf8_reads_as_replacement_and_only_an_incomplete_tail_waits() {
    let tok = Tokenizer::Bytes;
    let mut t = TextState::new(None);
    for id in bytes(b"ab\xffcd") {
        t.push(id, &tok);
    }
    // Text after an invalid byte is not lost.
    assert_eq!(t.text(&tok, false), "ab\u{fffd}cd");
    assert_eq!(t.delta(&tok, false), "ab\u{fffd}cd");
    // The first two bytes of the euro sign wait for the third.
    for id in bytes(&[0xe2, 0x82]) {
        t.push(id, &tok);
    }
    assert_eq!(t.delta(&tok, false), "");
    assert_eq!(t.text(&tok, true), "ab\u{fffd}cd\u{fffd}");
    t.push(0xac, &tok);
    assert_eq!(t.delta(&tok, false), "\u{20ac}");
}

/// A stream continued on another engine sends the text the first one
/// held back (two bytes of a euro sign, an `X` that may start the stop
/// string) before the new tokens' text: the client reads what one
/// engine would have sent.
#[test]
fn a_resumed_stream_sends_the_text_its_first_engine_held_back() {
    let tok = Tokenizer::Bytes;
    let resume = |sent| super::Resume {
        generated_tokens: 4,
        text_sent_bytes: sent,
        chat: false,
    };
    // The first engine sent "ab" of a, b, 0xe2, 0x82.
    let mut prompt = bytes(b"prompt");
    prompt.extend(bytes(&[b'a', b'b', 0xe2, 0x82]));
    let mut t = TextState::new(None);
    t.resume(&prompt, resume(2), &tok).unwrap();
    assert_eq!(t.delta(&tok, false), "");
    t.push(0xac, &tok);
    assert_eq!(t.delta(&tok, false), "\u{20ac}");
    assert_eq!(t.own_ids(), [0xac]);
    // A stop string that spans the engines still stops.
    let mut prompt = bytes(b"prompt");
    prompt.extend(bytes(b"abcX"));
    let mut t = TextState::new(Some(Stop::One("XY".into())));
    t.resume(&prompt, resume(3), &tok).unwrap();
    assert!(t.push(u32::from(b'Y'), &tok));
    assert_eq!(t.delta(&tok, true), "");
    assert_eq!(t.stopped.as_deref(), Some("abc"));
    // Counts past the prompt or past the text are refused.
    let mut t = TextState::new(None);
    let e = t.resume(&prompt[..3], resume(0), &tok).unwrap_err();
    assert!(e.message.contains("generated_tokens"), "{}", e.message);
    let e = t.resume(&prompt, resume(5), &tok).unwrap_err();
    assert!(e.message.contains("text_sent_bytes"), "{}", e.message);
}

#[test]
fn stop_strings_cut_the_text_and_a_held_back_prefix_is_never_sent() {
    let tok = Tokenizer::Bytes;
    let mut t = TextState::new(Some(Stop::Many(vec!["XY".into(), String::new()])));
    let mut sent = String::new();
    for id in bytes(b"abX") {
        assert!(!t.push(id, &tok));
        sent.push_str(&t.delta(&tok, false));
    }
    assert_eq!(sent, "ab", "the X may start the stop string");
    assert!(t.push(u32::from(b'Y'), &tok));
    sent.push_str(&t.delta(&tok, true));
    assert_eq!(sent, "ab");
    assert_eq!(t.stopped.as_deref(), Some("ab"));
    // A possible prefix that turns out not to be one is sent at the end.
    let mut t = TextState::new(Some(Stop::One("XY".into())));
    for id in bytes(b"abX") {
        t.push(id, &tok);
    }
    assert_eq!(t.delta(&tok, false), "ab");
    assert_eq!(t.delta(&tok, true), "X");
}

/// A byte-level BPE decoder (as Llama 3's) turns a token ending inside a
/// character into U+FFFD, which the next token replaces: the streamed
/// text must hold it back and never slice inside the character.
#[test]
fn a_character_split_across_hf_tokens_streams_whole() {
    let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":null,"post_processor":null,
"decoder":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":false},
"model":{"type":"WordLevel","vocab":{"[UNK]":0,"a":1,"\u00f0\u0141\u013a":2,"\u0122":3},"unk_token":"[UNK]"}}"#;
    let hf: tokenizers::Tokenizer = json.parse().expect("tokenizer json");
    let tok = Tokenizer::Hf(Box::new(hf));
    assert_eq!(tok.decode_bytes(&[1, 2, 3]), "a\u{1f600}".as_bytes());
    let mut t = TextState::new(None);
    let mut sent = String::new();
    for id in [1, 2, 3, 1] {
        t.push(id, &tok);
        sent.push_str(&t.delta(&tok, false));
    }
    sent.push_str(&t.delta(&tok, true));
    assert_eq!(sent, "a\u{1f600}a");
    // Even text that changes under what was sent is never cut inside a
    // character.
    let mut t = TextState::new(None);
    t.sent = "a\u{fffd}".len();
    t.stopped = Some("a\u{1f600}b".into());
    assert_eq!(t.delta(&tok, true), "b");
}

/// A sequence that fails after the stream's 200 sends vLLM's error
/// event (the shape OpenAI clients raise on); [DONE] follows from the
/// stream (tested live in tests/serving.rs).
#[test]
fn a_failed_stream_ends_with_an_error_event() {
    let raw = super::ApiError::internal("boom").sse_event();
    let text = std::str::from_utf8(&raw).unwrap();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.len(), 1, "{text}");
    let v: serde_json::Value = serde_json::from_str(events[0]).unwrap();
    assert_eq!(v["error"]["message"], "boom");
    assert_eq!(v["error"]["code"], 500);
    assert_eq!(v["error"]["type"], "InternalServerError");
}

/// builtin:tiny behind the real router, no pool, in this process.
fn served(config: &str) -> (tokio::runtime::Runtime, axum::Router) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let node = NodeConfig::from_toml(config, "test.toml").unwrap();
    let model = crate::loader::load("builtin:tiny").unwrap();
    let reg = kvpool_runtime::metrics::MetricsRegistry::new();
    let engine = rt
        .block_on(super::Engine::start(model, &node, None, &reg))
        .unwrap();
    (rt, engine.router(reg))
}

fn request(method: &str, path: &str, body: impl Into<axum::body::Body>) -> axum::extract::Request {
    axum::http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body.into())
        .unwrap()
}

async fn call(app: &axum::Router, req: axum::extract::Request) -> axum::response::Response {
    use tower::ServiceExt;
    app.clone().oneshot(req).await.unwrap()
}

async fn json_of(resp: axum::response::Response) -> serde_json::Value {
    let b = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&b).unwrap()
}

#[test]
fn requests_past_the_engine_limits_get_503_until_one_ends() {
    use futures_util::StreamExt;
    let (rt, app) = served("[engine]\nmax_num_seqs = 1\nmax_waiting = 1\n");
    rt.block_on(async {
        let body = r#"{"prompt": "a", "max_tokens": 1, "temperature": 0, "stream": true}"#;
        // Two streams (the limit: 1 running + 1 waiting) that have sent
        // their last event but are not closed yet: they still count.
        let mut open = Vec::new();
        for _ in 0..2 {
            let resp = call(&app, request("POST", "/v1/completions", body)).await;
            assert_eq!(resp.status(), 200);
            let mut events = resp.into_body().into_data_stream();
            let mut seen = Vec::new();
            while !seen.ends_with(b"data: [DONE]\n\n") {
                let chunk = events.next().await.expect("an event").unwrap();
                seen.extend_from_slice(&chunk);
            }
            open.push(events);
        }
        let plain = r#"{"prompt": "a", "max_tokens": 2, "temperature": 0}"#;
        for path in ["/v1/completions", "/v1/chat/completions", "/tokenize"] {
            let resp = call(&app, request("POST", path, plain)).await;
            assert_eq!(resp.status(), 503, "{path}");
            assert_eq!(resp.headers()["retry-after"], "1", "{path}");
            let v = json_of(resp).await;
            assert_eq!(v["type"], "ServiceUnavailableError", "{v}");
            assert!(v["message"].as_str().unwrap().contains("in flight"), "{v}");
        }
        // Routes that hold nothing are not admitted.
        let resp = call(&app, request("GET", "/health", "")).await;
        assert_eq!(resp.status(), 200);
        // One stream closes: a request is admitted again.
        drop(open.pop());
        let resp = call(&app, request("POST", "/v1/completions", plain)).await;
        assert_eq!(resp.status(), 200);
        // A plain answer does not keep its place once sent.
        let resp = call(&app, request("POST", "/v1/completions", plain)).await;
        assert_eq!(resp.status(), 200);
    });
}

#[test]
fn x_request_id_names_the_answer_and_models_name_the_kv_keys() {
    let (rt, app) = served("");
    rt.block_on(async {
        let body = r#"{"prompt": "a", "max_tokens": 2, "temperature": 0}"#;
        let mut req = request("POST", "/v1/completions", body);
        req.headers_mut()
            .insert("x-request-id", "abc-123".parse().unwrap());
        let resp = call(&app, req).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-request-id"], "abc-123");
        assert_eq!(json_of(resp).await["id"], "cmpl-abc-123");
        // A stream says it in its header, an error too.
        let mut req = request(
            "POST",
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "stream": true}"#,
        );
        req.headers_mut()
            .insert("x-request-id", "s-1".parse().unwrap());
        let resp = call(&app, req).await;
        assert_eq!(resp.headers()["x-request-id"], "s-1");
        let mut req = request("POST", "/v1/completions", r#"{"prompt": []}"#);
        req.headers_mut()
            .insert("x-request-id", "e-1".parse().unwrap());
        let resp = call(&app, req).await;
        assert_eq!(resp.status(), 400);
        assert_eq!(resp.headers()["x-request-id"], "e-1");
        // An id that is not 1..=128 visible characters is ignored.
        let mut req = request("POST", "/v1/completions", body);
        req.headers_mut()
            .insert("x-request-id", "x".repeat(129).parse().unwrap());
        let resp = call(&app, req).await;
        assert!(resp.headers().get("x-request-id").is_none());
        assert!(json_of(resp).await["id"]
            .as_str()
            .unwrap()
            .starts_with("cmpl-"));

        let v = json_of(call(&app, request("GET", "/v1/models", "")).await).await;
        let kv = &v["data"][0]["kvpool"];
        assert_eq!(kv["chunk_tokens"], 256, "{v}");
        assert!(kv["key_model"].as_str().unwrap().starts_with('m'), "{v}");
        assert_eq!(kv["key_format"], "kv2-f32-l4h4d32", "{v}");
        assert!(kv["pool"].is_null(), "{v}");
    });
}

#[test]
fn a_body_over_the_limit_gets_413_in_vllms_error_shape() {
    let (rt, app) = served("[engine]\nmax_body_bytes = \"1 KiB\"\n");
    rt.block_on(async {
        let big = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(2048));
        let resp = call(&app, request("POST", "/v1/completions", big)).await;
        assert_eq!(resp.status(), 413);
        let v = json_of(resp).await;
        assert_eq!(v["object"], "error", "{v}");
        assert_eq!(v["type"], "PayloadTooLargeError", "{v}");
        assert_eq!(v["code"], 413, "{v}");
    });
}

#[test]
fn engine_config_file_parses_and_bad_keys_are_named() {
    let cfg = NodeConfig::from_toml(include_str!("../../../configs/engine.toml"), "engine.toml")
        .expect("configs/engine.toml parses");
    cfg.engine.validate().expect("and is valid");
    assert_eq!(cfg.engine.chunk_tokens, 256);
    let e = NodeConfig::from_toml("[engine]\nchunk_tokns = 8\n", "t").unwrap_err();
    assert!(e.to_string().contains("chunk_tokns"), "{e}");
    let cfg = NodeConfig::from_toml("[engine]\nmax_num_seqs = 0\n", "t").unwrap();
    let e = cfg.engine.validate().unwrap_err();
    assert!(e.contains("engine.max_num_seqs"), "{e}");
}

/// Token ids sent along (`kvpool_prompt_token_ids`, what the conductor's
/// front sends once it tokenized the prompt) are the prompt: the text or
/// messages are not tokenized again, and the answer is that of the ids as a
/// token-id prompt. Out-of-vocabulary ids are refused as in a token prompt.
#[test]
fn prompt_token_ids_sent_along_are_the_prompt_and_skip_the_tokenizer() {
    let (rt, app) = served("");
    assert_eq!(
        kvpool_http::openai::PROMPT_TOKEN_IDS,
        "kvpool_prompt_token_ids"
    );
    rt.block_on(async {
        let tokenized = || async {
            let resp = call(&app, request("GET", "/metrics", "")).await;
            let b = axum::body::to_bytes(resp.into_body(), usize::MAX)
                .await
                .unwrap();
            String::from_utf8_lossy(&b)
                .lines()
                .find_map(|l| l.strip_prefix("kvpool_engine_prompts_tokenized_total "))
                .map(|v| v.trim().parse::<u64>().unwrap())
                .unwrap_or(0)
        };
        let ids = r#"[256, 104, 105, 33]"#;
        let plain = format!(
            r#"{{"prompt": {ids}, "max_tokens": 4, "temperature": 0, "ignore_eos": true,
            "return_token_ids": true}}"#
        );
        let want =
            json_of(call(&app, request("POST", "/v1/completions", plain.clone())).await).await;
        assert_eq!(tokenized().await, 0, "a token-id prompt is not tokenized");
        for (path, body) in [
            (
                "/v1/completions",
                format!(
                    r#"{{"prompt": "other text", "kvpool_prompt_token_ids": {ids},
                    "max_tokens": 4, "temperature": 0, "ignore_eos": true,
                    "return_token_ids": true}}"#
                ),
            ),
            (
                "/v1/chat/completions",
                format!(
                    r#"{{"messages": [{{"role": "user", "content": "other"}}],
                    "kvpool_prompt_token_ids": {ids}, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": true, "return_token_ids": true}}"#
                ),
            ),
        ] {
            let v = json_of(call(&app, request("POST", path, body.clone())).await).await;
            assert_eq!(v["usage"]["prompt_tokens"], 4, "{path}: {v}");
            assert_eq!(
                v["choices"][0]["token_ids"], want["choices"][0]["token_ids"],
                "{path}: {v}"
            );
        }
        assert_eq!(tokenized().await, 0, "ids sent along skip the tokenizer");
        // The text alone is tokenized, and counted.
        let text = r#"{"prompt": "hi!", "max_tokens": 1}"#;
        assert_eq!(
            call(&app, request("POST", "/v1/completions", text))
                .await
                .status(),
            200
        );
        assert_eq!(tokenized().await, 1);
        // Ids are checked as a token-id prompt's are.
        let bad = r#"{"prompt": "x", "kvpool_prompt_token_ids": [4000000000], "max_tokens": 1}"#;
        let resp = call(&app, request("POST", "/v1/completions", bad)).await;
        assert_eq!(resp.status(), 400);
        let v = json_of(resp).await;
        assert!(
            v["message"]
                .as_str()
                .unwrap()
                .contains("outside the vocabulary"),
            "{v}"
        );
    });
}

/// The text as the whole of `ids` decodes (what the incremental text
/// must equal): invalid bytes as U+FFFD; unless `last`, an incomplete
/// tail held back (and a Hugging Face decoder's trailing U+FFFD).
fn whole_text(tok: &Tokenizer, ids: &[u32], last: bool) -> String {
    let bytes = tok.decode_bytes(ids);
    let mut out = String::new();
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                rest = &[];
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                out.push_str(std::str::from_utf8(valid).unwrap());
                match e.error_len() {
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        rest = &after[n..];
                    }
                    None => {
                        if last {
                            out.push(char::REPLACEMENT_CHARACTER);
                        }
                        rest = &[];
                    }
                }
            }
        }
    }
    if !last && matches!(tok, Tokenizer::Hf(_)) {
        let kept = out.trim_end_matches(char::REPLACEMENT_CHARACTER).len();
        out.truncate(kept);
    }
    out
}

/// Token by token, the incremental text (settled chunks and a short
/// window) is the whole sequence's decode; the streamed deltas add up to
/// it; a stop string cuts it where it first appears in the whole text.
#[test]
fn incremental_text_and_stops_equal_the_whole_decode_token_by_token() {
    use rand::{Rng, SeedableRng};
    let tok = Tokenizer::Bytes;
    // ASCII, the bytes of two- to four-byte characters, invalid bytes.
    let alphabet: Vec<u8> = [&b"abXY "[..], "é€😀".as_bytes(), &[0xff, 0x80, 0xe2]].concat();
    for seed in 0..200u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let stop = match seed % 3 {
            0 => None,
            1 => Some(Stop::One("XY".into())),
            _ => Some(Stop::Many(vec!["€Y".into(), "a a".into()])),
        };
        let stops: Vec<String> = match &stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        let mut t = TextState::new(stop);
        let mut ids = Vec::new();
        let mut sent = String::new();
        let mut stopped = false;
        for _ in 0..rng.random_range(1..300) {
            let id = u32::from(alphabet[rng.random_range(0..alphabet.len())]);
            ids.push(id);
            let want = whole_text(&tok, &ids, false);
            let first = stops.iter().filter_map(|s| want.find(s.as_str())).min();
            if t.push(id, &tok) {
                assert_eq!(
                    t.stopped.as_deref(),
                    Some(&want[..first.unwrap()]),
                    "seed {seed}"
                );
                stopped = true;
                break;
            }
            assert_eq!(first, None, "seed {seed}: a stop string missed in {want:?}");
            assert_eq!(t.text(&tok, false), want, "seed {seed}");
            sent.push_str(&t.delta(&tok, false));
            assert!(
                want.starts_with(&sent),
                "seed {seed}: {sent:?} is not a prefix of {want:?}"
            );
        }
        sent.push_str(&t.delta(&tok, true));
        let want = match stopped {
            true => t.stopped.clone().unwrap(),
            false => whole_text(&tok, &ids, true),
        };
        assert_eq!(sent, want, "seed {seed}: the deltas add up to the text");
    }
}

/// The same with a Hugging Face tokenizer whose decoder puts a space
/// between words (the window's context decides the space): token by
/// token, the text is the whole sequence's decode.
#[test]
fn incremental_text_of_spaced_words_equals_the_whole_decode() {
    use rand::{Rng, SeedableRng};
    let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":{"type":"WhitespaceSplit"},"post_processor":null,
"decoder":null,"model":{"type":"WordLevel","vocab":{"[UNK]":0,"a":1,"X":2,"Y":3,"\u00e9t\u00e9":4},
"unk_token":"[UNK]"}}"#;
    let hf: tokenizers::Tokenizer = json.parse().expect("tokenizer json");
    let tok = Tokenizer::Hf(Box::new(hf));
    assert_eq!(tok.decode_bytes(&[1, 2, 4]), "a X été".as_bytes());
    for seed in 0..50u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut t = TextState::new(Some(Stop::One("X Y".into())));
        let mut ids = Vec::new();
        for _ in 0..rng.random_range(1..100) {
            let id = rng.random_range(1..5u32);
            ids.push(id);
            let want = whole_text(&tok, &ids, false);
            if t.push(id, &tok) {
                let at = want
                    .find("X Y")
                    .expect("a stop where the whole text has one");
                assert_eq!(t.stopped.as_deref(), Some(&want[..at]), "seed {seed}");
                break;
            }
            assert!(!want.contains("X Y"), "seed {seed}: a stop string missed");
            assert_eq!(t.text(&tok, false), want, "seed {seed}");
        }
    }
}

/// A decoder that strips the first word's leading space (SentencePiece's
/// Metaspace), and a special token (skipped when decoding) between two
/// words: the word after it keeps its space, as in the whole decode.
#[test]
fn a_skipped_special_token_between_words_keeps_the_next_words_space() {
    let json = r#"{"version":"1.0","truncation":null,"padding":null,
"added_tokens":[{"id":3,"content":"<sep>","single_word":false,"lstrip":false,"rstrip":false,
"normalized":false,"special":true}],
"normalizer":null,"pre_tokenizer":null,"post_processor":null,
"decoder":{"type":"Metaspace","replacement":"\u2581","prepend_scheme":"always","split":true},
"model":{"type":"WordLevel","vocab":{"[UNK]":0,"\u2581world":1,"\u2581next":2,"<sep>":3},
"unk_token":"[UNK]"}}"#;
    let hf: tokenizers::Tokenizer = json.parse().expect("tokenizer json");
    let tok = Tokenizer::Hf(Box::new(hf));
    let ids = [3, 1, 3, 3, 2, 1];
    assert_eq!(tok.decode_bytes(&ids), "world next world".as_bytes());
    let mut t = TextState::new(None);
    let mut sent = String::new();
    for (i, &id) in ids.iter().enumerate() {
        t.push(id, &tok);
        assert_eq!(t.text(&tok, false), whole_text(&tok, &ids[..=i], false));
        sent.push_str(&t.delta(&tok, false));
    }
    sent.push_str(&t.delta(&tok, true));
    assert_eq!(sent, "world next world");
}
