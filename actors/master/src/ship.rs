//! Log shipping (HA on etcd, docs/architecture/ha.md "Log shipping"): the
//! leader's shards send their state-log records to the standbys, and a
//! standby that wins the election loads them before it leads.
//!
//! ```text
//!  standby shard i                          leader shard i (its own port)
//!   AuthBegin / AuthProve (cluster secret)  ->
//!   Follow { session 0, acked 0 }           ->  new session: a snapshot of the
//!                                           <-  shard, in steps, then its log
//!   Shipped { session, start, records }         (whole records, <= SHIP_BYTES)
//!   check every frame, then apply to the
//!   standby image; Follow { acked += n }    ->  trims; once the snapshot is
//!                                               whole in the stream the session
//!                                               is in sync: replies wait for
//!                                               its acks (a drop of it is
//!                                               recorded in etcd first)
//! ```
//!
//! The stream of a session is one ordered byte sequence: the snapshot's
//! records and the live records the shard commits meanwhile, interleaved in
//! the order they were made. Records are full states of a key, so the
//! stream applied in order ends in the leader's state. After the snapshot,
//! the stream is the live log alone, so an ack at stream offset `a >= s`
//! (the snapshot ended at stream offset `s`, live offset `l`) confirms the
//! live log up to `l + (a - s)`.

use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use kvpool_wire::{ErrorCode, KvError};

use crate::journal::{next_frame, Frame, Image, Record, FRAME_HEADER};
use crate::state::SnapshotCursor;

/// Most standbys that follow one leader shard at once.
pub const MAX_FOLLOWERS: usize = 8;
/// Bytes a session may have unacknowledged (its live records, and the
/// snapshot's steps); a standby that falls further behind is dropped and
/// starts again from a snapshot.
pub const FOLLOWER_BUFFER_BYTES: usize = 64 << 20;
/// The snapshot's next step is made only while less than this is waiting.
pub const SNAPSHOT_LOW_WATER: usize = 1 << 20;
/// Objects one step of a snapshot shipped to a standby covers (compaction's
/// own snapshot steps by 4096: `service::COMPACT_STEP_OBJECTS`).
pub const SHIP_STEP_OBJECTS: usize = 1024;
/// Most bytes of records one `Shipped` carries (at least one record).
pub const SHIP_BYTES: usize = 1 << 20;
/// How long the leader holds a `Follow` that finds nothing to send.
pub const POLL_WAIT: Duration = Duration::from_millis(200);

/// One standby's session on a leader shard.
#[derive(Debug)]
struct Follower {
    session: u64,
    /// Stream bytes from `base` (the standby's last ack) on.
    buf: Vec<u8>,
    base: u64,
    /// The snapshot still being made; `None` once it is in the stream.
    snapshot: Option<SnapshotCursor>,
    /// (stream offset, live offset) where the snapshot ended.
    snap_end: Option<(u64, u64)>,
    last_poll: Instant,
    /// When the standby last confirmed new bytes, or had nothing left to
    /// confirm: a session that polls but stops moving is dropped as one
    /// that stops polling is.
    last_progress: Instant,
}

impl Follower {
    fn end(&self) -> u64 {
        self.base + self.buf.len() as u64
    }

    /// Whether replies wait for this session: from the moment its snapshot
    /// is whole in its stream. (Not from its ack: the standby calls itself
    /// in sync once it has applied the snapshot, so every reply made after
    /// that must have waited for it.)
    fn counted(&self) -> bool {
        self.snap_end.is_some()
    }

    /// Whether this session has confirmed the live log up to `live` (a
    /// session not counted holds nothing).
    fn confirms(&self, live: u64) -> bool {
        match self.snap_end {
            None => true,
            Some((s, l)) => self.base >= s && l + (self.base - s) >= live,
        }
    }
}

/// A leader shard's side: its sessions, and the live log's offset.
#[derive(Debug, Default)]
pub struct Shipping {
    followers: Vec<Follower>,
    /// Bytes of live records committed since the shard started.
    live: u64,
    /// Counted sessions dropped whose drop is not yet recorded in etcd
    /// (their standby would call itself in sync), and those being
    /// recorded: no reply goes out meanwhile ([`Self::confirmed`]).
    unrecorded: Vec<u64>,
    recording: Vec<u64>,
}

