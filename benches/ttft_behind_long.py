#!/usr/bin/env python3
"""Short-request TTFT with and without a long prompt in prefill (issue 30, item 2).

    python3 benches/ttft_behind_long.py target/release/kvpool 30000

Starts `kvpool run --role engine --model builtin:small` (no pool) on 127.0.0.1:18480;
measures a 9-token streamed request's time to its first event three times alone, then
five times while a LONG-token prompt (second argument) is in prefill, then the long
prompt's own TTFT (it ends at engine.request_timeout_ms, 600 s, if its prefill does not).
"""
import json, socket, subprocess, sys, threading, time, random
BIN, PORT = sys.argv[1], 18480  # the binary, the engine port
eng = subprocess.Popen([BIN, "run", "--role", "engine", "--model", "builtin:small", "--listen", f"127.0.0.1:{PORT}"],
                       stdout=subprocess.PIPE, stderr=open("/tmp/ttft/engine.log", "w"), text=True)
for line in eng.stdout:
    if "listening on" in line and "engine" in line: break
def ttft(n, seed, max_tokens=1):
    rnd = random.Random(seed)
    body = json.dumps({"prompt": [256] + [rnd.randrange(1, 255) for _ in range(n - 1)], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    s = socket.create_connection(("127.0.0.1", PORT)); t0 = time.monotonic()
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
    buf = b""
    while b"data: {" not in buf:
        d = s.recv(65536)
        if not d: raise SystemExit(f"no event: {buf[:300]!r}")
        buf += d
    t = time.monotonic() - t0
    while s.recv(65536): pass
    return t
alone = [ttft(9, i) for i in range(3)]
print("short alone TTFT s:", [round(x, 3) for x in alone], flush=True)
long_t = {}
th = threading.Thread(target=lambda: long_t.setdefault("t", ttft(int(sys.argv[2]), 99)))
th.start(); time.sleep(3)
behind = []
for i in range(5):
    behind.append(ttft(9, 10 + i)); time.sleep(1)
print("short TTFT with the long prompt in prefill s:", [round(x, 3) for x in behind], flush=True)
th.join()
print(f"long prompt ({sys.argv[2]} tokens) TTFT s: {long_t['t']:.1f}", flush=True)
eng.terminate(); eng.wait()
