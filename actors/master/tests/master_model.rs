//! Property test: random sequences of put/replace/end/revoke/get/exist/
//! remove/remove-all/unmount/time advances against a plain reference model (a
//! `HashMap` of objects, one of replaces under way beside a complete object,
//! and a list of reserved extents). After every step it checks that
//!
//! * no two live replicas overlap in memory (an allocation never lands on an
//!   extent the model holds: live objects, leased removals, quarantined puts),
//! * no leased or hard-pinned object is evicted, and no leased space reused,
//! * eviction takes a segment's replicas in rank order: no replica it could
//!   have taken (complete, lease ended, a lease past its put, not hard-pinned) ranks before one it
//!   took, unpinned before soft-pinned and the oldest lease first (checked
//!   in every step that does not move the clock; soft pins end with time),
//! * every complete object with a live segment is still readable (or was
//!   evicted legally), with the replicas the model expects,
//! * the answers the model can predict (codes, `Exist`, `RemoveAll` counts,
//!   `TryAgain` for a replace that meets another writer, the key limit that
//!   a replace of a stored key is not refused for) are the answers the
//!   master gives; a replace is read as the old object until its PutEnd and
//!   as the new one after, and the old object's space is held for its lease,
//! * the master's own space accounting holds (`ShardState::check_invariants`:
//!   used bytes equal the extents held, none overlapping, all in range).
//!
//! A failure prints the seed; `KVPOOL_MODEL_SEED=<seed>` replays that case.

use std::collections::HashMap;

use kvpool_config::{MasterConfig, Placement};
use kvpool_master::core::MasterCore;
use kvpool_wire::proto::{
    Endpoint, MasterRequest as Q, MasterResponse as A, PutOptions, SegmentId, SegmentSpec,
};
use kvpool_wire::ErrorCode;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const OWNER: u64 = 1_000;
const CLIENTS: [u64; 2] = [1, 2];
const KEYS: usize = 24;
const ALIGN: u64 = 64;

fn rounded(len: u64) -> u64 {
    len.max(1).next_multiple_of(ALIGN)
}

#[derive(Debug, Clone)]
enum State {
    Processing {
        writer: u64,
        started: u64,
    },
    Complete {
        lease_until: u64,
        /// A lease after the put: not evicted before (a put is a use; no
        /// segment of the model has an NVMe tier).
        kept_until: u64,
        hard_pin: bool,
        /// When the soft pin ends (0: none).
        pin_until: u64,
    },
}

#[derive(Debug, Clone)]
struct Obj {
    state: State,
    size: u64,
    /// (segment, offset)
    replicas: Vec<(SegmentId, u64)>,
    hard_pin: bool,
    /// The soft pin asked for, from PutEnd on.
    soft_pin_ms: u64,
}

/// An extent that must not be handed out before `until`.
#[derive(Debug, Clone)]
struct Held {
    seg: SegmentId,
    off: u64,
    len: u64,
    until: u64,
}

struct Model {
    /// What a key shows: its complete object, or its put under way.
    objs: HashMap<String, Obj>,
    /// Replaces under way (Processing) of keys whose complete object is in
    /// `objs`, until their PutEnd puts them there.
    replacing: HashMap<String, Obj>,
    held: Vec<Held>,
    segments: Vec<SegmentId>,
}

/// Events that must happen for the check to mean anything.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    puts: u64,
    evictions: u64,
    held_removals: u64,
    stale: u64,
    no_space: u64,
    /// PutEnds of a replace that took a complete object's place.
    replaced: u64,
    /// Replaces told to wait for another writer.
    try_again: u64,
    /// Puts refused for the key limit.
    key_limit: u64,
    /// Replaces of a stored key taken at the key limit.
    replace_at_limit: u64,
    /// Steps whose evictions were checked for rank order.
    ranked_evictions: u64,
    /// Evictions of soft-pinned replicas (pinned ones go last).
    pinned_evictions: u64,
}

struct Run {
    seen: Seen,
    m: MasterCore,
    model: Model,
    now: u64,
    cfg: MasterConfig,
    rng: ChaCha8Rng,
    next_segment: u32,
    seed: u64,
    /// The clock has moved during this step: evictions happened at other
    /// times than `now`, so their rank order is not checked.
    clock_moved: bool,
}

