//! A put's protocol as a state machine without I/O (issue 32): what the
//! client asks the master, when it writes, waits, reports a node or reads
//! the key back, and when the put is over. [`crate::Client::put_with`]
//! drives it over sockets and the transfer engine; the cluster simulation
//! (`tools/cluster-sim`) drives the same code over its simulated network,
//! so the rule for each error exists once.
//!
//! ```text
//!   place ──PutStart──▶ Replicas ──write──▶ ok ──PutEnd──▶ Done ─▶ Ok
//!     ▲        │ error                │ error        │ lost answer: again (backoff),
//!     │        ▼                      ▼              │ ObjectAlreadyExists after a
//!     │     decide ◀──(any answer)── PutRevoke       │ resend: read the key back
//!     │        │                                     ▼ other error
//!     │        ├ TryAgain / ReplicaNotReady: sleep 1, 2, 4, 8, 8 .. ms, place again
//!     └────────┼ ObjectNotFound (the master discarded the put): place again
//!              ├ ObjectAlreadyExists after a lost answer: read back; else revoke
//!              │   the earlier placement by its id and place again
//!              ├ anything else: report unreachable nodes; place again if there
//!              │   were any or the error was a timeout / unreachable node
//!              └ past [`MAX_PLACEMENTS`]: the error
//! ```
//!
//! A batch put drives one protocol per item, in rounds ([`batch`]): the
//! items' asks of a round go out grouped by kind and placement id
//! (`BatchPutStart`, `BatchPutEnd`, `BatchPutRevoke`), their writes in one
//! engine batch, and each item is fed its own part of the answers
//! ([`PutProtocol::feed`]), so a batch item is retried, placed again and
//! read back by the same rules.
//!
//! Inputs are the answers (`answered`, `written`, `reported`, `held`), the
//! end of a pause (`woke`) and the time since the put began; the output is
//! the next [`Action`]. The caller's deadline is the driver's: when it
//! passes, or the put ends in a timeout, [`PutProtocol::revoke_after`] names
//! the revoke to send.

use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use kvpool_wire::proto::call::{self, Call};
use kvpool_wire::proto::{ClientId, MasterRequest, MasterResponse, PutOptions, ReplicaDesc};
use kvpool_wire::{ErrorCode, KvError};

use crate::leader::leader_may_have_moved;

pub mod batch;

/// Times one put may be placed again after its node proved unreachable,
/// the master discarded it, or an earlier placement's answer was lost.
pub const MAX_PLACEMENTS: u32 = 3;

/// The longest pause between two tries of a put told to wait (`TryAgain`:
/// another writer's replace of the key is ending, space is on its way):
/// a replace ends within a millisecond or two, and a put that slept past
/// it added that sleep to its latency (a hot key's SETs from two RESP
/// threads: p99 73 ms at 50 ms; issue 28). One small request to the master
/// per waiting put every 8 ms is cheap.
pub const PUT_RETRY_MAX: Duration = Duration::from_millis(8);

/// How many times a put's end is sent again while the master cannot be
/// reached (with backoff up to 200 ms: about 5 s, the longest a failover
/// takes under the default etcd lease; the call's deadline ends it first).
pub const END_TRIES: u32 = 30;

/// The resends of one put's end (single or batch) while the master
/// cannot be reached: at most [`END_TRIES`], pausing 5, 10, 20 .. 200 ms.
#[derive(Debug)]
pub struct EndRetry {
    unanswered: u32,
    pause: Duration,
}

impl Default for EndRetry {
    fn default() -> Self {
        Self {
            unanswered: 0,
            pause: Duration::from_millis(5),
        }
    }
}

impl EndRetry {
    /// The pause before sending the end again after it failed with `e`, or
    /// `None` when `e` is the answer (the master answered, or the tries
    /// are spent).
    pub fn again(&mut self, e: &KvError) -> Option<Duration> {
        if !leader_may_have_moved(e) || self.unanswered >= END_TRIES {
            return None;
        }
        tracing::debug!("a put's end is sent again: {e}");
        self.unanswered += 1;
        let pause = self.pause;
        self.pause = (self.pause * 2).min(Duration::from_millis(200));
        Some(pause)
    }

    /// Whether the end was sent more than once (an answer to an earlier
    /// send may have been lost).
    pub fn resent(&self) -> bool {
        self.unanswered > 0
    }
}

/// Whether a put refused with `e` waits and asks again (within its
/// deadline): `TryAgain` (space on its way out, another writer's replace
/// ending, room only on a node a client reported unreachable) and
/// `ReplicaNotReady` (the key is an object a restarted or new leader
/// recovered, whose segment has not mounted again yet: it is taken back, or
/// dropped, within the master's `client_ttl_ms`).
pub fn waits_to_put(e: &KvError) -> bool {
    matches!(e.code, ErrorCode::TryAgain | ErrorCode::ReplicaNotReady)
}

