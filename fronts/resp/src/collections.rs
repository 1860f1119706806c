//! Lists, sets, hashes and sorted sets, held in the front's own memory.
//!
//! The pool stores immutable blobs: a list kept there would be rewritten
//! whole by every push (quadratic in its length). These types exist so that
//! Redis tools (redis-benchmark's default suite) and small coordination code
//! run against the front; KV-cache values are strings and go to the pool.
//! So they live here, shared by the front's RESP threads under one lock,
//! bounded by `resp.max_collection_memory`, and are not seen through another
//! front or after a restart. The decision: docs/architecture/resp.md.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use indexmap::IndexSet;

use crate::checks::{check_key, is_miss, pool_error, WRONGTYPE};
use crate::commands::Cmd;
use crate::conn::{Conn, Held, Part, BUDGET_SPENT};
use crate::proto::{parse_int, reply};

/// What one key costs beside its bytes (map entry, value header).
const KEY_COST: u64 = 96;
/// What one element costs beside its bytes (its allocation and the
/// structure's slot).
const ELEMENT_COST: u64 = 48;

/// A hash's field and value.
pub(crate) type Pair = (Vec<u8>, Vec<u8>);

/// The type of a collection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    List,
    Set,
    Hash,
    Zset,
}

impl Kind {
    /// What `TYPE` answers.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::List => "list",
            Kind::Set => "set",
            Kind::Hash => "hash",
            Kind::Zset => "zset",
        }
    }
}

/// A score, ordered by `f64::total_cmp` (NaN is refused at parse, -0 is 0).
#[derive(Debug, Clone, Copy)]
struct Score(f64);

impl PartialEq for Score {
    fn eq(&self, o: &Self) -> bool {
        self.0.total_cmp(&o.0).is_eq()
    }
}
impl Eq for Score {}
impl PartialOrd for Score {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Score {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// A sorted set: members by score, then by their bytes (Redis's order).
#[derive(Default)]
struct Zset {
    scores: HashMap<Vec<u8>, f64>,
    order: BTreeSet<(Score, Vec<u8>)>,
}

enum Value {
    List(VecDeque<Vec<u8>>),
    /// Insertion-ordered, so that a random member is one index away.
    Set(IndexSet<Vec<u8>>),
    Hash(HashMap<Vec<u8>, Vec<u8>>),
    Zset(Zset),
}

impl Value {
    fn new(kind: Kind) -> Self {
        match kind {
            Kind::List => Value::List(VecDeque::new()),
            Kind::Set => Value::Set(IndexSet::new()),
            Kind::Hash => Value::Hash(HashMap::new()),
            Kind::Zset => Value::Zset(Zset::default()),
        }
    }

    fn kind(&self) -> Kind {
        match self {
            Value::List(_) => Kind::List,
            Value::Set(_) => Kind::Set,
            Value::Hash(_) => Kind::Hash,
            Value::Zset(_) => Kind::Zset,
        }
    }

    fn len(&self) -> usize {
        match self {
            Value::List(l) => l.len(),
            Value::Set(s) => s.len(),
            Value::Hash(h) => h.len(),
            Value::Zset(z) => z.scores.len(),
        }
    }
}

struct Entry {
    value: Value,
    /// What it costs, its key included.
    bytes: u64,
}

/// One stripe of the map: the keys that hash to it, under one lock.
struct Stripe {
    map: HashMap<Vec<u8>, Entry>,
    /// xorshift64* state, for SPOP.
    rng: u64,
}

/// Stripes of [`Collections`]: the RESP threads (one per core) take
/// different locks for different keys, and a GET that checks its key's
/// type waits for no write of another key.
const STRIPES: usize = 64;

/// A number below `below` from xorshift64* state `rng`.
fn random(rng: &mut u64, below: usize) -> usize {
    let mut x = *rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *rng = x;
    (x.wrapping_mul(0x2545_f491_4f6c_dd1d) % below as u64) as usize
}

/// The front's collections: every RESP thread's connections see the same.
pub(crate) struct Collections {
    stripes: Box<[Mutex<Stripe>]>,
    /// Picks a key's stripe, seeded at random: keys chosen to share one
    /// stripe cannot be aimed at it.
    striper: RandomState,
    /// Keys held (read without a lock: a GET skips the stripes while none).
    keys: AtomicUsize,
    /// Bytes held, reserved before a write adds them.
    bytes: AtomicU64,
    /// Bytes at most (`resp.max_collection_memory`).
    limit: u64,
}

/// Redis's index arithmetic: negative counts from the end; the range
/// `start..=stop` clamped to `0..len`, `None` when empty.
fn clamp(start: i64, stop: i64, len: usize) -> Option<(usize, usize)> {
    let len = len as i64;
    let at = |i: i64| if i < 0 { len + i } else { i };
    let (start, stop) = (at(start).max(0), at(stop).min(len - 1));
    (start <= stop && start < len).then_some((start as usize, stop as usize))
}

impl Collections {
    pub(crate) fn new(limit: u64) -> Self {
        let striper = RandomState::new();
        let seed = striper.hash_one(0x6b76_706f_6f6c_u64);
        Collections {
            striper,
            stripes: (0..STRIPES as u64)
                .map(|i| {
                    Mutex::new(Stripe {
                        map: HashMap::new(),
                        rng: seed.wrapping_add(i) | 1,
                    })
                })
                .collect(),
            keys: AtomicUsize::new(0),
            bytes: AtomicU64::new(0),
            limit,
        }
    }

