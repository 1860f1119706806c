//! Masters on etcd (issue 18): several masters, one leader under an etcd
//! lease, the others standing by; clients, storage nodes and the CLI find
//! the leader through etcd.
//!
//! ```text
//!  master (each)                        etcd (v3 election API, <name>/<lease>)
//!   lease_grant(ttl)            ---->   lease L
//!   campaign(<name>, "rpc=.. http=..", L)  blocks while an older key leads
//!   every ttl/3: keepalive(L)   ---->   ttl > 0: fence deadline = sent + ttl - margin
//!   won: term = create revision of its key; the fence opens
//!  client / node / CLI (etcd://h1:2379,h2:2379[/name])
//!   leader(<name>)              ---->   "rpc=HOST:PORT http=HOST:PORT" -> Hello to rpc
//!   observe(<name>)             ---->   each new leader: calls waiting on the old one end
//! ```
//!
//! * [`EtcdUrl`] parses `etcd://host:port[,host:port...][/name]`.
//! * [`spawn_election`]: runs one master's side of the election and moves
//!   its [`Fence`] (standby -> leader -> deposed).
//! * [`EtcdSource`]: a client's [`MasterSource`] for `etcd://` addresses;
//!   [`install`] registers it for the process.

mod etcd;

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd::Etcd;
use kvpool_client::leader::{Moved, Resolving};
use kvpool_client::MasterSource;
use kvpool_master::{Fence, FenceRole, MasterHandle};
use kvpool_runtime::Shutdown;
use kvpool_wire::{ErrorCode, KvError};
use tokio::sync::{oneshot, watch};

/// The election's name when the URL names none.
pub const DEFAULT_NAME: &str = "kvpool";

/// Deadline of one etcd call (connect, grant, keepalive, leader, revoke);
/// a campaign waits as long as another master leads.
const ETCD_CALL: Duration = Duration::from_secs(2);

/// Pause before a master tries etcd again after a failure.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Where the masters' election lives: etcd endpoints and an election name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUrl {
    /// `http://host:port` for each endpoint.
    pub endpoints: Vec<String>,
    /// The election's name: masters (and clients) with the same name form
    /// one cluster.
    pub name: String,
}

impl EtcdUrl {
    /// Parses `etcd://host:port[,host:port...][/name]`.
    pub fn parse(url: &str) -> Result<Self, String> {
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| format!("{url:?} is not an etcd://host:port[,host:port...] URL"))?;
        let (hosts, name) = match rest.split_once('/') {
            Some((h, n)) if !n.is_empty() => (h, n),
            Some((h, _)) => (h, DEFAULT_NAME),
            None => (rest, DEFAULT_NAME),
        };
        if name.contains('/') || name.len() > 128 {
            return Err(format!(
                "{url}: the election name {name:?} must be one path segment of at most 128 bytes"
            ));
        }
        let mut endpoints = Vec::new();
        for h in hosts.split(',') {
            let h = h.trim();
            let Some((host, port)) = h.rsplit_once(':') else {
                return Err(format!("{url}: {h:?} is not host:port"));
            };
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(format!("{url}: {h:?} is not host:port"));
            }
            endpoints.push(format!("http://{h}"));
        }
        Ok(Self {
            endpoints,
            name: name.to_string(),
        })
    }

    /// The etcd key prefix the election uses.
    pub fn election(&self) -> String {
        format!("kvpool/{}/leader", self.name)
    }

    /// The etcd key that names the master whose state is the cluster's
    /// (the last to lead; see [`Authority`]). Outside the election's prefix.
    pub fn state_key(&self) -> String {
        format!("kvpool/{}/state", self.name)
    }

    fn connect(&self) -> Result<Etcd, String> {
        Etcd::connect(&self.endpoints, ETCD_CALL).map_err(|e| format!("etcd connect: {e}"))
    }
}

/// `f` within [`ETCD_CALL`], its error as text naming `what`.
async fn within<T>(
    f: impl std::future::Future<Output = Result<T, etcd::EtcdError>>,
    what: &str,
) -> Result<T, String> {
    match tokio::time::timeout(ETCD_CALL, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("etcd {what}: {e}")),
        Err(_) => Err(format!("etcd {what}: no answer within {ETCD_CALL:?}")),
    }
}

