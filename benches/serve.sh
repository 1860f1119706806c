#!/usr/bin/env bash
# `kvpool bench serve` against a live disaggregated cluster of builtin:tiny
# engines (2 prefill, 1 decode, each behind its proxy, one conductor), one
# fresh cluster per (round, policy) so that no run finds another's KV in the
# pool; and `kvpool sim` on the same trace with the same cluster model.
# Policies alternate within each round. Output: one JSON line per live run
# (the `kvpool sim --json` keys plus round) and one per simulated policy, in
# $OUT (default /tmp/kvpool-serve-bench).
#
#   benches/serve.sh [ROUNDS] [REQUESTS] [SPEED] [SKIP]
#
# The default window is the trace's last 150 requests (SKIP 3800): they share
# 54 % of their blocks among themselves, where early windows of the same size
# share under 10 % (the trace's 65 % hit ratio comes from reuse across the
# whole 17 minutes), so the pool and cache-aware routing have work to do.
# Blocks are scaled to 16 tokens (the engines' chunk size here), answers to
# a tenth, at most 16 tokens. benches/serve_fit.py fits the cost model to the
# run.
#
# KVPOOL_BIN (default target/release/kvpool), MODEL (default
# configs/cluster-model-tiny.toml), POLICIES (default "cache_global
# round_robin random"). Hold the shared cargo lock while it runs.
set -euo pipefail

ROUNDS=${1:-3}
REQUESTS=${2:-150}
SPEED=${3:-1}
SKIP=${4:-3800}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${KVPOOL_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/kvpool}
MODEL=${MODEL:-$ROOT/configs/cluster-model-tiny.toml}
POLICIES=${POLICIES:-cache_global round_robin random}
OUT=${OUT:-/tmp/kvpool-serve-bench}
mkdir -p "$OUT"
rm -f "$OUT"/live.jsonl "$OUT"/sim.jsonl

TRACE=$OUT/trace.jsonl
"$BIN" sim scale --trace "$ROOT/tests/data/synthetic_trace.jsonl" --out "$TRACE" \
  --block-tokens 16 --skip "$SKIP" --requests "$REQUESTS" --output-scale 0.1 --output-max 16

CFG=$OUT/serving.toml
cat >"$CFG" <<EOF
[engine]
chunk_tokens = 16
[serving.conductor]
cost_model = "$MODEL"
EOF

PIDS=()
# start NAME ROLE ARGS...: runs `kvpool run --role ROLE ARGS`, waits (60 s
# at most) for its "kvpool ROLE listening on ADDR" line, sets ADDR.
start() {
  local name=$1 role=$2
  shift 2
  local log=$OUT/$name.log
  : >"$log"
  "$BIN" run --role "$role" "$@" >"$log" 2>"$OUT/$name.err" &
  PIDS+=($!)
  local i
  for i in $(seq 600); do
    ADDR=$(sed -n "s/^kvpool $role listening on //p" "$log" | head -1)
    [ -n "$ADDR" ] && return 0
    sleep 0.1
  done
  echo "$name did not start; stderr:" >&2
  cat "$OUT/$name.err" >&2
  return 1
}
stop_all() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT

for round in $(seq "$ROUNDS"); do
  # Rotate which policy goes first.
  read -r -a ps <<<"$POLICIES"
  n=${#ps[@]}
  for k in $(seq 0 $((n - 1))); do
    policy=${ps[$(((k + round - 1) % n))]}
    start pool all --no-serving --listen 127.0.0.1:0 --http 127.0.0.1:0 --shards 1 \
      --segment-size 512MiB
    pool=$ADDR
    start pe0 engine --model builtin:tiny --listen 127.0.0.1:0 --master "$pool" --config "$CFG"
    pe0=$ADDR
    start pe1 engine --model builtin:tiny --listen 127.0.0.1:0 --master "$pool" --config "$CFG"
    pe1=$ADDR
    start de0 engine --model builtin:tiny --listen 127.0.0.1:0 --master "$pool" --config "$CFG"
    de0=$ADDR
    start pp0 prefill-proxy --listen 127.0.0.1:0 --engine "$pe0" --config "$CFG"
    pp0=$ADDR
    start pp1 prefill-proxy --listen 127.0.0.1:0 --engine "$pe1" --config "$CFG"
    pp1=$ADDR
    start dp0 decode-proxy --listen 127.0.0.1:0 --engine "$de0" --config "$CFG"
    dp0=$ADDR
    start cond conductor --listen 127.0.0.1:0 --prefill "$pp0,$pp1" --decode "$dp0" \
      --master "$pool" --config "$CFG" --policy "$policy" \
      --decision-log "$OUT/decisions-$policy-$round.jsonl"
    # Ready means every proxy has reported its engine.
    front=$ADDR
    "$BIN" bench serve --front "$front" --trace "$TRACE" --block-tokens 16 --speed "$SPEED" \
      --json --no-progress --per-request "$OUT/requests-$policy-$round.jsonl" |
      jq -c --argjson round "$round" '. + {round: $round}' | tee -a "$OUT/live.jsonl"
    stop_all
  done
done

for policy in $POLICIES; do
  "$BIN" sim --trace "$TRACE" --model "$MODEL" --policy "$policy" --prefill 2 --decode 1 \
    --speed "$SPEED" --no-progress --json | jq -c . | tee -a "$OUT/sim.jsonl"
done