fn spec(name: &str, size: u64) -> SegmentSpec {
    SegmentSpec {
        name: name.into(),
        size,
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 1,
            nr_shards: 1,
        },
        slice_bytes: size,
        host_id: "h".into(),
        tier: kvpool_wire::proto::Tier::Dram,
        nvme: None,
    }
}

impl Run {
    fn new(seed: u64) -> Self {
        let cfg = MasterConfig {
            placement: Placement::Random,
            // Half the runs at a limit the keys reach (6 per shard).
            max_keys: if seed.is_multiple_of(2) { 1_000 } else { 12 },
            lease_ttl_ms: 2_000,
            put_timeout_ms: 6_000,
            stale_put_grace_ms: 3_000,
            client_ttl_ms: 10_000,
            ..Default::default()
        };
        let mut r = Self {
            seen: Seen::default(),
            m: MasterCore::new(2, &cfg, seed),
            model: Model {
                objs: HashMap::new(),
                replacing: HashMap::new(),
                held: Vec::new(),
                segments: Vec::new(),
            },
            now: 1,
            cfg,
            rng: ChaCha8Rng::seed_from_u64(seed),
            next_segment: 0,
            seed,
            clock_moved: false,
        };
        for _ in 0..2 {
            r.mount();
        }
        r
    }

    fn mount(&mut self) {
        let name = format!("seg-{}", self.next_segment);
        self.next_segment += 1;
        let size = 12 * 1024;
        match self.m.call(
            Q::MountSegment {
                client_id: OWNER,
                spec: spec(&name, size),
            },
            self.now,
        ) {
            Ok(A::Mounted { segment_id }) => self.model.segments.push(segment_id),
            other => panic!("seed {}: mount {other:?}", self.seed),
        }
    }

    fn fail(&self, what: String) -> ! {
        panic!("seed {}: {what}", self.seed)
    }

    /// Extents the model says are in use or held at `now`.
    fn reserved(&self) -> Vec<(SegmentId, u64, u64)> {
        let mut v: Vec<(SegmentId, u64, u64)> = self
            .model
            .objs
            .values()
            .chain(self.model.replacing.values())
            .flat_map(|o| {
                o.replicas
                    .iter()
                    .map(move |&(s, off)| (s, off, rounded(o.size)))
            })
            .collect();
        v.extend(
            self.model
                .held
                .iter()
                .filter(|h| h.until > self.now)
                .map(|h| (h.seg, h.off, h.len)),
        );
        v
    }

    fn key(&mut self) -> String {
        format!("key-{}", self.rng.random_range(0..KEYS))
    }

    /// Mostly a key the model holds complete (or, if not `complete`, being
    /// put), sometimes any key.
    fn key_where(&mut self, complete: bool) -> String {
        let mut ks: Vec<&String> = self
            .model
            .objs
            .iter()
            .filter(|(_, o)| matches!(o.state, State::Complete { .. }) == complete)
            .map(|(k, _)| k)
            .chain(self.model.replacing.keys().filter(|_| !complete))
            .collect();
        ks.sort();
        if ks.is_empty() || self.rng.random_ratio(1, 5) {
            return self.key();
        }
        ks[self.rng.random_range(0..ks.len())].clone()
    }

    /// Mostly the key's writer, sometimes another client.
    fn client_for(&mut self, key: &str) -> u64 {
        match self.processing_of(key) {
            Some(w) if self.rng.random_ratio(4, 5) => w,
            _ => CLIENTS[self.rng.random_range(0..CLIENTS.len())],
        }
    }

    fn step(&mut self) {
        let op = self.rng.random_range(0..100);
        if std::env::var_os("KVPOOL_MODEL_TRACE").is_some() {
            eprintln!(
                "now {} op {op} objs {:?} held {:?}",
                self.now, self.model.objs, self.model.held
            );
        }
        match op {
            0..=29 => self.put_start(),
            30..=44 => self.put_end(),
            45..=49 => self.put_revoke(),
            50..=64 => self.get(),
            65..=69 => self.exist(),
            70..=79 => self.remove(),
            80..=81 => self.remove_all(),
            82..=83 => self.unmount(),
            _ => self.advance(),
        }
        self.reconcile();
        self.clock_moved = false;
    }