/// What a leader publishes: its RPC and HTTP addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub rpc: String,
    pub http: String,
}

impl Published {
    /// `rpc=HOST:PORT http=HOST:PORT`, the value of the leader's key.
    pub fn encode(&self) -> String {
        format!("rpc={} http={}", self.rpc, self.http)
    }

    pub fn decode(value: &str) -> Option<Self> {
        let mut rpc = None;
        let mut http = None;
        for part in value.split_whitespace() {
            match part.split_once('=') {
                Some(("rpc", v)) => rpc = Some(v.to_string()),
                Some(("http", v)) => http = Some(v.to_string()),
                _ => {}
            }
        }
        Some(Self {
            rpc: rpc?,
            http: http.unwrap_or_default(),
        })
    }
}

/// Whose state the cluster's is: the master that led last, its term, and
/// the standby sessions it dropped while they were in sync. Written by each
/// new leader before its fence opens, and by the leader on each such drop
/// before its replies go on without that standby. A master may stand for
/// election only if it is that master (its state directory holds what it
/// led with), or every shard of its copy is in sync at that term in a
/// session not dropped, or no master has led yet (docs/architecture/ha.md,
/// "Who may lead").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authority {
    pub term: u64,
    /// The master's identity ([`ElectionConfig::id`]).
    pub id: String,
    /// Where it served, for people reading etcd.
    pub rpc: String,
    /// Sessions dropped while in sync (the newest [`MAX_DROPPED`]).
    pub dropped: Vec<u64>,
}

/// Most dropped sessions the state key keeps (a standby learns of its own
/// drop at its next `Follow` anyway; the key covers the time until then).
pub const MAX_DROPPED: usize = 4096;

impl Authority {
    /// `term=N id=ID rpc=HOST:PORT [dropped=HEX,HEX...]`, the value of the
    /// state key.
    pub fn encode(&self) -> String {
        let mut v = format!("term={} id={} rpc={}", self.term, self.id, self.rpc);
        if !self.dropped.is_empty() {
            let d: Vec<String> = self.dropped.iter().map(|s| format!("{s:x}")).collect();
            v += &format!(" dropped={}", d.join(","));
        }
        v
    }

    pub fn decode(value: &str) -> Option<Self> {
        let (mut term, mut id, mut rpc, mut dropped) = (None, None, String::new(), Vec::new());
        for part in value.split_whitespace() {
            match part.split_once('=') {
                Some(("term", v)) => term = v.parse().ok(),
                Some(("id", v)) if !v.is_empty() => id = Some(v.to_string()),
                Some(("rpc", v)) => rpc = v.to_string(),
                Some(("dropped", v)) => {
                    for h in v.split(',') {
                        dropped.push(u64::from_str_radix(h, 16).ok()?);
                    }
                }
                _ => {}
            }
        }
        Some(Self {
            term: term?,
            id: id?,
            rpc,
            dropped,
        })
    }
}

/// Writes the state key while this master's election key (`leader`: its
/// key and create revision) still stands: an error if etcd cannot be
/// reached or another master leads.
async fn record_state(
    etcd: &Etcd,
    cfg: &ElectionConfig,
    leader: &(Vec<u8>, i64),
    authority: &Authority,
) -> Result<(), String> {
    let put = etcd.put_while_created_at(
        leader.0.clone(),
        leader.1,
        cfg.url.state_key(),
        authority.encode(),
    );
    if within(put, "write the state key").await? {
        Ok(())
    } else {
        Err("this master's election key is gone: it leads no more".into())
    }
}

