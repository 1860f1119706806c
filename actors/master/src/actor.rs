//! The `Master` actor: the master's API for code in the same process.
//!
//! The actor does not hold metadata: each message is routed to the shard that
//! owns its key (or to the coordinator) together with its reply port, so the
//! actor's mailbox is never the bottleneck. Callers that want to skip the
//! actor hop can ask for the [`MasterHandle`] and call the shards directly.
//!
//! ```
//! use kvpool_config::MasterConfig;
//! use kvpool_master::{Master, MasterArgs, MasterMsg};
//! use kvpool_runtime::metrics::MetricsRegistry;
//! use kvpool_runtime::{ShardPool, ShardPoolConfig, Shutdown};
//! use kvpool_transport::proto::{Endpoint, SegmentSpec};
//! use ractor::{call, Actor};
//!
//! let pool = ShardPool::start(
//!     &ShardPoolConfig { shards: 1, pin: false, ..Default::default() },
//!     Shutdown::new(),
//! ).unwrap();
//! let rt = tokio::runtime::Runtime::new().unwrap();
//! rt.block_on(async {
//!     let args = MasterArgs {
//!         shards: pool.handle(),
//!         config: MasterConfig { listen: "127.0.0.1:0".into(), ..Default::default() },
//!         key: None,
//!         metrics: MetricsRegistry::new(),
//!     };
//!     let (master, _join) = Actor::spawn(None, Master, args).await.unwrap();
//!
//!     // A storage node would mount its segment like this (over RPC).
//!     let spec = SegmentSpec {
//!         name: "node-a:7300:1".into(),
//!         size: 1 << 20,
//!         endpoint: Endpoint { host: "127.0.0.1".into(), port: 7300, nr_shards: 1 },
//!         slice_bytes: 1 << 20,
//!         host_id: "node-a".into(),
//!         tier: kvpool_transport::proto::Tier::Dram,
//!         nvme: None,
//!     };
//!     let seg = call!(master, |reply| MasterMsg::MountSegment { client_id: 1, spec, reply })
//!         .unwrap()
//!         .unwrap();
//!
//!     // Allocate, then complete, an object; then look it up.
//!     let key = b"llama@00ff@fp16@256".to_vec();
//!     let replicas = call!(master, |reply| MasterMsg::PutStart {
//!         client_id: 7, key: key.clone(), len: 4096, opts: Default::default(), reply
//!     }).unwrap().unwrap();
//!     assert_eq!(replicas[0].segment_id, seg);
//!     call!(master, |reply| MasterMsg::PutEnd {
//!         client_id: 7, key: key.clone(), checksum: None, reply
//!     })
//!         .unwrap()
//!         .unwrap();
//!     let found = call!(master, |reply| MasterMsg::Exist { key: key.clone(), reply })
//!         .unwrap()
//!         .unwrap();
//!     assert!(found);
//!     master.stop(None);
//! });
//! pool.shutdown_and_join().unwrap();
//! ```

use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::ShardHandle;
use kvpool_transport::proto::{
    ClientId, ItemResult, MasterRequest, MasterResponse, ObjectInfo, PoolStat, PutDone, PutItem,
    PutOptions, ReplicaDesc, SegmentId, SegmentSpec,
};
use kvpool_transport::{ErrorCode, KvError};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::service::{self, MasterHandle};
use kvpool_config::MasterConfig;

type R<T> = RpcReplyPort<Result<T, KvError>>;
/// One result per key of a batch, in the order of the keys.
pub type BatchResults<T> = Vec<Result<T, KvError>>;

