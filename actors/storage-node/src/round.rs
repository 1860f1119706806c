//! One NVMe round without I/O (issue 32): its order (which master shard's
//! tasks the node asks for next, when it reports, that it evicts at the
//! end: [`Steps`]) and its reports (which copies the master hears of, which
//! become `PersistFailed` after the index flush, and which the node removes
//! once the master answered: [`Round`]). The node ([`crate::nvme_tier`])
//! drives both over its tier's regions; the cluster simulation
//! (`tools/cluster-sim`) drives the same code over its simulated disk, so
//! these rules exist once.
//!
//! ```text
//!  Steps:  Tasks(0) ─reports?─▶ Report(0) ─▶ Tasks(1) ... Tasks(n-1) ─▶ Evict ─▶ end
//!                   └─none────────────────▶┘           a failed call ends the round
//!
//!  Round:  tasks ran ──▶ ran(update, copy, wrote)      (Persist: Stored or PersistFailed,
//!                                                       Promote: Promoted)
//!          index flush ─▶ flushed(ok, stored() checked): gone for a copy not in its
//!                         place, flush or not; failed: the fresh copies are lost too
//!          report ──────▶ updates(); the answers ──▶ refused(results): copies to remove
//! ```
//!
//! When the next round starts is [`Pace`], for the tier's loop and a
//! tier-less node's fetch loop alike (which runs the same [`Steps`]: its
//! `Report` has nothing to flush, its `Evict` nothing to evict).
//!
//! A copy is named by the driver's `C` (the node's slot and write sequence
//! number, so it acts on the copy a report named, never on whatever took
//! its slot since).

use std::future::Future;
use std::ops::Add;
use std::time::{Duration, Instant};

use kvpool_runtime::Shutdown;
use kvpool_wire::proto::NvmeUpdate;
use kvpool_wire::KvError;

/// Tasks a `Tasks` step asks a master shard for at most (`NodeTasks`'s
/// `max`).
pub const TASKS_PER_STEP: u32 = 256;

/// A step of a round: a call (and, for `Report`, the index flush before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Ask master shard `n` for this node's tasks (`NodeTasks`) and run them.
    Tasks(u32),
    /// Flush the index of the copies shard `n`'s tasks wrote, then report
    /// them (`NvmeUpdates`) and remove the copies the master refused.
    Report(u32),
    /// Evict past the tier's watermark: `Evicted` reported first, the
    /// copies removed after.
    Evict,
}

/// Where a round is: the order of its steps.
#[derive(Debug, Clone, Default)]
pub struct Steps {
    shards: u32,
    out: Option<Step>,
}

impl Steps {
    /// The step under way, if any.
    pub fn out(&self) -> Option<Step> {
        self.out
    }

    /// The round timer fired, with `shards` master shards: the first step
    /// of a new round, or `None` while one is under way.
    pub fn tick(&mut self, shards: u32) -> Option<Step> {
        if self.out.is_some() {
            return None;
        }
        self.shards = shards;
        self.out = Some(if shards == 0 {
            Step::Evict
        } else {
            Step::Tasks(0)
        });
        self.out
    }

    /// The step under way ended; `reports`: its tasks have something to
    /// report (only a `Tasks` step reads it). The next step, or `None`: the
    /// round is over.
    pub fn done(&mut self, reports: bool) -> Option<Step> {
        let next = match self.out.take()? {
            Step::Tasks(n) if reports => Some(Step::Report(n)),
            Step::Tasks(n) | Step::Report(n) => Some(if n + 1 < self.shards {
                Step::Tasks(n + 1)
            } else {
                Step::Evict
            }),
            Step::Evict => None,
        };
        self.out = next;
        next
    }

    /// The step under way failed (its call erred or got no answer): the
    /// round ends; the next tick starts another from the first shard.
    pub fn failed(&mut self) {
        self.out = None;
    }
}

/// How often a failing loop logs while its rounds keep failing.
pub const ERROR_LOG_EVERY: Duration = Duration::from_secs(10);

/// The shortest pause after a failed round (the master away, or not
/// knowing the tier until the node mounts it again).
pub const FAILED_PAUSE: Duration = Duration::from_secs(1);

/// When a node's task loop (the tier's, or a tier-less node's fetch loop)
/// runs its next round: at once after a round that ran tasks (more may be
/// waiting), after `poll` after an idle one, after `poll` but at least
/// [`FAILED_PAUSE`] after a failed one. A failure is logged once per
/// [`ERROR_LOG_EVERY`] while rounds keep failing; a round that succeeds
/// ends the streak. In time `T` (an `Instant`, or a simulated clock).
#[derive(Debug, Clone)]
pub struct Pace<T> {
    poll: Duration,
    last_logged: Option<T>,
}

