//! Master RPC on one shard: a connection's requests decoded, checked,
//! routed to the owning shard (or the coordinator), answered.

use super::*;

/// Serves master RPC on one shard.
pub(super) struct MasterConn {
    pub(super) shard: u32,
    pub(super) state: Rc<Shard>,
    pub(super) handle: MasterHandle,
    pub(super) io_timeout: Duration,
    pub(super) metrics: MasterMetrics,
    /// The cluster secret: connections authenticate before anything else.
    pub(super) key: Option<ClusterKey>,
    pub(super) refusals: RefusalLog,
}

impl MasterConn {
    pub(super) async fn dispatch(&self, req: MasterRequest) -> Result<MasterResponse, KvError> {
        let map = &self.handle.inner.map;
        let n = self.handle.inner.inboxes.len();
        if let MasterRequest::Follow {
            shard,
            shards,
            session,
            acked,
            ..
        } = req
        {
            return self.follow(shard, shards, session, acked).await;
        }
        match route::target(&req, |k| map.shard_of(k), n)? {
            // This shard's own keys and task queue: no channel hop.
            Target::Shard(s) if s == self.shard as usize => {
                let from = self.state.mark();
                let r = apply_local(&self.state, &self.metrics, req);
                self.state.settle(from).await;
                r
            }
            Target::Batch => {
                if let Some(empty) = check_batch(&req, self.handle.inner.max_batch)? {
                    return Ok(empty);
                }
                let n = req.batch_keys().map(|k| k.len()).unwrap_or(0);
                let parts = split_batch(req, map);
                let mut answers = Vec::with_capacity(parts.len());
                let mut remote = Vec::new();
                let from = self.state.mark();
                for p in parts {
                    if p.shard == self.shard {
                        answers.push((p.positions, apply_local(&self.state, &self.metrics, p.req)));
                    } else {
                        remote.push(p);
                    }
                }
                if !remote.is_empty() {
                    answers.extend(self.handle.forward_parts(remote).await);
                }
                self.state.settle(from).await;
                merge_batch(n, answers)
            }
            _ => self.handle.request(req).await,
        }
    }

