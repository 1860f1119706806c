//! Batches in groups sent as parallel calls: from and into CUDA device
//! memory through pinned host staging buffers, the device copies of one
//! group of keys overlapped with the transfers of another; and large host
//! batches straight from and into the caller's memory ([`put_host`],
//! [`get_host`]).
//!
//! ```text
//!  put:  stream  |copy g0|copy g1|copy g2|          (all queued at once)
//!        network         |put g0 |put g1 |put g2|   (each when its copy is done)
//!  get:  network |get g0|get g1|get g2|             (all started at once)
//!        stream         |copy g0|copy g1|copy g2|   (each as its get completes)
//! ```
//!
//! A call's keys go in rounds of at most [`STAGING_CAP`] bytes (a key larger
//! than that is a round of its own), each round in groups of about
//! [`GROUP_BYTES`]. The bytes sent are the bytes staged: the device memory
//! is read once, by the DMA engine, into memory only this call uses, and
//! the checksum is computed over what is sent.

use kvpool_client::Client;
use kvpool_wire::proto::PutOptions;
use kvpool_wire::{ErrorCode, KvError};

use crate::cuda::{Device, Pinned, Session, StagingPool};
use crate::{memory, runtime};

/// Pinned staging memory a store keeps between calls, and the most one
/// round of a call stages.
pub const STAGING_CAP: usize = 256 << 20;
/// About this many bytes of keys go to the network as one batch: small
/// enough that the first batch leaves early, large enough that a batch of
/// small keys is one request.
const GROUP_BYTES: usize = 8 << 20;
/// And at most this many keys (a batch call's bound at the master is 1024).
const GROUP_KEYS: usize = 512;

/// One key's memory, in order.
pub type Parts = Vec<(usize, usize)>;

fn size(p: &Parts) -> usize {
    p.iter().map(|r| r.1).sum()
}

/// Consecutive runs of `sizes`' indices, each of total at most `cap`
/// (a single larger one alone).
fn runs(sizes: &[usize], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut total) = (0, 0usize);
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && total + s > cap {
            out.push(start..i);
            (start, total) = (i, 0);
        }
        total += s;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// The groups of a round: runs of about [`GROUP_BYTES`], at most
/// [`GROUP_KEYS`] keys each.
fn group_ranges(sizes: &[usize]) -> Vec<std::ops::Range<usize>> {
    runs(sizes, GROUP_BYTES)
        .into_iter()
        .flat_map(|r| {
            (r.start..r.end)
                .step_by(GROUP_KEYS)
                .map(move |s| s..(s + GROUP_KEYS).min(r.end))
        })
        .collect()
}

/// One group of keys: (key, staging address, length) each.
type Items = Vec<(Vec<u8>, usize, usize)>;

/// Stores each key's parts (device or host memory) as one object; per key
/// the put's result.
pub fn put(
    client: &Client,
    pool: &StagingPool,
    dev: Device,
    keys: &[Vec<u8>],
    parts: &[Parts],
    opts: &PutOptions,
) -> Vec<Result<(), KvError>> {
    let sizes: Vec<usize> = parts.iter().map(size).collect();
    let mut out: Vec<Result<(), KvError>> = Vec::with_capacity(keys.len());
    let session = match Session::open(dev) {
        Ok(s) => s,
        Err(e) => return keys.iter().map(|_| Err(e.clone())).collect(),
    };
    for round in runs(&sizes, STAGING_CAP) {
        let n = round.len();
        match put_round(
            client,
            pool,
            &session,
            &keys[round.clone()],
            &parts[round],
            opts,
        ) {
            Ok(r) => out.extend(r),
            Err(e) => out.extend(std::iter::repeat_n(Err(e), n)),
        }
    }
    out
}

