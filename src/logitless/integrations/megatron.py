"""Megatron-Core: per-token logprobs and entropy from a ``GPTModel``'s tensor-parallel output
layer, computed by :func:`linear_logprobs` without the ``[s, b, V/TP]`` logits.

Two ways in, one computation:

- megatron-core >= 0.18: pass :func:`output_processor` as ``GPTModel.forward``'s
  ``output_processor`` and a :class:`MegatronHead` as its ``output_processor_context``; the model
  returns the :class:`LogprobOutput` instead of its loss;
- older versions (no hook): :func:`forward` runs the model with ``post_process`` off (the
  decoder's hidden states come back, as for a pipeline stage without the head) and then the
  same computation over the model's output layer.

What the computation does with Megatron's layout: the hidden states ``[s, b, h]`` (``[t, 1, h]``
for packed THD sequences, ``packed_seq_params``) are all-gathered over the tensor-parallel group
first under sequence parallelism, by Megatron's own ``gather_from_sequence_parallel_region``
(its backward reduce-scatters the hidden gradient, so each rank's slice contributes its part:
``hidden_grad="partial"``); without it the hidden gradient is summed over the group, as
Megatron's ``copy_to_tensor_model_parallel_region`` does. The output layer's weight (the shared
embedding when the model ties them) is this rank's vocabulary slice, passed as
``vocab_parallel=`` the tensor-parallel group. ``labels`` ``[b, s]`` are global ids; ``-100``
rows are skipped (Megatron's own cross-entropy has no ignore index). With ``vocab_size`` the
padded rows Megatron adds (``make_vocab_size_divisible_by``) are left out of the softmax, so the
logprobs are those of the real vocabulary, as a rollout engine computes them.

With ``MegatronHead(loss=FusedLoss(config, old_logprobs, advantages))`` the same pass computes
the policy loss instead, by :func:`fused_policy_loss` over the sharded head
(``vocab_parallel=``), and the model returns ``(loss, metrics)``.

This module does not import megatron until a head is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss
from logitless.fused_losses.head.logprobs import LogprobOutput, linear_logprobs
from logitless.fused_losses.objectives.config import PolicyLossConfig

__all__ = ["FusedLoss", "MegatronHead", "forward", "output_processor"]


@dataclass
class FusedLoss:
    """The policy loss a :class:`MegatronHead` computes in place of the per-token results:
    :func:`fused_policy_loss` over the tensor-parallel output layer (``vocab_parallel=`` its
    group), the logits never formed.

    Attributes:
        config: the objective, a :class:`PolicyLossConfig`.
        old_logprobs: ``[b, s]`` like ``labels``.
        advantages: ``[b]`` or ``[b, s]``.
        mask: ``[b, s]``, the tokens in the loss (None: every token whose label is not
            ``ignore_index``; an ``ignore_index`` label drops its token either way).
        options: further keywords of :func:`fused_policy_loss` (``ref_logprobs``,
            ``rollout_logprobs``, ``entropy_coef``, ``ref_hidden`` / ``ref_weight`` for the
            exact KL with this rank's slice of the reference head, ``max_tile_bytes``, ...),
            per-token tensors ``[b, s]`` like ``labels``.
    """

    config: PolicyLossConfig
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    options: dict = field(default_factory=dict)


@dataclass
class MegatronHead:
    """What the head computes; the ``output_processor_context`` of :func:`output_processor`.

    Attributes:
        temperature: a number, or a float tensor ``[b, s]`` like ``labels`` (one per token).
        vocab_size: the real vocabulary's size; rows of the padded output layer at or past it
            are left out of the softmax. None: every row counts (Megatron's own loss).
        return_entropy: also return the entropy of the (tempered, truncated) softmax.
        top_k, top_p, min_p, sampler: the rollout sampler's truncation, as
            :func:`linear_logprobs` takes it (tensors ``[b, s]`` like ``labels``).
        kept_ids: recorded kept sets ``[b, s, K]`` (``linear_logprobs``' ``kept_ids``, -1
            padded). Over a sharded head the weight rows of the batch's kept ids and targets
            are gathered from their ranks (one all-reduce of ``[U, D]``, ``U`` the distinct
            ids); each rank then computes every token, and each row's gradient lands on its
            rank. Not with ``stats``.
        stats: further statistics of ``linear_logprobs`` (``"sum_p_sq"``, ``"lse"``, ...).
        ignore_index: the label of rows to skip.
        head_dtype: the precision of the head's GEMMs, ``linear_logprobs``' (None,
            ``"float32"``: fp32 logits from bf16 hidden states, or ``"tf32"``).
        loss: a :class:`FusedLoss`: the model returns ``(loss, metrics)`` of
            :func:`fused_policy_loss` instead (a number ``temperature``; not with the
            sampler's truncations, ``kept_ids`` or ``stats``).
    """

    temperature: float | torch.Tensor = 1.0
    vocab_size: int | None = None
    return_entropy: bool = True
    top_k: int | torch.Tensor | None = None
    top_p: float | torch.Tensor | None = None
    min_p: float | torch.Tensor | None = None
    sampler: str = "vllm"
    kept_ids: torch.Tensor | None = None
    stats: tuple[str, ...] = ()
    ignore_index: int = -100
    head_dtype: str | None = None
    loss: FusedLoss | None = None


def _tp_group(output_layer):
    """The output layer's tensor-parallel group (an attribute since megatron-core 0.13; before,
    the global one)."""
    group = getattr(output_layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


def _kept_rows(weight, bias, targets, kept_ids, group, offset, ignore_index):
    """``kept_ids`` over a vocabulary-sharded head: the weight (and bias) rows of the distinct
    ids the kept sets and targets name, gathered from the ranks that hold them (Megatron's
    ``reduce_from_tensor_model_parallel_region``: forward an all-reduce, backward the identity,
    so each row's gradient lands on its own rank), and the ids renumbered into them."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if not isinstance(kept_ids, torch.Tensor) or kept_ids.dtype != torch.int64:
        raise ValueError("kept_ids must be an int64 tensor [b, s, K] of vocabulary ids")
    named = torch.cat([kept_ids.reshape(-1), targets.reshape(-1)])
    ids = torch.unique(named[(named >= 0) & (named != ignore_index)])
    local = ids - offset
    mine = (local >= 0) & (local < weight.shape[0])
    at = local.clamp(0, max(weight.shape[0] - 1, 0))

    def gather(x):
        picked = x[at] if x.shape[0] else x.new_zeros((len(ids), *x.shape[1:]))
        mask = mine.reshape(-1, *([1] * (x.dim() - 1)))
        return reduce_from_tensor_model_parallel_region(torch.where(mask, picked, 0.0),
                                                        group=group)

    def renumber(x, pad):
        return torch.where((x >= 0) & (x != ignore_index),
                           torch.searchsorted(ids, x.clamp_min(0)), pad)

    return (gather(weight), None if bias is None else gather(bias),
            renumber(targets, ignore_index), renumber(kept_ids, -1))


def _real_rows(weight, bias, vocab_size, group):
    """This rank's slice without the padded rows at or past ``vocab_size`` (Megatron splits
    the padded vocabulary in equal slices in rank order)."""
    if vocab_size is None:
        return weight, bias
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    padded = weight.shape[0] * world
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size must be an integer in [1, {padded}] (the output layer's "
                         f"padded vocabulary), got {vocab_size!r}")
    rows = min(max(vocab_size - rank * weight.shape[0], 0), weight.shape[0])
    return weight[:rows], None if bias is None else bias[:rows]


def _per_token(x, labels):
    """A per-token ``[b, s]`` setting (or ``[b, s, K]`` ids) in the head's ``[s, b]`` order."""
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == labels.shape:
        return x.transpose(0, 1)
    return x


def _compute(hidden_states, weight, bias, labels, head, sequence_parallel, group,
             logit_scale=1.0) -> LogprobOutput:
    if not isinstance(head, MegatronHead):
        raise ValueError(f"output_processor_context must be a MegatronHead, got "
                         f"{type(head).__name__}")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError("labels must be the [b, s] token ids the model's loss would take, got "
                         f"{getattr(labels, 'shape', labels)!r}")
    if head.loss is not None:
        _check_loss(head)
    offset = torch.distributed.get_rank(group) * weight.shape[0]
    weight, bias = _real_rows(weight, bias, head.vocab_size, group)
    targets = labels.transpose(0, 1)  # [b, s] -> the hidden states' [s, b]
    kept_ids = _per_token(head.kept_ids, labels)
    # kept sets over a sharded head: their rows gathered, then every rank computes every token
    # with its whole hidden gradient (no reduction after the sequence-parallel gather)
    gathered = kept_ids is not None and torch.distributed.get_world_size(group) > 1
    if gathered:
        if head.stats:
            raise ValueError("stats are unsupported with kept_ids over a tensor-parallel head")
        weight, bias, targets, kept_ids = _kept_rows(weight, bias, targets, kept_ids, group,
                                                     offset, head.ignore_index)
    if sequence_parallel:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=not gathered, group=group)
    alone = gathered or torch.distributed.get_world_size(group) == 1
    if head.loss is not None:
        return _fused_loss(hidden_states, weight, bias, labels, head, logit_scale,
                           None if alone else group, sequence_parallel)
    out = linear_logprobs(
        hidden_states, weight, targets, bias=bias,
        temperature=_per_token(head.temperature, labels), top_k=_per_token(head.top_k, labels),
        top_p=_per_token(head.top_p, labels), min_p=_per_token(head.min_p, labels),
        kept_ids=kept_ids, sampler=head.sampler,
        logit_scale=logit_scale, ignore_index=head.ignore_index,
        return_entropy=head.return_entropy, stats=head.stats,
        vocab_parallel=None if alone else group,
        hidden_grad="partial" if sequence_parallel else "sum", head_dtype=head.head_dtype)
    for name, value in vars(out).items():  # [s, b] -> labels' [b, s]
        if value is not None:
            setattr(out, name, value.transpose(0, 1))
    return out


def _check_loss(head: MegatronHead) -> None:
    """What a `FusedLoss` head refuses (``ValueError``)."""
    if not isinstance(head.loss, FusedLoss):
        raise ValueError(f"loss must be a FusedLoss, got {type(head.loss).__name__}")
    if isinstance(head.temperature, torch.Tensor):
        raise ValueError("temperature: a FusedLoss takes a number, not per-token temperatures")
    given = [name for name in ("top_k", "top_p", "min_p", "kept_ids")
             if getattr(head, name) is not None] + (["stats"] if head.stats else [])
    if given:
        raise ValueError(f"{', '.join(given)}: not with a FusedLoss (fused_policy_loss scores "
                         "the untruncated softmax)")


def _fused_loss(hidden_states, weight, bias, labels, head: MegatronHead, logit_scale, group,
                sequence_parallel):
    """`fused_policy_loss` over this rank's vocabulary slice, on the ``[b, s]`` grid: the
    hidden states ``[s, b, h]`` (gathered) transposed, the hidden gradient left partial under
    sequence parallelism (the gather's backward reduce-scatters it)."""
    loss = head.loss
    mask = torch.ones_like(labels, dtype=torch.bool) if loss.mask is None else loss.mask
    return fused_policy_loss(
        hidden_states.transpose(0, 1), weight, labels, loss.old_logprobs, loss.advantages,
        mask, loss.config, bias=bias, temperature=head.temperature, logit_scale=logit_scale,
        ignore_index=head.ignore_index, vocab_parallel=group, head_dtype=head.head_dtype,
        hidden_grad="partial" if sequence_parallel else "sum", **loss.options)


def _logit_scale(config) -> float:
    """MuP's output multiplier, as ``LanguageModule._scale_logits`` applies it (1 without)."""
    if not getattr(config, "use_mup", False):
        return 1.0
    return float(config.mup_output_mult)


def output_processor(*, hidden_states, output_layer, output_weight, labels, context, config,
                     **_unused) -> LogprobOutput:
    """``GPTModel.forward``'s ``output_processor`` (megatron-core >= 0.18): the per-token
    results of ``context`` (a :class:`MegatronHead`) at ``labels`` (``[b, s]``), shaped
    ``[b, s]``, in place of the model's loss. Pass ``labels`` to the forward (the hook receives
    what the model was given)."""
    weight = output_weight if output_weight is not None else output_layer.weight
    return _compute(hidden_states, weight, getattr(output_layer, "bias", None), labels, context,
                    bool(getattr(output_layer, "sequence_parallel", False)),
                    _tp_group(output_layer), _logit_scale(config))


def forward(model, head: MegatronHead, *, labels, **forward_kwargs) -> LogprobOutput:
    """``model(**forward_kwargs)`` (a ``GPTModel`` with its output layer, any megatron-core
    version) run to the decoder's hidden states, then :func:`output_processor`'s computation
    over its output layer: per-token results at ``labels`` ``[b, s]``, shaped ``[b, s]``."""
    if not getattr(model, "post_process", False) or not hasattr(model, "output_layer"):
        raise ValueError("model must be a GPTModel stage with its output layer "
                         "(post_process=True)")
    if getattr(model.config, "mtp_num_layers", None):
        raise ValueError("model: multi-token prediction layers are unsupported by forward(); "
                         "use output_processor (megatron-core >= 0.18)")
    model.post_process = False  # the forward returns the decoder's hidden states
    try:
        hidden_states = model(**forward_kwargs)
    finally:
        model.post_process = True
    output_weight = (model.shared_embedding_or_output_weight()
                     if model.share_embeddings_and_output_weights else None)
    return output_processor(hidden_states=hidden_states, output_layer=model.output_layer,
                            output_weight=output_weight, labels=labels, context=head,
                            config=model.config)
