//! The engine role end to end: real `kvpool run` processes (a pool, engines
//! with `builtin:tiny`), the pool client over TCP between them, and the
//! engine's HTTP API.

use crate::common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::byte_prompt as prompt;
use common::{cli, config_file, engine_pool as pool, start, tiny_engine as engine, Proc};
use serde_json::{json, Value};

/// A POST with a JSON body; returns (status, body).
fn post(addr: &str, path: &str, body: &Value) -> (u16, String) {
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(addr).expect("connect engine");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read answer");
    let (head, body) = out.split_once("\r\n\r\n").expect("http answer");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status");
    (status, body.to_string())
}

fn post_json(addr: &str, path: &str, body: &Value) -> Value {
    let (status, text) = post(addr, path, body);
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
}

/// Waits (30 s at most) until `engine` counts at least `n` chunks stored;
/// a wait that runs out names the stores that failed and shows the engine's
/// log.
fn wait_stored(engine: &Proc, what: &str, n: f64) {
    common::eventually_blocking(what, Duration::from_secs(30), || -> Result<(), String> {
        let stored = common::metric(&engine.addr, "kvpool_engine_chunks_stored_total");
        if stored >= n {
            return Ok(());
        }
        Err(format!(
            "{stored} stored, {} failed; the engine's log, last line first:\n{}",
            common::metric(&engine.addr, "kvpool_engine_chunks_store_failed_total"),
            engine.stderr_tail(20)
        ))
    });
}

/// Engine processes share this config: the pool client over TCP only, and
/// no location cache. The tests corrupt a chunk by replacing its object
/// (`flip_a_bit`, another client); an engine that read the chunk before
/// would read the bytes it read (kept by its read lease) until the lease
/// ends, as every client of the pool may (docs/architecture/client.md, "Repeated
/// gets take one round trip"), instead of the corrupt ones these tests are
/// about.
const TCP_CONFIG: &str = "[client]\ntransport = \"tcp\"\nlocation_cache_entries = 0\n";

