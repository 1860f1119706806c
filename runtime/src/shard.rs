//! Thread-per-core shards.
//!
//! ```text
//!   main / tokio threads                      shard threads (pinned, one per core)
//!   --------------------                      ------------------------------------
//!   ShardPool::spawn_on(i, job) --flume(bounded)--> shard i: glommio LocalExecutor
//!   ShardPool::run_on(i, job).await <--oneshot----   runs job(ShardCtx) as a local task
//!   Shutdown::trigger() --watch--> every shard: tasks drain, DrainGuards drop, executor exits
//! ```
//!
//! A shard is a glommio `LocalExecutor` on its own thread, pinned to one core.
//! Work reaches a shard only as a message: a boxed job that the shard turns into
//! a local (`!Send`) task. The job channel is bounded: a full shard pushes back
//! on its callers instead of queueing without limit. State that belongs to a
//! shard is created inside a job and lives in that shard's tasks (`Rc`,
//! `RefCell`): no other thread touches it, so no lock guards it.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::time::{Duration, Instant};

use glommio::{LocalExecutorBuilder, Placement};
use tokio::sync::watch;

use crate::RuntimeError;

/// A unit of work for a shard: called on the shard's thread, it returns the
/// future that the shard runs as a local task.
pub type ShardJob = Box<dyn FnOnce(ShardCtx) -> Pin<Box<dyn Future<Output = ()>>> + Send>;

/// Settings of the shard pool, sized once at start.
#[derive(Debug, Clone)]
pub struct ShardPoolConfig {
    /// Number of shards; 0 means one per available core.
    pub shards: usize,
    /// Depth of each shard's job channel.
    pub job_queue_depth: usize,
    /// Pin each shard to one core (off: the OS places the threads).
    pub pin: bool,
    /// How long an idle shard spins before it parks; trades CPU for wake-up latency.
    pub spin_before_park: Duration,
    /// Memory glommio registers for io_uring buffers per shard.
    pub io_memory_bytes: usize,
    /// Thread name prefix.
    pub name: String,
    /// At shutdown, how long a shard waits for in-flight requests to finish.
    pub drain_timeout: Duration,
}

impl Default for ShardPoolConfig {
    fn default() -> Self {
        Self {
            shards: 0,
            job_queue_depth: 1024,
            pin: true,
            spin_before_park: Duration::ZERO,
            io_memory_bytes: 2560 * 1024,
            name: "kvpool-shard".into(),
            drain_timeout: Duration::from_secs(5),
        }
    }
}

/// A process-wide shutdown signal that every runtime (glommio, tokio) can await.
#[derive(Clone)]
pub struct Shutdown {
    tx: std::sync::Arc<watch::Sender<bool>>,
    rx: watch::Receiver<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Self {
        let (tx, rx) = watch::channel(false);
        Self {
            tx: std::sync::Arc::new(tx),
            rx,
        }
    }

    /// Asks everything that watches this signal to stop.
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }

    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once [`Shutdown::trigger`] has been called (at once if it was).
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        // An error means every sender is gone: nobody can trigger any more, and
        // the owner of the signal has ended, which is a shutdown too.
        let _ = rx.wait_for(|stopped| *stopped).await;
    }
}

/// What a job learns about the shard it runs on.
#[derive(Clone)]
pub struct ShardCtx {
    id: usize,
    nr_shards: usize,
    shutdown: Shutdown,
    drain: Rc<Cell<usize>>,
}

impl ShardCtx {
    pub fn id(&self) -> usize {
        self.id
    }

    pub fn nr_shards(&self) -> usize {
        self.nr_shards
    }

    pub fn shutdown(&self) -> &Shutdown {
        &self.shutdown
    }

    /// While a guard lives, the shard does not exit at shutdown (until the
    /// drain deadline passes). Connection tasks hold one for the request in flight.
    pub fn drain_guard(&self) -> DrainGuard {
        self.drain.set(self.drain.get() + 1);
        DrainGuard {
            drain: self.drain.clone(),
        }
    }
}

/// See [`ShardCtx::drain_guard`].
pub struct DrainGuard {
    drain: Rc<Cell<usize>>,
}

