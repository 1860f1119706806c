"""kvpool.mooncake against a real `kvpool run`: every method of the
Mooncake surface kvpool covers, with Mooncake's return conventions."""

import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from conftest import LEASE_MS, REPO, wait_until
from kvpool.mooncake import (
    BufferHandle,
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    mooncake_code_table,
)

INVALID_PARAMS, NOT_FOUND, HAS_LEASE, NO_SPACE = -600, -704, -706, -200
MIB = 1 << 20


def store_for(addr, segment=0, host="localhost"):
    s = MooncakeDistributedStore()
    assert s.setup(host, "P2PHANDSHAKE", segment, 16 * MIB, "tcp", "", addr) == 0
    return s


@pytest.fixture
def store(pool):
    s = store_for(pool.addr)
    yield s
    s.close()


def registered(store, nbytes, fill=None):
    a = np.zeros(nbytes, dtype=np.uint8) if fill is None else np.frombuffer(fill, dtype=np.uint8).copy()
    assert store.register_buffer(a.ctypes.data, a.nbytes) == 0
    return a


# --- setup, lifecycle ---------------------------------------------------

def test_setup_positional_and_lifecycle(pool):
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.addr, None) == 0
    assert s.get_hostname() == "localhost"
    assert s.health_check() == 0
    assert s.close() == 0
    assert s.health_check() == 1
    assert s.close() == 0
    # A closed store can be set up again.
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.addr) == 0
    assert s.is_exist("anything") == 0
    s.close()


def test_setup_dict_form(pool):
    s = MooncakeDistributedStore()
    cfg = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
           "global_segment_size": "0", "local_buffer_size": "16 MB", "protocol": "tcp",
           "rdma_devices": "", "master_server_addr": pool.addr, "some_unknown_key": 1}
    assert s.setup(cfg) == 0
    assert s.health_check() == 0
    s.close()
    assert s.setup(config=dict(cfg, local_buffer_size="16MB")) == 0
    s.close()
    assert s.setup(dict(cfg, local_buffer_size="50%")) != 0
    missing = dict(cfg)
    del missing["metadata_server"]
    assert s.setup(missing) == INVALID_PARAMS
    assert s.health_check() == 1


def test_setup_dict_takes_lmcaches_master_server_address(pool, keys):
    # LMCache's mooncakestore backend passes its extra_config with this
    # spelling (was: ignored, the store tried 127.0.0.1:50051).
    s = MooncakeDistributedStore()
    cfg = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
           "global_segment_size": 0, "local_buffer_size": 16 * MIB, "protocol": "tcp",
           "device_name": "", "master_server_address": pool.addr}
    assert s.setup(cfg) == 0
    k = keys("lmcache")
    assert s.put(k, b"chunk") == 0 and s.is_exist(k) == 1
    s.close()


def test_a_store_whose_setup_failed_never_answers_exists():
    # LMCache ignores setup's code and tests is_exist for truth: a store that
    # could not reach its master must not report 32 phantom hits.
    s = MooncakeDistributedStore()
    dead = f"127.0.0.1:{_free_port()}"
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", dead) != 0
    assert s.is_exist("k") == 0
    assert s.batch_is_exist([f"k{i}" for i in range(32)]) == [0] * 32


def _free_port():
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def test_the_async_store_awaits_every_method(pool, keys):
    # mooncake.async_store's class: `await store.async_<method>(...)`.
    import asyncio
    from kvpool.mooncake_async import MooncakeDistributedStoreAsync
    s = MooncakeDistributedStoreAsync()
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.addr) == 0
    k = keys("async")

    async def main():
        assert await s.async_put(k, b"awaited") == 0
        # Several at once on the loop, each on the executor.
        got = await asyncio.gather(s.async_get(k), s.async_is_exist(k), s.async_get_size(k))
        assert got == [b"awaited", 1, 7]
        assert await s.async_remove(k, True) == 0  # past the read lease

    asyncio.run(main())
    assert s.get(k) == b""
    with pytest.raises(AttributeError, match="no_such_method"):
        s.async_no_such_method
    with pytest.raises(AttributeError):
        s.not_async_at_all
    s.close()


def test_setup_refuses_bad_arguments(pool):
    s = MooncakeDistributedStore()
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.addr, no_such_option=1)
    with pytest.raises(TypeError):
        s.setup("localhost", "P2PHANDSHAKE", "0", 16 * MIB, "tcp", "", pool.addr)
    with pytest.raises(TypeError):
        s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "")  # six of seven
    assert s.setup("", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.addr) == INVALID_PARAMS
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "efa", "", pool.addr) == INVALID_PARAMS
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", "no-port") == INVALID_PARAMS
    assert s.setup("localhost", "P2PHANDSHAKE", 100, 16 * MIB, "tcp", "", pool.addr) == INVALID_PARAMS
    # Keyword extras Mooncake accepts are accepted.
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.addr, None,
                   enable_ssd_offload=False, tenant_id="default") == 0
    s.close()


