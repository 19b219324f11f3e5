"""``linear_logprobs``: per-token logprobs and softmax statistics from hidden states and a head.

The autograd function here owns what the kernels do not: input checks, compaction of ignored
rows, backend choice, the vocab-parallel all-reduces and the shaping of results. The math lives
in ``kernels/`` (Triton and its chunked torch twin, which share one launcher contract).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import ModuleType

import torch

from logitless.fused_losses.backend import triton_selected
from logitless.fused_losses.head import kept, sampled
from logitless.fused_losses.head.dtensor import sharded_head, sharded_logprobs
from logitless.fused_losses.head.shards import (
    VocabShard,
    all_reduce_partials,
    check_vocab_parallel,
    resolve,
)
from logitless.fused_losses.head.shards import vocab_offset as _vocab_offset
from logitless.fused_losses.oplib import (
    LogprobOutput,
    Op,
    check_devices,
    check_head,
    check_head_dtype,
    check_temperature,
    compact_rows,
    compute_dtype,
    distinct,
    grads_or_empty,
    head_precision,
    is_number,
    precision_gather,
    put_rows,
    take_rows,
)
from logitless.kernels import linear_softmax_torch
from logitless.kernels.linear_softmax_torch import acc_dtype
from logitless.kernels.softmax_partials import empty, finish, normaliser

__all__ = ["STATS", "LogprobOutput", "check_ignore_index", "check_kept_args", "linear_logprobs"]

STATS = ("sum_p_sq", "mean_logit", "is_top1", "lse", "log_kept_mass")


@dataclass(frozen=True)
class _Spec:
    temperature: float
    softcap: float | None
    logit_scale: float
    vocab_total: int
    want_s2: bool
    want_sum_z: bool
    backend: ModuleType
    group: object
    hidden_grad: str
    tile_bytes: int | None
    gather_weight: Callable[[], AbstractContextManager] | None
    dtype: torch.dtype


def _backend_for(device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The kernel module for this call (see :func:`triton_selected`)."""
    if not triton_selected(device, dtype):
        return linear_softmax_torch
    from logitless.kernels import linear_softmax

    return linear_softmax