    /// The stripe of `key`, locked.
    fn lock(&self, key: &[u8]) -> MutexGuard<'_, Stripe> {
        let at = self.striper.hash_one(key) as usize % STRIPES;
        // A panic while held ends the process (the binary's panic hook
        // aborts); a stripe is consistent at every unlock.
        self.stripes[at].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// No key is held: the string commands skip the stripes.
    pub(crate) fn is_empty(&self) -> bool {
        self.keys.load(Ordering::Acquire) == 0
    }

    /// Keys held.
    pub(crate) fn len(&self) -> usize {
        self.keys.load(Ordering::Acquire)
    }

    /// Bytes held (keys, elements and their costs).
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }

    /// Gives `n` bytes back.
    fn free(&self, n: u64) {
        self.bytes.fetch_sub(n, Ordering::AcqRel);
    }

    /// The type of `key`, if a collection holds it.
    pub(crate) fn kind_of(&self, key: &[u8]) -> Option<Kind> {
        if self.is_empty() {
            return None;
        }
        self.lock(key).map.get(key).map(|e| e.value.kind())
    }

    /// Removes `key`; whether it was held.
    pub(crate) fn remove(&self, key: &[u8]) -> bool {
        if self.is_empty() {
            return false;
        }
        let Some(e) = self.lock(key).map.remove(key) else {
            return false;
        };
        self.free(e.bytes);
        self.keys.fetch_sub(1, Ordering::AcqRel);
        true
    }

    /// Removes every key; how many there were.
    pub(crate) fn clear(&self) -> usize {
        let mut n = 0;
        for stripe in self.stripes.iter() {
            let mut g = stripe.lock().unwrap_or_else(|p| p.into_inner());
            let gone: u64 = g.map.values().map(|e| e.bytes).sum();
            n += g.map.len();
            self.keys.fetch_sub(g.map.len(), Ordering::AcqRel);
            g.map.clear();
            self.free(gone);
        }
        n
    }

    /// `f` on the value of `key` (None when absent); WRONGTYPE when the key
    /// holds another type.
    fn read<R>(
        &self,
        key: &[u8],
        kind: Kind,
        f: impl FnOnce(Option<&Value>) -> R,
    ) -> Result<R, String> {
        let g = self.lock(key);
        match g.map.get(key) {
            Some(e) if e.value.kind() != kind => Err(WRONGTYPE.into()),
            e => Ok(f(e.map(|e| &e.value))),
        }
    }

    /// `f` on the value of `key`, an empty one of `kind` made for it when
    /// absent and `create` (otherwise `Ok(None)`). `grow`: the bytes the
    /// change may add at most, refused past the limit before anything
    /// changes. `f` answers with its result and the bytes it added (+) or
    /// freed (-). A value left empty is removed, as Redis does.
    fn write<R>(
        &self,
        key: &[u8],
        kind: Kind,
        grow: u64,
        create: bool,
        f: impl FnOnce(&mut Value, &mut u64) -> (R, i64),
    ) -> Result<Option<R>, String> {
        let mut g = self.lock(key);
        let Stripe { map, rng } = &mut *g;
        let fresh = match map.get(key) {
            Some(e) if e.value.kind() != kind => return Err(WRONGTYPE.into()),
            Some(_) => false,
            None if !create => return Ok(None),
            None => true,
        };
        let key_cost = key.len() as u64 + KEY_COST;
        let need = grow + if fresh { key_cost } else { 0 };
        if need > 0 {
            // Reserved first, so that writes of other stripes cannot pass
            // the limit together.
            let held = self.bytes.fetch_add(need, Ordering::AcqRel);
            if held.saturating_add(need) > self.limit {
                self.free(need);
                return Err(format!(
                    "OOM command not allowed: the front's lists, sets, hashes and sorted sets \
                     hold {held} of their {} bytes (resp.max_collection_memory)",
                    self.limit
                ));
            }
        }
        if fresh {
            map.insert(
                key.to_vec(),
                Entry {
                    value: Value::new(kind),
                    bytes: key_cost,
                },
            );
            self.keys.fetch_add(1, Ordering::AcqRel);
        }
        let e = map.get_mut(key).expect("held or inserted above");
        let (r, delta) = f(&mut e.value, rng);
        e.bytes = e.bytes.saturating_add_signed(delta);
        // What `f` did not use of the reservation, or freed.
        let unused = grow as i64 - delta;
        if unused > 0 {
            self.free(unused as u64);
        } else {
            self.bytes
                .fetch_add(unused.unsigned_abs(), Ordering::AcqRel);
        }
        if e.value.len() == 0 {
            let gone = e.bytes;
            map.remove(key);
            self.free(gone);
            self.keys.fetch_sub(1, Ordering::AcqRel);
        }
        Ok(Some(r))
    }

