#!/usr/bin/env bash
# The verl extra's install recipe, run as written in a fresh venv: torch first (the CPU build
# where there is no CUDA), then `pip install -e ".[verl]"` from this checkout, then `pip check`,
# then the registered losses through verl's own registry.
#
#   bash scripts/check_verl_extra.sh [VENV]      # default /tmp/logitless-verl-venv (replaced)
set -euo pipefail

VENV=${1:-/tmp/logitless-verl-venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if command -v nvidia-smi >/dev/null 2>&1; then "${PIP[@]}" install torch
else "${PIP[@]}" install torch==2.13.0; fi
"${PIP[@]}" install -e "$ROOT[verl]"
"$VENV/bin/python" -m pip check
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version

from verl.trainer.ppo import core_algos

import logitless.integrations.verl  # noqa: F401 (registers the losses)

core_algos.get_policy_loss_fn("logitless_grpo")
print("verl", version("verl"), "transformers", version("transformers"), "torch",
      version("torch"), ": pip check clean, logitless_grpo registered")
PY
