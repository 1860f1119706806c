"""A program written against Mooncake's documented store API (the Python
API reference's quick start, zero-copy and batch zero-copy workflows). It
imports `mooncake.store` and nothing of kvpool; run it with
KVPOOL_AS_MOONCAKE=1 to run it on kvpool. The master address comes from
MOONCAKE_MASTER (as SGLang reads it), the lease from DEFAULT_KV_LEASE_TTL
(ms, as Mooncake's own tests read it)."""

import os
import time

import numpy as np
from mooncake.store import MooncakeDistributedStore

MASTER = os.environ.get("MOONCAKE_MASTER", "localhost:50051")
LEASE_TTL_S = int(os.environ.get("DEFAULT_KV_LEASE_TTL", "5000")) / 1000


def hello_world():
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", 512 * 1024 * 1024,
                     128 * 1024 * 1024, "tcp", "", MASTER)
    if rc != 0:
        raise RuntimeError(f"setup failed: {rc}")
    store.put("hello_key", b"Hello, Mooncake Store!")
    data = store.get("hello_key")
    print(data.decode())
    assert data.decode() == "Hello, Mooncake Store!"
    store.close()


def zero_copy():
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", 0, 64 * 1024 * 1024, "tcp", "", MASTER)
    if rc != 0:
        raise RuntimeError(f"setup failed: {rc}")
    src = np.random.randn(256, 256).astype(np.float32)
    src_ptr, nbytes = src.ctypes.data, src.nbytes
    if store.register_buffer(src_ptr, nbytes) != 0:
        raise RuntimeError("register_buffer failed")
    assert store.put_from("zero_copy_key", src_ptr, nbytes) == 0
    dst = np.empty((256, 256), dtype=np.float32)
    dst_ptr = dst.ctypes.data
    if store.register_buffer(dst_ptr, dst.nbytes) != 0:
        raise RuntimeError("register_buffer failed")
    n = store.get_into("zero_copy_key", dst_ptr, dst.nbytes)
    assert n > 0 and n == nbytes, n
    assert np.array_equal(src, dst)
    store.unregister_buffer(src_ptr)
    store.unregister_buffer(dst_ptr)
    store.close()


def batch_zero_copy():
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", 0, 64 * 1024 * 1024, "tcp", "", MASTER)
    if rc != 0:
        raise RuntimeError(f"setup failed: {rc}")
    keys = ["batch_key_0", "batch_key_1", "batch_key_2"]
    values = [os.urandom(1000 + 100 * i) for i in range(3)]
    for k, v in zip(keys, values):
        assert store.put(k, v) == 0
    slot = 1024 * 1024
    big = np.zeros(3 * slot, dtype=np.uint8)
    base = big.ctypes.data
    assert store.register_buffer(base, big.nbytes) == 0
    results = store.batch_get_into(keys, [base + i * slot for i in range(3)], [slot] * 3)
    for i, (n, v) in enumerate(zip(results, values)):
        assert n == len(v), (i, n)
        assert bytes(big[i * slot:i * slot + n]) == v
    time.sleep(LEASE_TTL_S)
    for k in keys:
        assert store.remove(k) == 0
    store.unregister_buffer(base)
    store.close()


if __name__ == "__main__":
    hello_world()
    zero_copy()
    batch_zero_copy()
    print("OK")
