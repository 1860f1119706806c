//! Command line of the simulator: `kvpool sim ...`, `kvpool sim cache ...`,
//! `kvpool sim gen ...`, `kvpool sim scale ...` and `kvpool sim replay ...`.
//!
//! The binary embeds [`SimCommand`] as its `sim` subcommand and calls
//! [`run_sim_command`]; [`run_sim`], [`run_sim_cache`] and [`run_sim_gen`]
//! run one form each.
//! Human-readable text goes to stdout; with `--json`, one JSON object per
//! line instead (per policy, or per cache policy and capacity). Progress bars
//! go to stderr and only when it is a terminal.

use std::io::{self, Write};
use std::path::PathBuf;
use std::str::FromStr;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::cache_sim::{simulate_cache, CacheSimReport};
use crate::error::SimError;
use crate::gen::{write_trace, GenParams, Preset};
use crate::plot::{plot_load_series, plot_ttft_cdf};
use crate::sim::{simulate_logged, PoolNodes, SimConfig, SimOutcome, SimReport, SWING_HIGH};
use crate::trace::{ScaleParams, Trace};
use kvpool_conductor::cache::{CachePolicy, Capacity};
use kvpool_conductor::cost::CostModel;
use kvpool_conductor::record::{replay, DecisionLog, ReplayReport};
use kvpool_conductor::scheduler::{Policy, Slo};

/// A `--policy` value: one policy, or `all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyArg {
    /// One policy.
    One(Policy),
    /// Every policy.
    All,
}

impl FromStr for PolicyArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "all" {
            return Ok(PolicyArg::All);
        }
        s.parse::<Policy>()
            .map(PolicyArg::One)
            .map_err(|e| e.to_string())
    }
}

/// `kvpool sim`: replay a trace against the modelled cluster.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Request trace, Mooncake format (JSON lines).
    #[arg(long, required = true)]
    pub trace: Option<PathBuf>,
    /// Scheduling policies, comma-separated, or `all`: random, round_robin,
    /// least_loaded, cache_local, cache_global, early_reject, predictive_reject.
    #[arg(long, value_delimiter = ',', default_value = "cache_global")]
    pub policy: Vec<PolicyArg>,
    /// Prefill instances.
    #[arg(long, default_value_t = 8)]
    pub prefill: usize,
    /// Decode instances.
    #[arg(long, default_value_t = 2)]
    pub decode: usize,
    /// Pool capacity in blocks, or `inf`.
    #[arg(long, default_value = "inf")]
    pub cache_blocks: Capacity,
    /// Pool eviction policy.
    #[arg(long, value_enum, default_value = "lru")]
    pub cache_policy: CachePolicy,
    /// TTFT SLO, ms.
    #[arg(long, default_value_t = 30_000.0)]
    pub ttft_slo_ms: f64,
    /// TBT SLO (per-request average gap between tokens), ms.
    #[arg(long, default_value_t = 100.0)]
    pub tbt_slo_ms: f64,
    /// Divide arrival timestamps by this (2 = twice the request rate).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Seed of the `random` policy.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Cluster cost model (TOML); defaults are built in.
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Print one JSON object per policy per line.
    #[arg(long)]
    pub json: bool,
    /// Also draw the TTFT CDF of every policy to this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Also sample prefill and decode load every simulated second and draw
    /// it over time, one panel per policy, to this PNG.
    #[arg(long, value_name = "FILE.png")]
    pub plot_load: Option<PathBuf>,
    /// Never show a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Model the pool's storage nodes (0: a fetch costs the instance's link
    /// only): blocks live on nodes by hash, each node serves one fetch at a time.
    #[arg(long, default_value_t = 0)]
    pub pool_nodes: usize,
    /// Each pool node's network, Gbit/s (with --pool-nodes).
    #[arg(long, default_value_t = 100.0)]
    pub node_gbps: f64,
    /// Hot-object replication (with --pool-nodes): a block read this many
    /// times within --hot-window-ms gets a second replica (0: off).
    #[arg(long, default_value_t = 0)]
    pub hot_reads: u32,
    /// The read-counting window of --hot-reads, ms.
    #[arg(long, default_value_t = 1_000.0)]
    pub hot_window_ms: f64,
    /// Write every decision with the cluster state it was made on to this
    /// file (JSON lines; `kvpool sim replay --log FILE` checks it).
    #[arg(long, value_name = "FILE")]
    pub decision_log: Option<PathBuf>,
}

