//! A client as a state machine, one call at a time, each under the client's
//! deadline ([`CLIENT_TIMEOUT_MS`]), as the real client runs every public
//! call under `tokio::time::timeout`.
//!
//! * put: the REAL protocol, [`kvpool_client::put::PutProtocol`] (the code
//!   `Client::put_with` drives): `PutStart` and its waits, re-placements,
//!   the end and its resends, the read-back after a lost answer, the revoke
//!   at the deadline. This model only does its I/O: the writes to the
//!   nodes (by the placement's time, as the transfer engine; a segment
//!   whose write failed unreachable or timed out is noted in the engine's
//!   [`Suspects`] and reported when the protocol asks), pauses as timers,
//!   the read-back as a get. Values are tags (put number n).
//! * get: `GetReplicaList`, then the REAL read rules of the transfer
//!   engine, [`kvpool_transport::read`]: the replicas in its order (suspect
//!   nodes last, DRAM first, this client's host first), each with its share
//!   of the time left, the next one after a failure or bytes that do not
//!   match the object's checksum (`Corrupt`), the last one's error. The
//!   nodes a read or write could not reach are noted by the engine's own
//!   [`Suspects`]. The bytes a get returns are checked: a value put under
//!   this key, never another key's or bytes of no value.
//! * remove (sometimes forced); a liveness ping every [`PING_MS`].
//!
//! Not modelled: batches, the location cache, shared-memory and RDMA paths.

use std::time::Duration;

use kvpool_client::put::{Action, PutIds, PutProtocol};
use kvpool_transport::read;
use kvpool_transport::read::{Prefer, ReplicaRead, Step, Suspects};
use kvpool_wire::proto::{MasterRequest, MasterResponse, PutOptions, ReplicaDesc};
use kvpool_wire::{ErrorCode, KvError};
use rand::Rng;

use crate::{
    key, sum_of, Addr, Body, Content, Ctx, Msg, Timer, CLIENT_TIMEOUT_MS, KEYS, LEASE_TTL_MS,
    PING_MS,
};

const LENS: [u64; 5] = [1, 700, 2048, 4096, 9000];

/// What a read leaves of its lease (the real client's `VIEW_MARGIN`): more
/// than the network's longest delay, so a read sent in time reaches its
/// node before the lease ends.
const READ_MARGIN_MS: u64 = 50;

#[derive(Debug)]
enum Stage {
    /// A put waits for the master's answer to its protocol's request.
    PutAsk,
    /// A put's writes: the round (its deadline timer's id) and the writes
    /// still out (id, segment).
    Writing(u64, Vec<(u64, u64)>),
    /// A put's pause (its timer's id).
    Sleeping(u64),
    /// A put reports unreachable segments, one request at a time: those
    /// left, and how many in all.
    Reporting(Vec<u64>, usize),
    /// Waiting for `GetReplicaList`, then for the read of replica `i`
    /// (the read's id, its share of the time left).
    Listing,
    Reading(usize, u64, Duration),
    Removing,
}

#[derive(Debug)]
struct Op {
    id: u64,
    /// When the call began, and its deadline (sim ms).
    start: u64,
    deadline: u64,
    key: Vec<u8>,
    /// The master request under way.
    awaiting: u64,
    stage: Stage,
    // put
    put: Option<PutProtocol>,
    tag: u64,
    /// A get that reads back this put's key for its protocol.
    reading_back: bool,
    // get
    /// When `GetReplicaList` was sent (its read lease runs from then).
    asked: u64,
    replicas: Vec<ReplicaDesc>,
    read: Option<ReplicaRead>,
}

pub struct ClientModel {
    pub idx: usize,
    id: u64,
    checksums: bool,
    op: Option<Op>,
    /// Names each placement (the real client's counter).
    put_ids: PutIds,
    /// Segments a read or write could not reach: reported by the next put
    /// that asks, tried last by reads for a while (the engine's own list).
    suspects: Suspects,
    /// This client's host (node i's), which its reads prefer.
    host: String,
}