def test_setup_dummy_is_a_pure_client(pool, keys):
    s = MooncakeDistributedStore()
    assert s.setup_dummy(mem_pool_size=64 * MIB, local_buffer_size=16 * MIB,
                         server_address=pool.addr) == 0
    assert s.put(keys("d"), b"dummy") == 0
    assert s.get(keys("d")) == b"dummy"
    s.close()


def test_every_call_before_setup_returns_not_crashes():
    s = MooncakeDistributedStore()
    a = np.zeros(16, dtype=np.uint8)
    p = a.ctypes.data
    assert s.put("k", b"v") == INVALID_PARAMS
    assert s.put_parts("k", b"a", b"b") == INVALID_PARAMS
    assert s.put_batch(["k"], [b"v"]) == INVALID_PARAMS
    assert s.get("k") == b""
    assert s.get_batch(["k", "j"]) == [b"", b""]
    assert s.get_buffer("k") is None
    assert s.batch_get_buffer(["k"]) == [None]
    assert s.put_from("k", p, 16) == INVALID_PARAMS
    assert s.get_into("k", p, 16) == INVALID_PARAMS
    assert s.batch_put_from(["k"], [p], [16]) == [INVALID_PARAMS]
    assert s.batch_get_into(["k"], [p], [16]) == [INVALID_PARAMS]
    assert s.batch_put_from_multi_buffers(["k"], [[p]], [[16]]) == []
    assert s.batch_get_into_multi_buffers(["k"], [[p]], [[16]]) == [INVALID_PARAMS]
    # Tested for truth by callers (LMCache): never a hit, never -600.
    assert s.is_exist("k") == 0
    assert s.batch_is_exist(["k", "j"]) == [0, 0]
    assert s.get_size("k") == INVALID_PARAMS
    assert s.remove("k") == INVALID_PARAMS
    assert s.batch_remove(["k"]) == [INVALID_PARAMS]
    assert s.remove_all() == INVALID_PARAMS
    assert s.register_buffer(p, 16) == INVALID_PARAMS
    assert s.unregister_buffer(p) == INVALID_PARAMS
    assert s.get_hostname() == ""
    assert s.health_check() == 1
    assert s.close() == 0


# --- copying put / get --------------------------------------------------

def test_put_get_exist_size_remove(store, keys):
    k = keys("a")
    assert store.get(k) == b""
    assert store.is_exist(k) == 0
    assert store.get_size(k) == NOT_FOUND
    assert store.put(k, b"value one") == 0
    assert store.is_exist(k) == 1
    assert store.get(k) == b"value one"
    assert store.get_size(k) == len(b"value one")
    assert store.remove(k) == HAS_LEASE  # the get's lease
    assert store.remove(k, force=True) == 0
    assert store.remove(k) == NOT_FOUND
    assert store.get(k) == b""


def test_put_is_write_once(store, keys):
    k = keys("once")
    assert store.put(k, b"first") == 0
    assert store.put(k, b"second, longer") == 0
    assert store.put_parts(k, b"x", b"y") == 0
    assert store.put_batch([k], [b"third"]) == 0
    src = registered(store, 8, b"fourth!!")
    assert store.put_from(k, src.ctypes.data, 8) == 0
    assert store.batch_put_from([k], [src.ctypes.data], [8]) == [0]
    assert store.batch_put_from_multi_buffers([k], [[src.ctypes.data]], [[8]]) == [0]
    assert store.get(k) == b"first"


def test_put_accepts_buffer_protocol_values(store, keys):
    assert store.put(keys("ba"), bytearray(b"from bytearray")) == 0
    assert store.put(keys("mv"), memoryview(b"from memoryview")) == 0
    assert store.put(keys("np"), np.arange(4, dtype=np.int32)) == 0
    assert store.get(keys("ba")) == b"from bytearray"
    assert store.get(keys("mv")) == b"from memoryview"
    assert store.get(keys("np")) == np.arange(4, dtype=np.int32).tobytes()


def test_put_parts_concatenates(store, keys):
    assert store.put_parts(keys("p"), b"meta|", bytearray(b"kv"), memoryview(b"|end")) == 0
    assert store.get(keys("p")) == b"meta|kv|end"
    assert store.put_parts(keys("q"), b"a", config=ReplicateConfig()) == 0


