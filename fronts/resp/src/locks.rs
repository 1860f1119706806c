//! Writes of one key from one RESP thread go one at a time.
//!
//! The master lets two writers replace a key at once (the second waits for
//! the first), but takes a second put of a key from the writer already
//! putting it for a bug. The connections of a RESP thread share its pool
//! client, hence one writer id: two of them setting one key at once
//! (`redis-benchmark -c 16` does) must take turns here. Single-threaded
//! (`Rc`, `RefCell`): it belongs to one RESP thread.
//!
//! SETs of one key from several connections combine ([`KeyLocks::set_one`]):
//! while the key is being written, the SETs that arrive join one pending
//! write, each replacing its value; when the key is free the first of them
//! writes the last value, and every one answers with that write's result.
//! Linearizable as a pipeline's repeated SETs are: each joined SET is
//! answered after the value that replaced it is in place.
//!
//! INCRs of one key combine the same way ([`KeyLocks::add_one`]): those
//! that arrive while one waits for the key join it, and its one read and
//! one write apply them all in the order they came; each answers with the
//! count after its own increment.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use tokio::sync::Notify;

#[derive(Default)]
pub(crate) struct KeyLocks {
    held: RefCell<HashMap<Vec<u8>, Rc<Notify>>>,
    /// Per key, the write that waits for it, which new SETs join.
    pending: RefCell<HashMap<Vec<u8>, Rc<Pending>>>,
    /// Per key, the increment that waits for it, which new INCRs join.
    adding: RefCell<HashMap<Vec<u8>, Rc<PendingAdd>>>,
}

/// One read-add-write of a key that INCRs joined while it waited.
struct PendingAdd {
    /// The increments, in the order they came (the leader's first).
    deltas: RefCell<Vec<i64>>,
    /// Per increment, the count after it (or why it failed), once the
    /// write ended.
    results: RefCell<Option<Vec<Result<i64, String>>>>,
    done: Notify,
}

impl PendingAdd {
    fn finish(&self, r: Vec<Result<i64, String>>) {
        let mut slot = self.results.borrow_mut();
        if slot.is_none() {
            *slot = Some(r);
            self.done.notify_waiters();
        }
    }
}

/// Ends a pending increment whose leader gave up (a deadline, or its
/// connection went away): the INCRs that joined it hear of it.
struct AddLeading<'a> {
    locks: &'a KeyLocks,
    key: &'a [u8],
    pending: Rc<PendingAdd>,
}

impl Drop for AddLeading<'_> {
    fn drop(&mut self) {
        let mut map = self.locks.adding.borrow_mut();
        if map
            .get(self.key)
            .is_some_and(|p| Rc::ptr_eq(p, &self.pending))
        {
            map.remove(self.key);
        }
        let n = self.pending.deltas.borrow().len();
        self.pending.finish(vec![
            Err(
                "ERR the INCR that was to write this key gave up".into()
            );
            n
        ]);
    }
}

/// One write of a key that SETs joined while the key was being written.
struct Pending {
    /// The last value a joined SET gave (a copy: that SET may give up
    /// before the write); none while only the writer's own is there.
    value: RefCell<Option<Vec<u8>>>,
    /// The write's result, once it ended.
    result: RefCell<Option<Result<(), String>>>,
    done: Notify,
}

impl Pending {
    fn finish(&self, r: Result<(), String>) {
        let mut slot = self.result.borrow_mut();
        if slot.is_none() {
            *slot = Some(r);
            self.done.notify_waiters();
        }
    }
}

/// Ends a pending write that its writer gave up on (a deadline, or its
/// connection went away): the SETs that joined it hear of it, and new ones
/// start a write of their own.
struct Leading<'a> {
    locks: &'a KeyLocks,
    key: &'a [u8],
    pending: Rc<Pending>,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        let mut map = self.locks.pending.borrow_mut();
        if map
            .get(self.key)
            .is_some_and(|p| Rc::ptr_eq(p, &self.pending))
        {
            map.remove(self.key);
        }
        self.pending
            .finish(Err("ERR the SET that was to write this key gave up".into()));
    }
}

