"""What the trainer adapters read per objective, beside the core registry: the TRL and verl
fields an objective's name decides. The registry (``objectives/catalog.py``) knows no peer; the
adapters look their fields up here by the objective's name.

- ``verl_dual_clip``: verl's matching loss applies ``clip_ratio_c`` as a dual clip (the PPO
  family, verl's ``vanilla``): the default of ``LogitlessPolicyLossConfig.dual_clip``.
- ``verl_keys``: ``PolicyLossConfig`` field -> the key of verl's ``policy_loss`` config it is
  read from, where that key depends on the objective (``cov_fraction``).
- ``trl_fields``: ``PolicyLossConfig`` fields TRL's loss of this name fixes, whatever
  ``GRPOConfig`` says.

A user objective sets its own with :func:`register_objective_fields`. ``register_objective``'s
old keywords of the same names still work for one release: they warn and forward here.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from types import MappingProxyType

from logitless.fused_losses.objectives import catalog

__all__ = ["register_objective_fields", "trl_fields", "verl_dual_clip", "verl_keys"]

# verl's ``vanilla`` loss, the counterpart of the PPO family, always applies the dual clip.
_VERL_DUAL_CLIP = {"ppo", "grpo", "dapo", "bnpo", "dr_grpo"}
_VERL_KEYS: dict[str, Mapping[str, str]] = {
    "clip_cov": MappingProxyType({"cov_fraction": "clip_cov_ratio"}),
    "kl_cov": MappingProxyType({"cov_fraction": "kl_cov_ratio"}),
}
# TRL computes vespo's sequence weight from token ratios whatever its importance_sampling_level,
# and clamps the log-ratio to +-20 (its other losses do not clamp).
_TRL_FIELDS: dict[str, Mapping[str, object]] = {
    "vespo": MappingProxyType({"ratio_level": "token", "log_ratio_clamp": 20.0}),
}


def register_objective_fields(name: str, *, verl_dual_clip: bool | None = None,
                              verl_keys: Mapping[str, str] | None = None,
                              trl_fields: Mapping[str, object] | None = None) -> None:
    """Set what the TRL and verl adapters read for objective ``name`` (module doc); a keyword
    left at None keeps what is set."""
    if verl_dual_clip is not None:
        (_VERL_DUAL_CLIP.add if verl_dual_clip else _VERL_DUAL_CLIP.discard)(name)
    if verl_keys is not None:
        _VERL_KEYS[name] = MappingProxyType(dict(verl_keys))
    if trl_fields is not None:
        _TRL_FIELDS[name] = MappingProxyType(dict(trl_fields))


def verl_dual_clip(name: str) -> bool:
    """Whether verl's loss matching objective ``name`` applies ``clip_ratio_c`` as a dual clip."""
    return name in _VERL_DUAL_CLIP


def verl_keys(name: str) -> Mapping[str, str]:
    """``PolicyLossConfig`` field -> verl ``policy_loss`` key, for objective ``name``."""
    return _VERL_KEYS.get(name, MappingProxyType({}))


def trl_fields(name: str) -> Mapping[str, object]:
    """``PolicyLossConfig`` fields TRL's loss ``name`` fixes."""
    return _TRL_FIELDS.get(name, MappingProxyType({}))


def _forward(keyword: str):
    def forward(name: str, value) -> None:
        warnings.warn(f"register_objective({keyword}=...) is deprecated: use "
                      f"logitless.integrations.objective_fields.register_objective_fields("
                      f"{name!r}, {keyword}=...)", DeprecationWarning, stacklevel=3)
        register_objective_fields(name, **{keyword: value})

    return forward


for _keyword in ("verl_dual_clip", "verl_keys", "trl_fields"):
    catalog.forward_keyword(_keyword, _forward(_keyword))
