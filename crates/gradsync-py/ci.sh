#!/usr/bin/env bash
# Builds the Python package `gradsync` (this crate, with maturin), installs it into a virtual
# environment and runs the Python tests.
#
#   bash crates/gradsync-py/ci.sh [VENV]        VENV defaults to /opt/gradsync-venv
#
# A VENV that does not exist is created with `python3 -m venv`; torch, numpy, maturin and
# pytest are installed into it with pip when it lacks them (PyPI's torch for x86-64 is the CUDA
# build, several GB; it runs on CPU). Extra arguments after VENV go to pytest.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-/opt/gradsync-venv}"
shift || true
start=$(date +%s)
step() { echo "=== gradsync-py: $* ($(( $(date +%s) - start )) s)"; }

step "virtual environment $venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
missing=()
for m in numpy torch maturin pytest; do
    "$py" -c "import $m" >/dev/null 2>&1 || missing+=("$m")
done
if [ ${#missing[@]} -gt 0 ]; then
    step "pip install ${missing[*]}"
    "$py" -m pip install --quiet --upgrade pip
    "$py" -m pip install --quiet "${missing[@]}"
fi

step "maturin build --release"
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
(cd "$here" && maturin build --release --locked --interpreter "$py" --out "$wheels")
"$py" -m pip install --quiet --force-reinstall --no-deps "$wheels"/gradsync-*.whl

step "pytest"
cd "$root"
"$py" -m pytest -q crates/gradsync-py/tests "$@"
step "done"
