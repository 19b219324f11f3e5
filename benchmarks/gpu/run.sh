#!/usr/bin/env bash
# The one device script: on a CUDA machine without network whose Python already has torch and
# triton (e.g. the lent H200: torch 2.11, triton 3.6, Python 3.12), install the missing peers
# from .whl/ (download_wheels.sh), run `logitless check` first (its rows printed as each case
# finishes, each case's error in its own row), then the bench sweeps with the GEMM floor first
# in each, and print a short summary table last. Under 8 minutes in all: each step has a time
# limit, capped by what is left of the script's budget, and the script carries on past a step
# that fails, so one bad provider cannot cost the rest.
#
#   bash benchmarks/gpu/run.sh OUTDIR            # on the GPU machine, from the checkout
#   bash benchmarks/gpu/run.sh OUTDIR --quick    # the same, check and two sweeps: under 4 min
#   bash benchmarks/gpu/run.sh OUTDIR --dry-run  # anywhere: CPU, tiny shapes, nothing installed,
#                                                # the sweeps in one process
#
# Outputs: OUTDIR/<date>-<device>-<sweep>.{json,png}, all records together in
# OUTDIR/<date>-<device>.json, a log per step. See benchmarks/gpu/README.md.
set -uo pipefail

OUT=${1:?usage: run.sh OUTDIR [--dry-run|--quick]}
DRY=0
QUICK=0
[[ "${2:-}" == "--dry-run" ]] && DRY=1
[[ "${2:-}" == "--quick" ]] && QUICK=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
[[ $DRY == 1 && -x "$ROOT/.venv/bin/python" && -z "${PYTHON:-}" ]] && PY=$ROOT/.venv/bin/python
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
# logitless runs from the checkout: no build step, nothing to install for it.
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
BUDGET_S=${RUN_BUDGET_S:-460}  # the whole script, install included: under 8 minutes
[[ $QUICK == 1 ]] && BUDGET_S=${RUN_BUDGET_S:-220}  # --quick: under 4 minutes
# The dry run checks the plumbing on whatever CPU runs it (a loaded CI machine too): each step
# gets 300 s, and the budget is not the GPU's.
[[ $DRY == 1 ]] && BUDGET_S=${RUN_BUDGET_S:-1500}
STATUS=0
START=$SECONDS

step() {  # step NAME TIMEOUT_S CMD...: run, log, time, never abort the script
  local name=$1 limit=$2 left
  shift 2
  [[ $DRY == 1 ]] && limit=300
  left=$((BUDGET_S - (SECONDS - START)))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    echo "== $name: skipped, the ${BUDGET_S}s budget is spent"
    STATUS=1
    return
  fi
  echo "== $name (limit ${limit}s, at $((SECONDS - START))s)"
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - START))s"
  ((rc == 0)) || STATUS=1
}

