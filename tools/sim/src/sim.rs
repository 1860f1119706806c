//! Discrete-event trace replay against a modelled cluster.
//!
//! Model:
//!
//! - Arrivals come from the trace, timestamps rebased to the first request
//!   and divided by `speed`. Each arrival is handed to the [`Scheduler`] with
//!   the simulator's state as its [`ClusterView`].
//! - A prefill instance runs one request at a time from a FIFO queue (bounded
//!   by `prefill.queue_max`). When a request starts, its reused prefix is the
//!   longer of the prefix in the instance's own LRU cache and the prefix in
//!   the pool; blocks only in the pool are fetched first (fetch time), then
//!   the uncached tokens are prefilled. Whatever the policy assumed, the
//!   instance reuses what is really there at start time. The view the
//!   scheduler gets counts, as an instance's local prefix, both its cache and
//!   the blocks of the requests already queued or running on it (FIFO order
//!   means they are computed before a request routed now starts); this is the
//!   conductor "updating the cache of the instance it routed to". When prefill ends,
//!   the first token exists (TTFT), and all the request's blocks are touched
//!   in the instance's cache and in the pool.
//! - Pool nodes (when [`PoolNodes::nodes`] > 0): a block lives on a home
//!   node (its hash modulo the node count) and a fetch reads it there; each
//!   node serves the bytes it is asked for one after another at `node_gbps`,
//!   so a node holding popular blocks queues the fetches that need it, and a
//!   fetch ends when its instance's link and every node it read from are
//!   done. With `hot_reads` > 0, a block read that many times within
//!   `hot_window_ms` gets a second replica on another node at once (no copy
//!   time, no budget, kept for the rest of the run), and its reads alternate
//!   between the two, as the master's hot-object replication does.
//! - The KV then goes to the chosen decode instance (the transfer is assumed
//!   to overlap prefill layer by layer, as in Mooncake, and costs nothing
//!   extra). A decode instance runs continuous batching: requests wait in a
//!   FIFO (bounded by `decode.queue_max`; a request arriving at a full queue
//!   is dropped) until the batch has room under `max_batch` sequences and
//!   `max_context_tokens` tokens, join at a step boundary, and each step
//!   takes `decode_step_ms(batch, context)` and gives every sequence one
//!   token. No preemption: context that grows during decode may overrun the
//!   token budget a little.
//! - TBT of a request = (time of its last token - time of its first token)
//!   / (output_tokens - 1): the average gap, which includes any wait for a
//!   decode slot. Requests with one output token have no TBT and meet the TBT
//!   SLO trivially.
//!
//! Accounting: a request meets the SLOs if TTFT <= ttft SLO and TBT <= tbt
//! SLO. `slo_attainment` = met / all requests (rejected ones included);
//! `goodput_rps` = met / makespan, where the makespan runs from the first
//! arrival to the last event. A *wasted prefill* is a request that was
//! prefilled and then missed the TBT SLO (including drops at a full decode
//! queue). `prefix_hit_ratio` is block-weighted over the prefilled requests.
//!
//! Forecast audit: every routed request carries the TBT the scheduler
//! predicted for it (`Decision::Route::predicted_tbt_ms`: the decode load now
//! for `early_reject`, the predicted one for `predictive_reject`). The report
//! compares it with the TBT estimate of its decode instance right after it
//! joined (`tbt_forecast_at_join_*`) and with the TBT it then got
//! (`tbt_forecast_*`), over requests that decoded.
//!
//! Load series (when `load_sample_ms` is set): every `load_sample_ms` of
//! simulated time (the state after the events at that time), the prefill load (mean over prefill instances of the queue
//! wait a request routed there would see, over the TTFT SLO) and the decode
//! load (mean over decode instances of the TBT estimate of what they hold,
//! 0 when idle, over the TBT SLO); 1.0 is "at the SLO". At most
//! [`MAX_LOAD_SAMPLES`] samples are kept: past that, every other one is
//! dropped and the interval doubles.
//!
//! The simulation is deterministic: events at equal times are ordered by kind
//! (decode steps, then prefill completions, then arrivals) and then by the
//! order they were scheduled in.
//!
//! Decision log ([`simulate_logged`]): every arrival's view and decision and
//! every finished request, in the format of [`kvpool_conductor::record`], the same as
//! the live conductor's; the scheduler then decides on the captured view
//! (which answers exactly what the simulator's state does).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use hdrhistogram::Histogram;
use serde::Serialize;

use kvpool_conductor::cache::{
    BlockCache, Cache, CachePolicy, Capacity, HitCounter, LruCache, PrefixIndex,
};
use kvpool_conductor::chunk_hash::{ChunkHash, IdHashBuilder, IdMap};
use kvpool_conductor::cost::CostModel;

use crate::error::SimError;
use crate::trace::Trace;
use kvpool_conductor::record::{LogRecord, LogSource, RecordedView};
use kvpool_conductor::scheduler::{
    ClusterView, Decision, DecodeLoad, Policy, PrefillLoad, RejectReason, RequestView, Scheduler,
    Slo,
};

/// Highest latency the histograms record: one day, in microseconds.
const HIST_MAX_US: u64 = 86_400_000_000;

/// Most samples a [`LoadSeries`] keeps (see the module docs).
pub const MAX_LOAD_SAMPLES: usize = 1 << 14;

/// Decode load (over the TBT SLO) at the top of a swing: 25 % over the SLO,
/// so every request decoding then is missing it.
pub const SWING_HIGH: f32 = 1.25;
/// Decode load a swing comes back to: the SLO.
pub const SWING_LOW: f32 = 1.0;
/// Swings in one run that make it oscillate ([`LoadSeries::oscillates`]).
pub const OSCILLATION_MIN_SWINGS: usize = 3;

/// Most storage nodes [`PoolNodes`] models (two counters each).
pub const MAX_POOL_NODES: usize = 65_536;

/// The pool's storage nodes, modelled (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolNodes {
    /// Storage nodes (0: not modelled; a fetch costs the instance's link only).
    pub nodes: usize,
    /// Each node's network, Gbit/s.
    pub node_gbps: f64,
    /// Reads of a block within `hot_window_ms` that give it a second
    /// replica (0: no replication).
    pub hot_reads: u32,
    /// The read-counting window, ms.
    pub hot_window_ms: f64,
}

