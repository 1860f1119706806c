//! What each command does, with the replies Redis gives.
//!
//! Keys are binary-safe byte strings of 1 to 4096 bytes (the pool's limit);
//! values are at least one byte (the pool stores no empty object). A run of
//! pipelined GETs is one batch lookup; its replies still go out one per
//! GET, in order.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_client::ReadView;
use kvpool_wire::proto::PutOptions;
use kvpool_wire::{ErrorCode, KvError};

use crate::cache::Epoch;
use crate::checks::{check_key, check_value, is_miss, pool_error, WRONGTYPE};
use crate::commands::{Cmd, SPECS};
use crate::conn::{Close, Conn, Held, Part, BUDGET_SPENT, FLUSH_AT};
use crate::proto::{parse_int, reply, Parser};

/// Keys read from other hosts per batch call (their values are held in
/// memory at once).
const REMOTE_BATCH: usize = 16;

/// A value fetched for a GET or an MGET.
pub(crate) enum Fetched {
    Value(Part),
    Nil,
    Error(String),
}

/// Shows an argument inside an error message as Redis does: quoted, at most
/// 128 bytes, unprintable bytes as '?'.
pub(crate) fn shown(a: &[u8]) -> String {
    a.iter()
        .take(128)
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '?'
            }
        })
        .collect()
}

fn is_get(p: &Parser, buf: &[u8], i: usize) -> bool {
    p.argc(i) == 2 && p.arg(buf, i, 0).eq_ignore_ascii_case(b"get")
}

/// A plain `SET key value` (no options).
fn is_plain_set(p: &Parser, buf: &[u8], i: usize) -> bool {
    p.argc(i) == 3 && p.arg(buf, i, 0).eq_ignore_ascii_case(b"set")
}

impl Conn {
    fn need_auth(&self) -> bool {
        !self.authed
    }

    /// Runs every completed command of `p`, in order, appending replies (and
    /// sending them whenever [`FLUSH_AT`] bytes wait).
    pub(crate) async fn execute(&mut self, p: &Parser, buf: &[u8]) -> Result<(), Close> {
        let n = p.ready();
        self.meta.touch();
        let mut i = 0;
        while i < n && !self.quit {
            let name = p.arg(buf, i, 0);
            let Some(cmd) = Cmd::lookup(name) else {
                self.ctx.shared.metrics.record_unknown();
                let msg = if let Some(why) = crate::commands::unsupported(name) {
                    format!("ERR kvpool does not support '{}': {why}", shown(name))
                } else {
                    let mut msg = format!(
                        "ERR unknown command '{}', with args beginning with: ",
                        shown(name)
                    );
                    for j in 1..p.argc(i).min(8) {
                        msg.push_str(&format!("'{}' ", shown(p.arg(buf, i, j))));
                    }
                    msg
                };
                self.multi_refused();
                reply::error(&mut self.out.bytes, &msg);
                i += 1;
                continue;
            };
            let t = Instant::now();
            let refused = if !cmd.arity_ok(p.argc(i)) {
                Some(format!(
                    "ERR wrong number of arguments for '{}' command",
                    cmd.name()
                ))
            } else if self.need_auth() && !cmd.no_auth() {
                Some("NOAUTH Authentication required.".to_string())
            } else {
                None
            };
            if let Some(msg) = refused {
                self.multi_refused();
                reply::error(&mut self.out.bytes, &msg);
                self.ctx
                    .shared
                    .metrics
                    .record(cmd.index(), false, t.elapsed());
                i += 1;
                continue;
            }
            if self.multi.is_some() {
                // In a transaction: queued, but for what ends or nests it.
                match cmd {
                    Cmd::Exec => {
                        self.multi_exec().await?;
                        self.ctx
                            .shared
                            .metrics
                            .record(cmd.index(), true, t.elapsed());
                    }
                    Cmd::Discard => self.multi_discard(),
                    Cmd::Multi => {
                        reply::error(&mut self.out.bytes, "ERR MULTI calls can not be nested")
                    }
                    Cmd::Quit => self.one(cmd, &[]).await,
                    _ => {
                        let args: Vec<&[u8]> = (1..p.argc(i)).map(|j| p.arg(buf, i, j)).collect();
                        self.multi_queue(cmd, &args);
                    }
                }
                i += 1;
            } else if cmd == Cmd::Get {
                let batch = self.ctx.shared.cfg.batch_keys;
                let mut j = i;
                while j < n && j - i < batch && is_get(p, buf, j) {
                    j += 1;
                }
                let keys: Vec<&[u8]> = (i..j).map(|k| p.arg(buf, k, 1)).collect();
                let fetched = self.fetch(&keys).await;
                let took = t.elapsed();
                for f in fetched {
                    let ok = !matches!(f, Fetched::Error(_));
                    self.put_fetched(f);
                    self.ctx.shared.metrics.record(Cmd::Get.index(), ok, took);
                }
                i = j;
            } else if cmd == Cmd::Set && is_plain_set(p, buf, i) {
                // A run of pipelined SETs is one batch of distinct keys. A
                // key set again in the run stores only its last value, and
                // each of its SETs answers with that store's result: every
                // reply goes out after the last value is in place, so each
                // earlier SET took effect, and was replaced, at that moment
                // (redis-benchmark's default is one key, -P 16 repeats it).
                let batch = self.ctx.shared.cfg.batch_keys;
                // A SET refused for its own key or value answers its own
                // error and replaces nothing.
                let mut items: Vec<(&[u8], &[u8])> = Vec::new();
                let mut item_of: Vec<Result<usize, String>> = Vec::new();
                let mut slot = std::collections::HashMap::new();
                let mut j = i;
                while j < n && j - i < batch && is_plain_set(p, buf, j) {
                    let (key, value) = (p.arg(buf, j, 1), p.arg(buf, j, 2));
                    item_of.push(check_key(key).and_then(|()| check_value(value)).map(|()| {
                        let at = *slot.entry(key).or_insert(items.len());
                        if at == items.len() {
                            items.push((key, value));
                        } else {
                            items[at].1 = value;
                        }
                        at
                    }));
                    j += 1;
                }
                let stored = self.store(&items).await;
                let took = t.elapsed();
                for r in item_of
                    .into_iter()
                    .map(|at| at.and_then(|at| stored[at].clone()))
                {
                    match &r {
                        Ok(()) => reply::ok(&mut self.out.bytes),
                        Err(e) => reply::error(&mut self.out.bytes, e),
                    }
                    self.ctx
                        .shared
                        .metrics
                        .record(Cmd::Set.index(), r.is_ok(), took);
                }
                i = j;
            } else {
                let at = self.out.bytes.len();
                let args: Vec<&[u8]> = (1..p.argc(i)).map(|j| p.arg(buf, i, j)).collect();
                self.one(cmd, &args).await;
                let ok = self.out.bytes.get(at) != Some(&b'-');
                self.ctx.shared.metrics.record(cmd.index(), ok, t.elapsed());
                i += 1;
            }
            if self.out.pending() >= FLUSH_AT {
                self.flush().await?;
            }
        }
        Ok(())
    }

