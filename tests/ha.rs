//! HA on etcd (issue 18): a real etcd started here on loopback, real
//! `kvpool` masters campaigning on it, a real storage node and clients that
//! follow the leader through it. Skipped (loudly) without /usr/bin/etcd,
//! unless KVPOOL_REQUIRE_ETCD=1 (what .ci/run sets).

use crate::common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{value, Proc, Signal};
use kvpool_client::{Client, ClientConfig, ErrorCode};
use kvpool_wire::proto::{call, PutOptions, Tier};

/// A single-member etcd on two free loopback ports, with its data in a
/// fresh directory; killed and removed when dropped.
struct Etcd {
    child: Child,
    /// `host:port` of its client URL.
    client: String,
    dir: PathBuf,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(self.dir.with_extension("log"));
    }
}

impl Etcd {
    /// `etcd://` URL of this etcd.
    fn url(&self) -> String {
        format!("etcd://{}", self.client)
    }
}

/// One HTTP GET; `None` when nothing answers (yet).
fn try_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// Starts etcd, or says why not: `None` (a printed skip) without the
/// binary, unless KVPOOL_REQUIRE_ETCD=1.
fn etcd() -> Option<Etcd> {
    let Some(etcd_bin) = common::on_path("etcd") else {
        if std::env::var("KVPOOL_REQUIRE_ETCD").is_ok_and(|v| v == "1") {
            panic!("etcd not found on PATH, and KVPOOL_REQUIRE_ETCD=1 requires it (apt-get install etcd-server)");
        }
        common::say_skip(
            "etcd not found on PATH (apt-get install etcd-server); the HA tests did not run",
        );
        return None;
    };
    let base = common::fixed_addr(2);
    let port: u16 = base.rsplit_once(':').unwrap().1.parse().unwrap();
    let client = format!("127.0.0.1:{port}");
    let peer = format!("http://127.0.0.1:{}", port + 1);
    let dir = std::env::temp_dir().join(format!(
        "kvpool-test-etcd-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let log = std::fs::File::create(dir.with_extension("log")).unwrap();
    let child = Command::new(&etcd_bin)
        .args([
            "--name",
            "t",
            "--data-dir",
            dir.to_str().unwrap(),
            "--listen-client-urls",
            &format!("http://{client}"),
            "--advertise-client-urls",
            &format!("http://{client}"),
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &format!("t={peer}"),
        ])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn etcd");
    let e = Etcd { child, client, dir };
    common::eventually_blocking("etcd healthy", Duration::from_secs(20), || {
        match try_get(&e.client, "/health") {
            Some((200, body)) if body.contains("true") => Ok(()),
            h => Err(format!(
                "/health: {h:?}; its log:\n{}",
                std::fs::read_to_string(e.dir.with_extension("log")).unwrap_or_default()
            )),
        }
    });
    Some(e)
}

/// The master config of these tests: a 2 s lease, fencing 500 ms before it
/// could end, short client liveness; `extra` after it (e.g. `[security]`).
fn master_config(tag: &str, extra: &str) -> String {
    common::config_file(
        tag,
        &format!(
            "[master]\nha_lease_ttl_s = 2\nha_fence_margin_ms = 500\nclient_ttl_ms = 3000\n{extra}"
        ),
    )
}

/// `kvpool run --role master --ha <url>` on ephemeral ports.
fn start_master(url: &str, cfg: &str) -> Proc {
    let mut args = common::ephemeral(&[]);
    args.splice(0..0, ["--config", cfg, "--ha", url]);
    common::start("master", &args)
}

/// A master that leads on `url`, then one that stands by (config `cfg`).
fn leader_and_standby(url: &str, cfg: &str) -> (Proc, Proc) {
    let a = start_master(url, cfg);
    wait_role(&a, "leader", Duration::from_secs(10));
    let b = start_master(url, cfg);
    wait_role(&b, "standby", Duration::from_secs(10));
    // Only a standby in sync stands for election.
    common::eventually_blocking("the standby in sync", Duration::from_secs(20), || {
        healthz_all(&b, "synced", "1")
    });
    (a, b)
}

/// With the cluster secret `secret`: a leader and a standby on `url`, and a
/// DRAM-only storage node of `size`.
fn secured_cluster(url: &str, tag: &str, secret: &str, size: &str) -> (Proc, Proc, Proc) {
    let security = format!("[security]\nsecret = \"{secret}\"\n");
    let mcfg = master_config(&format!("{tag}-master"), &security);
    let (a, b) = leader_and_standby(url, &mcfg);
    let scfg = common::config_file(&format!("{tag}-storage"), &security);
    let node = common::start_storage(url, size, &["--config", &scfg]);
    (a, b, node)
}

/// Objects `obj-0..n` (of `len(i)` bytes) read back byte-exact, each once
/// its node has mounted its segment on the new leader again.
async fn read_back(c: &Client, n: u64, len: impl Fn(u64) -> usize) {
    for i in 0..n {
        let key = format!("obj-{i}");
        let got = common::eventually("a read after failover", Duration::from_secs(20), || async {
            c.get(key.as_bytes()).await.map_err(|e| e.to_string())
        })
        .await;
        assert_eq!(got, value(i, len(i)), "{key} after failover");
    }
}

/// kill -9 of leader `a`; standby `b` must lead within 10 s (told to the
/// writers, if any). Returns when the kill was sent.
fn kill_leader(mut a: Proc, b: &Proc, w: Option<&Writers>) -> Instant {
    a.signal(Signal::KILL);
    let killed_at = Instant::now();
    a.wait_exit(Duration::from_secs(10))
        .expect("the leader died");
    let took = wait_role(b, "leader", Duration::from_secs(10));
    if let Some(w) = w {
        *w.led_at.lock().unwrap() = Some(Instant::now());
    }
    println!("a standby led {took:?} after the leader was killed");
    killed_at
}

/// The role a master's /healthz reports (`leader`, `standby`, `deposed`),
/// or "" when it does not answer.
fn role_of(m: &Proc) -> String {
    role_in(&try_get(&m.http, "/healthz"))
}

/// The role a `/healthz` answer names ("" without one).
fn role_in(healthz: &Option<(u16, String)>) -> String {
    match healthz {
        Some((_, body)) => body
            .split_whitespace()
            .find_map(|w| w.strip_prefix("role="))
            .unwrap_or("")
            .to_string(),
        None => String::new(),
    }
}

/// Waits until `m` reports `role`; panics after `within`. Returns how long.
fn wait_role(m: &Proc, role: &str, within: Duration) -> Duration {
    let start = Instant::now();
    common::eventually_blocking(&format!("master {} {role}", m.addr), within, || {
        // One `/healthz` per poll: the role and, if not yet, the message.
        let healthz = try_get(&m.http, "/healthz");
        if role_in(&healthz) == role {
            Ok(())
        } else {
            Err(format!("healthz: {healthz:?}; stderr:\n{}", m.stderr()))
        }
    });
    start.elapsed()
}

fn client_config(secret: &str) -> ClientConfig {
    ClientConfig {
        secret: kvpool_config::Secret::new(secret.to_string()),
        timeout_ms: 5_000,
        ..Default::default()
    }
}

/// Whether an error says clearly why a put did not finish across a
/// failover: the master was gone, not the leader, or out of time; or the
/// pool was full (`NoSpace`: a new leader with no segment mounted yet makes
/// the writer wait for the remount since 2026-11-25, docs/RELIABILITY.md).
fn clear_failover_error(e: &kvpool_client::KvError) -> bool {
    matches!(
        e.code,
        ErrorCode::Unavailable | ErrorCode::Timeout | ErrorCode::NotLeader | ErrorCode::NoSpace
    ) && !e.message.is_empty()
}

/// A put that returned Ok: its key, value seed and length, and when it
/// started and ended.
struct Put {
    key: String,
    seed: u64,
    len: usize,
    started: Instant,
    ended: Instant,
}

/// Eight clients that put (each `pause` apart) until stopped, following
/// the leader through etcd.
struct Writers {
    stop: Arc<AtomicBool>,
    /// When the new leader led (set by the test): puts started after it
    /// are counted in `ok_after_led`.
    led_at: Arc<Mutex<Option<Instant>>>,
    /// Writers whose first put has ended.
    under_way: Arc<AtomicUsize>,
    oks: Arc<AtomicUsize>,
    ok_after_led: Arc<AtomicUsize>,
    threads: Vec<std::thread::JoinHandle<(Vec<Put>, Vec<kvpool_client::KvError>)>>,
}

impl Writers {
    fn start(url: &str, secret: &'static str, pause: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let led_at = Arc::new(Mutex::new(None::<Instant>));
        let under_way = Arc::new(AtomicUsize::new(0));
        let oks = Arc::new(AtomicUsize::new(0));
        let ok_after_led = Arc::new(AtomicUsize::new(0));
        let threads = (0..8u64)
            .map(|w| {
                let url = url.to_string();
                let (stop, led_at) = (stop.clone(), led_at.clone());
                let (under_way, oks) = (under_way.clone(), oks.clone());
                let ok_after_led = ok_after_led.clone();
                std::thread::spawn(move || {
                    common::rt().block_on(async move {
                        let c = Client::connect(&url, client_config(secret)).await.unwrap();
                        let mut done = Vec::new();
                        let mut errors = Vec::new();
                        let mut i = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            let seed = 1_000_000 * (w + 1) + i;
                            let key = format!("live-{w}-{i}");
                            let len = 4096 + (i as usize % 7) * 1000;
                            i += 1;
                            let started = Instant::now();
                            match c.put(key.as_bytes(), &value(seed, len)).await {
                                Ok(()) => {
                                    let ended = Instant::now();
                                    done.push(Put {
                                        key,
                                        seed,
                                        len,
                                        started,
                                        ended,
                                    });
                                    oks.fetch_add(1, Ordering::Relaxed);
                                    if led_at.lock().unwrap().is_some_and(|t| started > t) {
                                        ok_after_led.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                                Err(e) => errors.push(e),
                            }
                            if i == 1 {
                                under_way.fetch_add(1, Ordering::Relaxed);
                            }
                            // Paced, so the pool does not fill up meanwhile.
                            tokio::time::sleep(pause).await;
                        }
                        (done, errors)
                    })
                })
            })
            .collect();
        Self {
            stop,
            led_at,
            under_way,
            oks,
            ok_after_led,
            threads,
        }
    }

    /// Stops the writers; the puts that returned Ok. Every put that failed
    /// must have failed with a clear error.
    fn stop(self) -> Vec<Put> {
        self.stop.store(true, Ordering::Relaxed);
        let mut puts = Vec::new();
        for t in self.threads {
            let (done, errors) = t.join().expect("a writer panicked");
            for e in &errors {
                assert!(clear_failover_error(e), "a put failed unclearly: {e}");
            }
            puts.extend(done);
        }
        puts
    }
}

#[test]
fn the_leader_killed_under_eight_clients_a_standby_leads_and_nvme_objects_read_back() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    let mcfg = master_config("ha-kill-master", "");
    let (a, b) = leader_and_standby(&url, &mcfg);

    let d = common::scratch_dir("ha-kill");
    let nvme = d.join("tier.kvnv");
    let scfg = common::write_config(
        &d,
        "storage.toml",
        &format!(
            "[storage.nvme]\npath = \"{}\"\ncapacity = \"256 MiB\"\npolicy = \"write_through\"\n\
             avg_object_bytes = \"64 KiB\"\ntask_poll_ms = 20\n",
            nvme.display()
        ),
    );
    let _node = common::start_storage(&url, "128MiB", &["--config", &scfg]);

    // The CLI finds the leader through etcd.
    let (code, out, err) = common::cli(&url, &["stat"], None);
    assert_eq!(code, 0, "kvpool --master {url} stat: {err}");
    let stat_before = String::from_utf8_lossy(&out).to_string();

    kvpool_ha::install();
    let rt = common::rt();
    let n = 48u64;
    let len = |i: u64| 8_000 + (i as usize * 7919) % 60_000;
    let c = rt.block_on(async {
        // A standby refuses, naming the leader.
        let e = Client::connect(&b.addr, client_config(""))
            .await
            .err()
            .expect("a standby refuses a client");
        assert_eq!(e.code, ErrorCode::NotLeader, "{e}");
        assert!(e.message.contains(&a.addr), "names the leader: {e}");

        let c = Client::connect(&url, client_config("")).await.unwrap();
        assert_eq!(c.master_addr(), a.addr);
        for i in 0..n {
            c.put(format!("obj-{i}").as_bytes(), &value(i, len(i)))
                .await
                .unwrap();
        }
        // Write-through: every object gets its NVMe copy.
        for i in 0..n {
            let key = format!("obj-{i}");
            common::eventually("an NVMe copy", Duration::from_secs(20), || async {
                let info = c
                    .describe(key.as_bytes())
                    .await
                    .map_err(|e| e.to_string())?;
                if info.replicas.iter().any(|r| r.tier == Tier::Nvme) {
                    Ok(())
                } else {
                    Err(format!("{key} has no NVMe copy yet"))
                }
            })
            .await;
        }
        c
    });

    // Eight clients put until told to stop, through the kill.
    let w = Writers::start(&url, "", Duration::from_millis(10));
    // The kill comes once every writer is putting.
    common::eventually_blocking("all 8 writers putting", Duration::from_secs(20), || {
        w.under_way.load(Ordering::Relaxed) == 8
    });

    kill_leader(a, &b, Some(&w));

    rt.block_on(async {
        // Every object complete before the kill had an NVMe copy: all read
        // back byte-exact once the node has remounted on the new leader.
        read_back(&c, n, len).await;
        assert_eq!(c.master_addr(), b.addr, "the client follows the new leader");
    });

    // Writers go on on the new leader until some of their puts landed there.
    common::eventually_blocking(
        "8 puts Ok on the new leader",
        Duration::from_secs(30),
        || w.ok_after_led.load(Ordering::Relaxed) >= 8,
    );
    let led = w.led_at.lock().unwrap().expect("set above");
    let mut after = 0;
    rt.block_on(async {
        for p in w.stop() {
            if p.started > led {
                let got = c.get(p.key.as_bytes()).await.unwrap();
                assert_eq!(
                    got,
                    value(p.seed, p.len),
                    "{}, put after the failover",
                    p.key
                );
                after += 1;
            }
        }
    });
    assert!(after > 0, "no put succeeded after the failover");

    // New puts work; the CLI follows the failover too.
    rt.block_on(async {
        c.put(b"after-failover", b"fresh").await.unwrap();
        assert_eq!(c.get(b"after-failover").await.unwrap(), b"fresh");
    });
    let (code, out, err) = common::cli(&url, &["stat"], None);
    assert_eq!(
        code, 0,
        "kvpool --master {url} stat after the failover: {err}"
    );
    assert!(!stat_before.is_empty() && !out.is_empty());
}

#[test]
fn a_stalled_leader_is_fenced_its_grants_refused_and_no_space_is_handed_out_twice() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    let secret = "ha test secret of more than sixteen bytes";
    let (a, b, _node) = secured_cluster(&url, "ha-stall", secret, "64MiB");
    // The standby follows the leader: the new leader will know the old
    // one's objects and the space its grants hold.
    common::eventually_blocking("the standby in sync", Duration::from_secs(20), || {
        healthz_all(&b, "synced", "1")
    });
    kvpool_ha::install();
    let rt = common::rt();
    // A client of the old leader alone (a fixed address: it cannot follow),
    // over TCP so the node checks every request's grant.
    let mut tcp = client_config(secret);
    tcp.transport = kvpool_config::Transport::Tcp;
    let (old, grant) = rt.block_on(async {
        let old = Client::connect(&a.addr, tcp.clone()).await.unwrap();
        old.put(b"before", &value(1, 50_000)).await.unwrap();
        // Space the old leader hands out, written only after it is deposed.
        let replicas = old
            .call(call::PutStart {
                client_id: old.id(),
                key: b"stale-write".to_vec(),
                len: 65_536,
                opts: PutOptions {
                    replicas: 1,
                    ..Default::default()
                },
            })
            .await
            .unwrap();
        (old, replicas)
    });

    a.freeze();
    let took = wait_role(&b, "leader", Duration::from_secs(10));
    println!("a standby led {took:?} after the leader stalled");

    // The new leader hands out the pool's space (all but what it was
    // shipped: the old leader's object and its grant's range, held until
    // its time): fill it with objects of its own.
    let n = 64u64;
    let c = rt.block_on(async {
        let c = Client::connect(&url, tcp.clone()).await.unwrap();
        assert_eq!(c.master_addr(), b.addr);
        for i in 0..n {
            let key = format!("new-{i}");
            common::eventually(
                "a put on the new leader",
                Duration::from_secs(15),
                || async {
                    c.put(key.as_bytes(), &value(100 + i, 65_536))
                        .await
                        .map_err(|e| e.to_string())
                },
            )
            .await;
        }
        c
    });

    a.signal(Signal::CONT);
    // Resumed past its lease, it never says it leads, not even before its
    // election task has run (node http.rs `master_role`).
    for _ in 0..20 {
        if let Some((_, body)) = try_get(&a.http, "/healthz") {
            assert!(!body.contains("role=leader"), "{body}");
        }
    }
    rt.block_on(async {
        // The old leader answers nothing: it refuses, naming the reason.
        let e = old
            .put(b"after", &value(2, 4096))
            .await
            .expect_err("a deposed leader took a put");
        assert_eq!(e.code, ErrorCode::NotLeader, "{e}");
        assert!(e.message.contains("not the leader"), "{e}");
        let e = old
            .get(b"before")
            .await
            .expect_err("a deposed leader answered a get");
        assert!(
            matches!(e.code, ErrorCode::NotLeader),
            "the old leader's read: {e}"
        );
        // Its grant, handed out before the stall, no longer writes: the node
        // has seen the new leader's term.
        let deadline = Instant::now() + Duration::from_secs(5);
        let e = old
            .engine()
            .write(&grant, &value(3, 65_536), deadline)
            .await
            .expect_err("a deposed leader's grant wrote");
        assert_eq!(e.code, ErrorCode::NotLeader, "{e}");
        assert!(e.message.contains("term"), "{e}");

        // Nothing was handed out twice: every object of the new leader reads
        // back byte-exact.
        for i in 0..n {
            let key = format!("new-{i}");
            assert_eq!(
                c.get(key.as_bytes()).await.unwrap(),
                value(100 + i, 65_536),
                "{key}"
            );
        }
        // The old leader's DRAM object was shipped to the new one.
        let got = c.get(b"before").await;
        let got = got.unwrap_or_else(|e| panic!("before: {e}; new leader's log:\n{}", b.stderr()));
        assert_eq!(got, value(1, 50_000));
    });
    // The old leader learns it lost the lease and says so.
    common::eventually_blocking(
        "the old leader reports deposed",
        Duration::from_secs(10),
        || match try_get(&a.http, "/healthz") {
            Some((503, body)) if body.contains("deposed") => Ok(()),
            h => Err(format!("healthz: {h:?}")),
        },
    );
    assert_eq!(role_of(&b), "leader");
}

/// Issue 29 item 6: a stalled leader is left when etcd elects another, not
/// at the deadline of the calls waiting for it: a client's put waiting on
/// it ends then, and the storage node's ping too, so the node mounts on the
/// new leader and writes go on within the lease's TTL and a remount, well
/// inside `timeout_ms` (10 s; before, the first write after the stall came
/// after it, and the node's segment later still).
#[test]
fn a_stalled_leader_is_left_when_etcd_elects_another_not_at_the_calls_deadline() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    let cfg = master_config("ha-follow", "");
    let (a, b) = leader_and_standby(&url, &cfg);
    let _node = common::start_storage(&url, "64MiB", &[]);
    kvpool_ha::install();
    let rt = common::rt();
    let cfg = ClientConfig::default();
    let deadline = Duration::from_millis(cfg.timeout_ms);
    let c = rt.block_on(async {
        let c = Client::connect(&url, cfg).await.unwrap();
        common::eventually(
            "a put before the stall",
            Duration::from_secs(10),
            || async {
                c.put(b"before", &value(1, 50_000))
                    .await
                    .map_err(|e| e.to_string())
            },
        )
        .await;
        c
    });

    a.freeze();
    let frozen = Instant::now();
    rt.block_on(async {
        // Sent to the stalled leader; it ends when the standby is elected:
        // sent again to the new leader where that is safe, or a clear error.
        let r = c.put(b"during", &value(2, 4096)).await;
        let ended = frozen.elapsed();
        println!("the put waiting on the stalled leader ended after {ended:?}: {r:?}");
        if let Err(e) = &r {
            assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
            assert!(e.message.contains("stopped leading"), "{e}");
        }
        assert!(ended < deadline / 2, "left after {ended:?}: {r:?}");

        // Writes go on at the new leader once the node has mounted there.
        common::eventually("a put on the new leader", deadline, || async {
            c.put(b"after", &value(3, 4096))
                .await
                .map_err(|e| e.to_string())
        })
        .await;
        let wrote = frozen.elapsed();
        println!("the first put after the stall returned Ok after {wrote:?}");
        assert_eq!(c.master_addr(), b.addr);
        // The old leader's object, shipped to the standby, reads back as
        // soon as the node's segment is mounted there.
        let got = common::eventually("the old leader's object", deadline, || async {
            c.get(b"before").await.map_err(|e| e.to_string())
        })
        .await;
        assert_eq!(got, value(1, 50_000));
        let read = frozen.elapsed();
        println!("the old leader's object read back after {read:?}");
        assert!(
            wrote < deadline * 7 / 10 && read < deadline * 7 / 10,
            "writes resumed after {wrote:?}, the old object read after {read:?}: \
             the stalled leader was waited for until the calls' deadline ({deadline:?})"
        );
    });
    a.signal(Signal::CONT);
}

