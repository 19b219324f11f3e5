"""`policy_loss`'s inputs: the per-token tensors, masks, advantages and packing checked once
and laid out on the right-padded ``[B, T]`` grid (`Batch`), with the config's per-token knobs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from logitless.fused_losses.oplib import is_compiling
from logitless.kernels.segments_torch import PackedIndex, packed_index

_POLICY_TENSORS = ("logprobs", "old_logprobs", "ref_logprobs", "rollout_logprobs", "entropy",
                   "token_weights", "attention_entropy", "kl", "topk_logprobs",
                   "old_topk_logprobs")
# Per-token tensors with a trailing ``K`` axis: ``[*mask.shape, K]`` (DPPO top-k).
_TOPK_TENSORS = ("topk_logprobs", "old_topk_logprobs")
_KNOBS = ("beta", "eps_low", "eps_high")  # config fields that may be per-token tensors


@dataclass
class Batch:
    """A validated batch on the right-padded ``[B, T]`` grid: what every stage reads.

    Built once at the public boundary (`to_batch`); a chunk of whole sequences is a slice of
    it (`rows`). ``m`` is the bool mask as given, ``adv`` the detached per-token advantages;
    ``tensors`` the per-token inputs by argument name (None where not given); ``knobs`` the
    config's ``beta``, ``eps_low``, ``eps_high`` as tensors on the grid (0-d when scalars).
    A chunk is laid out on its own grid already (``index`` None).
    """

    m: torch.Tensor
    adv: torch.Tensor
    packed: bool
    tensors: dict
    knobs: dict = field(default_factory=dict)
    index: PackedIndex | None = None  # where the packed input's tokens sit on the grid
    # the context-parallel group the sequences are split over (``cp_group=``): every
    # sequence-level reduction of the loss runs over it (`context_parallel`); None: local
    cp_group: object = None

    @property
    def width(self) -> int:
        return self.m.shape[1]

    def positions(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Grid ``(row, column)`` of token indices into the input's flattened layout."""
        if self.index is None:
            return flat // self.width, flat % self.width
        return self.index.row[flat], self.index.col[flat]

    def __getitem__(self, name):
        return self.tensors.get(name)

    def with_tensors(self, **tensors) -> Batch:
        return dataclasses.replace(self, tensors={**self.tensors, **tensors})

    def to(self, dtype: torch.dtype) -> Batch:
        def cast(t):
            return None if t is None else t.to(dtype)

        return dataclasses.replace(
            self, adv=self.adv.to(dtype), tensors={k: cast(t) for k, t in self.tensors.items()},
            knobs={k: t.to(dtype) for k, t in self.knobs.items()})

    def rows(self, s0: int, s1: int, width: int) -> Batch:
        """Sequences ``s0:s1``, positions ``:width`` (a chunk of whole sequences)."""

        def cut(t):
            return t if t is None or t.dim() < 2 else t[s0:s1, :width]

        return Batch(cut(self.m), cut(self.adv), self.packed,
                      {k: cut(t) for k, t in self.tensors.items()},
                      {k: cut(t) for k, t in self.knobs.items()}, index=None,
                      cp_group=self.cp_group)


def _check_cu_seqlens(cu_seqlens, n):
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError("cu_seqlens: expected a 1-D integer tensor [B + 1]")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != n:
        raise ValueError(
            f"cu_seqlens: must start at 0 and end at N={n}, got "
            f"{int(cu_seqlens[0])}..{int(cu_seqlens[-1])}"
        )
    if (cu_seqlens[1:] < cu_seqlens[:-1]).any():
        raise ValueError("cu_seqlens: must be non-decreasing")


def _check_max_seqlen(max_seqlen, cu_seqlens, validate):
    """``max_seqlen``: an int >= 0 given with ``cu_seqlens`` (free); with ``validate``, at
    least the longest sequence (a device read)."""
    if max_seqlen is None:
        return
    if cu_seqlens is None:
        raise ValueError("max_seqlen: given without cu_seqlens (it bounds packed sequences)")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int | torch.SymInt):
        raise ValueError(f"max_seqlen: expected an int, got {max_seqlen!r}")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen: expected an int >= 0, got {max_seqlen}")
    if validate and cu_seqlens.numel() > 1:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if longest > max_seqlen:
            raise ValueError(f"max_seqlen: {max_seqlen} is shorter than the longest sequence "
                             f"({longest} tokens)")