def test_batch_put_get(store, keys):
    ks = [keys(f"b{i}") for i in range(5)]
    vals = [bytes([i]) * (100 + i) for i in range(5)]
    assert store.put_batch(ks, vals) == 0
    assert store.get_batch(ks + [keys("missing")]) == vals + [b""]
    assert store.get_batch([]) == []
    assert store.put_batch(ks[:2], vals[:1]) == INVALID_PARAMS


def test_get_buffer(store, keys):
    assert store.put(keys("h"), b"handle bytes") == 0
    h = store.get_buffer(keys("h"))
    assert isinstance(h, BufferHandle)
    assert h.size() == len(h) == 12 and h.ptr() != 0
    assert bytes(h) == b"handle bytes"
    mv = memoryview(h)
    assert mv.nbytes == 12 and not mv.readonly and bytes(mv[7:]) == b"bytes"
    assert store.get_buffer(keys("none")) is None
    hs = store.batch_get_buffer([keys("h"), keys("none")])
    assert bytes(hs[0]) == b"handle bytes" and hs[1] is None


# --- zero copy ----------------------------------------------------------

def test_put_from_get_into(store, keys):
    data = os.urandom(64 * 1024)
    src = registered(store, len(data), data)
    dst = registered(store, len(data) + 100)
    assert store.put_from(keys("z"), src.ctypes.data, len(data)) == 0
    assert store.get_into(keys("z"), dst.ctypes.data, dst.nbytes) == len(data)
    assert dst[:len(data)].tobytes() == data
    # A buffer smaller than the object, a miss, memory never registered.
    assert store.get_into(keys("z"), dst.ctypes.data, 100) == INVALID_PARAMS
    assert store.get_into(keys("nope"), dst.ctypes.data, dst.nbytes) == NOT_FOUND
    other = np.zeros(len(data), dtype=np.uint8)
    assert store.get_into(keys("z"), other.ctypes.data, other.nbytes) == INVALID_PARAMS
    assert store.put_from(keys("u"), other.ctypes.data, other.nbytes) == INVALID_PARAMS
    # size 0 stores nothing and succeeds.
    assert store.put_from(keys("zero"), src.ctypes.data, 0) == 0
    assert store.is_exist(keys("zero")) == 0
    # Unregistered ranges are refused again.
    assert store.unregister_buffer(dst.ctypes.data) == 0
    assert store.unregister_buffer(dst.ctypes.data) == INVALID_PARAMS
    assert store.get_into(keys("z"), dst.ctypes.data, dst.nbytes) == INVALID_PARAMS


def test_batch_put_from_get_into(store, keys):
    ks = [keys(f"bz{i}") for i in range(4)]
    slot = 8192
    src = registered(store, 4 * slot, os.urandom(4 * slot))
    dst = registered(store, 4 * slot)
    ptrs = [src.ctypes.data + i * slot for i in range(4)]
    sizes = [slot - 7 * i for i in range(4)]
    assert store.batch_put_from(ks, ptrs, sizes) == [0, 0, 0, 0]
    out = [dst.ctypes.data + i * slot for i in range(4)]
    got = store.batch_get_into(ks + [keys("miss")], out + [dst.ctypes.data], [slot] * 5)
    # The last destination overlaps the first: the whole call is refused.
    assert got == [INVALID_PARAMS] * 5
    got = store.batch_get_into(ks + [keys("miss")], out + [0], [slot] * 4 + [0])
    assert got == sizes + [NOT_FOUND]
    for i in range(4):
        assert dst[i * slot:i * slot + sizes[i]].tobytes() == src[i * slot:i * slot + sizes[i]].tobytes()
    assert store.batch_get_into(ks[:2], out[:3], [slot] * 3) == [INVALID_PARAMS] * 2
    assert store.batch_put_from(ks[:2], ptrs[:3], sizes[:3]) == [INVALID_PARAMS] * 2
    assert store.batch_get_into([], [], []) == []
    assert store.batch_put_from([], [], []) == []


def test_multi_buffers_gather_and_scatter(store, keys):
    k_part, v_part = os.urandom(3000), os.urandom(5000)
    src = registered(store, 8000, k_part + v_part)
    p = src.ctypes.data
    ks = [keys("m0"), keys("m1")]
    assert store.batch_put_from_multi_buffers(ks, [[p, p + 3000], [p]], [[3000, 5000], [3000]]) == [0, 0]
    assert store.get(ks[0]) == k_part + v_part
    assert store.get(ks[1]) == k_part
    dst = registered(store, 16000)
    d = dst.ctypes.data
    got = store.batch_get_into_multi_buffers(ks, [[d, d + 8000], [d + 4000]], [[3000, 5000], [3000]])
    assert got == [8000, 3000]
    assert dst[:3000].tobytes() == k_part
    assert dst[8000:13000].tobytes() == v_part
    assert dst[4000:7000].tobytes() == k_part
    assert store.batch_get_into_multi_buffers(ks, [[d]], [[8000]]) == [INVALID_PARAMS] * 2
    assert store.batch_get_into_multi_buffers(ks[:1], [[d]], [[100]], True) == [INVALID_PARAMS]