    fn put_start(&mut self) {
        let replace = self.rng.random_ratio(1, 3);
        let key = if replace && self.rng.random_ratio(2, 3) {
            self.key_where(true)
        } else {
            self.key()
        };
        let client = CLIENTS[self.rng.random_range(0..CLIENTS.len())];
        // Few distinct sizes, so freed extents are reused exactly.
        let len = [1u64, 512, 1000, 1024, 2048][self.rng.random_range(0..5)];
        let replicas = self.rng.random_range(1..=2u32);
        let hard_pin = self.rng.random_ratio(1, 10);
        let soft = if self.rng.random_ratio(1, 5) {
            5_000
        } else {
            0
        };
        let res = self.m.call(
            Q::PutStart {
                client_id: client,
                key: key.clone().into_bytes(),
                len,
                opts: PutOptions {
                    replicas,
                    soft_pin_ttl_ms: soft,
                    hard_pin,
                    preferred_host: String::new(),
                    replace,
                    put_id: 0,
                },
            },
            self.now,
        );
        let complete = self.complete(&key);
        let writer = self.processing_of(&key);
        // What the master must answer before it looks for space.
        let want = match writer {
            Some(w) if replace && w != client => Some(ErrorCode::TryAgain),
            Some(_) => Some(ErrorCode::ObjectAlreadyExists),
            None if complete && !replace => Some(ErrorCode::ObjectAlreadyExists),
            None if !complete && self.entries_in_shard_of(&key) >= self.max_keys_per_shard() => {
                Some(ErrorCode::ResourceExhausted)
            }
            None => None,
        };
        let at_limit = self.entries_in_shard_of(&key) >= self.max_keys_per_shard();
        match (&res, want) {
            (Ok(_), None) if complete && at_limit => self.seen.replace_at_limit += 1,
            (Err(e), Some(w)) if e.code == w => {}
            (Err(e), None) if e.code == ErrorCode::NoSpace => {}
            (Ok(_), None) => {}
            (r, w) => self.fail(format!(
                "put_start {key} by {client} replace={replace} (complete {complete}, \
                 writer {writer:?}): {r:?}, model expects {w:?}"
            )),
        }
        match res {
            Ok(A::Replicas(reps)) => {
                if reps.is_empty() || reps.len() > replicas as usize {
                    self.fail(format!("{} replicas for {replicas} asked", reps.len()));
                }
                let mut segs: Vec<SegmentId> = reps.iter().map(|r| r.segment_id).collect();
                segs.sort();
                segs.dedup();
                if segs.len() != reps.len() {
                    self.fail(format!("replicas of {key} share a segment"));
                }
                let obj = Obj {
                    state: State::Processing {
                        writer: client,
                        started: self.now,
                    },
                    size: len,
                    replicas: reps.iter().map(|r| (r.segment_id, r.offset)).collect(),
                    hard_pin,
                    soft_pin_ms: soft,
                };
                // The put may have evicted (legally) to make room, the object
                // it replaces too: learn that first (with the put in place),
                // then nothing else the model still holds may be reused.
                self.add_put(&key, obj);
                self.reconcile();
                let obj = self
                    .model
                    .replacing
                    .remove(&key)
                    .or_else(|| self.model.objs.remove(&key))
                    .expect("the put just made");
                let reserved = self.reserved();
                for r in &reps {
                    if !self.model.segments.contains(&r.segment_id) {
                        self.fail(format!("{key} placed on unmounted segment"));
                    }
                    let (a, b) = (r.offset, r.offset + rounded(len));
                    for &(s, off, l) in &reserved {
                        if s == r.segment_id && a < off + l && off < b {
                            self.fail(format!(
                                "{key} at {a}..{b} overlaps a held or live extent {off}..{}",
                                off + l
                            ));
                        }
                    }
                }
                self.seen.puts += 1;
                self.add_put(&key, obj);
            }
            Ok(other) => self.fail(format!("put_start {key}: {other:?}")),
            Err(e) => match e.code {
                ErrorCode::NoSpace => self.seen.no_space += 1,
                ErrorCode::TryAgain => self.seen.try_again += 1,
                ErrorCode::ResourceExhausted => self.seen.key_limit += 1,
                _ => {}
            },
        }
    }

    /// A put just started: beside the key's complete object (a replace), or
    /// what the key shows.
    fn add_put(&mut self, key: &str, obj: Obj) {
        if self.complete(key) {
            self.model.replacing.insert(key.to_string(), obj);
        } else {
            self.model.objs.insert(key.to_string(), obj);
        }
    }

