//! Scheduling policies: pure logic, no I/O, no clock reads.
//!
//! [`Scheduler::schedule`] takes a request, a read-only [`ClusterView`] and
//! the current time, and returns a [`Decision`]: a (prefill, decode) pair or
//! a rejection with its reason. The same code runs in the simulator
//! (`kvpool_sim::sim`) and in the live actor ([`crate::actor`]), each with
//! its own view.
//!
//! Estimates (all from the [`CostModel`]):
//!
//! - TTFT on prefill instance `i` = queue wait (`busy_until - now`, at least 0)
//!   + fetch of the cached prefix that is in the pool but not on `i`
//!   + prefill of the uncached tokens on top of the cached ones.
//! - TBT on a decode instance with `s` sequences and `k` context tokens
//!   (running plus waiting, plus the new request): if `s` and `k` fit the
//!   instance's batch and KV limits, one decode step `step(s, k)`; otherwise
//!   the instance is oversubscribed by `o = max(s / max_batch, k / max_tokens)`
//!   and every sequence gets a step only `1/o` of the time, so the estimate is
//!   `step(s/o, k/o) * o`.
//!
//! Policies:
//!
//! - `random`, `round_robin`: prefill and decode picked at random / in turn.
//! - `least_loaded`: the prefill instance whose queue drains first; the decode
//!   instance with the lowest estimated TBT.
//! - `cache_local`: minimum TTFT counting only the prefix cached on each
//!   instance itself.
//! - `cache_global` (Mooncake): minimum TTFT counting the longer of the local
//!   prefix and the pool's prefix, plus the fetch of the difference.
//! - `early_reject`: `cache_global`, then reject if the best TTFT misses the
//!   TTFT SLO or the chosen decode instance's estimated TBT *now* misses the
//!   TBT SLO.
//! - `predictive_reject`: `cache_global`, then reject on the TTFT SLO, or if
//!   the decode pool's TBT *predicted from the moment this request would
//!   finish prefill (`t_ready`)* misses the TBT SLO. The prediction is
//!   system-level, as Mooncake's; per decode instance it models:
//!   - departures: every request decodes for the same expected time
//!     `T = E[output tokens] * pace`, and a sequence decoding at `t` is still
//!     decoding at `t + dt` with probability `exp(-dt / T)` (the departure
//!     rate of a steady batch, `n / T`, with a tail for long answers). The
//!     pace is the step time of the load the sequences will see: today's,
//!     or the predicted peak's if that is slower (a second pass).
//!     `E[output tokens]` is learned from finished requests
//!     ([`Scheduler::observe_decode_finished`]; the configured
//!     `decode.expected_output_tokens` until the first one);
//!   - arrivals: the requests this scheduler routed to the instance that
//!     have not reached it yet (a ledger sorted by predicted ready time), each
//!     joining at its ready time and then departing like the others;
//!   - the peak: the TBT at `t_ready` and at every ledger arrival within
//!     `E[output tokens] * max(pace, TBT SLO)` after it (as long as the new
//!     request may decode and still meet the SLO), the highest counting;
//!   - memory: if the sequences at a point do not fit `max_batch` or
//!     `max_context_tokens`, someone waits for a slot until the excess has
//!     left, about `(over - 1) * T`. That wait is one long gap in an answer;
//!     it is spread over half of an average answer's gaps
//!     ([`SLOT_WAIT_GAPS`] x `E[output tokens]`) and added to the step.
//!     Time sharing (all gaps) under-counts it for answers shorter than the
//!     mean; a tenth (the first choice) over-counted it for the average
//!     answer; a half was measured best on the issue 19 sweep;
//!   - the floor: the TBT with this request on the load decoding *now*
//!     (`early_reject`'s estimate). The load decoding is a fact, its
//!     departures a forecast; admitting onto an instance that is over the
//!     SLO now, betting on departures before `t_ready`, lost more requests
//!     than it won.
//!
//!   It ignores: real output lengths (one mean for all), the ages of the
//!   running sequences, requests that later arrivals will bring, and prefill
//!   times turning out other than predicted.
//!
//! Every policy refuses a prefill instance whose queue is full; if all are
//! full the request is rejected (`prefill_queues_full`).

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::chunk_hash::ChunkHash;
use super::cost::CostModel;

/// A scheduling policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Uniformly random prefill and decode instances.
    Random,
    /// Prefill and decode instances in turn.
    RoundRobin,
    /// Shortest prefill queue, least loaded decode instance.
    LeastLoaded,
    /// Minimum TTFT using only each instance's own cached prefix.
    CacheLocal,
    /// Minimum TTFT using local and pool prefixes (Mooncake).
    CacheGlobal,
    /// `cache_global` plus rejection on current load.
    EarlyReject,
    /// `cache_global` plus rejection on predicted decode load.
    PredictiveReject,
}

impl Policy {
    /// Every policy, in a fixed order.
    pub const ALL: [Policy; 7] = [
        Policy::Random,
        Policy::RoundRobin,
        Policy::LeastLoaded,
        Policy::CacheLocal,
        Policy::CacheGlobal,
        Policy::EarlyReject,
        Policy::PredictiveReject,
    ];

    /// The name used on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Random => "random",
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoaded => "least_loaded",
            Policy::CacheLocal => "cache_local",
            Policy::CacheGlobal => "cache_global",
            Policy::EarlyReject => "early_reject",
            Policy::PredictiveReject => "predictive_reject",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error of parsing a [`Policy`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy {0:?} (expected one of random, round_robin, least_loaded, cache_local, cache_global, early_reject, predictive_reject)")]
pub struct ParsePolicyError(pub String);

impl FromStr for Policy {
    type Err = ParsePolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Policy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| ParsePolicyError(s.to_string()))
    }
}