    pub(crate) fn put_fetched(&mut self, f: Fetched) {
        match f {
            Fetched::Value(part) => self.out.bulk_part(part),
            Fetched::Nil => reply::nil(&mut self.out.bytes, self.resp3),
            Fetched::Error(e) => reply::error(&mut self.out.bytes, &e),
        }
    }

    /// Values of `keys`, in order: in place from this host's storage node
    /// where a replica is here (one batch lookup), read from other hosts
    /// otherwise.
    pub(crate) async fn fetch(&self, keys: &[&[u8]]) -> Vec<Fetched> {
        let client = &self.ctx.client;
        let cache = &self.ctx.shared.views;
        let mut out: Vec<Option<Fetched>> = Vec::with_capacity(keys.len());
        // Views kept from earlier reads first (checked again against the
        // object's checksum); the rest from one lookup.
        let mut looked: Vec<&[u8]> = Vec::with_capacity(keys.len());
        let mut ask_at: Vec<usize> = Vec::with_capacity(keys.len());
        let colls = &self.ctx.shared.collections;
        for (i, k) in keys.iter().enumerate() {
            if let Err(e) = check_key(k) {
                out.push(Some(Fetched::Error(e)));
                continue;
            }
            if colls.kind_of(k).is_some() {
                out.push(Some(Fetched::Error(WRONGTYPE.into())));
                continue;
            }
            if let Some(v) = cache.get(k) {
                match self.read_view(&v) {
                    Ok(f) => {
                        out.push(Some(f));
                        continue;
                    }
                    // Its lease ended, or its bytes changed: look it up again.
                    Err(_) => cache.forget(k),
                }
            }
            out.push(None);
            looked.push(k);
            ask_at.push(i);
        }
        let epochs: Vec<Epoch> = looked.iter().map(|k| cache.epoch(k)).collect();
        let views: Vec<Result<ReadView, KvError>> = match looked.len() {
            0 => Vec::new(),
            1 => vec![client.get_view(looked[0]).await],
            _ => match client.batch_get_view(&looked).await {
                Ok(v) => v,
                Err(e) => looked.iter().map(|_| Err(e.clone())).collect(),
            },
        };
        let views: Vec<Result<Arc<ReadView>, KvError>> = views
            .into_iter()
            .zip(looked.iter().zip(epochs))
            .map(|(r, (k, epoch))| {
                r.map(|v| {
                    let v = Arc::new(v);
                    cache.put(k, v.clone(), epoch);
                    v
                })
            })
            .collect();
        let mut remote: Vec<usize> = Vec::new();
        for (r, &i) in views.into_iter().zip(&ask_at) {
            out[i] = match r.and_then(|v| self.read_view(&v)) {
                Ok(f) => Some(f),
                Err(e) if is_miss(&e) => Some(Fetched::Nil),
                // No replica here, or no same-host copy that checks: read it
                // from a node that has one, as any client would.
                Err(e)
                    if matches!(
                        e.code,
                        ErrorCode::Unavailable | ErrorCode::Corrupt | ErrorCode::Timeout
                    ) =>
                {
                    cache.forget(keys[i]);
                    remote.push(i);
                    None
                }
                Err(e) => Some(Fetched::Error(pool_error(&e))),
            };
        }
        for chunk in remote.chunks(REMOTE_BATCH) {
            let ks: Vec<&[u8]> = chunk.iter().map(|&i| keys[i]).collect();
            let got = client
                .batch_get(&ks)
                .await
                .unwrap_or_else(|e| ks.iter().map(|_| Err(e.clone())).collect());
            for (r, &i) in got.into_iter().zip(chunk) {
                out[i] = Some(match r {
                    Ok(v) => {
                        let mut held = Held::none(&self.ctx.shared);
                        if held.grow(v.len() as u64) {
                            Fetched::Value(Part {
                                value: v,
                                _held: held,
                            })
                        } else {
                            Fetched::Error(BUDGET_SPENT.into())
                        }
                    }
                    Err(e) if is_miss(&e) => Fetched::Nil,
                    Err(e) => Fetched::Error(pool_error(&e)),
                });
            }
        }
        out.into_iter()
            .map(|f| f.expect("every key answered"))
            .collect()
    }

