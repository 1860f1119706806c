//! KV import and export through the pool client.
//!
//! A chunk is one pool object per group of layers ([`KvLayout::groups`]).
//!
//! * Import ([`KvPool::load_prefix`]): one batch exists over every object of
//!   the prompt's loadable chunks, then one batch get of the leading run
//!   present, read straight into fresh segments. Each segment's header and
//!   checksum are checked; the run stops at the first chunk with an object
//!   missing or refused (header or checksum mismatch, or longer than its
//!   segment). A refused object is counted, removed from the pool (so the
//!   recomputed one can take its key) and its chunk recomputed; it is never used.
//! * Streamed import ([`KvPool::load_streamed`]): the same exists, then a
//!   task reads group 0 of every chunk of the run, hands it to the model
//!   thread, reads group 1, and so on, each group checked the same way; a
//!   group shorter than the run ends the run there.
//! * Export ([`KvPool::run_store`]): the store task puts sealed segments,
//!   straight from the sequence's memory, one batch put per job. An object
//!   another engine stored first counts as present. A failure is logged and
//!   counted; the request it came from is not failed.

use std::sync::Arc;
use std::time::Instant;

use kvpool_client::Client;
use kvpool_runtime::chunk_hash::ChunkHash;
use kvpool_wire::proto::PutOptions;
use kvpool_wire::ErrorCode;

use crate::kv::{block_bytes, block_bytes_mut, verify, KvLayout};
use crate::metrics::EngineMetrics;
use crate::scheduler::{PendingLoad, StoreJob, StreamedGroup};

/// The engine's side of the pool.
pub struct KvPool {
    client: Client,
    master: String,
    metrics: EngineMetrics,
}

/// Chunks loaded for a prompt.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Verified segments of the leading chunks, every group of a chunk
    /// before the next chunk.
    pub segs: Vec<Arc<[f32]>>,
    /// Leading chunks loaded.
    pub chunks: usize,
    /// Objects read but refused (header or checksum mismatch).
    pub refused: usize,
}

impl KvPool {
    pub fn new(client: Client, master: String, metrics: EngineMetrics) -> Self {
        Self {
            client,
            master,
            metrics,
        }
    }

    /// The master address the engine's pool is reached at.
    pub fn master(&self) -> &str {
        &self.master
    }

    /// Loads the longest run of leading chunks of `hashes` present in the
    /// pool. With `probe`, one batch exists finds the run first; without,
    /// every key is read (the caller was told they are there).
    pub async fn load_prefix(
        &self,
        layout: &KvLayout,
        hashes: &[ChunkHash],
        probe: bool,
    ) -> Loaded {
        if hashes.is_empty() {
            return Loaded::default();
        }
        let t0 = Instant::now();
        let n = if probe {
            self.present(layout, hashes).await
        } else {
            hashes.len()
        };
        let all: Vec<usize> = (0..layout.groups()).collect();
        let loaded = self.read_groups(layout, &hashes[..n], &all).await;
        self.metrics
            .kv_load_seconds
            .observe(t0.elapsed().as_secs_f64());
        self.metrics.chunks_loaded.inc_by(loaded.chunks as u64);
        loaded
    }

    /// Starts loading the longest run of leading chunks of `hashes` present
    /// in the pool group by group (see [`KvPool::load_prefix`] for `probe`).
    /// Returns the run's length and the groups as they arrive; each group's
    /// read has the client's deadline (a read that fails or runs past it
    /// ends the run there), and the model thread waits for the last group
    /// until `deadline`.
    pub async fn load_streamed(
        self: &Arc<Self>,
        layout: &KvLayout,
        hashes: &[ChunkHash],
        probe: bool,
        deadline: Instant,
    ) -> (usize, Option<PendingLoad>) {
        let t0 = Instant::now();
        let n = if probe && !hashes.is_empty() {
            self.present(layout, hashes).await
        } else {
            hashes.len()
        };
        if n == 0 {
            return (0, None);
        }
        let (tx, rx) = flume::bounded(layout.groups());
        let (pool, layout, mut hashes) = (self.clone(), *layout, hashes[..n].to_vec());
        tokio::spawn(async move {
            for g in 0..layout.groups() {
                let loaded = pool.read_groups(&layout, &hashes, &[g]).await;
                hashes.truncate(loaded.chunks);
                let group = StreamedGroup {
                    group: g,
                    segs: loaded.segs,
                    refused: loaded.refused,
                };
                if tx.send_async(group).await.is_err() || hashes.is_empty() {
                    return;
                }
            }
            pool.metrics
                .kv_load_seconds
                .observe(t0.elapsed().as_secs_f64());
            pool.metrics.chunks_loaded.inc_by(hashes.len() as u64);
        });
        let pending = PendingLoad {
            groups: rx,
            deadline,
        };
        (n, Some(pending))
    }

