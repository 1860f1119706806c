//! The engine loop: one thread owns the model and every running sequence.
//!
//! ```text
//!  HTTP handlers (tokio) --submit (bounded: max_waiting)--> engine thread
//!       ^   events per request (bounded: max_tokens + 2)        |  step:
//!       +---------------------------------------------------- <-+   1. admit up to max_num_seqs
//!                                                               |   2. one prefill piece (<= one chunk,
//!                                                               |      prompts take turns)
//!  store task (tokio) <--store jobs (bounded)------------------ +   3. one decode step, all decoding seqs
//! ```
//!
//! Each step runs at most one prefill piece, cut at the next chunk boundary,
//! then one batched decode step over every decoding sequence: a long prompt
//! delays running decodes by at most one chunk of prefill per token. Pieces
//! end on chunk boundaries, so every full chunk's KV is computed by the same
//! sequence of passes whether or not an earlier chunk came from the pool,
//! and a loaded prefix gives bit-identical results to a computed one.
//! Prompts in prefill take turns, one piece each, so a short prompt behind
//! a long one waits for one piece of it per piece of its own. A sequence
//! whose caller went away (its events receiver dropped) is dropped before
//! the step does any work for it, and counted.
//!
//! When a sequence's prompt is done, its new full chunks are sealed (header,
//! checksum) and handed to the store task, shared with the sequence (a full
//! chunk is never written again). With layer-wise streaming
//! (`engine.kv_stream`) each group of layers of a chunk is sealed and handed
//! over as soon as the piece computing the chunk has run its last layer, while
//! the next group computes; and a prefix loaded from the pool arrives group by
//! group while the piece runs: the pass waits before a group's first layer
//! until that group is in place ([`PendingLoad`]). A group that arrives short
//! (a chunk missing or refused) ends the pass; the sequence keeps the chunks
//! that arrived and computes the rest, so the output never depends on whether
//! or how KV was streamed.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_runtime::chunk_hash::ChunkHash;
use tokio::sync::{mpsc, oneshot};

use crate::error::EngineError;
use crate::kv::{KvLayout, SeqKv};
use crate::metrics::EngineMetrics;
use crate::model::{LayerHook, Llama, Step};
use crate::sampling::{logprobs, Sampler, SamplingParams, TokenLogprobs};

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token (or, decided by the caller, a stop string).
    Stop,
    /// `max_tokens` or the model's length limit.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What a running request hears from the engine.
#[derive(Debug)]
pub enum Event {
    /// The prompt is done: how many of its tokens were computed, and how
    /// many KV objects of a streamed load were refused on the way.
    Prefilled { computed: usize, refused: usize },
    /// A generated token, with its logprobs when the request asked.
    Token(u32, Option<TokenLogprobs>),
    /// The sequence ended.
    Done(Finish),
    /// The engine failed this sequence.
    Failed(String),
}

/// A segment to store: the index of its chunk in the prompt, its group, its
/// pool key and the sealed segment.
pub struct StoreItem {
    pub chunk: usize,
    pub group: usize,
    /// Whether this is the chunk's last group.
    pub last: bool,
    pub key: String,
    pub segment: Arc<[f32]>,
}

/// What a prompt's store jobs achieved, shared by all of them.
#[derive(Debug)]
pub struct StoreTally {
    /// The first chunk of the prompt with a segment not stored.
    first_failed: AtomicUsize,
}

impl Default for StoreTally {
    fn default() -> Self {
        Self {
            first_failed: AtomicUsize::new(usize::MAX),
        }
    }
}

impl StoreTally {
    /// Records that a segment of chunk `chunk` is not in the pool.
    pub fn fail(&self, chunk: usize) {
        self.first_failed.fetch_min(chunk, Ordering::Relaxed);
    }

    /// Leading chunks of `0..end` in the pool, the ones before a failure.
    pub fn leading(&self, end: usize) -> usize {
        self.first_failed.load(Ordering::Relaxed).min(end)
    }
}

/// Segments for the store task. Jobs run in order, so `done` (set on a
/// prompt's last job) hears, after every earlier job of the prompt ran, how
/// many of its leading chunks are in the pool: `end` (its full chunks)
/// capped at the first one whose store failed.
pub struct StoreJob {
    pub items: Vec<StoreItem>,
    pub tally: Arc<StoreTally>,
    pub done: Option<(usize, oneshot::Sender<usize>)>,
}

