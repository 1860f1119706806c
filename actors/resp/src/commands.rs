//! The commands the front answers: names, arity, what `COMMAND` and
//! `COMMAND DOCS` say about them, and the index their metrics live at.

/// One command the front knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmd {
    Get,
    Set,
    Mget,
    Mset,
    Exists,
    Del,
    Unlink,
    Strlen,
    Ping,
    Echo,
    Auth,
    Hello,
    Select,
    Client,
    Info,
    Dbsize,
    Flushall,
    Command,
    Quit,
    Setnx,
    Setex,
    Psetex,
    Getset,
    Ttl,
    Pttl,
    Expire,
    Pexpire,
    Expireat,
    Pexpireat,
    Persist,
    Type,
    Flushdb,
    Config,
    Multi,
    Exec,
    Discard,
}

/// What `COMMAND` and `COMMAND DOCS` tell about a command.
pub struct Spec {
    pub cmd: Cmd,
    /// Lower case, as Redis names it.
    pub name: &'static str,
    /// Redis's arity: n = exactly n arguments with the name; -n = at least n.
    pub arity: i64,
    pub flags: &'static [&'static str],
    pub first_key: i64,
    pub last_key: i64,
    pub step: i64,
    pub acl: &'static [&'static str],
    pub summary: &'static str,
    pub since: &'static str,
    pub group: &'static str,
    pub complexity: &'static str,
    /// Arguments after the name, for `COMMAND DOCS`: (name, type, flags).
    /// Only plain types (`key`, `string`, `integer`): redis-cli expects a
    /// `block` or `oneof` to carry nested arguments.
    pub args: &'static [(&'static str, &'static str, &'static str)],
}