    fn complete(&self, key: &str) -> bool {
        matches!(
            self.model.objs.get(key).map(|o| &o.state),
            Some(State::Complete { .. })
        )
    }

    /// The writer of the key's put under way (a replace, or a first put).
    fn processing_of(&self, key: &str) -> Option<u64> {
        let o = self.model.replacing.get(key).or(self.model.objs.get(key));
        match o.map(|o| &o.state) {
            Some(State::Processing { writer, .. }) => Some(*writer),
            _ => None,
        }
    }

    fn max_keys_per_shard(&self) -> usize {
        self.cfg.max_keys.div_ceil(self.m.shards.len() as u64) as usize
    }

    /// Objects the key's shard holds, complete and Processing (a key being
    /// replaced has one of each).
    fn entries_in_shard_of(&self, key: &str) -> usize {
        let s = self.m.shard_of(key.as_bytes());
        let m = &self.model;
        m.objs
            .keys()
            .chain(m.replacing.keys())
            .filter(|k| self.m.shard_of(k.as_bytes()) == s)
            .count()
    }

    /// Holds a complete object's extents until its lease ends (it was
    /// removed or replaced; a reader may still be copying it).
    fn retire(&mut self, o: &Obj) {
        let State::Complete { lease_until, .. } = o.state else {
            self.fail(format!("retiring a processing object {o:?}"));
        };
        if lease_until > self.now {
            self.seen.held_removals += 1;
            for &(seg, off) in &o.replicas {
                self.model.held.push(Held {
                    seg,
                    off,
                    len: rounded(o.size),
                    until: lease_until,
                });
            }
        }
    }

    /// The key's complete object is gone (removed, evicted, unmounted): a
    /// replace under way is now what the key shows.
    fn complete_gone(&mut self, key: &str) {
        self.model.objs.remove(key);
        if let Some(p) = self.model.replacing.remove(key) {
            self.model.objs.insert(key.to_string(), p);
        }
    }

    fn put_end(&mut self) {
        let key = self.key_where(false);
        let client = self.client_for(&key);
        let res = self.m.call(
            Q::PutEnd {
                client_id: client,
                put_id: 0,
                key: key.clone().into_bytes(),
                checksum: None,
            },
            self.now,
        );
        match (self.processing_of(&key), res) {
            (Some(w), Ok(_)) if w == client => {
                let mut o = match self.model.replacing.remove(&key) {
                    Some(new) => {
                        let old = self.model.objs.remove(&key).expect("replaced");
                        self.retire(&old);
                        self.seen.replaced += 1;
                        new
                    }
                    None => self.model.objs.remove(&key).expect("present"),
                };
                o.state = State::Complete {
                    lease_until: self.now,
                    kept_until: self.now + self.cfg.lease_ttl_ms,
                    hard_pin: o.hard_pin,
                    pin_until: if o.soft_pin_ms > 0 {
                        self.now + o.soft_pin_ms
                    } else {
                        0
                    },
                };
                self.model.objs.insert(key, o);
            }
            (Some(w), Err(e)) if w != client && e.code == ErrorCode::IllegalClient => {}
            (None, Err(e))
                if matches!(
                    e.code,
                    ErrorCode::ObjectNotFound | ErrorCode::ObjectAlreadyExists
                ) => {}
            (p, r) => self.fail(format!("put_end {key} by {client} (writer {p:?}): {r:?}")),
        }
    }

    fn put_revoke(&mut self) {
        let key = self.key_where(false);
        let client = self.client_for(&key);
        let res = self.m.call(
            Q::PutRevoke {
                client_id: client,
                put_id: 0,
                key: key.clone().into_bytes(),
            },
            self.now,
        );
        match (self.processing_of(&key), res) {
            (Some(w), Ok(_)) if w == client => {
                // A revoked replace leaves the object it would have replaced.
                if self.model.replacing.remove(&key).is_none() {
                    self.model.objs.remove(&key);
                }
            }
            (Some(w), Err(e)) if w != client && e.code == ErrorCode::IllegalClient => {}
            (None, Err(e))
                if matches!(
                    e.code,
                    ErrorCode::ObjectNotFound | ErrorCode::ObjectAlreadyExists
                ) => {}
            (p, r) => self.fail(format!(
                "put_revoke {key} by {client} (writer {p:?}): {r:?}"
            )),
        }
    }

