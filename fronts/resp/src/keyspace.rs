//! `SET`'s options and the commands around a key's lifetime and type, with
//! what a pool without expiry can truthfully answer; `CONFIG GET`.
//!
//! kvpool keys do not expire: the pool keeps a value until it is replaced,
//! removed or evicted under memory pressure. A time to live given with a
//! write (`SET .. EX/PX/EXAT/PXAT`, `SETEX`, `PSETEX`) becomes the value's
//! soft pin: until then eviction takes every unpinned value first. So
//! `TTL`/`PTTL` answer -1 for a key that exists (no deletion is scheduled)
//! and -2 for one that does not; `PERSIST` answers 0 (there is no timeout to
//! remove); `EXPIRE` and its kin remove the key when the time given is not in
//! the future, as Redis does, and otherwise answer 0, "no timeout set".
//! The decision and what it means for LMCache's `remote_ttl`:
//! docs/architecture/resp.md.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvpool_wire::proto::PutOptions;
use kvpool_wire::ErrorCode;

use crate::checks::{check_key, check_value, is_miss, pool_error, WRONGTYPE};
use crate::commands::Cmd;
use crate::conn::Conn;
use crate::exec::{shown, Fetched};
use crate::proto::{parse_int, reply};

/// The longest soft pin the master keeps (a `u32` of milliseconds, ~49.7
/// days); a longer time to live is kept this long.
const MAX_KEEP_MS: u64 = u32::MAX as u64;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Which state of the key a conditional `SET` needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Only {
    /// `NX`: no value under the key.
    Absent,
    /// `XX`: a value under the key.
    Present,
}

/// What `SET key value [NX|XX] [GET] [EX s|PX ms|EXAT ts|PXAT ms-ts|KEEPTTL]`
/// asks.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct SetOpts {
    only: Option<Only>,
    /// Answer with the value the key had.
    get: bool,
    /// Milliseconds the value is soft-pinned for.
    keep_ms: u64,
    /// The time to live given ended already: the key is removed (the value
    /// is set and expires at once, as in Redis).
    gone: bool,
}

impl SetOpts {
    /// Parses `SET`'s options (after the value), Redis's errors and all.
    pub(crate) fn parse(opts: &[&[u8]], cmd: &str, now_ms: i64) -> Result<Self, String> {
        let syntax = || "ERR syntax error".to_string();
        let mut o = SetOpts::default();
        let mut ttl_given = false;
        let mut keepttl = false;
        let mut k = 0;
        while k < opts.len() {
            let a = opts[k];
            let is = |s: &str| a.eq_ignore_ascii_case(s.as_bytes());
            if is("NX") || is("XX") {
                let want = if is("NX") {
                    Only::Absent
                } else {
                    Only::Present
                };
                if o.only.is_some_and(|w| w != want) {
                    return Err(syntax());
                }
                o.only = Some(want);
            } else if is("GET") {
                o.get = true;
            } else if is("KEEPTTL") {
                if ttl_given {
                    return Err(syntax());
                }
                keepttl = true;
            } else if is("EX") || is("PX") || is("EXAT") || is("PXAT") {
                if ttl_given || keepttl || k + 1 >= opts.len() {
                    return Err(syntax());
                }
                ttl_given = true;
                let Some(n) = parse_int(opts[k + 1]) else {
                    return Err("ERR value is not an integer or out of range".into());
                };
                let invalid = || format!("ERR invalid expire time in '{cmd}' command");
                if n <= 0 {
                    return Err(invalid());
                }
                let ms = if is("EX") || is("EXAT") {
                    n.checked_mul(1000).ok_or_else(invalid)?
                } else {
                    n
                };
                let left = if is("EXAT") || is("PXAT") {
                    ms.saturating_sub(now_ms)
                } else {
                    ms
                };
                if left <= 0 {
                    o.gone = true;
                } else {
                    o.keep_ms = (left as u64).min(MAX_KEEP_MS);
                }
                k += 1;
            } else {
                return Err(syntax());
            }
            k += 1;
        }
        Ok(o)
    }
}

/// A time or a count argument, with Redis's error.
fn int_arg(a: &[u8]) -> Result<i64, String> {
    parse_int(a).ok_or_else(|| "ERR value is not an integer or out of range".to_string())
}

/// `*` and `?` globs, ASCII case folded (what `CONFIG GET` patterns use).
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && (pattern[p] == b'?' || pattern[p].eq_ignore_ascii_case(&text[t])) {
            p += 1;
            t += 1;
        } else if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