/// The simulated clock as the read rules take it.
fn at(ctx: &Ctx) -> Duration {
    Duration::from_millis(ctx.now)
}

fn ms(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

impl ClientModel {
    /// `checksums`: whether this client computes and checks checksums
    /// (`client.checksums`, on by default).
    pub fn new(idx: usize, checksums: bool, ctx: &mut Ctx) -> Self {
        let c = Self {
            idx,
            id: ctx.rng.random::<u64>().max(1),
            checksums,
            op: None,
            put_ids: PutIds::default(),
            suspects: Suspects::default(),
            host: format!("host-{idx}"),
        };
        let me = Addr::Client(idx);
        let first = ctx.rng.random_range(1..200);
        ctx.timer(me, first, Timer::ClientNext);
        let ping = ctx.rng.random_range(1..PING_MS);
        ctx.timer(me, ping, Timer::ClientPing);
        c
    }

    fn me(&self) -> Addr {
        Addr::Client(self.idx)
    }

    pub fn open_deadline(&self) -> Option<u64> {
        self.op.as_ref().map(|o| o.deadline)
    }

    pub fn on_timer(&mut self, t: Timer, ctx: &mut Ctx) {
        let me = self.me();
        let Some(o) = self.op.as_mut() else {
            match t {
                Timer::ClientNext => self.start(ctx),
                Timer::ClientPing => self.ping(ctx),
                _ => {}
            }
            return;
        };
        match t {
            Timer::ClientPing => self.ping(ctx),
            Timer::ClientDeadline(op) if o.id == op => {
                // The put may be half done: its space back, best effort.
                let deadline = KvError::new(ErrorCode::Timeout, "the call's deadline");
                if let Some(revoke) = o.put.as_mut().and_then(|p| p.revoke_after(&deadline)) {
                    ctx.ask(me, revoke);
                }
                ctx.stats.timeouts += 1;
                self.end(ctx, Err(ErrorCode::Timeout));
            }
            Timer::ClientWake(id) if matches!(o.stage, Stage::Sleeping(t) if t == id) => {
                let a = {
                    let (p, ids) = self.protocol();
                    p.woke(ids)
                };
                self.drive(a, ctx);
            }
            Timer::ClientWriteBy(round) => {
                let Stage::Writing(r, ids) = &o.stage else {
                    return;
                };
                if *r != round {
                    return;
                }
                // As the engine: the write that did not finish in time
                // names its node (noted unreachable).
                let e = KvError::new(ErrorCode::Timeout, "a write did not finish by its time");
                if let Some(&(_, seg)) = ids.first() {
                    self.suspects.note(seg, &e, at(ctx));
                }
                let a = self.protocol().0.written(Err(e));
                self.drive(a, ctx);
            }
            Timer::ClientReadShare(id) => {
                let Stage::Reading(i, want, share) = o.stage else {
                    return;
                };
                if want != id {
                    return;
                }
                ctx.stats.read_shares_passed += 1;
                let e = ReplicaRead::share_passed(&o.replicas[i], share);
                self.replica_failed(i, e, ctx);
            }
            _ => {}
        }
    }

    fn ping(&mut self, ctx: &mut Ctx) {
        ctx.timer(self.me(), PING_MS, Timer::ClientPing);
        let req = MasterRequest::Ping {
            client_id: self.id,
            segments: Vec::new(),
        };
        ctx.ask(self.me(), req);
    }

    /// The put under way's protocol, and the placement names it takes.
    fn protocol(&mut self) -> (&mut PutProtocol, &PutIds) {
        let p = self.op.as_mut().and_then(|o| o.put.as_mut());
        (p.expect("a put under way"), &self.put_ids)
    }

    fn start(&mut self, ctx: &mut Ctx) {
        let k = key(ctx.rng.random_range(0..KEYS));
        let id = ctx.id();
        let mut op = Op {
            id,
            start: ctx.now,
            deadline: ctx.now + CLIENT_TIMEOUT_MS,
            key: k.clone(),
            awaiting: 0,
            stage: Stage::Listing,
            put: None,
            tag: 0,
            reading_back: false,
            asked: ctx.now,
            replicas: Vec::new(),
            read: None,
        };
        ctx.timer(self.me(), CLIENT_TIMEOUT_MS, Timer::ClientDeadline(id));
        match ctx.rng.random_range(0..100) {
            0..=39 => {
                op.tag = ctx.new_tag(&k);
                let len = LENS[ctx.rng.random_range(0..LENS.len())];
                let opts = PutOptions {
                    replicas: ctx.rng.random_range(1..=2),
                    replace: ctx.rng.random_ratio(2, 3),
                    soft_pin_ttl_ms: if ctx.rng.random_ratio(1, 5) { 300 } else { 0 },
                    hard_pin: ctx.rng.random_ratio(1, 30),
                    preferred_host: format!("host-{}", ctx.rng.random_range(0..3)),
                    put_id: 0,
                };
                let budget = Duration::from_millis(CLIENT_TIMEOUT_MS);
                let mut put = PutProtocol::new(self.id, k, len, opts, budget);
                let a = put.begin(&self.put_ids);
                op.put = Some(put);
                self.op = Some(op);
                self.drive(a, ctx);
            }
            40..=89 => {
                op.awaiting = ctx.ask(self.me(), MasterRequest::GetReplicaList { key: k });
                self.op = Some(op);
            }
            _ => {
                op.stage = Stage::Removing;
                let force = ctx.rng.random_ratio(1, 3);
                op.awaiting = ctx.ask(self.me(), MasterRequest::Remove { key: k, force });
                self.op = Some(op);
            }
        }
    }

    /// Does what the put's protocol asks.
    fn drive(&mut self, a: Action, ctx: &mut Ctx) {
        let me = self.me();
        let o = self.op.as_mut().expect("a put under way");
        match a {
            Action::Ask(req) => {
                o.stage = Stage::PutAsk;
                o.awaiting = ctx.ask(me, req);
            }
            Action::Write { replicas, by } => {
                let round = ctx.id();
                let mut ids = Vec::new();
                for r in &replicas {
                    let Some(&n) = ctx.seg_node.get(&r.segment_id) else {
                        continue;
                    };
                    let id = ctx.id();
                    ids.push((id, r.segment_id));
                    let body = Body::Write {
                        id,
                        seg: r.segment_id,
                        offset: r.offset,
                        len: r.len,
                        content: Some(o.tag),
                    };
                    ctx.send(me, Addr::Node(n), body);
                }
                if ids.is_empty() {
                    let checksum = self.checksums.then_some(sum_of(Some(o.tag)));
                    let a = self.protocol().0.written(Ok(checksum));
                    return self.drive(a, ctx);
                }
                let until = (o.start + ms(by)).saturating_sub(ctx.now);
                ctx.timer(me, until, Timer::ClientWriteBy(round));
                o.stage = Stage::Writing(round, ids);
            }
            Action::Sleep(pause) => {
                ctx.stats.put_pauses += 1;
                let t = ctx.id();
                o.stage = Stage::Sleeping(t);
                ctx.timer(me, ms(pause).max(1), Timer::ClientWake(t));
            }
            Action::ReportUnreachable => {
                ctx.stats.put_reports += 1;
                let left = self.suspects.take_unreachable();
                let n = left.len();
                self.report_next(left, n, ctx);
            }
            Action::ReadBack => {
                ctx.stats.put_readbacks += 1;
                o.reading_back = true;
                o.stage = Stage::Listing;
                let req = MasterRequest::GetReplicaList { key: o.key.clone() };
                o.asked = ctx.now;
                o.awaiting = ctx.ask(me, req);
            }
            Action::Done(r) => {
                match &r {
                    Ok(()) => ctx.stats.puts_ok += 1,
                    // A put that timed out may be half done (as the client).
                    Err(e) => {
                        if let Some(revoke) = o.put.as_mut().and_then(|p| p.revoke_after(e)) {
                            ctx.ask(me, revoke);
                        }
                    }
                }
                self.end(ctx, r.map_err(|e| e.code));
            }
        }
    }

    /// Reports the next unreachable segment, or tells the protocol how
    /// many were reported.
    fn report_next(&mut self, mut left: Vec<u64>, n: usize, ctx: &mut Ctx) {
        let me = self.me();
        let Some(segment_id) = left.pop() else {
            let a = {
                let (p, ids) = self.protocol();
                p.reported(ids, n)
            };
            return self.drive(a, ctx);
        };
        let o = self.op.as_mut().expect("a put under way");
        o.stage = Stage::Reporting(left, n);
        let req = MasterRequest::ReportUnreachable {
            client_id: self.id,
            segment_id,
        };
        o.awaiting = ctx.ask(me, req);
    }

    /// The call is over (answer or error).
    fn end(&mut self, ctx: &mut Ctx, res: Result<(), ErrorCode>) {
        let o = self.op.take().expect("a call");
        ctx.stats.calls_ended += 1;
        if ctx.now > o.deadline {
            ctx.fail(format!(
                "client {} ended a call at {} ms, past its deadline {} ms",
                self.idx, ctx.now, o.deadline
            ));
        }
        let _ = res;
        let think = ctx.rng.random_range(1..30);
        ctx.timer(self.me(), think, Timer::ClientNext);
    }

    /// A get is over: the call's end, or the read-back's answer.
    fn got(&mut self, ctx: &mut Ctx, res: Result<Content, ErrorCode>) {
        let o = self.op.as_mut().expect("a get");
        if o.reading_back {
            o.reading_back = false;
            let holds = res == Ok(Some(o.tag));
            let a = {
                let (p, ids) = self.protocol();
                p.held(ids, holds)
            };
            return self.drive(a, ctx);
        }
        if res.is_ok() {
            ctx.stats.gets_ok += 1;
        }
        self.end(ctx, res.map(|_| ()));
    }

    pub fn on_msg(&mut self, m: Msg, ctx: &mut Ctx) {
        match m.body {
            Body::Resp { id, res } if self.op.as_ref().is_some_and(|o| o.awaiting == id) => {
                self.on_answer(res, ctx);
            }
            Body::Data { id, res } => self.on_data(id, res, ctx),
            _ => {}
        }
    }

    fn on_answer(&mut self, res: Result<MasterResponse, KvError>, ctx: &mut Ctx) {
        let o = self.op.as_mut().expect("checked");
        o.awaiting = 0;
        let now = Duration::from_millis(ctx.now - o.start);
        match (std::mem::replace(&mut o.stage, Stage::Removing), res) {
            (Stage::PutAsk, res) => {
                let a = {
                    let (p, ids) = self.protocol();
                    p.answered(now, ids, res)
                };
                self.drive(a, ctx);
            }
            (Stage::Reporting(left, n), _) => self.report_next(left, n, ctx),
            (Stage::Listing, Ok(MasterResponse::Replicas(rs))) if !rs.is_empty() => {
                // As `Client::get`: a buffer of the first replica's length.
                let prefer = Prefer {
                    shm: true,
                    host_id: &self.host,
                };
                let read = ReplicaRead::new(&rs, rs[0].len, prefer, &self.suspects, at(ctx));
                o.read = Some(read.expect("a replica"));
                o.replicas = rs;
                self.read_next(ctx);
            }
            (Stage::Listing, r) => {
                let code = match r {
                    Ok(_) => ErrorCode::ObjectNotFound,
                    Err(e) => e.code,
                };
                self.got(ctx, Err(code));
            }
            (_, r) => self.end(ctx, r.map(|_| ()).map_err(|e| e.code)),
        }
    }

    /// Reads the replica the read rules name next, or ends the get.
    fn read_next(&mut self, ctx: &mut Ctx) {
        let me = self.me();
        let o = self.op.as_mut().expect("a get");
        let read = o.read.as_mut().expect("a read under way");
        // As `Client::get`: no read past the read lease (less a margin over
        // the network's longest delay), nor past the call's deadline.
        let d = Duration::from_millis;
        let lease_end = read::lease_read_end(d(o.asked), d(LEASE_TTL_MS), d(READ_MARGIN_MS));
        let left = lease_end.min(d(o.deadline)).saturating_sub(at(ctx));
        let (i, share, timed) = match read.next(left) {
            Step::Try {
                index,
                share,
                timed,
                failover,
            } => {
                ctx.stats.read_failovers += u64::from(failover);
                (index, share, timed)
            }
            Step::Failed(e) => return self.got(ctx, Err(e.code)),
        };
        let r = &o.replicas[i];
        let Some(&n) = ctx.seg_node.get(&r.segment_id) else {
            let e = KvError::new(ErrorCode::Unavailable, "no node serves this segment");
            return self.replica_failed(i, e, ctx);
        };
        let id = ctx.id();
        o.stage = Stage::Reading(i, id, share);
        let body = Body::Read {
            id,
            seg: r.segment_id,
            tier: r.tier,
            offset: r.offset,
            len: r.len,
        };
        ctx.send(me, Addr::Node(n), body);
        if timed {
            ctx.timer(me, ms(share).max(1), Timer::ClientReadShare(id));
        }
    }

    /// Replica `i` failed with `e` (as the engine: its node is noted when it
    /// could not be reached); the next one is tried.
    fn replica_failed(&mut self, i: usize, e: KvError, ctx: &mut Ctx) {
        let o = self.op.as_mut().expect("a get");
        self.suspects.note(o.replicas[i].segment_id, &e, at(ctx));
        o.read.as_mut().expect("a read under way").failed(e);
        self.read_next(ctx);
    }

    fn on_data(&mut self, id: u64, res: Result<Content, ErrorCode>, ctx: &mut Ctx) {
        let Some(o) = self.op.as_mut() else { return };
        match &mut o.stage {
            Stage::Writing(_, ids) if ids.iter().any(|w| w.0 == id) => {
                let seg = ids.iter().find(|w| w.0 == id).map_or(0, |w| w.1);
                ids.retain(|w| w.0 != id);
                if let Err(code) = res {
                    // The first error ends the writes (as the engine's
                    // `try_join_all`); a node it could not reach is noted.
                    let e = KvError::new(code, format!("a write to segment {seg:016x} failed"));
                    self.suspects.note(seg, &e, at(ctx));
                    let a = self.protocol().0.written(Err(e));
                    return self.drive(a, ctx);
                }
                if ids.is_empty() {
                    let checksum = self.checksums.then_some(sum_of(Some(o.tag)));
                    let a = self.protocol().0.written(Ok(checksum));
                    self.drive(a, ctx);
                }
            }
            Stage::Reading(i, want, _) if *want == id => {
                let i = *i;
                let r = &o.replicas[i];
                let content = match res {
                    Ok(c) => c,
                    Err(code) => {
                        let e = KvError::new(code, "the replica's node refused the read");
                        return self.replica_failed(i, e, ctx);
                    }
                };
                if self.checksums && r.checksum.is_some_and(|s| s != sum_of(content)) {
                    ctx.stats.corrupt_reads += 1;
                    let e = KvError::new(ErrorCode::Corrupt, "the bytes fail the checksum");
                    return self.replica_failed(i, e, ctx);
                }
                if !ctx.is_value_of(content, &o.key) {
                    let whose = content
                        .and_then(|t| ctx.tag_key.get(t as usize))
                        .map(|k| String::from_utf8_lossy(k).into_owned());
                    let what = format!(
                        "client {} got {:?} for key {} from a {:?} replica (segment {:016x}, \
                         offset {}): a value of {whose:?}, not of this key",
                        self.idx,
                        content,
                        String::from_utf8_lossy(&o.key),
                        r.tier,
                        r.segment_id,
                        r.offset
                    );
                    ctx.fail(what);
                }
                self.got(ctx, Ok(content));
            }
            _ => {}
        }
    }
}
