//! The checks a storage shard makes on a data request before it touches the
//! segment's memory, reads the NVMe tier or sets up queue pairs: the segment
//! it names, the range (in bounds, no overflow), the grant (with a cluster
//! secret) and the NVMe region. Before it, with a cluster secret, the
//! connection's handshake ([`handshake`]): a connection that has not proved
//! it holds the secret sends nothing else. Pure functions, so that the data
//! port and the `data_request` fuzz target (`fuzz/`) run the same code.

use std::sync::atomic::{AtomicU64, Ordering};

use kvpool_storage::nvme::NvmeLoc;
use kvpool_storage::StorageError;
use kvpool_wire::auth::{self, ClusterKey, Grant, GrantClock, GrantOp};
use kvpool_wire::proto::{DataRequest, DataResponse, SegmentId};
use kvpool_wire::server::ConnState;
use kvpool_wire::{ErrorCode, KvError, RdmaRequest};

/// What the data port does with a request, by the connection's handshake.
#[derive(Debug)]
pub enum Handshake {
    /// Not a handshake step, and the connection may send it: on to the gate.
    Pass,
    /// A handshake step: answer this and keep the connection.
    Answer(DataResponse),
    /// Answer this error and close the connection.
    Refuse(Refused),
}

/// With a cluster secret (`key`), a data connection proves it holds the
/// secret (`AuthBegin`, `AuthProve`, the master handshake's exchange under
/// labels of its own) before any other request: grants travel in clear
/// text, and without this a grant seen on the wire let anyone write its
/// range until it expired, after its put had ended and on freed ranges
/// (issue 29). Without a secret a handshake is refused (`Unsupported`): a
/// client with a secret does not trust a node without one.
pub fn handshake(key: Option<&ClusterKey>, req: &DataRequest, conn: &mut ConnState) -> Handshake {
    let refuse = |error: KvError, auth: bool| Handshake::Refuse(Refused { error, auth });
    let Some(key) = key else {
        return match req {
            DataRequest::AuthBegin { .. } | DataRequest::AuthProve { .. } => refuse(
                KvError::new(
                    ErrorCode::Unsupported,
                    "this storage node runs without a cluster secret: it cannot prove itself",
                ),
                false,
            ),
            _ => Handshake::Pass,
        };
    };
    match req {
        DataRequest::AuthBegin { client_id, nonce } => {
            if conn.authenticated || conn.challenge.is_some() {
                return refuse(
                    KvError::new(ErrorCode::InvalidParams, "a connection authenticates once"),
                    false,
                );
            }
            let ns = auth::nonce();
            conn.challenge = Some((*client_id, *nonce, ns));
            Handshake::Answer(DataResponse::AuthChallenge { nonce: ns })
        }
        DataRequest::AuthProve { proof } => {
            let Some((id, nc, ns)) = conn.challenge.take() else {
                return refuse(
                    KvError::new(ErrorCode::InvalidParams, "AuthProve without AuthBegin"),
                    false,
                );
            };
            if let Err(e) = key.verify_data_client_proof(id, &nc, &ns, proof) {
                return refuse(e, true);
            }
            conn.authenticated = true;
            conn.client_id = Some(id);
            Handshake::Answer(DataResponse::AuthOk {
                proof: key.data_server_proof(id, &nc, &ns),
            })
        }
        _ if !conn.authenticated => refuse(
            KvError::new(
                ErrorCode::Unauthenticated,
                format!(
                    "{} refused: this storage node requires the cluster secret on its data \
                     connections (set KVPOOL_SECRET or [security] secret)",
                    op_name(req)
                ),
            ),
            true,
        ),
        _ => Handshake::Pass,
    }
}

/// A data request's name in errors and logs.
pub fn op_name(req: &DataRequest) -> &'static str {
    match req {
        DataRequest::Write { .. } => "a Write",
        DataRequest::Read { .. } => "a Read",
        DataRequest::ReadNvme { .. } => "a ReadNvme",
        DataRequest::Rdma { .. } => "an RDMA set-up",
        DataRequest::AuthBegin { .. } => "an AuthBegin",
        DataRequest::AuthProve { .. } => "an AuthProve",
    }
}

