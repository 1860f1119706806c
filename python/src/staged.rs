//! Puts from and gets into CUDA device memory: through pinned host staging
//! buffers, with the device copies of one group of keys overlapped with the
//! network transfers of another.
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
use kvpool_transport::proto::PutOptions;
use kvpool_transport::{ErrorCode, KvError};

use crate::cuda::{Device, Pinned, Session, StagingPool};
use crate::{memory, runtime};

/// Pinned staging memory a store keeps between calls, and the most one
/// round of a call stages.
pub const STAGING_CAP: usize = 256 << 20;
/// About this many bytes of keys go to the network as one batch: small
/// enough that the first batch leaves early, large enough that a batch of
/// small keys is one request.
const GROUP_BYTES: usize = 8 << 20;

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
    for g in runs(sizes, GROUP_BYTES) {
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
        let mut out: Vec<Result<(), KvError>> = (0..n)
            .map(|_| Err(KvError::new(ErrorCode::Internal, "the put did not run")))
            .collect();
        let mut tasks = Vec::with_capacity(groups.len());
        tracing::debug!("put: {n} keys, copies queued at {:?}", t0.elapsed());
        for ((range, items), ev) in groups.into_iter().zip(&events) {
            // The copies of the later groups go on while this one is sent.
            if let Err(e) = ev.wait() {
                for i in range {
                    out[i] = Err(e.clone());
                }
                continue;
            }
            tracing::debug!("put: group {range:?} copied at {:?}", t0.elapsed());
            let client = client.clone();
            let opts = opts.clone();
            let task = tokio::spawn(async move {
                let pairs: Vec<(&[u8], &[u8])> = items
                    .iter()
                    // SAFETY: `a..a + l` lies in the staging buffer, whose
                    // copy finished (the event), and which stays allocated
                    // and unwritten until every task is joined below.
                    .map(|(k, a, l)| (k.as_slice(), unsafe { memory::slice(*a, *l) }))
                    .collect();
                client.batch_put(&pairs, &opts).await
            });
            tasks.push((range, task));
        }
        for (range, task) in tasks {
            let r = task.await;
            tracing::debug!("put: group {range:?} sent at {:?}", t0.elapsed());
            match r {
                Ok(Ok(rs)) => {
                    for (i, r) in range.zip(rs) {
                        out[i] = r;
                    }
                }
                Ok(Err(e)) => {
                    for i in range {
                        out[i] = Err(e.clone());
                    }
                }
                Err(e) => {
                    let e = KvError::new(ErrorCode::Internal, format!("put task: {e}"));
                    for i in range {
                        out[i] = Err(e.clone());
                    }
                }
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
        for g in runs(&sizes, GROUP_BYTES) {
            let items: Items = g
                .clone()
                .map(|i| (keys[i].clone(), offsets[i], sizes[i]))
                .collect();
            let client = client.clone();
            set.spawn(async move {
                let mut dsts: Vec<(&[u8], &mut [u8])> = items
                    .iter()
                    // SAFETY: each `a..a + l` is its own piece of the
                    // staging buffer (disjoint offsets), which stays
                    // allocated, and untouched by anyone else, until every
                    // task is joined below.
                    .map(|(k, a, l)| (k.as_slice(), unsafe { memory::slice_mut(*a, *l) }))
                    .collect();
                (g, client.batch_get_into(&mut dsts).await)
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
