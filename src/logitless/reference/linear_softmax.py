"""Reference for the fused linear softmax statistics: the full logits, then the formulas."""

from __future__ import annotations

import torch

__all__ = ["head_inputs", "linear_logits", "linear_softmax_stats", "softcap"]


def head_inputs(head_dtype: str | None, *tensors):
    """``tensors`` (None kept) as a head of ``head_dtype`` computes from them: as given for
    None, else upcast to at least fp32 (``"tf32"`` computes as fp32 here; fp64 stays)."""
    if head_dtype is None:
        return tensors
    return tuple(None if t is None else t.to(torch.promote_types(t.dtype, torch.float32))
                 for t in tensors)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma-style logit soft-capping); identity when ``cap`` is None."""
    if cap is None:
        return x
    return cap * torch.tanh(x / cap)


def linear_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap_value: float | None = None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """The tempered logits ``z = logit_scale * softcap(hidden @ W^T + b) / temperature``.

    hidden ``[..., D]``, weight ``[V, D]``, bias ``[V]`` -> ``[..., V]`` in the input dtype.
    """
    x = hidden @ weight.t()
    if bias is not None:
        x = x + bias
    return logit_scale * softcap(x, softcap_value) / temperature


def linear_softmax_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor]:
    """Per-token softmax statistics of the tempered logits, computed from the full logits.

    Returns a dict of tensors shaped like ``targets``, in the compute dtype (run it in fp64 for
    the oracle), with gradients through ``hidden``, ``weight`` and ``bias``:

    - ``lse``: ``log sum_j exp(z_j)``
    - ``logprobs``: ``z_y - lse``
    - ``entropy``: ``lse - sum_j p_j z_j``
    - ``sum_p_sq``: ``sum_j p_j^2``
    - ``mean_logit``: ``mean_j z_j``
    - ``is_top1``: ``y == argmax_j z_j`` (bool), the *first* maximum: a target tied with
      the maximum at a lower index does not count

    Positions whose target equals ``ignore_index`` hold 0 (``False`` for ``is_top1``).
    """
    z = linear_logits(
        hidden, weight, bias, temperature=temperature, softcap_value=softcap,
        logit_scale=logit_scale,
    )
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    lse = torch.logsumexp(z, dim=-1)
    logp = z - lse.unsqueeze(-1)
    p = logp.exp()
    z_y = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    out = {
        "lse": lse,
        "logprobs": z_y - lse,
        "entropy": lse - (p * z).sum(-1),
        "sum_p_sq": (p * p).sum(-1),
        "mean_logit": z.mean(-1),
    }
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    out = {k: torch.where(valid, v, zero) for k, v in out.items()}
    out["is_top1"] = (z.argmax(-1) == safe) & valid
    return out