class _LinearSoftmax(torch.autograd.Function):
    """Rows already compacted: every target is a local vocab id, below 0 or at least the local
    vocabulary size when it lies in an earlier or a later shard."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: _Spec):
        ctx.set_materialize_grads(False)
        stats = _rows_forward(spec, hidden, weight, bias, targets)
        ctx.spec = spec
        ctx.save_for_backward(hidden, weight, bias, targets, *stats[6:], stats[1], stats[2])
        ctx.mark_non_differentiable(*stats[4:5], *stats[6:])
        return stats

    @staticmethod
    def backward(ctx, g_lp, g_entropy, g_sum_p_sq, g_mean_logit, _g_top1, g_lse, *_g_norm):
        if all(g is None for g in (g_lp, g_entropy, g_sum_p_sq, g_mean_logit, g_lse)):
            return None, None, None, None, None
        hidden, weight, bias, targets, top, log_l, entropy, sum_p_sq = ctx.saved_tensors
        grads = _rows_backward(ctx.spec, hidden, weight, bias, targets, top, log_l, entropy,
                               sum_p_sq,
                               (g_lp, g_entropy, g_sum_p_sq, g_mean_logit, g_lse),
                               ctx.needs_input_grad[:3])
        return (*grads, None, None)


def _kernel_kw(spec: _Spec) -> dict:
    kw = dict(temperature=spec.temperature, softcap=spec.softcap, logit_scale=spec.logit_scale)
    if spec.tile_bytes is not None and spec.backend is linear_softmax_torch:
        kw["tile_bytes"] = spec.tile_bytes
    return kw


def _rows_forward(spec: _Spec, hidden, weight, bias, targets) -> tuple[torch.Tensor, ...]:
    """The statistics of compacted rows (no autograd): ``(logprobs, entropy, sum_p_sq,
    mean_logit, is_top1, lse, top, log_l)``, each ``[N]``; the last two are the normaliser as
    the backward reads it (``softmax_partials.normaliser``)."""
    with torch.autocast(hidden.device.type, enabled=False):
        if hidden.shape[0]:
            parts = spec.backend.forward(*_operands(spec, hidden, weight, bias), targets,
                                         want_s2=spec.want_s2, want_sum_z=spec.want_sum_z,
                                         **_kernel_kw(spec))
        else:
            parts = empty(hidden.device, linear_softmax_torch.acc_dtype(spec.dtype))
        if spec.group is not None:
            parts = all_reduce_partials(parts, spec.group)
        stats = finish(parts, spec.vocab_total)
    return (stats["logprobs"], stats["entropy"], stats["sum_p_sq"], stats["mean_logit"],
            stats["is_top1"], stats["lse"], *normaliser(parts))


def _rows_backward(spec: _Spec, hidden, weight, bias, targets, top, log_l, entropy, sum_p_sq,
                   grads, needs) -> tuple[torch.Tensor | None, ...]:
    """Gradients ``(d_hidden, d_weight, d_bias)`` of compacted rows, each in its input's dtype
    (None where ``needs`` says it is not wanted). ``grads``: the gradients of ``(logprobs,
    entropy, sum_p_sq, mean_logit, lse)``, None for outputs that received none."""
    g_lp, g_entropy, g_sum_p_sq, g_mean_logit, g_lse = grads
    need_hidden, need_weight, need_bias = needs
    gather = spec.gather_weight() if spec.gather_weight is not None else nullcontext()
    with torch.autocast(hidden.device.type, enabled=False), gather:
        if hidden.shape[0]:
            d_hidden, d_weight, d_bias = spec.backend.backward(
                *_operands(spec, hidden, weight, bias), targets, top, log_l,
                entropy if g_entropy is not None else None,
                sum_p_sq if g_sum_p_sq is not None else None,
                _acc(g_lp, log_l), _acc(g_entropy, log_l), _acc(g_sum_p_sq, log_l),
                _acc(g_mean_logit, log_l), g_lse=_acc(g_lse, log_l),
                vocab_total=spec.vocab_total, need_hidden=need_hidden,
                need_weight=need_weight, need_bias=need_bias, **_kernel_kw(spec))
        else:
            d_hidden = torch.zeros_like(hidden) if need_hidden else None
            d_weight = torch.zeros_like(weight) if need_weight else None
            d_bias = torch.zeros_like(bias) if need_bias else None
        if d_hidden is not None and spec.group is not None and spec.hidden_grad == "sum":
            # Each rank saw only its vocab slice: the hidden gradient is the sum over ranks
            # ("partial" leaves the sum to the caller, e.g. Megatron's reduce-scatter).
            torch.distributed.all_reduce(d_hidden, group=spec.group)
    return (
        None if d_hidden is None else d_hidden.to(hidden.dtype),
        None if d_weight is None else d_weight.to(weight.dtype),
        None if d_bias is None else d_bias.to(bias.dtype),
    )


def _operands(spec: _Spec, hidden, weight, bias):
    """The inputs as the kernels take them: hidden in the compute dtype, and the head too for
    the Triton kernels (the torch twin casts it slice by slice). Cast here, inside the autograd
    function, so each input's gradient comes back in its own dtype, from fp32 accumulators."""
    hidden = hidden.to(spec.dtype)
    if spec.backend is linear_softmax_torch:
        return hidden, weight, bias
    return hidden, weight.to(spec.dtype), None if bias is None else bias.to(spec.dtype)


def _acc(g, like):
    return None if g is None else g.to(like.dtype).contiguous()


def _finite(x) -> bool:
    """``math.isfinite`` by comparisons, which dynamo can trace on symbolic floats."""
    return -math.inf < x < math.inf


