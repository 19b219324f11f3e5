"""Kernel swap for TRL: every trainer that uses TRL's fused LM head computes through logitless.

TRL (1.16) gives GRPO, RLOO, DPO, KTO and SFT one fused head, ``add_fused_lm_head``, whose
forward calls ``ChunkedLogProbFunction.apply`` from ``trl.trainer.utils``. :func:`patch_trl`
replaces that one name with an object of the same contract backed by
:func:`logitless.linear_logprobs`, and the ``ChunkedDivergenceFunction`` that
``DistillationTrainer``'s loss calls (``trl.trainer.distillation_trainer``) with one backed by
:func:`logitless.linear_divergence`; :func:`unpatch_trl` restores both.

FSDP2. TRL's fused forward gathers a DTensor head (``weight.full_tensor()``) before its kernel;
while logitless's kernel is in place, `KeepShardedHead` stands in for the ``DTensor`` name there,
so the head reaches `linear_logprobs` sharded and runs vocabulary-parallel over its mesh, the
ranks' tokens gathered instead of the weight (`logitless.fused_losses.head.dtensor`).
"""

from __future__ import annotations

import inspect
import math

import torch

from logitless.fused_losses.head.divergence import linear_divergence
from logitless.fused_losses.head.dtensor import is_dtensor
from logitless.fused_losses.head.logprobs import linear_logprobs

__all__ = ["SUPPORTED_TRL", "patch_trl", "trl_patched", "unpatch_trl"]

SUPPORTED_TRL = (">=1.16", "<1.17")
# TRL's `ChunkedLogProbFunction.forward` parameters after `ctx`: the contract we reproduce.
_TRL_SIGNATURE = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                  "final_logit_softcapping", "logit_scale", "outputs")
_TRL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# TRL's `ChunkedDivergenceFunction.forward` parameters after `ctx`.
_TRL_DIVERGENCE_SIGNATURE = (
    "student_hidden", "student_weight", "student_bias", "teacher_hidden", "teacher_weight",
    "teacher_bias", "beta", "temperature", "student_logit_scale",
    "student_final_logit_softcapping", "teacher_logit_scale", "teacher_final_logit_softcapping")
_original = None
_original_divergence = None
_original_dtensor = None


class _NeverInstance(type):
    def __instancecheck__(cls, obj) -> bool:
        return False


class KeepShardedHead(metaclass=_NeverInstance):
    """Stands in for ``DTensor`` in ``trl.trainer.utils``, whose one use of the name is the
    ``isinstance(weight, DTensor)`` before ``weight.full_tensor()`` in ``add_fused_lm_head``'s
    forward: no object is an instance, so an FSDP2 head reaches logitless's kernel sharded and
    runs there as a vocabulary-parallel head over its mesh, without the gather
    (`logitless.fused_losses.head.dtensor`). Swapped in only while logitless's kernel is."""


def _gather_site(trl_utils) -> bool:
    """Whether TRL's fused forward gathers a DTensor head where `KeepShardedHead` expects:
    the module's ``DTensor`` used once, for ``weight.full_tensor()``."""
    try:
        source = inspect.getsource(trl_utils)
    except (OSError, TypeError):
        return False
    return (source.count("DTensor)") == 1 and "isinstance(weight, DTensor)" in source
            and "weight = weight.full_tensor()" in source)


def keep_sharded(trl_utils):
    """Swap `KeepShardedHead` in for TRL's ``DTensor`` name; returns what to restore (None when
    TRL's code is not the one `_gather_site` knows: the head is then gathered, as before)."""
    current = getattr(trl_utils, "DTensor", None)
    if current is KeepShardedHead or not _gather_site(trl_utils):
        return None
    trl_utils.DTensor = KeepShardedHead
    return current


def trl_modules():
    try:
        import trl
        import trl.trainer.utils as trl_utils
        from trl.kernels import ChunkedLogProbFunction
    except ImportError as err:
        wanted = ",".join(SUPPORTED_TRL)
        raise RuntimeError(f"patch_trl needs TRL {wanted} installed: {err}") from err
    return trl, trl_utils, ChunkedLogProbFunction