# --- existence and removal ----------------------------------------------

def test_a_large_batch_goes_in_groups_with_the_same_answers(store, keys):
    # Past 8 MiB a batch of one range per key is sent as parallel calls of
    # about 8 MiB each; every key's answer is what one call gives.
    n, size = 40, 512 * 1024  # 20 MiB: three groups
    rng = np.random.default_rng(7)
    src = registered(store, n * size, rng.integers(0, 256, n * size, dtype=np.uint8).tobytes())
    dst = registered(store, n * size)
    ks = [keys(f"big{i}") for i in range(n)]
    ptrs = [src.ctypes.data + i * size for i in range(n)]
    sizes = [size] * n
    stray = np.zeros(size, dtype=np.uint8)  # never registered
    ptrs[5], sizes[6] = stray.ctypes.data, 0
    codes = store.batch_put_from(ks, ptrs, sizes)
    assert codes[5] == INVALID_PARAMS and codes[6] == 0
    assert all(c == 0 for i, c in enumerate(codes) if i not in (5, 6))
    assert store.is_exist(ks[5]) == 0 and store.is_exist(ks[6]) == 0
    # Read back in reverse order into the other buffer; one too small.
    order = list(range(n))[::-1]
    gets = store.batch_get_into([ks[i] for i in order],
                                [dst.ctypes.data + j * size for j in range(n)],
                                [size - 1 if i == 9 else size for i in order])
    for j, i in enumerate(order):
        if i in (5, 6):
            assert gets[j] == NOT_FOUND
        elif i == 9:
            assert gets[j] == INVALID_PARAMS
        else:
            assert gets[j] == size
            assert (dst[j * size:(j + 1) * size] == src[i * size:(i + 1) * size]).all()


def test_batch_is_exist_and_batch_remove(store, keys):
    ks = [keys("e0"), keys("e1"), keys("e2")]
    assert store.put(ks[0], b"0") == 0 and store.put(ks[1], b"1") == 0
    assert store.batch_is_exist(ks) == [1, 1, 0]
    assert store.batch_remove(ks) == [0, 0, NOT_FOUND]
    assert store.batch_is_exist(ks) == [0, 0, 0]
    assert store.batch_is_exist([]) == []


def test_remove_under_lease_then_after_it(store, keys):
    k = keys("lease")
    assert store.put(k, b"leased") == 0
    assert store.get(k) == b"leased"
    assert store.remove(k) == HAS_LEASE
    assert store.batch_remove([k]) == [HAS_LEASE]
    # The lease ends: the remove goes through.
    assert wait_until(lambda: store.remove(k) == 0, timeout_s=LEASE_MS / 1000 + 5)


def test_remove_all_counts_and_skips_leased(fresh_pool):
    p = fresh_pool()
    s = store_for(p.addr)
    for i in range(5):
        assert s.put(f"ra{i}", b"x") == 0
    assert s.get("ra0") == b"x"  # leased: skipped
    assert s.remove_all() == 4
    assert s.batch_is_exist([f"ra{i}" for i in range(5)]) == [1, 0, 0, 0, 0]
    assert s.remove_all(force=True) == 1  # leased, but forced
    assert s.is_exist("ra0") == 0
    s.close()


def test_batch_replica_clear_removes_whole_objects_and_names_them(fresh_pool):
    import kvpool

    p = fresh_pool()
    s = store_for(p.addr)
    ks = ["rc0", "rc1", "rc2"]
    for k in ks:
        assert s.put(k, b"x" * 64) == 0
    assert s.get("rc1") == b"x" * 64  # a reader's lease: not cleared
    assert s.batch_replica_clear(ks + ["rc-missing"]) == ["rc0", "rc2"]
    assert s.batch_is_exist(ks) == [0, 1, 0]
    # By segment: only the keys whose replicas are all in the one named.
    for k in ("rc3", "rc4"):
        assert s.put(k, b"y" * 64) == 0
    segs = kvpool.Client(p.addr).stat()["segments"]
    assert len(segs) == 1
    assert s.batch_replica_clear(["rc3"], "no-such-segment") == []
    assert s.batch_replica_clear(["rc3"], segs[0]["name"]) == ["rc3"]
    assert s.batch_replica_clear(["rc4"], f"{segs[0]['id']:016x}") == ["rc4"]
    # The node's host:port, as Mooncake's callers pass get_hostname().
    assert s.put("rc5", b"z" * 64) == 0
    assert s.batch_replica_clear(["rc5"], segs[0]["endpoint"]) == ["rc5"]
    assert s.batch_is_exist(["rc3", "rc4", "rc5"]) == [0, 0, 0]
    assert s.batch_replica_clear([]) == []
    s.close()
    assert MooncakeDistributedStore().batch_replica_clear(["rc1"]) == []


