//! The fence in front of a master that runs under an election (HA on etcd,
//! `kvpool-ha`): whether this master may answer now, and the term it signs
//! grants with.
//!
//! ```text
//!  role       admits   set by
//!  Single     always   a master without --ha (term 0)
//!  Standby    nothing  start; the election while it campaigns
//!  Leader     until    won the election: term = the etcd revision of its key;
//!             deadline every keepalive the lease's etcd answered moves the
//!                      deadline to (time the keepalive was sent + TTL - margin)
//!  Deposed    nothing  the lease ran out, was lost or could not be renewed
//! ```
//!
//! The deadline is kept on the monotonic clock and read on every request
//! (and again before every answer leaves), so a leader that was stalled
//! (SIGSTOP, a long GC-like pause, a partition from etcd) refuses from the
//! moment its deadline passes, whether or not its election task has run
//! since: it stops answering before etcd can let its lease expire and a
//! standby win. The fence only reads atomics, so every shard checks it.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvpool_wire::{ErrorCode, KvError};

/// What a master is in its election.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FenceRole {
    /// No election (`master.ha` empty): it always answers.
    Single = 0,
    /// Campaigning; another master (or none yet) leads.
    Standby = 1,
    /// Leads under its lease, until the fence's deadline.
    Leader = 2,
    /// Led once and lost the lease (or could not prove it still held it):
    /// refuses everything. Its state may be stale; restart it to stand by
    /// again.
    Deposed = 3,
}

impl FenceRole {
    pub fn name(self) -> &'static str {
        match self {
            FenceRole::Single => "single",
            FenceRole::Standby => "standby",
            FenceRole::Leader => "leader",
            FenceRole::Deposed => "deposed",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => FenceRole::Standby,
            2 => FenceRole::Leader,
            3 => FenceRole::Deposed,
            _ => FenceRole::Single,
        }
    }
}

struct Inner {
    epoch: Instant,
    role: AtomicU8,
    /// Nanoseconds after `epoch` until which a leader answers.
    valid_until_ns: AtomicU64,
    /// The term grants are signed with (shared with every shard's state).
    term: Arc<AtomicU64>,
    /// Who leads, as this master last learnt it (for the refusal's text).
    leader: Mutex<String>,
}

/// Cheap to clone; every clone is the same fence.
#[derive(Clone)]
pub struct Fence {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence")
            .field("role", &self.role())
            .field("term", &self.term())
            .finish()
    }
}

impl Fence {
    fn new(role: FenceRole) -> Self {
        Self {
            inner: Arc::new(Inner {
                epoch: Instant::now(),
                role: AtomicU8::new(role as u8),
                valid_until_ns: AtomicU64::new(0),
                term: Arc::new(AtomicU64::new(0)),
                leader: Mutex::new(String::new()),
            }),
        }
    }

    /// A master without an election: always answers, term 0.
    pub fn single() -> Self {
        Self::new(FenceRole::Single)
    }

    /// A master that campaigns: refuses until it leads.
    pub fn standby() -> Self {
        Self::new(FenceRole::Standby)
    }

    pub fn role(&self) -> FenceRole {
        FenceRole::from_u8(self.inner.role.load(Ordering::Acquire))
    }

    /// The term of this master's leadership (0 before it led, and always
    /// for a single master).
    pub fn term(&self) -> u64 {
        self.inner.term.load(Ordering::Acquire)
    }

    /// The cell the shards read the term from when they sign grants.
    pub fn term_cell(&self) -> Arc<AtomicU64> {
        self.inner.term.clone()
    }