/// One group of a streamed load: segments of the leading chunks verified,
/// and how many objects of the group were refused (0 or 1: the run ends there).
pub struct StreamedGroup {
    pub group: usize,
    pub segs: Vec<Arc<[f32]>>,
    pub refused: usize,
}

/// A prefix being loaded group by group: the loader sends group `g`'s
/// verified segments of the leading chunks (in chunk order) for g = 0, 1, ...
/// A group covering fewer chunks than were promised ends the loaded run there.
pub struct PendingLoad {
    pub groups: flume::Receiver<StreamedGroup>,
    /// The model thread waits for a group at most until then.
    pub deadline: Instant,
}

/// A request handed to the engine.
pub struct Request {
    pub prompt: Vec<u32>,
    /// Chunk hashes of the prompt's full chunks.
    pub hashes: Vec<ChunkHash>,
    /// KV with the loaded prefix (whole chunks) already in place.
    pub kv: SeqKv,
    pub params: SamplingParams,
    /// Token ids that end the sequence (unless `params.ignore_eos`).
    pub eos: Vec<u32>,
    /// Position limit (prompt + generated).
    pub max_len: usize,
    /// Store the prompt's new full chunks; `Some(tx)` also reports when stored.
    pub store: Option<Option<oneshot::Sender<usize>>>,
    /// The loaded prefix still arriving (streamed), its chunks already in `kv`.
    pub pending: Option<PendingLoad>,
    pub events: mpsc::Sender<Event>,
}

struct Running {
    /// Admission order (round-robin of prefill pieces).
    seq: u64,
    req: Request,
    sampler: Sampler,
    loaded_blocks: usize,
    /// What the stores of this prompt achieved.
    tally: Arc<StoreTally>,
    /// Objects of a streamed load refused so far.
    refused: usize,
    /// The token to feed next (decode phase), if any.
    next: Option<u32>,
    generated: usize,
    computed: usize,
}

impl Running {
    fn prefilling(&self) -> bool {
        self.req.kv.len() < self.req.prompt.len()
    }

    fn send(&self, e: Event) -> bool {
        self.req.events.try_send(e).is_ok()
    }
}

/// Limits of the loop.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    pub chunk_tokens: usize,
    pub max_num_seqs: usize,
    /// Store each group of a chunk's layers as soon as it is computed.
    pub stream_store: bool,
}

/// What one [`Scheduler::step`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StepReport {
    /// Prompt tokens computed by this step's prefill piece (at most one chunk).
    pub prefill_tokens: usize,
    /// Sequences that decoded one token in this step's batch.
    pub decoded: usize,
}

/// The running sequences and what steps them.
pub struct Scheduler {
    model: Arc<Llama>,
    cfg: LoopConfig,
    store_tx: Option<flume::Sender<StoreJob>>,
    metrics: EngineMetrics,
    running: VecDeque<Running>,
    /// Sequences admitted so far.
    admitted: u64,
    /// The sequence whose prompt the last prefill piece was of.
    last_prefill: Option<u64>,
}

impl Scheduler {
    pub fn new(
        model: Arc<Llama>,
        cfg: LoopConfig,
        store_tx: Option<flume::Sender<StoreJob>>,
        metrics: EngineMetrics,
    ) -> Self {
        Self {
            model,
            cfg,
            store_tx,
            metrics,
            running: VecDeque::new(),
            admitted: 0,
            last_prefill: None,
        }
    }

    /// Sequences admitted and not finished.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Whether another sequence may be admitted.
    pub fn has_room(&self) -> bool {
        self.running.len() < self.cfg.max_num_seqs
    }

    /// Starts a sequence (the caller checks [`Scheduler::has_room`]).
    pub fn admit(&mut self, req: Request) {
        self.running.push_back(admit(self.admitted, req));
        self.admitted += 1;
        self.metrics.running.set(self.running.len() as i64);
    }

    /// Drops every sequence whose caller went away (its events receiver is
    /// gone: a client that disconnected, a request past its deadline),
    /// freeing its KV, before any more work is done for it.
    fn drop_abandoned(&mut self) {
        let before = self.running.len();
        self.running.retain(|r| !r.req.events.is_closed());
        let gone = before - self.running.len();
        if gone > 0 {
            self.metrics.cancelled.inc_by(gone as u64);
        }
    }

