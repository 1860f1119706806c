//! The part of etcd's v3 gRPC API the masters' election uses, written by
//! hand: no `protoc` and no build script (issue 27).
//!
//! Each message below declares only the fields kvpool reads or writes, with
//! the field numbers of etcd's `api/etcdserverpb/rpc.proto`,
//! `api/mvccpb/kv.proto` and `v3electionpb/v3election.proto` (stable since
//! etcd 3.0; the wire format skips the fields a message leaves out). The
//! calls go through tonic's generic client with prost's codec, on one
//! channel balanced over the endpoints. `tests/ha.rs` runs every call
//! against a real etcd.
//!
//! | call            | gRPC method                               |
//! |-----------------|-------------------------------------------|
//! | [`Etcd::get`]   | `/etcdserverpb.KV/Range` (one key)        |
//! | [`Etcd::put_while_created_at`] | `/etcdserverpb.KV/Txn` (a compare on a create revision, then a put) |
//! | [`Etcd::lease_grant`], [`Etcd::lease_revoke`] | `/etcdserverpb.Lease/LeaseGrant`, `LeaseRevoke` |
//! | [`Etcd::lease_keep_alive`] | `/etcdserverpb.Lease/LeaseKeepAlive` (a bidirectional stream) |
//! | [`Etcd::campaign`], [`Etcd::leader`] | `/v3electionpb.Election/Campaign`, `Leader` |
//! | [`Etcd::observe`] | `/v3electionpb.Election/Observe` (a server stream: the leader now, then each new one) |

use std::fmt;
use std::time::Duration;

use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};
use tonic_prost::ProstCodec;

/// What an etcd call failed with: the gRPC status or the transport's error,
/// as text.
#[derive(Debug, Clone)]
pub struct EtcdError(String);

impl fmt::Display for EtcdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EtcdError {}

impl From<tonic::Status> for EtcdError {
    fn from(s: tonic::Status) -> Self {
        Self(format!("{:?}: {}", s.code(), s.message()))
    }
}

/// `mvccpb.KeyValue`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(int64, tag = "2")]
    pub create_revision: i64,
    #[prost(bytes = "vec", tag = "5")]
    pub value: Vec<u8>,
    #[prost(int64, tag = "6")]
    pub lease: i64,
}

impl KeyValue {
    /// The value as UTF-8, `None` when it is not.
    pub fn value_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.value).ok()
    }
}

/// `etcdserverpb.RangeRequest`, one key.
#[derive(Clone, PartialEq, prost::Message)]
struct RangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
}

/// `etcdserverpb.RangeResponse`.
#[derive(Clone, PartialEq, prost::Message)]
struct RangeResponse {
    #[prost(message, repeated, tag = "2")]
    kvs: Vec<KeyValue>,
}

/// `etcdserverpb.PutRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// `etcdserverpb.RequestOp`: a put (its `request_put` case).
#[derive(Clone, PartialEq, prost::Message)]
struct RequestOp {
    #[prost(message, optional, tag = "2")]
    request_put: Option<PutRequest>,
}

/// `etcdserverpb.Compare`: `result` EQUAL (0) on `target` CREATE (1) with
/// `create_revision`.
#[derive(Clone, PartialEq, prost::Message)]
struct Compare {
    #[prost(int32, tag = "1")]
    result: i32,
    #[prost(int32, tag = "2")]
    target: i32,
    #[prost(bytes = "vec", tag = "3")]
    key: Vec<u8>,
    #[prost(int64, optional, tag = "5")]
    create_revision: Option<i64>,
}

const COMPARE_EQUAL: i32 = 0;
const COMPARE_TARGET_CREATE: i32 = 1;

/// `etcdserverpb.TxnRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct TxnRequest {
    #[prost(message, repeated, tag = "1")]
    compare: Vec<Compare>,
    #[prost(message, repeated, tag = "2")]
    success: Vec<RequestOp>,
}

/// `etcdserverpb.TxnResponse`.
#[derive(Clone, PartialEq, prost::Message)]
struct TxnResponse {
    #[prost(bool, tag = "2")]
    succeeded: bool,
}

/// `etcdserverpb.LeaseGrantRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct LeaseGrantRequest {
    #[prost(int64, tag = "1")]
    ttl: i64,
    #[prost(int64, tag = "2")]
    id: i64,
}

/// `etcdserverpb.LeaseGrantResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseGrantResponse {
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(int64, tag = "3")]
    pub ttl: i64,
    #[prost(string, tag = "4")]
    pub error: String,
}

/// `etcdserverpb.LeaseRevokeRequest` and `LeaseKeepAliveRequest` (both one
/// `ID = 1`).
#[derive(Clone, PartialEq, prost::Message)]
struct LeaseId {
    #[prost(int64, tag = "1")]
    id: i64,
}

/// `etcdserverpb.LeaseRevokeResponse` (its header only, unread).
#[derive(Clone, PartialEq, prost::Message)]
struct Empty {}

/// `etcdserverpb.LeaseKeepAliveResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseKeepAliveResponse {
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(int64, tag = "3")]
    pub ttl: i64,
}

