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
//! * batch put (2-4 keys): the REAL [`BatchPut`] (the code
//!   `Client::batch_put` drives): its rounds of grouped `BatchPutStart` /
//!   `BatchPutEnd` / `BatchPutRevoke`, writes by their time, pauses, reports
//!   and read-backs, each item fed its part; this model carries a round out
//!   as the single put's I/O.
//! * get: the client's REAL get protocol, [`GetProtocol`] (the code
//!   `Client::get` drives): the location cache's entry first ([`Locations`],
//!   the real table on the simulated clock), else `GetReplicaList`; every
//!   answer, a get's or a read-back's, leaves its checked DRAM replicas in
//!   the cache until the read lease's end less the client's margin; a read
//!   through an entry that fails forgets it and asks the master. Then the
//!   REAL read rules of the transfer engine, [`kvpool_transport::read`]:
//!   the replicas in its order (suspect nodes last, DRAM first, this
//!   client's host first), each with its share of the time left, the next
//!   one after a failure or bytes that do not match the object's checksum
//!   (`Corrupt`), the last one's error. The nodes a read or write could not
//!   reach are noted by the engine's own [`Suspects`]. The bytes a get
//!   returns are checked: a value put under this key, never another key's
//!   or bytes of no value. A put, batch put or remove forgets its keys in
//!   the cache when it is over.
//! * remove (sometimes forced); a liveness ping every [`PING_MS`].
//!
//! Writes and reads carry the grant of the replica they name (the master
//! signs them on seeds with a cluster secret; nodes check them).
//!
//! With [`crate::Options::stalled_reads`], a read now and then waits in the
//! client before it leaves (up to three quarters of its replica's share).
//!
//! Not modelled: shared-memory and RDMA paths.

use std::sync::Arc;
use std::time::Duration;

use kvpool_client::get::{Answers, BatchGet, GetProtocol, Step};
use kvpool_client::locations::Locations;
use kvpool_client::put::batch::{Ask, BatchPut, Round};
use kvpool_client::put::{Action, Input, OneId, PlaceIds, PutIds, PutProtocol};
use kvpool_transport::read;
use kvpool_transport::read::{Prefer, ReplicaRead, Suspects};
use kvpool_wire::proto::call::{self, Call};
use kvpool_wire::proto::{DataRequest, MasterRequest, MasterResponse, PutOptions, ReplicaDesc};
use kvpool_wire::{ErrorCode, KvError};
use rand::Rng;

use crate::{
    key, sum_of, Addr, Body, Content, Ctx, Msg, Timer, CLIENT_TIMEOUT_MS, KEYS, LEASE_TTL_MS,
    MAX_VALUE_BYTES, PING_MS,
};

const LENS: [u64; 5] = [1, 700, 2048, 4096, 9000];

/// Entries of a client's location cache (the client's default).
const LOCATION_ENTRIES: usize = 65_536;

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
    /// A get, or a put's read-back ([`Op::reader`]).
    Reading,
    /// A batch put's round ([`Op::batch`]).
    Batch,
    /// A batch get ([`Op::batch_get`]).
    BatchGet,
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
    /// The read of a get or read-back.
    reader: Option<Reader>,
    batch: Option<Box<BatchRun>>,
    batch_get: Option<Box<BatchGetRun>>,
    /// The keys this call changes (a put's, a batch's, a removal's): the
    /// location cache forgets them when it is over.
    changes: Vec<Vec<u8>>,
}

/// What a read needs of its client.
struct Env<'a> {
    me: Addr,
    idx: usize,
    checksums: bool,
    host: &'a str,
    /// The call's deadline (sim ms).
    deadline: u64,
    suspects: &'a mut Suspects,
    locations: &'a Locations<Duration>,
}

/// What a client holds the master's replica lists to (the cluster map's
/// lease and value bound; its checksum setting).
fn answers(checksums: bool) -> Answers {
    Answers {
        lease: Duration::from_millis(LEASE_TTL_MS),
        checksums,
        max_len: MAX_VALUE_BYTES,
    }
}

/// One read of one key (a get, or a put's read-back): the client's REAL
/// get protocol ([`GetProtocol`]: the location cache's entry first for a
/// get, else `GetReplicaList`; what an answer leaves in the cache and until
/// when it may be read; a failed read through an entry forgets it and asks
/// the master), then the transfer engine's read rules ([`ReplicaRead`])
/// until the lease or the call ends. The bytes it returns are checked: a
/// value put under this key, never another key's or bytes of no value.
#[derive(Debug)]
struct Reader {
    key: Vec<u8>,
    /// `None` for a read of a batch get (whose protocol decides on a
    /// failed read).
    get: Option<GetProtocol<Duration>>,
    /// The id of the `GetReplicaList` out (0: none).
    awaiting: u64,
    /// Until when the replicas may be read (the protocol's step).
    lease_end: Duration,
    replicas: Arc<[ReplicaDesc]>,
    read: Option<ReplicaRead>,
    /// The replica read under way: its index, the read's id, its share.
    reading: Option<(usize, u64, Duration)>,
}