/// What one poll of a session gets: the bytes to send (`records`, from
/// stream offset `start`), and whether the snapshot is in them.
#[derive(Debug)]
pub struct Batch {
    pub start: u64,
    pub records: Vec<u8>,
    pub synced: bool,
}

impl Shipping {
    /// The live log's offset (what a reply made now waits for).
    pub fn live(&self) -> u64 {
        self.live
    }

    /// Standbys with a session.
    pub fn followers(&self) -> usize {
        self.followers.len()
    }

    /// Standbys in sync (the replies wait for them).
    pub fn in_sync(&self) -> usize {
        self.followers.iter().filter(|f| f.counted()).count()
    }

    /// Notes a dropped session: one that was counted must be recorded as
    /// dropped before replies go out without it.
    fn note_drop(unrecorded: &mut Vec<u64>, f: &Follower) {
        if f.counted() {
            unrecorded.push(f.session);
        }
    }

    /// Takes the dropped sessions to record now (they stay unconfirmed
    /// until [`Self::recorded`]).
    pub fn begin_recording(&mut self) -> Vec<u64> {
        let new = std::mem::take(&mut self.unrecorded);
        self.recording.extend_from_slice(&new);
        new
    }

    /// The drops of `sessions` are recorded: replies may go out without
    /// them.
    pub fn recorded(&mut self, sessions: &[u64]) {
        self.recording.retain(|s| !sessions.contains(s));
    }

    /// Whether dropped sessions wait to be recorded.
    pub fn drops_unrecorded(&self) -> bool {
        !self.unrecorded.is_empty() || !self.recording.is_empty()
    }

    /// Appends committed records to every session; drops (and names) the
    /// sessions that would go past their buffer.
    pub fn append_live(&mut self, frames: &[u8]) -> Vec<u64> {
        if frames.is_empty() {
            return Vec::new();
        }
        self.live += frames.len() as u64;
        let mut dropped = Vec::new();
        let unrecorded = &mut self.unrecorded;
        self.followers.retain_mut(|f| {
            if f.buf.len() + frames.len() > FOLLOWER_BUFFER_BYTES {
                dropped.push(f.session);
                Self::note_drop(unrecorded, f);
                return false;
            }
            f.buf.extend_from_slice(frames);
            true
        });
        dropped
    }

    /// Starts a session; its id.
    pub fn open(&mut self, now: Instant) -> Result<u64, KvError> {
        if self.followers.len() >= MAX_FOLLOWERS {
            return Err(KvError::new(
                ErrorCode::ResourceExhausted,
                format!("this leader shard already ships to {MAX_FOLLOWERS} standbys"),
            ));
        }
        let session = loop {
            let s: u64 = rand::random();
            if s != 0 && self.followers.iter().all(|f| f.session != s) {
                break s;
            }
        };
        self.followers.push(Follower {
            session,
            buf: Vec::new(),
            base: 0,
            snapshot: Some(SnapshotCursor::default()),
            snap_end: None,
            last_poll: now,
            last_progress: now,
        });
        Ok(session)
    }

    fn find(&mut self, session: u64) -> Result<&mut Follower, KvError> {
        self.followers
            .iter_mut()
            .find(|f| f.session == session)
            .ok_or_else(|| {
                KvError::new(
                    ErrorCode::ObjectNotFound,
                    format!(
                        "no shipping session {session:x} here (dropped, or another leader): \
                         start a new one"
                    ),
                )
            })
    }

    /// The standby applied the stream up to `acked`: the bytes before it
    /// go. An ack outside what was sent ends the session.
    pub fn ack(&mut self, session: u64, acked: u64, now: Instant) -> Result<(), KvError> {
        let f = self.find(session)?;
        if acked < f.base || acked > f.end() {
            let why = format!(
                "ack {acked} outside the session's unacknowledged stream {}..{}",
                f.base,
                f.end()
            );
            self.drop_session(session);
            return Err(KvError::new(ErrorCode::InvalidParams, why));
        }
        let f = self.find(session)?;
        if acked > f.base || acked == f.end() {
            f.last_progress = now;
        }
        f.buf.drain(..(acked - f.base) as usize);
        f.base = acked;
        f.last_poll = now;
        Ok(())
    }