    fn get(&mut self) {
        let key = self.key_where(true);
        let res = self.m.call(
            Q::GetReplicaList {
                key: key.clone().into_bytes(),
            },
            self.now,
        );
        let now = self.now;
        let ttl = self.cfg.lease_ttl_ms;
        match (self.model.objs.get_mut(&key), res) {
            (Some(o), Ok(A::Replicas(reps))) => match &mut o.state {
                State::Complete { lease_until, .. } => {
                    *lease_until = (*lease_until).max(now + ttl);
                    let got: Vec<(SegmentId, u64)> =
                        reps.iter().map(|r| (r.segment_id, r.offset)).collect();
                    let mut want = o.replicas.clone();
                    want.sort();
                    let mut got_s = got.clone();
                    got_s.sort();
                    if got_s != want {
                        let msg = format!("get {key}: replicas {got:?}, model {want:?}");
                        self.fail(msg);
                    }
                }
                State::Processing { .. } => self.fail(format!("get of processing {key} succeeded")),
            },
            (Some(o), Err(e)) => {
                if !(matches!(o.state, State::Processing { .. })
                    && e.code == ErrorCode::ReplicaNotReady)
                {
                    let msg = format!("get {key} ({:?}): {e}", o.state);
                    self.fail(msg);
                }
            }
            (None, Err(e)) if e.code == ErrorCode::ObjectNotFound => {}
            (o, r) => {
                let msg = format!("get {key} (model {o:?}): {r:?}");
                self.fail(msg)
            }
        }
    }

    fn exist(&mut self) {
        let key = self.key();
        let want = matches!(
            self.model.objs.get(&key).map(|o| &o.state),
            Some(State::Complete { .. })
        );
        match self.m.call(
            Q::Exist {
                key: key.clone().into_bytes(),
            },
            self.now,
        ) {
            Ok(A::Exists(b)) if b == want => {}
            other => self.fail(format!("exist {key}: {other:?}, model says {want}")),
        }
    }

    fn remove(&mut self) {
        let key = self.key_where(true);
        let force = self.rng.random_ratio(1, 3);
        let res = self.m.call(
            Q::Remove {
                key: key.clone().into_bytes(),
                force,
            },
            self.now,
        );
        let now = self.now;
        match (self.model.objs.get(&key).cloned(), res) {
            (Some(o), r) => match o.state {
                State::Processing { .. } => {
                    if !matches!(&r, Err(e) if e.code == ErrorCode::ReplicaNotReady) {
                        self.fail(format!("remove of processing {key}: {r:?}"));
                    }
                }
                State::Complete { lease_until, .. } => {
                    let leased = lease_until > now;
                    match r {
                        Ok(_) if force || !leased => {
                            // A replace under way goes on (and completes).
                            self.complete_gone(&key);
                            self.retire(&o);
                        }
                        Err(e) if leased && !force && e.code == ErrorCode::ObjectHasLease => {}
                        r => {
                            self.fail(format!("remove {key} force={force} leased={leased}: {r:?}"))
                        }
                    }
                }
            },
            (None, Err(e)) if e.code == ErrorCode::ObjectNotFound => {}
            (None, r) => self.fail(format!("remove of missing {key}: {r:?}")),
        }
    }

    fn remove_all(&mut self) {
        let now = self.now;
        let gone: Vec<String> = self
            .model
            .objs
            .iter()
            .filter(|(_, o)| matches!(o.state, State::Complete { lease_until, .. } if lease_until <= now))
            .map(|(k, _)| k.clone())
            .collect();
        match self.m.call(Q::RemoveAll { force: false }, now) {
            Ok(A::Removed(n)) if n == gone.len() as u64 => {
                for k in gone {
                    self.complete_gone(&k);
                }
            }
            other => self.fail(format!(
                "remove_all: {other:?}, model expects {}",
                gone.len()
            )),
        }
    }

    fn unmount(&mut self) {
        if self.model.segments.is_empty() {
            return;
        }
        let i = self.rng.random_range(0..self.model.segments.len());
        let seg = self.model.segments.remove(i);
        self.m
            .call(
                Q::UnmountSegment {
                    client_id: OWNER,
                    segment_id: seg,
                },
                self.now,
            )
            .unwrap_or_else(|e| self.fail(format!("unmount: {e}")));
        self.model.replacing.retain(|_, o| {
            o.replicas.retain(|r| r.0 != seg);
            !o.replicas.is_empty()
        });
        let mut gone = Vec::new();
        for (k, o) in self.model.objs.iter_mut() {
            o.replicas.retain(|r| r.0 != seg);
            if o.replicas.is_empty() {
                gone.push(k.clone());
            }
        }
        for k in gone {
            self.complete_gone(&k);
        }
        self.model.held.retain(|h| h.seg != seg);
        self.mount();
    }

