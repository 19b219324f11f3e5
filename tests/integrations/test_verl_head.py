"""The verl ``linear_cross_entropy`` drop-in against materialised logits, its vocab-parallel
form on gloo, and the enable/disable switch inside verl's own patched model forward.

verl's kernel needs CUDA, so the oracle is plain fp64 torch on the full logits, and verl's
contract (argument order, flat ``[N]`` fp32 outputs, reductions) is checked by calling the
drop-in exactly as verl's forwards do. This module imports verl only inside the tests that
need it, so the spawned gloo workers start quickly.
"""


import pytest
import torch
import torch.distributed as dist

from logitless.integrations.verl_head import (
    disable_fused_head,
    enable_fused_head,
    fused_head_enabled,
    linear_cross_entropy,
)

from testing import assert_close_to_oracle, run_on_gloo


def _oracle(hidden, weight, labels, temperature):
    """fp64 logprobs and entropies from the full logits, flattened like verl's outputs."""
    z = (hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().T) / temperature
    return _from_logits(z, labels)


def _from_logits(z, labels):
    logp = torch.log_softmax(z.double(), dim=-1)
    lp = logp.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _problem(b=3, t=7, d=50, v=37, dtype=torch.float64):
    # d = 50: verl's own kernel rejects it (hidden size must be a multiple of 128).
    hidden = torch.randn(b, t, d, dtype=dtype)
    weight = (torch.randn(v, d, dtype=dtype) / d**0.5)
    labels = torch.randint(0, v, (b, t))
    return hidden, weight, labels


def _grads(fn, hidden, weight, labels, temperature, g_lp, g_ent):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fn(h, w, labels, temperature)
    loss = (lp * g_lp).sum() if lp.dim() else lp * g_lp.sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def test_values_and_gradients_match_materialised_logits():
    hidden, weight, labels = _problem()
    n = labels.numel()
    g_lp, g_ent = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)

    def ours(h, w, y, temp):
        # Positional, as verl's forwards call it.
        return linear_cross_entropy(h, w, y, temp, "none")

    lp, ent, dh, dw = _grads(ours, hidden, weight, labels, 0.7, g_lp, g_ent)
    lp_o, ent_o, dh_o, dw_o = _grads(_oracle, hidden, weight, labels, 0.7, g_lp, g_ent)
    assert lp.shape == ent.shape == (n,)
    torch.testing.assert_close(lp, lp_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent_o, rtol=1e-12, atol=1e-12)
    assert dh.shape == hidden.shape
    torch.testing.assert_close(dh, dh_o, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, dw_o, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["sum", "mean", "MEAN"])
def test_reductions_reduce_the_logprobs_only(reduction):
    hidden, weight, labels = _problem()
    n = labels.numel()
    g_ent = torch.randn(n, dtype=torch.float64)
    scale = torch.tensor(1.3, dtype=torch.float64)

    def ours(h, w, y, temp):
        return linear_cross_entropy(h, w, y, temp, reduction)

    def oracle(h, w, y, temp):
        lp, ent = _oracle(h, w, y, temp)
        return (lp.sum() if reduction == "sum" else lp.mean()), ent

    got = _grads(ours, hidden, weight, labels, 1.0, scale.expand(1), g_ent)
    want = _grads(oracle, hidden, weight, labels, 1.0, scale.expand(1), g_ent)
    assert got[0].dim() == 0 and got[1].shape == (n,)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_low_precision_inputs_give_fp32_outputs():
    hidden, weight, labels = _problem(dtype=torch.bfloat16)
    lp, ent = linear_cross_entropy(hidden, weight, labels)
    assert lp.dtype == ent.dtype == torch.float32
    # Three-way: no worse than bf16 torch (logits rounded to bf16) against the fp64 oracle.
    lp_o, ent_o = _oracle(hidden, weight, labels, 1.0)
    lp_16, ent_16 = _from_logits(hidden.reshape(-1, hidden.shape[-1]) @ weight.T, labels)
    assert_close_to_oracle(lp, lp_o, lp_16, 1e-5, "logprobs")
    assert_close_to_oracle(ent, ent_o, ent_16, 1e-5, "entropy")