/// Whether every master shard's figure `name=` in `m`'s /healthz is `want`
/// (`synced=1,1`: both shards of a standby in sync).
fn healthz_all(m: &Proc, name: &str, want: &str) -> bool {
    try_get(&m.http, "/healthz").is_some_and(|(_, body)| {
        body.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .is_some_and(|v| v.split(',').all(|x| x == want))
    })
}

#[test]
fn the_leader_killed_under_eight_clients_every_dram_object_reads_back_from_the_standby() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    let secret = "ha shipping secret of more than sixteen bytes";
    // DRAM only: the new leader can learn these objects from nowhere but
    // the log the old one shipped it.
    let (a, b, _node) = secured_cluster(&url, "ha-ship", secret, "256MiB");
    // The standby follows every shard of the leader (authenticated with the
    // cluster secret), and the leader's replies wait for it.
    common::eventually_blocking("the standby in sync", Duration::from_secs(20), || {
        healthz_all(&b, "synced", "1")
    });
    common::eventually_blocking(
        "the leader's standby in sync",
        Duration::from_secs(20),
        || healthz_all(&a, "standbys_in_sync", "1"),
    );

    kvpool_ha::install();
    let rt = common::rt();
    let n = 48u64;
    let len = |i: u64| 8_000 + (i as usize * 7919) % 60_000;
    let c = rt.block_on(async {
        let c = Client::connect(&url, client_config(secret)).await.unwrap();
        assert_eq!(c.master_addr(), a.addr);
        for i in 0..n {
            c.put(format!("obj-{i}").as_bytes(), &value(i, len(i)))
                .await
                .unwrap();
        }
        c
    });

    // Eight clients put until told to stop, through the kill.
    let w = Writers::start(&url, secret, Duration::from_millis(5));
    common::eventually_blocking(
        "80 puts Ok from the writers",
        Duration::from_secs(30),
        || w.oks.load(Ordering::Relaxed) >= 80,
    );

    let killed_at = kill_leader(a, &b, Some(&w));
    common::eventually_blocking(
        "8 puts Ok on the new leader",
        Duration::from_secs(30),
        || w.ok_after_led.load(Ordering::Relaxed) >= 8,
    );
    let puts = w.stop();

    let mut before = 0;
    rt.block_on(async {
        // Every object complete before the kill reads back byte-exact (once
        // the node has mounted its segment on the new leader again).
        read_back(&c, n, len).await;
        assert_eq!(c.master_addr(), b.addr, "the client follows the new leader");
        for p in puts {
            let got = c.get(p.key.as_bytes()).await;
            let when = if p.ended < killed_at {
                before += 1;
                "before"
            } else {
                "after"
            };
            let got = got.unwrap_or_else(|e| panic!("{}, put {when} the kill: {e}", p.key));
            assert_eq!(got, value(p.seed, p.len), "{}, put {when} the kill", p.key);
        }
    });
    assert!(before >= 80, "only {before} puts ended before the kill");
}

