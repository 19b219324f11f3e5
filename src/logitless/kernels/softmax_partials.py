"""Partial softmax statistics over a slice of the vocabulary, and how to merge them.

Every forward path (Triton programs that split the vocabulary, the chunked torch path, ranks of
a vocab-parallel group) produces, per token, statistics of the logits it has seen, relative to
its own running maximum ``m``:

- ``l  = sum_j exp(z_j - m)``
- ``a  = sum_j exp(z_j - m) * (z_j - m)``  (kept relative to ``m`` so the entropy does not
  cancel two large numbers: ``H = log L - A / L`` instead of ``lse - sum p z``)
- ``s2 = sum_j exp(2 (z_j - m))``          (for ``sum_j p_j^2 = S2 / L^2``)
- ``sum_z = sum_j z_j``                      (for the mean logit)
- ``z_y``: the target's logit if the target lies in this slice, else 0 (so partials add up)
- ``m_before``: the largest logit of this slice at an index strictly before the target's
  (the slice's max when the whole slice lies before the target, -inf when it lies after)

Merging rescales each part to the common maximum ``M``; finishing turns the merged parts into
``lse``, ``logprobs``, ``entropy``, ``sum_p_sq``, ``mean_logit`` and ``is_top1``.
All tensors are fp32.

The backward recomputes ``p = exp(z - lse)``, which it cannot do from ``lse`` itself at a low
temperature: ``lse`` is a number of the logits' size (1e4 for logits of 10 at T = 1e-3), whose
rounding (1e-3 there) is an error of every ``p`` that the chain factor ``1 / T`` then multiplies.
The backward reads the normaliser in two parts instead (:func:`normaliser`): ``top``, the row's
largest logit exactly as the forward saw it (its ``m``, or a kernel's own ``top``), and
``log l``; ``z - top`` is exact at the maximum and small near it, so ``p = exp((z - top) -
log l)`` is as accurate as ``log_softmax`` on materialised logits.

``is_top1`` is ``z_y >= m and z_y > m_before``: the target counts as the top-1 prediction
only when it is the *first* maximum (the lowest index among tied maxima), which is what
``argmax`` returns and what TRL's fused head reports.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Partials(NamedTuple):
    """Per-token partial statistics; every field is fp32 and shaped ``[..., N]``."""

    m: torch.Tensor
    l: torch.Tensor
    a: torch.Tensor
    s2: torch.Tensor
    sum_z: torch.Tensor
    z_y: torch.Tensor
    m_before: torch.Tensor
    # The row's largest logit in a kernel's own units (monotone in ``m``), where its backward
    # reads the maximum in those (``linear_softmax``); None: ``m`` itself.
    top: torch.Tensor | None = None


def empty(device, dtype: torch.dtype = torch.float32) -> Partials:
    """Partials of zero tokens."""
    none = torch.empty(0, dtype=dtype, device=device)
    return Partials(*(none,) * len(Partials._fields))


def merge(parts: Partials, dim: int = 0) -> Partials:
    """Merge partials stacked along ``dim`` (vocab splits) into one set of partials."""
    m = parts.m.amax(dim=dim, keepdim=True)
    # A slice that saw no logit has m = -inf and l = 0; its scale must be 0, not NaN.
    scale = torch.exp(parts.m - m).nan_to_num_(0.0)
    shift = (parts.m - m).nan_to_num_(0.0, neginf=0.0)
    l = (parts.l * scale).sum(dim)
    a = ((parts.a + parts.l * shift) * scale).sum(dim)
    s2 = (parts.s2 * scale * scale).sum(dim)
    return Partials(m.squeeze(dim), l, a, s2, parts.sum_z.sum(dim), parts.z_y.sum(dim),
                    parts.m_before.amax(dim), None if parts.top is None else parts.top.amax(dim))


def stack(parts: list[Partials]) -> Partials:
    """Stack a list of partials over the same tokens along a new leading dimension."""
    return Partials(*(None if field[0] is None else torch.stack(field)
                      for field in zip(*parts)))


def rescale_to(parts: Partials, m: torch.Tensor) -> Partials:
    """Express partials relative to a larger common maximum ``m`` (used before an all-reduce)."""
    scale = torch.exp(parts.m - m).nan_to_num_(0.0)
    shift = (parts.m - m).nan_to_num_(0.0, neginf=0.0)
    return Partials(
        m,
        parts.l * scale,
        (parts.a + parts.l * shift) * scale,
        parts.s2 * scale * scale,
        parts.sum_z,
        parts.z_y,
        parts.m_before,
        parts.top,
    )


def normaliser(parts: Partials) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top, log l)`` of fully merged partials: the normaliser ``lse = m + log l`` in the two
    parts a backward reads (see the module's docstring); ``top`` is ``m`` unless the kernel
    gave its own."""
    return (parts.m if parts.top is None else parts.top), torch.log(parts.l)


def finish_logprobs(parts: Partials, log_l: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy, lse)`` per token from fully merged partials: the three statistics
    a loss reads, in four ops (a chunk loop's share of `finish`; ``log_l``: ``log l`` where
    the caller has it already, from :func:`normaliser`). The entropy ``log l - a / l`` as one
    ``addcdiv``: the same bits (``-1 * a`` is exact, then one division and one subtraction,
    each rounded once)."""
    log_l = torch.log(parts.l) if log_l is None else log_l
    lse = parts.m + log_l
    return parts.z_y - lse, torch.addcdiv(log_l, parts.a, parts.l, value=-1), lse


def finish(parts: Partials, vocab_size: int) -> dict[str, torch.Tensor]:
    """Per-token statistics from fully merged partials over a vocabulary of ``vocab_size``."""
    logprobs, entropy, lse = finish_logprobs(parts)
    return {
        "lse": lse,
        "logprobs": logprobs,
        "entropy": entropy,
        "sum_p_sq": parts.s2 / (parts.l * parts.l),
        "mean_logit": parts.sum_z / vocab_size,
        "is_top1": (parts.z_y >= parts.m) & (parts.z_y > parts.m_before),
    }
