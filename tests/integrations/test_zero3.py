"""DeepSpeed ZeRO-3 through TRL, with DeepSpeed itself: two processes launched by
``torch.distributed.run``, DeepSpeed's CPU accelerator over gloo (``make test-dist`` installs
DeepSpeed into ``.venv-deepspeed`` and runs the ``dist`` tests).

The worker (tests/integrations/zero3_worker.py) trains one saved tiny Qwen2 for two GRPO steps
under one ZeRO-3 config (every parameter partitioned over the two ranks, the trainer's SGD
wrapped by DeepSpeed's ZeRO-3 optimizer) with stock TRL, with ``patch_trl()``, with
logitless's ``GRPOTrainer`` (fused: the head and the loss one ``fused_policy_loss`` call,
whose head gradients, computed in the forward, reach the partitions) and with that trainer's
composed path (``fused=False``), for TRL's default loss and for DAPO with a KL term (a
reference model that DeepSpeed partitions too). The logged losses and metrics of every step
and the updated parameters, gathered from the partitions, must equal stock TRL's.

Tolerances: the heads compute the same fp32 logprobs with different reduction orders (TRL's
4096-column chunks, logitless's tiles), a few ulps per logit; after two steps at learning rate
2 the parameters differ by 3.3e-7 of each tensor's largest entry (measured): 1e-5, the bound
of the one-process parity tests (test_trl_trainer.py), leaves room for other BLAS blockings
and still fails on any gradient that is wrong for one rank's tokens or one partition (those
move parameters by 1e-2 and more here). Losses: 1e-5 relative plus 1e-7 absolute (step 1's
GRPO loss is zero up to rounding, ~1e-8: on-policy, with group-centred advantages).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import logitless

from testing import _free_port
from tiny_models import tiny_qwen2, tiny_tokenizer

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("zero3_worker.py")
RUNS = ("stock", "patch_trl", "grpo_trainer", "composed")
CONFIGS = ("grpo", "dapo_kl")
TIMING_KEYS = ("step_time", "runtime", "_per_second")  # wall-clock metrics


def deepspeed_dir() -> Path:
    """The --target folder `make test-dist` installs DeepSpeed into."""
    path = Path(os.environ.get("LOGITLESS_DEEPSPEED", REPO / ".venv-deepspeed"))
    if not (path / "deepspeed" / "__init__.py").is_file():
        pytest.fail(f"DeepSpeed is not installed in {path}: `make test-dist` installs it there "
                    f"(or set LOGITLESS_DEEPSPEED to a --target folder holding it)")
    return path


def worker_env(ds: Path) -> dict:
    env = dict(os.environ)
    src = str(Path(logitless.__file__).resolve().parents[1])  # the logitless under test
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ds), src, env.get("PYTHONPATH")) if p)
    env["PATH"] = os.pathsep.join((str(ds / "bin"), env.get("PATH", "")))  # pip's ninja
    env.update(
        DS_ACCELERATOR="cpu",  # DeepSpeed's CPU accelerator over gloo, on any machine
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",  # two ranks on two cores
        HF_HUB_OFFLINE="1",
        TRITON_INTERPRET="1",
    )
    return env


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    """Launches the worker once: ``(results, parameters, initial parameters)``."""
    ds = deepspeed_dir()
    model_dir = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = tiny_tokenizer()
    model = tiny_qwen2(tokenizer)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    out = tmp_path_factory.mktemp("zero3-out")
    # a static rendezvous on loopback (--standalone's c10d rendezvous takes minutes here)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(WORKER),
           "--model-dir", str(model_dir), "--out", str(out)]
    proc = subprocess.run(cmd, env=worker_env(ds), cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"the ZeRO-3 run failed (exit {proc.returncode}):\n{log}"
    results = json.loads((out / "results.json").read_text())
    params = {name: torch.load(out / f"{name}.pt") for name in results}
    return results, params, initial


def assert_same_logs(ours, theirs, name):
    assert len(ours) == len(theirs) == 3, name  # two steps and the summary
    assert [h.get("loss") is not None for h in theirs] == [True, True, False]
    for step, (o, t) in enumerate(zip(ours, theirs)):
        for key, value in t.items():
            assert key in o, f"{name} step {step}: {key} not logged"
            if key.endswith(TIMING_KEYS):
                continue
            assert abs(o[key] - value) <= 1e-5 * abs(value) + 1e-7, (name, step, key, o[key],
                                                                     value)


def relative_difference(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("config", CONFIGS)
def test_zero3_runs_partitioned_on_two_ranks(zero3_runs, config):
    """The runs really are ZeRO-3 over two ranks: every parameter of the policy (and of the
    reference model) is partitioned, each rank holding its half outside the gathers."""
    results, _, initial = zero3_runs
    for run in RUNS:
        r = results[f"{config}-{run}"]
        assert (r["zero_stage"], r["world_size"]) == (3, 2)
        assert r["partition"].keys() == initial.keys()
        for key, (held, partition) in r["partition"].items():
            full = initial[key].numel()
            assert held == 0 and partition == (full + 1) // 2, (run, key, held, partition)
        assert r["reference_partitioned"] == (config == "dapo_kl")


@pytest.mark.parametrize("config", CONFIGS)
def test_zero3_patch_trl_and_grpo_trainer_match_stock_trl(zero3_runs, config):
    results, params, initial = zero3_runs
    stock = results[f"{config}-stock"]
    assert stock["head_calls"] == {"grad": 0, "no_grad": 0, "fused": 0}  # TRL's own kernel
    theirs = params[f"{config}-stock"]
    moved = max(relative_difference(theirs[k], initial[k]) for k in initial)
    assert moved >= 1e-3, f"stock TRL moved the parameters by {moved:.2e} only"
    for run in ("patch_trl", "grpo_trainer", "composed"):
        name = f"{config}-{run}"
        calls = results[name]["head_calls"]
        # logitless's head served the no-grad passes (old policy or reference logprobs) on
        # both ranks' batches, and the training forwards: the head and the loss one
        # fused_policy_loss call in the fused trainer (no fallback to the composed path),
        # linear_logprobs then the loss otherwise
        assert calls["no_grad"] > 0, (name, calls)
        if run == "grpo_trainer":
            assert results[name]["fallbacks"] == [], (name, results[name]["fallbacks"])
            assert calls["fused"] > 0 and calls["grad"] == 0, (name, calls)
        else:
            assert calls["grad"] > 0 and calls["fused"] == 0, (name, calls)
        assert_same_logs(results[name]["log_history"], stock["log_history"], name)
        ours = params[name]
        assert ours.keys() == theirs.keys() == initial.keys()
        for key in theirs:
            err = relative_difference(ours[key], theirs[key])
            assert err <= 1e-5, f"{name}: {key} differs from stock TRL's by {err:.2e}"