def test_tensors_round_trip_in_mooncakes_format(store, keys):
    # CI installs torch and sets KVPOOL_REQUIRE_TORCH=1: there a missing
    # torch fails instead of skipping.
    if os.environ.get("KVPOOL_REQUIRE_TORCH") == "1":
        import torch
    else:
        torch = pytest.importorskip("torch", reason="the tensor calls need torch")
    from kvpool import _tensor

    cases = {
        "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "bf16": torch.linspace(-1, 1, 10, dtype=torch.bfloat16),
        "bool": torch.tensor([[True, False], [False, True]]),
        "i64-scalar": torch.tensor(7, dtype=torch.int64),
        "f16-strided": torch.arange(20, dtype=torch.float16).reshape(4, 5).t(),
    }
    if hasattr(torch, "float8_e4m3fn"):
        cases["fp8"] = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)
    for name, t in cases.items():
        k = keys(name)
        assert store.put_tensor(k, t) == 0, name
        got = store.get_tensor(k)
        assert got.dtype == t.dtype and got.shape == t.shape, name
        as_bytes = lambda x: x.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(as_bytes(got), as_bytes(t)), name
        # The stored value is Mooncake's: a 304-byte header, then the bytes.
        raw = store.get(k)
        assert len(raw) == 304 + t.numel() * t.element_size(), name
        assert int.from_bytes(raw[:4], "little") == 0x4D4F4F4E
        assert _tensor.decode_header(raw)[1] == tuple(t.shape)
    # put is write-once (0, the stored tensor stays, as put), upsert
    # replaces; batches answer per key.
    k = keys("f32")
    assert store.put_tensor(k, torch.ones(2)) == 0
    assert torch.equal(store.get_tensor(k), cases["f32"])
    assert store.upsert_tensor(k, torch.ones(2)) == 0
    assert torch.equal(store.get_tensor(k), torch.ones(2))
    bk = [keys("b0"), keys("b1")]
    assert store.batch_put_tensor(bk, [torch.ones(3), torch.zeros(2, 2)]) == [0, 0]
    got = store.batch_get_tensor(bk + [keys("missing")])
    assert torch.equal(got[0], torch.ones(3)) and torch.equal(got[1], torch.zeros(2, 2))
    assert got[2] is None
    assert store.batch_upsert_tensor(bk, [torch.zeros(1), torch.ones(1)]) == [0, 0]
    assert torch.equal(store.get_tensor(bk[1]), torch.ones(1))
    assert store.pub_tensor(keys("pub"), torch.ones(4), ReplicateConfig()) == 0
    # Not a tensor, or a dtype Mooncake has no code for: -600, nothing stored.
    assert store.put_tensor(keys("np"), np.zeros(3)) == INVALID_PARAMS
    assert store.put_tensor(keys("c64"), torch.zeros(2, dtype=torch.complex64)) == INVALID_PARAMS
    assert store.is_exist(keys("c64")) == 0
    # An empty tensor is its header alone, and reads back with its shape
    # and dtype (as Mooncake stores it).
    for i, shape in enumerate([(0,), (0, 5), (2, 0, 3)]):
        empty = torch.zeros(shape, dtype=torch.bfloat16)
        assert store.put_tensor(keys(f"empty{i}"), empty) == 0
        assert store.get_size(keys(f"empty{i}")) == _tensor.HEADER_SIZE
        back = store.get_tensor(keys(f"empty{i}"))
        assert back.shape == empty.shape and back.dtype == empty.dtype
    # A value that is not a tensor object reads as None, not as a tensor.
    assert store.put(keys("plain"), b"\0" * 400) == 0
    assert store.get_tensor(keys("plain")) is None
    assert store.get_tensor(keys("missing")) is None


def test_tensor_headers_are_checked_before_use():
    from kvpool import _tensor

    good = _tensor.encode_header(0, (2, 3), 24) + bytes(24)
    assert _tensor.decode_header(good) == (0, (2, 3))
    bad = {
        "short": good[:100],
        "magic": b"XXXX" + good[4:],
        "dtype": good[:8] + (99).to_bytes(4, "little") + good[12:],
        "data bytes": good + b"\0",
        "shape": _tensor.encode_header(0, (2, 4), 24) + bytes(24),
    }
    for what, buf in bad.items():
        with pytest.raises(ValueError):
            _tensor.decode_header(buf)


# --- configs, allocator, codes ------------------------------------------

