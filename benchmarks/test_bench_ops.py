"""pytest-benchmark regression guard: every op x provider x mode of ``logitless bench`` at small
CPU shapes (``make bench``; not part of ``make test``).

Each case also checks the provider against the fp64 reference on the first token block, so a
change that makes something fast by making it wrong fails here. Providers that cannot run on
this machine are skipped with their reason; Liger's Triton kernels need ``TRITON_INTERPRET=1``
on CPU and are slow under it.
"""

from __future__ import annotations

import os

import pytest
import torch

from logitless.tools.bench.measure import block_errors, prepare
from logitless.tools.bench.registry import get_op, get_providers

SHAPES = {
    "logprobs": {"tokens": 256, "hidden": 256, "vocab": 32000},
    "policy-loss": {"tokens": 256, "hidden": 256, "vocab": 32000},
    "attention-entropy": {"batch": 1, "heads": 4, "kv_heads": 2, "seq": 512, "head_dim": 64},
}
# fp32 against fp64: a correct provider is far inside these.
TOLERANCE = 1e-3

CASES = [
    pytest.param(op, provider.name, mode, id=f"{op}-{provider.name}-{mode}")
    for op in SHAPES
    for provider in get_providers(op)
    for mode in get_op(op).modes
]


@pytest.mark.parametrize(("op_name", "provider_name", "mode"), CASES)
def test_bench(benchmark, op_name, provider_name, mode):
    op = get_op(op_name)
    (provider,) = get_providers(op_name, [provider_name])
    why = provider.unavailable("cpu", torch.float32, mode)
    if why is None and provider.interpreted_on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        why = "Triton kernels: set TRITON_INTERPRET=1 to run them on CPU (slow)"
    if why:
        pytest.skip(why)
    inputs = op.make_inputs(SHAPES[op_name], torch.float32, "cpu")
    leaves, upstream = prepare(op, provider, inputs, mode)

    def run():
        provider.step(inputs, mode, upstream)
        for t in leaves:
            t.grad = None

    benchmark.extra_info.update(shape=SHAPES[op_name], mode=mode, provider=provider_name)
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    if not provider.is_floor:
        errors = block_errors(op, provider, inputs, mode, rows=16)
        benchmark.extra_info["errors"] = errors
        assert max(errors.values()) < TOLERANCE, errors
