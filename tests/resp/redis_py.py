"""redis-py (the `redis` package) against kvpool's RESP front.

Usage: redis_py.py PORT [PASSWORD]

REDIS_PROTOCOL: 2 (the default here), 3, or `default` (what this redis-py
asks for by itself: RESP3 from redis-py 8 on, as `pip install lmcache`
brings it).

Every check raises on failure (the exit status is then non-zero and the
traceback names the check); on success it prints `ok: N checks`.
"""
import os
import sys

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

port = int(sys.argv[1])
password = sys.argv[2] if len(sys.argv) > 2 else None
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def expect_error(fn, *words):
    """`fn` raises a redis error whose text holds every word."""
    try:
        fn()
    except redis.exceptions.RedisError as e:
        text = str(e)
        for w in words:
            check(w in text, f"error {text!r} lacks {w!r}")
        return e
    raise AssertionError(f"no error, wanted one with {words}")


proto = os.environ.get("REDIS_PROTOCOL", "2")
major = int(redis.__version__.split(".")[0])
want_proto = 3 if proto == "3" or (proto == "default" and major >= 8) else 2


def connect(**kw):
    if proto != "default":
        kw["protocol"] = int(proto)
    # No retries: redis-py 8 retries a ConnectionError, and counts an
    # AuthenticationError as one, three times with backoff (3.6 s per refused
    # AUTH); the refusals below are the replies under test.
    kw["retry"] = Retry(NoBackoff(), 0)
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=20, **kw)


# --- auth ---------------------------------------------------------------
if password:
    anon = connect()
    # The reply is "-NOAUTH Authentication required."; redis-py 8 turns the
    # NOAUTH prefix into the exception's class and drops it from the text.
    for call in (lambda: anon.get("k"), lambda: anon.flushall()):
        # RESP3 clients (redis-py 8's default) open with HELLO 3, which is
        # refused first (with NOAUTH, as Redis does).
        e = expect_error(call)
        check(
            "Authentication required" in str(e)
            or "HELLO must be called with the client already authenticated" in str(e),
            f"{e!r} is not an authentication refusal",
        )
        check(
            "NOAUTH" in str(e) or isinstance(e, redis.exceptions.AuthenticationError),
            f"{type(e)} {e!r} is not NOAUTH",
        )
    wrong = connect(password="not-" + password)
    e = expect_error(lambda: wrong.ping(), "invalid username-password pair")
    check(isinstance(e, redis.exceptions.AuthenticationError), f"{type(e)}")
    named = connect(username="default", password=password)
    check(named.ping() is True, "AUTH default <pass>")
    other_user = connect(username="alice", password=password)
    expect_error(lambda: other_user.ping(), "invalid username-password pair")
    r = connect(password=password)
else:
    r = connect()
    expect_error(lambda: r.execute_command("AUTH", "x"), "without any password configured")

prefix = os.urandom(4).hex().encode() + b":"

# --- basics -------------------------------------------------------------
check(r.ping() is True, "PING")
check(r.echo(b"hi\r\nthere") == b"hi\r\nthere", "ECHO")
check(r.set(prefix + b"a", b"1") is True, "SET")
check(r.get(prefix + b"a") == b"1", "GET")
check(r.get(prefix + b"missing") is None, "GET of a missing key is None")
check(r.strlen(prefix + b"a") == 1, "STRLEN")
check(r.strlen(prefix + b"missing") == 0, "STRLEN missing")
check(r.exists(prefix + b"a", prefix + b"missing", prefix + b"a") == 2, "EXISTS counts twice")
expect_error(lambda: r.execute_command("HELLO", 4), "NOPROTO")
# HELLO with the protocol this connection speaks (another would change the
# server's replies under redis-py's parser).
hello = r.execute_command("HELLO", want_proto)
check(b"proto" in hello or "proto" in hello, f"HELLO {want_proto} {hello}")
check(r.execute_command("SELECT", 0) in (True, b"OK", "OK"), "SELECT 0")
expect_error(lambda: r.execute_command("SELECT", 1), "out of range")
expect_error(lambda: r.execute_command("NOSUCHCMD", "x"), "unknown command 'NOSUCHCMD'")

# --- replacing a value ----------------------------------------------------
check(r.set(prefix + b"a", b"two") is True, "SET over an existing key")
check(r.get(prefix + b"a") == b"two", "GET sees the replacing value")

