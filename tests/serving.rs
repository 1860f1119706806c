//! The serving path end to end, every part a real process on real sockets:
//! a pool (`kvpool run --no-serving`), engines (`--role engine`, builtin:tiny),
//! proxies (`--role prefill-proxy`, `--role decode-proxy`) and the conductor
//! (`--role conductor`), or role all with its serving half; clients are raw
//! HTTP, `kvpool chat`, `kvpool bench serve`, and Python's `openai` package.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::byte_prompt as prompt;
use common::{config_file, engine_pool as pool, start, tiny_engine as engine, Proc};
use serde_json::{json, Value};

mod clients;
use clients::*;

/// A config whose serving parts probe and poll quickly (so that a failure
/// shows soon), with `conductor` added to `[serving.conductor]` and `more`
/// (whole sections) after.
fn fast(conductor: &str, more: &str) -> String {
    format!(
        "[serving.conductor]\nload_poll_ms = 50\n{conductor}\n\
         [serving.prefill_proxy]\nprobe_interval_ms = 100\n\
         [serving.decode_proxy]\nprobe_interval_ms = 100\n{more}"
    )
}

const TCP: &str = "[client]\ntransport = \"tcp\"\n";

fn proxy(role: &'static str, engine: &str, config: &str) -> Proc {
    start(
        role,
        &[
            "--listen",
            "127.0.0.1:0",
            "--engine",
            engine,
            "--config",
            config,
        ],
    )
}

fn conductor(
    prefill: &[&Proc],
    decode: &[&Proc],
    master: &str,
    config: &str,
    extra: &[&str],
) -> Proc {
    let list = |ps: &[&Proc]| {
        ps.iter()
            .map(|p| p.addr.clone())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (p, d) = (list(prefill), list(decode));
    let mut args = vec![
        "--listen",
        "127.0.0.1:0",
        "--prefill",
        &p,
        "--decode",
        &d,
        "--master",
        master,
        "--config",
        config,
    ];
    args.extend_from_slice(extra);
    start("conductor", &args)
}

/// An HTTP answer: status, headers (lower-case names), body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

fn send(addr: &str, path: &str, body: &Value, headers: &[(&str, &str)]) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// Reads the head of an HTTP answer.
fn read_head(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    (status, headers)
}

/// A POST, the whole answer read (chunked bodies de-chunked).
fn post(addr: &str, path: &str, body: &Value, headers: &[(&str, &str)]) -> Answer {
    let mut r = BufReader::new(send(addr, path, body, headers));
    let (status, headers) = read_head(&mut r);
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut body = String::new();
    if chunked {
        for data in chunks(&mut r) {
            body.push_str(&data);
        }
    } else {
        r.read_to_string(&mut body).unwrap();
    }
    Answer {
        status,
        headers,
        body,
    }
}

/// The data of a chunked body, chunk by chunk, until its end (or EOF).
fn chunks(r: &mut BufReader<TcpStream>) -> impl Iterator<Item = String> + '_ {
    std::iter::from_fn(move || {
        let mut size = String::new();
        if r.read_line(&mut size).ok()? == 0 {
            return None;
        }
        let n = usize::from_str_radix(size.trim(), 16).ok()?;
        if n == 0 {
            return None;
        }
        let mut buf = vec![0; n + 2];
        r.read_exact(&mut buf).ok()?;
        buf.truncate(n);
        Some(String::from_utf8_lossy(&buf).into_owned())
    })
}

/// The `data:` payloads of an SSE body.
fn events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

