//! A get's protocol as a state machine without I/O (issue 32): whether a
//! get reads through the location cache's entry or asks the master, what an
//! answer leaves in the cache and until when its replicas may be read, and
//! what a failed read leads to. [`crate::Client::get`] (and `get_into`,
//! `get_view`, a put's read-back) drives it over sockets and the transfer
//! engine; the cluster simulation (`tools/cluster-sim`) drives the same
//! code over its simulated network and clock.
//!
//! ```text
//!   start ── an entry in the location cache ──▶ Read (its replicas, until its end)
//!     │ none, or not asked to look                   │ ok: the value
//!     ▼                                              │ failed: the entry is forgotten
//!   Ask (GetReplicaList; the key's generation   ◀────┘
//!     │  and the time are noted first)
//!     │ no replica: ObjectNotFound; an error: that error
//!     ▼
//!   Read (the answer's replicas, until the read lease's end less READ_MARGIN;
//!     │   its checked DRAM replicas are remembered that long)
//!     ▼ ok: the value; failed: that error
//! ```
//!
//! Which replica is read first, the share of the time each gets and when
//! to try the next are the transfer engine's read rules
//! (`kvpool_transport::read`), which both drivers also share. The call's
//! deadline is the driver's: a read stops at the earlier of it and the
//! step's `until`.

use std::ops::Add;
use std::sync::Arc;
use std::time::Duration;

use kvpool_transport::read::lease_read_end;
use kvpool_wire::proto::ReplicaDesc;
use kvpool_wire::{ErrorCode, KvError};

use crate::locations::{cacheable, Generation, Locations};

/// How long before the read lease's end a read stops, and a view stops
/// handing out bytes (clock skew between this process and the master, and
/// the time the read itself takes); at most a quarter of the lease
/// ([`lease_read_end`]).
pub const READ_MARGIN: Duration = Duration::from_millis(500);

/// What the client holds a master's replica list to.
#[derive(Debug, Clone, Copy)]
pub struct Answers {
    /// The read lease the master grants (the cluster map's `lease_ttl_ms`).
    pub lease: Duration,
    /// Whether this client checks values (what its location cache keeps).
    pub checksums: bool,
    /// The longest value the cluster stores (the cluster map's
    /// `max_value_bytes`): a list naming a longer one is refused before any
    /// buffer is sized by it.
    pub max_len: u64,
}

/// `Malformed` if a replica the master names is longer than `max_len`
/// (the cluster's `max_value_bytes`): buffers are sized by these lengths,
/// and a master's word alone does not make a client allocate past what the
/// cluster stores.
pub fn within_bound(replicas: &[ReplicaDesc], max_len: u64) -> Result<(), KvError> {
    match replicas.iter().find(|r| r.len > max_len) {
        None => Ok(()),
        Some(r) => Err(KvError::new(
            ErrorCode::Malformed,
            format!(
                "the master names a replica of {} bytes, over the cluster's max_value_bytes ({max_len})",
                r.len
            ),
        )),
    }
}

/// What the driver does next.
#[derive(Debug)]
pub enum Step<T> {
    /// Send `GetReplicaList` for the key, and feed its answer to
    /// [`GetProtocol::answered`].
    Ask,
    /// Read the value from these replicas (a buffer of the first one's
    /// length), not past `until`; a failure goes to
    /// [`GetProtocol::read_failed`].
    Read {
        replicas: Arc<[ReplicaDesc]>,
        until: T,
    },
}

/// One get of one key, in time `T` (an `Instant`, or a simulated clock).
#[derive(Debug)]
pub struct GetProtocol<T> {
    /// The key's generation in the location cache when the master was
    /// asked (an answer is kept only if it has not moved since); `None`
    /// until then (a get served from the cache never takes it).
    generation: Option<Generation>,
    /// When the master was asked: the read lease runs from then.
    asked: T,
    /// The read under way is through the location cache's entry.
    cached: bool,
}

impl<T: Copy + Ord + Add<Duration, Output = T>> GetProtocol<T> {
    /// A get of `key` at `now`: through the location cache's entry if
    /// `look` and one lasts past `now` (a get), else by asking the master
    /// (a view, a put's read-back).
    pub fn start(key: &[u8], locations: &Locations<T>, look: bool, now: T) -> (Self, Step<T>) {
        let known = if look { locations.get(key, now) } else { None };
        let mut get = Self {
            generation: None,
            asked: now,
            cached: known.is_some(),
        };
        let step = match known {
            Some((until, replicas)) => Step::Read { replicas, until },
            None => get.ask(key, locations, now),
        };
        (get, step)
    }

