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

from logitless.fused_losses.head.logprobs import linear_logprobs
from logitless.integrations.verl_head import (
    disable_fused_head,
    enable_fused_head,
    fused_head_enabled,
    linear_cross_entropy,
)

from testing import SequenceParallelGather, assert_close_to_oracle, run_on_gloo


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


# ---------------------------------------------------------------- tensor-parallel on gloo
#
# verl's Megatron forwards (verl.models.mcore.model_forward_fused) run the head as
#     hidden = gather_from_sequence_parallel_region(hidden)   # [s/TP, 1, D] -> [s, 1, D]
#     logprobs, entropy = linear_cross_entropy(hidden, weight_r, labels, temp, "none", tp_group)
# with labels [1, s] (packed). The gather's backward reduce-scatters, so it sums the ranks'
# hidden gradients itself: the head must return each rank's partial gradient, as verl's own
# kernel does (efficient_entropy_backward has no all-reduce of d_hidden).

SPLIT = [20, 17, 13]  # uneven contiguous vocabulary slices, in rank order
SEQ = 12  # divisible by the 3 ranks, as Megatron's sequence parallelism needs


def _megatron_worker(rank, world, head, device, dim):
    torch.manual_seed(0)  # every rank builds the same full problem
    dtype = torch.float64 if device == "cpu" else torch.float32
    v = sum(SPLIT)
    hidden = torch.randn(SEQ, 1, dim, dtype=dtype)
    weight = torch.randn(v, dim, dtype=dtype) / dim**0.5
    labels = torch.randint(0, v, (1, SEQ))  # [1, s] against hidden's [s, 1]: verl flattens
    g_lp, g_ent = torch.randn(SEQ, dtype=dtype), torch.randn(SEQ, dtype=dtype)
    lo, hi = sum(SPLIT[:rank]), sum(SPLIT[: rank + 1])
    rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)

    shard = hidden[rows].clone().to(device).requires_grad_(True)
    w_r = weight[lo:hi].clone().to(device).requires_grad_(True)
    full = SequenceParallelGather.apply(shard)
    lp, ent = head(full, w_r, labels.to(device), 0.9, "none", dist.group.WORLD)
    ((lp * g_lp.to(device)).sum() + (ent * g_ent.to(device)).sum()).backward()

    lp_o, ent_o, dh_o, dw_o = _grads(_oracle, hidden.double(), weight.double(),
                                     labels.reshape(-1), 0.9, g_lp.double(), g_ent.double())
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(lp.cpu().double(), lp_o, **tol)
    torch.testing.assert_close(ent.cpu().double(), ent_o, **tol)
    # This rank's sequence shard of the full hidden gradient, once the reduce-scatter has summed
    # the ranks' partial gradients (an op that sums them itself gives TP times this).
    torch.testing.assert_close(shard.grad.cpu().double(), dh_o[rows], **tol)
    torch.testing.assert_close(w_r.grad.cpu().double(), dw_o[lo:hi], **tol)


@pytest.mark.dist  # gloo ranks, as every multi-process test: make test-dist
def test_megatron_sequence_parallel_gradients_on_gloo():
    run_on_gloo(3, _megatron_worker, linear_cross_entropy, "cpu", 50)


def _verl_head(*args):
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl_own

    return verl_own(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="verl's kernel needs CUDA")
def test_verl_own_kernel_passes_the_same_megatron_check():
    # The same harness with verl's own kernel (CUDA only: it asserts is_cuda), which pins the
    # contract the drop-in follows; its hidden size must be a multiple of 128.
    run_on_gloo(3, _megatron_worker, _verl_head, "cuda", 128)


def test_hidden_grad_must_be_sum_or_partial():
    hidden, weight, labels = _problem()
    with pytest.raises(ValueError, match="hidden_grad"):
        linear_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                        hidden_grad="mean")


# ---------------------------------------------------------------- switch inside verl


def test_enable_routes_verl_forward_and_disable_restores():
    pytest.importorskip("verl", reason="verl is installed by `make test`")
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
    pytest.importorskip("verl", reason="verl is installed by `make test`")
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


# ------------------------------------------------------- FSDP2 (verl's apply_fsdp2) on gloo


