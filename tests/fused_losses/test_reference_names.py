"""`logitless.reference` under the public ops' names (issue 23): each takes the fast op's
arguments and gives its numbers in fp64, values and gradients of hidden, weight and bias."""

import pytest
import torch

import logitless
from logitless import PolicyLossConfig, reference

B, T, D, V = 3, 13, 24, 1007


def _head(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) / D**0.5 * 2
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.3
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([[T], [T - 4], [5]])
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 6 - 1
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return hidden, weight, bias, targets, mask, old, adv


def _leaves(*xs):
    return [x.clone().requires_grad_(True) for x in xs]


def test_old_names_still_give_the_same_numbers():
    """The old name ``linear_softmax_stats`` and the public one give the softmax statistics of
    the soft-capped logits, each checked against ``log_softmax`` written out here (comparing
    the two names with each other could not fail: one calls the other)."""
    hidden, weight, bias, targets, *_ = _head(4)
    z = 5.0 * torch.tanh((hidden @ weight.t() + bias) / 5.0)
    log_p = torch.log_softmax(z, dim=-1)
    want = {"lse": torch.logsumexp(z, dim=-1),
            "logprobs": log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1),
            "entropy": -(log_p.exp() * log_p).sum(-1),
            "sum_p_sq": (log_p.exp() ** 2).sum(-1),
            "mean_logit": z.mean(-1),
            "is_top1": targets == z.argmax(-1)}
    public = reference.linear_logprobs(hidden, weight, targets, bias=bias, softcap=5.0,
                                       return_entropy=True,
                                       stats=("sum_p_sq", "mean_logit", "is_top1", "lse"))
    results = {"linear_logprobs": {k: v for k, v in vars(public).items() if v is not None},
               "linear_softmax_stats": reference.linear_softmax_stats(hidden, weight, targets,
                                                                      bias, softcap=5.0)}
    for name, got in results.items():
        assert got.keys() == want.keys(), name
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12,
                                       msg=f"{name}: {key}")


@pytest.mark.parametrize("truncation", [{}, {"top_k": 50, "top_p": 0.9}])
def test_linear_logprobs_by_the_public_name(truncation):
    hidden, weight, bias, targets, *_ = _head(1)
    opts = dict(temperature=0.7, **truncation)
    ours = logitless.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                     **opts)
    want = reference.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                     **opts)
    torch.testing.assert_close(ours.logprobs, want.logprobs, rtol=1e-9, atol=1e-9)
    assert ours.entropy is not None
    torch.testing.assert_close(ours.entropy, want.entropy, rtol=1e-9, atol=1e-9)


def test_policy_loss_by_the_public_name():
    hidden, weight, bias, targets, mask, old, adv = _head(2)
    stats = reference.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True)
    cfg = PolicyLossConfig(objective="grpo", entropy_coef=0.01)
    lp, ent = _leaves(stats.logprobs.detach(), stats.entropy.detach())
    ours, _ = logitless.policy_loss(lp, old, adv, mask, cfg, entropy=ent)
    lp2, ent2 = _leaves(lp.detach(), ent.detach())
    want = reference.policy_loss(lp2, old, adv, mask, cfg, entropy=ent2)
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)
    g_ours = torch.autograd.grad(ours, (lp, ent))
    g_want = torch.autograd.grad(want, (lp2, ent2))
    for a, b in zip(g_ours, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("objective", ["grpo", "gspo", "cispo"])
def test_fused_policy_loss_by_the_public_name(objective):
    hidden, weight, bias, targets, mask, old, adv = _head(3)
    targets = torch.where(mask, targets, -100)  # the fast op ignores these; so must the oracle
    cfg = PolicyLossConfig(objective=objective, entropy_coef=0.003)
    h1, w1, b1 = _leaves(hidden, weight, bias)
    ours, _ = logitless.fused_policy_loss(h1, w1, targets, old, adv, mask, cfg, bias=b1,
                                          temperature=0.8)
    h2, w2, b2 = _leaves(hidden, weight, bias)
    want = reference.fused_policy_loss(h2, w2, targets, old, adv, mask, cfg, bias=b2,
                                       temperature=0.8)
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-12)
    for a, b in zip(torch.autograd.grad(ours, (h1, w1, b1)),
                    torch.autograd.grad(want, (h2, w2, b2))):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11)
