#!/usr/bin/env bash
# Install verl 0.9.1 into the venv of the given python, for the verl parity and adapter tests.
#
#   bash scripts/install_verl.sh .venv/bin/python
#
# verl's own requirements pull in vllm-era pins (transformers<5.11, torch==2.11 through its
# extras, ray[default], wandb, tensorboard, ...). The tests only need `import verl`,
# verl.trainer.ppo.core_algos (policy-loss registry, agg_loss, kl_penalty), the rollout
# correction helper, verl.workers.config (PolicyLossConfig, instantiated through hydra) and
# verl.utils.kernel.linear_cross_entropy, so verl goes in with --no-deps followed by the short
# list of what those imports load. Everything is --no-deps: torch and transformers stay as
# they are (torch 2.13.0 CPU, the transformers TRL uses); none of the modules above touch
# transformers' version-specific internals, so verl's transformers pin does not matter here.
# Idempotent: returns at once when every package below is already at its listed version.
set -euo pipefail

PY=${1:?usage: install_verl.sh PYTHON}

# name==version for the pinned ones; a bare name means "any version already there is fine".
PACKAGES=(
  verl==0.9.1
  ray==2.60.0                 # verl.protocol imports ray at `import verl`
  tensordict==0.10.0          # verl pins >=0.8,<=0.10.0
  pyvers                      # tensordict
  omegaconf==2.3.0            # hydra-core 1.3 needs omegaconf<2.4
  antlr4-python3-runtime==4.9.3
  hydra-core==1.3.8           # instantiates `policy_loss._target_`
  codetiming
  cloudpickle msgpack protobuf orjson
  jsonschema jsonschema-specifications referencing rpds-py attrs
  requests urllib3 certifi charset-normalizer
)

if "$PY" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for spec in sys.argv[1:]:
    name, _, wanted = spec.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if wanted and have != wanted:
        sys.exit(1)
EOF
then
  exit 0
fi

"$PY" -m pip install --disable-pip-version-check -q --no-deps "${PACKAGES[@]}"

# The verl wheel also ships a top-level `tests` package; it would shadow any project's own
# `tests` package on sys.path, so remove it (it is verl's test suite, not part of verl).
"$PY" - <<'EOF'
import pathlib
import shutil
import sysconfig

site = pathlib.Path(sysconfig.get_paths()["purelib"])
tests = site / "tests"
if (tests / "trainer" / "ppo" / "test_core_algos_on_cpu.py").exists():
    shutil.rmtree(tests)
EOF

"$PY" -c "import torch, verl.trainer.ppo.core_algos, verl.workers.config, hydra; \
print('verl', verl.__version__, 'torch', torch.__version__)"
