//! Where a master request goes, and how a batch is split by owning shard
//! and its answers merged back in order. Clients and the master's shards
//! route with the same functions.

use std::collections::BTreeMap;

use kvpool_runtime::hash::ShardMap;

use crate::error::{ErrorCode, KvError};
use crate::proto::{ItemResult, MasterRequest, MasterResponse, Route};

/// Where a request goes, resolved against a master's shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The connection answers it (the cluster map, the handshake).
    Connection,
    /// This master shard.
    Shard(usize),
    /// Split by owning shard, merged back in order.
    Batch,
    /// The coordinator (shard 0).
    Coordinator,
}

/// Resolves [`MasterRequest::route`] with `shard_of` (the owner of a key)
/// over `nr_shards` shards; a shard the master does not have is
/// `InvalidParams`. The one routing function: clients, the master's
/// connections, its handle and `MasterCore` all call it.
pub fn target(
    req: &MasterRequest,
    shard_of: impl Fn(&[u8]) -> u32,
    nr_shards: usize,
) -> Result<Target, KvError> {
    Ok(match req.route() {
        Route::Connection => Target::Connection,
        Route::Key(k) => Target::Shard(shard_of(k) as usize),
        Route::Shard(s) if (s as usize) < nr_shards => Target::Shard(s as usize),
        Route::Shard(s) => {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                format!("no master shard {s}"),
            ))
        }
        Route::Batch => Target::Batch,
        Route::Coordinator => Target::Coordinator,
    })
}

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
/// cluster map's ranges). `shard_of` is called once per key, in order.
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
                MasterRequest::BatchPutEnd {
                    client_id,
                    put_id,
                    items,
                } => MasterRequest::BatchPutEnd {
                    client_id: *client_id,
                    put_id: *put_id,
                    items: pick(items, &positions),
                },
                MasterRequest::BatchPutRevoke {
                    client_id,
                    put_id,
                    keys,
                } => MasterRequest::BatchPutRevoke {
                    client_id: *client_id,
                    put_id: *put_id,
                    keys: pick(keys, &positions),
                },
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