#[test]
fn a_stalled_standby_is_dropped_catches_up_from_a_snapshot_and_then_loses_nothing_at_failover() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    // An open cluster this time (no secret): the same sessions, unauthenticated.
    let mcfg = master_config("ha-catchup-master", "");
    let (a, b) = leader_and_standby(&url, &mcfg);
    let _node = common::start_storage(&url, "128MiB", &[]);
    common::eventually_blocking("the standby in sync", Duration::from_secs(20), || {
        healthz_all(&b, "synced", "1")
    });
    kvpool_ha::install();
    let rt = common::rt();
    let len = |i: u64| 4_000 + (i as usize * 7919) % 30_000;
    let c = rt.block_on(async { Client::connect(&url, client_config("")).await.unwrap() });
    let put = |from: u64, to: u64| {
        rt.block_on(async {
            for i in from..to {
                c.put(format!("obj-{i}").as_bytes(), &value(i, len(i)))
                    .await
                    .unwrap_or_else(|e| panic!("put obj-{i}: {e}"));
            }
        })
    };
    put(0, 40);
    // The standby stalls: the leader's replies wait for it at most the
    // sync timeout, then it is dropped and puts go on without it.
    b.freeze();
    put(40, 80);
    common::eventually_blocking(
        "the stalled standby dropped on every shard",
        Duration::from_secs(10),
        || healthz_all(&a, "standbys_in_sync", "0"),
    );
    // Resumed, it starts a new session: a snapshot holding the 80 objects
    // (40 of which it never saw in the log), then the log.
    b.signal(Signal::CONT);
    common::eventually_blocking("the standby in sync again", Duration::from_secs(20), || {
        healthz_all(&a, "standbys_in_sync", "1") && healthz_all(&b, "synced", "1")
    });
    put(80, 120);
    kill_leader(a, &b, None);
    rt.block_on(async {
        read_back(&c, 120, len).await;
        assert_eq!(c.master_addr(), b.addr, "the client follows the new leader");
    });
}