    /// Whether the read under way is through the location cache's entry
    /// (no master asked).
    pub fn cached(&self) -> bool {
        self.cached
    }

    /// Notes the key's generation and the time, then asks.
    fn ask(&mut self, key: &[u8], locations: &Locations<T>, now: T) -> Step<T> {
        self.cached = false;
        self.generation = Some(locations.generation(key));
        self.asked = now;
        Step::Ask
    }

    /// The master's answer at `now`, `replicas` (`GetReplicaList`; the
    /// cluster's read lease is `lease`): the replicas to read (as
    /// [`Step::Read`]) and until when, or
    /// `ObjectNotFound` when no replica may be read. Its DRAM replicas
    /// with a checksum this client checks are remembered until then
    /// ([`cacheable`]), unless this client changed the key meanwhile.
    pub fn answered(
        &mut self,
        key: &[u8],
        locations: &Locations<T>,
        replicas: Vec<ReplicaDesc>,
        rules: Answers,
        now: T,
    ) -> Result<(Arc<[ReplicaDesc]>, T), KvError> {
        if replicas.is_empty() {
            return Err(KvError::new(
                ErrorCode::ObjectNotFound,
                "the object has no readable replica",
            ));
        }
        within_bound(&replicas, rules.max_len)?;
        // No read past the read lease: past it the master may free the
        // space and a put reuse it, and a read would find other bytes
        // (caught only by a checksum).
        let until = lease_read_end(self.asked, rules.lease, READ_MARGIN);
        let replicas: Arc<[ReplicaDesc]> = replicas.into();
        // Without checksums nothing is kept (`cacheable`): not even looked at.
        if let (Some(seen), true) = (self.generation, rules.checksums) {
            locations.put(key, cacheable(&replicas, true), until, seen, now);
        }
        Ok((replicas, until))
    }

    /// The read failed with `e` at `now`: through the cache's entry, the
    /// entry is forgotten and the master asked (a node gone, a lease that
    /// ended early by the master's clock, bytes that fail the checksum, a
    /// buffer too small for the value); else `e` is the get's answer.
    pub fn read_failed(
        &mut self,
        key: &[u8],
        locations: &Locations<T>,
        e: KvError,
        now: T,
    ) -> Result<Step<T>, KvError> {
        if !self.cached {
            return Err(e);
        }
        tracing::debug!("a read at a remembered location failed ({e}); asking the master");
        locations.forget(key);
        Ok(self.ask(key, locations, now))
    }
}

/// A batch get's protocol: the get protocol ([`GetProtocol`]) for each
/// key, the asks of a pass gathered into one `BatchGet`, in time `T`.
/// [`crate::Client::batch_get`] and `batch_get_into` drive it.
///
/// ```text
///   start: each key's get starts (an entry in the cache: a read; else an ask)
///   pass:  asks() --one BatchGet--> answered(): reads, or those keys' errors
///          reads() --the driver reads them--> read(i, outcome): the key is done,
///          or (a failed read through the cache) it asks in the next pass
/// ```
///
/// A read through the cache that fails asks once; a read of an answer that
/// fails is the key's error: at most two passes.
#[derive(Debug)]
pub struct BatchGet<T> {
    keys: Vec<(GetProtocol<T>, KeyStep<T>)>,
}

/// Where one key of a batch get is.
#[derive(Debug)]
enum KeyStep<T> {
    Ask,
    Read(BatchRead<T>),
    Done(Result<usize, KvError>),
}

/// A read a batch get asks for.
#[derive(Debug, Clone)]
pub struct BatchRead<T> {
    /// The key's place in the batch.
    pub index: usize,
    pub replicas: Arc<[ReplicaDesc]>,
    /// The value's length (the first replica's): the buffer it needs.
    pub len: usize,
    /// No read past this (the read window of the entry or the answer).
    pub until: T,
    /// Through the location cache's entry (no master asked).
    pub cached: bool,
}

impl<T: Copy + Ord + Add<Duration, Output = T>> BatchGet<T> {
    /// A get of each of `keys` at `now`, through the location cache's entry
    /// where one lasts past `now`.
    pub fn start(keys: &[&[u8]], locations: &Locations<T>, now: T) -> Self {
        let keys = keys
            .iter()
            .enumerate()
            .map(|(index, k)| {
                let (get, step) = GetProtocol::start(k, locations, true, now);
                let step = Self::step(index, step, &get);
                (get, step)
            })
            .collect();
        Self { keys }
    }

