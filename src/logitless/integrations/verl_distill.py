"""verl distillation loss ``logitless_forward_kl_topk``: verl 0.9.1's top-k forward KL from the
student's hidden states and head, by :func:`logitless.linear_topk_distill`.

Registered in verl's distillation-loss registry (``verl.trainer.distillation.losses``) when
:mod:`logitless.integrations.verl` loads, which the ``verl.plugins`` entry point does on
``import verl``. Select it with::

    distillation.distillation_loss.loss_mode=logitless_forward_kl_topk

It is a top-k loss for verl (``use_topk=True``: the teacher serves its top-k log-probs) and
takes verl's registry arguments ``(config, distillation_config, model_output, data)``:

- ``model_output["hidden_states"]`` (packed ``[total_nnz, D]``, the rows verl's logits have),
  ``model_output["lm_head_weight"]`` ``[V, D]`` and optionally ``model_output["lm_head_bias"]``:
  the loss is computed from them without logits, on the rows that predict response tokens,
  at the micro-batch's ``temperature``, with ``distillation_loss.log_prob_min_clamp`` and the
  floor at 0 that verl's ``forward_kl_topk`` applies (``loss_max_clamp`` is applied
  afterwards by verl's ``distillation_loss``, for every loss mode).
- Without ``hidden_states``: verl 0.9.1's engines compute the top-k loss in their logits
  processor, from the materialised logits, before any registry function runs; the per-token
  losses are then already in ``model_output`` and this loss is verl's own ``forward_kl_topk``
  on them (nothing is saved: the logits existed).
"""

from __future__ import annotations

from typing import Any

import torch

from logitless.fused_losses.head.divergence import linear_topk_distill

__all__ = ["TOPK_LOSS_NAME", "compute_forward_kl_topk", "register_verl_distillation_loss"]

TOPK_LOSS_NAME = "logitless_forward_kl_topk"


def _response_rows(data, total: int) -> torch.Tensor:
    """Bool ``[total]``: the packed rows whose logits predict a response token (verl's
    ``no_padding_2_padding`` reads exactly these)."""
    prompts, responses = data["prompts"], data["responses"]
    if not (prompts.is_nested and responses.is_nested):
        raise ValueError("data: logitless_forward_kl_topk needs verl's packed (nested) "
                         "prompts and responses, got padded tensors")
    prompt_lens = prompts.offsets().diff().tolist()
    response_lens = responses.offsets().diff().tolist()
    rows = torch.zeros(total, dtype=torch.bool, device=prompts.device)
    start = 0
    for p, r in zip(prompt_lens, response_lens):
        rows[start + p - 1:start + p + r - 1] = True
        start += p + r
    if start != total:
        raise ValueError(f"model_output['hidden_states']: expected {start} packed rows "
                         f"(prompts plus responses), got {total}")
    return rows


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.values() if t.is_nested else t


def compute_forward_kl_topk(config, distillation_config, model_output: dict,
                            data) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's registry contract: per-token losses ``[bsz, max_response_len]`` and metrics."""
    from verl.trainer.distillation.losses import DISTILLATION_LOSS_REGISTRY
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    if "hidden_states" not in model_output:
        return DISTILLATION_LOSS_REGISTRY["forward_kl_topk"](
            config=config, distillation_config=distillation_config,
            model_output=model_output, data=data)
    hidden = _values(model_output["hidden_states"])
    weight = model_output.get("lm_head_weight")
    if weight is None:
        raise ValueError("model_output['lm_head_weight']: the student's head [V, D] is needed "
                         "with model_output['hidden_states']")
    temperature = tu.get_non_tensor_data(data=data, key="temperature", default=1.0)
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError("temperature: logitless_forward_kl_topk supports one temperature "
                             "per micro-batch, got a per-sample tensor")
        temperature = float(temperature)
    ids = _values(data["teacher_ids"])
    teacher_lp = _values(data["teacher_logprobs"])
    rows = _response_rows(data, hidden.shape[0])
    loss_config = distillation_config.distillation_loss
    losses = linear_topk_distill(
        hidden, weight, ids, teacher_lp, rows, temperature=float(temperature),
        bias=model_output.get("lm_head_bias"), log_prob_min_clamp=loss_config.log_prob_min_clamp,
        loss_max_clamp=None)
    losses = no_padding_2_padding(losses.float(), data)
    mask = data["response_mask"]
    mask = (mask.to_padded_tensor(False) if mask.is_nested else mask).bool()
    teacher_mass = no_padding_2_padding(teacher_lp.float().exp().sum(-1), data)[mask]
    return losses, {"distillation/teacher_mass": teacher_mass.mean().item()}


def register_verl_distillation_loss() -> str:
    """Register :data:`TOPK_LOSS_NAME` in verl's distillation-loss registry (once); returns
    the name."""
    from verl.trainer.distillation.losses import (
        DISTILLATION_LOSS_REGISTRY,
        DistillationLossSettings,
        register_distillation_loss,
    )

    if DISTILLATION_LOSS_REGISTRY.get(TOPK_LOSS_NAME) is not compute_forward_kl_topk:
        DISTILLATION_LOSS_REGISTRY.pop(TOPK_LOSS_NAME, None)  # a reloaded module's function
        register_distillation_loss(DistillationLossSettings(
            names=[TOPK_LOSS_NAME], use_topk=True))(compute_forward_kl_topk)
    return TOPK_LOSS_NAME
