//! Batch calls: many keys in one call per master shard, their transfers
//! side by side.

use super::*;

use crate::get::{BatchGet, BatchRead};
use crate::put::batch::{BatchPut, Round};
use crate::put::{Input, OneId};

impl Client {
    /// Stores several values; one result per item, in order. Each item
    /// follows the put protocol ([`PutProtocol`]: waits, placements again,
    /// resent ends and read-backs by the same rules as [`Client::put_with`]);
    /// the items move together in rounds, each round's requests grouped
    /// into one batch call per kind and placement (one per owning master
    /// shard), its writes in one engine batch (sent straight from the given
    /// slices). With `opts.replace` (the atomic replace of
    /// [`Client::upsert`]) an item that meets another client's put of its
    /// key waits for it within the deadline. A batch the deadline cuts
    /// short is a `Timeout`; the placements it leaves are revoked.
    pub async fn batch_put(
        &self,
        items: &[(&[u8], &[u8])],
        opts: &PutOptions,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        // Forgotten once the puts are over (as in `put_with`).
        let _forget = OnDrop(|| {
            for (k, _) in items {
                self.inner.locations.forget(k);
            }
        });
        let start = Instant::now();
        let deadline = start + self.timeout();
        let opts = self.with_host(opts);
        let lens: Vec<(&[u8], u64)> = items.iter().map(|(k, v)| (*k, v.len() as u64)).collect();
        let mut batch = BatchPut::new(self.inner.id, &lens, &opts, self.timeout());
        let res = self
            .deadline("batch_put", async {
                let mut round = batch.begin(&OneId(self.next_put_id()));
                while let Some(r) = round {
                    let inputs = self.put_round(items, r, start, deadline).await;
                    let ids = OneId(self.next_put_id());
                    round = batch.feed(start.elapsed(), &ids, inputs);
                }
                Ok(())
            })
            .await;
        // Half-done placements give their space back, best effort, under a
        // deadline of their own: those the deadline cut short and those
        // whose last placement timed out (as a single put's).
        let revokes = batch.revokes(res.as_ref().err());
        if !revokes.is_empty() {
            let me = self.clone();
            tokio::spawn(async move {
                for revoke in revokes {
                    let _ = me.deadline("batch put revoke", me.send(revoke)).await;
                }
            });
        }
        res?;
        Ok(batch.results())
    }

    /// Carries out one round of a batch put ([`Round`]) side by side; each
    /// item's input, in no set order.
    async fn put_round(
        &self,
        items: &[(&[u8], &[u8])],
        round: Round,
        start: Instant,
        deadline: Instant,
    ) -> Vec<(usize, Input)> {
        let asks = round.asks.into_iter().map(|ask| async move {
            let res = self.send(ask.req.clone()).await;
            ask.inputs(res)
        });
        let summing = self.inner.cfg.checksums;
        let writes = round.writes.into_iter().map(|(by, group)| async move {
            let mut transfers: Vec<Transfer<'_>> = group
                .iter()
                .map(|(i, reps)| {
                    let v = items[*i].1;
                    if summing {
                        Transfer::write_summed(v, reps)
                    } else {
                        Transfer::write(v, reps)
                    }
                })
                .collect();
            self.inner
                .engine
                .run(&mut transfers, start + by, None)
                .await;
            group
                .iter()
                .zip(transfers)
                .map(|((i, _), t)| {
                    let written = match t.status {
                        Some(Err(e)) => Err(e),
                        _ => Ok(t.sum),
                    };
                    (*i, Input::Written(written))
                })
                .collect::<Vec<_>>()
        });
        let sleeping = async {
            let Some((pause, sleepers)) = round.sleep else {
                return Vec::new();
            };
            tokio::time::sleep(pause).await;
            sleepers
                .into_iter()
                .map(|i| (i, Input::Woke))
                .collect::<Vec<_>>()
        };
        let reporting = async {
            if round.reporters.is_empty() {
                return Vec::new();
            }
            let n = self.report_unreachable().await;
            round
                .reporters
                .into_iter()
                .map(|i| (i, Input::Reported(n)))
                .collect()
        };
        let reading = round.readers.into_iter().map(|i| async move {
            let (k, v) = items[i];
            (i, Input::Held(self.holds(k, v, deadline).await))
        });
        let (asked, written, slept, reported, read) = tokio::join!(
            futures_util::future::join_all(asks),
            futures_util::future::join_all(writes),
            sleeping,
            reporting,
            futures_util::future::join_all(reading),
        );
        let mut out: Vec<(usize, Input)> = asked.into_iter().flatten().collect();
        out.extend(written.into_iter().flatten());
        out.extend(slept);
        out.extend(reported);
        out.extend(read);
        out
    }

