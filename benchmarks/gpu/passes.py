"""Measured beside predicted, per pass: one call of each GPU path under the profiler, its
kernels' device time grouped into the cost model's passes.

    python benchmarks/gpu/passes.py [--device cuda] [--tokens 16384] [--hidden 4096]
        [--vocab 151936] [--json OUT.json]

For `linear_logprobs` without and with its backward, and for `fused_policy_loss` (GRPO) with
its backward, each kernel that `torch.profiler` records on the device is put in one group:

- ``GEMMs``: cuBLAS / CUTLASS kernels (names with gemm, xmma, cutlass, nvjet, or sm90_);
- ``statistics pass``: ``tile_stats_kernel``;
- ``dz pass``: ``tile_grad_kernel``;
- ``other``: everything else (the objective's small kernels, copies, casts, fills).

Beside each group: the same group of `gpu_plan`'s passes at that shape (bf16), so that a
measured row can be read against the model row by row. The first call of each path is a
warm-up (Triton compiles); the second is profiled. On a machine without CUDA the predicted
column is printed and the measured one says why it is empty.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import logitless
from logitless.tools import gpu_plan

GROUPS = ("GEMMs", "statistics pass", "dz pass", "other")
_GEMM_MARKS = ("gemm", "xmma", "cutlass", "nvjet", "sm90_")
PATHS = {"linear_logprobs, no grad": "logprobs-nograd",
         "linear_logprobs, forward + backward": "logprobs-fwd-bwd",
         "fused_policy_loss (GRPO), forward + backward": "fused-policy-loss"}


def group_of_kernel(name: str) -> str:
    low = name.lower()
    if "tile_stats_kernel" in low:
        return "statistics pass"
    if "tile_grad_kernel" in low:
        return "dz pass"
    if any(m in low for m in _GEMM_MARKS):
        return "GEMMs"
    return "other"


def group_of_pass(p: gpu_plan.Pass) -> str:
    if p.unit == "matmul":
        return "GEMMs"
    if p.name.startswith("statistics pass"):
        return "statistics pass"
    if p.name.startswith("dz pass"):
        return "dz pass"
    return "other"


def predicted(path: str, n: int, d: int, v: int) -> dict[str, float]:
    """Milliseconds per group of the model's passes."""
    out = dict.fromkeys(GROUPS, 0.0)
    for p in gpu_plan.gpu_plan(n, d, v, "bfloat16", path).passes:
        out[group_of_pass(p)] += p.seconds * 1e3
    return out


def _call(label: str, hidden, weight, targets, extra):
    if label.startswith("linear_logprobs, no grad"):
        with torch.no_grad():
            logitless.linear_logprobs(hidden, weight, targets, return_entropy=True)
        return
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    if label.startswith("linear_logprobs"):
        out = logitless.linear_logprobs(h, w, targets, return_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    else:
        loss, _ = logitless.fused_policy_loss(h, w, targets, *extra,
                                              logitless.PolicyLossConfig(objective="grpo"))
        loss.backward()


def measured(label: str, hidden, weight, targets, extra) -> dict[str, float]:
    """Milliseconds of device time per group, from one profiled call after a warm-up."""
    from torch.profiler import ProfilerActivity, profile

    _call(label, hidden, weight, targets, extra)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _call(label, hidden, weight, targets, extra)
        torch.cuda.synchronize()
    out = dict.fromkeys(GROUPS, 0.0)
    for e in prof.events():
        us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
        if e.device_type == torch.autograd.DeviceType.CUDA and us:
            out[group_of_kernel(e.name)] += us / 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    n, d, v = a.tokens, a.hidden, a.vocab
    run = a.device == "cuda" and torch.cuda.is_available()
    why = "" if run else f"not run: no CUDA device here (--device {a.device})"
    if run:
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(n, d, device="cuda", generator=g).bfloat16()
        weight = (torch.randn(v, d, device="cuda", generator=g) * d**-0.5).bfloat16()
        targets = torch.randint(0, v, (n,), device="cuda", generator=g)
        # 16 sequences of n / 16 tokens for the fused loss
        seqs = 16
        t = n // seqs
        extra = (-torch.rand(seqs, t, device="cuda", generator=g) * 3,
                 torch.randn(seqs, device="cuda", generator=g),
                 torch.ones(seqs, t, dtype=torch.bool, device="cuda"))
    records = []
    print(f"per pass, N={n} D={d} V={v} bf16: measured ms (device time) | predicted ms")
    for label, path in PATHS.items():
        pred = predicted(path, n, d, v)
        meas, status = None, why
        if run:
            try:
                if path == "fused-policy-loss":
                    meas = measured(label, hidden[:seqs * t].view(seqs, t, d), weight,
                                    targets[:seqs * t].view(seqs, t), extra)
                else:
                    meas = measured(label, hidden, weight, targets, ())
            except Exception as exc:  # a path's failure is its row's result
                status = f"failed: {type(exc).__name__}: {exc}"[:200]
        print(f"== {label}" + ("" if meas else f" ({status})"))
        for group in GROUPS:
            m = "-" if meas is None else f"{meas[group]:9.2f}"
            print(f"   {group:16s} {m:>9s} | {pred[group]:9.2f}")
        total = "-" if meas is None else f"{sum(meas.values()):9.2f}"
        print(f"   {'total':16s} {total:>9s} | {sum(pred.values()):9.2f}", flush=True)
        records.append(dict(path=path, label=label, shape=dict(tokens=n, hidden=d, vocab=v),
                            predicted_ms=pred, measured_ms=meas, status=status or "ok"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