    /// Elements of `key` (LLEN, SCARD, HLEN, ZCARD): 0 when absent.
    pub(crate) fn count(&self, key: &[u8], kind: Kind) -> Result<usize, String> {
        self.read(key, kind, |v| v.map_or(0, Value::len))
    }

    /// `LPUSH`/`RPUSH`: the list's length after.
    pub(crate) fn push(&self, key: &[u8], left: bool, items: &[&[u8]]) -> Result<usize, String> {
        let grow: u64 = items.iter().map(|i| i.len() as u64 + ELEMENT_COST).sum();
        self.write(key, Kind::List, grow, true, |v, _| {
            let Value::List(l) = v else { unreachable!() };
            for i in items {
                if left {
                    l.push_front(i.to_vec());
                } else {
                    l.push_back(i.to_vec());
                }
            }
            (l.len(), grow as i64)
        })
        .map(|r| r.unwrap_or(0))
    }

    /// `LPOP`/`RPOP`: up to `count` elements; `None` when the key is absent.
    pub(crate) fn pop(
        &self,
        key: &[u8],
        left: bool,
        count: usize,
        admit: Admit<'_>,
    ) -> Result<Option<Vec<Vec<u8>>>, String> {
        self.write(key, Kind::List, 0, false, |v, _| {
            let Value::List(l) = v else { unreachable!() };
            let mut out = Vec::with_capacity(count.min(l.len()));
            let mut freed = 0i64;
            while out.len() < count {
                let Some(i) = (if left { l.pop_front() } else { l.pop_back() }) else {
                    break;
                };
                freed += (i.len() as u64 + ELEMENT_COST) as i64;
                out.push(i);
            }
            if !admit(reply_bound(out.iter().map(Vec::len))) {
                for i in out.into_iter().rev() {
                    if left {
                        l.push_front(i);
                    } else {
                        l.push_back(i);
                    }
                }
                return (Err(()), 0);
            }
            (Ok(out), -freed)
        })
        .and_then(refused)
    }

    /// `LRANGE key start stop`.
    pub(crate) fn range(&self, key: &[u8], start: i64, stop: i64) -> Result<Vec<Vec<u8>>, String> {
        self.read(key, Kind::List, |v| {
            let Some(Value::List(l)) = v else {
                return Vec::new();
            };
            match clamp(start, stop, l.len()) {
                Some((a, b)) => l.range(a..=b).cloned().collect(),
                None => Vec::new(),
            }
        })
    }

    /// `SADD`: members added.
    pub(crate) fn sadd(&self, key: &[u8], members: &[&[u8]]) -> Result<usize, String> {
        let grow: u64 = members.iter().map(|m| m.len() as u64 + ELEMENT_COST).sum();
        self.write(key, Kind::Set, grow, true, |v, _| {
            let Value::Set(s) = v else { unreachable!() };
            let (mut n, mut added) = (0, 0i64);
            for m in members {
                if s.insert(m.to_vec()) {
                    n += 1;
                    added += (m.len() as u64 + ELEMENT_COST) as i64;
                }
            }
            (n, added)
        })
        .map(|r| r.unwrap_or(0))
    }

    /// `SREM`: members removed.
    pub(crate) fn srem(&self, key: &[u8], members: &[&[u8]]) -> Result<usize, String> {
        self.write(key, Kind::Set, 0, false, |v, _| {
            let Value::Set(s) = v else { unreachable!() };
            let (mut n, mut freed) = (0, 0i64);
            for m in members {
                if s.swap_remove(*m) {
                    n += 1;
                    freed += (m.len() as u64 + ELEMENT_COST) as i64;
                }
            }
            (n, -freed)
        })
        .map(|r| r.unwrap_or(0))
    }

    /// `SPOP`: up to `count` members taken at random; `None` when absent.
    pub(crate) fn spop(
        &self,
        key: &[u8],
        count: usize,
        admit: Admit<'_>,
    ) -> Result<Option<Vec<Vec<u8>>>, String> {
        self.write(key, Kind::Set, 0, false, |v, rng| {
            let Value::Set(s) = v else { unreachable!() };
            let mut out = Vec::with_capacity(count.min(s.len()));
            let mut freed = 0i64;
            while out.len() < count && !s.is_empty() {
                let at = random(rng, s.len());
                let Some(m) = s.swap_remove_index(at) else {
                    break;
                };
                freed += (m.len() as u64 + ELEMENT_COST) as i64;
                out.push(m);
            }
            if !admit(reply_bound(out.iter().map(Vec::len))) {
                s.extend(out);
                return (Err(()), 0);
            }
            (Ok(out), -freed)
        })
        .and_then(refused)
    }

    /// `SISMEMBER`.
    pub(crate) fn sismember(&self, key: &[u8], member: &[u8]) -> Result<bool, String> {
        self.read(
            key,
            Kind::Set,
            |v| matches!(v, Some(Value::Set(s)) if s.contains(member)),
        )
    }

