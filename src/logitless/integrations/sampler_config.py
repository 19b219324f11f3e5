"""The sampler's truncation settings as the trainer adapters read them from a framework config.

:class:`SamplerTruncation` holds the ``top_k`` / ``top_p`` / ``min_p`` a rollout engine sampled
with, each None when that truncation is off, and hands the set ones to
:func:`logitless.linear_logprobs` (:meth:`SamplerTruncation.kwargs`). :func:`read_sampler_config`
builds one from raw config values, reading each framework's "off" spelling (TRL's ``top_k=0``,
verl's ``top_k=-1``, ``top_p=1``, ``min_p`` None or 0) and reporting a value no sampler accepts
under the config field's own name.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from logitless.fused_losses.head.sampled import drop_outside_kept
from logitless.fused_losses.oplib import renamed_keyword
from logitless.kernels.sampler_torch import ENGINES

__all__ = ["GREEDY_TEMPERATURE", "SamplerTruncation", "drop_outside_kept", "read_sampler_config"]

# vLLM samples greedily below this temperature (its sampling epsilon): no truncation, no
# temperature, so there is no tempered distribution to match.
GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True, init=False)
class SamplerTruncation:
    """Truncations of the sampler's distribution (None: off), and the ``sampler`` whose rules
    apply them (``"vllm"``, ``"sglang"`` or ``"transformers"``, as ``linear_logprobs``'s
    ``sampler``). ``engine`` is its deprecated name (docs/api-changes.md)."""

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    sampler: str = "vllm"

    def __init__(self, top_k=None, top_p=None, min_p=None, sampler="vllm", *, engine=None):
        sampler = renamed_keyword("engine", engine, "sampler", sampler, "vllm")
        if sampler not in ENGINES:
            raise ValueError(f"sampler: expected one of {ENGINES}, got {sampler!r}")
        for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                            ("sampler", sampler)):
            object.__setattr__(self, name, value)

    @property
    def engine(self) -> str:
        """Deprecated: :attr:`sampler`'s old name."""
        renamed_keyword("engine", self.sampler, "sampler", None)
        return self.sampler

    @property
    def truncates(self) -> bool:
        """Whether any truncation is on."""
        return any(v is not None for v in (self.top_k, self.top_p, self.min_p))

    def kwargs(self) -> dict:
        """The arguments of :func:`logitless.linear_logprobs` for the truncations that are on,
        with ``sampler`` when any is."""
        on = {k: getattr(self, k) for k in ("top_k", "top_p", "min_p")
              if getattr(self, k) is not None}
        return {**on, "sampler": self.sampler} if on else {}



def _number(value, name: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return value


def read_sampler_config(*, temperature, top_k, top_p, min_p, names: dict[str, str],
                        top_k_off: tuple[int, ...], sampler: str = "vllm",
                        engine: str | None = None) -> SamplerTruncation:
    """Validate one framework's sampler values and return the truncations that are on.

    Args:
        temperature: the sampling temperature (checked only: the head receives it itself).
        top_k: an int, off when in ``top_k_off``; otherwise at least 1.
        top_p: in (0, 1]; 1 (or None) is off.
        min_p: in [0, 1]; None or 0 is off.
        names: the config's name for each of the four, used in error messages.
        top_k_off: the values the framework reads as "top-k off".
        sampler: the rollout engine whose rules apply the truncations (``engine``: its
            deprecated name).
    """
    sampler = renamed_keyword("engine", engine, "sampler", sampler, "vllm")
    t = _number(temperature, names["temperature"], "a finite number")
    if t < GREEDY_TEMPERATURE:
        raise ValueError(
            f"{names['temperature']}: sampler matching needs a sampling temperature >= "
            f"{GREEDY_TEMPERATURE} (below it vLLM samples greedily), got {temperature!r}")
    k = None
    if top_k is not None and top_k not in top_k_off:
        off = " or ".join(str(v) for v in top_k_off)
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
            raise ValueError(f"{names['top_k']}: expected an int >= 1 ({off}: off), "
                             f"got {top_k!r}")
        k = int(top_k)
    p = None
    if top_p is not None:
        p = _number(top_p, names["top_p"], "a number in (0, 1]")
        if not 0 < p <= 1:
            raise ValueError(f"{names['top_p']}: expected a number in (0, 1], got {top_p!r}")
        p = None if p == 1 else p
    m = None
    if min_p is not None:
        m = _number(min_p, names["min_p"], "a number in [0, 1]")
        if not 0 <= m <= 1:
            raise ValueError(f"{names['min_p']}: expected a number in [0, 1], got {min_p!r}")
        m = None if m == 0 else m
    return SamplerTruncation(top_k=k, top_p=p, min_p=m, sampler=sampler)
