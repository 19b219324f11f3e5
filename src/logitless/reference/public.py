"""The reference under the public ops' names: ``reference.linear_logprobs``,
``reference.policy_loss`` and ``reference.fused_policy_loss`` take the arguments the fast op of
the same name takes (right-padded ``[B, T]`` batches) and compute the same quantity from the
materialised logits and the token-by-token loss. Run them in fp64 to check a head or a config
of your own against the fast path (docs/design.md, "Checking your own head")."""

from __future__ import annotations

import functools
import inspect
import math
import warnings

import torch

from logitless.fused_losses.oplib import LogprobOutput
from logitless.reference.linear_softmax import head_inputs, linear_logits, linear_softmax_stats
from logitless.reference.objectives import policy_loss_reference
from logitless.reference.sampler import kept_set_logprobs, sampler_logprobs


def bias_keyword(fn):
    """``fn(hidden, weight, ..., *, bias=None, ...)`` that still takes ``bias`` as the
    positional argument after its leading ones, as the reference did before it took the
    public ops' signatures, with a ``DeprecationWarning`` (docs/api-changes.md)."""
    n = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in inspect.signature(fn).parameters.values())

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if len(args) == n + 1:
            if "bias" in kwargs:
                raise TypeError(f"{fn.__name__}() got multiple values for argument 'bias'")
            warnings.warn(f"reference.{fn.__name__}: bias is keyword-only, as in the public op; "
                          f"passing it by position goes in the next release "
                          f"(docs/api-changes.md)", DeprecationWarning, stacklevel=2)
            *args, kwargs["bias"] = args
        return fn(*args, **kwargs)

    return call


@bias_keyword
def linear_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, top_k=None,
                    top_p=None, min_p=None, kept_ids=None, ids=None, sampler="vllm",
                    softcap=None, logit_scale=1.0, ignore_index=-100, return_entropy=False,
                    stats=(), head_dtype=None) -> LogprobOutput:
    """`logitless.linear_logprobs` from the full logits: a :class:`LogprobOutput` shaped like
    ``targets``, holding what the op's call asks for (``entropy`` with ``return_entropy``, the
    ``stats``, ``id_logprobs`` with ``ids``). With ``top_k`` / ``top_p`` / ``min_p`` or a
    per-token temperature, the logprobs under the ``sampler`` engine's (vLLM's by default)
    truncated distribution; with ``kept_ids``, under the recorded kept set. ``head_dtype``: the
    head upcast to fp32 first (`head_inputs`)."""
    hidden, weight, bias = head_inputs(head_dtype, hidden, weight, bias)
    head = dict(softcap=softcap, logit_scale=logit_scale, ignore_index=ignore_index)
    per_token = isinstance(temperature, torch.Tensor)
    if kept_ids is not None:
        got = kept_set_logprobs(hidden, weight, targets, kept_ids, bias,
                                temperature=temperature, **head)
    elif top_k is None and top_p is None and min_p is None and not per_token:
        got = linear_softmax_stats(hidden, weight, targets, bias, temperature=temperature,
                                   **head)
        got["log_kept_mass"] = torch.zeros_like(got["logprobs"])
    else:
        got = sampler_logprobs(hidden, weight, targets, bias, temperature=temperature,
                               top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler, **head)
    valid = targets != ignore_index
    if "lse" in stats or ids is not None:
        temp = temperature.unsqueeze(-1) if per_token else temperature
        z = linear_logits(hidden, weight, bias, softcap_value=softcap,
                          logit_scale=logit_scale) / temp
        got["lse"] = torch.where(valid, torch.logsumexp(z, -1), 0.0)
    missing = [s for s in stats if s not in got]
    if missing:
        raise ValueError(f"stats {missing} are unsupported with top_k/top_p/min_p, kept_ids or "
                         f"a per-token temperature")
    out = LogprobOutput(logprobs=got["logprobs"],
                        entropy=got["entropy"] if return_entropy else None,
                        **{s: got[s] for s in stats})
    if ids is not None:
        at = z.gather(-1, ids.clamp(min=0).long()) - got["lse"].unsqueeze(-1)
        at = torch.where(ids >= 0, at, -math.inf)
        out.id_logprobs = torch.where(valid.unsqueeze(-1), at, 0.0)
    return out


def policy_loss(logprobs, old_logprobs, advantages, mask, config, *, ref_logprobs=None,
                entropy=None, rollout_logprobs=None, token_weights=None,
                attention_entropy=None, training_progress=None, kl=None) -> torch.Tensor:
    """`logitless.policy_loss`'s loss (not its metrics) on a right-padded ``[B, T]`` batch,
    token by token; differentiable in ``logprobs`` and ``entropy``."""
    return policy_loss_reference(logprobs, old_logprobs, advantages, mask, config,
                                 ref=ref_logprobs, entropy=entropy, rollout=rollout_logprobs,
                                 token_weights=token_weights,
                                 attention_entropy=attention_entropy,
                                 training_progress=training_progress, kl=kl)


def fused_policy_loss(hidden, weight, targets, old_logprobs, advantages, mask, config, *,
                      bias=None, ref_logprobs=None, rollout_logprobs=None, token_weights=None,
                      attention_entropy=None, temperature=1.0, softcap=None, logit_scale=1.0,
                      ignore_index=-100, training_progress=None) -> torch.Tensor:
    """`logitless.fused_policy_loss`'s loss from the head: the full logits give the logprobs
    and entropies, then `policy_loss` token by token; differentiable in hidden, weight and
    bias. ``targets`` may hold any id where ``mask`` is False; a target of ``ignore_index``
    drops its token from ``mask``."""
    mask = mask.masked_fill(targets == ignore_index, 0)
    safe = torch.where(mask.bool(), targets, torch.zeros_like(targets))
    stats = linear_softmax_stats(hidden, weight, safe, bias, temperature=temperature,
                                 softcap=softcap, logit_scale=logit_scale)
    return policy_loss(stats["logprobs"], old_logprobs, advantages, mask, config,
                       ref_logprobs=ref_logprobs, entropy=stats["entropy"],
                       rollout_logprobs=rollout_logprobs, token_weights=token_weights,
                       attention_entropy=attention_entropy,
                       training_progress=training_progress)
