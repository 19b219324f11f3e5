"""fused_policy_loss through the Triton chunk store (``kernels/stored_logits.py``, what
CUDA runs), under TRITON_INTERPRET=1 on CPU tensors with ``LOGITLESS_BACKEND=triton``: against
the fp64 reference (values, metrics, hidden/weight/bias gradients; bf16 by the three-way check),
against the torch store, over several chunks and masks with ignored tokens.

The epilogue passes step through the vocabulary 128 columns at a time here (V=301: three
steps, the last partial) so that their fold crosses block boundaries at small sizes.
"""

from __future__ import annotations

import os

import pytest
import torch

from fused_losses.test_fused_policy_loss import (
    HEAD,
    D,
    V,
    make_batch,
    packed,
    run_fused,
    run_reference,
)
from logitless import PolicyLossConfig
from logitless.fused_losses.fused import plan as fpl_plan
from logitless.kernels import linear_softmax, stored_logits_torch

from testing import assert_close_to_oracle, requires_triton

BLOCK = 128
# The batch's sequences hold 13, 7, 0, 10 and 4 loss rows: chunks of at most 13 rows, four of
# them, all within the budget (none streamed).
CHUNK_ROWS = 13


@pytest.fixture
def triton_store(monkeypatch):
    """The Triton store selected as on CUDA, its launches counted."""
    from logitless.kernels import stored_logits as st

    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    monkeypatch.setattr(linear_softmax, "_BLOCK_V", BLOCK)
    calls = {"forward": 0, "backward_": 0}
    for name in calls:
        real = getattr(st.StoredLogitsTriton, name)

        def counted(self, *args, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(st.StoredLogitsTriton, name, counted)
    return calls


def budget(rows, dtype):
    """A memory budget of ``rows`` chunk rows for the Triton store."""
    from logitless.kernels.stored_logits import StoredLogitsTriton

    return rows * StoredLogitsTriton.bytes_per_row(V, dtype, HEAD["softcap"], hidden_size=D)


CONFIGS = {
    "grpo": PolicyLossConfig(objective="grpo", beta=0.05),
    "dapo": PolicyLossConfig(objective="dapo"),
    "gspo-sequence": PolicyLossConfig(objective="gspo"),
    "grpo-entropy": PolicyLossConfig(objective="grpo", entropy_coef=0.02),
}


def _scale(g):
    scale = float(g.abs().max())
    assert scale > 0, "a zero gradient would hide a wrong one"
    return scale


@requires_triton
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp32_matches_reference(triton_store, name, layout):
    batch = make_batch(dtype=torch.float32, seed=3)
    if layout == "packed":
        batch = packed(batch)
    cfg = CONFIGS[name]
    loss, metrics, grads = run_fused(batch, cfg, with_ref=cfg.beta > 0,
                                     max_tile_bytes=budget(CHUNK_ROWS, torch.float32))
    assert triton_store["forward"] >= 3 and triton_store["backward_"] >= 3
    loss_r, metrics_r, grads_r = run_reference(batch, cfg, with_ref=cfg.beta > 0)
    torch.testing.assert_close(loss.double(), loss_r, rtol=1e-5, atol=1e-6)
    for k, v in metrics_r.items():
        torch.testing.assert_close(metrics[k].double(), v.double(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, k=k: f"metric {k}: {m}")
    for what, g, gr in zip(("hidden", "weight", "bias"), grads, grads_r):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), gr, rtol=1e-4, atol=1e-5 * _scale(gr),
                                   msg=lambda m, what=what: f"d_{what}: {m}")


BF16_CONFIGS = {
    # an entropy bonus large enough that a wrong entropy term exceeds bf16's own error
    "grpo-entropy": PolicyLossConfig(objective="grpo", entropy_coef=0.2),
    "gspo-sequence": CONFIGS["gspo-sequence"],
}


def _rms(x):
    return float(x.double().pow(2).mean().sqrt())