impl<T: Copy + Ord + Add<Duration, Output = T>> Pace<T> {
    /// A loop that polls every `poll` while idle.
    pub fn new(poll: Duration) -> Self {
        Self {
            poll,
            last_logged: None,
        }
    }

    /// A round ended at `now`, having run `ran` tasks (`None`: it failed).
    /// The pause before the next round, and whether to log the failure.
    pub fn after(&mut self, ran: Option<usize>, now: T) -> (Duration, bool) {
        match ran {
            Some(n) => {
                self.last_logged = None;
                (if n > 0 { Duration::ZERO } else { self.poll }, false)
            }
            None => {
                let log = self.last_logged.is_none_or(|t| now >= t + ERROR_LOG_EVERY);
                if log {
                    self.last_logged = Some(now);
                }
                (self.poll.max(FAILED_PAUSE), log)
            }
        }
    }
}

/// Runs `round` until `shutdown`, at the pace of [`Pace`] (the loop
/// itself, this module's one async part); `what` names a failed round in
/// the log.
pub async fn run_rounds<F, Fut>(poll: Duration, shutdown: Shutdown, what: &str, mut round: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<usize, KvError>>,
{
    let mut pace = Pace::new(poll);
    loop {
        let ran = round().await;
        let (wait, log) = pace.after(ran.as_ref().ok().copied(), Instant::now());
        if let (Err(e), true) = (&ran, log) {
            tracing::warn!("{what} round failed: {e}");
        }
        if wait > Duration::ZERO {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.wait() => break,
            }
        } else if shutdown.is_triggered() {
            break;
        }
    }
}

/// The reports of one round's tasks and the copies they name.
#[derive(Debug, Clone)]
pub struct Round<C> {
    updates: Vec<NvmeUpdate>,
    /// The copy each update names (a Stored report's), if any.
    written: Vec<Option<C>>,
    /// The copies this round wrote (not found already there).
    fresh: Vec<C>,
}

impl<C> Default for Round<C> {
    fn default() -> Self {
        Self {
            updates: Vec::new(),
            written: Vec::new(),
            fresh: Vec::new(),
        }
    }
}

impl<C: Copy + PartialEq> Round<C> {
    /// A task ran: its report, the copy the report names, and whether the
    /// task wrote that copy (rather than finding it there).
    pub fn ran(&mut self, update: NvmeUpdate, copy: Option<C>, wrote: bool) {
        self.updates.push(update);
        self.written.push(copy);
        if wrote {
            self.fresh.extend(copy);
        }
    }

    /// Whether no task has anything to report.
    pub fn is_empty(&self) -> bool {
        self.updates.is_empty()
    }

    /// Every copy a report names (the index flush covers them all: a copy
    /// found already there may be one whose record an earlier, failed flush
    /// left behind).
    pub fn copies(&self) -> impl Iterator<Item = &C> {
        self.written.iter().flatten()
    }

    /// The `Stored` reports whose copy `pick` selects, to check after the
    /// flush that each is still in its place: (report, key, copy).
    pub fn stored(&self, pick: impl Fn(&C) -> bool) -> Vec<(usize, Vec<u8>, C)> {
        self.updates
            .iter()
            .zip(&self.written)
            .enumerate()
            .filter_map(|(i, (u, w))| match (u, w) {
                (NvmeUpdate::Stored { key, .. }, Some(c)) if pick(c) => Some((i, key.clone(), *c)),
                _ => None,
            })
            .collect()
    }

    /// Report `i`'s copy is not in its place after the flush (a later task
    /// evicted it, or replaced the key's copy in the same slot): the master
    /// must not hear of it as stored.
    pub fn gone(&mut self, i: usize) {
        persist_failed(&mut self.updates[i]);
        self.written[i] = None;
    }

    /// The index flush of the copies `pick` selects failed: the copies this
    /// round wrote there are lost (after a crash their records would not
    /// be there); their reports become `PersistFailed`. Returns them, for
    /// the driver to remove.
    pub fn flush_failed(&mut self, pick: impl Fn(&C) -> bool) -> Vec<C> {
        let mut lost: Vec<C> = Vec::new();
        for c in self.fresh.iter().filter(|c| pick(c)) {
            if !lost.contains(c) {
                lost.push(*c);
            }
        }
        for (u, w) in self.updates.iter_mut().zip(self.written.iter_mut()) {
            if w.is_some_and(|c| lost.contains(&c)) {
                persist_failed(u);
                *w = None;
            }
        }
        lost
    }

