"""Gradients at low temperatures (issue 40, item 5): at every temperature, down to the 1e-5
that TRL and verl accept, the head's gradients are at least as accurate as fp32 autograd on
the materialised logits (``log_softmax``), on both backends.

The backward recomputes ``p``; it used to take it as ``exp(z - lse)`` with an fp32 ``lse`` of
the logits' size (1e4 for logits of 10 at T = 1e-3), whose rounding is an error of every ``p``
that the chain factor ``1 / T`` multiplies: ``d_hidden`` off by 1.4 (Triton) and 0.18 (torch)
at T = 1e-3 where fp32 autograd is off by 1e-5. The same held for the two-head divergences,
``linear_topk_distill`` and ``fused_policy_loss``'s torch chunk store (the tests below).

The inputs are multiples of 1/64 and the temperatures powers of two, so every logit ``x / T``
is exact in fp32 whatever the GEMM: the three-way check then measures the softmax's
arithmetic, not which of two roundings of a near tie happened to land closer. Most targets
are the argmax, as a sample at a low temperature is, where the true gradient is small and an
error in ``p`` at the maximum is not.
"""

import pytest
import torch

import logitless
from logitless import reference

from testing import requires_triton

BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]
# 2^-17 (7.6e-6), 2^-10 (1e-3), 2^-7 (7.8e-3), 2^-5 (0.031), 2^-3 (0.125) and 1.
TEMPERATURES = [2.0**-17, 2.0**-10, 2.0**-7, 2.0**-5, 2.0**-3, 1.0]
N, D, V = 37, 48, 1007


def _dyadic(x, bits=6):
    return (x * 2**bits).round() / 2**bits


def _problem(seed, scale, temperature):
    """fp32 inputs of a few bits each (exact logits), the head's first rows repeated with a
    bias lower by 1/4 to 4 temperatures (every token then has a near tie at its maximum, the
    case a sample at a low temperature meets and an error in ``p`` shows), targets the argmax
    but for every fifth row, and upstream gradients of the logprobs and the entropy."""
    gen = torch.Generator().manual_seed(seed)
    half = V // 2
    hidden = _dyadic(torch.randn(N, D, generator=gen))
    base = _dyadic(torch.randn(V - half, D, generator=gen) * (scale / D**0.5))
    b = _dyadic(torch.randn(V - half, generator=gen) * 0.5)
    gap = 2.0 ** torch.randint(-2, 3, (half,), generator=gen) * temperature
    weight, bias = torch.cat([base, base[:half]]), torch.cat([b, b[:half] - gap])
    logits = hidden.double() @ weight.double().t() + bias.double()
    targets = logits.argmax(-1)
    targets[::5] = torch.randint(0, V, (len(targets[::5]),), generator=gen)
    upstream = torch.randn(2, N, generator=gen)
    return hidden, weight, bias, targets, upstream