/// Messages of the [`Master`] actor; each carries its reply port.
pub enum MasterMsg {
    MountSegment {
        client_id: ClientId,
        spec: SegmentSpec,
        reply: R<SegmentId>,
    },
    /// By the segment's owner.
    UnmountSegment {
        client_id: ClientId,
        segment_id: SegmentId,
        reply: R<()>,
    },
    /// Graceful leave: replicas stay readable, new puts go elsewhere.
    DrainSegment {
        segment_id: SegmentId,
        reply: R<()>,
    },
    PutStart {
        client_id: ClientId,
        key: Vec<u8>,
        len: u64,
        opts: PutOptions,
        reply: R<Vec<ReplicaDesc>>,
    },
    PutEnd {
        client_id: ClientId,
        key: Vec<u8>,
        /// xxh3-64 of the bytes written (readers check it), if computed.
        checksum: Option<u64>,
        reply: R<()>,
    },
    PutRevoke {
        client_id: ClientId,
        key: Vec<u8>,
        reply: R<()>,
    },
    GetReplicaList {
        key: Vec<u8>,
        reply: R<Vec<ReplicaDesc>>,
    },
    Exist {
        key: Vec<u8>,
        reply: R<bool>,
    },
    Remove {
        key: Vec<u8>,
        force: bool,
        reply: R<()>,
    },
    RemoveAll {
        reply: R<u64>,
    },
    Stat {
        reply: R<PoolStat>,
    },
    Ping {
        client_id: ClientId,
        reply: R<()>,
    },
    /// Metadata of one object; does not extend its lease.
    Describe {
        key: Vec<u8>,
        reply: R<ObjectInfo>,
    },
    BatchPutStart {
        client_id: ClientId,
        items: Vec<PutItem>,
        opts: PutOptions,
        reply: R<BatchResults<Vec<ReplicaDesc>>>,
    },
    BatchPutEnd {
        client_id: ClientId,
        items: Vec<PutDone>,
        reply: R<BatchResults<()>>,
    },
    BatchPutRevoke {
        client_id: ClientId,
        keys: Vec<Vec<u8>>,
        reply: R<BatchResults<()>>,
    },
    BatchGet {
        keys: Vec<Vec<u8>>,
        reply: R<BatchResults<Vec<ReplicaDesc>>>,
    },
    BatchExist {
        keys: Vec<Vec<u8>>,
        reply: R<BatchResults<bool>>,
    },
    BatchRemove {
        keys: Vec<Vec<u8>>,
        force: bool,
        reply: R<BatchResults<()>>,
    },
    /// Any request, answered as it would be on the wire.
    Request {
        req: MasterRequest,
        reply: R<MasterResponse>,
    },
    /// The direct handle to the shards (skips this actor).
    Handle(RpcReplyPort<MasterHandle>),
}

/// Start-up arguments of the [`Master`] actor.
pub struct MasterArgs {
    pub shards: ShardHandle,
    pub config: MasterConfig,
    /// The cluster secret (`None`: an open cluster).
    pub key: Option<kvpool_transport::auth::ClusterKey>,
    pub metrics: MetricsRegistry,
}

/// The master actor. Spawning it starts the master's shards and listeners.
pub struct Master;

fn wrong(resp: MasterResponse) -> KvError {
    KvError::new(
        ErrorCode::Internal,
        format!("unexpected master answer {resp:?}"),
    )
}

async fn forward<T: Send + 'static>(
    handle: &MasterHandle,
    req: MasterRequest,
    reply: R<T>,
    map: fn(MasterResponse) -> Result<T, KvError>,
) {
    handle
        .submit(
            req,
            Box::new(move |r| {
                let _ = reply.send(r.and_then(map));
            }),
        )
        .await;
}

fn done(r: MasterResponse) -> Result<(), KvError> {
    match r {
        MasterResponse::Done | MasterResponse::Pong { .. } => Ok(()),
        other => Err(wrong(other)),
    }
}

fn items<T>(v: Vec<ItemResult<T>>) -> BatchResults<T> {
    v.into_iter().map(Into::into).collect()
}

fn batch_replicas(r: MasterResponse) -> Result<BatchResults<Vec<ReplicaDesc>>, KvError> {
    match r {
        MasterResponse::BatchReplicas(v) => Ok(items(v)),
        other => Err(wrong(other)),
    }
}

fn batch_done(r: MasterResponse) -> Result<BatchResults<()>, KvError> {
    match r {
        MasterResponse::BatchDone(v) => Ok(items(v)),
        other => Err(wrong(other)),
    }
}

fn replicas(r: MasterResponse) -> Result<Vec<ReplicaDesc>, KvError> {
    match r {
        MasterResponse::Replicas(v) => Ok(v),
        other => Err(wrong(other)),
    }
}