def check_byte_budget(name: str, value) -> None:
    """A bound in bytes: None (the default) or an integer > 0 (not a bool, a float or a
    string such as ``"1GB"``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                              or value <= 0):
        raise ValueError(f"{name} must be None or an integer number of bytes > 0, got {value!r}")


def check_ignore_index(ignore_index) -> None:
    """The target id that marks a token out of the loss: an integer (-100 by default, as
    PyTorch's ``cross_entropy``, TRL's labels and Liger's kernels have it)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"ignore_index must be an integer token id, got {ignore_index!r}")


def check_head_args(hidden, weight, targets, bias, temperature, softcap, logit_scale, stats,
                    *, zero_scale: bool = False):
    """Validate the head's arguments (``ValueError`` naming the argument). ``zero_scale``: a
    ``logit_scale`` of 0 (constant logits, a uniform softmax) is accepted."""
    check_head(hidden, weight, bias)
    if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point \
            or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError("targets must be an integer tensor of token ids")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    check_devices(hidden, (("weight", weight), ("targets", targets), ("bias", bias)))
    check_temperature(temperature, compute_dtype(hidden))
    if softcap is not None and not (is_number(softcap) and _finite(softcap)
                                    and softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if not (is_number(logit_scale) and _finite(logit_scale)
            and (zero_scale or logit_scale != 0)):
        wanted = "finite number" if zero_scale else "finite non-zero number"
        raise ValueError(f"logit_scale must be a {wanted}, got {logit_scale!r}")
    unknown = [s for s in stats if s not in STATS]
    if unknown:
        raise ValueError(f"stats must be drawn from {STATS}, got unknown {unknown}")


def _upcast(hidden, weight, bias, head_dtype):
    """With ``head_dtype``, the head in its compute dtype, cast once (differentiably) for a
    call of two passes: their gradients then add up in fp32 and round to the inputs' dtypes
    once, not once a pass."""
    if head_dtype is None:
        return hidden, weight, bias
    dtype = compute_dtype(hidden, head_dtype)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _kept_set(hidden, weight, targets, kept_ids, bias, temperature, top_k, top_p, min_p,
              softcap, logit_scale, ignore_index, return_entropy, stats, vocab_parallel,
              max_tile_bytes, gather_weight, head_dtype) -> LogprobOutput:
    """``linear_logprobs(kept_ids=...)``: the checks of the combination, then `kept`."""
    check_kept_args(top_k, top_p, min_p, vocab_parallel)
    other = [s for s in stats if s != "log_kept_mass"]
    if other:
        raise ValueError(f"stats {other} are unsupported with kept_ids (only 'log_kept_mass')")
    check_ignore_index(ignore_index)
    check_byte_budget("max_tile_bytes", max_tile_bytes)
    kept.check_kept_temperature(temperature, targets, compute_dtype(hidden))
    want_mass = "log_kept_mass" in stats
    if want_mass:
        hidden, weight, bias = _upcast(hidden, weight, bias, head_dtype)

    def full_lse():
        return linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                               softcap=softcap, logit_scale=logit_scale,
                               ignore_index=ignore_index, stats=("lse",),
                               max_tile_bytes=max_tile_bytes, gather_weight=gather_weight,
                               head_dtype=head_dtype).lse

    with head_precision(head_dtype):
        lp, ent, mass = kept.kept_logprobs(
            hidden, weight, targets, kept_ids, bias=bias, temperature=temperature,
            softcap=None if logit_scale == 0 else softcap, logit_scale=logit_scale,
            ignore_index=ignore_index, dtype=compute_dtype(hidden, head_dtype),
            return_entropy=return_entropy, want_mass=want_mass, full_lse=full_lse,
            max_tile_bytes=max_tile_bytes,
            gather_weight=precision_gather(gather_weight, head_dtype))
    return LogprobOutput(logprobs=lp, entropy=ent, log_kept_mass=mass)


def check_kept_args(top_k, top_p, min_p, vocab_parallel) -> None:
    """``kept_ids`` is the kept set itself: not with ``top_k`` / ``top_p`` / ``min_p``, nor
    with ``vocab_parallel`` (``ValueError``)."""
    given = [n for n, v in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)) if v is not None]
    if given:
        raise ValueError(f"kept_ids is the kept set itself: pass it without {given}")
    if vocab_parallel is not None:
        raise ValueError("kept_ids is unsupported with vocab_parallel")


