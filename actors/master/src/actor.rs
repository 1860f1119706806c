//! The `Master` actor: the master's API for code in the same process.
//!
//! The actor does not hold metadata: each request is routed to the shard that
//! owns its key (or to the coordinator) together with its reply port, so the
//! actor's mailbox is never the bottleneck. Its one message carries any
//! `MasterRequest`; [`call`] is the typed form (`call(&master,
//! call::Exist { key })` is a `bool`), the same calls a remote client makes.
//! Callers that want to skip the actor hop can ask for the [`MasterHandle`]
//! and call the shards directly.
//!
//! ```
//! use kvpool_config::MasterConfig;
//! use kvpool_master::{call, Master, MasterArgs};
//! use kvpool_runtime::metrics::MetricsRegistry;
//! use kvpool_runtime::{ShardPool, ShardPoolConfig, Shutdown};
//! use kvpool_wire::proto::call::{Exist, MountSegment, PutEnd, PutStart};
//! use kvpool_wire::proto::{Endpoint, SegmentSpec};
//! use ractor::Actor;
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
//!         tier: kvpool_wire::proto::Tier::Dram,
//!         nvme: None,
//!     };
//!     let seg = call(&master, MountSegment { client_id: 1, spec }).await.unwrap();
//!
//!     // Allocate, then complete, an object; then look it up.
//!     let key = b"llama@00ff@fp16@256".to_vec();
//!     let replicas = call(&master, PutStart {
//!         client_id: 7, key: key.clone(), len: 4096, opts: Default::default(),
//!     }).await.unwrap();
//!     assert_eq!(replicas[0].segment_id, seg);
//!     call(&master, PutEnd { client_id: 7, key: key.clone(), put_id: 0, checksum: None }).await.unwrap();
//!     let found: bool = call(&master, Exist { key: key.clone() }).await.unwrap();
//!     assert!(found);
//!     master.stop(None);
//! });
//! pool.shutdown_and_join().unwrap();
//! ```

use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::ShardHandle;
use kvpool_wire::proto::call::Call;
use kvpool_wire::proto::{MasterRequest, MasterResponse};
use kvpool_wire::{ErrorCode, KvError};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::service::{self, MasterHandle};
use kvpool_config::MasterConfig;

/// Messages of the [`Master`] actor.
pub enum MasterMsg {
    /// Any request, answered as it would be on the wire (see [`call`] for
    /// the typed form).
    Request {
        req: MasterRequest,
        reply: RpcReplyPort<Result<MasterResponse, KvError>>,
    },
    /// The direct handle to the shards (skips this actor).
    Handle(RpcReplyPort<MasterHandle>),
}

/// A typed call through the actor: `call(&master, call::Stat)` is a
/// `PoolStat`. An actor that is gone is `Unavailable`.
pub async fn call<C: Call>(master: &ActorRef<MasterMsg>, c: C) -> Result<C::Reply, KvError> {
    let req = c.into();
    let resp =
        ractor::call!(master, |reply| MasterMsg::Request { req, reply }).map_err(|e| {
            KvError::new(
                ErrorCode::Unavailable,
                format!("the master actor did not answer {}: {e}", C::OP),
            )
        })??;
    C::reply(resp)
}

/// Start-up arguments of the [`Master`] actor.
pub struct MasterArgs {
    pub shards: ShardHandle,
    pub config: MasterConfig,
    /// The cluster secret (`None`: an open cluster).
    pub key: Option<kvpool_wire::auth::ClusterKey>,
    pub metrics: MetricsRegistry,
}

/// The master actor. Spawning it starts the master's shards and listeners.
pub struct Master;

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
        match msg {
            MasterMsg::Request { req, reply } => {
                // Routed to the owning shard with the reply port: the actor
                // does not wait for the answer.
                h.submit(
                    req,
                    Box::new(move |r| {
                        let _ = reply.send(r);
                    }),
                )
                .await
            }
            MasterMsg::Handle(reply) => {
                let _ = reply.send(h.clone());
            }
        }
        Ok(())
    }
}
