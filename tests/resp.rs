//! The Redis protocol front (`--resp`, role gateway) against real clients
//! nobody here wrote (redis-cli, redis-benchmark, redis-py: installed by
//! `.ci/run`; without them these tests print `skip: <tool> not found`
//! unless `KVPOOL_REQUIRE_EXTERNAL=1`), and raw sockets for what no client
//! sends on purpose (malformed requests, limits).

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

use std::time::{Duration, Instant};

use common::Proc;

/// Role all with a RESP listener on an ephemeral port; `config` (TOML) is
/// written to a file first when given.
fn pool_with_resp(config: Option<&str>, extra: &[&str]) -> Proc {
    // A folder per call: the tests run at once in one process, and a shared
    // one was emptied under a pool that had not read its config yet.
    let dir = common::scratch_dir(&format!("resp-cfg-{}", rand::random::<u32>()));
    let mut args: Vec<&str> =
        common::ephemeral(&["--segment-size", "256MiB", "--resp", "127.0.0.1:0"]);
    let path;
    if let Some(text) = config {
        path = common::write_config(&dir, &format!("{}.toml", rand::random::<u32>()), text);
        args.push("--config");
        args.push(&path);
    }
    args.extend_from_slice(extra);
    let p = common::start("all", &args);
    assert!(!p.resp.is_empty(), "no `kvpool resp listening on` line");
    p
}

/// A reply as the wire carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
    /// RESP3's `_`.
    Null,
    /// RESP3's `%`.
    Map(Vec<(Reply, Reply)>),
}

/// A raw RESP connection (for requests no client library sends).
struct Raw {
    r: BufReader<TcpStream>,
}