def _at_ids(hidden, weight, targets, ids, bias, temperature, top_k, top_p, min_p, kept_ids,
            sampler, softcap, logit_scale, ignore_index, return_entropy, stats, vocab_parallel,
            max_tile_bytes, gather_weight, hidden_grad, head_dtype) -> LogprobOutput:
    """``linear_logprobs(ids=...)``: the plain call (with ``"lse"``, one streamed pass of the
    whole head, on its backend) and the logits at ``ids`` from a gather of their rows
    (`kept.id_logits`); ``id_logprobs = z_ids - lse``, -inf at padding (where no gradient
    flows), 0 on ignored rows."""
    given = [n for n, v in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                            ("kept_ids", kept_ids)) if v is not None]
    if given:
        raise ValueError(f"ids reads full-vocabulary logprobs, which a truncation does not "
                         f"define: pass it without {given}")
    if vocab_parallel is not None or sharded_head(weight, bias) is not None:
        raise ValueError("ids is unsupported with vocab_parallel or a DTensor weight "
                         "(the ids' rows lie in other ranks' slices)")
    check_ignore_index(ignore_index)
    check_byte_budget("max_tile_bytes", max_tile_bytes)
    kept.check_kept_temperature(temperature, targets, compute_dtype(hidden))
    hidden, weight, bias = _upcast(hidden, weight, bias, head_dtype)
    want = tuple(stats) if "lse" in stats else (*stats, "lse")
    out = linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                          sampler=sampler, softcap=softcap, logit_scale=logit_scale,
                          ignore_index=ignore_index, return_entropy=return_entropy, stats=want,
                          max_tile_bytes=max_tile_bytes, gather_weight=gather_weight,
                          hidden_grad=hidden_grad, head_dtype=head_dtype)
    with head_precision(head_dtype):
        z = kept.id_logits(hidden, weight, targets, ids, bias=bias, temperature=temperature,
                           softcap=None if logit_scale == 0 else softcap,
                           logit_scale=logit_scale, ignore_index=ignore_index,
                           dtype=compute_dtype(hidden, head_dtype),
                           max_tile_bytes=max_tile_bytes,
                           gather_weight=precision_gather(gather_weight, head_dtype))
    lp = torch.where(ids >= 0, z - out.lse.unsqueeze(-1).to(z.dtype), -math.inf)
    out.id_logprobs = torch.where((targets != ignore_index).unsqueeze(-1), lp, 0.0)
    if "lse" not in stats:
        out.lse = None
    return out


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    kept_ids: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    sampler: str = "vllm",
    softcap: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    stats: tuple[str, ...] | list[str] = (),
    vocab_parallel=None,
    max_tile_bytes: int | None = None,
    gather_weight: Callable[[], AbstractContextManager] | None = None,
    hidden_grad: str = "sum",
    head_dtype: str | None = None,
) -> LogprobOutput:
    """Per-token logprob (and entropy, softmax statistics) of ``targets`` under the LM head.

    The tempered logits ``z = logit_scale * softcap(hidden @ weight^T + bias) / temperature``
    (softcap ``c * tanh(x / c)``) are streamed through tiles and never stored whole.
    ``logit_scale=0`` is allowed: every logit is 0, the softmax uniform, the gradients 0.

    Args:
        hidden: ``[..., D]`` fp32/bf16/fp16 hidden states (e.g. ``[B, T, D]`` or ``[N, D]``);
            the head runs in their dtype (autocast's under ``torch.autocast``), ``weight`` and
            ``bias`` of another float dtype cast to it, their gradients in their own dtype.
        weight: ``[V, D]`` head weight (``[V_r, D]``, this rank's slice, with ``vocab_parallel``).
            An FSDP2 DTensor (``Shard(0)`` on a 1-D mesh; ``bias`` then too) runs without a
            gather of the weight: the ranks' tokens are all-gathered and each rank's slice is a
            vocabulary-parallel head over the mesh's group; each rank gets its own tokens'
            results and hidden gradient, the weight's lands sharded, the mean over ranks of
            each rank's loss gradient (FSDP2's average; ``fused_losses/head/dtensor.py``).
        targets: integer token ids shaped ``hidden.shape[:-1]``, in ``[0, V)`` or
            ``ignore_index`` (an integer); ignored rows are dropped before any kernel runs.
        bias: optional ``[V]`` head bias.
        temperature: a number or a float tensor of ``targets``' shape (one per token), a
            normal number of the accumulation dtype (``[tiny, max]`` of fp32, of fp64 for
            fp64 inputs; `check_temperature`), on every path alike.
        top_k, top_p, min_p: vLLM's truncations (a number or a tensor of ``targets``' shape;
            None: off; ``top_k >= V``, ``top_p == 1``, ``min_p == 0`` are no-ops): the
            results are then those of the distribution vLLM samples from, the tempered logits
            truncated and renormalised (``logprobs`` ``-inf`` for targets outside the kept set,
            ``entropy`` the kept distribution's); see ``docs/sampler.md``. With
            ``vocab_parallel``, a distributed select gives one process's kept set. Not with
            the stats ``sum_p_sq``, ``mean_logit``, ``is_top1``.
        sampler: whose rules ``top_k`` / ``top_p`` / ``min_p`` follow: ``"vllm"`` (default),
            ``"sglang"`` (its FlashInfer backend) or ``"transformers"`` (``generate``'s
            warpers); they differ in order and ties (the table in ``docs/sampler.md``).
        kept_ids: the kept set an engine recorded, instead of ``top_k`` / ``top_p`` /
            ``min_p``: an int64 tensor ``[*targets.shape, K]`` of vocabulary ids, padded with
            -1 (sets of different sizes per token). The results are those of the tempered
            softmax renormalised over the set, from a gather of its weight rows in bounded
            chunks (``stats`` may ask for ``"log_kept_mass"`` only, one streamed pass more).
            Not with ``vocab_parallel`` nor under ``torch.compile``.
        ids: ids to read logprobs at, an int64 tensor ``[*targets.shape, K]`` (a teacher's
            top-k ids, the rollout's top-k, offline soft labels' ids; -1 pads, repeats
            allowed): ``id_logprobs`` holds ``z_i - logsumexp(z)``, the full-vocabulary
            logprobs of those ids under the same transformed logits, with gradients; -inf at
            padding (where no gradient flows), 0 on ignored rows. From a gather of ``K``
            weight rows per token and the plain path's ``lse`` (one streamed pass), never
            the logits; see ``docs/distillation.md``. Combines with the plain call's outputs
            and a per-token temperature; not with ``top_k`` / ``top_p`` / ``min_p`` /
            ``kept_ids``, ``vocab_parallel`` or a DTensor head, nor under ``torch.compile``.
        return_entropy: also return ``H = -sum_j p_j log p_j``.
        stats: any of ``"sum_p_sq"`` (``sum_j p_j^2``), ``"mean_logit"``, ``"is_top1"``
            (target is an argmax), ``"lse"`` (``log sum_j exp z_j``), ``"log_kept_mass"``
            (log of the kept set's probability under the tempered untruncated softmax; 0 with
            no truncation).
        vocab_parallel: a ``torch.distributed`` process group over which the vocabulary is
            sharded in rank order (targets are global ids); every rank gets the same results
            and its slice's weight gradient; the hidden gradient is summed over the group.
            Not with a DTensor ``weight``, whose mesh gives the group.
        max_tile_bytes: bound in bytes (an integer > 0) on temporary logits of the chunked
            torch path (default 64 MB).
        gather_weight: for sharded parameters (DeepSpeed ZeRO-3), a callable returning a
            context manager under which ``weight`` and ``bias`` hold their full values; the
            backward, which recomputes the logits, runs inside it (on every path: plain,
            ``top_k`` / ``top_p`` / ``min_p``, a per-token temperature, ``kept_ids``; eager
            only). The caller runs the forward inside the same context.
        hidden_grad: with ``vocab_parallel``, ``"sum"`` returns the hidden gradient summed over
            the group; ``"partial"`` returns this rank's slice's contribution only, for callers
            whose own communication sums it (Megatron's sequence-parallel reduce-scatter).
        head_dtype: the precision of the head's GEMMs. None: the compute dtype above.
            ``"float32"``: fp32 GEMMs and logits from 16-bit inputs (upcast inside, chunk by
            chunk on the torch path), gradients back in each input's dtype (TRL's
            ``cast_lm_head_to_fp32``, NeMo-RL's ``fp32_lm_head``); fp64 inputs stay fp64.
            ``"tf32"``: as ``"float32"``, every GEMM of the head (forward and backward)
            under torch's fp32 matmul precision ``"high"`` (TF32 tensor cores on CUDA; a CPU
            has no TF32 and computes fp32), restored after. On every path (plain,
            ``top_k`` / ``top_p`` / ``min_p``, ``kept_ids``, ``ids``, ``vocab_parallel``).

    Returns:
        :class:`LogprobOutput` with fp32 tensors shaped like ``targets``. Gradients reach
        ``hidden``, ``weight`` and ``bias`` through ``logprobs``, ``entropy``, ``sum_p_sq``,
        ``mean_logit`` and ``lse`` (a z-loss on it trains the head); outputs that receive no
        gradient cost nothing in the backward.
    """
    stats = tuple(stats)
    check_head_args(hidden, weight, targets, bias,
                    1.0 if isinstance(temperature, torch.Tensor) else temperature, softcap,
                    logit_scale, stats, zero_scale=True)
    sampled.check_sampler(sampler)
    check_head_dtype(head_dtype)
    if ids is not None:
        return _at_ids(hidden, weight, targets, ids, bias, temperature, top_k, top_p, min_p,
                       kept_ids, sampler, softcap, logit_scale, ignore_index, return_entropy,
                       stats, vocab_parallel, max_tile_bytes, gather_weight, hidden_grad,
                       head_dtype)
    fsdp = sharded_head(weight, bias)
    if fsdp is not None:  # an FSDP2 DTensor head: the tokens gathered, never the weight
        return sharded_logprobs(
            linear_logprobs, fsdp, hidden, targets, kept_ids=kept_ids,
            vocab_parallel=vocab_parallel, gather_weight=gather_weight, hidden_grad=hidden_grad,
            return_entropy=return_entropy, stats=stats, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, sampler=sampler, softcap=softcap,
            logit_scale=logit_scale, ignore_index=ignore_index, max_tile_bytes=max_tile_bytes,
            head_dtype=head_dtype)
    if kept_ids is not None:
        return _kept_set(hidden, weight, targets, kept_ids, bias, temperature, top_k, top_p,
                         min_p, softcap, logit_scale, ignore_index, return_entropy, stats,
                         vocab_parallel, max_tile_bytes, gather_weight, head_dtype)
    # with vocab_parallel the whole vocabulary's size is known inside the op only
    sampler = sampled.sampler_settings(targets, None if vocab_parallel is not None
                                       else weight.shape[0], temperature, top_k, top_p, min_p,
                                       sampler)
    if sampler is not None:
        temperature = 1.0 if sampler.temperature is not None else temperature
        plain_only = [s for s in stats if s in ("sum_p_sq", "mean_logit", "is_top1")]
        if plain_only:
            raise ValueError(f"stats {plain_only} are unsupported with top_k/top_p/min_p or a "
                             f"per-token temperature")
    if logit_scale == 0:
        softcap = None  # every logit is 0 whatever the cap (and so is every gradient)
    check_vocab_parallel(vocab_parallel, hidden_grad)
    check_ignore_index(ignore_index)
    check_byte_budget("max_tile_bytes", max_tile_bytes)
    dtype = compute_dtype(hidden, head_dtype)
    want_s2, want_sum_z = "sum_p_sq" in stats, "mean_logit" in stats
    kept_mass = None
    if sampler is not None:
        # One graph node too: the settings' values are checked inside the op (requires
        # torch >= 2.4, as the package does). A gather callable does not fit the op's
        # schema: the op's own forward and backward then run eagerly, the backward inside it.
        run = (torch.ops.logitless.sampled_logprobs if gather_weight is None
               else sampled.gathered(gather_weight))
        lp, ent, kept_mass, lse, *_ = run(
            hidden, weight, bias, targets,
            *sampled.per_token(sampler, targets, float(temperature), dtype),
            None if softcap is None else float(softcap), float(logit_scale), int(ignore_index),
            max_tile_bytes, dtype, sampler.sampler,
            None if vocab_parallel is None else vocab_parallel.group_name, hidden_grad,
            head_dtype)
        outs = (lp, ent, None, None, None, lse)
    elif gather_weight is None:
        # One graph node under torch.compile: the op compacts, validates and plans inside; a
        # process group crosses by name, and its collectives run inside the op too.
        outs = torch.ops.logitless.linear_logprobs(
            hidden, weight, bias, targets, float(temperature),
            None if softcap is None else float(softcap), float(logit_scale), int(ignore_index),
            max_tile_bytes, dtype, want_s2, want_sum_z,
            None if vocab_parallel is None else vocab_parallel.group_name, hidden_grad,
            head_dtype)
    else:
        # A gather callable does not fit an op's schema: eager only.
        group = vocab_parallel
        if group is not None:
            offset, v_total = _vocab_offset(weight.shape[0], group, hidden.device)
        else:
            offset, v_total = 0, weight.shape[0]
        spec = _Spec(float(temperature), None if softcap is None else float(softcap),
                     float(logit_scale), v_total, want_s2, want_sum_z,
                     _backend_for(hidden.device, dtype), group, hidden_grad, max_tile_bytes,
                     precision_gather(gather_weight, head_dtype), dtype)
        with head_precision(head_dtype):
            outs = _logprobs_impl(hidden, weight, bias, targets, spec, ignore_index, offset,
                                  _LinearSoftmax.apply)
    lp, ent, s2, mean, top1, lse = outs[:6]
    if kept_mass is None and "log_kept_mass" in stats:
        kept_mass = torch.zeros_like(lp)
    return LogprobOutput(
        logprobs=lp,
        entropy=ent if return_entropy else None,
        sum_p_sq=s2 if want_s2 else None,
        mean_logit=mean if want_sum_z else None,
        is_top1=top1 if "is_top1" in stats else None,
        lse=lse if "lse" in stats else None,
        log_kept_mass=kept_mass if "log_kept_mass" in stats else None,
    )