# --- binary-safe keys and values ----------------------------------------
bkey = prefix + bytes(range(256))
bval = bytes(range(256)) * 4099
check(r.set(bkey, bval) is True, "SET binary")
check(r.get(bkey) == bval, "GET binary")
check(r.exists(bkey) == 1, "EXISTS binary")
long_key = prefix + b"k" * (4096 - len(prefix))
check(r.set(long_key, b"v") is True, "a 4096-byte key")
check(r.get(long_key) == b"v", "GET of a 4096-byte key")
expect_error(lambda: r.set(long_key + b"x", b"v"), "4096")
check(r.ping() is True, "the connection survives a refused key")
expect_error(lambda: r.set(prefix + b"empty", b""), "empty value")
big = os.urandom(8 << 20)
check(r.set(prefix + b"big", big) is True, "SET 8 MiB")
check(r.get(prefix + b"big") == big, "GET 8 MiB")

# --- MSET / MGET ----------------------------------------------------------
items = {prefix + b"m%d" % i: os.urandom(100 + i) for i in range(50)}
check(r.mset(items) is True, "MSET")
keys = list(items) + [prefix + b"nothere"]
got = r.mget(keys)
check(got[:-1] == list(items.values()), "MGET values in order")
check(got[-1] is None, "MGET of a missing key is None")
check(r.execute_command("MSET", prefix + b"dup", b"first", prefix + b"dup", b"last"), "MSET dup")
check(r.get(prefix + b"dup") == b"last", "MSET: the last value of a key wins")
check(r.delete(*items.keys(), prefix + b"nothere") == 50, "DEL counts removed keys")
check(r.mget(list(items)) == [None] * 50, "MGET after DEL")
check(r.unlink(prefix + b"dup", prefix + b"dup") == 1, "UNLINK counts a key once")

# --- pipelines ------------------------------------------------------------
p = r.pipeline(transaction=False)
vals = [os.urandom(1000 + i) for i in range(300)]
for i, v in enumerate(vals):
    p.set(prefix + b"p%d" % i, v)
for i in range(300):
    p.get(prefix + b"p%d" % i)
p.get(prefix + b"nothere")
p.exists(prefix + b"p0", prefix + b"p1")
p.incr(prefix + b"p0")  # an error inside a pipeline
p.get(prefix + b"p0")
res = p.execute(raise_on_error=False)
check(res[:300] == [True] * 300, "pipelined SETs")
check(res[300:600] == vals, "pipelined GETs in order")
check(res[600] is None, "pipelined GET miss")
check(res[601] == 2, "pipelined EXISTS")
check(isinstance(res[602], redis.exceptions.ResponseError), f"pipelined error {res[602]!r}")
check(res[603] == vals[0], "the pipeline goes on after an error")

# --- SET's options and a key's lifetime (kvpool keys do not expire: a time
# to live is a soft pin; see docs/architecture/resp.md) ------------------
t = prefix + b"ttl"
check(r.set(t, b"v1", ex=10) is True, "SET EX (LMCache's remote_ttl)")
check(r.get(t) == b"v1", "GET after SET EX")
check(r.ttl(t) == -1 and r.pttl(t) == -1, "TTL of a key: -1, no deletion scheduled")
check(r.ttl(prefix + b"none") == -2, "TTL of a missing key: -2")
check(r.set(t, b"v2", nx=True) is None, "SET NX on an existing key sets nothing")
check(r.get(t) == b"v1", "SET NX left the value")
check(r.set(prefix + b"nx", b"n", nx=True) is True, "SET NX on a missing key")
check(r.set(prefix + b"xx", b"x", xx=True) is None, "SET XX on a missing key sets nothing")
check(r.get(prefix + b"xx") is None, "SET XX made no key")
check(r.set(t, b"v3", xx=True, px=5000) is True, "SET XX PX on an existing key")
check(r.set(t, b"v4", get=True) == b"v3", "SET GET answers the old value")
check(r.get(t) == b"v4", "SET GET set the new one")
check(r.getset(t, b"v5") == b"v4", "GETSET")
check(r.setnx(t, b"no") is False and r.setnx(prefix + b"snx", b"y") is True, "SETNX")
check(r.setex(prefix + b"sx", 30, b"s") is True and r.get(prefix + b"sx") == b"s", "SETEX")
check(r.psetex(prefix + b"psx", 30000, b"p") is True, "PSETEX")
check(r.expire(t, 100) is False, "EXPIRE in the future sets no timeout (0)")
check(r.persist(t) is False, "PERSIST: no timeout to remove")
check(r.type(t) in (b"string", "string") and r.type(prefix + b"none") in (b"none", "none"), "TYPE")
check(r.expire(t, 0) is True, "EXPIRE 0 removes the key")
check(r.get(t) is None and r.exists(t) == 0, "the key is gone after EXPIRE 0")
check(r.pexpireat(prefix + b"sx", 1) is True and r.get(prefix + b"sx") is None, "PEXPIREAT past")
check(r.set(prefix + b"gone", b"g", exat=1) is True, "SET EXAT in the past answers OK")
check(r.get(prefix + b"gone") is None, "SET EXAT in the past leaves no value")
expect_error(lambda: r.set(t, b"v", ex=0), "invalid expire time")
expect_error(lambda: r.append(prefix + b"n", b"x"), "kvpool does not support 'APPEND'", "immutable")
expect_error(lambda: r.xadd(prefix + b"st", {"f": "v"}), "kvpool does not support 'XADD'", "streams")
expect_error(lambda: r.keys("*"), "kvpool does not support 'KEYS'")

