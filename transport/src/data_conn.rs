//! A data-plane connection to a storage node: its proof of the cluster
//! secret ([`prove_data`]), shared by the TCP/shm engine and its RDMA path.

use kvpool_wire::error::{ErrorCode, KvError};
use kvpool_wire::frame::{self, check_answer, FrameKind};
use kvpool_wire::proto::{DataRequest, DataResponse};

use crate::pool::Stream;

/// Proves on a new data connection that this side holds the cluster secret,
/// and checks the node's proof in turn (a node without the secret is not
/// trusted with this engine's bytes). Uses request ids `id` and `id + 1`.
pub async fn prove_data(
    s: &mut Stream,
    key: &kvpool_wire::auth::ClusterKey,
    id: u64,
    max_frame: u32,
) -> Result<(), KvError> {
    async fn ask(
        s: &mut Stream,
        id: u64,
        req: &DataRequest,
        max_frame: u32,
    ) -> Result<Result<DataResponse, KvError>, KvError> {
        frame::write_all(s, &frame::encode(FrameKind::DataRequest, id, req)).await?;
        let (rid, answer) =
            frame::read_reply::<DataResponse, _>(s, FrameKind::DataResponse, max_frame).await?;
        check_answer(rid, id, answer)
    }
    // Data connections name no client.
    const CLIENT: u64 = 0;
    let nc = kvpool_wire::auth::nonce();
    let begin = DataRequest::AuthBegin {
        client_id: CLIENT,
        nonce: nc,
    };
    let ns = match ask(s, id, &begin, max_frame).await? {
        Ok(DataResponse::AuthChallenge { nonce }) => nonce,
        Ok(other) => {
            return Err(KvError::new(
                ErrorCode::Malformed,
                format!("the node answered AuthBegin with {other:?}"),
            ))
        }
        Err(e) if e.code == ErrorCode::Unsupported => {
            return Err(KvError::new(
                ErrorCode::Unauthenticated,
                format!(
                    "this client has a cluster secret but the storage node has none ({}); \
                     refusing to trust it",
                    e.message
                ),
            ))
        }
        Err(e) => return Err(e),
    };
    let prove = DataRequest::AuthProve {
        proof: key.data_client_proof(CLIENT, &nc, &ns),
    };
    let proof = match ask(s, id + 1, &prove, max_frame).await?? {
        DataResponse::AuthOk { proof } => proof,
        other => {
            return Err(KvError::new(
                ErrorCode::Malformed,
                format!("the node answered AuthProve with {other:?}"),
            ))
        }
    };
    key.verify_data_server_proof(CLIENT, &nc, &ns, &proof)
        .map_err(|_| {
            KvError::new(
                ErrorCode::Unauthenticated,
                "the storage node could not prove it holds the cluster secret",
            )
        })
}