fn greedy(engine: &Proc, prompt: &[u32], max_tokens: usize, kvp: Option<Value>) -> Value {
    let mut body = json!({"model": "builtin:tiny", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    if let Some(k) = kvp {
        body["kv_transfer_params"] = k;
    }
    post_json(&engine.addr, "/v1/completions", &body)
}

fn token_ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The `chunk_keys` of a prefill answer's `kv_transfer_params`.
fn chunk_keys(kvp: &Value) -> Vec<String> {
    kvp["chunk_keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_string())
        .collect()
}

/// Replaces the object `key` with its bytes but one bit in the middle;
/// returns the original bytes.
fn flip_a_bit(pool: &Proc, key: &str) -> Vec<u8> {
    let (code, bytes, err) = cli(&pool.addr, &["get", key], None);
    assert_eq!(code, 0, "{err}");
    let mut bad = bytes.clone();
    let at = bad.len() / 2;
    bad[at] ^= 0x10;
    assert_eq!(cli(&pool.addr, &["rm", "--force", key], None).0, 0);
    let (code, _, err) = cli(&pool.addr, &["put", key], Some(&bad));
    assert_eq!(code, 0, "{err}");
    bytes
}

#[test]
fn greedy_output_with_pool_kv_equals_scratch_and_a_corrupt_chunk_is_recomputed() {
    let pool = pool();
    let cfg = config_file("tcp", TCP_CONFIG);
    let scratch_engine = engine(None, &cfg);
    let prefill = engine(Some(&pool.addr), &cfg);
    let decode = engine(Some(&pool.addr), &cfg);
    let p = prompt(700, 1);

    let scratch = greedy(&scratch_engine, &p, 32, None);
    let want = token_ids(&scratch);
    assert_eq!(want.len(), 32);
    assert_eq!(scratch["kvpool"]["prompt_tokens_computed"], 700);

    // P/D: the prefill engine computes the prompt and puts its two full
    // chunks in the pool before it answers.
    let pre = greedy(&prefill, &p, 1, Some(json!({"do_remote_decode": true})));
    assert_eq!(token_ids(&pre)[0], want[0]);
    let kvp = pre["kv_transfer_params"].clone();
    assert_eq!(kvp["do_remote_prefill"], true, "{pre}");
    assert_eq!(kvp["num_tokens"], 700);
    assert_eq!(kvp["pool"], pool.addr.as_str());
    let keys = chunk_keys(&kvp);
    assert_eq!(keys.len(), 2, "{kvp}");
    assert_eq!(
        common::metric(&prefill.addr, "kvpool_engine_chunks_stored_total"),
        2.0
    );

    // The decode engine (another process) reads both chunks over TCP and
    // computes only the 188 tokens after them.
    let mut dec_req = kvp.clone();
    dec_req["do_remote_prefill"] = true.into();
    let out = greedy(&decode, &p, 32, Some(dec_req.clone()));
    assert_eq!(token_ids(&out), want, "decode with imported KV");
    assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 512);
    assert_eq!(out["kvpool"]["prompt_tokens_computed"], 188);
    assert_eq!(
        common::metric(&decode.addr, "kvpool_engine_chunks_loaded_total"),
        2.0
    );

    // Corrupt the second chunk in the pool: one payload bit flipped.
    let bytes = flip_a_bit(&pool, &keys[1]);

    let out = greedy(&decode, &p, 32, Some(dec_req));
    assert_eq!(token_ids(&out), want, "decode after a corrupt chunk");
    assert_eq!(out["kvpool"]["chunks_refused"], 1);
    assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 256);
    assert_eq!(out["kvpool"]["prompt_tokens_computed"], 444);
    assert_eq!(
        common::metric(&decode.addr, "kvpool_engine_chunks_refused_total"),
        1.0
    );

    // The refused chunk was replaced by the recomputed one: a plain request
    // (lookup by batch exists) now loads both again, and the bytes are the
    // original ones.
    wait_stored(&decode, "the recomputed chunk to be stored", 1.0);
    let (code, again, _) = cli(&pool.addr, &["get", &keys[1]], None);
    assert_eq!(code, 0);
    assert_eq!(
        again, bytes,
        "the recomputed chunk is byte for byte the first one"
    );
    let out = greedy(&decode, &p, 32, None);
    assert_eq!(token_ids(&out), want);
    assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 512);
    assert_eq!(out["kvpool"]["chunks_refused"], 0);

    // An object longer than any chunk under the key (it does not even fit
    // the block) is refused and replaced the same way.
    let mut long = bytes.clone();
    long.push(0);
    assert_eq!(cli(&pool.addr, &["rm", "--force", &keys[1]], None).0, 0);
    let (code, _, err) = cli(&pool.addr, &["put", &keys[1]], Some(&long));
    assert_eq!(code, 0, "{err}");
    let stored_before = common::metric(&decode.addr, "kvpool_engine_chunks_stored_total");
    let out = greedy(&decode, &p, 32, Some(kvp.clone()));
    assert_eq!(token_ids(&out), want, "decode after an oversized chunk");
    assert_eq!(out["kvpool"]["chunks_refused"], 1);
    assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 256);
    assert_eq!(
        common::metric(&decode.addr, "kvpool_engine_chunks_refused_total"),
        2.0
    );
    wait_stored(
        &decode,
        "the recomputed chunk to be stored again",
        stored_before + 1.0,
    );
    let (code, again, _) = cli(&pool.addr, &["get", &keys[1]], None);
    assert_eq!(code, 0);
    assert_eq!(again, bytes);
}

/// The pool key of group `g` of the chunk named `key` (its last group's key).
fn group_key(key: &str, g: usize, groups: usize) -> String {
    let last = format!("-g{}of{groups}@", groups - 1);
    assert!(key.contains(&last), "{key}");
    key.replace(&last, &format!("-g{g}of{groups}@"))
}

