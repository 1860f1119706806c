//! Trace replay on the synthetic trace: determinism, SLOs at speed 1, and
//! early rejection under overload.

use crate::support;

use kvpool_conductor::scheduler::Policy;
use kvpool_sim::sim::{simulate, SimConfig, SimReport};
use kvpool_sim::trace::Trace;
use support::load_trace;

fn run(trace: &Trace, policy: Policy, prefill: usize, decode: usize, speed: f64) -> SimReport {
    let mut cfg = SimConfig::new(policy, prefill, decode);
    cfg.speed = speed;
    simulate(trace, &cfg).unwrap().report
}

#[test]
fn same_seed_same_report_byte_for_byte() {
    let trace = load_trace();
    for policy in [Policy::Random, Policy::PredictiveReject] {
        let mut cfg = SimConfig::new(policy, 8, 2);
        cfg.speed = 3.0;
        cfg.seed = 42;
        let a = serde_json::to_string(&simulate(&trace, &cfg).unwrap().report).unwrap();
        let b = serde_json::to_string(&simulate(&trace, &cfg).unwrap().report).unwrap();
        assert_eq!(a, b, "{policy}");
    }
    // A different seed changes what `random` does.
    let mut cfg = SimConfig::new(Policy::Random, 8, 2);
    cfg.seed = 1;
    let a = simulate(&trace, &cfg).unwrap().report;
    cfg.seed = 2;
    let b = simulate(&trace, &cfg).unwrap().report;
    assert_ne!(a, b);
}

#[test]
fn the_per_request_outcome_adds_up_to_the_report() {
    // `met` is what the issue-19 sweep pairs two policies on.
    let trace = load_trace();
    let mut cfg = SimConfig::new(Policy::EarlyReject, 2, 1);
    cfg.speed = 4.0;
    let out = simulate(&trace, &cfg).unwrap();
    assert_eq!(out.met.len() as u64, out.report.requests);
    let met = out.met.iter().filter(|&&m| m).count() as u64;
    assert_eq!(met, out.report.slo_met);
    assert!(met > 0 && met < out.report.requests, "{:?}", out.report);
}

#[test]
fn default_cluster_meets_the_slos_at_speed_one() {
    let trace = load_trace();
    for policy in [
        Policy::CacheGlobal,
        Policy::EarlyReject,
        Policy::PredictiveReject,
    ] {
        let r = run(&trace, policy, 8, 2, 1.0);
        assert!(r.slo_attainment > 0.99, "{policy}: {r:?}");
        assert_eq!(r.wasted_prefills, 0, "{policy}");
        assert!(
            r.prefix_hit_ratio > 0.63 && r.prefix_hit_ratio < 0.6397,
            "{policy}: {r:?}"
        );
    }
    // Every policy completes the trace without rejections it was not asked for.
    for policy in [
        Policy::Random,
        Policy::RoundRobin,
        Policy::LeastLoaded,
        Policy::CacheLocal,
    ] {
        let r = run(&trace, policy, 8, 2, 1.0);
        assert_eq!(r.rejected, 0, "{policy}");
        assert_eq!(r.completed, r.requests, "{policy}");
    }
}

#[test]
fn cache_aware_routing_beats_blind_routing() {
    let trace = load_trace();
    let random = run(&trace, Policy::Random, 8, 2, 1.0);
    let global = run(&trace, Policy::CacheGlobal, 8, 2, 1.0);
    assert!(global.prefix_hit_ratio >= random.prefix_hit_ratio);
    assert!(
        global.ttft_ms_p90 < random.ttft_ms_p90,
        "{global:?} vs {random:?}"
    );
    assert!(global.goodput_rps > random.goodput_rps);
}

fn assert_rejection_cuts_waste(prefill: usize, decode: usize, speed: f64) {
    let trace = load_trace();
    let base = run(&trace, Policy::CacheGlobal, prefill, decode, speed);
    let early = run(&trace, Policy::EarlyReject, prefill, decode, speed);
    let pred = run(&trace, Policy::PredictiveReject, prefill, decode, speed);
    // The SLOs really break without rejection.
    assert!(base.slo_attainment < 0.5, "not overloaded: {base:?}");
    assert!(base.wasted_prefills > 50, "{base:?}");
    assert!(
        early.wasted_prefills < base.wasted_prefills,
        "early_reject {} vs cache_global {}",
        early.wasted_prefills,
        base.wasted_prefills
    );
    assert!(
        pred.wasted_prefills < base.wasted_prefills,
        "predictive_reject {} vs cache_global {}",
        pred.wasted_prefills,
        base.wasted_prefills
    );
    assert!(early.goodput_rps > base.goodput_rps);
    assert!(pred.goodput_rps > base.goodput_rps);
}

#[test]
fn early_rejection_cuts_wasted_prefills_on_the_default_cluster_at_3x() {
    // 8 prefill + 2 decode instances, arrivals 3x faster: prefill-bound.
    assert_rejection_cuts_waste(8, 2, 3.0);
}

#[test]
fn early_rejection_cuts_wasted_prefills_when_decode_is_the_bottleneck() {
    // 16 prefill + 1 decode instances, arrivals 4x faster: decode-bound, the
    // case the rejection policies are for.
    assert_rejection_cuts_waste(16, 1, 4.0);
}

#[test]
fn predictive_rejection_wastes_less_than_early_rejection_when_decode_is_the_bottleneck() {
    let trace = load_trace();
    let early = run(&trace, Policy::EarlyReject, 16, 1, 4.0);
    let pred = run(&trace, Policy::PredictiveReject, 16, 1, 4.0);
    assert!(
        pred.wasted_prefills < early.wasted_prefills,
        "{pred:?} vs {early:?}"
    );
}