SITE=${WHEEL_SITE:-/tmp/logitless-site}
install() {
  local wheels=("$ROOT"/.whl/*.whl)
  if [[ ! -e "${wheels[0]}" ]]; then
    echo "no wheels in $ROOT/.whl (benchmarks/gpu/download_wheels.sh): the peers that are not" \
         "on this machine will be listed as unavailable"
    return 0
  fi
  if [[ $DRY == 1 ]]; then
    echo "dry run: would install ${#wheels[@]} wheels from $ROOT/.whl into $SITE"
    return 0
  fi
  # --no-deps into a folder of its own: the machine's torch, triton and transformers stay as
  # they are; download_wheels.sh fetched the closure of what is missing, nothing else.
  timeout 90 "$PY" -m pip install --disable-pip-version-check -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" || return 1
  rm -rf "$SITE/tests"  # verl's wheel ships its test suite as a top-level `tests` package
}

echo "== install (at 0s)"
install 2>&1 | tee "$OUT/install.log"
((PIPESTATUS[0] == 0)) || STATUS=1
[[ -d "$SITE" && $DRY == 0 ]] && export PYTHONPATH="$PYTHONPATH:$SITE"
echo "== install: done after $((SECONDS - START))s"

if [[ $DRY == 1 ]]; then
  SLUG=dry-run
  # In-process and tiny: the dry run checks the script's plumbing, not performance.
  BENCH=(--device cpu --no-isolate --no-progress --warmup 1 --repeats 1 --block-rows 8)
  BIG=(--tokens 64 --hidden 32 --vocab 500)
  BIG_BLOCK=(--block-rows 8)  # the tests bound bf16 errors on 8 rows
  SMALL=(--tokens 32 --hidden 32 --vocab 500)
  ATTN=(--seq 32 --heads 2 --head-dim 16)
  PROVIDERS=(--providers gemm,logitless,naive,torch)
  POLICY_PROVIDERS=(--providers gemm,logitless-fused,logitless,naive)
  MID=(--tokens 48 --hidden 32 --vocab 500)
  DIV_PROVIDERS=(--providers gemm,logitless,naive,trl)
  # The smallest shapes that still run every op and case: their content is checked at these
  # shapes by tests/tools/test_check.py (test_every_op_passes_on_the_torch_twins).
  CHECK=(--device cpu --backend torch --dtype float32 --batch 2 --seq-len 9 --hidden 40
         --vocab 300 --attn-seq-len 70)
  CHECK_LIMIT=300
  INVARIANCE=(--device cpu --tokens 195 --hidden 32 --vocab 500 --chunk 64)
  PASSES=(--device cpu --tokens 64 --hidden 32 --vocab 500)
else
  SLUG=$("$PY" -c "import torch; print(torch.cuda.get_device_name().lower())" 2>/dev/null \
         | sed -E 's/^nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
  SLUG=${SLUG:-cuda}
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name())"
  # One warm-up call per row before the memory step and the timing (autotuning, compilation).
  BENCH=(--device cuda --no-progress --warmup 1)
  BIG=(--tokens 16384 --hidden 4096 --vocab 151936)
  # The error column over all 16384 timed rows (the fp64 reference runs 1024 rows at a time).
  BIG_BLOCK=(--block-rows 16384)
  SMALL=(--preset qwen-small)
  ATTN=(--preset attn-small)
  PROVIDERS=(--providers gemm,logitless,naive,torch,trl,liger,cce,verl)
  POLICY_PROVIDERS=(--providers gemm,logitless-fused,logitless,naive,liger)
  MID=(--tokens 4096 --hidden 4096 --vocab 151936)
  DIV_PROVIDERS=(--providers gemm,logitless,naive,trl,liger)
  # The CUDA paths users run (Triton epilogues over cuBLAS tiles), in the dtypes they train in.
  CHECK=(--device cuda --backend triton --dtype bfloat16 float32)
  CHECK_LIMIT=90
  [[ $QUICK == 1 ]] && CHECK=(--device cuda --backend triton --dtype bfloat16) && CHECK_LIMIT=60
  INVARIANCE=(--device cuda)
  PASSES=(--device cuda "${BIG[@]}")
  [[ $QUICK == 1 ]] && PASSES=(--device cuda "${MID[@]}")
fi
TAG="$(date -u +%Y-%m-%d)-$SLUG"

SWEEPS=()  # the dry run's sweeps, as NAME COUNT ARGS... groups for benchmarks/gpu/sweeps.py
bench() {  # bench NAME TIMEOUT_S ARGS...: the GEMM floor is the first provider of every sweep
  local name=$1 limit=$2
  shift 2
  local argv=(bench "${BENCH[@]}" "$@" --json "$OUT/$TAG-$name.json" --plot "$OUT/$TAG-$name.png")
  if [[ $DRY == 1 ]]; then  # queued: the dry run runs its sweeps in one process (below)
    SWEEPS+=("$name" "${#argv[@]}" "${argv[@]}")
    return
  fi
  step "$name" "$limit" "$PY" -m logitless.tools.cli "${argv[@]}"
}

# Every op against the fp64 reference first, with its own limit: its rows stream into the log
# as each case finishes, so even a step cut short by its limit reports what it reached.
step check "$CHECK_LIMIT" "$PY" -m logitless.tools.cli check "${CHECK[@]}"
# A block of rows at other offsets inside the head's 1024-row chunks: bitwise the same.
step invariance 40 "$PY" "$ROOT/benchmarks/gpu/invariance.py" "${INVARIANCE[@]}"
# One call per GPU path under the profiler: device time per pass beside the cost model's.
step passes 40 "$PY" "$ROOT/benchmarks/gpu/passes.py" "${PASSES[@]}" --json "$OUT/passes-$TAG.json"

if [[ $QUICK == 1 ]]; then
  bench logprobs-4k 40 --op logprobs --dtype bfloat16 --mode fwd-bwd "${MID[@]}" \
    --providers gemm,logitless,naive
  bench policy-loss-4k 40 --op policy-loss --dtype bfloat16 --mode fwd-bwd "${MID[@]}" \
    --providers gemm,logitless-fused,naive
  "$PY" "$ROOT/benchmarks/gpu/summary.py" "$OUT" "$TAG"
  echo "done in $((SECONDS - START))s, exit $STATUS; results in $OUT"
  exit $STATUS
fi

bench logprobs-16k 110 --op logprobs --dtype bfloat16 --mode fwd-bwd "${BIG[@]}" \
  "${BIG_BLOCK[@]}" "${PROVIDERS[@]}"
bench policy-loss-16k 80 --op policy-loss --dtype bfloat16 --mode fwd-bwd "${BIG[@]}" \
  "${POLICY_PROVIDERS[@]}"
bench logprobs-sweep 70 --op logprobs --dtype bfloat16 --mode both "${SMALL[@]}" \
  "${PROVIDERS[@]}"
# The two-head divergence (generalized JSD, beta 0.5) and the sampler-matched logprobs at top-p
# 0.9, at 4096 tokens: the materialising providers hold two (one) [N, V] fp32 tensors.
bench divergence-4k 60 --op divergence --dtype bfloat16 --mode fwd-bwd "${MID[@]}" \
  "${DIV_PROVIDERS[@]}"
bench logprobs-topp-4k 50 --op logprobs --dtype bfloat16 --mode fwd-bwd "${MID[@]}" \
  --top-p 0.9 --providers gemm,logitless,naive
bench attention-entropy 30 --op attention-entropy --dtype bfloat16 --mode fwd "${ATTN[@]}" \
  --providers gemm,logitless,naive
# The dry run's sweeps, with the arguments above, one after the other in one process: at its
# tiny shapes, starting Python and importing torch cost more than a sweep.
[[ $DRY == 1 ]] && step sweeps 300 "$PY" "$ROOT/benchmarks/gpu/sweeps.py" "$OUT" "${SWEEPS[@]}"
# All records in OUTDIR/<tag>.json, and the summary table, last.
"$PY" "$ROOT/benchmarks/gpu/summary.py" "$OUT" "$TAG"
echo "done in $((SECONDS - START))s, exit $STATUS; results in $OUT"
exit $STATUS
