#!/usr/bin/env bash
# Download, where the package registry is reachable, every wheel benchmarks/gpu/run.sh installs
# on a CUDA machine without network: manylinux x86_64, CPython 3.12, into .whl/ at the
# repository root (git-ignored; copy it to the GPU machine with the checkout).
#
#   bash benchmarks/gpu/download_wheels.sh [PYTHON]      # PYTHON: a venv with `make setup` done
#
# The list is the dependency closure of logitless's `trl` and `bench` extras, of pytest and of
# scripts/install_verl.sh's packages, pinned to the versions installed in PYTHON's environment
# (the versions the test suite ran against), minus torch, triton and NVIDIA's wheels, which the
# GPU machine's Python already has. Each wheel is fetched with --no-deps, so pip never reaches
# for a torch of its own.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${1:-$ROOT/.venv/bin/python}
DEST=$ROOT/.whl
mkdir -p "$DEST"

# scripts/install_verl.sh's package names (comments stripped, pins dropped).
VERL=$(sed -n '/^PACKAGES=(/,/^)/p' "$ROOT/scripts/install_verl.sh" | sed -e '1d;$d' -e 's/#.*//' \
       | tr -s ' \n' '\n' | sed 's/==.*//' | grep -v '^$')

PINS=$("$PY" - "$ROOT/pyproject.toml" $VERL <<'PYEOF'
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

# scripts/install_verl.sh installs its list with --no-deps: those are taken as they are.
pyproject, flat = sys.argv[1], sys.argv[2:]
with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
roots = [*project["dependencies"], *project["optional-dependencies"]["trl"],
         *project["optional-dependencies"]["bench"], "pytest", "setuptools"]
# The GPU machine's Python (3.12, Linux x86_64) evaluates the markers.
env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
skip = re.compile(r"^(torch|triton|nvidia-.*|pytorch-triton.*)$")
seen, todo = {}, [Requirement(r) for r in roots]
for name in flat:
    try:
        seen[re.sub(r"[-_.]+", "-", name).lower()] = distribution(name).version
    except PackageNotFoundError:
        print(f"# not installed here, skipped: {name}", file=sys.stderr)
while todo:
    req = todo.pop()
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if skip.match(name) or name in seen or (req.marker and not req.marker.evaluate(env)):
        continue
    try:
        dist = distribution(req.name)
    except PackageNotFoundError:
        print(f"# not installed here, skipped: {req}", file=sys.stderr)
        continue
    seen[name] = dist.version
    for extra in req.extras:
        env_extra = dict(env, extra=extra)
        todo += [r for r in map(Requirement, dist.requires or [])
                 if r.marker and r.marker.evaluate(env_extra) and not r.marker.evaluate(env)]
    todo += [r for r in map(Requirement, dist.requires or [])
             if not r.marker or r.marker.evaluate(env)]
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PYEOF
)

echo "downloading $(echo "$PINS" | wc -l) wheels into $DEST"
FAILED=()
for pin in $PINS; do
  if ! "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 \
      --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
      -d "$DEST" "$pin"; then
    FAILED+=("$pin")
  fi
done
if ((${#FAILED[@]})); then
  echo "no manylinux/cp312 wheel for: ${FAILED[*]} (run.sh carries on without them;" \
       "the bench lists a provider whose package is missing as unavailable)" >&2
fi
ls "$DEST" | wc -l | xargs echo "wheels in $DEST:"