    /// `SMEMBERS`.
    pub(crate) fn smembers(&self, key: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        self.read(key, Kind::Set, |v| match v {
            Some(Value::Set(s)) => s.iter().cloned().collect(),
            _ => Vec::new(),
        })
    }

    /// `HSET key field value [field value ..]`: fields added (not replaced).
    pub(crate) fn hset(&self, key: &[u8], pairs: &[(&[u8], &[u8])]) -> Result<usize, String> {
        let cost = |f: &[u8], v: &[u8]| (f.len() + v.len()) as u64 + ELEMENT_COST;
        let grow: u64 = pairs.iter().map(|(f, v)| cost(f, v)).sum();
        self.write(key, Kind::Hash, grow, true, |v, _| {
            let Value::Hash(h) = v else { unreachable!() };
            let (mut n, mut delta) = (0, 0i64);
            for (f, val) in pairs {
                delta += cost(f, val) as i64;
                match h.insert(f.to_vec(), val.to_vec()) {
                    Some(old) => delta -= cost(f, &old) as i64,
                    None => n += 1,
                }
            }
            (n, delta)
        })
        .map(|r| r.unwrap_or(0))
    }

    /// `HGET`.
    pub(crate) fn hget(&self, key: &[u8], field: &[u8]) -> Result<Option<Vec<u8>>, String> {
        self.read(key, Kind::Hash, |v| match v {
            Some(Value::Hash(h)) => h.get(field).cloned(),
            _ => None,
        })
    }

    /// `HDEL`: fields removed.
    pub(crate) fn hdel(&self, key: &[u8], fields: &[&[u8]]) -> Result<usize, String> {
        self.write(key, Kind::Hash, 0, false, |v, _| {
            let Value::Hash(h) = v else { unreachable!() };
            let (mut n, mut freed) = (0, 0i64);
            for f in fields {
                if let Some(old) = h.remove(*f) {
                    n += 1;
                    freed += ((f.len() + old.len()) as u64 + ELEMENT_COST) as i64;
                }
            }
            (n, -freed)
        })
        .map(|r| r.unwrap_or(0))
    }

    /// `HGETALL`: field, value pairs.
    pub(crate) fn hgetall(&self, key: &[u8]) -> Result<Vec<Pair>, String> {
        self.read(key, Kind::Hash, |v| match v {
            Some(Value::Hash(h)) => h.iter().map(|(f, v)| (f.clone(), v.clone())).collect(),
            _ => Vec::new(),
        })
    }

    /// `ZADD key score member [score member ..]`: members added (a member
    /// given again has its score replaced).
    pub(crate) fn zadd(&self, key: &[u8], pairs: &[(f64, &[u8])]) -> Result<usize, String> {
        let cost = |m: &[u8]| 2 * m.len() as u64 + 2 * ELEMENT_COST;
        let grow: u64 = pairs.iter().map(|(_, m)| cost(m)).sum();
        self.write(key, Kind::Zset, grow, true, |v, _| {
            let Value::Zset(z) = v else { unreachable!() };
            let (mut n, mut added) = (0, 0i64);
            for &(score, m) in pairs {
                match z.scores.insert(m.to_vec(), score) {
                    Some(old) => {
                        z.order.remove(&(Score(old), m.to_vec()));
                    }
                    None => {
                        n += 1;
                        added += cost(m) as i64;
                    }
                }
                z.order.insert((Score(score), m.to_vec()));
            }
            (n, added)
        })
        .map(|r| r.unwrap_or(0))
    }

    /// `ZPOPMIN`: up to `count` lowest members with their scores.
    pub(crate) fn zpopmin(
        &self,
        key: &[u8],
        count: usize,
        admit: Admit<'_>,
    ) -> Result<Vec<(Vec<u8>, f64)>, String> {
        let cost = |m: &[u8]| 2 * m.len() as u64 + 2 * ELEMENT_COST;
        self.write(key, Kind::Zset, 0, false, |v, _| {
            let Value::Zset(z) = v else { unreachable!() };
            let mut out = Vec::with_capacity(count.min(z.scores.len()));
            let mut freed = 0i64;
            while out.len() < count {
                let Some((Score(s), m)) = z.order.pop_first() else {
                    break;
                };
                z.scores.remove(&m);
                freed += cost(&m) as i64;
                out.push((m, s));
            }
            if !admit(reply_bound(out.iter().map(|(m, _)| m.len()))) {
                for (m, s) in out {
                    z.scores.insert(m.clone(), s);
                    z.order.insert((Score(s), m));
                }
                return (Err(()), 0);
            }
            (Ok(out), -freed)
        })
        .and_then(refused)
        .map(Option::unwrap_or_default)
    }

    /// `ZSCORE`.
    pub(crate) fn zscore(&self, key: &[u8], member: &[u8]) -> Result<Option<f64>, String> {
        self.read(key, Kind::Zset, |v| match v {
            Some(Value::Zset(z)) => z.scores.get(member).copied(),
            _ => None,
        })
    }

