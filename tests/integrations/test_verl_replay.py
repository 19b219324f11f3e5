"""verl with ``policy_loss.match_sampler=replay``: the batch's ``kept_ids`` (the sets the
rollout engine recorded, aligned with ``responses``) go through verl's own padding removal
(``left_right_2_no_padding``) and its FSDP engine's ``prepare_model_inputs`` (the real method,
on a stand-in engine object holding the attributes it reads), reach the fused head laid out as
its rows, and the head's response logprobs (sliced by verl's ``no_padding_2_padding``),
entropies and gradients equal the fp64 oracle renormalised over those sets.
"""

import re
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is installed by `make test`")
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from logitless.integrations import verl_head
from logitless.integrations.replay import kept_ids_from_masks
from logitless.integrations.verl import LogitlessPolicyLossConfig
from logitless.integrations.verl_head import (
    head_replays,
    kept_rows_for_head,
    linear_cross_entropy,
    sampler_head_calls,
    set_head_replay,
    set_head_sampler,
)
from logitless.reference.sampler import kept_set_logprobs

from testing import run_on_gloo

V, D, TEMPERATURE = 211, 24, 0.8
PROMPTS, RESPONSES, WIDTH_P, WIDTH_R = [3, 5, 2, 4], [4, 1, 6, 3], 5, 6


@pytest.fixture(autouse=True)
def no_replay_after():
    yield
    set_head_sampler(None)  # per process: leave neither replay nor a sampler behind


def batch(seed=0, empty_at=None, drop_key=False):
    """A left/right padded batch as verl's rollout leaves it, with random kept sets per
    response token (each holding the token), converted by verl to its no-padding layout."""
    g = torch.Generator().manual_seed(seed)
    b = len(PROMPTS)
    prompts = torch.zeros(b, WIDTH_P, dtype=torch.long)
    responses = torch.zeros(b, WIDTH_R, dtype=torch.long)
    attention = torch.zeros(b, WIDTH_P + WIDTH_R, dtype=torch.long)
    masks = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        prompts[i, WIDTH_P - p:] = torch.randint(1, V, (p,), generator=g)
        responses[i, :r] = torch.randint(1, V, (r,), generator=g)
        attention[i, WIDTH_P - p:WIDTH_P + r] = 1
        sets = []
        for j in range(r):
            ids = torch.randperm(V, generator=g)[:int(torch.randint(2, 9, (1,), generator=g))]
            ids = [int(x) for x in ids if int(x) != int(responses[i, j])]
            sets.append([*ids, int(responses[i, j])])
        masks.append(sets)
    if empty_at is not None:
        masks[empty_at[0]][empty_at[1]] = None
    response_mask = attention[:, WIDTH_P:].clone()
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    data = TensorDict({"prompts": prompts, "responses": responses,
                       "input_ids": torch.cat([prompts, responses], 1),
                       "attention_mask": attention, "response_mask": response_mask,
                       "position_ids": position}, batch_size=[b])
    if not drop_key:
        data["kept_ids"] = kept_ids_from_masks(masks, WIDTH_R, vocab_size=V)
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, temperature=TEMPERATURE, use_fused_kernels=True)
    return data


def engine(pad=0):
    """The attributes ``FSDPEngineWithLMHead.prepare_model_inputs`` reads from its engine."""
    return SimpleNamespace(pad_to_length=False, _get_packed_pad_size=lambda n: pad,
                           use_ulysses_sp=False, pass_packed_cu_seqlens=False)


def replay_config():
    root = OmegaConf.create({"policy_loss": {
        "_target_": "logitless.integrations.verl.LogitlessPolicyLossConfig",
        "loss_mode": "logitless_grpo", "match_sampler": "replay"}})
    return omega_conf_to_dataclass(root.policy_loss)


@pytest.mark.parametrize(("remove_padding", "pad"), [(True, 0), (True, 3), (False, 0)],
                         ids=["packed", "packed-static-pad", "padded"])
