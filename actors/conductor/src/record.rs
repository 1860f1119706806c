//! Decision logs: what a scheduler saw and decided, so that the decisions
//! can be made again.
//!
//! The live conductor and the simulator run the same [`Scheduler`], each
//! against its own cluster (real engines, or the cost model's). To check
//! that they really decide alike, both can write a decision log: for every
//! request, the cluster as the scheduler saw it ([`RecordedView`]: each
//! prefill instance's load, the prefix it holds of this request, whether it
//! is up; the pool's prefix; each decode instance's load) and the decision;
//! and every finished request the scheduler learned from. [`replay`] feeds
//! the recorded views, in order, to a fresh scheduler with the logged
//! policy, cost model, SLOs and seed, and compares each decision with the
//! logged one (`kvpool sim replay --log FILE`).
//!
//! The live conductor schedules *on the captured view itself* (it captures
//! the view, then calls the scheduler with it), so what is logged is exactly
//! what was decided on; the simulator does the same when it logs. Decisions
//! are compared exactly, floating-point estimates included (JSON round-trips
//! `f64`).
//!
//! Format: JSON lines, [`LogRecord`] tagged by `kind`: `start` (policy,
//! cost model, SLOs, seed; a log may hold several runs, each from its
//! `start`), `schedule`, `decode_finished`.

use std::io::{self, BufRead, Write};

use serde::{Deserialize, Serialize};

use super::chunk_hash::ChunkHash;
use super::cost::CostModel;
use super::scheduler::{
    ClusterView, Decision, DecodeLoad, Policy, PrefillLoad, RequestView, Scheduler, Slo,
};

/// One prefill instance as the scheduler saw it for one request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecordedPrefill {
    /// Its load.
    #[serde(flatten)]
    pub load: PrefillLoad,
    /// Leading blocks of the request it holds itself.
    pub local_prefix_blocks: usize,
    /// Whether it was up.
    pub available: bool,
}

/// One decode instance as the scheduler saw it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecordedDecode {
    /// Its load.
    #[serde(flatten)]
    pub load: DecodeLoad,
    /// Whether it was up.
    pub available: bool,
}

/// The cluster as a scheduler saw it for one request. As a
/// [`ClusterView`] it answers prefix questions for that request only (it
/// keeps the lengths, not the blocks).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedView {
    /// Per prefill instance.
    pub prefill: Vec<RecordedPrefill>,
    /// Leading blocks of the request in the pool.
    pub global_prefix_blocks: usize,
    /// Per decode instance.
    pub decode: Vec<RecordedDecode>,
}

impl RecordedView {
    /// What `view` answers for a request of `blocks`.
    pub fn capture<V: ClusterView + ?Sized>(view: &V, blocks: &[ChunkHash]) -> Self {
        Self {
            prefill: (0..view.prefill_instances())
                .map(|i| RecordedPrefill {
                    load: view.prefill_load(i),
                    local_prefix_blocks: view.local_prefix_blocks(i, blocks),
                    available: view.prefill_available(i),
                })
                .collect(),
            global_prefix_blocks: view.global_prefix_blocks(blocks),
            decode: (0..view.decode_instances())
                .map(|d| RecordedDecode {
                    load: view.decode_load(d),
                    available: view.decode_available(d),
                })
                .collect(),
        }
    }
}

impl ClusterView for RecordedView {
    fn prefill_instances(&self) -> usize {
        self.prefill.len()
    }
    fn prefill_load(&self, i: usize) -> PrefillLoad {
        self.prefill[i].load
    }
    fn local_prefix_blocks(&self, i: usize, blocks: &[ChunkHash]) -> usize {
        self.prefill[i].local_prefix_blocks.min(blocks.len())
    }
    fn global_prefix_blocks(&self, blocks: &[ChunkHash]) -> usize {
        self.global_prefix_blocks.min(blocks.len())
    }
    fn decode_instances(&self) -> usize {
        self.decode.len()
    }
    fn decode_load(&self, d: usize) -> DecodeLoad {
        self.decode[d].load
    }
    fn prefill_available(&self, i: usize) -> bool {
        self.prefill[i].available
    }
    fn decode_available(&self, d: usize) -> bool {
        self.decode[d].available
    }
}

/// Where a log came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogSource {
    /// The live conductor.
    Live,
    /// `kvpool sim`.
    Sim,
}

/// One line of a decision log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LogRecord {
    /// A scheduler was made: everything its decisions depend on besides
    /// the views.
    Start {
        /// Who logged.
        source: LogSource,
        /// Policy.
        policy: Policy,
        /// Cost model.
        cost: CostModel,
        /// SLOs.
        slo: Slo,
        /// Seed of the `random` policy.
        seed: u64,
    },
    /// One request and its decision.
    Schedule {
        /// The caller's request id.
        id: u64,
        /// The scheduler's clock, ms.
        now_ms: f64,
        /// Prompt tokens.
        input_tokens: u32,
        /// Full chunks of the prompt.
        blocks: usize,
        /// The cluster as seen.
        view: RecordedView,
        /// The decision.
        decision: Decision,
    },
    /// The scheduler learned that a request finished decoding.
    DecodeFinished {
        /// Tokens it generated.
        output_tokens: u32,
    },
}