def test_replicate_config(store, keys):
    c = ReplicateConfig()
    assert c.replica_num == 1 and not c.with_soft_pin and not c.with_hard_pin
    assert c.soft_pin_action == SoftPinAction.PRESERVE and c.soft_pin_ttl_ms is None
    assert c.preferred_segments == [] and c.preferred_segment == "" and c.group_ids is None
    with pytest.raises(AttributeError):
        c.no_such_field = 1
    c.with_hard_pin = True
    c.preferred_segment = store.get_hostname()
    assert store.put(keys("hp"), b"pinned", c) == 0
    c2 = ReplicateConfig()
    c2.soft_pin_ttl_ms = 1000  # only valid with soft_pin_action ENABLE
    assert store.put(keys("sp"), b"x", config=c2) == INVALID_PARAMS
    c2.soft_pin_action = SoftPinAction.ENABLE
    assert store.put(keys("sp"), b"x", config=c2) == 0
    c3 = ReplicateConfig()
    c3.prefer_alloc_in_same_node = True
    assert store.put(keys("pa"), b"x", c3) == INVALID_PARAMS
    c3.replica_num = 0
    assert "replica_num: 0" in str(c3)


def test_host_mem_allocator(store, keys):
    a = MooncakeHostMemAllocator()
    p = a.alloc(1 << 20)
    assert p != 0
    assert store.register_buffer(p, 1 << 20) == 0
    arr = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (1 << 20)).from_address(p))
    arr[:5] = np.frombuffer(b"hello", dtype=np.uint8)
    assert store.put_from(keys("hm"), p, 5) == 0
    assert store.get(keys("hm")) == b"hello"
    assert store.unregister_buffer(p) == 0
    assert a.free(p) == 0
    assert a.free(p) == -1


def test_alloc_from_mem_pool_gives_memory_to_register(store, keys):
    # Issue 31, item 4: vLLM's staging ring takes its memory from here.
    p = store.alloc_from_mem_pool(1 << 20)
    assert p != 0
    assert store.register_buffer(p, 1 << 20) == 0
    arr = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (1 << 20)).from_address(p))
    arr[:3] = np.frombuffer(b"mem", dtype=np.uint8)
    assert store.put_from(keys("amp"), p, 3) == 0
    assert store.get(keys("amp")) == b"mem"
    assert store.unregister_buffer(p) == 0
    assert MooncakeHostMemAllocator().free(p) == 0
    assert store.alloc_from_mem_pool(0) == 0


def test_replica_descriptors_as_vllm_reads_them(store, keys):
    # Issue 31, item 4: vLLM's tier logging calls batch_get_replica_desc.
    k = keys("rd")
    assert store.put(k, b"x" * 5000) == 0
    missing = keys("rd-missing")
    descs = store.batch_get_replica_desc([k, missing])
    assert list(descs) == [k], "a key without replicas is left out"
    (r,) = descs[k]
    assert r.status == ReplicaStatus.COMPLETE
    assert r.is_memory_replica() and not r.is_disk_replica()
    assert not r.is_local_disk_replica()
    d = r.get_memory_descriptor().buffer_descriptor
    assert d.size == 5000
    host, port = d.transport_endpoint.rsplit(":", 1)
    assert host and int(port) > 0
    assert store.get_replica_desc(missing) == []
    assert [x.get_memory_descriptor().buffer_descriptor.size
            for x in store.get_replica_desc(k)] == [5000]
    assert MooncakeDistributedStore().batch_get_replica_desc([k]) == {}, "not set up"


def test_get_into_ranges_copies_checked_fragments(store, keys):
    # Issue 31, item 4: Mooncake's ranged read, results per buffer, key, fragment.
    a, b, gone = keys("gr-a"), keys("gr-b"), keys("gr-gone")
    va = bytes(range(256)) * 16
    vb = b"0123456789" * 100
    assert store.put(a, va) == 0 and store.put(b, vb) == 0
    buf0 = np.zeros(8192, dtype=np.uint8)
    buf1 = np.zeros(4096, dtype=np.uint8)
    p0, p1 = buf0.ctypes.data, buf1.ctypes.data
    assert store.register_buffer(p0, buf0.nbytes) == 0
    assert store.register_buffer(p1, buf1.nbytes) == 0
    try:
        r = store.get_into_ranges(
            [p0, p1],
            [[a, b], [b, gone]],
            [[[0, 100], [200]], [[10], [0]]],
            [[[5, 4000], [990]], [[0], [0]]],
            [[[10, 96], [10]], [[20], [4]]],
        )
        assert r == [[[10, 96], [10]], [[20], [-704]]]
        assert buf0[:10].tobytes() == va[5:15]
        assert buf0[100:196].tobytes() == va[4000:4096]
        assert buf0[200:210].tobytes() == vb[990:1000]
        assert buf1[10:30].tobytes() == vb[:20]
        # Past the value, outside the registered buffer, shapes that differ.
        r = store.get_into_ranges([p0], [[a]], [[[0, 8190]]], [[[4090, 0]]], [[[10, 4]]])
        assert r == [[[-600, -600]]]
        assert store.get_into_ranges([p0], [[a]], [[[0]]], [[[0]]], [[[1], [2]]]) == [[[-600]]]
        assert store.get_into_ranges([p0, p1], [[a]], [[[0]]], [[[0]]], [[[1]]]) == [[[-600]]]
    finally:
        store.unregister_buffer(p0)
        store.unregister_buffer(p1)