fn post_ok(addr: &str, path: &str, body: &Value) -> Value {
    let a = post(addr, path, body, &[]);
    assert_eq!(a.status, 200, "{path}: {}", a.body);
    a.json()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not token ids: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn greedy(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"model": "builtin:tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "return_token_ids": true})
}

/// A disaggregated pair over TCP: a pool, a prefill and a decode engine
/// with their proxies, a front over them, and one engine alone (`mono`,
/// no pool) to compare answers with.
struct Pd {
    _pool: Proc,
    mono: Proc,
    pe: Proc,
    de: Proc,
    front: Proc,
    _proxies: [Proc; 2],
}

fn pd(tag: &str) -> Pd {
    let pool = pool();
    let cfg = config_file(tag, &fast("", TCP));
    let mono = engine(None, &cfg);
    let pe = engine(Some(&pool.addr), &cfg);
    let de = engine(Some(&pool.addr), &cfg);
    let pp = proxy("prefill-proxy", &pe.addr, &cfg);
    let dp = proxy("decode-proxy", &de.addr, &cfg);
    let front = conductor(&[&pp], &[&dp], &pool.addr, &cfg, &[]);
    Pd {
        _pool: pool,
        mono,
        pe,
        de,
        front,
        _proxies: [pp, dp],
    }
}

/// A text prompt (and a chat) through the front is tokenized once: by the
/// front's `/tokenize` call; the prefill and decode engines take the ids
/// along (`kvpool_prompt_token_ids`) and answer as one engine does. The
/// front's own fields from a client (`kvpool_prompt_token_ids`, and
/// `kvpool_resume`, which would make the decode engine treat the prompt's
/// last tokens as its answer) are not passed on.
#[test]
fn a_text_prompt_through_the_front_is_tokenized_once_and_answers_as_one_engine() {
    let c = pd("tok-once");
    let (mono, pe, de, front) = (&c.mono, &c.pe, &c.de, &c.front);
    let tokenized = || {
        common::metric(&pe.addr, "kvpool_engine_prompts_tokenized_total")
            + common::metric(&de.addr, "kvpool_engine_prompts_tokenized_total")
    };
    let text = "a prompt of plain text, tokenized by the front once. ".repeat(12);
    let completion = json!({"model": "builtin:tiny", "prompt": text, "max_tokens": 12,
        "temperature": 0, "ignore_eos": true, "return_token_ids": true,
        "kvpool_prompt_token_ids": [1, 2, 3],
        "kvpool_resume": {"generated_tokens": 8, "text_sent_bytes": 5, "chat": false}});
    let chat = json!({"model": "builtin:tiny", "max_tokens": 12, "temperature": 0,
        "ignore_eos": true, "return_token_ids": true,
        "messages": [{"role": "user", "content": text}]});
    for (path, body) in [
        ("/v1/completions", &completion),
        ("/v1/chat/completions", &chat),
    ] {
        let mut alone = body.clone();
        let fields = alone.as_object_mut().unwrap();
        fields.remove("kvpool_prompt_token_ids");
        fields.remove("kvpool_resume");
        let want = post_ok(&mono.addr, path, &alone);
        let before = tokenized();
        let got = post_ok(&front.addr, path, body);
        assert_eq!(
            tokenized() - before,
            1.0,
            "{path}: the prompt is tokenized once, by the front's /tokenize"
        );
        assert_eq!(
            got["usage"]["prompt_tokens"], want["usage"]["prompt_tokens"],
            "{path}: {got}"
        );
        assert_eq!(
            ids(&got["choices"][0]["token_ids"]),
            ids(&want["choices"][0]["token_ids"]),
            "{path}: the answer through the front is one engine's"
        );
        let text = |v: &Value| {
            let c = &v["choices"][0];
            c["text"]
                .as_str()
                .or(c["message"]["content"].as_str())
                .map(str::to_owned)
        };
        assert_eq!(text(&got), text(&want), "{path}: the same text");
    }
}

/// A counter from `addr`'s /metrics that must be there.
fn counter(addr: &str, name: &str) -> f64 {
    let (status, text) = common::http(addr, "GET", "/metrics");
    assert_eq!(status, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no counter {name} at {addr}"))
}

/// A prompt through the front is looked up in the pool once: the front's
/// lookup (the one it routes by) goes to the prefill engine as
/// `kvpool_pool_prefix`, which reads that many chunks without a lookup of
/// its own. Asked directly, the engine looks up itself; a count that is
/// wrong either way costs reads or recomputation, never other KV: the
/// answers stay one engine's.
#[test]
fn a_prompt_through_the_front_is_looked_up_in_the_pool_once() {
    let c = pd("lookup-once");
    let (mono, pe, front) = (&c.mono, &c.pe, &c.front);
    let lookups = || counter(&pe.addr, "kvpool_engine_pool_lookups_total");
    let loaded = || counter(&pe.addr, "kvpool_engine_prompt_tokens_loaded_total");
    let answer = |addr: &str, body: &Value| {
        ids(&post_ok(addr, "/v1/completions", body)["choices"][0]["token_ids"])
    };
    let p = prompt(700, 21);
    let want = answer(&mono.addr, &greedy(&p, 8));
    // Through the front, twice: the second finds the first's two chunks.
    for round in 0..2 {
        let (l0, k0) = (lookups(), loaded());
        assert_eq!(answer(&front.addr, &greedy(&p, 8)), want, "round {round}");
        assert_eq!(
            lookups() - l0,
            0.0,
            "round {round}: the prefill engine looked up again"
        );
        assert_eq!(
            loaded() - k0,
            [0.0, 512.0][round],
            "round {round}: tokens loaded"
        );
    }
    // Directly, without the count: the engine's own lookup finds them.
    let (l0, k0) = (lookups(), loaded());
    assert_eq!(answer(&pe.addr, &greedy(&p, 8)), want, "direct");
    assert_eq!(
        lookups() - l0,
        1.0,
        "the engine looks up a prompt sent without the count"
    );
    assert_eq!(loaded() - k0, 512.0);
    // A count of 0: nothing read, nothing looked up, the same answer.
    let mut zero = greedy(&p, 8);
    zero["kvpool_pool_prefix"] = json!(0);
    let (l0, k0) = (lookups(), loaded());
    assert_eq!(answer(&pe.addr, &zero), want, "count 0");
    assert_eq!((lookups() - l0, loaded() - k0), (0.0, 0.0));
    // A count for chunks the pool does not hold (a new prompt): the first
    // read misses and ends the run; the prompt is computed.
    let q = prompt(700, 22);
    let want_q = answer(&mono.addr, &greedy(&q, 8));
    let mut over = greedy(&q, 8);
    over["kvpool_pool_prefix"] = json!(1_000_000);
    let (l0, k0) = (lookups(), loaded());
    assert_eq!(answer(&pe.addr, &over), want_q, "a count too high");
    assert_eq!((lookups() - l0, loaded() - k0), (0.0, 0.0));
}

#[test]
fn disaggregated_greedy_output_equals_one_engine_and_a_shared_prefix_is_loaded() {
    let c = pd("pd");
    let (mono, pe, de, front) = (&c.mono, &c.pe, &c.de, &c.front);

    // One engine alone, then the same request through the front: prefill
    // on one process, KV through the pool, decode on another.
    let p = prompt(700, 1);
    let want =
        ids(&post_ok(&mono.addr, "/v1/completions", &greedy(&p, 32))["choices"][0]["token_ids"]);
    let a = post(
        &front.addr,
        "/v1/completions",
        &greedy(&p, 32),
        &[("X-Request-Id", "pd-1")],
    );
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.header("x-request-id"), Some("pd-1"));
    let v = a.json();
    assert_eq!(
        ids(&v["choices"][0]["token_ids"]),
        want,
        "disaggregated != monolithic"
    );
    assert_eq!(v["id"], "cmpl-pd-1");
    assert_eq!(v["usage"]["prompt_tokens"], 700);
    assert_eq!(v["usage"]["completion_tokens"], 32);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // The id reached both engines.
    assert_eq!(v["kvpool"]["prefill_answer_id"], "cmpl-pd-1", "{v}");
    assert_eq!(v["kvpool"]["decode_answer_id"], "cmpl-pd-1", "{v}");
    // The prefill engine computed the prompt; the decode engine loaded its
    // two full chunks from the pool and computed the 188 tokens after them.
    assert_eq!(
        common::metric(&pe.addr, "kvpool_engine_prompt_tokens_computed_total"),
        700.0
    );
    assert_eq!(
        common::metric(&de.addr, "kvpool_engine_prompt_tokens_loaded_total"),
        512.0
    );
    assert_eq!(
        common::metric(&de.addr, "kvpool_engine_prompt_tokens_computed_total"),
        188.0
    );

    // A second prompt sharing k = 2 chunks: prefill computes only the rest,
    // and the streamed answer still equals one engine's.
    let mut second = p[..512].to_vec();
    second.extend(prompt(101, 9).into_iter().skip(1));
    let want2 = ids(
        &post_ok(&mono.addr, "/v1/completions", &greedy(&second, 24))["choices"][0]["token_ids"],
    );
    let computed = common::metric(&pe.addr, "kvpool_engine_prompt_tokens_computed_total");
    let loaded = common::metric(&pe.addr, "kvpool_engine_prompt_tokens_loaded_total");
    let mut body = greedy(&second, 24);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let a = post(&front.addr, "/v1/completions", &body, &[]);
    assert_eq!(a.status, 200, "{}", a.body);
    let rid = a
        .header("x-request-id")
        .expect("a request id is made")
        .to_string();
    let evs = events(&a.body);
    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"), "{}", a.body);
    let mut got = Vec::new();
    let mut finish = Value::Null;
    let mut usage = Value::Null;
    for e in &evs[..evs.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["id"], format!("cmpl-{rid}"));
        if let Some(c) = v["choices"].get(0) {
            got.extend(ids(&c["token_ids"]));
            if !c["finish_reason"].is_null() {
                finish = c["finish_reason"].clone();
            }
        } else {
            usage = v["usage"].clone();
        }
    }
    assert_eq!(got, want2, "streamed disaggregated != monolithic");
    assert_eq!(finish, "length");
    assert_eq!(usage["completion_tokens"], 24, "{usage}");
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 512,
        "{usage}"
    );
    assert_eq!(
        common::metric(&pe.addr, "kvpool_engine_prompt_tokens_computed_total") - computed,
        100.0
    );
    assert_eq!(
        common::metric(&pe.addr, "kvpool_engine_prompt_tokens_loaded_total") - loaded,
        512.0
    );

    // Chat: the same text as one engine's chat.
    let chat = json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12,
        "temperature": 0, "ignore_eos": true});
    let one = post_ok(&mono.addr, "/v1/chat/completions", &chat);
    let two = post_ok(&front.addr, "/v1/chat/completions", &chat);
    assert_eq!(two["object"], "chat.completion");
    assert_eq!(two["choices"][0]["message"], one["choices"][0]["message"]);

    // The other routes.
    let (status, models) = common::http(&front.addr, "GET", "/v1/models");
    assert_eq!(status, 200);
    assert!(models.contains("builtin:tiny"), "{models}");
    assert_eq!(common::http(&front.addr, "GET", "/healthz").0, 200);
    assert!(
        common::metric(
            &front.addr,
            "kvpool_conductor_requests_total{route=\"completions\",result=\"ok\"}"
        ) >= 2.0
    );
    // Bad requests get OpenAI's error shape.
    let a = post(
        &front.addr,
        "/v1/completions",
        &json!({"prompt": [[1], [2]]}),
        &[],
    );
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(
        a.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("batch"),
        "{}",
        a.body
    );
    let a = post(
        &front.addr,
        "/v1/completions",
        &json!({"model": "gpt-9", "prompt": "x"}),
        &[],
    );
    assert_eq!(a.status, 404, "{}", a.body);
    assert_eq!(a.json()["error"]["code"], "model_not_found");
}