type ReadResult = Result<Content, ErrorCode>;

impl Reader {
    /// A read of `key` not begun (`get`: a single get's protocol).
    fn new(key: Vec<u8>, get: Option<GetProtocol<Duration>>) -> Self {
        Self {
            key,
            get,
            awaiting: 0,
            lease_end: Duration::ZERO,
            replicas: Arc::new([]),
            read: None,
            reading: None,
        }
    }

    /// A read of `key`; `cache`: through the location cache's entry first
    /// (a get; a put's read-back asks the master). `Some` when the read is
    /// already over.
    fn start(
        key: Vec<u8>,
        cache: bool,
        env: &mut Env<'_>,
        ctx: &mut Ctx,
    ) -> (Self, Option<ReadResult>) {
        let (get, step) = GetProtocol::start(&key, env.locations, cache, at(ctx));
        let mut r = Self::new(key, Some(get));
        if r.get.as_ref().is_some_and(|g| g.cached()) {
            ctx.stats.location_hits += 1;
        }
        let res = r.step(step, env, ctx);
        (r, res)
    }

    /// A read of `replicas` of `key` until `until`, for a batch get (whose
    /// protocol takes its outcome). `Some` when it is already over.
    fn of(
        key: Vec<u8>,
        replicas: Arc<[ReplicaDesc]>,
        until: Duration,
        env: &mut Env<'_>,
        ctx: &mut Ctx,
    ) -> (Self, Option<ReadResult>) {
        let mut r = Self::new(key, None);
        let res = r.begin(replicas, until, env, ctx);
        (r, res)
    }

    /// Carries out the protocol's step; `Some` when the read is over.
    fn step(
        &mut self,
        step: Step<Duration>,
        env: &mut Env<'_>,
        ctx: &mut Ctx,
    ) -> Option<ReadResult> {
        self.read = None;
        self.reading = None;
        match step {
            Step::Ask => {
                let req = MasterRequest::GetReplicaList {
                    key: self.key.clone(),
                };
                self.awaiting = ctx.ask(env.me, req);
                None
            }
            Step::Read { replicas, until } => self.begin(replicas, until, env, ctx),
        }
    }

    /// Reads `rs` by the read rules until `until`; `Some` when the read is
    /// over.
    fn begin(
        &mut self,
        rs: Arc<[ReplicaDesc]>,
        until: Duration,
        env: &mut Env<'_>,
        ctx: &mut Ctx,
    ) -> Option<ReadResult> {
        // As `Client::get`: a buffer of the first replica's length.
        let prefer = Prefer {
            shm: true,
            host_id: env.host,
        };
        let read = ReplicaRead::new(&rs, rs[0].len, prefer, env.suspects, at(ctx));
        self.read = Some(read.expect("a replica"));
        self.replicas = rs;
        self.lease_end = until;
        self.next(env, ctx)
    }

    /// The master's answer; `Some` when the read is over.
    fn on_answer(
        &mut self,
        res: Result<MasterResponse, KvError>,
        env: &mut Env<'_>,
        ctx: &mut Ctx,
    ) -> Option<ReadResult> {
        self.awaiting = 0;
        // As the client's typed call: an answer of another kind is an error.
        let rs = match res.and_then(call::GetReplicaList::reply) {
            Ok(rs) => rs,
            Err(e) => return Some(Err(e.code)),
        };
        let (key, loc) = (&self.key, env.locations);
        let get = self.get.as_mut().expect("a get's read asks");
        match get.answered(key, loc, rs, answers(env.checksums), at(ctx)) {
            Ok((rs, until)) => self.begin(rs, until, env, ctx),
            Err(e) => Some(Err(e.code)),
        }
    }