/// A drain is a journal record the leader ships (issue 32): after a kill
/// -9 of the leader, the standby that takes over (the service's take-over:
/// the shipped records, its image, `recover`) still says the segment is
/// draining once its node has mounted it again, and places no put there.
#[test]
fn a_drain_holds_after_the_leader_is_killed_and_the_standby_leads() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    let mcfg = master_config("ha-drain-master", "");
    let (a, b) = leader_and_standby(&url, &mcfg);
    let ncfg = common::config_file("ha-drain-node", "[storage]\nping_interval_ms = 200\n");
    let _n1 = common::start_storage(&url, "32MiB", &["--config", &ncfg]);
    let _n2 = common::start_storage(&url, "32MiB", &["--config", &ncfg]);
    kvpool_ha::install();
    let rt = common::rt();
    let c = rt.block_on(async { Client::connect(&url, client_config("")).await.unwrap() });
    let stat = || rt.block_on(c.stat()).unwrap();
    common::eventually_blocking("both segments mounted", Duration::from_secs(20), || {
        stat().segments.len() == 2
    });
    let drained = stat().segments[0].id;
    rt.block_on(c.drain_segment(drained)).unwrap();
    assert!(
        stat()
            .segments
            .iter()
            .any(|g| g.id == drained && g.draining),
        "draining on the leader: {:?}",
        stat()
    );
    common::eventually_blocking("the standby in sync", Duration::from_secs(20), || {
        healthz_all(&b, "synced", "1")
    });
    kill_leader(a, &b, None);
    common::eventually_blocking(
        "both segments mounted on the new leader",
        Duration::from_secs(20),
        || stat().segments.len() == 2,
    );
    let s = stat();
    assert_eq!(c.master_addr(), b.addr, "the client follows the new leader");
    assert!(
        s.segments.iter().any(|g| g.id == drained && g.draining),
        "the drain holds on the new leader: {s:?}"
    );
    rt.block_on(common::puts_avoid(&c, drained));
}