/// A pool, a prefill and a decode engine (builtin:tiny, with the pool) and
/// their proxies, under a quickly probing config named `name`.
struct Parts {
    pool: Proc,
    pe: Proc,
    // Held so that its process lives as long as the others.
    _de: Proc,
    pp: Proc,
    dp: Proc,
}

fn parts(name: &str) -> Parts {
    let pool = pool();
    let cfg = config_file(name, &fast("", ""));
    let pe = engine(Some(&pool.addr), &cfg);
    let de = engine(Some(&pool.addr), &cfg);
    let pp = proxy("prefill-proxy", &pe.addr, &cfg);
    let dp = proxy("decode-proxy", &de.addr, &cfg);
    Parts {
        pool,
        pe,
        _de: de,
        pp,
        dp,
    }
}

/// A conductor that serves one request at a time (`max_in_flight = 1`, and
/// `more` in its section), policy cache_global.
fn one_at_a_time(pool: &Proc, pp: &Proc, dp: &Proc, name: &str, more: &str) -> Proc {
    let cfg = config_file(name, &fast(&format!("max_in_flight = 1\n{more}"), ""));
    conductor(
        &[pp],
        &[dp],
        &pool.addr,
        &cfg,
        &["--policy", "cache_global"],
    )
}

/// The status of a two-token completion.
fn small_request(addr: &str) -> u16 {
    post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
        &[],
    )
    .status
}