impl SimArgs {
    /// The policies to run, in command-line order, without duplicates.
    pub fn policies(&self) -> Vec<Policy> {
        let mut out: Vec<Policy> = Vec::new();
        for p in &self.policy {
            let add: &[Policy] = match p {
                PolicyArg::All => &Policy::ALL,
                PolicyArg::One(p) => std::slice::from_ref(p),
            };
            for p in add {
                if !out.contains(p) {
                    out.push(*p);
                }
            }
        }
        out
    }
}

/// `kvpool sim cache`: the pool's hit ratio alone.
#[derive(Debug, Clone, clap::Args)]
pub struct SimCacheArgs {
    /// Request trace, Mooncake format (JSON lines).
    #[arg(long)]
    pub trace: PathBuf,
    /// Eviction policies, comma-separated: lru, lfu, length_aware.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "lru")]
    pub cache_policy: Vec<CachePolicy>,
    /// Capacities in blocks, comma-separated; `inf` for unbounded.
    #[arg(long, value_delimiter = ',', default_value = "inf")]
    pub cache_blocks: Vec<Capacity>,
    /// Print one JSON object per (policy, capacity) per line.
    #[arg(long)]
    pub json: bool,
}

/// `kvpool sim gen`: write a seeded workload in Mooncake's trace format.
///
/// The parameters start from `--preset` (or from `--from FILE`'s header),
/// then every flag given overrides one; all of them go into the file's first
/// line, so the file alone reproduces itself.
#[derive(Debug, Clone, clap::Args)]
pub struct SimGenArgs {
    /// Output file, or `-` for stdout.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Starting parameters.
    #[arg(
        long,
        value_enum,
        default_value = "decode-heavy",
        conflicts_with = "from"
    )]
    pub preset: Preset,
    /// Start from the parameters in this generated trace's header instead.
    #[arg(long, value_name = "FILE")]
    pub from: Option<PathBuf>,
    /// Seed of the generator.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Requests in the trace (default 12,000 with a preset).
    #[arg(long)]
    pub requests: Option<u32>,
    /// Mean request rate before modulation, /s.
    #[arg(long)]
    pub rate_rps: Option<f64>,
    /// Period of the diurnal ramp, s (0 = none).
    #[arg(long)]
    pub diurnal_period_s: Option<f64>,
    /// Relative depth of the diurnal ramp, in [0, 1).
    #[arg(long)]
    pub diurnal_amplitude: Option<f64>,
    /// Mean gap between bursts, s (0 = none).
    #[arg(long)]
    pub burst_every_s: Option<f64>,
    /// Length of a burst, s.
    #[arg(long)]
    pub burst_len_s: Option<f64>,
    /// Rate multiplier inside a burst.
    #[arg(long)]
    pub burst_factor: Option<f64>,
    /// Distinct shared system prompts (0 = none).
    #[arg(long)]
    pub shared_prefixes: Option<u32>,
    /// Tokens of each shared system prompt.
    #[arg(long)]
    pub prefix_tokens: Option<u32>,
    /// Mean turns per conversation.
    #[arg(long)]
    pub turns_mean: Option<f64>,
    /// Mean think time between turns, s.
    #[arg(long)]
    pub think_s_mean: Option<f64>,
    /// Mean tokens of a conversation's first message.
    #[arg(long)]
    pub first_input_tokens_mean: Option<u32>,
    /// Mean tokens of a later message.
    #[arg(long)]
    pub turn_input_tokens_mean: Option<u32>,
    /// Log-normal shape of message lengths.
    #[arg(long)]
    pub input_sigma: Option<f64>,
    /// Mean output tokens.
    #[arg(long)]
    pub output_tokens_mean: Option<u32>,
    /// Log-normal shape of output lengths.
    #[arg(long)]
    pub output_sigma: Option<f64>,
    /// Longest output.
    #[arg(long)]
    pub output_tokens_max: Option<u32>,
    /// Longest prompt; a conversation ends before exceeding it.
    #[arg(long)]
    pub context_tokens_max: Option<u32>,
    /// Zipf exponent of the shared prompts' popularity (0 = uniform).
    #[arg(long)]
    pub prefix_zipf_s: Option<f64>,
}

/// Requests of `kvpool sim gen` when neither `--requests` nor `--from` says.
pub const GEN_DEFAULT_REQUESTS: u32 = 12_000;