impl Actor for Master {
    type Msg = MasterMsg;
    type State = MasterHandle;
    type Arguments = MasterArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: MasterArgs,
    ) -> Result<MasterHandle, ActorProcessingErr> {
        Ok(service::start(&args.shards, &args.config, args.key, &args.metrics).await?)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: MasterMsg,
        h: &mut MasterHandle,
    ) -> Result<(), ActorProcessingErr> {
        use MasterRequest as Q;
        match msg {
            MasterMsg::MountSegment {
                client_id,
                spec,
                reply,
            } => {
                forward(h, Q::MountSegment { client_id, spec }, reply, |r| match r {
                    MasterResponse::Mounted { segment_id } => Ok(segment_id),
                    other => Err(wrong(other)),
                })
                .await
            }
            MasterMsg::UnmountSegment {
                client_id,
                segment_id,
                reply,
            } => {
                forward(
                    h,
                    Q::UnmountSegment {
                        client_id,
                        segment_id,
                    },
                    reply,
                    done,
                )
                .await
            }
            MasterMsg::DrainSegment { segment_id, reply } => {
                forward(h, Q::DrainSegment { segment_id }, reply, done).await
            }
            MasterMsg::Describe { key, reply } => {
                forward(h, Q::Describe { key }, reply, |r| match r {
                    MasterResponse::Described(i) => Ok(i),
                    other => Err(wrong(other)),
                })
                .await
            }
            MasterMsg::BatchPutStart {
                client_id,
                items,
                opts,
                reply,
            } => {
                forward(
                    h,
                    Q::BatchPutStart {
                        client_id,
                        items,
                        opts,
                    },
                    reply,
                    batch_replicas,
                )
                .await
            }
            MasterMsg::BatchPutEnd {
                client_id,
                items,
                reply,
            } => forward(h, Q::BatchPutEnd { client_id, items }, reply, batch_done).await,
            MasterMsg::BatchPutRevoke {
                client_id,
                keys,
                reply,
            } => forward(h, Q::BatchPutRevoke { client_id, keys }, reply, batch_done).await,
            MasterMsg::BatchGet { keys, reply } => {
                forward(h, Q::BatchGet { keys }, reply, batch_replicas).await
            }
            MasterMsg::BatchExist { keys, reply } => {
                forward(h, Q::BatchExist { keys }, reply, |r| match r {
                    MasterResponse::BatchExists(v) => Ok(items(v)),
                    other => Err(wrong(other)),
                })
                .await
            }
            MasterMsg::BatchRemove { keys, force, reply } => {
                forward(h, Q::BatchRemove { keys, force }, reply, batch_done).await
            }
            MasterMsg::PutStart {
                client_id,
                key,
                len,
                opts,
                reply,
            } => {
                forward(
                    h,
                    Q::PutStart {
                        client_id,
                        key,
                        len,
                        opts,
                    },
                    reply,
                    replicas,
                )
                .await
            }
            MasterMsg::PutEnd {
                client_id,
                key,
                checksum,
                reply,
            } => {
                forward(
                    h,
                    Q::PutEnd {
                        client_id,
                        key,
                        checksum,
                    },
                    reply,
                    done,
                )
                .await
            }
            MasterMsg::PutRevoke {
                client_id,
                key,
                reply,
            } => forward(h, Q::PutRevoke { client_id, key }, reply, done).await,
            MasterMsg::GetReplicaList { key, reply } => {
                forward(h, Q::GetReplicaList { key }, reply, replicas).await
            }
            MasterMsg::Exist { key, reply } => {
                forward(h, Q::Exist { key }, reply, |r| match r {
                    MasterResponse::Exists(b) => Ok(b),
                    other => Err(wrong(other)),
                })
                .await
            }
            MasterMsg::Remove { key, force, reply } => {
                forward(h, Q::Remove { key, force }, reply, done).await
            }
            MasterMsg::RemoveAll { reply } => {
                forward(h, Q::RemoveAll, reply, |r| match r {
                    MasterResponse::Removed(n) => Ok(n),
                    other => Err(wrong(other)),
                })
                .await
            }
            MasterMsg::Stat { reply } => {
                forward(h, Q::Stat, reply, |r| match r {
                    MasterResponse::Stat(s) => Ok(s),
                    other => Err(wrong(other)),
                })
                .await
            }
            MasterMsg::Ping { client_id, reply } => {
                let ping = Q::Ping {
                    client_id,
                    segments: Vec::new(),
                };
                forward(h, ping, reply, done).await
            }
            MasterMsg::Request { req, reply } => forward(h, req, reply, Ok).await,
            MasterMsg::Handle(reply) => {
                let _ = reply.send(h.clone());
            }
        }
        Ok(())
    }
}