impl Raw {
    fn connect(addr: &str) -> Self {
        let s = TcpStream::connect(addr).expect("connect resp");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Self {
            r: BufReader::new(s),
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.r.get_mut().write_all(bytes).expect("send");
    }

    fn cmd(&mut self, args: &[&[u8]]) -> Reply {
        self.send(&encode(args));
        self.reply()
    }

    fn line(&mut self) -> String {
        let mut l = Vec::new();
        self.r.read_until(b'\n', &mut l).expect("read reply line");
        assert!(l.ends_with(b"\r\n"), "bad line {l:?}");
        String::from_utf8(l[..l.len() - 2].to_vec()).unwrap()
    }

    fn reply(&mut self) -> Reply {
        let l = self.line();
        let (t, rest) = l.split_at(1);
        match t {
            "+" => Reply::Simple(rest.into()),
            "-" => Reply::Error(rest.into()),
            ":" => Reply::Int(rest.parse().unwrap()),
            "$" => {
                let n: i64 = rest.parse().unwrap();
                if n < 0 {
                    return Reply::Bulk(None);
                }
                let mut v = vec![0u8; n as usize + 2];
                self.r.read_exact(&mut v).expect("bulk");
                assert_eq!(&v[n as usize..], b"\r\n");
                v.truncate(n as usize);
                Reply::Bulk(Some(v))
            }
            "*" => {
                let n: i64 = rest.parse().unwrap();
                if n < 0 {
                    return Reply::Array(None);
                }
                Reply::Array(Some((0..n).map(|_| self.reply()).collect()))
            }
            "_" => Reply::Null,
            "%" => {
                let n: usize = rest.parse().unwrap();
                Reply::Map((0..n).map(|_| (self.reply(), self.reply())).collect())
            }
            _ => panic!("bad reply line {l:?}"),
        }
    }

    /// Waits (bounded) for the server to close the connection; returns what
    /// came before the close.
    fn until_closed(&mut self, within: Duration) -> Vec<u8> {
        self.r.get_ref().set_read_timeout(Some(within)).unwrap();
        let mut rest = Vec::new();
        match self.r.read_to_end(&mut rest) {
            Ok(_) => rest,
            Err(e) => panic!("the connection was not closed within {within:?}: {e}"),
        }
    }
}

fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn ok() -> Reply {
    Reply::Simple("OK".into())
}

fn bulk(v: &[u8]) -> Reply {
    Reply::Bulk(Some(v.to_vec()))
}

fn port_of(addr: &str) -> &str {
    addr.rsplit_once(':').expect("host:port").1
}

use common::run_command as run_tool;

#[test]
fn redis_cli_moves_a_16_mib_file_byte_exact_and_answers_exists_and_del() {
    let Some(cli) = common::external_tool("redis-cli") else {
        return;
    };
    let p = pool_with_resp(None, &[]);
    let port = port_of(&p.resp);
    let file = common::value(7, 16 << 20);
    let rc = |args: &[&str], stdin: Option<&[u8]>| {
        let mut c = Command::new(&cli);
        c.args(["-p", port]).args(args);
        run_tool(&mut c, stdin, Duration::from_secs(60))
    };
    let (st, out, err) = rc(&["-x", "set", "file"], Some(&file));
    assert_eq!((st, out.as_slice()), (0, &b"OK\n"[..]), "{err}");
    let (st, out, err) = rc(&["--raw", "get", "file"], None);
    assert_eq!(st, 0, "{err}");
    // --raw prints the value, then a newline.
    assert_eq!(out.len(), file.len() + 1);
    assert!(out[..file.len()] == file[..], "GET returned other bytes");
    let (_, out, _) = rc(&["strlen", "file"], None);
    assert_eq!(out, format!("{}\n", 16 << 20).as_bytes());
    let (_, out, _) = rc(&["exists", "file", "nope", "file"], None);
    assert_eq!(out, b"2\n");
    let (_, out, _) = rc(&["del", "file", "nope"], None);
    assert_eq!(out, b"1\n");
    let (_, out, _) = rc(&["exists", "file"], None);
    assert_eq!(out, b"0\n");
    let (_, out, _) = rc(&["get", "file"], None);
    assert_eq!(out, b"\n", "a miss prints nothing (nil)");
}

#[test]
fn redis_cli_pipe_mode_runs_pipelined_input_in_order() {
    let Some(cli) = common::external_tool("redis-cli") else {
        return;
    };
    let p = pool_with_resp(None, &[]);
    // 2000 SETs then DELs of every other key, all in one pipelined stream.
    let mut input = Vec::new();
    for i in 0..2000u32 {
        let v = common::value(i as u64, 100 + i as usize % 900);
        input.extend(encode(&[b"SET", format!("pk{i}").as_bytes(), &v]));
    }
    for i in (0..2000u32).step_by(2) {
        input.extend(encode(&[b"DEL", format!("pk{i}").as_bytes()]));
    }
    let mut c = Command::new(&cli);
    c.args(["-p", port_of(&p.resp), "--pipe"]);
    let (st, out, err) = run_tool(&mut c, Some(&input), Duration::from_secs(120));
    let out = String::from_utf8_lossy(&out);
    assert_eq!(st, 0, "{out} {err}");
    assert!(out.contains("errors: 0, replies: 3000"), "{out}");
    let mut raw = Raw::connect(&p.resp);
    for i in [0u32, 1, 998, 999, 1999] {
        let got = raw.cmd(&[b"GET", format!("pk{i}").as_bytes()]);
        if i % 2 == 0 {
            assert_eq!(got, Reply::Bulk(None), "pk{i} was deleted");
        } else {
            assert_eq!(
                got,
                bulk(&common::value(i as u64, 100 + i as usize % 900)),
                "pk{i}"
            );
        }
    }
    // The same over one raw connection, replies checked one by one.
    let mut req = Vec::new();
    for i in 0..200u32 {
        req.extend(encode(&[b"GET", format!("pk{i}").as_bytes()]));
        req.extend(encode(&[b"PING"]));
    }
    raw.send(&req);
    for i in 0..200u32 {
        let want = if i % 2 == 0 {
            Reply::Bulk(None)
        } else {
            bulk(&common::value(i as u64, 100 + i as usize % 900))
        };
        assert_eq!(raw.reply(), want, "GET pk{i}");
        assert_eq!(raw.reply(), Reply::Simple("PONG".into()));
    }
}

#[test]
fn redis_cli_interactive_mode_starts_runs_commands_and_shows_help() {
    let Some(cli) = common::external_tool("redis-cli") else {
        return;
    };
    let Ok(py) = which_python() else {
        return;
    };
    let p = pool_with_resp(None, &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/resp/cli_interactive.py");
    let mut c = Command::new(py);
    c.args([script, &cli, port_of(&p.resp)]);
    let (st, out, err) = run_tool(&mut c, None, Duration::from_secs(60));
    assert_eq!(st, 0, "{}{err}", String::from_utf8_lossy(&out));
}

/// Any python 3 (the pty script needs nothing else).
fn which_python() -> Result<String, ()> {
    if let Ok(p) = std::env::var("KVPOOL_PYTHON") {
        return Ok(p);
    }
    common::external_tool("python3").ok_or(())
}

#[test]
fn redis_benchmark_set_get_finishes_without_an_error() {
    let Some(bench) = common::external_tool("redis-benchmark") else {
        return;
    };
    let p = pool_with_resp(None, &[]);
    for extra in [
        &["-c", "4"][..],
        &["-c", "8", "-P", "16"],
        &["-c", "2", "-r", "1000", "-d", "4096"],
    ] {
        let mut c = Command::new(&bench);
        c.args([
            "-p",
            port_of(&p.resp),
            "-t",
            "set,get",
            "-n",
            "3000",
            "--csv",
        ])
        .args(extra);
        let (st, out, err) = run_tool(&mut c, None, Duration::from_secs(120));
        let out = String::from_utf8_lossy(&out);
        assert_eq!(st, 0, "{extra:?}: {out} {err}");
        assert!(
            out.contains("\"SET\"") && out.contains("\"GET\""),
            "{extra:?}: {out}"
        );
        assert!(!err.to_lowercase().contains("error"), "{extra:?}: {err}");
        // It reads `CONFIG GET save` and `appendonly` at start.
        assert!(
            !err.contains("Could not fetch server CONFIG"),
            "{extra:?}: {err}"
        );
    }
    // The server counted no failed SET or GET.
    let mut raw = Raw::connect(&p.resp);
    let Reply::Bulk(Some(info)) = raw.cmd(&[b"INFO", b"commandstats"]) else {
        panic!("INFO");
    };
    let info = String::from_utf8(info).unwrap();
    for cmd in ["set", "get"] {
        let line = info
            .lines()
            .find(|l| l.starts_with(&format!("cmdstat_{cmd}:")))
            .unwrap_or_else(|| panic!("no {cmd} in {info}"));
        assert!(line.ends_with("failed_calls=0"), "{line}");
    }
}

/// redis-benchmark's default run (no `-t`): it exits at the first error
/// reply, so every test of it needs its command: INCR, lists, sets,
/// hashes, sorted sets. What it leaves behind is checked too: 50
/// connections on both RESP threads INCR one counter, and none is lost.
#[test]
fn redis_benchmark_default_suite_completes() {
    let Some(bench) = common::external_tool("redis-benchmark") else {
        return;
    };
    let p = pool_with_resp(None, &[]);
    let n = 1000;
    let mut c = Command::new(&bench);
    c.args(["-p", port_of(&p.resp), "-n", &n.to_string(), "--csv"]);
    let (st, out, err) = run_tool(&mut c, None, Duration::from_secs(300));
    let out = String::from_utf8_lossy(&out);
    assert_eq!(st, 0, "{out} {err}");
    for test in [
        "PING_INLINE",
        "PING_MBULK",
        "SET",
        "GET",
        "INCR",
        "LPUSH",
        "RPUSH",
        "LPOP",
        "RPOP",
        "SADD",
        "HSET",
        "SPOP",
        "ZADD",
        "ZPOPMIN",
        "LRANGE_100 (first 100 elements)",
        "LRANGE_600 (first 600 elements)",
        "MSET (10 keys)",
    ] {
        assert!(out.contains(&format!("\"{test}\"")), "no {test} in {out}");
    }
    let mut raw = Raw::connect(&p.resp);
    // Every INCR counted, though the connections were spread over the RESP
    // threads (one per shard).
    assert_eq!(
        raw.cmd(&[b"GET", b"counter:__rand_int__"]),
        bulk(n.to_string().as_bytes())
    );
    // LPUSH, RPUSH, LPOP, RPOP n each, then n LPUSHes for the LRANGEs.
    assert_eq!(raw.cmd(&[b"LLEN", b"mylist"]), Reply::Int(n));
    assert_eq!(raw.cmd(&[b"TYPE", b"mylist"]), Reply::Simple("list".into()));
    assert_eq!(raw.cmd(&[b"HLEN", b"myhash"]), Reply::Int(1));
    let Reply::Bulk(Some(info)) = raw.cmd(&[b"INFO", b"commandstats"]) else {
        panic!("INFO");
    };
    let info = String::from_utf8(info).unwrap();
    for line in info.lines().filter(|l| l.starts_with("cmdstat_")) {
        assert!(line.ends_with("failed_calls=0"), "{line}");
    }
}

#[test]
fn redis_py_mget_mset_auth_binary_keys_and_pipelines() {
    let Some(py) = common::python_with_redis() else {
        return;
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/resp/redis_py.py");
    let run = |port: &str, password: Option<&str>, protocol: &str| {
        let mut c = Command::new(&py);
        c.args([script, port])
            .args(password)
            .env("REDIS_PROTOCOL", protocol);
        let (st, out, err) = run_tool(&mut c, None, Duration::from_secs(180));
        let out = String::from_utf8_lossy(&out).into_owned();
        assert_eq!(st, 0, "RESP{protocol}: {out}{err}");
        assert!(out.starts_with("ok: "), "{out}");
        println!("redis-py, protocol {protocol}: {}", out.trim());
    };
    // Without a password, then with one; RESP2, RESP3, and what this
    // redis-py asks for by itself (RESP3 from redis-py 8 on).
    let open = pool_with_resp(None, &[]);
    for protocol in ["2", "3", "default"] {
        run(port_of(&open.resp), None, protocol);
    }
    drop(open);
    let locked = pool_with_resp(Some("[resp]\nrequirepass = \"s3cret pass\"\n"), &[]);
    for protocol in ["2", "default"] {
        run(port_of(&locked.resp), Some("s3cret pass"), protocol);
    }
}

#[test]
fn a_malformed_request_closes_only_its_own_connection_with_an_error() {
    let p = pool_with_resp(None, &[]);
    let mut good = Raw::connect(&p.resp);
    assert_eq!(good.cmd(&[b"SET", b"k", b"v"]), ok());
    for (bad, want) in [
        (
            &b"*2\r\n$3\r\nGET\r\n+k\r\n"[..],
            "-ERR Protocol error: expected '$', got '+'\r\n",
        ),
        (
            b"*x\r\n",
            "-ERR Protocol error: invalid multibulk length\r\n",
        ),
        (
            b"*1\r\n$-7\r\n",
            "-ERR Protocol error: invalid bulk length\r\n",
        ),
        (
            b"SET \"unbalanced\r\n",
            "-ERR Protocol error: unbalanced quotes in request\r\n",
        ),
    ] {
        let mut raw = Raw::connect(&p.resp);
        // A good command first: it is answered before the error.
        let mut req = encode(&[b"PING"]);
        req.extend_from_slice(bad);
        raw.send(&req);
        let rest = raw.until_closed(Duration::from_secs(10));
        let want = format!("+PONG\r\n{want}");
        assert_eq!(
            String::from_utf8_lossy(&rest),
            want,
            "{:?}",
            String::from_utf8_lossy(bad)
        );
        // The other connection noticed nothing.
        assert_eq!(good.cmd(&[b"GET", b"k"]), bulk(b"v"));
    }
    let (_, metrics) = common::http(&p.http, "GET", "/metrics");
    assert!(
        metrics.contains("kvpool_resp_protocol_errors_total 4"),
        "{metrics}"
    );
}

#[test]
fn limits_refuse_before_buffering_cap_clients_and_close_idle_ones() {
    let p = pool_with_resp(
        Some(
            "[resp]\nproto_max_bulk_len = \"1 MiB\"\nmax_query_buffer = \"2 MiB\"\n\
             max_clients = 3\nidle_timeout_ms = 1500\nio_timeout_ms = 1500\n",
        ),
        &[],
    );
    // A bulk over the limit is refused from its length line alone: none of
    // its bytes are sent, yet the error comes and the connection closes.
    let mut raw = Raw::connect(&p.resp);
    raw.send(format!("*3\r\n$3\r\nSET\r\n$1\r\nk\r\n${}\r\n", (1 << 20) + 1).as_bytes());
    let rest = raw.until_closed(Duration::from_secs(10));
    assert_eq!(rest, b"-ERR Protocol error: invalid bulk length\r\n");
    // One byte less than the limit plus one is fine: exactly the limit.
    let mut raw = Raw::connect(&p.resp);
    let v = common::value(1, 1 << 20);
    assert_eq!(raw.cmd(&[b"SET", b"max", &v]), ok());
    assert_eq!(raw.cmd(&[b"GET", b"max"]), bulk(&v));
    // A key longer than the pool's limit is an error, not a closed
    // connection.
    let long = vec![b'k'; 4097];
    let Reply::Error(e) = raw.cmd(&[b"SET", &long, b"v"]) else {
        panic!("a 4097-byte key was accepted");
    };
    assert!(e.contains("4096"), "{e}");
    let Reply::Error(e) = raw.cmd(&[b"GET", &long]) else {
        panic!("GET of a 4097-byte key was not an error");
    };
    assert!(e.contains("4096"), "{e}");
    assert_eq!(raw.cmd(&[b"PING"]), Reply::Simple("PONG".into()));
    drop(raw);
    // Clients up to the cap; one more gets Redis's error. First wait until
    // the server has counted the closed connections out.
    let mut probe = Raw::connect(&p.resp);
    common::eventually_blocking(
        "closed connections counted out",
        Duration::from_secs(10),
        || {
            let Reply::Bulk(Some(info)) = probe.cmd(&[b"INFO", b"clients"]) else {
                panic!("INFO clients");
            };
            let info = String::from_utf8_lossy(&info);
            if info.contains("connected_clients:1\r\n") {
                Ok(())
            } else {
                Err(format!("still counted: {info}"))
            }
        },
    );
    let mut held: Vec<Raw> = (0..2).map(|_| Raw::connect(&p.resp)).collect();
    for c in &mut held {
        assert_eq!(c.cmd(&[b"PING"]), Reply::Simple("PONG".into()));
    }
    held.push(probe);
    let mut extra = Raw::connect(&p.resp);
    assert_eq!(
        extra.until_closed(Duration::from_secs(10)),
        b"-ERR max number of clients reached\r\n"
    );
    let (_, metrics) = common::http(&p.http, "GET", "/metrics");
    assert!(
        metrics.contains("kvpool_resp_connections_rejected_total 1"),
        "{metrics}"
    );
    // Idle connections are closed at idle_timeout_ms; then there is room.
    let t = Instant::now();
    for c in &mut held {
        assert!(c.until_closed(Duration::from_secs(10)).is_empty());
    }
    assert!(
        t.elapsed() >= Duration::from_millis(1000),
        "{:?}",
        t.elapsed()
    );
    // A command that starts and never ends is cut at io_timeout_ms.
    let mut slow = Raw::connect(&p.resp);
    slow.send(b"*2\r\n$3\r\nGET\r\n$10\r\nabc");
    assert!(slow.until_closed(Duration::from_secs(10)).is_empty());
    let mut raw = Raw::connect(&p.resp);
    assert_eq!(raw.cmd(&[b"GET", b"max"]), bulk(&v));
}

/// The value of an unlabelled figure on `/metrics`.
#[test]
fn idle_sockets_cannot_lock_clients_out() {
    // Sockets that never send a command may stay io_timeout_ms, and at
    // max_clients a newcomer takes the place of the oldest of them; a
    // client that has run a command is never closed for one.
    let p = pool_with_resp(
        Some("[resp]\nmax_clients = 20\nmax_pending_per_peer = 0\nio_timeout_ms = 4000\n"),
        &[],
    );
    let pong = || Reply::Simple("PONG".into());
    let mut early = Raw::connect(&p.resp);
    assert_eq!(early.cmd(&[b"PING"]), pong());
    let t = Instant::now();
    let mut idle: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(&p.resp).expect("connect"))
        .collect();
    let mut late = Raw::connect(&p.resp);
    assert_eq!(late.cmd(&[b"PING"]), pong(), "a newcomer is let in");
    assert_eq!(early.cmd(&[b"PING"]), pong(), "an active client stays");
    // The oldest idle sockets were closed for the newer ones.
    let mut first = idle.remove(0);
    first
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(first.read(&mut byte).expect("closed, not timed out"), 0);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // The rest are closed at io_timeout_ms: they never ran a command.
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(s.read(&mut byte).expect("closed, not timed out"), 0);
    }
    assert!(
        t.elapsed() >= Duration::from_millis(3500),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(
        early.cmd(&[b"PING"]),
        pong(),
        "idle past io_timeout_ms, yet open"
    );
    assert_eq!(late.cmd(&[b"PING"]), pong());

    // One address may hold max_pending_per_peer connections that ran
    // nothing; one more is refused, a client that has run a command is not.
    let p = pool_with_resp(Some("[resp]\nmax_pending_per_peer = 5\n"), &[]);
    let held: Vec<TcpStream> = (0..5)
        .map(|_| TcpStream::connect(&p.resp).expect("connect"))
        .collect();
    let mut refused = Raw::connect(&p.resp);
    assert_eq!(
        refused.until_closed(Duration::from_secs(10)),
        &b"-ERR too many connections from this address that have not run a command yet \
           (resp.max_pending_per_peer)\r\n"[..]
    );
    drop(held);
    let mut ok_client = common::eventually_blocking(
        "a client served after the idle sockets closed",
        Duration::from_secs(10),
        || {
            let mut c = Raw::connect(&p.resp);
            c.send(&encode(&[b"PING"]));
            let mut first = [0u8; 1];
            c.r.get_ref()
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            match c.r.read_exact(&mut first) {
                Ok(()) if first[0] == b'+' => Ok(c),
                // The server had not yet counted the dropped sockets out.
                Ok(()) => Err(format!("still refused: first byte {:?}", first[0] as char)),
                Err(e) => Err(format!("still refused: {e}")),
            }
        },
    );
    assert_eq!(ok_client.line(), "PONG");
}

/// Finding 2 of the RESP/HTTP review: past its first 16 KiB a read buffer
/// grew by one byte per read when no bulk length was pending, so a large
/// pipeline or inline line was read a byte at a time (and rescanned each
/// time). It now doubles: a 20,000-pair MSET sent in one write grows the
/// buffer a handful of times.
#[test]
fn a_large_request_grows_the_read_buffer_geometrically() {
    let p = pool_with_resp(None, &[]);
    let mut raw = Raw::connect(&p.resp);
    let pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..20_000)
        .map(|i| (format!("g{i}").into_bytes(), format!("{i}").into_bytes()))
        .collect();
    let mut args: Vec<&[u8]> = vec![b"MSET"];
    for (k, v) in &pairs {
        args.push(k);
        args.push(v);
    }
    let req = encode(&args);
    assert!(req.len() > 400_000, "{}", req.len());
    let before = common::metric(&p.http, "kvpool_resp_buffer_grows_total");
    assert_eq!(raw.cmd(&args), ok());
    let grows = common::metric(&p.http, "kvpool_resp_buffer_grows_total") - before;
    // From 16 KiB to ~450 KB by at least half each time: 9 grows at most
    // (5 when each doubles).
    assert!(
        grows <= 9.0,
        "{grows} grows for one {} byte request",
        req.len()
    );
    assert_eq!(raw.cmd(&[b"GET", b"g19999"]), bulk(b"19999"));
}

/// Finding 5 of the RESP/HTTP review: with `requirepass` set, a client that
/// had not authenticated still got the full limits (`proto_max_bulk_len`
/// bulks, a million arguments, `max_query_buffer`, `idle_timeout_ms`).
/// Until AUTH it now gets Redis's: 10 arguments, 16 KiB bulks, and
/// `io_timeout_ms` to send each command.
#[test]
fn an_unauthenticated_client_gets_small_limits_until_auth() {
    let p = pool_with_resp(
        Some("[resp]\nrequirepass = \"opensesame\"\nio_timeout_ms = 1500\n"),
        &[],
    );
    for (bad, want) in [
        (
            &b"*2\r\n$4\r\nECHO\r\n$20000\r\n"[..],
            "-ERR Protocol error: unauthenticated bulk length\r\n",
        ),
        (
            b"*11\r\n",
            "-ERR Protocol error: unauthenticated multibulk length\r\n",
        ),
    ] {
        let mut raw = Raw::connect(&p.resp);
        raw.send(bad);
        assert_eq!(
            String::from_utf8_lossy(&raw.until_closed(Duration::from_secs(10))),
            want
        );
    }
    // AUTH lifts them, also for a command pipelined right behind it.
    let mut raw = Raw::connect(&p.resp);
    let v = common::value(5, 100_000);
    let mut req = encode(&[b"AUTH", b"opensesame"]);
    req.extend_from_slice(&encode(&[b"SET", b"big", &v]));
    raw.send(&req);
    assert_eq!(raw.reply(), ok());
    assert_eq!(raw.reply(), ok());
    assert_eq!(raw.cmd(&[b"GET", b"big"]), bulk(&v));
    // An authenticated connection idles up to idle_timeout_ms (ten
    // minutes here); one that never authenticated is closed after
    // io_timeout_ms.
    let mut idle = Raw::connect(&p.resp);
    assert_eq!(
        idle.cmd(&[b"PING"]),
        Reply::Error("NOAUTH Authentication required.".into())
    );
    assert!(idle.until_closed(Duration::from_secs(20)).is_empty());
    assert_eq!(raw.cmd(&[b"PING"]), Reply::Simple("PONG".into()));
}

/// Finding 8 of the RESP/HTTP review: empty requests (`*0`, `*-1`, blank
/// lines) were skipped but their bytes kept until a real command came, so
/// enough of them filled the query buffer and closed the connection with an
/// error. They are now dropped as they are parsed.
#[test]
fn empty_requests_are_dropped_as_they_come() {
    let p = pool_with_resp(
        Some("[resp]\nproto_max_bulk_len = \"64 KiB\"\nmax_query_buffer = \"128 KiB\"\n"),
        &[],
    );
    let mut raw = Raw::connect(&p.resp);
    // 200 KB of empty requests, well over the 128 KiB query buffer.
    let mut req = Vec::new();
    while req.len() < 200_000 {
        req.extend_from_slice(b"*0\r\n*-1\r\n\r\n");
    }
    raw.send(&req);
    assert_eq!(raw.cmd(&[b"PING"]), Reply::Simple("PONG".into()));
}

/// Finding 4 of the RESP/HTTP review: the parser's argument table (24 B an
/// argument) was outside `max_buffer_memory`: a request of a million empty
/// arguments is 6 MB on the wire and 24 MB of table, none of it counted.
/// The table is now charged to the budget (and shown in
/// `kvpool_resp_buffer_bytes`).
#[test]
fn the_argument_table_is_charged_to_the_buffer_budget() {
    let p = pool_with_resp(None, &[]);
    let mut raw = Raw::connect(&p.resp);
    // 600,000 arguments announced and sent (3.6 MB), the request unfinished.
    let mut req = b"*1048576\r\n$3\r\nDEL\r\n".to_vec();
    for _ in 0..600_000 {
        req.extend_from_slice(b"$0\r\n\r\n");
    }
    raw.send(&req);
    common::eventually_blocking(
        "the argument table charged to the buffer budget",
        Duration::from_secs(30),
        || {
            let held = common::metric(&p.http, "kvpool_resp_buffer_bytes");
            if held >= 600_000.0 * 24.0 {
                Ok(())
            } else {
                Err(format!("{held} bytes held for 600,000 arguments"))
            }
        },
    );
    drop(raw);
}

/// A large collection reply (LRANGE of a big list) is held from the
/// front's buffer budget until sent, as a GET's value is: past the budget
/// it is Redis's error, not memory the budget does not see.
#[test]
fn a_large_collection_reply_is_charged_to_the_buffer_budget() {
    let p = pool_with_resp(
        Some(
            "[resp]\nproto_max_bulk_len = \"1 MiB\"\nmax_query_buffer = \"2 MiB\"\n\
             max_buffer_memory = \"2 MiB\"\n",
        ),
        &[],
    );
    let mut raw = Raw::connect(&p.resp);
    let v = vec![b'x'; 512 * 1024];
    for n in 1..=6 {
        assert_eq!(raw.cmd(&[b"RPUSH", b"big", &v]), Reply::Int(n));
    }
    // 3 MiB of reply against a 2 MiB budget.
    let Reply::Error(e) = raw.cmd(&[b"LRANGE", b"big", b"0", b"-1"]) else {
        panic!("a 3 MiB LRANGE answered past a 2 MiB budget");
    };
    assert!(e.contains("resp.max_buffer_memory"), "{e}");
    // What fits is answered.
    let Reply::Array(Some(two)) = raw.cmd(&[b"LRANGE", b"big", b"0", b"1"]) else {
        panic!("LRANGE 0 1");
    };
    assert_eq!(two, vec![bulk(&v), bulk(&v)]);
    // A pop whose reply the budget cannot hold is refused before it takes
    // anything: the six elements stay (before, they were gone with the error).
    let Reply::Error(e) = raw.cmd(&[b"LPOP", b"big", b"6"]) else {
        panic!("a 3 MiB LPOP answered past a 2 MiB budget");
    };
    assert!(e.contains("resp.max_buffer_memory"), "{e}");
    assert_eq!(raw.cmd(&[b"LLEN", b"big"]), Reply::Int(6));
    let Reply::Array(Some(two)) = raw.cmd(&[b"LPOP", b"big", b"2"]) else {
        panic!("LPOP big 2");
    };
    assert_eq!(two, vec![bulk(&v), bulk(&v)]);
    assert_eq!(raw.cmd(&[b"LLEN", b"big"]), Reply::Int(4));
}

/// A gateway (a pool client and the RESP front only) for `master`, with
/// `config` (TOML) when given.
fn gateway(master: &str, config: Option<&str>) -> Proc {
    let dir = common::scratch_dir("resp-gw");
    let mut args: Vec<String> = [
        "--master",
        master,
        "--resp",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--shards",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(text) = config {
        args.push("--config".into());
        args.push(common::write_config(
            &dir,
            &format!("gw-{}.toml", rand::random::<u32>()),
            text,
        ));
    }
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let p = common::start("gateway", &a);
    assert_eq!(p.addr, p.resp, "a gateway's address is its RESP port");
    p
}

/// Where the master keeps `key`'s first replica: its node's data address.
fn replica_node(master: &str, key: &[u8]) -> Option<String> {
    let rt = common::rt();
    rt.block_on(async {
        let c = kvpool_client::Client::connect(
            master,
            kvpool_config::ClientConfig {
                ping_interval_ms: 0,
                ..Default::default()
            },
        )
        .await
        .ok()?;
        let info = c.describe(key).await.ok()?;
        info.replicas.first().map(|r| r.endpoint.shard_addr(0))
    })
}

#[test]
fn a_gateway_serves_the_pool_of_its_master_and_its_metrics() {
    // A storage node serves RESP too.
    let mut pool = common::Cluster::spec("resp-gateway")
        .node_with(common::Node::new("128MiB").args(&["--resp", "127.0.0.1:0"]))
        .start();
    let gw = gateway(pool.addr(), None);
    let mut raw = Raw::connect(&gw.resp);
    let v = common::value(3, 300_000);
    assert_eq!(raw.cmd(&[b"SET", b"gk", &v]), ok());
    assert_eq!(raw.cmd(&[b"GET", b"gk"]), bulk(&v));
    assert_eq!(
        raw.cmd(&[b"MGET", b"gk", b"none"]),
        Reply::Array(Some(vec![bulk(&v), Reply::Bulk(None)]))
    );
    assert_eq!(raw.cmd(&[b"DBSIZE"]), Reply::Int(1));
    // The value is in the pool: the CLI (another client) reads it.
    let (code, out, err) = common::cli(pool.addr(), &["get", "gk"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out == v, "the pool holds other bytes");
    let (status, metrics) = common::http(&gw.http, "GET", "/metrics");
    assert_eq!(status, 200);
    for want in [
        "kvpool_resp_commands_total{op=\"get\",result=\"ok\"} 1",
        "kvpool_resp_commands_total{op=\"set\",result=\"ok\"} 1",
        "kvpool_resp_command_seconds_count{op=\"mget\"} 1",
        "kvpool_resp_connections 1",
    ] {
        assert!(metrics.contains(want), "{want} not in:\n{metrics}");
    }
    let (status, _) = common::http(&gw.http, "GET", "/healthz");
    assert_eq!(status, 200);
    // The storage node's RESP port sees the same pool.
    let node = &mut pool.nodes[0];
    let mut on_node = Raw::connect(&node.resp);
    assert_eq!(on_node.cmd(&[b"GET", b"gk"]), bulk(&v));
    // SIGTERM with RESP connections open: a clean exit, the connections
    // closed.
    let mut gw = gw;
    gw.signal(common::Signal::TERM);
    let st = gw
        .wait_exit(Duration::from_secs(15))
        .expect("the gateway exits");
    assert!(st.success(), "{st:?}");
    assert!(raw.until_closed(Duration::from_secs(5)).is_empty());
    node.signal(common::Signal::TERM);
    let st = node
        .wait_exit(Duration::from_secs(15))
        .expect("the node exits");
    assert!(st.success(), "{st:?}");
}

/// `kvpool run <args>` with `env`, which must stop at start-up: its exit
/// code and stderr.
fn start_refused(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let child = Command::new(common::BIN)
        .arg("run")
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = common::wait_output(child, Duration::from_secs(60));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_unprotected_resp_listener_beyond_loopback_stops_start_up() {
    let (code, err) = start_refused(
        &[
            "--role",
            "gateway",
            "--resp",
            "0.0.0.0:0",
            "--http",
            "127.0.0.1:0",
        ],
        &[],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("resp.requirepass") && err.contains("protected_mode"),
        "{err}"
    );
}

/// Issue 29 (3): in a cluster with a secret the RESP front is inside the
/// trust model. Without `resp.requirepass` it refuses to start, saying so
/// (and claims no open front); with one, redis-cli gets nothing without
/// AUTH and everything with it.
#[test]
fn with_a_cluster_secret_the_resp_front_needs_a_password() {
    let secret = "0123456789abcdef0123456789abcdef";
    let (code, err) = start_refused(
        &common::ephemeral(&[
            "--no-serving",
            "--segment-size",
            "64MiB",
            "--resp",
            "127.0.0.1:0",
        ]),
        &[("KVPOOL_SECRET", secret)],
    );
    assert_ne!(code, Some(0), "started without a password: {err}");
    assert!(
        err.contains("resp.requirepass") && err.contains("secret"),
        "{err}"
    );
    assert!(
        !err.contains("IS OPEN"),
        "a warning that is not true: {err}"
    );

    // The refusal needs no tool; what follows drives redis-cli.
    let Some(cli) = common::external_tool("redis-cli") else {
        return;
    };
    let dir = common::scratch_dir("resp-secret");
    let cfg = common::write_config(&dir, "resp.toml", "[resp]\nrequirepass = \"opensesame\"\n");
    let mut args: Vec<&str> =
        common::ephemeral(&["--segment-size", "64MiB", "--resp", "127.0.0.1:0"]);
    args.extend(["--config", cfg.as_str()]);
    let p = common::start_env("all", &args, &[("KVPOOL_SECRET", secret)]);
    let port = port_of(&p.resp).to_string();
    let rc = |auth: bool, args: &[&str]| {
        let mut c = Command::new(&cli);
        c.args(["-p", &port]);
        if auth {
            c.args(["-a", "opensesame", "--no-auth-warning"]);
        }
        c.args(args);
        let (_, out, err) = run_tool(&mut c, None, Duration::from_secs(30));
        format!("{}{err}", String::from_utf8_lossy(&out))
    };
    for cmd in [&["set", "k", "v"][..], &["get", "k"], &["flushall"]] {
        let got = rc(false, cmd);
        assert!(got.contains("NOAUTH"), "{cmd:?} without AUTH: {got}");
    }
    assert_eq!(rc(true, &["set", "k", "v"]), "OK\n");
    assert_eq!(rc(true, &["get", "k"]), "v\n");
}

#[test]
fn auth_gates_every_command_and_flushall_empties_the_pool() {
    let p = pool_with_resp(Some("[resp]\nrequirepass = \"opensesame\"\n"), &[]);
    let mut raw = Raw::connect(&p.resp);
    assert_eq!(
        raw.cmd(&[b"GET", b"k"]),
        Reply::Error("NOAUTH Authentication required.".into())
    );
    assert_eq!(
        raw.cmd(&[b"FLUSHALL"]),
        Reply::Error("NOAUTH Authentication required.".into())
    );
    let Reply::Error(e) = raw.cmd(&[b"HELLO", b"2"]) else {
        panic!("HELLO without auth");
    };
    assert!(e.starts_with("NOAUTH HELLO must be called"), "{e}");
    assert_eq!(
        raw.cmd(&[b"AUTH", b"wrong"]),
        Reply::Error("WRONGPASS invalid username-password pair or user is disabled.".into())
    );
    let Reply::Array(Some(hello)) = raw.cmd(&[b"HELLO", b"2", b"AUTH", b"default", b"opensesame"])
    else {
        panic!("HELLO 2 AUTH");
    };
    assert_eq!(hello[4], bulk(b"proto"));
    assert_eq!(hello[5], Reply::Int(2));
    for i in 0..20 {
        assert_eq!(raw.cmd(&[b"SET", format!("f{i}").as_bytes(), b"v"]), ok());
    }
    assert_eq!(raw.cmd(&[b"DBSIZE"]), Reply::Int(20));
    assert_eq!(raw.cmd(&[b"FLUSHALL"]), ok());
    assert_eq!(raw.cmd(&[b"DBSIZE"]), Reply::Int(0));
    assert_eq!(raw.cmd(&[b"GET", b"f1"]), Reply::Bulk(None));
    let mut other = Raw::connect(&p.resp);
    assert_eq!(other.cmd(&[b"AUTH", b"default", b"opensesame"]), ok());
    assert_eq!(
        other.cmd(&[b"HELLO", b"4"]),
        Reply::Error("NOPROTO unsupported protocol version".into())
    );
    // RESP3 after HELLO 3 (redis-py 8's first command): a map, `_` nulls;
    // HELLO 2 goes back.
    let Reply::Map(hello) = other.cmd(&[b"HELLO", b"3"]) else {
        panic!("HELLO 3 answered no map");
    };
    assert!(
        hello.contains(&(bulk(b"proto"), Reply::Int(3))),
        "{hello:?}"
    );
    assert_eq!(other.cmd(&[b"GET", b"f1"]), Reply::Null);
    assert_eq!(other.cmd(&[b"CLIENT", b"GETNAME"]), Reply::Null);
    let Reply::Array(Some(hello)) = other.cmd(&[b"HELLO", b"2"]) else {
        panic!("HELLO 2 answered no array");
    };
    assert_eq!(hello[5], Reply::Int(2));
    assert_eq!(other.cmd(&[b"GET", b"f1"]), Reply::Bulk(None));
    assert_eq!(other.cmd(&[b"CLIENT", b"SETNAME", b"me"]), ok());
    assert_eq!(other.cmd(&[b"CLIENT", b"GETNAME"]), bulk(b"me"));
    assert_eq!(other.cmd(&[b"SELECT", b"0"]), ok());
    assert_eq!(other.cmd(&[b"QUIT"]), ok());
    assert!(other.until_closed(Duration::from_secs(5)).is_empty());
}

#[test]
fn multi_exec_queues_runs_in_order_and_discards_on_a_refused_command() {
    let p = pool_with_resp(None, &[]);
    let mut raw = Raw::connect(&p.resp);
    let queued = || Reply::Simple("QUEUED".into());
    assert_eq!(
        raw.cmd(&[b"EXEC"]),
        Reply::Error("ERR EXEC without MULTI".into())
    );
    assert_eq!(
        raw.cmd(&[b"DISCARD"]),
        Reply::Error("ERR DISCARD without MULTI".into())
    );
    let big = common::value(3, 3 << 20);
    assert_eq!(raw.cmd(&[b"MULTI"]), ok());
    assert_eq!(
        raw.cmd(&[b"MULTI"]),
        Reply::Error("ERR MULTI calls can not be nested".into())
    );
    assert_eq!(raw.cmd(&[b"SET", b"t1", &big]), queued());
    assert_eq!(raw.cmd(&[b"GET", b"t1"]), queued());
    assert_eq!(raw.cmd(&[b"SET", b"t2", b"v", b"NX"]), queued());
    assert_eq!(raw.cmd(&[b"SET", b"t2", b"w", b"NX", b"GET"]), queued());
    assert_eq!(raw.cmd(&[b"TTL", b"t2"]), queued());
    assert_eq!(raw.cmd(&[b"GET", b"nothing"]), queued());
    // Nothing ran yet: another connection sees no key.
    let mut other = Raw::connect(&p.resp);
    assert_eq!(other.cmd(&[b"EXISTS", b"t1"]), Reply::Int(0));
    assert_eq!(
        raw.cmd(&[b"EXEC"]),
        Reply::Array(Some(vec![
            ok(),
            Reply::Bulk(Some(big.clone())),
            ok(),
            bulk(b"v"),
            Reply::Int(-1),
            Reply::Bulk(None),
        ]))
    );
    assert_eq!(other.cmd(&[b"GET", b"t2"]), bulk(b"v"));
    // A command refused while queueing discards the transaction at EXEC.
    assert_eq!(raw.cmd(&[b"MULTI"]), ok());
    assert_eq!(raw.cmd(&[b"SET", b"t3", b"x"]), queued());
    let Reply::Error(e) = raw.cmd(&[b"APPEND", b"t3", b"y"]) else {
        panic!("APPEND queued");
    };
    assert!(e.starts_with("ERR kvpool does not support 'APPEND'"), "{e}");
    assert_eq!(
        raw.cmd(&[b"GET"]),
        Reply::Error("ERR wrong number of arguments for 'get' command".into())
    );
    assert_eq!(
        raw.cmd(&[b"EXEC"]),
        Reply::Error("EXECABORT Transaction discarded because of previous errors.".into())
    );
    assert_eq!(raw.cmd(&[b"EXISTS", b"t3"]), Reply::Int(0));
    // DISCARD drops what was queued.
    assert_eq!(raw.cmd(&[b"MULTI"]), ok());
    assert_eq!(raw.cmd(&[b"SET", b"t4", b"x"]), queued());
    let Reply::Bulk(Some(list)) = other.cmd(&[b"CLIENT", b"LIST"]) else {
        panic!("CLIENT LIST");
    };
    let list = String::from_utf8(list).unwrap();
    assert_eq!(list.lines().count(), 2, "{list}");
    assert!(
        list.contains(" multi=1 "),
        "the open transaction shows: {list}"
    );
    assert_eq!(raw.cmd(&[b"DISCARD"]), ok());
    assert_eq!(raw.cmd(&[b"EXISTS", b"t4"]), Reply::Int(0));
    // SET's options on the wire, CONFIG GET as tools read it.
    assert_eq!(raw.cmd(&[b"SET", b"t4", b"x", b"XX"]), Reply::Bulk(None));
    assert_eq!(raw.cmd(&[b"SET", b"t4", b"x", b"EX", b"100", b"NX"]), ok());
    assert_eq!(raw.cmd(&[b"SETNX", b"t4", b"y"]), Reply::Int(0));
    assert_eq!(
        raw.cmd(&[b"SET", b"t4", b"x", b"NX", b"XX"]),
        Reply::Error("ERR syntax error".into())
    );
    assert_eq!(
        raw.cmd(&[b"CONFIG", b"GET", b"save", b"appendonly"]),
        Reply::Array(Some(vec![
            bulk(b"appendonly"),
            bulk(b"no"),
            bulk(b"save"),
            bulk(b""),
        ]))
    );
    assert_eq!(raw.cmd(&[b"TYPE", b"t4"]), Reply::Simple("string".into()));
    assert_eq!(raw.cmd(&[b"FLUSHDB"]), ok());
    assert_eq!(raw.cmd(&[b"DBSIZE"]), Reply::Int(0));
}

#[test]
fn a_storage_node_killed_mid_read_gives_resp_clients_an_error_not_a_hang_or_other_bytes() {
    let mut pool = common::Cluster::spec("resp-node-killed")
        .node("128MiB")
        .start();
    // TCP to the nodes, so the kill breaks the read (over shared memory the
    // gateway's mapping would outlive the node and still hold the bytes).
    let gw = gateway(
        pool.addr(),
        Some("[client]\ntransport = \"tcp\"\ntimeout_ms = 3000\n"),
    );
    let big = common::value(11, 32 << 20);
    let mut reader = Raw::connect(&gw.resp);
    assert_eq!(reader.cmd(&[b"SET", b"big", &big]), ok());
    assert_eq!(
        replica_node(pool.addr(), b"big").as_deref(),
        Some(pool.nodes[0].addr.as_str())
    );
    // A second node, and a key on it (the emptier node takes new puts).
    let b = pool.start_node(common::Node::new("128MiB"));
    let mut other = Raw::connect(&gw.resp);
    let mut on_b = None;
    for i in 0..50 {
        let k = format!("small{i}");
        assert_eq!(other.cmd(&[b"SET", k.as_bytes(), b"on b?"]), ok());
        if replica_node(pool.addr(), k.as_bytes()).as_deref() == Some(b.addr.as_str()) {
            on_b = Some(k);
            break;
        }
    }
    let on_b = on_b.expect("no key landed on the second node");
    // Reads of the big value run back to back; the node dies under them.
    let addr = gw.resp.clone();
    let big2 = big.clone();
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Result<(), String>)>();
    let reads = std::thread::spawn(move || {
        let mut r = Raw::connect(&addr);
        loop {
            r.send(&encode(&[b"GET", b"big"]));
            let got = r.reply();
            let at = Instant::now();
            let res = match got {
                Reply::Bulk(Some(v)) if v == big2 => Ok(()),
                Reply::Bulk(Some(v)) => panic!("GET returned {} other bytes", v.len()),
                Reply::Error(e) => Err(e),
                other => panic!("GET answered {other:?}"),
            };
            let failed = res.is_err();
            if tx.send((at, res)).is_err() || failed {
                return;
            }
        }
    });
    // Let a few reads complete, then kill the node mid-stream.
    for _ in 0..3 {
        let (_, r) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("reads before the kill");
        r.expect("a read before the kill");
    }
    let killed = Instant::now();
    pool.nodes[0].signal(common::Signal::KILL);
    let _ = pool.nodes[0].wait_exit(Duration::from_secs(10));
    let error = loop {
        let (at, r) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("a GET hung after the node was killed");
        if let Err(e) = r {
            break (at, e);
        }
    };
    reads.join().expect("no read returned other bytes");
    assert!(error.1.starts_with("ERR"), "{}", error.1);
    // Within the client's deadline (3 s) and then some for the reply.
    assert!(
        error.0.duration_since(killed) < Duration::from_secs(8),
        "{:?}",
        error.0.duration_since(killed)
    );
    // Other connections and keys keep working.
    assert_eq!(other.cmd(&[b"GET", on_b.as_bytes()]), bulk(b"on b?"));
    assert_eq!(other.cmd(&[b"PING"]), Reply::Simple("PONG".into()));
    let mut fresh = Raw::connect(&gw.resp);
    assert_eq!(fresh.cmd(&[b"GET", on_b.as_bytes()]), bulk(b"on b?"));
    // An error while the master still lists the dead node's replica, a
    // miss once it has dropped it: never bytes.
    match fresh.cmd(&[b"GET", b"big"]) {
        Reply::Error(_) | Reply::Bulk(None) => {}
        other => panic!("GET of the dead node's value answered {other:?}"),
    }
}

#[test]
fn a_write_through_the_front_is_seen_at_once_by_every_connection() {
    let p = pool_with_resp(None, &[]);
    let addr = p.resp.clone();
    // A reader keeps reading the key on its own connection (so views of
    // it are kept and lookups of it are always under way).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let reader = std::thread::spawn(move || {
        let mut r = Raw::connect(&addr);
        let mut reads = 0u64;
        while !s2.load(std::sync::atomic::Ordering::Relaxed) {
            match r.cmd(&[b"GET", b"hot"]) {
                Reply::Bulk(_) => reads += 1,
                other => panic!("GET hot answered {other:?}"),
            }
        }
        reads
    });
    let mut writer = Raw::connect(&p.resp);
    let mut checker = Raw::connect(&p.resp);
    for i in 0..300u64 {
        let v = common::value(i, 2000 + (i as usize % 7) * 1000);
        if i % 10 == 0 {
            // Removed through the front: no connection sees it any more.
            let _ = writer.cmd(&[b"DEL", b"hot"]);
            assert_eq!(
                checker.cmd(&[b"GET", b"hot"]),
                Reply::Bulk(None),
                "round {i}"
            );
        }
        // Replaced through the front: once the SET has answered, no
        // connection sees an older value.
        assert_eq!(writer.cmd(&[b"SET", b"hot", &v]), ok());
        assert_eq!(checker.cmd(&[b"GET", b"hot"]), bulk(&v), "round {i}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reads = reader.join().expect("the reader saw only values or misses");
    assert!(reads > 0);
}

/// A client that asks and then does not read for longer than the read
/// lease still gets the whole value, byte for byte: the reply is a checked
/// copy, not the segment's memory, so the lease ending under it changes
/// nothing it sends.
#[test]
fn a_reader_slower_than_the_read_lease_gets_the_whole_value() {
    // Leases of 1.5 s: a view is good for 1 s (the client's margin).
    let p = pool_with_resp(Some("[master]\nlease_ttl_ms = 1500\n"), &[]);
    let v = common::value(5, 48 << 20);
    let mut w = Raw::connect(&p.resp);
    assert_eq!(w.cmd(&[b"SET", b"slow", &v]), ok());
    let mut s = TcpStream::connect(&p.resp).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&encode(&[b"GET", b"slow"])).unwrap();
    std::thread::sleep(Duration::from_millis(3000));
    let mut want = format!("${}\r\n", v.len()).into_bytes();
    want.extend_from_slice(&v);
    want.extend_from_slice(b"\r\n");
    let mut got = vec![0u8; want.len()];
    s.read_exact(&mut got).expect("the whole reply");
    assert!(got == want, "bytes other than the value's were sent");
    // The server goes on.
    assert_eq!(w.cmd(&[b"STRLEN", b"slow"]), Reply::Int(v.len() as i64));
}

#[test]
fn set_replaces_atomically_readers_see_the_old_or_the_new_value_never_a_mix_or_a_miss() {
    let p = pool_with_resp(None, &[]);
    let a = common::value(21, 1 << 20);
    let b = common::value(22, 1 << 20);
    let mut first = Raw::connect(&p.resp);
    assert_eq!(first.cmd(&[b"SET", b"swap", &a]), ok());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two writers of the one key on their own connections (four
    // connections in all: both RESP threads get some), two readers.
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let (addr, a, b) = (p.resp.clone(), a.clone(), b.clone());
            std::thread::spawn(move || {
                let mut c = Raw::connect(&addr);
                for i in 0..60 {
                    let v = if (i + w) % 2 == 0 { &b } else { &a };
                    assert_eq!(c.cmd(&[b"SET", b"swap", v]), ok(), "writer {w} SET {i}");
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (addr, a, b, stop) = (p.resp.clone(), a.clone(), b.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut c = Raw::connect(&addr);
                let (mut seen_a, mut seen_b) = (0, 0);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match c.cmd(&[b"GET", b"swap"]) {
                        Reply::Bulk(Some(v)) if v == a => seen_a += 1,
                        Reply::Bulk(Some(v)) if v == b => seen_b += 1,
                        Reply::Bulk(Some(v)) => {
                            panic!("GET returned {} bytes of neither value", v.len())
                        }
                        other => panic!("GET during replaces answered {other:?}"),
                    }
                }
                (seen_a, seen_b)
            })
        })
        .collect();
    for w in writers {
        w.join().expect("every SET answered OK");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        let (sa, sb) = r.join().expect("readers saw only the two values");
        assert!(sa + sb > 0);
    }
    // Pipelined SETs of one key land in order: the last one wins.
    let mut req = Vec::new();
    for v in [&a, &b, &a, &b] {
        req.extend(encode(&[b"SET", b"swap", v]));
    }
    req.extend(encode(&[b"GET", b"swap"]));
    first.send(&req);
    for _ in 0..4 {
        assert_eq!(first.reply(), ok());
    }
    assert_eq!(first.reply(), bulk(&b));
}

/// SETs of one key from connections on both RESP threads take turns in the
/// front: a thread's write of the key waits for the other's at the key's
/// stripe, woken when it ends, and the master never refuses a replace of
/// it for another (`TryAgain`: `put_start` errors). The same for MSETs of
/// the key among others (their writes took no stripe: they met the other
/// thread's SETs at the master).
#[test]
fn sets_of_one_key_from_both_resp_threads_take_turns_in_the_front_not_at_the_master() {
    let p = pool_with_resp(None, &[]);
    let told_to_wait = || common::series(&p.http, common::PUT_START_ERRORS) as u64;
    let before = told_to_wait();
    // Eight connections: both RESP threads get some.
    let writers: Vec<_> = (0..8u64)
        .map(|w| {
            let addr = p.resp.clone();
            std::thread::spawn(move || {
                let mut c = Raw::connect(&addr);
                for i in 0..40 {
                    let v = common::value(w * 100 + i, 4096);
                    assert_eq!(c.cmd(&[b"SET", b"turns", &v]), ok(), "writer {w} SET {i}");
                }
            })
        })
        .collect();
    // SETs with an option (here an expiry) take the same turns.
    let with_expiry: Vec<_> = (0..8u64)
        .map(|w| {
            let addr = p.resp.clone();
            std::thread::spawn(move || {
                let mut c = Raw::connect(&addr);
                for i in 0..20 {
                    let v = common::value(w * 100 + i, 4096);
                    let r = c.cmd(&[b"SET", b"turns-ex", &v, b"EX", b"1000"]);
                    assert_eq!(r, ok(), "writer {w} SET EX {i}");
                }
            })
        })
        .collect();
    // MSETs of the key and another take the same turns.
    let msets: Vec<_> = (0..8u64)
        .map(|w| {
            let addr = p.resp.clone();
            std::thread::spawn(move || {
                let mut c = Raw::connect(&addr);
                for i in 0..20 {
                    let v = common::value(w * 100 + i, 4096);
                    let other = format!("turns-m{w}");
                    let r = c.cmd(&[b"MSET", b"turns", &v, other.as_bytes(), &v]);
                    assert_eq!(r, ok(), "writer {w} MSET {i}");
                }
            })
        })
        .collect();
    for w in writers.into_iter().chain(with_expiry).chain(msets) {
        w.join().expect("every SET answered OK");
    }
    assert_eq!(
        told_to_wait() - before,
        0,
        "a replace of the key met another at the master"
    );
    let mut c = Raw::connect(&p.resp);
    let Reply::Bulk(Some(v)) = c.cmd(&[b"GET", b"turns"]) else {
        panic!("the key holds a value")
    };
    assert_eq!(v.len(), 4096);
}

/// `redis-benchmark`'s default SET is one key; with `-P 16` a connection
/// sends it sixteen times in one pipeline. A run of pipelined SETs of one
/// key stores its last value once, and every SET of it answers OK after
/// that value is in place; a SET refused for its own value (empty) answers
/// its own error and replaces nothing.
#[test]
fn pipelined_sets_of_one_key_answer_in_order_and_leave_the_last_value() {
    let p = pool_with_resp(None, &[]);
    let mut raw = Raw::connect(&p.resp);
    let mut req = Vec::new();
    for v in [&b"a"[..], b"b", b"", b"c"] {
        req.extend(encode(&[b"SET", b"hot", v]));
    }
    req.extend(encode(&[b"GET", b"hot"]));
    for v in [&b"d"[..], b"e"] {
        req.extend(encode(&[b"SET", b"hot", v]));
    }
    req.extend(encode(&[b"SET", b"other", b"x"]));
    req.extend(encode(&[b"SET", b"hot", b""]));
    req.extend(encode(&[b"GET", b"hot"]));
    raw.send(&req);
    let empty = Reply::Error("ERR kvpool cannot store an empty value".into());
    let want = [
        ok(),
        ok(),
        empty.clone(),
        ok(),
        bulk(b"c"),
        ok(),
        ok(),
        ok(),
        empty,
        bulk(b"e"),
    ];
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&raw.reply(), w, "reply {i}");
    }
    assert_eq!(raw.cmd(&[b"GET", b"other"]), bulk(b"x"));

    // Sixteen SETs of one key in one pipeline are one put in the pool.
    let puts = || {
        common::metric(
            &p.http,
            "kvpool_master_calls_total{op=\"put_start\",result=\"ok\"}",
        )
    };
    let before = puts();
    let mut req = Vec::new();
    for i in 0..16 {
        req.extend(encode(&[b"SET", b"hot16", format!("v{i}").as_bytes()]));
    }
    raw.send(&req);
    for i in 0..16 {
        assert_eq!(raw.reply(), ok(), "reply {i}");
    }
    assert_eq!(raw.cmd(&[b"GET", b"hot16"]), bulk(b"v15"));
    assert_eq!(puts() - before, 1.0, "one put for the sixteen SETs");
}
