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

The other engines (``sampler=``, see ``docs/sampler.md``):

- ``"sglang"``: SGLang 0.5.23 on CUDA, its default FlashInfer backend
  (``python/sglang/srt/layers/sampler.py``, ``Sampler._sample_from_probs``), on the tempered
  softmax ``pi``. A row without min-p goes to FlashInfer's
  ``top_k_top_p_sampling_from_probs(..., filter_apply_order="joint")``, whose rejection
  kernel (``TopKTopPSamplingFromProbKernel``) accepts a token when fewer than ``k`` tokens
  have a larger probability *and* their mass is below ``p``: both thresholds on the whole row,
  ties at either boundary all kept. A row with min-p goes through ``top_k_renorm_prob``
  (keeps every probability ``>=`` the ``k``-th largest: ties kept), ``top_p_renorm_prob``
  (AIR top-p: keeps every probability ``>=`` the largest value whose mass at or above it
  reaches ``p`` of the survivors': ties kept), then ``min_p_sampling_from_probs`` (keeps
  ``probs >= max * min_p``), each on the previous step's renormalised output.
- ``"transformers"``: ``GenerationMixin._get_logits_processor``'s warpers in its order,
  ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` (drops ``scores <`` the ``k``-th largest
  value: ties kept), ``TopPLogitsWarper`` (ascending sort, drops where the cumulative
  softmax of the survivors is ``<= 1 - p``, never the last), ``MinPLogitsWarper`` (drops
  ``probs < min_p * max`` of the survivors' softmax). TopP's sort is not stable: how many
  tied tokens it keeps at the boundary is fixed, which of them is not; here the lowest ids
  are kept, as for vLLM.
"""

from __future__ import annotations

import math

import torch

from logitless.reference.linear_softmax import linear_logits

__all__ = ["SAMPLERS", "kept_set_logprobs", "sampler_kept_mask", "sampler_logprobs"]

# The engines whose sampler the reference reproduces (``sampler=``).
SAMPLERS = ("vllm", "sglang", "transformers")


def _per_row(value, n: int, default, dtype, device) -> torch.Tensor:
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(device=device, dtype=dtype)
    return torch.full((n,), value, dtype=dtype, device=device)


def sampler_kept_mask(z: torch.Tensor, top_k=None, top_p=None, min_p=None,
                      sampler: str = "vllm") -> torch.Tensor:
    """The tokens the ``sampler`` engine (one of :data:`SAMPLERS`) can draw from the tempered
    logits ``z [N, V]`` (bool ``[N, V]``). ``top_k`` (``>= 1``), ``top_p`` (``(0, 1]``) and
    ``min_p`` (``[0, 1]``) are numbers, ``[N]`` tensors or None (off)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    n, v = z.shape
    z = z.clone()
    mp = _per_row(min_p, n, 0.0, z.dtype, z.device)
    k = _per_row(top_k, n, v, torch.int64, z.device).clamp(max=v)
    p = _per_row(top_p, n, 1.0, z.dtype, z.device)
    if sampler == "sglang":
        return _sglang_kept(z, k, p, mp)
    if sampler == "transformers":
        return _transformers_kept(z, k, p, mp)
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


def _ahead(z: torch.Tensor, probs: torch.Tensor):
    """Per token, how many tokens of its row have a strictly larger logit, and their mass
    under ``probs`` (0 where ``z`` is ``-inf``-masked out: pass ``probs`` 0 there)."""
    z_sort, order = z.sort(dim=-1, descending=True, stable=True)
    mass_before = probs.gather(-1, order).cumsum(-1) - probs.gather(-1, order)
    # the first sorted position of each token's value: how many are strictly larger
    neg = (-z_sort).contiguous()
    first = torch.searchsorted(neg, neg, side="left")
    count = torch.empty_like(first)
    count.scatter_(-1, order, first)
    mass = torch.empty_like(probs)
    mass.scatter_(-1, order, mass_before.gather(-1, first))
    return count, mass


def _sglang_kept(z, k, p, mp):
    """SGLang's FlashInfer filtering (module doc), as its kernels decide a token: on the
    tempered softmax, thresholds on "strictly larger than this token", so tied tokens share
    one fate. Rows with ``min_p > 0`` take the sequential path (SGLang takes it for the whole
    batch when any request has min-p)."""
    probs = torch.softmax(z, -1)
    count, mass = _ahead(z, probs)
    k, p, mp = k.unsqueeze(-1), p.unsqueeze(-1), mp.unsqueeze(-1)
    off = p >= 1  # top_p == 1: no top-p filter (both kernels' fast paths)
    # joint (TopKTopPSamplingFromProbKernel): #larger < k and their mass < p
    joint = (count < k) & ((mass < p) | off)
    # sequential: top_k_renorm_prob, then top_p_renorm_prob on its renormalised output,
    # then min_p_sampling_from_probs on that one
    k1 = count < k
    probs1 = torch.where(k1, probs, 0.0)
    probs1 = probs1 / probs1.sum(-1, keepdim=True)
    _, mass1 = _ahead(torch.where(k1, z, -math.inf), probs1)
    k2 = k1 & ((mass1 < p) | off)
    probs2 = torch.where(k2, probs1, 0.0)
    probs2 = probs2 / probs2.sum(-1, keepdim=True)
    k3 = k2 & (probs2 >= probs2.amax(-1, keepdim=True) * mp)
    return torch.where(mp > 0, k3, joint)


def _transformers_kept(z, k, p, mp):
    """transformers' warpers as written (module doc), with TopP's tied logits sorted so that
    the lowest ids are the last to go."""
    neg = torch.tensor(-math.inf, dtype=z.dtype, device=z.device)
    # TopKLogitsWarper: scores < topk(scores, k)[0][..., -1]
    kth = z.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
    z = torch.where(z < kth, neg, z)
    # TopPLogitsWarper: ascending sort, cumsum of the softmax, drop <= 1 - p, keep the last
    flipped = z.flip(-1)
    z_sort, order = flipped.sort(dim=-1, stable=True)
    idx = (z.shape[-1] - 1) - order
    cum = z_sort.softmax(-1).cumsum(-1)
    drop = cum <= (1 - p).unsqueeze(-1)
    drop[:, -1] = False
    removed = torch.zeros_like(drop)
    removed.scatter_(-1, idx, drop)
    z = torch.where(removed, neg, z)
    # MinPLogitsWarper: softmax of the survivors, drop probs < min_p * max
    probs = torch.softmax(z, -1)
    z = torch.where(probs < mp.unsqueeze(-1) * probs.amax(-1, keepdim=True), neg, z)
    return z > -math.inf


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
    sampler: str = "vllm",
) -> dict[str, torch.Tensor]:
    """Logprobs of ``targets`` under the distribution the ``sampler`` engine (vLLM by default,
    see :data:`SAMPLERS`) samples from, from the full logits.

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
    kept = sampler_kept_mask(z.detach(), top_k, top_p, min_p, sampler)
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
    # padding (-1) scatters into one extra column: written to id 0, it would race with a real 0
    vocab = z.shape[-1]
    keep = torch.zeros((*z.shape[:-1], vocab + 1), dtype=torch.bool, device=z.device)
    keep.scatter_(-1, torch.where(kept_ids >= 0, kept_ids, vocab), True)
    keep = keep[..., :vocab]
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