/// Why this master may not lead now (`None`: it may). An error when etcd
/// could not be read.
async fn why_not_lead(
    master: &MasterHandle,
    cfg: &ElectionConfig,
    etcd: &Etcd,
) -> Result<Option<String>, String> {
    let key = cfg.url.state_key();
    let Some(kv) = within(etcd.get(key.clone()), "get the state key").await? else {
        // No master has led this cluster yet.
        return Ok(None);
    };
    let value = kv.value_str().unwrap_or("");
    let Some(a) = Authority::decode(value) else {
        return Ok(Some(format!(
            "etcd key {key} holds {value:?}, not `term=N id=ID rpc=ADDR`"
        )));
    };
    if a.id == cfg.id {
        return Ok(None);
    }
    let synced = master.synced_copy();
    match &synced {
        Some((t, sessions)) if *t == a.term && !sessions.iter().any(|s| a.dropped.contains(s)) => {
            Ok(None)
        }
        _ => Ok(Some(format!(
            "the cluster's state is master {} ({}, term {})'s, and this master's copy of it is \
             not in sync (in sync at term and sessions: {synced:x?}; sessions the leader dropped: \
             {}); it stands for election once it is, or once that master is back. To let it \
             lead with what it has (objects may be lost), delete the etcd key {key}",
            a.id,
            a.rpc,
            a.term,
            a.dropped.len()
        ))),
    }
}

/// How one master campaigns.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    pub url: EtcdUrl,
    /// This master's identity in the state key: kept in its state directory
    /// (so it is the same after a restart on that directory), random for a
    /// master without one.
    pub id: String,
    /// The lease's TTL asked for (etcd may raise it to its minimum).
    pub ttl: Duration,
    /// The leader refuses from this long before its lease could end.
    pub margin: Duration,
    pub me: Published,
}

/// Runs this master's side of the election until `shutdown`, moving `fence`:
/// standby while another leads, leader once it wins (term: the create
/// revision of its key), deposed for good if it then loses the lease or
/// cannot renew it in time (restart it to stand by again: its state may be
/// stale). A standby whose lease is lost campaigns again with a new one.
///
/// Before its fence opens, a winner takes over the state the old leader
/// shipped it ([`MasterHandle::take_over`]), within its lease.
pub fn spawn_election(
    master: MasterHandle,
    cfg: ElectionConfig,
    shutdown: Shutdown,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let fence = master.fence().clone();
        loop {
            let end = tokio::select! {
                r = session(&master, &cfg) => r,
                _ = shutdown.wait() => return,
            };
            if let Err(e) = end {
                tracing::warn!("election on {}: {e}", cfg.url.election());
            }
            if matches!(fence.role(), FenceRole::Leader | FenceRole::Deposed) {
                fence.depose();
                tracing::error!(
                    "this master lost its leadership ({}): it refuses every request from now \
                     on; restart it to stand by again",
                    cfg.url.election()
                );
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(RETRY_PAUSE) => {}
                _ = shutdown.wait() => return,
            }
        }
    })
}

/// One lease: campaign under it, keep it alive, lead while it lives.
/// Returns when the lease is lost or etcd fails; a leader is deposed first.
/// Then the lease is revoked (best effort), so a campaign key of this
/// session cannot stay the oldest and name a master that no longer campaigns
/// under it.
async fn session(master: &MasterHandle, cfg: &ElectionConfig) -> Result<(), String> {
    let fence = master.fence();
    let etcd = cfg.url.connect()?;
    wait_until_eligible(master, cfg, &etcd).await?;
    let asked = Instant::now();
    let ttl_s = cfg.ttl.as_secs().max(1) as i64;
    let lease = within(etcd.lease_grant(ttl_s), "lease grant").await?;
    let id = lease.id;
    let ended = campaign_under(master, cfg, &etcd, asked, &lease).await;
    if fence.role() == FenceRole::Leader {
        fence.depose();
    }
    let _ = within(etcd.lease_revoke(id), "lease revoke").await;
    ended
}