impl Drop for DrainGuard {
    fn drop(&mut self) {
        self.drain.set(self.drain.get() - 1);
    }
}

/// The running shards of this process.
pub struct ShardPool {
    jobs: Vec<flume::Sender<ShardJob>>,
    threads: Vec<glommio::ExecutorJoinHandle<()>>,
    shutdown: Shutdown,
}

impl ShardPool {
    /// Starts the shards. Reads the core list before any thread is pinned.
    pub fn start(cfg: &ShardPoolConfig, shutdown: Shutdown) -> Result<Self, RuntimeError> {
        let cores: Vec<usize> = core_affinity::get_core_ids()
            .map(|ids| ids.into_iter().map(|c| c.id).collect())
            .unwrap_or_default();
        let nr = if cfg.shards == 0 {
            cores.len().max(1)
        } else {
            cfg.shards
        };
        if cfg.job_queue_depth == 0 {
            return Err(RuntimeError::Config(
                "runtime.job_queue_depth must be at least 1".into(),
            ));
        }
        let mut jobs = Vec::with_capacity(nr);
        let mut threads = Vec::with_capacity(nr);
        for id in 0..nr {
            let (tx, rx) = flume::bounded::<ShardJob>(cfg.job_queue_depth);
            let placement = match (cfg.pin, cores.is_empty()) {
                (true, false) => Placement::Fixed(cores[id % cores.len()]),
                _ => Placement::Unbound,
            };
            let shutdown = shutdown.clone();
            let drain = cfg.drain_timeout;
            let mut builder = LocalExecutorBuilder::new(placement)
                .name(&format!("{}-{id}", cfg.name))
                .io_memory(cfg.io_memory_bytes);
            if !cfg.spin_before_park.is_zero() {
                builder = builder.spin_before_park(cfg.spin_before_park);
            }
            let handle = builder
                .spawn(move || {
                    // Dropped only by a panic unwinding the shard thread.
                    let guard = AbortOnPanic(id);
                    async move {
                        shard_main(id, nr, rx, shutdown, drain).await;
                        std::mem::forget(guard);
                    }
                })
                .map_err(|e| RuntimeError::Shard(format!("cannot start shard {id}: {e}")))?;
            jobs.push(tx);
            threads.push(handle);
        }
        tracing::debug!(shards = nr, "shard pool started");
        Ok(Self {
            jobs,
            threads,
            shutdown,
        })
    }

    pub fn nr_shards(&self) -> usize {
        self.jobs.len()
    }

    pub fn shutdown_signal(&self) -> &Shutdown {
        &self.shutdown
    }

    /// A cloneable handle that can send jobs to the shards from any thread.
    pub fn handle(&self) -> ShardHandle {
        ShardHandle {
            jobs: self.jobs.clone().into(),
        }
    }

