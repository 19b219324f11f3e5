"""A drop-in for verl's fused ``linear_cross_entropy``, computed by :func:`linear_logprobs`.

verl's patched model forwards (``verl.models.transformers.*`` when
``use_fused_kernels=True`` with ``fused_kernel_options.impl_backend=triton``, and the Megatron
forwards in ``verl.models.mcore``) call
``linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)`` and
expect fp32 per-token logprobs and entropies, flattened to ``[N]``. verl's own kernel needs
CUDA, a hidden size that is a multiple of 128, and computes every position. This one runs on
any device and hidden size, drops ``ignore_index`` rows before the head, shards the vocabulary
over ``dist_process_group`` (the tensor-parallel group; like verl's kernel it returns each
rank's partial hidden gradient, which Megatron's sequence-parallel gather sums) and, because
the entropy falls out of the logprob pass's accumulators, costs nothing for it in the forward
and nothing in the backward when no gradient reaches it.

Sampler matching: after :func:`set_head_sampler` (which ``LogitlessPolicyLossConfig``'s
``match_sampler`` calls in each process that builds the actor config), every call computes the
logprobs and entropies of the distribution the rollout engine samples from (the tempered logits
truncated by top-k / top-p / min-p as vLLM does, renormalised); :func:`sampler_head_calls`
counts those calls, so the loss can check that its logprobs came through this head.

Replay: after :func:`set_head_replay` (``match_sampler: replay``), every call renormalises over
the kept sets the rollout engine recorded instead. They travel in the batch under
``"kept_ids"`` (int64 ``[B, response_length, K]``, -1 padded, aligned with ``responses``);
:func:`set_head_replay` wraps verl's FSDP engine's ``prepare_model_inputs`` so that each micro
batch's sets are laid out as the head's rows (:func:`kept_rows_for_head`) and handed to the
next head call.

Optimal token baseline: verl's ``optimal_token_baseline`` and ``tir_optimal_token_baseline``
advantage estimators read ``sum_pi_squared`` (the sum of the squared token probabilities,
``sum_j p_j^2``, per position) from the actor, which verl computes only from materialised
logits (``calculate_sum_pi_squared=True`` raises with ``use_fused_kernels=True``). After
``enable_fused_head(sum_pi_squared=True)`` every head call also keeps its rows' ``sum_p_sq``
(a statistic of the same vocabulary pass), and verl's FSDP engine's
``prepare_model_outputs`` is wrapped so that a micro batch asking for it gets it, laid out
by verl's own code exactly as the entropy is.

This module does not import verl until :func:`enable_fused_head` is called.
"""

from __future__ import annotations

import sys

import torch

from logitless.fused_losses.head.dtensor import is_dtensor
from logitless.fused_losses.head.logprobs import linear_logprobs
from logitless.fused_losses.oplib import check_head_dtype
from logitless.integrations.replay import KEPT_IDS_KEY
from logitless.integrations.sampler_config import SamplerTruncation

__all__ = [
    "disable_fused_head",
    "enable_fused_head",
    "fused_head_enabled",
    "head_dtype",
    "head_replays",
    "head_sampler",
    "kept_rows_for_head",
    "linear_cross_entropy",
    "sampler_head_calls",
    "set_head_deferral",
    "set_head_dtype",
    "set_head_replay",
    "set_head_sampler",
]

_REDUCTIONS = ("none", "sum", "mean")

# The module that defines verl's function, then the modules that bind it at import time
# (``from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy`` at the top).
# The HF forwards import it inside the function body, so patching the first one covers them.
_KERNEL_MODULE = "verl.utils.kernel.linear_cross_entropy"
_BINDING_MODULES = (
    _KERNEL_MODULE,
    "verl.models.mcore.model_forward_fused",
    "verl.models.mcore.model_forward_1f1b_overlap",
)
_ATTR = "linear_cross_entropy"
_original: object | None = None
_sampler: SamplerTruncation | None = None
_sampler_calls = 0
_replay = False
_pending_kept: torch.Tensor | None = None
# verl's FSDP engine class whose prepare_model_inputs lays the recorded sets out, and its own
_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
_ENGINE_CLASS = "FSDPEngineWithLMHead"
_original_prepare = None
# enable_fused_head(sum_pi_squared=True): the head keeps its latest call's sum_p_sq, and the
# engine's prepare_model_outputs (its own, kept here) lays it out
SUM_PI_SQUARED_KEY = "sum_pi_squared"
_keep_sum_p_sq = False
_pending_sum_p_sq: torch.Tensor | None = None
_original_outputs = None
# set_head_deferral: a hook that may answer a head call itself (the verl adapter's fused loss)
_deferral = None
_head_dtype: str | None = None  # set_head_dtype: the GEMMs' precision of every head call


