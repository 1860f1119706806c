//! A client as a state machine: a MODEL of `actors/client` (`put_with`,
//! `get`, `remove_with`), one call at a time, each under the client's
//! deadline ([`CLIENT_TIMEOUT_MS`]), as the real client runs every public
//! call under `tokio::time::timeout`.
//!
//! * put: `PutStart` (a `TryAgain` answer waits 1, 2, 4 .. 50 ms and asks
//!   again); the value written to every replica; on a write error the put's
//!   space is revoked, the unreachable segment reported and the put placed
//!   again (at most [`MAX_PLACEMENTS`] times); `PutEnd` with the checksum
//!   when the client computes checksums. A put that times out is revoked in
//!   the background.
//! * get: `GetReplicaList`, then each replica in order until one answers
//!   with bytes that match the object's checksum (a mismatch is `Corrupt`,
//!   the next replica is tried). The bytes a get returns are checked: a
//!   value put under this key, never another key's or bytes of no value.
//! * remove (sometimes forced); a liveness ping every [`PING_MS`].
//!
//! Not modelled: batches, the location cache, shared-memory and RDMA paths.

use kvpool_wire::proto::{MasterRequest, MasterResponse, PutOptions, ReplicaDesc};
use kvpool_wire::{ErrorCode, KvError};
use rand::Rng;

use crate::{key, sum_of, Addr, Body, Content, Ctx, Msg, Timer, CLIENT_TIMEOUT_MS, KEYS, PING_MS};

/// Placements of one put (as `MAX_PLACEMENTS` in the real client).
pub const MAX_PLACEMENTS: u32 = 3;
const LENS: [u64; 5] = [1, 700, 2048, 4096, 9000];

#[derive(Debug)]
enum Stage {
    /// Waiting for `PutStart`'s answer.
    Start,
    /// Waiting for these writes (id, segment).
    Writing(Vec<(u64, u64)>),
    /// A write failed: revoking, then reporting, then placing again.
    Revoking,
    Reporting,
    Ending,
    /// Waiting for `GetReplicaList`, then for the read of replica `i`.
    Listing,
    Reading(usize, u64),
    Removing,
}

#[derive(Debug)]
struct Op {
    id: u64,
    deadline: u64,
    key: Vec<u8>,
    /// The master request under way.
    awaiting: u64,
    stage: Stage,
    // put
    tag: u64,
    len: u64,
    opts: PutOptions,
    replicas: Vec<ReplicaDesc>,
    failed: Option<u64>,
    placements: u32,
    backoff: u64,
    // get
    corrupt: bool,
}