impl SimGenArgs {
    /// The parameters these arguments name.
    pub fn params(&self) -> Result<GenParams, SimError> {
        let mut p = match &self.from {
            Some(path) => {
                let trace = Trace::load(path)?;
                trace.generator().cloned().ok_or_else(|| {
                    SimError::InvalidArg(format!(
                        "{} has no `kvpool sim gen` header to start from",
                        path.display()
                    ))
                })?
            }
            None => self.preset.params(0, GEN_DEFAULT_REQUESTS),
        };
        fn set<T: Copy>(dst: &mut T, v: Option<T>) {
            if let Some(v) = v {
                *dst = v;
            }
        }
        set(&mut p.seed, self.seed);
        set(&mut p.requests, self.requests);
        set(&mut p.rate_rps, self.rate_rps);
        set(&mut p.diurnal_period_s, self.diurnal_period_s);
        set(&mut p.diurnal_amplitude, self.diurnal_amplitude);
        set(&mut p.burst_every_s, self.burst_every_s);
        set(&mut p.burst_len_s, self.burst_len_s);
        set(&mut p.burst_factor, self.burst_factor);
        set(&mut p.shared_prefixes, self.shared_prefixes);
        set(&mut p.prefix_tokens, self.prefix_tokens);
        set(&mut p.turns_mean, self.turns_mean);
        set(&mut p.think_s_mean, self.think_s_mean);
        set(&mut p.first_input_tokens_mean, self.first_input_tokens_mean);
        set(&mut p.turn_input_tokens_mean, self.turn_input_tokens_mean);
        set(&mut p.input_sigma, self.input_sigma);
        set(&mut p.output_tokens_mean, self.output_tokens_mean);
        set(&mut p.output_sigma, self.output_sigma);
        set(&mut p.output_tokens_max, self.output_tokens_max);
        set(&mut p.context_tokens_max, self.context_tokens_max);
        set(&mut p.prefix_zipf_s, self.prefix_zipf_s);
        p.validate()
            .map_err(|e| SimError::InvalidArg(e.to_string()))?;
        Ok(p)
    }
}

/// `kvpool sim scale`: a smaller copy of a trace, for engines that cannot
/// serve the original (see [`ScaleParams`]).
#[derive(Debug, Clone, clap::Args)]
pub struct SimScaleArgs {
    /// The trace to shrink (Mooncake format).
    #[arg(long)]
    pub trace: PathBuf,
    /// Tokens per block of `--trace`.
    #[arg(long, default_value_t = 512)]
    pub from_block_tokens: u32,
    /// Output file, or `-` for stdout.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Tokens per block in the output: every block keeps its id.
    #[arg(long)]
    pub block_tokens: u32,
    /// Requests passed over at the start of `--trace`.
    #[arg(long, default_value_t = 0)]
    pub skip: usize,
    /// Requests kept (after `--skip`).
    #[arg(long, default_value_t = usize::MAX)]
    pub requests: usize,
    /// Factor on output lengths.
    #[arg(long, default_value_t = 1.0)]
    pub output_scale: f64,
    /// Longest output written.
    #[arg(long, default_value_t = u32::MAX)]
    pub output_max: u32,
}

/// `kvpool sim replay`: make every decision of a decision log again.
#[derive(Debug, Clone, clap::Args)]
pub struct SimReplayArgs {
    /// A decision log (`kvpool sim --decision-log`, or the live
    /// conductor's `serving.conductor.decision_log`).
    #[arg(long, value_name = "FILE")]
    pub log: PathBuf,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Subcommands of `kvpool sim`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum SimSubcommand {
    /// The pool's hit ratio alone, no cluster model.
    Cache(SimCacheArgs),
    /// Write a seeded workload (decode-heavy, bursty, ...) as a trace.
    Gen(Box<SimGenArgs>),
    /// Write a smaller copy of a trace (fewer tokens per block, shorter
    /// answers, fewer requests), the same prefixes shared.
    Scale(SimScaleArgs),
    /// Replay a decision log through the scheduler: exit 0 if every
    /// decision is made again the same, 2 otherwise.
    Replay(SimReplayArgs),
}

/// `kvpool sim [ARGS]` or `kvpool sim cache [ARGS]`.
#[derive(Debug, Clone, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct SimCommand {
    /// `cache`, or nothing for the full simulation.
    #[command(subcommand)]
    pub command: Option<SimSubcommand>,
    /// Arguments of the full simulation.
    #[command(flatten)]
    pub args: SimArgs,
}