/// Like [`split_batch_by`], and a shard's part of more than `max` keys is
/// cut into pieces of at most `max` keys, in order, each a request of its
/// own to that shard (a master refuses a batch over `master.max_batch`).
pub fn split_batch_pieces(
    req: MasterRequest,
    shard_of: impl Fn(&[u8]) -> u32,
    max: usize,
) -> Vec<BatchPart> {
    let max = max.max(1);
    let mut out = Vec::new();
    for part in split_batch_by(req, shard_of) {
        if part.positions.len() <= max {
            out.push(part);
            continue;
        }
        // The n-th key of the part goes to piece n / max.
        let next = std::cell::Cell::new(0usize);
        let pieces = split_batch_by(part.req, |_| {
            let i = next.get();
            next.set(i + 1);
            (i / max) as u32
        });
        for p in pieces {
            out.push(BatchPart {
                shard: part.shard,
                positions: p.positions.iter().map(|&i| part.positions[i]).collect(),
                req: p.req,
            });
        }
    }
    out
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
        // Items are matched to keys by place: an answer with another count
        // than the part's keys names no key for sure, and every key of the
        // part fails (a shifted list would hand one key another's replicas).
        let res = res.and_then(|r| {
            let items = match &r {
                MasterResponse::BatchReplicas(v) => v.len(),
                MasterResponse::BatchDone(v) => v.len(),
                MasterResponse::BatchExists(v) => v.len(),
                _ => return Ok(r),
            };
            if items == pos.len() {
                return Ok(r);
            }
            Err(KvError::new(
                ErrorCode::Malformed,
                format!("a shard answered {items} items for {} keys", pos.len()),
            ))
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::call::{self, Call};

    fn owner(k: &[u8]) -> u32 {
        k.len() as u32 % 3
    }

    #[test]
    fn each_kind_of_request_goes_where_its_route_says() {
        let t = |q: MasterRequest| target(&q, owner, 3).unwrap();
        assert_eq!(
            t(call::Exist {
                key: b"ab".to_vec()
            }
            .into()),
            Target::Shard(2)
        );
        assert_eq!(
            t(call::PutRevoke {
                client_id: 1,
                key: b"abcd".to_vec(),
                put_id: 0,
            }
            .into()),
            Target::Shard(1)
        );
        assert_eq!(
            t(call::BatchExist {
                keys: vec![b"a".to_vec()]
            }
            .into()),
            Target::Batch
        );
        assert_eq!(t(call::Stat.into()), Target::Coordinator);
        assert_eq!(t(call::Hello { client_id: 1 }.into()), Target::Connection);
        let tasks = |shard| call::NodeTasks {
            client_id: 1,
            shard,
            segments: vec![],
            max: 1,
        };
        assert_eq!(t(tasks(2).into()), Target::Shard(2));
        let e = target(&tasks(3).into(), owner, 3).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidParams, "{e}");
    }

    /// A part answered with fewer or more items than it has keys fails
    /// every one of its keys; the other parts' answers keep their places.
    #[test]
    fn a_part_answered_with_another_count_of_items_fails_each_of_its_keys() {
        let yes = || ItemResult::from(Ok::<bool, KvError>(true));
        for items in [1, 3] {
            let short = MasterResponse::BatchExists((0..items).map(|_| yes()).collect());
            let good = MasterResponse::BatchExists(vec![yes()]);
            let merged = merge_batch(3, vec![(vec![0, 2], Ok(short)), (vec![1], Ok(good))]);
            let Ok(MasterResponse::BatchExists(v)) = merged else {
                panic!("{merged:?}")
            };
            let v: Vec<Result<bool, KvError>> = v.into_iter().map(Result::from).collect();
            assert_eq!(v[0].as_ref().unwrap_err().code, ErrorCode::Malformed);
            assert_eq!(v[2].as_ref().unwrap_err().code, ErrorCode::Malformed);
            assert_eq!(v[1].as_ref().ok(), Some(&true));
        }
    }

    /// A shard's part over the bound is cut into pieces of at most `max`
    /// keys, in order; every key is in one piece, of its own shard, and its
    /// answer goes back to its own place.
    #[test]
    fn a_part_over_the_bound_is_cut_into_pieces_that_keep_every_keys_place() {
        let keys: Vec<Vec<u8>> = (0..23u32)
            .map(|i| vec![b'k'; 1 + (i as usize % 5)])
            .collect();
        let req: MasterRequest = call::BatchExist { keys: keys.clone() }.into();
        let parts = split_batch_pieces(req, owner, 4);
        let mut seen = vec![0; keys.len()];
        for p in &parts {
            let MasterRequest::BatchExist { keys: sub } = &p.req else {
                panic!("a piece of another kind")
            };
            assert!(sub.len() <= 4 && sub.len() == p.positions.len());
            assert!(p.positions.windows(2).all(|w| w[0] < w[1]), "in order");
            for (k, &at) in sub.iter().zip(&p.positions) {
                assert_eq!(k, &keys[at]);
                assert_eq!(owner(k), p.shard);
                seen[at] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
        // Answers merge back in the batch's order.
        let answers = parts
            .iter()
            .map(|p| {
                let v = p
                    .positions
                    .iter()
                    .map(|&at| ItemResult::from(Ok::<bool, KvError>(at % 2 == 0)))
                    .collect();
                (p.positions.clone(), Ok(MasterResponse::BatchExists(v)))
            })
            .collect();
        let MasterResponse::BatchExists(v) = merge_batch(keys.len(), answers).unwrap() else {
            panic!("not an exists answer")
        };
        let got: Vec<bool> = v.into_iter().map(|r| Result::from(r).unwrap()).collect();
        let want: Vec<bool> = (0..keys.len()).map(|i| i % 2 == 0).collect();
        assert_eq!(got, want);
        // Within the bound: the parts of split_batch_by, unchanged.
        let req: MasterRequest = call::BatchExist { keys }.into();
        assert_eq!(split_batch_pieces(req, owner, 100).len(), 3);
    }

    #[test]
    fn a_typed_call_reads_its_own_answer_and_refuses_another() {
        assert!(call::Exist::reply(MasterResponse::Exists(true)).unwrap());
        let e = call::Exist::reply(MasterResponse::Done).unwrap_err();
        assert_eq!(e.code, ErrorCode::Internal);
        assert!(e.message.contains("exist"), "{e}");
        let q: MasterRequest = call::Stat.into();
        assert_eq!(q.op_name(), <call::Stat as Call>::OP);
    }
}