#[test]
fn layer_wise_streamed_kv_gives_the_scratch_tokens_loaded_streamed_or_whole() {
    let pool = pool();
    let plain = config_file("tcp", TCP_CONFIG);
    // builtin:tiny has four layers: one pool object per layer of a chunk.
    let streaming = config_file(
        "stream",
        &format!("{TCP_CONFIG}[engine]\nkv_layer_groups = 4\nkv_stream = true\n"),
    );
    let whole = config_file(
        "groups",
        &format!("{TCP_CONFIG}[engine]\nkv_layer_groups = 4\n"),
    );
    let scratch_engine = engine(None, &plain);
    let prefill = engine(Some(&pool.addr), &streaming);
    let decode = engine(Some(&pool.addr), &streaming);
    let reader = engine(Some(&pool.addr), &whole);
    let p = prompt(700, 11);
    let want = token_ids(&greedy(&scratch_engine, &p, 24, None));

    // The prefill engine streams each layer of both full chunks as the
    // piece computing the chunk finishes it; it answers once all are in.
    let pre = greedy(&prefill, &p, 1, Some(json!({"do_remote_decode": true})));
    assert_eq!(token_ids(&pre)[0], want[0]);
    let kvp = pre["kv_transfer_params"].clone();
    let keys = chunk_keys(&kvp);
    assert_eq!(keys.len(), 2, "{kvp}");
    assert_eq!(
        common::metric(&prefill.addr, "kvpool_engine_chunks_stored_total"),
        2.0
    );
    for key in &keys {
        for g in 0..4 {
            let (code, _, err) = cli(&pool.addr, &["get", &group_key(key, g, 4)], None);
            assert_eq!(code, 0, "group {g} of {key}: {err}");
        }
    }

    // The decode engine starts the prompt's last piece while the prefix
    // arrives layer by layer.
    let mut dec_req = kvp.clone();
    dec_req["do_remote_prefill"] = true.into();
    let out = greedy(&decode, &p, 24, Some(dec_req.clone()));
    assert_eq!(token_ids(&out), want, "streamed load");
    assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 512);
    assert_eq!(out["kvpool"]["prompt_tokens_computed"], 188);
    assert!(common::metric(&decode.addr, "kvpool_engine_kv_stream_wait_seconds_count") >= 1.0);

    // An engine that does not stream (same layout) loads the chunks whole.
    let out = greedy(&reader, &p, 24, None);
    assert_eq!(token_ids(&out), want, "streamed chunks loaded whole");
    assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 512);

    // Layer 2 of the second chunk corrupted: the streamed load stops there,
    // the piece that had started is run again from the first chunk.
    let bad_key = group_key(&keys[1], 2, 4);
    let bytes = flip_a_bit(&pool, &bad_key);
    let out = greedy(&decode, &p, 24, Some(dec_req));
    assert_eq!(
        token_ids(&out),
        want,
        "a refused streamed layer is recomputed"
    );
    assert_eq!(out["kvpool"]["chunks_refused"], 1);
    assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 256);
    assert_eq!(out["kvpool"]["prompt_tokens_computed"], 444);
    assert_eq!(
        common::metric(&decode.addr, "kvpool_engine_chunks_refused_total"),
        1.0
    );
    common::eventually_blocking(
        "the recomputed layer to be stored",
        Duration::from_secs(30),
        || {
            let (code, again, _) = cli(&pool.addr, &["get", &bad_key], None);
            code == 0 && again == bytes
        },
    );
}

