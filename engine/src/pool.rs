//! KV import and export through the pool client.
//!
//! * Import ([`KvPool::load_prefix`]): one batch exists over the prompt's
//!   loadable chunk keys, then one batch get of the leading run present,
//!   read straight into fresh KV blocks. Each block's header and checksum
//!   are checked; the run stops at the first chunk that is missing or
//!   refused (header or checksum mismatch, or an object longer than a
//!   chunk). A refused chunk is counted, removed from the pool (so the
//!   recomputed one can take its key) and recomputed; it is never used.
//! * Export ([`KvPool::run_store`]): the store task puts sealed blocks,
//!   straight from the sequence's memory, one batch put per prompt. A chunk
//!   another engine stored first counts as present. A failure is logged and
//!   counted; the request it came from is not failed.

use std::sync::Arc;
use std::time::Instant;

use kvpool_client::Client;
use kvpool_runtime::chunk_hash::ChunkHash;
use kvpool_transport::proto::PutOptions;
use kvpool_transport::ErrorCode;

use crate::kv::{block_bytes, block_bytes_mut, verify, KvLayout};
use crate::metrics::EngineMetrics;
use crate::scheduler::StoreJob;

/// The engine's side of the pool.
pub struct KvPool {
    client: Client,
    master: String,
    metrics: EngineMetrics,
}

/// Chunks loaded for a prompt.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Verified blocks of the leading chunks, in order.
    pub blocks: Vec<Arc<[f32]>>,
    /// Chunks read but refused (header or checksum mismatch).
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
        let loaded = self.load_inner(layout, hashes, probe).await;
        self.metrics
            .kv_load_seconds
            .observe(t0.elapsed().as_secs_f64());
        self.metrics
            .chunks_loaded
            .inc_by(loaded.blocks.len() as u64);
        self.metrics.chunks_refused.inc_by(loaded.refused as u64);
        loaded
    }

    async fn load_inner(&self, layout: &KvLayout, hashes: &[ChunkHash], probe: bool) -> Loaded {
        let keys: Vec<String> = hashes.iter().map(|h| layout.key(*h)).collect();
        let mut n = keys.len();
        if probe {
            let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
            match self.client.batch_exists(&refs).await {
                Ok(found) => n = found.iter().take_while(|r| matches!(r, Ok(true))).count(),
                Err(e) => {
                    tracing::warn!("KV lookup failed, computing the whole prompt: {e}");
                    return Loaded::default();
                }
            }
        }
        if n == 0 {
            return Loaded::default();
        }
        let mut blocks: Vec<Arc<[f32]>> = (0..n).map(|_| layout.new_block()).collect();
        let results = {
            let mut items: Vec<(&[u8], &mut [u8])> = keys[..n]
                .iter()
                .zip(blocks.iter_mut())
                .map(|(k, b)| {
                    let b = Arc::get_mut(b).expect("a fresh block is not shared");
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
        for (i, (res, block)) in results.into_iter().zip(blocks).enumerate() {
            let why = match res {
                Ok(len) => match verify(layout, hashes[i], &block, len) {
                    Ok(()) => {
                        out.blocks.push(block);
                        continue;
                    }
                    Err(why) => why.to_string(),
                },
                // Our keys are valid, so InvalidParams here is the client
                // saying the object does not fit the block: it is longer
                // than any chunk of this layout.
                Err(e) if e.code == ErrorCode::InvalidParams => {
                    format!("longer than a chunk of this layout ({e})")
                }
                Err(e) => {
                    tracing::debug!("KV chunk {} not loaded: {e}", keys[i]);
                    break;
                }
            };
            out.refused += 1;
            tracing::warn!("KV chunk {} refused ({why}); recomputing it", keys[i]);
            if let Err(e) = self.client.remove_with(keys[i].as_bytes(), true).await {
                tracing::warn!("could not remove refused chunk {}: {e}", keys[i]);
            }
            break;
        }
        out
    }

    /// Stores the jobs of `rx` until every sender is gone.
    pub async fn run_store(self: Arc<Self>, rx: flume::Receiver<StoreJob>) {
        while let Ok(job) = rx.recv_async().await {
            let present = self.store(&job).await;
            if let Some(done) = job.done {
                let _ = done.send(job.loaded_before + present);
            }
        }
    }

    /// Puts a job's chunks; returns the leading run now in the pool.
    async fn store(&self, job: &StoreJob) -> usize {
        let items: Vec<(&[u8], &[u8])> = job
            .items
            .iter()
            .map(|(k, b)| (k.as_bytes(), block_bytes(b)))
            .collect();
        let n = items.len();
        let results = match self.client.batch_put(&items, &PutOptions::default()).await {
            Ok(r) => r,
            Err(e) => {
                self.metrics.chunks_store_failed.inc_by(n as u64);
                tracing::warn!("storing {n} KV chunks failed: {e}");
                return 0;
            }
        };
        let mut leading = 0;
        let mut run = true;
        for ((key, _), r) in job.items.iter().zip(results) {
            let present = match r {
                Ok(()) => {
                    self.metrics.chunks_stored.inc();
                    true
                }
                Err(e) if e.code == ErrorCode::ObjectAlreadyExists => true,
                Err(e) => {
                    self.metrics.chunks_store_failed.inc();
                    tracing::warn!("storing KV chunk {key} failed: {e}");
                    false
                }
            };
            run &= present;
            if run {
                leading += 1;
            }
        }
        leading
    }
}
