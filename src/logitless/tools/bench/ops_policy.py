"""Op ``policy-loss``: a GRPO-style clipped policy loss from hidden states and the LM head.

The batch is ``B = tokens / T`` right-padded sequences of ``T = min(tokens, 128)`` tokens (the
first sequence's last quarter is padding), advantages per sequence, old logprobs near the
current ones. Objective: the clipped ratio with eps 0.2, token-mean aggregation, no KL (Liger's
``loss_type="dapo"`` with ``beta=0``, the same loss).

Providers: logitless fused (``fused_policy_loss``), logitless composed (``linear_logprobs`` then
``policy_loss``), naive torch (materialised logits, then ``policy_loss``), Liger's fused linear
GRPO loss, and the plain GEMMs floor.
"""

from __future__ import annotations

import importlib.util

import torch

from logitless import reference
from logitless.tools.bench.ops_logprobs import LogprobsOp, PlainGemms
from logitless.tools.bench.registry import Provider, register_op, register_provider

SEQ_LEN = 128


def _config():
    from logitless import PolicyLossConfig

    return PolicyLossConfig(objective="grpo", eps_low=0.2, eps_high=0.2, loss_agg="token-mean")


class PolicyLossOp(LogprobsOp):
    name = "policy-loss"
    grad_inputs = ("hidden", "weight")
    row_separable = False  # one loss over the batch: the reference runs on the whole block

    def make_inputs(self, shape, dtype, device, seed=0):
        flat = super().make_inputs(shape, dtype, device, seed)
        n, d = shape["tokens"], shape["hidden"]
        t = min(n, SEQ_LEN)
        if n % t:
            raise ValueError(f"policy-loss needs tokens ({n}) to be a multiple of {t}")
        b = n // t
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        mask = torch.ones(b, t, device=device)
        mask[0, t - t // 4:] = 0
        with torch.no_grad():
            from logitless import linear_logprobs

            lp = linear_logprobs(flat["hidden"], flat["weight"], flat["targets"]).logprobs
        noise = 0.1 * torch.randn(n, generator=gen, device=device)
        return {
            "hidden": flat["hidden"].reshape(b, t, d),
            "weight": flat["weight"],
            "targets": flat["targets"].reshape(b, t),
            "mask": mask,
            "old_logprobs": (lp + noise).reshape(b, t),
            "advantages": torch.randn(b, generator=gen, device=device),
        }

    def first_block(self, inputs, rows):
        t = inputs["mask"].shape[1]
        b = max(1, rows // t)
        return {k: v if k == "weight" else v[:b] for k, v in inputs.items()}

    def reference(self, inputs, quantities):
        from logitless import policy_loss

        stats = reference.linear_softmax_stats(inputs["hidden"], inputs["weight"],
                                               inputs["targets"])
        loss, _ = policy_loss(stats["logprobs"], inputs["old_logprobs"], inputs["advantages"],
                              inputs["mask"], _config())
        return {"loss": loss}

    def upstream(self, inputs, quantities):
        return {q: torch.ones((), device=inputs["hidden"].device) for q in quantities}


register_op(PolicyLossOp())


def _policy_loss(lp, x):
    from logitless import policy_loss

    loss, _ = policy_loss(lp, x["old_logprobs"], x["advantages"], x["mask"], _config())
    return {"loss": loss}


@register_provider
class Fused(Provider):
    op, name, package = "policy-loss", "logitless-fused", "logitless"
    quantities = ("loss",)

    def forward(self, x):
        from logitless import fused_policy_loss

        loss, _ = fused_policy_loss(x["hidden"], x["weight"], x["targets"], x["old_logprobs"],
                                    x["advantages"], x["mask"], _config())
        return {"loss": loss}


@register_provider
class Composed(Provider):
    op, name, package = "policy-loss", "logitless", "logitless"
    quantities = ("loss",)

    def forward(self, x):
        from logitless import linear_logprobs

        return _policy_loss(linear_logprobs(x["hidden"], x["weight"], x["targets"]).logprobs, x)


@register_provider
class Naive(Provider):
    op, name, package = "policy-loss", "naive", "torch"
    quantities = ("loss",)

    def forward(self, x):
        logits = x["hidden"] @ x["weight"].t()
        logp = torch.log_softmax(logits.float(), dim=-1)
        lp = logp.gather(-1, x["targets"].unsqueeze(-1)).squeeze(-1)
        return _policy_loss(lp, x)


@register_provider
class LigerGRPO(Provider):
    """``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (torch chunks under
    ``torch.compile``, one sequence per chunk by default)."""

    op, name, package = "policy-loss", "liger", "liger-kernel"
    quantities = ("loss",)

    def unavailable(self, device, dtype, mode):
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed (pip install liger-kernel)"
        return None

    def forward(self, x):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        if not hasattr(self, "_loss"):
            self._loss = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False,
                                                  epsilon_low=0.2, epsilon_high=0.2,
                                                  loss_type="dapo")
        out = self._loss(x["hidden"], x["weight"], x["targets"], x["mask"], x["advantages"],
                         old_per_token_logps=x["old_logprobs"])
        return {"loss": out[0] if isinstance(out, tuple) else out}


@register_provider
class PolicyGemms(PlainGemms):
    op = "policy-loss"

    def step(self, inputs, mode, upstream):
        flat = {"hidden": inputs["hidden"].reshape(-1, inputs["hidden"].shape[-1]),
                "weight": inputs["weight"]}
        super().step(flat, mode, upstream)