def _distillation_module():
    import trl.trainer.distillation_trainer as distillation

    return distillation


def check_contract(trl, function, expected=_TRL_SIGNATURE) -> None:
    from packaging.version import Version

    version = Version(trl.__version__)
    params = tuple(inspect.signature(function.forward).parameters)[1:]
    supported = Version("1.16") <= version < Version("1.17")
    if not supported or params != expected:
        raise RuntimeError(
            f"logitless.integrations.trl supports TRL {','.join(SUPPORTED_TRL)} whose kernels "
            f"are called as {function.__name__}.apply{expected}; found TRL {trl.__version__} "
            f"with {params}. Pin TRL to that range or leave TRL's own kernels in place."
        )


def logitless_softcap(final_logit_softcapping, logit_scale):
    """logitless's ``softcap`` for TRL's kernel arguments. TRL soft-caps the scaled logit,
    c * tanh(s x / c); logitless scales the soft-capped one. They agree with logitless's cap
    c / |s|. TRL's kernel caps at 1.0 when given 0.0 (`final_logit_softcapping or 1.0`);
    logit_scale=0 (all logits 0) is kept, as TRL keeps it, and makes the cap irrelevant."""
    if final_logit_softcapping is None:
        return None
    return (final_logit_softcapping or 1.0) / abs(logit_scale) if logit_scale != 0 else None


