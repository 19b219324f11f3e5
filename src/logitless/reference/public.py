"""The reference under the public ops' names: ``reference.linear_logprobs``,
``reference.policy_loss`` and ``reference.fused_policy_loss`` take the arguments the fast op of
the same name takes (right-padded ``[B, T]`` batches) and compute the same quantity from the
materialised logits and the token-by-token loss. Run them in fp64 to check a head or a config
of your own against the fast path (docs/design.md, "Checking your own head")."""

from __future__ import annotations

import torch

from logitless.reference.linear_softmax import linear_softmax_stats
from logitless.reference.objectives import policy_loss_reference
from logitless.reference.sampler import kept_set_logprobs, sampler_logprobs


def linear_logprobs(hidden, weight, targets, bias=None, *, temperature=1.0, softcap=None,
                    logit_scale=1.0, ignore_index=-100, top_k=None, top_p=None, min_p=None,
                    kept_ids=None, sampler="vllm"):
    """`logitless.linear_logprobs` from the full logits: a dict of per-token tensors shaped
    like ``targets`` (``logprobs``, ``entropy`` and the other statistics; with ``top_k`` /
    ``top_p`` / ``min_p`` the logprobs under the ``sampler`` engine's (vLLM's by default)
    truncated distribution, with ``kept_ids``
    under the recorded kept set)."""
    if kept_ids is not None:
        return kept_set_logprobs(hidden, weight, targets, kept_ids, bias,
                                 temperature=temperature, softcap=softcap,
                                 logit_scale=logit_scale, ignore_index=ignore_index)
    if top_k is None and top_p is None and min_p is None:
        return linear_softmax_stats(hidden, weight, targets, bias, temperature=temperature,
                                    softcap=softcap, logit_scale=logit_scale,
                                    ignore_index=ignore_index)
    return sampler_logprobs(hidden, weight, targets, bias, temperature=temperature,
                            top_k=top_k, top_p=top_p, min_p=min_p, softcap=softcap,
                            logit_scale=logit_scale, ignore_index=ignore_index, sampler=sampler)


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
                      bias=None, temperature=1.0, softcap=None, logit_scale=1.0,
                      ref_logprobs=None, rollout_logprobs=None, token_weights=None,
                      attention_entropy=None, training_progress=None) -> torch.Tensor:
    """`logitless.fused_policy_loss`'s loss from the head: the full logits give the logprobs
    and entropies, then `policy_loss` token by token; differentiable in hidden, weight and
    bias. ``targets`` may hold any id where ``mask`` is False."""
    safe = torch.where(mask.bool(), targets, torch.zeros_like(targets))
    stats = linear_softmax_stats(hidden, weight, safe, bias, temperature=temperature,
                                 softcap=softcap, logit_scale=logit_scale)
    return policy_loss(stats["logprobs"], old_logprobs, advantages, mask, config,
                       ref_logprobs=ref_logprobs, entropy=stats["entropy"],
                       rollout_logprobs=rollout_logprobs, token_weights=token_weights,
                       attention_entropy=attention_entropy,
                       training_progress=training_progress)