/// Waits (following the leader, for refusals, /healthz and log shipping)
/// until this master may lead; says why not now and then.
async fn wait_until_eligible(
    master: &MasterHandle,
    cfg: &ElectionConfig,
    etcd: &Etcd,
) -> Result<(), String> {
    let mut said = None;
    let name = cfg.url.election();
    loop {
        let Some(why) = why_not_lead(master, cfg, etcd).await? else {
            return Ok(());
        };
        if said.is_none_or(|t: Instant| t.elapsed() >= Duration::from_secs(30)) {
            tracing::warn!("not standing for election: {why}");
            said = Some(Instant::now());
        }
        if let Ok(Some(kv)) = within(etcd.leader(name.clone()), "leader").await {
            if let Some(v) = kv.value_str() {
                master.fence().set_leader(v);
            }
        }
        tokio::time::sleep(ELIGIBLE_POLL).await;
    }
}

/// How often a master that may not lead looks again.
const ELIGIBLE_POLL: Duration = Duration::from_millis(250);

/// Campaigns under `lease` (granted at `asked`), then leads while it lives.
async fn campaign_under(
    master: &MasterHandle,
    cfg: &ElectionConfig,
    etcd: &Etcd,
    asked: Instant,
    lease: &etcd::LeaseGrantResponse,
) -> Result<(), String> {
    let fence: &Fence = master.fence();
    let ttl = Duration::from_secs(lease.ttl.max(1) as u64);
    let id = lease.id;
    let margin = cfg.margin.min(ttl / 2);
    let mut valid_until = asked + ttl - margin;
    let (mut keeper, mut stream) =
        within(etcd.lease_keep_alive(id), "lease keepalive stream").await?;
    let name = cfg.url.election();
    let me = cfg.me.encode();
    let campaign = etcd.campaign(name.clone(), me.clone(), id);
    tokio::pin!(campaign);
    let mut tick = tokio::time::interval(ttl / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut leading = false;
    // Once leading: its election key, and the state key's value.
    let mut leader_key = (Vec::new(), 0i64);
    let mut authority = Authority {
        term: 0,
        id: cfg.id.clone(),
        rpc: cfg.me.rpc.clone(),
        dropped: Vec::new(),
    };
    let drops = master.drop_notes();
    tracing::info!(lease = id, ttl_s = ttl.as_secs(), "campaigning on {name}");
    loop {
        tokio::select! {
            won = &mut campaign, if !leading => {
                let won = won.map_err(|e| format!("etcd campaign: {e}"))?;
                let term = won.as_ref().map(|k| k.rev).unwrap_or(0).max(1) as u64;
                if let Some(k) = won {
                    leader_key = (k.key, k.rev);
                }
                if Instant::now() >= valid_until {
                    return Err("won the election after the lease may have run out".into());
                }
                // Eligible when it campaigned, but another master may have
                // led since (and this copy not be in sync with it).
                if let Some(why) = why_not_lead(master, cfg, etcd).await? {
                    return Err(format!("won the election but may not lead: {why}"));
                }
                // State at failover (docs/architecture/ha.md, "Log shipping"):
                // every shard takes the state the old leader shipped it
                // before the fence opens; its objects wait for their
                // segments to mount again, as after a restart. It must be
                // done within the lease: a winner that cannot is deposed.
                let left = valid_until.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, master.take_over()).await {
                    Ok(Ok(objects)) => {
                        tracing::info!(objects, "took over the old leader's shipped state")
                    }
                    Ok(Err(e)) => {
                        fence.depose();
                        return Err(format!("taking over the shipped state: {e}"));
                    }
                    Err(_) => {
                        fence.depose();
                        return Err("taking over the shipped state outlasted the lease".into());
                    }
                }
                // The cluster's state is this master's from now on.
                authority.term = term;
                if let Err(e) = record_state(etcd, cfg, &leader_key, &authority).await {
                    fence.depose();
                    return Err(e);
                }
                if Instant::now() >= valid_until {
                    fence.depose();
                    return Err("took over after the lease may have run out".into());
                }
                fence.lead(term, valid_until, &me);
                leading = true;
                tracing::info!(term, "leading {name} ({me})");
            }
            note = drops.recv_async(), if leading => {
                // A shard dropped standby sessions that were in sync: etcd
                // hears of it before the shard's replies go on without them.
                let Ok(note) = note else { continue };
                authority.dropped.extend_from_slice(&note.sessions);
                let over = authority.dropped.len().saturating_sub(MAX_DROPPED);
                authority.dropped.drain(..over);
                let r = record_state(etcd, cfg, &leader_key, &authority).await;
                let failed = r.as_ref().err().cloned();
                let _ = note.done.send(r);
                if let Some(e) = failed {
                    fence.depose();
                    return Err(format!("recording dropped standbys: {e}"));
                }
                tracing::info!(
                    sessions = ?note.sessions,
                    "recorded standby sessions dropped while in sync: they stand for election no \
                     more"
                );
            }
            _ = tick.tick() => {
                if leading && fence.role() == FenceRole::Deposed {
                    // A shard deposed this master (it could not have a
                    // dropped standby recorded in time): the lease goes, so
                    // that a standby can lead.
                    return Err("a master shard deposed this leader".into());
                }
                let sent = Instant::now();
                let renewed = tokio::time::timeout(ttl / 3, async {
                    keeper.keep_alive().await?;
                    stream.message().await.map_err(etcd::EtcdError::from)
                })
                .await;
                match renewed {
                    Ok(Ok(Some(r))) if r.ttl > 0 => {
                        valid_until = sent + ttl - margin;
                        fence.renew(valid_until);
                    }
                    Ok(Ok(_)) => return Err(format!("the lease {id:x} ran out")),
                    Ok(Err(e)) => return Err(format!("etcd keepalive: {e}")),
                    Err(_) if Instant::now() >= valid_until => {
                        return Err("no keepalive was answered before the lease could end".into());
                    }
                    Err(_) => tracing::warn!("etcd keepalive: no answer within {:?}", ttl / 3),
                }
                if !leading {
                    // Standby: remember who leads, for refusals and /healthz.
                    if let Ok(Some(kv)) = within(etcd.leader(name.clone()), "leader").await {
                        if let Some(v) = kv.value_str() {
                            fence.set_leader(v);
                        }
                    }
                }
            }
        }
    }
}