/// Runs whichever form `cmd` names, printing to stdout.
pub fn run_sim_command(cmd: &SimCommand) -> Result<(), SimError> {
    match &cmd.command {
        Some(SimSubcommand::Cache(args)) => run_sim_cache(args),
        Some(SimSubcommand::Gen(args)) => run_sim_gen(args).map(|_| ()),
        Some(SimSubcommand::Scale(args)) => run_sim_scale(args).map(|_| ()),
        Some(SimSubcommand::Replay(args)) => {
            let stdout = io::stdout();
            let mut out = stdout.lock();
            run_sim_replay_to(args, &mut out).map(|_| ())
        }
        None => run_sim(&cmd.args),
    }
}

/// Opens `path` for writing, or stdout for `-`.
fn create_out(path: &std::path::Path) -> Result<Box<dyn Write>, SimError> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(io::BufWriter::new(io::stdout())));
    }
    let file = std::fs::File::create(path).map_err(|e| {
        SimError::Output(io::Error::new(e.kind(), format!("{}: {e}", path.display())))
    })?;
    Ok(Box::new(io::BufWriter::new(file)))
}

/// `kvpool sim scale`: returns the requests written.
pub fn run_sim_scale(args: &SimScaleArgs) -> Result<u64, SimError> {
    let p = ScaleParams {
        block_tokens: args.block_tokens,
        skip: args.skip,
        requests: args.requests,
        output_scale: args.output_scale,
        output_max: args.output_max,
    };
    p.validate().map_err(SimError::InvalidArg)?;
    let trace = Trace::load_with_block_tokens(&args.trace, args.from_block_tokens)?;
    let mut out = create_out(&args.out)?;
    let n = trace.write_scaled(&p, &mut out)?;
    out.flush()?;
    Ok(n)
}

/// `kvpool sim replay` writing to `out`. A decision made differently is an
/// error (after the report is written).
pub fn run_sim_replay_to(
    args: &SimReplayArgs,
    out: &mut dyn Write,
) -> Result<ReplayReport, SimError> {
    let file = std::fs::File::open(&args.log)
        .map_err(|e| SimError::InvalidArg(format!("cannot read {}: {e}", args.log.display())))?;
    let r = replay(io::BufReader::new(file)).map_err(|e| SimError::InvalidArg(e.to_string()))?;
    if args.json {
        json_line(out, &r)?;
    } else {
        writeln!(
            out,
            "replayed {} decisions ({} routed, {} rejected) of {} run(s): {} made again the same",
            r.decisions, r.routed, r.rejected, r.runs, r.agreed
        )?;
        for m in &r.mismatches {
            writeln!(
                out,
                "  line {} (request {}): logged {}, replayed {}",
                m.line,
                m.id,
                serde_json::to_string(&m.logged).unwrap_or_default(),
                serde_json::to_string(&m.replayed).unwrap_or_default()
            )?;
        }
    }
    if r.agreed != r.decisions {
        return Err(SimError::InvalidArg(format!(
            "{} of {} decisions differ from the log",
            r.decisions - r.agreed,
            r.decisions
        )));
    }
    if r.decisions == 0 {
        return Err(SimError::InvalidArg(format!(
            "{} holds no decision",
            args.log.display()
        )));
    }
    Ok(r)
}

/// `kvpool sim gen`: writes the trace to `--out` (or stdout for `-`) and
/// returns the parameters and the number of requests written.
pub fn run_sim_gen(args: &SimGenArgs) -> Result<(GenParams, u64), SimError> {
    let params = args.params()?;
    let gen_err = |e: super::gen::GenError| match e {
        super::gen::GenError::Io(e) => SimError::Output(e),
        other => SimError::InvalidArg(other.to_string()),
    };
    let n = if args.out.as_os_str() == "-" {
        let stdout = io::stdout();
        let mut out = io::BufWriter::new(stdout.lock());
        let n = write_trace(&params, &mut out).map_err(gen_err)?;
        out.flush()?;
        n
    } else {
        let file = std::fs::File::create(&args.out).map_err(|e| {
            SimError::Output(io::Error::new(
                e.kind(),
                format!("{}: {e}", args.out.display()),
            ))
        })?;
        let mut out = io::BufWriter::new(file);
        let n = write_trace(&params, &mut out).map_err(gen_err)?;
        out.flush()?;
        n
    };
    Ok((params, n))
}