def test_replay_head_over_verls_layout(remove_padding, pad):
    assert isinstance(replay_config(), LogitlessPolicyLossConfig)  # turns replay on
    assert head_replays()
    data = batch()
    tu.assign_non_tensor(data, use_remove_padding=remove_padding)
    inputs, _ = FSDPEngineWithLMHead.prepare_model_inputs(engine(pad), data)
    g = torch.Generator().manual_seed(1)
    weight = (0.4 * torch.randn(V, D, generator=g, dtype=torch.float64)).requires_grad_()
    if remove_padding:  # as verl's fused forward: [1, nnz + pad] hidden, the engine's labels
        labels = inputs["shift_labels"]
        hidden = torch.randn(1, labels.shape[-1], D, generator=g, dtype=torch.float64)
    else:  # [b, S] hidden, each row's labels rolled by the forward
        labels = torch.roll(inputs["input_ids"], shifts=-1, dims=-1)
        hidden = torch.randn(*labels.shape, D, generator=g, dtype=torch.float64)
    hidden.requires_grad_()
    lp, ent = linear_cross_entropy(hidden, weight, labels, TEMPERATURE, "none", None)
    assert sampler_head_calls() == 1
    n = sum(PROMPTS) + sum(RESPONSES)
    if remove_padding:  # verl strips the static pad, then slices the responses
        lp_flat, ent_flat, h_rows = lp[:n], ent[:n], hidden[0, :n]
    else:
        keep = data["input_ids"].offsets().diff()
        live = torch.arange(labels.shape[1])[None] < keep[:, None]
        lp_flat, ent_flat, h_rows = lp.view(labels.shape)[live], ent.view(labels.shape)[live], \
            hidden[live]
    response_lp = no_padding_2_padding(lp_flat, data)
    response_ent = no_padding_2_padding(ent_flat, data)
    # the oracle: the hidden rows that predict each response token, over its recorded set
    ends = data["input_ids"].offsets()[1:].tolist()
    rows = torch.stack([torch.stack([h_rows[e - r - 1 + j] if j < r else h_rows[0]
                                     for j in range(WIDTH_R)])
                        for e, r in zip(ends, RESPONSES, strict=True)])
    rows = rows.detach().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    mask = data["response_mask"].bool()
    targets = data["responses"].masked_fill(~mask, -100)
    ref = kept_set_logprobs(rows, w, targets, data["kept_ids"], temperature=TEMPERATURE)
    assert bool(torch.isfinite(ref["logprobs"][mask]).all())
    torch.testing.assert_close(response_lp[mask], ref["logprobs"][mask])
    torch.testing.assert_close(response_ent[mask], ref["entropy"][mask])
    assert float(ref["log_kept_mass"][mask].detach().max()) < -0.5  # far from the full softmax
    # gradients: a weighted sum over the response tokens only
    wl = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    we = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    ((response_lp * wl).sum() + (response_ent * we).sum()).backward()
    ((torch.where(mask, ref["logprobs"], 0) * wl).sum()
     + (torch.where(mask, ref["entropy"], 0) * we).sum()).backward()
    torch.testing.assert_close(weight.grad, w.grad)
    got = hidden.grad[0, :n] if remove_padding else hidden.grad[live]
    want = torch.zeros_like(got)
    for i, (e, r) in enumerate(zip(ends, RESPONSES, strict=True)):
        want[e - r - 1:e - 1] = rows.grad[i, :r]
    torch.testing.assert_close(got, want)


def test_replay_turns_off_and_restores_verls_engine():
    original = FSDPEngineWithLMHead.prepare_model_inputs
    set_head_replay(True)
    assert FSDPEngineWithLMHead.prepare_model_inputs is not original
    set_head_replay(False)
    assert FSDPEngineWithLMHead.prepare_model_inputs is original and not head_replays()


def test_replay_refuses_a_micro_batch_without_sets():
    set_head_replay(True)
    data = batch(drop_key=True)
    tu.assign_non_tensor(data, use_remove_padding=True)
    with pytest.raises(ValueError, match=re.escape("kept_ids: policy_loss.match_sampler")):
        FSDPEngineWithLMHead.prepare_model_inputs(engine(), data)
    # a head call with nothing laid out (a forward that did not go through the FSDP engine)
    with pytest.raises(ValueError, match=re.escape("kept_ids: policy_loss.match_sampler")):
        linear_cross_entropy(torch.randn(3, D), torch.randn(V, D), torch.arange(3))