/// What one shard of a storage node serves.
pub struct DataGate<'a> {
    /// The segment's length in bytes: a `Write`/`Read` range must lie
    /// inside `0..segment_len` (the shard slices its segment by it).
    pub segment_len: u64,
    pub segment_id: SegmentId,
    /// The node's NVMe tier, if it has one.
    pub nvme_id: Option<SegmentId>,
    /// This shard: it serves NVMe region `shard` only.
    pub shard: u32,
    /// The cluster secret: every request needs a grant.
    pub key: Option<&'a ClusterKey>,
    /// The newest master term this node has seen in an admitted grant
    /// (shared by its shards and its shm listener): a grant of an older
    /// term comes from a deposed leader and is refused.
    pub term: &'a AtomicU64,
}

/// Checks `grant`'s term against the newest one `seen` and records it, when
/// the grant's signature was checked (`key` is the cluster secret, `Some`
/// only after the caller verified the grant with it): `NotLeader` for a
/// grant of an older term. Without a secret nothing signs the term, so it
/// is neither recorded nor checked: one packet with term 2^63 would
/// otherwise fence every legitimate get and put until a restart (issue 29).
/// An open cluster is fenced by the masters' lease deadline alone.
pub fn check_term(
    seen: &AtomicU64,
    grant: &Grant,
    key: Option<&ClusterKey>,
) -> Result<(), KvError> {
    if key.is_none() {
        return Ok(());
    }
    let newest = seen.fetch_max(grant.term, Ordering::AcqRel);
    if grant.term < newest {
        return Err(KvError::new(
            ErrorCode::NotLeader,
            format!(
                "the grant was signed in master term {}, and a newer leader (term {newest}) \
                 has signed grants since: the master that signed it was deposed",
                grant.term
            ),
        ));
    }
    Ok(())
}

/// Why a request was refused.
#[derive(Debug)]
pub struct Refused {
    pub error: KvError,
    /// The grant was missing, forged, expired or for something else
    /// (counted and logged as an authentication refusal).
    pub auth: bool,
}

fn invalid(error: KvError) -> Refused {
    Refused { error, auth: false }
}

/// A handshake step at the gate ([`handshake`] answers those).
fn not_data() -> Refused {
    invalid(KvError::new(
        ErrorCode::InvalidParams,
        "a handshake step is not a data request",
    ))
}