    fn step(index: usize, step: Step<T>, get: &GetProtocol<T>) -> KeyStep<T> {
        match step {
            Step::Ask => KeyStep::Ask,
            Step::Read { replicas, until } => KeyStep::Read(BatchRead {
                index,
                len: replicas.first().map_or(0, |r| r.len as usize),
                replicas,
                until,
                cached: get.cached(),
            }),
        }
    }

    /// The keys to ask the master for now, in one `BatchGet` (their places,
    /// ascending).
    pub fn asks(&self) -> Vec<usize> {
        (0..self.keys.len())
            .filter(|&i| matches!(self.keys[i].1, KeyStep::Ask))
            .collect()
    }

    /// The master's answer at `now` to the asks of `asked` (as
    /// [`Self::asks`] gave them): one list per key, in order. Each becomes
    /// the key's read, or its error (no replica: `ObjectNotFound`; a
    /// list missing from the answer: `Internal`), held to `rules`
    /// ([`Answers`]).
    pub fn answered(
        &mut self,
        keys: &[&[u8]],
        locations: &Locations<T>,
        asked: &[usize],
        lists: Vec<Result<Vec<ReplicaDesc>, KvError>>,
        rules: Answers,
        now: T,
    ) {
        let mut lists = lists.into_iter();
        for &i in asked {
            let (get, step) = &mut self.keys[i];
            let answer = lists.next().unwrap_or_else(|| {
                Err(KvError::new(
                    ErrorCode::Internal,
                    "the master's BatchGet answer names fewer keys than were asked",
                ))
            });
            *step = match answer.and_then(|r| get.answered(keys[i], locations, r, rules, now)) {
                Ok((replicas, until)) => Self::step(i, Step::Read { replicas, until }, get),
                Err(e) => KeyStep::Done(Err(e)),
            };
        }
    }

    /// The reads to make now (by place, ascending).
    pub fn reads(&self) -> Vec<BatchRead<T>> {
        self.keys
            .iter()
            .filter_map(|(_, s)| match s {
                KeyStep::Read(r) => Some(r.clone()),
                _ => None,
            })
            .collect()
    }

    /// The read of key `index` ended at `now` with `outcome`: the key is
    /// done (its value's length, or the error), or, through the cache, the
    /// entry is forgotten and the key asks in the next pass.
    pub fn read(
        &mut self,
        keys: &[&[u8]],
        locations: &Locations<T>,
        index: usize,
        outcome: Result<(), KvError>,
        now: T,
    ) {
        let (get, step) = &mut self.keys[index];
        let KeyStep::Read(r) = step else {
            return;
        };
        *step = match outcome {
            Ok(()) => KeyStep::Done(Ok(r.len)),
            Err(e) => match get.read_failed(keys[index], locations, e, now) {
                Ok(next) => Self::step(index, next, get),
                Err(e) => KeyStep::Done(Err(e)),
            },
        };
    }

    /// Whether every key's get has ended.
    pub fn done(&self) -> bool {
        self.keys.iter().all(|(_, s)| matches!(s, KeyStep::Done(_)))
    }

