"""Fixtures: a real `kvpool run` started from the built binary.

The binary is $KVPOOL_BIN, else $CARGO_TARGET_DIR/release/kvpool, else the
repository's target/release/kvpool. Each pool listens on free ports of
127.0.0.1 and is stopped when its fixture ends.
"""

import os
import pathlib
import queue
import signal
import subprocess
import threading
import time
import uuid

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
START_DEADLINE_S = 30
#: The read lease of the test pools (ms): short, so tests that wait for a
#: lease to end stay quick, long enough that a remove right after a get
#: meets it.
LEASE_MS = 3000


def kvpool_bin() -> str:
    candidates = [os.environ.get("KVPOOL_BIN", "")]
    if os.environ.get("CARGO_TARGET_DIR"):
        candidates.append(os.path.join(os.environ["CARGO_TARGET_DIR"], "release", "kvpool"))
    candidates.append(str(REPO / "target" / "release" / "kvpool"))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise RuntimeError("no kvpool binary: build it (cargo build --release) or set KVPOOL_BIN")


class Pool:
    """A running `kvpool run`; `addr` is its master's host:port, `listening`
    every listener it named before its role's (`{"resp": "127.0.0.1:..."}`)."""

    def __init__(self, tmp: pathlib.Path, role="all", segment="256MiB", config=""):
        cfg = tmp / f"kvpool-{uuid.uuid4().hex[:8]}.toml"
        cfg.write_text(
            f"[master]\nlease_ttl_ms = {LEASE_MS}\n"
            "[runtime]\nshards = 1\npin_shards = false\n" + config
        )
        args = [kvpool_bin(), "run", "--role", role, "--config", str(cfg),
                "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"]
        if role == "all":
            args += ["--segment-size", segment]
        self.stderr_path = tmp / f"{cfg.stem}.stderr"
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE,
                                     stderr=open(self.stderr_path, "w"), text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in self.proc.stdout],
                         daemon=True).start()
        want = f"kvpool {role} listening on "
        end = time.monotonic() + START_DEADLINE_S
        self.addr = None
        self.listening = {}
        while time.monotonic() < end and self.addr is None:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith(want):
                self.addr = line[len(want):].strip()
            elif line.startswith("kvpool ") and " listening on " in line:
                name, addr = line[len("kvpool "):].split(" listening on ", 1)
                self.listening[name] = addr.strip()
        if self.addr is None:
            self.stop()
            raise RuntimeError(f"kvpool did not start: {self.stderr_path.read_text()[-2000:]}")

    def signal(self, sig):
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            # kill() returns before every thread has stopped (on a loaded
            # machine a request can still be served just after it): wait
            # until each thread of the process reads as stopped.
            end = time.monotonic() + 10
            while not self._all_stopped():
                assert time.monotonic() < end, "the process did not stop"
                time.sleep(0.01)

    def _all_stopped(self) -> bool:
        tasks = pathlib.Path(f"/proc/{self.proc.pid}/task")
        try:
            states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0]
                      for t in tasks.iterdir()]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return bool(states) and all(st in ("T", "t") for st in states)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("pool"))
    yield p
    p.stop()


@pytest.fixture
def fresh_pool(tmp_path):
    """A pool of its own, for tests that fill, freeze or kill it."""
    pools = []

    def make(**kw):
        p = Pool(tmp_path, **kw)
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.stop()


@pytest.fixture
def keys():
    """Keys no other test uses."""
    prefix = uuid.uuid4().hex[:12]
    return lambda name: f"{prefix}-{name}"


def wait_until(pred, timeout_s=10.0, step_s=0.05):
    """Polls `pred` until it is true or the deadline passes; returns it."""
    end = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v or time.monotonic() > end:
            return v
        time.sleep(step_s)
