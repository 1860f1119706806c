//! A bound on an actor's mailbox.
//!
//! ractor's mailboxes are unbounded. A [`MailboxGate`] counts the messages
//! sent through it and not yet handled; past its bound a send fails at once
//! (the caller gets its message's worth of error, nothing waits or grows).
//! The actor calls [`MailboxGate::handled`] once per message it takes.
//! Messages sent straight through the `ActorRef` are not counted, and
//! `handled` saturates at zero, so they cannot make the count wrap.
//!
//! Used by the conductor's [`crate::actor::ConductorHandle`] and by the
//! serving crate's proxy handles.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{ActorRef, RpcReplyPort};

/// Why a send through a [`MailboxGate`] did not happen or got no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GateError {
    /// `bound` messages are already waiting.
    #[error("{bound} messages are already waiting")]
    Full {
        /// The bound.
        bound: usize,
    },
    /// The actor is gone (or dropped the reply).
    #[error("the actor is not running: {0}")]
    NotRunning(String),
    /// No answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Counts messages sent to one actor and not yet handled; see the module
/// docs. Clones share the count.
#[derive(Debug, Clone)]
pub struct MailboxGate {
    count: Arc<AtomicUsize>,
    bound: usize,
}

impl MailboxGate {
    /// A gate admitting at most `bound` outstanding messages (at least 1).
    pub fn new(bound: usize) -> Self {
        Self {
            count: Arc::new(AtomicUsize::new(0)),
            bound: bound.max(1),
        }
    }

    /// The bound.
    pub fn bound(&self) -> usize {
        self.bound
    }

    /// Messages sent through the gate and not yet handled.
    pub fn outstanding(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Counts one message in, or refuses it when `bound` are outstanding.
    pub fn admit(&self) -> Result<(), GateError> {
        self.count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.bound).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| GateError::Full { bound: self.bound })
    }

    /// Takes back an [`admit`](Self::admit) whose message was not sent.
    pub fn release(&self) {
        self.handled();
    }

    /// Called by the actor for every message it takes (saturating).
    pub fn handled(&self) {
        let _ = self
            .count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// Sends `msg` to `actor` through the gate.
    pub fn cast<M: ractor::Message>(&self, actor: &ActorRef<M>, msg: M) -> Result<(), GateError> {
        self.admit()?;
        actor.cast(msg).map_err(|e| {
            self.release();
            GateError::NotRunning(e.to_string())
        })
    }

    /// Sends the message `build` makes and waits at most `timeout` for its
    /// reply.
    pub async fn call<M: ractor::Message, T: Send + 'static>(
        &self,
        actor: &ActorRef<M>,
        build: impl FnOnce(RpcReplyPort<T>) -> M,
        timeout: Duration,
    ) -> Result<T, GateError> {
        self.admit()?;
        match actor.call(build, Some(timeout)).await {
            Ok(CallResult::Success(v)) => Ok(v),
            Ok(CallResult::Timeout) => Err(GateError::Timeout(timeout)),
            Ok(CallResult::SenderError) => {
                Err(GateError::NotRunning("the actor dropped the reply".into()))
            }
            Err(e) => {
                self.release();
                Err(GateError::NotRunning(e.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_counts_refuses_past_its_bound_and_never_wraps() {
        let g = MailboxGate::new(2);
        g.admit().unwrap();
        g.admit().unwrap();
        assert_eq!(g.admit(), Err(GateError::Full { bound: 2 }));
        assert_eq!(g.outstanding(), 2);
        g.handled();
        g.admit().unwrap();
        g.handled();
        g.handled();
        // A message that did not come through the gate.
        g.handled();
        assert_eq!(g.outstanding(), 0);
        assert_eq!(MailboxGate::new(0).bound(), 1);
    }
}
