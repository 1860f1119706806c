//! `kvpool bench serve`: a request trace (Mooncake format) replayed against
//! the live front at its timestamps (divided by `--speed`), reported in the
//! columns `kvpool sim` uses: TTFT and TBT percentiles, SLO attainment,
//! goodput, prefix hit ratio, rejections.
//!
//! Prompts from hash ids: a trace gives token counts and block ids, not
//! text. Block id `h` becomes `block_tokens` token ids drawn from a
//! generator seeded by `h` alone ([`block_tokens`]), so two requests that
//! share leading ids share exactly those leading tokens, and so the same
//! chunk hashes and pool keys, as in the traced system; a request's last,
//! partial block is the start of its id's block. Prompts go as token-id
//! lists (`"prompt": [..]`), greedy, `ignore_eos`, `max_tokens` =
//! the trace's output length, streamed with usage and token ids (tokens are
//! counted by id: a byte-level token may hold its text back).
//!
//! Measured per request, from its scheduled arrival: TTFT = the first
//! token's event; TBT = (last token - first token) / (tokens - 1), the
//! simulator's definition; a 503 is a rejection (by its `code`), an error
//! or an error event a failure.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::cli::write_report_rows;
use crate::sim::SimReport;
use crate::trace::Trace;
use axum::body::Bytes;
use hdrhistogram::Histogram;
use hyper::{Method, StatusCode};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvpool_conductor::cache::{CachePolicy, Capacity};
use kvpool_conductor::chunk_hash::ChunkHash;
use kvpool_conductor::scheduler::Policy;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use kvpool_serving::{api, http, sse};

/// `kvpool bench serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchServeArgs {
    /// The conductor's front (default: `serving.conductor.listen`).
    #[arg(long, value_name = "HOST:PORT")]
    pub front: Option<String>,
    /// Request trace, Mooncake format (JSON lines).
    #[arg(long)]
    pub trace: PathBuf,
    /// Tokens per block of the trace (512 for Mooncake's; what `kvpool sim
    /// scale --block-tokens` wrote for a scaled one). Must be a multiple of
    /// the engines' chunk size for shared blocks to be shared chunks.
    #[arg(long, default_value_t = 512)]
    pub block_tokens: u32,
    /// Divide arrival times by this (2 = twice the request rate).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Requests from the start of the trace (default: all).
    #[arg(long)]
    pub requests: Option<usize>,
    /// TTFT SLO for the attainment columns, ms (default: the conductor's).
    #[arg(long)]
    pub ttft_slo_ms: Option<f64>,
    /// TBT SLO for the attainment columns, ms (default: the conductor's).
    #[arg(long)]
    pub tbt_slo_ms: Option<f64>,
    /// Most requests open at once; later arrivals wait (and their TTFT
    /// counts the wait).
    #[arg(long, default_value_t = 512)]
    pub max_open: usize,
    /// Give up on one request after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// Print one JSON object (the `kvpool sim --json` keys).
    #[arg(long)]
    pub json: bool,
    /// Never show a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Also write one JSON line per request (times, tokens, outcome) here.
    #[arg(long, value_name = "FILE")]
    pub per_request: Option<PathBuf>,
}

/// The tokens of block id `id`: `n` ids below 256 (bytes, valid in every
/// vocabulary) from a splitmix64 stream seeded by `id`.
pub fn block_tokens(id: u64, n: usize) -> Vec<u32> {
    let mut x = id ^ 0x6b76_706f_6f6c_b10c;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % 256) as u32
        })
        .collect()
}

/// The prompt of a request of `input_tokens` tokens whose blocks are
/// `blocks` (see the module docs).
pub fn prompt_of(blocks: &[ChunkHash], input_tokens: u32, block_tokens_n: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(input_tokens as usize);
    let b = block_tokens_n as usize;
    for h in blocks {
        let want = (input_tokens as usize - out.len()).min(b);
        let mut t = block_tokens(h.0, b);
        t.truncate(want);
        out.extend(t);
    }
    out
}

