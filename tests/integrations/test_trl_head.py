"""The TRL kernel swaps honour ChunkedLogProbFunction's and ChunkedDivergenceFunction's
contracts (values, gradients, outputs, refusals)."""

import pytest
import torch

from logitless.integrations import trl_head

from testing import assert_close_to_oracle, tied_head_inputs

trl_kernels = pytest.importorskip("trl.kernels", reason="TRL is installed by `make test`")

OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def trl_reference(h, w, b, t, temperature, softcap, scale):
    """TRL's transform (softcap of the scaled logit) on materialised fp64 logits."""
    x = (h @ w.t() + b) * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    z = x / temperature
    logp = z.log_softmax(-1)
    p = logp.exp()
    return {
        "log_probs": logp.gather(-1, t[:, None]).squeeze(-1),
        "entropy": -(p * logp).sum(-1),
        "log_sum_sq_probs": torch.log((p * p).sum(-1)),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == t,
    }


@pytest.mark.parametrize("softcap,scale", [(None, 1.0), (5.0, 1.0), (4.0, 1.7), (3.0, -0.5)])
def test_swap_matches_trl_contract(softcap, scale):
    n, d, v = 29, 48, 1007
    h = torch.randn(n, d)
    w = torch.randn(v, d) / d**0.5
    b = torch.randn(v)
    t = torch.randint(0, v, (n,))
    t[:5] = (h[:5] @ w.t() + b).argmax(-1) if scale > 0 else t[:5]
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    ours = trl_head.LogitlessChunkedLogProb.apply(*leaves, t, 0.8, 4096, softcap, scale, OUTPUTS)
    theirs_leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    theirs = trl_kernels.ChunkedLogProbFunction.apply(*theirs_leaves, t, 0.8, 4096, softcap,
                                                      scale, OUTPUTS)
    leaves64 = [x.double().requires_grad_(True) for x in (h, w, b)]
    exact = trl_reference(*leaves64, t, 0.8, softcap, scale)
    names = ("log_probs", *OUTPUTS)
    for name, a, c in zip(names, ours, theirs):
        if name == "is_top1":
            assert torch.equal(a, exact[name]) and torch.equal(c, exact[name])
            continue
        assert a.dtype == torch.float32
        assert_close_to_oracle(a, exact[name], c, tol=1e-5, name=name)
    assert not ours[2].requires_grad and not ours[3].requires_grad
    g = torch.randn(n), torch.randn(n)
    grads = torch.autograd.grad(ours[0] @ g[0] + ours[1] @ g[1], leaves)
    trl_grads = torch.autograd.grad(theirs[0] @ g[0] + theirs[1] @ g[1], theirs_leaves)
    exact_grads = torch.autograd.grad(exact["log_probs"] @ g[0].double()
                                      + exact["entropy"] @ g[1].double(), leaves64)
    for name, a, c, e in zip(("hidden", "weight", "bias"), grads, trl_grads, exact_grads):
        assert_close_to_oracle(a, e, c, tol=1e-5 * float(e.abs().max()), name=f"d_{name}")


@pytest.mark.parametrize("chunk_size", [4096, 200])
def test_is_top1_ties_match_trl(chunk_size):
    """Tied maxima: the patched head and TRL's own kernel agree on which target is top-1."""
    hidden, weight, bias, targets = (x.float() if x.is_floating_point() else x
                                     for x in tied_head_inputs())
    args = (hidden, weight, bias, targets, 1.0, chunk_size, None, 1.0, ("is_top1",))
    ours = trl_head.LogitlessChunkedLogProb.apply(*args)[4]
    theirs = trl_kernels.ChunkedLogProbFunction.apply(*args)[4]
    logits = hidden @ weight.t() + bias
    at_max = logits.gather(1, targets[:, None]).squeeze(1) == logits.amax(-1)
    assert theirs.any() and (at_max & ~theirs).any()  # TRL sees both kinds of tie
    assert torch.equal(ours, theirs)


def test_patch_and_unpatch():
    import trl.trainer.distillation_trainer as distillation
    import trl.trainer.utils as trl_utils
    from torch.distributed.tensor import DTensor

    original = trl_utils._ChunkedLogProbFunction
    original_divergence = distillation.ChunkedDivergenceFunction
    trl_head.patch_trl()
    try:
        assert trl_head.trl_patched()
        assert trl_utils._ChunkedLogProbFunction is trl_head.LogitlessChunkedLogProb
        assert distillation.ChunkedDivergenceFunction is trl_head.LogitlessChunkedDivergence
        # TRL's gather of an FSDP2 head is off while our kernel is in (it runs sharded)
        assert trl_utils.DTensor is trl_head.KeepShardedHead
        trl_head.patch_trl()  # idempotent
    finally:
        trl_head.unpatch_trl()
    assert trl_utils._ChunkedLogProbFunction is original
    assert distillation.ChunkedDivergenceFunction is original_divergence
    assert trl_utils.DTensor is DTensor
    assert not trl_head.trl_patched()


