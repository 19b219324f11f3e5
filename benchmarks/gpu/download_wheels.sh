#!/usr/bin/env bash
# Download, where the package registry is reachable, the wheels benchmarks/gpu/run.sh installs
# on the GPU machine (no network there): manylinux x86_64, CPython 3.12, into .whl/ at the
# repository root (git-ignored; a device call carries it with the checkout).
#
#   bash benchmarks/gpu/download_wheels.sh [--list] [PYTHON]
#
#   --list   print the plan (group, pinned wheel) and fetch nothing
#   PYTHON   a venv with `make setup` done (default .venv/bin/python): versions are its own
#
# Only what the GPU machine lacks is fetched: benchmarks/gpu/device_packages.txt lists what its
# image already has (torch, triton, transformers, accelerate, peft, pandas, pyarrow,
# matplotlib, tqdm, pytest, ...). wheel_plan.py groups the rest: base, then one group per peer
# (trl, liger, cce, verl). A group is kept whole or left out whole, in that order, so that the
# wheels total at most WHEEL_BUDGET_MIB (default 56: a device call carries 64 MiB with the
# checkout). verl's group does not fit (ray alone is ~70 MB): it is left out and the GPU run
# lists verl as unavailable. .whl/PLAN.txt records what was kept and what was left out.
set -euo pipefail

LIST=0
if [[ "${1:-}" == "--list" ]]; then LIST=1; shift; fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${1:-$ROOT/.venv/bin/python}
DEST=$ROOT/.whl
BUDGET=$(( ${WHEEL_BUDGET_MIB:-56} * 1024 * 1024 ))

PLAN=$("$PY" "$ROOT/benchmarks/gpu/wheel_plan.py")
if ((LIST)); then
  echo "$PLAN"
  exit 0
fi

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two of one package stop the whole install
TMP=$(mktemp -d "$DEST/.group.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
TOTAL=0
REPORT=$(printf '%-6s %6s %5s  %s' group wheels MiB kept)
for group in $(echo "$PLAN" | awk '{print $1}' | uniq); do
  rm -f "$TMP"/*
  missing=""
  for pin in $(echo "$PLAN" | awk -v g="$group" '$1 == g {print $2}'); do
    if ! "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_34_x86_64 --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none -d "$TMP" "$pin"; then
      echo "no manylinux/cp312 wheel for $pin" >&2
      missing+=" ${pin%%==*}"
    fi
  done
  size=$(cat "$TMP"/*.whl 2>/dev/null | wc -c)
  count=$(ls "$TMP" | wc -l)
  mib=$(( (size + 1048575) / 1048576 ))
  why=""
  ((TOTAL + size > BUDGET)) && why="over the $((BUDGET / 1048576)) MiB budget"
  [[ -n "$missing" ]] && why="${why:+$why; }no wheel for$missing"
  if [[ -n "$why" ]]; then
    REPORT+=$'\n'$(printf '%-6s %6s %5s  %s' "$group" "$count" "$mib" "no: $why")
  else
    mv "$TMP"/*.whl "$DEST"/
    TOTAL=$((TOTAL + size))
    REPORT+=$'\n'$(printf '%-6s %6s %5s  %s' "$group" "$count" "$mib" yes)
  fi
done
{
  echo "$REPORT"
  echo "total: $(( (TOTAL + 1048575) / 1048576 )) MiB in $(find "$DEST" -maxdepth 1 -type f -name '*.whl' \
       | wc -l) wheels"
} | tee "$DEST/PLAN.txt"
