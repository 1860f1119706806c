//! Batch calls: many keys in one call per master shard, their transfers
//! side by side.

use super::*;

impl Client {
    /// Stores several values; one result per item, in order. Keys are
    /// grouped by owning master shard (one call per shard); all values move
    /// in one engine batch (sent straight from the given slices). Items
    /// that meet space still being freed, a key still being recovered by a
    /// restarted master, or (with `opts.replace`, the atomic replace of
    /// [`Client::upsert`]) another client's put of their key, wait for it
    /// within the deadline.
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
        let deadline = self.call_deadline();
        self.deadline("batch_put", async {
            let mut out: Vec<Option<Result<(), KvError>>> = vec![None; items.len()];
            let mut todo: Vec<usize> = (0..items.len()).collect();
            let mut backoff = Duration::from_millis(1);
            loop {
                let sub: Vec<(&[u8], &[u8])> = todo.iter().map(|&i| items[i]).collect();
                let res = self.batch_put_once(&sub, opts, deadline).await?;
                let mut again = Vec::new();
                for (&i, r) in todo.iter().zip(res) {
                    match r {
                        Err(e) if waits_to_put(&e) => again.push(i),
                        r => out[i] = Some(r),
                    }
                }
                if again.is_empty() {
                    break;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(PUT_RETRY_MAX);
                todo = again;
            }
            Ok(out
                .into_iter()
                .map(|o| o.expect("every item has its result"))
                .collect())
        })
        .await
    }

    pub(super) async fn batch_put_once(
        &self,
        items: &[(&[u8], &[u8])],
        opts: &PutOptions,
        deadline: Instant,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        {
            let mut opts = self.with_host(opts);
            opts.put_id = self.next_put_id();
            let put_id = opts.put_id;
            let req = call::BatchPutStart {
                client_id: self.inner.id,
                items: items
                    .iter()
                    .map(|(k, v)| PutItem {
                        key: k.to_vec(),
                        len: v.len() as u64,
                    })
                    .collect(),
                opts,
            };
            let started: Vec<Result<Vec<ReplicaDesc>, KvError>> =
                self.ask(req).await?.into_iter().map(Result::from).collect();
            // Per item: Ok(checksum) written; Err((e, true)) allocated but
            // not written (its space must go back); Err((e, false)) refused.
            let summing = self.inner.cfg.checksums;
            let mut transfers: Vec<Transfer<'_>> = Vec::new();
            let mut which: Vec<usize> = Vec::new();
            for (i, (s, (_, v))) in started.iter().zip(items).enumerate() {
                if let Ok(reps) = s {
                    transfers.push(if summing {
                        Transfer::write_summed(v, reps)
                    } else {
                        Transfer::write(v, reps)
                    });
                    which.push(i);
                }
            }
            self.inner.engine.run(&mut transfers, deadline, None).await;
            let mut written: Vec<Result<Option<u64>, (KvError, bool)>> = started
                .iter()
                .map(|s| match s {
                    Ok(_) => Ok(None),
                    Err(e) => Err((e.clone(), false)),
                })
                .collect();
            for (t, &i) in transfers.into_iter().zip(&which) {
                written[i] = match t.status {
                    Some(Err(e)) => Err((e, true)),
                    _ => Ok(t.sum),
                };
            }
            type Written = Result<Option<u64>, (KvError, bool)>;
            let keys_where = |pred: fn(&Written) -> bool| -> Vec<Vec<u8>> {
                written
                    .iter()
                    .zip(items)
                    .filter(|(w, _)| pred(w))
                    .map(|(_, (k, _))| k.to_vec())
                    .collect()
            };
            let ok_items: Vec<PutDone> = written
                .iter()
                .zip(items)
                .filter_map(|(w, (k, _))| {
                    w.as_ref().ok().map(|sum| PutDone {
                        key: k.to_vec(),
                        checksum: *sum,
                    })
                })
                .collect();
            let failed_keys = keys_where(|w| matches!(w, Err((_, true))));
            if !failed_keys.is_empty() {
                let _ = self
                    .ask(call::BatchPutRevoke {
                        client_id: self.inner.id,
                        put_id,
                        keys: failed_keys,
                    })
                    .await;
            }
            let ok_values: Vec<&[u8]> = written
                .iter()
                .zip(items)
                .filter(|(w, _)| w.is_ok())
                .map(|(_, (_, v))| *v)
                .collect();
            // Sent again while the master cannot be reached, as a single
            // put's end is (see `end_put`).
            let (answers, again) = if ok_items.is_empty() {
                (Vec::new(), false)
            } else {
                let (r, again) = self
                    .send_end(|| call::BatchPutEnd {
                        client_id: self.inner.id,
                        put_id,
                        items: ok_items.clone(),
                    })
                    .await;
                let answers: Vec<Result<(), KvError>> = r?.into_iter().map(Result::from).collect();
                (answers, again)
            };
            let mut ends = Vec::with_capacity(answers.len());
            for ((a, d), v) in answers.into_iter().zip(&ok_items).zip(ok_values) {
                ends.push(match a {
                    Err(e) if e.code == ErrorCode::ObjectAlreadyExists && again => {
                        if self.holds(&d.key, v, deadline).await {
                            Ok(())
                        } else {
                            Err(e)
                        }
                    }
                    a => a,
                });
            }
            let mut ended = ends.into_iter();
            Ok(written
                .into_iter()
                .map(|w| match w {
                    Ok(_) => ended.next().unwrap_or_else(|| {
                        Err(KvError::new(ErrorCode::Internal, "missing put_end result"))
                    }),
                    Err((e, _)) => Err(e),
                })
                .collect())
        }
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
            self.inner.engine.run(&mut transfers, deadline, None).await;
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
            self.inner.engine.run(&mut transfers, deadline, None).await;
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