    /// The index flush of the copies `pick` selects ended (`ok`: it
    /// succeeded), and `present[j]` says whether the copy of `checked[j]`
    /// (from [`Round::stored`], taken before) was still in its place after
    /// it. A copy not in its place is not reported stored, whether the
    /// flush succeeded or not: a found copy that a later task's eviction
    /// took is gone all the same when the flush fails (it is not one of
    /// the fresh copies a failed flush loses). Returns the copies the
    /// driver removes: the fresh ones, when the flush failed.
    pub fn flushed(
        &mut self,
        pick: impl Fn(&C) -> bool,
        ok: bool,
        checked: &[(usize, Vec<u8>, C)],
        present: &[bool],
    ) -> Vec<C> {
        for ((i, _, _), here) in checked.iter().zip(present) {
            if !here {
                self.gone(*i);
            }
        }
        if ok {
            Vec::new()
        } else {
            self.flush_failed(pick)
        }
    }

    /// The reports to send (in task order).
    pub fn take_updates(&mut self) -> Vec<NvmeUpdate> {
        std::mem::take(&mut self.updates)
    }

    /// The copies to remove once the master answered the reports (one
    /// result each, in order): those named by a report it refused (it does
    /// not want them) and by no report it took (two Persist tasks of one
    /// object's bytes name one copy: a refusal of the first must not remove
    /// the copy the master took for the second).
    pub fn refused(&self, results: &[Result<(), KvError>]) -> Vec<C> {
        let taken: Vec<C> = self
            .written
            .iter()
            .zip(results)
            .filter_map(|(w, r)| w.filter(|_| r.is_ok()))
            .collect();
        let mut out: Vec<C> = Vec::new();
        for (w, r) in self.written.iter().zip(results) {
            if let Some(c) = w {
                if r.is_err() && !taken.contains(c) && !out.contains(c) {
                    out.push(*c);
                }
            }
        }
        out
    }
}

/// Whether the master's refusal of a `Recovered` copy (a report of the
/// whole tier) means the copy is stale and the node removes it: another
/// object lives under the key, or no object lists it
/// (`ObjectAlreadyExists`). Any other refusal keeps it (`TryAgain`: its
/// own `Stored` report is on the way; a full pool, a master restarting).
pub fn stale(e: &KvError) -> bool {
    e.code == kvpool_wire::ErrorCode::ObjectAlreadyExists
}

