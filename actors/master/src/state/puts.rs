//! Puts: a placement's start, its end (a replace retires the old object in
//! the same step; write-through queues the copy to NVMe), its revoke, and
//! the check that an end or revoke names the put it acts on (`put_id`).
use super::*;

impl ShardState {
    /// Places a put of `len` bytes under `key` (a `replace` of a complete key
    /// beside it): `Processing` until its end; the replicas to write.
    pub fn put_start(
        &mut self,
        client: ClientId,
        key: &[u8],
        len: u64,
        opts: &PutOptions,
        now_ms: u64,
    ) -> Result<Vec<ReplicaDesc>, KvError> {
        self.check_key(key)?;
        if len == 0 {
            return Err(err(ErrorCode::InvalidParams, "value length is 0"));
        }
        if len > self.cfg.max_value_bytes {
            return Err(err(
                ErrorCode::InvalidParams,
                format!(
                    "value of {len} bytes exceeds the maximum of {}",
                    self.cfg.max_value_bytes
                ),
            ));
        }
        if opts.replicas == 0 {
            return Err(err(ErrorCode::InvalidParams, "replicas must be at least 1"));
        }
        if self.parked_only(key) {
            return Err(Self::recovering(key));
        }
        let exists = self.objs.complete_id(key).is_some();
        if exists && !opts.replace {
            return Err(err(
                ErrorCode::ObjectAlreadyExists,
                format!("key {} exists", show_key(key)),
            ));
        }
        if let Some(id) = self.objs.processing_id(key) {
            let o = self.objs.get(id);
            if !self.is_stale(o, now_ms) {
                // Two replaces by different writers: one waits for the other
                // to end, then replaces its object (the last PutEnd wins).
                // One writer's second put of a key it is putting is a bug.
                return Err(if opts.replace && o.put().writer != client {
                    err(
                        ErrorCode::TryAgain,
                        format!(
                            "another writer is putting key {}; try again when it is done",
                            show_key(key)
                        ),
                    )
                } else {
                    err(
                        ErrorCode::ObjectAlreadyExists,
                        format!("key {} is being put", show_key(key)),
                    )
                });
            }
            self.discard_processing(id, now_ms);
        }
        // A replace of a stored key adds no key in the end: the count does
        // not refuse it. Its Processing entry counts while it lasts (so at
        // most one replace per stored key stands beyond the limit).
        if (!exists && self.key_count() >= self.cfg.max_keys) || !self.objs.has_room() {
            return Err(err(
                ErrorCode::ResourceExhausted,
                format!(
                    "the pool holds its maximum of keys ({} on this shard)",
                    self.cfg.max_keys
                ),
            ));
        }
        self.release_due(now_ms);
        let want = opts.replicas as usize;
        let mut targets = self.place(len, want, &opts.preferred_host);
        if targets.is_empty() {
            // Allocation failed: evict until the object fits, then try once
            // more.
            let idxs = self.evict_to_fit(len, want, now_ms);
            targets = self.place(len, want, &opts.preferred_host);
            if targets.is_empty() {
                // Space on its way out to the NVMe tier (demotions under
                // way) that would make room: the writer waits for it. Space
                // held by leases or quarantine is not counted: it may stay
                // held for longer than a put's deadline.
                let coming = idxs.iter().any(|&idx| {
                    let s = self.slot(idx);
                    let demoting = self.demoting_bytes(idx);
                    demoting > 0 && s.alloc.free() + demoting >= s.alloc.rounded(len)
                });
                if coming {
                    return Err(err(
                        ErrorCode::TryAgain,
                        format!("no room for {len} bytes yet; demotions to NVMe are freeing space"),
                    ));
                }
            }
        }
        if targets.is_empty() {
            if self.room_while_suspect(len) {
                // A client could not reach the node of a segment with room
                // (a lossy link, a dead node): placement skips it until its
                // node pings again, or its lease ends and it goes. The
                // writer waits for that within its deadline instead of
                // hearing that there is no room.
                return Err(err(
                    ErrorCode::TryAgain,
                    format!(
                        "the segments with room for {len} bytes are suspected unreachable \
                         (a client could not reach their nodes); waiting for their next ping"
                    ),
                ));
            }
            if self.awaiting_segments(now_ms) {
                // A restarted master or a new leader: segments it knew of
                // have not mounted again yet (their nodes ping within a
                // second). The writer waits for them within its deadline.
                return Err(err(
                    ErrorCode::TryAgain,
                    format!(
                        "no room for {len} bytes yet: this master just took over and its \
                         storage nodes have not all mounted again"
                    ),
                ));
            }
            return Err(err(
                ErrorCode::NoSpace,
                format!("no segment has room for {len} bytes, even after eviction"),
            ));
        }
        if targets.len() < want {
            // Acknowledged all the same (a put that waited for a second
            // node could wait forever), and said: the tick reports it
            // (a metric and a log line).
            self.fewer_replicas += 1;
        }
        let mut replicas = SmallVec::new();
        for &idx in &targets {
            let offset = self
                .slot_mut(idx)
                .alloc
                .alloc(len)
                .expect("placement checked the largest free extent");
            replicas.push(Replica::ready(idx, offset));
            // The writer may write there until its grant runs out, even
            // past a restart of this master.
            let until = self.write_hold_until(now_ms);
            self.hold(idx, offset, len, until);
        }
        let obj = Object {
            size: len,
            phase: Phase::Processing(Processing {
                started_ms: now_ms,
                writer: client,
                soft_pin_ttl_ms: opts.soft_pin_ttl_ms.min(u32::MAX as u64) as u32,
                hard_pin: opts.hard_pin,
                replace: opts.replace,
                put_id: opts.put_id,
            }),
            replicas,
        };
        let descs = describe(
            &self.slots,
            &obj,
            self.signer.as_ref(),
            Access::Write {
                until_ms: now_ms + self.cfg.put_timeout_ms,
            },
            self.term(),
        );
        self.objs.insert(key, obj);
        for idx in targets {
            self.owe_if_high(idx);
        }
        Ok(descs)
    }