    fn advance(&mut self) {
        self.clock_moved = true;
        let ms = self.rng.random_range(1..=4_000u64);
        let target = self.now + ms;
        while self.now < target {
            self.now = (self.now + 1000).min(target);
            self.m
                .call(
                    Q::Ping {
                        client_id: OWNER,
                        segments: Vec::new(),
                    },
                    self.now,
                )
                .unwrap_or_else(|e| self.fail(format!("ping: {e}")));
            // Stale puts are discarded at housekeeping; their space is held
            // for the grace, since the writer may still be sending.
            let (timeout, grace, now) = (
                self.cfg.put_timeout_ms,
                self.cfg.stale_put_grace_ms,
                self.now,
            );
            let is_stale = |o: &Obj| matches!(o.state, State::Processing { started, .. } if now - started >= timeout);
            let stale: Vec<Obj> = self
                .model
                .objs
                .extract_if(|_, o| is_stale(o))
                .chain(self.model.replacing.extract_if(|_, o| is_stale(o)))
                .map(|(_, o)| o)
                .collect();
            for o in stale {
                self.seen.stale += 1;
                for (seg, off) in o.replicas {
                    self.model.held.push(Held {
                        seg,
                        off,
                        len: rounded(o.size),
                        until: now + grace,
                    });
                }
            }
            self.m.tick(self.now);
        }
        let now = self.now;
        self.model.held.retain(|h| h.until > now);
    }

    /// Eviction is the master's choice: find what it evicted and check that
    /// each eviction was allowed; check what remains matches the model.
    fn reconcile(&mut self) {
        for (i, sh) in self.m.shards.iter().enumerate() {
            if let Err(e) = sh.check_invariants() {
                panic!("shard {i} at {} ms: {e}", self.now);
            }
        }
        // (segment, rank, key) of every replica evicted since the last look.
        let mut evicted: Vec<(SegmentId, (bool, u64), String)> = Vec::new();
        let keys: Vec<String> = self.model.objs.keys().cloned().collect();
        for key in keys {
            let o = self.model.objs[&key].clone();
            let res = self.m.call(
                Q::Describe {
                    key: key.clone().into_bytes(),
                },
                self.now,
            );
            let info = match res {
                Ok(A::Described(i)) => Some(i),
                Err(e) if e.code == ErrorCode::ObjectNotFound => None,
                other => self.fail(format!("describe {key}: {other:?}")),
            };
            let shown: Vec<(SegmentId, u64)> = info
                .as_ref()
                .map(|i| {
                    i.replicas
                        .iter()
                        .map(|r| (r.segment_id, r.offset))
                        .collect()
                })
                .unwrap_or_default();
            // A key whose complete object was evicted while a replace of it
            // is under way shows the replace.
            let replace_shown = info.as_ref().is_some_and(|i| !i.complete)
                && matches!(o.state, State::Complete { .. })
                && self.model.replacing.contains_key(&key);
            let still = if replace_shown {
                Vec::new()
            } else {
                shown.clone()
            };
            let lost: Vec<(SegmentId, u64)> = o
                .replicas
                .iter()
                .copied()
                .filter(|r| !still.contains(r))
                .collect();
            if still.iter().any(|r| !o.replicas.contains(r)) {
                self.fail(format!(
                    "{key} has replicas the model never saw: {still:?} vs {:?}",
                    o.replicas
                ));
            }
            if lost.is_empty() {
                if let Some(i) = &info {
                    let complete = matches!(o.state, State::Complete { .. });
                    if i.complete != complete {
                        self.fail(format!(
                            "{key}: complete={} but model {:?}",
                            i.complete, o.state
                        ));
                    }
                }
                continue;
            }
            match o.state {
                State::Processing { .. } => self.fail(format!(
                    "processing {key} lost replicas {lost:?} (only housekeeping may drop it)"
                )),
                State::Complete {
                    lease_until,
                    kept_until,
                    hard_pin,
                    pin_until,
                } => {
                    if lease_until > self.now {
                        self.fail(format!(
                            "leased {key} (until {lease_until}, now {}) was evicted",
                            self.now
                        ));
                    }
                    if kept_until > self.now {
                        self.fail(format!(
                            "{key}, put a lease ago or less (kept until {kept_until}, now {}), \
                             was evicted",
                            self.now
                        ));
                    }
                    if hard_pin {
                        self.fail(format!("hard-pinned {key} was evicted"));
                    }
                    let rank = (pin_until > self.now, lease_until.max(kept_until));
                    for &(seg, _) in &lost {
                        evicted.push((seg, rank, key.clone()));
                    }
                }
            }
            self.seen.evictions += lost.len() as u64;
            if still.is_empty() {
                self.complete_gone(&key);
            } else {
                self.model.objs.get_mut(&key).expect("present").replicas = still;
            }
            if replace_shown {
                let mut want = self.model.objs[&key].replicas.clone();
                want.sort();
                let mut got = shown;
                got.sort();
                if got != want {
                    self.fail(format!(
                        "{key}: the replace under way shows {got:?}, model {want:?}"
                    ));
                }
            }
        }
        if !self.clock_moved {
            self.check_rank_order(&evicted);
        }
    }

