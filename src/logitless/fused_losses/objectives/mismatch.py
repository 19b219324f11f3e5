"""Train-inference mismatch: how far the trainer's logprobs of the sampled tokens are from the
engine's (docs/mismatch.md)."""

from __future__ import annotations

import math

import torch

__all__ = ["RATIO_BAND", "logged_mismatch", "mismatch_metrics"]

# the band of trainer / engine probability ratios counted as agreeing
RATIO_BAND = (0.9, 1.1)


def _check_logprobs(name: str, t, shape, mask: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a floating-point tensor, got {kind}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)} like mask, got {list(t.shape)}")
    if t.device != mask.device:
        raise ValueError(f"{name}: expected it on mask's device {mask.device}, got {t.device}")
    if not torch.isfinite(t[mask]).all():
        raise ValueError(f"{name}: non-finite values (NaN or inf) at tokens in the mask; leave "
                         f"tokens without a logprob out of the mask")


def _check_mask(mask) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype.is_complex:
        kind = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask: expected a bool, integer or floating tensor of 0/1, got {kind}")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask: expected values 0 or 1 only")
    return mask.bool()


@torch.no_grad()
def mismatch_metrics(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                     mask: torch.Tensor, *,
                     log_kept_mass: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """How far the trainer's logprobs of the sampled tokens are from the engine's.

    The tokens were sampled by the engine (vLLM, SGLang) and scored again by the trainer at
    the same weights. With ``d = trainer_logprobs - engine_logprobs`` per token and
    ``r = exp(d)`` the trainer / engine probability ratio (the rollout importance weight), the
    means below are over the tokens of ``mask`` (one token, one vote, across sequences):

    - ``abs_diff/mean``, ``abs_diff/max``: mean and maximum of ``|d|``, in nats.
    - ``kl_k1``, ``kl_k3``: Schulman's k1 ``-d`` and k3 ``r - 1 - d`` estimators of
      ``KL(engine || trainer) = E_engine[log engine - log trainer]``, unbiased because the
      tokens are the engine's samples. k3 is >= 0 per token; k1 is not (its mean can be
      negative on a small batch). This is NeMo-RL's ``gen_kl_error`` with
      ``reference_policy_kl_type`` ``"k1"`` / ``"k3"`` (its ``calculate_kl(generation_logprobs,
      prev_logprobs)`` unclamped, a token mean), save NeMo-RL's 1e-8 added to the token count.
      k3 is computed as ``expm1(d) - d`` in float64, exact where ``exp(d) - 1 - d`` cancels.
    - ``ratio_outside``: the fraction of tokens with ``r`` outside ``[0.9, 1.1]``.
    - ``kept_mass/mean`` (only with ``log_kept_mass``): the mean of ``exp(log_kept_mass)``, the
      full softmax's mass on the sampler's kept set (``linear_logprobs(...,
      stats=("log_kept_mass",))``): how much probability the truncation keeps.

    Args:
        trainer_logprobs, engine_logprobs: ``[...]`` floating tensors, the same shape as
            ``mask`` (any floating dtypes). Values outside the mask are ignored; inside it they
            must be finite (a token the engine did not score belongs out of the mask).
        mask: bool, integer or floating tensor of 0 and 1: the tokens measured.
        log_kept_mass: optional, shaped like ``mask``, finite inside it.

    Returns a dict of 0-d float64 tensors on the inputs' device, without gradient (read them
    with ``.item()`` or stack them for one sync). An empty mask gives NaN for every entry: no
    token, no measurement (the adapters' cross-rank means skip NaN). The reduction is over this
    call's tensors only: under data or context parallelism each rank measures its own tokens.
    """
    mask = _check_mask(mask)
    shape = tuple(mask.shape)
    _check_logprobs("trainer_logprobs", trainer_logprobs, shape, mask)
    _check_logprobs("engine_logprobs", engine_logprobs, shape, mask)
    if log_kept_mass is not None:
        _check_logprobs("log_kept_mass", log_kept_mass, shape, mask)
    d = (trainer_logprobs.double() - engine_logprobs.double())[mask]
    n = d.new_tensor(d.numel())
    nan = d.new_tensor(math.nan)

    def mean(x):
        return x.sum() / n if d.numel() else nan

    abs_d = d.abs()
    low, high = RATIO_BAND
    ratio = torch.exp(d)
    out = {
        "abs_diff/mean": mean(abs_d),
        "abs_diff/max": abs_d.max() if d.numel() else nan,
        "kl_k1": mean(-d),
        "kl_k3": mean(torch.expm1(d) - d),
        "ratio_outside": mean(((ratio < low) | (ratio > high)).double()),
    }
    if log_kept_mass is not None:
        out["kept_mass/mean"] = mean(torch.exp(log_kept_mass.double()[mask]))
    return out


def logged_mismatch(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                    mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """`mismatch_metrics` as the adapters log it: keys under ``mismatch/``, and the tokens the
    engine did not score (NaN, as TRL stores them) or scored non-finite left out of the mask
    (a diagnostic does not stop the run)."""
    measured = mask.bool() & torch.isfinite(engine_logprobs)
    metrics = mismatch_metrics(trainer_logprobs, engine_logprobs, measured)
    return {f"mismatch/{name}": value for name, value in metrics.items()}
