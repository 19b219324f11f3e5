"""``policy_loss.fused`` and the rollout logprobs through verl's own training step.

verl's FSDP engine (``FSDPEngineWithLMHead.forward_backward_batch``: the normalisers,
``prepare_model_inputs``, verl's fused forward calling our ``linear_cross_entropy``,
``prepare_model_outputs``, verl's ``ppo_loss`` bound as its actor worker binds it,
``partial(ppo_loss, config=...)``, and the backward) on the stand-in engine and tiny model of
test_verl_ulysses_adapter, one process, fp64.

The fused step must equal the composed one (the head's logprobs, then the policy loss) and
verl's built-in losses on the composed path: the loss, verl's metrics and every parameter's
gradient. Its head work, counted with ``FlopCounterMode`` (a ``TorchDispatchMode``) over the
whole step, forward and backward, is three GEMM passes over the response rows.
"""

import functools
import warnings

import pytest

pytest.importorskip("verl", reason="verl is installed by `make test`")
import torch
import torch.distributed as dist
import verl.workers.config as verl_config
import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
from torch.utils.flop_counter import FlopCounterMode
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

import logitless
from integrations.test_verl_ulysses_adapter import (
    SEQS,
    TEMPERATURE,
    VERL_GSPO,
    WIDTH_R,
    D,
    V,
    _batch,
    _CausalLM,
    _engine,
    _params,
)
from logitless.integrations import verl as verl_adapter
from logitless.integrations.replay import kept_ids_from_masks
from logitless.integrations.verl import (
    LogitlessPolicyLossConfig,
    disable_fused_head,
    enable_fused_head,
)
from logitless.integrations.verl_head import set_head_replay, set_head_sampler

RTOL, ATOL = 1e-11, 1e-13
RESPONSE_ROWS = sum(r for _, r in SEQS)


