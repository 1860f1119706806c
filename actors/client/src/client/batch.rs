//! Batch calls: many keys in one call per master shard, their transfers
//! side by side.

use super::*;

use std::collections::BTreeMap;

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
        let mut puts: Vec<PutProtocol> = items
            .iter()
            .map(|(k, v)| {
                let len = v.len() as u64;
                PutProtocol::new(self.inner.id, k.to_vec(), len, opts.clone(), self.timeout())
            })
            .collect();
        let mut out: Vec<Option<Result<(), KvError>>> = vec![None; items.len()];
        // A key given again in the batch is refused, as the master refuses
        // a second put of a key by the writer putting it; it is not placed
        // (its placements would share the first one's id, and a revoke of
        // its own could reach the first's).
        let mut seen = std::collections::HashSet::with_capacity(items.len());
        for (i, (k, _)) in items.iter().enumerate() {
            if !seen.insert(*k) {
                out[i] = Some(Err(KvError::new(
                    ErrorCode::ObjectAlreadyExists,
                    "the key is given earlier in this batch (being put)",
                )));
            }
        }
        let res = self
            .deadline("batch_put", async {
                let ids = OneId(self.next_put_id());
                let mut next: Vec<(usize, Action)> = puts
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| out[*i].is_none())
                    .map(|(i, p)| (i, p.begin(&ids)))
                    .collect();
                loop {
                    let mut pending = Vec::with_capacity(next.len());
                    for (i, a) in next {
                        match a {
                            Action::Done(r) => out[i] = Some(r),
                            a => pending.push((i, a)),
                        }
                    }
                    if pending.is_empty() {
                        return Ok(());
                    }
                    let inputs = self.put_round(items, pending, start, deadline).await;
                    let now = start.elapsed();
                    let ids = OneId(self.next_put_id());
                    next = inputs
                        .into_iter()
                        .map(|(i, input)| (i, puts[i].feed(now, &ids, input)))
                        .collect();
                }
            })
            .await;
        // Half-done placements give their space back, best effort, under a
        // deadline of their own: those the deadline cut short and those
        // whose last placement timed out (as a single put's).
        let mut revokes: BTreeMap<u16, Vec<Vec<u8>>> = BTreeMap::new();
        for (p, o) in puts.iter_mut().zip(&out) {
            let e = match (o, &res) {
                (Some(Err(e)), _) | (None, Err(e)) => e,
                _ => continue,
            };
            if let Some(MasterRequest::PutRevoke { key, put_id, .. }) = p.revoke_after(e) {
                revokes.entry(put_id).or_default().push(key);
            }
        }
        if !revokes.is_empty() {
            let me = self.clone();
            let client_id = self.inner.id;
            tokio::spawn(async move {
                for (put_id, keys) in revokes {
                    let revoke = call::BatchPutRevoke {
                        client_id,
                        put_id,
                        keys,
                    };
                    let _ = me.deadline("batch put revoke", me.ask(revoke)).await;
                }
            });
        }
        res?;
        Ok(out
            .into_iter()
            .map(|o| o.expect("every item has its result"))
            .collect())
    }

    /// One round of a batch put: the items' actions (none `Done`), grouped
    /// and carried out side by side; each item's input, in no set order.
    async fn put_round(
        &self,
        items: &[(&[u8], &[u8])],
        pending: Vec<(usize, Action)>,
        start: Instant,
        deadline: Instant,
    ) -> Vec<(usize, Input)> {
        type Group<T> = BTreeMap<u16, (Vec<usize>, Vec<T>)>;
        let mut starts: Group<PutItem> = BTreeMap::new();
        let mut start_opts: BTreeMap<u16, PutOptions> = BTreeMap::new();
        let mut ends: Group<PutDone> = BTreeMap::new();
        let mut revokes: Group<Vec<u8>> = BTreeMap::new();
        let mut alone: Vec<(usize, MasterRequest)> = Vec::new();
        let mut writes: BTreeMap<Duration, Vec<(usize, Vec<ReplicaDesc>)>> = BTreeMap::new();
        let (mut sleep, mut sleepers) = (Duration::ZERO, Vec::new());
        let (mut reporters, mut readers) = (Vec::new(), Vec::new());
        let mut out = Vec::with_capacity(pending.len());
        for (i, a) in pending {
            match a {
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
                Action::Ask(req) => alone.push((i, req)),
                Action::Write { replicas, by } => writes.entry(by).or_default().push((i, replicas)),
                Action::Sleep(d) => {
                    sleep = sleep.max(d);
                    sleepers.push(i);
                }
                Action::ReportUnreachable => reporters.push(i),
                Action::ReadBack => readers.push(i),
                Action::Done(r) => out.push((
                    i,
                    Input::Answer(Err(KvError::new(
                        ErrorCode::Internal,
                        format!("a batch put's round got a finished item ({r:?})"),
                    ))),
                )),
            }
        }
        let client_id = self.inner.id;
        // Every request of the round, one future each, side by side: the
        // grouped ones answer per item, another (none today) as it is.
        let mut requests: Vec<(Vec<usize>, MasterRequest, bool)> = Vec::new();
        for (put_id, (at, items)) in starts {
            let opts = start_opts.remove(&put_id).unwrap_or_default();
            let req = call::BatchPutStart {
                client_id,
                items,
                opts,
            };
            requests.push((at, req.into(), true));
        }
        for (put_id, (at, items)) in ends {
            let req = call::BatchPutEnd {
                client_id,
                put_id,
                items,
            };
            requests.push((at, req.into(), true));
        }
        for (put_id, (at, keys)) in revokes {
            let req = call::BatchPutRevoke {
                client_id,
                put_id,
                keys,
            };
            requests.push((at, req.into(), true));
        }
        requests.extend(alone.into_iter().map(|(i, req)| (vec![i], req, false)));
        let asks = requests.into_iter().map(|(at, req, grouped)| async move {
            let res = self.send(req).await;
            if grouped {
                per_item(at, res)
            } else {
                at.into_iter()
                    .map(|i| (i, Input::Answer(res.clone())))
                    .collect()
            }
        });
        let summing = self.inner.cfg.checksums;
        let writes = writes.into_iter().map(|(by, group)| async move {
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
            if !sleepers.is_empty() {
                tokio::time::sleep(sleep).await;
            }
            sleepers
                .into_iter()
                .map(|i| (i, Input::Woke))
                .collect::<Vec<_>>()
        };
        let reporting = async {
            if reporters.is_empty() {
                return Vec::new();
            }
            let n = self.report_unreachable().await;
            reporters
                .into_iter()
                .map(|i| (i, Input::Reported(n)))
                .collect()
        };
        let reading = readers.into_iter().map(|i| async move {
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
        out.extend(asked.into_iter().flatten());
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
            for (i, (list, (_, buf))) in lists.iter().zip(items.iter_mut()).enumerate() {
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
                            transfers.push(Transfer::read(&mut buf[..len], reps));
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
                        transfers.push(Transfer::read(buf, reps));
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

/// A batch answer (`BatchDone` or `BatchReplicas`) handed to the items at
/// `at` as the answers of their single calls; a whole failure is each
/// item's.
fn per_item(at: Vec<usize>, res: Result<MasterResponse, KvError>) -> Vec<(usize, Input)> {
    let answers: Vec<Result<MasterResponse, KvError>> = match res {
        Ok(MasterResponse::BatchDone(v)) if v.len() == at.len() => v
            .into_iter()
            .map(|r| Result::from(r).map(|()| MasterResponse::Done))
            .collect(),
        Ok(MasterResponse::BatchReplicas(v)) if v.len() == at.len() => v
            .into_iter()
            .map(|r| Result::from(r).map(MasterResponse::Replicas))
            .collect(),
        Ok(other) => vec![Err(call::unexpected("a batch put", &other)); at.len()],
        Err(e) => vec![Err(e); at.len()],
    };
    at.into_iter()
        .zip(answers)
        .map(|(i, a)| (i, Input::Answer(a)))
        .collect()
}