/// `kvpool sim`, printing to stdout (progress bars on stderr).
pub fn run_sim(args: &SimArgs) -> Result<(), SimError> {
    let stdout = io::stdout();
    let mut out = stdout.lock();
    run_sim_to(args, &mut out, !args.no_progress)?;
    out.flush()?;
    Ok(())
}

/// `kvpool sim cache`, printing to stdout.
pub fn run_sim_cache(args: &SimCacheArgs) -> Result<(), SimError> {
    let stdout = io::stdout();
    let mut out = stdout.lock();
    run_sim_cache_to(args, &mut out)?;
    out.flush()?;
    Ok(())
}

/// Simulated time between load samples with `--plot-load`, ms.
pub const LOAD_SAMPLE_MS: f64 = 1_000.0;

/// The configurations `args` asks for, one per policy.
pub fn sim_configs(args: &SimArgs) -> Result<Vec<SimConfig>, SimError> {
    let cost = match &args.model {
        Some(path) => CostModel::load(path)?,
        None => CostModel::default(),
    };
    let policies = args.policies();
    if policies.is_empty() {
        return Err(SimError::InvalidArg("--policy names no policy".into()));
    }
    let configs: Vec<SimConfig> = policies
        .into_iter()
        .map(|policy| SimConfig {
            policy,
            prefill: args.prefill,
            decode: args.decode,
            cache_policy: args.cache_policy,
            cache_blocks: args.cache_blocks,
            slo: Slo {
                ttft_ms: args.ttft_slo_ms,
                tbt_ms: args.tbt_slo_ms,
            },
            speed: args.speed,
            seed: args.seed,
            cost: cost.clone(),
            load_sample_ms: args.plot_load.as_ref().map(|_| LOAD_SAMPLE_MS),
            pool_nodes: PoolNodes {
                nodes: args.pool_nodes,
                node_gbps: args.node_gbps,
                hot_reads: args.hot_reads,
                hot_window_ms: args.hot_window_ms,
            },
        })
        .collect();
    for c in &configs {
        c.validate()?;
    }
    Ok(configs)
}

fn progress_bar(len: u64, policy: Policy, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{prefix:>18} [{bar:40}] {pos}/{len} requests")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(policy.as_str());
    bar
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"))
}

fn write_text(out: &mut dyn Write, r: &SimReport) -> io::Result<()> {
    writeln!(
        out,
        "policy {}  (prefill {}, decode {}, pool {} {}, speed {}x, SLO TTFT {} ms / TBT {} ms)",
        r.policy,
        r.prefill,
        r.decode,
        r.cache_policy,
        r.cache_blocks,
        r.speed,
        r.ttft_slo_ms,
        r.tbt_slo_ms
    )?;
    write_report_rows(out, r)
}

/// The rows of a report under its heading line: counts, TTFT and TBT
/// percentiles, SLO attainment, goodput, hit ratio. `kvpool bench serve`
/// prints a live run with these same rows.
pub fn write_report_rows(out: &mut dyn Write, r: &SimReport) -> io::Result<()> {
    writeln!(
        out,
        "  requests {}  rejected {} (ttft {}, tbt {}, queues full {})  prefilled {}  completed {}  dropped {}  wasted prefills {}",
        r.requests,
        r.rejected,
        r.rejected_ttft,
        r.rejected_tbt,
        r.rejected_queue_full,
        r.prefilled,
        r.completed,
        r.dropped,
        r.wasted_prefills
    )?;
    writeln!(
        out,
        "  TTFT ms  p50 {:>9}  p90 {:>9}  p99 {:>9}",
        fmt_ms(r.ttft_ms_p50),
        fmt_ms(r.ttft_ms_p90),
        fmt_ms(r.ttft_ms_p99)
    )?;
    writeln!(
        out,
        "  TBT ms   p50 {:>9}  p90 {:>9}  p99 {:>9}",
        fmt_ms(r.tbt_ms_p50),
        fmt_ms(r.tbt_ms_p90),
        fmt_ms(r.tbt_ms_p99)
    )?;
    writeln!(
        out,
        "  SLO attainment {:.1}%  goodput {:.3} req/s  prefix hit ratio {:.4}  makespan {:.1} s",
        r.slo_attainment * 100.0,
        r.goodput_rps,
        r.prefix_hit_ratio,
        r.makespan_s
    )?;
    if let Some(skew) = r.pool_node_skew {
        writeln!(
            out,
            "  pool nodes: busiest served {skew:.2}x the mean bytes; {} blocks replicated as hot",
            r.hot_blocks
        )?;
    }
    Ok(())
}

