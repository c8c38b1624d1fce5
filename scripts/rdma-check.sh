#!/usr/bin/env bash
# The rdma transport on the kernel's real RDMA stack: builds gradsync with the `rdma` feature as
# static programs, then, in Soft-RoCE VMs (scripts/rdma-vm.sh):
#   1. one VM: the rdma unit tests of gradsync-transport (device tests included: writes with
#      immediate, sends, a wrong remote key, the registration pool, RLIMIT_MEMLOCK), the
#      conformance suites over rdma, the split suites (children of an rdma communicator, formed
#      over it), `gradsync doctor`, and the benchmark: gradsync's 2-rank
#      all-reduce busbw beside `ib_write_bw` on the same device in the same boot;
#   2. two VMs joined by a virtual wire: a 2-rank all-reduce across them (RoCE v2 packets on the
#      wire), `gradsync bench -c 1` over every dtype, which fails on any wrong element.
# Usage (root, Debian 12): scripts/rdma-check.sh [single|two-vm|all]   (default all)
# RDMA_CHECK_REPS: benchmark repetitions (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
export DEBIAN_FRONTEND=noninteractive
start=$(date +%s)
step() { echo "=== rdma-check: $* ($(( $(date +%s) - start )) s)"; }

step "build packages"
need=""
for p in gcc pkg-config libibverbs-dev libnl-3-dev libnl-route-3-dev; do
    dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"
done
if [ -n "$need" ]; then
    apt-get update -o DPkg::Lock::Timeout=600 >/dev/null
    # shellcheck disable=SC2086
    apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=600 $need >/dev/null
fi

