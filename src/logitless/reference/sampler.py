"""Reference for sampler-matched logprobs: the full logits, then vLLM's truncations as written.

The semantics follow vLLM 0.34.0's V1 GPU sampler, the path it takes on CUDA when the
processed logprobs are requested (``logprobs_mode="processed_logprobs"``):

1. ``vllm/v1/worker/gpu/sample/sampler.py``, ``Sampler.apply_sampling_params``: the logits are
   divided by the temperature, then min-p is applied, then top-k and top-p together.
2. ``vllm/v1/worker/gpu/sample/min_p.py``, ``_min_p_kernel``: a logit is masked when it is
   below ``max + log(min_p)`` (strictly), on the tempered logits.
3. ``vllm/v1/sample/ops/topk_topp_sampler.py``, ``apply_top_k_top_p``: with Triton available
   (every CUDA install) it calls ``apply_top_k_top_p_triton`` in
   ``vllm/v1/sample/ops/topk_topp_triton.py``: top-k first, by logit value, keeping exactly
   ``k`` tokens; then top-p over the renormalised survivors, keeping the fewest most-probable
   tokens whose mass reaches ``p``. Tokens tied at either boundary are kept in vocabulary order,
   lowest id first (its "duplicate logit handling": a running count over the vocabulary tiles
   in index order).

The top-p rule is written here as vLLM's PyTorch fallback ``apply_top_k_top_p_pytorch`` writes
it (ascending sort, cumulative sum, drop while the mass up to and including a token is
``<= 1 - p``, never the last), with the sort's ties ordered as the Triton path keeps them.
That fallback (vLLM without Triton, and its CPU worker) differs from the rule here on ties only:
its top-k keeps every token equal to the ``k``-th value, and its unstable sort orders tied
logits arbitrarily.
"""

from __future__ import annotations

import math

import torch

from logitless.reference.linear_softmax import linear_logits

__all__ = ["sampler_kept_mask", "sampler_logprobs"]


def _per_row(value, n: int, default, dtype, device) -> torch.Tensor:
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(device=device, dtype=dtype)
    return torch.full((n,), value, dtype=dtype, device=device)


def sampler_kept_mask(z: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The tokens vLLM's sampler can draw from the tempered logits ``z [N, V]`` (bool
    ``[N, V]``). ``top_k`` (``>= 1``), ``top_p`` (``(0, 1]``) and ``min_p`` (``[0, 1]``) are
    numbers, ``[N]`` tensors or None (off)."""
    n, v = z.shape
    z = z.clone()
    mp = _per_row(min_p, n, 0.0, z.dtype, z.device)
    k = _per_row(top_k, n, v, torch.int64, z.device).clamp(max=v)
    p = _per_row(top_p, n, 1.0, z.dtype, z.device)
    neg = torch.tensor(-math.inf, dtype=z.dtype, device=z.device)

    # min_p.py, _min_p_kernel: threshold = max + log(min_p); logits < threshold -> -inf.
    threshold = z.amax(-1, keepdim=True) + torch.log(mp).unsqueeze(-1)
    z = torch.where(z < threshold, neg, z)

    # apply_top_k_top_p_pytorch: sort ascending. Ties go in decreasing vocabulary id, so that
    # at a boundary the lowest ids are the last to go (the Triton path's tie order): a stable
    # sort of the reversed row.
    flipped = z.flip(-1)
    z_sort, order = flipped.sort(dim=-1, stable=True)
    idx = (v - 1) - order
    # Top-k, the Triton path's exact count: keep the last k sorted positions.
    pos = torch.arange(v, device=z.device).unsqueeze(0)
    z_sort = torch.where(pos < (v - k).unsqueeze(-1), neg, z_sort)
    # Top-p (apply_top_k_top_p_pytorch): softmax, cumsum, drop where cumsum <= 1 - p, keep the
    # last. Rows with p == 1 are left alone (the Triton kernel's ``if p < 1.0``).
    probs_sum = z_sort.softmax(-1).cumsum(-1)
    drop = probs_sum <= (1 - p).unsqueeze(-1)
    drop[:, -1] = False
    drop &= (p < 1).unsqueeze(-1)
    z_sort = torch.where(drop, neg, z_sort)
    kept = torch.zeros_like(z, dtype=torch.bool)
    kept.scatter_(-1, idx, z_sort > -math.inf)
    return kept


def sampler_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor]:
    """Logprobs of ``targets`` under the distribution vLLM samples from, from the full logits.

    ``temperature``, ``top_k``, ``top_p``, ``min_p``: numbers or tensors of ``targets``' shape
    (None: that truncation off). ``z = logit_scale * softcap(h W^T + b) / temperature``, the
    kept set ``K`` from :func:`sampler_kept_mask`, ``q = softmax(z)`` restricted to ``K``.
    Returns tensors shaped like ``targets``, with gradients through the logits (the kept set
    is a constant):

    - ``logprobs``: ``log q_y``, ``-inf`` where ``y`` is outside ``K``
    - ``entropy``: ``-sum_{j in K} q_j log q_j``
    - ``log_kept_mass``: ``log sum_{j in K} p_j`` with ``p = softmax(z)`` over the whole
      vocabulary (0 when nothing is truncated)
    - ``kept``: ``K`` itself, ``[..., V]`` bool

    Positions whose target equals ``ignore_index`` hold 0.
    """
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    n = h.shape[0]
    z = linear_logits(h, weight, bias, softcap_value=softcap, logit_scale=logit_scale)
    z = z / _per_row(temperature, n, 1.0, z.dtype, z.device).unsqueeze(-1)
    kept = sampler_kept_mask(z.detach(), top_k, top_p, min_p)
    t = targets.reshape(-1).long()
    valid = t != ignore_index
    safe = torch.where(valid, t, 0)
    neg = torch.tensor(-math.inf, dtype=z.dtype, device=z.device)
    zk = torch.where(kept, z, neg)
    lse_kept = torch.logsumexp(zk, -1)
    lse_full = torch.logsumexp(z, -1)
    q = torch.softmax(zk, -1)
    z_y = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    y_kept = kept.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    out = {
        "logprobs": torch.where(y_kept, z_y - lse_kept, neg),
        "entropy": lse_kept - (q * torch.where(kept, z, 0.0)).sum(-1),
        "log_kept_mass": lse_kept - lse_full,
    }
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    out = {name: torch.where(valid, x, zero).reshape(shape) for name, x in out.items()}
    out["kept"] = kept.reshape(*shape, -1)
    return out


def kept_set_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    kept_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature=1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor]:
    """Logprobs under the tempered softmax renormalised over a recorded kept set, from the full
    logits: ``kept_ids`` ``[*targets.shape, K]``, padded with -1. Returns ``logprobs`` (-inf
    for a target outside the set), ``entropy`` of the renormalised distribution and
    ``log_kept_mass`` (the set's log mass under the untruncated softmax); 0 where ignored."""
    temp = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    z = linear_logits(hidden, weight, bias, softcap_value=softcap, logit_scale=logit_scale) / temp
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep.scatter_(-1, kept_ids.clamp_min(0), kept_ids >= 0)
    zk = z.masked_fill(~keep, float("-inf"))
    log_q = torch.log_softmax(zk, dim=-1)
    q = log_q.exp()
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    out = {
        "logprobs": log_q.gather(-1, safe.unsqueeze(-1)).squeeze(-1),
        "entropy": -(q * log_q.masked_fill(~keep, 0.0)).sum(-1),
        "log_kept_mass": torch.logsumexp(zk, -1) - torch.logsumexp(z, -1),
    }
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    return {k: torch.where(valid, v, zero) for k, v in out.items()}
