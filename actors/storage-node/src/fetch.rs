//! Extra replicas of hot objects: the node copies an object from another
//! node's replica into the range of its own segment the master allocated
//! (`NodeTask::Fetch`), and answers `Promoted`.
//!
//! ```text
//!  loop (tokio, only when the cluster map says hot replication is on and
//!        the node has no NVMe tier: the tier's loop runs these tasks too)
//!     every task_poll_ms (at once after a round that ran tasks):
//!     NodeTasks(dram) from every master shard, then their reports
//!        Fetch: read a replica of `from` -> check the checksum -> copy into
//!               the range -> Promoted { ok }
//! ```
//!
//! The bytes are read into a buffer of the task's length (which must fit
//! this node's segment), checked against the object's checksum, and only
//! then written into the segment: a range never holds bytes that fail it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_runtime::hash::value_sum;
use kvpool_runtime::Shutdown;
use kvpool_storage::Segment;
use kvpool_wire::proto::{call, FetchTask, NodeTask, NvmeUpdate, SegmentId};
use kvpool_wire::{ErrorCode, KvError};

use crate::metrics::StorageMetrics;
use crate::round::{run_rounds, Step, Steps, TASKS_PER_STEP};
use crate::task::FetchRule;

/// How long one fetch may take (reading another node's replica).
pub const FETCH_DEADLINE: Duration = Duration::from_secs(5);

/// The node's segment, as a fetch writes into it.
#[derive(Clone)]
pub struct FetchTarget {
    pub dram: Arc<Segment>,
    pub dram_id: SegmentId,
    pub metrics: StorageMetrics,
}

impl FetchTarget {
    /// Runs one `Fetch` task; returns the report the master waits for.
    pub async fn run(&self, client: &Client, task: FetchTask) -> NvmeUpdate {
        let ok = match self.fetch(client, &task).await {
            Ok(()) => {
                self.metrics.hot_fetches.inc();
                true
            }
            Err(e) => {
                tracing::warn!("fetching a replica of a hot object failed: {e}");
                false
            }
        };
        task.promoted(ok)
    }

    async fn fetch(&self, client: &Client, task: &FetchTask) -> Result<(), KvError> {
        let (key, from) = (&task.key[..], &task.from[..]);
        let (offset, len) = (task.offset, task.len);
        task.target(self.dram_id, self.dram.len())?;
        let mut buf = vec![0u8; len as usize];
        let read = client
            .engine()
            .read(key, from, &mut buf, Instant::now() + FETCH_DEADLINE)
            .await;
        // The engine checks the bytes against the replica's checksum when
        // the client checks checksums; this node checks them itself too.
        if let Err(e) = read.and_then(|()| task.check(value_sum(&buf))) {
            if e.code == ErrorCode::Corrupt {
                self.metrics.checksum_mismatches.inc();
            }
            return Err(e);
        }
        // SAFETY: in bounds (checked above); the master allocated this range
        // for the fetch and sends no reader or writer to it until it gets
        // the Promoted report.
        unsafe { self.dram.slice_mut(offset, len) }.copy_from_slice(&buf);
        Ok(())
    }

    /// One round: the Fetch tasks of every master shard, run and reported,
    /// in the order of the tier's rounds ([`Steps`]: nothing to flush
    /// before a report, nothing to evict at the end). Returns how many
    /// tasks ran.
    async fn round(&self, client: &Client) -> Result<usize, KvError> {
        let mut ran = 0;
        let mut steps = Steps::default();
        let mut updates = Vec::new();
        let mut step = steps.tick(client.cluster_map().shards.len() as u32);
        while let Some(s) = step {
            step = match s {
                Step::Tasks(shard) => {
                    let tasks = client
                        .call(call::NodeTasks {
                            client_id: client.id(),
                            shard,
                            segments: vec![self.dram_id],
                            max: TASKS_PER_STEP,
                        })
                        .await?;
                    for t in tasks {
                        ran += 1;
                        // A node without a tier is handed only Fetch tasks.
                        if let NodeTask::Fetch(f) = t {
                            updates.push(self.run(client, f).await);
                        }
                    }
                    steps.done(!updates.is_empty())
                }
                Step::Report(_) => {
                    let results = client
                        .call(call::NvmeUpdates {
                            client_id: client.id(),
                            updates: std::mem::take(&mut updates),
                        })
                        .await?;
                    for r in results.into_iter().map(Result::from) {
                        if let Err(e) = r {
                            tracing::debug!("a fetch report was refused: {e}");
                        }
                    }
                    steps.done(false)
                }
                Step::Evict => steps.done(false),
            };
        }
        Ok(ran)
    }

    /// Runs rounds until shutdown, at the tier loop's pace
    /// ([`crate::round::Pace`]).
    pub fn spawn_loop(self, client: Client, poll: Duration, shutdown: Shutdown) {
        tokio::spawn(async move {
            let (target, client) = (&self, &client);
            run_rounds(poll, shutdown, "hot-replica fetch", || target.round(client)).await
        });
    }
}
