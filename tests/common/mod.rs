//! Helpers for tests that run the real `kvpool` binary on 127.0.0.1.

#![allow(dead_code)] // each test binary uses a different subset of the helpers

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod cluster;
#[allow(unused_imports)] // not every test binary starts a cluster
pub use cluster::{Cluster, Node};

pub const BIN: &str = env!("CARGO_BIN_EXE_kvpool");

/// A running `kvpool run` process; killed when dropped.
pub struct Proc {
    pub child: Child,
    /// The address from its `listening on` line.
    pub addr: String,
    /// Its HTTP address (from `kvpool http listening on`).
    pub http: String,
    /// Its RESP address (from `kvpool resp listening on`), "" if none.
    pub resp: String,
    pub role: &'static str,
    stderr_path: PathBuf,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: Signal) {
        let pid = Pid::from_raw(self.pid()).expect("child pid");
        kill_process(pid, sig).unwrap_or_else(|e| panic!("kill({pid:?}, {sig:?}): {e}"));
    }

    /// Stops the process (SIGSTOP) and waits until every thread of it is
    /// stopped: signal delivery is asynchronous.
    pub fn freeze(&self) {
        self.signal(Signal::STOP);
        let end = Instant::now() + Duration::from_secs(5);
        let tasks = format!("/proc/{}/task", self.pid());
        loop {
            let all_stopped = std::fs::read_dir(&tasks)
                .map(|d| {
                    d.flatten().all(|t| {
                        std::fs::read_to_string(t.path().join("stat"))
                            .ok()
                            .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('T')))
                            .unwrap_or(false)
                    })
                })
                .unwrap_or(false);
            if all_stopped {
                return;
            }
            assert!(Instant::now() < end, "process {} did not stop", self.pid());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for the process to exit, with a deadline.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The last `n` lines of its log, last line first (for a failure's
    /// message).
    pub fn stderr_tail(&self, n: usize) -> String {
        let log = self.stderr();
        log.lines().rev().take(n).collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.stderr_path);
    }
}

pub use rustix::process::Signal;
use rustix::process::{kill_process, Pid};

/// Starts `kvpool run --role <role> <args>` and waits (bounded) for its
/// `kvpool <role> listening on ADDR` line.
pub fn start(role: &'static str, args: &[&str]) -> Proc {
    start_env(role, args, &[])
}

/// [`start`] with extra environment variables. Role `all` runs without its
/// serving path (`--no-serving`): the store's tests need the pool alone, and
/// fixed serving ports would collide between tests; [`start_lines`] runs it
/// whole.
pub fn start_env(role: &'static str, args: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut a: Vec<&str> = Vec::new();
    if role == "all" {
        a.push("--no-serving");
    }
    a.extend_from_slice(args);
    start_lines(role, &a, env, &[]).0
}

/// Starts `kvpool run --role <role> <args>` as given, waits (bounded) for
/// its `kvpool <role> listening on ADDR` line, and returns the addresses of
/// the lines `kvpool <name> listening on ADDR` for each of `names` printed
/// before it.
pub fn start_lines(
    role: &'static str,
    args: &[&str],
    env: &[(&str, &str)],
    names: &[&str],
) -> (Proc, std::collections::HashMap<String, String>) {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("KVPOOL_SECRET").envs(env.iter().copied());
    spawn_ready(cmd, role, args, names)
}