    /// Whether session `session` wants its snapshot's next step now (its
    /// cursor, to be given back with [`Self::snapshot_step_done`]).
    pub fn snapshot_due(&mut self, session: u64) -> Option<SnapshotCursor> {
        let f = self.find(session).ok()?;
        if f.buf.len() >= SNAPSHOT_LOW_WATER {
            return None;
        }
        f.snapshot
    }

    /// Appends a snapshot step's records; `done`: the snapshot is whole.
    pub fn snapshot_step_done(
        &mut self,
        session: u64,
        cur: SnapshotCursor,
        frames: &[u8],
        done: bool,
    ) {
        let live = self.live;
        let Ok(f) = self.find(session) else { return };
        f.buf.extend_from_slice(frames);
        if done {
            f.snapshot = None;
            f.snap_end = Some((f.end(), live));
        } else {
            f.snapshot = Some(cur);
        }
    }

    /// The next bytes of session `session` (whole records, at most
    /// [`SHIP_BYTES`] unless one record is larger); empty when nothing waits.
    pub fn next(&mut self, session: u64) -> Result<Batch, KvError> {
        let f = self.find(session)?;
        let mut at = 0usize;
        while at + FRAME_HEADER <= f.buf.len() {
            let len = u32::from_le_bytes(f.buf[at..at + 4].try_into().expect("4")) as usize;
            let next = at + FRAME_HEADER + len;
            if at > 0 && next > SHIP_BYTES {
                break;
            }
            at = next;
        }
        let synced = f.snap_end.is_some_and(|(s, _)| f.base + at as u64 >= s);
        Ok(Batch {
            start: f.base,
            records: f.buf[..at].to_vec(),
            synced,
        })
    }

    /// Whether every session in sync has confirmed the live log up to
    /// `live`, and no dropped one waits to be recorded.
    pub fn confirmed(&self, live: u64) -> bool {
        !self.drops_unrecorded() && self.followers.iter().all(|f| f.confirms(live))
    }

    /// Drops the sessions in sync that have not confirmed `live` (a reply
    /// waited its deadline for them); their ids.
    pub fn drop_lagging(&mut self, live: u64) -> Vec<u64> {
        let mut dropped = Vec::new();
        let unrecorded = &mut self.unrecorded;
        self.followers.retain(|f| {
            if f.confirms(live) {
                return true;
            }
            dropped.push(f.session);
            Self::note_drop(unrecorded, f);
            false
        });
        dropped
    }

    /// Drops the sessions not polled since `before`, and those that poll
    /// but have confirmed nothing since `before` while bytes wait for them
    /// (a standby stuck mid-snapshot would otherwise hold its buffer, up to
    /// [`FOLLOWER_BUFFER_BYTES`], and a session slot for good); their ids.
    pub fn drop_silent(&mut self, before: Instant) -> Vec<u64> {
        let mut dropped = Vec::new();
        let unrecorded = &mut self.unrecorded;
        self.followers.retain(|f| {
            let stuck = !f.buf.is_empty() && f.last_progress < before;
            if f.last_poll < before || stuck {
                dropped.push(f.session);
                Self::note_drop(unrecorded, f);
                false
            } else {
                true
            }
        });
        dropped
    }

    pub fn drop_session(&mut self, session: u64) {
        let unrecorded = &mut self.unrecorded;
        self.followers.retain(|f| {
            if f.session != session {
                return true;
            }
            Self::note_drop(unrecorded, f);
            false
        });
    }
}

/// Checks every frame of `bytes` (shipped records: untrusted) and decodes
/// them; each key must belong to master shard `shard` (`shard_of`: the
/// cluster's key -> shard map). Nothing is applied unless all of it is
/// valid.
pub fn decode_records(
    bytes: &[u8],
    shard: u32,
    shard_of: impl Fn(&[u8]) -> u32,
) -> Result<Vec<Record>, String> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let (payload, end) = match next_frame(&bytes[at..]) {
            Frame::Whole { payload, end } => (payload, end),
            f => return Err(format!("{} at byte {at}", f.why())),
        };
        let rec = Record::decode(payload).map_err(|e| format!("the record at byte {at}: {e}"))?;
        let key = match &rec {
            Record::Object { key, .. }
            | Record::Gone { key }
            | Record::DropOwed { key, .. }
            | Record::DropDone { key, .. } => Some(key),
            Record::Hold(_)
            | Record::TierListed { .. }
            | Record::Epoch { .. }
            | Record::Segment { .. } => None,
        };
        if let Some(k) = key {
            let owner = shard_of(k);
            if owner != shard {
                return Err(format!(
                    "the record at byte {at} names a key of master shard {owner}, not {shard}"
                ));
            }
        }
        out.push(rec);
        at += end;
    }
    Ok(out)
}