    /// Removes a sequence that ended; one whose caller is gone (its last
    /// event could not be sent) counts as cancelled.
    fn finish(&mut self, i: usize) {
        if let Some(r) = self.running.remove(i) {
            if r.req.events.is_closed() {
                self.metrics.cancelled.inc();
            }
        }
    }

    /// The sequence the next prefill piece is of: prompts take turns, one
    /// piece each (the first still in its prompt after the last one served,
    /// in admission order), so a short prompt admitted behind a long one
    /// waits for a piece of it per piece of its own, not for all of it.
    fn next_prefill(&self) -> Option<usize> {
        let prefilling = || {
            self.running
                .iter()
                .enumerate()
                .filter(|(_, r)| r.prefilling())
        };
        let after = self.last_prefill;
        prefilling()
            .find(|(_, r)| after.is_some_and(|l| r.seq > l))
            .or_else(|| prefilling().next())
            .map(|(i, _)| i)
    }

    /// One prefill piece (of the prompt whose turn it is, up to the next
    /// chunk boundary), then one decode step over every sequence past its
    /// prompt. Sequences whose caller went away are dropped first.
    pub fn step(&mut self) -> StepReport {
        let mut report = StepReport::default();
        self.drop_abandoned();
        if let Some(i) = self.next_prefill() {
            self.last_prefill = Some(self.running[i].seq);
            let before = self.running[i].req.kv.len();
            let keep = prefill_piece(
                &self.model,
                &self.cfg,
                &mut self.running[i],
                self.store_tx.as_ref(),
                &self.metrics,
            );
            report.prefill_tokens = self.running[i].req.kv.len() - before;
            if !keep {
                self.finish(i);
            }
        }
        let decoding: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].next.is_some())
            .collect();
        if !decoding.is_empty() {
            report.decoded = decoding.len();
            let ended = decode_step(&self.model, &mut self.running, &decoding, &self.metrics);
            for i in ended.into_iter().rev() {
                self.finish(i);
            }
        }
        self.drop_abandoned();
        self.metrics.running.set(self.running.len() as i64);
        report
    }
}

/// Runs the engine loop until every sender of `rx` is gone and no sequence
/// is left.
pub fn run(
    model: Arc<Llama>,
    cfg: LoopConfig,
    rx: flume::Receiver<Request>,
    store_tx: Option<flume::Sender<StoreJob>>,
    metrics: EngineMetrics,
) {
    let mut s = Scheduler::new(model, cfg, store_tx, metrics.clone());
    loop {
        if s.running() == 0 {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(r) => s.admit(r),
                Err(flume::RecvTimeoutError::Timeout) => {
                    metrics.waiting.set(rx.len() as i64);
                    continue;
                }
                Err(flume::RecvTimeoutError::Disconnected) => return,
            }
        }
        while s.has_room() {
            match rx.try_recv() {
                Ok(r) => s.admit(r),
                Err(_) => break,
            }
        }
        metrics.waiting.set(rx.len() as i64);
        s.step();
    }
}

fn admit(seq: u64, req: Request) -> Running {
    let sampler = Sampler::new(&req.params);
    let loaded_blocks = req.kv.len() / req.kv.layout().chunk_tokens;
    Running {
        seq,
        req,
        sampler,
        loaded_blocks,
        tally: Arc::default(),
        refused: 0,
        next: None,
        generated: 0,
        computed: 0,
    }
}