def _local_spec(hidden, weight, temperature, softcap, logit_scale, want_s2=False,
                want_sum_z=False, tile_bytes=None, dtype=None) -> _Spec:
    """The spec of a call without vocab parallelism or a gather callable."""
    dtype = hidden.dtype if dtype is None else dtype
    return _Spec(float(temperature), None if softcap is None else float(softcap),
                 float(logit_scale), weight.shape[0], want_s2, want_sum_z,
                 _backend_for(hidden.device, dtype), None, "sum", tile_bytes, None, dtype)


def _logprobs_impl(hidden, weight, bias, targets, spec: _Spec, ignore_index: int, offset: int,
                   run) -> tuple[torch.Tensor, ...]:
    """Validate and compact the rows, ``run(h, weight, bias, t, spec)`` on them and scatter its
    statistics back to ``targets``' shape (0 at ignored positions)."""
    flat_t, rows = compact_rows(targets, ignore_index, spec.vocab_total)
    h = take_rows(hidden, rows, hidden.shape[-1])
    # With vocab_parallel, local ids lie outside [0, v_local) when the target is in another
    # rank's slice: below 0 before this slice, past its end after it (is_top1 needs which).
    t = take_rows(flat_t, rows) - offset if offset else take_rows(flat_t, rows)
    return tuple(put_rows(x, rows, targets.shape) for x in run(h, weight, bias, t, spec))