    /// Triggers shutdown and waits for every shard thread to end. Each shard
    /// gives its in-flight work `drain_timeout` to finish.
    pub fn shutdown_and_join(self) -> Result<(), RuntimeError> {
        self.shutdown.trigger();
        drop(self.jobs);
        let mut first_err = None;
        for (id, t) in self.threads.into_iter().enumerate() {
            if let Err(e) = t.join() {
                first_err.get_or_insert(RuntimeError::Shard(format!("shard {id} failed: {e}")));
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Sends jobs to shards; cheap to clone, usable from any thread or runtime.
#[derive(Clone)]
pub struct ShardHandle {
    jobs: std::sync::Arc<[flume::Sender<ShardJob>]>,
}

impl ShardHandle {
    pub fn nr_shards(&self) -> usize {
        self.jobs.len()
    }

    /// Runs `job` on shard `shard` as a local task; waits for room in the
    /// shard's queue (that wait is the back-pressure).
    pub async fn spawn_on<F, Fut>(&self, shard: usize, job: F) -> Result<(), RuntimeError>
    where
        F: FnOnce(ShardCtx) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let boxed: ShardJob = Box::new(move |ctx| Box::pin(job(ctx)));
        self.jobs[shard]
            .send_async(boxed)
            .await
            .map_err(|_| RuntimeError::ShardGone(shard))
    }

    /// Like [`ShardHandle::spawn_on`] but blocks the calling thread; for use
    /// outside any async runtime (start-up code).
    pub fn spawn_on_blocking<F, Fut>(&self, shard: usize, job: F) -> Result<(), RuntimeError>
    where
        F: FnOnce(ShardCtx) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let boxed: ShardJob = Box::new(move |ctx| Box::pin(job(ctx)));
        self.jobs[shard]
            .send(boxed)
            .map_err(|_| RuntimeError::ShardGone(shard))
    }

    /// Runs `job` on shard `shard` and returns its output.
    pub async fn run_on<F, Fut, T>(&self, shard: usize, job: F) -> Result<T, RuntimeError>
    where
        F: FnOnce(ShardCtx) -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
        T: Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.spawn_on(shard, move |ctx| async move {
            let _ = tx.send(job(ctx).await);
        })
        .await?;
        rx.await.map_err(|_| RuntimeError::ShardGone(shard))
    }
}

/// Ends the process when a panic unwinds a shard's thread: a shard that
/// died while the others serve would leave a half-alive process whose calls
/// to that shard time out forever. The panic message is printed by the
/// panic hook before this runs; a supervisor restarts the process whole.
struct AbortOnPanic(usize);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!(shard = self.0, "a shard panicked; aborting the process");
            eprintln!("kvpool: shard {} panicked; aborting the process", self.0);
            std::process::abort();
        }
    }
}

async fn shard_main(
    id: usize,
    nr: usize,
    rx: flume::Receiver<ShardJob>,
    shutdown: Shutdown,
    drain_timeout: Duration,
) {
    let ctx = ShardCtx {
        id,
        nr_shards: nr,
        shutdown: shutdown.clone(),
        drain: Rc::new(Cell::new(0)),
    };
    loop {
        let next = futures_lite::future::or(async { Some(rx.recv_async().await) }, async {
            shutdown.wait().await;
            None
        })
        .await;
        match next {
            Some(Ok(job)) => {
                glommio::spawn_local(job(ctx.clone())).detach();
            }
            // Every sender is gone, or shutdown: stop taking jobs.
            Some(Err(_)) | None => break,
        }
    }
    // Give in-flight requests time to finish; poll with a bound.
    let deadline = Instant::now() + drain_timeout;
    while ctx.drain.get() > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(5)).await;
    }
    if ctx.drain.get() > 0 {
        tracing::warn!(
            shard = id,
            in_flight = ctx.drain.get(),
            "shutdown drain deadline passed; dropping in-flight work"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_on_the_shard_they_name_and_return_values() {
        let cfg = ShardPoolConfig {
            shards: 2,
            pin: false,
            ..Default::default()
        };
        let pool = ShardPool::start(&cfg, Shutdown::new()).unwrap();
        let h = pool.handle();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ids = rt.block_on(async {
            let a = h.run_on(0, |ctx| async move { ctx.id() }).await.unwrap();
            let b = h.run_on(1, |ctx| async move { ctx.id() }).await.unwrap();
            (a, b)
        });
        assert_eq!(ids, (0, 1));
        pool.shutdown_and_join().unwrap();
    }

    #[test]
    fn shutdown_waits_for_drain_guards_then_exits() {
        let cfg = ShardPoolConfig {
            shards: 1,
            pin: false,
            ..Default::default()
        };
        let pool = ShardPool::start(&cfg, Shutdown::new()).unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d2 = done.clone();
        pool.handle()
            .spawn_on_blocking(0, move |ctx| async move {
                let _g = ctx.drain_guard();
                ctx.shutdown().wait().await;
                // Work that finishes after the signal, before the deadline.
                glommio::timer::sleep(Duration::from_millis(50)).await;
                d2.store(true, std::sync::atomic::Ordering::SeqCst);
            })
            .unwrap();
        // Let the job start before shutting down.
        let h = pool.handle();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(h.run_on(0, |_| async {})).unwrap();
        pool.shutdown_and_join().unwrap();
        assert!(done.load(std::sync::atomic::Ordering::SeqCst));
    }
}