def _leaves_grads(fn, inputs, dtype):
    leaves = [None if x is None else x.to(dtype).clone().requires_grad_() for x in inputs]
    fn(*leaves).backward()
    return [x.grad.double() for x in leaves if x is not None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", TEMPERATURES, ids=lambda t: f"T{t:.3g}")
@pytest.mark.parametrize(("seed", "scale"), [(0, 2.0), (1, 5.0)])
def test_low_temperature_gradients_as_accurate_as_fp32_autograd(backend, temperature, seed,
                                                                scale, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, b, targets, upstream = _problem(seed, scale, temperature)

    def loss_of(lp, ent):
        return (lp * upstream[0].to(lp.dtype)).sum() + (ent * upstream[1].to(ent.dtype)).sum()

    def materialised(h, w, bias_):
        z = reference.linear_logits(h, w, bias_, temperature=temperature)
        logp = torch.log_softmax(z, -1)
        return loss_of(logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1))

    def fused(h, w, bias_):
        out = logitless.linear_logprobs(h, w, targets, bias=bias_, temperature=temperature,
                                        return_entropy=True)
        return loss_of(out.logprobs, out.entropy)

    inputs = (hidden, weight, b)
    exact = _leaves_grads(materialised, inputs, torch.float64)
    same = _leaves_grads(materialised, inputs, torch.float32)
    got = _leaves_grads(fused, inputs, torch.float32)
    # Slack: one fp32 rounding of each token's upstream gradient at its target's logit (the
    # ``g (1 - p_y)`` both sides cancel), through the chain factor 1 / T: tiny next to the
    # errors this guards against (0.7 at T = 2^-10, 1e4 at 2^-17).
    eps = torch.finfo(torch.float32).eps
    one_hot = torch.zeros(N, V, dtype=torch.float64)
    one_hot[torch.arange(N), targets] = upstream.abs().sum(0).double() / temperature
    slack = [eps * t.max() for t in (one_hot @ weight.double().abs(),
                                          one_hot.t() @ hidden.double().abs(), one_hot.sum(0))]
    for name, g, s, e, tol in zip(("d_hidden", "d_weight", "d_bias"), got, same, exact, slack):
        err, err_same = float((g - e).abs().max()), float((s - e).abs().max())
        assert err <= 2 * err_same + tol, \
            f"{name}: {err:.2e} vs fp32 autograd {err_same:.2e} (+ {float(tol):.1e})"


def _distill_problem(seed, scale, temperature):
    """`_problem`'s student and a teacher of its own hidden size: the student's head with its
    bias moved by 1/4 to 4 temperatures either way per column, so that the two distributions
    overlap at every temperature (each token's top tokens are near ties in both heads)."""
    hidden, weight, bias, targets, upstream = _problem(seed, scale, temperature)
    gen = torch.Generator().manual_seed(seed + 100)
    shift = 2.0 ** torch.randint(-2, 3, (V,), generator=gen) * temperature
    sign = torch.randint(0, 2, (V,), generator=gen) * 2.0 - 1.0
    t_weight = torch.cat([weight, _dyadic(torch.randn(V, 8, generator=gen) * 0.25)], 1)
    t_hidden = torch.cat([hidden, torch.zeros(N, 8)], 1)  # the teacher's extra features: 0
    return hidden, weight, bias, t_hidden, t_weight, bias + sign * shift, targets, upstream


def _check_like_fp32_autograd(loss, inputs, fused, roundings=1):
    """``fused``'s gradients of ``(hidden, weight, bias)`` within twice fp32 autograd's error
    on ``loss(logits)`` (the student's materialised logits before the temperature) plus
    ``roundings`` fp32 roundings of every logit gradient. The slack: a two-head gradient's
    error is a few roundings of each element, whose sum through the GEMMs cancels by luck
    more in one order than in another (the KLs: the same elementwise error as fp32 autograd,
    0.5-4x its error after the GEMMs), while the errors this guards against are 10-1e4x."""
    hidden, weight, bias = inputs

    def materialised(h, w, b):
        return loss(reference.linear_logits(h, w, b))

    exact = _leaves_grads(materialised, inputs, torch.float64)
    same = _leaves_grads(materialised, inputs, torch.float32)
    got = _leaves_grads(fused, inputs, torch.float32)
    z = reference.linear_logits(hidden.double(), weight.double(), bias.double())
    dz = torch.autograd.grad(loss(z.requires_grad_()), z)[0].abs()
    eps = torch.finfo(torch.float32).eps
    slack = [roundings * eps * t.max()
             for t in (dz @ weight.double().abs(), dz.t() @ hidden.double().abs(), dz.sum(0))]
    for name, g, s, e, tol in zip(("d_hidden", "d_weight", "d_bias"), got, same, exact, slack):
        err, err_same = float((g - e).abs().max()), float((s - e).abs().max())
        assert err <= 2 * err_same + tol, \
            f"{name}: {err:.2e} vs fp32 autograd {err_same:.2e} (+ {float(tol):.1e})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", TEMPERATURES, ids=lambda t: f"T{t:.3g}")
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_gradients_as_accurate_as_fp32_autograd(backend, temperature, beta,
                                                           monkeypatch):
    """``linear_divergence`` (forward KL, JSD, reverse KL): the student's gradients against
    ``reference.generalized_jsd`` (``log_softmax`` of both heads' materialised logits) in fp32
    autograd, from the fp64 one. Its backward used to recompute ``p_s`` and ``p_t`` from fp32
    ``lse``s of the logits' size (and the Triton passes folded ``x k - m k``): the reverse KL's
    ``d_hidden`` was 5.7-7.5x fp32 autograd's error at T = 0.03."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, b, t_hidden, t_weight, t_bias, _, upstream = _distill_problem(
        0, 3.0, temperature)

    def loss(zs):
        zt = reference.linear_logits(*(x.to(zs.dtype) for x in (t_hidden, t_weight, t_bias)))
        div = reference.generalized_jsd(zs, zt, beta, temperature)
        return (div * upstream[0].to(div.dtype)).sum()

    def fused(h, w, bias_):
        div = logitless.linear_divergence(h, w, t_hidden, t_weight, beta=beta,
                                          temperature=temperature, bias=bias_,
                                          teacher_bias=t_bias).divergence
        return (div * upstream[0].to(div.dtype)).sum()

    # The JSD's logit gradient (1 - beta) p_s (w - E_s[w]) takes log p_s, log p_t, the
    # softplus w and the mean E_s[w] each rounded once, then the difference w - E_s[w]
    # (a few tenths where w is -0.6): that formula in fp32 on materialised logits is 2.7x
    # fp32 autograd's elementwise error at T = 1/8, so four roundings, not one.
    _check_like_fp32_autograd(loss, (hidden, weight, b), fused, 1 if beta in (0.0, 1.0) else 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", TEMPERATURES, ids=lambda t: f"T{t:.3g}")
def test_topk_distill_gradients_as_accurate_as_fp32_autograd(backend, temperature,
                                                             monkeypatch):
    """``linear_topk_distill``: its backward recomputed ``p`` as ``exp(z - lse)`` too."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, b, t_hidden, t_weight, t_bias, _, upstream = _distill_problem(
        1, 3.0, temperature)
    zt = reference.linear_logits(t_hidden.double(), t_weight.double(), t_bias.double(),
                                 temperature=temperature)
    t_logp, ids = torch.log_softmax(zt, -1).topk(4, -1)
    t_logp = t_logp.float()

    def loss_of(loss):
        return (loss * upstream[0].to(loss.dtype)).sum()

    def loss(z):
        log_q = torch.log_softmax(z / temperature, -1).gather(-1, ids)
        return loss_of(reference.topk_forward_kl(log_q, t_logp.to(z.dtype), None, None))

    def fused(h, w, bias_):
        return loss_of(logitless.linear_topk_distill(h, w, ids, t_logp, temperature=temperature,
                                                     bias=bias_, log_prob_min_clamp=None,
                                                     loss_max_clamp=None))

    _check_like_fp32_autograd(loss, (hidden, weight, b), fused)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", TEMPERATURES, ids=lambda t: f"T{t:.3g}")