def check_shapes(mask, advantages, cu_seqlens, validate, tensors, max_seqlen=None) -> bool:
    """Shapes (free) and, with ``validate``, NaN, ``cu_seqlens`` and ``max_seqlen`` (they
    synchronise with the device; under ``torch.compile`` they are skipped: docs/compile.md).
    Returns whether the advantages are per sequence."""
    validate = validate and not is_compiling()
    shape = mask.shape
    if cu_seqlens is None:
        if mask.dim() != 2:
            raise ValueError(f"mask: expected [B, T] (or [N] with cu_seqlens), got {tuple(shape)}")
        num_seqs = shape[0]
    else:
        if mask.dim() != 1:
            raise ValueError(f"mask: expected packed [N] with cu_seqlens, got {tuple(shape)}")
        if validate:
            _check_cu_seqlens(cu_seqlens, shape[0])
        num_seqs = cu_seqlens.numel() - 1
    _check_topk_shapes(shape, tensors)
    for name, t in tensors.items():
        if t is None:
            continue
        if name not in _TOPK_TENSORS and t.shape != shape:
            raise ValueError(
                f"{name}: expected shape {tuple(shape)} like mask, got {tuple(t.shape)}"
            )
        if validate and name != "rollout_logprobs" and torch.isnan(t).any():
            raise ValueError(f"{name}: contains NaN")
    if validate and torch.isnan(advantages).any():
        raise ValueError("advantages: contains NaN")
    _check_max_seqlen(max_seqlen, cu_seqlens, validate)
    return _advantages_per_sequence(advantages.shape, shape, num_seqs)


def _check_topk_shapes(shape, tensors) -> None:
    """The top-k tensors, when given, are ``[*mask.shape, K]`` with one ``K >= 1``."""
    ks = set()
    for name in _TOPK_TENSORS:
        t = tensors.get(name)
        if t is None:
            continue
        if t.dim() != len(shape) + 1 or t.shape[:-1] != shape or t.shape[-1] < 1:
            raise ValueError(f"{name}: expected shape {(*tuple(shape), 'K')} (mask's shape and "
                             f"K >= 1 top-k entries), got {tuple(t.shape)}")
        ks.add(t.shape[-1])
    if len(ks) > 1:
        raise ValueError(f"old_topk_logprobs: expected the K of topk_logprobs, got K in "
                         f"{sorted(ks)}")


def _advantages_per_sequence(adv_shape, mask_shape, num_seqs) -> bool:
    """The one rule for reading advantages: shaped like the mask, one per token (checked first:
    a packed ``[N]`` tensor with ``N == B`` is per token); else ``[B]`` or ``[B, 1]``, one per
    sequence. Packed per-sequence advantages with ``N == B`` must come as ``[B, 1]``."""
    if adv_shape == mask_shape:
        return False
    if adv_shape in ((num_seqs,), (num_seqs, 1)):
        return True
    raise ValueError(
        f"advantages: expected [{num_seqs}] per sequence or {tuple(mask_shape)} per "
        f"token, got {tuple(adv_shape)}"
    )


def _knob_tensors(cfg, mask, dtype, device) -> dict:
    """``beta``, ``eps_low``, ``eps_high`` as tensors, per-token ones checked against the
    layout of the logprobs (knobs never receive gradients)."""
    out = {}
    for name in _KNOBS:
        value = getattr(cfg, name)
        if not isinstance(value, torch.Tensor):
            out[name] = torch.tensor(float(value), dtype=dtype, device=device)
            continue
        value = value.detach().to(dtype=dtype, device=device)
        if value.dim() and tuple(value.shape) != tuple(mask.shape):
            raise ValueError(
                f"{name}: per-token tensor must be laid out like logprobs {tuple(mask.shape)}"
            )
        out[name] = value
    return out


def to_batch(mask, advantages, cu_seqlens, dtype, validate=True, cfg=None, max_seqlen=None,
              *, cp_group=None, **tensors) -> Batch:
    """Validate (`check_shapes`), cast to ``dtype`` and lay every input out on the ``[B, T]``
    grid once (packed: ``T`` is ``max_seqlen`` when given); with ``cfg``, its tensor knobs
    too; ``cp_group`` the batch's context-parallel group."""
    per_sequence = check_shapes(mask, advantages, cu_seqlens, validate, tensors, max_seqlen)
    adv = advantages.detach().to(dtype)
    out = {name: None if t is None else t.to(dtype) for name, t in tensors.items()}
    knobs = {} if cfg is None else _knob_tensors(cfg, mask, dtype, mask.device)
    index = None
    if cu_seqlens is None:
        m = mask != 0
    else:
        index = packed_index(cu_seqlens, total=mask.shape[0], width=max_seqlen)
        m = index.pad(mask != 0, False)
        out = {k: None if t is None else index.pad(t) for k, t in out.items()}
        knobs = {k: index.pad(t) if t.dim() else t for k, t in knobs.items()}
        if not per_sequence:
            adv = index.pad(adv)
    if per_sequence:
        adv = adv.reshape(m.shape[0], 1).expand(m.shape)
    return Batch(m, adv, cu_seqlens is not None, out, knobs, index, cp_group)


def check_policy_inputs(mask, advantages, *, cu_seqlens=None, max_seqlen=None,
                        **tensors) -> None:
    """Raise ``ValueError`` where `policy_loss` would (shapes, NaN, ``cu_seqlens``,
    ``max_seqlen``), without computing anything: lets a chunked caller validate the batch
    once."""
    with torch.no_grad():
        check_shapes(mask, advantages, cu_seqlens, True, tensors, max_seqlen)


def promoted_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)
