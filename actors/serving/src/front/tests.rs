use super::*;

#[test]
fn requests_are_checked_before_any_work() {
    let r = Req::parse(br#"{"prompt": "hi"}"#, false).unwrap();
    assert_eq!(
        (r.max_tokens, r.stream, r.path),
        (Some(16), false, "/v1/completions")
    );
    let r = Req::parse(
        br#"{"prompt": [1, 2], "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 5}"#,
        false,
    )
    .unwrap();
    assert!(r.stream && r.include_usage);
    assert_eq!(r.max_tokens, Some(5));
    let r = Req::parse(br#"{"messages": [{"role": "user", "content": "x"}]}"#, true).unwrap();
    assert_eq!((r.max_tokens, r.path), (None, "/v1/chat/completions"));
    // echo is served here and not sent on to the engines.
    let r = Req::parse(br#"{"prompt": "say", "echo": true}"#, false).unwrap();
    assert_eq!(r.echo.as_deref(), Some("say"));
    assert!(r.body.get("echo").is_none());
    // n sequences: one decode each, so the engines get no n.
    let r = Req::parse(br#"{"prompt": "say", "n": 3}"#, false).unwrap();
    assert_eq!(r.n, 3);
    assert!(r.body.get("n").is_none());
    for (bad, chat) in [
        (&br#"{"prompt": ["a", "b"]}"#[..], false),
        (br#"{"prompt": [[1], [2]]}"#, false),
        (br#"{"prompt": 3}"#, false),
        (br#"[1]"#, false),
        (br#"{"messages": []}"#, true),
        (br#"{"prompt": "x", "n": 0}"#, false),
        (br#"{"prompt": "x", "n": 17}"#, false),
        (br#"{"prompt": "x", "n": "2"}"#, false),
        (b"not json", false),
        (br#"{"prompt": [1, 2], "echo": true}"#, false),
        (br#"{"prompt": "x", "echo": true, "logprobs": 1}"#, false),
        (br#"{"prompt": "x", "echo": 1}"#, false),
        (
            br#"{"messages": [{"role": "user", "content": "x"}], "echo": true}"#,
            true,
        ),
    ] {
        let e = Req::parse(bad, chat).err().expect("refused");
        assert_eq!(
            e.status,
            StatusCode::BAD_REQUEST,
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}

/// Pieces' logprobs join into one, field by field.
#[test]
fn logprobs_of_pieces_join_into_one() {
    let piece = |toks: &[&str], at: usize| {
        json!({"tokens": toks, "token_logprobs": vec![-1.0; toks.len()],
            "top_logprobs": vec![json!({}); toks.len()], "text_offset": [at]})
    };
    let mut acc = Value::Null;
    append_logprobs(&mut acc, piece(&["ab"], 0), false);
    append_logprobs(&mut acc, Value::Null, false);
    append_logprobs(&mut acc, piece(&["c"], 2), false);
    assert_eq!(acc["tokens"], json!(["ab", "c"]));
    assert_eq!(acc["text_offset"], json!([0, 2]));
    assert_eq!(acc["token_logprobs"].as_array().unwrap().len(), 2);
    let mut chat = Value::Null;
    for t in ["x", "y"] {
        let more = json!({"content": [{"token": t, "logprob": -0.5}]});
        append_logprobs(&mut chat, more, true);
    }
    assert_eq!(chat["content"][1]["token"], "y");
}

/// Finding 7 of the RESP/HTTP review: a token-id prompt is counted
/// before it is parsed into JSON values (and refused when longer than
/// the context).
#[test]
fn a_token_prompt_is_counted_without_being_built() {
    assert_eq!(
        token_prompt_len(br#"{"model": "m", "prompt": [1, 2, 3], "x": {"y": [4]}}"#),
        Some(3)
    );
    assert_eq!(token_prompt_len(br#"{"prompt": "text"}"#), None);
    assert_eq!(token_prompt_len(br#"{"messages": []}"#), None);
    assert_eq!(token_prompt_len(b"not json"), None);
    assert_eq!(
        token_prompt_len(br#"{"prompt": [1, 2, 3, 4], "prompt": [1]}"#),
        Some(4)
    );
    let mut big = b"{\"prompt\": [".to_vec();
    for _ in 0..40_000 {
        big.extend_from_slice(b"7,");
    }
    big.extend_from_slice(b"7]}");
    assert_eq!(token_prompt_len(&big), Some(40_001));
    assert!(check_context(40_001, 32_768).is_err());
    assert!(check_context(32_767, 32_768).is_ok());
}

#[test]
fn engine_failures_are_told_from_refusals() {
    let down = br#"{"error": {"message": "x", "code": "engine_down"}}"#;
    assert!(is_engine_failure(StatusCode::BAD_GATEWAY, down));
    assert!(!is_engine_failure(StatusCode::SERVICE_UNAVAILABLE, down));
    assert!(!is_engine_failure(StatusCode::BAD_GATEWAY, b"{}"));
}

#[test]
fn scheduler_settings_name_the_bad_key() {
    let mut cfg = ConductorConfig::default();
    let (p, cost, slo) = scheduler_settings(&cfg, 16).unwrap();
    assert_eq!(p, Policy::PredictiveReject);
    assert_eq!(cost.block_tokens, 16);
    assert_eq!(slo.tbt_ms, 100.0);
    cfg.policy = "fastest".into();
    let e = scheduler_settings(&cfg, 16).unwrap_err();
    assert!(e.to_string().contains("serving.conductor.policy"), "{e}");
    cfg.policy = "cache_global".into();
    cfg.cost_model = "/nonexistent/model.toml".into();
    let e = scheduler_settings(&cfg, 16).unwrap_err();
    assert!(
        e.to_string().contains("serving.conductor.cost_model"),
        "{e}"
    );
}