fn put_round(
    client: &Client,
    pool: &StagingPool,
    session: &Session,
    keys: &[Vec<u8>],
    parts: &[Parts],
    opts: &PutOptions,
) -> Result<Vec<Result<(), KvError>>, KvError> {
    let sizes: Vec<usize> = parts.iter().map(size).collect();
    let buf = pool.take(sizes.iter().sum())?;
    let r = put_staged(client, session, &buf, keys, parts, &sizes, opts);
    // Every put from `buf` has ended (put_staged joins all of its tasks)
    // and, once the stream is idle, no copy writes it: it can serve again.
    if session.synchronize().is_ok() {
        pool.give(buf);
    } else {
        std::mem::forget(buf); // a copy may still land in it: never reuse
    }
    r
}

fn put_staged(
    client: &Client,
    session: &Session,
    buf: &Pinned,
    keys: &[Vec<u8>],
    parts: &[Parts],
    sizes: &[usize],
    opts: &PutOptions,
) -> Result<Vec<Result<(), KvError>>, KvError> {
    let t0 = std::time::Instant::now();
    // Queue every copy, an event after each group.
    let mut groups: Vec<(std::ops::Range<usize>, Items)> = Vec::new();
    let mut events = Vec::new();
    let mut off = 0usize;
    for g in group_ranges(sizes) {
        let mut items = Items::new();
        for i in g.clone() {
            let at = buf.addr() + off;
            let mut o = at;
            for &(a, l) in &parts[i] {
                // SAFETY: `a..a + l` is registered memory the caller keeps
                // valid and unwritten during the call (Mooncake's contract
                // for put_from); `o..o + l` lies in `buf` (sized for the
                // round), which only this call uses until the stream is
                // synchronised (the events below, or the session's drop).
                unsafe { session.copy(o, a, l) }?;
                o += l;
            }
            items.push((keys[i].clone(), at, sizes[i]));
            off += sizes[i];
        }
        events.push(session.mark()?);
        groups.push((g, items));
    }
    let n = keys.len();
    runtime::block_on(async {
        let mut failed: Vec<(std::ops::Range<usize>, KvError)> = Vec::new();
        let mut tasks = Vec::with_capacity(groups.len());
        tracing::debug!("put: {n} keys, copies queued at {:?}", t0.elapsed());
        for ((range, items), ev) in groups.into_iter().zip(&events) {
            // The copies of the later groups go on while this one is sent.
            if let Err(e) = ev.wait() {
                failed.push((range, e));
                continue;
            }
            tracing::debug!("put: group {range:?} copied at {:?}", t0.elapsed());
            // SAFETY: the items lie in the staging buffer, whose copy
            // finished (the event), and which stays allocated and unwritten
            // until every task is joined below.
            tasks.push((range, unsafe { spawn_put(client, items, opts) }));
        }
        let mut out = join(n, tasks, "put").await;
        tracing::debug!("put: every group sent at {:?}", t0.elapsed());
        for (range, e) in failed {
            for i in range {
                out[i] = Err(e.clone());
            }
        }
        out
    })
}

/// Reads each key's object into its parts (device or host memory); per key
/// the object's length or the error.
pub fn get(
    client: &Client,
    pool: &StagingPool,
    dev: Device,
    keys: &[Vec<u8>],
    parts: &[Parts],
) -> Vec<Result<usize, KvError>> {
    let sizes: Vec<usize> = parts.iter().map(size).collect();
    let mut out: Vec<Result<usize, KvError>> = Vec::with_capacity(keys.len());
    let session = match Session::open(dev) {
        Ok(s) => s,
        Err(e) => return keys.iter().map(|_| Err(e.clone())).collect(),
    };
    for round in runs(&sizes, STAGING_CAP) {
        let n = round.len();
        let r = pool
            .take(sizes[round.clone()].iter().sum())
            .and_then(|buf| {
                let r = get_staged(client, &session, &buf, &keys[round.clone()], &parts[round]);
                // Every get into `buf` has ended (all joined); once the stream
                // is idle no copy reads it: it can serve again.
                if session.synchronize().is_ok() {
                    pool.give(buf);
                } else {
                    std::mem::forget(buf); // a copy may still read it: never reuse
                }
                r
            });
        match r {
            Ok(r) => out.extend(r),
            Err(e) => out.extend(std::iter::repeat_n(Err(e), n)),
        }
    }
    out
}