    /// The caller's own Processing object, of the placement `put_id` names
    /// (any, for 0); a stale one is discarded first.
    pub(super) fn own_processing(
        &mut self,
        client: ClientId,
        key: &[u8],
        put_id: u16,
        now_ms: u64,
    ) -> Result<Id, KvError> {
        self.check_key(key)?;
        let Some(id) = self.objs.processing_id(key) else {
            return Err(if self.objs.complete_id(key).is_some() {
                err(
                    ErrorCode::ObjectAlreadyExists,
                    format!("key {} is already complete", show_key(key)),
                )
            } else {
                not_found(key)
            });
        };
        let obj = self.objs.get(id);
        if obj.put().writer != client {
            return Err(err(
                ErrorCode::IllegalClient,
                format!("key {} is being put by another client", show_key(key)),
            ));
        }
        if put_id != 0 && obj.put().put_id != put_id {
            // An end or revoke of an earlier placement that reached us after
            // the writer placed the key again: that placement is over.
            return Err(err(
                ErrorCode::ObjectNotFound,
                format!(
                    "put {put_id} of key {} is over (the writer placed the key again since)",
                    show_key(key)
                ),
            ));
        }
        if self.is_stale(obj, now_ms) {
            self.discard_processing(id, now_ms);
            return Err(err(
                ErrorCode::ObjectNotFound,
                format!(
                    "the put of {} took over put_timeout_ms ({}) and was discarded",
                    show_key(key),
                    self.cfg.put_timeout_ms
                ),
            ));
        }
        Ok(id)
    }

    /// Completes a put; `checksum` is what the writer computed over the
    /// bytes it wrote (readers check it).
    pub fn put_end(
        &mut self,
        client: ClientId,
        key: &[u8],
        put_id: u16,
        checksum: Option<u64>,
        now_ms: u64,
    ) -> Result<(), KvError> {
        let id = self.own_processing(client, key, put_id, now_ms)?;
        // Recovered replicas of the key still waiting for their segment are
        // the old object's: they go with it.
        self.retire_parked(key);
        // A replace: the object it replaces goes now, as a forced Remove
        // would take it (its space waits for its readers' lease, its NVMe
        // copies are dropped before the new object's copy is asked for).
        if let Some(old) = self.objs.complete_id(key) {
            debug_assert!(
                self.objs.get(id).put().replace,
                "only a replace meets a complete key"
            );
            let (k, old) = self.objs.remove(old);
            self.retire(&k, &old, now_ms);
        }
        let version = self.next_version();
        self.objs
            .update(id, |o| o.complete_at(now_ms, checksum, version));
        // Write-through: the first replica on a node with an NVMe tier is
        // copied there now (the node does it when it next asks for work).
        let obj = self.objs.get(id);
        let through = obj.replicas.iter().find_map(|r| {
            let s = self.slot(r.slot);
            match &s.spec.nvme {
                Some(a) if a.write_through => Some((s.id, r.offset)),
                _ => None,
            }
        });
        if let Some((seg, offset)) = through {
            let (len, checksum) = (obj.size, obj.checksum());
            let version = obj.stored().version;
            let q = self.tasks.entry(seg).or_default();
            if q.len() < MAX_TASKS_PER_SEGMENT {
                q.push_back(NodeTask::Persist(PersistTask {
                    key: key.to_vec(),
                    dram: seg,
                    offset,
                    len,
                    demote: false,
                    checksum,
                    version,
                }));
            }
        }
        Ok(())
    }

    /// Ends a put its writer gave up. Its space is quarantined for
    /// `stale_put_grace_ms`, not freed at once: the writer stopped, but
    /// bytes it had sent may still be on their way to a node (a write that
    /// failed on a deadline), and they must not land in another key's put.
    pub fn put_revoke(
        &mut self,
        client: ClientId,
        key: &[u8],
        put_id: u16,
        now_ms: u64,
    ) -> Result<(), KvError> {
        let id = self.own_processing(client, key, put_id, now_ms)?;
        self.discard_processing(id, now_ms);
        Ok(())
    }

    pub(super) fn batch_put_start(
        &mut self,
        client: ClientId,
        items: &[PutItem],
        opts: &PutOptions,
        now_ms: u64,
    ) -> Vec<ItemResult<Vec<ReplicaDesc>>> {
        items
            .iter()
            .map(|i| self.put_start(client, &i.key, i.len, opts, now_ms).into())
            .collect()
    }

    /// A key is being put beside its complete object only by a replace.
    pub(super) fn check_puts(&self) -> Result<(), String> {
        for id in self.objs.processing_ids() {
            let (k, o) = (self.objs.key(id), self.objs.get(id));
            if !o.put().replace && self.objs.complete_id(k).is_some() {
                return Err(format!(
                    "{} is complete and being put by a put that is not a replace",
                    show_key(k)
                ));
            }
        }
        Ok(())
    }
}