/// A standby shard's copy of the leader's shard, as shipped.
#[derive(Debug, Default)]
pub struct Standby {
    pub image: Image,
    /// The session the image is from (0: none yet; the image is what this
    /// master's own state directory held at start).
    pub session: u64,
    /// Stream bytes applied in this session.
    pub acked: u64,
    /// The session's snapshot is wholly in the image, and the leader has
    /// not refused the session since: its replies wait for this standby.
    pub synced: bool,
    /// The term of the leader the session is with.
    pub term: u64,
    /// This master leads now: nothing more is applied.
    pub stopped: bool,
    /// Holds in the image after the last trim (holds that ended are
    /// trimmed once there are twice as many).
    holds_after_trim: usize,
}

impl Standby {
    /// Applies one answer of the leader (already checked to belong to the
    /// session asked for and to start at `acked`). A new session starts
    /// from an empty image.
    pub fn apply(
        &mut self,
        session: u64,
        term: u64,
        records: Vec<Record>,
        bytes: u64,
        synced: bool,
    ) {
        if session != self.session {
            self.image = Image::default();
            self.session = session;
            self.term = term;
            self.acked = 0;
            self.synced = false;
            self.holds_after_trim = 0;
        }
        for r in records {
            self.image.apply(r);
        }
        self.acked += bytes;
        self.synced |= synced;
        if self.image.holds.len() > 2 * self.holds_after_trim.max(1024) {
            self.image.drop_holds_before(kvpool_wire::auth::unix_ms());
            self.holds_after_trim = self.image.holds.len();
        }
    }
}

/// Whether a leader's error answer to `Follow` ends the standby's session:
/// the leader does not have it (it dropped it, or it is another leader, or
/// a restarted one) or refused its ack. A refusal at the fence (`NotLeader`:
/// the leader's lease is in doubt), of the request (`Unsupported`), or a
/// leader shutting down (`Unavailable`) does not: such a leader answers
/// nothing from then on, so its replies stopped waiting for no standby, and
/// the copy is as in sync as it was. (Ending the session there made every
/// standby of a leader cut off from etcd unfit to lead.)
pub fn ends_session(e: &KvError) -> bool {
    matches!(e.code, ErrorCode::ObjectNotFound | ErrorCode::InvalidParams)
}

impl Standby {
    /// The leader refused the session (it dropped this standby, or it is
    /// another leader now): the next `Follow` asks for a new one. The image
    /// is kept until that one's first answer, but it is in sync no more:
    /// the leader's replies stopped waiting for it.
    pub fn lose_session(&mut self) {
        self.session = 0;
        self.synced = false;
    }

    /// The term and session this copy is in sync at, if it is (what lets a
    /// standby stand for election: docs/architecture/ha.md, "Who may lead").
    pub fn synced_at(&self) -> Option<(u64, u64)> {
        (self.synced && !self.stopped && self.session != 0).then_some((self.term, self.session))
    }
}