def set_head_dtype(value: str | None) -> None:
    """Run every later :func:`linear_cross_entropy` call of this process, and the fused loss,
    with ``head_dtype=value`` (None, ``"float32"`` or ``"tf32"``: `linear_logprobs`'s; the
    verl adapter's ``policy_loss.head_dtype``)."""
    global _head_dtype
    check_head_dtype(value)
    _head_dtype = value


def head_dtype() -> str | None:
    """The ``head_dtype`` of this process's head calls (`set_head_dtype`)."""
    return _head_dtype


def set_head_sampler(sampler: SamplerTruncation | None) -> None:
    """Truncate every later :func:`linear_cross_entropy` call of this process as the sampler
    does (None: the full distribution again); restarts :func:`sampler_head_calls` at 0 and
    turns replay off."""
    global _sampler, _sampler_calls
    if sampler is not None and not isinstance(sampler, SamplerTruncation):
        raise ValueError(f"sampler: expected a SamplerTruncation or None, got {sampler!r}")
    set_head_replay(False)
    _sampler = sampler
    _sampler_calls = 0


def set_head_replay(on: bool) -> None:
    """Renormalise every later :func:`linear_cross_entropy` call of this process over the kept
    sets of its micro-batch (``"kept_ids"``), or stop (False). On, it wraps verl's FSDP
    engine's ``prepare_model_inputs`` (undone by ``set_head_replay(False)``) and drops any
    sampler truncation; restarts :func:`sampler_head_calls` at 0."""
    global _replay, _sampler, _sampler_calls, _pending_kept, _original_prepare
    import importlib

    _pending_kept = None
    _sampler_calls = 0
    if on:
        _sampler = None
        engine = getattr(importlib.import_module(_ENGINE_MODULE), _ENGINE_CLASS)
        if _original_prepare is None:
            _original_prepare = engine.prepare_model_inputs
            engine.prepare_model_inputs = _replaying_prepare
    elif _original_prepare is not None:
        engine = getattr(sys.modules[_ENGINE_MODULE], _ENGINE_CLASS)
        engine.prepare_model_inputs = _original_prepare
        _original_prepare = None
    _replay = bool(on)


def set_head_deferral(hook) -> None:
    """Let ``hook(hidden, weight, labels, temperature, reduction, dist_process_group,
    entropy_grad)`` see every later :func:`linear_cross_entropy` call first: a
    ``(logprobs, entropy)`` pair it returns is the call's result, None runs the head as usual
    (``hook=None``: no hook). The verl adapter's ``policy_loss.fused`` hands the head's inputs
    to the loss this way."""
    global _deferral
    _deferral = hook


def head_replays() -> bool:
    """Whether :func:`linear_cross_entropy` renormalises over recorded sets in this process."""
    return _replay


def _replaying_prepare(self, micro_batch):
    """verl's ``prepare_model_inputs``, then the micro-batch's kept sets laid out as the rows
    of the head call its forward makes (not for the value-head engine, which inherits the
    method: a critic in the same process reads no sets)."""
    global _pending_kept
    model_inputs, output_args = _original_prepare(self, micro_batch)
    value_head = getattr(sys.modules[_ENGINE_MODULE], "FSDPEngineWithValueHead", ())
    if _replay and not isinstance(self, value_head):  # a critic's forward has no LM head
        if "shift_labels" in model_inputs:  # remove-padding: the packed, rolled labels
            labels = model_inputs["shift_labels"].reshape(-1)
        else:  # padded [b, S]: the fused forward rolls each row itself
            labels = torch.roll(model_inputs["input_ids"], shifts=-1, dims=-1).reshape(-1)
        _pending_kept = kept_rows_for_head(micro_batch, labels,
                                           "shift_labels" in model_inputs,
                                           int(output_args.get("pad_size", 0) or 0))
    return model_inputs, output_args


def _first_rows(tensor, i: int, n: int) -> torch.Tensor:
    """The first ``n`` rows of sample ``i`` of a padded or a jagged nested tensor."""
    if tensor.is_nested:
        start = int(tensor.offsets()[i])
        return tensor.values()[start:start + n]
    return tensor[i, :n]


def _response_lengths(micro_batch) -> list[int]:
    """Each sample's response length, as verl's ``no_padding_2_padding`` reads it."""
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    if prompts.is_nested:
        return responses.offsets().diff().tolist()
    attention = micro_batch["attention_mask"]
    return attention[:, prompts.shape[1]:].sum(1).tolist()