    /// A standby's `Follow` (docs/architecture/ha.md, "Log shipping"): acks
    /// what it applied, then answers the next records of its session,
    /// waiting up to [`ship::POLL_WAIT`] for some.
    pub(super) async fn follow(
        &self,
        shard: u32,
        shards: u32,
        session: u64,
        acked: u64,
    ) -> Result<MasterResponse, KvError> {
        let fence = &self.handle.inner.fence;
        let n = self.handle.inner.inboxes.len() as u32;
        if fence.role() != crate::fence::FenceRole::Leader {
            return Err(KvError::new(
                ErrorCode::Unsupported,
                "only a master that leads under an election ships its state log",
            ));
        }
        if shards != n || shard != self.shard {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                format!(
                    "Follow of shard {shard} of {shards} on shard {} of {n}: a standby follows \
                     each shard on its own port, with the leader's shard count",
                    self.shard
                ),
            ));
        }
        let st = &self.state;
        let now = Instant::now();
        let session = if session == 0 {
            let s = st.ship.borrow_mut().open(now)?;
            tracing::info!(
                shard = self.shard,
                session = format!("{s:x}"),
                "a standby follows this shard's log: a snapshot, then the log"
            );
            s
        } else {
            let r = st.ship.borrow_mut().ack(session, acked, now);
            st.ship_acked.notify_waiters();
            st.publish_ship();
            r?;
            session
        };
        let deadline = now + ship::POLL_WAIT;
        loop {
            let data = st.ship_data.notified();
            let due = st.ship.borrow_mut().snapshot_due(session);
            if let Some(mut cur) = due {
                let mut buf = Vec::new();
                let done =
                    st.state
                        .borrow()
                        .snapshot_step(&mut cur, ship::SHIP_STEP_OBJECTS, &mut buf);
                st.ship
                    .borrow_mut()
                    .snapshot_step_done(session, cur, &buf, done);
            }
            let b = st.ship.borrow_mut().next(session)?;
            let left = deadline.saturating_duration_since(Instant::now());
            if b.records.is_empty() && due.is_some() && !left.is_zero() {
                // A snapshot step with nothing in it: the next one now.
                continue;
            }
            if !b.records.is_empty() || left.is_zero() {
                return Ok(MasterResponse::Shipped(Shipped {
                    session,
                    term: fence.term(),
                    start: b.start,
                    records: b.records,
                    synced: b.synced,
                }));
            }
            futures_lite::future::or(data, glommio::timer::sleep(left)).await;
        }
    }

    /// The handshake, and the gate in front of every other request. `Ok`:
    /// dispatch the request; `Err`: answer this instead (and whether to
    /// close the connection).
    pub(super) fn admit(
        &self,
        req: &MasterRequest,
        conn: &mut ConnState,
    ) -> Result<(), (Result<MasterResponse, KvError>, bool)> {
        use kvpool_wire::auth;
        let refuse = |e: KvError| Err((Err(e), true));
        let Some(key) = &self.key else {
            return match req {
                MasterRequest::AuthBegin { .. } | MasterRequest::AuthProve { .. } => {
                    refuse(KvError::new(
                        ErrorCode::Unsupported,
                        "this master runs without a cluster secret: it cannot prove itself",
                    ))
                }
                _ => Ok(()),
            };
        };
        match req {
            MasterRequest::AuthBegin { client_id, nonce } => {
                if conn.authenticated || conn.challenge.is_some() {
                    return refuse(KvError::new(
                        ErrorCode::InvalidParams,
                        "a connection authenticates once",
                    ));
                }
                let ns = auth::nonce();
                conn.challenge = Some((*client_id, *nonce, ns));
                Err((Ok(MasterResponse::AuthChallenge { nonce: ns }), false))
            }
            MasterRequest::AuthProve { proof } => {
                let Some((id, nc, ns)) = conn.challenge.take() else {
                    return refuse(KvError::new(
                        ErrorCode::InvalidParams,
                        "AuthProve without AuthBegin",
                    ));
                };
                if let Err(e) = key.verify_client_proof(id, &nc, &ns, proof) {
                    self.metrics.auth_refusals.inc();
                    self.refusals.refused("master", "a connection's proof", &e);
                    return refuse(e);
                }
                conn.authenticated = true;
                conn.client_id = Some(id);
                Err((
                    Ok(MasterResponse::AuthOk {
                        proof: key.server_proof(id, &nc, &ns),
                    }),
                    false,
                ))
            }
            _ if !conn.authenticated => {
                let e = KvError::new(
                    ErrorCode::Unauthenticated,
                    format!(
                        "{} refused: this cluster requires the cluster secret \
                         (set KVPOOL_SECRET or [security] secret)",
                        req.op_name()
                    ),
                );
                self.metrics.auth_refusals.inc();
                self.refusals.refused(
                    "master",
                    &format!("an unauthenticated {}", req.op_name()),
                    &e,
                );
                refuse(e)
            }
            _ => match (req.client_id(), conn.client_id) {
                (Some(named), Some(own)) if named != own => Err((
                    Err(KvError::new(
                        ErrorCode::IllegalClient,
                        format!(
                            "{} names client {named:#x}; this connection is client {own:#x}",
                            req.op_name()
                        ),
                    )),
                    false,
                )),
                _ => Ok(()),
            },
        }
    }
}

impl Handler for MasterConn {
    async fn handle(
        &self,
        hdr: FrameHeader,
        payload: kvpool_wire::frame::AlignedVec,
        stream: &mut TcpStream,
        conn: &mut ConnState,
    ) -> Next {
        let Some(req) = server::open_request::<MasterRequest>(
            stream,
            &hdr,
            &payload,
            FrameKind::MasterRequest,
            "master",
        )
        .await
        else {
            return Next::Close;
        };
        drop(payload);
        let op = req.op_name();
        let fence = &self.handle.inner.fence;
        let (res, close) = match self.admit(&req, conn) {
            Err(answer) => answer,
            // Not the leader (a standby, or past its lease): nothing is
            // served, the caller is told who leads.
            Ok(()) => match fence.admit() {
                Err(e) => (Err(e), false),
                Ok(()) => {
                    let r = match glommio::timer::timeout(self.io_timeout, async {
                        Ok(self.dispatch(req).await)
                    })
                    .await
                    {
                        Ok(r) => r,
                        Err(_) => Err(KvError::new(
                            ErrorCode::Timeout,
                            format!("{op} was not answered within {:?}", self.io_timeout),
                        )),
                    };
                    // Checked again as the answer leaves: a leader stalled
                    // past its lease while serving sends nothing it decided.
                    (r.and_then(|r| fence.admit().map(|()| r)), false)
                }
            },
        };
        let bytes = match &res {
            Ok(resp) => frame::encode(FrameKind::MasterResponse, hdr.request_id, resp),
            Err(e) => frame::encode_error(hdr.request_id, e),
        };
        match server::answer_within(stream, &bytes, self.io_timeout).await {
            Next::Continue if !close => Next::Continue,
            _ => Next::Close,
        }
    }
}