@requires_triton
@pytest.mark.parametrize("name", sorted(BF16_CONFIGS))
def test_bf16_three_way(triton_store, name):
    """bf16: the logits are stored in bf16 as PyTorch's bf16 GEMM rounds them; everything after
    is fp32. Within bf16 PyTorch's own distance from the fp64 reference, elementwise (plus
    half a percent of the gradient's scale), and closer than it in RMS."""
    batch = make_batch(dtype=torch.bfloat16, seed=9)
    cfg = BF16_CONFIGS[name]
    ours = run_fused(batch, cfg, with_ref=False, max_tile_bytes=budget(CHUNK_ROWS,
                                                                       torch.bfloat16))
    assert triton_store["forward"] >= 3
    exact = run_reference(batch, cfg, with_ref=False, dtype=torch.float64)
    same = run_reference(batch, cfg, with_ref=False, dtype=torch.bfloat16)
    assert_close_to_oracle(ours[0], exact[0], same[0], tol=1e-4, name="loss")
    for what, g, ge, gs in zip(("hidden", "weight", "bias"), ours[2], exact[2], same[2]):
        assert g.dtype == torch.bfloat16
        assert_close_to_oracle(g, ge, gs, tol=5e-3 * _scale(ge), name=f"d_{what}")
        assert _rms(g - ge) <= _rms(gs - ge), what


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_store(triton_store, monkeypatch, dtype):
    """The same call through the torch store (fp32 exponentials in vocabulary blocks) and
    through the Triton store: the same loss and gradients, to the inputs' precision."""
    batch = make_batch(dtype=dtype, seed=5)
    cfg = CONFIGS["grpo-entropy"]
    ours = run_fused(batch, cfg, max_tile_bytes=budget(CHUNK_ROWS, dtype))
    assert triton_store["forward"] >= 3
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    theirs = run_fused(batch, cfg, max_tile_bytes=CHUNK_ROWS * stored_logits_torch.bytes_per_row(
        V, dtype, HEAD["softcap"]))
    assert triton_store["forward"] >= 3  # unchanged count: the torch store ran
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours[0].double(), theirs[0].double(), rtol=tol, atol=tol)
    for what, g, gt in zip(("hidden", "weight", "bias"), ours[2], theirs[2]):
        torch.testing.assert_close(g.double(), gt.double(), rtol=tol,
                                   atol=tol * _scale(gt), msg=lambda m, what=what: f"d_{what}: {m}")


@requires_triton
def test_runs_are_bitwise_identical(triton_store):
    batch = make_batch(dtype=torch.bfloat16, seed=7)
    cfg = CONFIGS["grpo-entropy"]
    first = run_fused(batch, cfg, max_tile_bytes=budget(CHUNK_ROWS, torch.bfloat16))
    second = run_fused(batch, cfg, max_tile_bytes=budget(CHUNK_ROWS, torch.bfloat16))
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


def test_store_selection(monkeypatch):
    """Triton where `triton_selected` says so (CUDA; LOGITLESS_BACKEND=triton), the torch
    store on CPU by default and for fp64."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("LOGITLESS_BACKEND", raising=False)
    assert fpl_plan.store_type(cpu, torch.float32) is stored_logits_torch.StoredLogits
    if os.environ.get("TRITON_INTERPRET") == "1":
        from logitless.kernels.stored_logits import StoredLogitsTriton

        monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
        assert fpl_plan.store_type(cpu, torch.bfloat16) is StoredLogitsTriton
        assert fpl_plan.store_type(cpu, torch.float64) is stored_logits_torch.StoredLogits


def test_chunk_rows_follow_the_cost_model():
    """The Triton store sizes a chunk's row as gpu_plan does: the stored logits in the input
    dtype plus the gathered hidden row and its gradient row."""
    pytest.importorskip("triton")
    from logitless.kernels.stored_logits import StoredLogitsTriton
    from logitless.tools import gpu_plan

    n, d, v = gpu_plan.REFERENCE_SHAPE
    row = StoredLogitsTriton.bytes_per_row(v, torch.bfloat16, None, hidden_size=d)
    plan = gpu_plan.gpu_plan(n, d, v, "bfloat16", "fused-policy-loss")
    rows = gpu_plan.wave_rows(gpu_plan.CUDA_MEMORY_BUDGET // row, d)
    assert plan.chunks == -(-n // rows)