impl Default for PoolNodes {
    fn default() -> Self {
        Self {
            nodes: 0,
            node_gbps: 100.0,
            hot_reads: 0,
            hot_window_ms: 1_000.0,
        }
    }
}

/// What to simulate.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Scheduling policy.
    pub policy: Policy,
    /// Prefill instances.
    pub prefill: usize,
    /// Decode instances.
    pub decode: usize,
    /// Eviction policy of the pool.
    pub cache_policy: CachePolicy,
    /// Capacity of the pool.
    pub cache_blocks: Capacity,
    /// SLOs.
    pub slo: Slo,
    /// Arrival-time compression factor (2 = twice the request rate).
    pub speed: f64,
    /// Seed of the scheduler's RNG.
    pub seed: u64,
    /// Cluster cost model.
    pub cost: CostModel,
    /// Record a [`LoadSeries`] with a sample every this many simulated ms
    /// (`None`: no series).
    pub load_sample_ms: Option<f64>,
    /// The pool's storage nodes.
    pub pool_nodes: PoolNodes,
}

impl SimConfig {
    /// A configuration with the default cost model and SLOs, an unbounded
    /// LRU pool, speed 1 and seed 0.
    pub fn new(policy: Policy, prefill: usize, decode: usize) -> Self {
        Self {
            policy,
            prefill,
            decode,
            cache_policy: CachePolicy::Lru,
            cache_blocks: Capacity::Unbounded,
            slo: Slo::default(),
            speed: 1.0,
            seed: 0,
            cost: CostModel::default(),
            load_sample_ms: None,
            pool_nodes: PoolNodes::default(),
        }
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), SimError> {
        if self.prefill == 0 || self.decode == 0 {
            return Err(SimError::InvalidArg(format!(
                "the cluster needs at least one prefill and one decode instance (got --prefill {} --decode {})",
                self.prefill, self.decode
            )));
        }
        if !(self.speed.is_finite() && self.speed > 0.0) {
            return Err(SimError::InvalidArg(format!(
                "--speed must be a finite number > 0, got {}",
                self.speed
            )));
        }
        for (name, v) in [
            ("--ttft-slo-ms", self.slo.ttft_ms),
            ("--tbt-slo-ms", self.slo.tbt_ms),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(SimError::InvalidArg(format!(
                    "{name} must be a finite number > 0, got {v}"
                )));
            }
        }
        if let Some(ms) = self.load_sample_ms {
            if !(ms.is_finite() && ms > 0.0) {
                return Err(SimError::InvalidArg(format!(
                    "the load sample interval must be a finite number of ms > 0, got {ms}"
                )));
            }
        }
        let n = &self.pool_nodes;
        if n.nodes > MAX_POOL_NODES {
            return Err(SimError::InvalidArg(format!(
                "--pool-nodes is at most {MAX_POOL_NODES}, got {}",
                n.nodes
            )));
        }
        if n.nodes > 0 && !(n.node_gbps.is_finite() && n.node_gbps > 0.0) {
            return Err(SimError::InvalidArg(format!(
                "--node-gbps must be a finite number > 0, got {}",
                n.node_gbps
            )));
        }
        if n.hot_reads > 0 && !(n.hot_window_ms.is_finite() && n.hot_window_ms > 0.0) {
            return Err(SimError::InvalidArg(format!(
                "--hot-window-ms must be a finite number > 0, got {}",
                n.hot_window_ms
            )));
        }
        self.cost.validate()?;
        Ok(())
    }
}

/// Results of one simulation; one JSON line of `kvpool sim --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimReport {
    /// Scheduling policy.
    pub policy: Policy,
    /// Prefill instances.
    pub prefill: usize,
    /// Decode instances.
    pub decode: usize,
    /// Pool eviction policy.
    pub cache_policy: CachePolicy,
    /// Pool capacity in blocks (`"inf"` when unbounded).
    pub cache_blocks: Capacity,
    /// Arrival speed-up.
    pub speed: f64,
    /// RNG seed.
    pub seed: u64,
    /// TTFT SLO, ms.
    pub ttft_slo_ms: f64,
    /// TBT SLO, ms.
    pub tbt_slo_ms: f64,
    /// Requests in the trace.
    pub requests: u64,
    /// Requests rejected by the scheduler (all reasons).
    pub rejected: u64,
    /// Of those, rejected on the TTFT SLO.
    pub rejected_ttft: u64,
    /// Of those, rejected on the TBT SLO.
    pub rejected_tbt: u64,
    /// Of those, rejected because every prefill queue was full.
    pub rejected_queue_full: u64,
    /// Requests that finished prefill.
    pub prefilled: u64,
    /// Requests that finished decoding.
    pub completed: u64,
    /// Prefilled requests dropped at a full decode queue.
    pub dropped: u64,
    /// Prefilled requests that then missed the TBT SLO (drops included).
    pub wasted_prefills: u64,
    /// Requests meeting both SLOs.
    pub slo_met: u64,
    /// TTFT percentiles over prefilled requests, ms (null when none).
    pub ttft_ms_p50: Option<f64>,
    /// See `ttft_ms_p50`.
    pub ttft_ms_p90: Option<f64>,
    /// See `ttft_ms_p50`.
    pub ttft_ms_p99: Option<f64>,
    /// TBT percentiles over completed requests with >= 2 output tokens, ms.
    pub tbt_ms_p50: Option<f64>,
    /// See `tbt_ms_p50`.
    pub tbt_ms_p90: Option<f64>,
    /// See `tbt_ms_p50`.
    pub tbt_ms_p99: Option<f64>,
    /// `slo_met / requests`.
    pub slo_attainment: f64,
    /// `slo_met / makespan_s`.
    pub goodput_rps: f64,
    /// Block-weighted prefix hit ratio over prefilled requests.
    pub prefix_hit_ratio: f64,
    /// Pool nodes modelled: bytes the busiest node served over the nodes'
    /// mean (1.0 = even; null when not modelled or nothing was fetched).
    pub pool_node_skew: Option<f64>,
    /// Blocks that got a second replica (hot-object replication).
    pub hot_blocks: u64,
    /// First arrival to last event, s (simulated time).
    pub makespan_s: f64,
    /// Requests in the forecast audit: routed, decoded, >= 2 output tokens.
    pub tbt_forecast_requests: u64,
    /// Mean of (TBT the scheduler predicted - TBT estimate of the decode
    /// instance right after the request joined it), ms.
    pub tbt_forecast_at_join_bias_ms: Option<f64>,
    /// Mean of (predicted TBT - TBT the request got), ms.
    pub tbt_forecast_bias_ms: Option<f64>,
    /// Mean absolute difference of predicted and experienced TBT, ms.
    pub tbt_forecast_mae_ms: Option<f64>,
}