def rows_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, softcap=None,
                   logit_scale=1.0, head_dtype=None, shard: VocabShard | None = None):
    """`linear_logprobs`'s private path for rows a caller has checked already (the chunks of
    ``fused_policy_loss``): ``hidden [N, D]``, ``weight`` and ``bias`` in one compute dtype,
    every target in ``[0, V)``. No checks, no host synchronisation. With ``shard`` (placed),
    ``weight`` is this rank's slice, the targets local to it, and the statistics and the
    hidden gradient are reduced over its group as in `linear_logprobs`.
    Returns ``(logprobs, entropy)``, each ``[N]``, with gradient; the backward under
    `head_precision` of ``head_dtype`` (the caller runs the forward so)."""
    spec = dataclasses.replace(_local_spec(hidden, weight, temperature, softcap, logit_scale),
                               gather_weight=precision_gather(None, head_dtype))
    if shard is not None:
        spec = dataclasses.replace(spec, vocab_total=shard.total, group=shard.group,
                                   hidden_grad=shard.hidden_grad)
    lp, ent, *_ = _LinearSoftmax.apply(hidden, weight, bias, targets, spec)
    return lp, ent


# --- linear_logprobs ----------------------------------------------------------------------

# The op's arguments, declared once: the implementations below read them by name, and its
# backward op takes them too (`oplib.Op`). vocab parallelism: the process group by name
# (``ProcessGroup.group_name``, as torch's functional collectives take it), resolved inside the
# op; None: the vocabulary is whole.
_LP_ARGS = ("Tensor hidden", "Tensor weight", "Tensor? bias", "Tensor targets",
            "float temperature", "float? softcap", "float logit_scale", "int ignore_index",
            "int? tile_bytes", "ScalarType dtype", "bool want_s2", "bool want_sum_z",
            "str? group_name=None", 'str hidden_grad="sum"', "str? head_dtype=None")