/// Writes a decision log, one [`LogRecord`] per line. The first write error
/// is kept (and further records dropped) so that logging never fails the
/// caller's work; [`DecisionLog::finish`] reports it.
pub struct DecisionLog<W: Write> {
    out: W,
    error: Option<io::Error>,
    records: u64,
}

impl<W: Write> DecisionLog<W> {
    /// A log writing to `out`.
    pub fn new(out: W) -> Self {
        Self {
            out,
            error: None,
            records: 0,
        }
    }

    /// Writes one record.
    pub fn write(&mut self, record: &LogRecord) {
        if self.error.is_some() {
            return;
        }
        let r = serde_json::to_writer(&mut self.out, record)
            .map_err(io::Error::from)
            .and_then(|()| self.out.write_all(b"\n"));
        match r {
            Ok(()) => self.records += 1,
            Err(e) => self.error = Some(e),
        }
    }

    /// Records written.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Flushes; the first error met, if any.
    pub fn flush(&mut self) -> io::Result<()> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.out.flush()
    }

    /// Flushes and returns the writer, or the first error met.
    pub fn finish(mut self) -> io::Result<W> {
        self.flush()?;
        Ok(self.out)
    }
}

/// A decision the replay made differently.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Mismatch {
    /// 1-based line of the log.
    pub line: usize,
    /// The request id.
    pub id: u64,
    /// What the log says.
    pub logged: Decision,
    /// What the replay decided.
    pub replayed: Decision,
}

/// Result of [`replay`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// `start` records (runs) in the log.
    pub runs: u64,
    /// Decisions replayed.
    pub decisions: u64,
    /// Of those, equal to the logged one.
    pub agreed: u64,
    /// Routed / rejected, as logged.
    pub routed: u64,
    /// See `routed`.
    pub rejected: u64,
    /// The first few decisions that differ (at most [`MAX_MISMATCHES`]).
    pub mismatches: Vec<Mismatch>,
}

/// Most mismatches a [`ReplayReport`] lists.
pub const MAX_MISMATCHES: usize = 10;

/// Errors of reading a log.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Reading failed.
    #[error("cannot read the decision log: {0}")]
    Io(#[from] io::Error),
    /// A line is not a record.
    #[error("decision log line {line}: {source}")]
    Parse {
        /// 1-based line.
        line: usize,
        /// Why.
        source: serde_json::Error,
    },
    /// A record before any `start`.
    #[error("decision log line {line}: a {kind} record before any start record")]
    NoStart {
        /// 1-based line.
        line: usize,
        /// The record's kind.
        kind: &'static str,
    },
}