/// Holds keys; lets them go when dropped.
pub(crate) struct KeysHeld<'a> {
    locks: &'a KeyLocks,
    keys: Vec<Vec<u8>>,
}

impl Drop for KeysHeld<'_> {
    fn drop(&mut self) {
        let mut held = self.locks.held.borrow_mut();
        for k in &self.keys {
            if let Some(n) = held.remove(k) {
                n.notify_waiters();
            }
        }
    }
}

impl KeyLocks {
    /// Takes every key of `keys` (distinct), in sorted order so that two
    /// writers of overlapping keys cannot wait for each other; waits at
    /// most `within` in all.
    pub(crate) async fn lock<'a>(
        &'a self,
        keys: &[&[u8]],
        within: Duration,
    ) -> Result<KeysHeld<'a>, ()> {
        let mut sorted: Vec<&[u8]> = keys.to_vec();
        sorted.sort_unstable();
        let mut guard = KeysHeld {
            locks: self,
            keys: Vec::with_capacity(sorted.len()),
        };
        let deadline = tokio::time::Instant::now() + within;
        for k in sorted {
            loop {
                let waiting = {
                    let mut held = self.held.borrow_mut();
                    match held.get(k) {
                        None => {
                            held.insert(k.to_vec(), Rc::new(Notify::new()));
                            None
                        }
                        // A `Notified` is woken by `notify_waiters` from the
                        // moment it is made, polled or not.
                        Some(n) => Some(n.clone()),
                    }
                };
                let Some(n) = waiting else {
                    guard.keys.push(k.to_vec());
                    break;
                };
                let woken = n.notified();
                if tokio::time::timeout_at(deadline, woken).await.is_err() {
                    return Err(());
                }
            }
        }
        Ok(guard)
    }

    /// A SET of one key: joins the write that waits for the key, if one
    /// does (its value is then the one written), else waits for the key
    /// itself and writes the last value given by then with `write`: `None`
    /// for its own `value` (not copied), else the copy a joined SET left.
    /// Every joined SET answers with that write's result; at most `within`.
    /// `busy` is the error when the key stays held past it. The write takes
    /// `stripe` (the front's lock of the key across RESP threads, as INCR's)
    /// before the key: another thread's write of the key waits for it here,
    /// woken when it ends, rather than meeting it at the master and asking
    /// again every few milliseconds.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn set_one<F, Fut>(
        &self,
        key: &[u8],
        value: &[u8],
        stripe: &tokio::sync::Mutex<()>,
        within: Duration,
        busy: &str,
        write: F,
    ) -> Result<(), String>
    where
        F: FnOnce(Option<Vec<u8>>) -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        let deadline = tokio::time::Instant::now() + within;
        let joined = self.pending.borrow().get(key).cloned();
        if let Some(p) = joined {
            {
                let mut last = p.value.borrow_mut();
                match last.as_mut() {
                    Some(v) => value.clone_into(v),
                    None => *last = Some(value.to_vec()),
                }
            }
            loop {
                let woken = p.done.notified();
                if let Some(r) = p.result.borrow().clone() {
                    return r;
                }
                if tokio::time::timeout_at(deadline, woken).await.is_err() {
                    return Err(busy.into());
                }
            }
        }
        let pending = Rc::new(Pending {
            value: RefCell::new(None),
            result: RefCell::new(None),
            done: Notify::new(),
        });
        self.pending
            .borrow_mut()
            .insert(key.to_vec(), pending.clone());
        let leading = Leading {
            locks: self,
            key,
            pending,
        };
        let Ok(_turn) = tokio::time::timeout_at(deadline, stripe.lock()).await else {
            return Err(busy.into());
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Ok(_held) = self.lock(&[key], left).await else {
            return Err(busy.into());
        };
        // The key is this write's: SETs arriving from now on wait for it
        // in a pending write of their own.
        self.pending.borrow_mut().remove(key);
        let joined = leading.pending.value.borrow_mut().take();
        let r = write(joined).await;
        leading.pending.finish(r.clone());
        r
    }
}