impl DataGate<'_> {
    /// Checks `req` at `clock`. `Ok` means: a `Write`/`Read` range lies inside
    /// the segment (so the shard may slice it), a `ReadNvme` names this
    /// shard's region of this node's tier, an RDMA `Connect` names this
    /// segment; with a cluster secret, each carries a live grant for it.
    /// Last, with a cluster secret, a grant of an older master term than
    /// this node has seen is refused (`NotLeader`).
    pub fn admit(&self, req: &DataRequest, clock: GrantClock) -> Result<(), Refused> {
        self.admit_signed(req, clock)?;
        let grant = match req {
            DataRequest::Write { grant, .. }
            | DataRequest::Read { grant, .. }
            | DataRequest::ReadNvme { grant, .. } => grant,
            DataRequest::Rdma {
                req: RdmaRequest::Connect(_),
                grant,
            } => grant,
            DataRequest::Rdma { .. } => return Ok(()),
            DataRequest::AuthBegin { .. } | DataRequest::AuthProve { .. } => return Err(not_data()),
        };
        check_term(self.term, grant, self.key).map_err(|error| Refused { error, auth: true })
    }

    fn admit_signed(&self, req: &DataRequest, clock: GrantClock) -> Result<(), Refused> {
        match req {
            DataRequest::Write {
                segment_id,
                offset,
                len,
                grant,
            }
            | DataRequest::Read {
                segment_id,
                offset,
                len,
                grant,
            } => {
                let op = if matches!(req, DataRequest::Write { .. }) {
                    GrantOp::Write
                } else {
                    GrantOp::Read
                };
                self.check_range(*segment_id, *offset, *len)
                    .map_err(invalid)?;
                self.authorize(|k| k.check_grant(grant, op, *segment_id, (*offset, *len), clock))
            }
            DataRequest::ReadNvme {
                segment_id,
                loc,
                len,
                grant,
                ..
            } => {
                if Some(*segment_id) != self.nvme_id {
                    return Err(invalid(KvError::new(
                        ErrorCode::SegmentNotFound,
                        format!("NVMe tier {segment_id:016x} is not served here"),
                    )));
                }
                self.authorize(|k| {
                    k.check_grant(grant, GrantOp::ReadNvme, *segment_id, (*loc, *len), clock)
                })?;
                let region = NvmeLoc::unpack(*loc).region;
                if region != self.shard {
                    return Err(invalid(KvError::new(
                        ErrorCode::InvalidParams,
                        format!(
                            "NVMe region {region} is served by shard {region}, not {}",
                            self.shard
                        ),
                    )));
                }
                Ok(())
            }
            DataRequest::Rdma { req, grant } => match req {
                RdmaRequest::Connect(c) => {
                    // Queue pairs to the segment reach all of it: the client
                    // must show a live grant the master signed for it.
                    self.authorize(|k| k.check_segment_access(grant, c.segment_id, clock))?;
                    if c.segment_id != self.segment_id {
                        return Err(invalid(self.not_here(c.segment_id)));
                    }
                    Ok(())
                }
                _ => Ok(()),
            },
            DataRequest::AuthBegin { .. } | DataRequest::AuthProve { .. } => Err(not_data()),
        }
    }

    fn not_here(&self, segment_id: SegmentId) -> KvError {
        KvError::new(
            ErrorCode::SegmentNotFound,
            format!(
                "segment {segment_id:016x} is not served here (this node serves {:016x})",
                self.segment_id
            ),
        )
    }

    fn check_range(&self, segment_id: SegmentId, offset: u64, len: u64) -> Result<(), KvError> {
        if segment_id != self.segment_id {
            return Err(self.not_here(segment_id));
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.segment_len => Ok(()),
            _ => Err(KvError::new(
                ErrorCode::InvalidParams,
                StorageError::OutOfBounds {
                    offset,
                    len,
                    size: self.segment_len,
                }
                .to_string(),
            )),
        }
    }

    fn authorize(
        &self,
        check: impl FnOnce(&ClusterKey) -> Result<(), KvError>,
    ) -> Result<(), Refused> {
        match self.key {
            None => Ok(()),
            Some(k) => check(k).map_err(|error| Refused { error, auth: true }),
        }
    }
}

/// What a client's `ReadNvme` is served, past the gate: the copy of its
/// key only, and only at the length it asked for. A slot evicted and reused
/// since the reader got its location may hold another key's copy, of the
/// same size too (a later copy of the same key is that key's bytes, put
/// after the reader asked). The data port and the cluster simulation both
/// answer by it.
#[derive(Debug, Clone, Copy)]
pub struct NvmeRead<'a> {
    pub key: &'a [u8],
    pub len: u64,
}

