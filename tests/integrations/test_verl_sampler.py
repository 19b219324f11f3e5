"""verl with ``policy_loss.match_sampler``: the rollout config reaches the fused head through
verl's own config instantiation (and through pickling, as Ray ships configs), the drop-in then
returns the logprobs and entropies of vLLM's truncated distribution (fp64 sampler oracle,
``logitless.reference.sampler``), and what cannot be honoured is refused naming it.
"""

import pickle
import re
import textwrap

import pytest

pytest.importorskip("verl", reason="verl is installed by `make test`")
import torch
import torch.distributed as dist
import verl.trainer.ppo.core_algos as core_algos
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass

from logitless.integrations.sampler_config import SamplerTruncation
from logitless.integrations.verl import LogitlessPolicyLossConfig, sampler_from_rollout
from logitless.integrations.verl_head import (
    head_sampler,
    linear_cross_entropy,
    sampler_head_calls,
    set_head_sampler,
)
from logitless.reference.sampler import sampler_logprobs

from testing import SequenceParallelGather, run_on_gloo

# verl's trainer config, trimmed to what the actor and the rollout read here.
CONFIG = textwrap.dedent("""
    actor_rollout_ref:
      rollout:
        name: vllm
        temperature: 0.8
        top_k: 40
        top_p: 0.9
        repetition_penalty: 1.0
        logprobs_mode: processed_logprobs
      actor:
        _target_: verl.workers.config.ActorConfig
        strategy: fsdp
        rollout_n: 1
        ppo_micro_batch_size_per_gpu: 1
        use_kl_loss: false
        policy_loss:
          _target_: logitless.integrations.verl.LogitlessPolicyLossConfig
          loss_mode: logitless_grpo
          match_sampler: ${actor_rollout_ref.rollout}
""")


@pytest.fixture(autouse=True)
def untruncated_head_after():
    yield
    set_head_sampler(None)  # the setting is per process: leave none behind


def _actor(**overrides):
    root = OmegaConf.create(CONFIG)
    for key, value in overrides.items():
        OmegaConf.update(root, key, value)
    return omega_conf_to_dataclass(root.actor_rollout_ref.actor)


def test_rollout_config_reaches_the_head_through_verls_instantiation():
    actor = _actor()
    assert isinstance(actor.policy_loss, LogitlessPolicyLossConfig)
    assert head_sampler() == SamplerTruncation(top_k=40, top_p=0.9)
    set_head_sampler(None)
    shipped = pickle.loads(pickle.dumps(actor.policy_loss))  # what a Ray worker receives
    assert shipped == actor.policy_loss
    assert head_sampler() == SamplerTruncation(top_k=40, top_p=0.9)
    # a config without match_sampler (another role's, in the same process) leaves it set
    _actor(**{"actor_rollout_ref.actor.policy_loss.match_sampler": None})
    assert head_sampler() == SamplerTruncation(top_k=40, top_p=0.9)


@pytest.mark.parametrize(("engine", "min_p"), [
    ("vllm", 0.01), ("sglang", 0.01), ("sglang", None), ("transformers", 0.01)])
