//! The front's open connections: one shared table, written when a
//! connection opens, closes, names itself or runs its first command (never
//! per command: a command only stores its time in an atomic). `CLIENT LIST`
//! and `CLIENT INFO` read it, and the acceptor decides from it who gets in.
//!
//! A connection is *pending* until it has run a command with the right to
//! (authenticated, where a password is set). Idle sockets are the cheap way
//! to lock a front: 10,050 of them answered every client "max number of
//! clients reached" for ten minutes (issue 29). So pending connections may
//! stay `io_timeout_ms` only, one peer address may hold at most
//! `max_pending_per_peer` of them, and at `max_clients` a new connection
//! takes the place of the oldest pending one. A connection that has run a
//! command is never closed to make room.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::Notify;

/// Has not run a command yet (with the right to).
const PENDING: u8 = 0;
/// Has run one: stays until it closes or goes idle.
const PROVEN: u8 = 1;
/// Closed (while pending) to make room for a new connection.
const EVICTED: u8 = 2;

/// What a connection names about itself (`CLIENT SETNAME`, `SETINFO`,
/// `HELLO ... SETNAME`).
#[derive(Default)]
pub(crate) struct Names {
    pub name: Option<Vec<u8>>,
    pub lib_name: Option<Vec<u8>>,
    pub lib_ver: Option<Vec<u8>>,
}

/// One open connection.
pub(crate) struct ClientMeta {
    pub id: u64,
    peer: Option<IpAddr>,
    state: AtomicU8,
    evict: Notify,
    addr: String,
    laddr: String,
    opened: Instant,
    /// Milliseconds after `opened` of its last command.
    last_ms: AtomicU64,
    /// Commands queued in its transaction, -1 outside one.
    multi: AtomicI64,
    resp3: AtomicBool,
    names: Mutex<Names>,
}

impl ClientMeta {
    pub(crate) fn new(id: u64, peer: Option<IpAddr>, addr: String, laddr: String) -> Self {
        Self {
            id,
            peer,
            state: AtomicU8::new(PENDING),
            evict: Notify::new(),
            addr,
            laddr,
            opened: Instant::now(),
            last_ms: AtomicU64::new(0),
            multi: AtomicI64::new(-1),
            resp3: AtomicBool::new(false),
            names: Mutex::new(Names::default()),
        }
    }

    /// Its names, to read or change.
    pub(crate) fn names(&self) -> MutexGuard<'_, Names> {
        // A panic ends the process (the binary's panic hook), so a poisoned
        // lock is never seen; take the data either way.
        self.names.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether it has run a command (with the right to).
    pub(crate) fn proven(&self) -> bool {
        self.state.load(Ordering::Relaxed) == PROVEN
    }

    /// Resolves once the acceptor closed it to make room.
    pub(crate) async fn evicted(&self) {
        while self.state.load(Ordering::Acquire) != EVICTED {
            self.evict.notified().await;
        }
    }

    /// A command ran now.
    pub(crate) fn touch(&self) {
        let ms = self.opened.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    pub(crate) fn set_multi(&self, queued: Option<usize>) {
        let n = queued.map_or(-1, |n| n as i64);
        self.multi.store(n, Ordering::Relaxed);
    }

    pub(crate) fn set_resp3(&self, on: bool) {
        self.resp3.store(on, Ordering::Relaxed);
    }

    /// Its line in `CLIENT LIST` (Redis's fields that mean something here),
    /// ending in a newline.
    pub(crate) fn line(&self) -> String {
        let age = self.opened.elapsed();
        let idle_ms = (age.as_millis() as u64).saturating_sub(self.last_ms.load(Ordering::Relaxed));
        let multi = self.multi.load(Ordering::Relaxed);
        let names = self.names();
        let text = |v: &Option<Vec<u8>>| {
            v.as_deref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        format!(
            "id={} addr={} laddr={} name={} age={} idle={} flags={} db=0 sub=0 psub=0 \
             multi={} user=default resp={} lib-name={} lib-ver={}\n",
            self.id,
            self.addr,
            self.laddr,
            text(&names.name),
            age.as_secs(),
            idle_ms / 1000,
            if multi >= 0 { "x" } else { "N" },
            multi,
            if self.resp3.load(Ordering::Relaxed) {
                3
            } else {
                2
            },
            text(&names.lib_name),
            text(&names.lib_ver),
        )
    }
}

#[derive(Default)]
struct Table {
    /// By id: the oldest first.
    open: BTreeMap<u64, Arc<ClientMeta>>,
    /// Pending connections per peer address.
    pending: HashMap<IpAddr, usize>,
}

impl Table {
    fn unpend(&mut self, peer: Option<IpAddr>) {
        if let Some(ip) = peer {
            if let Some(n) = self.pending.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.pending.remove(&ip);
                }
            }
        }
    }
}