impl NvmeRead<'_> {
    /// Whether the copy of `key` at `version` found in the slot may serve
    /// the read (the tier's `read_if` filter; otherwise the read is
    /// `ObjectNotFound`).
    pub fn wants(&self, key: &[u8], _version: u64) -> bool {
        key == self.key
    }

    /// The answer for a copy of `found` bytes: `Ok` at the asked length,
    /// else `InvalidParams` (the reader's buffer is not this copy's size).
    pub fn fits(&self, found: u64) -> Result<(), KvError> {
        if found == self.len {
            Ok(())
        } else {
            Err(KvError::new(
                ErrorCode::InvalidParams,
                format!(
                    "length differs from the object's ({} bytes asked, {found} held)",
                    self.len
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(term: u64) -> Grant {
        Grant {
            op: 0,
            offset: 0,
            len: 0,
            expires_ms: 0,
            term,
            mac: [0; 16],
        }
    }

    /// A `ReadNvme` is served only its own key's copy, at its length.
    #[test]
    fn an_nvme_read_takes_its_keys_copy_at_its_length_only() {
        let r = NvmeRead {
            key: b"k",
            len: 4096,
        };
        assert!(r.wants(b"k", 7));
        assert!(!r.wants(b"other", 7));
        assert!(r.fits(4096).is_ok());
        assert_eq!(r.fits(4095).unwrap_err().code, ErrorCode::InvalidParams);
    }

    /// Without a secret an unsigned term raises nothing: a grant of term
    /// 2^63 fences nobody (issue 29: it made every later get and put
    /// `NotLeader` until the node restarted).
    #[test]
    fn an_unsigned_term_fences_nothing() {
        let seen = AtomicU64::new(0);
        check_term(&seen, &grant(1 << 63), None).unwrap();
        assert_eq!(seen.load(Ordering::Relaxed), 0);
        check_term(&seen, &grant(0), None).unwrap();
    }

    /// With a secret (the grant's signature checked by the caller) the
    /// newest term is kept and older ones are refused.
    #[test]
    fn a_signed_older_term_is_refused() {
        let key = ClusterKey::new(b"0123456789abcdef0123").unwrap();
        let seen = AtomicU64::new(0);
        check_term(&seen, &grant(5), Some(&key)).unwrap();
        assert_eq!(seen.load(Ordering::Relaxed), 5);
        let e = check_term(&seen, &grant(4), Some(&key)).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotLeader);
        check_term(&seen, &grant(6), Some(&key)).unwrap();
    }

    fn write() -> DataRequest {
        DataRequest::Write {
            segment_id: 1,
            offset: 0,
            len: 8,
            grant: grant(1),
        }
    }

    fn refused(h: Handshake) -> KvError {
        match h {
            Handshake::Refuse(r) => r.error,
            other => panic!("not refused: {other:?}"),
        }
    }

    /// With a secret, nothing but the handshake passes before it; a proof
    /// made with another secret, or the master handshake's proof, fails; the
    /// right one passes and gets the node's proof back.
    #[test]
    fn a_data_connection_proves_the_secret_before_anything_else() {
        let key = ClusterKey::new(b"0123456789abcdef0123").unwrap();
        let other = ClusterKey::new(b"another secret, also long").unwrap();
        let mut conn = ConnState::default();
        let e = refused(handshake(Some(&key), &write(), &mut conn));
        assert_eq!(e.code, ErrorCode::Unauthenticated);
        let nc = [7u8; 16];
        let begin = DataRequest::AuthBegin {
            client_id: 9,
            nonce: nc,
        };
        // Another secret's proof; this secret's proof for the master.
        type Forge<'a> = &'a dyn Fn(&[u8; 16]) -> [u8; 32];
        let forgeries: [Forge; 2] = [&|ns| other.data_client_proof(9, &nc, ns), &|ns| {
            key.client_proof(9, &nc, ns)
        }];
        for forge in forgeries {
            let mut conn = ConnState::default();
            let Handshake::Answer(DataResponse::AuthChallenge { nonce: ns }) =
                handshake(Some(&key), &begin, &mut conn)
            else {
                panic!("no challenge");
            };
            let forged = forge(&ns);
            let e = refused(handshake(
                Some(&key),
                &DataRequest::AuthProve { proof: forged },
                &mut conn,
            ));
            assert_eq!(e.code, ErrorCode::Unauthenticated);
            assert!(!conn.authenticated);
        }
        let Handshake::Answer(DataResponse::AuthChallenge { nonce: ns }) =
            handshake(Some(&key), &begin, &mut conn)
        else {
            panic!("no challenge");
        };
        let prove = DataRequest::AuthProve {
            proof: key.data_client_proof(9, &nc, &ns),
        };
        let Handshake::Answer(DataResponse::AuthOk { proof }) =
            handshake(Some(&key), &prove, &mut conn)
        else {
            panic!("the right proof was refused");
        };
        key.verify_data_server_proof(9, &nc, &ns, &proof).unwrap();
        assert!(matches!(
            handshake(Some(&key), &write(), &mut conn),
            Handshake::Pass
        ));
        let e = refused(handshake(Some(&key), &begin, &mut conn));
        assert_eq!(e.code, ErrorCode::InvalidParams);
    }

    /// Without a secret requests pass and a handshake is refused.
    #[test]
    fn an_open_node_refuses_a_handshake() {
        let mut conn = ConnState::default();
        assert!(matches!(
            handshake(None, &write(), &mut conn),
            Handshake::Pass
        ));
        let begin = DataRequest::AuthBegin {
            client_id: 1,
            nonce: [0; 16],
        };
        let e = refused(handshake(None, &begin, &mut conn));
        assert_eq!(e.code, ErrorCode::Unsupported);
    }
}