    /// Leading chunks of `hashes` with every object present (one batch exists).
    async fn present(&self, layout: &KvLayout, hashes: &[ChunkHash]) -> usize {
        let groups = layout.groups();
        let keys: Vec<String> = hashes
            .iter()
            .flat_map(|h| (0..groups).map(|g| layout.group_key(*h, g)))
            .collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        self.metrics.pool_lookups.inc();
        match self.client.batch_exists(&refs).await {
            Ok(found) => found.iter().take_while(|r| matches!(r, Ok(true))).count() / groups,
            Err(e) => {
                tracing::warn!("KV lookup failed, computing the whole prompt: {e}");
                0
            }
        }
    }

    /// Reads groups `which` of the chunks of `hashes` (one batch get) and
    /// checks them; keeps the leading run of chunks whose every group in
    /// `which` was read and verified.
    async fn read_groups(
        &self,
        layout: &KvLayout,
        hashes: &[ChunkHash],
        which: &[usize],
    ) -> Loaded {
        if hashes.is_empty() {
            return Loaded::default();
        }
        let objects: Vec<(usize, usize, String)> = hashes
            .iter()
            .enumerate()
            .flat_map(|(c, h)| which.iter().map(move |&g| (c, g, layout.group_key(*h, g))))
            .collect();
        let mut segs: Vec<Arc<[f32]>> = objects
            .iter()
            .map(|&(_, g, _)| layout.new_segment(g))
            .collect();
        let results = {
            let mut items: Vec<(&[u8], &mut [u8])> = objects
                .iter()
                .zip(segs.iter_mut())
                .map(|((_, _, k), b)| {
                    let b = Arc::get_mut(b).expect("a fresh segment is not shared");
                    (k.as_bytes(), block_bytes_mut(b))
                })
                .collect();
            self.client.batch_get_into(&mut items).await
        };
        let results = match results {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("KV load failed, computing the whole prompt: {e}");
                return Loaded::default();
            }
        };
        let mut out = Loaded::default();
        let mut good = 0;
        for (i, (res, seg)) in results.into_iter().zip(segs).enumerate() {
            let (c, g, key) = &objects[i];
            let why = match res {
                Ok(len) => match verify(layout, hashes[*c], *g, &seg, len) {
                    Ok(()) => {
                        out.segs.push(seg);
                        good += 1;
                        continue;
                    }
                    Err(why) => why.to_string(),
                },
                // Our keys are valid, so InvalidParams here is the client
                // saying the object does not fit the segment: it is longer
                // than this group of this layout.
                Err(e) if e.code == ErrorCode::InvalidParams => {
                    format!("longer than a segment of this layout ({e})")
                }
                Err(e) => {
                    tracing::debug!("KV object {key} not loaded: {e}");
                    break;
                }
            };
            out.refused += 1;
            self.metrics.chunks_refused.inc();
            tracing::warn!("KV object {key} refused ({why}); recomputing its chunk");
            if let Err(e) = self.client.remove_with(key.as_bytes(), true).await {
                tracing::warn!("could not remove refused KV object {key}: {e}");
            }
            break;
        }
        out.chunks = good / which.len();
        out.segs.truncate(out.chunks * which.len());
        out
    }

    /// Stores the jobs of `rx` until every sender is gone.
    pub async fn run_store(self: Arc<Self>, rx: flume::Receiver<StoreJob>) {
        while let Ok(job) = rx.recv_async().await {
            self.store(&job).await;
            if let Some((end, done)) = job.done {
                let _ = done.send(job.tally.leading(end));
            }
        }
    }

    /// Puts a job's segments, recording failures in its tally.
    async fn store(&self, job: &StoreJob) {
        if job.items.is_empty() {
            return;
        }
        let items: Vec<(&[u8], &[u8])> = job
            .items
            .iter()
            .map(|i| (i.key.as_bytes(), block_bytes(&i.segment)))
            .collect();
        let n = items.len();
        let results = match self.client.batch_put(&items, &PutOptions::default()).await {
            Ok(r) => r,
            Err(e) => {
                self.metrics.chunks_store_failed.inc_by(n as u64);
                for i in &job.items {
                    job.tally.fail(i.chunk);
                }
                tracing::warn!("storing {n} KV objects failed: {e}");
                return;
            }
        };
        for (item, r) in job.items.iter().zip(results) {
            match r {
                Ok(()) => {
                    // A chunk counts once, when its last group is stored.
                    if item.last {
                        self.metrics.chunks_stored.inc();
                    }
                }
                Err(e) if e.code == ErrorCode::ObjectAlreadyExists => {}
                Err(e) => {
                    self.metrics.chunks_store_failed.inc();
                    job.tally.fail(item.chunk);
                    tracing::warn!("storing KV object {} failed: {e}", item.key);
                }
            }
        }
    }
}
