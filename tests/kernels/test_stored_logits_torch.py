"""The stored-logits buffer of fused_policy_loss's chunks, tested directly against the fp64
reference: its forward statistics, and the gradients its backward turns the store into."""

import pytest
import torch

from logitless import reference
from logitless.kernels import stored_logits_torch

OPTS = [dict(temperature=1.0, softcap=None, logit_scale=1.0),
        dict(temperature=0.8, softcap=5.0, logit_scale=0.9)]


def _problem(n=37, d=96, v=1007):
    hidden = torch.randn(n, d, dtype=torch.float64)
    weight = torch.randn(v, d, dtype=torch.float64) / d**0.5 * 2
    return hidden, weight, torch.randn(v, dtype=torch.float64), torch.randint(0, v, (n,))


@pytest.mark.parametrize("opts", OPTS, ids=["plain", "capped"])
@pytest.mark.parametrize("block", [None, 300], ids=["one-block", "blocks"])
def test_forward_and_backward_match_the_reference(opts, block):
    hidden, weight, bias, targets = _problem()
    n, v = targets.shape[0], weight.shape[0]
    store = stored_logits_torch.StoredLogits(v, n, torch.float64, "cpu", opts["softcap"],
                                             block=block)
    lp, ent, lse = store.forward(hidden, weight, bias, targets, **opts)
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    ref = reference.linear_softmax_stats(*leaves[:2], targets, leaves[2],
                                         softcap=opts["softcap"],
                                         temperature=opts["temperature"],
                                         logit_scale=opts["logit_scale"])
    for name, a in (("logprobs", lp), ("entropy", ent), ("lse", lse)):
        torch.testing.assert_close(a, ref[name].detach(), rtol=1e-12, atol=1e-12, msg=name)

    g_lp, g_ent = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    want = torch.autograd.grad((ref["logprobs"] * g_lp + ref["entropy"] * g_ent).sum(), leaves)
    d_weight = torch.full_like(weight, float("nan"))  # weight_beta=0 overwrites it
    d_bias = torch.zeros_like(bias)
    d_hidden = store.backward_(hidden, weight, ent, g_lp, g_ent, d_weight, d_bias,
                               want_hidden=True, weight_beta=0.0)
    for name, a, b in zip(("hidden", "weight", "bias"), (d_hidden, d_weight, d_bias), want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


def test_bytes_per_row_counts_every_buffer():
    """bytes_per_row matches what a store allocates per row (pool, cap, low-precision block)."""
    v, rows = 1007, 8
    for dtype, softcap in ((torch.float32, None), (torch.bfloat16, 3.0), (torch.float16, None)):
        store = stored_logits_torch.StoredLogits(v, rows, dtype, "cpu", softcap, block=300)
        held = sum(b.numel() * b.element_size()
                   for b in (store._pool, store._cap, store._low) if b is not None)
        assert held == rows * stored_logits_torch.bytes_per_row(v, dtype, softcap, block=300)