def test_code_table_covers_every_kvpool_code_and_matches_readme():
    import kvpool
    table = mooncake_code_table()
    assert sorted(c for c, _, _, _ in table) == sorted(kvpool.ERROR_CODES.values())
    assert all(m < 0 for _, _, m, _ in table)
    readme = (REPO / "README.md").read_text()
    for _, name, code, mname in table:
        assert re.search(rf"\|\s*`{name}` \(\d+\)\s*\|\s*{code}\s*\|\s*`{mname}`\s*\|", readme), name


# --- a full pool, a dead master -----------------------------------------

def test_full_pool_is_no_space(fresh_pool):
    p = fresh_pool(segment="4MiB")
    s = store_for(p.addr)
    pin = ReplicateConfig()
    pin.with_hard_pin = True  # never evicted: the pool really fills
    codes = [s.put(f"fill{i}", b"x" * 256 * 1024, pin) for i in range(32)]
    assert NO_SPACE in codes, codes
    assert codes[0] == 0
    s.close()


def test_dead_master_answers_within_the_timeout(fresh_pool, tmp_path, monkeypatch):
    cfg = tmp_path / "client.toml"
    cfg.write_text("[client]\ntimeout_ms = 2000\nconnect_timeout_ms = 500\n")
    monkeypatch.setenv("KVPOOL_CONFIG", str(cfg))
    p = fresh_pool()
    s = store_for(p.addr)
    assert s.put("before", b"x") == 0
    # A master that does not answer: the call times out (-901).
    p.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    rc = s.put("frozen", b"x")
    assert rc in (-900, -901), rc
    assert time.monotonic() - t0 < 10
    # A master that is gone: connections fail (-900) or time out.
    p.stop()
    t0 = time.monotonic()
    assert s.put("dead", b"x") in (-900, -901)
    assert s.is_exist("before") in (-900, -901)
    assert s.get("before") == b""
    assert s.health_check() == 2
    assert time.monotonic() - t0 < 30
    s.close()


def test_calls_release_the_gil(fresh_pool, tmp_path, monkeypatch):
    cfg = tmp_path / "client.toml"
    cfg.write_text("[client]\ntimeout_ms = 2000\n")
    monkeypatch.setenv("KVPOOL_CONFIG", str(cfg))
    p = fresh_pool()
    s = store_for(p.addr)
    p.signal(signal.SIGSTOP)
    done = threading.Event()
    t = threading.Thread(target=lambda: (s.is_exist("k"), done.set()))
    t.start()
    # While the call waits on the frozen master, this thread runs Python.
    spins = 0
    while not done.is_set():
        spins += 1
    t.join()
    p.signal(signal.SIGCONT)
    assert spins > 100_000, spins
    s.close()


# --- threads, the embedded node -----------------------------------------

def test_threads_call_concurrently(store, keys):
    errors = []

    def worker(w):
        try:
            buf = registered(store, 4096)
            for i in range(50):
                k = keys(f"t{w}-{i}")
                v = os.urandom(1000 + w)
                assert store.put(k, v) == 0
                assert store.get_into(k, buf.ctypes.data, buf.nbytes) == len(v)
                assert buf[:len(v)].tobytes() == v
                assert store.batch_is_exist([k]) == [1]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


def thread_affinities():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:
            pass
    return out


def test_embedded_node_gives_this_process_memory(fresh_pool):
    master = fresh_pool(role="master")  # no memory of its own
    before = os.sched_getaffinity(0)
    client = store_for(master.addr)
    assert client.put("nowhere", b"x") == NO_SPACE
    holder = store_for(master.addr, segment=32 * MIB)
    host, port = holder.get_hostname().rsplit(":", 1)
    assert host == "localhost" and int(port) > 0
    # The node's threads are not pinned: every thread keeps the process's CPUs.
    assert all(a == before for a in thread_affinities().values())
    assert client.put("somewhere", b"in the holder") == 0
    assert client.get("somewhere") == b"in the holder"
    assert holder.close() == 0
    # The segment left with the node.
    assert wait_until(lambda: client.put("gone", b"x") == NO_SPACE)
    client.close()