/// Names each placement of a client's puts (`PutOptions::put_id`): one
/// counter per client, shared by its puts; never 0 (wraps, skipping it).
#[derive(Debug)]
pub struct PutIds(AtomicU16);

impl Default for PutIds {
    fn default() -> Self {
        Self(AtomicU16::new(1))
    }
}

/// Where a put's placements get their ids: a client's [`PutIds`], or
/// [`OneId`] for the placements of one round of a batch put.
pub trait PlaceIds {
    /// The id of a new placement.
    fn next(&self) -> u16;
}

/// One id for every placement made with it: the items of a batch put
/// placed in the same round share their `BatchPutStart`'s id.
#[derive(Debug, Clone, Copy)]
pub struct OneId(pub u16);

impl PlaceIds for OneId {
    fn next(&self) -> u16 {
        self.0
    }
}

impl PlaceIds for PutIds {
    /// A name for a new placement.
    fn next(&self) -> u16 {
        loop {
            let id = self.0.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }
}

/// What the driver does next.
#[derive(Debug)]
pub enum Action {
    /// Send this request to the master; its answer goes to
    /// [`PutProtocol::answered`].
    Ask(MasterRequest),
    /// Write the value to every replica, done within `by` of the put's
    /// start; the result (the checksum of the bytes written, when the
    /// client computes them) goes to [`PutProtocol::written`].
    Write {
        replicas: Vec<ReplicaDesc>,
        by: Duration,
    },
    /// Pause, then [`PutProtocol::woke`].
    Sleep(Duration),
    /// Report to the master the segments the transfers could not reach;
    /// how many goes to [`PutProtocol::reported`].
    ReportUnreachable,
    /// Read the key back: whether it holds exactly this put's value goes
    /// to [`PutProtocol::held`] (false on any error).
    ReadBack,
    /// The put is over.
    Done(Result<(), KvError>),
}

/// What came of an [`Action`] (see [`PutProtocol::feed`]).
#[derive(Debug)]
pub enum Input {
    /// The master's answer to [`Action::Ask`].
    Answer(Result<MasterResponse, KvError>),
    /// The result of [`Action::Write`].
    Written(Result<Option<u64>, KvError>),
    /// [`Action::Sleep`] is over.
    Woke,
    /// [`Action::ReportUnreachable`]: how many segments were reported.
    Reported(usize),
    /// [`Action::ReadBack`]: whether the key holds this put's value.
    Held(bool),
}

#[derive(Debug)]
enum Stage {
    /// `PutStart` sent.
    Starting,
    /// The value is being written.
    Writing,
    /// A write failed (the error): the placement's revoke sent.
    Revoking(KvError),
    /// `PutEnd` sent.
    Ending,
    /// `PutEnd` went unanswered: pausing before sending it again.
    EndPause,
    /// `PutEnd` was refused with `ObjectAlreadyExists` after a resend
    /// (the error): reading the key back.
    CheckingEnd(KvError),
    /// Told to wait: pausing before the next placement.
    Waiting,
    /// The unreachable segments are being reported (the error).
    Reporting(KvError),
    /// `ObjectAlreadyExists` after a lost answer (the error): reading the
    /// key back.
    CheckingExists(KvError),
    /// The earlier placement's revoke sent (the error, if it fails).
    RevokingEarlier(KvError),
    Done,
}

/// One put of one value, from its first placement to its end.
#[derive(Debug)]
pub struct PutProtocol {
    client_id: ClientId,
    key: Vec<u8>,
    len: u64,
    opts: PutOptions,
    /// The call's time, from the put's start.
    budget: Duration,
    stage: Stage,
    /// Placements made again so far.
    placements: u32,
    /// The id of the placement under way (0: none yet), and of the one
    /// before it (whose answer may have been lost).
    put_id: u16,
    before: u16,
    backoff: Duration,
    checksum: Option<u64>,
    /// The resends of this placement's `PutEnd`.
    end: EndRetry,
    /// `revoke_after` named its revoke already.
    revoke_named: bool,
    /// The put ended well (nothing to revoke).
    ended_well: bool,
}

impl PutProtocol {
    /// A put of `len` bytes under `key` with `opts` (`put_id` is set per
    /// placement) that has `budget` from its start.
    pub fn new(
        client_id: ClientId,
        key: Vec<u8>,
        len: u64,
        opts: PutOptions,
        budget: Duration,
    ) -> Self {
        Self {
            client_id,
            key,
            len,
            opts,
            budget,
            stage: Stage::Done,
            placements: 0,
            put_id: 0,
            before: 0,
            backoff: Duration::from_millis(1),
            checksum: None,
            end: EndRetry::default(),
            revoke_named: false,
            ended_well: false,
        }
    }

