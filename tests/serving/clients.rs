//! Outside clients of the serving path: the `openai` package, Hugging Face
//! tokenizer files, `kvpool chat` and the front's checks before any work.

use super::*;

/// Python with the `openai` package: `KVPOOL_PYTHON` (what .ci/run sets),
/// else `python3` on PATH. `None` (after saying why) when it lacks the
/// package, unless `KVPOOL_REQUIRE_EXTERNAL=1`.
pub(super) fn python_with_openai() -> Option<String> {
    python_with("openai")
}

/// Python with the package `module` (pip's name too), as
/// [`python_with_openai`].
pub(super) fn python_with(module: &str) -> Option<String> {
    let python = std::env::var("KVPOOL_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = std::process::Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    let why = format!(
        "python with the {module} package not found ({python:?}; pip install {module}, and set \
         KVPOOL_PYTHON)"
    );
    if std::env::var("KVPOOL_REQUIRE_EXTERNAL").as_deref() == Ok("1") {
        panic!("{why}");
    }
    common::say_skip(&why);
    None
}

/// Issue 30, item 5: the engine's tokenizer as Hugging Face files, served
/// through the front (`/kvpool/v1/tokenizer.json`, `tokenizer_config.json`)
/// and written by `kvpool tokenizer DIR`: the two are the same, and both our
/// loader and Hugging Face's own `tokenizers` package (pip) count a prompt
/// as the engine's `usage.prompt_tokens` does (load generators miscounted).
#[test]
fn the_tokenizer_as_hugging_face_files_counts_a_prompt_as_the_engine_does() {
    let (_all, found) = common::start_lines(
        "all",
        &common::ephemeral(&["--segment-size", "64MiB"]),
        &[],
        &["conductor"],
    );
    let front = found.get("conductor").expect("role all runs a conductor");
    let (status, served) = common::http(front, "GET", "/kvpool/v1/tokenizer.json");
    assert_eq!(status, 200, "{served}");
    let (status, config) = common::http(front, "GET", "/kvpool/v1/tokenizer_config.json");
    assert_eq!(status, 200, "{config}");
    let config: Value = serde_json::from_str(&config).unwrap();
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(config["eos_token"], "</s>");
    assert!(config["model_max_length"].as_u64().unwrap() > 0, "{config}");

    let dir = std::env::temp_dir().join(format!("kvpool-tokenizer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.display().to_string();
    let (code, out, err) = kvpool(
        &["tokenizer", &d, "--model", "builtin:tiny"],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("tokenizer.json") && out.contains("tokenizer_config.json"),
        "{out}"
    );
    let file = dir.join("tokenizer.json");
    let written: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(written, serde_json::from_str::<Value>(&served).unwrap());
    let (code, _, err) = kvpool(
        &["tokenizer", &d, "--model", "builtin:nope"],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("builtin:nope"), "{err}");

    let prompt = "The pool holds h\u{e9}llo, \u{4f60}\u{597d} \u{1f980}\n  and <b>tags</b>";
    let usage = post_ok(
        front,
        "/v1/completions",
        &json!({"model": "builtin:tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}),
    )["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    let ours = kvpool_engine::tokenizer::Tokenizer::from_file(&file)
        .unwrap()
        .encode(prompt)
        .unwrap();
    assert_eq!(ours.len() as u64, usage, "our loader of the exported file");
    let Some(python) = python_with("tokenizers") else {
        return;
    };
    let out = std::process::Command::new(&python)
        .args([
            "-c",
            "import sys; from tokenizers import Tokenizer; \
             t = Tokenizer.from_file(sys.argv[1]); e = t.encode(sys.argv[2]); \
             print(len(e.ids)); print(t.decode(e.ids) == sys.argv[2])",
            file.to_str().unwrap(),
            prompt,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text.trim(),
        format!("{usage}\nTrue"),
        "Hugging Face's tokenizers"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

pub(super) const OPENAI_SCRIPT: &str = r#"
import json, math, sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=120)
out = {}
msgs = [{"role": "user", "content": "hello"}]
s = c.chat.completions.create(model="builtin:tiny", messages=msgs, max_tokens=8,
                              temperature=0, stream=True,
                              stream_options={"include_usage": True})
text, finish, usage, ids = "", None, None, set()
for ch in s:
    ids.add(ch.id)
    if ch.usage is not None:
        usage = ch.usage.completion_tokens
    for ch_choice in ch.choices:
        if ch_choice.delta.content:
            text += ch_choice.delta.content
        if ch_choice.finish_reason:
            finish = ch_choice.finish_reason
whole = c.chat.completions.create(model="builtin:tiny", messages=msgs, max_tokens=8,
                                  temperature=0)
out["chat"] = {"text": text, "finish": finish, "usage": usage, "ids": sorted(ids),
               "whole": whole.choices[0].message.content,
               "whole_usage": whole.usage.completion_tokens}
s = c.completions.create(model="builtin:tiny", prompt="The pool holds", max_tokens=10,
                         temperature=0, stream=True)
text, finish = "", None
for ch in s:
    for ch_choice in ch.choices:
        text += ch_choice.text
        if ch_choice.finish_reason:
            finish = ch_choice.finish_reason
whole = c.completions.create(model="builtin:tiny", prompt="The pool holds", max_tokens=10,
                             temperature=0)
out["completion"] = {"text": text, "finish": finish, "whole": whole.choices[0].text}
# n sequences through the front (one prefill, a decode each): greedy, equal.
r = c.completions.create(model="builtin:tiny", prompt="The pool holds", max_tokens=10,
                         temperature=0, n=3)
out["n"] = {"texts": [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)],
            "usage": r.usage.completion_tokens}
s = c.chat.completions.create(model="builtin:tiny", messages=msgs, max_tokens=8,
                              temperature=0, n=2, stream=True)
streamed = {}
for ch in s:
    for cc in ch.choices:
        streamed[cc.index] = streamed.get(cc.index, "") + (cc.delta.content or "")
out["n"]["streamed"] = [streamed.get(0), streamed.get(1)]
out["models"] = [m.id for m in c.models.list()]
# Issue 30, item 4: logprobs (greedy: the sampled token is the most likely
# one), and echo.
r = c.chat.completions.create(model="builtin:tiny", messages=msgs, max_tokens=6,
                              temperature=0, logprobs=True, top_logprobs=3)
lp = r.choices[0].logprobs.content
out["chat_logprobs"] = {
    "n": len(lp), "usage": r.usage.completion_tokens,
    "tops": [len(t.top_logprobs) for t in lp],
    "greedy": all(t.logprob == t.top_logprobs[0].logprob for t in lp),
    "bytes": b"".join(bytes(t.bytes) for t in lp).decode("utf-8", "replace")
             == r.choices[0].message.content}
s = c.chat.completions.create(model="builtin:tiny", messages=msgs, max_tokens=6,
                              temperature=0, logprobs=True, top_logprobs=3, stream=True)
out["chat_logprobs"]["streamed"] = [t.logprob for ch in s for cc in ch.choices
                                    if cc.logprobs for t in cc.logprobs.content]
out["chat_logprobs"]["whole"] = [t.logprob for t in lp]
r = c.completions.create(model="builtin:tiny", prompt="The pool holds", max_tokens=5,
                         temperature=0, logprobs=2)
l = r.choices[0].logprobs
out["completion_logprobs"] = {
    "n": len(l.tokens), "lps": len(l.token_logprobs), "tops": [len(t) for t in l.top_logprobs],
    "offsets": l.text_offset, "text": r.choices[0].text, "max": max(l.token_logprobs)}
e = c.completions.create(model="builtin:tiny", prompt="The pool holds", max_tokens=10,
                         temperature=0, echo=True)
out["echo"] = e.choices[0].text
s = c.completions.create(model="builtin:tiny", prompt="The pool holds", max_tokens=10,
                         temperature=0, echo=True, stream=True)
out["echo_streamed"] = "".join(cc.text for ch in s for cc in ch.choices)
# Content as OpenAI's list of parts (guidellm's chat mode sends it): the
# same prompt as the string.
parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
out["parts"] = c.chat.completions.create(model="builtin:tiny", messages=parts, max_tokens=8,
                                         temperature=0).choices[0].message.content
try:
    c.chat.completions.create(model="builtin:tiny", max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}]}])
    out["image"] = "accepted"
except Exception as e:
    out["image"] = [getattr(e, "status_code", None), str(e)]
# Probes, and paths or methods the API does not have.
import urllib.request, urllib.error
root = sys.argv[1][: -len("/v1")]
def status(method, path):
    try:
        r = urllib.request.urlopen(urllib.request.Request(root + path, method=method), timeout=30)
        return [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        return [e.code, json.loads(e.read())["error"]["message"]]
out["health"] = status("GET", "/health")[0]
out["404"] = status("GET", "/v1/nope")
out["405"] = status("GET", "/v1/completions")
print(json.dumps(out))
"#;

#[test]
fn the_openai_python_client_streams_a_chat_and_a_completion_from_role_all() {
    let Some(python) = python_with_openai() else {
        return;
    };
    let (all, found) = common::start_lines(
        "all",
        &common::ephemeral(&["--segment-size", "64MiB"]),
        &[],
        &["conductor"],
    );
    let front = found.get("conductor").expect("role all runs a conductor");
    let out = common::wait_output(
        std::process::Command::new(&python)
            .args(["-c", OPENAI_SCRIPT, &format!("http://{front}/v1")])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
        Duration::from_secs(180),
    );
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        all.stderr()
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let chat = &v["chat"];
    assert_eq!(chat["finish"], "length", "{v}");
    assert_eq!(chat["usage"], 8, "{v}");
    assert_eq!(chat["text"], chat["whole"], "{v}");
    assert_eq!(chat["whole_usage"], 8, "{v}");
    assert_eq!(
        chat["ids"].as_array().unwrap().len(),
        1,
        "one id per answer: {v}"
    );
    let comp = &v["completion"];
    assert_eq!(comp["finish"], "length", "{v}");
    assert_eq!(comp["text"], comp["whole"], "{v}");
    assert_eq!(v["models"], json!(["builtin:tiny"]));
    // Issue 30, item 4: n sequences through the front.
    let whole = comp["whole"].as_str().unwrap();
    assert_eq!(v["n"]["texts"], json!([whole, whole, whole]), "{v}");
    assert_eq!(v["n"]["usage"], 30, "{v}");
    assert_eq!(
        v["n"]["streamed"],
        json!([chat["whole"], chat["whole"]]),
        "{v}"
    );
    // Issue 30, item 4: logprobs and echo through the front.
    let lp = &v["chat_logprobs"];
    assert_eq!(lp["n"], 6, "one entry per generated token: {v}");
    assert_eq!(lp["usage"], 6, "{v}");
    assert_eq!(lp["tops"], json!([3, 3, 3, 3, 3, 3]), "{v}");
    assert_eq!(lp["greedy"], true, "{v}");
    assert_eq!(lp["bytes"], true, "the tokens' bytes make the text: {v}");
    assert_eq!(lp["streamed"], lp["whole"], "{v}");
    let lp = &v["completion_logprobs"];
    assert_eq!(
        (lp["n"].as_u64(), lp["lps"].as_u64()),
        (Some(5), Some(5)),
        "{v}"
    );
    // Two alternatives, plus the sampled token when it is not one of them
    // (no two tokens share a string: parts of characters read `bytes:\x..`).
    assert!(
        lp["tops"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t == 2 || t == 3),
        "{v}"
    );
    assert!(lp["max"].as_f64().unwrap() <= 0.0, "{v}");
    // Offsets rise through the text and stay inside it.
    let offsets: Vec<u64> = ids(&lp["offsets"]);
    assert_eq!(offsets[0], 0, "{v}");
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{v}");
    let chars = lp["text"].as_str().unwrap().chars().count() as u64;
    assert!(offsets.iter().all(|&o| o < chars), "{v}");
    assert_eq!(
        v["echo"],
        format!("The pool holds{}", comp["whole"].as_str().unwrap()),
        "{v}"
    );
    assert_eq!(v["echo_streamed"], v["echo"], "{v}");
    // Issue 30, item 4: content parts, /health, error bodies on 404 and 405.
    assert_eq!(v["parts"], chat["whole"], "{v}");
    assert_eq!(v["image"][0], 400, "{v}");
    assert!(
        v["image"][1].as_str().unwrap().contains("not supported"),
        "{v}"
    );
    assert_eq!(v["health"], 200, "{v}");
    assert_eq!(v["404"][0], 404, "{v}");
    assert!(v["404"][1].as_str().unwrap().contains("/v1/nope"), "{v}");
    assert_eq!(v["405"][0], 405, "{v}");
}

/// Issue 30, items 3 and 4: with an API key (`--api-key`; also
/// `[serving] api_key`, `KVPOOL_API_KEY`) the `/v1` routes need it and
/// probes do not; a body that says it is not JSON is 415; a prompt plus
/// `max_tokens` beyond the context is 400 before any work; `/v1/models`
/// names the context length. Every refusal is an OpenAI error body.
#[test]
fn the_front_checks_its_api_key_content_type_and_context_before_any_work() {
    let (_all, found) = common::start_lines(
        "all",
        &common::ephemeral(&["--segment-size", "64MiB", "--api-key", "k-123"]),
        &[],
        &["conductor"],
    );
    let front = found.get("conductor").expect("role all runs a conductor");
    let body = json!({"prompt": "hi", "max_tokens": 2});
    let error = |a: &Answer| a.json()["error"].clone();
    let a = post(front, "/v1/completions", &body, &[]);
    assert_eq!(a.status, 401, "{}", a.body);
    assert_eq!(error(&a)["code"], "invalid_api_key", "{}", a.body);
    let a = post(
        front,
        "/v1/completions",
        &body,
        &[("Authorization", "Bearer wrong")],
    );
    assert_eq!(a.status, 401, "{}", a.body);
    let key = [("Authorization", "Bearer k-123")];
    let a = post(front, "/v1/completions", &body, &key);
    assert_eq!(a.status, 200, "{}", a.body);
    let (status, _) = common::http(front, "GET", "/v1/models");
    assert_eq!(status, 401);
    let (status, text) = common::http_with(
        front,
        "GET",
        "/v1/models",
        "Authorization: Bearer k-123\r\n",
    );
    assert_eq!(status, 200, "{text}");
    let models: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 32_768, "{models}");
    for probe in ["/health", "/healthz", "/metrics"] {
        assert_eq!(common::http(front, "GET", probe).0, 200, "{probe}");
    }
    // A form body (curl -d without -H) is 415.
    let text = body.to_string();
    let mut s = TcpStream::connect(front.as_str()).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k-123\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    let mut got = String::new();
    s.read_to_string(&mut got).unwrap();
    assert!(got.starts_with("HTTP/1.1 415"), "{got}");
    assert!(got.contains("application/json"), "{got}");
    // max_tokens of 10^9, and a prompt plus max_tokens one past the context.
    for (prompt, max_tokens) in [(prompt(8, 1), 1_000_000_000u64), (prompt(768, 2), 32_001)] {
        let a = post(
            front,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": max_tokens}),
            &key,
        );
        assert_eq!(a.status, 400, "{}", a.body);
        assert_eq!(error(&a)["code"], "context_length_exceeded", "{}", a.body);
        assert!(
            error(&a)["message"]
                .as_str()
                .unwrap()
                .contains("maximum context length is 32768 tokens"),
            "{}",
            a.body
        );
    }
}

#[test]
fn kvpool_chat_streams_from_role_all_and_a_dead_front_is_an_error() {
    let (_all, found) = common::start_lines(
        "all",
        &common::ephemeral(&["--segment-size", "64MiB"]),
        &[],
        &["conductor"],
    );
    let front = found
        .get("conductor")
        .expect("role all runs a conductor")
        .clone();
    // As soon as the front is ready it knows the engines' model: its
    // models list, and every event of the first answer, name it.
    let (status, text) = common::http(&front, "GET", "/v1/models");
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["data"][0]["id"], "builtin:tiny", "{v}");
    let a = post(
        &front,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": true}),
        &[],
    );
    assert_eq!(a.status, 200, "{}", a.body);
    let evs = events(&a.body);
    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"), "{}", a.body);
    for e in &evs[..evs.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["model"], "builtin:tiny", "{e}");
    }
    let chat = |args: &[&str]| {
        let out = common::wait_output(
            std::process::Command::new(common::BIN)
                .arg("chat")
                .args(args)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
            Duration::from_secs(120),
        );
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, text, err) = chat(&["hello", "--front", &front, "--max-tokens", "6"]);
    assert_eq!(code, Some(0), "{err}");
    // The same greedy turn, not streamed.
    let whole = post_ok(
        &front,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
            "temperature": 0.0}),
    );
    assert_eq!(
        text.trim_end_matches('\n'),
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let free = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let (code, _, err) = chat(&["hello", "--front", &free]);
    assert_eq!(code, Some(2));
    assert!(err.contains("cannot connect"), "{err}");
}

/// `kvpool` with `args`; returns (exit code, stdout, stderr).
pub(super) fn kvpool(args: &[&str], within: Duration) -> (Option<i32>, String, String) {
    let out = common::wait_output(
        std::process::Command::new(common::BIN)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
        within,
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The (prefill, decode) of every routed decision in a decision log.
pub(super) fn routes(log: &str) -> Vec<(u64, u64)> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] == "schedule" && v["decision"]["decision"] == "route")
        .map(|v| {
            (
                v["decision"]["prefill"].as_u64().unwrap(),
                v["decision"]["decode"].as_u64().unwrap(),
            )
        })
        .collect()
}
