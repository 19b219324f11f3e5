"""Kernel swap for TRL: every trainer that uses TRL's fused LM head computes through logitless.

TRL (1.16) gives GRPO, RLOO, DPO, KTO and SFT one fused head, ``add_fused_lm_head``, whose
forward calls ``ChunkedLogProbFunction.apply`` from ``trl.trainer.utils``. :func:`patch_trl`
replaces that one name with an object of the same contract backed by
:func:`logitless.linear_logprobs`; :func:`unpatch_trl` restores it.
"""

from __future__ import annotations

import inspect

import torch

from logitless.fused_losses.logprobs import linear_logprobs

__all__ = ["SUPPORTED_TRL", "patch_trl", "trl_patched", "unpatch_trl"]

SUPPORTED_TRL = (">=1.16", "<1.17")
# TRL's `ChunkedLogProbFunction.forward` parameters after `ctx`: the contract we reproduce.
_TRL_SIGNATURE = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                  "final_logit_softcapping", "logit_scale", "outputs")
_TRL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_original = None


def _trl_modules():
    try:
        import trl
        import trl.trainer.utils as trl_utils
        from trl.kernels import ChunkedLogProbFunction
    except ImportError as err:
        wanted = ",".join(SUPPORTED_TRL)
        raise RuntimeError(f"patch_trl needs TRL {wanted} installed: {err}") from err
    return trl, trl_utils, ChunkedLogProbFunction


def _check_contract(trl, function) -> None:
    from packaging.version import Version

    version = Version(trl.__version__)
    params = tuple(inspect.signature(function.forward).parameters)[1:]
    supported = Version("1.16") <= version < Version("1.17")
    if not supported or params != _TRL_SIGNATURE:
        raise RuntimeError(
            f"logitless.integrations.trl supports TRL {','.join(SUPPORTED_TRL)} whose fused head "
            f"calls ChunkedLogProbFunction.apply{_TRL_SIGNATURE}; found TRL {trl.__version__} "
            f"with {params}. Pin TRL to that range or leave TRL's own head in place."
        )


class LogitlessChunkedLogProb:
    """Stands in for ``trl.kernels.ChunkedLogProbFunction`` with the same ``apply`` contract."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0, outputs=_TRL_OUTPUTS):
        del chunk_size  # logitless sizes its own tiles
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        # TRL soft-caps the scaled logit, c * tanh(s x / c); logitless scales the soft-capped
        # one. They agree with logitless's cap c / |s|. TRL's kernel caps at 1.0 when given
        # 0.0 (`final_logit_softcapping or 1.0`); logit_scale=0 (all logits 0) is kept, as TRL
        # keeps it, and makes the cap irrelevant.
        softcap = final_logit_softcapping
        if softcap is not None:
            softcap = (softcap or 1.0) / abs(logit_scale) if logit_scale != 0 else None
        stats = tuple(name for name, wanted in (("sum_p_sq", "log_sum_sq_probs"),
                                                ("mean_logit", "mean_logits"),
                                                ("is_top1", "is_top1")) if wanted in outputs)
        out = linear_logprobs(
            hidden, weight, targets, bias=bias, temperature=temperature, softcap=softcap,
            logit_scale=logit_scale, return_entropy="entropy" in outputs, stats=stats,
            gather_weight=lambda: maybe_gather_lm_head_ctx(weight, bias),
        )
        log_sum_sq = None if out.sum_p_sq is None else torch.log(out.sum_p_sq.detach())
        mean = None if out.mean_logit is None else out.mean_logit.detach()
        return out.logprobs, out.entropy, log_sum_sq, mean, out.is_top1


def patch_trl() -> None:
    """Route TRL's fused LM head (all trainers that use it) through logitless. Idempotent."""
    global _original
    trl, trl_utils, function = _trl_modules()
    if trl_utils._ChunkedLogProbFunction is LogitlessChunkedLogProb:
        return
    _check_contract(trl, function)
    _original = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = LogitlessChunkedLogProb


def unpatch_trl() -> None:
    """Restore TRL's own fused head. A no-op when not patched."""
    global _original
    _, trl_utils, _ = _trl_modules()
    if _original is not None:
        trl_utils._ChunkedLogProbFunction = _original
        _original = None


def trl_patched() -> bool:
    _, trl_utils, _ = _trl_modules()
    return trl_utils._ChunkedLogProbFunction is LogitlessChunkedLogProb
