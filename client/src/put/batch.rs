//! A batch put without I/O (issue 32): one [`PutProtocol`] per item, moved
//! in rounds. A round is every unfinished item's next action, grouped: the
//! starts, ends and revokes as one batch request per kind and placement id
//! (the placements of one round share an id, [`super::OneId`]), writes by
//! their time, pauses as the longest, reports once, read-backs side by
//! side. The driver carries a [`Round`] out and hands each item its input;
//! [`crate::Client::batch_put`] does so over sockets, the cluster
//! simulation over its network.
//!
//! ```text
//!   BatchPut::begin(ids) -> Round --driver--> inputs -> feed(now, ids, inputs) -> Round ...
//!                                                                          \-> None: results()
//! ```

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use kvpool_wire::proto::call;
use kvpool_wire::proto::{
    ClientId, MasterRequest, MasterResponse, PutDone, PutItem, PutOptions, ReplicaDesc,
};
use kvpool_wire::{ErrorCode, KvError};

use super::{Action, Input, PlaceIds, PutProtocol};

/// The items of one batch put and where each stands.
#[derive(Debug)]
pub struct BatchPut {
    client_id: ClientId,
    puts: Vec<PutProtocol>,
    out: Vec<Option<Result<(), KvError>>>,
    /// The items of the round under way.
    pending: Vec<usize>,
}

/// One request of a round to the master, and the items its answer is for.
#[derive(Debug, Clone)]
pub struct Ask {
    pub req: MasterRequest,
    /// The items, in the order of the request's keys.
    pub at: Vec<usize>,
    /// A batch request, answered per item (else one item's own request).
    grouped: bool,
}

impl Ask {
    /// The answer `res`, as each item's input: a batch answer item by item,
    /// a failure of the whole request each item's.
    pub fn inputs(&self, res: Result<MasterResponse, KvError>) -> Vec<(usize, Input)> {
        if !self.grouped {
            return self
                .at
                .iter()
                .map(|&i| (i, Input::Answer(res.clone())))
                .collect();
        }
        let n = self.at.len();
        let answers: Vec<Result<MasterResponse, KvError>> = match res {
            Ok(MasterResponse::BatchDone(v)) if v.len() == n => v
                .into_iter()
                .map(|r| Result::from(r).map(|()| MasterResponse::Done))
                .collect(),
            Ok(MasterResponse::BatchReplicas(v)) if v.len() == n => v
                .into_iter()
                .map(|r| Result::from(r).map(MasterResponse::Replicas))
                .collect(),
            Ok(other) => vec![Err(call::unexpected("a batch put", &other)); n],
            Err(e) => vec![Err(e); n],
        };
        self.at
            .iter()
            .zip(answers)
            .map(|(&i, a)| (i, Input::Answer(a)))
            .collect()
    }
}

/// Writes due by one time (since the batch began): each item's value to
/// its replicas.
pub type WriteGroup = (Duration, Vec<(usize, Vec<ReplicaDesc>)>);

/// What a round does, side by side; every item of it gets one input.
#[derive(Debug, Default)]
pub struct Round {
    /// Requests to the master; each answer reaches its items through
    /// [`Ask::inputs`].
    pub asks: Vec<Ask>,
    /// Writes by their time, earliest first; each item is fed
    /// `Input::Written`.
    pub writes: Vec<WriteGroup>,
    /// Items that pause, all for the longest pause any asked; each is fed
    /// `Input::Woke`.
    pub sleep: Option<(Duration, Vec<usize>)>,
    /// Items that report the unreachable segments (reported once for
    /// all); each is fed `Input::Reported` with how many.
    pub reporters: Vec<usize>,
    /// Items whose key is read back; each is fed `Input::Held`.
    pub readers: Vec<usize>,
}

impl BatchPut {
    /// A batch put of `items` (key, length) with `opts`, with `budget` from
    /// its start. A key given again in the batch is refused at once
    /// (`ObjectAlreadyExists`, as the master refuses a second put of a key
    /// by the writer putting it) and never placed: its placements would
    /// share the first one's id, and a revoke of its own could reach the
    /// first's.
    pub fn new(
        client_id: ClientId,
        items: &[(&[u8], u64)],
        opts: &PutOptions,
        budget: Duration,
    ) -> Self {
        let mut seen = HashSet::with_capacity(items.len());
        let out = items
            .iter()
            .map(|(k, _)| {
                (!seen.insert(*k)).then(|| {
                    Err(KvError::new(
                        ErrorCode::ObjectAlreadyExists,
                        "the key is given earlier in this batch (being put)",
                    ))
                })
            })
            .collect();
        let puts = items
            .iter()
            .map(|(k, len)| PutProtocol::new(client_id, k.to_vec(), *len, opts.clone(), budget))
            .collect();
        Self {
            client_id,
            puts,
            out,
            pending: Vec::new(),
        }
    }