/// One request's result.
#[derive(Debug, Clone, Serialize)]
pub struct RequestResult {
    /// Index in the trace.
    pub index: usize,
    /// Scheduled arrival, ms from the start.
    pub arrival_ms: f64,
    /// `ok`, `rejected`, `failed`.
    pub outcome: &'static str,
    /// The rejection's code, or the failure.
    pub reason: Option<String>,
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Mean gap between tokens, ms.
    pub tbt_ms: Option<f64>,
    /// Tokens received.
    pub tokens: u64,
    /// Prompt tokens whose KV came from the pool on prefill.
    pub cached_tokens: u64,
    /// End, ms from the start.
    pub end_ms: f64,
    /// The request id.
    pub request_id: String,
}

struct Job {
    index: usize,
    arrival: Instant,
    arrival_ms: f64,
    prompt: Vec<u32>,
    output: u32,
}

async fn run_one(front: String, job: Job, start: Instant, timeout: Duration) -> RequestResult {
    let rid = format!("bench-{}-{:08x}", job.index, rand::random::<u32>());
    let body = json!({"prompt": job.prompt, "max_tokens": job.output, "temperature": 0,
        "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
        "return_token_ids": true});
    let mut r = RequestResult {
        index: job.index,
        arrival_ms: job.arrival_ms,
        outcome: "failed",
        reason: None,
        ttft_ms: None,
        tbt_ms: None,
        tokens: 0,
        cached_tokens: 0,
        end_ms: 0.0,
        request_id: rid.clone(),
    };
    let since = |t: Instant| t.duration_since(job.arrival).as_secs_f64() * 1000.0;
    let res = async {
        let mut a = http::send(
            &front,
            Method::POST,
            "/v1/completions",
            &[(api::REQUEST_ID, rid.as_str())],
            Some(Bytes::from(body.to_string())),
            Duration::from_secs(5),
            Instant::now() + timeout,
        )
        .await
        .map_err(|e| e.to_string())?;
        if a.status() != StatusCode::OK {
            let status = a.status();
            let body = a.bytes(1 << 20).await.map_err(|e| e.to_string())?;
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let code = v["error"]["code"].as_str().map(str::to_string);
            if status == StatusCode::SERVICE_UNAVAILABLE {
                r.outcome = "rejected";
                r.reason = code;
                return Ok(());
            }
            return Err(format!("{status}: {}", String::from_utf8_lossy(&body)));
        }
        let mut reader = sse::Reader::new();
        let mut events = Vec::new();
        let (mut first, mut last) = (None, None);
        let mut usage_tokens = None;
        loop {
            let Some(chunk) = a.chunk(None).await.map_err(|e| e.to_string())? else {
                return Err("the stream ended without [DONE]".into());
            };
            let now = Instant::now();
            events.clear();
            reader
                .feed(&chunk, &mut events)
                .map_err(|e| e.to_string())?;
            for ev in events.drain(..) {
                let sse::Event::Data(d) = ev else {
                    let n = usage_tokens.unwrap_or(r.tokens).max(r.tokens);
                    r.tokens = n;
                    if let (Some(f), Some(l)) = (first, last) {
                        r.ttft_ms = Some(since(f));
                        if n >= 2 {
                            r.tbt_ms = Some(
                                Instant::duration_since(&l, f).as_secs_f64() * 1000.0
                                    / (n - 1) as f64,
                            );
                        }
                    }
                    r.outcome = "ok";
                    return Ok(());
                };
                let v: Value = serde_json::from_str(&d).map_err(|e| e.to_string())?;
                if let Some((message, _)) = api::event_error(&v) {
                    if let Some(f) = first {
                        r.ttft_ms = Some(since(f));
                    }
                    return Err(message);
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    usage_tokens = u["completion_tokens"].as_u64();
                    r.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0);
                }
                // Token ids, not text: a byte-level token may hold its text
                // back until the character is complete.
                let ids = v["choices"][0]["token_ids"].as_array().map_or(0, Vec::len) as u64;
                if ids > 0 {
                    r.tokens += ids;
                    first.get_or_insert(now);
                    last = Some(now);
                }
            }
        }
    }
    .await;
    if let Err(e) = res {
        r.outcome = "failed";
        r.reason = Some(e);
    }
    r.end_ms = start.elapsed().as_secs_f64() * 1000.0;
    r
}