def test_detached_entropy_leaves_the_logprob_gradient():
    hidden, weight, labels = _problem()
    n = labels.numel()
    g_lp = torch.randn(n, dtype=torch.float64)

    def ours(h, w, y, temp):
        lp, ent = linear_cross_entropy(h, w, y, temp, "none", None, entropy_grad=False)
        assert not ent.requires_grad
        # The entropy still enters the loss, with no effect on the gradient.
        return lp + 0 * ent, ent

    got = _grads(ours, hidden, weight, labels, 1.0, g_lp, None)
    want = _grads(_oracle, hidden, weight, labels, 1.0, g_lp, None)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_ignored_labels_read_zero():
    hidden, weight, labels = _problem()
    labels[0, :3] = -100
    lp, ent = linear_cross_entropy(hidden, weight, labels)
    assert torch.all(lp.view_as(labels)[0, :3] == 0)
    assert torch.all(ent.view_as(labels)[0, :3] == 0)
    lp_o, _ = _oracle(hidden, weight, labels.clamp_min(0), 1.0)
    torch.testing.assert_close(lp.view_as(labels)[1:], lp_o.view_as(labels)[1:])


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(reduction="avg"), "reduction"), (dict(temperature="1.0"), "temperature")],
)
def test_bad_arguments_raise(kwargs, match):
    hidden, weight, labels = _problem()
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(hidden, weight, labels, **kwargs)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:, :-1])


# ---------------------------------------------------------------- vocab-parallel on gloo

SPLIT = [20, 17]  # uneven contiguous vocabulary slices, in rank order


def _tp_worker(rank, world):
    torch.manual_seed(0)  # every rank builds the same full problem
    hidden, weight, labels = _problem(v=sum(SPLIT))
    n = labels.numel()
    g_lp, g_ent = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    lo = sum(SPLIT[:rank])
    hi = lo + SPLIT[rank]
    group = dist.new_group([0, 1])

    def ours(h, w, y, temp):
        return linear_cross_entropy(h, w[lo:hi], y, temp, "none", group)

    lp, ent, dh, dw = _grads(ours, hidden, weight, labels, 0.9, g_lp, g_ent)
    lp_o, ent_o, dh_o, dw_o = _grads(_oracle, hidden, weight, labels, 0.9, g_lp, g_ent)
    torch.testing.assert_close(lp, lp_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, dh_o, rtol=1e-10, atol=1e-12)
    # Each rank's weight gradient is its own slice of the full one.
    torch.testing.assert_close(dw[lo:hi], dw_o[lo:hi], rtol=1e-10, atol=1e-12)
    assert torch.all(dw[:lo] == 0) and torch.all(dw[hi:] == 0)


def test_vocab_parallel_over_the_tp_group_on_gloo():
    run_on_gloo(2, _tp_worker)


# ---------------------------------------------------------------- switch inside verl


def test_enable_routes_verl_forward_and_disable_restores():
    import verl.utils.kernel.linear_cross_entropy as kernel
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.models.transformers.dense_common import forward_with_triton_backend

    verl_own = kernel.linear_cross_entropy
    config = LlamaConfig(vocab_size=53, hidden_size=40, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).double().eval()
    ids = torch.randint(0, 53, (2, 9))
    mask = torch.ones_like(ids)
    try:
        enable_fused_head()
        enable_fused_head()  # idempotent: the original is not lost
        assert fused_head_enabled() and kernel.linear_cross_entropy is linear_cross_entropy
        with torch.no_grad():
            out = forward_with_triton_backend(model, input_ids=ids, attention_mask=mask,
                                              return_dict=True, temperature=0.5)
            logits = model(input_ids=ids, attention_mask=mask).logits
        logp = torch.log_softmax(logits / 0.5, dim=-1)
        rolled = torch.roll(ids, shifts=-1, dims=-1)
        want_lp = logp.gather(-1, rolled.unsqueeze(-1)).squeeze(-1).reshape(-1)
        want_ent = -(logp.exp() * logp).sum(-1).reshape(-1)
        torch.testing.assert_close(out.log_probs, want_lp, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out.entropy, want_ent, rtol=1e-10, atol=1e-10)

        enable_fused_head(entropy_grad=False)
        assert fused_head_enabled() and kernel.linear_cross_entropy is not verl_own
    finally:
        disable_fused_head()
    assert not fused_head_enabled() and kernel.linear_cross_entropy is verl_own
    disable_fused_head()  # a second call is a no-op
    assert kernel.linear_cross_entropy is verl_own


def test_enable_reaches_modules_that_bound_the_name_at_import():
    import sys
    import types

    import verl.utils.kernel.linear_cross_entropy as kernel

    verl_own = kernel.linear_cross_entropy
    # Stand-in for verl.models.mcore.model_forward_fused (needs megatron to import): a module
    # that did `from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy`.
    name = "verl.models.mcore.model_forward_fused"
    fake = types.ModuleType(name)
    fake.linear_cross_entropy = verl_own
    saved = sys.modules.get(name)
    sys.modules[name] = fake
    try:
        enable_fused_head()
        assert fake.linear_cross_entropy is linear_cross_entropy
        disable_fused_head()
        assert fake.linear_cross_entropy is verl_own
    finally:
        disable_fused_head()
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