#[test]
fn rejected_requests_get_503_with_retry_after() {
    let Parts {
        pool,
        pe,
        _de,
        pp,
        dp,
    } = parts("rej");
    // A TTFT objective no prefill can meet: early rejection, before any
    // engine work.
    let strict = config_file(
        "strict",
        &fast("ttft_slo_ms = 0.001\nretry_after_s = 7", ""),
    );
    let front = conductor(
        &[&pp],
        &[&dp],
        &pool.addr,
        &strict,
        &["--policy", "early_reject"],
    );
    let a = post(
        &front.addr,
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 4}),
        &[],
    );
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.header("retry-after"), Some("7"));
    let e = a.json();
    assert_eq!(e["error"]["code"], "ttft_slo", "{e}");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("time to first token"));
    assert_eq!(
        common::metric(&pe.addr, "kvpool_engine_requests_total"),
        0.0
    );
    assert_eq!(
        common::metric(
            &front.addr,
            "kvpool_conductor_rejected_total{reason=\"ttft_slo\"}"
        ),
        1.0
    );

    // A full front: one request in flight at most.
    let front = one_at_a_time(&pool, &pp, &dp, "one", "");
    let mut long = greedy(&prompt(64, 3), 4000);
    long["stream"] = json!(true);
    let mut held = BufReader::new(send(&front.addr, "/v1/completions", &long, &[]));
    let (status, _) = read_head(&mut held);
    assert_eq!(status, 200);
    let a = post(
        &front.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
        &[],
    );
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.json()["error"]["code"], "queues_full");
    assert_eq!(a.header("retry-after"), Some("1"));
    drop(held);
    // The stream's place frees when its client goes: a request gets in again.
    common::eventually_blocking(
        "the front to take requests again",
        Duration::from_secs(30),
        || small_request(&front.addr) == 200,
    );
}

/// Connects with a receive buffer of 4 KiB (set before the handshake, so
/// the window it offers stays small).
fn connect_small_window(addr: &str) -> TcpStream {
    use rustix::net::{sockopt, AddressFamily, SocketType};
    let addr: std::net::SocketAddr = addr.parse().unwrap();
    let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    sockopt::set_socket_recv_buffer_size(&fd, 4096).unwrap();
    // A small segment size, asked for in the SYN, keeps the server's send
    // buffer small too: Linux sizes a new connection's send buffer by its
    // segment size, about 1.3 MB with loopback's 64 KiB segments, 40 KB
    // with 536-byte ones. The stall then shows after a few hundred tokens,
    // not thousands.
    let mss: libc::c_int = 536;
    // SAFETY: `fd` is an open socket; the option value is a c_int that
    // lives across the call, and its size is passed with it.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::IPPROTO_TCP,
            libc::TCP_MAXSEG,
            (&mss as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "TCP_MAXSEG: {}", std::io::Error::last_os_error());
    rustix::net::connect(&fd, &addr).unwrap();
    TcpStream::from(fd)
}

/// Finding 1 of the RESP/HTTP review: a streaming client that never reads
/// held its request's run, and its admission place, forever (the relay's
/// send into the answer had no deadline): `max_in_flight` such sockets made
/// every other request a 503. Now a client that takes nothing for
/// `stall_timeout_ms` is dropped and its place freed.
#[test]
fn a_streaming_client_that_never_reads_loses_its_place() {
    let Parts {
        pool,
        pe: _pe,
        _de,
        pp,
        dp,
    } = parts("noread");
    let front = one_at_a_time(&pool, &pp, &dp, "noread1", "stall_timeout_ms = 1000");
    // As long an answer as the model takes, each event made long by a
    // long request id: far more than the socket buffers, hyper's and the
    // relay channel hold.
    let mut body = greedy(&prompt(64, 3), 32_000);
    body["stream"] = json!(true);
    let body = body.to_string();
    let rid = "r".repeat(128);
    let mut s = connect_small_window(&front.addr);
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         x-request-id: {rid}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The stream has started (its place is taken) ...
    common::eventually_blocking("the stream to start", Duration::from_secs(60), || {
        common::metric(&front.addr, "kvpool_conductor_in_flight") == 1.0
    });
    // ... and is dropped once its client has taken nothing for a second:
    // another request gets in, with the silent socket still open.
    common::eventually_blocking(
        "the silent client's place to free",
        Duration::from_secs(300),
        || small_request(&front.addr) == 200,
    );
    assert!(common::metric(&front.addr, "kvpool_conductor_clients_stalled_total") >= 1.0);
    assert_eq!(
        common::metric(&front.addr, "kvpool_conductor_in_flight"),
        0.0
    );
    drop(s);
}

/// A pool, one engine (builtin:tiny, with the pool) behind a prefill and a
/// decode proxy, and a conductor: with the quickly probing config, or with
/// `front_section` as its `[serving.conductor]` when that is given.
struct OneEngine {
    pool: Proc,
    pe: Proc,
    pp: Proc,
    dp: Proc,
    front: Proc,
}

fn one_engine(name: &str, front_section: &str) -> OneEngine {
    let pool = pool();
    let cfg = config_file(name, &fast("", ""));
    let pe = engine(Some(&pool.addr), &cfg);
    let pp = proxy("prefill-proxy", &pe.addr, &cfg);
    let dp = proxy("decode-proxy", &pe.addr, &cfg);
    let front_cfg = if front_section.is_empty() {
        cfg
    } else {
        config_file(
            &format!("{name}-front"),
            &format!("[serving.conductor]\n{front_section}\n"),
        )
    };
    let front = conductor(&[&pp], &[&dp], &pool.addr, &front_cfg, &[]);
    OneEngine {
        pool,
        pe,
        pp,
        dp,
        front,
    }
}

