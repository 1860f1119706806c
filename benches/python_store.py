#!/usr/bin/env python3
"""Python get_into / batch_get_into through kvpool, through the Rust client,
and through Mooncake's own wheel, on this machine, in alternating rounds.

    python benches/python_store.py [--rounds 5] [--mooncake-venv DIR] [--json]

Run it with the Python that has `kvpool` installed (`pip install ./python`).
It starts, on 127.0.0.1:
  * `kvpool run` (master + one storage node, 4 GiB, 1 s leases), then per
    round: a Python worker using `kvpool.mooncake` (a pure client,
    global_segment_size 0), and `kvpool bench transfer` (the Rust client)
    for the same sizes and batches;
  * with `--mooncake-venv DIR` (a venv with `mooncake-transfer-engine-non-cuda`):
    `mooncake_master`, a `mooncake_client` holding 4 GB, and the same Python
    worker importing `mooncake.store` in that venv.

Each worker puts `calls * batch` distinct values, reads each once with
`get_into` (batch 1) or `batch_get_into` (batch > 1) into a registered
buffer, checks the bytes, and removes them. Percentiles are exact over the
samples of a case; a round runs the systems in a rotating order; the table
gives the median over rounds of each figure.
"""

import argparse
import json
import os
import pathlib
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
LEASE_MS = 1000
START_DEADLINE_S = 30


def size_name(n):
    for unit, v in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= v and n % v == 0:
            return f"{n // v} {unit}"
    return f"{n} B"


# --- the worker (runs in either venv) ------------------------------------

