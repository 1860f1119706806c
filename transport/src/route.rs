//! Where a master request goes, and how a batch is split by owning shard
//! and its answers merged back in order. Clients and the master's shards
//! route with the same functions.

use std::collections::BTreeMap;

use kvpool_runtime::hash::ShardMap;

use crate::error::{ErrorCode, KvError};
use crate::proto::{ItemResult, MasterRequest, MasterResponse};

/// One shard's part of a batch: the sub-request and where its results go.
pub struct BatchPart {
    pub shard: u32,
    pub req: MasterRequest,
    pub positions: Vec<usize>,
}

/// Splits a batch request by owning shard, keeping each part's order.
pub fn split_batch(req: MasterRequest, map: &ShardMap) -> Vec<BatchPart> {
    split_batch_by(req, |k| map.shard_of(k))
}

/// Like [`split_batch`] with any key -> shard function (clients use the
/// cluster map's ranges).
pub fn split_batch_by(req: MasterRequest, shard_of: impl Fn(&[u8]) -> u32) -> Vec<BatchPart> {
    let keys = req.batch_keys().expect("a batch request");
    let mut by_shard: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, k) in keys.iter().enumerate() {
        by_shard.entry(shard_of(k)).or_default().push(i);
    }
    if by_shard.len() == 1 {
        let (shard, positions) = by_shard.into_iter().next().expect("one part");
        return vec![BatchPart {
            shard,
            req,
            positions,
        }];
    }
    fn pick<T: Clone>(v: &[T], pos: &[usize]) -> Vec<T> {
        pos.iter().map(|&i| v[i].clone()).collect()
    }
    by_shard
        .into_iter()
        .map(|(shard, positions)| {
            let sub = match &req {
                MasterRequest::BatchPutStart {
                    client_id,
                    items,
                    opts,
                } => MasterRequest::BatchPutStart {
                    client_id: *client_id,
                    items: pick(items, &positions),
                    opts: opts.clone(),
                },
                MasterRequest::BatchPutEnd { client_id, items } => MasterRequest::BatchPutEnd {
                    client_id: *client_id,
                    items: pick(items, &positions),
                },
                MasterRequest::BatchPutRevoke { client_id, keys } => {
                    MasterRequest::BatchPutRevoke {
                        client_id: *client_id,
                        keys: pick(keys, &positions),
                    }
                }
                MasterRequest::BatchGet { keys } => MasterRequest::BatchGet {
                    keys: pick(keys, &positions),
                },
                MasterRequest::BatchExist { keys } => MasterRequest::BatchExist {
                    keys: pick(keys, &positions),
                },
                MasterRequest::BatchRemove { keys, force } => MasterRequest::BatchRemove {
                    keys: pick(keys, &positions),
                    force: *force,
                },
                MasterRequest::NvmeUpdates { client_id, updates } => MasterRequest::NvmeUpdates {
                    client_id: *client_id,
                    updates: pick(updates, &positions),
                },
                _ => unreachable!("batch_keys returned Some"),
            };
            BatchPart {
                shard,
                req: sub,
                positions,
            }
        })
        .collect()
}

/// Puts the parts' answers back in the order of the original batch of `n`.
pub fn merge_batch(
    n: usize,
    parts: Vec<(Vec<usize>, Result<MasterResponse, KvError>)>,
) -> Result<MasterResponse, KvError> {
    fn place<T>(slots: &mut [Option<ItemResult<T>>], pos: &[usize], items: Vec<ItemResult<T>>) {
        for (&p, it) in pos.iter().zip(items) {
            slots[p] = Some(it);
        }
    }
    fn fill<T>(slots: Vec<Option<ItemResult<T>>>, e: &KvError) -> Vec<ItemResult<T>> {
        slots
            .into_iter()
            .map(|s| s.unwrap_or_else(|| ItemResult::from(Err::<T, _>(e.clone()))))
            .collect()
    }
    let missing = KvError::new(
        ErrorCode::Unavailable,
        "the shard owning this key did not answer",
    );
    let mut replicas: Option<Vec<Option<_>>> = None;
    let mut done: Option<Vec<Option<_>>> = None;
    let mut exists: Option<Vec<Option<_>>> = None;
    let mut failed: Vec<(Vec<usize>, KvError)> = Vec::new();
    for (pos, res) in parts {
        match res {
            Ok(MasterResponse::BatchReplicas(v)) => place(
                replicas.get_or_insert_with(|| (0..n).map(|_| None).collect()),
                &pos,
                v,
            ),
            Ok(MasterResponse::BatchDone(v)) => place(
                done.get_or_insert_with(|| (0..n).map(|_| None).collect()),
                &pos,
                v,
            ),
            Ok(MasterResponse::BatchExists(v)) => place(
                exists.get_or_insert_with(|| (0..n).map(|_| None).collect()),
                &pos,
                v,
            ),
            Ok(other) => {
                return Err(KvError::new(
                    ErrorCode::Internal,
                    format!("a shard answered a batch with {other:?}"),
                ))
            }
            Err(e) => failed.push((pos, e)),
        }
    }
    // A part that failed as a whole fails each of its keys with its error.
    let apply_failed = |e: &(Vec<usize>, KvError)| -> Vec<(usize, KvError)> {
        e.0.iter().map(|&p| (p, e.1.clone())).collect()
    };
    let fails: Vec<(usize, KvError)> = failed.iter().flat_map(apply_failed).collect();
    macro_rules! finish {
        ($slots:expr, $variant:ident) => {{
            let mut slots = $slots;
            for (p, e) in &fails {
                slots[*p] = Some(ItemResult::from(Err(e.clone())));
            }
            Ok(MasterResponse::$variant(fill(slots, &missing)))
        }};
    }
    if let Some(s) = replicas {
        return finish!(s, BatchReplicas);
    }
    if let Some(s) = done {
        return finish!(s, BatchDone);
    }
    if let Some(s) = exists {
        return finish!(s, BatchExists);
    }
    // Every part failed: the batch fails with the first error.
    Err(failed
        .into_iter()
        .next()
        .map(|(_, e)| e)
        .unwrap_or_else(|| KvError::new(ErrorCode::InvalidParams, "empty batch")))
}
