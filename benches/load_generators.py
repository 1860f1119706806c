#!/usr/bin/env python3
"""OpenAI load generators nobody here wrote against `kvpool run` (issue 30).

    python3 benches/load_generators.py [--bin target/release/kvpool]
        [--tools aiperf,guidellm,inference-perf] [--concurrency 4[,16...]]
        [--seconds 30] [--model builtin:tiny|words]

Starts one `kvpool run` (prefill and decode engines behind the conductor's
front, ephemeral ports), writes the served model's tokenizer with `kvpool
tokenizer`, then runs each tool for each concurrency: a chat load, streamed,
128 prompt and 32 output tokens (synthetic), bounded by --seconds.
inference-perf runs its random dataset on the completions API at a constant
rate of concurrency / 2 requests a second (its load is a rate).

--model words serves a model folder written here: a seeded random Llama
(2 layers, hidden 64) with a word-level tokenizer of 1,024 words. Every
token id decodes to a whole word, so a tool that draws random token ids,
decodes them and counts the text again (inference-perf's random dataset)
gets the count it drew; the built-in models' byte-level tokenizer cannot
give that (a lone byte 0x80-0xFF decodes to U+FFFD, three tokens).

aiperf, guidellm and inference-perf come from pip, found beside this Python
or on PATH (inference-perf needs Python 3.12 or later). Prints one line per
run (requests, errors, TTFT and ITL p50/p99 in ms, output tokens/s) and a
Markdown table; exits 1 when a run has an error or completes no request, 2
when a tool is missing.
"""

import argparse
import array
import json
import os
import pathlib
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 32


def tool(name):
    here = pathlib.Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


WORDS = 1024


def word_model(d, seed=7):
    """A seeded random LlamaForCausalLM folder with a word-level tokenizer:
    `[UNK]`, `<s>`, `</s>` and words w3..w1023; decoding joins words with
    spaces, so any id sequence decodes to text that counts the same again."""
    d.mkdir(parents=True, exist_ok=True)
    h, inter, layers, heads = 64, 128, 2, 4
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "vocab_size": WORDS, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32"}))
    specials = ["[UNK]", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), WORDS)})
    (d / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": w, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, w in enumerate(specials)],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
    rng = random.Random(seed)
    shapes = [("model.embed_tokens.weight", [WORDS, h], 1.0)]
    for n in range(layers):
        p = f"model.layers.{n}"
        shapes += [(f"{p}.self_attn.{x}_proj.weight", [h, h], h ** -0.5) for x in "qkvo"]
        shapes += [(f"{p}.mlp.gate_proj.weight", [inter, h], h ** -0.5),
                   (f"{p}.mlp.up_proj.weight", [inter, h], h ** -0.5),
                   (f"{p}.mlp.down_proj.weight", [h, inter], inter ** -0.5),
                   (f"{p}.input_layernorm.weight", [h], 0.0),
                   (f"{p}.post_attention_layernorm.weight", [h], 0.0)]
    shapes += [("model.norm.weight", [h], 0.0), ("lm_head.weight", [WORDS, h], 4 * h ** -0.5)]
    header, blobs, at = {}, [], 0
    for name, shape, std in shapes:
        n = 1
        for x in shape:
            n *= x
        a = std * 3 ** 0.5
        data = array.array("f", [1.0] * n if std == 0 else
                           [rng.uniform(-a, a) for _ in range(n)])
        if sys.byteorder != "little":
            data.byteswap()
        blob = data.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for b in blobs:
            f.write(b)
    return d


def start_pool(bin_, work, model=None):
    log = open(work / "kvpool.log", "w")
    args = [bin_, "run", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
            "--shards", "2", "--segment-size", "256MiB"]
    if model:
        args += ["--model", str(model)]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True)
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