step "static build with the rdma feature"
target=x86_64-unknown-linux-gnu
export RUSTFLAGS="-C target-feature=+crt-static"
exe() {  # cargo args...: prints the test executables built
    cargo "$@" --locked --features rdma --target "$target" --message-format=json |
        python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])'
}
bin=$(mktemp -d /tmp/gradsync-rdma-bin.XXXXXX)
trap 'rm -rf "$bin"' EXIT
cp "$(exe test --no-run -p gradsync-transport --lib | tail -1)" "$bin/gs-transport-tests"
cp "$(exe test --no-run -p gradsync --test conformance | tail -1)" "$bin/gs-conformance"
cp "$(exe test --no-run -p gradsync --test split | tail -1)" "$bin/gs-split"
cargo build --release --locked --features rdma --target "$target" -p gradsync-cli
cp "target/$target/release/gradsync" "$bin/gradsync"
unset RUSTFLAGS
for b in "$bin"/*; do
    ldd "$b" 2>&1 | grep -qE "not a dynamic|statically linked" ||
        { echo "rdma-check: $b is not static"; exit 1; }
done
export RDMAVM_BINS="$bin/gs-transport-tests $bin/gs-conformance $bin/gs-split $bin/gradsync"

step "fallback on this host (no RDMA here; GRADSYNC_IB_HCA names a device no host has): two ranks as two hosts"
# auto: a WARN naming the cause, then the job runs over tcp; GRADSYNC_TRANSPORT=rdma: an error.
fallback() {  # transport port: runs the 2 ranks, leaves their output in $bin/fb-RANK.txt
    local pids=() r rc=0
    for r in 0 1; do
        RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$2 GRADSYNC_HOST_ID=fallback-$r \
            GRADSYNC_IB_HCA=nosuchdev0 GRADSYNC_TRANSPORT=$1 GRADSYNC_TIMEOUT=20 \
            timeout 60 "$bin/gradsync" bench all_reduce -b 8 -e 64K -f 8 -n 2 -w 1 -c 1 \
            >"$bin/fb-$r.txt" 2>&1 &
        pids+=($!)
    done
    for r in "${pids[@]}"; do wait "$r" || rc=1; done
    return $rc
}
fallback auto 29613 || { cat "$bin"/fb-*.txt; echo "rdma-check: auto fallback failed"; exit 1; }
for r in 0 1; do
    grep -q "WARN.*rank $r: RDMA setup failed, falling back to tcp.*rdma device" "$bin/fb-$r.txt" ||
        { cat "$bin/fb-$r.txt"; echo "rdma-check: rank $r did not warn of the fallback"; exit 1; }
done
if fallback rdma 29614; then
    cat "$bin"/fb-*.txt; echo "rdma-check: GRADSYNC_TRANSPORT=rdma without a device succeeded"; exit 1
fi
grep -q "GRADSYNC_TRANSPORT=rdma.*rdma device" "$bin/fb-0.txt" ||
    { cat "$bin/fb-0.txt"; echo "rdma-check: the forced rdma error does not name the cause"; exit 1; }
grep -h "falling back\|GRADSYNC_TRANSPORT=rdma" "$bin"/fb-*.txt | head -4

reps=${RDMA_CHECK_REPS:-3}
# The single VM runs about 5 minutes of emulated work; leave room for a slower machine.
export RDMAVM_TIMEOUT=${RDMAVM_TIMEOUT:-1200}
if [ "$mode" = single ] || [ "$mode" = all ]; then
    step "one VM: tests, conformance, doctor, benchmark"
    # shellcheck disable=SC2016
    RDMAVM_SINGLE_CMD='set -e
export GRADSYNC_TRANSPORT=rdma
gs-transport-tests rdma:: --test-threads=1
gs-conformance rdma_ --test-threads=1
gs-split rdma_ --test-threads=1
gradsync doctor --nproc 2 --size 1M --iters 2 --lat-iters 50
gradsync bench --nproc 2 all_reduce -b 8 -e 8M -f 8 -c 1 -d all -n 2 -w 1
echo "== benchmark: 2-rank all-reduce (4 MiB, f32 sum, busbw from the time column) against ib_write_bw (1 MiB RDMA writes, average; one direction, and both directions at once as the all-reduce runs, per direction), alternating"
ibw() {  # extra flags: prints the client average in Gb/s
  ib_write_bw -d rxe0 -x $RDMAVM_GID_INDEX -F -s 1048576 -n 200 --report_gbits "$@" >/tmp/srv.txt 2>&1 &
  retry -s 0.2 ib_write_bw -d rxe0 -x $RDMAVM_GID_INDEX -F -s 1048576 -n 200 --report_gbits "$@" $RDMAVM_IP >/tmp/cli.txt 2>&1
  wait
  awk "\$1 == 1048576 {print \$4}" /tmp/cli.txt
}
for i in $(seq '"$reps"'); do
  ib=$(ibw)
  bi=$(ibw -b)
  gradsync bench --nproc 2 all_reduce -b 4M -e 4M -n 10 -w 2 >/tmp/gs.txt 2>&1
  us=$(awk "/^ +4194304/ {print \$6}" /tmp/gs.txt)
  gs=$(awk -v t=$us "BEGIN{printf \"%.3f\", 4194304 * 8 / (t * 1000)}")
  r=$(awk -v g=$gs -v i=$ib "BEGIN{printf \"%.3f\", g / i}")
  rb=$(awk -v g=$gs -v i=$bi "BEGIN{printf \"%.3f\", g / (i / 2)}")
  echo "RDMA-BENCH rep $i: ib_write_bw $ib Gb/s one way, $bi Gb/s both ways; gradsync busbw $gs Gb/s ($us us per call); ratio $r to one way, $rb to both ways per direction"
  echo $r >>/tmp/ratios
  echo $rb >>/tmp/ratios_bi
done
med() { sort -n "$1" | awk "{v[NR]=\$1} END{print v[int((NR+1)/2)]}"; }
echo "RDMA-BENCH median of $(wc -l </tmp/ratios) reps: ratio $(med /tmp/ratios) to one way, $(med /tmp/ratios_bi) to both ways per direction"'
    export RDMAVM_SINGLE_CMD
    scripts/rdma-vm.sh single
fi

if [ "$mode" = two-vm ] || [ "$mode" = all ]; then
    step "two VMs: 2-rank all-reduce across the wire"
    run='GRADSYNC_TRANSPORT=rdma GRADSYNC_SOCKET_IFNAME=eth0 gradsync launch --nnodes 2 --nproc 1 --master 10.77.0.1:29500'
    bench='gradsync bench all_reduce -b 8 -e 1M -f 8 -c 1 -d all -n 2 -w 1'
    RDMAVM_SERVER_CMD="$run --node-rank 0 -- $bench && rdma statistic show link rxe0/1"
    RDMAVM_CLIENT_CMD="$run --node-rank 1 -- $bench && rdma statistic show link rxe0/1"
    export RDMAVM_SERVER_CMD RDMAVM_CLIENT_CMD
    scripts/rdma-vm.sh two-vm
fi
step "done"