def worker(args):
    import numpy as np

    if args.worker == "kvpool":
        from kvpool.mooncake import MooncakeDistributedStore
    else:
        from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", args.master)
    if rc != 0:
        raise SystemExit(f"setup failed: {rc}")
    rows = []
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else SIZES
    batches = [int(x) for x in args.batches.split(",")] if args.batches else [1, args.batch]
    for size in sizes:
        for batch in batches:
            calls = max(1, min(args.max_calls, args.bytes // (size * batch)))
            keys = [f"bench-{args.worker}-{size}-{batch}-{os.getpid()}-{i}"
                    for i in range(calls * batch)]
            src = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
            dst = np.ones(size * batch, dtype=np.uint8)  # touched: no first-touch faults timed
            for a in (src, dst):
                if store.register_buffer(a.ctypes.data, a.nbytes) != 0:
                    raise SystemExit("register_buffer failed")
            for i in range(0, len(keys), 64):
                chunk = keys[i:i + 64]
                got = store.batch_put_from(chunk, [src.ctypes.data] * len(chunk),
                                           [size] * len(chunk))
                if any(g != 0 for g in got):
                    raise SystemExit(f"put failed: {got}")
            ptrs = [dst.ctypes.data + j * size for j in range(batch)]
            samples = []
            t_all = time.perf_counter_ns()
            for c in range(calls):
                ks = keys[c * batch:(c + 1) * batch]
                t0 = time.perf_counter_ns()
                if batch == 1:
                    n = store.get_into(ks[0], ptrs[0], size)
                    ok = n == size
                else:
                    got = store.batch_get_into(ks, ptrs, [size] * batch)
                    ok = all(g == size for g in got)
                samples.append(time.perf_counter_ns() - t0)
                if not ok:
                    raise SystemExit(f"get failed at call {c}")
            wall = time.perf_counter_ns() - t_all
            if not np.array_equal(dst[:size], src):
                raise SystemExit("bytes read differ from bytes written")
            samples.sort()

            def pct(p):
                return samples[min(len(samples) - 1, int(p * len(samples)))] / 1000

            rows.append({"size": size, "batch": batch, "calls": calls,
                         "p50_us": pct(0.50), "p99_us": pct(0.99), "p999_us": pct(0.999),
                         "max_us": samples[-1] / 1000,
                         "gb_per_s": calls * batch * size / wall})
            for i in range(0, len(keys), 256):
                store.batch_remove(keys[i:i + 256], True)
            store.unregister_buffer(src.ctypes.data)
            store.unregister_buffer(dst.ctypes.data)
    store.close()
    print(json.dumps(rows))


# --- the driver ---------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_line(proc, prefix, what):
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    end = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise SystemExit(f"{what} did not start")


def wait_port(port, what):
    end = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on {port}")


class Procs:
    def __init__(self):
        self.procs = []

    def start(self, args, **kw):
        p = subprocess.Popen(args, **kw)
        self.procs.append(p)
        return p

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def kvpool_bin(arg):
    for c in (arg, os.environ.get("KVPOOL_BIN"),
              os.path.join(os.environ.get("CARGO_TARGET_DIR", str(REPO / "target")),
                           "release", "kvpool")):
        if c and os.access(c, os.X_OK):
            return c
    raise SystemExit("no kvpool binary: cargo build --release, or --kvpool-bin")


def run_worker(python, which, master, args):
    out = subprocess.run([python, str(HERE), "--worker", which, "--master", master,
                          "--bytes", str(args.bytes), "--max-calls", str(args.max_calls),
                          "--batch", str(args.batch)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{which} worker failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_rust(binary, master, args):
    sizes = ",".join(f"{s >> 10}KiB" for s in SIZES)
    out = subprocess.run([binary, "--master", master, "bench", "transfer", "--transport", "auto",
                          "--sizes", sizes, "--batch", f"1,{args.batch}",
                          "--bytes", str(args.bytes), "--max-calls", str(args.max_calls),
                          "--json"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"kvpool bench transfer failed: {out.stderr[-2000:]}")
    rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    return [dict(r, path=r["path"]) for r in rows if r["op"] == "get"]


def start_mooncake(procs, venv, tmp):
    bindir = pathlib.Path(venv) / "bin"
    rpc, metrics, holder = free_port(), free_port(), free_port()
    log = open(tmp / "mooncake.log", "w")
    procs.start([str(bindir / "mooncake_master"), f"--rpc_port={rpc}",
                 f"--metrics_port={metrics}", f"--default_kv_lease_ttl={LEASE_MS}",
                 "--enable_http_metadata_server=false"], stdout=log, stderr=log)
    wait_port(rpc, "mooncake_master")
    procs.start([str(bindir / "mooncake_client"), "--global_segment_size=4GB",
                 f"--master_server_address=127.0.0.1:{rpc}", "--metadata_server=P2PHANDSHAKE",
                 "--protocol=tcp", f"--port={holder}"], stdout=log, stderr=log)
    wait_port(holder, "mooncake_client")
    return f"127.0.0.1:{rpc}", str(bindir / "python")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=["kvpool", "mooncake"], help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help="worker only: value sizes in bytes, comma-separated")
    ap.add_argument("--batches", help="worker only: batch sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="keys per batch_get_into (default 16)")
    ap.add_argument("--bytes", type=int, default=256 << 20, help="bytes read per case")
    ap.add_argument("--max-calls", type=int, default=2000, help="calls per case, at most")
    ap.add_argument("--kvpool-bin")
    ap.add_argument("--mooncake-venv", help="a venv with mooncake-transfer-engine-non-cuda")
    ap.add_argument("--json", action="store_true", help="one JSON object per table row")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    binary = kvpool_bin(args.kvpool_bin)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-pybench-"))
    procs = Procs()
    results = {}  # (system, size, batch) -> list of rows
    mooncake_error = None
    try:
        cfg = tmp / "pool.toml"
        cfg.write_text(f"[master]\nlease_ttl_ms = {LEASE_MS}\n")
        p = procs.start([binary, "run", "--config", str(cfg), "--listen", "127.0.0.1:0",
                         "--http", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
                         "--segment-size", "4GiB"],
                        stdout=subprocess.PIPE, stderr=open(tmp / "kvpool.log", "w"), text=True)
        master = wait_line(p, "kvpool all listening on ", "kvpool run")
        systems = [("kvpool-py", lambda: run_worker(sys.executable, "kvpool", master, args)),
                   ("rust", lambda: run_rust(binary, master, args))]
        if args.mooncake_venv:
            try:
                mc_master, mc_python = start_mooncake(procs, args.mooncake_venv, tmp)
                systems.append(("mooncake-py",
                                lambda: run_worker(mc_python, "mooncake", mc_master, args)))
            except (SystemExit, OSError) as e:
                mooncake_error = str(e)
        for r in range(args.rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for name, run in order:
                for row in run():
                    results.setdefault((name, row["size"], row["batch"]), []).append(row)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(name, size, batch, field):
        rows = results.get((name, size, batch))
        return statistics.median(r[field] for r in rows) if rows else None

    out = []
    for size in SIZES:
        for batch in (1, args.batch):
            row = {"size": size, "batch": batch, "op": "get_into" if batch == 1 else "batch_get_into"}
            for name in ("kvpool-py", "rust", "mooncake-py"):
                for f in ("p50_us", "p99_us", "gb_per_s"):
                    row[f"{name}.{f}"] = med(name, size, batch, f)
            paths = {r.get("path") for r in results.get(("rust", size, batch), [])}
            row["rust.path"] = "+".join(sorted(p for p in paths if p))
            out.append(row)
    if args.json:
        for row in out:
            print(json.dumps(row))
    else:
        print(f"medians of {args.rounds} rounds; p50 in us, throughput in GB/s")
        print(f"{'case':<26} {'kvpool py p50':>13} {'GB/s':>6} {'rust p50':>9} {'GB/s':>6} "
              f"{'py/rust':>7} {'mooncake p50':>12} {'GB/s':>6} {'mc/kvpool':>9}")
        for row in out:
            def f(v, w, d=1):
                return f"{v:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"
            kp, rs, mc = (row[f"{n}.p50_us"] for n in ("kvpool-py", "rust", "mooncake-py"))
            case = f"{row['op']} {size_name(row['size'])} x{row['batch']}"
            print(f"{case:<26} {f(kp, 13)} {f(row['kvpool-py.gb_per_s'], 6, 2)} {f(rs, 9)} "
                  f"{f(row['rust.gb_per_s'], 6, 2)} {f(kp / rs if kp and rs else None, 7, 2)} "
                  f"{f(mc, 12)} {f(row['mooncake-py.gb_per_s'], 6, 2)} "
                  f"{f(mc / kp if mc and kp else None, 9, 2)}")
    if args.mooncake_venv and mooncake_error:
        print(f"mooncake: not measured: {mooncake_error}", file=sys.stderr)


if __name__ == "__main__":
    main()
