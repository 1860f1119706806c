//! Prediction-based early rejection against plain early rejection, swept
//! over generated decode-heavy and bursty traces (issue 19).
//!
//! Every regime is a (prefill instances, decode instances, speed-up, TTFT
//! SLO, TBT SLO) point; both policies replay the same trace there. In every
//! regime `predictive_reject` must reach at least 0.95x the goodput of
//! `early_reject` and its SLO attainment less at most [`ATTAINMENT_TIE`];
//! where early rejection oscillates it must reach at least 1.2x the goodput,
//! at least the SLO attainment, and not oscillate itself.
//!
//! "Oscillates" ([`LoadSeries::oscillates`]) is measured on the decode load
//! series (TBT estimate / TBT SLO, sampled every simulated second): at least
//! three times the load climbs to 1.25 (every request decoding then is
//! missing the SLO) after having come back to the SLO or below.
//!
//! Why a tie band on attainment: near capacity (speed 1-2 here) both
//! policies hold decode at the SLO. `early_reject` sees decode without the
//! requests still in prefill, so it admits a little past the SLO at burst
//! onsets; TBT is an average over a long answer, so most of those still make
//! it. `predictive_reject` counts them and holds back. The difference is up
//! to 2 percentage points either way (1.83 against `predictive_reject` at
//! worst in this sweep, 38 of 216 regimes below); a predictor that took the same
//! gamble would hold decode past the SLO under sustained overload, where
//! every request then misses (tried: 3 % of slack on the SLO fell to
//! 0.09-0.17x of `early_reject`'s goodput in the worst regimes).
//!
//! The table is printed (`cargo test --release --test conductor_sweep --
//! --nocapture`); docs/BENCHMARKS.md holds a copy.

use kvpool_conductor::gen::{generate, write_trace, GenParams, Preset};
use kvpool_conductor::scheduler::{Policy, Slo};
use kvpool_conductor::sim::{simulate, LoadSeries, SimConfig, SimOutcome};
use kvpool_conductor::trace::Trace;

/// How far below `early_reject`'s SLO attainment `predictive_reject`'s may
/// be outside the oscillating regimes (see the module docs).
const ATTAINMENT_TIE: f64 = 0.02;
/// Requests per generated trace.
const REQUESTS: u32 = 6_000;

fn trace_of(params: &GenParams) -> Trace {
    let mut bytes = Vec::new();
    write_trace(params, &mut bytes).expect("valid generator parameters");
    Trace::parse(bytes.as_slice(), "generated", 512).expect("generated traces load")
}

#[derive(Debug, Clone, Copy)]
struct Regime {
    prefill: usize,
    decode: usize,
    speed: f64,
    ttft_slo_ms: f64,
    tbt_slo_ms: f64,
}

fn run(trace: &Trace, policy: Policy, r: Regime) -> SimOutcome {
    let mut cfg = SimConfig::new(policy, r.prefill, r.decode);
    cfg.speed = r.speed;
    cfg.slo = Slo {
        ttft_ms: r.ttft_slo_ms,
        tbt_ms: r.tbt_slo_ms,
    };
    cfg.load_sample_ms = Some(1_000.0);
    simulate(trace, &cfg).expect("valid configuration")
}

struct Row {
    trace: &'static str,
    regime: Regime,
    early: SimOutcome,
    pred: SimOutcome,
}

impl Row {
    fn load(o: &SimOutcome) -> &LoadSeries {
        o.load.as_ref().expect("the sweep samples load")
    }
    fn swings(o: &SimOutcome) -> usize {
        Self::load(o).overload_swings()
    }
    fn early_oscillates(&self) -> bool {
        Self::load(&self.early).oscillates()
    }
    fn ratio(&self) -> f64 {
        self.pred.report.goodput_rps / self.early.report.goodput_rps
    }
}

fn regimes() -> Vec<Regime> {
    let mut out = Vec::new();
    for prefill in [4, 8, 16] {
        for decode in [1, 2] {
            for speed in [1.0, 2.0, 4.0] {
                for ttft_slo_ms in [10_000.0, 30_000.0] {
                    for tbt_slo_ms in [40.0, 60.0, 100.0] {
                        out.push(Regime {
                            prefill,
                            decode,
                            speed,
                            ttft_slo_ms,
                            tbt_slo_ms,
                        });
                    }
                }
            }
        }
    }
    out
}

fn sweep() -> Vec<Row> {
    let traces = [
        (
            "decode-heavy",
            trace_of(&Preset::DecodeHeavy.params(1, REQUESTS)),
        ),
        ("bursty", trace_of(&Preset::Bursty.params(1, REQUESTS))),
    ];
    let mut rows = Vec::new();
    for (name, trace) in &traces {
        for regime in regimes() {
            rows.push(Row {
                trace: name,
                regime,
                early: run(trace, Policy::EarlyReject, regime),
                pred: run(trace, Policy::PredictiveReject, regime),
            });
        }
    }
    rows
}

