//! HA on etcd (issue 18): a real etcd started here on loopback, real
//! `kvpool` masters campaigning on it, a real storage node and clients that
//! follow the leader through it. Skipped (loudly) without /usr/bin/etcd,
//! unless KVPOOL_REQUIRE_ETCD=1 (what .ci/run sets).

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{value, Proc, Signal};
use kvpool_client::{Client, ClientConfig, ErrorCode};
use kvpool_transport::proto::{call, PutOptions, Tier};

const ETCD: &str = "/usr/bin/etcd";

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
    if !std::path::Path::new(ETCD).exists() {
        if std::env::var("KVPOOL_REQUIRE_ETCD").is_ok_and(|v| v == "1") {
            panic!("{ETCD} not found, and KVPOOL_REQUIRE_ETCD=1 requires it (apt-get install etcd-server)");
        }
        println!("skip: {ETCD} not found (apt-get install etcd-server); the HA tests did not run");
        return None;
    }
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
    let child = Command::new(ETCD)
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
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((200, body)) = try_get(&e.client, "/health") {
            if body.contains("true") {
                return Some(e);
            }
        }
        assert!(
            Instant::now() < end,
            "etcd did not become healthy in 20 s; its log:\n{}",
            std::fs::read_to_string(e.dir.with_extension("log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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

/// The role a master's /healthz reports (`leader`, `standby`, `deposed`),
/// or "" when it does not answer.
fn role_of(m: &Proc) -> String {
    match try_get(&m.http, "/healthz") {
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
    loop {
        if role_of(m) == role {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "master {} is not {role} after {within:?} (healthz: {:?}); stderr:\n{}",
            m.addr,
            try_get(&m.http, "/healthz"),
            m.stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `done` every 20 ms until it holds; fails the test after `within`.
fn poll_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !done() {
        assert!(
            Instant::now() < end,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn client_config(secret: &str) -> ClientConfig {
    ClientConfig {
        secret: kvpool_config::Secret::new(secret.to_string()),
        timeout_ms: 5_000,
        ..Default::default()
    }
}

/// Polls `f` until it is `Some`, for at most `within`.
async fn eventually<T, F, Fut>(what: &str, within: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let end = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) => assert!(Instant::now() < end, "{what} within {within:?}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether an error says clearly why a put did not finish across a
/// failover: the master was gone, not the leader, or out of time; or the new
/// leader had no segment yet (`NoSpace` until the node's next ping remounts
/// it, docs/RELIABILITY.md).
fn clear_failover_error(e: &kvpool_client::KvError) -> bool {
    matches!(
        e.code,
        ErrorCode::Unavailable | ErrorCode::Timeout | ErrorCode::NotLeader | ErrorCode::NoSpace
    ) && !e.message.is_empty()
}

#[test]
fn the_leader_killed_under_eight_clients_a_standby_leads_and_nvme_objects_read_back() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url();
    let mcfg = master_config("ha-kill-master", "");
    let a = start_master(&url, &mcfg);
    wait_role(&a, "leader", Duration::from_secs(10));
    let b = start_master(&url, &mcfg);
    wait_role(&b, "standby", Duration::from_secs(10));

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
            eventually("an NVMe copy", Duration::from_secs(20), || async {
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
    let stop = Arc::new(AtomicBool::new(false));
    let killed_at = Arc::new(Mutex::new(None::<Instant>));
    let led_at = Arc::new(Mutex::new(None::<Instant>));
    // Writers whose first put has ended, and puts Ok after the standby led.
    let under_way = Arc::new(AtomicUsize::new(0));
    let ok_after_led = Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = (0..8u64)
        .map(|w| {
            let url = url.clone();
            let stop = stop.clone();
            let led_at = led_at.clone();
            let under_way = under_way.clone();
            let ok_after_led = ok_after_led.clone();
            std::thread::spawn(move || {
                let rt = common::rt();
                rt.block_on(async move {
                    let c = Client::connect(&url, client_config("")).await.unwrap();
                    // (key, value seed) of each put that returned Ok after
                    // the standby led; the errors, each with its text.
                    let mut ok_after = Vec::new();
                    let mut errors = Vec::new();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let seed = 1_000_000 * (w + 1) + i;
                        let key = format!("live-{w}-{i}");
                        i += 1;
                        let started = Instant::now();
                        match c
                            .put(key.as_bytes(), &value(seed, 4096 + (i as usize % 7) * 1000))
                            .await
                        {
                            Ok(()) => {
                                let led = *led_at.lock().unwrap();
                                if led.is_some_and(|t| started > t) {
                                    ok_after.push((key, seed, 4096 + (i as usize % 7) * 1000));
                                    ok_after_led.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            Err(e) => errors.push(e),
                        }
                        if i == 1 {
                            under_way.fetch_add(1, Ordering::Relaxed);
                        }
                        // Paced, so the pool does not fill up meanwhile.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    (ok_after, errors)
                })
            })
        })
        .collect();
    // The kill comes once every writer is putting.
    poll_until("all 8 writers putting", Duration::from_secs(20), || {
        under_way.load(Ordering::Relaxed) == 8
    });

    let mut a = a;
    a.signal(Signal::KILL);
    *killed_at.lock().unwrap() = Some(Instant::now());
    a.wait_exit(Duration::from_secs(10))
        .expect("the leader died");
    let took = wait_role(&b, "leader", Duration::from_secs(10));
    *led_at.lock().unwrap() = Some(Instant::now());
    println!("a standby led {took:?} after the leader was killed");

    rt.block_on(async {
        // Every object complete before the kill had an NVMe copy: all read
        // back byte-exact once the node has remounted on the new leader.
        for i in 0..n {
            let key = format!("obj-{i}");
            let got = eventually("a read after failover", Duration::from_secs(20), || async {
                c.get(key.as_bytes()).await.map_err(|e| e.to_string())
            })
            .await;
            assert_eq!(got, value(i, len(i)), "{key} after failover");
        }
        assert_eq!(c.master_addr(), b.addr, "the client follows the new leader");
    });

    // Writers go on on the new leader until some of their puts landed there.
    poll_until(
        "8 puts Ok on the new leader",
        Duration::from_secs(30),
        || ok_after_led.load(Ordering::Relaxed) >= 8,
    );
    stop.store(true, Ordering::Relaxed);
    let mut after = 0;
    rt.block_on(async {
        for w in writers {
            let (ok_after, errors) = w.join().expect("a writer panicked");
            for e in &errors {
                assert!(clear_failover_error(e), "a put failed unclearly: {e}");
            }
            for (key, seed, l) in ok_after {
                let got = c.get(key.as_bytes()).await.unwrap();
                assert_eq!(got, value(seed, l), "{key}, put after the failover");
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
    let security = format!("[security]\nsecret = \"{secret}\"\n");
    let mcfg = master_config("ha-stall-master", &security);
    let a = start_master(&url, &mcfg);
    wait_role(&a, "leader", Duration::from_secs(10));
    let b = start_master(&url, &mcfg);
    wait_role(&b, "standby", Duration::from_secs(10));
    let scfg = common::config_file("ha-stall-storage", &security);
    let _node = common::start_storage(&url, "64MiB", &["--config", &scfg]);
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

    // The new leader hands out the pool's space again (it knows no DRAM
    // object of the old one): fill it with objects of its own.
    let n = 64u64;
    let c = rt.block_on(async {
        let c = Client::connect(&url, tcp.clone()).await.unwrap();
        assert_eq!(c.master_addr(), b.addr);
        for i in 0..n {
            let key = format!("new-{i}");
            eventually(
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
    });
    // The old leader learns it lost the lease and says so.
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some((503, body)) = try_get(&a.http, "/healthz") {
            if body.contains("deposed") {
                break;
            }
        }
        assert!(
            Instant::now() < end,
            "the old leader never reported deposed: {:?}",
            try_get(&a.http, "/healthz")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(role_of(&b), "leader");
}