/// Prefill and decode load over simulated time (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadSeries {
    /// Simulated time between two samples, ms; sample `i` is at `i * interval_ms`.
    pub interval_ms: f64,
    /// Prefill load per sample: mean queue wait / TTFT SLO.
    pub prefill: Vec<f32>,
    /// Decode load per sample: mean TBT estimate / TBT SLO.
    pub decode: Vec<f32>,
}

impl LoadSeries {
    fn new(interval_ms: f64) -> Self {
        Self {
            interval_ms,
            prefill: Vec::new(),
            decode: Vec::new(),
        }
    }

    fn push(&mut self, prefill: f32, decode: f32) {
        if self.decode.len() >= MAX_LOAD_SAMPLES {
            for s in [&mut self.prefill, &mut self.decode] {
                let kept: Vec<f32> = s.iter().step_by(2).copied().collect();
                *s = kept;
            }
            self.interval_ms *= 2.0;
        }
        self.prefill.push(prefill);
        self.decode.push(decode);
    }

    /// Swings of the decode load: how many times it climbs to `high` or
    /// more after having fallen to `low` or less (the first climb counts
    /// only after a low). With `high` above the SLO (1.0) and `low` well
    /// below it, each swing is one overload-then-drain cycle.
    pub fn decode_swings(&self, high: f32, low: f32) -> usize {
        swings(&self.decode, high, low)
    }

    /// Swings between [`SWING_HIGH`] and [`SWING_LOW`].
    pub fn overload_swings(&self) -> usize {
        self.decode_swings(SWING_HIGH, SWING_LOW)
    }

    /// Whether the decode load oscillates: at least
    /// [`OSCILLATION_MIN_SWINGS`] overload swings in the run.
    pub fn oscillates(&self) -> bool {
        self.overload_swings() >= OSCILLATION_MIN_SWINGS
    }

    /// Fraction of samples with the decode load above `level`.
    pub fn decode_fraction_above(&self, level: f32) -> f64 {
        if self.decode.is_empty() {
            return 0.0;
        }
        self.decode.iter().filter(|&&v| v > level).count() as f64 / self.decode.len() as f64
    }
}

/// Times `series` reaches `high` or more after having been at `low` or less.
pub fn swings(series: &[f32], high: f32, low: f32) -> usize {
    let mut was_low = false;
    let mut n = 0;
    for &v in series {
        if v <= low {
            was_low = true;
        } else if v >= high && was_low {
            n += 1;
            was_low = false;
        }
    }
    n
}

/// A report plus the latency histograms it was computed from (microseconds).
#[derive(Debug, Clone)]
pub struct SimOutcome {
    /// The report.
    pub report: SimReport,
    /// TTFT of every prefilled request, µs.
    pub ttft_us: Histogram<u64>,
    /// TBT of every completed request with >= 2 output tokens, µs.
    pub tbt_us: Histogram<u64>,
    /// Load over time, when `SimConfig::load_sample_ms` was set.
    pub load: Option<LoadSeries>,
    /// Per trace request, in trace order: whether it met both SLOs. Two
    /// policies replayed on one trace can be compared request by request
    /// (a paired test) with it.
    pub met: Vec<bool>,
}

#[derive(Debug, Clone, Copy)]
struct PrefillJob {
    req: u32,
    decode: u32,
    predicted_ms: f64,
    predicted_tbt_ms: f64,
}

#[derive(Debug)]
struct PrefillInst {
    queue: VecDeque<PrefillJob>,
    running: Option<PrefillJob>,
    running_end: f64,
    queued_pred_ms: f64,
    local: LruCache,
    /// Blocks of the requests queued or running here (with multiplicity):
    /// they will be in `local` by the time a request routed now starts.
    pending: IdMap<ChunkHash, u32>,
}

impl PrefillInst {
    fn add_pending(&mut self, blocks: &[ChunkHash]) {
        for b in blocks {
            *self.pending.entry(*b).or_insert(0) += 1;
        }
    }

