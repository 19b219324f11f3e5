"""verl's optimal-token-baseline estimators (``optimal_token_baseline``,
``tir_optimal_token_baseline``, verl #4678) fed with ``sum_pi_squared`` from logitless's fused
head, through verl's own FSDP engine (``forward_backward_batch`` with
``use_fused_kernels=True``, verl's fused forward calling our ``linear_cross_entropy``, verl's
``prepare_model_outputs`` laying the values out), on the stand-in engine and tiny model of
test_verl_ulysses_adapter (one process, fp64).

Against verl's own ``calculate_sum_pi_squared_from_logits`` on materialised logits, and verl's
estimators run on both: the advantages agree to rounding."""

import numpy as np
import pytest

pytest.importorskip("verl", reason="verl is installed by `make test`")
import torch
import torch.distributed as dist
import verl.trainer.ppo.core_algos as core_algos
import verl.utils.torch_functional as verl_F
import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
from transformers.modeling_outputs import BaseModelOutputWithPast
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from integrations.test_verl_ulysses_adapter import (
    SEQS,
    TEMPERATURE,
    _batch,
    _Body,
    _CausalLM,
    _engine,
    _params,
)
from logitless.integrations.verl import disable_fused_head, enable_fused_head

RTOL, ATOL = 1e-12, 1e-14


class _InferBody(_Body):
    """The stand-in decoder for a no-grad (inference) step: no ``retain_grad``."""

    def forward(self, input_ids, position_ids, **_):
        hidden = self.embed[input_ids] + torch.tanh(self.pos[position_ids])
        return BaseModelOutputWithPast(last_hidden_state=hidden)


def _model():
    model, params = _CausalLM(_params()), _params()
    model.model = _InferBody(params["embed"], params["pos"])
    return model


@pytest.fixture
def cpu_engine(monkeypatch, tmp_path):
    """verl's FSDP engine on CPU (it moves batches to get_device_id()), one process in a
    one-rank gloo group (its step all-reduces the batch's token counts)."""
    monkeypatch.setattr(fsdp_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(fsdp_impl, "get_device_name", lambda: "cpu")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    try:
        yield _engine(_model(), None, 1)
    finally:
        if owned:
            dist.destroy_process_group()


def _materialised_sum_pi_squared(data):
    """Every packed position's sum of squared probabilities from materialised logits, by
    verl's own function."""
    params = _params()
    ids, pos = data["input_ids"].values(), data["position_ids"].values()
    hidden = params["embed"][ids] + torch.tanh(params["pos"][pos])
    return verl_F.calculate_sum_pi_squared_from_logits(hidden @ params["head"].T / TEMPERATURE)


def _infer(engine, data):
    out = engine.forward_backward_batch(data, None, forward_only=True)
    return out["model_output"]


def test_sum_pi_squared_with_fused_kernels_feeds_verls_estimators(cpu_engine):
    data = _batch()
    tu.assign_non_tensor(data, calculate_sum_pi_squared=True)
    enable_fused_head(sum_pi_squared=True)
    try:
        ours = _infer(cpu_engine, data)
    finally:
        disable_fused_head()
    got = ours["sum_pi_squared"].values()
    want = _materialised_sum_pi_squared(data)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert "log_probs" in ours and "entropy" in ours  # the rest of the output as without it

    # verl's estimators on the response positions, from ours and from materialised logits
    b = len(SEQS)
    response_mask = data["response_mask"].to(torch.float64)
    g = torch.Generator().manual_seed(11)
    rewards = torch.zeros_like(response_mask)
    lengths = response_mask.sum(-1).long()
    rewards[torch.arange(b), lengths - 1] = torch.randn(b, generator=g, dtype=torch.float64)
    index = np.array([0, 0, 1, 1])
    common = dict(token_level_rewards=rewards, response_mask=response_mask, index=index,
                  old_log_probs=data["old_log_probs"])
    s2_ours = no_padding_2_padding(got, data)
    s2_want = no_padding_2_padding(want, data)
    assert s2_ours.shape == response_mask.shape
    for estimator in (core_algos.compute_optimal_token_baseline_advantage,
                      core_algos.compute_multi_turn_optimal_token_baseline_advantage):
        adv, _ = estimator(**common, sum_pi_squared=s2_ours)
        adv_want, _ = estimator(**common, sum_pi_squared=s2_want)
        torch.testing.assert_close(adv, adv_want, rtol=RTOL, atol=ATOL)
        assert float(adv.abs().sum()) > 0


def test_without_the_option_verl_refuses_and_the_option_is_undone(cpu_engine):
    """verl's own refusal with fused kernels stays in place unless the option is on, and
    `disable_fused_head` takes the wrapper off."""
    data = _batch()
    tu.assign_non_tensor(data, calculate_sum_pi_squared=True)
    original = fsdp_impl.FSDPEngineWithLMHead.prepare_model_outputs
    enable_fused_head()
    try:
        with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared"):
            _infer(cpu_engine, data)
    finally:
        disable_fused_head()
    enable_fused_head(sum_pi_squared=True)
    assert fsdp_impl.FSDPEngineWithLMHead.prepare_model_outputs is not original
    disable_fused_head()
    assert fsdp_impl.FSDPEngineWithLMHead.prepare_model_outputs is original
