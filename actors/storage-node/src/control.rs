//! A storage node's control lane, without I/O (issue 32): when it mounts
//! its DRAM segment, mounts its NVMe tier and reports every copy there,
//! pings, and mounts again what the master says it does not know (it
//! restarted, or declared the node dead). The `StorageNode` actor
//! ([`crate::node`]) drives it over the client's calls; the cluster
//! simulation (`tools/cluster-sim`) over its simulated network, so these
//! rules exist once.
//!
//! ```text
//!  tick ──▶ MountDram (until the master has it) ─ok─▶ MountTier ─ok─▶ ReportTier ─ok─▶ started
//!       └─▶ Ping (started; first, even while a mount or report is owed)
//!             ─▶ Pong: DRAM unknown ─▶ MountDram ─ok─▶ (tier unknown too) MountTier ...
//!                                 tier unknown ─▶ MountTier ─ok─▶ ReportTier
//!                                 nothing, a report still owed ─▶ MountTier ─ok─▶ ReportTier
//!  a failed or unanswered call: nothing now; the next tick asks again
//! ```
//!
//! The driver sends one call at a time ([`Lane::tick`] answers `None`
//! while one is out) and feeds its outcome back ([`Lane::answered`]), which
//! may name the next call of the same tick.

/// A call the lane asks the driver to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// `MountSegment` of the DRAM segment.
    MountDram,
    /// `MountSegment` of the NVMe tier.
    MountTier,
    /// `NvmeUpdates` naming every copy the tier holds (`Recovered`), its
    /// index flushed first; the driver removes the copies the master
    /// refuses as stale (`crate::round::stale`).
    ReportTier,
    /// `Ping` naming both segments.
    Ping,
}

/// How the call the lane asked for ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Mounted; or the report reached the master (whatever it answered for
    /// each copy).
    Done,
    /// An error, or no answer by the call's deadline: it may or may not
    /// have taken effect, so it is asked again.
    Failed,
    /// The ping's answer: which of the node's segments the master does not
    /// know.
    Pong {
        dram_unknown: bool,
        tier_unknown: bool,
    },
}

/// The lane's state.
#[derive(Debug, Clone)]
pub struct Lane {
    has_tier: bool,
    /// The master may not have the DRAM segment mounted.
    need_dram: bool,
    /// The master may not have the tier mounted, or has not heard every
    /// copy on it.
    need_tier: bool,
    /// Mounted and reported once since the start.
    started: bool,
    /// Unmounted on request: no more calls.
    unmounted: bool,
    /// The call out, if any.
    out: Option<Ask>,
}

impl Lane {
    /// A node that has not mounted anything yet (`has_tier`: it has an NVMe
    /// tier to mount and report).
    pub fn new(has_tier: bool) -> Self {
        Self {
            has_tier,
            need_dram: true,
            need_tier: has_tier,
            started: false,
            unmounted: false,
            out: None,
        }
    }

    /// Whether the node has mounted its segments and reported its tier once
    /// (it runs tier rounds from then on).
    pub fn started(&self) -> bool {
        self.started
    }

    /// Whether the master has not heard every copy on the tier since it
    /// last mounted it (a mount or report failed, or the master forgot it).
    pub fn unreported(&self) -> bool {
        self.need_tier
    }

    /// The call out, if any.
    pub fn out(&self) -> Option<Ask> {
        self.out
    }

    /// The node's segment was unmounted on request: the lane asks nothing
    /// more.
    pub fn unmounted(&mut self) {
        self.unmounted = true;
    }

    /// The timer fired: the call to make now, if any (none while one is
    /// out).
    pub fn tick(&mut self) -> Option<Ask> {
        if self.out.is_some() || self.unmounted {
            return None;
        }
        let ask = if self.started {
            // Once started, a ping goes first, even while a mount or report
            // is owed: it keeps the node alive at the master (and clears
            // what it marked suspect), and its answer says what to mount.
            Ask::Ping
        } else if self.need_dram {
            Ask::MountDram
        } else {
            Ask::MountTier
        };
        self.out = Some(ask);
        Some(ask)
    }

    /// The call out ended with `outcome`: the next call of this tick, if any.
    pub fn answered(&mut self, outcome: Outcome) -> Option<Ask> {
        let ask = self.out.take()?;
        let next = match (ask, outcome) {
            (_, Outcome::Failed) => None,
            (Ask::MountDram, _) => {
                self.need_dram = false;
                self.after_dram()
            }
            (Ask::MountTier, _) => Some(Ask::ReportTier),
            (Ask::ReportTier, _) => {
                self.need_tier = false;
                self.started = true;
                None
            }
            (
                Ask::Ping,
                Outcome::Pong {
                    dram_unknown,
                    tier_unknown,
                },
            ) => {
                self.need_dram |= dram_unknown;
                self.need_tier |= tier_unknown && self.has_tier;
                if self.need_dram {
                    Some(Ask::MountDram)
                } else if self.need_tier {
                    Some(Ask::MountTier)
                } else {
                    None
                }
            }
            (Ask::Ping, Outcome::Done) => None,
        };
        self.out = next;
        next
    }