def test_fused_policy_loss_gradients_as_accurate_as_fp32_autograd(backend, temperature,
                                                                  monkeypatch):
    """``fused_policy_loss``, whose chunks keep their logits (``stored_logits_torch``): the torch
    store's backward took ``p = e exp(m_b - lse)`` with an fp32 ``lse`` of the logits' size,
    as the head's did. REINFORCE with an entropy bonus: a loss linear in the logprobs and the
    entropies, so the gradients measure the backward alone (a ratio's ``exp(lp - old)`` would
    add the forward logprobs' own rounding, the same on every path)."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, b, targets, upstream = _problem(2, 3.0, temperature)
    cfg = logitless.PolicyLossConfig(objective="reinforce", entropy_coef=0.01)
    gen = torch.Generator().manual_seed(3)
    z = reference.linear_logits(hidden.double(), weight.double(), b.double(),
                                temperature=temperature)
    old = (torch.log_softmax(z, -1).gather(-1, targets[:, None])[:, 0]
           + 0.1 * torch.rand(N, generator=gen, dtype=torch.float64) - 0.05).float()[None]
    adv, mask = upstream[:1], torch.ones(1, N, dtype=torch.bool)

    def loss(logits):
        logp = torch.log_softmax(logits / temperature, -1)
        lp = logp.gather(-1, targets[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        return logitless.policy_loss(lp[None], old.to(lp.dtype), adv.to(lp.dtype), mask, cfg,
                                     entropy=entropy[None])[0]

    def fused(h, w, bias_):
        return logitless.fused_policy_loss(h[None], w, targets[None], old, adv, mask, cfg,
                                           bias=bias_, temperature=temperature)[0]

    _check_like_fp32_autograd(loss, (hidden, weight, b), fused)
