"""``logitless demo`` (after ``logitless check``): logitless beside plain PyTorch and stock TRL.

1. ``linear_logprobs`` forward+backward with entropy on a Qwen2.5-0.5B-sized head (D=896,
   V=151936) for 512 tokens, fp32 on CPU, beside the naive materialised logits: time and peak
   memory beyond the inputs and their gradients, each measured by ``logitless bench``'s
   machinery in a process of its own, and their ratios.
2. A few GRPO steps through TRL on a tiny model (``logitless.tools.tiny``), stock
   ``GRPOTrainer`` beside logitless's, then the LM head's time and memory at the shape those
   steps sent it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import tempfile
import time
import warnings
from contextlib import contextmanager

import torch

from logitless.tools import tiny
from logitless.tools.bench.runner import Settings, run_sweep

SHAPE = {"tokens": 512, "hidden": 896, "vocab": 151936}
_MB = 2**20


NOISE = ("timings: medians of a few calls on whatever CPU this is; on a shared machine they move "
         "by 10-20% between runs, the ratios less")


def check_summary(args) -> int:
    """One line per op: ``logitless check``'s comparisons with the fp64 reference, summed up
    (the full table is ``logitless check``'s). Returns 1 if any comparison failed."""
    from logitless.tools import check

    shape = check.Shape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(check.Shape)})
    devices = args.device or check.present_devices()
    print("logitless check, summed up: each op's values and gradients against the fp64 "
          "reference (full table: logitless check)")
    failed = 0
    for op in args.op or list(check.CASES):
        rows = []
        for device in devices:
            backends = [b for b in (args.backend or check.default_backends(device))
                        if not (b == "triton" and device == "cpu"
                                and os.environ.get("TRITON_INTERPRET") != "1")]
            rows += check.run_checks(devices=[device], backends=backends, dtypes=args.dtype,
                                     ops=[op], shape=shape)
        bad = [r for r in rows if not r.ok]
        failed += len(bad)
        where = ", ".join(sorted({f"{r.device}/{r.backend}" for r in rows}))
        verdict = "ok" if not bad else f"{len(bad)} FAILED ({bad[0].case}: {bad[0].quantity})"
        print(f"  {op:<20} {len(rows):>4} comparisons on {where}: {verdict}")
    return 1 if failed else 0


def side_by_side(records: list[dict]) -> str:
    """Table of the naive and logitless rows of one shape, with logitless / naive ratios."""
    by = {r["provider"]: r for r in records}
    ours, naive = by["logitless"], by["naive"]
    lines = [f"{'':<16}{'time ms (median)':>17}{'peak MiB':>12}{'max err vs fp64':>18}"]
    for name, r in (("naive PyTorch", naive), ("logitless", ours)):
        if r["status"] != "ok":
            lines.append(f"{name:<16}{r['status']}: {r['reason']}")
            continue
        err = max(r["errors"].values()) if r["errors"] else float("nan")
        lines.append(f"{name:<16}{r['time_ms']['median']:>17.1f}"
                     f"{r['peak_bytes'] / _MB:>12.1f}{err:>18.1e}")
    if ours["status"] == naive["status"] == "ok":
        t = ours["time_ms"]["median"] / naive["time_ms"]["median"]
        m = ours["peak_bytes"] / max(naive["peak_bytes"], 1)
        lines.append(f"{'logitless/naive':<16}{t:>16.2f}x{m:>11.3f}x")
    return "\n".join(lines)


def run_head_demo() -> int:
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    print(f"\nlinear_logprobs forward+backward with entropy vs naive PyTorch (materialised "
          f"logits), fp32, CPU, {shape}\npeak MiB: above the inputs and their gradients, each "
          f"provider in its own process (about a minute)\n{NOISE}")
    records = run_sweep(Settings(op="logprobs", shapes=[SHAPE], modes=["fwd-bwd"],
                                 providers=["naive", "logitless"], warmup=0, repeats=2,
                                 progress=False))
    print(side_by_side(records))
    print("more: logitless bench --op logprobs --device cpu --preset qwen-small")
    return 0 if all(r["status"] == "ok" for r in records) else 1