/// Watches `b` for 6 s (three times the tests' 2 s lease, so a leader
/// whose lease ran out has been replaced by then if anyone may replace it)
/// and fails if it leads; `who` names it in the failure.
fn never_leads(b: &Proc, who: &str) {
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        assert_ne!(role_of(b), "leader", "{who} leads; stderr:\n{}", b.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Configs of two masters (the tests' lease and fence) with a state
/// directory each.
fn configs_with_state_dirs(tag: &str) -> (String, String) {
    let cfg = |side: &str| {
        let dir = common::scratch_dir(&format!("{tag}-{side}"));
        let state = format!("state_dir = \"{}\"\n", dir.display());
        master_config(&format!("{tag}-{side}"), &state)
    };
    (cfg("a"), cfg("b"))
}

/// Puts `obj-from..obj-to` (of `len(i)` bytes), each retried while the
/// pool settles.
async fn put_objects(c: &Client, from: u64, to: u64, len: impl Fn(u64) -> usize) {
    for i in from..to {
        let key = format!("obj-{i}");
        common::eventually("a put", Duration::from_secs(10), || async {
            c.put(key.as_bytes(), &value(i, len(i)))
                .await
                .map_err(|e| e.to_string())
        })
        .await;
    }
}

/// A standby that never received the leader's state does not lead with its
/// own (a fresh, or stale, state directory): the leader is stopped before
/// the standby could sync, and the standby stays a standby well past the
/// leader's lease. The old leader, restarted on its state directory, is the
/// master whose state the cluster's is, and leads again; every object reads
/// back. Once the standby is in sync with it, the standby takes over when
/// it is killed, and every object still reads back.
#[test]
fn a_standby_never_in_sync_does_not_lead_and_the_last_leader_leads_again_from_its_state_dir() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    let (cfg_a, cfg_b) = configs_with_state_dirs("ha-eligible");
    let mut a = start_master(&url, &cfg_a);
    wait_role(&a, "leader", Duration::from_secs(10));
    let _node = common::start_storage(&url, "64MiB", &[]);
    kvpool_ha::install();
    let rt = common::rt();
    let len = |i: u64| 3_000 + (i as usize * 7919) % 20_000;
    let c = rt.block_on(async { Client::connect(&url, client_config("")).await.unwrap() });
    rt.block_on(put_objects(&c, 0, 30, len));
    a.freeze();
    let b = start_master(&url, &cfg_b);
    // The lease is 2 s: without the rule, b led after about that.
    never_leads(&b, "a standby that never synced");
    assert!(
        b.stderr().contains("not standing for election"),
        "the standby says why it does not lead; stderr:\n{}",
        b.stderr()
    );
    a.signal(Signal::KILL);
    a.wait_exit(Duration::from_secs(10))
        .expect("the old leader died");
    let a2 = start_master(&url, &cfg_a);
    wait_role(&a2, "leader", Duration::from_secs(15));
    rt.block_on(read_back(&c, 30, len));
    common::eventually_blocking("the standby in sync", Duration::from_secs(20), || {
        healthz_all(&b, "synced", "1")
    });
    kill_leader(a2, &b, None);
    rt.block_on(read_back(&c, 30, len));
}

/// A standby the leader drops (it stalled past the sync timeout) is
/// recorded in etcd as dropped before the leader acknowledges puts without
/// it. When the leader then dies while the standby is still stalled, the
/// resumed standby, which lacks those puts, does not lead; the old leader,
/// restarted on its state directory, does, and every put reads back.
#[test]
fn a_standby_dropped_while_stalled_does_not_lead_when_the_leader_dies() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    let (cfg_a, cfg_b) = configs_with_state_dirs("ha-dropped");
    let mut a = start_master(&url, &cfg_a);
    wait_role(&a, "leader", Duration::from_secs(10));
    let b = start_master(&url, &cfg_b);
    wait_role(&b, "standby", Duration::from_secs(10));
    common::eventually_blocking("the standby in sync", Duration::from_secs(20), || {
        healthz_all(&b, "synced", "1")
    });
    let _node = common::start_storage(&url, "64MiB", &[]);
    kvpool_ha::install();
    let rt = common::rt();
    let len = |i: u64| 3_000 + (i as usize * 7919) % 20_000;
    let c = rt.block_on(async { Client::connect(&url, client_config("")).await.unwrap() });
    rt.block_on(put_objects(&c, 0, 20, len));
    b.freeze();
    // The first of these waits the sync timeout for b, which is dropped,
    // and its drop recorded; the rest go on without it.
    rt.block_on(put_objects(&c, 20, 40, len));
    common::eventually_blocking(
        "the stalled standby dropped on every shard",
        Duration::from_secs(10),
        || healthz_all(&a, "standbys_in_sync", "0"),
    );
    a.signal(Signal::KILL);
    a.wait_exit(Duration::from_secs(10))
        .expect("the leader died");
    b.signal(Signal::CONT);
    never_leads(
        &b,
        "a standby the leader had dropped (it lacks the puts made after)",
    );
    let a2 = start_master(&url, &cfg_a);
    wait_role(&a2, "leader", Duration::from_secs(15));
    rt.block_on(read_back(&c, 40, len));
}

/// The leader loses etcd (etcd paused past the lease) while its standby
/// still reaches it: the leader stops at its fence and refuses the
/// standby's polls, and the standby keeps its session (the refusal does not
/// mean the leader stopped waiting for it: it answers nothing any more), so
/// once etcd is back the standby leads, and every object reads back. Before,
/// any refusal ended the session, and the standby, no longer in sync, would
/// not lead: nobody did.
#[test]
fn a_leader_cut_from_etcd_is_replaced_by_its_standby_in_sync() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    let cfg = master_config("ha-etcd-pause", "");
    let (a, b) = leader_and_standby(&url, &cfg);
    let _node = common::start_storage(&url, "64MiB", &[]);
    kvpool_ha::install();
    let rt = common::rt();
    let len = |i: u64| 2_000 + (i as usize * 7919) % 10_000;
    let c = rt.block_on(async { Client::connect(&url, client_config("")).await.unwrap() });
    rt.block_on(put_objects(&c, 0, 20, len));
    let pid = etcd.child.id().to_string();
    let signal = |sig: &str| {
        let ok = Command::new("kill")
            .args([sig, &pid])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} etcd");
    };
    signal("-STOP");
    // The lease is 2 s: the leader fences itself and is deposed.
    common::eventually_blocking("the leader deposed", Duration::from_secs(10), || {
        try_get(&a.http, "/healthz").is_some_and(|(_, body)| body.contains("deposed"))
    });
    // Time for the standby's polls to meet the deposed leader's refusal
    // (one poll waits at most 200 ms, a retry 200 ms): what is tested is
    // that the refusal keeps the session. Nothing to poll for: on the fixed
    // code the standby's state does not change.
    std::thread::sleep(Duration::from_millis(500));
    signal("-CONT");
    wait_role(&b, "leader", Duration::from_secs(15));
    rt.block_on(read_back(&c, 20, len));
}
