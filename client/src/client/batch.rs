//! Batch calls: many keys in one call per master shard, their transfers
//! side by side.

use super::*;

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
    /// item (the value's length), in order.
    pub async fn batch_get_into(
        &self,
        items: &mut [(&[u8], &mut [u8])],
    ) -> Result<Vec<Result<usize, KvError>>, KvError> {
        let deadline = self.call_deadline();
        self.deadline("batch_get", async {
            let req = call::BatchGet {
                keys: items.iter().map(|(k, _)| k.to_vec()).collect(),
            };
            let until = self.lease_until(Instant::now());
            let lists: Vec<Result<Vec<ReplicaDesc>, KvError>> =
                self.ask(req).await?.into_iter().map(Result::from).collect();
            let mut out: Vec<Result<usize, KvError>> = Vec::with_capacity(items.len());
            let mut transfers: Vec<Transfer<'_>> = Vec::new();
            let mut which: Vec<usize> = Vec::new();
            for (i, (list, (key, buf))) in lists.iter().zip(items.iter_mut()).enumerate() {
                match list {
                    Ok(reps) if reps.is_empty() => out.push(Err(KvError::new(
                        ErrorCode::ObjectNotFound,
                        "no readable replica",
                    ))),
                    Ok(reps) => {
                        let len = reps[0].len as usize;
                        if len > buf.len() {
                            out.push(Err(too_small(len, buf.len())));
                        } else {
                            out.push(Ok(len));
                            transfers.push(Transfer::read(key, &mut buf[..len], reps));
                            which.push(i);
                        }
                    }
                    Err(e) => out.push(Err(e.clone())),
                }
            }
            // No read past the lease (see `Client::lease_until`).
            let until = deadline.min(until);
            self.inner.engine.run(&mut transfers, until, None).await;
            for (t, &i) in transfers.into_iter().zip(&which) {
                if let Some(Err(e)) = t.status {
                    out[i] = Err(e);
                }
            }
            Ok(out)
        })
        .await
    }

    /// Reads several values; one result per key, in order.
    pub async fn batch_get(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<Vec<u8>, KvError>>, KvError> {
        let deadline = self.call_deadline();
        self.deadline("batch_get", async {
            let req = call::BatchGet {
                keys: keys.iter().map(|k| k.to_vec()).collect(),
            };
            let until = self.lease_until(Instant::now());
            let lists: Vec<Result<Vec<ReplicaDesc>, KvError>> =
                self.ask(req).await?.into_iter().map(Result::from).collect();
            let mut bufs: Vec<Vec<u8>> = lists
                .iter()
                .map(|l| match l {
                    Ok(reps) if !reps.is_empty() => vec![0u8; reps[0].len as usize],
                    _ => Vec::new(),
                })
                .collect();
            let mut transfers: Vec<Transfer<'_>> = Vec::new();
            let mut which: Vec<usize> = Vec::new();
            for (i, (list, buf)) in lists.iter().zip(bufs.iter_mut()).enumerate() {
                if let Ok(reps) = list {
                    if !reps.is_empty() {
                        transfers.push(Transfer::read(keys[i], buf, reps));
                        which.push(i);
                    }
                }
            }
            // No read past the lease (see `Client::lease_until`).
            let until = deadline.min(until);
            self.inner.engine.run(&mut transfers, until, None).await;
            let mut status: Vec<Option<KvError>> = vec![None; keys.len()];
            for (t, &i) in transfers.into_iter().zip(&which) {
                if let Some(Err(e)) = t.status {
                    status[i] = Some(e);
                }
            }
            Ok(lists
                .into_iter()
                .zip(bufs)
                .zip(status)
                .map(|((list, buf), st)| match (list, st) {
                    (Err(e), _) | (Ok(_), Some(e)) => Err(e),
                    (Ok(reps), None) if reps.is_empty() => Err(KvError::new(
                        ErrorCode::ObjectNotFound,
                        "no readable replica",
                    )),
                    (Ok(_), None) => Ok(buf),
                })
                .collect())
        })
        .await
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