pub struct ClientModel {
    pub idx: usize,
    id: u64,
    checksums: bool,
    op: Option<Op>,
    /// The next placement's `put_id` (as the real client counts them).
    next_put: u16,
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
            next_put: 1,
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
        match t {
            Timer::ClientNext => self.start(ctx),
            Timer::ClientPing => {
                ctx.timer(self.me(), PING_MS, Timer::ClientPing);
                let req = MasterRequest::Ping {
                    client_id: self.id,
                    segments: Vec::new(),
                };
                ctx.ask(self.me(), req);
            }
            Timer::ClientDeadline(op) if self.op.as_ref().is_some_and(|o| o.id == op) => {
                {
                    let o = self.op.as_ref().expect("checked");
                    if matches!(
                        o.stage,
                        Stage::Start
                            | Stage::Writing(_)
                            | Stage::Ending
                            | Stage::Revoking
                            | Stage::Reporting
                    ) {
                        // The put may be half done: its space back, best effort.
                        let req = MasterRequest::PutRevoke {
                            client_id: self.id,
                            key: o.key.clone(),
                            put_id: o.opts.put_id,
                        };
                        ctx.ask(self.me(), req);
                    }
                    ctx.stats.timeouts += 1;
                    self.end(ctx, Err(ErrorCode::Timeout));
                }
            }
            Timer::ClientRetry(op) if self.op.as_ref().is_some_and(|o| o.id == op) => {
                self.put_start(ctx);
            }
            _ => {}
        }
    }

    fn start(&mut self, ctx: &mut Ctx) {
        let k = key(ctx.rng.random_range(0..KEYS));
        let id = ctx.id();
        let mut op = Op {
            id,
            deadline: ctx.now + CLIENT_TIMEOUT_MS,
            key: k.clone(),
            awaiting: 0,
            stage: Stage::Start,
            tag: 0,
            len: 0,
            opts: PutOptions::default(),
            replicas: Vec::new(),
            failed: None,
            placements: 0,
            backoff: 1,
            corrupt: false,
        };
        ctx.timer(self.me(), CLIENT_TIMEOUT_MS, Timer::ClientDeadline(id));
        match ctx.rng.random_range(0..100) {
            0..=39 => {
                op.tag = ctx.new_tag(&k);
                op.len = LENS[ctx.rng.random_range(0..LENS.len())];
                op.opts = PutOptions {
                    replicas: ctx.rng.random_range(1..=2),
                    replace: ctx.rng.random_ratio(2, 3),
                    soft_pin_ttl_ms: if ctx.rng.random_ratio(1, 5) { 300 } else { 0 },
                    hard_pin: ctx.rng.random_ratio(1, 30),
                    preferred_host: format!("host-{}", ctx.rng.random_range(0..3)),
                    put_id: 0,
                };
                self.op = Some(op);
                self.put_start(ctx);
            }
            40..=89 => {
                op.stage = Stage::Listing;
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

    fn put_start(&mut self, ctx: &mut Ctx) {
        let me = self.me();
        let o = self.op.as_mut().expect("a put");
        o.stage = Stage::Start;
        o.opts.put_id = self.next_put;
        self.next_put = self.next_put.wrapping_add(1).max(1);
        o.awaiting = ctx.ask(
            me,
            MasterRequest::PutStart {
                client_id: self.id,
                key: o.key.clone(),
                len: o.len,
                opts: o.opts.clone(),
            },
        );
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
        let me = self.me();
        let o = self.op.as_mut().expect("checked");
        o.awaiting = 0;
        match (&o.stage, res) {
            (Stage::Start, Ok(MasterResponse::Replicas(rs))) => {
                let mut ids = Vec::new();
                for r in &rs {
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
                o.replicas = rs;
                o.stage = Stage::Writing(ids);
            }
            // As the real client: space on its way, or a key a restarted
            // master is still recovering (`ReplicaNotReady`).
            (Stage::Start, Err(e))
                if matches!(e.code, ErrorCode::TryAgain | ErrorCode::ReplicaNotReady) =>
            {
                let wait = o.backoff;
                o.backoff = (o.backoff * 2).min(50);
                ctx.timer(me, wait, Timer::ClientRetry(o.id));
            }
            (Stage::Revoking, _) => {
                let seg = o.failed.take();
                if o.placements >= MAX_PLACEMENTS || seg.is_none() {
                    self.end(ctx, Err(ErrorCode::Unavailable));
                    return;
                }
                o.placements += 1;
                o.stage = Stage::Reporting;
                o.awaiting = ctx.ask(
                    me,
                    MasterRequest::ReportUnreachable {
                        client_id: self.id,
                        segment_id: seg.expect("checked"),
                    },
                );
            }
            (Stage::Reporting, _) => self.put_start(ctx),
            (Stage::Ending, Ok(_)) => {
                ctx.stats.puts_ok += 1;
                self.end(ctx, Ok(()));
            }
            (Stage::Listing, Ok(MasterResponse::Replicas(rs))) if !rs.is_empty() => {
                o.replicas = rs;
                self.read(0, ctx);
            }
            (Stage::Removing, r) => self.end(ctx, r.map(|_| ()).map_err(|e| e.code)),
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
            self.end(ctx, Err(code));
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
        let me = self.me();
        let Some(o) = self.op.as_mut() else { return };
        match &mut o.stage {
            Stage::Writing(ids) if ids.iter().any(|w| w.0 == id) => {
                let seg = ids.iter().find(|w| w.0 == id).map(|w| w.1);
                ids.retain(|w| w.0 != id);
                if let Err(code) = res {
                    // The engine marks a node it could not reach; the
                    // client reports it and places the put again. Any
                    // other error ends the put (after the revoke).
                    o.failed = seg.filter(|_| code == ErrorCode::Unavailable);
                    o.stage = Stage::Revoking;
                    o.awaiting = ctx.ask(
                        me,
                        MasterRequest::PutRevoke {
                            client_id: self.id,
                            key: o.key.clone(),
                            put_id: o.opts.put_id,
                        },
                    );
                    return;
                }
                if ids.is_empty() {
                    o.stage = Stage::Ending;
                    let checksum = self.checksums.then_some(sum_of(Some(o.tag)));
                    o.awaiting = ctx.ask(
                        me,
                        MasterRequest::PutEnd {
                            client_id: self.id,
                            key: o.key.clone(),
                            put_id: o.opts.put_id,
                            checksum,
                        },
                    );
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
                ctx.stats.gets_ok += 1;
                self.end(ctx, Ok(()));
            }
            _ => {}
        }
    }
}