    /// The first round (`None`: nothing to do), its placements named by
    /// `ids`.
    pub fn begin(&mut self, ids: &impl PlaceIds) -> Option<Round> {
        let next: Vec<(usize, Action)> = (0..self.puts.len())
            .filter(|&i| self.out[i].is_none())
            .map(|i| (i, self.puts[i].begin(ids)))
            .collect();
        self.plan(next)
    }

    /// The inputs of the round under way, `now` since the batch began; the
    /// next round (`None`: every item is over), its placements named by
    /// `ids`. An item of the round given no input fails (`Internal`).
    pub fn feed(
        &mut self,
        now: Duration,
        ids: &impl PlaceIds,
        inputs: Vec<(usize, Input)>,
    ) -> Option<Round> {
        let mut fed = vec![false; self.puts.len()];
        let mut next = Vec::with_capacity(inputs.len());
        for (i, input) in inputs {
            if !self.pending.contains(&i) || std::mem::replace(&mut fed[i], true) {
                continue;
            }
            next.push((i, self.puts[i].feed(now, ids, input)));
        }
        for &i in &self.pending {
            if !fed[i] {
                let e = KvError::new(ErrorCode::Internal, "a batch put's round gave no input");
                next.push((i, Action::Done(Err(e))));
            }
        }
        self.plan(next)
    }

