"""``logitless_forward_kl_topk`` in verl 0.9.1's distillation-loss registry: registered on
``import verl``, and equal to verl's own ``forward_kl_topk`` (its FSDP logits processor on the
materialised logits, then its registered loss) on the same hidden states, head and teacher."""

import pytest
import torch

pytest.importorskip("verl", reason="verl is installed by `make test`")

from tensordict import TensorDict
from verl.trainer.distillation import losses as verl_losses
from verl.trainer.distillation.fsdp import losses as fsdp_losses
from verl.utils import tensordict_utils as tu
from verl.workers.config import DistillationConfig, DistillationLossConfig
from verl.workers.utils.padding import no_padding_2_padding

from logitless import reference
from logitless.integrations import verl_distill

from testing import assert_close_to_oracle

PROMPTS, RESPONSES = [3, 2, 4], [5, 1, 4]
D, V, K = 40, 1007, 6


def packed(t):
    lengths = torch.tensor([p + r for p, r in zip(PROMPTS, RESPONSES)])
    return torch.nested.nested_tensor_from_jagged(
        t, offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))


def case(seed, temperature):
    """Packed rows, a head whose log-probs cross verl's -10 clamp, and a teacher whose top-k
    ids are half the student's top ids (with log-probs below the student's) and half random
    ids: on odd rows with the student's log-probs (the top-k sum dips under 0, which verl
    floors), on even rows with log-probs near -2 (a positive loss)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(PROMPTS) + sum(RESPONSES)
    hidden = torch.randn(n, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) * 8 / D**0.5
    bias = torch.randn(V, generator=gen)
    student = ((hidden @ weight.t() + bias) / temperature).log_softmax(-1)
    ids = torch.cat([student.topk(K // 2, -1).indices,
                     torch.randint(0, V, (n, K - K // 2), generator=gen)], -1)
    teacher_lp = student.gather(-1, ids) - 0.5 * torch.rand(n, K, generator=gen)
    even = torch.arange(n) % 2 == 0  # rows where the teacher puts mass on the random ids
    teacher_lp[even, K // 2:] = -2.0 - torch.rand(int(even.sum()), K - K // 2, generator=gen)
    jag = lambda sizes: torch.nested.nested_tensor([torch.ones(s, dtype=torch.long)
                                                    for s in sizes], layout=torch.jagged)
    data = TensorDict({"prompts": jag(PROMPTS), "responses": jag(RESPONSES),
                       "response_mask": jag(RESPONSES), "teacher_ids": packed(ids),
                       "teacher_logprobs": packed(teacher_lp)}, batch_size=[len(PROMPTS)])
    tu.assign_non_tensor(data, temperature=temperature)
    return hidden, weight, bias, data


def config(log_prob_min_clamp):
    return DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode=verl_distill.TOPK_LOSS_NAME, topk=K, log_prob_min_clamp=log_prob_min_clamp))


def verls(hidden, weight, bias, data, cfg):
    """verl's path: logits / T, its FSDP logits processor, its registered forward_kl_topk."""
    temperature = tu.get_non_tensor_data(data=data, key="temperature", default=1.0)
    logits = (hidden @ weight.t() + bias) / temperature
    outputs = fsdp_losses.compute_forward_kl_topk(
        student_logits=logits.unsqueeze(0), teacher_topk_log_probs=data["teacher_logprobs"],
        teacher_topk_ids=data["teacher_ids"], config=cfg, data_format="thd")
    model_output = {k: v.squeeze(0) for k, v in outputs.items()}
    fn = verl_losses.get_distillation_loss_fn("forward_kl_topk")
    return fn(config=None, distillation_config=cfg, model_output=model_output, data=data), \
        model_output


def test_registered_on_import_as_a_topk_loss():
    import verl  # noqa: F401  (the entry point ran when logitless.integrations.verl loaded)

    name = verl_distill.TOPK_LOSS_NAME
    assert name.startswith("logitless_")
    assert verl_losses.get_distillation_loss_fn(name) is verl_distill.compute_forward_kl_topk
    settings = verl_losses.get_distillation_loss_settings(name)
    assert settings.use_topk and not settings.use_estimator
    # verl's config accepts the name and asks the teacher for its top-k
    assert config(-10.0).distillation_loss.loss_settings.use_topk
    assert verl_distill.register_verl_distillation_loss() == name  # idempotent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("log_prob_min_clamp", [-10.0, None])
def test_equals_verls_forward_kl_topk(temperature, log_prob_min_clamp):
    hidden, weight, bias, data = case(int(temperature * 10), temperature)
    cfg = config(log_prob_min_clamp)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    their_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    fn = verl_losses.get_distillation_loss_fn(verl_distill.TOPK_LOSS_NAME)
    ours, metrics = fn(config=None, distillation_config=cfg, data=data, model_output={
        "hidden_states": leaves[0], "lm_head_weight": leaves[1], "lm_head_bias": leaves[2]})
    (theirs, their_metrics), processed = verls(*their_leaves, data, cfg)
    assert ours.shape == theirs.shape == (len(PROMPTS), max(RESPONSES))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert float(theirs.detach().max()) > 0
    assert bool((processed["distillation_losses"] < 0).any())
    assert metrics["distillation/teacher_mass"] == pytest.approx(
        their_metrics["distillation/teacher_mass"], rel=1e-6)
    # Gradients: three-way against the fp64 oracle (verl sums its KL in fp32 too). Without the
    # clamp the student's log-probs reach -40, where fp32's spacing is 4e-6: both fp32 paths
    # are off by up to ~1e-5 of the largest gradient, not always at the same elements.
    exact_leaves = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    exact = reference.linear_topk_distill(
        exact_leaves[0], exact_leaves[1], data["teacher_ids"].values(),
        data["teacher_logprobs"].values(), temperature=temperature, bias=exact_leaves[2],
        log_prob_min_clamp=log_prob_min_clamp, loss_max_clamp=None)
    exact = no_padding_2_padding(exact, data)
    upstream = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((ours * upstream).sum(), leaves)
    their_grads = torch.autograd.grad((theirs * upstream).sum(), their_leaves)
    exact_grads = torch.autograd.grad((exact * upstream.double()).sum(), exact_leaves)
    for name, a, b, e in zip(("hidden", "weight", "bias"), grads, their_grads, exact_grads):
        assert_close_to_oracle(a, e, b, tol=3e-5 * float(e.abs().max()), name=name)
    # Without hidden states (verl's engine ran its logits processor): verl's loss itself.
    fallback, _ = fn(config=None, distillation_config=cfg, model_output=processed, data=data)
    assert torch.equal(fallback, theirs)


def test_bad_model_output():
    hidden, weight, _, data = case(0, 1.0)
    fn = verl_losses.get_distillation_loss_fn(verl_distill.TOPK_LOSS_NAME)
    with pytest.raises(ValueError, match="lm_head_weight"):
        fn(config=None, distillation_config=config(-10.0), data=data,
           model_output={"hidden_states": hidden})
    with pytest.raises(ValueError, match="hidden_states"):
        fn(config=None, distillation_config=config(-10.0), data=data,
           model_output={"hidden_states": hidden[:-1], "lm_head_weight": weight})