/// Runs the next piece of `r`'s prompt; false when the sequence is over.
fn prefill_piece(
    model: &Llama,
    cfg: &LoopConfig,
    r: &mut Running,
    store_tx: Option<&flume::Sender<StoreJob>>,
    metrics: &EngineMetrics,
) -> bool {
    let pos = r.req.kv.len();
    let len = r.req.prompt.len();
    let end = ((pos / cfg.chunk_tokens + 1) * cfg.chunk_tokens).min(len);
    let last = end == len;
    let t0 = Instant::now();
    let layout = *r.req.kv.layout();
    let chunk = pos / cfg.chunk_tokens;
    // The chunk this piece completes, when its groups are streamed to the pool.
    let stream = match store_tx {
        Some(tx)
            if cfg.stream_store
                && r.req.store.is_some()
                && end == (chunk + 1) * cfg.chunk_tokens
                && chunk >= r.loaded_blocks =>
        {
            Some(StreamStore {
                chunk,
                hash: r.req.hashes[chunk],
                filled: end,
                tx,
                tally: &r.tally,
                metrics,
            })
        }
        _ => None,
    };
    let mut hook = PieceHook {
        layout,
        pending: r.req.pending.as_ref(),
        waited: Duration::ZERO,
        refused: 0,
        store: stream,
    };
    let out = {
        let mut steps = [Step {
            tokens: &r.req.prompt[pos..end],
            kv: &mut r.req.kv,
            want_logits: last,
        }];
        model.forward_with(&mut steps, &mut hook)
    };
    let waited = hook.waited;
    r.refused += hook.refused;
    if r.req.pending.is_some() {
        metrics.kv_stream_wait_seconds.observe(waited.as_secs_f64());
        if (0..layout.groups()).all(|g| !r.req.kv.awaits(g)) {
            r.req.pending = None;
        }
    }
    let secs = (t0.elapsed() - waited).as_secs_f64();
    let logits = match out {
        Ok(l) => l,
        Err(EngineError::KvLost { keep }) => {
            // Keep the chunks that arrived; the next piece computes from there.
            let keep = keep.min(r.loaded_blocks);
            r.req.kv.truncate_chunks(keep);
            r.loaded_blocks = keep;
            if keep == 0 {
                r.req.pending = None;
            }
            return true;
        }
        Err(e) => {
            r.send(Event::Failed(format!("prefill failed: {e}")));
            return false;
        }
    };
    let n = end - pos;
    r.computed += n;
    metrics.prompt_tokens_computed.inc_by(n as u64);
    metrics.prefill_seconds.inc_by(secs);
    if secs > 0.0 {
        metrics.prefill_tokens_per_second.set(n as f64 / secs);
    }
    if !last {
        // A caller gone by now is counted and dropped at the step's end.
        return true;
    }
    store_new_chunks(r, cfg, store_tx, metrics);
    if !r.send(Event::Prefilled {
        computed: r.computed,
        refused: r.refused,
    }) {
        return false;
    }
    let token = r.sampler.sample(&logits[0]);
    let lp = r
        .req
        .params
        .logprobs
        .map(|k| logprobs(&logits[0], token, k));
    // The first token of the answer: generated too (was left out, so the
    // counter read one token short per request).
    metrics.generated_tokens.inc();
    emit(r, token, lp)
}

/// The layer hook of a prefill piece: waits for streamed groups of the
/// loaded prefix, and streams the groups of the chunk the piece completes.
struct PieceHook<'a> {
    layout: KvLayout,
    pending: Option<&'a PendingLoad>,
    /// Time spent waiting for streamed groups.
    waited: Duration,
    /// Objects of the streamed groups received that were refused.
    refused: usize,
    store: Option<StreamStore<'a>>,
}

struct StreamStore<'a> {
    chunk: usize,
    hash: ChunkHash,
    /// Positions written once the piece's layers ran.
    filled: usize,
    tx: &'a flume::Sender<StoreJob>,
    tally: &'a Arc<StoreTally>,
    metrics: &'a EngineMetrics,
}

impl LayerHook for PieceHook<'_> {
    fn before_layer(&mut self, _: usize, layer: usize, kv: &mut SeqKv) -> Result<(), EngineError> {
        let g = self.layout.group_of(layer);
        let Some(p) = self.pending.filter(|_| kv.awaits(g)) else {
            return Ok(());
        };
        let t0 = Instant::now();
        let got = loop {
            match p.groups.recv_deadline(p.deadline) {
                // Groups come in order; one installed by an earlier pass
                // that ended is not sent again.
                Ok(got) if got.group == g => break Some(got),
                Ok(_) => continue,
                Err(_) => break None,
            }
        };
        self.waited += t0.elapsed();
        match got {
            Some(got) => {
                self.refused += got.refused;
                let keep = got.segs.len();
                if kv.install(g, got.segs) {
                    Ok(())
                } else {
                    Err(EngineError::KvLost { keep })
                }
            }
            None => {
                tracing::warn!("streamed KV group {g} did not arrive in time; recomputing");
                Err(EngineError::KvLost { keep: 0 })
            }
        }
    }

    fn after_layer(&mut self, _: usize, layer: usize, kv: &mut SeqKv) {
        let Some(s) = &self.store else {
            return;
        };
        let g = self.layout.group_of(layer);
        let (first, count) = self.layout.group_span(g);
        if layer + 1 != first + count {
            return;
        }
        let item = StoreItem {
            chunk: s.chunk,
            group: g,
            last: g + 1 == self.layout.groups(),
            key: self.layout.group_key(s.hash, g),
            segment: kv.seal_segment(s.chunk, g, s.hash, s.filled),
        };
        let job = StoreJob {
            items: vec![item],
            tally: s.tally.clone(),
            done: None,
        };
        if s.tx.try_send(job).is_err() {
            s.tally.fail(s.chunk);
            s.metrics.chunks_store_failed.inc();
            tracing::warn!("KV store queue is full or closed: a streamed group not stored");
        }
    }
}