    /// Each item's result, in order; an item not over is `Timeout` (the
    /// call's deadline cut the batch short).
    pub fn results(self) -> Vec<Result<(), KvError>> {
        self.out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Err(KvError::new(
                        ErrorCode::Timeout,
                        "the batch put did not finish before its deadline",
                    ))
                })
            })
            .collect()
    }

    /// The revokes that give half-done placements their space back (best
    /// effort, under a deadline of their own): those of items that failed
    /// and, when the whole call failed with `call` (its deadline), of items
    /// not over. One `BatchPutRevoke` per placement id.
    pub fn revokes(&mut self, call: Option<&KvError>) -> Vec<MasterRequest> {
        let mut by_id: BTreeMap<u16, Vec<Vec<u8>>> = BTreeMap::new();
        for (p, o) in self.puts.iter_mut().zip(&self.out) {
            let e = match (o, call) {
                (Some(Err(e)), _) | (None, Some(e)) => e,
                _ => continue,
            };
            if let Some(MasterRequest::PutRevoke { key, put_id, .. }) = p.revoke_after(e) {
                by_id.entry(put_id).or_default().push(key);
            }
        }
        let client_id = self.client_id;
        by_id
            .into_iter()
            .map(|(put_id, keys)| {
                call::BatchPutRevoke {
                    client_id,
                    put_id,
                    keys,
                }
                .into()
            })
            .collect()
    }

    /// Records the finished items of `next` and groups the others' actions
    /// into a round.
    fn plan(&mut self, next: Vec<(usize, Action)>) -> Option<Round> {
        type Group<T> = BTreeMap<u16, (Vec<usize>, Vec<T>)>;
        let mut starts: Group<PutItem> = BTreeMap::new();
        let mut start_opts: BTreeMap<u16, PutOptions> = BTreeMap::new();
        let mut ends: Group<PutDone> = BTreeMap::new();
        let mut revokes: Group<Vec<u8>> = BTreeMap::new();
        let mut writes: BTreeMap<Duration, Vec<(usize, Vec<ReplicaDesc>)>> = BTreeMap::new();
        let mut round = Round::default();
        let mut alone = Vec::new();
        self.pending.clear();
        for (i, a) in next {
            if !matches!(a, Action::Done(_)) {
                self.pending.push(i);
            }
            match a {
                Action::Done(r) => self.out[i] = Some(r),
                Action::Ask(MasterRequest::PutStart { key, len, opts, .. }) => {
                    let g = starts.entry(opts.put_id).or_default();
                    g.0.push(i);
                    g.1.push(PutItem { key, len });
                    start_opts.entry(opts.put_id).or_insert(opts);
                }
                Action::Ask(MasterRequest::PutEnd {
                    key,
                    put_id,
                    checksum,
                    ..
                }) => {
                    let g = ends.entry(put_id).or_default();
                    g.0.push(i);
                    g.1.push(PutDone { key, checksum });
                }
                Action::Ask(MasterRequest::PutRevoke { key, put_id, .. }) => {
                    let g = revokes.entry(put_id).or_default();
                    g.0.push(i);
                    g.1.push(key);
                }
                Action::Ask(req) => alone.push(Ask {
                    req,
                    at: vec![i],
                    grouped: false,
                }),
                Action::Write { replicas, by } => writes.entry(by).or_default().push((i, replicas)),
                Action::Sleep(d) => {
                    let (longest, who) = round.sleep.get_or_insert((d, Vec::new()));
                    *longest = (*longest).max(d);
                    who.push(i);
                }
                Action::ReportUnreachable => round.reporters.push(i),
                Action::ReadBack => round.readers.push(i),
            }
        }
        if self.pending.is_empty() {
            return None;
        }
        let client_id = self.client_id;
        let mut grouped = |at: Vec<usize>, req: MasterRequest| {
            let grouped = true;
            round.asks.push(Ask { req, at, grouped });
        };
        for (put_id, (at, items)) in starts {
            let opts = start_opts.remove(&put_id).unwrap_or_default();
            let req = call::BatchPutStart {
                client_id,
                items,
                opts,
            };
            grouped(at, req.into());
        }
        for (put_id, (at, items)) in ends {
            let req = call::BatchPutEnd {
                client_id,
                put_id,
                items,
            };
            grouped(at, req.into());
        }
        for (put_id, (at, keys)) in revokes {
            let req = call::BatchPutRevoke {
                client_id,
                put_id,
                keys,
            };
            grouped(at, req.into());
        }
        round.asks.extend(alone);
        round.writes = writes.into_iter().collect();
        Some(round)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::put::OneId;
    use kvpool_wire::proto::ItemResult;

    const BUDGET: Duration = Duration::from_secs(10);

    #[test]
    fn a_round_groups_the_items_starts_into_one_batch_request_and_a_repeated_key_is_refused() {
        let items: [(&[u8], u64); 3] = [(b"a", 10), (b"b", 20), (b"a", 30)];
        let mut b = BatchPut::new(7, &items, &PutOptions::default(), BUDGET);
        let r = b.begin(&OneId(5)).expect("a round");
        assert_eq!(r.asks.len(), 1);
        let ask = &r.asks[0];
        assert_eq!(ask.at, [0, 1]);
        match &ask.req {
            MasterRequest::BatchPutStart {
                client_id,
                items,
                opts,
            } => {
                assert_eq!((*client_id, opts.put_id), (7, 5));
                let keys: Vec<&[u8]> = items.iter().map(|i| i.key.as_slice()).collect();
                assert_eq!(keys, [b"a".as_slice(), b"b"]);
            }
            other => panic!("{other:?}"),
        }
        // The master's whole answer lost: each item's input is the error.
        let lost = KvError::new(ErrorCode::Unavailable, "reset");
        let inputs = ask.inputs(Err(lost));
        assert_eq!(inputs.len(), 2);
        assert!(inputs
            .iter()
            .all(|(_, i)| matches!(i, Input::Answer(Err(e)) if e.code == ErrorCode::Unavailable)));
        let err = b.results().remove(2).unwrap_err();
        assert_eq!(err.code, ErrorCode::ObjectAlreadyExists);
    }

    #[test]
    fn each_item_is_fed_its_own_part_of_a_batch_answer_and_an_item_given_no_input_fails() {
        let items: [(&[u8], u64); 2] = [(b"a", 10), (b"b", 20)];
        let mut b = BatchPut::new(7, &items, &PutOptions::default(), BUDGET);
        let r = b.begin(&OneId(5)).unwrap();
        // "a" refused, "b" placed.
        let answer = MasterResponse::BatchReplicas(vec![
            ItemResult::from(Err(KvError::new(ErrorCode::InvalidParams, "bad key"))),
            ItemResult::Ok(Vec::new()),
        ]);
        let r = b
            .feed(Duration::ZERO, &OneId(6), r.asks[0].inputs(Ok(answer)))
            .expect("b goes on");
        assert_eq!(r.writes.len(), 1);
        assert_eq!(r.writes[0].1.iter().map(|w| w.0).collect::<Vec<_>>(), [1]);
        // "a" first reports unreachable nodes (none): then its error stands.
        assert_eq!(r.reporters, [0]);
        // The driver forgets b's write: b fails rather than hangs.
        let reported = vec![(0, Input::Reported(0))];
        assert!(b.feed(Duration::ZERO, &OneId(7), reported).is_none());
        let res = b.results();
        assert_eq!(res[0].as_ref().unwrap_err().code, ErrorCode::InvalidParams);
        assert_eq!(res[1].as_ref().unwrap_err().code, ErrorCode::Internal);
    }
}