    /// The value under `v`, copied out of the shared segment and checked
    /// (the copy is what the reply sends: a writer that changes the segment
    /// after the check cannot reach the client), its memory held from the
    /// budget. `Err` when the lease ended or no copy checked.
    fn read_view(&self, v: &ReadView) -> Result<Fetched, KvError> {
        let mut held = Held::none(&self.ctx.shared);
        if !held.grow(v.len()) {
            return Ok(Fetched::Error(BUDGET_SPENT.into()));
        }
        let value = v.read()?;
        Ok(Fetched::Value(Part { value, _held: held }))
    }

    /// One command, its arity and auth checked (GETs come here only from a
    /// transaction: outside one they run in batches).
    pub(crate) async fn one(&mut self, cmd: Cmd, args: &[&[u8]]) {
        let o = &mut self.out.bytes;
        match cmd {
            Cmd::Get => {
                // A GET in a transaction (outside one, GETs run in batches).
                let f = self.fetch(args).await.into_iter().next();
                self.put_fetched(f.unwrap_or(Fetched::Nil));
            }
            Cmd::Ping => match args {
                [] => reply::simple(o, "PONG"),
                [m] => reply::bulk(o, m),
                _ => reply::error(o, "ERR wrong number of arguments for 'ping' command"),
            },
            Cmd::Echo => reply::bulk(o, args[0]),
            Cmd::Quit => {
                reply::ok(o);
                self.quit = true;
            }
            Cmd::Select => match parse_int(args[0]) {
                Some(0) => reply::ok(o),
                Some(_) => reply::error(o, "ERR DB index is out of range"),
                None => reply::error(o, "ERR value is not an integer or out of range"),
            },
            Cmd::Auth => self.auth(args),
            Cmd::Hello => self.hello(args),
            Cmd::Client => self.client_cmd(args),
            Cmd::Command => self.command_cmd(args),
            Cmd::Set | Cmd::Setnx | Cmd::Setex | Cmd::Psetex | Cmd::Getset => {
                self.set_family(cmd, args).await
            }
            Cmd::Ttl | Cmd::Pttl | Cmd::Persist | Cmd::Type => self.lifetime(cmd, args[0]).await,
            Cmd::Expire | Cmd::Pexpire | Cmd::Expireat | Cmd::Pexpireat => {
                self.expire(cmd, args).await
            }
            Cmd::Config => self.config(args).await,
            Cmd::Multi => self.multi_start(),
            Cmd::Exec => reply::error(o, "ERR EXEC without MULTI"),
            Cmd::Discard => reply::error(o, "ERR DISCARD without MULTI"),
            Cmd::Mget => self.mget(args).await,
            Cmd::Mset => self.mset(args).await,
            Cmd::Exists => self.exists(args).await,
            Cmd::Del | Cmd::Unlink => self.del(args).await,
            Cmd::Strlen => self.strlen(args[0]).await,
            Cmd::Dbsize => match self.ctx.client.stat().await {
                Ok(s) => reply::int(
                    o,
                    (s.keys as usize + self.ctx.shared.collections.len()) as i64,
                ),
                Err(e) => reply::error(o, &pool_error(&e)),
            },
            Cmd::Flushall | Cmd::Flushdb => self.flushall(args).await,
            Cmd::Incr | Cmd::Decr | Cmd::Incrby | Cmd::Decrby => self.incr_by(cmd, args).await,
            Cmd::Lpush
            | Cmd::Rpush
            | Cmd::Lpop
            | Cmd::Rpop
            | Cmd::Lrange
            | Cmd::Llen
            | Cmd::Sadd
            | Cmd::Srem
            | Cmd::Spop
            | Cmd::Scard
            | Cmd::Sismember
            | Cmd::Smembers
            | Cmd::Hset
            | Cmd::Hget
            | Cmd::Hdel
            | Cmd::Hlen
            | Cmd::Hgetall
            | Cmd::Zadd
            | Cmd::Zpopmin
            | Cmd::Zcard
            | Cmd::Zscore
            | Cmd::Zrange => self.collection(cmd, args).await,
            Cmd::Info => {
                let text = crate::info::render(&self.ctx, args).await;
                reply::bulk(&mut self.out.bytes, text.as_bytes());
            }
        }
    }