/// Every open connection of the front.
#[derive(Default)]
pub(crate) struct Clients {
    table: Mutex<Table>,
}

/// Why a new connection is turned away: the line it is sent.
pub(crate) const MAX_CLIENTS_REACHED: &[u8] = b"-ERR max number of clients reached\r\n";
pub(crate) const TOO_MANY_PENDING: &[u8] = b"-ERR too many connections from this address that \
    have not run a command yet (resp.max_pending_per_peer)\r\n";

impl Clients {
    fn table(&self) -> MutexGuard<'_, Table> {
        // As in `ClientMeta::names`.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets `meta` in, or says why not: past `max_pending_per_peer` pending
    /// connections of its peer (0: no limit), or at `max_clients` with no
    /// pending connection to close in its place (the oldest one is closed).
    /// Listed until the returned guard is dropped.
    pub(crate) fn admit(
        self: &Arc<Self>,
        meta: Arc<ClientMeta>,
        open: usize,
        max_clients: usize,
        max_pending_per_peer: usize,
    ) -> Result<Registered, &'static [u8]> {
        let mut t = self.table();
        if let Some(ip) = meta.peer {
            let n = t.pending.get(&ip).copied().unwrap_or(0);
            if max_pending_per_peer > 0 && n >= max_pending_per_peer {
                return Err(TOO_MANY_PENDING);
            }
        }
        if open >= max_clients {
            let oldest = t.open.values().find(|m| {
                m.state
                    .compare_exchange(PENDING, EVICTED, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            });
            match oldest {
                Some(m) => m.evict.notify_one(),
                None => return Err(MAX_CLIENTS_REACHED),
            }
        }
        if let Some(ip) = meta.peer {
            *t.pending.entry(ip).or_insert(0) += 1;
        }
        t.open.insert(meta.id, meta.clone());
        Ok(Registered {
            clients: self.clone(),
            meta,
        })
    }

    /// `meta` ran a command with the right to: it is no longer pending.
    /// `false` if it was closed to make room meanwhile.
    pub(crate) fn prove(&self, meta: &ClientMeta) -> bool {
        match meta
            .state
            .compare_exchange(PENDING, PROVEN, Ordering::AcqRel, Ordering::Relaxed)
        {
            Ok(_) => {
                self.table().unpend(meta.peer);
                true
            }
            Err(s) => s == PROVEN,
        }
    }

    /// `CLIENT LIST`: one line per open connection, by id.
    pub(crate) fn list(&self) -> String {
        let metas: Vec<Arc<ClientMeta>> = self.table().open.values().cloned().collect();
        metas.iter().map(|m| m.line()).collect()
    }
}

/// Removes a connection from the table when dropped.
pub(crate) struct Registered {
    clients: Arc<Clients>,
    meta: Arc<ClientMeta>,
}

impl Registered {
    pub(crate) fn meta(&self) -> &Arc<ClientMeta> {
        &self.meta
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut t = self.clients.table();
        t.open.remove(&self.meta.id);
        if self.meta.state.load(Ordering::Acquire) != PROVEN {
            t.unpend(self.meta.peer);
        }
    }
}