# --- counters: strings in the pool, changed one at a time through the front --
c = prefix + b"counter"
check(r.incr(c) == 1 and r.incr(c, 41) == 42 and r.decr(c) == 41, "INCR / INCRBY / DECR")
check(r.decrby(c, 50) == -9 and r.get(c) == b"-9", "DECRBY; the counter is a string")
check(r.set(c, b"100") is True and r.incr(c) == 101, "INCR of a value SET")
expect_error(lambda: r.incr(prefix + b"p0"), "not an integer")
check(r.set(c, str(2**63 - 1)) is True, "SET the largest integer")
expect_error(lambda: r.incr(c), "overflow")
check(r.get(c) == str(2**63 - 1).encode(), "an overflowing INCR changes nothing")

# --- lists, sets, hashes, sorted sets: in the front's memory -----------------
L, S, H, Z = (prefix + x for x in (b"list", b"set", b"hash", b"zset"))
check(r.rpush(L, b"a", b"b") == 2 and r.lpush(L, b"z") == 3, "RPUSH / LPUSH")
check(r.lrange(L, 0, -1) == [b"z", b"a", b"b"] and r.llen(L) == 3, "LRANGE / LLEN")
check(r.lpop(L) == b"z" and r.rpop(L, 5) == [b"b", b"a"], "LPOP / RPOP with a count")
check(r.exists(L) == 0 and r.lpop(L) is None, "an emptied list is gone")
check(r.sadd(S, b"x", b"y", b"x") == 2 and r.scard(S) == 2, "SADD / SCARD")
check(r.sismember(S, b"x") in (1, True) and r.smembers(S) == {b"x", b"y"}, "SISMEMBER / SMEMBERS")
check(sorted(r.spop(S, 5)) == [b"x", b"y"] and r.spop(S) is None, "SPOP")
check(r.hset(H, mapping={b"f1": b"1", b"f2": b"2"}) == 2 and r.hget(H, b"f1") == b"1", "HSET / HGET")
check(r.hgetall(H) == {b"f1": b"1", b"f2": b"2"} and r.hlen(H) == 2, "HGETALL / HLEN")
check(r.hdel(H, b"f1", b"nope") == 1, "HDEL")
check(r.zadd(Z, {b"m1": 2, b"m2": 1.5, b"m3": -3}) == 3 and r.zcard(Z) == 3, "ZADD / ZCARD")
check(r.zscore(Z, b"m2") == 1.5, "ZSCORE")
check(r.zrange(Z, 0, -1) == [b"m3", b"m2", b"m1"], "ZRANGE")
# redis-py gives pairs as tuples in RESP2 and lists in RESP3 (as from Redis).
got = [tuple(p) for p in r.zrange(Z, 0, 0, withscores=True)]
check(got == [(b"m3", -3.0)], f"ZRANGE WITHSCORES {got!r}")
got = r.zpopmin(Z)
check(got in ([(b"m3", -3.0)], [b"m3", -3.0]), f"ZPOPMIN {got!r}")
check(r.type(H) in (b"hash", "hash") and r.type(Z) in (b"zset", "zset"), "TYPE of collections")
expect_error(lambda: r.get(H), "WRONGTYPE")
expect_error(lambda: r.lpush(H, b"x"), "WRONGTYPE")
expect_error(lambda: r.incr(H), "WRONGTYPE")
expect_error(lambda: r.sadd(c, b"x"), "WRONGTYPE")
expect_error(lambda: r.zadd(Z, {b"m": 1}, nx=True), "NX is not supported")
check(r.mget([H, c]) == [None, str(2**63 - 1).encode()], "MGET: nil for a hash")
check(r.exists(H, Z, c) == 3 and r.delete(H, Z) == 2, "EXISTS / DEL of collections")
check(r.set(S, b"str") is True and r.sadd(L, b"m") == 1, "a set key reused")
check(r.set(L, b"now a string") is True and r.get(L) == b"now a string", "SET replaces a set")