def test_kvpool_config_and_protocols(pool, tmp_path, monkeypatch):
    import kvpool
    s = MooncakeDistributedStore()
    bad = tmp_path / "bad.toml"
    bad.write_text("[client]\nno_such_key = 1\n")
    monkeypatch.setenv("KVPOOL_CONFIG", str(bad))
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.addr) == INVALID_PARAMS
    monkeypatch.setenv("KVPOOL_CONFIG", str(tmp_path / "missing.toml"))
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.addr) == INVALID_PARAMS
    monkeypatch.delenv("KVPOOL_CONFIG")
    rc = s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "rdma", "", pool.addr)
    if not kvpool.RDMA:
        # vLLM's and SGLang's example configs say rdma: a build without it
        # warns and uses tcp, as Mooncake's wheels without RDMA do.
        assert rc == 0
        assert s.health_check() == 0
        assert s.put("rdma-fallback", b"v") == 0 and s.get("rdma-fallback") == b"v"
        s.remove("rdma-fallback")
    s.close()
    assert s.health_check() == 1


def test_a_forked_child_gets_an_error_not_a_hang(store, keys):
    assert store.put(keys("f"), b"before the fork") == 0
    pid = os.fork()
    if pid == 0:  # the child: kvpool's threads did not come along
        ok = store.is_exist(keys("f")) == -900 and store.get(keys("f")) == b""
        os._exit(0 if ok else 1)
    end = time.monotonic() + 20
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert store.get(keys("f")) == b"before the fork"  # the parent is unaffected


def test_registering_again_keeps_the_range_usable(store, keys):
    buf = np.zeros(8192, dtype=np.uint8)
    p = buf.ctypes.data
    assert store.register_buffer(p, 8192) == 0
    assert store.register_buffer(p, 8192) == 0  # the same range again
    assert store.register_buffer(p, 4096) == 0  # a new length replaces it
    assert store.put(keys("r"), b"r" * 5000) == 0
    assert store.get_into(keys("r"), p, 8192) == INVALID_PARAMS  # past the 4 KiB now
    assert store.register_buffer(p, 8192) == 0
    assert store.get_into(keys("r"), p, 8192) == 5000
    assert store.unregister_buffer(p) == 0


def test_upsert_variants_replace(store, keys):
    k = keys("u")
    assert store.upsert(k, b"absent: inserted") == 0
    assert store.get(k) == b"absent: inserted"
    assert store.upsert(k, b"replaced, longer than before") == 0
    assert store.get(k) == b"replaced, longer than before"
    assert store.put(k, b"a put keeps what is there") == 0
    assert store.get(k) == b"replaced, longer than before"
    assert store.upsert_parts(k, b"par", b"ts") == 0
    assert store.get(k) == b"parts"
    ks = [keys("ub0"), keys("ub1")]
    assert store.put_batch(ks, [b"old0", b"old1"]) == 0
    assert store.upsert_batch(ks, [b"new0", b"new1"], ReplicateConfig()) == 0
    assert store.get_batch(ks) == [b"new0", b"new1"]
    src = registered(store, 16, b"0123456789abcdef")
    p = src.ctypes.data
    assert store.upsert_from(k, p, 10) == 0
    assert store.get(k) == b"0123456789"
    assert store.batch_upsert_from(ks, [p, p + 10], [4, 6]) == [0, 0]
    assert store.get_batch(ks) == [b"0123", b"abcdef"]
    assert store.batch_upsert_from(ks, [p], [4, 6]) == [INVALID_PARAMS] * 2
    other = np.zeros(8, dtype=np.uint8)
    assert store.upsert_from(k, other.ctypes.data, 8) == INVALID_PARAMS
    assert store.get(k) == b"0123456789"


def test_upsert_before_setup_is_invalid_params():
    s = MooncakeDistributedStore()
    assert s.upsert("k", b"v") == INVALID_PARAMS
    assert s.upsert_parts("k", b"v") == INVALID_PARAMS
    assert s.upsert_batch(["k"], [b"v"]) == INVALID_PARAMS
    assert s.upsert_from("k", 1, 1) == INVALID_PARAMS
    assert s.batch_upsert_from(["k"], [1], [1]) == [INVALID_PARAMS]


def test_readers_see_old_or_new_during_upserts(store, keys):
    k = keys("race")
    old, new = b"o" * 100_000, b"n" * 100_000
    assert store.put(k, old) == 0
    stop = threading.Event()
    seen = []

    def reader():
        while not stop.is_set():
            seen.append(store.get(k))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(20):
        assert store.upsert(k, new if i % 2 == 0 else old) == 0
    stop.set()
    t.join()
    assert seen and all(v in (old, new) for v in seen)