/// `v3electionpb.CampaignRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct CampaignRequest {
    #[prost(bytes = "vec", tag = "1")]
    name: Vec<u8>,
    #[prost(int64, tag = "2")]
    lease: i64,
    #[prost(bytes = "vec", tag = "3")]
    value: Vec<u8>,
}

/// `v3electionpb.LeaderKey`: the key a campaign won with; `rev` is its
/// create revision.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaderKey {
    #[prost(bytes = "vec", tag = "1")]
    pub name: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub key: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub rev: i64,
    #[prost(int64, tag = "4")]
    pub lease: i64,
}

/// `v3electionpb.CampaignResponse`.
#[derive(Clone, PartialEq, prost::Message)]
struct CampaignResponse {
    #[prost(message, optional, tag = "2")]
    leader: Option<LeaderKey>,
}

/// `v3electionpb.LeaderRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct LeaderRequest {
    #[prost(bytes = "vec", tag = "1")]
    name: Vec<u8>,
}

/// `v3electionpb.LeaderResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaderResponse {
    #[prost(message, optional, tag = "2")]
    pub kv: Option<KeyValue>,
}

/// A client of one etcd cluster. Cheap to clone; clones share the channel.
#[derive(Clone)]
pub struct Etcd {
    grpc: tonic::client::Grpc<Channel>,
}

impl Etcd {
    /// A channel balanced over `endpoints` (`http://host:port`), each
    /// connected within `connect_timeout`. It connects when first used: an
    /// endpoint that is down fails the calls, not this.
    pub fn connect(endpoints: &[String], connect_timeout: Duration) -> Result<Self, EtcdError> {
        let mut list = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            let ep = Endpoint::from_shared(e.clone())
                .map_err(|err| EtcdError(format!("endpoint {e}: {err}")))?
                .connect_timeout(connect_timeout)
                .tcp_nodelay(true);
            list.push(ep);
        }
        if list.is_empty() {
            return Err(EtcdError("no etcd endpoint".into()));
        }
        Ok(Self {
            grpc: tonic::client::Grpc::new(Channel::balance_list(list.into_iter())),
        })
    }

    /// A handle on the channel once it can take a call.
    async fn ready(&self) -> Result<tonic::client::Grpc<Channel>, EtcdError> {
        let mut grpc = self.grpc.clone();
        grpc.ready()
            .await
            .map_err(|e| EtcdError(format!("not ready: {e}")))?;
        Ok(grpc)
    }

    async fn unary<Q, R>(&self, path: &'static str, req: Q) -> Result<R, EtcdError>
    where
        Q: prost::Message + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        let r = self
            .ready()
            .await?
            .unary(
                tonic::Request::new(req),
                PathAndQuery::from_static(path),
                ProstCodec::<Q, R>::default(),
            )
            .await?;
        Ok(r.into_inner())
    }

    /// The key's value, `None` when it does not exist.
    pub async fn get(&self, key: impl Into<Vec<u8>>) -> Result<Option<KeyValue>, EtcdError> {
        let r: RangeResponse = self
            .unary("/etcdserverpb.KV/Range", RangeRequest { key: key.into() })
            .await?;
        Ok(r.kvs.into_iter().next())
    }

    /// Puts `key = value` if `guard` exists with create revision
    /// `created_at`, in one transaction; whether it did.
    pub async fn put_while_created_at(
        &self,
        guard: Vec<u8>,
        created_at: i64,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
    ) -> Result<bool, EtcdError> {
        let txn = TxnRequest {
            compare: vec![Compare {
                result: COMPARE_EQUAL,
                target: COMPARE_TARGET_CREATE,
                key: guard,
                create_revision: Some(created_at),
            }],
            success: vec![RequestOp {
                request_put: Some(PutRequest {
                    key: key.into(),
                    value: value.into(),
                }),
            }],
        };
        let r: TxnResponse = self.unary("/etcdserverpb.KV/Txn", txn).await?;
        Ok(r.succeeded)
    }

    /// A new lease of `ttl_s` seconds (etcd may raise it to its minimum).
    pub async fn lease_grant(&self, ttl_s: i64) -> Result<LeaseGrantResponse, EtcdError> {
        let r: LeaseGrantResponse = self
            .unary(
                "/etcdserverpb.Lease/LeaseGrant",
                LeaseGrantRequest { ttl: ttl_s, id: 0 },
            )
            .await?;
        if !r.error.is_empty() {
            return Err(EtcdError(format!("lease grant: {}", r.error)));
        }
        Ok(r)
    }

    pub async fn lease_revoke(&self, id: i64) -> Result<(), EtcdError> {
        let _: Empty = self
            .unary("/etcdserverpb.Lease/LeaseRevoke", LeaseId { id })
            .await?;
        Ok(())
    }

    /// Opens the keep-alive stream of lease `id` and renews it once (etcd
    /// answers a stream only once a request is on it): an error when the
    /// lease is gone. Then each [`LeaseKeeper::keep_alive`] is answered by
    /// one message of the returned stream.
    pub async fn lease_keep_alive(
        &self,
        id: i64,
    ) -> Result<(LeaseKeeper, tonic::Streaming<LeaseKeepAliveResponse>), EtcdError> {
        // Bounded: one request waits for its answer before the next.
        let (tx, rx) = tokio::sync::mpsc::channel::<LeaseId>(4);
        tx.send(LeaseId { id })
            .await
            .map_err(|_| EtcdError("keep-alive stream closed".into()))?;
        let requests =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        let mut stream = self
            .ready()
            .await?
            .streaming(
                tonic::Request::new(requests),
                PathAndQuery::from_static("/etcdserverpb.Lease/LeaseKeepAlive"),
                ProstCodec::<LeaseId, LeaseKeepAliveResponse>::default(),
            )
            .await?
            .into_inner();
        match stream.message().await? {
            Some(r) if r.ttl > 0 => Ok((LeaseKeeper { id, tx }, stream)),
            Some(_) => Err(EtcdError(format!("lease {id:x} not found"))),
            None => Err(EtcdError("keep-alive stream ended at once".into())),
        }
    }

    /// Campaigns for `name` under `lease` with `value`: answers once this
    /// campaign's key is the oldest, i.e. it leads.
    pub async fn campaign(
        &self,
        name: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> Result<Option<LeaderKey>, EtcdError> {
        let r: CampaignResponse = self
            .unary(
                "/v3electionpb.Election/Campaign",
                CampaignRequest {
                    name: name.into(),
                    lease,
                    value: value.into(),
                },
            )
            .await?;
        Ok(r.leader)
    }

    /// The key of the election's leader now (etcd answers an error when
    /// none leads).
    pub async fn leader(&self, name: impl Into<Vec<u8>>) -> Result<Option<KeyValue>, EtcdError> {
        let r: LeaderResponse = self
            .unary(
                "/v3electionpb.Election/Leader",
                LeaderRequest { name: name.into() },
            )
            .await?;
        Ok(r.kv)
    }

    /// The election's leader now (once one leads), then each new leader as
    /// it is elected: a stream that ends or fails with the connection. No
    /// deadline of its own: the caller bounds each wait.
    pub async fn observe(
        &self,
        name: impl Into<Vec<u8>>,
    ) -> Result<tonic::Streaming<LeaderResponse>, EtcdError> {
        let stream = self
            .ready()
            .await?
            .server_streaming(
                tonic::Request::new(LeaderRequest { name: name.into() }),
                PathAndQuery::from_static("/v3electionpb.Election/Observe"),
                ProstCodec::<LeaderRequest, LeaderResponse>::default(),
            )
            .await?
            .into_inner();
        Ok(stream)
    }
}