#[test]
fn a_second_request_sharing_k_chunks_computes_only_the_rest() {
    let pool = pool();
    let cfg = config_file("share", TCP_CONFIG);
    let e = engine(Some(&pool.addr), &cfg);
    let first = prompt(3 * 256 + 50, 7);
    let out = greedy(&e, &first, 4, None);
    assert_eq!(out["kvpool"]["prompt_tokens_computed"], 818);
    wait_stored(&e, "three chunks stored", 3.0);

    // Shares k = 2 full chunks, then 100 different tokens.
    let mut second = first[..512].to_vec();
    second.extend(prompt(101, 8).into_iter().skip(1));
    assert_eq!(second.len(), 612);
    let computed_before = common::metric(&e.addr, "kvpool_engine_prompt_tokens_computed_total");
    let loaded_before = common::metric(&e.addr, "kvpool_engine_prompt_tokens_loaded_total");
    let out = greedy(&e, &second, 4, None);
    assert_eq!(
        common::metric(&e.addr, "kvpool_engine_prompt_tokens_computed_total") - computed_before,
        100.0
    );
    assert_eq!(
        common::metric(&e.addr, "kvpool_engine_prompt_tokens_loaded_total") - loaded_before,
        512.0
    );
    assert_eq!(out["usage"]["prompt_tokens_details"]["cached_tokens"], 512);

    // The same prompt again: every chunk but the one holding the last token
    // is loaded (that token's logits start the generation).
    let exact = first[..768].to_vec();
    let out = greedy(&e, &exact, 4, None);
    assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 512);
    assert_eq!(out["kvpool"]["prompt_tokens_computed"], 256);
}

#[test]
fn an_engine_whose_pool_is_down_serves_and_uses_the_pool_once_it_is_up() {
    // An address with nothing behind it yet.
    let master = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let cfg = config_file("down", TCP_CONFIG);
    let e = engine(Some(&master), &cfg);
    let p = prompt(600, 5);
    let out = greedy(&e, &p, 4, None);
    assert_eq!(token_ids(&out).len(), 4);
    assert_eq!(out["kvpool"]["prompt_tokens_computed"], 600);
    // A P/D prefill answers too, naming no chunk (none is in the pool).
    let pre = greedy(&e, &p, 1, Some(json!({"do_remote_decode": true})));
    assert_eq!(pre["kv_transfer_params"]["chunk_keys"], json!([]), "{pre}");
    assert_eq!(pre["kv_transfer_params"]["pool"], master.as_str());

    // The pool comes up at that address: the engine reaches it on its own
    // and its prefills store their chunks there.
    let _pool = start(
        "all",
        &[
            "--listen",
            &master,
            "--data-listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--shards",
            "1",
            "--segment-size",
            "256MiB",
        ],
    );
    common::eventually_blocking(
        "the engine to store its chunks in the pool",
        Duration::from_secs(30),
        || {
            let pre = greedy(&e, &p, 1, Some(json!({"do_remote_decode": true})));
            pre["kv_transfer_params"]["chunk_keys"]
                .as_array()
                .is_some_and(|k| k.len() == 2)
        },
    );
}

