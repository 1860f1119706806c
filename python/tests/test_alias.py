"""KVPOOL_AS_MOONCAKE=1: unmodified Mooncake programs get kvpool's store;
without it, `mooncake` is left alone."""

import os
import pathlib
import subprocess
import sys

from conftest import LEASE_MS

PROGRAMS = pathlib.Path(__file__).parent / "programs"


def run(code_or_file, env_extra, *args):
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_AS_MOONCAKE"}
    env.update(env_extra)
    cmd = [sys.executable, str(code_or_file)] if isinstance(code_or_file, pathlib.Path) \
        else [sys.executable, "-c", code_or_file]
    return subprocess.run(cmd + list(args), env=env, capture_output=True, text=True, timeout=120)


def test_unmodified_mooncake_program_runs_on_kvpool(pool):
    r = run(PROGRAMS / "mooncake_quickstart.py",
            {"KVPOOL_AS_MOONCAKE": "1", "MOONCAKE_MASTER": pool.addr,
             "DEFAULT_KV_LEASE_TTL": str(LEASE_MS + 1000)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "OK"
    assert "Hello, Mooncake Store!" in r.stdout


def test_a_store_built_from_mooncake_config_load_from_env_works(pool, tmp_path):
    # Mooncake's own tests build their store this way.
    prog = (
        "from mooncake.mooncake_config import MooncakeConfig\n"
        "from mooncake.store import MooncakeDistributedStore\n"
        "c = MooncakeConfig.load_from_env()\n"
        "assert (c.global_segment_size, c.local_buffer_size) == (64 << 20, 16 << 20), c\n"
        "s = MooncakeDistributedStore()\n"
        "assert s.setup(c.local_hostname, c.metadata_server, c.global_segment_size,\n"
        "               c.local_buffer_size, c.protocol, c.device_name,\n"
        "               c.master_server_address) == 0\n"
        "assert s.put('cfg/k', b'v' * 100) == 0 and s.get('cfg/k') == b'v' * 100\n"
        "s.close(); print('ok')\n")
    env = {"KVPOOL_AS_MOONCAKE": "1", "MOONCAKE_MASTER": pool.addr,
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": "64MB", "MOONCAKE_LOCAL_BUFFER_SIZE": "16 mb",
           "MOONCAKE_PROTOCOL": "tcp"}
    r = run(prog, env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
    # From a file, which must name the master.
    f = tmp_path / "mooncake.json"
    f.write_text('{"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE"}')
    r = run("from mooncake.mooncake_config import MooncakeConfig; MooncakeConfig.load_from_env()",
            {"KVPOOL_AS_MOONCAKE": "1", "MOONCAKE_CONFIG_PATH": str(f)})
    assert r.returncode != 0 and "master_server_address" in r.stderr, r.stderr


def test_the_alias_gives_kvpools_module():
    r = run("import mooncake.store, kvpool.mooncake; "
            "assert mooncake.store is kvpool.mooncake; "
            "from mooncake.store import MooncakeDistributedStore, ReplicateConfig; print('ok')",
            {"KVPOOL_AS_MOONCAKE": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    r = run("import mooncake.async_store as a, kvpool.mooncake_async as k; assert a is k; "
            "from mooncake.async_store import MooncakeDistributedStoreAsync; print('ok')",
            {"KVPOOL_AS_MOONCAKE": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    r = run("import mooncake.engine", {"KVPOOL_AS_MOONCAKE": "1"})
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr


def test_without_the_variable_mooncake_is_not_hijacked(tmp_path):
    r = run("import importlib.util, sys; print(importlib.util.find_spec('mooncake')); "
            "print('kvpool' in sys.modules)", {})
    assert r.returncode == 0 and r.stdout.split() == ["None", "False"], r.stdout + r.stderr
    # A real Mooncake installed: without the variable it is the one imported,
    # with it kvpool's.
    fake = tmp_path / "site" / "mooncake"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "store.py").write_text("WHO = 'mooncake'\n")
    prog = "import mooncake.store as s; print(getattr(s, 'WHO', 'kvpool'))"
    env = {"PYTHONPATH": str(tmp_path / "site")}
    assert run(prog, env).stdout.strip() == "mooncake"
    assert run(prog, dict(env, KVPOOL_AS_MOONCAKE="1")).stdout.strip() == "kvpool"
    assert run(prog, dict(env, KVPOOL_AS_MOONCAKE="0")).stdout.strip() == "mooncake"