impl KeyLocks {
    /// An INCR of one key by `delta`: joins the increment that waits for
    /// the key, if one does, else leads one: takes `stripe` (the front's
    /// lock of the key across RESP threads), then the key, then runs
    /// `apply` once with every increment joined by then, in order; `apply`
    /// answers the count after each (or why that one failed). Answers this
    /// INCR's count; at most `within`, else `busy`.
    pub(crate) async fn add_one<F, Fut>(
        &self,
        key: &[u8],
        delta: i64,
        stripe: &tokio::sync::Mutex<()>,
        within: Duration,
        busy: &str,
        apply: F,
    ) -> Result<i64, String>
    where
        F: FnOnce(Vec<i64>) -> Fut,
        Fut: std::future::Future<Output = Vec<Result<i64, String>>>,
    {
        let deadline = tokio::time::Instant::now() + within;
        let joined = self.adding.borrow().get(key).cloned();
        if let Some(p) = joined {
            let at = {
                let mut d = p.deltas.borrow_mut();
                d.push(delta);
                d.len() - 1
            };
            loop {
                let woken = p.done.notified();
                if let Some(r) = p.results.borrow().as_ref() {
                    return r.get(at).cloned().unwrap_or_else(|| Err(busy.into()));
                }
                if tokio::time::timeout_at(deadline, woken).await.is_err() {
                    return Err(busy.into());
                }
            }
        }
        let pending = Rc::new(PendingAdd {
            deltas: RefCell::new(vec![delta]),
            results: RefCell::new(None),
            done: Notify::new(),
        });
        self.adding
            .borrow_mut()
            .insert(key.to_vec(), pending.clone());
        let leading = AddLeading {
            locks: self,
            key,
            pending,
        };
        let Ok(_turn) = tokio::time::timeout_at(deadline, stripe.lock()).await else {
            return Err(busy.into());
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Ok(_held) = self.lock(&[key], left).await else {
            return Err(busy.into());
        };
        // The key is this increment's: INCRs arriving from now on wait in
        // one of their own.
        self.adding.borrow_mut().remove(key);
        let deltas = leading.pending.deltas.borrow().clone();
        let results = apply(deltas).await;
        let mine = results.first().cloned().unwrap_or_else(|| Err(busy.into()));
        leading.pending.finish(results);
        mine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a one-thread runtime where `spawn_local` works.
    fn on_one_thread(f: impl std::future::Future<Output = ()>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&rt, f);
    }

    #[test]
    fn a_second_writer_of_a_key_waits_for_the_first() {
        on_one_thread(async {
            let locks = Rc::new(KeyLocks::default());
            let order = Rc::new(RefCell::new(Vec::new()));
            let first = locks
                .lock(&[b"k", b"a"], Duration::from_secs(5))
                .await
                .unwrap();
            let (l2, o2) = (locks.clone(), order.clone());
            let second = tokio::task::spawn_local(async move {
                let _g = l2
                    .lock(&[b"a", b"k"], Duration::from_secs(5))
                    .await
                    .unwrap();
                o2.borrow_mut().push("second");
            });
            // Another key is free meanwhile.
            let other = locks.lock(&[b"z"], Duration::from_millis(10)).await;
            assert!(other.is_ok());
            drop(other);
            tokio::task::yield_now().await;
            order.borrow_mut().push("first");
            drop(first);
            second.await.unwrap();
            assert_eq!(*order.borrow(), vec!["first", "second"]);
            // A key held past the wait is an error, not a hang.
            let _g = locks.lock(&[b"k"], Duration::from_secs(1)).await.unwrap();
            assert!(locks
                .lock(&[b"k"], Duration::from_millis(20))
                .await
                .is_err());
        });
    }

    /// SETs of a key that is being written join one write, of the last
    /// value; each answers with its result. The next SET writes its own.
    #[test]
    fn sets_of_a_key_being_written_combine_into_one_write_of_the_last_value() {
        on_one_thread(async {
            let locks = Rc::new(KeyLocks::default());
            let stripe = Rc::new(tokio::sync::Mutex::new(()));
            let writes = Rc::new(RefCell::new(Vec::new()));
            let within = Duration::from_secs(5);
            let set = |v: &'static [u8], fail: bool| {
                let (l, w, s) = (locks.clone(), writes.clone(), stripe.clone());
                tokio::task::spawn_local(async move {
                    l.set_one(b"k", v, &s, within, "busy", |joined| async move {
                        w.borrow_mut().push(joined.unwrap_or_else(|| v.to_vec()));
                        if fail {
                            Err("ERR refused".to_string())
                        } else {
                            Ok(())
                        }
                    })
                    .await
                })
            };
            let held = locks.lock(&[b"k"], within).await.unwrap();
            let sets: Vec<_> = [&b"1"[..], b"2", b"3"]
                .into_iter()
                .map(|v| set(v, false))
                .collect();
            tokio::task::yield_now().await;
            drop(held);
            for s in sets {
                assert_eq!(s.await.unwrap(), Ok(()));
            }
            assert_eq!(
                *writes.borrow(),
                vec![b"3".to_vec()],
                "one write, the last value"
            );
            // A write's error reaches every SET that joined it.
            let held = locks.lock(&[b"k"], within).await.unwrap();
            let (a, b) = (set(b"4", true), set(b"5", true));
            tokio::task::yield_now().await;
            drop(held);
            assert_eq!(a.await.unwrap(), Err("ERR refused".to_string()));
            assert_eq!(b.await.unwrap(), Err("ERR refused".to_string()));
            assert_eq!(writes.borrow().last().unwrap(), b"5");
            // Nothing waits: a SET writes its own value at once.
            assert_eq!(set(b"6", false).await.unwrap(), Ok(()));
            assert_eq!(writes.borrow().len(), 3);
            assert!(locks.pending.borrow().is_empty());
        });
    }