def test_replay_leaves_a_critics_forward_alone():
    """verl's value-head engine inherits ``prepare_model_inputs``: a critic in the replaying
    process lays out no sets and needs none."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    set_head_replay(True)
    critic = FSDPEngineWithValueHead.__new__(FSDPEngineWithValueHead)
    vars(critic).update(vars(engine()))
    data = batch(drop_key=True)
    tu.assign_non_tensor(data, use_remove_padding=True)
    FSDPEngineWithLMHead.prepare_model_inputs(critic, data)
    assert verl_head._pending_kept is None


def test_replay_refuses_an_empty_set_in_the_loss():
    set_head_replay(True)
    data = batch(empty_at=(2, 4))
    tu.assign_non_tensor(data, use_remove_padding=True)
    with pytest.raises(ValueError, match=re.escape("kept_ids: sample 2, response token 4")):
        FSDPEngineWithLMHead.prepare_model_inputs(engine(), data)


def _ulysses_worker(rank, world):
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    set_head_replay(True)
    data = batch(seed=4)
    tu.assign_non_tensor(data, use_remove_padding=True)
    sp = SimpleNamespace(pad_to_length=False, _get_packed_pad_size=lambda n: 0,
                         use_ulysses_sp=True, ulysses_sequence_parallel_size=world,
                         module=SimpleNamespace(config=SimpleNamespace()),
                         pass_packed_cu_seqlens=False)
    inputs, out = FSDPEngineWithLMHead.prepare_model_inputs(sp, data)
    mine = verl_head._pending_kept
    assert out["pad_size"] == 2  # 28 packed tokens, padded to a multiple of 3
    labels = inputs["shift_labels"].reshape(-1)
    # one rank's layout of the whole padded sequence, this rank's slice of it
    whole = torch.cat([torch.roll(data["input_ids"].values(), -1),
                       labels.new_zeros(out["pad_size"])])
    rows = kept_rows_for_head(data, whole, True, out["pad_size"])
    part = whole.numel() // world
    assert mine.shape[0] == labels.numel() == part
    torch.testing.assert_close(mine, rows[rank * part:(rank + 1) * part], rtol=0, atol=0)
    # the head on this rank's rows: the single-layout numbers at those rows
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(whole.numel(), D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    lp, ent = linear_cross_entropy(hidden[rank * part:(rank + 1) * part], weight, labels,
                                   TEMPERATURE)
    ref = kept_set_logprobs(hidden, weight, whole, rows, temperature=TEMPERATURE)
    torch.testing.assert_close(lp, ref["logprobs"][rank * part:(rank + 1) * part])
    torch.testing.assert_close(ent, ref["entropy"][rank * part:(rank + 1) * part])


@pytest.mark.dist  # gloo ranks, as every multi-process test: make test-dist
def test_replay_under_ulysses_sequence_parallel_on_gloo():
    """Three Ulysses ranks: each rank's head rows are its slice of the one-rank layout of the
    padded sequence (28 tokens padded to 30), and its head numbers those rows' numbers."""
    run_on_gloo(3, _ulysses_worker)


def test_loss_with_replay_checks_the_head_ran():
    import verl.trainer.ppo.core_algos as core_algos

    root = OmegaConf.create({"actor": {
        "_target_": "verl.workers.config.ActorConfig", "strategy": "fsdp", "rollout_n": 1,
        "ppo_micro_batch_size_per_gpu": 1, "use_kl_loss": False,
        "policy_loss": {"_target_": "logitless.integrations.verl.LogitlessPolicyLossConfig",
                        "loss_mode": "logitless_grpo", "match_sampler": "replay"}}})
    actor = omega_conf_to_dataclass(root.actor)
    lp = torch.full((2, 3), -1.0, dtype=torch.float64)

    def loss():
        return core_algos.get_policy_loss_fn("logitless_grpo")(
            old_log_prob=lp - 0.1, log_prob=lp, advantages=torch.ones(2, 3, dtype=torch.float64),
            response_mask=torch.ones(2, 3, dtype=torch.bool), loss_agg_mode="token-mean",
            config=actor)

    with pytest.raises(ValueError, match=re.escape("policy_loss.match_sampler")):
        loss()  # no head call renormalised over recorded sets yet
    data = batch()
    tu.assign_non_tensor(data, use_remove_padding=True)
    inputs, _ = FSDPEngineWithLMHead.prepare_model_inputs(engine(), data)
    labels = inputs["shift_labels"]
    linear_cross_entropy(torch.randn(1, labels.shape[-1], D), torch.randn(V, D), labels)
    value, metrics = loss()
    assert torch.isfinite(value) and metrics["actor/logitless/sampler/outside_kept"] == 0
