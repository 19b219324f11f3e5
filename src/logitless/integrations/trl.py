"""logitless inside TRL: the fused-head kernel swap and a `GRPOTrainer` whose loss is `policy_loss`.

``from logitless.integrations.trl import GRPOTrainer`` in place of TRL's: same arguments, plus
``loss_config`` (a `PolicyLossConfig`; by default :func:`config_from_grpo` of the
``GRPOConfig``, which reproduces TRL's loss for every ``loss_type``). The forward passes are
TRL's own (`_get_per_token_logps_and_entropies` over TRL's fused LM head), with the head's
kernel swapped for `linear_logprobs` during each call; the loss, its gradient-accumulation
scaling and TRL's metrics are computed from `policy_loss`.

Sharded heads. Under FSDP2 a head sharded on its own (``fully_shard(model.lm_head)``) is a
``Shard(0)`` DTensor when TRL's fused forward reads it; TRL gathers it there with
``full_tensor()``, and our kernel swaps that gather out (`trl_head.KeepShardedHead`): the head
runs vocabulary-parallel over its mesh, the ranks' tokens all-gathered instead of the weight,
and the weight gradient lands sharded, the mean over ranks of each rank's loss gradient
(FSDP2's average; `logitless.fused_losses.head.dtensor`). The fused loss gets the sharded head
too and keeps it sharded (`logitless.fused_losses.fused.fsdp2`: the ranks' batches in turn, in
chunks). TRL's gather gives each rank's shard its own loss's gradient only, the same when every
rank scores the same batch. Under DeepSpeed
ZeRO-3 TRL gathers the weight with ``maybe_gather_lm_head_ctx`` around the forward; our
kernel's backward, which recomputes the logits, re-enters that same TRL context
(``gather_weight``); the fused loss, computed inside it, gets its head gathered again for its
backward by DeepSpeed's own pre-backward hook of the head module (`_gathered_for_backward`).
Verified on CPU: FSDP2 with the head sharded over two and three gloo ranks
(values and the sharded weight gradient against the unsharded head and TRL's gathering path),
that the backward enters TRL's ZeRO-3 gather context, and DeepSpeed ZeRO-3 itself on two gloo
ranks (tests/integrations/test_zero3.py: losses and gathered parameters, fused and composed,
equal to stock TRL's under the same config; docs/trl.md). Not verified (no GPUs here): ZeRO-3
over NCCL, and FSDP2 on GPUs with the whole model sharded and mixed precision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import warnings
from collections.abc import Sequence

import torch
import trl

from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss
from logitless.fused_losses.fused.validation import Head
from logitless.fused_losses.head.divergence import linear_divergence
from logitless.fused_losses.head.dtensor import is_dtensor
from logitless.fused_losses.head.logprobs import linear_logprobs
from logitless.fused_losses.head.sampled import drop_outside_kept
from logitless.fused_losses.objectives.aggregation import agg_counts
from logitless.fused_losses.objectives.catalog import CLIPPED_SURROGATE, OBJECTIVES, clip_flags
from logitless.fused_losses.objectives.config import KL_EXACT, PolicyLossConfig
from logitless.fused_losses.objectives.entropy_control import AdaptiveEntropyCoef
from logitless.fused_losses.objectives.mismatch import logged_mismatch
from logitless.fused_losses.objectives.policy_loss import policy_loss, policy_loss_globals
from logitless.fused_losses.objectives.ratios import compute_ratio
from logitless.integrations.replay import KEPT_IDS_KEY, SAMPLING_MASK_KEY, kept_ids_from_masks
from logitless.integrations.sampler_config import SamplerTruncation
from logitless.integrations.trl_config import (
    check_grpo_replay,
    config_from_grpo,
    head_dtype_from_grpo,
    loss_config_over_grpo,
    sampler_from_generate,
    sampler_from_grpo,
)
from logitless.integrations.trl_head import (
    SUPPORTED_TRL,
    LogitlessChunkedLogProb,
    check_contract,
    keep_sharded,
    logitless_softcap,
    patch_trl,
    trl_modules,
    trl_patched,
    unpatch_trl,
)

__all__ = [
    "SUPPORTED_TRL",
    "GRPOTrainer",
    "LogitlessChunkedLogProb",
    "check_grpo_replay",
    "config_from_grpo",
    "loss_config_over_grpo",
    "patch_trl",
    "sampler_from_generate",
    "sampler_from_grpo",
    "trl_patched",
    "unpatch_trl",
]

# The generation batch's key for the reference model's last hidden states on the completion
# grid, ``[B, T, D_ref]`` (kl_estimator="exact"): TRL's shuffling and splitting carry them.
REF_HIDDEN_KEY = "ref_hidden_states"

# Multimodal inputs TRL's forward helper takes from the batch.
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                 "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                 "mm_token_type_ids", "image_position_ids")


def _check_exact_kl_head(call: Head) -> None:
    """The exact KL's two-head passes take temperature and logit scale, not a softcap."""
    if call.softcap is not None:
        raise ValueError("kl_estimator='exact': the exact KL supports temperature and "
                         "logit scale, not the model's final_logit_softcapping")


class _Head:
    """TRL's kernel contract for one forward helper call; drops the entropy when not wanted
    (TRL's policy head always computes it, even in the old-policy pass that discards it), and
    applies the sampler's truncations when given them, or the recorded kept sets: ``kept``,
    one ``(mask, kept_ids)`` per model call of the helper's batch loop, in its order (see
    `_replay_chunks`). ``calls``: a list that gets each call's `Head` (its rows, as TRL's
    ``hidden[mask]`` or every position, the head and the logit transform: the exact KL reads
    them)."""

    def __init__(self, entropy: bool, sampler: SamplerTruncation | None = None,
                 kept: list | None = None, calls: list | None = None):
        self.entropy = entropy
        self.sampler = sampler
        self.kept = kept
        self.calls = calls

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0, outputs=()):
        if self.calls is not None:
            self.calls.append(Head(hidden, weight, bias, temperature, logitless_softcap(
                final_logit_softcapping, logit_scale), logit_scale))
        if not self.entropy:
            outputs = tuple(o for o in outputs if o != "entropy")
        kept_ids = None if self.kept is None else self._rows(hidden.shape[0])
        return LogitlessChunkedLogProb.apply(hidden, weight, bias, targets, temperature,
                                             chunk_size, final_logit_softcapping, logit_scale,
                                             outputs, sampler=self.sampler, kept_ids=kept_ids)

    def _rows(self, rows: int) -> torch.Tensor:
        """The kept sets of the head's rows for the next model call. TRL's fused forward passes
        the rows whose label is not -100 (``hidden[mask]``, on Triton devices) or every
        position with the -100 labels read as 0: the rows outside the mask get the set {0}."""
        if not self.kept:
            raise RuntimeError("match_sampler='replay': TRL's head was called more often than "
                               "the forward helper makes model calls")
        mask, kept = self.kept.pop(0)
        if rows == int(mask.sum()):
            return kept[mask]
        if rows == mask.numel():
            return kept.reshape(rows, -1)
        raise RuntimeError(f"match_sampler='replay': TRL's head got {rows} rows for a model "
                           f"call of {tuple(mask.shape)} positions ({int(mask.sum())} scored)")