/// The leader's shard `shard` address, from what the leader published
/// (`rpc=HOST:PORT ...`): its base port plus the shard.
pub fn leader_shard_addr(published: &str, shard: u32) -> Option<std::net::SocketAddr> {
    let rpc = published
        .split_whitespace()
        .find_map(|p| p.strip_prefix("rpc="))?;
    let (host, port) = rpc.rsplit_once(':')?;
    let port = port.parse::<u16>().ok()?.checked_add(shard as u16)?;
    (host, port).to_socket_addrs().ok()?.next()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::ObjectRec;
    use kvpool_runtime::hash::ShardMap;

    fn rec(key: &[u8], n: u64) -> Vec<u8> {
        let mut b = Vec::new();
        Record::Object {
            key: key.to_vec(),
            obj: ObjectRec {
                size: n,
                sum: None,
                hard_pin: false,
                version: 0,
                replicas: vec![(1, 0)],
            },
        }
        .encode(&mut b);
        b
    }

    #[test]
    fn a_session_is_in_sync_once_its_snapshot_is_acked_and_then_holds_replies() {
        let now = Instant::now();
        let mut s = Shipping::default();
        let a = s.open(now).unwrap();
        let live1 = rec(b"k1", 1);
        assert!(s.append_live(&live1).is_empty());
        // Not in sync yet: nothing waits for it.
        assert!(s.confirmed(s.live()));
        let cur = s.snapshot_due(a).expect("a snapshot step is due");
        let snap = rec(b"k0", 5);
        s.snapshot_step_done(a, cur, &snap, true);
        assert!(s.snapshot_due(a).is_none());
        let b = s.next(a).unwrap();
        assert_eq!(b.start, 0);
        assert_eq!(b.records.len(), live1.len() + snap.len());
        assert!(b.synced);
        // In sync from the moment its snapshot is whole in its stream (the
        // standby calls itself in sync once it applied it): a reply waits
        // for its ack of the snapshot and of the records before it.
        assert_eq!(s.in_sync(), 1);
        assert!(!s.confirmed(s.live()));
        s.ack(a, b.records.len() as u64, now).unwrap();
        assert!(s.confirmed(s.live()));
        let live2 = rec(b"k2", 2);
        s.append_live(&live2);
        assert!(!s.confirmed(s.live()));
        let b2 = s.next(a).unwrap();
        assert_eq!(b2.records, live2);
        s.ack(a, b2.start + live2.len() as u64, now).unwrap();
        assert!(s.confirmed(s.live()));
        // An ack beyond the stream ends the session.
        assert!(s.ack(a, 1 << 40, now).is_err());
        assert_eq!(s.followers(), 0);
    }

    #[test]
    fn a_lagging_or_overfull_session_is_dropped_and_stops_holding_replies() {
        let now = Instant::now();
        let mut s = Shipping::default();
        let a = s.open(now).unwrap();
        let cur = s.snapshot_due(a).unwrap();
        s.snapshot_step_done(a, cur, &[], true);
        s.ack(a, 0, now).unwrap();
        s.append_live(&rec(b"x", 1));
        assert!(!s.confirmed(s.live()));
        assert_eq!(s.drop_lagging(s.live()), vec![a]);
        // Its standby calls itself in sync: no reply goes out without it
        // until its drop is recorded.
        assert!(!s.confirmed(s.live()));
        let recording = s.begin_recording();
        assert_eq!(recording, vec![a]);
        assert!(!s.confirmed(s.live()), "being recorded");
        s.recorded(&recording);
        assert!(s.confirmed(s.live()));
        // A session dropped before its snapshot was whole needs no record.
        let b = s.open(now).unwrap();
        let big = vec![0u8; FOLLOWER_BUFFER_BYTES + 1];
        assert_eq!(s.append_live(&big), vec![b]);
        assert!(!s.drops_unrecorded());
        for _ in 0..MAX_FOLLOWERS {
            s.open(now).unwrap();
        }
        assert!(s.open(now).is_err(), "the sessions are bounded");
    }

    #[test]
    fn shipped_records_are_checked_before_any_is_applied() {
        let map = ShardMap::new(1).unwrap();
        let mut bytes = rec(b"a", 1);
        bytes.extend(rec(b"b", 2));
        assert_eq!(
            decode_records(&bytes, 0, |k| map.shard_of(k))
                .unwrap()
                .len(),
            2
        );
        let mut bad = bytes.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(decode_records(&bad, 0, |k| map.shard_of(k))
            .unwrap_err()
            .contains("checksum"));
        assert!(decode_records(&bytes[..bytes.len() - 3], 0, |k| map.shard_of(k)).is_err());
        let map2 = ShardMap::new(2).unwrap();
        let other = (0..64u8)
            .map(|i| vec![b'k', i])
            .find(|k| map2.shard_of(k) == 1)
            .unwrap();
        assert!(decode_records(&rec(&other, 1), 0, |k| map2.shard_of(k))
            .unwrap_err()
            .contains("shard"));
    }

    #[test]
    fn a_session_that_polls_but_confirms_nothing_while_bytes_wait_is_dropped() {
        let t0 = Instant::now();
        let later = |ms| t0 + Duration::from_millis(ms);
        let mut s = Shipping::default();
        let stuck = s.open(t0).unwrap();
        let moving = s.open(t0).unwrap();
        let idle = s.open(t0).unwrap();
        for f in [stuck, moving, idle] {
            let cur = s.snapshot_due(f).unwrap();
            s.snapshot_step_done(f, cur, &rec(b"k0", 5), true);
        }
        // `idle` takes everything at once; then nothing more comes for it
        // to confirm.
        let all = s.next(idle).unwrap().records.len() as u64;
        s.ack(idle, all, later(100)).unwrap();
        for i in 1..=30u64 {
            let now = later(100 * i);
            assert!(s.append_live(&rec(b"k1", i)).is_empty());
            // `stuck` polls, always at its first offset.
            s.ack(stuck, 0, now).unwrap();
            let to = s.next(moving).unwrap();
            s.ack(moving, to.start + to.records.len() as u64, now)
                .unwrap();
            let to = s.next(idle).unwrap();
            s.ack(idle, to.start + to.records.len() as u64, now)
                .unwrap();
        }
        let dropped = s.drop_silent(later(3000) - Duration::from_millis(1500));
        assert_eq!(dropped, vec![stuck]);
        assert_eq!(s.followers(), 2);
    }

    #[test]
    fn only_a_leader_that_lost_or_refused_the_session_ends_it() {
        let mut s = Shipping::default();
        let gone = s.next(42).unwrap_err();
        assert!(ends_session(&gone), "{gone}");
        let a = s.open(Instant::now()).unwrap();
        let outside = s.ack(a, 1 << 40, Instant::now()).unwrap_err();
        assert!(ends_session(&outside), "{outside}");
        for code in [
            ErrorCode::NotLeader,
            ErrorCode::Unsupported,
            ErrorCode::Unavailable,
            ErrorCode::Timeout,
        ] {
            assert!(!ends_session(&KvError::new(code, "x")), "{code:?}");
        }
    }

    #[test]
    fn a_copy_is_in_sync_at_its_sessions_term_until_the_leader_refuses_the_session() {
        let map = ShardMap::new(1).unwrap();
        let mut sb = Standby::default();
        assert_eq!(sb.synced_at(), None, "the state directory's copy");
        let r = rec(b"a", 1);
        let recs = || decode_records(&r, 0, |k| map.shard_of(k)).unwrap();
        sb.apply(7, 42, recs(), r.len() as u64, false);
        assert_eq!(sb.synced_at(), None, "mid-snapshot");
        sb.apply(7, 42, recs(), r.len() as u64, true);
        assert_eq!(sb.synced_at(), Some((42, 7)));
        sb.lose_session();
        assert_eq!(sb.synced_at(), None, "dropped by the leader");
        assert_eq!(sb.image.objects.len(), 1, "the image is kept meanwhile");
        sb.apply(8, 43, recs(), r.len() as u64, true);
        assert_eq!(sb.synced_at(), Some((43, 8)));
        sb.stopped = true;
        assert_eq!(sb.synced_at(), None, "it leads");
    }

    #[test]
    fn a_new_session_replaces_the_image() {
        let map = ShardMap::new(1).unwrap();
        let mut sb = Standby::default();
        let r = rec(b"a", 1);
        sb.apply(
            7,
            1,
            decode_records(&r, 0, |k| map.shard_of(k)).unwrap(),
            r.len() as u64,
            true,
        );
        assert_eq!(sb.image.objects.len(), 1);
        let r2 = rec(b"b", 1);
        sb.apply(
            9,
            1,
            decode_records(&r2, 0, |k| map.shard_of(k)).unwrap(),
            r2.len() as u64,
            false,
        );
        assert_eq!(sb.image.objects.len(), 1);
        assert!(sb.image.objects.contains_key(b"b".as_slice()));
        assert_eq!(sb.acked, r2.len() as u64);
        assert!(!sb.synced);
    }
}