def kept_rows_for_head(micro_batch, labels: torch.Tensor, packed: bool,
                       pad_size: int = 0) -> torch.Tensor:
    """The micro-batch's recorded sets as the head's rows ``[labels.numel(), K]``.

    ``micro_batch`` is verl's no-padding TensorDict (nested ``input_ids``) with ``kept_ids``
    (``[B, response_length, K]`` padded, or jagged nested): response token ``j`` of sample
    ``i`` is predicted at the position before it, ``end_i - r_i - 1 + j`` of the packed
    sequence (verl's own response slicing). ``packed``: the remove-padding layout (one
    sequence, ``pad_size`` padding rows at its end, then this rank's Ulysses slice); else the
    padded ``[b, S]`` one. Every other row (prompt, padding, a response token with no set whose
    ``response_mask`` is 0) gets the set {its label}: a logprob 0 that verl discards.

    Raises ``ValueError`` naming ``kept_ids`` when the micro-batch has none, it has too few
    rows, or a response token in the loss has an empty set."""
    kept = micro_batch.get(KEPT_IDS_KEY, None)
    if kept is None:
        raise ValueError(
            f"{KEPT_IDS_KEY}: policy_loss.match_sampler='replay' needs the recorded kept sets "
            f"in the batch under {KEPT_IDS_KEY!r} (int64 [batch, response_length, K], -1 "
            f"padded, aligned with responses); this micro-batch has none")
    if kept.dtype != torch.int64:
        raise ValueError(f"{KEPT_IDS_KEY}: expected int64 ids, got {kept.dtype}")
    offsets = micro_batch["input_ids"].offsets().tolist()
    response_mask = micro_batch["response_mask"]
    k = kept.shape[-1]
    rows = torch.full((offsets[-1], k), -1, dtype=torch.int64, device=labels.device)
    for i, r in enumerate(_response_lengths(micro_batch)):
        sets = _first_rows(kept, i, r)
        if sets.shape[0] != r:
            raise ValueError(f"{KEPT_IDS_KEY}: sample {i} has {sets.shape[0]} sets for its "
                             f"{r} response tokens")
        in_loss = _first_rows(response_mask, i, r).bool().to(labels.device)
        empty = (sets < 0).all(-1).to(labels.device) & in_loss
        if bool(empty.any()):
            raise ValueError(f"{KEPT_IDS_KEY}: sample {i}, response token "
                             f"{int(empty.nonzero()[0])} is in the loss but has an empty set")
        end = offsets[i + 1]
        rows[end - r - 1:end - 1] = sets.to(labels.device)
    if packed:
        rows = torch.cat([rows, rows.new_full((pad_size, k), -1)])
        if rows.shape[0] != labels.numel():  # this rank's Ulysses slice of the sequence
            from verl.utils.ulysses import slice_input_tensor

            rows = slice_input_tensor(rows.unsqueeze(0), dim=1, padding=False)[0]
    else:
        width = labels.numel() // (len(offsets) - 1)
        padded = rows.new_full((len(offsets) - 1, width, k), -1)
        for i in range(len(offsets) - 1):
            padded[i, :offsets[i + 1] - offsets[i]] = rows[offsets[i]:offsets[i + 1]]
        rows = padded.reshape(-1, k)
    if rows.shape[0] != labels.numel():
        raise ValueError(f"{KEPT_IDS_KEY}: laid out {rows.shape[0]} rows for the head's "
                         f"{labels.numel()} labels")
    free = (rows < 0).all(-1)
    rows[free, 0] = labels[free]
    return rows


def head_sampler() -> SamplerTruncation | None:
    """The truncations :func:`linear_cross_entropy` applies in this process (None: none)."""
    return _sampler


