"""kvpool.Client against a real `kvpool run`."""

import os
import threading

import numpy as np
import pytest

import kvpool
from conftest import LEASE_MS, wait_until

CODES = kvpool.ERROR_CODES


@pytest.fixture
def client(pool):
    with kvpool.Client(pool.addr) as c:
        yield c


def test_put_get_exists_remove(client, keys):
    k = keys("a")
    assert client.get(k) is None
    assert not client.exists(k)
    client.put(k, b"hello")
    assert client.exists(k)
    assert client.get(k) == b"hello"
    assert client.get(k.encode()) == b"hello"  # bytes keys too
    with pytest.raises(kvpool.KvpoolError) as e:
        client.remove(k)  # the get's lease
    assert e.value.code == CODES["ObjectHasLease"] and e.value.name == "ObjectHasLease"
    assert client.remove(k, force=True) is True
    assert client.remove(k) is False


def test_double_put_raises_with_its_code(client, keys):
    client.put(keys("d"), b"one")
    with pytest.raises(kvpool.KvpoolError) as e:
        client.put(keys("d"), b"two")
    assert e.value.code == CODES["ObjectAlreadyExists"]
    assert "ObjectAlreadyExists (3)" in str(e.value)
    assert client.get(keys("d")) == b"one"


def test_get_into_and_put_from_buffers(client, keys):
    data = os.urandom(10_000)
    client.put_from(keys("b"), np.frombuffer(data, dtype=np.uint8))
    ba = bytearray(20_000)
    assert client.get_into(keys("b"), ba) == len(data)
    assert bytes(ba[:len(data)]) == data
    arr = np.zeros(10_000, dtype=np.uint8)
    client.register_buffer(arr)
    assert client.get_into(keys("b"), arr) == len(data)
    assert arr.tobytes() == data
    assert client.unregister_buffer(arr) is True
    assert client.unregister_buffer(arr) is False
    assert client.get_into(keys("nope"), ba) is None
    with pytest.raises(kvpool.KvpoolError) as e:
        client.get_into(keys("b"), bytearray(10))
    assert e.value.code == CODES["InvalidParams"]
    with pytest.raises(BufferError):
        client.get_into(keys("b"), b"read-only bytes")
    with pytest.raises(BufferError):
        client.get_into(keys("b"), np.zeros((100, 100), dtype=np.uint8)[:, ::2])


def test_batch_forms(client, keys):
    ks = [keys(f"k{i}") for i in range(4)]
    vals = [bytes([i]) * (10 + i) for i in range(4)]
    assert client.batch_put(ks, vals) == [None] * 4
    again = client.batch_put(ks[:1], [b"x"])
    assert isinstance(again[0], kvpool.KvpoolError) and again[0].code == CODES["ObjectAlreadyExists"]
    assert client.batch_get(ks + [keys("none")]) == vals + [None]
    bufs = [bytearray(64) for _ in range(5)]
    assert client.batch_get_into(ks + [keys("none")], bufs) == [10, 11, 12, 13, None]
    assert [bytes(b[:10 + i]) for i, b in enumerate(bufs[:4])] == vals
    shared = bytearray(64)
    with pytest.raises(ValueError, match="overlap"):
        client.batch_get_into(ks[:2], [shared, memoryview(shared)[8:]])
    assert client.batch_exists(ks + [keys("none")]) == [True] * 4 + [False]
    assert wait_until(lambda: not any(isinstance(r, Exception)
                                      for r in _try(client.batch_remove, ks)),
                      timeout_s=LEASE_MS / 1000 + 5)
    assert client.batch_exists(ks) == [False] * 4
    with pytest.raises(ValueError):
        client.batch_put(ks, vals[:2])


def _try(f, *a):
    try:
        return f(*a)
    except kvpool.KvpoolError as e:
        return [e]


def test_stat_and_remove_all(fresh_pool):
    p = fresh_pool()
    with kvpool.Client(p.addr) as c:
        c.put("s1", b"x" * 100, hard_pin=True)
        c.put("s2", b"y" * 100, replicas=1, soft_pin_ms=1000)
        s = c.stat()
        assert s["keys"] == 2 and s["capacity"] > 0 and len(s["segments"]) == 1
        assert s["segments"][0]["used"] >= 200
        assert c.get("s1") == b"x" * 100  # leased: remove_all skips it
        assert c.remove_all() == 1
        assert c.remove_all(force=True) == 1
        assert c.stat()["keys"] == 0


def test_options_and_errors(pool):
    with pytest.raises(ValueError, match="no_such_option"):
        kvpool.Client(pool.addr, no_such_option=1)
    c = kvpool.Client(pool.addr, timeout_ms=5000, checksums=True, transport="tcp")
    assert c.master == pool.addr
    c.close()
    with pytest.raises(kvpool.KvpoolError) as e:
        c.get("x")
    assert e.value.code == CODES["Unavailable"]
    with pytest.raises(kvpool.KvpoolError) as e:
        kvpool.Client("127.0.0.1:1", connect_timeout_ms=300, timeout_ms=1000)
    assert e.value.code in (CODES["Unavailable"], CODES["Timeout"])


def test_threads_share_one_client(client, keys):
    errors = []

    def worker(w):
        try:
            buf = bytearray(2048)
            for i in range(50):
                k = keys(f"{w}-{i}")
                v = os.urandom(500 + w)
                client.put(k, v)
                assert client.get_into(k, buf) == len(v) and bytes(buf[:len(v)]) == v
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


def test_upsert_replaces(client, keys):
    k = keys("u")
    client.upsert(k, b"first")
    client.upsert(k, b"second")
    assert client.get(k) == b"second"
    with pytest.raises(kvpool.KvpoolError):
        client.put(k, b"third")
    assert client.get(k) == b"second"