/// Finding 3 of the RESP/HTTP review: every HTTP listener was served by
/// `axum::serve`, which gives hyper no timer, so its header read timeout
/// was off; nothing bounded a request body's arrival either. A client that
/// sent part of a request head, or of a body, and stopped held its
/// connection open for ever. Now each listener closes such a connection:
/// a head must arrive within `runtime.http_header_timeout_ms`, a body
/// within `runtime.http_body_timeout_ms` of its head (then a 4xx answer).
/// Here 1 s and 2 s: the defaults are 30 s and 60 s, so a listener that
/// ignored the keys would fail the test's 20 s bound.
#[test]
fn a_request_that_stops_half_way_is_cut_off_on_every_http_listener() {
    let limits = "[runtime]\nhttp_header_timeout_ms = 1000\nhttp_body_timeout_ms = 2000\n";
    let pool_cfg = config_file("slow-pool", limits);
    let mut pool_args: Vec<&str> = common::ephemeral(&["--segment-size", "256MiB"]);
    pool_args.extend(["--config", &pool_cfg]);
    let pool = start("all", &pool_args);
    let cfg = config_file("slow", &fast("", limits));
    let pe = engine(Some(&pool.addr), &cfg);
    let pp = proxy("prefill-proxy", &pe.addr, &cfg);
    let dp = proxy("decode-proxy", &pe.addr, &cfg);
    let front = conductor(&[&pp], &[&dp], &pool.addr, &cfg, &[]);
    let head = |addr: &str| {
        let mut s = TcpStream::connect(addr).unwrap();
        write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty").unwrap();
        s
    };
    let body = |addr: &str| {
        let mut s = TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: 1000\r\n\r\n{{\"prompt\": "
        )
        .unwrap();
        s
    };
    let began = Instant::now();
    let mut slow = vec![
        ("node head", head(&pool.http), false),
        ("engine head", head(&pe.addr), false),
        ("proxy head", head(&pp.addr), false),
        ("conductor head", head(&front.addr), false),
        ("engine body", body(&pe.addr), true),
        ("proxy body", body(&pp.addr), true),
        ("conductor body", body(&front.addr), true),
    ];
    // Each is closed (a body after a 400) within its deadline; all wait at
    // once.
    let threads: Vec<_> = slow
        .drain(..)
        .map(|(what, mut s, answered)| {
            std::thread::spawn(move || {
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let mut got = Vec::new();
                let r = s.read_to_end(&mut got);
                assert!(r.is_ok(), "{what}: not closed: {r:?}");
                if answered {
                    let text = String::from_utf8_lossy(&got);
                    assert!(text.starts_with("HTTP/1.1 4"), "{what}: {text}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let took = began.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "the listeners took {took:?}: not the configured 1 s / 2 s limits"
    );
    // The listeners still serve.
    let (status, _) = common::http(&pool.http, "GET", "/healthz");
    assert_eq!(status, 200);
    let (status, _) = common::http(&front.addr, "GET", "/v1/models");
    assert_eq!(status, 200);
}

/// Finding 9 of the RESP/HTTP review: error answers named the cluster's
/// inner addresses (`cannot connect to 10.0.0.5:8200 ...`). Clients now
/// read the instance's name; the log keeps the address.
#[test]
fn error_answers_name_instances_not_their_addresses() {
    // No poll after the first: the dead proxy is found by the request.
    let OneEngine {
        pool: _pool,
        pe,
        mut pp,
        dp,
        front,
    } = one_engine("names", "load_poll_ms = 600000");
    pp.child.kill().unwrap();
    pp.child.wait().unwrap();
    let a = post(
        &front.addr,
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 2}),
        &[],
    );
    assert!(a.status >= 500, "{} {}", a.status, a.body);
    assert!(a.body.contains("prefill instance 0"), "{}", a.body);
    for addr in [&pp.addr, &dp.addr, &pe.addr] {
        assert!(!a.body.contains(addr.as_str()), "{addr} in {}", a.body);
    }
}

/// Finding 7 of the RESP/HTTP review: a token-id prompt was parsed into
/// JSON values (16 MiB of ids: about 256 MiB), then hashed, looked up in the
/// pool and scheduled before the engine refused it for its length. A
/// prompt longer than the context is now refused first, as the engine
/// words it.
#[test]
fn a_token_prompt_longer_than_the_context_is_refused_before_any_work() {
    let OneEngine {
        pool: _pool,
        pe: _pe,
        pp: _pp,
        dp: _dp,
        front,
    } = one_engine("ctx", "");
    // The front knows the engines' context once it lists their model.
    common::eventually_blocking("the model to be listed", Duration::from_secs(30), || {
        let (_, body) = common::http(&front.addr, "GET", "/v1/models");
        body.contains("builtin:tiny")
    });
    let long = vec![7u32; 40_000];
    let a = post(
        &front.addr,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 1}),
        &[],
    );
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.body.contains("context is 32768 tokens"), "{}", a.body);
    assert_eq!(
        common::metric(&front.addr, "kvpool_conductor_schedule_seconds_count"),
        0.0
    );
}

/// Reads a stream's events until `[DONE]` or the end of the connection,
/// calling `each` on each; returns the events, and whether `[DONE]` came.
fn read_stream(r: &mut BufReader<TcpStream>, mut each: impl FnMut(&Value)) -> (Vec<Value>, bool) {
    let mut buf = String::new();
    let mut out = Vec::new();
    for data in chunks(r) {
        buf.push_str(&data);
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            let Some(d) = ev.trim_end().strip_prefix("data: ") else {
                continue;
            };
            if d == "[DONE]" {
                return (out, true);
            }
            let v: Value = serde_json::from_str(d).unwrap();
            each(&v);
            out.push(v);
        }
    }
    (out, false)
}