/// Seals the prompt's full chunks computed here (those not streamed already)
/// and queues them for the pool.
fn store_new_chunks(
    r: &mut Running,
    cfg: &LoopConfig,
    store_tx: Option<&flume::Sender<StoreJob>>,
    metrics: &EngineMetrics,
) {
    let Some(done) = r.req.store.take() else {
        return;
    };
    let loaded = r.loaded_blocks;
    let layout = *r.req.kv.layout();
    let full = r.req.prompt.len() / layout.chunk_tokens;
    let Some(tx) = store_tx.filter(|_| full > loaded) else {
        if let Some(done) = done {
            let _ = done.send(loaded);
        }
        return;
    };
    let mut items = Vec::new();
    if !cfg.stream_store {
        for c in loaded..full {
            let hash = r.req.hashes[c];
            for (g, segment) in r.req.kv.seal_chunk(c, hash).into_iter().enumerate() {
                let key = layout.group_key(hash, g);
                items.push(StoreItem {
                    chunk: c,
                    group: g,
                    last: g + 1 == layout.groups(),
                    key,
                    segment,
                });
            }
        }
    }
    if items.is_empty() && done.is_none() {
        return;
    }
    let n = items.len() as u64;
    let job = StoreJob {
        items,
        tally: r.tally.clone(),
        done: done.map(|tx| (full, tx)),
    };
    if let Err(e) = tx.try_send(job) {
        metrics.chunks_store_failed.inc_by(n);
        tracing::warn!("KV store queue is full or closed: {n} KV objects not stored");
        if let Some((_, done)) = e.into_inner().done {
            let _ = done.send(loaded);
        }
    }
}

/// Handles a sampled token; false when the sequence is over.
fn emit(r: &mut Running, token: u32, lp: Option<TokenLogprobs>) -> bool {
    r.generated += 1;
    if !r.send(Event::Token(token, lp)) {
        return false;
    }
    let eos = !r.req.params.ignore_eos && r.req.eos.contains(&token);
    let finish = if eos {
        Some(Finish::Stop)
    } else if r.generated >= r.req.params.max_tokens
        || r.req.prompt.len() + r.generated >= r.req.max_len
    {
        Some(Finish::Length)
    } else {
        None
    };
    match finish {
        Some(f) => {
            r.send(Event::Done(f));
            false
        }
        None => {
            r.next = Some(token);
            true
        }
    }
}