def _lp_spec(a, want_s2=False, want_sum_z=False):
    """``(spec, offset)``: the call's spec and the first global id of this rank's vocabulary
    slice. ``a.group_name`` names the process group the vocabulary is sharded over (None: not
    sharded, offset 0); the group's all-gather of slice sizes and its all-reduces run here,
    inside the op."""

    spec = _local_spec(a.hidden, a.weight, a.temperature, a.softcap, a.logit_scale, want_s2,
                       want_sum_z, a.tile_bytes, a.dtype)
    if a.group_name is None:
        return spec, 0
    group = resolve(a.group_name)
    offset, v_total = _vocab_offset(a.weight.shape[0], group, a.hidden.device)
    return dataclasses.replace(spec, vocab_total=v_total, group=group,
                               hidden_grad=a.hidden_grad), offset


def _lp_forward(a):
    spec, offset = _lp_spec(a, a.want_s2, a.want_sum_z)
    return distinct(_logprobs_impl(a.hidden, a.weight, a.bias, a.targets, spec, a.ignore_index,
                                   offset, lambda h, w, b, t, s: _rows_forward(s, h, w, b, t)))


def _lp_forward_fake(a):
    acc = acc_dtype(a.dtype)
    floats = [a.hidden.new_empty(a.targets.shape, dtype=acc) for _ in range(4)]
    top1 = a.hidden.new_empty(a.targets.shape, dtype=torch.bool)
    return (*floats, top1, *(a.hidden.new_empty(a.targets.shape, dtype=acc) for _ in range(3)))