/// Turns a `Stored` report into `PersistFailed` (the copy is not to be
/// listed; the master ends a demotion without it).
pub fn persist_failed(u: &mut NvmeUpdate) {
    if let NvmeUpdate::Stored {
        key,
        dram,
        offset,
        demote,
        ..
    } = u
    {
        *u = NvmeUpdate::PersistFailed {
            key: std::mem::take(key),
            dram: *dram,
            offset: *offset,
            demote: *demote,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_wire::ErrorCode;

    fn stored(key: &str, loc: u64) -> NvmeUpdate {
        NvmeUpdate::Stored {
            key: key.as_bytes().to_vec(),
            nvme: 1,
            loc,
            len: 4,
            dram: 2,
            offset: 0,
            demote: true,
            sum: 9,
            version: 0,
        }
    }

    fn failed(u: &NvmeUpdate) -> bool {
        matches!(u, NvmeUpdate::PersistFailed { demote: true, .. })
    }

    fn no() -> Result<(), KvError> {
        Err(KvError::new(ErrorCode::ObjectNotFound, "gone"))
    }

    #[test]
    fn a_round_asks_every_shard_in_turn_reports_only_what_ran_and_evicts_last() {
        let mut s = Steps::default();
        assert_eq!(s.tick(2), Some(Step::Tasks(0)));
        assert_eq!(s.tick(2), None, "one round at a time");
        assert_eq!(s.done(true), Some(Step::Report(0)));
        assert_eq!(s.done(false), Some(Step::Tasks(1)));
        assert_eq!(s.done(false), Some(Step::Evict), "nothing to report");
        assert_eq!(s.done(false), None);
        assert_eq!(s.out(), None);
        // A failed step ends the round; the next starts from shard 0.
        s.tick(3);
        s.done(false);
        s.failed();
        assert_eq!(s.out(), None);
        assert_eq!(s.tick(3), Some(Step::Tasks(0)));
        // No shard known: eviction only.
        let mut none = Steps::default();
        assert_eq!(none.tick(0), Some(Step::Evict));
    }

    #[test]
    fn a_refused_report_removes_its_copy_unless_another_report_the_master_took_names_it() {
        let mut r: Round<(u64, u64)> = Round::default();
        r.ran(stored("a", 1), Some((1, 7)), true);
        r.ran(stored("b", 1), Some((1, 7)), false); // the same bytes, one copy
        r.ran(stored("c", 2), Some((2, 8)), true);
        r.ran(stored("d", 2), Some((2, 8)), false);
        assert_eq!(r.refused(&[no(), Ok(()), no(), no()]), vec![(2, 8)]);
    }

    #[test]
    fn a_failed_flush_loses_the_fresh_copies_it_covers_and_their_reports() {
        let mut r: Round<(u64, u64)> = Round::default();
        r.ran(stored("a", 1), Some((1, 1)), true);
        r.ran(stored("b", 2), Some((2, 1)), false); // found there: not lost
        r.ran(stored("c", 3), Some((3, 1)), true); // another region
        assert_eq!(r.flush_failed(|c| c.0 < 3), vec![(1, 1)]);
        let u = r.take_updates();
        assert!(failed(&u[0]) && !failed(&u[1]) && !failed(&u[2]), "{u:?}");
        // A lost copy is no longer named, so a refusal removes nothing more.
        assert_eq!(r.refused(&[no(), Ok(()), Ok(())]), vec![]);
    }

    #[test]
    fn a_copy_gone_after_the_flush_is_reported_failed_and_never_removed() {
        let mut r: Round<(u64, u64)> = Round::default();
        r.ran(stored("a", 1), Some((1, 1)), true);
        r.ran(stored("b", 2), Some((2, 1)), true);
        let check = r.stored(|_| true);
        assert_eq!(check.len(), 2);
        assert_eq!((check[1].0, check[1].1.as_slice()), (1, &b"b"[..]));
        r.gone(0);
        assert_eq!(r.refused(&[no(), no()]), vec![(2, 1)]);
        assert!(failed(&r.take_updates()[0]));
    }

    /// Cluster simulation seed 6757 (unsummed): a copy found there, which a
    /// later task's eviction took, is not reported stored when the flush
    /// fails either (it is not one of the fresh copies the failure loses).
    #[test]
    fn a_found_copy_gone_before_a_failed_flush_is_not_reported_stored() {
        let mut r: Round<(u64, u64)> = Round::default();
        r.ran(stored("found", 1), Some((1, 1)), false);
        r.ran(stored("fresh", 2), Some((2, 1)), true);
        r.ran(stored("kept", 3), Some((3, 1)), false);
        let check = r.stored(|_| true);
        let lost = r.flushed(|_| true, false, &check, &[false, true, true]);
        assert_eq!(lost, vec![(2, 1)], "the fresh copy, lost with the flush");
        let u = r.take_updates();
        assert!(failed(&u[0]) && failed(&u[1]) && !failed(&u[2]), "{u:?}");
        // A flush that succeeded: only the copy not in its place.
        let mut r: Round<(u64, u64)> = Round::default();
        r.ran(stored("found", 1), Some((1, 1)), false);
        r.ran(stored("fresh", 2), Some((2, 1)), true);
        let check = r.stored(|_| true);
        assert_eq!(r.flushed(|_| true, true, &check, &[false, true]), vec![]);
        let u = r.take_updates();
        assert!(failed(&u[0]) && !failed(&u[1]), "{u:?}");
    }

    #[test]
    fn a_busy_loop_goes_on_at_once_a_failing_one_pauses_and_logs_once_per_streak_interval() {
        let ms = Duration::from_millis;
        let mut p = Pace::new(ms(100));
        assert_eq!(p.after(Some(3), ms(0)), (Duration::ZERO, false));
        assert_eq!(p.after(Some(0), ms(0)), (ms(100), false));
        assert_eq!(p.after(None, ms(0)), (FAILED_PAUSE, true));
        assert_eq!(p.after(None, ms(9_999)), (FAILED_PAUSE, false));
        assert_eq!(p.after(None, ms(10_000)), (FAILED_PAUSE, true));
        // A success ends the streak: the next failure is logged at once.
        p.after(Some(0), ms(10_001));
        assert!(p.after(None, ms(10_002)).1);
        // A poll longer than the failed pause is kept.
        assert_eq!(Pace::new(ms(2_000)).after(None, ms(0)).0, ms(2_000));
    }
}
