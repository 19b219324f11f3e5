"""One GRPO training step through TRL on CPU, with a head that dominates: stock TRL, logitless's
``GRPOTrainer`` composed (``fused=False``) and fused (the default).

The model: a randomly initialised Qwen2 of ``--layers`` layers, D=``--d``, over a word-level
vocabulary of V=``--v`` (``logitless.tools.tiny``; defaults: one layer, D=896, V=151936, the
Qwen2.5-0.5B head), fp32, SGD. One optimizer step: 8 completions of 256 tokens (a random
model never stops early), DAPO, ``num_iterations=2``: TRL makes its old-policy pass (an
on-policy step, ``num_iterations=1``, runs fused too, with ``old_logprobs=None``: docs/trl.md).

Each variant runs in its own process. Printed, one JSON line per variant:

- ``step_s``: the whole ``training_step`` (generation, TRL's old-policy pass, loss, backward);
- ``loss_step_s``: ``compute_loss`` and its backward (the part the three variants change);
- ``loss_step_matmul_flops``: every matmul inside ``compute_loss`` and its backward (a
  ``TorchDispatchMode`` counting ``mm``/``addmm``/``bmm``/``baddbmm``, ``out=`` and in-place
  overloads included), and ``head_matmul_flops``: that minus the backbone's forward and
  backward on the same batch, counted the same way;
- ``peak_rss_gib``: the process's peak resident memory (model, optimizer, generation and the
  loss step), and ``rss_before_loss_gib``: resident memory when the loss step starts.

TRL 1.16's ``GRPOTrainer`` has no Liger loss path (``use_liger_kernel`` applies Liger's layer
kernels only and refuses ``fused_linear_cross_entropy``), so there is no Liger variant.

Usage: ``python benchmarks/trl_grpo_step_cpu.py [--variants stock composed fused] [--layers 1]
[--d 896] [--v 151936] [--completion 256]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"}


class MatmulFlops(TorchDispatchMode):
    """2 M N K per matmul while ``counting``."""

    def __init__(self):
        super().__init__()
        self.counting, self.flops = False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.counting and name in _MATMULS:
            a, b = args[1:3] if name.startswith(("addmm", "baddbmm")) else args[:2]
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **kwargs or {})


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def run_variant(variant: str, a) -> dict:
    import trl

    from logitless.integrations.trl import GRPOTrainer
    from logitless.tools import tiny

    tok = tiny.tokenizer(a.v)
    folder = tempfile.mkdtemp()
    tiny.qwen2(tok, hidden=a.d, layers=a.layers).save_pretrained(folder)
    base = trl.GRPOTrainer if variant == "stock" else GRPOTrainer
    counter = MatmulFlops()
    seen = {}

    class Measured(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            start = time.perf_counter()
            counter.counting = True
            with counter:
                out = super().training_step(model, inputs, num_items_in_batch)
            seen["step_s"] = time.perf_counter() - start
            seen["loss_step_s"] = time.perf_counter() - seen.pop("loss_start")
            return out

        def _prepare_inputs(self, generation_batch):
            counter.counting = False
            try:
                return super()._prepare_inputs(generation_batch)
            finally:
                counter.counting = True
                seen["rss_before_loss_gib"] = _rss_gib()
                seen["loss_start"] = time.perf_counter()

        def compute_loss(self, model, inputs, **kwargs):
            seen["batch"] = (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                             torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1))
            return super().compute_loss(model, inputs, **kwargs)

    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_generations=8,
        max_completion_length=a.completion, gradient_accumulation_steps=1, num_iterations=2,
        max_steps=1, loss_type="dapo", learning_rate=1e-3, optim="sgd", report_to=[],
        use_cpu=True, bf16=False, seed=0, save_strategy="no", disable_tqdm=True,
        logging_steps=1)
    kwargs = {} if variant == "stock" else {"fused": variant == "fused"}
    trainer = Measured(model=folder, reward_funcs=tiny.vowel_reward, args=args,
                       train_dataset=tiny.prompts(), processing_class=tok, **kwargs)
    trainer.train()
    loss_flops = counter.flops
    # the backbone's share: its forward and backward on the step's batch, counted alike
    ids, mask = seen.pop("batch")
    counter.flops = 0
    backbone = trainer.model.model
    with counter:
        backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state.sum(
        ).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return dict(variant=variant, step_s=round(seen["step_s"], 2),
                loss_step_s=round(seen["loss_step_s"], 2),
                loss_step_matmul_flops=loss_flops,
                head_matmul_flops=loss_flops - counter.flops,
                peak_rss_gib=round(peak, 2),
                rss_before_loss_gib=round(seen["rss_before_loss_gib"], 2),
                completion_tokens=int(mask[:, -a.completion:].sum()),
                threads=torch.get_num_threads())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", default=["stock", "composed", "fused"],
                   choices=["stock", "composed", "fused"])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--d", type=int, default=896)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print("RESULT " + json.dumps(run_variant(a.one, a)), flush=True)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for variant in a.variants:  # one process each: its own peak memory
        cmd = [sys.executable, __file__, "--one", variant, "--layers", str(a.layers),
               "--d", str(a.d), "--v", str(a.v), "--completion", str(a.completion)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        print([line[7:] for line in out.splitlines() if line.startswith("RESULT ")][-1],
              flush=True)


if __name__ == "__main__":
    main()
