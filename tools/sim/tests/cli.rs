//! The `kvpool sim` command line, parsed with clap and run to a buffer.

use crate::support;

use std::collections::BTreeSet;
use std::path::PathBuf;

use clap::Parser;
use kvpool_sim::cli::{run_sim_cache_to, run_sim_gen, run_sim_to, SimCommand, SimSubcommand};
use kvpool_sim::trace::Trace;
use support::{load_trace, TRACE_PATH};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Top,
}

#[derive(clap::Subcommand)]
enum Top {
    Sim(SimCommand),
}

fn parse(args: &[&str]) -> Result<SimCommand, clap::Error> {
    let mut all = vec!["kvpool", "sim"];
    all.extend_from_slice(args);
    Cli::try_parse_from(all).map(|c| match c.cmd {
        Top::Sim(s) => s,
    })
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpool-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn json_lines(buf: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8(buf.to_vec())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn sim_json_has_one_line_per_policy_with_the_issue_keys() {
    let cmd = parse(&[
        "--trace",
        TRACE_PATH,
        "--policy",
        "all",
        "--prefill",
        "8",
        "--decode",
        "2",
        "--cache-blocks",
        "inf",
        "--ttft-slo-ms",
        "30000",
        "--tbt-slo-ms",
        "100",
        "--speed",
        "3",
        "--json",
    ])
    .unwrap();
    assert!(cmd.command.is_none());
    let mut out = Vec::new();
    let reports = run_sim_to(&cmd.args, &mut out, false).unwrap();
    assert_eq!(reports.len(), 7);
    let lines = json_lines(&out);
    let names: Vec<&str> = lines
        .iter()
        .map(|l| l["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "random",
            "round_robin",
            "least_loaded",
            "cache_local",
            "cache_global",
            "early_reject",
            "predictive_reject"
        ]
    );
    for l in &lines {
        for key in [
            "policy",
            "prefix_hit_ratio",
            "ttft_ms_p50",
            "ttft_ms_p90",
            "ttft_ms_p99",
            "tbt_ms_p50",
            "tbt_ms_p90",
            "tbt_ms_p99",
            "slo_attainment",
            "goodput_rps",
            "rejected",
            "wasted_prefills",
        ] {
            assert!(l.get(key).is_some(), "missing {key} in {l}");
        }
        assert!(l["ttft_ms_p50"].as_f64().unwrap() <= l["ttft_ms_p99"].as_f64().unwrap());
    }
}

#[test]
fn sim_text_output_and_plot() {
    let dir = scratch_dir("plot");
    let png = dir.join("ttft.png");
    let cmd = parse(&[
        "--trace",
        TRACE_PATH,
        "--policy",
        "cache_global,random",
        "--plot",
        png.to_str().unwrap(),
    ])
    .unwrap();
    let mut out = Vec::new();
    run_sim_to(&cmd.args, &mut out, false).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("policy cache_global"), "{text}");
    assert!(text.contains("policy random"), "{text}");
    assert!(text.contains("SLO attainment"), "{text}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    assert!(bytes.len() > 5_000);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sim_cache_json_lines() {
    let cmd = parse(&[
        "cache",
        "--trace",
        TRACE_PATH,
        "--cache-policy",
        "lru",
        "--cache-blocks",
        "1000,10000,inf",
        "--json",
    ])
    .unwrap();
    let Some(SimSubcommand::Cache(args)) = &cmd.command else {
        panic!("expected the cache subcommand");
    };
    let mut out = Vec::new();
    run_sim_cache_to(args, &mut out).unwrap();
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 3);
    let got: Vec<(String, String, f64)> = lines
        .iter()
        .map(|l| {
            (
                l["cache_policy"].as_str().unwrap().to_string(),
                l["cache_blocks"].to_string(),
                l["prefix_hit_ratio"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got[0].0, "lru");
    assert_eq!(got[0].1, "1000");
    assert_eq!(got[2].1, "\"inf\"");
    let total = load_trace().total_blocks();
    assert!(lines
        .iter()
        .all(|l| l["total_blocks"].as_u64() == Some(total)));
    for ((_, _, r), want) in got.iter().zip([0.0825, 0.4235, 0.6396]) {
        assert!((r - want).abs() <= 0.0005, "{r} vs {want}");
    }
}

fn gen_args(cmd: &SimCommand) -> &kvpool_sim::cli::SimGenArgs {
    match &cmd.command {
        Some(SimSubcommand::Gen(args)) => args,
        _ => panic!("expected the gen subcommand"),
    }
}

#[test]
fn sim_gen_writes_a_trace_that_reproduces_itself() {
    let dir = scratch_dir("gen");
    let a = dir.join("a.jsonl");
    let b = dir.join("b.jsonl");
    let cmd = parse(&[
        "gen",
        "--preset",
        "bursty",
        "--seed",
        "5",
        "--requests",
        "500",
        "--output-tokens-mean",
        "300",
        "--out",
        a.to_str().unwrap(),
    ])
    .unwrap();
    let (params, n) = run_sim_gen(gen_args(&cmd)).unwrap();
    assert_eq!(
        (params.seed, params.requests, params.output_tokens_mean),
        (5, 500, 300)
    );
    assert_eq!(n, 500);
    let trace = Trace::load(&a).unwrap();
    assert_eq!(trace.len(), 500);
    assert_eq!(trace.generator(), Some(&params));
    // The file alone gives the same bytes again.
    let cmd = parse(&[
        "gen",
        "--from",
        a.to_str().unwrap(),
        "--out",
        b.to_str().unwrap(),
    ])
    .unwrap();
    run_sim_gen(gen_args(&cmd)).unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    // A flag on top of --from changes only that parameter.
    let cmd = parse(&[
        "gen",
        "--from",
        a.to_str().unwrap(),
        "--seed",
        "6",
        "--out",
        b.to_str().unwrap(),
    ])
    .unwrap();
    let (changed, _) = run_sim_gen(gen_args(&cmd)).unwrap();
    assert_eq!(changed.seed, 6);
    assert_eq!(changed.output_tokens_mean, 300);
    assert_ne!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    // Refusals: --from and --preset together, a trace without a header, a
    // parameter out of range (named).
    assert!(parse(&["gen", "--from", "x", "--preset", "bursty", "--out", "y"]).is_err());
    let cmd = parse(&["gen", "--from", TRACE_PATH, "--out", b.to_str().unwrap()]).unwrap();
    let err = run_sim_gen(gen_args(&cmd)).unwrap_err();
    assert!(
        err.to_string().contains("no `kvpool sim gen` header"),
        "{err}"
    );
    let cmd = parse(&[
        "gen",
        "--diurnal-amplitude",
        "1.5",
        "--out",
        b.to_str().unwrap(),
    ])
    .unwrap();
    let err = run_sim_gen(gen_args(&cmd)).unwrap_err();
    assert!(err.to_string().contains("diurnal_amplitude"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sim_plot_load_draws_the_load_of_every_policy() {
    let dir = scratch_dir("load");
    let trace = dir.join("t.jsonl");
    let png = dir.join("load.png");
    let cmd = parse(&["gen", "--requests", "800", "--out", trace.to_str().unwrap()]).unwrap();
    run_sim_gen(gen_args(&cmd)).unwrap();
    let cmd = parse(&[
        "--trace",
        trace.to_str().unwrap(),
        "--policy",
        "early_reject,predictive_reject",
        "--decode",
        "1",
        "--speed",
        "2",
        "--plot-load",
        png.to_str().unwrap(),
    ])
    .unwrap();
    let mut out = Vec::new();
    run_sim_to(&cmd.args, &mut out, false).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(text.matches("decode load:").count(), 2, "{text}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    assert!(bytes.len() > 5_000);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_arguments_are_refused() {
    assert!(parse(&[]).is_err(), "--trace is required");
    assert!(parse(&["--trace", "t", "--policy", "fastest"]).is_err());
    assert!(parse(&["--trace", "t", "--cache-blocks", "lots"]).is_err());
    assert!(parse(&["cache", "--trace", "t", "--cache-policy", "fifo"]).is_err());
    let cmd = parse(&["--trace", TRACE_PATH, "--speed", "0"]).unwrap();
    let err = run_sim_to(&cmd.args, &mut Vec::new(), false).unwrap_err();
    assert!(err.to_string().contains("--speed"), "{err}");
    let cmd = parse(&["--trace", TRACE_PATH, "--prefill", "0"]).unwrap();
    assert!(run_sim_to(&cmd.args, &mut Vec::new(), false).is_err());
    let cmd = parse(&["--trace", "/nonexistent/trace.jsonl"]).unwrap();
    let err = run_sim_to(&cmd.args, &mut Vec::new(), false).unwrap_err();
    assert!(
        err.to_string().contains("/nonexistent/trace.jsonl"),
        "{err}"
    );
}

#[test]
fn bad_trace_line_and_bad_config_name_the_culprit() {
    let dir = scratch_dir("bad");
    let trace = dir.join("bad.jsonl");
    let good = std::fs::read_to_string(TRACE_PATH).unwrap();
    let mut text: String = good.lines().take(4).map(|l| format!("{l}\n")).collect();
    text.push_str("{\"timestamp\": 9999999, \"input_length\": \"many\"}\n");
    std::fs::write(&trace, text).unwrap();
    let cmd = parse(&["--trace", trace.to_str().unwrap()]).unwrap();
    let err = run_sim_to(&cmd.args, &mut Vec::new(), false).unwrap_err();
    assert!(err.to_string().contains("line 5"), "{err}");

    let config = dir.join("cluster.toml");
    std::fs::write(&config, "[decode]\nmax_bach = 64\n").unwrap();
    let cmd = parse(&["--trace", TRACE_PATH, "--model", config.to_str().unwrap()]).unwrap();
    let err = run_sim_to(&cmd.args, &mut Vec::new(), false).unwrap_err();
    assert!(err.to_string().contains("max_bach"), "{err}");
    std::fs::write(&config, "[decode]\nmax_batch = 0\n").unwrap();
    let cmd = parse(&["--trace", TRACE_PATH, "--model", config.to_str().unwrap()]).unwrap();
    let err = run_sim_to(&cmd.args, &mut Vec::new(), false).unwrap_err();
    assert!(err.to_string().contains("decode.max_batch"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn example_config_loads_and_matches_the_defaults() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cluster-model.toml"
    );
    let model = kvpool_conductor::cost::CostModel::load(std::path::Path::new(path)).unwrap();
    assert_eq!(model, kvpool_conductor::cost::CostModel::default());
    // Every key of the model appears in the example, so each is documented there.
    let text = std::fs::read_to_string(path).unwrap();
    let keys: BTreeSet<String> = toml::to_string(&model)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(" = ").map(|(k, _)| k.trim().to_string()))
        .collect();
    for key in keys {
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with(&format!("{key} ="))),
            "{key} is not in the example config"
        );
    }
}