def _label_mask(input_ids, attention_mask, logits_to_keep):
    """The positions TRL's fused head scores, ``[B, L - 1]``: ``labels[:, 1:] != -100`` with
    TRL's own labels (the completion tokens under the attention mask)."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    return labels[:, 1:] != -100


def _on_grid(values, mask, who: str):
    """TRL's head rows of one model call (``[rows, D]`` hidden states, or ``[rows]`` per-row
    values) on its position grid ``[b, L - 1, ...]``: TRL's compact rows (``hidden[mask]``,
    the labelled positions; 0 elsewhere) or every position."""
    rows, tail = values.shape[0], values.shape[1:]
    if rows == int(mask.sum()):
        where = mask.view(*mask.shape, *(1,) * len(tail))
        return values.new_zeros(*mask.shape, *tail).masked_scatter(where, values)
    if rows == mask.numel():
        return values.view(*mask.shape, *tail)
    raise RuntimeError(f"{who}: TRL's head got {rows} rows for {tuple(mask.shape)} positions "
                       f"({int(mask.sum())} labelled)")


def _replay_chunks(input_ids, attention_mask, logits_to_keep, batch_size, kept_ids):
    """Per model call of TRL's forward-helper loop (rows ``[start, start + batch_size)``): the
    positions TRL's fused head scores (``labels[:, 1:] != -100``, TRL's own labels) and the
    kept sets ``[b, L - 1, K]`` at those positions, {0} elsewhere. ``kept_ids`` is
    ``[B, logits_to_keep, K]``, aligned with the completion ids."""
    if kept_ids.shape[:2] != (input_ids.shape[0], logits_to_keep):
        raise ValueError(f"{KEPT_IDS_KEY}: expected shape [{input_ids.shape[0]}, "
                         f"{logits_to_keep}, K] (the completions), got {list(kept_ids.shape)}")
    mask = _label_mask(input_ids, attention_mask, logits_to_keep)
    full = kept_ids.new_full((*mask.shape, kept_ids.shape[-1]), -1)
    full[:, -logits_to_keep:] = kept_ids.to(full.device)
    outside = ~mask
    full[outside] = -1
    full[..., 0].masked_fill_(outside, 0)
    batch_size = batch_size or input_ids.shape[0]
    return [(mask[i:i + batch_size], full[i:i + batch_size])
            for i in range(0, input_ids.shape[0], batch_size)]


@contextlib.contextmanager
def _kernel(kernel):
    """``kernel`` in place of TRL's fused head kernel inside the block, and an FSDP2 head kept
    sharded (`keep_sharded`): it reaches the kernel without a gather."""
    import trl.trainer.utils as trl_utils

    saved = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = kernel
    dtensor = keep_sharded(trl_utils)
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = saved
        if dtensor is not None:
            trl_utils.DTensor = dtensor


@contextlib.contextmanager
def _logitless_head(entropy: bool, sampler: SamplerTruncation | None = None,
                    kept: list | None = None, calls: list | None = None):
    """TRL's fused head computes through logitless inside the block (TRL looks the kernel up
    at each call; the backward belongs to the returned tensors, so it needs no patch)."""
    with _kernel(_Head(entropy, sampler, kept, calls)):
        yield
    if kept:
        raise RuntimeError("match_sampler='replay': TRL's head was called fewer times than "
                           "the forward helper makes model calls")


class _FusedLoss:
    """TRL's kernel contract for the one model call of the training forward, where the head and
    the loss are one `fused_policy_loss` call: the head's rows (TRL's ``hidden[mask]``, or
    every position) are laid out on the completion grid, the loss computed there (inside TRL's
    autocast and ZeRO-3 gather context, which hold the kernel call) and kept in ``result``;
    under ZeRO-3 (``zero3_head``, the head module) through `_gathered_for_backward`. TRL's
    forward gets zeros for its per-token outputs, which nothing reads.

    ``world_globals``: a function of the current entropies and logprobs on the completion grid
    that returns the batch's `BatchGlobals` over every process (`_world_entropy_globals`);
    the entropies come from one no-grad pass of TRL's head contract over TRL's rows (the
    composed path's values), and the call selects with them (``selection_entropy``), so it
    makes no pass of its own. ``truncation``: match_sampler's (`linear_logprobs`'s keywords);
    ``probe``: the tokens out of the loss whose current logprobs the trainer's metrics read
    all the same (`_probe`)."""

    def __init__(self, label_mask, logits_to_keep, targets, world_globals=None, zero3_head=None,
                 truncation=None, probe=None, **loss_args):
        self.label_mask, self.logits_to_keep = label_mask, logits_to_keep
        self.targets, self.loss_args = targets, loss_args
        self.world_globals, self.zero3_head = world_globals, zero3_head
        self.truncation, self.probe = truncation or {}, probe
        self.result = None

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0, outputs=()):
        if self.result is not None:
            raise RuntimeError("GRPOTrainer(fused=True): TRL's head was called more than once "
                               "in the training forward")
        rows = hidden.shape[0]
        mask = self.label_mask.to(hidden.device)
        grid = _on_grid(hidden, mask, "GRPOTrainer(fused=True)")
        extra = {}
        if self.world_globals is not None:
            with torch.no_grad():
                lp, ent, *_ = LogitlessChunkedLogProb.apply(
                    hidden, weight, bias, targets, temperature, chunk_size,
                    final_logit_softcapping, logit_scale, ("log_probs", "entropy"))
            lp, ent = (_on_grid(x, mask, "GRPOTrainer(fused=True)")[:, -self.logits_to_keep:]
                       for x in (lp, ent))
            extra = dict(selection_entropy=ent, batch_globals=self.world_globals(ent, lp))
        # the per-token logprobs the loss used, for TRL's per-sequence clip metrics and VESPO
        self.logprobs = torch.empty(self.loss_args["mask"].shape, device=hidden.device,
                                    dtype=torch.promote_types(hidden.dtype, torch.float32))
        head = dict(bias=bias, temperature=temperature,
                    softcap=logitless_softcap(final_logit_softcapping, logit_scale),
                    logit_scale=logit_scale)
        completions = grid[:, -self.logits_to_keep:]
        self.result = fused_policy_loss(completions, weight, self.targets,
                                        out_logprobs=self.logprobs, **head, **self.truncation,
                                        **extra, **self.loss_args)
        self._probe(completions, weight, head)
        if self.zero3_head is not None:
            loss, metrics = self.result
            self.result = _gathered_for_backward(self.zero3_head, loss), metrics
        zeros = hidden.new_zeros(rows)
        return zeros, zeros if "entropy" in outputs else None, None, None, None


    def _probe(self, hidden, weight, head) -> None:
        """The current logprobs of the ``probe`` tokens (left out of the loss before the call,
        so the fused loss did not score them) into ``logprobs``: one no-grad head call on
        those rows, as the composed path has them for its ``outside_kept`` count."""
        if self.probe is None or not bool(self.probe.any()):
            return
        at = self.probe.to(hidden.device)
        kw = {k: v[at] if k == "kept_ids" else v for k, v in self.truncation.items()}
        with torch.no_grad():
            out = linear_logprobs(hidden[at], weight, self.targets[at],
                                  head_dtype=self.loss_args.get("head_dtype"), **head, **kw)
        self.logprobs[at] = out.logprobs.to(self.logprobs.dtype)


def _gathered_for_backward(head, loss):
    """``loss`` through DeepSpeed ZeRO-3's pre-backward function of the ``head`` module, the
    one DeepSpeed applies to the outputs of every module it partitions: when the backward
    reaches it, DeepSpeed gathers the head's parameters (as for the backward of the head's own
    forward), so the weight and bias gradients `fused_policy_loss` computed in the forward,
    full-size, accumulate into full parameters, and DeepSpeed's gradient hooks reduce-scatter
    them into the partitions. Without it the parameters are partitioned (empty) when the
    backward hands the gradients over: TRL's fused forward reads the head inside its
    ``maybe_gather_lm_head_ctx``, never calling the head module, and only its per-token
    outputs, which the model returns, pass DeepSpeed's backward hooks. DeepSpeed partitions
    the parameters again as for any module whose post-backward hook does not fire (its
    leftovers at the end of the backward, at the latest the optimizer step).
    tests/integrations/test_zero3.py runs it under DeepSpeed on two ranks."""
    if not loss.requires_grad:  # no backward (evaluation): nothing to gather for
        return loss
    pre_backward = getattr(head, "pre_bwd_fn", None)
    if pre_backward is None:
        raise RuntimeError("GRPOTrainer(fused=True): under DeepSpeed ZeRO-3 the LM head module "
                           "has no DeepSpeed pre-backward function (pre_bwd_fn); DeepSpeed "
                           "did not register the head, or its hooks changed")
    return pre_backward.apply(loss)


@contextlib.contextmanager
def _fused_head(loss: _FusedLoss):
    """TRL's fused head computes the loss through `fused_policy_loss` inside the block (an FSDP2
    head sharded, as in `_logitless_head`)."""
    with _kernel(loss):
        yield
    if loss.result is None:
        raise RuntimeError("GRPOTrainer(fused=True): TRL's training forward did not call its "
                           "fused head")


def _uses_kl(cfg: PolicyLossConfig) -> bool:
    return isinstance(cfg.beta, torch.Tensor) or cfg.beta != 0 or cfg.future_kl_coef != 0


def _check_exact_kl_backend(cfg: PolicyLossConfig, args) -> None:
    """The exact KL keeps the reference head's weight from TRL's reference pass; under
    DeepSpeed ZeRO-3 that is a gathered copy of a partitioned parameter, released when TRL's
    gather ends, and the training forward's head is partitioned again before the KL's passes;
    with ``sync_ref_model`` TRL copies new weights into that head in place between the
    reference pass and the loss steps of its generation batch, which would pair the kept
    hidden states with another head: both refused (``ValueError``), not run."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not (cfg.kl_estimator == KL_EXACT and _uses_kl(cfg)):
        return
    if getattr(args, "sync_ref_model", False):
        raise ValueError("loss_config.kl_estimator: 'exact' is not supported with "
                         "GRPOConfig.sync_ref_model (the reference head changes in place "
                         "after the reference pass whose hidden states the KL uses); use a "
                         "sampled estimator ('k1', 'k2', 'k3')")
    if is_deepspeed_zero3_enabled():
        raise ValueError("loss_config.kl_estimator: 'exact' is not supported under DeepSpeed "
                         "ZeRO-3 (the reference and policy heads are partitioned outside TRL's "
                         "gathers); use a sampled estimator ('k1', 'k2', 'k3')")