#[test]
fn killing_the_decode_engine_mid_stream_gives_a_whole_answer_or_an_error_event() {
    let pool = pool();
    let cfg = config_file("kill", &fast("", TCP));
    let mono = engine(None, &cfg);
    let pe = engine(Some(&pool.addr), &cfg);
    let mut de = [
        engine(Some(&pool.addr), &cfg),
        engine(Some(&pool.addr), &cfg),
    ];
    let pp = proxy("prefill-proxy", &pe.addr, &cfg);
    let dp = [
        proxy("decode-proxy", &de[0].addr, &cfg),
        proxy("decode-proxy", &de[1].addr, &cfg),
    ];
    let front = conductor(
        &[&pp],
        &[&dp[0], &dp[1]],
        &pool.addr,
        &cfg,
        &["--policy", "round_robin"],
    );
    let deadline = Duration::from_secs(120);

    // Streams a long greedy answer; kills the decode engine serving it
    // after 20 tokens; reads to the end. Returns the token ids, whether
    // [DONE] came, and the error event if one did.
    let p = prompt(300, 5);
    let n = 600;
    let run = |de: &mut [Proc; 2]| {
        let mut body = greedy(&p, n);
        body["stream"] = json!(true);
        // Logprobs go on across the engines too.
        body["logprobs"] = json!(1);
        let t0 = Instant::now();
        let mut r = BufReader::new(send(&front.addr, "/v1/completions", &body, &[]));
        let (status, _) = read_head(&mut r);
        assert_eq!(status, 200);
        let mut got: Vec<u64> = Vec::new();
        let mut text = String::new();
        let mut offsets: Vec<u64> = Vec::new();
        let mut killed = None;
        let (evs, done) = read_stream(&mut r, |v| {
            if let Some(c) = v["choices"].get(0) {
                got.extend(ids(&c["token_ids"]));
                text.push_str(c["text"].as_str().unwrap_or(""));
                if let Some(o) = c["logprobs"]["text_offset"].as_array() {
                    offsets.extend(o.iter().map(|o| o.as_u64().unwrap()));
                }
            }
            if killed.is_none() && got.len() >= 20 {
                // The engine whose proxy holds the stream.
                let busy = (0..2)
                    .find(|&i| {
                        let (_, load) = common::http(&dp[i].addr, "GET", "/v1/load");
                        serde_json::from_str::<Value>(&load).unwrap()["in_flight"] == 1
                    })
                    .expect("a decode proxy holds the stream");
                de[busy].child.kill().unwrap();
                killed = Some(busy);
            }
        });
        assert!(
            t0.elapsed() < deadline,
            "the answer took {:?}",
            t0.elapsed()
        );
        assert!(done, "the stream ended without [DONE]: {evs:?}");
        let error = evs.iter().find(|v| v.get("error").is_some()).cloned();
        if error.is_none() {
            // One entry per token; offsets count from the answer's start
            // on the second engine too (never back to 0).
            assert_eq!(offsets.len(), got.len(), "a logprob per token");
            assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
        }
        (got, text, error, killed.expect("an engine was killed"))
    };

    // An engine continuing another's stream first sends the text the other
    // held back: here two bytes of a euro sign (the built-in tokenizer's
    // ids are bytes), of which the client got nothing.
    // n sequences from one engine: greedy, each equals the one answer;
    // streamed, each index ends once and [DONE] comes last.
    let want8 =
        ids(&post_ok(&mono.addr, "/v1/completions", &greedy(&p, 8))["choices"][0]["token_ids"]);
    let mut body = greedy(&p, 8);
    body["n"] = json!(3);
    let v = post_ok(&mono.addr, "/v1/completions", &body);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert_eq!(ids(&c["token_ids"]), want8, "{v}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
    body["stream"] = json!(true);
    body["n"] = json!(2);
    let mut r = BufReader::new(send(&mono.addr, "/v1/completions", &body, &[]));
    assert_eq!(read_head(&mut r).0, 200);
    let mut per: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
    let mut finished = [0; 2];
    let (_, done) = read_stream(&mut r, |v| {
        let c = &v["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        per[i].extend(ids(&c["token_ids"]));
        if !c["finish_reason"].is_null() {
            finished[i] += 1;
        }
    });
    assert!(done, "[DONE] after both sequences");
    assert_eq!(finished, [1, 1]);
    assert_eq!(per[0], want8);
    assert_eq!(per[1], want8);

    let mut held = p.clone();
    held.extend([0xe2, 0x82]);
    let mut body = greedy(&held, 8);
    body["kvpool_resume"] = json!({"generated_tokens": 2, "text_sent_bytes": 0});
    let v = post_ok(&mono.addr, "/v1/completions", &body);
    let mut bytes = vec![0xe2u8, 0x82];
    bytes.extend(
        ids(&v["choices"][0]["token_ids"])
            .iter()
            .filter(|&&t| t < 256)
            .map(|&t| t as u8),
    );
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap(),
        String::from_utf8_lossy(&bytes),
        "the held-back bytes lead the continued text"
    );
    assert_eq!(v["usage"]["completion_tokens"], 8);

    // Two decode engines: the answer continues on the other one.
    let mono_answer = post_ok(&mono.addr, "/v1/completions", &greedy(&p, n));
    let want = ids(&mono_answer["choices"][0]["token_ids"]);
    let want_text = mono_answer["choices"][0]["text"].as_str().unwrap();
    assert_eq!(want.len(), n);
    // With ignore_eos the answer holds end-of-sequence tokens (id 257): the
    // engine streams their ids too, or a continuation would lose them.
    let eos_at = want.iter().position(|&t| t == 257);
    assert!(
        eos_at.is_some_and(|i| i > 40),
        "no EOS after the kill point: {eos_at:?}"
    );
    let (got, text, error, killed) = run(&mut de);
    assert!(
        error.is_none(),
        "an error event although another engine was up: {error:?}"
    );
    assert_eq!(got.len(), n, "a whole answer");
    assert_eq!(got[..20], want[..20]);
    // Greedy, the continuation (the prompt and the 20+ tokens sent, as one
    // prompt on the other engine) gives the uninterrupted answer, and its
    // text, byte for byte (what the dead engine held back included).
    assert_eq!(got, want, "the continued answer differs from one engine's");
    assert_eq!(
        text, want_text,
        "the continued text differs from one engine's"
    );
    assert_eq!(
        common::metric(
            &front.addr,
            "kvpool_conductor_failovers_total{phase=\"decode_stream\"}"
        ),
        1.0
    );
    // The dead engine's instance is down; a new request goes to the other.
    common::eventually_blocking(
        "the dead instance to be marked down",
        Duration::from_secs(10),
        || {
            let (_, h) = common::http(&front.addr, "GET", "/kvpool/v1/status");
            let v: Value = serde_json::from_str(&h).unwrap();
            v["decode"][killed]["up"] == false
        },
    );
    let v = post_ok(&front.addr, "/v1/completions", &greedy(&p, 8));
    assert_eq!(ids(&v["choices"][0]["token_ids"]), want[..8]);
    assert_eq!(v["kvpool"]["decode"], 1 - killed);

    // The last decode engine dies mid-stream too: an error event, then
    // [DONE], within the deadline; never a cut stream.
    let (got, _, error, _) = run(&mut de);
    let error = error.expect("an error event");
    assert!(got.len() >= 20 && got.len() < n, "{}", got.len());
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("decode"),
        "{error}"
    );
}