    /// The first placement: `PutStart`.
    pub fn begin(&mut self, ids: &impl PlaceIds) -> Action {
        self.place(ids)
    }

    /// The id of the placement under way (0: none yet).
    pub fn put_id(&self) -> u16 {
        self.put_id
    }

    /// Whether the put is over.
    pub fn is_done(&self) -> bool {
        matches!(self.stage, Stage::Done)
    }

    /// What came of the last action, as one input (the batch put's driver
    /// hands each item its part of a round this way).
    pub fn feed(&mut self, now: Duration, ids: &impl PlaceIds, input: Input) -> Action {
        match input {
            Input::Answer(res) => self.answered(now, ids, res),
            Input::Written(res) => self.written(res),
            Input::Woke => self.woke(ids),
            Input::Reported(n) => self.reported(ids, n),
            Input::Held(holds) => self.held(ids, holds),
        }
    }

    /// The master's answer to the last [`Action::Ask`].
    pub fn answered(
        &mut self,
        now: Duration,
        ids: &impl PlaceIds,
        res: Result<MasterResponse, KvError>,
    ) -> Action {
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::Starting => match res.and_then(call::PutStart::reply) {
                Ok(replicas) => {
                    self.stage = Stage::Writing;
                    Action::Write {
                        replicas,
                        by: self.write_by(now),
                    }
                }
                Err(e) => self.decide(ids, e),
            },
            // Whatever the revoke's answer: the write's error decides.
            Stage::Revoking(e) => self.decide(ids, e),
            Stage::Ending => match res.and_then(call::PutEnd::reply) {
                Ok(()) => self.succeeded(),
                Err(e) => match self.end.again(&e) {
                    Some(pause) => {
                        self.stage = Stage::EndPause;
                        Action::Sleep(pause)
                    }
                    // The end may have taken effect though its answer was
                    // lost: done if the key holds this value.
                    None if e.code == ErrorCode::ObjectAlreadyExists && self.end.resent() => {
                        self.stage = Stage::CheckingEnd(e);
                        Action::ReadBack
                    }
                    None => self.decide(ids, e),
                },
            },
            Stage::RevokingEarlier(e) => match res.and_then(call::PutRevoke::reply) {
                Ok(()) => {
                    self.placements += 1;
                    tracing::debug!("a put's earlier placement is revoked: {e}");
                    self.place(ids)
                }
                Err(_) => Action::Done(Err(e)),
            },
            other => self.unexpected(other, "an answer"),
        }
    }