class LogitlessChunkedLogProb:
    """Stands in for ``trl.kernels.ChunkedLogProbFunction`` with the same ``apply`` contract."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0, outputs=_TRL_OUTPUTS, *,
              sampler=None, kept_ids=None):
        """TRL's arguments, plus ``sampler`` (a ``SamplerTruncation``, or None): the sampler's
        top-k / top-p / min-p, which make the logprobs and entropy those of the truncated,
        renormalised distribution the sampler drew from (logitless's ``GRPOTrainer`` passes
        it with ``match_sampler=True``); or ``kept_ids`` (int64 ``[N, K]``, one row per row of
        ``hidden``, padded with -1): the sets the engine recorded, renormalised over
        (``match_sampler="replay"``). With ``kept_ids`` only the logprobs and the entropy are
        computed (the other outputs read None)."""
        if kept_ids is not None:
            if sampler is not None:
                raise ValueError("kept_ids: the recorded kept set replaces the sampler's "
                                 "truncations; pass one of sampler and kept_ids")
            outputs = tuple(o for o in outputs if o == "entropy")
        del chunk_size  # logitless sizes its own tiles
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        softcap = logitless_softcap(final_logit_softcapping, logit_scale)
        stats = tuple(name for name, wanted in (("sum_p_sq", "log_sum_sq_probs"),
                                                ("mean_logit", "mean_logits"),
                                                ("is_top1", "is_top1")) if wanted in outputs)
        # An FSDP2 DTensor head (`KeepShardedHead`) is never ZeRO-3 partitioned: no gather
        gather = None if is_dtensor(weight) else lambda: maybe_gather_lm_head_ctx(weight, bias)
        out = linear_logprobs(
            hidden, weight, targets, bias=bias, temperature=temperature, softcap=softcap,
            logit_scale=logit_scale, return_entropy="entropy" in outputs, stats=stats,
            gather_weight=gather,
            **({} if sampler is None else sampler.kwargs()),
            **({} if kept_ids is None else {"kept_ids": kept_ids}),
        )
        log_sum_sq = None if out.sum_p_sq is None else torch.log(out.sum_p_sq.detach())
        mean = None if out.mean_logit is None else out.mean_logit.detach()
        return out.logprobs, out.entropy, log_sum_sq, mean, out.is_top1


class LogitlessChunkedDivergence:
    """Stands in for TRL's ``ChunkedDivergenceFunction`` (``apply`` with the same arguments,
    returning the per-token divergence and the student's entropy, both ``[N]`` fp32).

    Supported range, refused with a ``ValueError`` outside it: no final-logit soft-capping on
    either head, the same ``logit_scale`` > 0 on both heads (it is folded into the
    temperature), and no DeepSpeed ZeRO-3 (its partitioned heads are gathered by TRL's kernel
    only). Everything else is what ``linear_divergence`` checks (``beta`` in [0, 1],
    temperature > 0, one vocabulary).
    """

    @staticmethod
    def apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
              teacher_bias, beta, temperature=1.0, student_logit_scale=1.0,
              student_final_logit_softcapping=None, teacher_logit_scale=1.0,
              teacher_final_logit_softcapping=None):
        for name, cap in (("student_final_logit_softcapping", student_final_logit_softcapping),
                          ("teacher_final_logit_softcapping", teacher_final_logit_softcapping)):
            if cap is not None:
                raise ValueError(
                    f"{name}: logitless's divergence supports heads without final-logit "
                    f"soft-capping (None), got {cap!r}; call logitless.integrations.trl."
                    f"unpatch_trl() to train this model with TRL's own kernel")
        scale = student_logit_scale
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0
                and teacher_logit_scale == scale):
            raise ValueError(
                f"student_logit_scale, teacher_logit_scale: logitless's divergence supports one "
                f"finite logit_scale > 0 shared by both heads, got {student_logit_scale!r} and "
                f"{teacher_logit_scale!r}; call logitless.integrations.trl.unpatch_trl() to "
                f"train this pair with TRL's own kernel")
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            raise ValueError(
                "student_weight: logitless's divergence does not gather DeepSpeed ZeRO-3 "
                "partitioned heads (supported: unsharded heads and FSDP2, whose heads TRL "
                "gathers itself); call logitless.integrations.trl.unpatch_trl() under ZeRO-3")
        out = linear_divergence(
            student_hidden, student_weight, teacher_hidden, teacher_weight, beta=beta,
            temperature=temperature / scale if scale != 1 else temperature,
            bias=student_bias, teacher_bias=teacher_bias, return_entropy=True)
        return out.divergence, out.entropy


def patch_trl() -> None:
    """Route TRL's fused LM head (all trainers that use it) and ``DistillationTrainer``'s
    divergence kernel through logitless. Idempotent."""
    global _original, _original_divergence, _original_dtensor
    trl, trl_utils, function = trl_modules()
    distillation = _distillation_module()
    check_contract(trl, function)
    if distillation.ChunkedDivergenceFunction is not LogitlessChunkedDivergence:
        check_contract(trl, distillation.ChunkedDivergenceFunction, _TRL_DIVERGENCE_SIGNATURE)
    if trl_utils._ChunkedLogProbFunction is not LogitlessChunkedLogProb:
        _original = trl_utils._ChunkedLogProbFunction
        trl_utils._ChunkedLogProbFunction = LogitlessChunkedLogProb
    dtensor = keep_sharded(trl_utils)
    if dtensor is not None:
        _original_dtensor = dtensor
    if distillation.ChunkedDivergenceFunction is not LogitlessChunkedDivergence:
        _original_divergence = distillation.ChunkedDivergenceFunction
        distillation.ChunkedDivergenceFunction = LogitlessChunkedDivergence


def unpatch_trl() -> None:
    """Restore TRL's own fused head and divergence kernel. A no-op when not patched."""
    global _original, _original_divergence, _original_dtensor
    _, trl_utils, _ = trl_modules()
    if _original is not None:
        trl_utils._ChunkedLogProbFunction = _original
        _original = None
    if _original_dtensor is not None:
        trl_utils.DTensor = _original_dtensor
        _original_dtensor = None
    if _original_divergence is not None:
        _distillation_module().ChunkedDivergenceFunction = _original_divergence
        _original_divergence = None


def trl_patched() -> bool:
    """Whether both of TRL's kernels are logitless's."""
    _, trl_utils, _ = trl_modules()
    return (trl_utils._ChunkedLogProbFunction is LogitlessChunkedLogProb
            and _distillation_module().ChunkedDivergenceFunction is LogitlessChunkedDivergence)