def _divergence_inputs(seed):
    n, d, d_t, v = 37, 48, 40, 1007
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    return [r(n, d), r(v, d) * 2 / d**0.5, r(v) * 0.5, r(n, d_t), r(v, d_t) * 2 / d_t**0.5,
            r(v) * 0.5]


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_divergence_swap_matches_trl_contract(beta, scale):
    """LogitlessChunkedDivergence.apply against TRL's ChunkedDivergenceFunction.apply (fp32)
    and fp64 materialised logits: per-token divergence, student entropy, student gradients."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    x = _divergence_inputs(int(beta * 10) + int(scale * 10))
    ours_in = [t.clone().requires_grad_(i < 3) for i, t in enumerate(x)]
    their_in = [t.clone().requires_grad_(i < 3) for i, t in enumerate(x)]
    exact_in = [t.double().requires_grad_(i < 3) for i, t in enumerate(x)]
    args = (beta, 0.8, scale, None, scale, None)
    ours = trl_head.LogitlessChunkedDivergence.apply(*ours_in, *args)
    theirs = ChunkedDivergenceFunction.apply(*their_in, *args)
    hs, ws, bs, ht, wt, bt = exact_in
    log_s = ((hs @ ws.t() + bs) * scale / 0.8).log_softmax(-1)
    log_t = ((ht @ wt.t() + bt) * scale / 0.8).log_softmax(-1)
    kl = lambda a, b: (a.exp() * (a - b)).sum(-1)  # KL(a || b) from log-probs
    if beta == 0.0:
        div = kl(log_t, log_s)
    elif beta == 1.0:
        div = kl(log_s, log_t)
    else:
        log_m = torch.logaddexp(log_s + torch.log1p(torch.tensor(-beta, dtype=torch.float64)),
                                log_t + torch.log(torch.tensor(beta, dtype=torch.float64)))
        div = beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)
    exact = (div, -(log_s.exp() * log_s).sum(-1))
    for name, a, c, e in zip(("divergence", "entropy"), ours, theirs, exact):
        assert a.dtype == torch.float32 and a.shape == (37,)
        assert_close_to_oracle(a, e, c, tol=1e-6 * float(e.abs().max()), name=name)
    assert not ours[1].requires_grad
    g = torch.randn(37)
    grads = torch.autograd.grad(ours[0] @ g, ours_in[:3])
    trl_grads = torch.autograd.grad(theirs[0] @ g, their_in[:3])
    exact_grads = torch.autograd.grad(exact[0] @ g.double(), exact_in[:3])
    for name, a, c, e in zip(("hidden", "weight", "bias"), grads, trl_grads, exact_grads):
        assert_close_to_oracle(a, e, c, tol=1e-5 * float(e.abs().max()), name=f"d_{name}")


@pytest.mark.parametrize("change, match", [
    (dict(student_final_logit_softcapping=30.0), "student_final_logit_softcapping"),
    (dict(teacher_final_logit_softcapping=30.0), "teacher_final_logit_softcapping"),
    (dict(student_logit_scale=0.5), "one finite logit_scale > 0 shared by both heads"),
    (dict(student_logit_scale=-1.0, teacher_logit_scale=-1.0), "logit_scale > 0"),
    (dict(beta=1.5), "beta"),
    (dict(temperature=0.0), "temperature"),
])
def test_divergence_swap_refuses_outside_its_range(change, match):
    kw = dict(beta=0.5, temperature=1.0, student_logit_scale=1.0,
              student_final_logit_softcapping=None, teacher_logit_scale=1.0,
              teacher_final_logit_softcapping=None)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        trl_head.LogitlessChunkedDivergence.apply(*_divergence_inputs(0), **kw)


def test_unsupported_trl_is_refused(monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.99.0")
    with pytest.raises(RuntimeError, match=r"supports TRL >=1\.16,<1\.17"):
        trl_head.patch_trl()


def _fused_head_step(model, ids):
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


def test_cast_lm_head_to_fp32_on_bf16_model_matches_trl():
    """TRL's `add_fused_lm_head(model, cast_lm_head_to_fp32=True)` on a bf16 model hands the
    head fp32 hidden states and the model's own head weight: patched, the same outputs and
    gradients (in each parameter's dtype) as TRL's kernel."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = Qwen2Config(vocab_size=301, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    add_fused_lm_head(model, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, config.vocab_size, (2, 9))
    theirs, their_grads = _fused_head_step(model, ids)
    trl_head.patch_trl()
    try:
        ours, our_grads = _fused_head_step(model, ids)
    finally:
        trl_head.unpatch_trl()
    for name in ("log_probs", "entropy"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for name, g in our_grads.items():
        assert g.dtype == their_grads[name].dtype, name
        # bf16 gradients: both sum in fp32 and round once; the order of the sums may move
        # a value by one bf16 step.
        step = torch.finfo(g.dtype).eps
        torch.testing.assert_close(g.float(), their_grads[name].float(), rtol=step,
                                   atol=step * float(their_grads[name].float().abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("softcap,scale", [(0.0, 1.0), (0.0, 2.5), (None, 0.0), (5.0, 0.0),
                                           (0.0, 0.0)])
def test_zero_softcap_and_zero_scale_as_trl(softcap, scale):
    """TRL's kernel takes final_logit_softcapping=0.0 (it caps at 1.0) and logit_scale=0.0
    (all logits 0: uniform, zero gradients); the patched head does what it does."""
    n, d, v = 13, 24, 301
    h, w, b = torch.randn(n, d), torch.randn(v, d) / d**0.5 * 4, torch.randn(v)
    t = torch.randint(1, v, (n,))
    t[0] = 0  # with constant logits only token 0, the first maximum, is top-1
    results = []
    for fn in (trl_head.LogitlessChunkedLogProb, trl_kernels.ChunkedLogProbFunction):
        leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
        out = fn.apply(*leaves, t, 0.8, 128, softcap, scale, OUTPUTS)
        grads = torch.autograd.grad(out[0].sum() + out[1].sum(), leaves)
        results.append((out, grads))
    (ours, our_grads), (theirs, their_grads) = results
    for name, a, c in zip(("log_probs", *OUTPUTS), ours, theirs):
        if name == "is_top1":
            assert torch.equal(a, c)
        else:
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=name)
    for a, c in zip(our_grads, their_grads):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5 * float(c.abs().max()))