    /// The writes of [`Action::Write`] are over: the checksum of the bytes
    /// (when the client computes them), or the first error.
    pub fn written(&mut self, res: Result<Option<u64>, KvError>) -> Action {
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::Writing => match res {
                Ok(checksum) => {
                    self.checksum = checksum;
                    self.stage = Stage::Ending;
                    Action::Ask(self.end())
                }
                Err(e) => {
                    self.stage = Stage::Revoking(e);
                    Action::Ask(self.revoke(self.put_id))
                }
            },
            other => self.unexpected(other, "a write's result"),
        }
    }

    /// The pause of [`Action::Sleep`] is over.
    pub fn woke(&mut self, ids: &impl PlaceIds) -> Action {
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::Waiting => self.place(ids),
            Stage::EndPause => {
                self.stage = Stage::Ending;
                Action::Ask(self.end())
            }
            other => self.unexpected(other, "a wake-up"),
        }
    }

    /// `n` unreachable segments were reported (the report may have gone
    /// with another call's: a write that timed out or found its node gone
    /// is placed again all the same).
    pub fn reported(&mut self, ids: &impl PlaceIds, n: usize) -> Action {
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::Reporting(e) => {
                let unreached = matches!(e.code, ErrorCode::Timeout | ErrorCode::Unavailable);
                if n == 0 && !unreached {
                    return Action::Done(Err(e));
                }
                self.placements += 1;
                tracing::debug!("a put is placed again: {e}");
                self.place(ids)
            }
            other => self.unexpected(other, "a report"),
        }
    }

    /// Whether the key read back holds exactly this put's value.
    pub fn held(&mut self, ids: &impl PlaceIds, holds: bool) -> Action {
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::CheckingEnd(_) | Stage::CheckingExists(_) if holds => self.succeeded(),
            Stage::CheckingEnd(e) => self.decide(ids, e),
            // Or the start of the earlier placement took effect though its
            // answer was lost ("being put" by this client): revoked by its
            // id (it touches no other placement), then placed again.
            Stage::CheckingExists(e) => {
                if self.before != 0 && self.placements < MAX_PLACEMENTS {
                    self.stage = Stage::RevokingEarlier(e);
                    Action::Ask(self.revoke(self.before))
                } else {
                    Action::Done(Err(e))
                }
            }
            other => self.unexpected(other, "a read-back"),
        }
    }

    /// The put is over with `e` (the driver's deadline passing is a
    /// `Timeout`): after a timeout, the revoke that gives a half-done
    /// placement's space back, if one was named (its start or end may have
    /// taken effect though no answer came: whether the deadline cut the put
    /// short or the last placement itself timed out). It names its
    /// placement, so arriving late it touches no later put of the key. Once.
    pub fn revoke_after(&mut self, e: &KvError) -> Option<MasterRequest> {
        self.stage = Stage::Done;
        let due = e.code == ErrorCode::Timeout
            && self.put_id != 0
            && !self.revoke_named
            && !self.ended_well;
        self.revoke_named |= due;
        due.then(|| self.revoke(self.put_id))
    }

    /// The put is done, well.
    fn succeeded(&mut self) -> Action {
        self.ended_well = true;
        Action::Done(Ok(()))
    }

    /// What a placement's error leads to.
    fn decide(&mut self, ids: &impl PlaceIds, e: KvError) -> Action {
        if waits_to_put(&e) {
            // Space is on its way out, another writer's put of the key is
            // ending, or the key is a recovered object whose segment has
            // not mounted again yet: wait for it, bounded by the call's
            // deadline (then it is a Timeout).
            self.stage = Stage::Waiting;
            let pause = self.backoff;
            self.backoff = (self.backoff * 2).min(PUT_RETRY_MAX);
            return Action::Sleep(pause);
        }
        if e.code == ErrorCode::ObjectNotFound {
            // The PutEnd found the put gone: the master discarded it (it
            // ran past put_timeout_ms, or heard nothing from this client
            // for client_ttl_ms and dropped its puts). The bytes are
            // written again, in a new placement.
            if self.placements >= MAX_PLACEMENTS {
                return Action::Done(Err(KvError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the master discarded the put before it ended, {} times: {}",
                        self.placements + 1,
                        e.message
                    ),
                )));
            }
            self.placements += 1;
            tracing::debug!("a put is placed again: {e}");
            return self.place(ids);
        }
        if e.code == ErrorCode::ObjectAlreadyExists && self.placements > 0 && !self.opts.replace {
            // An earlier placement whose end took effect though its answer
            // was lost: done if the key holds these bytes.
            self.stage = Stage::CheckingExists(e);
            return Action::ReadBack;
        }
        if self.placements < MAX_PLACEMENTS {
            // A node that could not be reached: the master hears of it and
            // places the put elsewhere.
            self.stage = Stage::Reporting(e);
            return Action::ReportUnreachable;
        }
        Action::Done(Err(e))
    }

    /// A new placement: a new id, `PutStart`.
    fn place(&mut self, ids: &impl PlaceIds) -> Action {
        self.before = self.put_id;
        self.put_id = ids.next();
        self.stage = Stage::Starting;
        self.end = EndRetry::default();
        let mut opts = self.opts.clone();
        opts.put_id = self.put_id;
        Action::Ask(
            call::PutStart {
                client_id: self.client_id,
                key: self.key.clone(),
                len: self.len,
                opts,
            }
            .into(),
        )
    }

    /// By when a placement's bytes are written: one that is not the last
    /// may use half the time left, so that if a node it was placed on fell
    /// silent the next placement still has time.
    fn write_by(&self, now: Duration) -> Duration {
        if self.placements < MAX_PLACEMENTS {
            now + self.budget.saturating_sub(now) / 2
        } else {
            self.budget
        }
    }

    fn end(&self) -> MasterRequest {
        call::PutEnd {
            client_id: self.client_id,
            key: self.key.clone(),
            put_id: self.put_id,
            checksum: self.checksum,
        }
        .into()
    }

    fn revoke(&self, put_id: u16) -> MasterRequest {
        call::PutRevoke {
            client_id: self.client_id,
            key: self.key.clone(),
            put_id,
        }
        .into()
    }

    /// An input the stage does not wait for: a driver's bug, reported as
    /// the put's error rather than a panic of the caller's process.
    fn unexpected(&mut self, stage: Stage, input: &str) -> Action {
        self.stage = Stage::Done;
        Action::Done(Err(KvError::new(
            ErrorCode::Internal,
            format!("a put got {input} in stage {stage:?}"),
        )))
    }
}

#[cfg(test)]
mod tests;