def _lp_backward(a):
    spec, offset = _lp_spec(a)
    flat_t, rows = compact_rows(a.targets, a.ignore_index, spec.vocab_total)
    # the entropy and sum_p_sq enter the backward only with a gradient of their own
    per_row = [take_rows(x, rows) for x in (
        flat_t - offset, a.top, a.log_l, a.entropy if a.g_entropy is not None else None,
        a.sum_p_sq if a.g_sum_p_sq is not None else None, a.g_lp, a.g_entropy, a.g_sum_p_sq,
        a.g_mean_logit, a.g_lse)]
    d_hidden, d_weight, d_bias = _rows_backward(
        spec, take_rows(a.hidden, rows, a.hidden.shape[-1]), a.weight, a.bias, *per_row[:5],
        tuple(per_row[5:]), a.need)
    return grads_or_empty(a.hidden, a.weight, rows, d_hidden, d_weight, d_bias)


LINEAR_LOGPROBS = Op(
    "linear_logprobs", _LP_ARGS,
    ("lp", "entropy", "sum_p_sq", "mean_logit", "top1", "lse", "top", "log_l"),
    _lp_forward, _lp_forward_fake, wrt=("hidden", "weight", "bias"),
    grads=("lp", "entropy", "sum_p_sq", "mean_logit", "lse"),
    saved=("top", "log_l", "entropy", "sum_p_sq"), backward=_lp_backward,
    forward_only=("want_s2", "want_sum_z"))