fn print_table(rows: &[Row]) {
    println!(
        "| trace | P | D | speed | TTFT SLO s | TBT SLO ms | early goodput | pred goodput | ratio | early attainment | pred attainment | early wasted | pred wasted | early swings | pred swings |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let (e, p) = (&r.early.report, &r.pred.report);
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {} | {} | {} | {} |",
            r.trace,
            r.regime.prefill,
            r.regime.decode,
            r.regime.speed,
            r.regime.ttft_slo_ms / 1000.0,
            r.regime.tbt_slo_ms,
            e.goodput_rps,
            p.goodput_rps,
            r.ratio(),
            e.slo_attainment,
            p.slo_attainment,
            e.wasted_prefills,
            p.wasted_prefills,
            Row::swings(&r.early),
            Row::swings(&r.pred),
        );
    }
}

#[test]
fn generated_traces_are_decode_heavy_and_bursty() {
    // The sweep means something only if the traces are what they claim.
    let heavy = generate(&Preset::DecodeHeavy.params(1, REQUESTS)).unwrap();
    let mean_out = heavy
        .iter()
        .map(|r| f64::from(r.output_length))
        .sum::<f64>()
        / heavy.len() as f64;
    assert!(mean_out > 700.0, "{mean_out}");
    // Bursts bring new conversations: count first turns (the block after
    // the shared system prompt is new) per 10 s.
    let params = Preset::Bursty.params(1, REQUESTS);
    let bursty = generate(&params).unwrap();
    let prefix_blocks = (params.prefix_tokens / 512) as usize;
    let last = bursty.last().unwrap().timestamp;
    let mut starts = vec![0u32; (last / 10_000 + 1) as usize];
    let mut seen = std::collections::HashSet::new();
    for r in &bursty {
        if !seen.contains(&r.hash_ids[prefix_blocks]) {
            starts[(r.timestamp / 10_000) as usize] += 1;
        }
        seen.extend(r.hash_ids.iter().copied());
    }
    let mean = starts.iter().sum::<u32>() as f64 / starts.len() as f64;
    // About 13 bursts of 20 s at 5x the base rate in ~1,500 s.
    let peaks = starts
        .iter()
        .filter(|&&n| f64::from(n) > 2.0 * mean)
        .count();
    assert!(peaks >= 10, "{peaks} windows in bursts");
}

#[test]
fn predictive_rejection_never_loses_to_early_rejection() {
    let rows = sweep();
    print_table(&rows);
    let mut failures = Vec::new();
    for r in &rows {
        let (e, p) = (&r.early.report, &r.pred.report);
        let what = format!("{} {:?}", r.trace, r.regime);
        if p.goodput_rps < 0.95 * e.goodput_rps {
            failures.push(format!(
                "{what}: goodput {:.3} < 0.95 x {:.3}",
                p.goodput_rps, e.goodput_rps
            ));
        }
        if p.slo_attainment < e.slo_attainment - ATTAINMENT_TIE {
            failures.push(format!(
                "{what}: SLO attainment {:.4} < {:.4} - {ATTAINMENT_TIE}",
                p.slo_attainment, e.slo_attainment
            ));
        }
        if r.early_oscillates() {
            if r.ratio() < 1.2 {
                failures.push(format!(
                    "{what}: early_reject oscillates but the goodput ratio is only {:.2}",
                    r.ratio()
                ));
            }
            if p.slo_attainment < e.slo_attainment {
                failures.push(format!(
                    "{what}: early_reject oscillates but SLO attainment {:.4} < {:.4}",
                    p.slo_attainment, e.slo_attainment
                ));
            }
            if Row::load(&r.pred).oscillates() {
                failures.push(format!(
                    "{what}: predictive_reject oscillates too ({} swings)",
                    Row::swings(&r.pred)
                ));
            }
        }
    }
    let at_least = rows
        .iter()
        .filter(|r| r.pred.report.slo_attainment >= r.early.report.slo_attainment)
        .count();
    println!(
        "predictive_reject's SLO attainment >= early_reject's in {at_least} of {} regimes",
        rows.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} regimes fail:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
    // Oscillation is detected where it is expected: bursts on few prefill
    // instances, decode short, arrivals 2-4x faster.
    for (prefill, decode, speed) in [(4, 1, 4.0), (4, 2, 2.0), (4, 2, 4.0)] {
        let r = rows
            .iter()
            .find(|r| {
                r.trace == "bursty"
                    && (r.regime.prefill, r.regime.decode, r.regime.speed)
                        == (prefill, decode, speed)
                    && r.regime.ttft_slo_ms == 10_000.0
                    && r.regime.tbt_slo_ms == 40.0
            })
            .expect("the regime is in the sweep");
        assert!(
            r.early_oscillates(),
            "{:?}: early_reject has only {} swings",
            r.regime,
            Row::swings(&r.early)
        );
    }
    let oscillating = rows.iter().filter(|r| r.early_oscillates()).count();
    assert!(oscillating >= 10, "only {oscillating} oscillating regimes");
}
