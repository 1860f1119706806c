//! Writes of one key from one RESP thread go one at a time.
//!
//! The master lets two writers replace a key at once (the second waits for
//! the first), but takes a second put of a key from the writer already
//! putting it for a bug. The connections of a RESP thread share its pool
//! client, hence one writer id: two of them setting one key at once
//! (`redis-benchmark -c 16` does) must take turns here. Single-threaded
//! (`Rc`, `RefCell`): it belongs to one RESP thread.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use tokio::sync::Notify;

#[derive(Default)]
pub(crate) struct KeyLocks {
    held: RefCell<HashMap<Vec<u8>, Rc<Notify>>>,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_of_a_key_waits_for_the_first() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
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
}