    /// Reads the replica the read rules name next; `Some` when the read
    /// is over.
    fn next(&mut self, env: &mut Env<'_>, ctx: &mut Ctx) -> Option<ReadResult> {
        let read = self.read.as_mut().expect("a read under way");
        // As `Client::get`: no read past the lease's end, nor past the
        // call's deadline.
        let d = Duration::from_millis;
        let left = self.lease_end.min(d(env.deadline)).saturating_sub(at(ctx));
        let (i, share, timed) = match read.next(left) {
            read::Step::Try {
                index,
                share,
                timed,
                failover,
            } => {
                ctx.stats.read_failovers += u64::from(failover);
                (index, share, timed)
            }
            // The protocol's rule: a read through the cache's entry that
            // failed forgets it and asks the master; else the error.
            read::Step::Failed(e) => {
                let Some(get) = self.get.as_mut() else {
                    return Some(Err(e.code));
                };
                let failed = get.read_failed(&self.key, env.locations, e, at(ctx));
                return match failed {
                    Ok(step) => self.step(step, env, ctx),
                    Err(e) => Some(Err(e.code)),
                };
            }
        };
        let id = match ctx.send_read(env.me, &self.replicas[i], &self.key, share) {
            Ok(id) => id,
            Err(e) => return self.failed(i, e, env, ctx),
        };
        self.reading = Some((i, id, share));
        if timed {
            ctx.timer(env.me, ms(share).max(1), Timer::ClientReadShare(id));
        }
        None
    }

    /// Replica `i` failed with `e` (as the engine: its node is noted when
    /// it could not be reached); the next one is tried.
    fn failed(
        &mut self,
        i: usize,
        e: KvError,
        env: &mut Env<'_>,
        ctx: &mut Ctx,
    ) -> Option<ReadResult> {
        self.reading = None;
        env.suspects.note(self.replicas[i].segment_id, &e, at(ctx));
        self.read.as_mut().expect("a read under way").failed(e);
        self.next(env, ctx)
    }

    /// Whether `id` is the replica read under way.
    fn reads(&self, id: u64) -> bool {
        self.reading.is_some_and(|r| r.1 == id)
    }

    /// The share of the read `id` passed.
    fn on_share(&mut self, id: u64, env: &mut Env<'_>, ctx: &mut Ctx) -> Option<ReadResult> {
        let (i, _, share) = self.reading.filter(|r| r.1 == id)?;
        ctx.stats.read_shares_passed += 1;
        let e = ReplicaRead::share_passed(&self.replicas[i], share);
        self.failed(i, e, env, ctx)
    }

    /// The node's answer to the read under way ([`Reader::reads`]).
    fn on_data(&mut self, res: ReadResult, env: &mut Env<'_>, ctx: &mut Ctx) -> Option<ReadResult> {
        let (i, _, _) = self.reading.take()?;
        let r = &self.replicas[i];
        let content = match res {
            Ok(c) => c,
            Err(code) => {
                let e = KvError::new(code, "the replica's node refused the read");
                return self.failed(i, e, env, ctx);
            }
        };
        if env.checksums && r.checksum.is_some_and(|s| s != sum_of(content)) {
            ctx.stats.corrupt_reads += 1;
            let e = KvError::new(ErrorCode::Corrupt, "the bytes fail the checksum");
            return self.failed(i, e, env, ctx);
        }
        if !ctx.is_value_of(content, &self.key) {
            let whose = content
                .and_then(|t| ctx.tag_key.get(t as usize))
                .map(|k| String::from_utf8_lossy(k).into_owned());
            let what = format!(
                "client {} got {:?} for key {} from a {:?} replica (segment {:016x}, \
                 offset {}): a value of {whose:?}, not of this key",
                env.idx,
                content,
                String::from_utf8_lossy(&self.key),
                r.tier,
                r.segment_id,
                r.offset
            );
            ctx.fail(what);
        }
        Some(Ok(content))
    }
}

/// An item of a batch and its writes still out (id, segment).
type ItemWrites = (usize, Vec<(u64, u64)>);

/// A batch put under way: the real [`BatchPut`] and what its round still
/// waits for. Each item's value is its own tag.
#[derive(Debug)]
struct BatchRun {
    batch: BatchPut,
    keys: Vec<Vec<u8>>,
    tags: Vec<u64>,
    /// Requests out (their ids) and whose answers they are.
    asks: Vec<(u64, Ask)>,
    /// Write groups out: the timer's id, and per item the writes still out.
    writes: Vec<(u64, Vec<ItemWrites>)>,
    /// The pause's timer and its items.
    sleep: Option<(u64, Vec<usize>)>,
    /// Segments left to report, how many in all, the request out, and the
    /// items that wait for the reports.
    report: Option<(Vec<u64>, usize, u64, Vec<usize>)>,
    /// Read-backs under way.
    readers: Vec<(usize, Reader)>,
    /// The round's inputs so far.
    inputs: Vec<(usize, Input)>,
}