    /// `AUTH [user] pass`: the user is `default` (the only one).
    fn auth(&mut self, args: &[&[u8]]) {
        let o = &mut self.out.bytes;
        let (user, pass) = match args {
            [p] => (None, *p),
            [u, p] => (Some(*u), *p),
            _ => return reply::error(o, "ERR syntax error"),
        };
        let want = self.ctx.shared.cfg.requirepass.as_bytes();
        if want.is_empty() && user.is_none() {
            return reply::error(
                o,
                "ERR AUTH <password> called without any password configured for the default \
                 user. Are you sure your configuration is correct?",
            );
        }
        match self.check_password(user, pass) {
            Ok(()) => reply::ok(&mut self.out.bytes),
            Err(e) => reply::error(&mut self.out.bytes, e),
        }
    }

    /// Checks a user and password; on success the connection is
    /// authenticated. Without a password configured, `default` with any
    /// password is accepted (Redis's `nopass` user).
    fn check_password(&mut self, user: Option<&[u8]>, pass: &[u8]) -> Result<(), &'static str> {
        let wrong = "WRONGPASS invalid username-password pair or user is disabled.";
        if user.is_some_and(|u| u != b"default") {
            self.ctx.shared.metrics.auth_failures.inc();
            return Err(wrong);
        }
        let want = self.ctx.shared.cfg.requirepass.as_bytes();
        if want.is_empty() || kvpool_wire::auth::constant_time_eq(pass, want) {
            self.authed = true;
            Ok(())
        } else {
            self.ctx.shared.metrics.auth_failures.inc();
            Err(wrong)
        }
    }

    /// `HELLO [2 [AUTH user pass] [SETNAME name]]`: RESP2 only.
    fn hello(&mut self, args: &[&[u8]]) {
        let mut resp3 = self.resp3;
        if let Some(v) = args.first() {
            match parse_int(v) {
                Some(2) => resp3 = false,
                Some(3) => resp3 = true,
                Some(_) => {
                    return reply::error(
                        &mut self.out.bytes,
                        "NOPROTO unsupported protocol version",
                    )
                }
                None => {
                    return reply::error(
                        &mut self.out.bytes,
                        "ERR Protocol version is not an integer or out of range",
                    )
                }
            }
        }
        let mut name = None;
        let mut k = 1;
        while k < args.len() {
            let opt = args[k];
            if opt.eq_ignore_ascii_case(b"AUTH") && k + 2 < args.len() {
                if let Err(e) = self.check_password(Some(args[k + 1]), args[k + 2]) {
                    return reply::error(&mut self.out.bytes, e);
                }
                k += 3;
            } else if opt.eq_ignore_ascii_case(b"SETNAME") && k + 1 < args.len() {
                name = Some(args[k + 1]);
                k += 2;
            } else {
                return reply::error(
                    &mut self.out.bytes,
                    &format!("ERR Syntax error in HELLO option '{}'", shown(opt)),
                );
            }
        }
        if self.need_auth() {
            return reply::error(
                &mut self.out.bytes,
                "NOAUTH HELLO must be called with the client already authenticated, otherwise \
                 the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the \
                 client and select the RESP protocol version at the same time",
            );
        }
        if let Some(n) = name {
            if let Err(e) = check_client_name(n) {
                return reply::error(&mut self.out.bytes, e);
            }
            self.meta.names().name = (!n.is_empty()).then(|| n.to_vec());
        }
        // The protocol changes with this reply (Redis answers HELLO 3 in
        // RESP3).
        self.resp3 = resp3;
        self.meta.set_resp3(resp3);
        let o = &mut self.out.bytes;
        reply::map(o, 7, resp3);
        for (k, v) in [("server", "redis"), ("version", crate::info::REDIS_VERSION)] {
            reply::bulk(o, k.as_bytes());
            reply::bulk(o, v.as_bytes());
        }
        reply::bulk(o, b"proto");
        reply::int(o, if resp3 { 3 } else { 2 });
        reply::bulk(o, b"id");
        reply::int(o, self.id as i64);
        for (k, v) in [("mode", "standalone"), ("role", "master")] {
            reply::bulk(o, k.as_bytes());
            reply::bulk(o, v.as_bytes());
        }
        reply::bulk(o, b"modules");
        reply::array(o, 0);
    }

    /// `CLIENT ID | INFO | LIST [TYPE NORMAL] | SETNAME n | GETNAME |
    /// SETINFO LIB-NAME|LIB-VER v | HELP`.
    fn client_cmd(&mut self, args: &[&[u8]]) {
        let sub = args[0];
        let o = &mut self.out.bytes;
        let is = |s: &str| sub.eq_ignore_ascii_case(s.as_bytes());
        if is("ID") && args.len() == 1 {
            reply::int(o, self.id as i64);
        } else if is("SETNAME") && args.len() == 2 {
            match check_client_name(args[1]) {
                Ok(()) => {
                    self.meta.names().name = (!args[1].is_empty()).then(|| args[1].to_vec());
                    reply::ok(o);
                }
                Err(e) => reply::error(o, e),
            }
        } else if is("GETNAME") && args.len() == 1 {
            match &self.meta.names().name {
                Some(n) => reply::bulk(o, n),
                None => reply::nil(o, self.resp3),
            }
        } else if is("INFO") && args.len() == 1 {
            reply::bulk(o, self.meta.line().as_bytes());
        } else if is("LIST") && (args.len() == 1 || is_type_normal(&args[1..])) {
            reply::bulk(o, self.ctx.shared.clients.list().as_bytes());
        } else if is("SETINFO") && args.len() == 3 {
            let attr = args[1];
            if check_client_name(args[2]).is_err() {
                return reply::error(
                    o,
                    &format!(
                        "ERR {} cannot contain spaces, newlines or special characters.",
                        shown(attr)
                    ),
                );
            }
            if attr.eq_ignore_ascii_case(b"LIB-NAME") {
                self.meta.names().lib_name = Some(args[2].to_vec());
                reply::ok(o);
            } else if attr.eq_ignore_ascii_case(b"LIB-VER") {
                self.meta.names().lib_ver = Some(args[2].to_vec());
                reply::ok(o);
            } else {
                reply::error(o, &format!("ERR Unrecognized option '{}'", shown(attr)));
            }
        } else if is("HELP") {
            let lines = [
                "CLIENT <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
                "ID",
                "    Return the ID of the current connection.",
                "INFO",
                "    Return information about the current client connection.",
                "LIST [TYPE NORMAL]",
                "    Return information about the open client connections.",
                "GETNAME",
                "    Return the name of the current connection.",
                "SETNAME <connection-name>",
                "    Assign the name <connection-name> to the current connection.",
                "SETINFO <option> <value>",
                "    Set client meta attr. Options are: LIB-NAME, LIB-VER.",
                "HELP",
                "    Print this help.",
            ];
            reply::array(o, lines.len());
            for l in lines {
                reply::simple(o, l);
            }
        } else {
            reply::error(
                o,
                &format!(
                    "ERR unknown subcommand or wrong number of arguments for '{}'. Try CLIENT HELP.",
                    shown(sub)
                ),
            );
        }
    }

    /// `COMMAND`, `COMMAND COUNT | LIST | INFO [name..] | DOCS [name..]`.
    fn command_cmd(&mut self, args: &[&[u8]]) {
        let o = &mut self.out.bytes;
        let Some(sub) = args.first() else {
            reply::array(o, SPECS.len());
            for s in SPECS {
                command_info(o, s);
            }
            return;
        };
        let is = |s: &str| sub.eq_ignore_ascii_case(s.as_bytes());
        let named = |names: &[&[u8]]| -> Vec<Option<&'static crate::commands::Spec>> {
            if names.is_empty() {
                SPECS.iter().map(Some).collect()
            } else {
                names
                    .iter()
                    .map(|n| Cmd::lookup(n).map(Cmd::spec))
                    .collect()
            }
        };
        if is("COUNT") && args.len() == 1 {
            reply::int(o, SPECS.len() as i64);
        } else if is("LIST") && args.len() == 1 {
            reply::array(o, SPECS.len());
            for s in SPECS {
                reply::bulk(o, s.name.as_bytes());
            }
        } else if is("INFO") {
            let specs = named(&args[1..]);
            reply::array(o, specs.len());
            for s in specs {
                match s {
                    Some(s) => command_info(o, s),
                    None => reply::array_nil(o, self.resp3),
                }
            }
        } else if is("DOCS") {
            let specs: Vec<_> = named(&args[1..]).into_iter().flatten().collect();
            reply::map(o, specs.len(), self.resp3);
            for s in specs {
                reply::bulk(o, s.name.as_bytes());
                command_docs(o, s, self.resp3);
            }
        } else {
            reply::error(
                o,
                &format!(
                    "ERR unknown subcommand or wrong number of arguments for '{}'. Try COMMAND HELP.",
                    shown(sub)
                ),
            );
        }
    }

    /// Stores `items` (distinct keys), each replacing any value atomically
    /// (the pool's replace): one result per item, in order, as the error
    /// reply's text. One batch for several; the keys are this thread's
    /// while it runs (see [`crate::locks`]).
    pub(crate) async fn store(&self, items: &[(&[u8], &[u8])]) -> Vec<Result<(), String>> {
        let mut out: Vec<Result<(), String>> = items
            .iter()
            .map(|(k, v)| check_key(k).and_then(|()| check_value(v)))
            .collect();
        let todo: Vec<(&[u8], &[u8])> = items
            .iter()
            .zip(&out)
            .filter(|(_, r)| r.is_ok())
            .map(|(kv, _)| *kv)
            .collect();
        if todo.is_empty() {
            return out;
        }
        let keys: Vec<&[u8]> = todo.iter().map(|(k, _)| *k).collect();
        let within = Duration::from_millis(self.ctx.client_timeout_ms);
        let busy = "ERR another SET of this key did not end in time";
        let client = &self.ctx.client;
        if let [(key, value)] = todo[..] {
            // One key: SETs of it from this thread's other connections
            // combine, and another thread's write of it is waited for at
            // its stripe (see crate::locks).
            let stripe = self.ctx.shared.counters.of(key);
            let r = self
                .ctx
                .keys
                .set_one(key, value, stripe, within, busy, |joined| async move {
                    let v = joined.as_deref().unwrap_or(value);
                    let r = client.upsert(key, v).await.map_err(|e| pool_error(&e));
                    // Whatever the answer (a put that timed out may still
                    // have ended).
                    self.ctx.shared.views.forget(key);
                    if r.is_ok() {
                        // SET replaces a key of any type, as in Redis.
                        self.ctx.shared.collections.remove(key);
                    }
                    r
                })
                .await;
            if let Some(slot) = out.iter_mut().find(|r| r.is_ok()) {
                *slot = r;
            }
            return out;
        }
        // The keys' stripes first (as a SET of one key takes its own):
        // another RESP thread's write of one of them waits here, not at the
        // master; then this thread's hold on the keys.
        let deadline = tokio::time::Instant::now() + within;
        let stripes = self.ctx.shared.counters.lock_all(&keys, deadline).await;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let held = match stripes {
            Some(_) => self.ctx.keys.lock(&keys, left).await.ok(),
            None => None,
        };
        let (Some(_turns), Some(_held)) = (stripes, held) else {
            for r in out.iter_mut().filter(|r| r.is_ok()) {
                *r = Err(busy.into());
            }
            return out;
        };
        let opts = PutOptions {
            replace: true,
            ..PutOptions::default()
        };
        let done: Vec<Result<(), KvError>> = match client.batch_put(&todo, &opts).await {
            Ok(v) => v,
            Err(e) => todo.iter().map(|_| Err(e.clone())).collect(),
        };
        // Whatever the answers (a put that timed out may still have ended).
        for k in &keys {
            self.ctx.shared.views.forget(k);
        }
        for (k, r) in keys.iter().zip(&done) {
            if r.is_ok() {
                self.ctx.shared.collections.remove(k);
            }
        }
        let mut done = done.into_iter();
        for r in out.iter_mut().filter(|r| r.is_ok()) {
            if let Some(Err(e)) = done.next() {
                *r = Err(pool_error(&e));
            }
        }
        out
    }

    /// `MSET k v [k v ..]`: every key replaced (each atomically on its own);
    /// a key given twice takes its last value.
    async fn mset(&mut self, args: &[&[u8]]) {
        if !args.len().is_multiple_of(2) {
            return reply::error(
                &mut self.out.bytes,
                "ERR wrong number of arguments for 'mset' command",
            );
        }
        let mut items: Vec<(&[u8], &[u8])> = Vec::with_capacity(args.len() / 2);
        for pair in args.chunks(2) {
            if let Err(e) = check_key(pair[0]).and_then(|()| check_value(pair[1])) {
                return reply::error(&mut self.out.bytes, &e);
            }
            items.push((pair[0], pair[1]));
        }
        // The last value of each key wins, as if set one after another.
        let mut seen = std::collections::HashSet::new();
        let mut last: Vec<(&[u8], &[u8])> = items
            .iter()
            .rev()
            .filter(|(k, _)| seen.insert(*k))
            .copied()
            .collect();
        last.reverse();
        let mut first_err = None;
        for chunk in last.chunks(self.ctx.shared.cfg.batch_keys) {
            if let Some(Err(e)) = self.store(chunk).await.into_iter().find(|r| r.is_err()) {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            None => reply::ok(&mut self.out.bytes),
            Some(e) => reply::error(&mut self.out.bytes, &e),
        }
    }

    /// `MGET k [k ..]`: an array of values, nil for missing keys; one pool
    /// error fails the whole reply (never a miss in its place).
    async fn mget(&mut self, keys: &[&[u8]]) {
        let mut all: Vec<Fetched> = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.ctx.shared.cfg.batch_keys) {
            // A key the pool cannot hold is simply missing here, as an
            // unknown key is in Redis.
            let fetched = self.fetch(chunk).await;
            for (f, k) in fetched.into_iter().zip(chunk) {
                all.push(match f {
                    // Redis's MGET: nil for a key it cannot hold and for one
                    // of another type.
                    Fetched::Error(e) if check_key(k).is_err() || e == WRONGTYPE => Fetched::Nil,
                    f => f,
                });
            }
        }
        if let Some(Fetched::Error(e)) = all.iter().find(|f| matches!(f, Fetched::Error(_))) {
            let e = e.clone();
            return reply::error(&mut self.out.bytes, &e);
        }
        reply::array(&mut self.out.bytes, all.len());
        for f in all {
            self.put_fetched(f);
        }
    }

    /// `EXISTS k [k ..]`: how many of the keys exist (a key named twice
    /// counts twice).
    async fn exists(&mut self, keys: &[&[u8]]) {
        let unique = unique_keys(keys);
        let mut found = std::collections::HashSet::new();
        let colls = &self.ctx.shared.collections;
        found.extend(unique.iter().filter(|k| colls.kind_of(k).is_some()));
        for chunk in unique.chunks(self.ctx.shared.cfg.batch_keys) {
            match self.ctx.client.batch_exists(chunk).await {
                Ok(rs) => {
                    for (r, k) in rs.into_iter().zip(chunk) {
                        match r {
                            Ok(true) => {
                                found.insert(*k);
                            }
                            Ok(false) => {}
                            Err(e) if is_miss(&e) => {}
                            Err(e) => return reply::error(&mut self.out.bytes, &pool_error(&e)),
                        }
                    }
                }
                Err(e) => return reply::error(&mut self.out.bytes, &pool_error(&e)),
            }
        }
        let n = keys.iter().filter(|k| found.contains(*k)).count();
        reply::int(&mut self.out.bytes, n as i64);
    }

    /// `DEL` / `UNLINK k [k ..]`: how many of the keys were removed. A
    /// reader's lease does not stop it (the space is freed once the lease
    /// ends).
    async fn del(&mut self, keys: &[&[u8]]) {
        let unique = unique_keys(keys);
        // A key counts once, held by a collection, the pool or both.
        let colls = &self.ctx.shared.collections;
        let held: std::collections::HashSet<&[u8]> =
            unique.iter().copied().filter(|k| colls.remove(k)).collect();
        let mut removed = held.len() as i64;
        for chunk in unique.chunks(self.ctx.shared.cfg.batch_keys) {
            let r = self.ctx.client.batch_remove(chunk, true).await;
            for k in chunk {
                self.ctx.shared.views.forget(k);
            }
            match r {
                Ok(rs) => {
                    for (r, k) in rs.into_iter().zip(chunk) {
                        match r {
                            Ok(()) if !held.contains(k) => removed += 1,
                            Ok(()) => {}
                            Err(e) if is_miss(&e) => {}
                            Err(e) => return reply::error(&mut self.out.bytes, &pool_error(&e)),
                        }
                    }
                }
                Err(e) => return reply::error(&mut self.out.bytes, &pool_error(&e)),
            }
        }
        reply::int(&mut self.out.bytes, removed);
    }

    /// `STRLEN k`: the value's length, 0 if there is none.
    async fn strlen(&mut self, key: &[u8]) {
        if check_key(key).is_err() {
            return reply::int(&mut self.out.bytes, 0);
        }
        if self.ctx.shared.collections.kind_of(key).is_some() {
            return reply::error(&mut self.out.bytes, WRONGTYPE);
        }
        match self.ctx.client.describe(key).await {
            Ok(info) if info.complete => reply::int(&mut self.out.bytes, info.size as i64),
            Ok(_) => reply::int(&mut self.out.bytes, 0),
            Err(e) if is_miss(&e) => reply::int(&mut self.out.bytes, 0),
            Err(e) => reply::error(&mut self.out.bytes, &pool_error(&e)),
        }
    }

    /// `FLUSHALL` / `FLUSHDB [ASYNC|SYNC]`: removes every object.
    async fn flushall(&mut self, args: &[&[u8]]) {
        match args {
            [] => {}
            [m] if m.eq_ignore_ascii_case(b"ASYNC") || m.eq_ignore_ascii_case(b"SYNC") => {}
            _ => return reply::error(&mut self.out.bytes, "ERR syntax error"),
        }
        // Every key, under a reader's lease or not (as DEL: the space of a
        // value being read is freed when its lease ends).
        let r = self.ctx.client.remove_all_with(true).await;
        self.ctx.shared.views.clear();
        self.ctx.shared.collections.clear();
        match r {
            Ok(n) => {
                tracing::info!(conn = self.id, removed = n, "FLUSHALL");
                reply::ok(&mut self.out.bytes)
            }
            Err(e) => reply::error(&mut self.out.bytes, &pool_error(&e)),
        }
    }
}

