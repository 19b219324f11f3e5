"""The logitless policy losses as verl's actor calls them, beside verl's own, on CPU.

verl's actor looks its loss up by name (``actor.policy_loss.loss_mode``) in
``verl.trainer.ppo.core_algos``'s registry and calls it with the old and new logprobs, the
advantages, the response mask, the aggregation mode and the actor config. This script builds
the actor config from YAML through verl's own ``omega_conf_to_dataclass`` (hydra underneath),
once with verl's built-in loss and once with the logitless loss that reproduces it, and prints
both losses and their gradients' largest difference. Every row should read a difference at
fp64 rounding.

    python examples/verl_loss.py            # verl 0.9.1 installed (pip install "logitless[verl]")
"""

from __future__ import annotations

import textwrap

import torch
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos
from verl.utils.config import omega_conf_to_dataclass

import logitless.integrations.verl  # noqa: F401 (registers logitless_<objective>)

# verl's loss -> the logitless loss mode and the LogitlessPolicyLossConfig fields that give
# verl's behaviour exactly (docs/verl.md, "Equal to verl's built-in losses").
PAIRS = {
    "vanilla": ("logitless_ppo", {}),
    "gpg": ("logitless_gpg", {}),
    "cispo": ("logitless_cispo", {}),
    "gspo": ("logitless_gspo", {"ratio_level": "sequence_token", "seq_log_ratio_max": 10.0,
                                "log_ratio_clamp": None}),
}


def actor_config(loss_mode: str, fields: dict, logitless_target: bool):
    target = ("logitless.integrations.verl.LogitlessPolicyLossConfig" if logitless_target
              else "verl.workers.config.PolicyLossConfig")
    policy_loss = {"_target_": target, "loss_mode": loss_mode, **fields}
    yaml = textwrap.dedent("""
        _target_: verl.workers.config.ActorConfig
        strategy: fsdp
        rollout_n: 1
        ppo_micro_batch_size_per_gpu: 1
        clip_ratio: 0.2
        clip_ratio_low: 0.2
        clip_ratio_high: 0.28
        clip_ratio_c: 3.0
        loss_agg_mode: token-mean
    """)
    config = OmegaConf.create(yaml)
    config.policy_loss = policy_loss
    return omega_conf_to_dataclass(config)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 13
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    lp = -3 * torch.rand(b, t, generator=g, dtype=torch.float64) - 0.05
    old = (lp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = 2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    return lp, old, adv, mask


def call(actor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and its gradient in the new logprobs, called as verl's actor calls it."""
    lp, old, adv, mask = batch()
    lp.requires_grad_(True)
    loss, _ = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
        loss_agg_mode=actor.loss_agg_mode, config=actor, rollout_is_weights=None)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def main() -> list[tuple[str, float, float]]:
    rows = []
    print(f"{'verl loss':<10}{'logitless loss mode':<22}{'verl':>12}{'logitless':>12}"
          f"{'|d loss|':>10}{'max |d grad|':>14}")
    for name, (mode, fields) in PAIRS.items():
        theirs, g_theirs = call(actor_config(name, {}, logitless_target=False))
        ours, g_ours = call(actor_config(mode, fields, logitless_target=True))
        d_loss, d_grad = float((ours - theirs).abs()), float((g_ours - g_theirs).abs().max())
        rows.append((name, d_loss, d_grad))
        print(f"{name:<10}{mode:<22}{float(theirs):>12.6f}{float(ours):>12.6f}"
              f"{d_loss:>10.1e}{d_grad:>14.1e}")
    return rows


if __name__ == "__main__":
    main()
