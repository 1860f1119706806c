"""One of LMCache's own remote connectors, as LMCache builds it from its
config, stores chunks of KV and reads them back (run by test_lmcache.py).

    python lmcache_connector.py URL [MASTER]

URL is LMCache's `remote_url` (`redis://`, `resp://`, `mooncakestore://`);
for `mooncakestore://` the master goes in `extra_config` as LMCache's docs
write it, and the program runs with KVPOOL_AS_MOONCAKE=1. Prints
`OK <url> <chunks>` when every chunk read back equals what was put; exits
non-zero otherwise.
"""

import asyncio
import os
import sys
import threading

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

CHUNKS = 4
MODEL = "kvpool-lmcache-test"

url = sys.argv[1]
extra = {}
if url.startswith("mooncakestore://"):
    extra["extra_config"] = {
        "local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp", "device_name": "", "master_server_address": sys.argv[2],
        "global_segment_size": 0, "local_buffer_size": 64 << 20, "transfer_timeout": 5}
cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False, max_local_cpu_size=0.1,
                                         remote_url=url, remote_serde="naive", **extra)
# 2 layers, K and V, 256 tokens, 2 heads of 64 (bf16): 256 KiB per chunk.
md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                     local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 256, 2, 64))
backend = LocalCPUBackend(cfg, md)
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
conn = CreateConnector(url, loop, backend, cfg, md)


def run(coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)


def as_bytes(t):
    return t.contiguous().view(torch.uint8).flatten()


shape = torch.Size([2, 2, 256, 128])
for i in range(CHUNKS):
    obj = backend.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
    obj.tensor.copy_(torch.randn(shape).to(torch.bfloat16))
    want = as_bytes(obj.tensor).clone()
    key = CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0,
                         chunk_hash=int.from_bytes(os.urandom(7), "little"),
                         dtype=torch.bfloat16)
    assert not run(conn.exists(key)), f"chunk {i}: exists before its put"
    run(conn.put(key, obj))
    assert run(conn.exists(key)), f"chunk {i}: missing after its put"
    if conn.support_batched_get():
        got = run(conn.batched_get([key]))[0]
    else:
        got = run(conn.get(key))
    assert got is not None, f"chunk {i}: no answer"
    assert torch.equal(as_bytes(got.tensor)[: want.numel()], want), f"chunk {i}: other bytes"
print("OK", url, CHUNKS, flush=True)
os._exit(0)  # LMCache's memory objects complain when collected at exit
