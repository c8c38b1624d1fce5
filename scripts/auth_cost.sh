#!/usr/bin/env bash
# Cost of authentication when healthy: the same 2-rank bench with a job token (as
# `gradsync launch` sets one) and without (ranks started by hand, no GRADSYNC_TOKEN), alternating,
# REPS times. Prints out-of-place / in-place busbw at 64 MiB and the 8 B time of each run, then
# the medians. Checksums stay off (the default).
#   bash scripts/auth_cost.sh [REPS]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/gradsync
REPS=${1:-5}
[ -x "$BIN" ] || cargo build --release -p gradsync-cli
args=(bench all_reduce -w 2 -c 1)
row() { grep -v '^#' | awk '{print $8, $12, $6}'; }
manual() { # world=2, no token
    local port=$((30000 + RANDOM % 20000)) out
    out=$(mktemp)
    for r in 0 1; do
        env -u GRADSYNC_TOKEN RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            "$BIN" "${args[@]}" "$@" > "$out.$r" 2>/dev/null &
    done
    wait
    row < "$out.0"
    rm -f "$out" "$out.0" "$out.1"
}
on=(); off=()
for i in $(seq "$REPS"); do
    a=$(GRADSYNC_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n') "$BIN" launch --nproc 2 --no-prefix -- "$BIN" "${args[@]}" -b 64M -e 64M -n 10 | row)
    b=$(manual -b 64M -e 64M -n 10)
    c=$(GRADSYNC_TOKEN=x"$i" "$BIN" launch --nproc 2 --no-prefix -- "$BIN" "${args[@]}" -b 8 -e 8 -n 5000 | row)
    d=$(manual -b 8 -e 8 -n 5000)
    echo "rep $i  token: busbw ${a% *} | 8B $(echo "$c" | awk '{print $3}') us   no token: busbw ${b% *} | 8B $(echo "$d" | awk '{print $3}') us"
    on+=("$(echo "$a" | awk '{print $1}') $(echo "$a" | awk '{print $2}') $(echo "$c" | awk '{print $3}')")
    off+=("$(echo "$b" | awk '{print $1}') $(echo "$b" | awk '{print $2}') $(echo "$d" | awk '{print $3}')")
done
med() { sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
for k in 1 2 3; do
    name=$(echo "busbw-out-of-place busbw-in-place 8B-us" | cut -d' ' -f$k)
    x=$(printf '%s\n' "${on[@]}" | awk -v k=$k '{print $k}' | med)
    y=$(printf '%s\n' "${off[@]}" | awk -v k=$k '{print $k}' | med)
    echo "median $name: token $x, no token $y, ratio $(awk -v x="$x" -v y="$y" 'BEGIN{printf "%.3f", x/y}')"
done