    fn remove_pending(&mut self, blocks: &[ChunkHash]) {
        for b in blocks {
            if let Some(n) = self.pending.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    self.pending.remove(b);
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Seq {
    req: u32,
    remaining: u32,
    context: u64,
    first_token_ms: f64,
    predicted_tbt_ms: f64,
}

#[derive(Debug)]
struct DecodeInst {
    active: Vec<Seq>,
    active_tokens: u64,
    waiting: VecDeque<Seq>,
    waiting_tokens: u64,
    stepping: bool,
}

struct State<'t> {
    trace: &'t Trace,
    prefill: Vec<PrefillInst>,
    decode: Vec<DecodeInst>,
    pool: Cache,
    nodes: NodeState,
}

/// SplitMix64's finaliser: trace block ids are small consecutive numbers,
/// the nodes must not see them in order.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The node block `b` is placed on among `n` (pseudo-random, as the master's
/// placement spreads objects).
fn home_node(b: ChunkHash, n: usize) -> usize {
    (mix(b.0) % n as u64) as usize
}

/// The modelled storage nodes: when each is free, what each served, and
/// the read counts of hot-object replication.
#[derive(Debug, Default)]
struct NodeState {
    busy_until_ms: Vec<f64>,
    bytes: Vec<f64>,
    /// Per block: start of its read window, reads in it, replicated.
    reads: IdMap<ChunkHash, (f64, u32, bool)>,
    hot_blocks: u64,
}

impl NodeState {
    /// Reads `bytes` of block `b` at `now`; returns when the node that
    /// serves it is done.
    fn read(&mut self, cfg: &PoolNodes, b: ChunkHash, bytes: f64, now: f64) -> f64 {
        let n = cfg.nodes;
        let home = home_node(b, n);
        let mut node = home;
        if cfg.hot_reads > 0 && n > 1 {
            let e = self.reads.entry(b).or_insert((now, 0, false));
            if now - e.0 > cfg.hot_window_ms {
                *e = (now, 0, e.2);
            }
            e.1 += 1;
            if !e.2 && e.1 >= cfg.hot_reads {
                e.2 = true;
                self.hot_blocks += 1;
            }
            if e.2 && e.1.is_multiple_of(2) {
                node = (home + 1 + (mix(b.0 ^ 1) % (n as u64 - 1)) as usize) % n;
            }
        }
        let start = self.busy_until_ms[node].max(now);
        let end = start + bytes * 8.0 / (cfg.node_gbps * 1e9) * 1e3;
        self.busy_until_ms[node] = end;
        self.bytes[node] += bytes;
        end
    }

    /// Busiest node's bytes over the mean.
    fn skew(&self) -> Option<f64> {
        let total: f64 = self.bytes.iter().sum();
        let busiest = self.bytes.iter().copied().fold(0.0, f64::max);
        (total > 0.0).then(|| busiest / (total / self.bytes.len() as f64))
    }
}

impl ClusterView for State<'_> {
    fn prefill_instances(&self) -> usize {
        self.prefill.len()
    }
    fn prefill_load(&self, i: usize) -> PrefillLoad {
        let p = &self.prefill[i];
        let base = if p.running.is_some() {
            p.running_end
        } else {
            0.0
        };
        PrefillLoad {
            queued: p.queue.len(),
            busy_until_ms: base + p.queued_pred_ms,
        }
    }
    fn local_prefix_blocks(&self, i: usize, blocks: &[ChunkHash]) -> usize {
        let p = &self.prefill[i];
        blocks
            .iter()
            .take_while(|b| p.local.contains(**b) || p.pending.contains_key(*b))
            .count()
    }
    fn global_prefix_blocks(&self, blocks: &[ChunkHash]) -> usize {
        self.pool.prefix_len(blocks)
    }
    fn decode_instances(&self) -> usize {
        self.decode.len()
    }
    fn decode_load(&self, i: usize) -> DecodeLoad {
        let d = &self.decode[i];
        DecodeLoad {
            active_seqs: d.active.len(),
            active_tokens: d.active_tokens,
            waiting_seqs: d.waiting.len(),
            waiting_tokens: d.waiting_tokens,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum EventKind {
    DecodeStep = 0,
    PrefillDone = 1,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    time: f64,
    kind: EventKind,
    seq: u64,
    instance: u32,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    // Reversed: BinaryHeap is a max-heap and we want the earliest event.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .time
            .total_cmp(&self.time)
            .then_with(|| other.kind.cmp(&self.kind))
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Default)]
struct Counters {
    rejected_ttft: u64,
    rejected_tbt: u64,
    rejected_queue_full: u64,
    rejected_other: u64,
    prefilled: u64,
    completed: u64,
    dropped: u64,
    wasted: u64,
    slo_met: u64,
    hits: HitCounter,
    forecasts: u64,
    forecast_at_join_err_ms: f64,
    forecast_err_ms: f64,
    forecast_abs_err_ms: f64,
}

/// Where [`simulate_logged`] sends the records of its decision log.
pub type LogSink<'a> = &'a mut dyn FnMut(LogRecord);

struct Sim<'t, 'l> {
    log: Option<LogSink<'l>>,
    cfg: &'t SimConfig,
    state: State<'t>,
    scheduler: Scheduler,
    events: BinaryHeap<Event>,
    next_seq: u64,
    arrival_ms: Vec<f64>,
    ttft_ok: Vec<bool>,
    met: Vec<bool>,
    counters: Counters,
    ttft_us: Histogram<u64>,
    tbt_us: Histogram<u64>,
    last_event_ms: f64,
    load: Option<LoadSeries>,
    next_sample_ms: f64,
}

fn histogram() -> Histogram<u64> {
    // 3 significant digits from 1 µs to one day.
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).expect("constant histogram bounds are valid")
}

fn mean(sum: f64, n: u64) -> Option<f64> {
    (n > 0).then(|| sum / n as f64)
}

fn ms_to_us(ms: f64) -> u64 {
    (ms * 1000.0).round().clamp(1.0, HIST_MAX_US as f64) as u64
}

impl<'t, 'l> Sim<'t, 'l> {
    fn new(trace: &'t Trace, cfg: &'t SimConfig, mut log: Option<LogSink<'l>>) -> Self {
        if let Some(log) = log.as_mut() {
            log(LogRecord::Start {
                source: LogSource::Sim,
                policy: cfg.policy,
                cost: cfg.cost.clone(),
                slo: cfg.slo,
                seed: cfg.seed,
            });
        }
        let local_cap = cfg.cost.prefill.local_cache_blocks;
        let prefill = (0..cfg.prefill)
            .map(|_| PrefillInst {
                queue: VecDeque::with_capacity(cfg.cost.prefill.queue_max.min(4096)),
                running: None,
                running_end: 0.0,
                queued_pred_ms: 0.0,
                local: LruCache::new(local_cap),
                pending: IdMap::with_hasher(IdHashBuilder),
            })
            .collect();
        let decode = (0..cfg.decode)
            .map(|_| DecodeInst {
                active: Vec::with_capacity(cfg.cost.decode.max_batch.min(4096)),
                active_tokens: 0,
                waiting: VecDeque::with_capacity(cfg.cost.decode.queue_max.min(4096)),
                waiting_tokens: 0,
                stepping: false,
            })
            .collect();
        let t0 = trace.requests().first().map_or(0, |r| r.timestamp_ms);
        let arrival_ms = trace
            .requests()
            .iter()
            .map(|r| (r.timestamp_ms - t0) as f64 / cfg.speed)
            .collect();
        Self {
            log,
            cfg,
            state: State {
                trace,
                prefill,
                decode,
                pool: Cache::new(cfg.cache_policy, cfg.cache_blocks),
                nodes: NodeState {
                    busy_until_ms: vec![0.0; cfg.pool_nodes.nodes],
                    bytes: vec![0.0; cfg.pool_nodes.nodes],
                    ..NodeState::default()
                },
            },
            scheduler: Scheduler::new(cfg.policy, cfg.cost.clone(), cfg.slo, cfg.seed),
            events: BinaryHeap::with_capacity(cfg.prefill + cfg.decode + 1),
            next_seq: 0,
            arrival_ms,
            ttft_ok: vec![false; trace.len()],
            met: vec![false; trace.len()],
            counters: Counters::default(),
            ttft_us: histogram(),
            tbt_us: histogram(),
            last_event_ms: 0.0,
            load: cfg.load_sample_ms.map(LoadSeries::new),
            next_sample_ms: 0.0,
        }
    }

    fn push(&mut self, time: f64, kind: EventKind, instance: usize) {
        self.next_seq += 1;
        self.events.push(Event {
            time,
            kind,
            seq: self.next_seq,
            instance: instance as u32,
        });
    }

    fn run(&mut self, progress: &mut dyn FnMut(u64)) {
        let n = self.arrival_ms.len();
        let mut next = 0usize;
        loop {
            let ta = if next < n {
                self.arrival_ms[next]
            } else {
                f64::INFINITY
            };
            let te = self.events.peek().map_or(f64::INFINITY, |e| e.time);
            if ta.is_infinite() && te.is_infinite() {
                break;
            }
            if self.load.is_some() {
                self.sample_load_before(ta.min(te));
            }
            if te <= ta {
                if let Some(ev) = self.events.pop() {
                    self.last_event_ms = self.last_event_ms.max(ev.time);
                    match ev.kind {
                        EventKind::DecodeStep => self.decode_step(ev.instance as usize, ev.time),
                        EventKind::PrefillDone => self.prefill_done(ev.instance as usize, ev.time),
                    }
                }
            } else {
                self.last_event_ms = self.last_event_ms.max(ta);
                self.arrive(next, ta);
                next += 1;
                if next & 0xff == 0 || next == n {
                    progress(next as u64);
                }
            }
        }
    }

    /// Records load samples for every sample time before `t` (the state
    /// does not change between events).
    fn sample_load_before(&mut self, t: f64) {
        while self.next_sample_ms < t {
            let now = self.next_sample_ms;
            let state = &self.state;
            let np = state.prefill.len().max(1) as f64;
            let wait: f64 = (0..state.prefill.len())
                .map(|i| (state.prefill_load(i).busy_until_ms - now).max(0.0))
                .sum();
            let nd = state.decode.len().max(1) as f64;
            let tbt: f64 = state
                .decode
                .iter()
                .filter(|d| !(d.active.is_empty() && d.waiting.is_empty()))
                .map(|d| {
                    self.scheduler.tbt_for(
                        (d.active.len() + d.waiting.len()) as f64,
                        (d.active_tokens + d.waiting_tokens) as f64,
                    )
                })
                .sum();
            let prefill = (wait / np / self.cfg.slo.ttft_ms) as f32;
            let decode = (tbt / nd / self.cfg.slo.tbt_ms) as f32;
            let Some(load) = self.load.as_mut() else {
                return;
            };
            load.push(prefill, decode);
            self.next_sample_ms = load.decode.len() as f64 * load.interval_ms;
        }
    }

    fn arrive(&mut self, idx: usize, now: f64) {
        let trace = self.state.trace;
        let r = &trace.requests()[idx];
        let view = RequestView {
            id: idx as u64,
            input_tokens: r.input_tokens,
            blocks: trace.blocks(r),
        };
        let decision = match self.log.as_mut() {
            Some(log) => {
                let seen = RecordedView::capture(&self.state, view.blocks);
                let decision = self.scheduler.schedule(&view, &seen, now);
                log(LogRecord::Schedule {
                    id: view.id,
                    now_ms: now,
                    input_tokens: view.input_tokens,
                    blocks: view.blocks.len(),
                    view: seen,
                    decision,
                });
                decision
            }
            None => self.scheduler.schedule(&view, &self.state, now),
        };
        match decision {
            Decision::Route {
                prefill,
                decode,
                predicted_prefill_ms,
                predicted_tbt_ms,
                ..
            } => {
                let p = &mut self.state.prefill[prefill];
                p.add_pending(view.blocks);
                p.queue.push_back(PrefillJob {
                    req: idx as u32,
                    decode: decode as u32,
                    predicted_ms: predicted_prefill_ms,
                    predicted_tbt_ms,
                });
                p.queued_pred_ms += predicted_prefill_ms;
                if p.running.is_none() {
                    self.start_prefill(prefill, now);
                }
            }
            Decision::Reject(reason) => match reason {
                RejectReason::TtftSlo { .. } => self.counters.rejected_ttft += 1,
                RejectReason::TbtSlo { .. } => self.counters.rejected_tbt += 1,
                RejectReason::PrefillQueuesFull { .. } => self.counters.rejected_queue_full += 1,
                RejectReason::NoInstances => self.counters.rejected_other += 1,
            },
        }
    }

    fn start_prefill(&mut self, i: usize, now: f64) {
        let trace = self.state.trace;
        let cost = &self.cfg.cost;
        let Some(job) = self.state.prefill[i].queue.pop_front() else {
            return;
        };
        let r = &trace.requests()[job.req as usize];
        let blocks = trace.blocks(r);
        let local = self.state.prefill[i].local.prefix_len(blocks);
        let global = self.state.pool.prefix_len(blocks);
        let cached = local.max(global);
        self.counters.hits.record(cached, blocks.len());
        let cached_tokens = cost.blocks_to_tokens(cached, r.input_tokens);
        let local_tokens = cost.blocks_to_tokens(local, r.input_tokens);
        let mut fetch_ms = cost.fetch_ms(cached_tokens - local_tokens.min(cached_tokens));
        if self.cfg.pool_nodes.nodes > 0 && cached > local {
            // The blocks only in the pool, each from the node serving it.
            let per_token = cost.network.kv_bytes_per_token as f64;
            let mut done = now + fetch_ms;
            for (k, b) in blocks.iter().enumerate().take(cached).skip(local) {
                let tokens = cost.blocks_to_tokens(k + 1, r.input_tokens)
                    - cost.blocks_to_tokens(k, r.input_tokens);
                let end =
                    self.state
                        .nodes
                        .read(&self.cfg.pool_nodes, *b, tokens as f64 * per_token, now);
                done = done.max(end);
            }
            fetch_ms = done - now;
        }
        let duration =
            fetch_ms + cost.prefill_ms(u64::from(r.input_tokens) - cached_tokens, cached_tokens);
        let p = &mut self.state.prefill[i];
        p.queued_pred_ms = if p.queue.is_empty() {
            0.0
        } else {
            (p.queued_pred_ms - job.predicted_ms).max(0.0)
        };
        p.running = Some(job);
        p.running_end = now + duration;
        self.push(now + duration, EventKind::PrefillDone, i);
    }

    fn prefill_done(&mut self, i: usize, now: f64) {
        let trace = self.state.trace;
        let Some(job) = self.state.prefill[i].running.take() else {
            return;
        };
        let idx = job.req as usize;
        let r = &trace.requests()[idx];
        let blocks = trace.blocks(r);
        self.state.prefill[i].local.touch(blocks);
        self.state.prefill[i].remove_pending(blocks);
        self.state.pool.touch(blocks);
        self.counters.prefilled += 1;
        let ttft = now - self.arrival_ms[idx];
        self.ttft_us.saturating_record(ms_to_us(ttft));
        let ttft_ok = ttft <= self.cfg.slo.ttft_ms;
        self.ttft_ok[idx] = ttft_ok;
        if r.output_tokens <= 1 {
            self.counters.completed += 1;
            if ttft_ok {
                self.counters.slo_met += 1;
                self.met[idx] = true;
            }
        } else {
            let seq = Seq {
                req: job.req,
                remaining: r.output_tokens - 1,
                context: u64::from(r.input_tokens) + 1,
                first_token_ms: now,
                predicted_tbt_ms: job.predicted_tbt_ms,
            };
            let d = job.decode as usize;
            let dec = &mut self.state.decode[d];
            if dec.waiting.len() >= self.cfg.cost.decode.queue_max {
                self.counters.dropped += 1;
                self.counters.wasted += 1;
            } else {
                let at_join = self.scheduler.tbt_for(
                    (dec.active.len() + dec.waiting.len() + 1) as f64,
                    (dec.active_tokens + dec.waiting_tokens + seq.context) as f64,
                );
                self.counters.forecast_at_join_err_ms += job.predicted_tbt_ms - at_join;
                dec.waiting_tokens += seq.context;
                dec.waiting.push_back(seq);
                if !dec.stepping {
                    self.admit_and_step(d, now);
                }
            }
        }
        self.start_prefill(i, now);
    }

    fn admit_and_step(&mut self, d: usize, now: f64) {
        let max_batch = self.cfg.cost.decode.max_batch;
        let max_tokens = self.cfg.cost.decode.max_context_tokens;
        let dec = &mut self.state.decode[d];
        while let Some(head) = dec.waiting.front() {
            let fits_batch = dec.active.len() < max_batch;
            let fits_tokens =
                dec.active.is_empty() || dec.active_tokens + head.context <= max_tokens;
            if !(fits_batch && fits_tokens) {
                break;
            }
            let Some(seq) = dec.waiting.pop_front() else {
                break;
            };
            dec.waiting_tokens -= seq.context;
            dec.active_tokens += seq.context;
            dec.active.push(seq);
        }
        if dec.active.is_empty() {
            dec.stepping = false;
            return;
        }
        dec.stepping = true;
        let step = self
            .cfg
            .cost
            .decode_step_ms(dec.active.len() as f64, dec.active_tokens as f64);
        self.push(now + step, EventKind::DecodeStep, d);
    }

    fn decode_step(&mut self, d: usize, now: f64) {
        let tbt_slo = self.cfg.slo.tbt_ms;
        let trace = self.state.trace;
        let dec = &mut self.state.decode[d];
        let mut k = 0;
        while k < dec.active.len() {
            let s = &mut dec.active[k];
            s.remaining -= 1;
            s.context += 1;
            dec.active_tokens += 1;
            if s.remaining == 0 {
                let seq = dec.active.swap_remove(k);
                dec.active_tokens -= seq.context;
                let out = trace.requests()[seq.req as usize].output_tokens;
                let tbt = (now - seq.first_token_ms) / f64::from(out - 1);
                self.tbt_us.saturating_record(ms_to_us(tbt));
                self.counters.completed += 1;
                self.counters.forecasts += 1;
                self.counters.forecast_err_ms += seq.predicted_tbt_ms - tbt;
                self.counters.forecast_abs_err_ms += (seq.predicted_tbt_ms - tbt).abs();
                self.scheduler.observe_decode_finished(out);
                if let Some(log) = self.log.as_mut() {
                    log(LogRecord::DecodeFinished { output_tokens: out });
                }
                if tbt <= tbt_slo {
                    if self.ttft_ok[seq.req as usize] {
                        self.counters.slo_met += 1;
                        self.met[seq.req as usize] = true;
                    }
                } else {
                    self.counters.wasted += 1;
                }
            } else {
                k += 1;
            }
        }
        self.admit_and_step(d, now);
    }

    fn report(self) -> SimOutcome {
        let c = &self.counters;
        let cfg = self.cfg;
        let requests = self.arrival_ms.len() as u64;
        let rejected = c.rejected_ttft + c.rejected_tbt + c.rejected_queue_full + c.rejected_other;
        let q = |h: &Histogram<u64>, p: f64| {
            if h.is_empty() {
                None
            } else {
                Some(h.value_at_quantile(p) as f64 / 1000.0)
            }
        };
        let makespan_s = self.last_event_ms / 1000.0;
        let report = SimReport {
            policy: cfg.policy,
            prefill: cfg.prefill,
            decode: cfg.decode,
            cache_policy: cfg.cache_policy,
            cache_blocks: cfg.cache_blocks,
            speed: cfg.speed,
            seed: cfg.seed,
            ttft_slo_ms: cfg.slo.ttft_ms,
            tbt_slo_ms: cfg.slo.tbt_ms,
            requests,
            rejected,
            rejected_ttft: c.rejected_ttft,
            rejected_tbt: c.rejected_tbt,
            rejected_queue_full: c.rejected_queue_full,
            prefilled: c.prefilled,
            completed: c.completed,
            dropped: c.dropped,
            wasted_prefills: c.wasted,
            slo_met: c.slo_met,
            ttft_ms_p50: q(&self.ttft_us, 0.50),
            ttft_ms_p90: q(&self.ttft_us, 0.90),
            ttft_ms_p99: q(&self.ttft_us, 0.99),
            tbt_ms_p50: q(&self.tbt_us, 0.50),
            tbt_ms_p90: q(&self.tbt_us, 0.90),
            tbt_ms_p99: q(&self.tbt_us, 0.99),
            slo_attainment: if requests == 0 {
                0.0
            } else {
                c.slo_met as f64 / requests as f64
            },
            goodput_rps: if makespan_s > 0.0 {
                c.slo_met as f64 / makespan_s
            } else {
                0.0
            },
            prefix_hit_ratio: c.hits.ratio(),
            pool_node_skew: self.state.nodes.skew(),
            hot_blocks: self.state.nodes.hot_blocks,
            makespan_s,
            tbt_forecast_requests: c.forecasts,
            tbt_forecast_at_join_bias_ms: mean(c.forecast_at_join_err_ms, c.forecasts),
            tbt_forecast_bias_ms: mean(c.forecast_err_ms, c.forecasts),
            tbt_forecast_mae_ms: mean(c.forecast_abs_err_ms, c.forecasts),
        };
        SimOutcome {
            report,
            ttft_us: self.ttft_us,
            tbt_us: self.tbt_us,
            load: self.load,
            met: self.met,
        }
    }
}

/// Simulates `trace` under `cfg`.
pub fn simulate(trace: &Trace, cfg: &SimConfig) -> Result<SimOutcome, SimError> {
    simulate_with_progress(trace, cfg, &mut |_| {})
}

/// Like [`simulate`], calling `progress` with the number of arrivals
/// processed so far (every 256 arrivals and at the end).
pub fn simulate_with_progress(
    trace: &Trace,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64),
) -> Result<SimOutcome, SimError> {
    simulate_logged(trace, cfg, progress, None)
}

/// Like [`simulate_with_progress`], sending the decision log's records to
/// `log` when given (see the module docs).
pub fn simulate_logged(
    trace: &Trace,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64),
    log: Option<LogSink<'_>>,
) -> Result<SimOutcome, SimError> {
    cfg.validate()?;
    let mut sim = Sim::new(trace, cfg, log);
    sim.run(progress);
    Ok(sim.report())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(lines: &[(u64, u32, u32, &[u64])]) -> Trace {
        let text: String = lines
            .iter()
            .map(|(ts, i, o, h)| {
                format!(
                    "{{\"timestamp\": {ts}, \"input_length\": {i}, \"output_length\": {o}, \"hash_ids\": {h:?}}}\n"
                )
            })
            .collect();
        Trace::parse(text.as_bytes(), "test", 512).unwrap()
    }

    #[test]
    fn single_request_timeline_matches_the_cost_model() {
        let t = trace(&[(0, 1024, 3, &[1, 2])]);
        let cfg = SimConfig::new(Policy::CacheGlobal, 1, 1);
        let out = simulate(&t, &cfg).unwrap();
        let r = &out.report;
        let prefill = cfg.cost.prefill_ms(1024, 0);
        let step = cfg.cost.decode_step_ms(1.0, 1025.0);
        let step2 = cfg.cost.decode_step_ms(1.0, 1026.0);
        assert_eq!(r.prefilled, 1);
        assert_eq!(r.completed, 1);
        assert_eq!(r.slo_met, 1);
        let ttft = r.ttft_ms_p50.unwrap();
        assert!(
            (ttft - prefill).abs() < prefill * 0.002,
            "{ttft} vs {prefill}"
        );
        let tbt = r.tbt_ms_p50.unwrap();
        let want = (step + step2) / 2.0;
        assert!((tbt - want).abs() < 0.05, "{tbt} vs {want}");
        assert!((r.makespan_s * 1000.0 - (prefill + step + step2)).abs() < 1e-6);
        // The forecast was one step on an empty instance: exact at join,
        // a hair under the TBT it got (the context grew by a token).
        assert_eq!(r.tbt_forecast_requests, 1);
        assert_eq!(r.tbt_forecast_at_join_bias_ms, Some(0.0));
        let bias = r.tbt_forecast_bias_ms.unwrap();
        assert!((bias - (step - want)).abs() < 1e-9, "{bias}");
        assert_eq!(r.tbt_forecast_mae_ms, Some(bias.abs()));
    }

    #[test]
    fn second_request_reuses_the_prefix() {
        let t = trace(&[(0, 1024, 1, &[1, 2]), (10_000, 1536, 1, &[1, 2, 3])]);
        let out = simulate(&t, &SimConfig::new(Policy::CacheGlobal, 2, 1)).unwrap();
        assert_eq!(out.report.prefix_hit_ratio, 2.0 / 5.0);
        assert_eq!(out.report.completed, 2);
        assert_eq!(out.report.tbt_ms_p50, None);
    }

    #[test]
    fn full_decode_queue_drops_and_counts_waste() {
        let mut cfg = SimConfig::new(Policy::CacheGlobal, 4, 1);
        cfg.cost.decode.max_batch = 1;
        cfg.cost.decode.queue_max = 1;
        let t = trace(&[
            (0, 512, 50, &[1]),
            (0, 512, 50, &[2]),
            (0, 512, 50, &[3]),
            (0, 512, 50, &[4]),
        ]);
        let r = simulate(&t, &cfg).unwrap().report;
        assert!(r.dropped >= 1, "{r:?}");
        assert!(r.wasted_prefills >= r.dropped);
        assert_eq!(r.completed + r.dropped, 4);
    }

    #[test]
    fn load_series_follows_the_queues_and_the_batch() {
        // Three 8k-token prompts at once on one prefill instance: the queue
        // holds two of them at first; then all three decode together.
        let t = trace(&[
            (0, 8192, 200, &[1; 16]),
            (0, 8192, 200, &[2; 16]),
            (0, 8192, 200, &[3; 16]),
        ]);
        let mut cfg = SimConfig::new(Policy::CacheGlobal, 1, 1);
        cfg.load_sample_ms = Some(100.0);
        let out = simulate(&t, &cfg).unwrap();
        let load = out.load.unwrap();
        assert_eq!(load.interval_ms, 100.0);
        assert_eq!(load.prefill.len(), load.decode.len());
        let makespan_ms = out.report.makespan_s * 1000.0;
        assert_eq!(load.decode.len(), (makespan_ms / 100.0).ceil() as usize);
        // A sample shows the state after the events at its time: at 0 the
        // instance holds all three prefills; 100 ms later, 100 ms less.
        let all = 3.0 * cfg.cost.prefill_ms(8192, 0);
        for (i, left) in [(0, all), (1, all - 100.0)] {
            let want = (left / cfg.slo.ttft_ms) as f32;
            assert!(
                (load.prefill[i] - want).abs() < 1e-4,
                "{} vs {want}",
                load.prefill[i]
            );
        }
        // Decode is idle before the first prefill ends, busy afterwards.
        let first_done = (cfg.cost.prefill_ms(8192, 0) / 100.0).floor() as usize;
        assert_eq!(load.decode[first_done], 0.0);
        let busy = load.decode[load.decode.len() - 2];
        let step3 = cfg.cost.decode_step_ms(3.0, 3.0 * 8192.0);
        assert!(
            busy > 0.0 && f64::from(busy) * cfg.slo.tbt_ms < step3 * 1.01,
            "{busy}"
        );
        assert!(out.report.tbt_forecast_requests == 3);
        assert!(simulate(&t, &SimConfig::new(Policy::CacheGlobal, 1, 1))
            .unwrap()
            .load
            .is_none());
    }

    #[test]
    fn load_series_stays_bounded() {
        let t = trace(&[(0, 1024, 2_000, &[1, 2])]);
        let mut cfg = SimConfig::new(Policy::CacheGlobal, 1, 1);
        cfg.load_sample_ms = Some(0.5);
        let out = simulate(&t, &cfg).unwrap();
        let load = out.load.unwrap();
        // ~30 s of decode at 0.5 ms would be ~60k samples.
        assert!(load.decode.len() <= MAX_LOAD_SAMPLES);
        assert!(load.decode.len() > MAX_LOAD_SAMPLES / 2);
        assert!(load.interval_ms >= 2.0, "{}", load.interval_ms);
        let span = load.decode.len() as f64 * load.interval_ms;
        assert!(span >= out.report.makespan_s * 1000.0);
        cfg.load_sample_ms = Some(0.0);
        assert!(simulate(&t, &cfg).is_err());
    }

    #[test]
    fn swings_count_overload_cycles() {
        assert_eq!(swings(&[0.5, 1.3, 0.9, 1.3, 1.0, 1.3], 1.25, 1.0), 3);
        // Staying high, or wobbling inside the band, is no swing.
        assert_eq!(swings(&[1.3, 1.4, 1.3], 1.25, 1.0), 0);
        assert_eq!(swings(&[0.9, 1.1, 1.2, 1.1, 1.3], 1.25, 1.0), 1);
        assert_eq!(swings(&[], 1.25, 1.0), 0);
    }

    #[test]
    fn a_logged_run_decides_alike_and_replays() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/synthetic_trace.jsonl"
        ))
        .unwrap();
        let head: String = text.lines().take(400).map(|l| format!("{l}\n")).collect();
        let t = Trace::parse(head.as_bytes(), "head", 512).unwrap();
        for policy in [
            Policy::CacheGlobal,
            Policy::PredictiveReject,
            Policy::Random,
        ] {
            let mut cfg = SimConfig::new(policy, 4, 2);
            cfg.speed = 4.0;
            cfg.slo.tbt_ms = 40.0;
            let plain = simulate(&t, &cfg).unwrap();
            let mut log = kvpool_conductor::record::DecisionLog::new(Vec::new());
            let logged =
                simulate_logged(&t, &cfg, &mut |_| {}, Some(&mut |r| log.write(&r))).unwrap();
            assert_eq!(logged.report, plain.report, "{policy}");
            let bytes = log.finish().unwrap();
            let r = kvpool_conductor::record::replay(&bytes[..]).unwrap();
            assert_eq!(r.decisions, 400, "{policy}");
            assert_eq!(r.agreed, r.decisions, "{policy}: {:?}", r.mismatches);
        }
    }

    #[test]
    fn hot_replication_spreads_a_popular_prefix_over_two_pool_nodes() {
        // One 8-block prefix read by every request, each on a prefill
        // instance that does not hold it: every block comes from the pool,
        // and all eight live on node 0.
        let shared: Vec<u64> = (0..)
            .filter(|&id| home_node(ChunkHash(id), 4) == 0)
            .take(8)
            .collect();
        let lines: Vec<(u64, u32, u32, Vec<u64>)> = (0..40)
            .map(|i| {
                let mut blocks = shared.clone();
                blocks.push(1_000_000 + i);
                // The first request stores the prefix; the rest come later.
                let at = if i == 0 { 0 } else { 600_000 + i * 10 };
                (at, 9 * 512, 1, blocks)
            })
            .collect();
        let refs: Vec<(u64, u32, u32, &[u64])> = lines
            .iter()
            .map(|(t, i, o, b)| (*t, *i, *o, b.as_slice()))
            .collect();
        let t = trace(&refs);
        let run = |hot_reads: u32| {
            let mut cfg = SimConfig::new(Policy::Random, 40, 1);
            cfg.cost.prefill.local_cache_blocks = Capacity::Blocks(0);
            cfg.pool_nodes = PoolNodes {
                nodes: 4,
                node_gbps: 1.0,
                hot_reads,
                hot_window_ms: 10_000.0,
            };
            simulate(&t, &cfg).unwrap().report
        };
        let (off, on) = (run(0), run(4));
        assert_eq!(off.hot_blocks, 0);
        assert_eq!(on.hot_blocks, 8);
        let (skew_off, skew_on) = (off.pool_node_skew.unwrap(), on.pool_node_skew.unwrap());
        assert_eq!(skew_off, 4.0, "every fetched byte from node 0");
        // Node 0 and one other share it (by each window's read parity).
        assert!(skew_on <= 3.0, "{skew_on}");
        // Slow nodes make the fetch the bottleneck: two replicas halve the queue.
        assert!(
            on.ttft_ms_p99.unwrap() < off.ttft_ms_p99.unwrap(),
            "{on:?} vs {off:?}"
        );
        let plain = {
            let cfg = SimConfig::new(Policy::Random, 40, 1);
            simulate(&t, &cfg).unwrap().report
        };
        assert_eq!(plain.pool_node_skew, None, "not modelled by default");
    }

    #[test]
    fn bad_config_is_an_error() {
        let t = trace(&[(0, 512, 2, &[1])]);
        let mut cfg = SimConfig::new(Policy::CacheGlobal, 0, 1);
        assert!(simulate(&t, &cfg).is_err());
        cfg.prefill = 1;
        cfg.speed = 0.0;
        assert!(simulate(&t, &cfg)
            .unwrap_err()
            .to_string()
            .contains("--speed"));
        cfg.speed = 1.0;
        cfg.pool_nodes.nodes = MAX_POOL_NODES + 1;
        assert!(simulate(&t, &cfg)
            .unwrap_err()
            .to_string()
            .contains("--pool-nodes"));
    }
}
