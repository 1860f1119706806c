"""LMCache's own connector classes (pip's `lmcache`) against a real
`kvpool run`: `redis://` as LMCache documents it (redis-py 8, RESP3 first),
`resp://` (LMCache's own RESP client), and `mooncakestore://` with LMCache's
documented `extra_config` (kvpool standing in for Mooncake). Each stores
chunks of KV and reads the same bytes back. Skipped without lmcache, unless
KVPOOL_REQUIRE_LMCACHE=1 (CI, in a venv of its own)."""

import os
import subprocess
import sys

import pytest

from conftest import Pool

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "lmcache_connector.py")

if os.environ.get("KVPOOL_REQUIRE_LMCACHE") != "1":
    pytest.importorskip("lmcache", reason="LMCache's connectors need `pip install lmcache`")


@pytest.fixture(scope="module")
def resp_pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("lmcache"),
             config='[resp]\nlisten = "127.0.0.1:0"\n')
    yield p
    p.stop()


@pytest.mark.parametrize("scheme", ["redis", "resp", "mooncakestore"])
def test_lmcaches_connector_stores_and_reads_back_chunks(resp_pool, scheme):
    resp = resp_pool.listening["resp"]
    url = {"redis": f"redis://{resp}", "resp": f"resp://{resp}",
           "mooncakestore": f"mooncakestore://{resp_pool.addr}/"}[scheme]
    env = dict(os.environ, KVPOOL_AS_MOONCAKE="1")
    r = subprocess.run([sys.executable, PROGRAM, url, resp_pool.addr], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.strip().splitlines()[-1] == f"OK {url} 4", r.stdout