/// Runs `cmd` (the `kvpool` binary, or a wrapper that execs it, such as
/// `ip netns exec NS kvpool`) with `run --role <role> <args>`, stderr to a
/// log file, and waits (bounded) for its `kvpool <role> listening on ADDR`
/// line, as [`start_lines`] does.
pub fn spawn_ready(
    mut cmd: Command,
    role: &'static str,
    args: &[&str],
    names: &[&str],
) -> (Proc, std::collections::HashMap<String, String>) {
    let stderr_path = std::env::temp_dir().join(format!(
        "kvpool-test-{}-{}-{}.log",
        role,
        std::process::id(),
        rand::random::<u32>()
    ));
    let stderr = std::fs::File::create(&stderr_path).expect("stderr log file");
    if !cmd.get_envs().any(|(k, _)| k == "RUST_LOG") {
        cmd.env("RUST_LOG", "info");
    }
    let mut child = cmd
        .arg("run")
        .arg("--role")
        .arg(role)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("spawn kvpool");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    let want = format!("kvpool {role} listening on ");
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    std::thread::spawn(move || {
        let mut http = String::new();
        let mut found = std::collections::HashMap::new();
        let mut resp = String::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(addr) = line.strip_prefix("kvpool http listening on ") {
                http = addr.trim().to_string();
            }
            for n in &names {
                if let Some(addr) = line.strip_prefix(&format!("kvpool {n} listening on ")) {
                    found.insert(n.clone(), addr.trim().to_string());
                }
            }
            if let Some(addr) = line.strip_prefix("kvpool resp listening on ") {
                resp = addr.trim().to_string();
            }
            if let Some(addr) = line.strip_prefix(&want) {
                let _ = tx.send((
                    addr.trim().to_string(),
                    http.clone(),
                    resp.clone(),
                    found.clone(),
                ));
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok((addr, http, resp, found)) => (
            Proc {
                child,
                addr,
                http,
                resp,
                role,
                stderr_path,
            },
            found,
        ),
        Err(e) => {
            let _ = child.kill();
            let status = child.wait().ok();
            let log = std::fs::read_to_string(&stderr_path).unwrap_or_default();
            let why = match e {
                mpsc::RecvTimeoutError::Timeout => "did not become ready within 30 s".to_string(),
                mpsc::RecvTimeoutError::Disconnected => {
                    format!("exited ({status:?}) before it was ready")
                }
            };
            panic!("kvpool {role} {why}; stderr:\n{log}");
        }
    }
}

/// Common flags: ephemeral ports, 2 shards, no pinning (tests share cores).
pub fn ephemeral(extra: &[&'static str]) -> Vec<&'static str> {
    let mut v = vec![
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--shards",
        "2",
    ];
    v.extend_from_slice(extra);
    v
}

/// Runs a CLI command against `master`; returns (exit code, stdout, stderr).
pub fn cli(master: &str, args: &[&str], stdin: Option<&[u8]>) -> (i32, Vec<u8>, String) {
    cli_env(master, args, stdin, &[])
}

/// [`cli`] with extra environment variables.
pub fn cli_env(
    master: &str,
    args: &[&str],
    stdin: Option<&[u8]>,
    env: &[(&str, &str)],
) -> (i32, Vec<u8>, String) {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("KVPOOL_SECRET")
        .envs(env.iter().copied())
        .arg("--master")
        .arg(master)
        .args(args);
    run_command(&mut cmd, stdin, Duration::from_secs(60))
}

/// Runs `cmd` with `stdin` (fed from a thread, so a command that answers
/// before reading all of it cannot block us); returns (exit code, stdout,
/// stderr). A command still running after `within` fails the test.
pub fn run_command(
    cmd: &mut Command,
    stdin: Option<&[u8]>,
    within: Duration,
) -> (i32, Vec<u8>, String) {
    use std::io::Write;
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn a command");
    if let Some(data) = stdin {
        let mut s = child.stdin.take().expect("stdin");
        let data = data.to_vec();
        std::thread::spawn(move || {
            let _ = s.write_all(&data);
        });
    }
    let out = wait_output(child, within);
    (
        out.status.code().unwrap_or(-1),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `wait_with_output` with a deadline: a hung CLI fails the test.
pub fn wait_output(child: Child, within: Duration) -> std::process::Output {
    let (tx, rx) = mpsc::channel();
    let pid = child.id() as i32;
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(out) => out.expect("wait_with_output"),
        Err(_) => {
            if let Some(pid) = Pid::from_raw(pid) {
                let _ = kill_process(pid, Signal::KILL);
            }
            panic!("command did not finish within {within:?}");
        }
    }
}

/// A tokio runtime for client-library tests.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// A plain HTTP/1.1 request; returns (status, body).
pub fn http(addr: &str, method: &str, path: &str) -> (u16, String) {
    http_with(addr, method, path, "")
}

/// [`http`] with extra header lines (each ending in `\r\n`).
pub fn http_with(addr: &str, method: &str, path: &str, headers: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect http");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read http answer");
    let (head, body) = out.split_once("\r\n\r\n").expect("http answer");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status code");
    (status, body.to_string())
}

/// A value of `len` bytes that differs for every `i` (xorshift).
pub fn value(i: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A fresh directory on a real file system (O_DIRECT does not work on tmpfs).
pub fn scratch_dir(name: &str) -> PathBuf {
    let d =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes a config file into `dir`; returns its path.
pub fn write_config(dir: &std::path::Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

/// `kvpool run --role storage` on ephemeral ports, 2 shards, `size` of DRAM,
/// mounted at `master`; `extra` flags first (e.g. `--config FILE`).
pub fn start_storage(master: &str, size: &str, extra: &[&str]) -> Proc {
    start_storage_env(master, size, extra, &[])
}

/// [`start_storage`] with extra environment variables.
pub fn start_storage_env(master: &str, size: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut a: Vec<&str> = extra.to_vec();
    a.extend_from_slice(&[
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--shards",
        "2",
        "--master",
        master,
        "--segment-size",
        size,
    ]);
    start_env("storage", &a, env)
}

/// What one poll of [`eventually`] or [`eventually_blocking`] found: done
/// (with a value) or not yet (with why, for the failure message).
pub trait Outcome {
    type Done;
    fn outcome(self) -> Result<Self::Done, String>;
}

impl Outcome for bool {
    type Done = ();
    fn outcome(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err("not yet".into())
        }
    }
}

impl<T> Outcome for Option<T> {
    type Done = T;
    fn outcome(self) -> Result<T, String> {
        self.ok_or_else(|| "not yet".into())
    }
}

impl<T> Outcome for Result<T, String> {
    type Done = T;
    fn outcome(self) -> Result<T, String> {
        self
    }
}

/// Polls `f` every 20 ms until it is done and returns what it found; after
/// `within`, fails the test naming `what` and the last "not yet". The one
/// wait of the suite (a fixed sleep hides how long things take).
pub async fn eventually<O, F, Fut>(what: &str, within: Duration, mut f: F) -> O::Done
where
    O: Outcome,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = O>,
{
    let end = Instant::now() + within;
    loop {
        match f().await.outcome() {
            Ok(v) => return v,
            Err(e) => assert!(Instant::now() < end, "{what}: not within {within:?}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`eventually`] on a thread without a runtime.
pub fn eventually_blocking<O: Outcome>(
    what: &str,
    within: Duration,
    mut f: impl FnMut() -> O,
) -> O::Done {
    let end = Instant::now() + within;
    loop {
        match f().outcome() {
            Ok(v) => return v,
            Err(e) => assert!(Instant::now() < end, "{what}: not within {within:?}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A put that waits while the pool is full (`NoSpace`) and demotions or
/// evictions catch up, as a cache's client does: at most 30 s.
pub async fn put_patiently(c: &kvpool_client::Client, key: &str, v: &[u8]) {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        match c.put(key.as_bytes(), v).await {
            Ok(()) => return,
            Err(e) if e.code == kvpool_wire::ErrorCode::NoSpace && Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("put {key}: {e}"),
        }
    }
}

/// The value of one series of the `/metrics` of the process at `http`, as
/// printed (its name and labels, e.g.
/// `kvpool_master_calls_total{op="put_start",result="error"}`); 0 while it
/// is not there (a labelled counter appears with its first count).
pub fn series(http: &str, series: &str) -> f64 {
    let (_, text) = self::http(http, "GET", "/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().expect("a number"))
}

/// The value of one series of the `/metrics` of the process at `http`
/// (its name and labels as printed, a counter's with its `_total`), which
/// must be there: a series renamed or gone fails the test, naming it,
/// rather than reading as 0.
pub fn metric(http: &str, series: &str) -> f64 {
    let (status, text) = self::http(http, "GET", "/metrics");
    assert_eq!(status, 200, "GET /metrics of {http}: {text}");
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().expect("a number"))
        .unwrap_or_else(|| panic!("no series {series} at {http}:\n{text}"))
}

/// The master's `put_start` calls answered with an error (a put told to
/// wait: `TryAgain`, `ReplicaNotReady`) so far.
pub const PUT_START_ERRORS: &str = "kvpool_master_calls_total{op=\"put_start\",result=\"error\"}";

/// Puts `after-0..20` (100,000 bytes each) and fails if any of them got a
/// replica on segment `drained` (a segment being drained takes no put).
pub async fn puts_avoid(c: &kvpool_client::Client, drained: u64) {
    for i in 0..20 {
        let key = format!("after-{i}");
        c.put(key.as_bytes(), &value(i, 100_000)).await.unwrap();
        let info = c.describe(key.as_bytes()).await.unwrap();
        assert!(
            info.replicas.iter().all(|r| r.segment_id != drained),
            "{key} was placed on the drained segment: {info:?}"
        );
    }
}

/// `127.0.0.1:PORT` with `n` free ports from PORT on, outside the kernel's
/// ephemeral range (32768..), so that a process restarted on the same
/// address does not find it taken by another test's outgoing connection.
pub fn fixed_addr(n: u16) -> String {
    for _ in 0..200 {
        let base = 20_000 + (rand::random::<u16>() % 10_000);
        let held: Vec<_> = (0..n)
            .map_while(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).ok())
            .collect();
        if held.len() == n as usize {
            return format!("127.0.0.1:{base}");
        }
    }
    panic!("no block of {n} free ports in 20000..30000");
}

/// Writes `text` to a fresh config file in the temp directory; returns its path.
pub fn config_file(tag: &str, text: &str) -> String {
    let p = std::env::temp_dir().join(format!(
        "kvpool-test-{tag}-{}-{}.toml",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

/// A pool for engines: role all (no serving path), 256 MiB.
pub fn engine_pool() -> Proc {
    start("all", &ephemeral(&["--segment-size", "256MiB"]))
}

/// `kvpool run --role engine --model builtin:tiny` on a free port, with
/// the pool at `master` when given.
pub fn tiny_engine(master: Option<&str>, config: &str) -> Proc {
    let mut args = vec![
        "--model",
        "builtin:tiny",
        "--listen",
        "127.0.0.1:0",
        "--config",
        config,
    ];
    if let Some(m) = master {
        args.extend(["--master", m]);
    }
    start("engine", &args)
}

/// BOS (256) then `n - 1` pseudo-random bytes.
pub fn byte_prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = vec![256u32];
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push((x % 256) as u32);
    }
    v
}

/// Whether tests must fail, not skip, when a tool they drive is missing
/// (`.ci/run` sets `KVPOOL_REQUIRE_EXTERNAL=1` after installing them).
fn external_required() -> bool {
    std::env::var("KVPOOL_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1")
}

/// Says a test did not run, and why: `skip: <why>` on stderr, written past
/// the test harness's capture, so that a plain `cargo test` shows it.
pub fn say_skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "skip: {why}");
}

/// Says a tool is missing: prints `skip: <what> not found` and returns
/// `None`, or fails the test when `KVPOOL_REQUIRE_EXTERNAL=1`.
fn missing<T>(what: &str) -> Option<T> {
    if external_required() {
        panic!("{what} not found, and KVPOOL_REQUIRE_EXTERNAL=1 requires it");
    }
    say_skip(&format!("{what} not found"));
    None
}

/// The path of `name` on PATH, if it is there.
pub fn on_path(name: &str) -> Option<String> {
    let paths = std::env::var_os("PATH")?;
    let mut found = std::env::split_paths(&paths).map(|d| d.join(name));
    let path = found.find(|p| p.is_file())?;
    Some(path.to_string_lossy().into_owned())
}

/// The path of `name` on PATH (a tool nobody here wrote: redis-cli,
/// redis-benchmark, redis-server), or a skip (see [`missing`]).
pub fn external_tool(name: &str) -> Option<String> {
    on_path(name).or_else(|| missing(name))
}

/// A Python with the `redis` package (redis-py): `KVPOOL_PYTHON` (what
/// `.ci/run` sets up), else `python3` if it has the package; or a skip.
pub fn python_with_redis() -> Option<String> {
    let py = std::env::var("KVPOOL_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import redis"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Some(py)
    } else {
        missing(&format!("python with the redis package ({py})"))
    }
}

/// Writes one frame on `s`; reads the answer: the response, or the error
/// code of an error frame, or `Unavailable` when the peer closed instead.
/// (A data read's bytes follow its `Data` answer on `s`.)
pub fn exchange<Q: kvpool_wire::frame::Payload, A: kvpool_wire::frame::Payload>(
    s: &mut std::net::TcpStream,
    kind: kvpool_wire::frame::FrameKind,
    id: u64,
    req: &Q,
    payload: &[u8],
) -> Result<A, kvpool_wire::ErrorCode> {
    use kvpool_wire::frame::{self, FrameHeader, FrameKind, HEADER_LEN};
    use kvpool_wire::ErrorCode;
    use std::io::{Read, Write};
    let mut bytes = frame::encode(kind, id, req);
    bytes.extend_from_slice(payload);
    if s.write_all(&bytes).is_err() {
        return Err(ErrorCode::Unavailable);
    }
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head)
        .map_err(|_| ErrorCode::Unavailable)?;
    let hdr = FrameHeader::decode(&head, u32::MAX).unwrap();
    let mut p = frame::AlignedVec::<16>::new();
    p.resize(hdr.len as usize, 0);
    s.read_exact(&mut p).unwrap();
    if hdr.kind == FrameKind::Error {
        let e: kvpool_wire::proto::WireError = frame::decode(&p).unwrap();
        return Err(ErrorCode::from_code(e.code));
    }
    Ok(frame::decode(&p).unwrap())
}