/// Replays a decision log (see the module docs).
pub fn replay<R: BufRead>(log: R) -> Result<ReplayReport, ReplayError> {
    let mut report = ReplayReport {
        runs: 0,
        decisions: 0,
        agreed: 0,
        routed: 0,
        rejected: 0,
        mismatches: Vec::new(),
    };
    let mut scheduler: Option<Scheduler> = None;
    let mut blocks: Vec<ChunkHash> = Vec::new();
    for (i, line) in log.lines().enumerate() {
        let line_no = i + 1;
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let record: LogRecord =
            serde_json::from_str(&line).map_err(|source| ReplayError::Parse {
                line: line_no,
                source,
            })?;
        match record {
            LogRecord::Start {
                policy,
                cost,
                slo,
                seed,
                ..
            } => {
                report.runs += 1;
                scheduler = Some(Scheduler::new(policy, cost, slo, seed));
            }
            LogRecord::Schedule {
                id,
                now_ms,
                input_tokens,
                blocks: n,
                view,
                decision,
            } => {
                let s = scheduler.as_mut().ok_or(ReplayError::NoStart {
                    line: line_no,
                    kind: "schedule",
                })?;
                // The recorded view answers with lengths; the blocks only
                // need to be as many.
                blocks.clear();
                blocks.extend((0..n as u64).map(ChunkHash));
                let req = RequestView {
                    id,
                    input_tokens,
                    blocks: &blocks,
                };
                let replayed = s.schedule(&req, &view, now_ms);
                report.decisions += 1;
                match decision {
                    Decision::Route { .. } => report.routed += 1,
                    Decision::Reject(_) => report.rejected += 1,
                }
                if replayed == decision {
                    report.agreed += 1;
                } else if report.mismatches.len() < MAX_MISMATCHES {
                    report.mismatches.push(Mismatch {
                        line: line_no,
                        id,
                        logged: decision,
                        replayed,
                    });
                }
            }
            LogRecord::DecodeFinished { output_tokens } => {
                scheduler
                    .as_mut()
                    .ok_or(ReplayError::NoStart {
                        line: line_no,
                        kind: "decode_finished",
                    })?
                    .observe_decode_finished(output_tokens);
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::RejectReason;

    fn view(np: usize, nd: usize) -> RecordedView {
        RecordedView {
            prefill: vec![
                RecordedPrefill {
                    load: PrefillLoad::default(),
                    local_prefix_blocks: 0,
                    available: true,
                };
                np
            ],
            global_prefix_blocks: 0,
            decode: vec![
                RecordedDecode {
                    load: DecodeLoad::default(),
                    available: true,
                };
                nd
            ],
        }
    }

    fn start(policy: Policy) -> LogRecord {
        LogRecord::Start {
            source: LogSource::Sim,
            policy,
            cost: CostModel::default(),
            slo: Slo::default(),
            seed: 3,
        }
    }

    /// Logs decisions made on `views` by a real scheduler, as the actor does.
    fn logged(policy: Policy, views: &[RecordedView]) -> Vec<u8> {
        let mut log = DecisionLog::new(Vec::new());
        log.write(&start(policy));
        let mut s = Scheduler::new(policy, CostModel::default(), Slo::default(), 3);
        let blocks: Vec<ChunkHash> = (0..4).map(ChunkHash).collect();
        for (i, v) in views.iter().enumerate() {
            let req = RequestView {
                id: i as u64,
                input_tokens: 2048,
                blocks: &blocks,
            };
            let decision = s.schedule(&req, v, i as f64 * 0.3);
            log.write(&LogRecord::Schedule {
                id: i as u64,
                now_ms: i as f64 * 0.3,
                input_tokens: 2048,
                blocks: 4,
                view: v.clone(),
                decision,
            });
            s.observe_decode_finished(40 + i as u32);
            log.write(&LogRecord::DecodeFinished {
                output_tokens: 40 + i as u32,
            });
        }
        log.finish().unwrap()
    }

    #[test]
    fn a_log_replays_to_the_same_decisions_and_a_changed_one_is_caught() {
        let mut views = Vec::new();
        for i in 0..20usize {
            let mut v = view(3, 2);
            v.prefill[i % 3].local_prefix_blocks = i % 5;
            v.prefill[(i + 1) % 3].load.busy_until_ms = i as f64 * 7.5;
            v.prefill[2].available = i % 4 != 0;
            v.global_prefix_blocks = i % 4;
            v.decode[i % 2].load.active_seqs = i;
            views.push(v);
        }
        for policy in Policy::ALL {
            let log = logged(policy, &views);
            let r = replay(&log[..]).unwrap();
            assert_eq!((r.runs, r.decisions, r.agreed), (1, 20, 20), "{policy}");
            assert!(r.mismatches.is_empty());
        }
        // Another seed decides `random` differently: the replay says so.
        let log = String::from_utf8(logged(Policy::Random, &views)).unwrap();
        let other = log.replacen("\"seed\":3", "\"seed\":4", 1);
        let r = replay(other.as_bytes()).unwrap();
        assert!(r.agreed < r.decisions, "{r:?}");
        assert!(!r.mismatches.is_empty());
        assert_eq!(r.mismatches[0].line, 2);
    }

    #[test]
    fn bad_logs_are_errors_naming_the_line() {
        let e = replay(&b"{\"kind\":\"decode_finished\",\"output_tokens\":3}\n"[..]).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        let mut log = serde_json::to_string(&start(Policy::CacheGlobal)).unwrap();
        log.push_str("\nnot json\n");
        let e = replay(log.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
    }

    #[test]
    fn a_recorded_view_answers_what_it_captured() {
        let mut v = view(2, 1);
        v.prefill[1].local_prefix_blocks = 3;
        v.prefill[0].available = false;
        v.global_prefix_blocks = 2;
        let blocks: Vec<ChunkHash> = (0..4).map(ChunkHash).collect();
        let again = RecordedView::capture(&v, &blocks);
        assert_eq!(again, v);
        let d = Scheduler::new(Policy::CacheGlobal, CostModel::default(), Slo::default(), 0)
            .schedule(
                &RequestView {
                    id: 0,
                    input_tokens: 2048,
                    blocks: &blocks,
                },
                &v,
                0.0,
            );
        assert!(
            matches!(
                d,
                Decision::Route {
                    prefill: 1,
                    cached_blocks: 3,
                    ..
                }
            ),
            "{d:?}"
        );
        let none = RecordedView {
            decode: vec![],
            ..view(1, 0)
        };
        assert_eq!(
            Scheduler::new(Policy::CacheGlobal, CostModel::default(), Slo::default(), 0).schedule(
                &RequestView {
                    id: 0,
                    input_tokens: 10,
                    blocks: &[]
                },
                &none,
                0.0
            ),
            Decision::Reject(RejectReason::NoInstances)
        );
    }
}