@pytest.fixture
def cpu_engine(monkeypatch, tmp_path):
    """verl's FSDP engine on CPU, one process in a one-rank gloo group (its step all-reduces
    the batch's token count), the logitless head in verl's fused forward."""
    monkeypatch.setattr(fsdp_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(fsdp_impl, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(verl_adapter, "_warned", set())  # each test sees its first warning
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    enable_fused_head()
    try:
        yield
    finally:
        disable_fused_head()
        if owned:
            dist.destroy_process_group()


def _data(entropy=False, weights=False, rollout=False, fused_kernels=True, ref=False):
    data = _batch()
    tu.assign_non_tensor(data, calculate_entropy=entropy, use_fused_kernels=fused_kernels)
    g = torch.Generator().manual_seed(17)
    old = data["old_log_probs"]
    if ref:  # the reference's logprobs: some near, some far from the current ones (k3's clamp)
        far = torch.rand(old.shape, generator=g, dtype=torch.float64) < 0.15
        data["ref_log_prob"] = old + torch.where(
            far, torch.full_like(old, -12.0),
            0.4 * torch.randn(old.shape, generator=g, dtype=torch.float64))
    if weights:  # verl's rollout IS weights, some truncated to 0 as IcePop does
        w = torch.rand(old.shape, generator=g, dtype=torch.float64) * 1.5 + 0.25
        data["rollout_is_weights"] = torch.where(w > 1.6, torch.zeros_like(w), w)
    if rollout:  # the engine's logprobs: the old ones, off by a few percent
        data["rollout_log_probs"] = old + 0.05 * torch.randn(old.shape, generator=g,
                                                             dtype=torch.float64)
    return data


def _step(policy_loss, agg="seq-mean-token-mean", entropy_coeff=0.0, data=None, **actor_kw):
    """One verl training step; the loss, verl's metrics, the gradients, the matmul FLOPs."""
    actor = verl_config.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
        clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=entropy_coeff, loss_agg_mode=agg,
        policy_loss=policy_loss, **actor_kw)
    model = _CausalLM(_params())
    engine = _engine(model, None, 1)
    with FlopCounterMode(display=False) as flops:
        out = engine.forward_backward_batch(_data() if data is None else data,
                                            functools.partial(ppo_loss, config=actor))
    (loss,) = out["loss"]
    # verl's Metric objects, and the plain numbers it logs per micro-batch (kl_coef)
    metrics = {k: float(v.aggregate()) if hasattr(v, "aggregate") else float(sum(v) / len(v))
               for k, v in out["metrics"].items()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    return dict(loss=loss, metrics=metrics, grads=grads, flops=flops.get_total_flops())


def _same(got, want, what):
    torch.testing.assert_close(got["loss"], want["loss"], rtol=RTOL, atol=ATOL, msg=what)
    assert got["metrics"].keys() == want["metrics"].keys(), what
    for name, value in got["metrics"].items():
        torch.testing.assert_close(value, want["metrics"][name], rtol=RTOL, atol=ATOL,
                                   msg=f"{what}: {name}")
    for name, grad in got["grads"].items():
        assert grad is not None and bool(grad.abs().sum() > 0), f"{what}: {name}"
        torch.testing.assert_close(grad, want["grads"][name], rtol=RTOL, atol=ATOL,
                                   msg=f"{what}: {name}")


# (loss mode, LogitlessPolicyLossConfig options, loss_agg_mode, verl's built-in loss or None)
CASES = {
    "grpo": ("logitless_grpo", {}, "seq-mean-token-mean", "vanilla"),
    "gspo-verl": ("logitless_gspo", VERL_GSPO, "seq-mean-token-mean", "gspo"),
    "gspo": ("logitless_gspo", {}, "token-mean", None),
    "cispo": ("logitless_cispo", {}, "token-mean", "cispo"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_step_equals_composed_and_verls_loss(cpu_engine, case):
    mode, options, agg, verls = CASES[case]
    for weights in (False, True):
        fused = _step(LogitlessPolicyLossConfig(loss_mode=mode, fused=True, **options), agg,
                      data=_data(weights=weights))
        composed = _step(LogitlessPolicyLossConfig(loss_mode=mode, **options), agg,
                         data=_data(weights=weights))
        _same(fused, composed, f"{case}, IS weights {weights}")
        if verls is not None:
            theirs = _step(verl_config.PolicyLossConfig(loss_mode=verls), agg,
                           data=_data(weights=weights))
            torch.testing.assert_close(fused["loss"], theirs["loss"], rtol=RTOL, atol=ATOL)
            for name, grad in fused["grads"].items():
                torch.testing.assert_close(grad, theirs["grads"][name], rtol=RTOL, atol=ATOL,
                                           msg=f"{case} against verl's {verls}: {name}")
        # the head work: three GEMM passes over the response rows, forward and backward
        # (the tiny model's body has no matmul; the composed head runs four passes over every
        # packed row, prompts included, in kernels this counter does not see on CPU)
        assert fused["flops"] == 3 * 2 * RESPONSE_ROWS * D * V, case
    assert fused["metrics"]["actor/pg_clipfrac"] > 0, case  # clipping is active


# verl's entropy and KL terms folded into the fused call:
# (loss mode, options, loss_agg_mode, calculate_entropy, entropy_coeff, kl_loss_type or None)
TERMS = {
    "entropy bonus": ("logitless_grpo", {}, "seq-mean-token-mean", True, 0.03, None),
    "entropy logged": ("logitless_grpo", {}, "token-mean", True, 0.0, None),
    "low_var_kl": ("logitless_grpo", {}, "seq-mean-token-mean", False, 0.0, "low_var_kl"),
    "k1, token-mean": ("logitless_grpo", {}, "token-mean", False, 0.0, "k1"),
    "mse, sum-norm": ("logitless_grpo", {}, "seq-mean-token-sum-norm", False, 0.0, "mse"),
    "abs": ("logitless_grpo", {}, "seq-mean-token-mean", False, 0.0, "abs"),
    "k3+": ("logitless_grpo", {}, "token-mean", False, 0.0, "k3+"),
    "k2+": ("logitless_grpo", {}, "seq-mean-token-mean", False, 0.0, "k2+"),
    "kl+ with entropy": ("logitless_grpo", {}, "seq-mean-token-mean", True, 0.02, "kl+"),
    "gspo, both": ("logitless_gspo", VERL_GSPO, "seq-mean-token-mean", True, 0.03, "k3"),
}
VERLS = {"logitless_grpo": "vanilla", "logitless_gspo": "gspo"}


def test_fused_step_folds_verls_entropy_and_kl_terms(cpu_engine):
    """verl's ``ppo_loss`` adds ``- entropy_coeff * agg_loss(entropy)`` (with
    ``calculate_entropy``) and ``+ kl_loss_coef * agg_loss(kl_penalty(...))`` (with
    ``use_kl_loss``, the batch's ``ref_log_prob``): the fused step computes them in its one
    ``fused_policy_loss`` call, with no fallback, and equals the composed step (loss, every
    metric verl logs, ``actor/entropy_loss``, ``kl_loss`` and ``kl_coef`` among them, every
    gradient) and verl's built-in loss, in three GEMM passes."""
    for case, (mode, options, agg, entropy, coeff, kl) in TERMS.items():
        actor = dict(entropy_coeff=coeff)
        if kl is not None:
            actor.update(use_kl_loss=True, kl_loss_type=kl, kl_loss_coef=0.07)
        data = functools.partial(_data, entropy=entropy, weights=True, ref=kl is not None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            fused = _step(LogitlessPolicyLossConfig(loss_mode=mode, fused=True, **options), agg,
                          data=data(), **actor)
        composed = _step(LogitlessPolicyLossConfig(loss_mode=mode, **options), agg,
                         data=data(), **actor)
        _same(fused, composed, case)
        theirs = _step(verl_config.PolicyLossConfig(loss_mode=VERLS[mode]), agg, data=data(),
                       **actor)
        torch.testing.assert_close(fused["loss"], theirs["loss"], rtol=RTOL, atol=ATOL)
        for name in ("actor/pg_loss", "actor/entropy_loss", "kl_loss", "kl_coef"):
            if name in theirs["metrics"]:
                torch.testing.assert_close(fused["metrics"][name], theirs["metrics"][name],
                                           rtol=RTOL, atol=ATOL, msg=f"{case}: {name}")
        for name, grad in fused["grads"].items():
            torch.testing.assert_close(grad, theirs["grads"][name], rtol=RTOL, atol=ATOL,
                                       msg=f"{case} against verl's {VERLS[mode]}: {name}")
        assert ("actor/entropy_loss" in fused["metrics"]) == entropy, case
        assert not entropy or fused["metrics"]["actor/entropy_loss"] > 0, case
        assert ("kl_loss" in fused["metrics"]) == (kl is not None), case
        if kl is not None:  # the term is there, and not the same as without it
            assert fused["metrics"]["kl_loss"] > 0, case
            without = _step(LogitlessPolicyLossConfig(loss_mode=mode, fused=True, **options),
                            agg, data=data(), entropy_coeff=coeff)
            assert abs(without["loss"] - fused["loss"]) > 1e-6, case
        assert fused["flops"] == 3 * 2 * RESPONSE_ROWS * D * V, case


def test_fused_falls_back_with_one_warning_where_it_cannot_run(cpu_engine):
    """verl's KL term aggregated otherwise than the policy term (``policy_loss.loss_agg``): the
    composed path runs, said once; a head whose entropy has no gradient with an entropy
    bonus: the same."""
    cfg = lambda fused, **kw: LogitlessPolicyLossConfig(loss_mode="logitless_grpo",
                                                        fused=fused, **kw)
    kl = dict(use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=0.07)
    with pytest.warns(UserWarning, match="policy_loss.loss_agg") as caught:
        fused = _step(cfg(True, loss_agg="token-mean"), data=_data(ref=True), **kl)
        _step(cfg(True, loss_agg="token-mean"), data=_data(ref=True), **kl)
    assert sum("policy_loss.fused" in str(w.message) for w in caught) == 1
    composed = _step(cfg(False, loss_agg="token-mean"), data=_data(ref=True), **kl)
    _same(fused, composed, "loss_agg with KL")
    assert fused["flops"] == composed["flops"]
    # under Ulysses the loss runs with cp_group (test_verl_ulysses_adapter): what cp_group
    # refuses keeps the composed path, its reason named
    actor = lambda mode: verl_config.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        policy_loss=LogitlessPolicyLossConfig(loss_mode=mode, fused=True))
    reason = verl_adapter._ulysses_reason(actor("logitless_clip_cov"), dist.group.WORLD)
    assert reason.startswith("ulysses_sequence_parallel_size > 1") and "clip_cov" in reason
    assert verl_adapter._ulysses_reason(actor("logitless_grpo"), dist.group.WORLD) is None
    disable_fused_head()
    enable_fused_head(entropy_grad=False)
    with pytest.warns(UserWarning, match="entropy_grad=False"):
        fused = _step(cfg(True), entropy_coeff=0.03, data=_data(entropy=True))
    composed = _step(cfg(False), entropy_coeff=0.03, data=_data(entropy=True))
    _same(fused, composed, "entropy without gradient")


@pytest.mark.parametrize("entropy", [False, True], ids=["policy-term", "entropy-term"])
def test_fused_with_match_sampler(cpu_engine, entropy):
    """``policy_loss.match_sampler`` runs fused, with no warning: fused_policy_loss under the
    rollout's truncation (vLLM's rules), the tokens outside the kept set out of the loss as
    the composed path leaves them (``outside_kept`` > 0 here): the same loss, metrics and
    gradients as the composed path. verl's entropy term covers the tokens outside the kept
    set, which the policy term leaves out: with it the composed path runs, said once."""
    rollout = {"name": "vllm", "temperature": TEMPERATURE, "top_k": 20, "top_p": 0.9}
    cfg = lambda **kw: LogitlessPolicyLossConfig(loss_mode="logitless_grpo",
                                                 match_sampler=rollout, **kw)
    coeff = 0.03 if entropy else 0.0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fused = _step(cfg(fused=True), entropy_coeff=coeff, data=_data(entropy=entropy))
        composed = _step(cfg(), entropy_coeff=coeff, data=_data(entropy=entropy))
    finally:
        set_head_sampler(None)
    said = [str(w.message) for w in caught if "policy_loss.fused" in str(w.message)]
    assert said == (["policy_loss.fused: this micro-batch runs the composed loss (the head's "
                     "logprobs, then the policy loss): policy_loss.match_sampler with "
                     "calculate_entropy: verl's entropy term and metric cover the tokens "
                     "outside the kept set, which leave the policy term"] if entropy else [])
    _same(fused, composed, "match_sampler")
    assert composed["metrics"]["actor/logitless/sampler/outside_kept"] > 0  # it truncated


def _with_sets(data, seed=23):
    """``data`` with recorded kept sets (``kept_ids``, aligned with ``responses``): random
    sets of 2 to 8 ids, each holding its response token but one per sequence, which leaves the
    loss (as a set that misses its token does on the composed path)."""
    g = torch.Generator().manual_seed(seed)
    responses = data["responses"]
    responses = responses.to_padded_tensor(0) if responses.is_nested else responses
    masks = []
    for i, (_, r) in enumerate(SEQS):
        sets = []
        for j in range(r):
            token = int(responses[i, j])
            ids = [int(x) for x in torch.randperm(V, generator=g)[:int(torch.randint(
                2, 9, (1,), generator=g))] if int(x) != token]
            sets.append(ids if j == 1 else [*ids, token])
        masks.append(sets)
    data["kept_ids"] = kept_ids_from_masks(masks, WIDTH_R, vocab_size=V)
    return data


def test_fused_with_replay(cpu_engine):
    """``policy_loss.match_sampler=replay`` runs fused, with no warning: fused_policy_loss over
    the recorded sets verl's ``prepare_model_inputs`` laid out for the head call (``kept_ids``
    of the picked rows), equal to the composed path: loss, metrics and gradients, a set that
    misses its token out of the loss on both (``outside_kept`` > 0)."""
    # CISPO: the sets' renormalised logprobs lie far above verl's old ones, whose every
    # ratio GRPO's clip would cut off from the gradient; CISPO's clipped weight keeps it
    cfg = lambda **kw: LogitlessPolicyLossConfig(loss_mode="logitless_cispo",
                                                 match_sampler="replay", **kw)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fused = _step(cfg(fused=True), "token-mean", data=_with_sets(_data()))
        composed = _step(cfg(), "token-mean", data=_with_sets(_data()))
    finally:
        set_head_replay(False)
    assert not [str(w.message) for w in caught if "policy_loss.fused" in str(w.message)]
    _same(fused, composed, "replay")
    assert composed["metrics"]["actor/logitless/sampler/outside_kept"] > 0


def test_fused_refuses_what_it_cannot_do(cpu_engine):
    with pytest.raises(ValueError, match=r"^policy_loss\.fused: the fused loss is a logitless"):
        LogitlessPolicyLossConfig(loss_mode="vanilla", fused=True)
    with pytest.raises(ValueError, match=r"^policy_loss\.fused: expected True or False"):
        LogitlessPolicyLossConfig(loss_mode="logitless_grpo", fused="yes")
    with pytest.raises(ValueError, match=r"^policy_loss\.fused: needs .*use_fused_kernels"):
        _step(LogitlessPolicyLossConfig(loss_mode="logitless_grpo", fused=True),
              data=_data(fused_kernels=False))


@pytest.mark.parametrize("fused", [False, True])
def test_rollout_log_probs_give_the_mismatch_metrics(cpu_engine, fused):
    """verl's batch carries the engine's ``rollout_log_probs``; verl's ``ppo_loss`` does not
    pass them on, the engine hook does: the step logs ``actor/logitless/mismatch/*`` of the
    old logprobs against them, as ``logitless.mismatch_metrics`` gives them."""
    data = _data(rollout=True)
    mask = data["response_mask"].to_padded_tensor().bool() if data["response_mask"].is_nested \
        else data["response_mask"].bool()
    old, rollout = data["old_log_probs"], data["rollout_log_probs"]
    want = logitless.mismatch_metrics(old, rollout, mask)
    cfg = lambda: LogitlessPolicyLossConfig(
        loss_mode="logitless_grpo", **({"fused": True} if fused else {}))
    got = _step(cfg(), data=data)
    for name, value in want.items():
        torch.testing.assert_close(got["metrics"][f"actor/logitless/mismatch/{name}"],
                                   float(value), rtol=1e-12, atol=1e-14, msg=name)
    assert want["abs_diff/mean"] > 0
    without = _step(cfg())
    assert not any("mismatch" in k for k in without["metrics"])
    assert old.shape[1] == WIDTH_R
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback here
        _step(cfg(), data=data)