/// Gives the lease of a leader back when it stops cleanly, so a standby
/// takes over at once instead of after the TTL. Best effort, bounded.
pub async fn resign(url: &EtcdUrl) {
    let Ok(etcd) = url.connect() else {
        return;
    };
    if let Ok(Some(kv)) = within(etcd.leader(url.election()), "leader").await {
        let _ = within(etcd.lease_revoke(kv.lease), "lease revoke").await;
    }
}

/// A client's [`MasterSource`] for `etcd://...`: asks etcd who leads, and
/// follows the election (etcd's `Observe` stream, opened on first use) so
/// that a call to a master that is no longer the leader ends as soon as
/// another one is elected ([`MasterSource::moved_from`]).
pub struct EtcdSource {
    url: EtcdUrl,
    text: String,
    etcd: tokio::sync::Mutex<Option<Etcd>>,
    /// The newest leader this source has heard of (by its key's create
    /// revision, which grows with every election): from `leader` calls and
    /// from the observing task.
    newest: Arc<watch::Sender<Option<Elected>>>,
    /// The observing task and the sender whose drop stops it.
    observer: std::sync::Mutex<Option<(tokio::task::JoinHandle<()>, oneshot::Sender<()>)>>,
}

/// A leader as etcd names it: its key's create revision and its RPC address.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Elected {
    rev: i64,
    rpc: String,
}

/// How long one `Observe` stream is trusted before it is opened again (a
/// connection that died without a word would otherwise be waited on for
/// ever; a new stream starts with the leader now).
const OBSERVE_RENEW: Duration = Duration::from_secs(10);

impl EtcdSource {
    pub fn new(url: &str) -> Result<Self, KvError> {
        Ok(Self {
            url: EtcdUrl::parse(url).map_err(|e| KvError::new(ErrorCode::InvalidParams, e))?,
            text: url.to_string(),
            etcd: tokio::sync::Mutex::new(None),
            newest: Arc::new(watch::channel(None).0),
            observer: std::sync::Mutex::new(None),
        })
    }