/// `CLIENT LIST TYPE normal` (every connection of the front is a normal
/// one).
fn is_type_normal(args: &[&[u8]]) -> bool {
    matches!(args, [t, v] if t.eq_ignore_ascii_case(b"TYPE") && v.eq_ignore_ascii_case(b"NORMAL"))
}

/// Each key the pool can hold, once (keys it cannot hold do not exist).
fn unique_keys<'a>(keys: &[&'a [u8]]) -> Vec<&'a [u8]> {
    let mut v: Vec<&[u8]> = keys
        .iter()
        .copied()
        .filter(|k| check_key(k).is_ok())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Redis's rule for connection names and library attributes: printable
/// ASCII, no spaces.
fn check_client_name(n: &[u8]) -> Result<(), &'static str> {
    if n.iter().all(|&b| (b'!'..=b'~').contains(&b)) {
        Ok(())
    } else {
        Err("ERR Client names cannot contain spaces, newlines or special characters.")
    }
}

/// One entry of `COMMAND` / `COMMAND INFO`.
fn command_info(o: &mut Vec<u8>, s: &crate::commands::Spec) {
    reply::array(o, 10);
    reply::bulk(o, s.name.as_bytes());
    reply::int(o, s.arity);
    reply::array(o, s.flags.len());
    for f in s.flags {
        reply::simple(o, f);
    }
    reply::int(o, s.first_key);
    reply::int(o, s.last_key);
    reply::int(o, s.step);
    reply::array(o, s.acl.len());
    for a in s.acl {
        reply::simple(o, a);
    }
    reply::array(o, 0); // tips
    reply::array(o, 0); // key specifications
    reply::array(o, 0); // subcommands
}

/// One command's `COMMAND DOCS` map (a flat array in RESP2).
fn command_docs(o: &mut Vec<u8>, s: &crate::commands::Spec, resp3: bool) {
    reply::map(o, 5, resp3);
    for (k, v) in [
        ("summary", s.summary),
        ("since", s.since),
        ("group", s.group),
        ("complexity", s.complexity),
    ] {
        reply::bulk(o, k.as_bytes());
        reply::bulk(o, v.as_bytes());
    }
    reply::bulk(o, b"arguments");
    reply::array(o, s.args.len());
    for (name, ty, flags) in s.args {
        let flags: Vec<&str> = flags.split(',').filter(|f| !f.is_empty()).collect();
        reply::map(o, if flags.is_empty() { 3 } else { 4 }, resp3);
        for (k, v) in [("name", *name), ("type", *ty), ("display_text", *name)] {
            reply::bulk(o, k.as_bytes());
            reply::bulk(o, v.as_bytes());
        }
        if !flags.is_empty() {
            reply::bulk(o, b"flags");
            reply::array(o, flags.len());
            for f in flags {
                reply::simple(o, f);
            }
        }
    }
}