impl Conn {
    /// `SET key value [options]` and the commands that are a `SET` with
    /// options (`SETNX`, `SETEX`, `PSETEX`, `GETSET`). `int_reply`: answer
    /// 1/0 (SETNX) instead of OK/nil.
    pub(crate) async fn set_with(&mut self, key: &[u8], value: &[u8], o: SetOpts, int_reply: bool) {
        if let Err(e) = check_key(key).and_then(|()| check_value(value)) {
            return reply::error(&mut self.out.bytes, &e);
        }
        if o == SetOpts::default() {
            // A plain SET: the path pipelined SETs take.
            return match self.store(&[(key, value)]).await.remove(0) {
                Ok(()) => reply::ok(&mut self.out.bytes),
                Err(e) => reply::error(&mut self.out.bytes, &e),
            };
        }
        let within = Duration::from_millis(self.ctx.client_timeout_ms);
        let ctx = self.ctx.clone();
        let busy = "ERR another SET of this key did not end in time";
        // The key's stripe first (as a plain SET's write and INCR take it):
        // another RESP thread's write of the key waits for this one here,
        // not at the master; then this thread's hold on the key.
        let deadline = tokio::time::Instant::now() + within;
        let stripe = ctx.shared.counters.of(key);
        let Ok(_turn) = tokio::time::timeout_at(deadline, stripe.lock()).await else {
            return reply::error(&mut self.out.bytes, busy);
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Ok(_held) = ctx.keys.lock(&[key], left).await else {
            return reply::error(&mut self.out.bytes, busy);
        };
        // A list, set, hash or sorted set under the key: it exists, GET
        // cannot answer its old value, and a SET replaces it.
        let coll = ctx.shared.collections.kind_of(key).is_some();
        if coll && o.get {
            return reply::error(&mut self.out.bytes, WRONGTYPE);
        }
        // The old value first (GET), then whether the condition holds, then
        // the write: one after another under the key's stripe and this
        // thread's hold on it. Another process's write may come between
        // them (no transaction spans the pool); see docs/architecture/resp.md.
        let old = if o.get {
            match self.fetch(&[key]).await.into_iter().next() {
                Some(Fetched::Error(e)) => return reply::error(&mut self.out.bytes, &e),
                Some(f) => Some(f),
                None => Some(Fetched::Nil),
            }
        } else {
            None
        };
        let client = &ctx.client;
        // NX is the put's own check (a put without replace), except when
        // nothing is put.
        let check = o.only == Some(Only::Present) || (o.only.is_some() && o.gone);
        let mut set = if check {
            let exists = match self.key_exists(key).await {
                Ok(b) => b,
                Err(e) => return reply::error(&mut self.out.bytes, &e),
            };
            (exists || coll) == (o.only == Some(Only::Present))
        } else {
            !(coll && o.only == Some(Only::Absent))
        };
        if set {
            let r = if o.gone {
                // Set, and expired at once: what stays is no value.
                match client.remove_with(key, true).await {
                    Err(e) if !is_miss(&e) => Err(e),
                    _ => Ok(true),
                }
            } else {
                let opts = PutOptions {
                    replace: o.only != Some(Only::Absent),
                    soft_pin_ttl_ms: o.keep_ms,
                    ..PutOptions::default()
                };
                match client.put_with(key, value, &opts).await {
                    Ok(()) => Ok(true),
                    Err(e) if e.code == ErrorCode::ObjectAlreadyExists => Ok(false),
                    Err(e) => Err(e),
                }
            };
            // Whatever the answer (a put that timed out may still have ended).
            ctx.shared.views.forget(key);
            if r.is_ok() {
                ctx.shared.collections.remove(key);
            }
            match r {
                Ok(b) => set = b,
                Err(e) => return reply::error(&mut self.out.bytes, &pool_error(&e)),
            }
        }
        match (old, int_reply) {
            (Some(f), _) => self.put_fetched(f),
            (None, true) => reply::int(&mut self.out.bytes, set as i64),
            (None, false) if set => reply::ok(&mut self.out.bytes),
            (None, false) => reply::nil(&mut self.out.bytes, self.resp3),
        }
    }

    /// `INCR`, `DECR`, `INCRBY`, `DECRBY`: the key's string read as a
    /// 64-bit integer (none: 0), changed and written back. The three steps
    /// hold the key's stripe of the front's counter locks (other INCRs of
    /// it through any RESP thread wait) and this thread's hold on the key;
    /// INCRs of the key from this thread that arrive meanwhile join the
    /// same read and write ([`crate::locks::KeyLocks::add_one`]). A SET or
    /// a write through another front may come between the read and the
    /// write (see docs/architecture/resp.md).
    pub(crate) async fn incr_by(&mut self, cmd: Cmd, args: &[&[u8]]) {
        let key = args[0];
        let delta = match cmd {
            Cmd::Incr => Ok(1),
            Cmd::Decr => Ok(-1),
            Cmd::Incrby => int_arg(args[1]),
            _ => int_arg(args[1]).and_then(|n| {
                n.checked_neg()
                    .ok_or_else(|| "ERR decrement would overflow".to_string())
            }),
        };
        let delta = match delta.and_then(|d| check_key(key).map(|()| d)) {
            Ok(d) => d,
            Err(e) => return reply::error(&mut self.out.bytes, &e),
        };
        if self.ctx.shared.collections.kind_of(key).is_some() {
            return reply::error(&mut self.out.bytes, WRONGTYPE);
        }
        let ctx = self.ctx.clone();
        let within = Duration::from_millis(ctx.client_timeout_ms);
        let stripe = ctx.shared.counters.of(key);
        let busy = "ERR another INCR or SET of this key did not end in time";
        let this = &*self;
        let (client, views) = (&ctx.client, &ctx.shared.views);
        let r = ctx
            .keys
            .add_one(key, delta, stripe, within, busy, |deltas| async move {
                let fail = |e: String| deltas.iter().map(|_| Err(e.clone())).collect();
                let old = match this.fetch(&[key]).await.into_iter().next() {
                    Some(Fetched::Value(p)) => match parse_int(&p.value) {
                        Some(n) => n,
                        None => return fail("ERR value is not an integer or out of range".into()),
                    },
                    Some(Fetched::Error(e)) => return fail(e),
                    Some(Fetched::Nil) | None => 0,
                };
                // Each in the order it came; one that would overflow fails
                // alone and changes nothing, as in Redis.
                let mut at = old;
                let out: Vec<Result<i64, String>> = deltas
                    .iter()
                    .map(|d| match at.checked_add(*d) {
                        Some(x) => {
                            at = x;
                            Ok(x)
                        }
                        None => Err("ERR increment or decrement would overflow".to_string()),
                    })
                    .collect();
                if at == old {
                    return out;
                }
                let r = client.upsert(key, at.to_string().as_bytes()).await;
                views.forget(key);
                match r {
                    Ok(()) => out,
                    Err(e) => fail(pool_error(&e)),
                }
            })
            .await;
        match r {
            Ok(n) => reply::int(&mut self.out.bytes, n),
            Err(e) => reply::error(&mut self.out.bytes, &e),
        }
    }

    /// `SET`, `SETNX`, `SETEX`, `PSETEX`, `GETSET`.
    pub(crate) async fn set_family(&mut self, cmd: Cmd, args: &[&[u8]]) {
        let parsed = match cmd {
            Cmd::Set => SetOpts::parse(&args[2..], "set", now_ms()).map(|o| (args[1], o)),
            Cmd::Setnx => Ok((
                args[1],
                SetOpts {
                    only: Some(Only::Absent),
                    ..SetOpts::default()
                },
            )),
            Cmd::Getset => Ok((
                args[1],
                SetOpts {
                    get: true,
                    ..SetOpts::default()
                },
            )),
            // SETEX key seconds value, PSETEX key ms value.
            _ => {
                let unit: &[u8] = if cmd == Cmd::Setex { b"EX" } else { b"PX" };
                SetOpts::parse(&[unit, args[1]], cmd.name(), now_ms()).map(|o| (args[2], o))
            }
        };
        match parsed {
            Ok((value, o)) => self.set_with(args[0], value, o, cmd == Cmd::Setnx).await,
            Err(e) => reply::error(&mut self.out.bytes, &e),
        }
    }

    /// Whether `key` holds a value (a key the pool cannot hold does not).
    async fn key_exists(&self, key: &[u8]) -> Result<bool, String> {
        if check_key(key).is_err() {
            return Ok(false);
        }
        match self.ctx.client.exists(key).await {
            Ok(b) => Ok(b),
            Err(e) if is_miss(&e) => Ok(false),
            Err(e) => Err(pool_error(&e)),
        }
    }

    /// `TTL`/`PTTL` (-1: exists, with no deletion scheduled; -2: absent),
    /// `PERSIST` (0: no timeout to remove), `TYPE` (string or none).
    pub(crate) async fn lifetime(&mut self, cmd: Cmd, key: &[u8]) {
        if let Some(kind) = self.ctx.shared.collections.kind_of(key) {
            let o = &mut self.out.bytes;
            return match cmd {
                Cmd::Type => reply::simple(o, kind.name()),
                Cmd::Persist => reply::int(o, 0),
                _ => reply::int(o, -1),
            };
        }
        let exists = match self.key_exists(key).await {
            Ok(b) => b,
            Err(e) => return reply::error(&mut self.out.bytes, &e),
        };
        let o = &mut self.out.bytes;
        match cmd {
            Cmd::Type => reply::simple(o, if exists { "string" } else { "none" }),
            Cmd::Persist => reply::int(o, 0),
            _ => reply::int(o, if exists { -1 } else { -2 }),
        }
    }

    /// `EXPIRE key seconds [NX|XX|GT|LT]` and `PEXPIRE`, `EXPIREAT`,
    /// `PEXPIREAT`: a time not in the future removes the key (1 if it had a
    /// value); a later one sets nothing (0), kvpool keys do not expire.
    pub(crate) async fn expire(&mut self, cmd: Cmd, args: &[&[u8]]) {
        let n = match int_arg(args[1]) {
            Ok(n) => n,
            Err(e) => return reply::error(&mut self.out.bytes, &e),
        };
        let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
        for a in &args[2..] {
            let is = |s: &str| a.eq_ignore_ascii_case(s.as_bytes());
            if is("NX") {
                nx = true;
            } else if is("XX") {
                xx = true;
            } else if is("GT") {
                gt = true;
            } else if is("LT") {
                lt = true;
            } else {
                return reply::error(
                    &mut self.out.bytes,
                    &format!("ERR Unsupported option {}", shown(a)),
                );
            }
        }
        if nx && (xx || gt || lt) {
            return reply::error(
                &mut self.out.bytes,
                "ERR NX and XX, GT or LT options at the same time are not compatible",
            );
        }
        if gt && lt {
            return reply::error(
                &mut self.out.bytes,
                "ERR GT and LT options at the same time are not compatible",
            );
        }
        let invalid = format!("ERR invalid expire time in '{}' command", cmd.name());
        let left_ms = match cmd {
            Cmd::Expire => n.checked_mul(1000),
            Cmd::Pexpire => Some(n),
            Cmd::Expireat => n.checked_mul(1000).map(|ms| ms.saturating_sub(now_ms())),
            _ => Some(n.saturating_sub(now_ms())),
        };
        let Some(left_ms) = left_ms else {
            return reply::error(&mut self.out.bytes, &invalid);
        };
        // A key without a timeout has an infinite one: XX and GT never
        // apply to it, NX and LT always do.
        let key = args[0];
        let coll = self.ctx.shared.collections.kind_of(key).is_some();
        if coll && !(xx || gt || left_ms > 0) {
            // Expired at once: gone from both (a string of the same name in
            // the pool too, which DEL would remove as well).
            self.ctx.shared.collections.remove(key);
            let _ = self.ctx.client.remove_with(key, true).await;
            self.ctx.shared.views.forget(key);
            return reply::int(&mut self.out.bytes, 1);
        }
        if xx || gt || left_ms > 0 {
            return match self.key_exists(args[0]).await {
                Ok(_) => reply::int(&mut self.out.bytes, 0),
                Err(e) => reply::error(&mut self.out.bytes, &e),
            };
        }
        if check_key(key).is_err() {
            return reply::int(&mut self.out.bytes, 0);
        }
        let r = self.ctx.client.remove_with(key, true).await;
        self.ctx.shared.views.forget(key);
        match r {
            Ok(()) => reply::int(&mut self.out.bytes, 1),
            Err(e) if is_miss(&e) => reply::int(&mut self.out.bytes, 0),
            Err(e) => reply::error(&mut self.out.bytes, &pool_error(&e)),
        }
    }

    /// `CONFIG GET pattern [pattern ..]` (what a Redis client or tool reads
    /// at start: redis-benchmark reads `save` and `appendonly`); the other
    /// subcommands are refused: the front is configured by its file.
    pub(crate) async fn config(&mut self, args: &[&[u8]]) {
        let sub = args[0];
        if sub.eq_ignore_ascii_case(b"HELP") {
            let lines = [
                "CONFIG <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
                "GET <pattern>",
                "    Return parameters matching the glob-like <pattern> and their values.",
                "kvpool reads its settings from its configuration file and flags: CONFIG SET,",
                "REWRITE and RESETSTAT are not supported.",
                "HELP",
                "    Print this help.",
            ];
            reply::array(&mut self.out.bytes, lines.len());
            for l in lines {
                reply::simple(&mut self.out.bytes, l);
            }
            return;
        }
        if !sub.eq_ignore_ascii_case(b"GET") {
            return reply::error(
                &mut self.out.bytes,
                &format!(
                    "ERR CONFIG {} is not supported by kvpool: the RESP front is configured by \
                     its configuration file ([resp]) and flags",
                    shown(sub).to_uppercase()
                ),
            );
        }
        let patterns = &args[1..];
        if patterns.is_empty() {
            return reply::error(
                &mut self.out.bytes,
                "ERR wrong number of arguments for 'config|get' command",
            );
        }
        let wanted = |name: &str| patterns.iter().any(|p| glob(p, name.as_bytes()));
        let shared = &self.ctx.shared;
        let cfg = &shared.cfg;
        let mut params: Vec<(&str, String)> = vec![
            ("appendonly", "no".into()),
            ("save", String::new()),
            ("databases", "1".into()),
            ("maxclients", cfg.max_clients.to_string()),
            ("timeout", (cfg.idle_timeout_ms / 1000).to_string()),
            ("port", shared.port.to_string()),
            (
                "protected-mode",
                if cfg.protected_mode { "yes" } else { "no" }.into(),
            ),
            (
                "proto-max-bulk-len",
                cfg.proto_max_bulk_len.get().to_string(),
            ),
            (
                "client-query-buffer-limit",
                cfg.max_query_buffer.get().to_string(),
            ),
            ("maxmemory-policy", "allkeys-lru".into()),
        ];
        params.retain(|(name, _)| wanted(name));
        if wanted("maxmemory") {
            match self.ctx.client.stat().await {
                Ok(s) => params.push(("maxmemory", s.capacity.to_string())),
                Err(e) => return reply::error(&mut self.out.bytes, &pool_error(&e)),
            }
        }
        let o = &mut self.out.bytes;
        reply::map(o, params.len(), self.resp3);
        for (name, value) in params {
            reply::bulk(o, name.as_bytes());
            reply::bulk(o, value.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_options_parse_as_redis_reads_them() {
        let p = |a: &[&str]| {
            let a: Vec<&[u8]> = a.iter().map(|s| s.as_bytes()).collect();
            SetOpts::parse(&a, "set", 1_000_000)
        };
        assert_eq!(p(&[]), Ok(SetOpts::default()));
        let o = p(&["nx", "GET", "EX", "10"]).unwrap();
        assert_eq!(
            (o.only, o.get, o.keep_ms, o.gone),
            (Some(Only::Absent), true, 10_000, false)
        );
        assert_eq!(p(&["PX", "1500"]).unwrap().keep_ms, 1500);
        assert_eq!(p(&["PXAT", "1000500"]).unwrap().keep_ms, 500);
        assert!(p(&["EXAT", "999"]).unwrap().gone);
        assert_eq!(p(&["KEEPTTL"]), Ok(SetOpts::default()));
        assert_eq!(
            p(&["EX", "0"]),
            Err("ERR invalid expire time in 'set' command".into())
        );
        assert_eq!(
            p(&["EX", "x"]),
            Err("ERR value is not an integer or out of range".into())
        );
        for bad in [
            &["NX", "XX"][..],
            &["EX", "1", "PX", "1"],
            &["EX"],
            &["KEEPTTL", "EX", "1"],
            &["FOO"],
        ] {
            assert_eq!(p(bad), Err("ERR syntax error".into()), "{bad:?}");
        }
        assert_eq!(
            p(&["EX", "9223372036854775807"]).unwrap_err(),
            "ERR invalid expire time in 'set' command"
        );
        assert_eq!(p(&["PX", "99999999999999"]).unwrap().keep_ms, MAX_KEEP_MS);
    }

    #[test]
    fn config_patterns_are_globs_without_case() {
        assert!(glob(b"*", b"save"));
        assert!(glob(b"SAVE", b"save"));
        assert!(glob(b"max*", b"maxmemory-policy"));
        assert!(glob(b"*memory*", b"maxmemory"));
        assert!(glob(b"s?ve", b"save"));
        assert!(!glob(b"save?", b"save"));
        assert!(!glob(b"max*x", b"maxmemory"));
        assert!(glob(b"a*b*c", b"aXbYbZc"));
    }
}