/// One batched decode step; returns the indexes of sequences that ended.
fn decode_step(
    model: &Llama,
    running: &mut VecDeque<Running>,
    which: &[usize],
    metrics: &EngineMetrics,
) -> Vec<usize> {
    let t0 = Instant::now();
    let out = {
        let mut steps: Vec<Step<'_>> = Vec::with_capacity(which.len());
        for r in running.iter_mut().filter(|r| r.next.is_some()) {
            let Running { req, next, .. } = r;
            steps.push(Step {
                tokens: std::slice::from_ref(next.as_ref().expect("filtered on next")),
                kv: &mut req.kv,
                want_logits: true,
            });
        }
        debug_assert_eq!(steps.len(), which.len());
        model.forward(&mut steps)
    };
    let secs = t0.elapsed().as_secs_f64();
    metrics.decode_seconds.inc_by(secs);
    if secs > 0.0 {
        metrics
            .decode_tokens_per_second
            .set(which.len() as f64 / secs);
    }
    let mut ended = Vec::new();
    match out {
        Ok(logits) => {
            for (&i, l) in which.iter().zip(&logits) {
                let r = &mut running[i];
                let token = r.sampler.sample(l);
                let lp = r.req.params.logprobs.map(|k| logprobs(l, token, k));
                metrics.generated_tokens.inc();
                if !emit(r, token, lp) {
                    ended.push(i);
                }
            }
        }
        Err(e) => {
            for &i in which {
                running[i].send(Event::Failed(format!("decode failed: {e}")));
                ended.push(i);
            }
        }
    }
    ended
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvLayout;
    use kvpool_runtime::chunk_hash::chunk_hashes;
    use kvpool_runtime::metrics::MetricsRegistry;

    const CHUNK: usize = 64;

    fn setup(store: bool) -> (Scheduler, KvLayout, Option<flume::Receiver<StoreJob>>) {
        setup_with(store, 4, false)
    }

    /// builtin:tiny (4 layers) with `group_layers` layers per KV object.
    fn setup_with(
        store: bool,
        group_layers: usize,
        stream_store: bool,
    ) -> (Scheduler, KvLayout, Option<flume::Receiver<StoreJob>>) {
        let m = crate::loader::load("builtin:tiny").unwrap();
        let c = m.model.config();
        let layout = KvLayout {
            chunk_tokens: CHUNK,
            layers: c.num_hidden_layers,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim(),
            fingerprint: m.fingerprint,
            group_layers,
        };
        let (tx, rx) = if store {
            let (tx, rx) = flume::bounded(64);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let cfg = LoopConfig {
            chunk_tokens: CHUNK,
            max_num_seqs: 4,
            stream_store,
        };
        let metrics = EngineMetrics::new(&MetricsRegistry::new());
        (
            Scheduler::new(Arc::new(m.model), cfg, tx, metrics),
            layout,
            rx,
        )
    }

    fn request(
        _layout: KvLayout,
        prompt: Vec<u32>,
        kv: SeqKv,
        max_tokens: usize,
    ) -> (Request, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel(max_tokens + 2);
        let hashes = chunk_hashes(&prompt, CHUNK).unwrap();
        let req = Request {
            prompt,
            hashes,
            kv,
            params: SamplingParams {
                temperature: 0.0,
                max_tokens,
                ignore_eos: true,
                ..SamplingParams::default()
            },
            eos: vec![],
            max_len: 4096,
            store: Some(None),
            pending: None,
            events: tx,
        };
        (req, rx)
    }

    fn prompt(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7) % 256)
            .collect()
    }

    fn tokens(rx: &mut mpsc::Receiver<Event>) -> Vec<u32> {
        let mut out = Vec::new();
        while let Ok(e) = rx.try_recv() {
            if let Event::Token(t, _) = e {
                out.push(t);
            }
        }
        out
    }

    fn run_to_end(s: &mut Scheduler) {
        for _ in 0..10_000 {
            if s.running() == 0 {
                return;
            }
            s.step();
        }
        panic!("the sequences did not finish");
    }

    #[test]
    fn a_long_prefill_is_cut_so_running_decodes_go_on_every_step() {
        let (mut s, layout, _) = setup(false);
        let (a, mut a_rx) = request(layout, prompt(10, 1), SeqKv::new(layout), 100);
        s.admit(a);
        let r = s.step();
        assert_eq!(
            r,
            StepReport {
                prefill_tokens: 10,
                decoded: 1
            }
        );
        let (b, mut b_rx) = request(layout, prompt(300, 2), SeqKv::new(layout), 4);
        s.admit(b);
        // 300 tokens = 4 pieces of 64 + 44; A decodes in every one of those steps.
        for want in [64, 64, 64, 64, 44] {
            let r = s.step();
            assert_eq!(r.prefill_tokens, want);
            assert!(r.decoded >= 1, "{r:?}");
        }
        assert!(matches!(
            b_rx.try_recv(),
            Ok(Event::Prefilled { computed: 300, .. })
        ));
        assert_eq!(tokens(&mut a_rx).len(), 2 + 5);
    }

    #[test]
    fn a_short_prompt_behind_a_long_one_takes_turns_with_it_and_both_give_the_same_tokens() {
        let long = prompt(640, 5);
        let short = prompt(30, 6);
        let alone = |p: &Vec<u32>| {
            let (mut s, layout, _) = setup(false);
            let (r, mut rx) = request(layout, p.clone(), SeqKv::new(layout), 6);
            s.admit(r);
            run_to_end(&mut s);
            tokens(&mut rx)
        };
        let (long_alone, short_alone) = (alone(&long), alone(&short));

        let (mut s, layout, _) = setup(false);
        let (a, mut a_rx) = request(layout, long, SeqKv::new(layout), 6);
        let (b, mut b_rx) = request(layout, short, SeqKv::new(layout), 6);
        s.admit(a);
        assert_eq!(s.step().prefill_tokens, 64);
        s.admit(b);
        // The short prompt's one piece is next, not after the long one's nine.
        assert_eq!(s.step().prefill_tokens, 30);
        assert!(matches!(
            b_rx.try_recv(),
            Ok(Event::Prefilled { computed: 30, .. })
        ));
        assert_eq!(s.step().prefill_tokens, 64);
        run_to_end(&mut s);
        assert_eq!(tokens(&mut a_rx), long_alone);
        assert_eq!(tokens(&mut b_rx), short_alone);
    }

    #[test]
    fn a_sequence_whose_caller_went_away_gets_no_more_work_and_is_counted() {
        let (mut s, layout, _) = setup(false);
        let (a, a_rx) = request(layout, prompt(640, 7), SeqKv::new(layout), 6);
        let (b, _b_rx) = request(layout, prompt(100, 8), SeqKv::new(layout), 100);
        s.admit(a);
        s.admit(b);
        assert_eq!(s.step().prefill_tokens, 64);
        drop(a_rx);
        // B's pieces only (36 left after its first 64), A is gone.
        assert_eq!(s.step().prefill_tokens, 64);
        assert_eq!(s.step().prefill_tokens, 36);
        assert_eq!(s.running(), 1);
        assert_eq!(s.metrics.cancelled.get(), 1);
    }

    #[test]
    fn a_loaded_prefix_gives_the_same_tokens_and_a_wrong_one_does_not() {
        let (mut s, layout, store_rx) = setup(true);
        let p = prompt(200, 3);
        let (a, mut a_rx) = request(layout, p.clone(), SeqKv::new(layout), 24);
        s.admit(a);
        run_to_end(&mut s);
        let scratch = tokens(&mut a_rx);
        assert_eq!(scratch.len(), 24);
        let job = store_rx
            .unwrap()
            .try_recv()
            .expect("three full chunks queued for the pool");
        assert_eq!(job.items.len(), 3);
        let blocks: Vec<Arc<[f32]>> = job.items.iter().map(|i| i.segment.clone()).collect();
        let hashes = chunk_hashes(&p, CHUNK).unwrap();
        for (i, b) in blocks.iter().enumerate() {
            crate::kv::verify(&layout, hashes[i], 0, b, layout.segment_bytes(0)).unwrap();
        }

        let (b, mut b_rx) = request(
            layout,
            p.clone(),
            SeqKv::with_loaded(layout, blocks.clone()),
            24,
        );
        s.admit(b);
        run_to_end(&mut s);
        assert!(b_rx
            .try_recv()
            .is_ok_and(|e| matches!(e, Event::Prefilled { computed: 8, .. })));
        assert_eq!(tokens(&mut b_rx), scratch, "tokens after a loaded prefix");

        let (d, mut d_rx) = request(
            layout,
            p,
            SeqKv::with_loaded(layout, blocks[..1].to_vec()),
            24,
        );
        s.admit(d);
        run_to_end(&mut s);
        assert_eq!(tokens(&mut d_rx), scratch, "one loaded chunk, two computed");

        // KV of the same shape but of another prompt changes the output, so
        // the loaded KV really is what the generation reads.
        let other = prompt(200, 4);
        let other_blocks: Vec<Arc<[f32]>> = {
            let (mut s2, _, rx2) = setup(true);
            let (e, _e_rx) = request(layout, other, SeqKv::new(layout), 1);
            s2.admit(e);
            run_to_end(&mut s2);
            rx2.unwrap()
                .try_recv()
                .unwrap()
                .items
                .into_iter()
                .map(|i| i.segment)
                .collect()
        };
        let (f, mut f_rx) = request(
            layout,
            prompt(200, 3),
            SeqKv::with_loaded(layout, other_blocks),
            24,
        );
        s.admit(f);
        run_to_end(&mut s);
        assert_ne!(
            tokens(&mut f_rx),
            scratch,
            "a wrong prefix must change the output"
        );
    }

    /// Runs `p` alone; returns its tokens and every store job it queued.
    fn run_alone(
        group_layers: usize,
        stream: bool,
        p: &[u32],
        kv: impl FnOnce(KvLayout) -> (SeqKv, Option<PendingLoad>),
    ) -> (Vec<u32>, Vec<StoreJob>) {
        let (mut s, layout, store_rx) = setup_with(true, group_layers, stream);
        let (kv, pending) = kv(layout);
        let (mut r, mut rx) = request(layout, p.to_vec(), kv, 12);
        r.pending = pending;
        s.admit(r);
        run_to_end(&mut s);
        let jobs = store_rx.unwrap().try_iter().collect();
        (tokens(&mut rx), jobs)
    }

    /// The segments of every chunk, chunk after chunk, from store jobs.
    fn segments(layout: KvLayout, jobs: &[StoreJob]) -> Vec<Vec<Arc<[f32]>>> {
        let mut by_chunk: Vec<Vec<Option<Arc<[f32]>>>> = Vec::new();
        for i in jobs.iter().flat_map(|j| &j.items) {
            while by_chunk.len() <= i.chunk {
                by_chunk.push(vec![None; layout.groups()]);
            }
            by_chunk[i.chunk][i.group] = Some(i.segment.clone());
        }
        by_chunk
            .into_iter()
            .map(|c| {
                c.into_iter()
                    .map(|s| s.expect("every group stored"))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn streamed_groups_are_stored_as_they_finish_and_load_back_to_the_same_tokens() {
        let p = prompt(200, 3);
        let hashes = chunk_hashes(&p, CHUNK).unwrap();
        let (whole, _) = run_alone(4, false, &p, |l| (SeqKv::new(l), None));
        // One layer per group: each of the three full chunks' four groups is
        // its own job, queued by the piece that computed the chunk.
        let (streamed, jobs) = run_alone(1, true, &p, |l| (SeqKv::new(l), None));
        assert_eq!(streamed, whole, "storing layer by layer changes nothing");
        assert_eq!(jobs.len(), 12);
        assert!(jobs.iter().all(|j| j.items.len() == 1 && j.done.is_none()));
        let (_, layout, _) = setup_with(false, 1, true);
        let chunks = segments(layout, &jobs);
        for (c, segs) in chunks.iter().enumerate() {
            for (g, seg) in segs.iter().enumerate() {
                crate::kv::verify(&layout, hashes[c], g, seg, layout.segment_bytes(g)).unwrap();
            }
        }
        let all: Vec<Arc<[f32]>> = chunks.iter().flatten().cloned().collect();

        // Loaded whole by an engine that does not stream.
        let (loaded, _) = run_alone(1, false, &p, |l| (SeqKv::with_loaded(l, all.clone()), None));
        assert_eq!(loaded, whole, "streamed chunks loaded whole");

        // Loaded group by group while the piece runs: group g for its first n chunks.
        let groups = |sent: &[(usize, usize)]| {
            let (tx, rx) = flume::bounded(4);
            for &(g, n) in sent {
                let segs = chunks.iter().take(n).map(|c| c[g].clone()).collect();
                tx.send(StreamedGroup {
                    group: g,
                    segs,
                    refused: 0,
                })
                .unwrap();
            }
            PendingLoad {
                groups: rx,
                deadline: Instant::now() + Duration::from_secs(5),
            }
        };
        let every = [(0, 3), (1, 3), (2, 3), (3, 3)];
        let (got, _) = run_alone(1, true, &p, |l| {
            (SeqKv::with_pending(l, 3), Some(groups(&every)))
        });
        assert_eq!(got, whole, "streamed load");

        // Group 2 arrives for one chunk only: the two others are computed.
        let short = groups(&[(0, 3), (1, 3), (2, 1), (3, 1)]);
        let (got, jobs) = run_alone(1, true, &p, |l| (SeqKv::with_pending(l, 3), Some(short)));
        assert_eq!(got, whole, "a short streamed group is recomputed");
        // Chunks 1 and 2 computed, each group stored once.
        assert_eq!(jobs.len(), 8);

        // Nothing arrives (the loader gave up): everything is computed.
        let (got, _) = run_alone(1, true, &p, |l| {
            (SeqKv::with_pending(l, 3), Some(groups(&[])))
        });
        assert_eq!(got, whole, "a streamed load that never came");
    }
}