    /// The leader's published addresses now.
    pub async fn leader(&self) -> Result<Published, KvError> {
        let unavailable = |e: String| KvError::new(ErrorCode::Unavailable, e);
        let mut slot = self.etcd.lock().await;
        if slot.is_none() {
            *slot = Some(self.url.connect().map_err(unavailable)?);
        }
        let etcd = slot.as_ref().expect("connected above");
        let asked = within(etcd.leader(self.url.election()), "leader").await;
        let r = match asked {
            Ok(r) => r,
            Err(e) => {
                // A new connection next time (the endpoint may be gone).
                *slot = None;
                return Err(unavailable(e));
            }
        };
        let published = r.as_ref().and_then(|kv| {
            let p = Published::decode(kv.value_str()?)?;
            Some((kv.create_revision, p))
        });
        let (rev, p) = published.ok_or_else(|| {
            unavailable(format!(
                "{}: no master leads {} yet",
                self.text,
                self.url.election()
            ))
        })?;
        heard(&self.newest, rev, &p.rpc);
        Ok(p)
    }

    /// The newest leader heard of, the observing task started (again, if
    /// the runtime it ran on has ended) so that it stays current.
    fn following(&self) -> watch::Receiver<Option<Elected>> {
        let mut slot = self.observer.lock().unwrap_or_else(|p| p.into_inner());
        let running = matches!(&*slot, Some((task, _)) if !task.is_finished());
        if !running {
            let (stop, stopped) = oneshot::channel();
            let task = tokio::spawn(observe(self.url.clone(), self.newest.clone(), stopped));
            *slot = Some((task, stop));
        }
        self.newest.subscribe()
    }
}

/// Records that etcd named `rpc` leader with a key created at `rev`, unless
/// a newer leader is known already.
fn heard(newest: &watch::Sender<Option<Elected>>, rev: i64, rpc: &str) {
    newest.send_if_modified(|now| {
        if now.as_ref().is_some_and(|e| e.rev >= rev) {
            return false;
        }
        *now = Some(Elected {
            rev,
            rpc: rpc.to_string(),
        });
        true
    });
}

/// Follows the election into `newest` until `stop` (the source is gone):
/// one `Observe` stream at a time, opened again after an error, its end,
/// or [`OBSERVE_RENEW`].
async fn observe(
    url: EtcdUrl,
    newest: Arc<watch::Sender<Option<Elected>>>,
    mut stop: oneshot::Receiver<()>,
) {
    // One channel for every stream (it reconnects by itself); made again
    // only when it could not be made.
    let mut etcd = None;
    loop {
        if etcd.is_none() {
            match url.connect() {
                Ok(e) => etcd = Some(e),
                Err(e) => tracing::debug!("following the election on etcd: {e}"),
            }
        }
        let Some(conn) = etcd.as_ref() else {
            tokio::select! {
                _ = &mut stop => return,
                () = tokio::time::sleep(RETRY_PAUSE) => continue,
            }
        };
        tokio::select! {
            _ = &mut stop => return,
            why = observe_once(conn, &url, &newest) => {
                tracing::debug!("following the election on etcd: {why}; opening it again");
            }
        }
        tokio::select! {
            _ = &mut stop => return,
            () = tokio::time::sleep(RETRY_PAUSE) => {}
        }
    }
}

/// One `Observe` stream into `newest`; why it ended.
async fn observe_once(
    etcd: &Etcd,
    url: &EtcdUrl,
    newest: &watch::Sender<Option<Elected>>,
) -> String {
    let mut stream = match within(etcd.observe(url.election()), "observe").await {
        Ok(s) => s,
        Err(e) => return e,
    };
    let end = tokio::time::Instant::now() + OBSERVE_RENEW;
    loop {
        match tokio::time::timeout_at(end, stream.message()).await {
            Err(_) => return format!("renewed after {OBSERVE_RENEW:?}"),
            Ok(Err(e)) => return format!("etcd observe: {e}"),
            Ok(Ok(None)) => return "the stream ended".into(),
            Ok(Ok(Some(r))) => {
                let Some(kv) = r.kv else { continue };
                if let Some(p) = kv.value_str().and_then(Published::decode) {
                    heard(newest, kv.create_revision, &p.rpc);
                }
            }
        }
    }
}

