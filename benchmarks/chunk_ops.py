"""Compute ops per extra chunk of ``fused_policy_loss`` on the Triton store path, counted on
CPU: run the same batch with budgets of k and k + 1 chunks under a ``TorchDispatchMode`` and
take the difference (views, allocations and the Triton interpreter's own work excluded). On
CUDA each counted op is a kernel launch. Also lists what reads back to the host.

    TRITON_INTERPRET=1 LOGITLESS_BACKEND=triton python benchmarks/chunk_ops.py
"""

from __future__ import annotations

import collections
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logitless
from logitless.kernels import stored_logits_triton

_FREE = ("view", "reshape", "expand", "empty", "slice", "select", "unsqueeze", "squeeze",
         "alias", "as_strided", "t.default", "transpose", "permute", "detach", "unbind",
         "split", "narrow", "_unsafe_view", "lift_fresh", "new_empty", "empty_like",
         "set_.source_Storage")  # set_: the Triton interpreter moving its tensors
_HOST = ("_local_scalar_dense", "item", "lift_fresh")


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.host = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(h in name for h in _HOST):
            self.host[name] += 1
        if not any(f in name for f in _FREE):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def run(chunks: int, b=6, t=16, d=32, v=500):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, t, d, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, d, generator=g) / d**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    old = -torch.rand(b, t, generator=g) * 3
    adv = torch.randn(b, generator=g)
    rows_per_chunk = -(-b // chunks) * t
    budget = rows_per_chunk * stored_logits_triton.StoredLogitsTriton.bytes_per_row(
        v, torch.bfloat16, None, d)
    cfg = logitless.PolicyLossConfig(objective="grpo")
    with Count() as count:
        loss, _ = logitless.fused_policy_loss(hidden, weight, targets, old, adv, mask, cfg,
                                              memory_budget=budget, strategy="chunked")
        loss.backward()
    return count


def main():
    two, three = run(2), run(3)
    extra = three.ops - two.ops
    print(json.dumps({"ops_per_extra_chunk": sum(three.ops.values()) - sum(two.ops.values()),
                      "host_reads_per_extra_chunk": sum(three.host.values())
                      - sum(two.host.values()),
                      "by_op": dict(extra.most_common())}, indent=1))


if __name__ == "__main__":
    main()