/// Latency objectives.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Time between tokens (per-request average), ms.
    pub tbt_ms: f64,
}

impl Default for Slo {
    /// 30 s / 100 ms: the Mooncake FAST'25 paper's TTFT threshold and its
    /// strictest TBT threshold ("threshold I") for the end-to-end runs.
    fn default() -> Self {
        Self {
            ttft_ms: 30_000.0,
            tbt_ms: 100.0,
        }
    }
}

/// What the scheduler sees of a request.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// Caller's id, for its own bookkeeping (the policies ignore it).
    pub id: u64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Prefix-chained chunk hashes of the prompt, in order.
    pub blocks: &'a [ChunkHash],
}

/// Load of one prefill instance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefillLoad {
    /// Requests waiting (not counting the one running).
    pub queued: usize,
    /// When the instance will have finished everything it holds, ms on the
    /// caller's clock (anything `<= now` means idle).
    pub busy_until_ms: f64,
}

/// Load of one decode instance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DecodeLoad {
    /// Sequences in the running batch.
    pub active_seqs: usize,
    /// Context tokens of the running batch.
    pub active_tokens: u64,
    /// Prefilled requests waiting for a slot.
    pub waiting_seqs: usize,
    /// Context tokens of the waiting requests.
    pub waiting_tokens: u64,
}

/// The cluster as the scheduler sees it.
pub trait ClusterView {
    /// Number of prefill instances (indices `0..n`).
    fn prefill_instances(&self) -> usize;
    /// Load of prefill instance `instance`.
    fn prefill_load(&self, instance: usize) -> PrefillLoad;
    /// Leading blocks of `blocks` cached on prefill instance `instance` itself.
    fn local_prefix_blocks(&self, instance: usize, blocks: &[ChunkHash]) -> usize;
    /// Leading blocks of `blocks` cached anywhere in the pool.
    fn global_prefix_blocks(&self, blocks: &[ChunkHash]) -> usize;
    /// Number of decode instances (indices `0..n`).
    fn decode_instances(&self) -> usize;
    /// Load of decode instance `instance`.
    fn decode_load(&self, instance: usize) -> DecodeLoad;
    /// Whether prefill instance `instance` takes requests. A live
    /// conductor marks an instance whose proxy or engine is down; the
    /// simulator's instances are always up.
    fn prefill_available(&self, _instance: usize) -> bool {
        true
    }
    /// Whether decode instance `instance` takes requests (see
    /// [`ClusterView::prefill_available`]).
    fn decode_available(&self, _instance: usize) -> bool {
        true
    }
}

/// Why a request was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum RejectReason {
    /// The view has no prefill or no decode instance.
    NoInstances,
    /// Every prefill queue is at its bound.
    PrefillQueuesFull {
        /// The per-instance bound.
        bound: usize,
    },
    /// The best achievable TTFT misses the SLO.
    TtftSlo {
        /// Best predicted TTFT, ms.
        predicted_ms: f64,
        /// The SLO, ms.
        slo_ms: f64,
    },
    /// The decode pool's (current or predicted) TBT misses the SLO.
    TbtSlo {
        /// Best predicted TBT, ms.
        predicted_ms: f64,
        /// The SLO, ms.
        slo_ms: f64,
    },
}

impl RejectReason {
    /// Short machine-readable name.
    pub fn kind(&self) -> &'static str {
        match self {
            RejectReason::NoInstances => "no_instances",
            RejectReason::PrefillQueuesFull { .. } => "prefill_queues_full",
            RejectReason::TtftSlo { .. } => "ttft_slo",
            RejectReason::TbtSlo { .. } => "tbt_slo",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::NoInstances => f.write_str("no prefill or no decode instance is up"),
            RejectReason::PrefillQueuesFull { bound } => {
                write!(f, "every prefill queue holds its limit of {bound} requests")
            }
            RejectReason::TtftSlo {
                predicted_ms,
                slo_ms,
            } => write!(
                f,
                "predicted time to first token {predicted_ms:.1} ms exceeds the {slo_ms:.1} ms SLO"
            ),
            RejectReason::TbtSlo {
                predicted_ms,
                slo_ms,
            } => write!(
                f,
                "predicted time between tokens {predicted_ms:.1} ms exceeds the {slo_ms:.1} ms SLO"
            ),
        }
    }
}

/// The scheduler's answer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Run prefill on `prefill`, then decode on `decode`.
    Route {
        /// Prefill instance index.
        prefill: usize,
        /// Decode instance index.
        decode: usize,
        /// Predicted time to first token (queue + fetch + prefill), ms.
        predicted_ttft_ms: f64,
        /// Predicted fetch + prefill time (no queue), ms.
        predicted_prefill_ms: f64,
        /// Predicted time between tokens on `decode`, ms.
        predicted_tbt_ms: f64,
        /// Leading blocks the chosen instance is expected to reuse.
        cached_blocks: usize,
        /// Of those, blocks fetched from the pool.
        fetched_blocks: usize,
    },
    /// Refuse the request now, before any prefill work.
    Reject(RejectReason),
}

#[derive(Debug, Clone, Copy)]
struct Inbound {
    ready_ms: f64,
    tokens: u64,
}

/// Most routed-but-not-yet-decoding requests remembered per decode instance
/// (for `predictive_reject`); beyond this the one that joins last is
/// forgotten.
pub const INBOUND_LEDGER_MAX: usize = 16_384;

/// Over what fraction of an answer's gaps `predictive_reject` spreads a
/// wait for a decode slot (see the module docs).
pub const SLOT_WAIT_GAPS: f64 = 0.5;