    /// After the DRAM segment's mount: the tier's, if owed.
    fn after_dram(&mut self) -> Option<Ask> {
        if self.need_tier {
            Some(Ask::MountTier)
        } else {
            self.started = true;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PONG: Outcome = Outcome::Pong {
        dram_unknown: false,
        tier_unknown: false,
    };

    #[test]
    fn a_node_starts_by_mounting_dram_then_its_tier_then_reporting_it() {
        let mut l = Lane::new(true);
        assert_eq!(l.tick(), Some(Ask::MountDram));
        assert_eq!(l.tick(), None, "one call at a time");
        assert_eq!(l.answered(Outcome::Done), Some(Ask::MountTier));
        assert_eq!(l.answered(Outcome::Done), Some(Ask::ReportTier));
        assert!(!l.started());
        assert_eq!(l.answered(Outcome::Done), None);
        assert!(l.started() && !l.unreported());
        assert_eq!(l.tick(), Some(Ask::Ping));
        assert_eq!(l.answered(PONG), None);
        // Without a tier, the DRAM mount is the start.
        let mut d = Lane::new(false);
        assert_eq!(d.tick(), Some(Ask::MountDram));
        assert_eq!(d.answered(Outcome::Done), None);
        assert!(d.started());
    }

    #[test]
    fn a_failed_tier_mount_or_report_is_asked_again_at_the_next_tick() {
        let mut l = Lane::new(true);
        l.tick();
        l.answered(Outcome::Done);
        assert_eq!(l.answered(Outcome::Failed), None, "the tier mount failed");
        assert_eq!(l.tick(), Some(Ask::MountTier), "not started: no ping");
        assert_eq!(l.answered(Outcome::Done), Some(Ask::ReportTier));
        assert_eq!(l.answered(Outcome::Failed), None, "the report failed");
        assert!(!l.started() && l.unreported());
        assert_eq!(l.tick(), Some(Ask::MountTier));
        l.answered(Outcome::Done);
        l.answered(Outcome::Done);
        assert!(l.started() && !l.unreported());
        // Started, a report owed again: a ping first, then the tier.
        l.tick();
        let tier_gone = Outcome::Pong {
            dram_unknown: false,
            tier_unknown: true,
        };
        assert_eq!(l.answered(tier_gone), Some(Ask::MountTier));
        assert_eq!(l.answered(Outcome::Done), Some(Ask::ReportTier));
        assert_eq!(l.answered(Outcome::Failed), None);
        assert_eq!(l.tick(), Some(Ask::Ping));
        assert_eq!(l.answered(PONG), Some(Ask::MountTier));
    }

    #[test]
    fn what_the_master_forgot_is_mounted_again_dram_first() {
        let mut l = Lane::new(true);
        l.tick();
        l.answered(Outcome::Done);
        l.answered(Outcome::Done);
        l.answered(Outcome::Done);
        l.tick();
        let both = Outcome::Pong {
            dram_unknown: true,
            tier_unknown: true,
        };
        assert_eq!(l.answered(both), Some(Ask::MountDram));
        assert_eq!(l.answered(Outcome::Failed), None);
        // Still owed: the next tick pings first (the node stays alive at
        // the master), then mounts DRAM again, then the tier.
        assert_eq!(l.tick(), Some(Ask::Ping));
        assert_eq!(l.answered(Outcome::Failed), None, "the master away");
        assert_eq!(l.tick(), Some(Ask::Ping));
        let dram_gone = Outcome::Pong {
            dram_unknown: true,
            tier_unknown: false,
        };
        assert_eq!(l.answered(dram_gone), Some(Ask::MountDram));
        assert_eq!(l.answered(Outcome::Done), Some(Ask::MountTier));
        assert_eq!(l.answered(Outcome::Done), Some(Ask::ReportTier));
        assert_eq!(l.answered(Outcome::Done), None);
        // A failed ping changes nothing; an unmounted node asks nothing.
        l.tick();
        assert_eq!(l.answered(Outcome::Failed), None);
        l.unmounted();
        assert_eq!(l.tick(), None);
        // A node without a tier never mounts one, whatever the answer says.
        let mut d = Lane::new(false);
        d.tick();
        d.answered(Outcome::Done);
        d.tick();
        assert_eq!(d.answered(both), Some(Ask::MountDram));
        assert_eq!(d.answered(Outcome::Done), None);
    }

    #[test]
    fn an_answer_with_no_call_out_is_ignored() {
        let mut l = Lane::new(true);
        assert_eq!(l.answered(Outcome::Done), None);
        assert_eq!(l.tick(), Some(Ask::MountDram));
    }
}
