#!/usr/bin/env python3
"""Puts from and gets into CUDA memory through kvpool.mooncake, against the
same calls on pinned host memory and against torch's own copies between the
device and pinned host memory, on this machine, in alternating rounds.

    python benches/gpu_store.py [--rounds 5] [--json FILE]

Needs torch with a CUDA device and `kvpool` installed; the binary is
$KVPOOL_BIN, else target/release/kvpool. It starts `kvpool run` (master and
one storage node with 8 GiB, prefaulted, the config's default shards) on
127.0.0.1 and one pure client (global_segment_size 0, the same config:
`shm_populate = "at_map"`) in this process.

Per case (value size x batch), per round and per memory kind: one
`batch_put_from` of `batch` distinct keys from a registered tensor (a
device tensor, or a pinned host one), one `batch_get_into` of them into
another registered tensor of the same kind, a byte check, a
`batch_remove`. The torch rows time `host.copy_(dev)` (device to host) and
`dev.copy_(host)` with a synchronize, for the same bytes. Figures are GB/s
(10^9 bytes/s) of the call, median over rounds.
"""

import argparse
import json
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import torch

from kvpool.mooncake import MooncakeDistributedStore

REPO = pathlib.Path(__file__).resolve().parents[1]
MIB = 1 << 20
CASES = [(256 * 1024, 128), (MIB, 64), (4 * MIB, 16), (16 * MIB, 1), (64 * MIB, 1)]


def start_pool(tmp, segment, prefault, at_map):
    binary = os.environ.get("KVPOOL_BIN") or str(REPO / "target" / "release" / "kvpool")
    cfg = pathlib.Path(tmp) / "gpu_bench.toml"
    # Steady state, as a long-lived inference worker sees it: the node's
    # segment committed at start, the client's map of it filled at map time
    # (else the first puts into fresh memory pay a page fault per 4 KiB on
    # both sides and run at about 1 GB/s).
    cfg.write_text("[master]\nlease_ttl_ms = 1000\n"
                   f"[storage]\nprefault = {str(prefault).lower()}\n"
                   f"[client]\nshm_populate = \"{'at_map' if at_map else 'on_use'}\"\n")
    os.environ["KVPOOL_CONFIG"] = str(cfg)
    proc = subprocess.Popen(
        [binary, "run", "--config", str(cfg), "--listen", "127.0.0.1:0",
         "--http", "127.0.0.1:0", "--segment-size", segment],
        stdout=subprocess.PIPE, stderr=open(pathlib.Path(tmp) / "kvpool.stderr", "w"), text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if line.startswith("kvpool all listening on "):
            return proc, line.split()[-1]
    proc.kill()
    sys.exit("kvpool did not start: " + (pathlib.Path(tmp) / "kvpool.stderr").read_text()[-2000:])


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


POOL_STDERR = None


def fail(msg):
    err = POOL_STDERR.read_text()[-3000:] if POOL_STDERR and POOL_STDERR.exists() else ""
    sys.exit(f"{msg}\n--- kvpool's stderr (end):\n{err}")


def store_round(store, src, dst, size, batch):
    tag = uuid.uuid4().hex[:10]
    ks = [f"{tag}-{i}" for i in range(batch)]
    sp = [src.data_ptr() + i * size for i in range(batch)]
    dp = [dst.data_ptr() + i * size for i in range(batch)]
    dst.zero_()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    put = store.batch_put_from(ks, sp, [size] * batch)
    t1 = time.perf_counter()
    got = store.batch_get_into(ks, dp, [size] * batch)
    t2 = time.perf_counter()
    if put != [0] * batch or got != [size] * batch:
        fail(f"{src.device} {size} x {batch}: put codes {set(put)}, get codes {set(got)}")
    if not torch.equal(src, dst.to(src.device)):
        fail(f"other bytes: {src.device} {size} x {batch}")
    store.batch_remove(ks, True)
    return gbps(size * batch, t1 - t0), gbps(size * batch, t2 - t1)


def torch_round(dev, host):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return gbps(dev.numel(), t1 - t0), gbps(dev.numel(), t2 - t1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--segment", default="8GiB")
    ap.add_argument("--no-prefault", action="store_true")
    ap.add_argument("--on-use", action="store_true", help="client.shm_populate = on_use")
    ap.add_argument("--cases", default="",
                    help="SIZE_KIB:BATCH,... instead of the default cases")
    a = ap.parse_args()
    cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",") if c]
    cases = [(k * 1024, b) for k, b in cases] or CASES
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    tmp = tempfile.mkdtemp(prefix="kvpool-gpu-")
    global POOL_STDERR
    POOL_STDERR = pathlib.Path(tmp) / "kvpool.stderr"
    proc, addr = start_pool(tmp, a.segment, not a.no_prefault, not a.on_use)
    rows = []
    try:
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", addr) == 0
        for size, batch in cases:
            n = size * batch
            g = torch.Generator(device="cuda").manual_seed(size)
            dev_src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
            dev_dst = torch.empty_like(dev_src)
            host_src = dev_src.cpu().pin_memory()
            host_dst = torch.empty_like(host_src).pin_memory()
            for t in (dev_src, dev_dst, host_src, host_dst):
                assert store.register_buffer(t.data_ptr(), n) == 0
            fig = {"device": [], "host": [], "torch": []}
            store_round(store, dev_src, dev_dst, size, batch)  # warm-up
            store_round(store, host_src, host_dst, size, batch)
            for r in range(a.rounds):
                order = ["device", "host", "torch"]
                order = order[r % 3:] + order[:r % 3]
                for kind in order:
                    if kind == "device":
                        fig[kind].append(store_round(store, dev_src, dev_dst, size, batch))
                    elif kind == "host":
                        fig[kind].append(store_round(store, host_src, host_dst, size, batch))
                    else:
                        fig[kind].append(torch_round(dev_src, host_dst))
            for t in (dev_src, dev_dst, host_src, host_dst):
                store.unregister_buffer(t.data_ptr())
            med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
                   for k, v in fig.items()}
            rows.append({"size": size, "batch": batch, **{
                f"{k}_{d}": round(med[k][j], 2) for k in med for j, d in enumerate(("put", "get"))}})
        store.close()
    finally:
        proc.kill()
        proc.wait()
    print(f"GB/s, median of {a.rounds} rounds; torch: put = device-to-host copy, "
          "get = host-to-device copy (pinned)")
    print(f"{'size x batch':>14} | {'device put':>10} {'device get':>10} | "
          f"{'host put':>8} {'host get':>8} | {'torch d2h':>9} {'torch h2d':>9}")
    for r in rows:
        label = f"{r['size'] // 1024} KiB x {r['batch']}"
        print(f"{label:>14} | {r['device_put']:>10} {r['device_get']:>10} | "
              f"{r['host_put']:>8} {r['host_get']:>8} | {r['torch_put']:>9} {r['torch_get']:>9}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