    /// `ZRANGE key start stop` by rank.
    pub(crate) fn zrange(
        &self,
        key: &[u8],
        start: i64,
        stop: i64,
    ) -> Result<Vec<(Vec<u8>, f64)>, String> {
        self.read(key, Kind::Zset, |v| {
            let Some(Value::Zset(z)) = v else {
                return Vec::new();
            };
            match clamp(start, stop, z.order.len()) {
                Some((a, b)) => z
                    .order
                    .iter()
                    .skip(a)
                    .take(b - a + 1)
                    .map(|(s, m)| (m.clone(), s.0))
                    .collect(),
                None => Vec::new(),
            }
        })
    }
}

/// A score argument (`ZADD`): a float, `inf`, `+inf` or `-inf`; NaN refused.
pub(crate) fn parse_score(a: &[u8]) -> Result<f64, String> {
    let bad = || "ERR value is not a valid float".to_string();
    let s = std::str::from_utf8(a).map_err(|_| bad())?;
    let x: f64 = match s.to_ascii_lowercase().as_str() {
        "inf" | "+inf" => f64::INFINITY,
        "-inf" => f64::NEG_INFINITY,
        t if t.contains("inf") || t.contains("nan") || t.trim() != t || t.is_empty() => {
            return Err(bad())
        }
        t => t.parse().map_err(|_| bad())?,
    };
    // -0 and 0 are one score.
    Ok(if x == 0.0 { 0.0 } else { x })
}

/// Asked by a pop, under its key's lock, whether a reply of at most this
/// many bytes may be held; on a refusal the pop puts back what it took
/// (nothing is lost to a reply that could not be sent).
pub(crate) type Admit<'a> = &'a mut dyn FnMut(u64) -> bool;

/// At most how long the reply of elements of these lengths is, in RESP2 or
/// RESP3 (a bulk header and a score each, the array's header).
fn reply_bound(lens: impl Iterator<Item = usize>) -> u64 {
    lens.map(|n| n as u64 + 64).sum::<u64>() + 32
}

/// A pop's answer, or the budget's refusal as its error reply.
fn refused<T>(r: Option<Result<T, ()>>) -> Result<Option<T>, String> {
    match r {
        None => Ok(None),
        Some(Ok(v)) => Ok(Some(v)),
        Some(Err(())) => Err(BUDGET_SPENT.into()),
    }
}

/// A count argument (`LPOP key count` and kin): at least 0.
fn count_arg(a: Option<&&[u8]>) -> Result<Option<usize>, String> {
    match a {
        None => Ok(None),
        Some(a) => match parse_int(a) {
            Some(n) if n >= 0 => Ok(Some(n as usize)),
            _ => Err("ERR value is out of range, must be positive".into()),
        },
    }
}

fn index_arg(a: &[u8]) -> Result<i64, String> {
    parse_int(a).ok_or_else(|| "ERR value is not an integer or out of range".into())
}

/// What a collection command answers, written once it is known whole (an
/// error never leaves half a reply).
enum Answer {
    Int(i64),
    Bulk(Option<Vec<u8>>),
    /// An array of bulk strings; `None`: a missing array.
    Array(Option<Vec<Vec<u8>>>),
    Set(Vec<Vec<u8>>),
    Map(Vec<Pair>),
    Score(Option<f64>),
    /// Members with scores: flat (`member, score, ...`) or pairs (RESP3's
    /// form where Redis nests them).
    Scored(Vec<(Vec<u8>, f64)>, bool),
}

impl Conn {
    /// Collection commands on a key no collection holds ask the pool once:
    /// a string there makes them WRONGTYPE, as in Redis.
    async fn not_a_string(&self, key: &[u8]) -> Result<(), String> {
        check_key(key)?;
        if self.ctx.shared.collections.kind_of(key).is_some() {
            return Ok(());
        }
        match self.ctx.client.exists(key).await {
            Ok(true) => Err(WRONGTYPE.into()),
            Ok(false) => Ok(()),
            Err(e) if is_miss(&e) => Ok(()),
            Err(e) => Err(pool_error(&e)),
        }
    }

    /// Lists, sets, hashes and sorted sets: `LPUSH` .. `ZRANGE`.
    pub(crate) async fn collection(&mut self, cmd: Cmd, args: &[&[u8]]) {
        // A pop takes its reply's budget before it lets its elements go
        // (`Admit`): a pop refused for want of budget loses nothing.
        let mut held = Held::none(&self.ctx.shared);
        let answer = match self.not_a_string(args[0]).await {
            Ok(()) => {
                self.collection_answer(cmd, args, &mut |n| n <= SMALL_REPLY as u64 || held.grow(n))
            }
            Err(e) => Err(e),
        };
        let resp3 = self.resp3;
        // Encoded apart; a large reply (LRANGE, SMEMBERS, HGETALL of a big
        // collection) is held from the front's buffer budget until sent, as
        // a GET's value is. The answer and its copy exist unbudgeted only
        // until here, with no wait in between: one per RESP thread at most.
        // A pop's reply is within what it took above, so `set` only gives
        // back.
        let mut buf = Vec::new();
        encode(&mut buf, answer, resp3);
        if buf.len() <= SMALL_REPLY {
            self.out.bytes.extend_from_slice(&buf);
            return;
        }
        if held.set(buf.len() as u64) {
            self.out.raw_part(Part {
                value: buf,
                _held: held,
            });
        } else {
            reply::error(&mut self.out.bytes, BUDGET_SPENT);
        }
    }

