#!/bin/bash
# rdma-compare.sh BENCH_BINARY
#
# Runs kvpool's rdma_bw bench (full mode) and perftest's ib_write_bw /
# ib_read_bw on the same RDMA device in the same machine, and prints the
# MB/s of each and their ratio. Meant to run where the device is: inside the
# soft-RoCE guest (../shared/tools/rxe-vm/run.sh) or directly
# on a host with a NIC.
#
# Settings: RDMA_DEVICE (rxe0), RDMA_GID_INDEX (1: the guest's RoCE v2
# IPv4-mapped GID), RDMA_BENCH_MIB (128 MiB moved per case).
set -u
BENCH=${1:?usage: rdma-compare.sh BENCH_BINARY}
DEV=${RDMA_DEVICE:-rxe0}
GID=${RDMA_GID_INDEX:-1}
MIB=${RDMA_BENCH_MIB:-128}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

echo "== machine: $(nproc) cpus, $(uname -r), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "== kvpool rdma_bw"
"$BENCH" --bench | tee "$OUT/kvpool.txt" || { echo "rdma_bw failed" >&2; exit 1; }

# Waits (bounded) for a TCP listener on $1.
wait_port() {
  for _ in $(seq 1 200); do
    if ss -ltn 2>/dev/null | grep -q ":$1 "; then return 0; fi
    sleep 0.05
  done
  return 1
}

echo "== perftest (one QP, about 4 MiB in flight, like the kvpool rows)"
port=18515
for op in write read; do
  for size in 65536 1048576 16777216; do
    iters=$(( MIB * 1048576 / size )); [ "$iters" -lt 8 ] && iters=8
    depth=$(( 4194304 / size )); [ "$depth" -lt 2 ] && depth=2; [ "$depth" -gt 64 ] && depth=64
    port=$((port + 1))
    args=(-d "$DEV" -x "$GID" -s "$size" -n "$iters" -t "$depth" -F -p "$port")
    "ib_${op}_bw" "${args[@]}" > "$OUT/server.txt" 2>&1 &
    srv=$!
    if ! wait_port "$port"; then echo "ib_${op}_bw server did not listen" >&2; kill "$srv"; exit 1; fi
    "ib_${op}_bw" "${args[@]}" 127.0.0.1 > "$OUT/client.txt" 2>&1
    rc=$?
    wait "$srv"
    if [ $rc -ne 0 ]; then echo "ib_${op}_bw -s $size failed:" >&2; cat "$OUT/client.txt" >&2; exit 1; fi
    # The result row: bytes iterations peak average msg-rate.
    avg=$(awk -v s="$size" '$1 == s && NF >= 5 { print $4 }' "$OUT/client.txt" | tail -1)
    echo "ib_${op}_bw size $size depth $depth iters $iters: average ${avg} MB/s"
    echo "RESULT perftest $op 1 $size $avg" >> "$OUT/kvpool.txt"
  done
done

echo "== ratio kvpool / perftest (same device, same run)"
printf '%-6s %9s %14s %14s %14s %9s\n' op size "kvpool_1lane" "kvpool_2lanes" "perftest" "ratio_1"
for op in write read; do
  for size in 65536 1048576 16777216; do
    k1=$(awk -v o="$op" -v s="$size" '$1=="RESULT" && $2=="kvpool" && $3==o && $4==1 && $5==s {print $6}' "$OUT/kvpool.txt")
    k2=$(awk -v o="$op" -v s="$size" '$1=="RESULT" && $2=="kvpool" && $3==o && $4==2 && $5==s {print $6}' "$OUT/kvpool.txt")
    p=$(awk -v o="$op" -v s="$size" '$1=="RESULT" && $2=="perftest" && $3==o && $5==s {print $6}' "$OUT/kvpool.txt")
    r=$(awk -v a="$k1" -v b="$p" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }')
    printf '%-6s %9s %14s %14s %14s %9s\n' "$op" "$size" "$k1" "$k2" "$p" "$r"
  done
done