class _TimedKernel:
    """Wraps a fused-head kernel's ``apply``: forward time, calls, and the training call's
    shape (rows, hidden, vocab)."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls, self.shape = inner, 0.0, 0, None

    def apply(self, hidden, weight, *args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.inner(hidden, weight, *args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        if torch.is_grad_enabled():
            self.shape = {"tokens": hidden.shape[0], "hidden": weight.shape[1],
                          "vocab": weight.shape[0]}
        return out


@contextmanager
def _timed(owner, name):
    """Times ``owner.name``: TRL's kernel class in its module, or our class's ``apply``."""
    saved = vars(owner)[name]
    if isinstance(saved, staticmethod):
        timer = _TimedKernel(saved.__func__)
        replacement = staticmethod(timer.apply)
    else:
        timer = replacement = _TimedKernel(saved.apply)
    setattr(owner, name, replacement)
    try:
        yield timer
    finally:
        setattr(owner, name, saved)


def _train(trainer_cls, steps, tokenizer, device, workdir):
    from transformers import PrinterCallback
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=workdir, per_device_train_batch_size=16, num_generations=4,
        max_completion_length=48, max_steps=steps, learning_rate=1e-3, logging_steps=1,
        report_to=[], bf16=False, use_cpu=device == "cpu", seed=0, save_strategy="no",
        disable_tqdm=True, num_iterations=2, steps_per_generation=2,
    )
    trainer = trainer_cls(model=tiny.qwen2(tokenizer, hidden=64), reward_funcs=tiny.vowel_reward,
                          args=args, train_dataset=tiny.prompts(32), processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_trl_demo(steps: int = 4, vocab_size: int = 8192) -> int:
    """A few GRPO steps with TRL's trainer and with logitless's, then the LM head's time and
    peak memory side by side at the shape those steps sent it (``logitless bench``)."""
    if importlib.util.find_spec("trl") is None:
        print("\nGRPO through TRL: skipped, TRL is not installed (pip install 'logitless[trl]')")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import trl.trainer.utils as trl_utils
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer as StockTrainer

    from logitless.integrations import trl_head
    from logitless.integrations.trl import GRPOTrainer

    hf_logging.set_verbosity_error()
    # The demo's own output only: transformers' and TRL's deprecation notices are for their
    # users' code, not for a reader of this comparison.
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(transformers|trl)\b")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = tiny.tokenizer(vocab_size)
    runs = (("stock TRL", StockTrainer, trl_utils, "_ChunkedLogProbFunction"),
            ("logitless", GRPOTrainer, trl_head.LogitlessChunkedLogProb, "apply"))
    print(f"\nGRPO through TRL: {steps} steps of a tiny Qwen2 (vocab {len(tokenizer)}, hidden "
          f"64, {device}), stock GRPOTrainer beside logitless.integrations.trl.GRPOTrainer")
    print(f"{'trainer':<12}{'head calls':>11}{'head fwd ms':>13}  losses")
    shape = None
    with tempfile.TemporaryDirectory() as workdir:
        for name, cls, owner, attr in runs:
            with _timed(owner, attr) as timer:
                losses = _train(cls, steps, tokenizer, device, workdir)
            shape = shape or timer.shape
            shown = " ".join(f"{x:+.4f}" for x in losses)
            print(f"{name:<12}{timer.calls:>11}{timer.seconds * 1e3:>13.1f}  {shown}")
    print(f"\nthe head, forward+backward with entropy at the training call's shape {shape}, "
          f"fp32, each kernel in its own process (logitless bench):")
    records = run_sweep(Settings(op="logprobs", shapes=[shape], modes=["fwd-bwd"],
                                 providers=["trl", "logitless"], device=device, warmup=1,
                                 repeats=3, progress=False))
    print(f"{'kernel':<12}{'time ms':>10}{'peak MiB':>10}\n{NOISE}")
    for r in records:
        if r["status"] != "ok":
            print(f"{r['provider']:<12}{r['status']}: {r['reason']}")
            continue
        print(f"{r['provider']:<12}{r['time_ms']['median']:>10.2f}"
              f"{r['peak_bytes'] / 2**20:>10.2f}")
    return 0 if all(r["status"] == "ok" for r in records) else 1


def run_demo() -> int:
    """Both parts; 1 if any measurement failed."""
    return max(run_head_demo(), run_trl_demo())