/// Finished requests the output-length estimate follows (see
/// [`Scheduler::observe_decode_finished`]).
pub const OUTPUT_MEAN_WINDOW: u64 = 256;

/// The highest predicted TBT over a window (wait for a slot included) and
/// the highest decode step.
#[derive(Debug, Clone, Copy)]
struct Peak {
    tbt_ms: f64,
    step_ms: f64,
}

#[derive(Debug, Clone, Copy)]
struct Estimate {
    instance: usize,
    ttft_ms: f64,
    prefill_ms: f64,
    cached_blocks: usize,
    fetched_blocks: usize,
}

/// The scheduler: a policy, the cost model, the SLOs and a seeded RNG, plus
/// its own small memory (round-robin cursors, and for `predictive_reject` the
/// requests it routed that are still in prefill).
#[derive(Debug, Clone)]
pub struct Scheduler {
    policy: Policy,
    cost: CostModel,
    slo: Slo,
    rng: ChaCha8Rng,
    rr_prefill: usize,
    rr_decode: usize,
    inbound: Vec<VecDeque<Inbound>>,
    output_tokens_mean: f64,
    output_tokens_seen: u64,
}

impl Scheduler {
    /// A scheduler; `seed` drives `random` (and nothing else).
    pub fn new(policy: Policy, cost: CostModel, slo: Slo, seed: u64) -> Self {
        Self {
            output_tokens_mean: f64::from(cost.decode.expected_output_tokens),
            policy,
            cost,
            slo,
            rng: ChaCha8Rng::seed_from_u64(seed),
            rr_prefill: 0,
            rr_decode: 0,
            inbound: Vec::new(),
            output_tokens_seen: 0,
        }
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The cost model.
    pub fn cost(&self) -> &CostModel {
        &self.cost
    }

    /// The SLOs.
    pub fn slo(&self) -> Slo {
        self.slo
    }

    /// Decides where `req`, arriving at `now_ms`, runs, or rejects it.
    pub fn schedule<V: ClusterView + ?Sized>(
        &mut self,
        req: &RequestView<'_>,
        view: &V,
        now_ms: f64,
    ) -> Decision {
        let np = view.prefill_instances();
        let nd = view.decode_instances();
        let nd_up = (0..nd).filter(|&d| view.decode_available(d)).count();
        if nd_up == 0 || !(0..np).any(|i| view.prefill_available(i)) {
            return Decision::Reject(RejectReason::NoInstances);
        }
        let bound = self.cost.prefill.queue_max;
        let has_room = |i: usize| view.prefill_available(i) && view.prefill_load(i).queued < bound;
        let open = (0..np).filter(|&i| has_room(i)).count();
        if open == 0 {
            return Decision::Reject(RejectReason::PrefillQueuesFull { bound });
        }
        let decode_up = |d: usize| view.decode_available(d);
        let global = view.global_prefix_blocks(req.blocks);
        let cost = &self.cost;
        let est =
            |i: usize, use_global: bool| estimate(cost, req, view, i, now_ms, global, use_global);

        let (prefill, decode_pick) = match self.policy {
            Policy::Random => {
                let k = self.rng.random_range(0..open);
                let p = (0..np).filter(|&i| has_room(i)).nth(k).unwrap_or(0);
                let k = self.rng.random_range(0..nd_up);
                let d = (0..nd).filter(|&d| decode_up(d)).nth(k).unwrap_or(0);
                (est(p, true), Some(d))
            }
            Policy::RoundRobin => {
                let mut p = self.rr_prefill % np;
                while !has_room(p) {
                    p = (p + 1) % np;
                }
                self.rr_prefill = (p + 1) % np;
                let mut d = self.rr_decode % nd;
                while !decode_up(d) {
                    d = (d + 1) % nd;
                }
                self.rr_decode = (d + 1) % nd;
                (est(p, true), Some(d))
            }
            Policy::LeastLoaded => {
                let mut best: Option<(f64, usize, usize)> = None;
                for i in (0..np).filter(|&i| has_room(i)) {
                    let load = view.prefill_load(i);
                    let key = (load.busy_until_ms.max(now_ms), load.queued, i);
                    if best.is_none_or(|b| key.0 < b.0 || (key.0 == b.0 && key.1 < b.1)) {
                        best = Some(key);
                    }
                }
                let p = best.map_or(0, |b| b.2);
                (est(p, true), None)
            }
            Policy::CacheLocal => (min_ttft(np, &has_room, |i| est(i, false)), None),
            Policy::CacheGlobal | Policy::EarlyReject | Policy::PredictiveReject => {
                (min_ttft(np, &has_room, |i| est(i, true)), None)
            }
        };

        let ctx = u64::from(req.input_tokens) + 1;
        if self.policy == Policy::PredictiveReject {
            let ready = now_ms + prefill.ttft_ms;
            if prefill.ttft_ms > self.slo.ttft_ms {
                return Decision::Reject(RejectReason::TtftSlo {
                    predicted_ms: prefill.ttft_ms,
                    slo_ms: self.slo.ttft_ms,
                });
            }
            let (d, tbt) = self.best_decode_predicted(view, now_ms, ready, ctx);
            if tbt > self.slo.tbt_ms {
                return Decision::Reject(RejectReason::TbtSlo {
                    predicted_ms: tbt,
                    slo_ms: self.slo.tbt_ms,
                });
            }
            self.remember_inbound(nd, d, ready, ctx);
            return route(prefill, d, tbt);
        }

        let (d, tbt) = match decode_pick {
            Some(d) => (d, self.tbt_estimate(view.decode_load(d), ctx)),
            None => self.best_decode_now(view, ctx),
        };
        if self.policy == Policy::EarlyReject {
            if prefill.ttft_ms > self.slo.ttft_ms {
                return Decision::Reject(RejectReason::TtftSlo {
                    predicted_ms: prefill.ttft_ms,
                    slo_ms: self.slo.ttft_ms,
                });
            }
            if tbt > self.slo.tbt_ms {
                return Decision::Reject(RejectReason::TbtSlo {
                    predicted_ms: tbt,
                    slo_ms: self.slo.tbt_ms,
                });
            }
        }
        route(prefill, d, tbt)
    }

    /// Estimated TBT of a decode instance holding `seqs` sequences and
    /// `tokens` context tokens in all (see the module docs).
    pub fn tbt_for(&self, seqs: f64, tokens: f64) -> f64 {
        let cap_seqs = self.cost.decode.max_batch as f64;
        let cap_tokens = self.cost.decode.max_context_tokens as f64;
        let over = (seqs / cap_seqs).max(tokens / cap_tokens).max(1.0);
        self.cost.decode_step_ms(seqs / over, tokens / over) * over
    }

    /// One decode step with `seqs` sequences and `tokens` tokens, or with
    /// as many as fit the batch and KV limits if they do not all fit.
    fn step_within_limits(&self, seqs: f64, tokens: f64) -> f64 {
        let cap_seqs = self.cost.decode.max_batch as f64;
        let cap_tokens = self.cost.decode.max_context_tokens as f64;
        let over = (seqs / cap_seqs).max(tokens / cap_tokens).max(1.0);
        self.cost.decode_step_ms(seqs / over, tokens / over)
    }

    fn tbt_estimate(&self, load: DecodeLoad, ctx: u64) -> f64 {
        let seqs = (load.active_seqs + load.waiting_seqs + 1) as f64;
        let tokens = (load.active_tokens + load.waiting_tokens + ctx) as f64;
        self.tbt_for(seqs, tokens)
    }

    /// The decode instance that is up with the lowest TBT estimate for a
    /// request of `context_tokens` joining it now, and that estimate; `None`
    /// when none is up. (What a live conductor uses to continue a request
    /// whose decode instance died.)
    pub fn least_loaded_decode<V: ClusterView + ?Sized>(
        &self,
        view: &V,
        context_tokens: u64,
    ) -> Option<(usize, f64)> {
        let (d, tbt) = self.best_decode_now(view, context_tokens);
        tbt.is_finite().then_some((d, tbt))
    }

    fn best_decode_now<V: ClusterView + ?Sized>(&self, view: &V, ctx: u64) -> (usize, f64) {
        let mut best = (0, f64::INFINITY);
        for d in (0..view.decode_instances()).filter(|&d| view.decode_available(d)) {
            let t = self.tbt_estimate(view.decode_load(d), ctx);
            if t < best.1 {
                best = (d, t);
            }
        }
        best
    }

    fn best_decode_predicted<V: ClusterView + ?Sized>(
        &mut self,
        view: &V,
        now_ms: f64,
        ready_ms: f64,
        ctx: u64,
    ) -> (usize, f64) {
        let nd = view.decode_instances();
        if self.inbound.len() < nd {
            self.inbound.resize_with(nd, VecDeque::new);
        }
        let mut best = (0, f64::INFINITY);
        for d in 0..nd {
            if !view.decode_available(d) {
                continue;
            }
            let load = view.decode_load(d);
            // Requests that finished prefill by now are in `load`.
            let ledger = &mut self.inbound[d];
            while ledger.front().is_some_and(|r| r.ready_ms <= now_ms) {
                ledger.pop_front();
            }
            // Sequences decode at the pace of the load they will see: a first
            // pass at today's pace finds the peak, the second uses the
            // peak's pace if it is slower.
            let ledger = &self.inbound[d];
            let pace_now = self.tbt_estimate(load, ctx);
            let first = self.peak_tbt(load, ledger, now_ms, ready_ms, ctx, pace_now);
            let peak = if first.step_ms > pace_now {
                self.peak_tbt(load, ledger, now_ms, ready_ms, ctx, first.step_ms)
                    .tbt_ms
            } else {
                first.tbt_ms
            };
            // The load already decoding is a fact, the departures a
            // forecast: never admit onto an instance whose TBT with this
            // request is over the SLO now (`early_reject`'s test), on the
            // strength of sequences expected to leave before it arrives.
            let t = peak.max(pace_now);
            if t < best.1 {
                best = (d, t);
            }
        }
        best
    }

    /// The highest TBT predicted on one decode instance from `ready_ms`
    /// (when the new request joins) until the requests already routed there
    /// that join while it may still be decoding have joined too, with
    /// sequences decoding at `pace_ms` per token (see the module docs).
    fn peak_tbt(
        &self,
        load: DecodeLoad,
        ledger: &VecDeque<Inbound>,
        now_ms: f64,
        ready_ms: f64,
        ctx: u64,
        pace_ms: f64,
    ) -> Peak {
        let cap_seqs = self.cost.decode.max_batch as f64;
        let cap_tokens = self.cost.decode.max_context_tokens as f64;
        let expected_out = self.expected_output_tokens();
        let decode_time = expected_out * pace_ms;
        // As long as the new request may decode and still meet the SLO.
        let horizon = ready_ms + expected_out * pace_ms.max(self.slo.tbt_ms);
        let long_gaps = (SLOT_WAIT_GAPS * expected_out).max(1.0);
        // Fraction of the sequences decoding at `from` still decoding at `to`.
        let survive = |from: f64, to: f64| {
            if decode_time > 0.0 {
                (-(to - from).max(0.0) / decode_time).exp()
            } else {
                0.0
            }
        };
        let at = |t: f64, in_seqs: f64, in_tokens: f64| {
            let left = survive(now_ms, t);
            let seqs = load.active_seqs as f64 * left + load.waiting_seqs as f64 + 1.0 + in_seqs;
            let tokens = load.active_tokens as f64 * left
                + load.waiting_tokens as f64
                + ctx as f64
                + in_tokens;
            let over = (seqs / cap_seqs).max(tokens / cap_tokens).max(1.0);
            let step = self.step_within_limits(seqs, tokens);
            // If they do not fit, someone waits for a slot until the excess
            // has left. That wait is one gap of an answer that also has
            // normal ones; it is spread over half of them (see
            // `SLOT_WAIT_GAPS`).
            let wait = (over - 1.0) * decode_time;
            Peak {
                tbt_ms: step + wait / long_gaps,
                step_ms: step,
            }
        };
        // Routed requests joined by `t`, each decayed like the running ones
        // from its own ready time. The ledger is sorted by ready time.
        let (mut in_seqs, mut in_tokens) = (0.0f64, 0.0f64);
        let mut joined = 0usize;
        let mut t = ready_ms;
        let mut last = ready_ms;
        let mut peak = Peak {
            tbt_ms: f64::NEG_INFINITY,
            step_ms: f64::NEG_INFINITY,
        };
        loop {
            let k = survive(last, t);
            in_seqs *= k;
            in_tokens *= k;
            last = t;
            while joined < ledger.len() && ledger[joined].ready_ms <= t {
                let k = survive(ledger[joined].ready_ms.max(now_ms), t);
                in_seqs += k;
                in_tokens += ledger[joined].tokens as f64 * k;
                joined += 1;
            }
            let p = at(t, in_seqs, in_tokens);
            peak.tbt_ms = peak.tbt_ms.max(p.tbt_ms);
            peak.step_ms = peak.step_ms.max(p.step_ms);
            match ledger.get(joined) {
                Some(next) if next.ready_ms < horizon => t = next.ready_ms,
                _ => break,
            }
        }
        peak
    }

    fn remember_inbound(&mut self, nd: usize, d: usize, ready_ms: f64, tokens: u64) {
        if self.inbound.len() < nd {
            self.inbound.resize_with(nd, VecDeque::new);
        }
        let q = &mut self.inbound[d];
        if q.len() >= INBOUND_LEDGER_MAX {
            // Forget the request that joins last: the prediction matters
            // most for the near future.
            match q.back() {
                Some(last) if last.ready_ms > ready_ms => {
                    q.pop_back();
                }
                _ => return,
            }
        }
        let at = q.partition_point(|r| r.ready_ms <= ready_ms);
        q.insert(at, Inbound { ready_ms, tokens });
    }

    /// Output tokens per request the predictor assumes: the configured
    /// `decode.expected_output_tokens` until requests finish decoding, then
    /// a moving mean of the finished ones (see
    /// [`Scheduler::observe_decode_finished`]).
    pub fn expected_output_tokens(&self) -> f64 {
        self.output_tokens_mean
    }

    /// Tells the scheduler that a request finished decoding after
    /// `output_tokens` tokens in all. The first observation replaces the
    /// configured prior; then each one moves the mean by a fraction
    /// `1 / min(observations, OUTPUT_MEAN_WINDOW)`, so the estimate is the
    /// plain mean at first and follows the last few hundred requests later.
    pub fn observe_decode_finished(&mut self, output_tokens: u32) {
        self.output_tokens_seen = self.output_tokens_seen.saturating_add(1);
        let n = self.output_tokens_seen.min(OUTPUT_MEAN_WINDOW) as f64;
        self.output_tokens_mean += (f64::from(output_tokens) - self.output_tokens_mean) / n;
    }

    /// Requests routed to decode instance `d` that this scheduler still
    /// expects to finish prefill (for `predictive_reject`; 0 otherwise).
    pub fn inbound_len(&self, d: usize) -> usize {
        self.inbound.get(d).map_or(0, VecDeque::len)
    }
}

fn min_ttft(
    np: usize,
    has_room: &impl Fn(usize) -> bool,
    est: impl Fn(usize) -> Estimate,
) -> Estimate {
    let mut best: Option<Estimate> = None;
    for i in (0..np).filter(|&i| has_room(i)) {
        let e = est(i);
        if best.is_none_or(|b| e.ttft_ms < b.ttft_ms) {
            best = Some(e);
        }
    }
    // `open > 0` was checked by the caller, so `best` is set.
    best.unwrap_or_else(|| est(0))
}

fn estimate<V: ClusterView + ?Sized>(
    cost: &CostModel,
    req: &RequestView<'_>,
    view: &V,
    instance: usize,
    now_ms: f64,
    global: usize,
    use_global: bool,
) -> Estimate {
    let local = view.local_prefix_blocks(instance, req.blocks);
    let (cached, fetched) = if use_global && global > local {
        (global, global - local)
    } else {
        (local, 0)
    };
    let cached_tokens = cost.blocks_to_tokens(cached, req.input_tokens);
    let local_tokens = cost.blocks_to_tokens(local.min(cached), req.input_tokens);
    let uncached = u64::from(req.input_tokens) - cached_tokens;
    let prefill_ms =
        cost.fetch_ms(cached_tokens - local_tokens) + cost.prefill_ms(uncached, cached_tokens);
    let wait = (view.prefill_load(instance).busy_until_ms - now_ms).max(0.0);
    Estimate {
        instance,
        ttft_ms: wait + prefill_ms,
        prefill_ms,
        cached_blocks: cached,
        fetched_blocks: fetched,
    }
}

fn route(p: Estimate, decode: usize, tbt: f64) -> Decision {
    Decision::Route {
        prefill: p.instance,
        decode,
        predicted_ttft_ms: p.ttft_ms,
        predicted_prefill_ms: p.prefill_ms,
        predicted_tbt_ms: tbt,
        cached_blocks: p.cached_blocks,
        fetched_blocks: p.fetched_blocks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[derive(Default)]
    struct FakeView {
        prefill: Vec<(PrefillLoad, HashSet<u64>)>,
        global: HashSet<u64>,
        decode: Vec<DecodeLoad>,
        prefill_down: HashSet<usize>,
        decode_down: HashSet<usize>,
    }

    impl ClusterView for FakeView {
        fn prefill_instances(&self) -> usize {
            self.prefill.len()
        }
        fn prefill_load(&self, i: usize) -> PrefillLoad {
            self.prefill[i].0
        }
        fn local_prefix_blocks(&self, i: usize, blocks: &[ChunkHash]) -> usize {
            blocks
                .iter()
                .take_while(|b| self.prefill[i].1.contains(&b.0))
                .count()
        }
        fn global_prefix_blocks(&self, blocks: &[ChunkHash]) -> usize {
            blocks
                .iter()
                .take_while(|b| self.global.contains(&b.0))
                .count()
        }
        fn decode_instances(&self) -> usize {
            self.decode.len()
        }
        fn decode_load(&self, i: usize) -> DecodeLoad {
            self.decode[i]
        }
        fn prefill_available(&self, i: usize) -> bool {
            !self.prefill_down.contains(&i)
        }
        fn decode_available(&self, i: usize) -> bool {
            !self.decode_down.contains(&i)
        }
    }

    fn view(np: usize, nd: usize) -> FakeView {
        FakeView {
            prefill: (0..np)
                .map(|_| (PrefillLoad::default(), HashSet::new()))
                .collect(),
            decode: vec![DecodeLoad::default(); nd],
            ..FakeView::default()
        }
    }

    fn decode_of(d: Decision) -> usize {
        match d {
            Decision::Route { decode, .. } => decode,
            Decision::Reject(r) => panic!("rejected: {r}"),
        }
    }

    #[test]
    fn every_policy_skips_instances_that_are_down() {
        let b = blocks(4);
        let mut v = view(3, 3);
        // The best prefill instance (it holds the prefix) and decode 0 are down.
        v.prefill[1].1.extend(0..4);
        v.prefill_down.insert(1);
        v.decode_down.insert(0);
        for p in Policy::ALL {
            let mut s = sched(p);
            for _ in 0..12 {
                let d = s.schedule(&req(&b), &v, 0.0);
                assert_ne!(prefill_of(d), 1, "{p}");
                assert_ne!(decode_of(d), 0, "{p}");
            }
        }
        let s = sched(Policy::CacheGlobal);
        assert_eq!(s.least_loaded_decode(&v, 100).map(|(d, _)| d), Some(1));
        // Nothing up on one side: no instance, whatever the queues say.
        v.decode_down.extend([1, 2]);
        assert_eq!(s.least_loaded_decode(&v, 100), None);
        for p in Policy::ALL {
            assert_eq!(
                sched(p).schedule(&req(&b), &v, 0.0),
                Decision::Reject(RejectReason::NoInstances),
                "{p}"
            );
        }
        v.decode_down.clear();
        v.prefill_down.extend([0, 2]);
        assert_eq!(
            sched(Policy::RoundRobin).schedule(&req(&b), &v, 0.0),
            Decision::Reject(RejectReason::NoInstances)
        );
    }

    #[test]
    fn decisions_round_trip_through_json() {
        let b = blocks(4);
        let mut v = view(2, 1);
        v.prefill[0].0.busy_until_ms = 123.456_789;
        let route = sched(Policy::CacheGlobal).schedule(&req(&b), &v, 0.1);
        let rejects = [
            Decision::Reject(RejectReason::NoInstances),
            Decision::Reject(RejectReason::PrefillQueuesFull { bound: 3 }),
            Decision::Reject(RejectReason::TtftSlo {
                predicted_ms: 1.0 / 3.0,
                slo_ms: 2.0,
            }),
        ];
        for d in std::iter::once(route).chain(rejects) {
            let text = serde_json::to_string(&d).unwrap();
            assert_eq!(
                serde_json::from_str::<Decision>(&text).unwrap(),
                d,
                "{text}"
            );
        }
    }

    fn blocks(n: u64) -> Vec<ChunkHash> {
        (0..n).map(ChunkHash).collect()
    }

    fn sched(p: Policy) -> Scheduler {
        Scheduler::new(p, CostModel::default(), Slo::default(), 7)
    }

    fn req(b: &[ChunkHash]) -> RequestView<'_> {
        RequestView {
            id: 1,
            input_tokens: (b.len() * 512) as u32,
            blocks: b,
        }
    }

    fn prefill_of(d: Decision) -> usize {
        match d {
            Decision::Route { prefill, .. } => prefill,
            Decision::Reject(r) => panic!("rejected: {r}"),
        }
    }

    #[test]
    fn policy_names_round_trip() {
        for p in Policy::ALL {
            assert_eq!(p.as_str().parse::<Policy>().unwrap(), p);
            assert_eq!(
                serde_json::to_string(&p).unwrap(),
                format!("\"{}\"", p.as_str())
            );
        }
        assert!("fastest".parse::<Policy>().is_err());
    }

    #[test]
    fn cache_local_follows_the_local_prefix_and_cache_global_counts_the_pool() {
        let b = blocks(20);
        let mut v = view(3, 1);
        v.prefill[2].1.extend(0..10);
        v.global.extend(0..20);
        assert_eq!(
            prefill_of(sched(Policy::CacheLocal).schedule(&req(&b), &v, 0.0)),
            2
        );
        // Everything is in the pool; instance 2 has half locally, so it
        // still fetches less and wins.
        let d = sched(Policy::CacheGlobal).schedule(&req(&b), &v, 0.0);
        match d {
            Decision::Route {
                prefill,
                cached_blocks,
                fetched_blocks,
                ..
            } => {
                assert_eq!((prefill, cached_blocks, fetched_blocks), (2, 20, 10));
            }
            Decision::Reject(r) => panic!("{r}"),
        }
        // A long queue on instance 2 sends the request elsewhere.
        v.prefill[2].0.busy_until_ms = 60_000.0;
        v.prefill[2].0.queued = 10;
        assert_ne!(
            prefill_of(sched(Policy::CacheGlobal).schedule(&req(&b), &v, 0.0)),
            2
        );
    }

    #[test]
    fn least_loaded_and_round_robin() {
        let b = blocks(2);
        let mut v = view(3, 2);
        v.prefill[0].0.busy_until_ms = 500.0;
        v.prefill[1].0.busy_until_ms = 100.0;
        v.prefill[2].0.busy_until_ms = 900.0;
        assert_eq!(
            prefill_of(sched(Policy::LeastLoaded).schedule(&req(&b), &v, 0.0)),
            1
        );
        let mut rr = sched(Policy::RoundRobin);
        let picks: Vec<usize> = (0..4)
            .map(|_| prefill_of(rr.schedule(&req(&b), &v, 0.0)))
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0]);
    }

    #[test]
    fn random_is_seeded() {
        let b = blocks(2);
        let v = view(8, 2);
        let run = |seed| {
            let mut s = Scheduler::new(Policy::Random, CostModel::default(), Slo::default(), seed);
            (0..32)
                .map(|_| prefill_of(s.schedule(&req(&b), &v, 0.0)))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn full_queues_are_skipped_then_rejected() {
        let b = blocks(2);
        let mut v = view(2, 1);
        let bound = CostModel::default().prefill.queue_max;
        v.prefill[0].0.queued = bound;
        for p in Policy::ALL {
            assert_eq!(prefill_of(sched(p).schedule(&req(&b), &v, 0.0)), 1, "{p}");
        }
        v.prefill[1].0.queued = bound;
        for p in Policy::ALL {
            assert_eq!(
                sched(p).schedule(&req(&b), &v, 0.0),
                Decision::Reject(RejectReason::PrefillQueuesFull { bound })
            );
        }
        assert_eq!(
            sched(Policy::CacheGlobal).schedule(&req(&b), &view(0, 1), 0.0),
            Decision::Reject(RejectReason::NoInstances)
        );
    }

    #[test]
    fn early_reject_on_ttft_and_on_current_decode_load() {
        let b = blocks(4);
        let mut v = view(1, 1);
        v.prefill[0].0.busy_until_ms = 40_000.0;
        let d = sched(Policy::EarlyReject).schedule(&req(&b), &v, 0.0);
        assert!(
            matches!(d, Decision::Reject(RejectReason::TtftSlo { .. })),
            "{d:?}"
        );
        assert!(matches!(
            sched(Policy::CacheGlobal).schedule(&req(&b), &v, 0.0),
            Decision::Route { .. }
        ));
        v.prefill[0].0.busy_until_ms = 0.0;
        let cap = CostModel::default().decode.max_context_tokens;
        v.decode[0] = DecodeLoad {
            active_seqs: 100,
            active_tokens: cap,
            waiting_seqs: 50,
            waiting_tokens: cap,
        };
        let d = sched(Policy::EarlyReject).schedule(&req(&b), &v, 0.0);
        match d {
            Decision::Reject(r @ RejectReason::TbtSlo { .. }) => {
                assert!(r.to_string().contains("time between tokens"), "{r}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn predictive_reject_sees_finishing_and_inbound_load() {
        let b = blocks(4);
        let cap = CostModel::default().decode.max_context_tokens;
        // Decode is full now and the request reaches decode only 20 s
        // later, when most of the current batch may have finished: both
        // refuse. The load decoding now is a fact, its departures a
        // forecast, and predictive_reject does not admit on the forecast.
        let mut v = view(1, 1);
        v.prefill[0].0.busy_until_ms = 20_000.0;
        v.decode[0] = DecodeLoad {
            active_seqs: 100,
            active_tokens: cap * 2,
            waiting_seqs: 0,
            waiting_tokens: 0,
        };
        assert!(matches!(
            sched(Policy::EarlyReject).schedule(&req(&b), &v, 0.0),
            Decision::Reject(RejectReason::TbtSlo { .. })
        ));
        assert!(matches!(
            sched(Policy::PredictiveReject).schedule(&req(&b), &v, 0.0),
            Decision::Reject(RejectReason::TbtSlo { .. })
        ));
        // An idle decode pool, but many requests already routed to it and
        // about to finish prefill: predictive_reject refuses once the ledger
        // fills the pool, early_reject never does.
        let mut v = view(1, 1);
        let big: Vec<ChunkHash> = blocks(40); // 20,480 tokens each
        let mut pr = sched(Policy::PredictiveReject);
        let mut er = sched(Policy::EarlyReject);
        let mut pr_rejected = false;
        for _ in 0..150 {
            v.prefill[0].0.busy_until_ms = 0.0;
            if let Decision::Reject(RejectReason::TbtSlo { .. }) = pr.schedule(&req(&big), &v, 0.0)
            {
                pr_rejected = true;
            }
            assert!(matches!(
                er.schedule(&req(&big), &v, 0.0),
                Decision::Route { .. }
            ));
        }
        assert!(pr_rejected);
        assert!(pr.inbound_len(0) > 0);
    }

    fn full_decode(active_seqs: usize, active_tokens: u64) -> DecodeLoad {
        DecodeLoad {
            active_seqs,
            active_tokens,
            waiting_seqs: 0,
            waiting_tokens: 0,
        }
    }

    #[test]
    fn predictive_reject_learns_the_output_length() {
        let b = blocks(4);
        let cap = CostModel::default().decode.max_context_tokens;
        // Decode is half full now; the requests routed now all reach it
        // 20 s later. How many fit depends on how much of today's batch has
        // finished by then, so on how long answers are.
        let mut v = view(1, 1);
        v.prefill[0].0.busy_until_ms = 20_000.0;
        v.decode[0] = full_decode(50, cap / 2);
        let admitted = |pr: &mut Scheduler| {
            for n in 0..10_000 {
                match pr.schedule(&req(&b), &v, 0.0) {
                    Decision::Route { .. } => {}
                    Decision::Reject(RejectReason::TbtSlo { .. }) => return n,
                    other => panic!("{other:?}"),
                }
            }
            panic!("never refused");
        };
        let mut short = sched(Policy::PredictiveReject);
        assert_eq!(short.expected_output_tokens(), 150.0);
        let with_short = admitted(&mut short);
        // Finished requests say answers are 2,000 tokens long: most of
        // today's batch is still decoding when the routed ones arrive.
        let mut long = sched(Policy::PredictiveReject);
        for _ in 0..10 {
            long.observe_decode_finished(2_000);
        }
        assert_eq!(long.expected_output_tokens(), 2_000.0);
        let with_long = admitted(&mut long);
        assert!(
            with_long < with_short,
            "{with_long} admitted with long answers, {with_short} with short ones"
        );
        // A moving mean: the first observation replaces the prior, then
        // each moves it by 1/n.
        let mut s = sched(Policy::PredictiveReject);
        s.observe_decode_finished(100);
        s.observe_decode_finished(300);
        assert_eq!(s.expected_output_tokens(), 200.0);
        for _ in 0..10 * OUTPUT_MEAN_WINDOW {
            s.observe_decode_finished(1_000);
        }
        assert!((s.expected_output_tokens() - 1_000.0).abs() < 1.0);
    }

    #[test]
    fn predictive_reject_counts_requests_that_join_after_it() {
        let big = blocks(60); // 30,720 tokens each
        let mut pr = sched(Policy::PredictiveReject);
        let mut er = sched(Policy::EarlyReject);
        // Long answers: a request decodes for over a minute.
        for _ in 0..10 {
            pr.observe_decode_finished(1_000);
        }
        // Requests routed while prefill is 20 s behind reach decode at about
        // 25 s. Route them until the predicted load there is full.
        let mut v = view(1, 1);
        let mut routed = 0;
        loop {
            v.prefill[0].0.busy_until_ms = 20_000.0;
            match pr.schedule(&req(&big), &v, 0.0) {
                Decision::Route { .. } => routed += 1,
                Decision::Reject(RejectReason::TbtSlo { .. }) => break,
                other => panic!("{other:?}"),
            }
            assert!(routed < 1_000);
        }
        assert!(routed > 10, "{routed}");
        assert_eq!(pr.inbound_len(0), routed);
        // Now prefill is idle: the same request would reach decode first, in
        // about 5 s, onto an empty instance, and still be decoding when the
        // others arrive, so it is refused. early_reject, which sees only the
        // empty instance, takes it.
        v.prefill[0].0.busy_until_ms = 0.0;
        assert!(matches!(
            pr.schedule(&req(&big), &v, 0.0),
            Decision::Reject(RejectReason::TbtSlo { .. })
        ));
        assert!(matches!(
            er.schedule(&req(&big), &v, 0.0),
            Decision::Route { .. }
        ));
        // Once they have joined (and show in the instance's load) the
        // ledger forgets them.
        v.decode[0] = full_decode(routed, routed as u64 * 30_721);
        let d = pr.schedule(&req(&big), &v, 30_000.0);
        let added = usize::from(matches!(d, Decision::Route { .. }));
        assert_eq!(pr.inbound_len(0), added);
    }

    #[test]
    fn predictive_reject_does_not_plan_to_queue_for_decode() {
        let b = blocks(4);
        let cap = CostModel::default().decode.max_context_tokens;
        // Ten sequences that hold 30 % more KV than fits: whoever joins next
        // waits seconds for some of them to finish. Shared in time, the
        // step would be ~77 ms, under the 100 ms SLO; early_reject takes it.
        let mut v = view(1, 1);
        v.decode[0] = full_decode(10, cap * 13 / 10);
        assert!(matches!(
            sched(Policy::EarlyReject).schedule(&req(&b), &v, 0.0),
            Decision::Route { .. }
        ));
        match sched(Policy::PredictiveReject).schedule(&req(&b), &v, 0.0) {
            Decision::Reject(RejectReason::TbtSlo { predicted_ms, .. }) => {
                assert!(predicted_ms > 100.0, "{predicted_ms}");
            }
            other => panic!("{other:?}"),
        }
        // With room for it, the same request is taken.
        v.decode[0] = full_decode(10, cap / 2);
        assert!(matches!(
            sched(Policy::PredictiveReject).schedule(&req(&b), &v, 0.0),
            Decision::Route { .. }
        ));
    }

    #[test]
    fn tbt_estimate_grows_with_oversubscription() {
        let s = sched(Policy::CacheGlobal);
        let cap = CostModel::default().decode.max_context_tokens as f64;
        let fits = s.tbt_for(10.0, cap / 2.0);
        let full = s.tbt_for(20.0, cap);
        let twice = s.tbt_for(40.0, 2.0 * cap);
        assert!(fits < full);
        assert!((twice - 2.0 * full).abs() < 1e-9);
    }
}