/// What the front says of itself (`GET /kvpool/v1/status`).
#[derive(Debug, Clone)]
pub struct FrontStatus {
    /// Policy.
    pub policy: Policy,
    /// Instances.
    pub prefill: usize,
    /// Instances.
    pub decode: usize,
    /// SLOs, ms.
    pub ttft_slo_ms: f64,
    /// SLOs, ms.
    pub tbt_slo_ms: f64,
    /// Seed.
    pub seed: u64,
}

/// Asks the front for its policy, instances and SLOs.
pub async fn front_status(front: &str) -> Result<FrontStatus, String> {
    let (s, body) = http::get(front, "/kvpool/v1/status", 4 << 20, Duration::from_secs(10))
        .await
        .map_err(|e| e.to_string())?;
    if !s.is_success() {
        return Err(format!("GET /kvpool/v1/status answered {s}"));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    let c = &v["conductor"];
    let policy = c["policy"]
        .as_str()
        .and_then(|p| p.parse().ok())
        .ok_or("the front's status names no policy")?;
    Ok(FrontStatus {
        policy,
        prefill: v["prefill"].as_array().map_or(0, Vec::len),
        decode: v["decode"].as_array().map_or(0, Vec::len),
        ttft_slo_ms: c["slo"]["ttft_ms"].as_f64().unwrap_or(30_000.0),
        tbt_slo_ms: c["slo"]["tbt_ms"].as_f64().unwrap_or(100.0),
        seed: c["seed"].as_u64().unwrap_or(0),
    })
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 86_400_000_000, 3).expect("constant bounds")
}

/// Builds the report from the requests' results.
pub fn report(
    results: &[RequestResult],
    st: &FrontStatus,
    speed: f64,
    block_tokens_n: u32,
    blocks: &[usize],
) -> SimReport {
    let (ttft_slo, tbt_slo) = (st.ttft_slo_ms, st.tbt_slo_ms);
    let mut ttft = histogram();
    let mut tbt = histogram();
    let us = |ms: f64| (ms * 1000.0).round().clamp(1.0, 86_400_000_000.0) as u64;
    let (mut rejected, mut r_ttft, mut r_tbt, mut r_full) = (0, 0, 0, 0);
    let (mut prefilled, mut completed, mut failed, mut wasted, mut met) = (0, 0, 0, 0, 0);
    let (mut hit, mut total) = (0u64, 0u64);
    let mut last_end: f64 = 0.0;
    for r in results {
        last_end = last_end.max(r.end_ms);
        if r.outcome == "rejected" {
            rejected += 1;
            match r.reason.as_deref() {
                Some("ttft_slo") => r_ttft += 1,
                Some("tbt_slo") => r_tbt += 1,
                Some("prefill_queues_full") | Some("queues_full") => r_full += 1,
                _ => {}
            }
            continue;
        }
        if let Some(t) = r.ttft_ms {
            prefilled += 1;
            ttft.saturating_record(us(t));
            let n = blocks.get(r.index).copied().unwrap_or(0) as u64;
            total += n;
            hit += (r.cached_tokens / u64::from(block_tokens_n.max(1))).min(n);
        }
        if r.outcome != "ok" {
            failed += 1;
            if r.ttft_ms.is_some() {
                wasted += 1;
            }
            continue;
        }
        completed += 1;
        if let Some(t) = r.tbt_ms {
            tbt.saturating_record(us(t));
        }
        let ttft_ok = r.ttft_ms.is_some_and(|t| t <= ttft_slo);
        let tbt_ok = r.tbt_ms.is_none_or(|t| t <= tbt_slo);
        if ttft_ok && tbt_ok {
            met += 1;
        } else if !tbt_ok {
            wasted += 1;
        }
    }
    let q = |h: &Histogram<u64>, p: f64| {
        (!h.is_empty()).then(|| h.value_at_quantile(p) as f64 / 1000.0)
    };
    let n = results.len() as u64;
    let makespan_s = last_end / 1000.0;
    SimReport {
        policy: st.policy,
        prefill: st.prefill,
        decode: st.decode,
        cache_policy: CachePolicy::Lru,
        cache_blocks: Capacity::Unbounded,
        speed,
        seed: st.seed,
        ttft_slo_ms: ttft_slo,
        tbt_slo_ms: tbt_slo,
        requests: n,
        rejected,
        rejected_ttft: r_ttft,
        rejected_tbt: r_tbt,
        rejected_queue_full: r_full,
        prefilled,
        completed,
        dropped: failed,
        wasted_prefills: wasted,
        slo_met: met,
        ttft_ms_p50: q(&ttft, 0.50),
        ttft_ms_p90: q(&ttft, 0.90),
        ttft_ms_p99: q(&ttft, 0.99),
        tbt_ms_p50: q(&tbt, 0.50),
        tbt_ms_p90: q(&tbt, 0.90),
        tbt_ms_p99: q(&tbt, 0.99),
        slo_attainment: if n == 0 { 0.0 } else { met as f64 / n as f64 },
        goodput_rps: if makespan_s > 0.0 {
            met as f64 / makespan_s
        } else {
            0.0
        },
        prefix_hit_ratio: if total == 0 {
            0.0
        } else {
            hit as f64 / total as f64
        },
        pool_node_skew: None,
        hot_blocks: 0,
        makespan_s,
        tbt_forecast_requests: 0,
        tbt_forecast_at_join_bias_ms: None,
        tbt_forecast_bias_ms: None,
        tbt_forecast_mae_ms: None,
    }
}