impl MasterSource for EtcdSource {
    fn resolve(&self) -> Resolving<'_> {
        Box::pin(async move { Ok(self.leader().await?.rpc) })
    }

    fn follows(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        self.text.clone()
    }

    fn moved_from<'a>(&'a self, addr: &'a str) -> Moved<'a> {
        Box::pin(async move {
            let mut rx = self.following();
            let moved = rx.wait_for(|e| e.as_ref().is_some_and(|e| e.rpc != addr));
            if moved.await.is_err() {
                // The sender is gone (never while `self` lives): no word.
                std::future::pending::<()>().await
            }
        })
    }
}

fn etcd_source(url: &str) -> Result<Arc<dyn MasterSource>, KvError> {
    Ok(Arc::new(EtcdSource::new(url)?))
}

/// Lets every client of this process take `etcd://...` master addresses.
pub fn install() {
    kvpool_client::register_scheme("etcd", etcd_source);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_key_names_term_identity_and_address_and_refuses_less() {
        let mut a = Authority {
            term: 17,
            id: "9f00".into(),
            rpc: "10.0.0.1:7070".into(),
            dropped: Vec::new(),
        };
        assert_eq!(a.encode(), "term=17 id=9f00 rpc=10.0.0.1:7070");
        assert_eq!(Authority::decode(&a.encode()), Some(a.clone()));
        a.dropped = vec![0xab, u64::MAX];
        assert_eq!(
            a.encode(),
            "term=17 id=9f00 rpc=10.0.0.1:7070 dropped=ab,ffffffffffffffff"
        );
        assert_eq!(Authority::decode(&a.encode()), Some(a));
        assert_eq!(
            Authority::decode("term=1 id=9 dropped=zz"),
            None,
            "a bad session"
        );
        assert_eq!(Authority::decode("id=9f00 rpc=x"), None, "no term");
        assert_eq!(
            Authority::decode("term=x id=9f00"),
            None,
            "a term not a number"
        );
        assert_eq!(Authority::decode("term=3 id="), None, "no identity");
        let u = EtcdUrl::parse("etcd://h:1/c1").unwrap();
        assert!(
            !u.state_key().starts_with(&format!("{}/", u.election())),
            "the state key is not a candidate of the election"
        );
    }

    #[test]
    fn the_newest_leader_heard_of_is_never_undone_by_an_older_message() {
        let newest = watch::channel(None).0;
        heard(&newest, 10, "a:1");
        heard(&newest, 20, "b:1");
        // A stream message about the older election, arriving late.
        heard(&newest, 10, "a:1");
        let now = newest.borrow().clone().unwrap();
        assert_eq!((now.rev, now.rpc.as_str()), (20, "b:1"));
        heard(&newest, 30, "a:1");
        assert_eq!(newest.borrow().as_ref().unwrap().rpc, "a:1");
    }

    #[test]
    fn urls_parse_with_and_without_a_name() {
        let u = EtcdUrl::parse("etcd://127.0.0.1:2379,h2:2380").unwrap();
        assert_eq!(
            u.endpoints,
            vec!["http://127.0.0.1:2379".to_string(), "http://h2:2380".into()]
        );
        assert_eq!(u.name, DEFAULT_NAME);
        assert_eq!(u.election(), "kvpool/kvpool/leader");
        assert_eq!(EtcdUrl::parse("etcd://h:1/pool-a").unwrap().name, "pool-a");
        for bad in [
            "h:2379",
            "etcd://",
            "etcd://h",
            "etcd://h:x",
            "etcd://h:1/a/b",
        ] {
            assert!(EtcdUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn published_addresses_round_trip() {
        let p = Published {
            rpc: "10.0.0.1:7070".into(),
            http: "10.0.0.1:9070".into(),
        };
        assert_eq!(Published::decode(&p.encode()), Some(p));
        assert_eq!(Published::decode("http=x:1"), None);
    }
}