def sampler_head_calls() -> int:
    """How many :func:`linear_cross_entropy` calls of this process applied the sampler since
    :func:`set_head_sampler`."""
    return _sampler_calls


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
    *,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy`` contract over :func:`logitless.linear_logprobs`.

    Args:
        hidden: ``[..., D]`` hidden states, any D (verl's kernel needs ``D % 128 == 0``).
        weight: ``[V, D]`` head weight, or this rank's ``[V_r, D]`` slice with
            ``dist_process_group`` (contiguous slices in rank order, as Megatron shards it),
            or an FSDP2 ``Shard(0)`` DTensor (verl's FSDP2 wraps ``lm_head`` on its own, and
            the dense models' fused forward passes ``self.lm_head.weight`` as it is): no
            gather, each rank's slice a vocabulary-parallel head over the mesh, the ranks'
            tokens all-gathered (see ``linear_logprobs``); each rank receives its own tokens'
            hidden gradient, the weight's lands sharded (the mean over ranks).
        labels: integer ids, one per row of ``hidden`` (both are flattened, as verl does:
            Megatron passes ``[s, 1, D]`` hidden with ``[1, s]`` labels), global vocabulary
            ids; ``-100`` rows are skipped and read 0.
        temperature: divides the logits.
        reduction: ``"none"`` (per-token logprobs), ``"sum"`` or ``"mean"`` (a scalar over the
            logprobs); the entropy is always per token.
        dist_process_group: the tensor-parallel group the vocabulary is sharded over, or None.
            With a group, the hidden gradient is this rank's partial one (its vocabulary
            slice's contribution), as verl's kernel returns it: the caller sums it over the
            group (Megatron's sequence-parallel gather does, in its backward).
        entropy_grad: False returns the entropy detached (for metrics only), so the backward
            never forms the entropy term even when the loss touches it with a zero coefficient.

    Returns:
        ``(logprobs, entropy)``: fp32 (fp64 for fp64 inputs), ``[N]`` with
        ``N = labels.numel()`` (``logprobs`` a scalar for ``"sum"``/``"mean"``). After
        :func:`set_head_sampler`, those of the sampler's truncated distribution (a logprob is
        ``-inf`` where the label lies outside the kept set).
    """
    global _sampler_calls
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise ValueError(f"temperature must be a number, got {type(temperature).__name__}")
    if hidden.dim() < 1 or labels.numel() != hidden[..., 0].numel():
        # verl flattens both: Megatron's packed path passes hidden [s, 1, D] with labels [1, s].
        raise ValueError(
            f"labels must have one id per row of hidden ({hidden[..., 0].numel()} for hidden "
            f"{tuple(hidden.shape)}), got shape {tuple(labels.shape)}"
        )
    kept = _take_kept(labels)
    if _deferral is not None:
        deferred = _deferral(hidden, weight, labels, temperature, reduction, dist_process_group,
                             entropy_grad, kept)
        if deferred is not None:  # the fused loss applies the truncation (or the sets)
            if _sampler is not None or kept is not None:
                _sampler_calls += 1
            return deferred
    if is_dtensor(weight):
        # verl's FSDP2 wraps lm_head on its own: its weight arrives here a Shard(0) DTensor,
        # which runs vocabulary-parallel over its mesh, the ranks' tokens gathered (not the
        # weight); each rank gets its own tokens' whole hidden gradient.
        if dist_process_group is not None:
            raise ValueError("dist_process_group: a DTensor (FSDP2) weight is sharded over its "
                             "own mesh; pass dist_process_group=None")
        parallel = {}
    else:
        # As verl's kernel: each rank's own share of the hidden gradient; Megatron's
        # sequence-parallel gather before the head sums them in its backward reduce-scatter.
        parallel = dict(vocab_parallel=dist_process_group, hidden_grad="partial")
    out = linear_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        temperature=float(temperature),
        return_entropy=True,
        stats=("sum_p_sq",) if _keep_sum_p_sq else (),
        head_dtype=_head_dtype,
        **parallel,
        **({} if _sampler is None else _sampler.kwargs()),
        **({} if kept is None else {"kept_ids": kept}),
    )
    if _sampler is not None or kept is not None:
        _sampler_calls += 1
    logprobs, entropy = out.logprobs, out.entropy
    if _keep_sum_p_sq:
        global _pending_sum_p_sq
        _pending_sum_p_sq = out.sum_p_sq.detach().reshape(entropy.shape)
    reduction = reduction.lower()
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    if not entropy_grad:
        entropy = entropy.detach()
    return logprobs, entropy


def _take_kept(labels: torch.Tensor) -> torch.Tensor | None:
    """Under replay, the sets laid out for this call (used once), checked against its rows."""
    global _pending_kept
    if not _replay:
        return None
    kept, _pending_kept = _pending_kept, None
    if kept is None:
        raise ValueError(
            f"{KEPT_IDS_KEY}: policy_loss.match_sampler='replay' but no micro-batch sets were "
            f"laid out for this head call (replay supports verl's FSDP engine, whose "
            f"prepare_model_inputs reads {KEPT_IDS_KEY!r})")
    if kept.shape[0] != labels.numel():
        raise ValueError(f"{KEPT_IDS_KEY}: {kept.shape[0]} rows laid out for a head call of "
                         f"{labels.numel()} labels")
    return kept.to(labels.device)


def _linear_cross_entropy_no_entropy_grad(
    hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None
):
    return linear_cross_entropy(hidden, weight, labels, temperature, reduction,
                                dist_process_group, entropy_grad=False)


_DROP_INS = (linear_cross_entropy, _linear_cross_entropy_no_entropy_grad)


def enable_fused_head(*, entropy_grad: bool = True, sum_pi_squared: bool = False) -> None:
    """Route verl's fused head (``use_fused_kernels`` with the ``triton`` backend, and the
    Megatron fused forwards) to :func:`linear_cross_entropy`. Idempotent; undone by
    :func:`disable_fused_head`. Call it in every worker process: the ``verl.plugins`` entry
    point does so when ``LOGITLESS_VERL_FUSED_HEAD=1`` is in the worker's environment.

    ``entropy_grad=False`` detaches the entropy (use it when ``entropy_coeff`` is 0 and the
    entropy is only logged). ``sum_pi_squared=True`` gives verl's FSDP engine
    ``sum_pi_squared`` with fused kernels (``actor.calculate_sum_pi_squared=True``, for the
    optimal-token-baseline estimators; module docstring).
    """
    global _original, _keep_sum_p_sq, _original_outputs
    import importlib

    if sum_pi_squared:
        engine = getattr(importlib.import_module(_ENGINE_MODULE), _ENGINE_CLASS)
        if _original_outputs is None:
            _original_outputs = engine.prepare_model_outputs
            engine.prepare_model_outputs = _prepare_outputs_with_sum_p_sq
        _keep_sum_p_sq = True

    kernel = importlib.import_module(_KERNEL_MODULE)
    current = getattr(kernel, _ATTR)
    if current not in _DROP_INS:
        _original = current
    drop_in = linear_cross_entropy if entropy_grad else _linear_cross_entropy_no_entropy_grad
    for name in _BINDING_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, _ATTR):
            setattr(module, _ATTR, drop_in)


def disable_fused_head() -> None:
    """Give verl back its own ``linear_cross_entropy`` everywhere it was bound (a no-op when
    :func:`enable_fused_head` was never called)."""
    global _original, _keep_sum_p_sq, _pending_sum_p_sq, _original_outputs
    if _original_outputs is not None:
        engine = getattr(sys.modules[_ENGINE_MODULE], _ENGINE_CLASS)
        engine.prepare_model_outputs = _original_outputs
        _original_outputs = None
    _keep_sum_p_sq, _pending_sum_p_sq = False, None
    if _original is None:
        return
    for name in _BINDING_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, _ATTR, None) in _DROP_INS:
            setattr(module, _ATTR, _original)
    _original = None


def _prepare_outputs_with_sum_p_sq(self, output, output_args, micro_batch,
                                   logits_processor_func):
    """verl's ``prepare_model_outputs``; for a micro batch with ``calculate_sum_pi_squared``
    and ``use_fused_kernels``, plus ``sum_pi_squared`` from this forward's head call, laid out
    by verl's own code run once more with it in the entropy's place (the same rows, the same
    Ulysses gather, the same nested layout)."""
    import copy

    from verl.utils import tensordict_utils as tu

    def flag(key):
        return tu.get_non_tensor_data(data=micro_batch, key=key, default=False)

    global _pending_sum_p_sq
    if not (flag("calculate_sum_pi_squared") and flag("use_fused_kernels")):
        return _original_outputs(self, output, output_args, micro_batch, logits_processor_func)
    s2, _pending_sum_p_sq = _pending_sum_p_sq, None
    if s2 is None or output.entropy is None or s2.shape != output.entropy.shape:
        raise ValueError(f"{SUM_PI_SQUARED_KEY}: calculate_sum_pi_squared with fused kernels "
                         "needs the forward's head call to run through logitless "
                         "(enable_fused_head(sum_pi_squared=True) in this process)")
    keys = ("calculate_sum_pi_squared", "calculate_entropy", "distillation_only",
            "distillation_use_topk")
    saved = {k: flag(k) for k in keys}
    try:
        tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=False)
        model_output = _original_outputs(self, output, output_args, micro_batch,
                                         logits_processor_func)
        tu.assign_non_tensor(micro_batch, calculate_entropy=True, distillation_only=True,
                             distillation_use_topk=False)
        in_place = copy.copy(output)
        in_place["entropy"] = s2
        laid = _original_outputs(self, in_place, output_args, micro_batch, None)
    finally:
        tu.assign_non_tensor(micro_batch, **saved)
    model_output[SUM_PI_SQUARED_KEY] = laid["entropy"]
    return model_output


def fused_head_enabled() -> bool:
    """Whether verl's ``linear_cross_entropy`` currently resolves to logitless."""
    module = sys.modules.get(_KERNEL_MODULE)
    return module is not None and getattr(module, _ATTR, None) in _DROP_INS
