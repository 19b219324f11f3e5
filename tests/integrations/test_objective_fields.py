"""The TRL and verl field maps live in ``integrations/objective_fields.py``, not in the core
objective registry: the registry's spec and ``register_objective``'s signature name no peer,
and the old keywords still work for one release (they warn and forward)."""

import dataclasses
import inspect
import re

import pytest

from logitless import register_objective
from logitless.fused_losses.objectives import catalog
from logitless.integrations import objective_fields

PEER = re.compile(r"verl|trl", re.IGNORECASE)


def test_the_core_registry_names_no_peer():
    names = [f.name for f in dataclasses.fields(catalog.ObjectiveSpec)]
    names += list(inspect.signature(register_objective).parameters)
    assert [n for n in names if PEER.search(n)] == []


def test_the_built_in_maps_are_the_adapters():
    assert {n for n in catalog.OBJECTIVES if objective_fields.verl_dual_clip(n)} \
        == {"ppo", "grpo", "dapo", "bnpo", "dr_grpo"}
    assert dict(objective_fields.verl_keys("kl_cov")) == {"cov_fraction": "kl_cov_ratio"}
    assert dict(objective_fields.verl_keys("clip_cov")) == {"cov_fraction": "clip_cov_ratio"}
    assert dict(objective_fields.trl_fields("vespo")) \
        == {"ratio_level": "token", "log_ratio_clamp": 20.0}
    assert dict(objective_fields.trl_fields("grpo")) == {}


def test_the_old_keywords_warn_and_forward():
    reinforce = catalog.OBJECTIVES["reinforce"].fn
    try:
        with pytest.warns(DeprecationWarning, match="register_objective_fields"):
            register_objective("test_peer_old", verl_dual_clip=True,
                               verl_keys={"cov_fraction": "kl_cov_ratio"},
                               trl_fields={"log_ratio_clamp": 5.0})(reinforce)
        assert "test_peer_old" in catalog.OBJECTIVES
        assert objective_fields.verl_dual_clip("test_peer_old")
        assert dict(objective_fields.verl_keys("test_peer_old")) == {
            "cov_fraction": "kl_cov_ratio"}
        assert dict(objective_fields.trl_fields("test_peer_old")) == {"log_ratio_clamp": 5.0}
        with pytest.raises(TypeError, match="not_a_keyword"):
            register_objective("test_peer_bad", not_a_keyword=1)
        assert "test_peer_bad" not in catalog.OBJECTIVES
    finally:
        catalog.OBJECTIVES.pop("test_peer_old", None)
        objective_fields.register_objective_fields("test_peer_old", verl_dual_clip=False,
                                                   verl_keys={}, trl_fields={})


def test_the_verl_adapter_reads_the_map():
    pytest.importorskip("verl")
    from logitless.integrations.verl import to_logitless_config

    actor = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean",
             "policy_loss": {"kl_cov_ratio": 0.01, "clip_cov_ratio": 0.5}}
    grpo, _ = to_logitless_config("grpo", actor)
    gspo, _ = to_logitless_config("gspo", actor)
    kl_cov, _ = to_logitless_config("kl_cov", actor)
    assert (grpo.dual_clip_c, gspo.dual_clip_c, kl_cov.cov_fraction) == (3.0, None, 0.01)
