//! A standby shard following its leader: the shipped-records session,
//! applied to an image the shard takes over with.

use super::*;

/// What a standby shard needs to follow the leader's.
pub(super) struct FollowSetup {
    pub(super) shard: u32,
    pub(super) shards: u32,
    pub(super) map: ShardMap,
    pub(super) fence: Fence,
    pub(super) key: Option<ClusterKey>,
    pub(super) io_timeout: Duration,
    pub(super) max_frame: u32,
}

/// Pause before a standby tries the leader again.
pub(super) const FOLLOW_RETRY: Duration = Duration::from_millis(200);

/// A standby shard follows the leader's shard (docs/architecture/ha.md, "Log
/// shipping") until this master leads or stops.
pub(super) async fn follow_loop(ctx: ShardCtx, shard: Rc<Shard>, setup: FollowSetup) {
    let client_id: u64 = rand::random::<u64>() | 1;
    let mut last_err = String::new();
    loop {
        if ctx.shutdown().is_triggered() || shard.standby.borrow().stopped {
            return;
        }
        let role = setup.fence.role();
        if role != crate::fence::FenceRole::Standby {
            if role == crate::fence::FenceRole::Leader || role == crate::fence::FenceRole::Deposed {
                return;
            }
        } else if let Some(addr) = ship::leader_shard_addr(&setup.fence.leader(), setup.shard) {
            let r =
                futures_lite::future::or(follow_session(&shard, &setup, addr, client_id), async {
                    ctx.shutdown().wait().await;
                    Ok(())
                })
                .await;
            if let Err(e) = r {
                if e != last_err {
                    tracing::info!(shard = setup.shard, leader = %addr, "following the leader: {e}");
                    last_err = e;
                }
            }
        }
        futures_lite::future::or(glommio::timer::sleep(FOLLOW_RETRY), async {
            ctx.shutdown().wait().await;
        })
        .await;
    }
}

/// One request to the leader and its answer, within the I/O timeout: the
/// outer error is the connection's, the inner one the leader's answer.
pub(super) async fn follow_rpc(
    s: &mut TcpStream,
    setup: &FollowSetup,
    id: u64,
    req: &MasterRequest,
) -> Result<Result<MasterResponse, KvError>, String> {
    let bytes = frame::encode(FrameKind::MasterRequest, id, req);
    let exchange = async {
        frame::write_all(s, &bytes)
            .await
            .map_err(|e| e.to_string())?;
        let (got, answer) =
            frame::read_reply::<MasterResponse, _>(s, FrameKind::MasterResponse, setup.max_frame)
                .await
                .map_err(|e| e.to_string())?;
        if got != id {
            return Err(format!("an answer to request {got}, not {id}"));
        }
        Ok(answer)
    };
    futures_lite::future::or(exchange, async {
        glommio::timer::sleep(setup.io_timeout).await;
        Err(format!("no answer within {:?}", setup.io_timeout))
    })
    .await
}

/// Connects to the leader's shard, authenticates, and follows its log
/// until the connection fails, the session is refused or this master
/// leads. A session the leader still knows is resumed on a new connection.
pub(super) async fn follow_session(
    shard: &Rc<Shard>,
    setup: &FollowSetup,
    addr: SocketAddr,
    client_id: u64,
) -> Result<(), String> {
    let mut s = TcpStream::connect_timeout(addr, setup.io_timeout)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = s.set_nodelay(true);
    let mut id = 1u64;
    if let Some(key) = &setup.key {
        let nc = kvpool_wire::auth::nonce();
        let begin = MasterRequest::AuthBegin {
            client_id,
            nonce: nc,
        };
        let ns = match follow_rpc(&mut s, setup, id, &begin).await? {
            Ok(MasterResponse::AuthChallenge { nonce }) => nonce,
            other => return Err(format!("AuthBegin answered with {other:?}")),
        };
        id += 1;
        let prove = MasterRequest::AuthProve {
            proof: key.client_proof(client_id, &nc, &ns),
        };
        let proof = match follow_rpc(&mut s, setup, id, &prove).await? {
            Ok(MasterResponse::AuthOk { proof }) => proof,
            other => return Err(format!("AuthProve answered with {other:?}")),
        };
        key.verify_server_proof(client_id, &nc, &ns, &proof)
            .map_err(|_| "the leader could not prove it holds the cluster secret".to_string())?;
    }
    loop {
        id += 1;
        let (session, acked) = {
            let sb = shard.standby.borrow();
            if sb.stopped {
                return Ok(());
            }
            (sb.session, sb.acked)
        };
        let req = MasterRequest::Follow {
            client_id,
            shard: setup.shard,
            shards: setup.shards,
            session,
            acked,
        };
        // A connection that fails keeps the session: the next one resumes
        // it if the leader still has it.
        let shipped = match follow_rpc(&mut s, setup, id, &req).await? {
            Ok(MasterResponse::Shipped(sh)) => sh,
            Ok(other) => return Err(format!("Follow answered with {other:?}")),
            Err(e) => {
                // The leader lost or refused the session: a new one next time
                // (the image is kept until that one's first answer). Other
                // refusals (its fence, its shutdown) keep it.
                if ship::ends_session(&e) {
                    shard.standby.borrow_mut().lose_session();
                    shard.publish_ship();
                }
                return Err(e.to_string());
            }
        };
        // Untrusted until checked: the session, the offset, every record.
        let fresh = session == 0;
        if shipped.session == 0
            || (!fresh && shipped.session != session)
            || shipped.start != if fresh { 0 } else { acked }
        {
            shard.standby.borrow_mut().lose_session();
            shard.publish_ship();
            return Err(format!(
                "the leader answered session {:x} at {} to session {session:x} at {acked}",
                shipped.session, shipped.start
            ));
        }
        let records =
            match ship::decode_records(&shipped.records, setup.shard, |k| setup.map.shard_of(k)) {
                Ok(r) => r,
                Err(e) => {
                    shard.standby.borrow_mut().lose_session();
                    shard.publish_ship();
                    return Err(format!("a shipped record: {e}"));
                }
            };
        let mut sb = shard.standby.borrow_mut();
        if sb.stopped {
            return Ok(());
        }
        let was_synced = sb.synced && !fresh;
        sb.apply(
            shipped.session,
            shipped.term,
            records,
            shipped.records.len() as u64,
            shipped.synced,
        );
        drop(sb);
        shard.publish_ship();
        let sb = shard.standby.borrow();
        if sb.synced && !was_synced {
            tracing::info!(
                shard = setup.shard,
                term = shipped.term,
                objects = sb.image.objects.len(),
                "in sync with the leader's state log"
            );
        }
    }
}
