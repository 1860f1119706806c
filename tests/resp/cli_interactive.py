"""redis-cli in interactive mode (a real terminal, through a pty) against the
RESP front: it starts (it asks COMMAND DOCS for its help), runs commands,
shows `help <command>` from our COMMAND DOCS, and quits with status 0.

Usage: cli_interactive.py REDIS_CLI PORT
Exit status 0 when every step saw what it expected; the transcript is
printed either way.
"""
import os
import pty
import select
import sys
import time

cli, port = sys.argv[1], sys.argv[2]
DEADLINE_S = 10

pid, fd = pty.fork()
if pid == 0:
    os.environ["TERM"] = "xterm"
    os.environ["REDISCLI_HISTFILE"] = "/dev/null"
    os.execvp(cli, [cli, "-p", port])

transcript = b""
queries = 0


def read_until(want: bytes) -> None:
    """Reads the terminal until `want` shows (answering linenoise's cursor
    position queries), or fails at the deadline."""
    global transcript
    end = time.monotonic() + DEADLINE_S
    start = len(transcript)
    while want not in transcript[start:]:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"did not see {want!r}")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            raise EOFError(f"redis-cli ended before {want!r}")
        if not chunk:
            raise EOFError(f"redis-cli ended before {want!r}")
        transcript += chunk
        # linenoise asks where the cursor is, moves it far right and asks
        # again (that is the width): answer column 1, then column 200.
        for _ in range(chunk.count(b"\x1b[6n")):
            global queries
            queries += 1
            os.write(fd, b"\x1b[1;1R" if queries % 2 else b"\x1b[1;200R")


def send(line: str) -> None:
    os.write(fd, line.encode() + b"\r")


prompt = f"127.0.0.1:{port}> ".encode()
ok = False
try:
    read_until(prompt)
    send("set ikey ivalue")
    read_until(b"OK")
    read_until(prompt)
    send("get ikey")
    read_until(b'"ivalue"')
    read_until(prompt)
    send("help get")
    read_until(b"Returns the string value of a key.")
    read_until(prompt)
    send("exists ikey nokey")
    read_until(b"(integer) 1")
    read_until(prompt)
    send("quit")
    end = time.monotonic() + DEADLINE_S
    status = None
    while time.monotonic() < end:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        try:
            r, _, _ = select.select([fd], [], [], 0.05)
            if r:
                transcript += os.read(fd, 4096)
        except OSError:
            pass
    if status is None:
        raise TimeoutError("redis-cli did not exit after quit")
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        raise RuntimeError(f"redis-cli exited with status {status}")
    ok = True
except Exception as e:  # the transcript says more than the exception
    print(f"FAILED: {e}")
finally:
    if not ok:
        print(transcript.decode(errors="replace"))
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
sys.exit(0 if ok else 1)