# --- transactions: redis-py's pipeline() is MULTI ... EXEC by default --------
tx = r.pipeline()
tx.set(prefix + b"tx1", b"one")
tx.get(prefix + b"tx1")
tx.set(prefix + b"tx2", b"two", ex=60)
tx.exists(prefix + b"tx1", prefix + b"tx2", prefix + b"none")
tx.delete(prefix + b"tx1")
tx.get(prefix + b"tx1")
check(tx.execute() == [True, b"one", True, 2, 1, None], "a transaction's replies in order")
check(r.get(prefix + b"tx2") == b"two", "a transaction's write stays")
tx = r.pipeline()
tx.set(prefix + b"tx3", b"three")
tx.execute_command("NOSUCHCMD", "x")
expect_error(lambda: tx.execute())
check(r.get(prefix + b"tx3") is None, "a transaction with a refused command writes nothing")
tx = r.pipeline()
tx.set(prefix + b"tx4", b"four")
tx.execute_command("APPEND", prefix + b"tx4", b"x")
# redis-py raises the first refusal (the server answered EXECABORT to EXEC).
expect_error(lambda: tx.execute(), "kvpool does not support 'APPEND'")
check(r.get(prefix + b"tx4") is None, "EXECABORT: nothing queued ran")
tx = r.pipeline()
tx.incr(prefix + b"tx5")
tx.rpush(prefix + b"tx6", b"a", b"b")
tx.incr(prefix + b"tx5")
tx.lrange(prefix + b"tx6", 0, -1)
check(tx.execute() == [1, 2, 2, [b"a", b"b"]], "counters and lists in a transaction")

# --- what tools read at start ------------------------------------------------
cfg = r.config_get("save")
check(cfg in ({"save": ""}, {b"save": b""}), f"CONFIG GET save {cfg}")
cfg = r.config_get("max*")
check(int(cfg.get("maxclients", cfg.get(b"maxclients"))) > 0, f"CONFIG GET max* {cfg}")
check(int(cfg.get("maxmemory", cfg.get(b"maxmemory"))) > 0, f"CONFIG GET maxmemory {cfg}")
expect_error(lambda: r.config_set("maxmemory", "1"), "not supported")

# --- connection commands and INFO -----------------------------------------
check(r.client_setname("kvpool-test") is True, "CLIENT SETNAME")
check(r.client_getname() in ("kvpool-test", b"kvpool-test"), "CLIENT GETNAME")
check(isinstance(r.client_id(), int), "CLIENT ID")
me = r.client_info()
check(int(me["id"]) == r.client_id() and me["name"] == "kvpool-test", f"CLIENT INFO {me}")
check(int(me["resp"]) == want_proto, f"CLIENT INFO resp {me}")
listed = r.client_list()
check(any(c["name"] == "kvpool-test" for c in listed), f"CLIENT LIST {listed}")
check(all("addr" in c and "age" in c for c in listed), f"CLIENT LIST fields {listed}")
info = r.info()
check(info["redis_version"] == "7.0.0", f"INFO {info.get('redis_version')}")
check(info["role"] == "master", "INFO role")
pool = r.info("pool")
check(pool["pool_keys"] >= 300, f"INFO pool {pool}")
check(pool["pool_capacity_bytes"] > 0, "INFO pool capacity")
check(r.dbsize() == pool["pool_keys"] or r.dbsize() > 0, "DBSIZE")
stats = r.info("commandstats")
check(stats["cmdstat_get"]["calls"] >= 300, f"INFO commandstats {stats.get('cmdstat_get')}")

# --- a URL, as LMCache's remote_url gives it ------------------------------
from urllib.parse import quote

auth = f":{quote(password, safe='')}@" if password else ""
query = "" if proto == "default" else f"?protocol={proto}"
u = redis.Redis.from_url(f"redis://{auth}127.0.0.1:{port}/0{query}")
check(u.set(prefix + b"url", b"via url") is True, "SET through a URL")
check(u.get(prefix + b"url") == b"via url", "GET through a URL")

# --- the protocol the connection speaks ------------------------------------
hello = u.execute_command("HELLO")
if isinstance(hello, (list, tuple)):
    hello = dict(zip(hello[::2], hello[1::2]))
got = hello.get(b"proto", hello.get("proto"))
check(got == want_proto, f"HELLO says proto {got!r}, wanted {want_proto} ({proto}, redis-py {redis.__version__})")
check(u.get(prefix + b"no such key") is None, "a miss is None")
check(u.mget([prefix + b"url", prefix + b"nope"]) == [b"via url", None], "MGET with a miss")

# --- FLUSHDB empties the pool -------------------------------------------------
check(r.flushdb() is True, "FLUSHDB")
check(r.dbsize() == 0 and r.get(prefix + b"url") is None, "nothing left after FLUSHDB")

print(f"ok: {checks} checks (RESP{want_proto}, redis-py {redis.__version__})")
