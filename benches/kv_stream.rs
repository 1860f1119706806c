//! Layer-wise KV streaming in P/D serving: time to first token of a
//! prefill engine + decode engine pair with streaming off (the defaults: one
//! pool object per chunk, stored when the prompt is done, loaded whole before
//! the request is queued) and on (`engine.kv_layer_groups = 4`,
//! `engine.kv_stream = true`: each group of four layers stored as the chunk's
//! piece finishes it, the decode engine's last piece started while its
//! prefix arrives group by group), in alternating order within each round.
//!
//! Real processes: one pool (`kvpool run --role all --no-serving`), and per
//! mode a prefill and a decode engine (`--role engine`), pool client over
//! TCP. One P/D request = POST the prefill engine (`do_remote_decode`,
//! `max_tokens` 1) then POST the decode engine with its `kv_transfer_params`
//! (`max_tokens` 1), as the prefill/decode proxies do; TTFT = both answers.
//! "none": a prompt never seen (one request per size and mode); "all": the
//! same prompt again (every chunk in the pool; median of the rounds). The decode
//! side's wait for KV is read from the decode engine's metrics: the load
//! before queueing (off) or the pieces' waits for streamed groups (on),
//! divided by the decode engine's time for the request.
//!
//!     cargo bench --bench kv_stream              # builtin:small, 1k-8k tokens (long)
//!     cargo test --release --bench kv_stream     # small run (part of the suite)

mod support;

use std::time::Instant;

use serde_json::{json, Value};
use support::full_mode;

struct Mode {
    name: &'static str,
    model: String,
    prefill: support::Node,
    decode: support::Node,
}

/// One P/D request's figures.
struct Pd {
    ttft_ms: f64,
    prefill_ms: f64,
    decode_ms: f64,
    /// The decode engine's wait for KV, ms.
    wait_ms: f64,
}

pub fn main() {
    let full = full_mode();
    let (model, sizes, cached_rounds): (&str, &[usize], usize) = if full {
        ("builtin:small", &[1024, 2048, 4096, 8192], 3)
    } else {
        ("builtin:tiny", &[512, 1024], 1)
    };
    println!(
        "kvpool kv_stream bench ({} mode): {model}, P/D over one pool, TCP, chunk_tokens 256",
        if full { "full" } else { "small" }
    );
    println!("machine: {}", support::machine());
    let pool = support::start(
        "all",
        &["--listen", "127.0.0.1:0", "--segment-size", "2GiB"],
    );
    let modes = [
        mode("off", model, &pool.addr, ""),
        mode(
            "on",
            model,
            &pool.addr,
            "[engine]\nkv_layer_groups = 4\nkv_stream = true\n",
        ),
    ];
    println!(
        "{:<6} {:<4} {:>7} {:>10} {:>10} {:>10} {:>9} {:>10}",
        "cached", "mode", "tokens", "ttft_ms", "prefill_ms", "decode_ms", "wait_ms", "wait/ttft"
    );
    for (k, &len) in sizes.iter().enumerate() {
        // Per mode a prompt never seen: its first P/D request is the "none"
        // figure, and it leaves every chunk in the pool for the "all" rounds.
        let prompts: Vec<Vec<u32>> = (0..2)
            .map(|i| support::byte_prompt(len, (k * 2 + i) as u32))
            .collect();
        let mut none: Vec<Pd> = Vec::new();
        for i in 0..2 {
            none.push(pd(&modes[i], &prompts[i]));
        }
        let mut all: Vec<Vec<Pd>> = vec![Vec::new(), Vec::new()];
        for round in 0..cached_rounds {
            for j in 0..2 {
                // Alternate which mode goes first.
                let i = (j + round) % 2;
                all[i].push(pd(&modes[i], &prompts[i]));
            }
        }
        for (cached, figures) in [
            ("all", all),
            ("none", none.into_iter().map(|p| vec![p]).collect()),
        ] {
            for (m, f) in modes.iter().zip(figures) {
                let med = |g: fn(&Pd) -> f64| median(f.iter().map(g).collect());
                let (ttft, wait) = (med(|p| p.ttft_ms), med(|p| p.wait_ms));
                println!(
                    "{cached:<6} {:<4} {len:>7} {ttft:>10.1} {:>10.1} {:>10.1} {wait:>9.1} {:>9.2}%",
                    m.name,
                    med(|p| p.prefill_ms),
                    med(|p| p.decode_ms),
                    100.0 * wait / ttft
                );
            }
        }
    }
}

fn mode(name: &'static str, model: &str, master: &str, engine_cfg: &str) -> Mode {
    let cfg = std::env::temp_dir().join(format!(
        "kvpool-bench-kv-stream-{}-{name}.toml",
        std::process::id()
    ));
    std::fs::write(&cfg, format!("[client]\ntransport = \"tcp\"\n{engine_cfg}"))
        .expect("bench config");
    let cfg = cfg.to_str().expect("utf-8 path").to_string();
    let engine = || {
        support::start(
            "engine",
            &[
                "--model",
                model,
                "--listen",
                "127.0.0.1:0",
                "--master",
                master,
                "--config",
                &cfg,
            ],
        )
    };
    Mode {
        name,
        model: model.to_string(),
        prefill: engine(),
        decode: engine(),
    }
}

/// One P/D request of `p` through mode `m`.
fn pd(m: &Mode, p: &[u32]) -> Pd {
    // Streamed, the load runs beside the piece: only the piece's waits count.
    let waited = |n: &support::Node| match m.name {
        "on" => seconds(&n.addr, "kvpool_engine_kv_stream_wait_seconds_sum"),
        _ => seconds(&n.addr, "kvpool_engine_kv_load_seconds_sum"),
    };
    let body = |kvp: Value| {
        json!({"model": m.model, "prompt": p, "max_tokens": 1, "temperature": 0,
            "ignore_eos": true, "kv_transfer_params": kvp})
    };
    let t0 = Instant::now();
    let pre = support::completion(&m.prefill.addr, &body(json!({"do_remote_decode": true})));
    let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut kvp = pre["kv_transfer_params"].clone();
    kvp["do_remote_prefill"] = true.into();
    // Metrics only between the two requests: not counted in the TTFT.
    let t_metrics = Instant::now();
    let before = waited(&m.decode);
    let skipped = t_metrics.elapsed();
    let t1 = Instant::now();
    let out = support::completion(&m.decode.addr, &body(kvp));
    let decode_ms = t1.elapsed().as_secs_f64() * 1e3;
    let ttft_ms = (t0.elapsed() - skipped).as_secs_f64() * 1e3;
    let wait_ms = (waited(&m.decode) - before) * 1e3;
    assert_eq!(
        out["kvpool"]["prompt_tokens_computed"].as_u64(),
        Some((p.len() as u64 - 1) % 256 + 1),
        "the decode engine loaded every loadable chunk: {out}"
    );
    Pd {
        ttft_ms,
        prefill_ms,
        decode_ms,
        wait_ms,
    }
}

/// A float metric (a histogram's `_sum`) of an engine; 0 when absent.
fn seconds(addr: &str, name: &str) -> f64 {
    let text = support::http(
        addr,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