/// Every command, in the order of [`Cmd`] (a command's index is its
/// position here, and its metrics' index).
pub static SPECS: &[Spec] = &[
    Spec {
        cmd: Cmd::Get,
        name: "get",
        arity: 2,
        flags: &["readonly", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@read", "@string", "@fast"],
        summary: "Returns the string value of a key.",
        since: "1.0.0",
        group: "string",
        complexity: "O(1)",
        args: &[("key", "key", "")],
    },
    Spec {
        cmd: Cmd::Set,
        name: "set",
        arity: -3,
        flags: &["write", "denyoom"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@write", "@string", "@slow"],
        summary: "Sets the string value of a key (NX, XX, GET; EX/PX/EXAT/PXAT soft-pin it that long: kvpool keys do not expire).",
        since: "1.0.0",
        group: "string",
        complexity: "O(1)",
        args: &[("key", "key", ""), ("value", "string", "")],
    },
    Spec {
        cmd: Cmd::Mget,
        name: "mget",
        arity: -2,
        flags: &["readonly", "fast"],
        first_key: 1,
        last_key: -1,
        step: 1,
        acl: &["@read", "@string", "@fast"],
        summary: "Atomically returns the string values of one or more keys.",
        since: "1.0.0",
        group: "string",
        complexity: "O(N) where N is the number of keys to retrieve.",
        args: &[("key", "key", "multiple")],
    },
    Spec {
        cmd: Cmd::Mset,
        name: "mset",
        arity: -3,
        flags: &["write", "denyoom"],
        first_key: 1,
        last_key: -1,
        step: 2,
        acl: &["@write", "@string", "@slow"],
        summary:
            "Sets the string values of one or more keys (each replaced atomically on its own).",
        since: "1.0.1",
        group: "string",
        complexity: "O(N) where N is the number of keys to set.",
        args: &[("key", "key", "multiple"), ("value", "string", "multiple")],
    },
    Spec {
        cmd: Cmd::Exists,
        name: "exists",
        arity: -2,
        flags: &["readonly", "fast"],
        first_key: 1,
        last_key: -1,
        step: 1,
        acl: &["@keyspace", "@read", "@fast"],
        summary: "Determines whether one or more keys exist.",
        since: "1.0.0",
        group: "generic",
        complexity: "O(N) where N is the number of keys to check.",
        args: &[("key", "key", "multiple")],
    },
    Spec {
        cmd: Cmd::Del,
        name: "del",
        arity: -2,
        flags: &["write"],
        first_key: 1,
        last_key: -1,
        step: 1,
        acl: &["@keyspace", "@write", "@slow"],
        summary: "Deletes one or more keys.",
        since: "1.0.0",
        group: "generic",
        complexity: "O(N) where N is the number of keys that will be removed.",
        args: &[("key", "key", "multiple")],
    },
    Spec {
        cmd: Cmd::Unlink,
        name: "unlink",
        arity: -2,
        flags: &["write", "fast"],
        first_key: 1,
        last_key: -1,
        step: 1,
        acl: &["@keyspace", "@write", "@fast"],
        summary:
            "Deletes one or more keys (as DEL: the pool frees space once readers' leases end).",
        since: "4.0.0",
        group: "generic",
        complexity: "O(N) where N is the number of keys that will be removed.",
        args: &[("key", "key", "multiple")],
    },
    Spec {
        cmd: Cmd::Strlen,
        name: "strlen",
        arity: 2,
        flags: &["readonly", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@read", "@string", "@fast"],
        summary: "Returns the length of a string value.",
        since: "2.2.0",
        group: "string",
        complexity: "O(1)",
        args: &[("key", "key", "")],
    },
    Spec {
        cmd: Cmd::Ping,
        name: "ping",
        arity: -1,
        flags: &["fast"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@fast", "@connection"],
        summary: "Returns the server's liveliness response.",
        since: "1.0.0",
        group: "connection",
        complexity: "O(1)",
        args: &[("message", "string", "optional")],
    },
    Spec {
        cmd: Cmd::Echo,
        name: "echo",
        arity: 2,
        flags: &["fast"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@fast", "@connection"],
        summary: "Returns the given string.",
        since: "1.0.0",
        group: "connection",
        complexity: "O(1)",
        args: &[("message", "string", "")],
    },
    Spec {
        cmd: Cmd::Auth,
        name: "auth",
        arity: -2,
        flags: &[
            "noscript",
            "loading",
            "stale",
            "fast",
            "no_auth",
            "allow_busy",
        ],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@fast", "@connection"],
        summary: "Authenticates the connection.",
        since: "1.0.0",
        group: "connection",
        complexity: "O(N) where N is the number of passwords defined for the user",
        args: &[
            ("username", "string", "optional"),
            ("password", "string", ""),
        ],
    },
    Spec {
        cmd: Cmd::Hello,
        name: "hello",
        arity: -1,
        flags: &[
            "noscript",
            "loading",
            "stale",
            "fast",
            "no_auth",
            "allow_busy",
        ],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@fast", "@connection"],
        summary: "Handshakes with the server (protocol 2 only).",
        since: "6.0.0",
        group: "connection",
        complexity: "O(1)",
        args: &[("protover", "integer", "optional")],
    },
    Spec {
        cmd: Cmd::Select,
        name: "select",
        arity: 2,
        flags: &["loading", "stale", "fast"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@keyspace", "@fast", "@connection"],
        summary: "Changes the selected database (the pool has one: 0).",
        since: "1.0.0",
        group: "connection",
        complexity: "O(1)",
        args: &[("index", "integer", "")],
    },
    Spec {
        cmd: Cmd::Client,
        name: "client",
        arity: -2,
        flags: &["noscript", "loading", "stale"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@slow", "@connection"],
        summary: "A container for client connection commands (ID, INFO, LIST, SETNAME, GETNAME, SETINFO).",
        since: "2.4.0",
        group: "connection",
        complexity: "Depends on subcommand.",
        args: &[("subcommand", "string", "")],
    },
    Spec {
        cmd: Cmd::Info,
        name: "info",
        arity: -1,
        flags: &["loading", "stale"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@slow", "@dangerous"],
        summary: "Returns information and statistics about the server and the pool.",
        since: "1.0.0",
        group: "server",
        complexity: "O(1)",
        args: &[("section", "string", "optional,multiple")],
    },
    Spec {
        cmd: Cmd::Dbsize,
        name: "dbsize",
        arity: 1,
        flags: &["readonly", "fast"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@keyspace", "@read", "@fast"],
        summary: "Returns the number of keys in the pool.",
        since: "1.0.0",
        group: "server",
        complexity: "O(1)",
        args: &[],
    },
    Spec {
        cmd: Cmd::Flushall,
        name: "flushall",
        arity: -1,
        flags: &["write"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@keyspace", "@write", "@slow", "@dangerous"],
        summary: "Removes every key of the pool (readers' leases or not).",
        since: "1.0.0",
        group: "server",
        complexity: "O(N) where N is the total number of keys in all databases",
        args: &[("flush-type", "string", "optional")],
    },
    Spec {
        cmd: Cmd::Command,
        name: "command",
        arity: -1,
        flags: &["loading", "stale"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@slow", "@connection"],
        summary: "Returns detailed information about all commands.",
        since: "2.8.13",
        group: "server",
        complexity: "O(N) where N is the total number of Redis commands",
        args: &[],
    },
    Spec {
        cmd: Cmd::Quit,
        name: "quit",
        arity: -1,
        flags: &[
            "allow_busy",
            "noscript",
            "loading",
            "stale",
            "fast",
            "no_auth",
        ],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@fast", "@connection"],
        summary: "Closes the connection.",
        since: "1.0.0",
        group: "connection",
        complexity: "O(1)",
        args: &[],
    },
    Spec {
        cmd: Cmd::Setnx,
        name: "setnx",
        arity: 3,
        flags: &["write", "denyoom", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@write", "@string", "@fast"],
        summary: "Sets the string value of a key only when the key does not exist.",
        since: "1.0.0",
        group: "string",
        complexity: "O(1)",
        args: &[("key", "key", ""), ("value", "string", "")],
    },
    Spec {
        cmd: Cmd::Setex,
        name: "setex",
        arity: 4,
        flags: &["write", "denyoom"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@write", "@string", "@slow"],
        summary: "Sets the string value of a key, soft-pinned for the given seconds (kvpool keys do not expire).",
        since: "2.0.0",
        group: "string",
        complexity: "O(1)",
        args: &[("key", "key", ""), ("seconds", "integer", ""), ("value", "string", "")],
    },
    Spec {
        cmd: Cmd::Psetex,
        name: "psetex",
        arity: 4,
        flags: &["write", "denyoom"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@write", "@string", "@slow"],
        summary: "Sets the string value of a key, soft-pinned for the given milliseconds (kvpool keys do not expire).",
        since: "2.6.0",
        group: "string",
        complexity: "O(1)",
        args: &[("key", "key", ""), ("milliseconds", "integer", ""), ("value", "string", "")],
    },
    Spec {
        cmd: Cmd::Getset,
        name: "getset",
        arity: 3,
        flags: &["write", "denyoom", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@write", "@string", "@fast"],
        summary: "Returns the previous string value of a key after setting it to a new value.",
        since: "1.0.0",
        group: "string",
        complexity: "O(1)",
        args: &[("key", "key", ""), ("value", "string", "")],
    },
    Spec {
        cmd: Cmd::Ttl,
        name: "ttl",
        arity: 2,
        flags: &["readonly", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@keyspace", "@read", "@fast"],
        summary: "Returns -1 for a key that exists (kvpool keys do not expire), -2 for one that does not.",
        since: "1.0.0",
        group: "generic",
        complexity: "O(1)",
        args: &[("key", "key", "")],
    },
    Spec {
        cmd: Cmd::Pttl,
        name: "pttl",
        arity: 2,
        flags: &["readonly", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@keyspace", "@read", "@fast"],
        summary: "Returns -1 for a key that exists (kvpool keys do not expire), -2 for one that does not.",
        since: "2.6.0",
        group: "generic",
        complexity: "O(1)",
        args: &[("key", "key", "")],
    },
    Spec {
        cmd: Cmd::Expire,
        name: "expire",
        arity: -3,
        flags: &["write", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@keyspace", "@write", "@fast"],
        summary: "Removes the key when the time given is not in the future; otherwise sets no timeout (0).",
        since: "1.0.0",
        group: "generic",
        complexity: "O(1)",
        args: &[("key", "key", ""), ("seconds", "integer", ""), ("condition", "string", "optional")],
    },
    Spec {
        cmd: Cmd::Pexpire,
        name: "pexpire",
        arity: -3,
        flags: &["write", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@keyspace", "@write", "@fast"],
        summary: "Removes the key when the time given is not in the future; otherwise sets no timeout (0).",
        since: "2.6.0",
        group: "generic",
        complexity: "O(1)",
        args: &[("key", "key", ""), ("milliseconds", "integer", ""), ("condition", "string", "optional")],
    },
    Spec {
        cmd: Cmd::Expireat,
        name: "expireat",
        arity: -3,
        flags: &["write", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@keyspace", "@write", "@fast"],
        summary: "Removes the key when the time given is not in the future; otherwise sets no timeout (0).",
        since: "1.2.0",
        group: "generic",
        complexity: "O(1)",
        args: &[("key", "key", ""), ("unix-time-seconds", "integer", ""), ("condition", "string", "optional")],
    },
    Spec {
        cmd: Cmd::Pexpireat,
        name: "pexpireat",
        arity: -3,
        flags: &["write", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@keyspace", "@write", "@fast"],
        summary: "Removes the key when the time given is not in the future; otherwise sets no timeout (0).",
        since: "2.6.0",
        group: "generic",
        complexity: "O(1)",
        args: &[("key", "key", ""), ("unix-time-milliseconds", "integer", ""), ("condition", "string", "optional")],
    },
    Spec {
        cmd: Cmd::Persist,
        name: "persist",
        arity: 2,
        flags: &["write", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@keyspace", "@write", "@fast"],
        summary: "Removes a key's timeout: always 0, kvpool keys have none.",
        since: "2.2.0",
        group: "generic",
        complexity: "O(1)",
        args: &[("key", "key", "")],
    },
    Spec {
        cmd: Cmd::Type,
        name: "type",
        arity: 2,
        flags: &["readonly", "fast"],
        first_key: 1,
        last_key: 1,
        step: 1,
        acl: &["@keyspace", "@read", "@fast"],
        summary: "Returns the type of the value of a key: string, or none.",
        since: "1.0.0",
        group: "generic",
        complexity: "O(1)",
        args: &[("key", "key", "")],
    },
    Spec {
        cmd: Cmd::Flushdb,
        name: "flushdb",
        arity: -1,
        flags: &["write"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@keyspace", "@write", "@slow", "@dangerous"],
        summary: "Removes every key of the pool (its one database), readers' leases or not.",
        since: "1.0.0",
        group: "server",
        complexity: "O(N) where N is the number of keys in the selected database",
        args: &[("flush-type", "string", "optional")],
    },
    Spec {
        cmd: Cmd::Config,
        name: "config",
        arity: -2,
        flags: &["admin", "noscript", "loading", "stale"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@admin", "@slow", "@dangerous"],
        summary: "CONFIG GET parameter [parameter ...] (read only: kvpool is configured by its file and flags).",
        since: "2.0.0",
        group: "server",
        complexity: "Depends on subcommand.",
        args: &[("subcommand", "string", "")],
    },
    Spec {
        cmd: Cmd::Multi,
        name: "multi",
        arity: 1,
        flags: &["noscript", "loading", "stale", "fast", "allow_busy"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@fast", "@transaction"],
        summary: "Starts a transaction: commands are queued until EXEC.",
        since: "1.2.0",
        group: "transactions",
        complexity: "O(1)",
        args: &[],
    },
    Spec {
        cmd: Cmd::Exec,
        name: "exec",
        arity: 1,
        flags: &["noscript", "loading", "stale", "skip_slowlog"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@slow", "@transaction"],
        summary: "Runs the queued commands in order (no other connection's command is held back meanwhile).",
        since: "1.2.0",
        group: "transactions",
        complexity: "Depends on commands in the transaction",
        args: &[],
    },
    Spec {
        cmd: Cmd::Discard,
        name: "discard",
        arity: 1,
        flags: &["noscript", "loading", "stale", "fast", "allow_busy"],
        first_key: 0,
        last_key: 0,
        step: 0,
        acl: &["@fast", "@transaction"],
        summary: "Discards a transaction.",
        since: "2.0.0",
        group: "transactions",
        complexity: "O(N), when N is the number of queued commands",
        args: &[],
    },
];

impl Cmd {
    /// Index into [`SPECS`] and the metrics.
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn spec(self) -> &'static Spec {
        &SPECS[self.index()]
    }

    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// The command named `name` (any case).
    pub fn lookup(name: &[u8]) -> Option<Cmd> {
        if name.len() > 16 {
            return None;
        }
        SPECS
            .iter()
            .find(|s| s.name.as_bytes().eq_ignore_ascii_case(name))
            .map(|s| s.cmd)
    }

    /// Whether `argc` arguments (the name included) fit the arity.
    pub fn arity_ok(self, argc: usize) -> bool {
        let a = self.spec().arity;
        if a >= 0 {
            argc as i64 == a
        } else {
            argc as i64 >= -a
        }
    }

    /// May run before AUTH when a password is set.
    pub fn no_auth(self) -> bool {
        matches!(self, Cmd::Auth | Cmd::Hello | Cmd::Quit)
    }
}

/// Why a Redis command kvpool does not run is refused: the reply names the
/// command and this reason, so that a tool's log says what to change.
pub fn unsupported(name: &[u8]) -> Option<&'static str> {
    const IN_PLACE: &[&str] = &[
        "incr",
        "decr",
        "incrby",
        "decrby",
        "incrbyfloat",
        "append",
        "setrange",
        "getrange",
        "substr",
        "getdel",
        "getex",
        "msetnx",
        "lcs",
    ];
    const TYPES: &[&str] = &[
        "lpush",
        "rpush",
        "lpushx",
        "rpushx",
        "lpop",
        "rpop",
        "lrange",
        "llen",
        "lindex",
        "lset",
        "lrem",
        "ltrim",
        "linsert",
        "lmove",
        "blpop",
        "brpop",
        "sadd",
        "srem",
        "spop",
        "smembers",
        "sismember",
        "scard",
        "srandmember",
        "sinter",
        "sunion",
        "sdiff",
        "hset",
        "hsetnx",
        "hget",
        "hmset",
        "hmget",
        "hgetall",
        "hdel",
        "hexists",
        "hlen",
        "hkeys",
        "hvals",
        "hincrby",
        "zadd",
        "zrem",
        "zrange",
        "zrangebyscore",
        "zscore",
        "zcard",
        "zincrby",
        "zpopmin",
        "zpopmax",
        "zrank",
        "xadd",
        "xrange",
        "xlen",
        "xread",
        "pfadd",
        "pfcount",
        "setbit",
        "getbit",
        "bitcount",
        "geoadd",
    ];
    const LISTING: &[&str] = &[
        "scan",
        "keys",
        "randomkey",
        "rename",
        "renamenx",
        "move",
        "copy",
    ];
    const PUBSUB: &[&str] = &[
        "subscribe",
        "psubscribe",
        "unsubscribe",
        "punsubscribe",
        "publish",
        "pubsub",
    ];
    const SCRIPTS: &[&str] = &[
        "eval",
        "evalsha",
        "eval_ro",
        "evalsha_ro",
        "script",
        "function",
        "fcall",
    ];
    const PERSIST: &[&str] = &["save", "bgsave", "bgrewriteaof", "lastsave"];
    let is_in = |set: &[&str]| set.iter().any(|c| c.as_bytes().eq_ignore_ascii_case(name));
    Some(if is_in(IN_PLACE) {
        "kvpool's values are immutable blobs: a value is replaced whole (SET), never changed in place"
    } else if is_in(TYPES) {
        "kvpool holds string values only (a KV-cache pool): no lists, sets, hashes, sorted sets, streams or bitmaps"
    } else if is_in(LISTING) {
        "kvpool does not list or rename its keys: they are spread over the master's shards"
    } else if is_in(PUBSUB) {
        "kvpool has no publish/subscribe"
    } else if is_in(SCRIPTS) {
        "kvpool runs no scripts"
    } else if is_in(PERSIST) {
        "kvpool's durability is the master's state directory and the NVMe tier, not RDB or AOF files"
    } else if name.eq_ignore_ascii_case(b"watch") || name.eq_ignore_ascii_case(b"unwatch") {
        "kvpool has no optimistic locking: MULTI/EXEC runs its queued commands in order, without WATCH"
    } else {
        return None;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_sits_at_its_own_index() {
        for (i, s) in SPECS.iter().enumerate() {
            assert_eq!(s.cmd.index(), i, "{}", s.name);
            assert_eq!(Cmd::lookup(s.name.to_uppercase().as_bytes()), Some(s.cmd));
        }
        assert_eq!(Cmd::lookup(b"gEt"), Some(Cmd::Get));
        assert_eq!(Cmd::lookup(b"getex"), None);
        assert!(unsupported(b"INCR").is_some() && unsupported(b"lpush").is_some());
        assert!(unsupported(b"get").is_none() && unsupported(b"nosuch").is_none());
        for s in SPECS {
            assert!(
                unsupported(s.name.as_bytes()).is_none(),
                "{} is run",
                s.name
            );
        }
        assert!(Cmd::Get.arity_ok(2) && !Cmd::Get.arity_ok(3));
        assert!(Cmd::Set.arity_ok(3) && Cmd::Set.arity_ok(5) && !Cmd::Set.arity_ok(2));
        for s in SPECS {
            for (name, ty, _) in s.args {
                assert!(
                    matches!(*ty, "key" | "string" | "integer"),
                    "{} {name}: redis-cli crashes on a {ty} without nested arguments",
                    s.name
                );
            }
        }
    }
}
