#!/usr/bin/env python3
"""OpenAI load generators nobody here wrote against `kvpool run` (issue 30).

    python3 benches/load_generators.py [--bin target/release/kvpool]
        [--tools aiperf,guidellm] [--concurrency 4[,16...]] [--seconds 30]

Starts one `kvpool run` (builtin:tiny prefill and decode engines behind the
conductor's front, ephemeral ports), writes the built-in model's tokenizer
with `kvpool tokenizer`, then runs each tool for each concurrency: a chat
load, streamed, 128 prompt and 32 output tokens (synthetic), bounded by
--seconds. aiperf and guidellm come from pip (`aiperf`, `guidellm`), found
beside this Python or on PATH. Prints one line per run (requests, errors,
TTFT and ITL p50/p99 in ms, output tokens/s) and a Markdown table; exits 1
when a run has an error or completes no request, 2 when a tool is missing.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 32


def tool(name):
    here = pathlib.Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def start_pool(bin_, work):
    log = open(work / "kvpool.log", "w")
    p = subprocess.Popen([bin_, "run", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                          "--shards", "2", "--segment-size", "256MiB"],
                         stdout=subprocess.PIPE, stderr=log, text=True)
    end = time.monotonic() + 120
    for line in p.stdout:
        if line.startswith("kvpool conductor listening on "):
            front = line.split()[-1]
            break
        if time.monotonic() > end:
            break
    else:
        front = None
    if front is None:
        p.kill()
        sys.exit(f"kvpool run did not start its front (log: {work / 'kvpool.log'})")
    # Keep reading its stdout so that it never blocks on a full pipe.
    import threading
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    # Ready when both engines are up behind the front.
    import urllib.request
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://{front}/health", timeout=5) as r:
                if r.status == 200:
                    return p, front
        except OSError:
            pass
        time.sleep(0.5)
    p.kill()
    sys.exit("the front did not become healthy within 120 s")


def run_aiperf(exe, front, tok, c, seconds, out):
    art = out / f"aiperf-c{c}"
    cmd = [exe, "profile", "--model", "builtin:tiny", "--url", f"http://{front}",
           "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tok),
           "--concurrency", str(c), "--benchmark-duration", str(seconds),
           "--isl", str(PROMPT_TOKENS), "--osl", str(OUTPUT_TOKENS),
           "--artifact-dir", str(art), "--ui-type", "none"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 240)
    (out / f"aiperf-c{c}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        return {"error": f"aiperf exited {r.returncode} (log: {out}/aiperf-c{c}.log)"}
    d = json.loads((art / "profile_export_aiperf.json").read_text())
    errors = sum(e.get("count", 1) for e in d.get("error_summary") or [])
    stat = lambda k, p: d[k][p]  # noqa: E731
    return {"requests": int(d["request_count"]["avg"]), "errors": errors,
            "ttft_p50": stat("time_to_first_token", "p50"),
            "ttft_p99": stat("time_to_first_token", "p99"),
            "itl_p50": stat("inter_token_latency", "p50"),
            "itl_p99": stat("inter_token_latency", "p99"),
            "out_tok_s": d["output_token_throughput"]["avg"]}


def run_guidellm(exe, front, tok, c, seconds, out):
    path = out / f"guidellm-c{c}.json"
    cmd = [exe, "run",
           "--backend", f"kind=openai_http,target=http://{front},model=builtin:tiny",
           "--profile", f"kind=concurrent,streams={c}",
           "--constraint", f"kind=max_duration,seconds={seconds}",
           "--tokenizer", f"kind=hf_auto,model={tok}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                     f"output_tokens={OUTPUT_TOKENS}",
           "--output", f"kind=json,path={path}", "--disable-console-interactive"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 240,
                       cwd=out)
    (out / f"guidellm-c{c}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        return {"error": f"guidellm exited {r.returncode} (log: {out}/guidellm-c{c}.log)"}
    b = json.loads(path.read_text())["benchmarks"][0]
    made = b["scheduler_metrics"]["requests_made"]
    m = b["metrics"]

    def q(name, p):
        dist = m[name]["successful"]
        return dist["percentiles"][p] if "percentiles" in dist else dist[p]
    return {"requests": made["successful"], "errors": made["errored"],
            "ttft_p50": q("time_to_first_token_ms", "p50"),
            "ttft_p99": q("time_to_first_token_ms", "p99"),
            "itl_p50": q("inter_token_latency_ms", "p50"),
            "itl_p99": q("inter_token_latency_ms", "p99"),
            "out_tok_s": m["output_tokens_per_second"]["successful"]["mean"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.environ.get(
        "KVPOOL_BIN", str(ROOT / "target" / "release" / "kvpool")))
    ap.add_argument("--tools", default="aiperf,guidellm")
    ap.add_argument("--concurrency", default="4")
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    runners = {"aiperf": run_aiperf, "guidellm": run_guidellm}
    tools = a.tools.split(",")
    exes = {t: tool(t) for t in tools}
    missing = [t for t, e in exes.items() if e is None or t not in runners]
    if missing:
        print(f"missing or unknown: {', '.join(missing)} (pip install aiperf guidellm)",
              file=sys.stderr)
        sys.exit(2)
    out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="kvpool-load-"))
    out.mkdir(parents=True, exist_ok=True)
    tok = out / "tokenizer"
    subprocess.run([a.bin, "tokenizer", str(tok), "--model", "builtin:tiny"], check=True,
                   capture_output=True)
    pool, front = start_pool(a.bin, out)
    rows, failed = [], False
    try:
        for c in [int(x) for x in a.concurrency.split(",")]:
            for t in tools:
                r = runners[t](exes[t], front, tok, c, a.seconds, out)
                r.update(tool=t, concurrency=c)
                print(json.dumps(r), flush=True)
                rows.append(r)
                if "error" in r or r["errors"] or not r["requests"]:
                    failed = True
    finally:
        pool.terminate()
        try:
            pool.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pool.kill()
    print("\n| tool | concurrency | requests | errors | TTFT p50 / p99 ms | ITL p50 / p99 ms "
          "| output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['tool']} | {r['concurrency']} | {r['error']} |")
            continue
        print(f"| {r['tool']} | {r['concurrency']} | {r['requests']} | {r['errors']} "
              f"| {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} | {r['itl_p50']:.1f} / "
              f"{r['itl_p99']:.1f} | {r['out_tok_s']:.0f} |")
    print(f"\nlogs: {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