def test_head_computes_the_samplers_truncated_distribution(engine, min_p):
    g = torch.Generator().manual_seed(3)
    t, d, v = 37, 96, 1007
    hidden = torch.randn(1, t, d, generator=g, dtype=torch.float64)
    weight = 0.3 * torch.randn(v, d, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (1, t), generator=g)
    top = (hidden[0] @ weight.T).argmax(-1)
    labels[0, ::2] = top[::2]  # half the targets inside the kept set, the others mostly not
    truncation = dict(top_k=40, top_p=0.9, min_p=min_p)
    set_head_sampler(SamplerTruncation(**truncation, sampler=engine))
    h = hidden.clone().requires_grad_(True)
    lp, ent = linear_cross_entropy(h, weight, labels, 0.8, "none", None)
    expected = sampler_logprobs(hidden[0], weight, labels[0], temperature=0.8, **truncation,
                                sampler=engine)
    if engine != "vllm":  # the case tells the engines apart
        vllm = sampler_logprobs(hidden[0], weight, labels[0], temperature=0.8, **truncation)
        assert not torch.allclose(vllm["entropy"], expected["entropy"])
    assert sampler_head_calls() == 1
    inside = torch.isfinite(expected["logprobs"])
    assert 0 < int(inside.sum()) < t
    assert torch.equal(torch.isfinite(lp), inside)
    torch.testing.assert_close(lp[inside], expected["logprobs"][inside])
    torch.testing.assert_close(ent, expected["entropy"])
    # gradients through the kept logits, the kept set held fixed
    hr = hidden[0].clone().requires_grad_(True)
    ref = sampler_logprobs(hr, weight, labels[0], temperature=0.8, **truncation, sampler=engine)
    (ref["logprobs"][inside].sum() + ref["entropy"].sum()).backward()
    (lp[inside].sum() + ent.sum()).backward()
    torch.testing.assert_close(h.grad[0], hr.grad)


def _loss(actor, outside=()):
    lp = torch.full((2, 3), -1.0, dtype=torch.float64)
    old = lp - 0.1
    for i, j in outside:  # outside the recomputed kept set, now and at rollout time
        lp[i, j] = old[i, j] = -torch.inf
    mask = torch.ones(2, 3, dtype=torch.bool)
    return core_algos.get_policy_loss_fn("logitless_grpo")(
        old_log_prob=old, log_prob=lp, advantages=torch.ones(2, 3, dtype=torch.float64),
        response_mask=mask, loss_agg_mode="token-mean", config=actor)


def test_loss_checks_the_logprobs_came_through_the_sampler_head():
    actor = _actor()
    with pytest.raises(ValueError, match=re.escape("policy_loss.match_sampler")):
        _loss(actor)  # no head call since the config was built: verl's own head ran
    w = torch.randn(11, 8, dtype=torch.float64)
    linear_cross_entropy(torch.randn(5, 8, dtype=torch.float64), w, torch.arange(5), 0.8)
    loss, metrics = _loss(actor)
    assert torch.isfinite(loss) and metrics["actor/logitless/sampler/outside_kept"] == 0
    loss, metrics = _loss(actor, outside=[(0, 1), (1, 2)])
    assert torch.isfinite(loss)  # not NaN from -inf - -inf: those tokens left the loss
    assert metrics["actor/logitless/sampler/outside_kept"] == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match=re.escape("actor.use_kl_loss")):
        _loss(_actor(**{"actor_rollout_ref.actor.use_kl_loss": True}))


def test_sampler_from_rollout_reads_verl_conventions():
    assert sampler_from_rollout({"top_k": -1, "top_p": 1.0}) == SamplerTruncation()
    assert sampler_from_rollout({"top_k": 0}) == SamplerTruncation()
    assert sampler_from_rollout({}) == SamplerTruncation()  # verl's defaults: no truncation
    # SGLang without truncation samples the tempered softmax like vLLM
    assert not sampler_from_rollout({"name": "sglang", "temperature": 0.6}).truncates
    assert sampler_from_rollout({"name": "vllm", "top_k": 5, "min_p": 0.1}) == SamplerTruncation(
        top_k=5, min_p=0.1)
    # SGLang's rules, whatever logprobs_mode says (verl hands that to vLLM only)
    got = sampler_from_rollout({"name": "sglang", "top_k": 5, "top_p": 0.9,
                                "logprobs_mode": "raw_logprobs"})
    assert got == SamplerTruncation(top_k=5, top_p=0.9, sampler="sglang")
    assert got.kwargs() == dict(top_k=5, top_p=0.9, sampler="sglang")