/// Sends the keep-alive requests of one lease.
pub struct LeaseKeeper {
    id: i64,
    tx: tokio::sync::mpsc::Sender<LeaseId>,
}

impl LeaseKeeper {
    pub async fn keep_alive(&mut self) -> Result<(), EtcdError> {
        self.tx
            .send(LeaseId { id: self.id })
            .await
            .map_err(|_| EtcdError("keep-alive stream closed".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// The bytes of a transaction are what etcd's own encoding of the same
    /// request gives (hand-checked against rpc.proto's field numbers): the
    /// compare's target_union case 5 must be sent even for revision 0.
    #[test]
    fn a_guarded_put_encodes_etcds_field_numbers() {
        let c = Compare {
            result: COMPARE_EQUAL,
            target: COMPARE_TARGET_CREATE,
            key: b"k".to_vec(),
            create_revision: Some(0),
        };
        // target=1 (field 2, varint), key (field 3, len 1), create_revision=0
        // (field 5, varint, present: a oneof case is sent when set).
        assert_eq!(
            c.encode_to_vec(),
            vec![0x10, 0x01, 0x1a, 0x01, b'k', 0x28, 0x00]
        );
        let op = RequestOp {
            request_put: Some(PutRequest {
                key: b"a".to_vec(),
                value: b"b".to_vec(),
            }),
        };
        assert_eq!(
            op.encode_to_vec(),
            vec![0x12, 0x06, 0x0a, 0x01, b'a', 0x12, 0x01, b'b']
        );
    }

    /// A response with fields this module leaves out decodes (they are
    /// skipped), and the ones it declares come through.
    #[test]
    fn unknown_fields_of_a_response_are_skipped() {
        // LeaderResponse { header (1) = { revision (3) = 7 }, kv (2) = {
        // key "k", create_revision 9, mod_revision (3) 10, version (4) 1,
        // value "v", lease 5 } }
        let kv = [
            0x0a, 0x01, b'k', 0x10, 0x09, 0x18, 0x0a, 0x20, 0x01, 0x2a, 0x01, b'v', 0x30, 0x05,
        ];
        let mut bytes = vec![0x0a, 0x02, 0x18, 0x07, 0x12, kv.len() as u8];
        bytes.extend_from_slice(&kv);
        let r = LeaderResponse::decode(bytes.as_slice()).unwrap();
        let kv = r.kv.unwrap();
        assert_eq!(kv.key, b"k");
        assert_eq!(kv.create_revision, 9);
        assert_eq!(kv.value_str(), Some("v"));
        assert_eq!(kv.lease, 5);
    }
}