    fn collection_answer(
        &self,
        cmd: Cmd,
        args: &[&[u8]],
        admit: Admit<'_>,
    ) -> Result<Answer, String> {
        let c = &self.ctx.shared.collections;
        let key = args[0];
        let rest = &args[1..];
        let n = |x: usize| Answer::Int(x as i64);
        Ok(match cmd {
            Cmd::Lpush | Cmd::Rpush => n(c.push(key, cmd == Cmd::Lpush, rest)?),
            Cmd::Lpop | Cmd::Rpop => {
                let left = cmd == Cmd::Lpop;
                match count_arg(rest.first())? {
                    None => Answer::Bulk(c.pop(key, left, 1, admit)?.and_then(|mut v| v.pop())),
                    Some(k) => Answer::Array(c.pop(key, left, k, admit)?),
                }
            }
            Cmd::Lrange => Answer::Array(Some(c.range(
                key,
                index_arg(rest[0])?,
                index_arg(rest[1])?,
            )?)),
            Cmd::Llen => n(c.count(key, Kind::List)?),
            Cmd::Sadd => n(c.sadd(key, rest)?),
            Cmd::Srem => n(c.srem(key, rest)?),
            Cmd::Spop => match count_arg(rest.first())? {
                None => Answer::Bulk(c.spop(key, 1, admit)?.and_then(|mut v| v.pop())),
                Some(k) => Answer::Set(c.spop(key, k, admit)?.unwrap_or_default()),
            },
            Cmd::Scard => n(c.count(key, Kind::Set)?),
            Cmd::Sismember => Answer::Int(c.sismember(key, rest[0])? as i64),
            Cmd::Smembers => Answer::Set(c.smembers(key)?),
            Cmd::Hset => {
                if !rest.len().is_multiple_of(2) {
                    return Err("ERR wrong number of arguments for 'hset' command".into());
                }
                let pairs: Vec<(&[u8], &[u8])> = rest.chunks(2).map(|p| (p[0], p[1])).collect();
                n(c.hset(key, &pairs)?)
            }
            Cmd::Hget => Answer::Bulk(c.hget(key, rest[0])?),
            Cmd::Hdel => n(c.hdel(key, rest)?),
            Cmd::Hlen => n(c.count(key, Kind::Hash)?),
            Cmd::Hgetall => Answer::Map(c.hgetall(key)?),
            Cmd::Zadd => {
                const FLAGS: [&str; 6] = ["NX", "XX", "GT", "LT", "CH", "INCR"];
                if let Some(f) = FLAGS
                    .iter()
                    .find(|f| f.as_bytes().eq_ignore_ascii_case(rest[0]))
                {
                    return Err(format!(
                        "ERR kvpool's ZADD takes score member pairs only: {f} is not supported"
                    ));
                }
                if !rest.len().is_multiple_of(2) {
                    return Err("ERR syntax error".into());
                }
                let mut pairs: Vec<(f64, &[u8])> = Vec::with_capacity(rest.len() / 2);
                for p in rest.chunks(2) {
                    pairs.push((parse_score(p[0])?, p[1]));
                }
                n(c.zadd(key, &pairs)?)
            }
            Cmd::Zpopmin => {
                let k = count_arg(rest.first())?;
                Answer::Scored(c.zpopmin(key, k.unwrap_or(1), admit)?, k.is_some())
            }
            Cmd::Zcard => n(c.count(key, Kind::Zset)?),
            Cmd::Zscore => Answer::Score(c.zscore(key, rest[0])?),
            Cmd::Zrange => {
                let scores = match &rest[2..] {
                    [] => false,
                    [w] if w.eq_ignore_ascii_case(b"WITHSCORES") => true,
                    _ => {
                        return Err("ERR kvpool's ZRANGE takes key start stop [WITHSCORES] \
                                    (by rank): BYSCORE, BYLEX, REV and LIMIT are not supported"
                            .into())
                    }
                };
                let got = c.zrange(key, index_arg(rest[0])?, index_arg(rest[1])?)?;
                if scores {
                    Answer::Scored(got, true)
                } else {
                    Answer::Array(Some(got.into_iter().map(|(m, _)| m).collect()))
                }
            }
            _ => unreachable!("{cmd:?} is not a collection command"),
        })
    }
}

/// Replies this long or shorter go straight into the connection's buffer.
const SMALL_REPLY: usize = 16 * 1024;

/// A collection command's answer (or its error) as RESP2 or RESP3 bytes.
fn encode(o: &mut Vec<u8>, answer: Result<Answer, String>, resp3: bool) {
    match answer {
        Err(e) => reply::error(o, &e),
        Ok(Answer::Int(n)) => reply::int(o, n),
        Ok(Answer::Bulk(Some(v))) => reply::bulk(o, &v),
        Ok(Answer::Bulk(None)) => reply::nil(o, resp3),
        Ok(Answer::Array(None)) => reply::array_nil(o, resp3),
        Ok(Answer::Array(Some(items))) => {
            reply::array(o, items.len());
            for i in items {
                reply::bulk(o, &i);
            }
        }
        Ok(Answer::Set(items)) => {
            reply::set(o, items.len(), resp3);
            for i in items {
                reply::bulk(o, &i);
            }
        }
        Ok(Answer::Map(pairs)) => {
            reply::map(o, pairs.len(), resp3);
            for (k, v) in pairs {
                reply::bulk(o, &k);
                reply::bulk(o, &v);
            }
        }
        Ok(Answer::Score(Some(x))) => reply::double(o, x, resp3),
        Ok(Answer::Score(None)) => reply::nil(o, resp3),
        Ok(Answer::Scored(items, nested)) => {
            if nested && resp3 {
                reply::array(o, items.len());
                for (m, x) in items {
                    reply::array(o, 2);
                    reply::bulk(o, &m);
                    reply::double(o, x, resp3);
                }
            } else {
                reply::array(o, items.len() * 2);
                for (m, x) in items {
                    reply::bulk(o, &m);
                    reply::double(o, x, resp3);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    #[test]
    fn a_pop_refused_its_reply_budget_puts_back_what_it_took() {
        let c = Collections::new(1 << 20);
        c.push(b"l", false, &[b"a", b"b", b"c"]).unwrap();
        c.sadd(b"s", &[b"x", b"y"]).unwrap();
        c.zadd(b"z", &[(1.0, b"m".as_slice()), (2.0, b"n")])
            .unwrap();
        let bytes = c.bytes();
        let refuse: Admit<'_> = &mut |_| false;
        assert_eq!(c.pop(b"l", true, 2, refuse), Err(BUDGET_SPENT.into()));
        assert_eq!(
            c.pop(b"l", false, 2, &mut |_| false),
            Err(BUDGET_SPENT.into())
        );
        assert_eq!(c.spop(b"s", 2, &mut |_| false), Err(BUDGET_SPENT.into()));
        assert_eq!(c.zpopmin(b"z", 1, &mut |_| false), Err(BUDGET_SPENT.into()));
        assert_eq!(c.range(b"l", 0, -1), Ok(vec![b("a"), b("b"), b("c")]));
        assert_eq!(c.count(b"s", Kind::Set), Ok(2));
        assert_eq!(c.zscore(b"z", b"m"), Ok(Some(1.0)));
        assert_eq!(c.zpopmin(b"z", 1, &mut |_| true), Ok(vec![(b("m"), 1.0)]));
        assert!(c.bytes() < bytes);
        // What a pop asks for covers its reply.
        let mut asked = 0;
        c.pop(b"l", true, 3, &mut |n| {
            asked = n;
            true
        })
        .unwrap();
        assert!(asked >= 3 * (1 + 8) + 8, "{asked}");
    }

    #[test]
    fn lists_push_pop_and_range_as_redis() {
        let c = Collections::new(1 << 20);
        assert!(c.is_empty());
        assert_eq!(c.push(b"l", true, &[b"a", b"b"]), Ok(2));
        assert_eq!(c.push(b"l", false, &[b"c"]), Ok(3));
        // LPUSH a b: b a; RPUSH c: b a c.
        assert_eq!(c.range(b"l", 0, -1), Ok(vec![b("b"), b("a"), b("c")]));
        assert_eq!(c.range(b"l", -2, 99), Ok(vec![b("a"), b("c")]));
        assert_eq!(c.range(b"l", 2, 1), Ok(vec![]));
        assert_eq!(c.range(b"l", 5, 9), Ok(vec![]));
        assert_eq!(c.range(b"none", 0, -1), Ok(vec![]));
        assert_eq!(c.count(b"l", Kind::List), Ok(3));
        assert_eq!(c.pop(b"l", true, 1, &mut |_| true), Ok(Some(vec![b("b")])));
        assert_eq!(
            c.pop(b"l", false, 5, &mut |_| true),
            Ok(Some(vec![b("c"), b("a")]))
        );
        // Emptied: the key is gone, and so are its bytes.
        assert_eq!(c.kind_of(b"l"), None);
        assert!(c.is_empty());
        assert_eq!(c.bytes(), 0);
        assert_eq!(c.pop(b"l", true, 1, &mut |_| true), Ok(None));
    }

    #[test]
    fn a_key_holds_one_type_and_commands_of_another_are_wrongtype() {
        let c = Collections::new(1 << 20);
        c.sadd(b"k", &[b"m"]).unwrap();
        assert_eq!(c.kind_of(b"k"), Some(Kind::Set));
        assert_eq!(c.push(b"k", true, &[b"x"]), Err(WRONGTYPE.into()));
        assert_eq!(c.hget(b"k", b"f"), Err(WRONGTYPE.into()));
        assert_eq!(c.zadd(b"k", &[(1.0, b"m")]), Err(WRONGTYPE.into()));
        assert_eq!(c.count(b"k", Kind::List), Err(WRONGTYPE.into()));
        assert!(c.remove(b"k"));
        assert_eq!(c.push(b"k", true, &[b"x"]), Ok(1));
        assert_eq!(c.clear(), 1);
        assert!(c.is_empty() && c.bytes() == 0);
    }

    #[test]
    fn sets_pop_every_member_once() {
        let c = Collections::new(1 << 20);
        let members: Vec<Vec<u8>> = (0..100).map(|i| format!("m{i}").into_bytes()).collect();
        let refs: Vec<&[u8]> = members.iter().map(|m| m.as_slice()).collect();
        assert_eq!(c.sadd(b"s", &refs), Ok(100));
        assert_eq!(c.sadd(b"s", &refs[..10]), Ok(0));
        assert_eq!(c.srem(b"s", &[b"m0", b"nope"]), Ok(1));
        assert_eq!(c.sismember(b"s", b"m1"), Ok(true));
        assert_eq!(c.sismember(b"s", b"m0"), Ok(false));
        let mut got = c.spop(b"s", 40, &mut |_| true).unwrap().unwrap();
        got.extend(c.spop(b"s", 1000, &mut |_| true).unwrap().unwrap());
        got.sort();
        let mut want: Vec<Vec<u8>> = members[1..].to_vec();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(c.spop(b"s", 1, &mut |_| true), Ok(None));
        assert!(c.is_empty());
    }

    #[test]
    fn hashes_count_added_fields_and_their_bytes() {
        let c = Collections::new(1 << 20);
        assert_eq!(c.hset(b"h", &[(b"f1", b"v1"), (b"f2", b"v2")]), Ok(2));
        let before = c.bytes();
        assert_eq!(c.hset(b"h", &[(b"f1", b"longer value")]), Ok(0));
        assert_eq!(c.bytes(), before + 10);
        assert_eq!(c.hget(b"h", b"f1"), Ok(Some(b("longer value"))));
        assert_eq!(c.hdel(b"h", &[b"f1", b"f9"]), Ok(1));
        assert_eq!(c.hgetall(b"h"), Ok(vec![(b("f2"), b("v2"))]));
        assert_eq!(c.hdel(b"h", &[b"f2"]), Ok(1));
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn sorted_sets_order_by_score_then_member() {
        let c = Collections::new(1 << 20);
        let pairs: [(f64, &[u8]); 4] = [
            (2.0, b"b"),
            (1.0, b"z"),
            (1.0, b"a"),
            (f64::NEG_INFINITY, b"n"),
        ];
        assert_eq!(c.zadd(b"z", &pairs), Ok(4));
        assert_eq!(c.zadd(b"z", &[(0.5, b"b")]), Ok(0));
        assert_eq!(c.zscore(b"z", b"b"), Ok(Some(0.5)));
        let names = |v: Vec<(Vec<u8>, f64)>| v.into_iter().map(|(m, _)| m).collect::<Vec<_>>();
        assert_eq!(
            names(c.zrange(b"z", 0, -1).unwrap()),
            vec![b("n"), b("b"), b("a"), b("z")]
        );
        assert_eq!(
            c.zpopmin(b"z", 2, &mut |_| true),
            Ok(vec![(b("n"), f64::NEG_INFINITY), (b("b"), 0.5)])
        );
        assert_eq!(c.count(b"z", Kind::Zset), Ok(2));
        assert_eq!(c.zpopmin(b"none", 1, &mut |_| true), Ok(vec![]));
        assert_eq!(parse_score(b"-0"), Ok(0.0));
        assert_eq!(parse_score(b"+inf"), Ok(f64::INFINITY));
        assert_eq!(parse_score(b"1e3"), Ok(1000.0));
        for bad in [&b"nan"[..], b"", b" 1", b"x", b"infinity"] {
            assert!(parse_score(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_memory_bound_refuses_before_changing_anything() {
        let c = Collections::new(1000);
        let big = vec![7u8; 600];
        assert_eq!(c.push(b"l", false, &[&big]), Ok(1));
        let e = c.push(b"l", false, &[&big]).unwrap_err();
        assert!(
            e.starts_with("OOM ") && e.contains("resp.max_collection_memory"),
            "{e}"
        );
        assert_eq!(c.count(b"l", Kind::List), Ok(1));
        assert!(c.sadd(b"s", &[&big]).is_err());
        assert_eq!(c.kind_of(b"s"), None);
        // What is freed can be used again.
        assert_eq!(
            c.pop(b"l", true, 1, &mut |_| true),
            Ok(Some(vec![big.clone()]))
        );
        assert_eq!(c.sadd(b"s", &[&big]), Ok(1));
    }
}