    /// Each key's outcome (its value's length), in order, and how many were
    /// served through the location cache; `None` until [`Self::done`].
    pub fn finish(self) -> Option<(Vec<Result<usize, KvError>>, usize)> {
        let mut hits = 0;
        let mut out = Vec::with_capacity(self.keys.len());
        for (get, step) in self.keys {
            let KeyStep::Done(r) = step else {
                return None;
            };
            hits += usize::from(r.is_ok() && get.cached());
            out.push(r);
        }
        Some((out, hits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn replica(checksum: Option<u64>) -> ReplicaDesc {
        ReplicaDesc {
            checksum,
            ..crate::locations::tests::rep(0)
        }
    }

    const LEASE: Duration = Duration::from_millis(4_000);
    const RULES: Answers = Answers {
        lease: LEASE,
        checksums: true,
        max_len: 1 << 20,
    };

    #[test]
    fn a_list_naming_a_value_longer_than_the_cluster_stores_is_refused_and_not_remembered() {
        let loc = Locations::<Duration>::new(16);
        let (mut get, _) = GetProtocol::start(b"k", &loc, true, ms(0));
        let mut long = replica(Some(1));
        long.len = RULES.max_len + 1;
        let e = get
            .answered(b"k", &loc, vec![replica(Some(1)), long], RULES, ms(1))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::Malformed);
        assert!(e.message.contains("max_value_bytes"), "{e}");
        let (_, step) = GetProtocol::start(b"k", &loc, true, ms(2));
        assert!(matches!(step, Step::Ask), "nothing remembered");
    }

    #[test]
    fn a_get_asks_the_master_then_reads_through_what_it_remembered() {
        let loc = Locations::<Duration>::new(16);
        let (mut get, step) = GetProtocol::start(b"k", &loc, true, ms(0));
        assert!(matches!(step, Step::Ask));
        let answer = get.answered(b"k", &loc, vec![replica(Some(1))], RULES, ms(3));
        // The lease runs from the ask; a read stops READ_MARGIN before it.
        let (replicas, until) = answer.unwrap();
        assert_eq!((replicas.len(), until), (1, ms(3_500)));
        let (get, step) = GetProtocol::start(b"k", &loc, true, ms(10));
        assert!(get.cached());
        assert!(matches!(step, Step::Read { until, .. } if until == ms(3_500)));
        // Past the entry's end the master is asked again.
        let (_, step) = GetProtocol::start(b"k", &loc, true, ms(3_500));
        assert!(matches!(step, Step::Ask));
    }

    #[test]
    fn a_failed_read_through_the_cache_forgets_it_and_asks_but_a_failed_read_of_an_answer_is_the_error(
    ) {
        let loc = Locations::<Duration>::new(16);
        let (mut get, _) = GetProtocol::start(b"k", &loc, true, ms(0));
        get.answered(b"k", &loc, vec![replica(Some(1))], RULES, ms(0))
            .unwrap();
        let (mut get, _) = GetProtocol::start(b"k", &loc, true, ms(5));
        let e = KvError::new(ErrorCode::Corrupt, "bytes fail the checksum");
        let step = get.read_failed(b"k", &loc, e.clone(), ms(6));
        assert!(matches!(step, Ok(Step::Ask)));
        assert!(!get.cached());
        assert!(loc.get(b"k", ms(7)).is_none(), "the entry is forgotten");
        // The answer's lease runs from the second ask.
        let answer = get.answered(b"k", &loc, vec![replica(Some(1))], RULES, ms(8));
        assert_eq!(answer.unwrap().1, ms(3_506));
        let end = get.read_failed(b"k", &loc, e, ms(9));
        assert_eq!(end.unwrap_err().code, ErrorCode::Corrupt);
    }

    #[test]
    fn no_replica_is_a_miss_and_a_view_or_read_back_does_not_look_in_the_cache() {
        let loc = Locations::<Duration>::new(16);
        let (mut get, _) = GetProtocol::start(b"k", &loc, true, ms(0));
        let miss = get.answered(b"k", &loc, Vec::new(), RULES, ms(1));
        assert_eq!(miss.unwrap_err().code, ErrorCode::ObjectNotFound);
        get.answered(b"k", &loc, vec![replica(Some(1))], RULES, ms(1))
            .unwrap();
        let (get, step) = GetProtocol::start(b"k", &loc, false, ms(2));
        assert!(matches!(step, Step::Ask) && !get.cached());
    }

    #[test]
    fn an_answer_asked_before_this_clients_change_of_the_key_is_not_remembered() {
        let loc = Locations::<Duration>::new(16);
        let (mut get, _) = GetProtocol::start(b"k", &loc, true, ms(0));
        loc.forget(b"k"); // this client's put of the key ended meanwhile
        get.answered(b"k", &loc, vec![replica(Some(1))], RULES, ms(1))
            .unwrap();
        assert!(loc.get(b"k", ms(2)).is_none());
        // Nor is a replica whose bytes this client cannot check.
        let (mut get, _) = GetProtocol::start(b"k", &loc, true, ms(3));
        get.answered(b"k", &loc, vec![replica(None)], RULES, ms(4))
            .unwrap();
        assert!(loc.get(b"k", ms(5)).is_none());
    }

    /// `key` remembered by an answered get at `now`.
    fn remembered(loc: &Locations<Duration>, key: &[u8], now: Duration) {
        let (mut get, _) = GetProtocol::start(key, loc, true, now);
        get.answered(key, loc, vec![replica(Some(1))], RULES, now)
            .unwrap();
    }

    #[test]
    fn a_batch_reads_what_the_cache_holds_and_asks_for_the_rest_in_one_batch_get() {
        let loc = Locations::<Duration>::new(1024);
        let keys: [&[u8]; 3] = [b"a", b"b", b"c"];
        remembered(&loc, b"b", ms(0));
        let mut batch = BatchGet::start(&keys, &loc, ms(1));
        assert_eq!(batch.asks(), vec![0, 2]);
        let reads = batch.reads();
        assert_eq!(reads.len(), 1);
        assert!(reads[0].index == 1 && reads[0].cached && reads[0].len == 10);
        // a is there, c is not.
        let lists = vec![Ok(vec![replica(Some(1))]), Ok(Vec::new())];
        batch.answered(&keys, &loc, &[0, 2], lists, RULES, ms(2));
        assert!(batch.asks().is_empty());
        let reads = batch.reads();
        let places: Vec<(usize, bool)> = reads.iter().map(|r| (r.index, r.cached)).collect();
        assert_eq!(places, vec![(0, false), (1, true)]);
        // The answer's read window runs from the start (the ask's time).
        assert_eq!(reads[0].until, ms(1 + 3_500));
        assert!(!batch.done());
        batch.read(&keys, &loc, 0, Ok(()), ms(3));
        batch.read(&keys, &loc, 1, Ok(()), ms(3));
        assert!(batch.done());
        let (out, hits) = batch.finish().unwrap();
        assert_eq!(out[0].as_ref().unwrap(), &10);
        assert_eq!(out[1].as_ref().unwrap(), &10);
        assert_eq!(out[2].as_ref().unwrap_err().code, ErrorCode::ObjectNotFound);
        assert_eq!(hits, 1, "b came through the cache");
        assert!(loc.get(b"a", ms(4)).is_some(), "a's answer is remembered");
    }

    #[test]
    fn a_failed_read_through_the_cache_asks_in_the_next_pass_and_a_failed_read_of_an_answer_ends_the_key(
    ) {
        let loc = Locations::<Duration>::new(1024);
        let keys: [&[u8]; 2] = [b"a", b"b"];
        remembered(&loc, b"a", ms(0));
        remembered(&loc, b"b", ms(0));
        let mut batch = BatchGet::start(&keys, &loc, ms(1));
        assert!(batch.asks().is_empty());
        let stale = KvError::new(ErrorCode::InvalidParams, "too small for the entry's value");
        batch.read(&keys, &loc, 0, Err(stale), ms(2));
        batch.read(&keys, &loc, 1, Ok(()), ms(2));
        assert!(loc.get(b"a", ms(3)).is_none(), "a's entry is forgotten");
        assert_eq!(batch.asks(), vec![0], "a asks in the next pass");
        batch.answered(
            &keys,
            &loc,
            &[0],
            vec![Ok(vec![replica(Some(1))])],
            RULES,
            ms(3),
        );
        let reads = batch.reads();
        assert!(reads.len() == 1 && !reads[0].cached);
        let corrupt = KvError::new(ErrorCode::Corrupt, "bytes fail the checksum");
        batch.read(&keys, &loc, 0, Err(corrupt), ms(4));
        assert!(batch.done(), "a read of an answer is not asked for again");
        let (out, hits) = batch.finish().unwrap();
        assert_eq!(out[0].as_ref().unwrap_err().code, ErrorCode::Corrupt);
        assert_eq!(out[1].as_ref().unwrap(), &10);
        assert_eq!(hits, 1);
    }

    #[test]
    fn a_key_missing_from_the_masters_answer_is_an_error_not_a_wait() {
        let loc = Locations::<Duration>::new(1024);
        let keys: [&[u8]; 2] = [b"a", b"b"];
        let mut batch = BatchGet::start(&keys, &loc, ms(0));
        let e = KvError::new(ErrorCode::ReplicaNotReady, "being put");
        batch.answered(&keys, &loc, &[0, 1], vec![Err(e)], RULES, ms(1));
        assert!(batch.done());
        let (out, _) = batch.finish().unwrap();
        assert_eq!(
            out[0].as_ref().unwrap_err().code,
            ErrorCode::ReplicaNotReady
        );
        assert_eq!(out[1].as_ref().unwrap_err().code, ErrorCode::Internal);
    }
}