@pytest.mark.parametrize(("rollout", "named"), [
    ({"name": "vllm", "repetition_penalty": 1.05}, "rollout.repetition_penalty"),
    ({"name": "trtllm", "top_p": 0.9}, "rollout.name"),
    ({"name": "vllm", "logprobs_mode": "raw_logprobs"}, "rollout.logprobs_mode"),
    ({"name": "vllm", "do_sample": False}, "rollout.do_sample"),
    ({"name": "vllm", "top_k": -2}, "rollout.top_k"),
    ({"name": "vllm", "top_p": 0.0}, "rollout.top_p"),
    ({"name": "vllm", "min_p": 1.5}, "rollout.min_p"),
    ({"name": "vllm", "temperature": 0.0}, "rollout.temperature"),
])
def test_sampler_from_rollout_refuses_what_the_head_cannot_reproduce(rollout, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        sampler_from_rollout(rollout)


def test_match_sampler_must_be_the_rollout_config():
    with pytest.raises(ValueError, match=re.escape("policy_loss.match_sampler")):
        LogitlessPolicyLossConfig(loss_mode="logitless_grpo", match_sampler=0.9)


# ---------------------------------------------------------------- a tensor-parallel head
#
# Megatron's head in verl (verl.models.mcore.model_forward_fused): the sequence-parallel gather,
# then linear_cross_entropy(hidden, weight_r, labels, temp, "none", tp_group) on this rank's
# vocabulary slice. With match_sampler the drop-in truncates on the sharded vocabulary too.

TP_SPLIT = [300, 1, 706]  # uneven contiguous vocabulary slices, one of a single id
TP_SEQ = 24  # divisible by the 3 ranks


def _tp_worker(rank, world):
    actor = _actor()  # each worker builds the actor config: the head's truncations are set
    torch.manual_seed(0)  # every rank builds the same full problem
    v, d = sum(TP_SPLIT), 64
    hidden = torch.randn(TP_SEQ, 1, d, dtype=torch.float64)
    weight = torch.randn(v, d, dtype=torch.float64) / d**0.5 * 3
    labels = torch.randint(0, v, (1, TP_SEQ))
    labels[0, ::2] = (hidden[::2, 0] @ weight.T).argmax(-1)  # half inside the kept set
    g_ent = torch.randn(TP_SEQ, dtype=torch.float64)
    lo, hi = sum(TP_SPLIT[:rank]), sum(TP_SPLIT[:rank + 1])
    rows = slice(rank * TP_SEQ // world, (rank + 1) * TP_SEQ // world)

    shard = hidden[rows].clone().requires_grad_(True)
    w_r = weight[lo:hi].clone().requires_grad_(True)
    lp, ent = linear_cross_entropy(SequenceParallelGather.apply(shard), w_r, labels, 0.8,
                                   "none", dist.group.WORLD)
    hr = hidden[:, 0].clone().requires_grad_(True)
    wr = weight.clone().requires_grad_(True)
    ref = sampler_logprobs(hr, wr, labels[0], temperature=0.8, top_k=40, top_p=0.9)
    inside = torch.isfinite(ref["logprobs"])
    assert 0 < int(inside.sum()) < TP_SEQ
    assert torch.equal(torch.isfinite(lp), inside)
    torch.testing.assert_close(lp[inside], ref["logprobs"][inside], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ent, ref["entropy"], rtol=1e-10, atol=1e-12)
    (lp[inside].sum() + (ent * g_ent).sum()).backward()
    (ref["logprobs"][inside].sum() + (ref["entropy"] * g_ent).sum()).backward()
    torch.testing.assert_close(shard.grad[:, 0], hr.grad[rows], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w_r.grad, wr.grad[lo:hi], rtol=1e-9, atol=1e-12)
    # the loss's check passes: its logprobs came through the sampler-matched head
    assert sampler_head_calls() == 1
    assert torch.isfinite(_loss(actor)[0])


@pytest.mark.dist  # gloo ranks, as every multi-process test: make test-dist
def test_tensor_parallel_head_with_match_sampler_on_gloo():
    run_on_gloo(3, _tp_worker)