    fn ns(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.inner.epoch).as_nanos() as u64
    }

    /// Won the election with `term`; answers until `valid_until` unless
    /// renewed. The term is set before the role, so no grant of this
    /// leadership carries an older term.
    pub fn lead(&self, term: u64, valid_until: Instant, me: &str) {
        self.inner.term.store(term, Ordering::Release);
        self.inner
            .valid_until_ns
            .store(self.ns(valid_until), Ordering::Release);
        self.set_leader(me);
        self.inner
            .role
            .store(FenceRole::Leader as u8, Ordering::Release);
    }

    /// A keepalive was answered: the lease holds until at least
    /// `valid_until` (already less the margin). Never moves the deadline
    /// back, and does nothing unless this master leads.
    pub fn renew(&self, valid_until: Instant) {
        if self.role() == FenceRole::Leader {
            self.inner
                .valid_until_ns
                .fetch_max(self.ns(valid_until), Ordering::AcqRel);
        }
    }

    /// The lease is gone: refuse everything from now on.
    pub fn depose(&self) {
        self.inner
            .role
            .store(FenceRole::Deposed as u8, Ordering::Release);
    }

    /// Who leads now (as published in etcd), for refusals and /healthz.
    pub fn set_leader(&self, who: &str) {
        let mut l = self.inner.leader.lock().unwrap_or_else(|p| p.into_inner());
        if *l != who {
            *l = who.to_string();
        }
    }

    pub fn leader(&self) -> String {
        self.inner
            .leader
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How long a leader still answers (zero when past its deadline or not
    /// leading).
    pub fn remaining(&self) -> std::time::Duration {
        if self.role() != FenceRole::Leader {
            return std::time::Duration::ZERO;
        }
        let until = self.inner.valid_until_ns.load(Ordering::Acquire);
        let now = self.ns(Instant::now());
        std::time::Duration::from_nanos(until.saturating_sub(now))
    }

    /// `Ok` when this master may answer a request now; otherwise
    /// `NotLeader` naming the leader as this master knows it.
    pub fn admit(&self) -> Result<(), KvError> {
        match self.role() {
            FenceRole::Single => Ok(()),
            FenceRole::Leader => {
                let until = self.inner.valid_until_ns.load(Ordering::Acquire);
                if self.ns(Instant::now()) < until {
                    Ok(())
                } else {
                    Err(self.refusal(
                        "this master's lease could not be renewed in time (it may have run out)",
                    ))
                }
            }
            FenceRole::Standby => Err(self.refusal("this master is a standby")),
            FenceRole::Deposed => Err(self.refusal("this master was deposed (its lease ran out)")),
        }
    }

    fn refusal(&self, why: &str) -> KvError {
        let leader = self.leader();
        let who = if leader.is_empty() {
            "no leader is known yet".to_string()
        } else {
            format!("the leader is at {leader}")
        };
        KvError::new(
            ErrorCode::NotLeader,
            format!("not the leader: {why}; {who}"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_leader_answers_until_its_deadline_and_not_after() {
        let f = Fence::standby();
        let e = f.admit().unwrap_err();
        assert_eq!(e.code, ErrorCode::NotLeader);
        assert!(e.message.contains("standby"), "{e}");
        f.set_leader("127.0.0.1:7070 http 127.0.0.1:7080");
        assert!(f.admit().unwrap_err().message.contains("127.0.0.1:7070"));

        f.lead(42, Instant::now() + Duration::from_secs(60), "me");
        assert!(f.admit().is_ok());
        assert_eq!(f.term(), 42);
        assert_eq!(f.term_cell().load(Ordering::Relaxed), 42);

        // A deadline in the past: refused, though nobody deposed it.
        let g = Fence::standby();
        g.lead(7, Instant::now(), "me");
        let e = g.admit().unwrap_err();
        assert_eq!(e.code, ErrorCode::NotLeader);
        assert!(e.message.contains("lease"), "{e}");
        // A renewal moves it forward again; never back.
        g.renew(Instant::now() + Duration::from_secs(60));
        assert!(g.admit().is_ok());
        g.renew(Instant::now());
        assert!(g.admit().is_ok());

        g.depose();
        assert!(g.admit().unwrap_err().message.contains("deposed"));
        // A renewal after being deposed does not bring it back.
        g.renew(Instant::now() + Duration::from_secs(60));
        assert!(g.admit().is_err());

        assert!(Fence::single().admit().is_ok());
        assert_eq!(Fence::single().term(), 0);
    }
}
