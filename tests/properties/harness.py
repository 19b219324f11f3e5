"""Running one policy-loss case both ways: the library in the batch's layout, and the plain-loop
fp64 reference on the ``[B, T]`` grid; gradients come back on the grid for comparison."""

import torch

from logitless import PolicyLossConfig, policy_loss
from logitless import reference as ref
from properties.strategies import PolicyBatch


def configs(kw, batch: PolicyBatch):
    """(the library's config, the reference's): per-token clip bounds laid out like the call's
    logprobs for the library, as ``[B, T]`` grids for the reference."""
    kw = dict(kw)
    if batch.layout.packed and kw.get("max_response_length") is None:
        kw["max_response_length"] = batch.layout.width  # the padded default, made explicit
    if batch.eps is None:
        cfg = PolicyLossConfig(**kw)
        return cfg, cfg
    ours = PolicyLossConfig(**dict(kw, eps_low=batch.pack(batch.eps[0]),
                                   eps_high=batch.pack(batch.eps[1])))
    theirs = PolicyLossConfig(**dict(kw, eps_low=batch.eps[0], eps_high=batch.eps[1]))
    return ours, theirs


def run_library(batch: PolicyBatch, cfg, training_progress=None):
    lp = batch.pack(batch.lp).clone().requires_grad_(True)
    ent = batch.pack(batch.entropy).clone().requires_grad_(True)
    loss, metrics = policy_loss(
        lp, batch.pack(batch.old), batch.pack(batch.adv), batch.pack(batch.mask), cfg,
        ref_logprobs=batch.pack(batch.ref), rollout_logprobs=batch.pack(batch.rollout),
        entropy=ent, token_weights=batch.pack(batch.token_weights),
        attention_entropy=batch.pack(batch.attention_entropy),
        cu_seqlens=batch.layout.cu_seqlens if batch.layout.packed else None,
        training_progress=training_progress)
    g_lp, g_ent = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
    return loss.detach(), _grid(batch, g_lp), _grid(batch, g_ent), metrics


def _grid(batch, g):
    """A gradient back on the ``[B, T]`` grid (zeros where there is none)."""
    out = torch.zeros_like(batch.lp)
    if g is None:
        return out
    if batch.layout.packed:
        out[batch.layout.mask] = g
        return out
    return g


def run_reference(batch: PolicyBatch, cfg, training_progress=None):
    lp = batch.lp.clone().requires_grad_(True)
    ent = batch.entropy.clone().requires_grad_(True)
    loss = ref.policy_loss_reference(
        lp, batch.old, batch.adv, batch.mask, cfg, ref=batch.ref, entropy=ent,
        rollout=batch.rollout, token_weights=batch.token_weights,
        attention_entropy=batch.attention_entropy, training_progress=training_progress)
    if not loss.requires_grad:
        return loss.detach(), torch.zeros_like(lp), torch.zeros_like(ent)
    g_lp, g_ent = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
    zero = torch.zeros_like(lp)
    return loss.detach(), zero if g_lp is None else g_lp, zero if g_ent is None else g_ent


def close(got, want, name, rtol=1e-9, atol=1e-12):
    """Elementwise ``|got - want| <= rtol * max|want| + atol`` (fp64 round-off on sums)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= rtol * scale + atol, f"{name}: error {err:.3e} at scale {scale:.3e}"