#[test]
fn live_decisions_replay_in_the_simulator_and_bench_serve_reports_them() {
    let dir = common::scratch_dir("serving-replay");
    let root = env!("CARGO_MANIFEST_DIR");
    // A small copy of the synthetic trace: 16-token blocks (the engines'
    // chunks here), short answers.
    let trace = dir.join("trace.jsonl");
    let (code, _, err) = kvpool(
        &[
            "sim",
            "scale",
            "--trace",
            &format!("{root}/tests/data/synthetic_trace.jsonl"),
            "--out",
            trace.to_str().unwrap(),
            "--block-tokens",
            "16",
            "--requests",
            "24",
            "--output-scale",
            "0.1",
            "--output-max",
            "12",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{err}");
    let model = format!("{root}/configs/cluster-model-tiny.toml");
    let pool = pool();
    let cfg = config_file(
        "replay",
        &fast(
            &format!("cost_model = \"{model}\""),
            "[engine]\nchunk_tokens = 16\n",
        ),
    );
    let pe = [
        engine(Some(&pool.addr), &cfg),
        engine(Some(&pool.addr), &cfg),
    ];
    let de = engine(Some(&pool.addr), &cfg);
    let pp = [
        proxy("prefill-proxy", &pe[0].addr, &cfg),
        proxy("prefill-proxy", &pe[1].addr, &cfg),
    ];
    let dp = proxy("decode-proxy", &de.addr, &cfg);

    for policy in ["cache_global", "round_robin"] {
        let live_log = dir.join(format!("live-{policy}.jsonl"));
        let front = conductor(
            &[&pp[0], &pp[1]],
            &[&dp],
            &pool.addr,
            &cfg,
            &[
                "--policy",
                policy,
                "--decision-log",
                live_log.to_str().unwrap(),
            ],
        );
        let (code, out, err) = kvpool(
            &[
                "bench",
                "serve",
                "--front",
                &front.addr,
                "--trace",
                trace.to_str().unwrap(),
                "--block-tokens",
                "16",
                "--speed",
                "8",
                "--json",
                "--no-progress",
            ],
            Duration::from_secs(300),
        );
        assert_eq!(code, Some(0), "{err}");
        let rep: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
        assert_eq!(rep["policy"], policy);
        assert_eq!(rep["requests"], 24);
        assert_eq!(rep["prefill"], 2);
        assert_eq!(rep["completed"], 24, "{rep}");
        for k in [
            "ttft_ms_p50",
            "ttft_ms_p99",
            "tbt_ms_p50",
            "slo_attainment",
            "goodput_rps",
        ] {
            assert!(rep[k].is_number(), "{k} in {rep}");
        }
        // Every live decision, made again by the simulator's scheduler on
        // the view it was made on.
        let (code, out, err) = kvpool(
            &["sim", "replay", "--log", live_log.to_str().unwrap()],
            Duration::from_secs(60),
        );
        assert_eq!(code, Some(0), "{out}{err}");
        assert!(out.contains("24 decisions (24 routed"), "{out}");
        assert!(out.contains("24 made again the same"), "{out}");
        // The same trace in `kvpool sim`, logged the same way.
        let sim_log = dir.join(format!("sim-{policy}.jsonl"));
        let (code, _, err) = kvpool(
            &[
                "sim",
                "--trace",
                trace.to_str().unwrap(),
                "--model",
                &model,
                "--policy",
                policy,
                "--prefill",
                "2",
                "--decode",
                "1",
                "--speed",
                "8",
                "--no-progress",
                "--decision-log",
                sim_log.to_str().unwrap(),
            ],
            Duration::from_secs(60),
        );
        assert_eq!(code, Some(0), "{err}");
        let (code, out, err) = kvpool(
            &["sim", "replay", "--log", sim_log.to_str().unwrap()],
            Duration::from_secs(60),
        );
        assert_eq!(code, Some(0), "{out}{err}");
        // A policy that does not look at the cluster routes the same in
        // both: the same pairs in the same order.
        if policy == "round_robin" {
            assert_eq!(
                routes(live_log.to_str().unwrap()),
                routes(sim_log.to_str().unwrap())
            );
        }
        // A decision changed in the log is caught.
        let text = std::fs::read_to_string(&live_log).unwrap();
        let line = text
            .lines()
            .position(|l| l.contains("\"decision\":\"route\""))
            .unwrap();
        let changed: Vec<String> = text
            .lines()
            .enumerate()
            .map(|(i, l)| {
                if i == line {
                    l.replace("\"decode\":0", "\"decode\":7")
                } else {
                    l.to_string()
                }
            })
            .collect();
        let bad = dir.join("changed.jsonl");
        std::fs::write(&bad, changed.join("\n")).unwrap();
        let (code, out, _) = kvpool(
            &["sim", "replay", "--log", bad.to_str().unwrap()],
            Duration::from_secs(60),
        );
        assert_eq!(code, Some(2), "{out}");
    }
}

#[test]
fn a_dead_prefill_engine_decode_proxy_or_pool_costs_no_answer() {
    let mut pool = pool();
    let cfg = config_file("deaths", &fast("", TCP));
    let mono = engine(None, &cfg);
    let mut pe = [
        engine(Some(&pool.addr), &cfg),
        engine(Some(&pool.addr), &cfg),
    ];
    let pp = [
        proxy("prefill-proxy", &pe[0].addr, &cfg),
        proxy("prefill-proxy", &pe[1].addr, &cfg),
    ];
    let de = [
        engine(Some(&pool.addr), &cfg),
        engine(Some(&pool.addr), &cfg),
    ];
    let mut dp = [
        proxy("decode-proxy", &de[0].addr, &cfg),
        proxy("decode-proxy", &de[1].addr, &cfg),
    ];
    let front = conductor(
        &[&pp[0], &pp[1]],
        &[&dp[0], &dp[1]],
        &pool.addr,
        &cfg,
        &["--policy", "round_robin"],
    );
    let p = prompt(400, 11);
    let want =
        ids(&post_ok(&mono.addr, "/v1/completions", &greedy(&p, 200))["choices"][0]["token_ids"]);

    // A prefill engine dies: requests (round robin would send every other
    // one to it) are all answered, by the other one.
    pe[0].child.kill().unwrap();
    for _ in 0..4 {
        let v = post_ok(&front.addr, "/v1/completions", &greedy(&p, 16));
        assert_eq!(ids(&v["choices"][0]["token_ids"]), want[..16]);
        assert_eq!(v["kvpool"]["prefill"], 1, "{v}");
    }

    // A decode proxy dies mid-stream: the stream breaks under the front,
    // which continues the answer on the other decode instance.
    let mut body = greedy(&p, 200);
    body["stream"] = json!(true);
    let mut r = BufReader::new(send(&front.addr, "/v1/completions", &body, &[]));
    assert_eq!(read_head(&mut r).0, 200);
    let mut got: Vec<u64> = Vec::new();
    let mut killed = false;
    let (evs, done) = read_stream(&mut r, |v| {
        if let Some(c) = v["choices"].get(0) {
            got.extend(ids(&c["token_ids"]));
        }
        if !killed && got.len() >= 10 {
            let busy = (0..2)
                .find(|&i| {
                    let (_, load) = common::http(&dp[i].addr, "GET", "/v1/load");
                    serde_json::from_str::<Value>(&load).unwrap()["in_flight"] == 1
                })
                .expect("a decode proxy holds the stream");
            dp[busy].child.kill().unwrap();
            killed = true;
        }
    });
    assert!(done, "the stream ended without [DONE]: {evs:?}");
    assert!(evs.iter().all(|v| v.get("error").is_none()), "{evs:?}");
    assert_eq!(got, want, "the continued answer differs from one engine's");

    // The pool dies: engines compute whole prompts, the front schedules
    // without lookups; answers are the same.
    pool.child.kill().unwrap();
    let other = prompt(300, 12);
    let want2 = ids(
        &post_ok(&mono.addr, "/v1/completions", &greedy(&other, 16))["choices"][0]["token_ids"],
    );
    let v = post_ok(&front.addr, "/v1/completions", &greedy(&other, 16));
    assert_eq!(ids(&v["choices"][0]["token_ids"]), want2);
}

/// Issue 30, item 1, through the whole serving path: a client that goes
/// away from the front stops its request at the engine (the front drops its
/// call to the proxy, the proxy its call to the engine, the engine its
/// sequence at the next step).
#[test]
fn a_client_that_leaves_the_front_stops_its_request_at_the_engine() {
    let OneEngine {
        pool: _pool,
        pe,
        pp: _pp,
        dp: _dp,
        front,
    } = one_engine("cancel", "");
    common::eventually_blocking("the model to be listed", Duration::from_secs(30), || {
        let (_, body) = common::http(&front.addr, "GET", "/v1/models");
        body.contains("builtin:tiny")
    });
    let computed = "kvpool_engine_prompt_tokens_computed_total";
    let cancelled = "kvpool_engine_requests_cancelled_total";
    assert_eq!(common::metric(&pe.addr, cancelled), 0.0);
    let s = send(
        &front.addr,
        "/v1/completions",
        &json!({"prompt": prompt(8000, 31), "max_tokens": 24_000, "temperature": 0,
            "ignore_eos": true}),
        &[],
    );
    common::eventually_blocking("the engine to start on it", Duration::from_secs(30), || {
        common::metric(&pe.addr, computed) > 0.0
    });
    drop(s);
    common::eventually_blocking(
        "the engine to cancel the request",
        Duration::from_secs(30),
        || common::metric(&pe.addr, cancelled) >= 1.0,
    );
    let work = || {
        (
            common::metric(&pe.addr, computed),
            common::metric(&pe.addr, "kvpool_engine_generated_tokens_total"),
        )
    };
    let stopped = work();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(work(), stopped, "the engine kept working for a gone client");
    assert_eq!(
        common::metric(&front.addr, "kvpool_conductor_in_flight"),
        0.0
    );
}