def _fsdp2_worker(rank, world):
    import types

    """verl's FSDP2 wrapping (``apply_fsdp2``: the layers, the embedding and ``lm_head`` each
    sharded) and its fused forward: ``lm_head.weight`` reaches our drop-in a ``Shard(0)``
    DTensor. Each rank scores its own batch (unequal sizes); every parameter's gradient (FSDP2
    averages the others, our head its own shard) equals that of ``mean_r loss_r`` in one
    process, and the outputs that rank's own."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.models.transformers.dense_common import forward_with_triton_backend
    from verl.utils.fsdp_utils import apply_fsdp2

    config = LlamaConfig(vocab_size=53, hidden_size=40, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).double()
    sharded = LlamaForCausalLM(config).double()
    sharded.load_state_dict(plain.state_dict())
    for model in (plain, sharded):  # verl's fused forward, as its monkey patch installs it
        model.forward = types.MethodType(forward_with_triton_backend, model)
    apply_fsdp2(sharded, {"mesh": init_device_mesh("cpu", (world,))}, {})
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 53, (1 + r % 2, 5 + 2 * r), generator=gen) for r in range(world)]
    upstream = [(torch.randn(ids.numel(), generator=gen, dtype=torch.float64),
                 torch.randn(ids.numel(), generator=gen, dtype=torch.float64)) for ids in batches]

    def loss(model, r):
        ids = batches[r]
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True,
                    temperature=0.7)
        g_lp, g_ent = upstream[r]
        return (out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(), out

    try:
        enable_fused_head()
        wanted = [loss(plain, r) for r in range(world)]
        (sum(x for x, _ in wanted) / world).backward()
        assert type(sharded.lm_head.weight).__name__ == "DTensor"
        got, out = loss(sharded, rank)
        got.backward()
    finally:
        disable_fused_head()
    torch.testing.assert_close(got.detach(), wanted[rank][0].detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.entropy, wanted[rank][1].entropy.detach(), rtol=1e-10,
                               atol=1e-10)
    params = dict(plain.named_parameters())
    for name, p in sharded.named_parameters():
        assert type(p.grad).__name__ == "DTensor", name
        if world == 3 and name.startswith("model.") and name != "model.norm.weight":
            # FSDP2 itself, without logitless, on 3 gloo ranks: the wrapped layers' and the
            # embedding's gradients come out ~5e-8 relative off one process's in fp64 (the
            # root's norm and the head exact), so those are compared on 2 ranks
            continue
        torch.testing.assert_close(p.grad.full_tensor(), params[name].grad, rtol=1e-9,
                                   atol=1e-11, msg=name)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_verl_fsdp2_head_without_gather(world):
    pytest.importorskip("verl", reason="verl is installed by `make test`")
    run_on_gloo(world, _fsdp2_worker)


def test_policy_loss_head_dtype_reaches_the_head():
    """``policy_loss.head_dtype`` (LogitlessPolicyLossConfig) sets every later head call's
    precision: bf16 hidden states give the fp32 head's logprobs; a bad value is refused under
    the config key's name."""
    pytest.importorskip("verl", reason="verl is installed by `make test`")
    from logitless.integrations.verl import LogitlessPolicyLossConfig
    from logitless.integrations.verl_head import head_dtype, set_head_dtype

    hidden, weight, labels = (x.to(torch.bfloat16) if x.is_floating_point() else x
                              for x in _problem(v=301))
    try:
        LogitlessPolicyLossConfig(loss_mode="logitless_grpo", head_dtype="float32")
        assert head_dtype() == "float32"
        lp, ent = linear_cross_entropy(hidden, weight, labels, 0.8)
        want = linear_logprobs(hidden.reshape(-1, 50), weight, labels.reshape(-1),
                               temperature=0.8, return_entropy=True, head_dtype="float32")
        assert torch.equal(lp, want.logprobs) and torch.equal(ent, want.entropy)
        oracle, _ = _oracle(hidden, weight, labels, 0.8)
        assert float((lp.double() - oracle).abs().max()) < 1e-4  # no bf16 logits
        with pytest.raises(ValueError, match=r"^policy_loss\.head_dtype must be None"):
            LogitlessPolicyLossConfig(loss_mode="logitless_grpo", head_dtype="fp32")
    finally:
        set_head_dtype(None)
    assert head_dtype() is None