fn json_line(out: &mut dyn Write, value: &impl serde::Serialize) -> Result<(), SimError> {
    let text = serde_json::to_string(value)
        .map_err(|e| SimError::Output(io::Error::new(io::ErrorKind::InvalidData, e)))?;
    writeln!(out, "{text}")?;
    Ok(())
}

/// `kvpool sim` writing to `out`; returns the reports. Progress bars are
/// drawn on stderr when `progress` is set and stderr is a terminal.
pub fn run_sim_to(
    args: &SimArgs,
    out: &mut dyn Write,
    progress: bool,
) -> Result<Vec<SimReport>, SimError> {
    let path = args
        .trace
        .as_ref()
        .ok_or_else(|| SimError::InvalidArg("--trace is required".into()))?;
    let configs = sim_configs(args)?;
    let trace = Trace::load_with_block_tokens(path, configs[0].cost.block_tokens)?;
    let mut log = match &args.decision_log {
        Some(p) => Some(DecisionLog::new(create_out(p)?)),
        None => None,
    };
    let mut outcomes: Vec<SimOutcome> = Vec::with_capacity(configs.len());
    for cfg in &configs {
        let bar = progress_bar(trace.len() as u64, cfg.policy, progress);
        let mut write = log.as_mut().map(|l| move |r| l.write(&r));
        let sink = write.as_mut().map(|w| w as super::sim::LogSink<'_>);
        let outcome = simulate_logged(&trace, cfg, &mut |n| bar.set_position(n), sink)?;
        bar.finish_and_clear();
        if args.json {
            json_line(out, &outcome.report)?;
        } else {
            write_text(out, &outcome.report)?;
            if let Some(load) = &outcome.load {
                writeln!(
                    out,
                    "  decode load: {} swings over {}x the TBT SLO and back{}; over the SLO {:.1}% of the time",
                    load.overload_swings(),
                    SWING_HIGH,
                    if load.oscillates() { " (oscillates)" } else { "" },
                    load.decode_fraction_above(1.0) * 100.0
                )?;
            }
        }
        outcomes.push(outcome);
    }
    if let Some(log) = log {
        log.finish()?;
    }
    if let Some(plot) = &args.plot {
        let series: Vec<(&str, &hdrhistogram::Histogram<u64>)> = outcomes
            .iter()
            .map(|o| (o.report.policy.as_str(), &o.ttft_us))
            .collect();
        let drawn = plot_ttft_cdf(plot, &series, args.ttft_slo_ms)?;
        if !drawn.with_text {
            eprintln!(
                "warning: no TrueType font found in the usual system locations; {} has curves but no text",
                plot.display()
            );
        }
    }
    if let Some(plot) = &args.plot_load {
        let series: Vec<(&str, &super::sim::LoadSeries)> = outcomes
            .iter()
            .filter_map(|o| o.load.as_ref().map(|l| (o.report.policy.as_str(), l)))
            .collect();
        let drawn = plot_load_series(plot, &series)?;
        if !drawn.with_text {
            eprintln!(
                "warning: no TrueType font found in the usual system locations; {} has curves but no text",
                plot.display()
            );
        }
    }
    Ok(outcomes.into_iter().map(|o| o.report).collect())
}

/// `kvpool sim cache` writing to `out`; returns the reports.
pub fn run_sim_cache_to(
    args: &SimCacheArgs,
    out: &mut dyn Write,
) -> Result<Vec<CacheSimReport>, SimError> {
    if args.cache_policy.is_empty() || args.cache_blocks.is_empty() {
        return Err(SimError::InvalidArg(
            "--cache-policy and --cache-blocks need at least one value each".into(),
        ));
    }
    let trace = Trace::load(&args.trace)?;
    let mut reports = Vec::new();
    for &policy in &args.cache_policy {
        for &cap in &args.cache_blocks {
            let r = simulate_cache(&trace, policy, cap);
            if args.json {
                json_line(out, &r)?;
            } else {
                writeln!(
                    out,
                    "{:<12} cache_blocks {:>8}  prefix hit ratio {:.4}  ({} of {} blocks, {} evictions)",
                    r.cache_policy, r.cache_blocks, r.prefix_hit_ratio, r.hit_blocks, r.total_blocks, r.evictions
                )?;
            }
            reports.push(r);
        }
    }
    Ok(reports)
}