#[test]
fn http_api_streams_tokenizes_and_refuses_bad_requests() {
    let cfg = config_file("api", "[engine]\nmax_num_seqs = 4\n");
    let e = engine(None, &cfg);
    let (status, _) = common::http(&e.addr, "GET", "/health");
    assert_eq!(status, 200);
    let (status, models) = common::http(&e.addr, "GET", "/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "builtin:tiny");

    let tok = post_json(&e.addr, "/tokenize", &json!({"prompt": "hi"}));
    assert_eq!(tok["tokens"], json!([256, 104, 105]));
    assert_eq!(tok["count"], 3);

    // Streaming text equals the non-streamed text of the same greedy request.
    let body = json!({"prompt": "The pool holds", "max_tokens": 20, "temperature": 0,
        "ignore_eos": true});
    let plain = post_json(&e.addr, "/v1/completions", &body);
    let mut sbody = body.clone();
    sbody["stream"] = true.into();
    let (status, raw) = post(&e.addr, "/v1/completions", &sbody);
    assert_eq!(status, 200);
    let events: Vec<&str> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{raw}");
    let mut text = String::new();
    let mut finish = Value::Null;
    for ev in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(ev).unwrap();
        text.push_str(v["choices"][0]["text"].as_str().unwrap());
        if !v["choices"][0]["finish_reason"].is_null() {
            finish = v["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(text, plain["choices"][0]["text"].as_str().unwrap());
    assert_eq!(finish, "length");

    // Chat, streamed: the first delta names the role.
    let chat = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
        "temperature": 0, "stream": true, "ignore_eos": true});
    let (status, raw) = post(&e.addr, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{raw}");
    let first: Value =
        serde_json::from_str(raw.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");

    // Seeded sampling repeats; another seed differs.
    let sample = |seed: u64| {
        let v = post_json(
            &e.addr,
            "/v1/completions",
            &json!({"prompt": "abc", "max_tokens": 24,
            "temperature": 1.5, "top_p": 0.95, "seed": seed, "ignore_eos": true, "return_token_ids": true}),
        );
        token_ids(&v)
    };
    assert_eq!(sample(11), sample(11));
    assert_ne!(sample(11), sample(12));

    // A stop string ends the text before its first occurrence (two
    // characters of the greedy text itself, so it does occur).
    let full = plain["choices"][0]["text"].as_str().unwrap().to_string();
    let stop: String = full.chars().skip(3).take(2).collect();
    assert_eq!(stop.chars().count(), 2, "greedy text too short: {full:?}");
    let v = post_json(
        &e.addr,
        "/v1/completions",
        &json!({"prompt": "The pool holds",
        "max_tokens": 20, "temperature": 0, "ignore_eos": true, "stop": stop}),
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let cut = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(cut, &full[..full.find(&stop).unwrap()], "{full:?}");

    // Concurrent streams all finish (decode steps batch them).
    let addr = e.addr.clone();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let v = post_json(&addr, "/v1/completions", &json!({"prompt": format!("request {i}"),
                    "max_tokens": 16, "temperature": 0, "ignore_eos": true, "return_token_ids": true}));
                token_ids(&v).len()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 16);
    }

    // Bad requests get vLLM-style errors.
    let (status, body) = post(
        &e.addr,
        "/v1/completions",
        &json!({"model": "other", "prompt": "x"}),
    );
    assert_eq!(status, 404, "{body}");
    let (status, body) = post(
        &e.addr,
        "/v1/completions",
        &json!({"prompt": [1, 2, 999999]}),
    );
    assert_eq!(status, 400, "{body}");
    let (status, body) = post(
        &e.addr,
        "/v1/completions",
        &json!({"prompt": "x", "top_p": 0}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("top_p"), "{body}");
    // n sequences: 1 to 16.
    for n in [0, 17] {
        let (status, body) = post(&e.addr, "/v1/completions", &json!({"prompt": "x", "n": n}));
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("n must be"), "{body}");
    }
    let long = vec![65u32; 40_000];
    let (status, body) = post(&e.addr, "/v1/completions", &json!({"prompt": long}));
    assert_eq!(status, 400, "{body}");
    let (status, body) = post(
        &e.addr,
        "/v1/completions",
        &json!({"prompt": "x",
        "kv_transfer_params": {"do_remote_prefill": true, "chunk_keys": ["nope"]}}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("chunk_keys[0]"), "{body}");
}

#[test]
fn a_bad_model_folder_stops_start_up_naming_file_and_field() {
    let dir = std::env::temp_dir().join(format!("kvpool-engine-badmodel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |dir: &std::path::Path| {
        let out = common::wait_output(
            std::process::Command::new(common::BIN)
                .args([
                    "run",
                    "--role",
                    "engine",
                    "--listen",
                    "127.0.0.1:0",
                    "--model",
                ])
                .arg(dir)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
            Duration::from_secs(60),
        );
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&dir);
    assert_eq!(code, Some(2));
    assert!(err.contains("config.json: (file): missing"), "{err}");

    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}"#,
    )
    .unwrap();
    let (code, err) = run(&dir);
    assert_eq!(code, Some(2));
    assert!(err.contains("config.json: architectures:"), "{err}");

    std::fs::write(
        dir.join("config.json"),
        json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "vocab_size": 300, "num_hidden_layers": 1,
            "num_attention_heads": 4, "rms_norm_eps": 1e-5, "max_position_embeddings": 64})
        .to_string(),
    )
    .unwrap();
    let (code, err) = run(&dir);
    assert_eq!(code, Some(2));
    assert!(err.contains("tokenizer.json: (file): missing"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 30, item 1: a client that goes away stops its request. The engine
/// drops the sequence at its next step (no more prefill or decode for it,
/// its KV freed), says so in /metrics, and serves the next request.
#[test]
fn an_abandoned_request_is_cancelled_at_the_next_step_and_counted() {
    let cfg = config_file("cancel", "[engine]\nchunk_tokens = 16\n");
    let e = engine(None, &cfg);
    assert_eq!(
        common::metric(&e.addr, "kvpool_engine_requests_cancelled_total"),
        0.0
    );
    // Up to the context's end: far more work than the test waits for.
    let body = json!({"prompt": prompt(8000, 21), "max_tokens": 24_000, "temperature": 0,
        "ignore_eos": true})
    .to_string();
    let mut s = std::net::TcpStream::connect(&e.addr).expect("connect engine");
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        e.addr,
        body.len()
    )
    .unwrap();
    common::eventually_blocking(
        "the long request's prefill",
        Duration::from_secs(30),
        || common::metric(&e.addr, "kvpool_engine_prompt_tokens_computed_total") > 0.0,
    );
    drop(s);
    common::eventually_blocking(
        "the abandoned request's cancellation",
        Duration::from_secs(30),
        || common::metric(&e.addr, "kvpool_engine_requests_cancelled_total") == 1.0,
    );
    let work = || {
        (
            common::metric(&e.addr, "kvpool_engine_prompt_tokens_computed_total"),
            common::metric(&e.addr, "kvpool_engine_generated_tokens_total"),
        )
    };
    let stopped = work();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(work(), stopped, "the engine kept working for a gone client");
    assert!(stopped.1 < 24_000.0, "{stopped:?}");
    // The engine is free for the next request.
    let t0 = Instant::now();
    let v = greedy(&e, &prompt(20, 22), 4, None);
    assert_eq!(token_ids(&v).len(), 4);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

/// vLLM's metric names (issue 30): dashboards and tools written for vLLM
/// read the same counts from kvpool's engine, labelled `model_name`.
#[test]
fn vllms_metric_names_count_what_ours_count() {
    let cfg = config_file("vllm-names", "");
    let e = engine(None, &cfg);
    for seed in [1, 2] {
        greedy(&e, &prompt(50, seed), 4, None);
    }
    let (status, text) = common::http(&e.addr, "GET", "/metrics");
    assert_eq!(status, 200);
    // One series per name, `name{model_name="builtin:tiny"} value`.
    let vllm = |name: &str| -> f64 {
        let want = format!("{name}{{model_name=\"builtin:tiny\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&want))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
    };
    assert_eq!(vllm("vllm:prompt_tokens_total"), 100.0);
    assert_eq!(
        common::metric(&e.addr, "kvpool_engine_prompt_tokens_total"),
        100.0
    );
    assert_eq!(vllm("vllm:generation_tokens_total"), 8.0);
    assert_eq!(
        common::metric(&e.addr, "kvpool_engine_generated_tokens_total"),
        8.0
    );
    assert_eq!(vllm("vllm:time_to_first_token_seconds_count"), 2.0);
    assert_eq!(vllm("vllm:e2e_request_latency_seconds_count"), 2.0);
    assert!(
        vllm("vllm:e2e_request_latency_seconds_sum")
            >= vllm("vllm:time_to_first_token_seconds_sum")
    );
    // The gauges are set at the end of the model thread's step, which may
    // come just after the answer that step finished was sent.
    common::eventually_blocking(
        "the running and waiting gauges to read 0",
        Duration::from_secs(30),
        || {
            let (_, text) = common::http(&e.addr, "GET", "/metrics");
            ["vllm:num_requests_running", "vllm:num_requests_waiting"]
                .iter()
                .all(|n| text.contains(&format!("{n}{{model_name=\"builtin:tiny\"}} 0\n")))
        },
    );
}
