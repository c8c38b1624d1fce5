#!/usr/bin/env bash
# The torch.distributed backend "gradsync" on CUDA tensors, against Gloo, on a machine with a GPU
# and torch (no network needed): DDP and FSDP2 train the same model on both backends, 2 ranks,
# several steps, and the losses must agree within 1e-5; collectives on CUDA tensors must give the
# expected values (scripts/gpu_check.py). Prints a PASS/FAIL table.
#
#   bash scripts/gpu-check.sh [WHEEL | DIR] [-- gpu_check.py options]
#
# The gradsync wheel is the one given, or the newest gradsync-*.whl in DIR, else in
# target/wheels or dist/ of the repository (build it elsewhere with
# `cd crates/gradsync-py && maturin build --release`). It is installed into a temporary
# directory, never into the Python environment. PYTHON picks the interpreter (default python3),
# which must have torch.
#
# After a check that passed, scripts/gpu_bench.py times all-reduce, all-gather and reduce-scatter
# on CUDA tensors against Gloo and against gradsync on CPU tensors (GPU_BENCH=0 skips it).
#
# Exit status: 0 every check passed (and the timings ran); 1 a check or a timing run failed;
# 2 no torch or no wheel; 3 no CUDA GPU (nothing was checked).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
py="${PYTHON:-python3}"

given=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
    given="$1"
    shift
fi
[ "${1:-}" = "--" ] && shift

if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "gpu-check: $py cannot import torch" >&2
    exit 2
fi
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False): nothing was checked"
    exit 3
fi

find_wheel() {
    ls -t "$1"/gradsync-*.whl 2>/dev/null | head -n 1
}
wheel=""
if [ -n "$given" ] && [ -f "$given" ]; then
    wheel="$given"
elif [ -n "$given" ]; then
    wheel="$(find_wheel "$given")"
else
    for d in "$root/target/wheels" "$root/dist"; do
        wheel="$(find_wheel "$d")"
        [ -n "$wheel" ] && break
    done
fi
if [ -z "$wheel" ]; then
    echo "gpu-check: no gradsync wheel ${given:+in $given }(give a wheel or a directory holding gradsync-*.whl)" >&2
    exit 2
fi

site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
echo "gpu-check: installing $wheel into $site"
"$py" -m pip install --quiet --no-index --no-deps --target "$site" "$wheel"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
set +e
"$py" "$here/gpu_check.py" "$@"
status=$?
if [ $status -eq 0 ] && [ "${GPU_BENCH:-1}" != "0" ]; then
    "$py" "$here/gpu_bench.py"
    status=$?
fi
set -e
exit $status
