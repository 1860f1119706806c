//! A client as a state machine, one call at a time, each under the client's
//! deadline ([`CLIENT_TIMEOUT_MS`]), as the real client runs every public
//! call under `tokio::time::timeout`.
//!
//! * put: the REAL protocol, [`kvpool_client::put::PutProtocol`] (the code
//!   `Client::put_with` drives): `PutStart` and its waits, re-placements,
//!   the end and its resends, the read-back after a lost answer, the revoke
//!   at the deadline. This model only does its I/O: the writes to the
//!   nodes (by the placement's time, as the transfer engine; a segment
//!   whose write failed unreachable or timed out is noted, as the engine
//!   notes it, and reported when the protocol asks), pauses as timers, the
//!   read-back as a get. Values are tags (put number n).
//! * get: a MODEL of `Client::get`: `GetReplicaList`, then each replica in
//!   order until one answers with bytes that match the object's checksum
//!   (a mismatch is `Corrupt`, the next replica is tried). The bytes a get
//!   returns are checked: a value put under this key, never another key's
//!   or bytes of no value.
//! * remove (sometimes forced); a liveness ping every [`PING_MS`].
//!
//! Not modelled: batches, the location cache, shared-memory and RDMA paths.

use std::time::Duration;

use kvpool_client::put::{Action, PutIds, PutProtocol};
use kvpool_wire::proto::{MasterRequest, MasterResponse, PutOptions, ReplicaDesc};
use kvpool_wire::{ErrorCode, KvError};
use rand::Rng;

use crate::{key, sum_of, Addr, Body, Content, Ctx, Msg, Timer, CLIENT_TIMEOUT_MS, KEYS, PING_MS};

const LENS: [u64; 5] = [1, 700, 2048, 4096, 9000];

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
    /// Waiting for `GetReplicaList`, then for the read of replica `i`.
    Listing,
    Reading(usize, u64),
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
    replicas: Vec<ReplicaDesc>,
    corrupt: bool,
}

pub struct ClientModel {
    pub idx: usize,
    id: u64,
    checksums: bool,
    op: Option<Op>,
    /// Names each placement (the real client's counter).
    put_ids: PutIds,
    /// Segments a write could not reach, until a put reports them (the
    /// transfer engine's list).
    unreachable: Vec<u64>,
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
            unreachable: Vec::new(),
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
                if let Some(&(_, seg)) = ids.first() {
                    self.note_unreachable(seg);
                }
                let e = KvError::new(ErrorCode::Timeout, "a write did not finish by its time");
                let a = self.protocol().0.written(Err(e));
                self.drive(a, ctx);
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

    fn note_unreachable(&mut self, seg: u64) {
        if !self.unreachable.contains(&seg) {
            self.unreachable.push(seg);
        }
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
            replicas: Vec::new(),
            corrupt: false,
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
                let left = std::mem::take(&mut self.unreachable);
                let n = left.len();
                self.report_next(left, n, ctx);
            }
            Action::ReadBack => {
                ctx.stats.put_readbacks += 1;
                o.reading_back = true;
                o.stage = Stage::Listing;
                let req = MasterRequest::GetReplicaList { key: o.key.clone() };
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
                o.replicas = rs;
                self.read(0, ctx);
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

    fn read(&mut self, i: usize, ctx: &mut Ctx) {
        let me = self.me();
        let o = self.op.as_mut().expect("a get");
        let Some(r) = o.replicas.get(i) else {
            let code = if o.corrupt {
                ErrorCode::Corrupt
            } else {
                ErrorCode::Unavailable
            };
            self.got(ctx, Err(code));
            return;
        };
        let id = ctx.id();
        o.stage = Stage::Reading(i, id);
        match ctx.seg_node.get(&r.segment_id) {
            Some(&n) => {
                let body = Body::Read {
                    id,
                    seg: r.segment_id,
                    tier: r.tier,
                    offset: r.offset,
                    len: r.len,
                };
                ctx.send(me, Addr::Node(n), body);
            }
            None => self.read(i + 1, ctx),
        }
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
                    if matches!(code, ErrorCode::Unavailable | ErrorCode::Timeout) {
                        self.note_unreachable(seg);
                    }
                    let e = KvError::new(code, format!("a write to segment {seg:016x} failed"));
                    let a = self.protocol().0.written(Err(e));
                    return self.drive(a, ctx);
                }
                if ids.is_empty() {
                    let checksum = self.checksums.then_some(sum_of(Some(o.tag)));
                    let a = self.protocol().0.written(Ok(checksum));
                    self.drive(a, ctx);
                }
            }
            Stage::Reading(i, want) if *want == id => {
                let i = *i;
                let r = &o.replicas[i];
                let content = match res {
                    Ok(c) => c,
                    Err(_) => {
                        self.read(i + 1, ctx);
                        return;
                    }
                };
                if self.checksums && r.checksum.is_some_and(|s| s != sum_of(content)) {
                    ctx.stats.corrupt_reads += 1;
                    o.corrupt = true;
                    self.read(i + 1, ctx);
                    return;
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