fn get_staged(
    client: &Client,
    session: &Session,
    buf: &Pinned,
    keys: &[Vec<u8>],
    parts: &[Parts],
) -> Result<Vec<Result<usize, KvError>>, KvError> {
    let sizes: Vec<usize> = parts.iter().map(size).collect();
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut off = 0usize;
    for &s in &sizes {
        offsets.push(buf.addr() + off);
        off += s;
    }
    let n = keys.len();
    let mut out = runtime::block_on(async {
        let mut out: Vec<Result<usize, KvError>> = (0..n)
            .map(|_| Err(KvError::new(ErrorCode::Internal, "the get did not run")))
            .collect();
        let mut set = tokio::task::JoinSet::new();
        for g in group_ranges(&sizes) {
            let items: Items = g
                .clone()
                .map(|i| (keys[i].clone(), offsets[i], sizes[i]))
                .collect();
            let client = client.clone();
            set.spawn(async move {
                // SAFETY: each item is its own piece of the staging buffer
                // (disjoint offsets), which stays allocated, and untouched
                // by anyone else, until every task is joined below.
                (g, unsafe { get_items(&client, items) }.await)
            });
        }
        while let Some(j) = set.join_next().await {
            let Ok((g, r)) = j else {
                continue; // a task that failed leaves its keys' error
            };
            let rs: Vec<Result<usize, KvError>> = match r {
                Ok(rs) => rs,
                Err(e) => g.clone().map(|_| Err(e.clone())).collect(),
            };
            for (i, r) in g.zip(rs) {
                out[i] = r.and_then(|len| {
                    // The value is in the staging buffer: queue its copy
                    // out while the other groups' gets go on.
                    let mut from = offsets[i];
                    let mut left = len;
                    for &(a, l) in &parts[i] {
                        let take = l.min(left);
                        // SAFETY: `a..a + take` is registered memory the
                        // caller keeps valid and untouched during the call,
                        // disjoint from every other destination (checked by
                        // the caller); `from..from + take` is this key's
                        // staged value, which nothing writes any more.
                        unsafe { session.copy(a, from, take) }?;
                        from += take;
                        left -= take;
                    }
                    Ok(len)
                });
            }
        }
        out
    })?;
    // A value is the caller's once its copy has landed: a failed wait
    // fails every key that was read.
    if let Err(e) = session.synchronize() {
        for r in out.iter_mut().filter(|r| r.is_ok()) {
            *r = Err(e.clone());
        }
    }
    Ok(out)
}

/// `batch_put` of a group's items on a worker of the runtime.
///
/// # Safety
/// Every item's range is readable memory nobody writes until the task has
/// been awaited.
unsafe fn spawn_put(
    client: &Client,
    items: Items,
    opts: &PutOptions,
) -> tokio::task::JoinHandle<Result<Vec<Result<(), KvError>>, KvError>> {
    let (client, opts) = (client.clone(), opts.clone());
    tokio::spawn(async move {
        let pairs: Vec<(&[u8], &[u8])> = items
            .iter()
            // SAFETY: this function's contract.
            .map(|(k, a, l)| (k.as_slice(), unsafe { memory::slice(*a, *l) }))
            .collect();
        client.batch_put(&pairs, &opts).await
    })
}

/// `batch_get_into` of a group's items.
///
/// # Safety
/// The items' ranges are disjoint, writable memory nobody else touches
/// until the returned future has completed or been dropped.
async unsafe fn get_items(
    client: &Client,
    items: Items,
) -> Result<Vec<Result<usize, KvError>>, KvError> {
    let mut dsts: Vec<(&[u8], &mut [u8])> = items
        .iter()
        // SAFETY: this function's contract.
        .map(|(k, a, l)| (k.as_slice(), unsafe { memory::slice_mut(*a, *l) }))
        .collect();
    client.batch_get_into(&mut dsts).await
}

