"""logitless: RL post-training losses from the LM head without the full-vocabulary logits."""

__version__ = "0.1.0"

from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss
from logitless.fused_losses.head.attention_entropy import attention_entropy
from logitless.fused_losses.head.divergence import (
    DivergenceOutput,
    linear_divergence,
    linear_topk_distill,
    mtp_draft_loss,
)
from logitless.fused_losses.head.logprobs import LogprobOutput, linear_logprobs
from logitless.fused_losses.objectives.aggregation import BatchGlobals
from logitless.fused_losses.objectives.catalog import (
    ObjectiveInputs,
    ObjectiveOutput,
    register_objective,
)
from logitless.fused_losses.objectives.config import PolicyLossConfig
from logitless.fused_losses.objectives.entropy_control import AdaptiveEntropyCoef
from logitless.fused_losses.objectives.mismatch import mismatch_metrics
from logitless.fused_losses.objectives.policy_inputs import check_policy_inputs
from logitless.fused_losses.objectives.policy_loss import policy_loss, policy_loss_globals

# register_objective's deprecated TRL / verl keywords forward to the adapters' field maps,
# which this import installs (no peer package is imported).
from logitless.integrations import objective_fields as _objective_fields  # noqa: F401

__all__ = [
    "AdaptiveEntropyCoef",
    "BatchGlobals",
    "DivergenceOutput",
    "LogprobOutput",
    "ObjectiveInputs",
    "ObjectiveOutput",
    "PolicyLossConfig",
    "attention_entropy",
    "check_policy_inputs",
    "fused_policy_loss",
    "linear_divergence",
    "linear_logprobs",
    "linear_topk_distill",
    "mismatch_metrics",
    "mtp_draft_loss",
    "policy_loss",
    "policy_loss_globals",
    "register_objective",
]