    /// Evictions at `now` took, per segment and shard (each shard evicts in
    /// its own range of a segment), replicas in rank order: no replica
    /// eviction could have taken there ranks before one it took. Rank:
    /// soft-pinned after unpinned, then the later of the lease end and a
    /// lease after the put (ties unordered).
    fn check_rank_order(&mut self, evicted: &[(SegmentId, (bool, u64), String)]) {
        let now = self.now;
        for (seg, rank, key) in evicted {
            if rank.0 {
                self.seen.pinned_evictions += 1;
            }
            for (k, o) in &self.model.objs {
                let State::Complete {
                    lease_until,
                    kept_until,
                    hard_pin: false,
                    pin_until,
                } = o.state
                else {
                    continue;
                };
                let theirs = (pin_until > now, lease_until.max(kept_until));
                if theirs.1 <= now
                    && theirs < *rank
                    && self.m.shard_of(k.as_bytes()) == self.m.shard_of(key.as_bytes())
                    && o.replicas.iter().any(|r| r.0 == *seg)
                {
                    self.fail(format!(
                        "{key} (rank {rank:?}) was evicted from segment {seg:016x} while {k} \
                         (rank {theirs:?}, same shard) stays there"
                    ));
                }
            }
        }
        if !evicted.is_empty() {
            self.seen.ranked_evictions += 1;
        }
    }
}

fn run_case(seed: u64, steps: usize) -> Seen {
    let mut r = Run::new(seed);
    for _ in 0..steps {
        r.step();
    }
    r.seen
}

#[test]
fn random_call_sequences_keep_the_masters_invariants() {
    let (seeds, steps): (Vec<u64>, usize) = match std::env::var("KVPOOL_MODEL_SEED") {
        Ok(s) => (vec![s.parse().expect("KVPOOL_MODEL_SEED is a u64")], 2_000),
        Err(_) => {
            let base: u64 = rand::random();
            ((0..150).map(|i| base.wrapping_add(i)).collect(), 400)
        }
    };
    let mut total = Seen::default();
    for seed in seeds {
        match std::panic::catch_unwind(|| run_case(seed, steps)) {
            Ok(s) => {
                total.puts += s.puts;
                total.evictions += s.evictions;
                total.held_removals += s.held_removals;
                total.stale += s.stale;
                total.no_space += s.no_space;
                total.replaced += s.replaced;
                total.try_again += s.try_again;
                total.key_limit += s.key_limit;
                total.replace_at_limit += s.replace_at_limit;
                total.ranked_evictions += s.ranked_evictions;
                total.pinned_evictions += s.pinned_evictions;
            }
            Err(panic) => {
                eprintln!("master model check failed: replay with KVPOOL_MODEL_SEED={seed}");
                std::panic::resume_unwind(panic);
            }
        }
    }
    println!("exercised: {total:?}");
    // The checks mean something only if the hard cases happened.
    assert!(total.puts > 0 && total.evictions > 0 && total.held_removals > 0);
    assert!(total.stale > 0 && total.no_space > 0);
    assert!(total.replaced > 0 && total.try_again > 0);
    assert!(total.key_limit > 0 && total.replace_at_limit > 0);
    assert!(total.ranked_evictions > 0 && total.pinned_evictions > 0);
}
