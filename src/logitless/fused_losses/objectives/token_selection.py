"""Token selections and weights (docs/objectives.md, section 5) on right-padded ``[B, T]`` tensors.

Thresholds that depend on the whole batch (quantiles, batch statistics) are computed once, in
`policy_loss_globals` (``objectives/policy_loss.py``), and passed in here, so a chunk of
sequences is selected exactly as it would be inside the full batch.
"""

import torch

from logitless.fused_losses.objectives import segments
from logitless.fused_losses.objectives.aggregation import host_value
from logitless.fused_losses.oplib import Op, is_compiling


def quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolation quantile of a 1-D tensor (``torch.quantile``'s rule, any size)."""
    v = values.detach().flatten().sort().values
    pos = (v.numel() - 1) * q
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def masked_quantile(values: torch.Tensor, m: torch.Tensor, q: float):
    """`quantile` of ``values`` over the tokens of ``m``, and their count, both 0-d tensors,
    without boolean indexing or a host read (static shapes: traceable by ``torch.compile``).

    The masked-out entries become NaN, which ``sort`` places after every number, so the valid
    tokens come first (a NaN among them is NaN either way) and the count indexes them; the
    interpolation is `quantile`'s, in the same precisions (its position in fp64, the fraction
    rounded to the values' dtype), so the result is `quantile` of ``values[m]`` to the bit.
    With no valid token the value is meaningless (any comparison the caller makes is masked).
    """
    v = torch.where(m, values.detach(), torch.nan).flatten().sort().values
    n = m.sum()
    pos = (n - 1).clamp(min=0).to(torch.float64) * q
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
    if v.numel() == 0:  # no token at all: nothing to index
        return v.new_full((), torch.nan), n
    frac = (pos - lo.to(torch.float64)).to(v.dtype)
    lo_v, hi_v = v.gather(0, torch.stack([lo, hi])).unbind()
    return lo_v + (hi_v - lo_v) * frac, n


def top_fraction_threshold(values, m, fraction):
    """Smallest value kept when keeping the top ``fraction`` of ``values`` over valid tokens
    (TRL: ``quantile(values, 1 - fraction)``); None when no token is valid. Under
    ``torch.compile``, a 0-d tensor whatever the count (with no valid token, every token it
    selects from is masked anyway)."""
    thr, n = masked_quantile(values, m, 1.0 - fraction)
    if is_compiling():
        return thr
    return None if int(n) == 0 else thr


def stapo_keep(adv, old_lp, entropy, m, prob_threshold, entropy_threshold):
    """STAPO spurious tokens: A > 0, p_old < tau_p and H < tau_H are dropped (and the loss is
    renormalised over what remains: the result narrows the mask). p is the old policy's, so the
    mask is known before the forward pass."""
    spurious = (
        (adv > 0) & (torch.exp(old_lp) < prob_threshold) & (entropy.detach() < entropy_threshold)
    )
    return m & ~spurious


def attention_entropy_stats(hatt, m):
    """Batch mean and std (unbiased) of attention entropies over valid tokens (`host_value`:
    floats, 0-d tensors under ``torch.compile``; masked sums, no boolean indexing). Below two
    tokens there is no spread: std 0 (one token's ``z`` is 0 and its weight 1, as a sequence of
    one token standardised on its own); no token: mean 0."""
    h = hatt.detach()
    n = m.sum()
    mean = torch.where(m, h, 0.0).sum() / n.clamp(min=1)
    var = torch.where(m, (h - mean).square(), 0.0).sum() / (n - 1).clamp(min=1)
    std = torch.where(n >= 2, var.sqrt(), 0.0)
    return host_value(mean), host_value(std)


def attention_entropy_weights(hatt, m, cfg, *, stats=None, thresholds=None, progress=None):
    """Anchor/explorer weights from per-token attention entropies ``hatt [B, T]`` (detached).

    ``z`` is ``hatt`` standardised per sequence (or with the batch ``stats``); alpha follows a
    linear schedule from ``attn_entropy_alpha`` to ``attn_entropy_alpha_final`` over
    ``progress`` in [0, 1]. ``tanh``: ``w = 1 + alpha tanh(z)``; ``softmax``: ``w = L_i
    softmax_i(alpha z)`` (mean weight 1 per sequence); ``low_quantile`` / ``high_quantile``:
    keep the tokens below / above the batch quantile (``thresholds``; None when the batch has
    no valid token: every weight 0), weight 1.
    A NaN entropy at a valid token (a corrupted attention row) gives NaN weights, never a
    weight a clean token could have: the loss shows the corruption.
    """
    h = hatt.detach()
    mode = cfg.attn_entropy_weighting
    if mode in ("low_quantile", "high_quantile"):
        if thresholds is None:
            return torch.zeros_like(h)
        keep = h <= thresholds[0] if mode == "low_quantile" else h >= thresholds[1]
        w = (m & keep).to(h.dtype)
        return torch.where(m & h.isnan(), h, w)
    alpha = cfg.attn_entropy_alpha
    if cfg.attn_entropy_alpha_final is not None and progress is not None:
        alpha = alpha + (cfg.attn_entropy_alpha_final - alpha) * min(max(progress, 0.0), 1.0)
    if cfg.attn_entropy_standardize == "batch":
        mean, std = stats
        z = (h - mean) / (std + 1e-8)
    else:
        mean = segments.segment_mean(h, m)[:, None]
        var = segments.segment_mean((h - mean).square(), m)[:, None]
        z = (h - mean) / (var.sqrt() + 1e-8)
    z = torch.where(m, z, torch.zeros_like(z))
    if mode == "tanh":
        return 1 + alpha * torch.tanh(z)
    logits = torch.where(m, alpha * z, torch.full_like(z, -torch.inf))
    # A sequence without valid tokens softmaxes to NaN: 0 there; any other NaN is kept.
    soft = torch.softmax(logits, -1)
    soft = torch.where(m.any(-1, keepdim=True), soft, torch.zeros_like(soft))
    return soft * m.sum(-1, keepdim=True).to(h.dtype)


def future_kl_advantages(adv, lp, ref_lp, m, coef, group=None):
    """FRPO: ``A_t - coef * sum_{j >= t} m_j (lp_j - ref_j)``, the suffix sum detached."""
    return adv - coef * segments.suffix_sum((lp - ref_lp).detach(), m, group=group)


def probability_reweighted_advantages(adv, lp, alpha):
    """Lopti-style: ``A <- (alpha sg(p) + 1 - alpha) A``."""
    return (alpha * torch.exp(lp.detach()) + 1 - alpha) * adv


# --- clip_cov / kl_cov token selections ------------------------------------------------------
#
# verl's clip_cov and kl_cov pick a number of tokens counted on the host (a fraction of the
# valid ones), clip_cov at random: data-dependent sizes that dynamo cannot trace. Each choice
# is one op whose output, a bool mask shaped like its input, carries no gradient; eager calls
# go through the same op, so the draws (torch's global generator unless a seed is given) are
# the same compiled or not.

def _cov_drop(candidates, valid, fraction, seed):
    """clip_cov's dropped tokens: ``max(int(fraction * #valid), 1)`` of the candidates (all of
    them when fewer), a random permutation of their flat positions deciding which."""
    flat = torch.nonzero(candidates.flatten()).flatten()
    num = max(int(fraction * int(valid.sum())), 1)
    dropped = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    if flat.numel():
        gen = None if seed is None else torch.Generator(device=flat.device).manual_seed(seed)
        perm = torch.randperm(flat.numel(), generator=gen, device=flat.device)
        dropped[flat[perm[:num]]] = True
    return dropped.view_as(candidates)


def _cov_top(cov, valid, fraction):
    """kl_cov's penalised tokens: the ``max(1, int(#valid * fraction))`` valid tokens of
    largest ``cov`` (none when no token is valid)."""
    chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    n = int(valid.sum())
    if n:
        flat_valid = torch.nonzero(valid.flatten()).flatten()
        top = torch.topk(cov.flatten()[flat_valid], max(1, int(n * fraction))).indices
        chosen[flat_valid[top]] = True
    return chosen.view_as(valid)


def _mask_fake(a):
    return torch.empty_like(a.valid, dtype=torch.bool)


cov_drop_mask = Op("cov_drop_mask", ("Tensor candidates", "Tensor valid", "float fraction",
                                     "int? seed"), ("dropped",),
                   lambda a: _cov_drop(**vars(a)), _mask_fake).op
cov_top_mask = Op("cov_top_mask", ("Tensor cov", "Tensor valid", "float fraction"), ("chosen",),
                  lambda a: _cov_top(**vars(a)), _mask_fake).op