/// A group's call, spawned, with the keys (by index) it answers for.
type GroupTask<T> = (
    std::ops::Range<usize>,
    tokio::task::JoinHandle<Result<Vec<Result<T, KvError>>, KvError>>,
);

/// Every group's answers in key order, each task awaited (so none still
/// uses its memory when this returns); a key whose group failed as a whole
/// gets the group's error.
async fn join<T>(n: usize, tasks: Vec<GroupTask<T>>, what: &str) -> Vec<Result<T, KvError>> {
    let mut out: Vec<Result<T, KvError>> = (0..n)
        .map(|_| {
            Err(KvError::new(
                ErrorCode::Internal,
                format!("the {what} did not run"),
            ))
        })
        .collect();
    for (g, task) in tasks {
        let rs: Vec<Result<T, KvError>> = match task.await {
            Ok(Ok(rs)) => rs,
            Ok(Err(e)) => g.clone().map(|_| Err(e.clone())).collect(),
            Err(e) => {
                let e = KvError::new(ErrorCode::Internal, format!("{what} task: {e}"));
                g.clone().map(|_| Err(e.clone())).collect()
            }
        };
        for (i, r) in g.zip(rs) {
            out[i] = r;
        }
    }
    out
}

/// Host memory, a batch above [`GROUP_BYTES`]: the same groups, sent as
/// parallel calls straight from and into the caller's memory (no staging).
/// On the same host the transfers are copies into and out of the shared
/// segment, one per call at a time: parallel calls use the runtime's
/// workers (measured: docs/benchmarks/python.md, "GPU memory through the Python
/// package", the host rows).
pub fn worth_grouping(ranges: &[(usize, usize)]) -> bool {
    ranges.iter().map(|r| r.1).sum::<usize>() > GROUP_BYTES
}

/// Puts each key's one host range, `worth_grouping` batches in groups sent
/// at once; per key the put's result.
///
/// # Safety
/// Every range is mapped memory the caller keeps valid and unwritten until
/// the call returns.
pub unsafe fn put_host(
    client: &Client,
    keys: &[Vec<u8>],
    ranges: &[(usize, usize)],
    opts: &PutOptions,
) -> Result<Vec<Result<(), KvError>>, KvError> {
    runtime::block_on(async {
        let tasks = host_groups(keys, ranges)
            .into_iter()
            // SAFETY: this function's contract; every task is joined
            // before it returns.
            .map(|(g, items)| (g, unsafe { spawn_put(client, items, opts) }))
            .collect();
        join(keys.len(), tasks, "put").await
    })
}

/// Reads each key into its one host range, in groups read at once; per key
/// the value's length or the error.
///
/// # Safety
/// Every range is mapped memory the caller keeps valid and untouched until
/// the call returns, and no two ranges overlap.
pub unsafe fn get_host(
    client: &Client,
    keys: &[Vec<u8>],
    ranges: &[(usize, usize)],
) -> Result<Vec<Result<usize, KvError>>, KvError> {
    runtime::block_on(async {
        let tasks = host_groups(keys, ranges)
            .into_iter()
            .map(|(g, items)| {
                let client = client.clone();
                // SAFETY: this function's contract (disjoint ranges, the
                // caller's until every task is joined below).
                let task = tokio::spawn(async move { unsafe { get_items(&client, items) }.await });
                (g, task)
            })
            .collect();
        join(keys.len(), tasks, "get").await
    })
}

/// The groups of a batch of one host range per key, with their items.
fn host_groups(
    keys: &[Vec<u8>],
    ranges: &[(usize, usize)],
) -> Vec<(std::ops::Range<usize>, Items)> {
    let sizes: Vec<usize> = ranges.iter().map(|r| r.1).collect();
    group_ranges(&sizes)
        .into_iter()
        .map(|g| {
            let items = g
                .clone()
                .map(|i| (keys[i].clone(), ranges[i].0, ranges[i].1))
                .collect();
            (g, items)
        })
        .collect()
}