def _check_reference_source(model, args, peft_config) -> None:
    """TRL 1.16 builds the reference model (``beta != 0``, no PEFT) from the policy's
    ``config._name_or_path``, which a model built in memory does not have (TRL then fails
    inside the hub client): say so, and what works, before TRL loads anything."""
    from trl.trainer.utils import get_config_model_id

    if args is None or args.beta == 0.0 or isinstance(model, str) or peft_config is not None:
        return
    if getattr(model, "peft_config", None) is not None:
        return  # a PEFT model: TRL disables the adapter for the reference
    config = getattr(model, "config", None)
    if config is not None and not get_config_model_id(config):
        raise ValueError(
            "model: with GRPOConfig.beta != 0 TRL rebuilds the reference model from "
            "model.config._name_or_path, which is empty for a model built in memory; "
            "model.save_pretrained(folder) and pass model=folder (see docs/trl.md)")


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` with the loss of `policy_loss` and the LM head of logitless.

    Args: TRL's, plus
        loss_config: the objective (default ``config_from_grpo(args)``: TRL's own loss).
            The fields passed to its constructor override those of the ``GRPOConfig``, the
            others come from it (:func:`loss_config_over_grpo`); a field set in both to
            different values raises ``ValueError``. Its ``grad_accum_steps`` and ``dp_size``
            are set per call from the trainer.
        attention_entropy_layers, attention_entropy_heads: layers and query heads whose mean
            attention entropy feeds ``attn_entropy_weighting`` (default: all).
        match_sampler: compute the policy's and the old policy's logprobs and entropies under
            the distribution the generation backend samples from: the tempered logits
            truncated by the ``GRPOConfig``'s ``top_k`` / ``top_p`` / ``min_p`` under the rules
            of the engine that generates (vLLM's with ``use_vllm``, transformers' ``generate``'s
            otherwise), renormalised (see :func:`sampler_from_grpo` for what is read and refused, at
            construction; with ``generate``, :func:`sampler_from_generate`: the settings
            merged with the model's own generation config, as ``generate`` merges them).
            The reference model's logprobs stay untruncated (the KL then
            compares a truncated policy with a full reference: 2.3 at step 1, where the policy
            is the reference, on the tiny model of tests/integrations/test_trl_sampler.py
            with temperature 0.7, top_k 8, top_p 0.9) unless ``truncate_reference``. A
            completion token
            outside the kept set of the recomputed policy or old policy (the two engines
            disagreeing at the boundary) is left out of the loss and counted in
            ``logitless/sampler/outside_kept``. Off by default: TRL's own numbers.
            ``"replay"``: renormalise over the kept set the engine recorded for each token
            instead of recomputing it from the settings (no boundary rounding, no version
            drift). The sets come from the ``rollout_func``, under the extra key
            ``"sampling_mask"`` (`logitless.integrations.replay.SAMPLING_MASK_KEY`): per
            completion, one list of kept vocabulary ids per completion token, or None for a
            token the engine did not sample (those need ``env_mask`` 0 there). vLLM returns
            them with ``return_sampling_mask=True``
            (`logitless.integrations.replay.masks_from_request_outputs` reads its
            ``RequestOutput``s), SGLang with the request's ``return_sampling_mask``
            (``masks_from_sglang_outputs``). The key is taken out of the extra fields (the
            reward functions do not see it); the generation batch carries the sets as
            ``"kept_ids"``, int64 ``[B, T, K]`` padded with -1, aligned with
            ``completion_ids``, and TRL's batch splitting and forward-helper chunking keep
            them aligned. What replay cannot honour is refused at construction
            (`check_grpo_replay`) or at the first generation (a missing key, a count that
            differs from the completions' tokens).
        truncate_reference: with ``match_sampler``, the reference model's logprobs too are
            those of its tempered logits under the same truncation (with ``"replay"``: the
            same recorded sets), so that the KL compares like with like (0 at step 1). A
            completion token outside the reference's kept set is left out of the loss and
            counted in ``logitless/sampler/outside_kept_reference``.
        fused: in the training forward, the head and the loss are one `fused_policy_loss`
            call over the completion tokens (three GEMM passes over the head; TRL's head and
            the composed path make four). Without TRL's old-policy pass (its default,
            ``num_iterations=1``) the call runs on-policy (``old_logprobs=None``: the current
            logprobs, detached, as TRL's ``per_token_logps.detach()``). With
            ``match_sampler`` (and ``"replay"``) the call takes the truncation (the recorded
            sets), with the composed path's tokens out of the loss and its metrics. An FSDP2
            head stays sharded (`fused.fsdp2`); under DeepSpeed ZeRO-3 DeepSpeed gathers the
            head for the backward (`_gathered_for_backward`). Where a step cannot run fused
            (see `_fused_reason`) it runs composed, with one warning per reason. ``False``:
            always composed (`linear_logprobs`, then `policy_loss`).

    Logs TRL's metric names (``kl``, ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``,
    ``vespo/phi_seq_mean``, ``policy_loss``, ``entropy_coef``, ``aux_loss``) with TRL's values,
    and every metric of `policy_loss` as ``logitless/<name>``.

    Attention-entropy weighting: the `AttentionEntropyRecorder` runs during TRL's old-policy
    pass when TRL makes one, else during a dedicated no-grad pass after generation; the
    per-token value of completion token t is the entropy at that token's position, averaged
    over the chosen layers and heads. Text-only models.
    """

    # Replay and the fused loss off until __init__ turns them on (also for trainers built
    # without it, as TRL's loss is sometimes called on a partly built trainer).
    _replay = False
    _replay_masks = None
    _replay_kept = None
    _fused = False
    _ref_hidden = None  # the exact KL's reference rows of the generation in progress
    _ref_head = None  # and its head, (weight, bias)

    def __init__(self, *args, loss_config: PolicyLossConfig | None = None,
                 attention_entropy_layers: Sequence[int] | None = None,
                 attention_entropy_heads: Sequence[int] | None = None,
                 match_sampler: bool | str = False, truncate_reference: bool = False,
                 fused: bool = True, **kwargs):
        trl_module, _, function = trl_modules()
        check_contract(trl_module, function)
        if match_sampler not in (False, True, "replay"):
            raise ValueError(f"match_sampler: expected False, True or 'replay', got "
                             f"{match_sampler!r}")
        bound = inspect.signature(trl.GRPOTrainer.__init__).bind_partial(
            self, *args, **kwargs).arguments
        _check_reference_source(bound.get("model"), bound.get("args"), bound.get("peft_config"))
        replay = match_sampler == "replay"
        if bound.get("args") is not None:  # refuse before TRL loads models and starts vLLM
            if replay:
                check_grpo_replay(bound["args"], bound.get("rollout_func"))
            elif match_sampler:
                sampler_from_grpo(bound["args"])
        if truncate_reference and not match_sampler:
            raise ValueError("truncate_reference: truncates the reference model's logprobs "
                             "as match_sampler truncates the policy's; set match_sampler=True")
        self._sampler = None
        self._replay = False
        self._replay_masks = None
        self._replay_kept = None
        self._truncate_reference = truncate_reference
        self._reference_pass = False
        if not isinstance(fused, bool):
            raise ValueError(f"fused: expected True or False, got {fused!r}")
        self._fused = fused
        self._fallbacks: set[str] = set()
        super().__init__(*args, **kwargs)
        if replay:
            check_grpo_replay(self.args, self.rollout_func)
            self._replay = True
            self._check_generation_backend()
        elif match_sampler:
            self._sampler = sampler_from_grpo(self.args)
            self._check_generation_backend()
        cfg = (config_from_grpo(self.args) if loss_config is None
               else loss_config_over_grpo(self.args, loss_config))
        if _uses_kl(cfg) and self.beta == 0.0:
            raise ValueError(
                "loss_config: a KL term (beta or future_kl_coef) needs the reference logprobs, "
                "which TRL computes only with GRPOConfig.beta != 0; set GRPOConfig.beta too"
            )
        _check_exact_kl_backend(cfg, self.args)
        if OBJECTIVES[cfg.objective].needs_topk:
            raise ValueError(
                f"loss_config.objective: {cfg.objective} needs the rollout's top-k token ids "
                "and the engine's logprobs there (old_topk_logprobs), which TRL's generation "
                "does not return (it asks vLLM for the sampled token's logprob only, and "
                "transformers' generate records none); choose another objective")
        for field in ("loss_agg", "entropy_agg"):
            if getattr(cfg, field) == "prompt-mean":
                raise ValueError(
                    f"loss_config.{field}: prompt-mean groups prompt_group_size consecutive "
                    "sequences, but TRL shuffles each generation batch before splitting it "
                    "into micro-batches (and splits a prompt's completions over processes), so "
                    "a micro-batch's consecutive sequences are not one prompt's; choose "
                    "another aggregation")
        self.loss_config = cfg
        self._configs: dict[tuple[int, int], PolicyLossConfig] = {}
        self._entropy_control = None
        if self.args.use_adaptive_entropy:
            self._entropy_control = AdaptiveEntropyCoef(
                cfg.entropy_coef, self.args.entropy_target, self.args.entropy_coef_delta,
                self.args.entropy_coef_min, self.args.entropy_coef_max)
        self._attention_layers = attention_entropy_layers
        self._attention_heads = attention_entropy_heads
        if cfg.attn_entropy_weighting is not None:  # fail fast on layer / head indices
            from logitless.integrations.transformers import AttentionEntropyRecorder

            AttentionEntropyRecorder(self.accelerator.unwrap_model(self.model),
                                     attention_entropy_layers, attention_entropy_heads)
        self._attention_pending = False
        self._attention_entropy = None

    def _check_generation_backend(self) -> None:
        """match_sampler's checks that need the built trainer: tokens TRL itself suppresses in
        transformers' generation, the settings ``generate`` takes from the model's own
        generation config (`sampler_from_generate`, which replaces the ``GRPOConfig``'s), the
        logprobs a vLLM server returns, DeepSpeed ZeRO-3."""
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if not (self._replay or self.use_vllm):
            if "suppress_tokens" in getattr(self, "generation_kwargs", {}):
                raise ValueError(
                    "processing_class: TRL suppresses the image token when generating with "
                    "transformers for a vision-language model, which match_sampler cannot "
                    "reproduce; generate with vLLM (use_vllm=True)")
            if not self.args.use_transformers_continuous_batching:
                self._sampler = sampler_from_generate(
                    self.accelerator.unwrap_model(self.model), self.generation_config)
        if (self._replay or self._sampler.truncates) and is_deepspeed_zero3_enabled():
            raise ValueError(
                "GRPOConfig.deepspeed: the sampler-matched head has not been run under DeepSpeed "
                "ZeRO-3 (its backward re-enters TRL's gather, tested without DeepSpeed only); "
                "unsharded heads and FSDP2 are supported")
        if self._replay:
            return  # the rollout_func generates: TRL's generation settings are not used
        server = self.use_vllm and self.vllm_mode == "server"
        if server and self.vllm_importance_sampling_correction and self.accelerator.is_main_process:
            info = self.vllm_generation.vllm_client.get_server_info()
            mode = info["model_config"]["logprobs_mode"]
            if mode != "processed_logprobs":
                raise ValueError(
                    f"vllm_importance_sampling_correction: the vLLM server returns "
                    f"{mode!r} logprobs, not those of the truncated distribution it samples "
                    f"from; restart it with `--logprobs-mode processed_logprobs`")

    # -- forward passes ----------------------------------------------------------------------

    @property
    def _matching(self) -> bool:
        """Whether the head follows the sampler (its settings, or the recorded sets)."""
        return self._sampler is not None or self._replay

    @property
    def _exact_kl(self) -> bool:
        """Whether the loss has the exact KL term (its reference head's passes)."""
        cfg = getattr(self, "loss_config", None)
        return cfg is not None and cfg.kl_estimator == KL_EXACT and _uses_kl(cfg)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, kept_ids=None,
                                           head_calls=None, **kwargs):
        """TRL's, plus ``kept_ids`` (replay: the batch's recorded sets, ``[B, T, K]``; during
        generation, TRL's old-policy and reference passes read the sets just generated) and
        ``head_calls`` (a list that gets each head call's `Head`). With the exact KL, the
        reference pass keeps the reference head's rows (`_keep_reference_head`)."""
        record = self._attention_pending and model is self.model
        recording = (self._recording_attention(model, logits_to_keep) if record
                     else contextlib.nullcontext())
        # the sampler drew from the policy: the reference model's logprobs stay untruncated
        # unless truncate_reference
        reference = model is self.ref_model or self._reference_pass
        follow = not reference or self._truncate_reference
        sampler = self._sampler if follow else None
        kept = None
        if self._replay and follow:
            if kept_ids is None:
                kept_ids = self._generation_kept_ids(logits_to_keep)
            kept = _replay_chunks(input_ids, attention_mask, logits_to_keep, batch_size,
                                  kept_ids.to(input_ids.device))
        keep_reference = reference and self._exact_kl
        calls = [] if keep_reference else head_calls
        with _logitless_head(compute_entropy, sampler, kept, calls), recording:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, **kwargs)
        if keep_reference:
            self._keep_reference_head(calls, input_ids, attention_mask, logits_to_keep,
                                      batch_size)
        return out

    def _keep_reference_head(self, calls, input_ids, attention_mask, logits_to_keep,
                             batch_size) -> None:
        """The exact KL's reference: the reference pass's head rows on the completion grid,
        ``[B, logits_to_keep, D_ref]`` (detached; the generation batch carries them under
        `REF_HIDDEN_KEY`), and its head (weight and bias, which stay with the trainer)."""
        mask = _label_mask(input_ids, attention_mask, logits_to_keep)
        step = batch_size or input_ids.shape[0]
        starts = range(0, input_ids.shape[0], step)
        if len(calls) != len(starts):
            raise RuntimeError(f"kl_estimator='exact': TRL's reference head was called "
                               f"{len(calls)} times for {len(starts)} model calls")
        grids = []
        for call, start in zip(calls, starts):
            _check_exact_kl_head(call)
            grid = _on_grid(call.hidden.detach(), mask[start:start + step].to(call.hidden.device),
                            "kl_estimator='exact'")
            grids.append(grid[:, -logits_to_keep:])
        head = calls[0]
        self._ref_hidden = torch.cat(grids)
        self._ref_head = (head.weight.detach(),
                          None if head.bias is None else head.bias.detach())

    def _reference_inputs(self, inputs) -> dict:
        """The exact KL's reference head for `fused_policy_loss` (``ref_hidden``,
        ``ref_weight``, ``ref_bias``); empty without the exact KL."""
        if not self._exact_kl:
            return {}
        if inputs.get(REF_HIDDEN_KEY) is None or self._ref_head is None:
            raise RuntimeError("kl_estimator='exact': the batch has no reference hidden states "
                               f"({REF_HIDDEN_KEY!r}); TRL's reference pass did not run")
        weight, bias = self._ref_head
        return dict(ref_hidden=inputs[REF_HIDDEN_KEY], ref_weight=weight, ref_bias=bias)

    @contextlib.contextmanager
    def _recording_attention(self, model, logits_to_keep):
        """Per-token attention entropy of each forward in the block, completion positions."""
        from logitless.integrations.transformers import AttentionEntropyRecorder

        self._attention_pending = False
        module = self.accelerator.unwrap_model(model)
        recorder = AttentionEntropyRecorder(module, self._attention_layers, self._attention_heads)
        chunks = []
        hook = module.register_forward_hook(lambda *_: chunks.append(recorder.per_token()))
        try:
            with recorder:
                yield
        finally:
            hook.remove()
        self._attention_entropy = torch.cat(chunks)[:, -logits_to_keep:]

    def _old_policy_pass(self) -> bool:
        """Whether TRL's `_generate_and_score_completions` computes old logprobs (its rule)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction)

    @contextlib.contextmanager
    def _marking_reference_passes(self):
        """TRL computes a PEFT model's reference logprobs on the policy model inside its
        ``use_adapter`` block (adapter disabled or "ref"): mark those passes for the duration."""
        import trl.trainer.grpo_trainer as grpo_module

        if not (self._matching or self._exact_kl):
            yield
            return
        inner = grpo_module.use_adapter

        @contextlib.contextmanager
        def marked(*args, **kwargs):
            with inner(*args, **kwargs):
                self._reference_pass = True
                try:
                    yield
                finally:
                    self._reference_pass = False

        grpo_module.use_adapter = marked
        try:
            yield
        finally:
            grpo_module.use_adapter = inner

    def _generate_and_score_completions(self, inputs):
        self._ref_hidden = None
        with self._marking_reference_passes():
            output = self._generate_and_score(inputs)
        if self._exact_kl:
            if self._ref_hidden is None:
                raise RuntimeError("kl_estimator='exact': TRL made no reference pass")
            output[REF_HIDDEN_KEY], self._ref_hidden = self._ref_hidden, None
        if self._replay:
            output[KEPT_IDS_KEY] = self._generation_kept_ids(output["completion_ids"].size(1))
            self._replay_masks = self._replay_kept = None
        return output

    def _generate(self, prompts):
        result = super()._generate(prompts)
        if self._replay:
            _, completion_ids, tool_mask, _, _, extra_fields, _, _ = result
            self._replay_masks = self._read_sampling_mask(
                extra_fields.pop(SAMPLING_MASK_KEY, None), completion_ids, tool_mask)
            self._replay_kept = None
        return result

    def _read_sampling_mask(self, masks, completion_ids, tool_mask):
        """The rollout's recorded sets, checked against its completions; a None entry (a token
        the engine did not sample) becomes the set {that token}, allowed where ``env_mask`` is
        0 only (the token is out of the loss)."""
        if masks is None:
            raise ValueError(
                f"rollout_func: match_sampler='replay' needs the kept sets the engine recorded "
                f"under the key {SAMPLING_MASK_KEY!r} of its output (vLLM: "
                f"return_sampling_mask=True, read with logitless.integrations.replay."
                f"masks_from_request_outputs); the output has none")
        if len(masks) != len(completion_ids):
            raise ValueError(f"rollout_func: {SAMPLING_MASK_KEY!r} has {len(masks)} entries for "
                             f"{len(completion_ids)} completions")
        out = []
        for b, (sets, ids) in enumerate(zip(masks, completion_ids, strict=True)):
            sets = list(sets)
            if len(sets) != len(ids):
                raise ValueError(f"rollout_func: {SAMPLING_MASK_KEY!r}[{b}] has {len(sets)} kept "
                                 f"sets for the completion's {len(ids)} tokens")
            row = []
            for t, kept in enumerate(sets):
                if kept is None:
                    if tool_mask is None or tool_mask[b][t] != 0:
                        raise ValueError(
                            f"rollout_func: {SAMPLING_MASK_KEY!r}[{b}][{t}] is None (no set) "
                            f"for a token in the loss; None is for tokens with env_mask 0")
                    kept = [int(ids[t])]
                row.append(kept)
            out.append(row)
        return out

    def _generation_kept_ids(self, length: int) -> torch.Tensor:
        """The sets of the generation in progress, ``[B, length, K]`` (built once)."""
        if self._replay_masks is None:
            raise RuntimeError("match_sampler='replay': a forward pass needs the recorded sets "
                               "but no generation has supplied them")
        if self._replay_kept is None or self._replay_kept.shape[1] != length:
            vocab = self.accelerator.unwrap_model(self.model).get_output_embeddings().weight
            self._replay_kept = kept_ids_from_masks(self._replay_masks, length,
                                                    vocab_size=vocab.shape[0],
                                                    device=self.accelerator.device)
        return self._replay_kept

    def _generate_and_score(self, inputs):
        if self.loss_config.attn_entropy_weighting is None:
            return super()._generate_and_score_completions(inputs)
        self._attention_entropy = None
        self._attention_pending = self._old_policy_pass()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._attention_pending = False
        if self._attention_entropy is None:
            self._dedicated_attention_pass(output)
        output["attention_entropy"] = self._attention_entropy
        self._attention_entropy = None
        return output

    def _dedicated_attention_pass(self, output):
        from trl.models.utils import disable_gradient_checkpointing

        multimodal = [k for k in _FORWARD_KEYS if k in output]
        if multimodal:
            raise ValueError(
                "attn_entropy_weighting: supported for text-only models, the batch has "
                f"{multimodal}"
            )
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        batch_size = (self.args.per_device_train_batch_size if self.model.training
                      else self.args.per_device_eval_batch_size)
        self._attention_pending = True
        try:
            with torch.no_grad(), disable_gradient_checkpointing(
                    self.model, self.args.gradient_checkpointing_kwargs):
                self._get_per_token_logps_and_entropies(
                    self.model, ids, mask, output["completion_ids"].size(1), batch_size=batch_size)
        finally:
            self._attention_pending = False

    # -- loss --------------------------------------------------------------------------------

    def _config_for(self, grad_accum_steps: int) -> PolicyLossConfig:
        key = (grad_accum_steps, self.accelerator.num_processes)
        if key not in self._configs:
            self._configs[key] = dataclasses.replace(
                self.loss_config, grad_accum_steps=key[0], dp_size=key[1])
        return self._configs[key]

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask
        if "tool_mask" in inputs:
            mask = completion_mask * inputs["tool_mask"]
        forward = dict(compute_aux_loss=self.aux_loss_enabled,
                       **{k: inputs.get(k) for k in _FORWARD_KEYS})

        mode = "train" if self.model.training else "eval"
        # TRL divides by the accumulation steps in training only (no accumulation in eval);
        # the token-mean normaliser spans the generation batch, rescaled to one window.
        grad_accum = self.current_gradient_accumulation_steps if mode == "train" else 1
        cfg = self._config_for(grad_accum)
        # TRL clamps the generation batch's token count at 1 before rescaling it (a batch of
        # empty completions has none, and its loss is 0).
        num_items = inputs["num_items_in_batch"].clamp(min=1.0)
        if mode == "train":
            num_items = num_items * grad_accum / self.args.steps_per_generation
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps")
        coef = cfg.entropy_coef
        if self._entropy_control is not None:
            coef = self._entropy_control.current()
        batch = dict(rollout_logprobs=inputs.get("sampling_per_token_logps"),
                     attention_entropy=inputs.get("attention_entropy"))
        loss_args = dict(num_items_in_batch=num_items, entropy_coef=coef,
                         training_progress=self.state.global_step / max(self.state.max_steps, 1))
        outside = None
        reference = self._reference_inputs(inputs)
        world = cfg.top_entropy_quantile < 1 and self.accelerator.num_processes > 1

        def world_globals(entropies, logps):
            # on-policy the old logprobs are the current ones (TRL's per_token_logps.detach())
            return self._world_entropy_globals(
                cfg, mask, inputs["advantages"], entropies,
                dict(old_logprobs=logps if old is None else old, **batch))

        truncating_ref = self._matching and ref is not None and self._truncate_reference
        fused = self._fused_reason(cfg) is None
        if fused:
            # match_sampler: the loss's tokens are those the composed path keeps below, the
            # reference's outside tokens left out before the call (their KL is undefined),
            # the policy's and old policy's by fused_policy_loss itself
            call_mask, call_ref, probe = mask, ref, None
            if truncating_ref:
                probe = torch.isneginf(ref) & mask.bool()
                _, call_ref, call_mask, _ = drop_outside_kept(ref, ref, mask)
            loss_step = _FusedLoss(
                _label_mask(input_ids, attention_mask, logits_to_keep), logits_to_keep,
                completion_ids, world_globals=world_globals if world else None,
                zero3_head=self._zero3_head(),
                truncation=self._truncation(inputs), probe=probe, old_logprobs=old,
                advantages=inputs["advantages"], mask=call_mask, config=cfg,
                ref_logprobs=call_ref, head_dtype=head_dtype_from_grpo(self.args),
                **reference, **batch, **loss_args)
            with _fused_head(loss_step):
                _, _, aux_loss = super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, **forward)
            (loss, metrics), logps = loss_step.result, loss_step.logprobs
            old = logps if old is None else old  # on-policy: TRL's per_token_logps.detach()
        else:
            calls = [] if reference else None
            logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
                kept_ids=inputs.get(KEPT_IDS_KEY), head_calls=calls, **forward)
            kl = None
            if reference:
                kl = self._exact_kl_term(calls, input_ids, attention_mask, logits_to_keep, mask,
                                         **reference)
            old = logps.detach() if old is None else old
        if self._matching:
            tokens = mask.sum()
            logps, old, mask, outside = drop_outside_kept(logps, old, mask)
            if truncating_ref:
                # a token outside the reference's kept set: logprob -inf, the KL undefined
                _, ref, mask, ref_outside = drop_outside_kept(ref, ref, mask)
                self._metrics[mode]["logitless/sampler/outside_kept_reference"].append(
                    self._global_mean(ref_outside, tokens))
        if not fused:
            batch_globals = world_globals(entropies, old) if world else None
            loss, metrics = policy_loss(
                logps, old, inputs["advantages"], mask, cfg, ref_logprobs=ref, entropy=entropies,
                batch_globals=batch_globals, kl=kl, **batch, **loss_args)
        self._log_entropy_bonus(mode, loss, metrics, coef, cfg, grad_accum)
        if batch["rollout_logprobs"] is not None:
            # the old policy's logprobs are the trainer's at the weights that generated
            metrics.update(logged_mismatch(old, batch["rollout_logprobs"], mask))
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / grad_accum
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_metrics(mode, metrics, cfg, logps, old, inputs, mask)
        if outside is not None:
            self._metrics[mode]["logitless/sampler/outside_kept"].append(
                self._global_mean(outside, tokens))
        return loss

    def _exact_kl_term(self, calls, input_ids, attention_mask, logits_to_keep, mask,
                       ref_hidden, ref_weight, ref_bias):
        """The composed path's exact KL(policy || reference) per completion token, with its
        graph: `linear_divergence` (``beta=1``) of the training forward's head rows against
        the reference's, both heads' logits divided by the policy's temperature over its
        logit scale (`fused_policy_loss`'s rule)."""
        if len(calls) != 1:
            raise RuntimeError(f"kl_estimator='exact': TRL's head was called {len(calls)} "
                               "times in the training forward")
        call = calls[0]
        _check_exact_kl_head(call)
        grid = _on_grid(call.hidden, _label_mask(input_ids, attention_mask, logits_to_keep).to(
            call.hidden.device), "kl_estimator='exact'")
        return linear_divergence(
            grid[:, -logits_to_keep:], call.weight, ref_hidden, ref_weight, mask.bool(),
            beta=1.0, temperature=call.temperature / call.logit_scale, bias=call.bias,
            teacher_bias=ref_bias, head_dtype=head_dtype_from_grpo(self.args)).divergence

    def _zero3_head(self):
        """The LM head module under DeepSpeed ZeRO-3 (None otherwise), whose parameters the fused
        loss's backward gathers (`_gathered_for_backward`)."""
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():
            return None
        return self.accelerator.unwrap_model(self.model).get_output_embeddings()

    def _fused_reason(self, cfg: PolicyLossConfig) -> str | None:
        """Why this loss step cannot run as one `fused_policy_loss` call (None: it can). Each
        reason but ``fused=False`` is warned about once per trainer."""
        if not self._fused:
            return "fused=False"
        reason = None
        if self._matching and cfg.kl_estimator == KL_EXACT and _uses_kl(cfg):
            reason = ("match_sampler with kl_estimator='exact': fused_policy_loss takes no "
                      "sampler truncation together with the exact KL")
        elif self._matching and cfg.top_entropy_quantile < 1 \
                and self.accelerator.num_processes > 1:
            reason = ("match_sampler with top_entropy_quantile over several processes: the "
                      "world threshold is taken before the tokens outside the kept set leave "
                      "the loss")
        elif self._matching and is_dtensor(
                self.accelerator.unwrap_model(self.model).get_output_embeddings().weight):
            reason = ("match_sampler with an FSDP2 (DTensor) head: fused_policy_loss takes no "
                      "sampler truncation over vocabulary shards")
        if reason is not None and reason not in self._fallbacks:
            self._fallbacks.add(reason)
            warnings.warn(f"GRPOTrainer: the loss runs on the composed path (linear_logprobs, "
                          f"then policy_loss), not fused: {reason}", RuntimeWarning, stacklevel=3)
        return reason

    def _truncation(self, inputs) -> dict:
        """The head's truncation under match_sampler, as `fused_policy_loss`'s keywords: the
        recorded sets with replay, the sampler's settings otherwise (empty: none)."""
        if self._replay:
            return dict(kept_ids=inputs[KEPT_IDS_KEY])
        return {} if self._sampler is None else self._sampler.kwargs()

    def _world_entropy_globals(self, cfg, mask, advantages, entropies, batch):
        """`policy_loss`'s batch globals with TRL's top-entropy selection, whose threshold is
        the quantile over every process's tokens (TRL's own ``get_high_entropy_mask``), where
        `policy_loss` alone would take it over this process's."""
        if cfg.rollout_rs is not None or cfg.stapo_prob_threshold is not None:
            raise ValueError(
                "top_entropy_quantile: over several processes it selects among the loss mask's "
                "tokens as TRL does, which rollout_rs and STAPO would narrow first")
        ent = entropies.detach()
        keep = self.get_high_entropy_mask(ent, mask, 1 - cfg.top_entropy_quantile)
        kept = ent[keep]
        # the smallest kept value selects exactly the kept tokens of this process
        threshold = float(kept.min()) if kept.numel() else math.inf
        glob = policy_loss_globals(mask, advantages, cfg, entropy=ent, **batch)
        adv = advantages[:, None] if advantages.dim() == 1 else advantages
        counts = agg_counts(keep, adv.expand(keep.shape), cfg.seq_count, cfg.length_power_alpha)
        return dataclasses.replace(glob, entropy_threshold=threshold, entropy=counts)

    # -- metrics -----------------------------------------------------------------------------

    def _log_entropy_bonus(self, mode, loss, metrics, coef, cfg, grad_accum):
        """TRL's ``policy_loss`` (the policy term before accumulation scaling) and
        ``entropy_coef``, and the adaptive coefficient's update at optimizer-step ends."""
        if cfg.entropy_coef == 0 and self._entropy_control is None:
            return
        if cfg.entropy_agg == "bnpo":
            tokens = metrics["entropy/bonus_tokens"]
            bonus = metrics["entropy/bonus_sum"] / tokens.clamp(min=1.0) / grad_accum
            policy = loss.detach() + coef * bonus
            if cfg.loss_agg not in ("token-mean", "token-sum"):
                policy = policy * grad_accum
            self._metrics[mode]["policy_loss"].append(
                self.accelerator.gather(policy).nanmean().item())
        control = self._entropy_control
        if control is not None and mode == "train":
            control.observe(metrics)
            if self.accelerator.sync_gradients:
                control.step(reduce=lambda x: self.accelerator.reduce(x, reduction="sum"))
                self.entropy_coef = control.coef
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(
                cfg.entropy_coef if control is None else control.coef)

    def _global_mean(self, value, count) -> float:
        """A mean over every rank's tokens (or sequences) from the local mean and count."""
        if self.accelerator.num_processes == 1:
            return float(value)
        count = torch.as_tensor(count, dtype=torch.float32, device=value.device)
        totals = self.accelerator.reduce(torch.stack([value.float() * count, count]),
                                         reduction="sum")
        return float(totals[0] / totals[1].clamp(min=1.0))

    def _log_metrics(self, mode, metrics, cfg, logps, old, inputs, mask):
        from trl.trainer.utils import nanmax, nanmin

        logged = self._metrics[mode]
        tokens = mask.sum()
        if _uses_kl(cfg):
            logged["kl"].append(self._global_mean(metrics["kl"], tokens))
        logged["entropy"].append(self._global_mean(metrics["entropy/mean"], tokens))
        per_sequence = cfg.ratio_level in ("sequence", "sequence_token")
        flag_count = mask.shape[0] if per_sequence else tokens
        if cfg.objective == "cispo":
            logged["cispo_clip_ratio"].append(
                self._global_mean(metrics["clip_ratio/high"], flag_count))
        elif "clip_ratio/low" in metrics:
            for side in ("low", "high", "region"):
                logged[f"clip_ratio/{side}_mean"].append(
                    self._global_mean(metrics[f"clip_ratio/{side}"], flag_count))
            # TRL's per-sequence clip metrics are defined for the clipped surrogate
            if OBJECTIVES[cfg.objective].family == CLIPPED_SURROGATE:
                low, high = self._clip_rate_per_sequence(cfg, logps, old, inputs, mask)
                logged["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(low)).item())
                logged["clip_ratio/high_max"].append(
                    nanmax(self.accelerator.gather(high)).item())
        if cfg.objective == "vespo":
            phi = self._vespo_weights(cfg, logps, old, inputs, mask)
            logged["vespo/phi_seq_mean"].append(self._global_mean(phi.mean(), phi.numel()))
        ours = {k: v for k, v in metrics.items() if not k.startswith("entropy/bonus")}
        values = self.accelerator.gather(torch.stack([v.float() for v in ours.values()])[None])
        for i, name in enumerate(ours):
            column = values[:, i]
            reduce = nanmin if name.endswith("/min") else nanmax if name.endswith("/max") else None
            value = reduce(column) if reduce is not None else column.nanmean()
            logged[f"logitless/{name}"].append(value.item())

    @torch.no_grad()
    def _clip_rate_per_sequence(self, cfg, logps, old, inputs, mask):
        """Per sequence, the fraction of tokens clipped low / high (one flag per sequence for
        sequence-level ratios); NaN for empty sequences, as TRL's ``masked_seq_mean``."""
        m = mask.bool()
        adv = inputs["advantages"]
        adv = adv[:, None].expand_as(logps) if adv.dim() == 1 else adv
        d = logps.detach() - old
        if cfg.log_ratio_clamp is not None:
            d = d.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)

        def bound(eps):
            return torch.as_tensor(eps, dtype=d.dtype, device=d.device)

        ratio = compute_ratio(cfg.ratio_level, d, logps.detach(), m, adv, cfg,
                              bound(cfg.eps_low), bound(cfg.eps_high), m)
        value = ratio.value if cfg.delta is None else ratio.value.clamp(max=cfg.delta)
        low, high = clip_flags(value, adv, ratio.low, ratio.high)
        if ratio.per_sequence:
            return (low & m).any(-1).float(), (high & m).any(-1).float()
        n = m.sum(-1)
        return (low & m).sum(-1) / n, (high & m).sum(-1) / n

    def _vespo_weights(self, cfg, logps, old, inputs, mask):
        """TRL's own gamma weights phi(w) ``[B, 1]`` for its ``vespo/phi_seq_mean`` metric."""
        adv = inputs["advantages"]
        return self.get_gamma_weights(
            advantages=adv[:, None] if adv.dim() == 1 else adv,
            log_ratio_per_token=logps.detach() - old,
            mask=mask,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
            k_pos=cfg.vespo_k_pos, lambda_pos=cfg.vespo_lambda_pos,
            k_neg=cfg.vespo_k_neg, lambda_neg=cfg.vespo_lambda_neg,
        )