/// Runs the bench; the report goes to `out`, progress to stderr.
pub async fn run_bench_serve(
    front: &str,
    args: &BenchServeArgs,
    out: &mut dyn Write,
) -> Result<SimReport, String> {
    if !(args.speed.is_finite() && args.speed > 0.0) {
        return Err(format!(
            "--speed must be a finite number > 0, got {}",
            args.speed
        ));
    }
    let trace =
        Trace::load_with_block_tokens(&args.trace, args.block_tokens).map_err(|e| e.to_string())?;
    let mut st = front_status(front).await?;
    if let Some(t) = args.ttft_slo_ms {
        st.ttft_slo_ms = t;
    }
    if let Some(t) = args.tbt_slo_ms {
        st.tbt_slo_ms = t;
    }
    let n = args.requests.unwrap_or(trace.len()).min(trace.len());
    let t0 = trace.requests().first().map_or(0, |r| r.timestamp_ms);
    let blocks: Vec<usize> = trace.iter().take(n).map(|(_, b)| b.len()).collect();
    let bar = if args.no_progress || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
        if let Ok(s) =
            ProgressStyle::with_template("{prefix:>18} [{bar:40}] {pos}/{len} requests {msg}")
        {
            b.set_style(s.progress_chars("=> "));
        }
        b.set_prefix(st.policy.as_str());
        b
    };
    let open = Arc::new(Semaphore::new(args.max_open.max(1)));
    let timeout = Duration::from_secs(args.timeout_s);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for (index, (r, b)) in trace.iter().take(n).enumerate() {
        let arrival_ms = (r.timestamp_ms - t0) as f64 / args.speed;
        let arrival = start + Duration::from_secs_f64(arrival_ms / 1000.0);
        let job = Job {
            index,
            arrival,
            arrival_ms,
            prompt: prompt_of(b, r.input_tokens, args.block_tokens),
            output: r.output_tokens.max(1),
        };
        let front = front.to_string();
        let open = open.clone();
        let bar = bar.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(job.arrival).await;
            let _permit = open.acquire_owned().await;
            let r = run_one(front, job, start, timeout).await;
            bar.inc(1);
            r
        }));
    }
    let mut results = Vec::with_capacity(n);
    for t in tasks {
        results.push(t.await.map_err(|e| format!("a request task failed: {e}"))?);
    }
    bar.finish_and_clear();
    if let Some(p) = &args.per_request {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?,
        );
        for r in &results {
            let line = serde_json::to_string(r).map_err(|e| e.to_string())?;
            writeln!(f, "{line}").map_err(|e| e.to_string())?;
        }
        f.flush().map_err(|e| e.to_string())?;
    }
    let rep = report(&results, &st, args.speed, args.block_tokens, &blocks);
    let w = |e: std::io::Error| e.to_string();
    if args.json {
        writeln!(
            out,
            "{}",
            serde_json::to_string(&rep).map_err(|e| e.to_string())?
        )
        .map_err(w)?;
    } else {
        writeln!(
            out,
            "live policy {}  (prefill {}, decode {}, front {}, speed {}x, SLO TTFT {} ms / TBT {} ms)",
            rep.policy, rep.prefill, rep.decode, front, rep.speed, rep.ttft_slo_ms, rep.tbt_slo_ms
        )
        .map_err(w)?;
        write_report_rows(out, &rep).map_err(w)?;
        let failed: Vec<&RequestResult> =
            results.iter().filter(|r| r.outcome == "failed").collect();
        if let Some(f) = failed.first() {
            writeln!(
                out,
                "  {} requests failed; the first (request {}): {}",
                failed.len(),
                f.index,
                f.reason.as_deref().unwrap_or("?")
            )
            .map_err(w)?;
        }
    }
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_ids_give_shared_tokens_and_partial_blocks_are_prefixes() {
        let a = prompt_of(&[ChunkHash(1), ChunkHash(2), ChunkHash(3)], 40, 16);
        let b = prompt_of(&[ChunkHash(1), ChunkHash(2), ChunkHash(9)], 40, 16);
        assert_eq!(a.len(), 40);
        assert_eq!(a[..32], b[..32]);
        assert_ne!(a[32..], b[32..]);
        let short = prompt_of(&[ChunkHash(1), ChunkHash(2), ChunkHash(3)], 35, 16);
        assert_eq!(short[..], a[..35]);
        assert!(a.iter().all(|&t| t < 256));
        assert_ne!(block_tokens(1, 16), block_tokens(2, 16));
    }

    #[test]
    fn the_report_counts_like_the_simulator() {
        let st = FrontStatus {
            policy: Policy::CacheGlobal,
            prefill: 2,
            decode: 1,
            ttft_slo_ms: 100.0,
            tbt_slo_ms: 10.0,
            seed: 0,
        };
        let r = |index, outcome, reason: Option<&str>, ttft, tbt, cached| RequestResult {
            index,
            arrival_ms: 0.0,
            outcome,
            reason: reason.map(str::to_string),
            ttft_ms: ttft,
            tbt_ms: tbt,
            tokens: 4,
            cached_tokens: cached,
            end_ms: 1000.0,
            request_id: String::new(),
        };
        let results = [
            r(0, "ok", None, Some(50.0), Some(5.0), 0),
            r(1, "ok", None, Some(50.0), Some(50.0), 32),
            r(2, "rejected", Some("ttft_slo"), None, None, 0),
            r(3, "failed", Some("x"), Some(10.0), None, 0),
        ];
        let rep = report(&results, &st, 1.0, 16, &[2, 4, 2, 2]);
        assert_eq!((rep.requests, rep.rejected, rep.rejected_ttft), (4, 1, 1));
        assert_eq!((rep.prefilled, rep.completed, rep.dropped), (3, 2, 1));
        assert_eq!((rep.slo_met, rep.wasted_prefills), (1, 2));
        assert_eq!(rep.slo_attainment, 0.25);
        assert_eq!(rep.goodput_rps, 1.0);
        assert!((rep.prefix_hit_ratio - 2.0 / 8.0).abs() < 1e-12);
    }
}
