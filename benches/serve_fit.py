#!/usr/bin/env python3
"""Fits the cluster model's prefill cost to a live `benches/serve.sh` run.

    benches/serve_fit.py [OUT]      (default /tmp/kvpool-serve-bench)

Takes every request the conductor routed to a prefill instance that was idle
when it arrived (from the decision logs: queued 0 and busy until no later than
now), whose TTFT is then its service time alone: prefill of the uncached
tokens, the KV moving through the pool both ways, the decode engine's first
token, and the HTTP hops. Fits, by least squares on the relative error,

    ttft = base_ms + ms_per_token*u + ms_per_token_sq*u*(u + 2c) + ms_per_cached*c

(u uncached prompt tokens, c tokens loaded from the pool: the cost model's
prefill form plus its fetch term, ms_per_cached = kv_bytes_per_token*8 /
(link_gbps*1e6)) and prints the fitted keys, the link speed that fetch term
means, and the relative error of the model in the decision logs against the
fitted one. The decode step's base is moved by what the simulator's median TBT
(sim.jsonl, same run) exceeds the live one (the model's other decode terms
kept). Standard library only.
"""

import glob
import json
import sys


def solve(rows, rhs):
    """Least squares: the normal equations, Gauss-Jordan with pivoting."""
    n = len(rows[0])
    m = [[sum(r[i] * r[j] for r in rows) for j in range(n)]
         + [sum(r[i] * y for r, y in zip(rows, rhs))] for i in range(n)]
    for i in range(n):
        p = max(range(i, n), key=lambda k: abs(m[k][i]))
        m[i], m[p] = m[p], m[i]
        for k in range(n):
            if k != i:
                f = m[k][i] / m[i][i]
                m[k] = [a - f * b for a, b in zip(m[k], m[i])]
    return [m[i][n] / m[i][i] for i in range(n)]


def quantiles(xs):
    xs = sorted(xs)
    return tuple(round(xs[int(q * (len(xs) - 1))], 3) for q in (0.1, 0.5, 0.9))


def load(out):
    trace = [json.loads(l) for l in open(f"{out}/trace.jsonl")]
    rows, start = [], None
    for path in sorted(glob.glob(f"{out}/requests-*.jsonl")):
        policy, rnd = path.split("requests-")[1][: -len(".jsonl")].rsplit("-", 1)
        reqs = [json.loads(l) for l in open(path)]
        reqs.sort(key=lambda r: (r["arrival_ms"], r["index"]))
        log = [json.loads(l) for l in open(f"{out}/decisions-{policy}-{rnd}.jsonl")]
        start = start or next(d for d in log if d["kind"] == "start")
        used = set()
        for d in (d for d in log if d["kind"] == "schedule"):
            # Decisions come in arrival order; requests that arrive at once
            # may swap, so match on the prompt length too.
            r = next((r for r in reqs if r["index"] not in used
                      and trace[r["index"]]["input_length"] == d["input_tokens"]), None)
            if r is None:
                continue
            used.add(r["index"])
            if d["decision"]["decision"] != "route" or r["outcome"] != "ok":
                continue
            v = d["view"]["prefill"][d["decision"]["prefill"]]
            c = r["cached_tokens"]
            rows.append({
                "idle": v["queued"] == 0 and v["busy_until_ms"] <= d["now_ms"],
                "u": d["input_tokens"] - c, "c": c, "ttft": r["ttft_ms"],
                "pred": d["decision"]["predicted_prefill_ms"],
                "tbt": r["tbt_ms"], "tokens": r["tokens"],
            })
    return rows, start


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvpool-serve-bench"
    rows, start = load(out)
    idle = [r for r in rows if r["idle"]]
    print(f"{len(rows)} requests routed and answered; {len(idle)} to an idle prefill instance")
    terms = [lambda r: 1.0, lambda r: r["u"], lambda r: r["u"] * (r["u"] + 2 * r["c"]),
             lambda r: r["c"]]
    x = solve([[t(r) / r["ttft"] for t in terms] for r in idle], [1.0] * len(idle))
    cost = start["cost"]
    kv = cost["network"]["kv_bytes_per_token"]
    print(f"prefill.base_ms = {x[0]:.1f}")
    print(f"prefill.ms_per_token = {x[1]:.3f}")
    print(f"prefill.ms_per_token_sq = {x[2]:.6f}")
    print(f"ms per cached token = {x[3]:.5f}  ->  network.link_gbps = {kv * 8 / (x[3] * 1e6):.2f}")
    fit = [sum(a * t(r) for a, t in zip(x, terms)) / r["ttft"] - 1 for r in idle]
    was = [r["pred"] / r["ttft"] - 1 for r in idle]
    print("relative error p10/p50/p90: logged model", quantiles(was), "fitted", quantiles(fit))
    tbt = sorted(r["tbt"] for r in rows if r["tokens"] > 1)
    live = tbt[len(tbt) // 2]
    sims = sorted(json.loads(l)["tbt_ms_p50"] for l in open(f"{out}/sim.jsonl"))
    sim = sims[len(sims) // 2]
    base = cost["decode"]["base_ms"]
    print(f"TBT p50: live {live:.3f} ms, simulated {sim:.3f} ms  ->  "
          f"decode.base_ms = {base - (sim - live):.2f} (was {base})")


if __name__ == "__main__":
    main()