impl BatchRun {
    /// Whether the round has every input.
    fn round_over(&self) -> bool {
        self.asks.is_empty()
            && self.writes.is_empty()
            && self.sleep.is_none()
            && self.report.is_none()
            && self.readers.is_empty()
    }
}

/// A batch get under way: the client's REAL batch get protocol
/// ([`BatchGet`]: the location cache's entries first, the other keys in one
/// `BatchGet`, a stale entry's key asked in a second pass), each read by a
/// [`Reader`] over the engine's read rules; a pass's reads side by side,
/// those through the cache and those of the answer each until their
/// group's earliest window's end, as `Client::batch_get` runs them.
#[derive(Debug)]
struct BatchGetRun {
    keys: Vec<Vec<u8>>,
    batch: BatchGet<Duration>,
    /// The `BatchGet` out: its id and the places it asks for.
    asking: Option<(u64, Vec<usize>)>,
    /// The pass's reads under way: each key's place and its reader.
    readers: Vec<(usize, Reader)>,
}

/// A read's end as the batch get protocol takes it.
fn outcome(res: ReadResult) -> Result<(), KvError> {
    res.map(|_| ())
        .map_err(|code| KvError::new(code, "the read failed"))
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
    /// Where the objects it read lie, while their leases last.
    locations: Locations<Duration>,
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
            locations: Locations::new(LOCATION_ENTRIES),
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

    /// The call under way and what a read needs of this client.
    fn op_env(&mut self) -> (&mut Op, Env<'_>) {
        let o = self.op.as_mut().expect("a call");
        let env = Env {
            me: Addr::Client(self.idx),
            idx: self.idx,
            checksums: self.checksums,
            host: &self.host,
            deadline: o.deadline,
            suspects: &mut self.suspects,
            locations: &self.locations,
        };
        (o, env)
    }

    /// The call under way's reader and what a read needs of this client.
    fn reading(&mut self) -> (&mut Reader, Env<'_>) {
        let (o, env) = self.op_env();
        (o.reader.as_mut().expect("a read under way"), env)
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
        if matches!(o.stage, Stage::Batch) && !matches!(t, Timer::ClientDeadline(_)) {
            return self.batch_timer(t, ctx);
        }
        match t {
            Timer::ClientPing => self.ping(ctx),
            Timer::ClientDeadline(op) if o.id == op => {
                // The put may be half done: its space back, best effort.
                let deadline = KvError::new(ErrorCode::Timeout, "the call's deadline");
                if let Some(revoke) = o.put.as_mut().and_then(|p| p.revoke_after(&deadline)) {
                    ctx.ask(me, revoke);
                }
                if let Some(b) = o.batch.as_mut() {
                    for revoke in b.batch.revokes(Some(&deadline)) {
                        ctx.ask(me, revoke);
                    }
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
            Timer::ClientReadShare(id) if matches!(o.stage, Stage::BatchGet) => {
                self.batch_get_read(id, None, ctx);
            }
            Timer::ClientReadShare(id) if matches!(o.stage, Stage::Reading) => {
                let (reader, mut env) = self.reading();
                if let Some(res) = reader.on_share(id, &mut env, ctx) {
                    self.got(ctx, res);
                }
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

    fn put_options(ctx: &mut Ctx) -> PutOptions {
        PutOptions {
            replicas: ctx.rng.random_range(1..=2),
            replace: ctx.rng.random_ratio(2, 3),
            soft_pin_ttl_ms: if ctx.rng.random_ratio(1, 5) { 300 } else { 0 },
            hard_pin: ctx.rng.random_ratio(1, 30),
            preferred_host: format!("host-{}", ctx.rng.random_range(0..3)),
            put_id: 0,
        }
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
            stage: Stage::Reading,
            put: None,
            tag: 0,
            reading_back: false,
            reader: None,
            batch: None,
            batch_get: None,
            changes: Vec::new(),
        };
        ctx.timer(self.me(), CLIENT_TIMEOUT_MS, Timer::ClientDeadline(id));
        let budget = Duration::from_millis(CLIENT_TIMEOUT_MS);
        match ctx.rng.random_range(0..100) {
            0..=29 => {
                op.tag = ctx.new_tag(&k);
                let len = LENS[ctx.rng.random_range(0..LENS.len())];
                let opts = Self::put_options(ctx);
                let mut put = PutProtocol::new(self.id, k, len, opts, budget);
                let a = put.begin(&self.put_ids);
                op.put = Some(put);
                op.changes = vec![op.key.clone()];
                self.op = Some(op);
                self.drive(a, ctx);
            }
            30..=39 => {
                // A batch put of 2-4 keys (now and then one twice).
                let n = ctx.rng.random_range(2..=4);
                let keys: Vec<Vec<u8>> =
                    (0..n).map(|_| key(ctx.rng.random_range(0..KEYS))).collect();
                let tags = keys.iter().map(|k| ctx.new_tag(k)).collect();
                let lens: Vec<(&[u8], u64)> = keys
                    .iter()
                    .map(|k| (k.as_slice(), LENS[ctx.rng.random_range(0..LENS.len())]))
                    .collect();
                let opts = Self::put_options(ctx);
                let mut batch = BatchPut::new(self.id, &lens, &opts, budget);
                let round = batch.begin(&OneId(self.put_ids.next()));
                ctx.stats.batch_puts += 1;
                op.stage = Stage::Batch;
                op.changes = keys.clone();
                op.batch = Some(Box::new(BatchRun {
                    batch,
                    keys,
                    tags,
                    asks: Vec::new(),
                    writes: Vec::new(),
                    sleep: None,
                    report: None,
                    readers: Vec::new(),
                    inputs: Vec::new(),
                }));
                self.op = Some(op);
                self.batch_round(round, ctx);
            }
            85..=89 => {
                // A batch get of 2-4 keys (now and then one twice).
                let n = ctx.rng.random_range(2..=4);
                let keys: Vec<Vec<u8>> =
                    (0..n).map(|_| key(ctx.rng.random_range(0..KEYS))).collect();
                let ks: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                let batch = BatchGet::start(&ks, &self.locations, at(ctx));
                ctx.stats.batch_gets += 1;
                op.stage = Stage::BatchGet;
                op.batch_get = Some(Box::new(BatchGetRun {
                    keys,
                    batch,
                    asking: None,
                    readers: Vec::new(),
                }));
                self.op = Some(op);
                self.batch_get_pass(ctx);
            }
            40..=84 => {
                self.op = Some(op);
                let (o, mut env) = self.op_env();
                let (reader, res) = Reader::start(k, true, &mut env, ctx);
                o.reader = Some(reader);
                if let Some(res) = res {
                    self.got(ctx, res);
                }
            }
            _ => {
                op.stage = Stage::Removing;
                op.changes = vec![k.clone()];
                let force = ctx.rng.random_ratio(1, 3);
                // The client's typed call (its answer read as `Client::remove_with` reads it).
                op.awaiting = ctx.ask(self.me(), call::Remove { key: k, force }.into());
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
                let ids = send_writes(me, &replicas, o.tag, ctx);
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
                o.stage = Stage::Reading;
                let key = o.key.clone();
                let (o, mut env) = self.op_env();
                let (reader, _) = Reader::start(key, false, &mut env, ctx);
                o.reader = Some(reader);
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
        // As the client's `OnDrop`: a change's keys are forgotten when it
        // is over, however it ended.
        for k in &o.changes {
            self.locations.forget(k);
        }
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
    fn got(&mut self, ctx: &mut Ctx, res: ReadResult) {
        let o = self.op.as_mut().expect("a get");
        o.reader = None;
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
        let Some(o) = self.op.as_ref() else { return };
        if matches!(o.stage, Stage::Batch) {
            return self.batch_msg(m.body, ctx);
        }
        if matches!(o.stage, Stage::BatchGet) {
            return self.batch_get_msg(m.body, ctx);
        }
        let reader = o.reader.as_ref();
        match m.body {
            Body::Resp { id, res } if reader.is_some_and(|r| r.awaiting == id) => {
                let (reader, mut env) = self.reading();
                if let Some(res) = reader.on_answer(res, &mut env, ctx) {
                    self.got(ctx, res);
                }
            }
            Body::Resp { id, res } if o.awaiting == id => self.on_answer(res, ctx),
            Body::Data { id, res } if reader.is_some_and(|r| r.reads(id)) => {
                let (reader, mut env) = self.reading();
                if let Some(res) = reader.on_data(res, &mut env, ctx) {
                    self.got(ctx, res);
                }
            }
            Body::Data { id, res } => self.on_written(id, res, ctx),
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
            (Stage::Removing, r) => {
                self.end(ctx, r.and_then(call::Remove::reply).map_err(|e| e.code))
            }
            (_, r) => self.end(ctx, r.map(|_| ()).map_err(|e| e.code)),
        }
    }

    /// A node's answer to one of a single put's writes.
    fn on_written(&mut self, id: u64, res: ReadResult, ctx: &mut Ctx) {
        let Some(o) = self.op.as_mut() else { return };
        let Stage::Writing(_, ids) = &mut o.stage else {
            return;
        };
        let Some(seg) = ids.iter().find(|w| w.0 == id).map(|w| w.1) else {
            return;
        };
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

    // A batch get: the real `BatchGet`'s passes, carried out here.

    /// The batch get's next pass: its asks out, else its reads side by
    /// side; the call ends once every key's get has.
    fn batch_get_pass(&mut self, ctx: &mut Ctx) {
        loop {
            let (o, mut env) = self.op_env();
            let b = o.batch_get.as_mut().expect("a batch get");
            if b.batch.done() {
                return self.batch_get_end(ctx);
            }
            let asks = b.batch.asks();
            if !asks.is_empty() {
                let keys = asks.iter().map(|&i| b.keys[i].clone()).collect();
                let id = ctx.ask(env.me, MasterRequest::BatchGet { keys });
                b.asking = Some((id, asks));
                return;
            }
            let reads = b.batch.reads();
            let end = |cached: bool| {
                reads
                    .iter()
                    .filter(|r| r.cached == cached)
                    .map(|r| r.until)
                    .min()
                    .unwrap_or(Duration::ZERO)
            };
            let (cached_end, asked_end) = (end(true), end(false));
            let mut over = Vec::new();
            for r in reads {
                let until = if r.cached { cached_end } else { asked_end };
                let key = b.keys[r.index].clone();
                match Reader::of(key, r.replicas, until, &mut env, ctx) {
                    (_, Some(res)) => over.push((r.index, res)),
                    (reader, None) => b.readers.push((r.index, reader)),
                }
            }
            let ks: Vec<&[u8]> = b.keys.iter().map(|k| &k[..]).collect();
            for (i, res) in over {
                b.batch.read(&ks, env.locations, i, outcome(res), at(ctx));
            }
            if !b.readers.is_empty() {
                return;
            }
        }
    }

    /// A message for the batch get: the master's answer to its asks, or a
    /// node's to one of its reads.
    fn batch_get_msg(&mut self, body: Body, ctx: &mut Ctx) {
        match body {
            Body::Resp { id, res } => {
                let (o, env) = self.op_env();
                let b = o.batch_get.as_mut().expect("a batch get");
                let Some((_, asked)) = b.asking.take_if(|a| a.0 == id) else {
                    return;
                };
                // As the client's typed call: the call's error, or an
                // answer of another kind, is the batch's.
                let lists = match res.and_then(call::BatchGet::reply) {
                    Ok(v) => v.into_iter().map(Result::from).collect(),
                    Err(e) => return self.end(ctx, Err(e.code)),
                };
                let ks: Vec<&[u8]> = b.keys.iter().map(|k| &k[..]).collect();
                let rules = answers(env.checksums);
                b.batch
                    .answered(&ks, env.locations, &asked, lists, rules, at(ctx));
                self.batch_get_pass(ctx);
            }
            Body::Data { id, res } => self.batch_get_read(id, Some(res), ctx),
            _ => {}
        }
    }

    /// A node's answer to the batch get's read `id` (`None`: its share of
    /// the time passed).
    fn batch_get_read(&mut self, id: u64, res: Option<ReadResult>, ctx: &mut Ctx) {
        let (o, mut env) = self.op_env();
        let b = o.batch_get.as_mut().expect("a batch get");
        let Some(j) = b.readers.iter().position(|(_, r)| r.reads(id)) else {
            return;
        };
        let reader = &mut b.readers[j].1;
        let over = match res {
            Some(res) => reader.on_data(res, &mut env, ctx),
            None => reader.on_share(id, &mut env, ctx),
        };
        let Some(res) = over else {
            return;
        };
        let (i, _) = b.readers.remove(j);
        let ks: Vec<&[u8]> = b.keys.iter().map(|k| &k[..]).collect();
        b.batch.read(&ks, env.locations, i, outcome(res), at(ctx));
        if b.readers.is_empty() {
            self.batch_get_pass(ctx);
        }
    }

    /// Every key's get ended: the call's end.
    fn batch_get_end(&mut self, ctx: &mut Ctx) {
        let o = self.op.as_mut().expect("a batch get");
        let b = o.batch_get.take().expect("a batch get");
        let (out, hits) = b.batch.finish().expect("done");
        ctx.stats.location_hits += hits as u64;
        ctx.stats.gets_ok += out.iter().filter(|r| r.is_ok()).count() as u64;
        self.end(ctx, Ok(()));
    }

    // A batch put: the real `BatchPut`'s rounds, carried out here.

    fn batch_run(&mut self) -> &mut BatchRun {
        let o = self.op.as_mut().expect("a batch put under way");
        o.batch.as_mut().expect("a batch put under way")
    }

    /// Carries out `round`, or ends the call when there is none.
    fn batch_round(&mut self, round: Option<Round>, ctx: &mut Ctx) {
        let me = self.me();
        let Some(round) = round else {
            let o = self.op.as_mut().expect("a batch put under way");
            let b = o.batch.take().expect("a batch put under way");
            ctx.stats.puts_ok += b.batch.results().iter().filter(|r| r.is_ok()).count() as u64;
            return self.end(ctx, Ok(()));
        };
        let o = self.op.as_mut().expect("a batch put under way");
        let start = o.start;
        let b = o.batch.as_mut().expect("a batch put under way");
        for ask in round.asks {
            let id = ctx.ask(me, ask.req.clone());
            b.asks.push((id, ask));
        }
        for (by, group) in round.writes {
            let timer = ctx.id();
            let mut items = Vec::new();
            for (i, replicas) in group {
                let ids = send_writes(me, &replicas, b.tags[i], ctx);
                if ids.is_empty() {
                    let checksum = self.checksums.then_some(sum_of(Some(b.tags[i])));
                    b.inputs.push((i, Input::Written(Ok(checksum))));
                } else {
                    items.push((i, ids));
                }
            }
            if !items.is_empty() {
                let until = (start + ms(by)).saturating_sub(ctx.now);
                ctx.timer(me, until, Timer::ClientWriteBy(timer));
                b.writes.push((timer, items));
            }
        }
        if let Some((pause, who)) = round.sleep {
            ctx.stats.put_pauses += 1;
            let t = ctx.id();
            ctx.timer(me, ms(pause).max(1), Timer::ClientWake(t));
            b.sleep = Some((t, who));
        }
        if !round.reporters.is_empty() {
            ctx.stats.put_reports += 1;
            let left = self.suspects.take_unreachable();
            let n = left.len();
            b.report = Some((left, n, 0, round.reporters));
        }
        for i in round.readers {
            ctx.stats.put_readbacks += 1;
            let (b, mut env) = self.batch_env();
            let (r, _) = Reader::start(b.keys[i].clone(), false, &mut env, ctx);
            b.readers.push((i, r));
        }
        self.batch_report_next(ctx);
        self.batch_check(ctx);
    }

    /// Sends the batch's next report, or hands its items how many went.
    fn batch_report_next(&mut self, ctx: &mut Ctx) {
        let me = self.me();
        let client_id = self.id;
        let b = self.batch_run();
        let Some((left, n, awaiting, who)) = b.report.as_mut() else {
            return;
        };
        match left.pop() {
            Some(segment_id) => {
                let req = MasterRequest::ReportUnreachable {
                    client_id,
                    segment_id,
                };
                *awaiting = ctx.ask(me, req);
            }
            None => {
                let n = *n;
                let who = std::mem::take(who);
                b.report = None;
                b.inputs
                    .extend(who.into_iter().map(|i| (i, Input::Reported(n))));
            }
        }
    }

    /// Feeds the round's inputs once it has them all; the next round.
    fn batch_check(&mut self, ctx: &mut Ctx) {
        let o = self.op.as_mut().expect("a batch put under way");
        let now = Duration::from_millis(ctx.now - o.start);
        let b = o.batch.as_mut().expect("a batch put under way");
        if !b.round_over() {
            return;
        }
        let inputs = std::mem::take(&mut b.inputs);
        let ids = OneId(self.put_ids.next());
        let round = b.batch.feed(now, &ids, inputs);
        self.batch_round(round, ctx);
    }

    /// A read-back's answer or end.
    fn batch_read(&mut self, at_i: usize, res: Option<ReadResult>, ctx: &mut Ctx) {
        let Some(res) = res else { return };
        let b = self.batch_run();
        let (i, _) = b.readers.remove(at_i);
        let holds = res == Ok(Some(b.tags[i]));
        b.inputs.push((i, Input::Held(holds)));
        self.batch_check(ctx);
    }

    fn batch_env(&mut self) -> (&mut BatchRun, Env<'_>) {
        let (o, env) = self.op_env();
        (o.batch.as_mut().expect("a batch put under way"), env)
    }

    fn batch_msg(&mut self, body: Body, ctx: &mut Ctx) {
        match body {
            Body::Resp { id, res } => {
                let b = self.batch_run();
                if let Some(at) = b.asks.iter().position(|a| a.0 == id) {
                    let (_, ask) = b.asks.remove(at);
                    b.inputs.extend(ask.inputs(res));
                    return self.batch_check(ctx);
                }
                if b.report.as_ref().is_some_and(|r| r.2 == id) {
                    self.batch_report_next(ctx);
                    return self.batch_check(ctx);
                }
                if let Some(at) = b.readers.iter().position(|r| r.1.awaiting == id) {
                    let (b, mut env) = self.batch_env();
                    let res = b.readers[at].1.on_answer(res, &mut env, ctx);
                    self.batch_read(at, res, ctx);
                }
            }
            Body::Data { id, res } => {
                let b = self.batch_run();
                if let Some(at) = b.readers.iter().position(|r| r.1.reads(id)) {
                    let (b, mut env) = self.batch_env();
                    let res = b.readers[at].1.on_data(res, &mut env, ctx);
                    return self.batch_read(at, res, ctx);
                }
                self.batch_written(id, res, ctx);
            }
            _ => {}
        }
    }

    /// A node's answer to one of the round's writes: an item is written
    /// once all its writes are; its first error ends its writes.
    fn batch_written(&mut self, id: u64, res: ReadResult, ctx: &mut Ctx) {
        let checksums = self.checksums;
        let b = self.batch_run();
        let found = b.writes.iter().enumerate().find_map(|(g, (_, items))| {
            items
                .iter()
                .enumerate()
                .find_map(|(n, (_, ids))| ids.iter().position(|w| w.0 == id).map(|w| (g, n, w)))
        });
        let Some((g, n, w)) = found else { return };
        let (i, ids) = &mut b.writes[g].1[n];
        let (i, (_, seg)) = (*i, ids.remove(w));
        let input = match res {
            Err(code) => {
                let e = KvError::new(code, format!("a write to segment {seg:016x} failed"));
                Some(Err(e))
            }
            Ok(_) if ids.is_empty() => Some(Ok(checksums.then_some(sum_of(Some(b.tags[i]))))),
            Ok(_) => None,
        };
        let Some(written) = input else { return };
        b.writes[g].1.remove(n);
        if b.writes[g].1.is_empty() {
            b.writes.remove(g);
        }
        if let Err(e) = &written {
            let now = at(ctx);
            self.suspects.note(seg, e, now);
        }
        let b = self.batch_run();
        b.inputs.push((i, Input::Written(written)));
        self.batch_check(ctx);
    }

    fn batch_timer(&mut self, t: Timer, ctx: &mut Ctx) {
        match t {
            Timer::ClientPing => self.ping(ctx),
            Timer::ClientWake(id) => {
                let b = self.batch_run();
                if b.sleep.as_ref().is_some_and(|s| s.0 == id) {
                    let (_, who) = b.sleep.take().expect("checked");
                    b.inputs.extend(who.into_iter().map(|i| (i, Input::Woke)));
                    self.batch_check(ctx);
                }
            }
            Timer::ClientWriteBy(timer) => {
                let b = self.batch_run();
                let Some(g) = b.writes.iter().position(|w| w.0 == timer) else {
                    return;
                };
                // As the engine: every write of the group not done by its
                // time fails; the first one out names its node.
                let (_, items) = b.writes.remove(g);
                let e = KvError::new(ErrorCode::Timeout, "a write did not finish by its time");
                let first = items.first().and_then(|(_, ids)| ids.first()).map(|w| w.1);
                b.inputs.extend(
                    items
                        .into_iter()
                        .map(|(i, _)| (i, Input::Written(Err(e.clone())))),
                );
                if let Some(seg) = first {
                    self.suspects.note(seg, &e, at(ctx));
                }
                self.batch_check(ctx);
            }
            Timer::ClientReadShare(id) => {
                let b = self.batch_run();
                if let Some(at) = b.readers.iter().position(|r| r.1.reads(id)) {
                    let (b, mut env) = self.batch_env();
                    let res = b.readers[at].1.on_share(id, &mut env, ctx);
                    self.batch_read(at, res, ctx);
                }
            }
            _ => {}
        }
    }
}

/// Sends a value's writes to its replicas' nodes: (id, segment) of each
/// sent (a replica whose segment no node serves is skipped).
fn send_writes(me: Addr, replicas: &[ReplicaDesc], tag: u64, ctx: &mut Ctx) -> Vec<(u64, u64)> {
    let mut ids = Vec::new();
    for r in replicas {
        let Some(&n) = ctx.seg_node.get(&r.segment_id) else {
            continue;
        };
        let id = ctx.id();
        ids.push((id, r.segment_id));
        let body = Body::Write {
            id,
            req: DataRequest::Write {
                segment_id: r.segment_id,
                offset: r.offset,
                len: r.len,
                grant: r.grant,
            },
            content: Some(tag),
        };
        ctx.send(me, Addr::Node(n), body);
    }
    ids
}
