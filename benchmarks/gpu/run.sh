#!/usr/bin/env bash
# The one device script: on a CUDA machine without network whose Python already has torch and
# triton (e.g. an H200 with torch 2.11, triton 3.6, Python 3.12), install the other dependencies
# from .whl/ (see download_wheels.sh), run `logitless check` on CUDA, then the bench sweeps, and
# write JSON + PNG into OUTDIR. Budget: under 8 minutes on an H200 (each step has a timeout and
# the script carries on past a step that fails, so one bad provider cannot cost the rest).
#
#   bash benchmarks/gpu/run.sh OUTDIR            # on the GPU machine, from the checkout
#   bash benchmarks/gpu/run.sh OUTDIR --dry-run  # anywhere: CPU, tiny shapes, nothing installed
#
# Outputs: OUTDIR/<date>-<device>-<sweep>.{json,png}, all records together in
# OUTDIR/<date>-<device>.json, and the logs. See benchmarks/gpu/README.md.
set -uo pipefail

OUT=${1:?usage: run.sh OUTDIR [--dry-run]}
DRY=0
[[ "${2:-}" == "--dry-run" ]] && DRY=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
[[ $DRY == 1 && -x "$ROOT/.venv/bin/python" && -z "${PYTHON:-}" ]] && PY=$ROOT/.venv/bin/python
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
# logitless runs from the checkout: no build step, nothing to install for it.
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
STATUS=0
START=$SECONDS

step() {  # step NAME TIMEOUT_S CMD...: run, log, time, never abort the script
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, at $((SECONDS - START))s)"
  if [[ $DRY == 1 ]]; then limit=300; fi
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - START))s"
  ((rc == 0)) || STATUS=1
}

install() {
  if [[ $DRY == 1 ]]; then
    echo "dry run: would install from $ROOT/.whl: the trl and bench extras, pytest, verl"
    return 0
  fi
  if [[ ! -d "$ROOT/.whl" ]]; then
    echo "no $ROOT/.whl: run benchmarks/gpu/download_wheels.sh where the registry is reachable"
    return 1
  fi
  local pip=("$PY" -m pip install --disable-pip-version-check -q --no-index
             --find-links "$ROOT/.whl")
  # Resolved against what is installed: torch and triton stay as they are (the extras only ask
  # torch>=2.4, triton>=3.0). One group failing leaves the others' providers usable.
  "${pip[@]}" numpy tqdm matplotlib pytest || echo "warning: base packages incomplete"
  "${pip[@]}" "trl>=1.16,<1.17" transformers accelerate || echo "warning: trl not installed"
  "${pip[@]}" liger-kernel || echo "warning: liger-kernel not installed"
  "${pip[@]}" cut-cross-entropy || echo "warning: cut-cross-entropy not installed"
  PIP_NO_INDEX=1 PIP_FIND_LINKS="$ROOT/.whl" bash scripts/install_verl.sh "$PY" \
    || echo "warning: verl not installed"
  "$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
}

if [[ $DRY == 1 ]]; then
  DEVICE=cpu
  SLUG=dry-run
  # In-process and tiny: the dry run checks the script's plumbing, not performance.
  BENCH=(--device cpu --no-isolate --no-progress --warmup 0 --repeats 1 --block-rows 8)
  BIG=(--tokens 64 --hidden 32 --vocab 500)
  SMALL=(--tokens 32 --hidden 32 --vocab 500)
  ATTN=(--seq 32 --heads 2 --head-dim 16)
  PROVIDERS=(--providers logitless,naive,gemm)
  POLICY_PROVIDERS=(--providers logitless-fused,logitless,naive,gemm)
else
  DEVICE=cuda
  SLUG=""
  BENCH=(--device cuda --no-progress)
  BIG=(--tokens 16384 --hidden 4096 --vocab 151936)
  SMALL=(--preset qwen-small)
  ATTN=(--preset attn-small)
  PROVIDERS=()
  POLICY_PROVIDERS=()
fi

echo "== install"
install 2>&1 | tee "$OUT/install.log"
((PIPESTATUS[0] == 0)) || STATUS=1
if [[ -z "$SLUG" ]]; then
  SLUG=$("$PY" -c "import torch; print(torch.cuda.get_device_name().lower())" 2>/dev/null \
         | sed -E 's/^nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
  SLUG=${SLUG:-cuda}
fi
DATE=$(date -u +%Y-%m-%d)
TAG="$DATE-$SLUG"

if [[ $DRY == 1 ]]; then
  echo "dry run: skipping 'logitless check' (it runs every op on every device present)"
else
  step check 90 "$PY" -m logitless.tools.cli check
fi

bench() {  # bench NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$PY" -m logitless.tools.cli bench "${BENCH[@]}" "$@" \
    --json "$OUT/$TAG-$name.json" --plot "$OUT/$TAG-$name.png"
}

bench logprobs-16k 100 --op logprobs --dtype bfloat16 --mode fwd-bwd "${BIG[@]}" "${PROVIDERS[@]}"
bench policy-loss-16k 80 --op policy-loss --dtype bfloat16 --mode fwd-bwd "${BIG[@]}" \
  "${POLICY_PROVIDERS[@]}"
bench logprobs-sweep 80 --op logprobs --dtype bfloat16 --mode both "${SMALL[@]}" \
  "${PROVIDERS[@]}"
bench attention-entropy 30 --op attention-entropy --dtype bfloat16 --mode fwd "${ATTN[@]}"

# Every record of this run in one file: benchmarks/results/<date>-<device>.json.
"$PY" - "$OUT" "$TAG" <<'PYEOF'
import json
import pathlib
import sys

out, tag = pathlib.Path(sys.argv[1]), sys.argv[2]
records = []
for path in sorted(out.glob(f"{tag}-*.json")):
    for r in json.loads(path.read_text()):
        r["sweep"] = path.stem[len(tag) + 1:]
        records.append(r)
(out / f"{tag}.json").write_text(json.dumps(records, indent=1) + "\n")
print(f"{len(records)} records in {out / f'{tag}.json'}")
PYEOF
echo "done in $((SECONDS - START))s, exit $STATUS; results in $OUT"
exit $STATUS