    /// INCRs of a key that waits join one read-add-write; each answers the
    /// count after its own increment, in the order they came.
    #[test]
    fn incrs_of_a_waiting_key_combine_and_answer_their_own_counts() {
        on_one_thread(async {
            let locks = Rc::new(KeyLocks::default());
            let stripe = Rc::new(tokio::sync::Mutex::new(()));
            let stored = Rc::new(RefCell::new(10i64));
            let applies = Rc::new(RefCell::new(0));
            let within = Duration::from_secs(5);
            let incr = |d: i64| {
                let (l, s, v, n) = (
                    locks.clone(),
                    stripe.clone(),
                    stored.clone(),
                    applies.clone(),
                );
                tokio::task::spawn_local(async move {
                    l.add_one(b"k", d, &s, within, "busy", |deltas| async move {
                        *n.borrow_mut() += 1;
                        let mut at = *v.borrow();
                        let out = deltas
                            .into_iter()
                            .map(|d| match at.checked_add(d) {
                                Some(x) => {
                                    at = x;
                                    Ok(x)
                                }
                                None => Err("ERR overflow".to_string()),
                            })
                            .collect();
                        *v.borrow_mut() = at;
                        out
                    })
                    .await
                })
            };
            let held = locks.lock(&[b"k"], within).await.unwrap();
            let runs: Vec<_> = [1, 5, i64::MAX, -2].into_iter().map(incr).collect();
            tokio::task::yield_now().await;
            drop(held);
            let mut got = Vec::new();
            for r in runs {
                got.push(r.await.unwrap());
            }
            assert_eq!(
                got,
                vec![Ok(11), Ok(16), Err("ERR overflow".to_string()), Ok(14)]
            );
            assert_eq!((*stored.borrow(), *applies.borrow()), (14, 1));
            // Nothing waits: an INCR applies its own at once.
            assert_eq!(incr(1).await.unwrap(), Ok(15));
            assert!(locks.adding.borrow().is_empty());
        });
    }
}