    /// Reads several values straight into the given buffers; one result per
    /// item (the value's length), in order. Each key follows the get
    /// protocol ([`GetProtocol`]): a key this client read while its lease
    /// still lasts is read from its node at once, the others are asked of
    /// the master in one `BatchGet` (see [`Client::batch_get`]). A value
    /// longer than its buffer is `InvalidParams` (nothing is read).
    pub async fn batch_get_into(
        &self,
        items: &mut [(&[u8], &mut [u8])],
    ) -> Result<Vec<Result<usize, KvError>>, KvError> {
        let keys: Vec<&[u8]> = items.iter().map(|(k, _)| *k).collect();
        self.batch_read(&keys, &mut Dsts::Into(items)).await
    }

    /// Reads several values; one result per key, in order. Each key
    /// follows the get protocol ([`GetProtocol`]), as [`Client::get`]: a
    /// key this client read while its lease still lasts is read from its
    /// node at once (the location cache's entry); the others are asked of
    /// the master in one `BatchGet`, and what it answers is remembered.
    /// The reads go side by side in the transfer engine, each until its
    /// replicas' read window ends; a read through an entry that fails
    /// (the object replaced, a node gone) forgets the entry and asks once
    /// more, with the batch's other such keys.
    pub async fn batch_get(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<Vec<u8>, KvError>>, KvError> {
        let mut bufs = vec![Vec::new(); keys.len()];
        let r = self.batch_read(keys, &mut Dsts::Owned(&mut bufs)).await;
        Ok(r?
            .into_iter()
            .zip(bufs)
            .map(|(r, buf)| r.map(|_| buf))
            .collect())
    }

    /// A batch get's driver ([`BatchGet`]): in each pass, one `BatchGet`
    /// of the keys that ask, then every read side by side: those through
    /// the location cache and those the master answered in two engine
    /// batches, each until the earliest end of its reads' windows (and the
    /// call's deadline). A value that does not fit its buffer is a failed
    /// read (through the cache, the entry may be stale: it asks again).
    async fn batch_read(
        &self,
        keys: &[&[u8]],
        dsts: &mut Dsts<'_, '_, '_>,
    ) -> Result<Vec<Result<usize, KvError>>, KvError> {
        let deadline = self.call_deadline();
        let r = self
            .deadline("batch_get", async {
                let locations = &self.inner.locations;
                let mut batch = BatchGet::start(keys, locations, Instant::now());
                while !batch.done() {
                    let asked = batch.asks();
                    if !asked.is_empty() {
                        let req = call::BatchGet {
                            keys: asked.iter().map(|&i| keys[i].to_vec()).collect(),
                        };
                        let lists = self.ask(req).await?.into_iter().map(Result::from).collect();
                        let rules = self.answers();
                        batch.answered(keys, locations, &asked, lists, rules, Instant::now());
                    }
                    let mut outcomes = Vec::new();
                    let mut fitting = Vec::new();
                    for r in batch.reads() {
                        match dsts.size(r.index, r.len) {
                            Ok(()) => fitting.push(r),
                            Err(e) => outcomes.push((r.index, Err(e))),
                        }
                    }
                    outcomes.extend(self.batch_transfers(keys, &fitting, dsts, deadline).await);
                    let now = Instant::now();
                    for (i, outcome) in outcomes {
                        batch.read(keys, locations, i, outcome, now);
                    }
                }
                let (out, hits) = batch.finish().expect("every key's get ended");
                self.inner
                    .location_hits
                    .fetch_add(hits as u64, Ordering::Relaxed);
                Ok(out)
            })
            .await;
        self.report_unreachable_later();
        r
    }

    /// Makes `reads` (ascending places) into their buffers: those through
    /// the location cache and those the master answered in two engine
    /// batches side by side, each stopped at the earliest end of its
    /// reads' windows (and `deadline`). Each read's place and outcome.
    async fn batch_transfers(
        &self,
        keys: &[&[u8]],
        reads: &[BatchRead<Instant>],
        dsts: &mut Dsts<'_, '_, '_>,
        deadline: Instant,
    ) -> Vec<(usize, Result<(), KvError>)> {
        let want: Vec<(usize, usize)> = reads.iter().map(|r| (r.index, r.len)).collect();
        let bufs = dsts.slices(&want);
        let (mut cached, mut asked) = (Vec::new(), Vec::new());
        let (mut cached_until, mut asked_until) = (deadline, deadline);
        for (r, buf) in reads.iter().zip(bufs) {
            let t = Transfer::read(keys[r.index], buf, &r.replicas);
            if r.cached {
                cached_until = cached_until.min(r.until);
                cached.push(t);
            } else {
                asked_until = asked_until.min(r.until);
                asked.push(t);
            }
        }
        let engine = &self.inner.engine;
        tokio::join!(
            engine.run(&mut cached, cached_until, None),
            engine.run(&mut asked, asked_until, None),
        );
        let (mut cached, mut asked) = (cached.into_iter(), asked.into_iter());
        reads
            .iter()
            .map(|r| {
                let t = if r.cached {
                    cached.next()
                } else {
                    asked.next()
                };
                let outcome = t.and_then(|t| t.status).unwrap_or_else(|| {
                    Err(KvError::new(
                        ErrorCode::Internal,
                        "a read without an outcome",
                    ))
                });
                (r.index, outcome)
            })
            .collect()
    }

    /// Whether each key is stored; one result per key, in order.
    pub async fn batch_exists(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<bool, KvError>>, KvError> {
        let req = call::BatchExist {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        };
        let v = self.call(req).await?;
        Ok(v.into_iter().map(Result::from).collect())
    }

    /// Removes several keys; one result per key, in order.
    pub async fn batch_remove(
        &self,
        keys: &[&[u8]],
        force: bool,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        let _forget = OnDrop(|| {
            for k in keys {
                self.inner.locations.forget(k);
            }
        }); // as in `put_with`
        let req = call::BatchRemove {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
            force,
        };
        let v = self.call(req).await?;
        Ok(v.into_iter().map(Result::from).collect())
    }

    /// Views of several values in place (see [`Client::get_view`]), from one
    /// batch lookup; one result per key, in order: `ObjectNotFound`,
    /// `ReplicaNotReady` (still being put), `Unavailable` (no replica that
    /// can be mapped on this host: read it with [`Client::batch_get`]), or
    /// the view.
    pub async fn batch_get_view(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<ReadView, KvError>>, KvError> {
        self.deadline("batch_get_view", async {
            let granted = Instant::now();
            let req = call::BatchGet {
                keys: keys.iter().map(|k| k.to_vec()).collect(),
            };
            let lists = self.ask(req).await?;
            let mut out = Vec::with_capacity(lists.len());
            for list in lists {
                out.push(match Result::<Vec<ReplicaDesc>, KvError>::from(list) {
                    Ok(reps) if reps.is_empty() => Err(KvError::new(
                        ErrorCode::ObjectNotFound,
                        "the object has no readable replica",
                    )),
                    Ok(reps) => self.view_of(&reps, granted).await,
                    Err(e) => Err(e),
                });
            }
            Ok(out)
        })
        .await
    }
}

/// Where a batch get's values go: buffers it sizes itself
/// ([`Client::batch_get`]) or the caller's ([`Client::batch_get_into`]).
enum Dsts<'a, 'k, 'b> {
    Owned(&'a mut [Vec<u8>]),
    Into(&'a mut [(&'k [u8], &'b mut [u8])]),
}

impl Dsts<'_, '_, '_> {
    /// Makes item `i`'s buffer hold a value of `len` bytes: sized to it, or
    /// `InvalidParams` when the caller's is smaller.
    fn size(&mut self, i: usize, len: usize) -> Result<(), KvError> {
        match self {
            Dsts::Owned(bufs) => {
                bufs[i] = zeroed(len as u64)?;
                Ok(())
            }
            Dsts::Into(items) if items[i].1.len() < len => Err(too_small(len, items[i].1.len())),
            Dsts::Into(_) => Ok(()),
        }
    }

    /// The buffers of the items `want` names (ascending item, the value's
    /// length), in that order.
    fn slices(&mut self, want: &[(usize, usize)]) -> Vec<&mut [u8]> {
        let mut want = want.iter().peekable();
        let bufs: Box<dyn Iterator<Item = &mut [u8]>> = match self {
            Dsts::Owned(bufs) => Box::new(bufs.iter_mut().map(|b| b.as_mut_slice())),
            Dsts::Into(items) => Box::new(items.iter_mut().map(|(_, b)| &mut **b)),
        };
        let mut out = Vec::with_capacity(want.len());
        for (i, b) in bufs.enumerate() {
            if let Some(&(_, len)) = want.next_if(|w| w.0 == i) {
                out.push(&mut b[..len]);
            }
        }
        out
    }
}
