"""One rank of the ZeRO-3 GRPO runs of tests/integrations/test_zero3.py (launched by
``torch.distributed.run``, DeepSpeed on its CPU accelerator with gloo).

For each GRPO configuration of ``CONFIGS``, trains the same saved tiny Qwen2 for two steps
four times under one ZeRO-3 config: stock TRL, stock TRL after ``patch_trl()``, logitless's
``GRPOTrainer`` (its default: the loss as one ``fused_policy_loss`` call) and that trainer
with ``fused=False`` (the composed path). Rank 0 writes, per run, the logged history, the
logitless head calls (with and without grad), the fused loss calls, the trainer's fallback
warnings, the parameters' partition sizes, and the updated parameters gathered under
``deepspeed.zero.GatheredParameters`` (``<config>-<run>.pt``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models

from logitless.kernels import interpreter_compat

from tiny_models import prompt_dataset, vowel_reward

interpreter_compat.apply()  # the suite's interpreter, in each rank (a no-op without it)

RUNS = ("stock", "patch_trl", "grpo_trainer", "composed")
# TRL's default loss; DAPO with a KL term, whose reference model DeepSpeed partitions too
CONFIGS = {"grpo": {}, "dapo_kl": dict(loss_type="dapo", beta=0.04)}


def zero3_config() -> dict:
    return {
        # persistence threshold 0: every parameter partitioned, however small (DeepSpeed keeps
        # those under 1e5 elements whole by default: all of the tiny model's)
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        # the trainer's torch SGD: DeepSpeed wraps it in its ZeRO-3 optimizer
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


def grpo_args(output_dir: str, **overrides):
    import trl

    fields = dict(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=2, gradient_accumulation_steps=2, num_iterations=2,
        learning_rate=2.0, optim="sgd", logging_steps=1, report_to=[], bf16=False,
        seed=0, save_strategy="no", disable_tqdm=True, deepspeed=zero3_config(),
        # the process state of `distributed_state()`, which the trainer would reset
        accelerator_config={"use_configured_state": True},
    )
    fields.update(overrides)
    return trl.GRPOConfig(**fields)


def distributed_state():
    """accelerate's process state for DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``).

    Without a GPU, accelerate (1.x) finds no device backend, lets DeepSpeed pick one and then
    records "no backend": one process, while DeepSpeed's engine runs over all of them (the
    trainer's gathers then fail in gloo: "invalid output tensor list ... expected length 2,
    got 1"). Naming gloo makes it record the launched world, as it does with NCCL on GPUs.
    """
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    state = PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    assert state.num_processes == int(os.environ["WORLD_SIZE"]), state
    return state


def head_spy(counts: dict):
    """Counts calls of logitless's TRL head: (with grad, without)."""
    from logitless.integrations import trl_head

    inner = trl_head.LogitlessChunkedLogProb.apply

    def spy(*args, **kwargs):
        counts["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return inner(*args, **kwargs)

    trl_head.LogitlessChunkedLogProb.apply = staticmethod(spy)
    return lambda: setattr(trl_head.LogitlessChunkedLogProb, "apply", staticmethod(inner))


def fused_spy(counts: dict):
    """Counts the training forwards whose head and loss were one `fused_policy_loss` call."""
    from logitless.integrations import trl as logitless_trl

    inner = logitless_trl._FusedLoss.apply

    def spy(self, *args, **kwargs):
        counts["fused"] += 1
        return inner(self, *args, **kwargs)

    logitless_trl._FusedLoss.apply = spy
    return lambda: setattr(logitless_trl._FusedLoss, "apply", inner)


def train(run: str, model_dir: str, tokenizer, output_dir: str, overrides: dict):
    import trl

    from logitless.integrations import trl_head
    from logitless.integrations.trl import GRPOTrainer

    kwargs = {}
    if run in ("grpo_trainer", "composed"):
        cls, kwargs = GRPOTrainer, dict(fused=run == "grpo_trainer")
    else:
        cls = trl.GRPOTrainer
    if run == "patch_trl":
        trl_head.patch_trl()
    try:
        trainer = cls(model=model_dir, reward_funcs=vowel_reward,
                      args=grpo_args(output_dir, **overrides), train_dataset=prompt_dataset(),
                      processing_class=tokenizer, **kwargs)
        trainer.train()
    finally:
        trl_head.unpatch_trl()
    return trainer


def gathered_parameters(model) -> tuple[dict, dict]:
    """The full parameters (gathered from every rank's partition) and, per parameter, the
    elements held outside a gather and in this rank's partition."""
    import deepspeed

    params = dict(model.named_parameters())
    local = {name: (p.numel(), p.ds_tensor.numel()) for name, p in params.items()}
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        full = {name: p.detach().clone() for name, p in params.items()}
    return full, local


def one_run(run, model_dir, tokenizer, out: Path, name: str, overrides: dict, rank: int):
    from accelerate.state import AcceleratorState

    counts = {"grad": 0, "no_grad": 0, "fused": 0}
    restore, restore_fused = head_spy(counts), fused_spy(counts)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = train(run, model_dir, tokenizer, str(out / name), overrides)
    finally:
        restore()
        restore_fused()
    fallbacks = [str(w.message) for w in caught if "not fused" in str(w.message)]
    full, local = gathered_parameters(trainer.model)
    if rank == 0:
        torch.save(full, out / f"{name}.pt")
    result = dict(
        log_history=trainer.state.log_history, head_calls=counts, fallbacks=fallbacks,
        zero_stage=trainer.model_wrapped.zero_optimization_stage(),
        world_size=trainer.accelerator.num_processes, partition=local,
        reference_partitioned=trainer.ref_model is not None and all(
            p.numel() == 0 for p in trainer.ref_model.parameters()),
    )
    AcceleratorState._reset_state()  # the next trainer brings its plugin; the processes stay
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    rank = distributed_state().process_index
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    out = Path(args.out)
    results = {}
    for config, overrides in CONFIGS.items():
        for run in RUNS:
            name = f"{config}-{run}"
            results[name] = one_run(run, args.model_dir, tokenizer, out, name, overrides, rank)
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