def model_name(front):
    """The model id the front serves (its /v1/models)."""
    import urllib.request
    with urllib.request.urlopen(f"http://{front}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def run_aiperf(exe, front, tok, c, seconds, out, model):
    art = out / f"aiperf-c{c}"
    cmd = [exe, "profile", "--model", model, "--url", f"http://{front}",
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


def run_guidellm(exe, front, tok, c, seconds, out, model):
    path = out / f"guidellm-c{c}.json"
    cmd = [exe, "run",
           "--backend", f"kind=openai_http,target=http://{front},model={model}",
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


def run_inference_perf(exe, front, tok, c, seconds, out, model):
    """Its random dataset (completions, streamed) at c / 2 requests a second
    for `seconds`: every request it means to send must be built and succeed."""
    rate = c / 2
    report = out / f"inference-perf-c{c}"
    cfg = {"load": {"type": "constant", "stages": [{"rate": rate, "duration": seconds}]},
           "api": {"type": "completion", "streaming": True},
           "server": {"type": "vllm", "model_name": model, "base_url": f"http://{front}",
                      "ignore_eos": True},
           "tokenizer": {"pretrained_model_name_or_path": str(tok)},
           "data": {"type": "random",
                    "input_distribution": {"min": PROMPT_TOKENS // 2,
                                           "max": PROMPT_TOKENS * 2,
                                           "mean": PROMPT_TOKENS, "std_dev": 32},
                    "output_distribution": {"min": OUTPUT_TOKENS // 2,
                                            "max": OUTPUT_TOKENS * 2,
                                            "mean": OUTPUT_TOKENS, "std_dev": 8}},
           "storage": {"local_storage": {"path": str(report)}}}
    conf = out / f"inference-perf-c{c}.yaml"
    conf.write_text(json.dumps(cfg))  # JSON is YAML
    r = subprocess.run([exe, "--config_file", str(conf)], capture_output=True, text=True,
                       timeout=seconds + 300, cwd=out)
    (out / f"inference-perf-c{c}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        return {"error": f"inference-perf exited {r.returncode} "
                         f"(log: {out}/inference-perf-c{c}.log)"}
    found = list(report.rglob("summary_lifecycle_metrics.json"))
    if not found:
        return {"error": f"inference-perf wrote no summary (log: {out}/inference-perf-c{c}.log)"}
    d = json.loads(found[0].read_text())
    ok, failed = d["successes"]["count"], d["failures"]["count"]
    # Requests it meant to send but could not build count as errors.
    unsent = max(0, int(rate * seconds) - ok - failed)
    lat = d["successes"].get("latency", {})
    tput = d["successes"].get("throughput", {})

    def q(name, p):
        v = (lat.get(name) or {}).get(p)
        return float("nan") if v is None else v * 1000
    return {"requests": ok, "errors": failed + unsent, "unsent": unsent,
            "ttft_p50": q("time_to_first_token", "median"),
            "ttft_p99": q("time_to_first_token", "p99"),
            "itl_p50": q("inter_token_latency", "median"),
            "itl_p99": q("inter_token_latency", "p99"),
            "out_tok_s": tput.get("output_tokens_per_sec", float("nan"))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.environ.get(
        "KVPOOL_BIN", str(ROOT / "target" / "release" / "kvpool")))
    ap.add_argument("--tools", default="aiperf,guidellm")
    ap.add_argument("--concurrency", default="4")
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default="builtin:tiny",
                    help="builtin:tiny, or `words` (a word-level model folder written here)")
    a = ap.parse_args()
    runners = {"aiperf": run_aiperf, "guidellm": run_guidellm,
               "inference-perf": run_inference_perf}
    tools = a.tools.split(",")
    exes = {t: tool(t) for t in tools}
    missing = [t for t, e in exes.items() if e is None or t not in runners]
    if missing:
        print(f"missing or unknown: {', '.join(missing)} "
              "(pip install aiperf guidellm inference-perf)",
              file=sys.stderr)
        sys.exit(2)
    out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="kvpool-load-"))
    out.mkdir(parents=True, exist_ok=True)
    model = word_model(out / "words-model") if a.model == "words" else a.model
    tok = out / "tokenizer"
    subprocess.run([a.bin, "tokenizer", str(tok), "--model", str(model)], check=True,
                   capture_output=True)
    pool, front = start_pool(a.bin, out, model if a.model == "words" else None)
    served = model_name(front)
    rows, failed = [], False
    try:
        for c in [int(x) for x in a.concurrency.split(",")]:
            for t in tools:
                r = runners[t](exes[t], front, tok, c, a.seconds, out, served)
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
