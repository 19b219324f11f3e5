"""logitless inside TRL, trained for real on CPU: a tiny Qwen2 built from its config, a tokenizer
trained here, an in-memory prompt set and a Python reward (nothing downloaded).

Stock TRL and logitless's `GRPOTrainer` train from the same weights and seed and must agree on
losses, parameters and logged metrics. SGD keeps the comparison meaningful: Adam divides each
gradient by its own magnitude, so on components whose gradient is near zero it would turn
ulp-level differences between the two heads into steps of the learning rate's size.
"""

import math
import os
import re
import warnings
from unittest import mock

import pytest
import torch

from logitless import PolicyLossConfig, policy_loss
from logitless.integrations import trl_head
from logitless.tools import tiny

from testing import MatmulFlops, run_on_gloo
from tiny_models import prompt_dataset, tiny_qwen2, tiny_tokenizer, vowel_reward

trl = pytest.importorskip("trl", reason="TRL is installed by `make test`")

from logitless.integrations import trl as trl_module  # noqa: E402
from logitless.integrations.trl import (  # noqa: E402
    GRPOTrainer,
    config_from_grpo,
    loss_config_over_grpo,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TIMING_KEYS = ("step_time", "runtime", "_per_second")  # suffixes of wall-clock metrics


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    # A path, not an instance: TRL builds the reference model (beta > 0) from it.
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_qwen2(tokenizer).save_pretrained(path)
    return str(path)


def grpo_args(tmp_path, **overrides):
    fields = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=2, gradient_accumulation_steps=2, num_iterations=2,
        learning_rate=2.0, optim="sgd", logging_steps=1, report_to=[], bf16=False,
        use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
    )
    fields.update(overrides)
    return trl.GRPOConfig(**fields)


def train(cls, model_dir, tokenizer, args, **kwargs):
    evaluates = args.eval_strategy != "no"
    trainer = cls(model=model_dir, reward_funcs=vowel_reward, args=args,
                  train_dataset=prompt_dataset(), processing_class=tokenizer,
                  eval_dataset=prompt_dataset(4) if evaluates else None, **kwargs)
    trainer.train()
    return trainer


# Stock TRL's run of each PARITY configuration, which test_stock_trl_parity and
# test_fused_equals_stock_trl both compare against: the same arguments and seed give the same
# run, so a worker trains it once. With it, the calls that reached logitless's head or fused
# loss during it (none: stock TRL keeps its own kernel).
_STOCK = {}


def stock_trl(model_dir, tokenizer, tmp_path, overrides):
    key = (model_dir, repr(sorted(overrides.items())))
    if key not in _STOCK:
        calls = []
        head, fused = trl_head.LogitlessChunkedLogProb.apply, trl_module._FusedLoss.apply
        with mock.patch.object(trl_head.LogitlessChunkedLogProb, "apply", staticmethod(
                lambda *a, **k: calls.append("head") or head(*a, **k))), \
                mock.patch.object(trl_module._FusedLoss, "apply",
                                  lambda self, *a, **k: calls.append("fused") or fused(self, *a,
                                                                                       **k)):
            trainer = train(trl.GRPOTrainer, model_dir, tokenizer,
                            grpo_args(tmp_path, **overrides))
        _STOCK[key] = trainer, calls
    return _STOCK[key]


@pytest.fixture
def head_calls(monkeypatch):
    """Every call of logitless's TRL head: (outputs requested, grad enabled)."""
    calls = []
    inner = trl_head.LogitlessChunkedLogProb.apply

    def spy(*args, **kwargs):
        outputs = kwargs.get("outputs", args[8] if len(args) > 8 else ())
        calls.append((tuple(outputs), torch.is_grad_enabled()))
        return inner(*args, **kwargs)

    monkeypatch.setattr(trl_head.LogitlessChunkedLogProb, "apply", staticmethod(spy))
    return calls


@pytest.fixture
def fused_calls(monkeypatch):
    """How many training forwards ran as one `fused_policy_loss` call."""
    calls = []
    inner = trl_module._FusedLoss.apply

    def spy(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(trl_module._FusedLoss, "apply", spy)
    return calls


def initial_parameters(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_same_parameters(ours, theirs, tol=1e-5):
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert a.keys() == b.keys()
    for name in b:
        err = float((a[name] - b[name]).detach().abs().max() / b[name].abs().max().clamp(min=1e-30))
        assert err <= tol, f"{name}: relative difference {err:.2e}"


def assert_moved(model, before, at_least):
    moved = max(float((p - before[k]).abs().max() / before[k].abs().max().clamp(min=1e-30))
                for k, p in model.named_parameters() if p.requires_grad)
    assert moved >= at_least, f"parameters moved by {moved:.2e} only"
    return moved


def assert_same_logs(ours, theirs, loss_atol=1e-7):
    """Every value stock TRL logs, ours logs too (we log more: logitless/*). ``loss_atol``: the
    absolute part of the tolerance of the loss values (1e-7 for every other value)."""
    assert len(ours) == len(theirs)
    for step, (o, t) in enumerate(zip(ours, theirs)):
        for key, value in t.items():
            assert key in o, f"step {step}: {key} not logged"
            if key.endswith(TIMING_KEYS):
                continue
            atol = loss_atol if key in ("loss", "train_loss") else 1e-7
            assert abs(o[key] - value) <= 1e-5 * abs(value) + atol, (step, key, o[key], value)


def test_config_from_grpo_maps_trl_semantics(tmp_path):
    cfg = config_from_grpo(grpo_args(tmp_path, loss_type="cispo", epsilon=0.3, epsilon_high=4.0))
    assert (cfg.objective, cfg.cispo_clip, cfg.cispo_cap) == ("cispo", "upper", 4.0)
    assert cfg.loss_agg == "token-mean" and cfg.entropy_agg == "bnpo" and cfg.seq_count == "all"
    cfg = config_from_grpo(grpo_args(
        tmp_path, loss_type="dr_grpo", beta=0.1, use_bias_correction_kl=True, delta=1.7,
        importance_sampling_level="sequence", top_entropy_quantile=0.4, entropy_coef=0.01,
        off_policy_mask_threshold=0.2))
    assert (cfg.ratio_level, cfg.beta, cfg.kl_estimator, cfg.delta) == ("sequence", 0.1, "k3", 1.7)
    assert cfg.kl_bias_correction and cfg.kl_bias_correction_grad
    assert (cfg.top_entropy_quantile, cfg.entropy_coef, cfg.opsm_threshold) == (0.4, 0.01, 0.2)
    assert (cfg.loss_agg, cfg.max_response_length, cfg.grad_accum_steps) == (
        "seq-mean-token-sum-norm", 8, 2)
    assert cfg.log_ratio_clamp is None
    cfg = config_from_grpo(grpo_args(tmp_path, loss_type="sapo", sapo_temperature_neg=1.05))
    assert cfg.sapo_tau_neg == float(torch.tensor(1.05)) != 1.05  # TRL's fp32 rounding
    cfg = config_from_grpo(grpo_args(
        tmp_path, loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.5))
    assert (cfg.rollout_is, cfg.rollout_is_mode, cfg.rollout_is_min, cfg.rollout_is_max) == (
        "token", "mask", 0.5, 2.5)
    assert cfg.log_ratio_clamp == 20.0
    cfg = config_from_grpo(grpo_args(tmp_path, use_vllm=True,
                                     vllm_importance_sampling_mode="sequence_truncate"))
    assert (cfg.rollout_is, cfg.rollout_is_mode) == ("sequence", "truncate")
    assert config_from_grpo(grpo_args(tmp_path), dual_clip_c=3.0).dual_clip_c == 3.0


LOSS_TYPES = {
    "grpo": {},
    "bnpo": {},
    "dr_grpo": {},
    "dapo": {},
    "cispo": dict(epsilon_high=1.5),  # TRL's cap of the ratio itself; reached on step 2
    "sapo": {},
    "luspo": dict(importance_sampling_level="sequence"),
    "vespo": {},
}
PARITY = [
    pytest.param(loss_type, dict(extra, loss_type=loss_type, beta=beta),
                 id=f"{loss_type}-beta{beta}",
                 # the reference-model path stays in the default run through grpo
                 marks=[pytest.mark.slow] if beta and loss_type != "grpo" else [])
    for loss_type, extra in LOSS_TYPES.items()
    for beta in (0.0, 0.05)
] + [
    pytest.param("gspo", dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05,
                              use_bias_correction_kl=True), id="gspo-bias-corrected-kl"),
    pytest.param("entropy", dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.02),
                 id="dapo-top-entropy-bonus"),
    pytest.param("adaptive", dict(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.01,
                                  entropy_target=10.0, entropy_coef_delta=0.02),
                 id="bnpo-adaptive-entropy"),
    pytest.param("opsm", dict(loss_type="grpo", delta=1.5, off_policy_mask_threshold=0.01),
                 id="grpo-delta-opsm"),
    # a cap below 1 (every weight capped on-policy) and an epsilon TRL's cispo never reads
    pytest.param("cispo", dict(loss_type="cispo", epsilon=-1.0, epsilon_high=0.9),
                 id="cispo-cap-below-1"),
    # TRL's fp32 head (#4303) on a bf16-autocast model: logitless's head in fp32 as TRL's is
    pytest.param("fp32-head", dict(loss_type="dapo", cast_lm_head_to_fp32=True, bf16=True),
                 id="dapo-cast-lm-head-to-fp32"),
    # generation every 2 optimizer steps: the token-mean normaliser spans 4 micro-batches
    pytest.param("spg", dict(loss_type="dapo", steps_per_generation=4, num_iterations=1),
                 id="dapo-steps-per-generation-4"),
    # evaluation: no accumulation scaling, the normaliser of the eval batch itself
    pytest.param("eval", dict(loss_type="dapo", eval_strategy="steps", eval_steps=2,
                              per_device_eval_batch_size=4), id="dapo-eval"),
]


def test_head_dtype_from_grpo(tmp_path):
    """cast_lm_head_to_fp32 -> head_dtype="float32", for callers that feed the head
    themselves (TRL's forward hands logitless's patched head fp32 tensors already)."""
    from logitless.integrations.trl_config import head_dtype_from_grpo

    assert head_dtype_from_grpo(grpo_args(tmp_path, cast_lm_head_to_fp32=True)) == "float32"
    assert head_dtype_from_grpo(grpo_args(tmp_path)) is None


@pytest.mark.parametrize("name,overrides", PARITY)
def test_stock_trl_parity(name, overrides, tmp_path, model_dir, tokenizer, head_calls):
    theirs, stock_calls = stock_trl(model_dir, tokenizer, tmp_path, overrides)
    assert not head_calls and not stock_calls  # stock TRL kept its own kernel
    ours = train(GRPOTrainer, model_dir, tokenizer, grpo_args(tmp_path, **overrides),
                 fused=False)  # the composed path (the fused one: test_fused_equals_stock_trl)
    assert_same_logs(ours.state.log_history, theirs.state.log_history)
    assert_same_parameters(ours.model, theirs.model)
    assert_moved(ours.model, initial_parameters(model_dir), at_least=1e-4)
    # Our head served every pass; entropy only where something uses it (the training pass).
    grad_calls = [outputs for outputs, grad in head_calls if grad]
    no_grad_calls = [outputs for outputs, grad in head_calls if not grad]
    assert grad_calls and all("entropy" in o for o in grad_calls)
    assert any("entropy" not in o for o in no_grad_calls)
    if name != "eval":  # evaluation's loss pass is no-grad and logs the entropy
        assert not any("entropy" in o for o in no_grad_calls)
    if name == "cispo":
        assert any(h.get("cispo_clip_ratio", 0) > 0 for h in theirs.state.log_history)
    if name == "eval":
        assert any("eval_loss" in h for h in theirs.state.log_history)
    if name == "adaptive":
        coefs = [h["entropy_coef"] for h in theirs.state.log_history if "entropy_coef" in h]
        assert coefs == pytest.approx([0.03, 0.05])  # entropy below target: it rises


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_lora_parity(fused, tmp_path, model_dir, tokenizer, fused_calls):
    """LoRA adapters, and with beta > 0 the reference is the model with adapters disabled."""
    from peft import LoraConfig

    def run(cls, **kwargs):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                          task_type="CAUSAL_LM")
        return train(cls, model_dir, tokenizer, grpo_args(tmp_path, beta=0.05, loss_type="grpo"),
                     peft_config=lora, **kwargs)

    theirs, ours = run(trl.GRPOTrainer), run(GRPOTrainer, fused=fused)
    assert bool(fused_calls) == fused
    assert_same_logs(ours.state.log_history, theirs.state.log_history)
    assert_same_parameters(ours.model, theirs.model)
    trained = {k: p for k, p in ours.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in k for k in trained)
    before = initial_parameters(model_dir)
    for name, p in ours.model.named_parameters():
        if not p.requires_grad:  # the base weights did not move
            base = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(p, before[base]), name
    assert any(h.get("kl", 0) > 0 for h in ours.state.log_history)



def test_lora_with_attention_entropy_weighting(tmp_path, model_dir, tokenizer):
    """The recorder sees through the PEFT wrapper; only the adapters train."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    cfg = PolicyLossConfig(objective="dapo", attn_entropy_weighting="softmax")
    trainer = train(GRPOTrainer, model_dir, tokenizer, grpo_args(tmp_path), peft_config=lora,
                    loss_config=cfg)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    lora_b = [p for k, p in trainer.model.named_parameters() if "lora_B" in k]
    assert lora_b and all(p.abs().max() > 0 for p in lora_b)  # initialised at zero

@pytest.mark.slow
def test_patch_trl_grpo_and_dpo_match_unpatched(tmp_path, model_dir, tokenizer, head_calls):
    def one_grpo_step():
        return train(trl.GRPOTrainer, model_dir, tokenizer,
                     grpo_args(tmp_path, max_steps=1, gradient_accumulation_steps=1))

    def one_dpo_step():
        pairs = [(p, " on a red mat", " zzz qq") for p in prompt_dataset()["prompt"]]
        data = {"prompt": [p for p, _, _ in pairs], "chosen": [c for _, c, _ in pairs],
                "rejected": [r for _, _, r in pairs]}
        from datasets import Dataset

        args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                             max_steps=1, learning_rate=1.0, optim="sgd", report_to=[],
                             bf16=False, use_cpu=True, seed=0, save_strategy="no",
                             disable_tqdm=True, logging_steps=1)
        trainer = trl.DPOTrainer(model=model_dir, args=args, processing_class=tokenizer,
                                 train_dataset=Dataset.from_dict(data))
        trainer.train()
        return trainer

    for run in (one_grpo_step, one_dpo_step):
        theirs = run()
        calls_before = len(head_calls)
        trl_head.patch_trl()
        try:
            ours = run()
        finally:
            trl_head.unpatch_trl()
        assert len(head_calls) > calls_before, run.__name__
        assert_same_logs(ours.state.log_history, theirs.state.log_history)
        assert_same_parameters(ours.model, theirs.model)
        assert_moved(ours.model, initial_parameters(model_dir), at_least=1e-4)


EXTRA_OBJECTIVES = {
    "gmpo": dict(objective="gmpo"),
    "dual_clip": dict(objective="grpo", dual_clip_c=2.0),
    "minpro": dict(objective="minpro"),
    "ctpo": dict(objective="ctpo"),
    "k1_kl": dict(objective="dapo", beta=0.05, kl_estimator="k1"),
    "k2_kl": dict(objective="dapo", beta=0.05, kl_estimator="k2"),
    # the reference model's backbone and head: its hidden states from TRL's reference pass
    "exact_kl": dict(objective="dapo", beta=0.05, kl_estimator="exact"),
    "balanced": dict(objective="dapo", loss_agg="balanced"),
    "attention_entropy": dict(objective="dapo", attn_entropy_weighting="tanh",
                              attn_entropy_alpha=0.5, attn_entropy_alpha_final=0.1),
}


@pytest.mark.parametrize("name", EXTRA_OBJECTIVES)
def test_extra_objectives_train(name, tmp_path, model_dir, tokenizer):
    """Ten steps of objectives TRL does not have: finite losses, parameters that move."""
    fields = EXTRA_OBJECTIVES[name]
    args = grpo_args(tmp_path, max_steps=10, gradient_accumulation_steps=1, learning_rate=0.5,
                     beta=fields.get("beta", 0.0))
    trainer = train(GRPOTrainer, model_dir, tokenizer, args,
                    loss_config=PolicyLossConfig(**fields))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 10
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in logs)
    assert all(math.isfinite(v) for h in logs for k, v in h.items() if k.startswith("logitless/"))
    assert any(h["logitless/ratio/max"] != 1.0 for h in logs)  # off-policy iterations happened
    assert_moved(trainer.model, initial_parameters(model_dir), at_least=1e-3)


@pytest.mark.parametrize("num_iterations", [2, 1], ids=["old-policy-pass", "dedicated-pass"])
def test_attention_entropy_weighting(num_iterations, tmp_path, model_dir, tokenizer):
    """The recorder's per-token attention entropies reach the loss and change its gradient."""
    from logitless.integrations.transformers import AttentionEntropyRecorder

    cfg = PolicyLossConfig(objective="dapo", attn_entropy_weighting="tanh", attn_entropy_alpha=0.8)
    args = grpo_args(tmp_path, gradient_accumulation_steps=1, num_iterations=num_iterations)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=args,
                          train_dataset=prompt_dataset(), processing_class=tokenizer,
                          loss_config=cfg, attention_entropy_layers=[1])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train, not called here
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)
    assert ("old_per_token_logps" in inputs) == (num_iterations == 2)

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad(), AttentionEntropyRecorder(trainer.model, layers=[1]) as rec:
        trainer.model(input_ids=ids, attention_mask=mask)
    width = inputs["completion_ids"].shape[1]
    torch.testing.assert_close(inputs["attention_entropy"], rec.per_token()[:, -width:])

    def gradient(config):
        trainer.loss_config, trainer._configs = config, {}
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, inputs).backward()
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])

    weighted = gradient(cfg)
    plain = gradient(PolicyLossConfig(objective="dapo"))
    assert (weighted - plain).abs().max() > 1e-3 * plain.abs().max()


class _TwoRanks:
    """This process's accelerator seen as rank 0 of two, the other rank holding the same
    batch with entropies shifted by half their spread: gathers and reductions change, so
    TRL's entropy quantile (and its metrics) see both ranks."""

    num_processes = 2

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def gather(self, x):
        if x.dim() == 0:
            return torch.stack([x, x])
        return torch.cat([x, x + 0.5 * (x.max() - x.min())])

    def pad_across_processes(self, x, **kwargs):
        return x

    def reduce(self, x, reduction="sum"):
        return 2 * x


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_entropy_quantile_over_processes(fused, tmp_path, model_dir, tokenizer, fused_calls):
    """TRL's top-entropy threshold is a quantile over every process's tokens; ours too, fused
    (the threshold handed to fused_policy_loss as its batch_globals) and composed."""
    args = dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.05,
                gradient_accumulation_steps=1)
    trainers = [cls(model=model_dir, reward_funcs=vowel_reward, args=grpo_args(tmp_path, **args),
                    train_dataset=prompt_dataset(), processing_class=tokenizer, **kwargs)
                for cls, kwargs in ((trl.GRPOTrainer, {}), (GRPOTrainer, dict(fused=fused)))]
    for trainer in trainers:
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train
    inputs = trainers[0]._generate_and_score_completions(
        next(iter(trainers[0].get_train_dataloader())))
    results = []
    for trainer in trainers:
        trainer.accelerator = _TwoRanks(trainer.accelerator)
        trainer._metrics["train"].clear()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            loss = trainer.compute_loss(trainer.model, inputs)
        assert not _fused_warnings(record)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
        results.append((loss.detach(), grads))
    assert fused_calls == ([True] if fused else [])
    (theirs, g_theirs), (ours, g_ours) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-5 * g_theirs.abs().max())
    logged = [{k: v[-1] for k, v in t._metrics["train"].items()} for t in trainers]
    assert {"entropy", "policy_loss", "clip_ratio/low_min"} <= logged[0].keys()
    for key, value in logged[0].items():  # reduced over both ranks alike
        assert abs(logged[1][key] - value) <= 1e-5 * abs(value) + 1e-7, key
    # The world threshold is not this process's own quantile: the test can tell them apart.
    local = trainers[1]._config_for(1)  # dp_size 2, as the trainer's own call
    lp, ent, _ = trainers[1]._get_per_token_logps_and_entropies(
        trainers[1].model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
        inputs["completion_ids"].shape[1], compute_entropy=True)
    alone, _ = policy_loss(lp, inputs.get("old_per_token_logps", lp.detach()),
                           inputs["advantages"], inputs["completion_mask"], local, entropy=ent,
                           num_items_in_batch=inputs["num_items_in_batch"])
    assert abs(float(alone) - float(theirs)) > 1e-4 * abs(float(theirs))

def _entropy_quantile_worker(rank, world, model_dir, out_dir):
    """One gloo rank of `test_entropy_quantile_on_two_processes`: accelerate's multi-CPU
    state over the spawned group, then stock TRL, the fused and the composed trainer."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    assert PartialState(cpu=True, backend="gloo").num_processes == world
    tokenizer = tiny_tokenizer()
    fused_calls = []
    inner = trl_module._FusedLoss.apply
    trl_module._FusedLoss.apply = lambda self, *a, **k: fused_calls.append(1) or inner(
        self, *a, **k)
    trainers = {}
    for name, cls, kwargs in (("stock", trl.GRPOTrainer, {}), ("fused", GRPOTrainer, {}),
                              ("composed", GRPOTrainer, dict(fused=False))):
        args = grpo_args(f"{out_dir}/{name}", loss_type="dapo", top_entropy_quantile=0.5,
                         entropy_coef=0.05, accelerator_config={"use_configured_state": True})
        calls = len(fused_calls)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainers[name] = train(cls, model_dir, tokenizer, args, **kwargs)
        assert trainers[name].accelerator.num_processes == world
        if name == "fused":
            assert not _fused_warnings(record)
            assert len(fused_calls) > calls
        AcceleratorState._reset_state()  # the next trainer's; the processes stay
    fused, composed, stock = (trainers[k] for k in ("fused", "composed", "stock"))
    assert_same_logs(fused.state.log_history, composed.state.log_history, loss_atol=2e-6)
    assert_same_parameters(fused.model, composed.model)
    assert_same_logs(fused.state.log_history, stock.state.log_history, loss_atol=2e-6)
    assert_same_parameters(fused.model, stock.model)


@pytest.mark.dist
def test_entropy_quantile_on_two_processes(model_dir, tmp_path):
    """Two gloo processes training (accelerate's multi-CPU data parallelism): the top-entropy
    threshold is the quantile over both processes' tokens, and the fused trainer (that
    threshold handed to fused_policy_loss) trains like the composed one and like stock TRL."""
    run_on_gloo(2, _entropy_quantile_worker, model_dir, str(tmp_path))


@pytest.mark.parametrize("grpo,config,message", [
    (dict(beta=0.04), PolicyLossConfig(objective="gmpo", beta=0.0),
     "GRPOConfig.beta=0.04 but loss_config.beta=0.0"),
    (dict(loss_type="grpo"), PolicyLossConfig(objective="gmpo"),
     "GRPOConfig.loss_type='grpo' but loss_config.objective='gmpo'"),
    (dict(loss_type="grpo"), PolicyLossConfig(objective="grpo", loss_agg="token-mean"),
     r"GRPOConfig.loss_type='grpo' \(which makes loss_agg='seq-mean-token-mean'\) but "
     "loss_config.loss_agg='token-mean'"),
    (dict(epsilon=0.3), PolicyLossConfig(eps_high=0.28),
     "GRPOConfig.epsilon=0.3 but loss_config.eps_high=0.28"),
    (dict(epsilon_high=0.28), PolicyLossConfig(eps_high=0.3),
     "GRPOConfig.epsilon_high=0.28 but loss_config.eps_high=0.3"),
    (dict(delta=2.0), PolicyLossConfig(delta=3.0), "GRPOConfig.delta=2.0 but loss_config.delta"),
    (dict(entropy_coef=0.01), PolicyLossConfig(entropy_coef=0.02),
     "GRPOConfig.entropy_coef=0.01 but loss_config.entropy_coef=0.02"),
    (dict(loss_type="cispo", epsilon_high=4.0), PolicyLossConfig(cispo_cap=5.0),
     "GRPOConfig.epsilon_high=4.0 but loss_config.cispo_cap=5.0"),
])
def test_loss_config_conflicts_with_grpo_config(grpo, config, message, tmp_path):
    """A field set in both configs (the GRPOConfig's away from TRL's default, the
    PolicyLossConfig's passed to it) to different values is refused, naming both."""
    with pytest.raises(ValueError, match=message):
        loss_config_over_grpo(grpo_args(tmp_path, **grpo), config)


@pytest.mark.parametrize("field,argument", [
    ("sapo_tau_pos", "sapo_temperature_pos"), ("sapo_tau_neg", "sapo_temperature_neg"),
    ("vespo_k_pos", "vespo_k_pos"), ("vespo_lambda_pos", "vespo_lambda_pos"),
    ("vespo_k_neg", "vespo_k_neg"), ("vespo_lambda_neg", "vespo_lambda_neg"),
])
def test_loss_config_agrees_with_grpo_config_at_trls_precision(field, argument, tmp_path):
    """TRL reads the sapo and vespo parameters in fp32 (``torch.where`` on python floats): the
    same value set in both configs is no conflict, although the GRPOConfig's reads as its fp32
    rounding; values that differ in fp32 still are."""
    args = grpo_args(tmp_path, **{argument: 0.7})
    assert getattr(config_from_grpo(args), field) == float(torch.tensor(0.7)) != 0.7
    merged = loss_config_over_grpo(args, PolicyLossConfig(**{field: 0.7}))
    assert getattr(merged, field) == 0.7
    with pytest.raises(ValueError, match=re.escape(
            f"GRPOConfig.{argument}=0.7 (which makes {field}={float(torch.tensor(0.7))!r}) but "
            f"loss_config.{field}=0.71")):
        loss_config_over_grpo(args, PolicyLossConfig(**{field: 0.71}))


def test_loss_config_overrides_grpo_config(tmp_path):
    """The fields passed to PolicyLossConfig override, the others come from the GRPOConfig:
    TRL's own objective gives config_from_grpo with the overrides; another objective keeps
    its defaults except what the GRPOConfig sets (here beta, with TRL's KL estimate) and the
    trainer's settings; equal values set in both are no conflict."""
    args = grpo_args(tmp_path, beta=0.04, loss_type="grpo", epsilon=0.3)
    assert loss_config_over_grpo(args, PolicyLossConfig(dual_clip_c=3.0)) == config_from_grpo(
        args, dual_clip_c=3.0)
    assert loss_config_over_grpo(args, PolicyLossConfig(objective="grpo", beta=0.04,
                                                        eps_low=0.3)) == config_from_grpo(args)
    args = grpo_args(tmp_path, beta=0.04)  # loss_type: TRL's default
    gmpo = loss_config_over_grpo(args, PolicyLossConfig(objective="gmpo"))
    theirs = config_from_grpo(args)
    assert gmpo == PolicyLossConfig(
        objective="gmpo", beta=0.04, kl_estimator="k3", kl_bias_correction=True,
        kl_bias_correction_grad=True, max_response_length=8, grad_accum_steps=2,
        seq_count="all")
    assert (gmpo.eps_low, gmpo.kl_bias_correction) == (0.4, theirs.kl_bias_correction)
    k2 = loss_config_over_grpo(args, PolicyLossConfig(objective="dapo", kl_estimator="k2"))
    assert k2 == config_from_grpo(args, kl_estimator="k2")


def test_loss_config_keeps_grpo_config_kl(tmp_path, model_dir, tokenizer):
    """The README's combination: GRPOConfig(beta=0.04) and a loss_config naming another
    objective. The loss keeps the KL term and TRL's ``kl`` metric is logged."""
    trainer = train(GRPOTrainer, model_dir, tokenizer, grpo_args(tmp_path, beta=0.04, max_steps=1),
                    loss_config=PolicyLossConfig(objective="gmpo"))
    assert trainer.loss_config.beta == 0.04 and trainer.loss_config.objective == "gmpo"
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert logged and all(math.isfinite(e["kl"]) for e in logged)


@pytest.mark.parametrize("config,kwargs,message", [
    (PolicyLossConfig(beta=0.1), {}, r"GRPOConfig\.beta"),
    (PolicyLossConfig(attn_entropy_weighting="tanh"), dict(attention_entropy_layers=[2]),
     r"layers must be distinct indices in \[0, 2\)"),
    # TRL shuffles the generation batch: a micro-batch's neighbours are not one prompt's
    (PolicyLossConfig(loss_agg="prompt-mean", prompt_group_size=4), {},
     r"loss_config\.loss_agg: prompt-mean groups .* TRL shuffles"),
    (PolicyLossConfig(entropy_coef=0.01, entropy_agg="prompt-mean", prompt_group_size=4), {},
     r"loss_config\.entropy_agg: prompt-mean groups .* TRL shuffles"),
    # neither path can train it: TRL's generation records no top-k ids or their logprobs
    (PolicyLossConfig(objective="dppo_topk_tv"), {},
     r"loss_config\.objective: dppo_topk_tv needs the rollout's top-k token ids"),
    (PolicyLossConfig(objective="dppo_topk_kl"), {},
     r"loss_config\.objective: dppo_topk_kl needs the rollout's top-k token ids"),
], ids=["kl-without-reference", "attention-layer-out-of-range", "prompt-mean",
        "entropy-prompt-mean", "dppo-topk-tv", "dppo-topk-kl"])
def test_bad_configuration_fails_at_construction(config, kwargs, message, tmp_path, model_dir,
                                                 tokenizer):
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=grpo_args(tmp_path),
                    train_dataset=prompt_dataset(), processing_class=tokenizer,
                    loss_config=config, **kwargs)


def _fused_head_grads(model, ids):
    """TRL's fused-head forward of ``model`` through our kernel, and the backward."""
    from logitless.integrations.trl import _logitless_head

    with _logitless_head(entropy=True):
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
    return out.log_probs.detach()


def test_zero3_gather_context_in_forward_and_backward(monkeypatch, tokenizer):
    """Under ZeRO-3 TRL gathers the head weight around its forward with
    ``maybe_gather_lm_head_ctx``; our kernel's backward, which recomputes the logits, must run
    inside the same context (it is a null context here: no DeepSpeed)."""
    import contextlib

    import trl.trainer.utils as trl_utils
    from trl.trainer.utils import add_fused_lm_head

    phases, phase = [], ["forward"]

    @contextlib.contextmanager
    def gather(*params):
        phases.append((phase[0], tuple(p.shape for p in params if p is not None)))
        yield

    monkeypatch.setattr(trl_utils, "maybe_gather_lm_head_ctx", gather)
    model = tiny_qwen2(tokenizer)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, len(tokenizer), (2, 7))
    from logitless.integrations.trl import _logitless_head

    with _logitless_head(entropy=True):
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert [p for p, _ in phases] == ["forward"]  # TRL's, around the whole head call
    phase[0] = "backward"
    (out.log_probs.sum() + out.entropy.sum()).backward()
    weight_shape = tuple(model.lm_head.weight.shape)
    assert phases[-1] == ("backward", (weight_shape,))
    assert model.lm_head.weight.grad.abs().sum() > 0


def _head_loss(model, ids, context):
    """TRL's fused-head forward of ``model`` inside ``context`` and the backward of a loss on
    its logprobs and entropies; returns the logprobs and entropies."""
    with context:
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
    return out.log_probs.detach(), out.entropy.detach()


class _Patched:
    """``patch_trl()`` for the duration of the block."""

    def __enter__(self):
        trl_head.patch_trl()

    def __exit__(self, *exc):
        trl_head.unpatch_trl()


def _fsdp2_worker(rank, world, model_dir):
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from logitless.integrations.trl import _logitless_head

    def load(shard):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        if shard:
            fully_shard(model.lm_head, mesh=init_device_mesh("cpu", (world,)))
            assert type(model.lm_head.weight).__name__ == "DTensor"
        return model

    gathers = []  # every full_tensor / redistribute of a DTensor (the weight gather)
    for name in ("full_tensor", "redistribute"):
        original = getattr(DTensor, name)
        setattr(DTensor, name, lambda self, *a, _f=original, _n=name, **k: (
            gathers.append(_n), _f(self, *a, **k))[1])

    def shard(grad):
        return grad.chunk(world)[rank]

    v = load(False).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, v, (2 + r, 9), generator=gen) for r in range(world)]
    for same in (True, False):  # every rank the same batch, then a batch of its own each
        ids = batches[0] if same else batches[rank]
        stock = load(True)  # TRL's own kernel on the head it gathers with full_tensor()
        expected = _head_loss(stock, ids, contextlib.nullcontext())
        assert gathers
        for context in (_logitless_head(entropy=True), _Patched()):
            ours = load(True)
            del gathers[:]
            got = _head_loss(ours, ids, context)
            assert not gathers, gathers  # the head ran sharded: no gather of the weight
            for x, y in zip(got, expected):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
            grads = {n: ours.lm_head.get_parameter(n).grad for n in ("weight",)}
            assert all(type(g).__name__ == "DTensor" for g in grads.values())
            # The single-process reference: rank r's backbone gets d loss_r; the head
            # d (mean_r loss_r) (FSDP2's average), so TRL's gather agrees when the batches do
            plain = load(False)
            head_grad = 0
            for r in range(world):
                plain.zero_grad()
                _head_loss(plain, batches[0] if same else batches[r], contextlib.nullcontext())
                head_grad = head_grad + plain.lm_head.weight.grad / world
                if r == rank:
                    own_head = plain.lm_head.weight.grad.clone()
                    own_norm = plain.model.norm.weight.grad.clone()
            torch.testing.assert_close(grads["weight"].to_local(), shard(head_grad),
                                       rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(ours.model.norm.weight.grad, own_norm, rtol=1e-5,
                                       atol=1e-7)
            if same:
                torch.testing.assert_close(grads["weight"].full_tensor(),
                                           stock.lm_head.weight.grad.full_tensor(),
                                           rtol=1e-5, atol=1e-7)
        # TRL's gather keeps each rank's shard of its own loss's gradient (no reduction)
        torch.testing.assert_close(stock.lm_head.weight.grad.to_local(), shard(own_head),
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_sharded_head(model_dir, world):
    """FSDP2 (``fully_shard(model.lm_head)``) over gloo ranks on CPU, through TRL's fused
    forward with logitless's kernel (our trainer's context and ``patch_trl()``): the head runs
    sharded, never gathered; the values and the head's gradient equal TRL's gathering path's
    when every rank scores the same batch, and the single-process reference (FSDP2's average
    over ranks) when each scores its own."""
    run_on_gloo(world, _fsdp2_worker, model_dir)


def test_example_script_runs(monkeypatch, capsys):
    import runpy
    from pathlib import Path

    script = Path(__file__).parents[2] / "examples" / "trl_grpo.py"
    monkeypatch.setattr("sys.argv", [str(script), "--steps", "2", "--objective", "gmpo",
                                     "--attention-entropy"])
    runpy.run_path(str(script), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"]


def test_example_script_with_kl(monkeypatch, capsys):
    """``--beta``: the example hands TRL a saved folder, from which TRL builds the reference
    model, and the KL is logged (an in-memory model would fail inside TRL)."""
    import runpy
    from pathlib import Path

    script = Path(__file__).parents[2] / "examples" / "trl_grpo.py"
    monkeypatch.setattr("sys.argv", [str(script), "--steps", "2", "--objective", "gmpo",
                                     "--beta", "0.04"])
    runpy.run_path(str(script), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"]
    kls = [float(line.split(" kl ")[1]) for line in lines]
    assert all(math.isfinite(k) and k >= 0 for k in kls)


def test_in_memory_model_with_kl_is_refused_clearly(tmp_path, tokenizer):
    """TRL rebuilds the reference from the policy's path; a model built in memory has none:
    a ValueError saying what works, before TRL fails in the hub client."""
    with pytest.raises(ValueError, match=r"save_pretrained\(folder\) and pass model=folder"):
        GRPOTrainer(model=tiny_qwen2(tokenizer), reward_funcs=vowel_reward,
                    args=grpo_args(tmp_path, beta=0.04), train_dataset=prompt_dataset(),
                    processing_class=tokenizer)


def _distill(tmp_path, tokenizer, beta):
    """Three steps of TRL's on-policy ``DistillationTrainer``: a tiny student and a wider
    teacher (hidden 48 vs 32, one vocabulary), SGD at a learning rate that moves the student.

    Not faster: at 200 the three steps amplify rounding chaotically (a random change of one
    part in 1e7 to the student's head moved stock TRL's own parameters by 1.06e-5 after three
    steps), so a comparison at 1e-5 held only while logitless's kernel gave TRL's bits; at 20
    the same change moves them by 9e-7."""
    student = tiny_qwen2(tokenizer, seed=0)
    teacher = tiny_qwen2(tokenizer, hidden=48, seed=1)
    args = trl.DistillationConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=8,
        max_steps=3, learning_rate=20.0, optim="sgd", logging_steps=1, report_to=[],
        bf16=False, use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True, beta=beta,
        temperature=0.9, gradient_checkpointing=False)
    trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                      train_dataset=prompt_dataset(), processing_class=tokenizer)
    trainer.train()
    return trainer


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_patch_trl_distillation_matches_unpatched(tmp_path, tokenizer, monkeypatch, beta):
    """TRL's DistillationTrainer, stock vs with patch_trl(): its divergence kernel runs through
    linear_divergence and the losses, entropies and parameters agree to 1e-5."""
    calls = []
    inner = trl_head.LogitlessChunkedDivergence.apply
    monkeypatch.setattr(trl_head.LogitlessChunkedDivergence, "apply",
                        staticmethod(lambda *a, **k: calls.append(a[6]) or inner(*a, **k)))
    theirs = _distill(tmp_path / "stock", tokenizer, beta)
    assert not calls
    trl_head.patch_trl()
    try:
        ours = _distill(tmp_path / "patched", tokenizer, beta)
    finally:
        trl_head.unpatch_trl()
    assert calls == [beta] * 3
    assert_same_logs(ours.state.log_history, theirs.state.log_history)
    assert_same_parameters(ours.model, theirs.model)
    start = {k: p.detach() for k, p in tiny_qwen2(tokenizer, seed=0).named_parameters()}
    assert_moved(ours.model, start, at_least=1e-3)

# -- fused=True (the default): the loss step is one fused_policy_loss call ---------------------
# Against stock TRL and against ``fused=False`` (the composed path: `linear_logprobs`, then
# `policy_loss`): the same losses, logged metrics and parameters after training; what cannot
# run fused falls back to the composed path with one warning naming why. And the matmul FLOPs
# of the loss step (``compute_loss`` and its backward) on a head-dominated tiny model, counted
# with a ``TorchDispatchMode``: at most 0.82x stock TRL's.


def _fused_warnings(record):
    return [str(w.message) for w in record if "not fused" in str(w.message)]


@pytest.mark.parametrize("name,overrides", PARITY)
def test_fused_equals_stock_trl(name, overrides, tmp_path, model_dir, tokenizer, fused_calls):
    """grpo_args' num_iterations=2 (or steps_per_generation 4): TRL makes its old-policy pass,
    and every training step's loss is one fused_policy_loss call."""
    theirs, stock_calls = stock_trl(model_dir, tokenizer, tmp_path, overrides)
    assert not fused_calls and not stock_calls  # stock TRL kept its own loss
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = train(GRPOTrainer, model_dir, tokenizer, grpo_args(tmp_path, **overrides))
    assert not _fused_warnings(record)
    assert fused_calls and (all(fused_calls) or name == "eval")  # eval's loss: no grad
    # luspo's and vespo's loss values are sums of +-A lp terms that cancel to 1e-3 .. 1e-7 of
    # the terms: the fused head's lp (|lp| ~ 6, an fp32 ulp 5e-7) rounds apart from TRL's by an
    # ulp, which moves such a sum by up to 1e-6 (their gradients and parameters agree at 1e-5)
    assert_same_logs(ours.state.log_history, theirs.state.log_history, loss_atol=2e-6)
    assert_same_parameters(ours.model, theirs.model)
    assert_moved(ours.model, initial_parameters(model_dir), at_least=1e-4)


@pytest.mark.parametrize("name", EXTRA_OBJECTIVES)
def test_fused_equals_composed(name, tmp_path, model_dir, tokenizer, fused_calls):
    """Objectives, aggregations and KL estimators TRL does not have: fused against
    ``fused=False``."""
    fields = EXTRA_OBJECTIVES[name]

    def run(fused):
        args = grpo_args(tmp_path, beta=fields.get("beta", 0.0))
        return train(GRPOTrainer, model_dir, tokenizer, args,
                     loss_config=PolicyLossConfig(**fields), fused=fused)

    _fused_equals_composed(run, fused_calls)


def _fused_equals_composed(run, fused_calls):
    """``run(fused)`` trains; the fused run (its loss steps fused_policy_loss calls) and the
    composed one log the same values and end at the same parameters. Returns the fused run."""
    composed = run(False)
    assert not fused_calls
    fused = run(True)
    assert fused_calls
    # loss values near 0 (on-policy steps: +-A terms that cancel): see test_fused_equals_stock_trl
    assert_same_logs(fused.state.log_history, composed.state.log_history, loss_atol=2e-6)
    assert_same_parameters(fused.model, composed.model)
    return fused


def _perturbed_trainer(tmp_path, model_dir, tokenizer, cfg, **overrides):
    """A built trainer (not trained) whose policy is moved off the reference (TRL's reference
    model is loaded on its own), in training mode, and one generation batch of it."""
    args = grpo_args(tmp_path, gradient_accumulation_steps=1, **overrides)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=args,
                          train_dataset=prompt_dataset(), processing_class=tokenizer,
                          loss_config=cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(2 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train
    inputs = trainer._generate_and_score_completions(
        next(iter(trainer.get_train_dataloader())))
    return trainer, inputs


def _loss_and_grads(trainer, inputs, fused):
    trainer._fused = fused
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), {k: p.grad.clone() for k, p in trainer.model.named_parameters()}, logged


def _last_hidden64(model, ids, attention, width):
    """``model``'s last hidden states in fp64 at the positions that predict the last ``width``
    tokens, and its head."""
    import copy

    model64 = copy.deepcopy(model).double()
    vars(model64).pop("forward", None)  # accelerate's wrapper, bound to the fp32 original
    out = model64(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    return out.hidden_states[-1][:, -width - 1:-1], model64


def test_exact_kl_against_fp64_oracle(tmp_path, model_dir, tokenizer, fused_calls):
    """kl_estimator="exact" with beta > 0: the reference model's last hidden states come from
    TRL's reference pass (in the generation batch), its head from the reference model; the
    fused step (one fused_policy_loss call) and the composed one (linear_divergence, then
    policy_loss(kl=...)) give the loss, the logged KL and the gradients of an fp64 oracle:
    both models in fp64, the KL from logitless.reference's linear_divergence."""
    from logitless import reference
    from logitless.integrations.trl import REF_HIDDEN_KEY

    cfg = PolicyLossConfig(objective="dapo", beta=1.0, kl_estimator="exact")
    trainer, inputs = _perturbed_trainer(tmp_path, model_dir, tokenizer, cfg, beta=1.0)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    width = inputs["completion_ids"].shape[1]
    mask = inputs["completion_mask"].bool()
    with torch.no_grad():
        ref_h, ref64 = _last_hidden64(trainer.ref_model, ids, attention, width)
    kept = inputs[REF_HIDDEN_KEY]
    assert kept.shape == (*mask.shape, ref_h.shape[-1])
    torch.testing.assert_close(kept[mask].double(), ref_h[mask], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # TRL's forward helper in model calls of 3 rows: 3 + 1 here
        trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attention, width,
                                                   batch_size=3)
    torch.testing.assert_close(trainer._ref_hidden[mask].double(), ref_h[mask], rtol=1e-5,
                               atol=1e-5)

    h, policy64 = _last_hidden64(trainer.model, ids, attention, width)
    w = policy64.lm_head.weight
    kl = reference.linear_divergence(h, w, ref_h, ref64.lm_head.weight, mask, beta=1.0).divergence
    logits = torch.log_softmax(h @ w.T, -1)
    lp = logits.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    ent = -(logits.exp() * logits).sum(-1)
    loss64, _ = policy_loss(lp, inputs["old_per_token_logps"].double(),
                            inputs["advantages"].double(), mask, trainer._config_for(1),
                            entropy=ent, kl=kl, num_items_in_batch=inputs["num_items_in_batch"])
    loss64.backward()
    grads64 = dict(policy64.named_parameters())
    assert float(kl[mask].mean()) > 1e-3  # the policy is off the reference

    for fused in (True, False):
        fused_calls.clear()
        loss, grads, logged = _loss_and_grads(trainer, inputs, fused)
        assert bool(fused_calls) == fused
        # the policy term's +-A lp terms cancel: see test_fused_equals_stock_trl's loss_atol
        assert abs(float(loss) - float(loss64)) <= 1e-5 * abs(float(loss64)) + 2e-6, fused
        assert logged["kl"] == pytest.approx(float(kl[mask].mean()), rel=1e-5)
        for name, g in grads.items():
            g64 = grads64[name].grad
            err = float((g.double() - g64).abs().max() / g64.abs().max())
            assert err <= 1e-5, (fused, name, err)


def test_exact_kl_refused_under_zero3(tmp_path, model_dir, tokenizer, monkeypatch):
    """Under DeepSpeed ZeRO-3 (seen through transformers' switch, as the trainer reads it) the
    exact KL is refused at construction, naming the estimators that work."""
    import transformers.integrations.deepspeed as hf_deepspeed

    monkeypatch.setattr(hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match=r"'exact' is not supported under DeepSpeed ZeRO-3"):
        GRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=grpo_args(tmp_path, beta=0.1),
                    train_dataset=prompt_dataset(), processing_class=tokenizer,
                    loss_config=PolicyLossConfig(kl_estimator="exact"))


def test_exact_kl_refused_with_sync_ref_model(tmp_path, model_dir, tokenizer):
    """TRL's sync_ref_model copies the policy into the reference head in place between the
    reference pass and the loss steps that use its kept hidden states: refused."""
    with pytest.raises(ValueError, match=r"'exact' is not supported with .*sync_ref_model"):
        GRPOTrainer(model=model_dir, reward_funcs=vowel_reward,
                    args=grpo_args(tmp_path, beta=0.1, sync_ref_model=True),
                    train_dataset=prompt_dataset(), processing_class=tokenizer,
                    loss_config=PolicyLossConfig(kl_estimator="exact"))


def test_lora_exact_kl_fused_equals_composed(tmp_path, model_dir, tokenizer, fused_calls):
    """LoRA with the exact KL: the reference is the model with its adapters disabled (TRL's
    reference pass, whose head rows the batch keeps); fused equals composed through training."""
    from peft import LoraConfig

    cfg = PolicyLossConfig(objective="dapo", beta=0.5, kl_estimator="exact")

    def run(fused):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                          task_type="CAUSAL_LM")
        return train(GRPOTrainer, model_dir, tokenizer, grpo_args(tmp_path, beta=0.5),
                     peft_config=lora, loss_config=cfg, fused=fused)

    fused = _fused_equals_composed(run, fused_calls)
    assert any(h.get("kl", 0) > 0 for h in fused.state.log_history)


class _FakeVLLM:
    """Stands in for TRL's ``VLLMGeneration`` (vLLM is not installed here): each completion's
    tokens drawn from the policy's own distribution at its current weights (TRL syncs vLLM's
    weights every step), and as vLLM's logprobs of them the policy's, perturbed as an engine's
    numerics would be (with a None, vLLM's NaN, now and then), so TRL's importance-sampling
    ratios are away from 1 and some are clipped or masked."""

    def __init__(self, model, max_completion_length, **kwargs):
        self.model, self.length = model, max_completion_length
        self.gen = torch.Generator().manual_seed(11)

    def sync_weights(self):
        pass

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        completions, logprobs = [], []
        for prompt in prompts:
            ids = torch.tensor(prompt)[None]
            for _ in range(self.length):
                logits = self.model(input_ids=ids).logits[0, -1].float()
                token = torch.multinomial(logits.softmax(-1), 1, generator=self.gen)
                ids = torch.cat([ids, token[None]], 1)
            tokens = ids[0, len(prompt):]
            lp = torch.log_softmax(self.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(),
                                   -1).gather(-1, tokens[:, None])[:, 0]
            lp = lp + 0.3 * torch.randn(lp.shape, generator=self.gen)
            completions.append(tokens.tolist())
            logprobs.append([[None if float(u) < 0.05 else float(x)]
                             for x, u in zip(lp, torch.rand(lp.shape, generator=self.gen))])
        return prompts, completions, logprobs, None


VLLM_IS = [
    pytest.param(dict(loss_type="dapo", vllm_importance_sampling_mode="token_truncate",
                      vllm_importance_sampling_clip_max=1.5), id="dapo-token-truncate"),
    pytest.param(dict(loss_type="grpo", beta=0.04, vllm_importance_sampling_mode="sequence_mask",
                      vllm_importance_sampling_clip_max=1.5), id="grpo-kl-sequence-mask"),
]


@pytest.mark.parametrize("overrides", VLLM_IS)
def test_vllm_importance_sampling_fused(overrides, tmp_path, model_dir, tokenizer, fused_calls,
                                        monkeypatch):
    """TRL's vLLM importance-sampling correction (``sampling_per_token_logps``, vLLM's
    logprobs, as ``rollout_logprobs``): the fused trainer trains like the composed one and
    like stock TRL (losses, logged metrics, parameters), generating with a stand-in for vLLM."""
    import trl.trainer.grpo_trainer as grpo_module

    monkeypatch.setattr(grpo_module, "VLLMGeneration", _FakeVLLM)
    overrides = dict(overrides, use_vllm=True, vllm_mode="colocate",
                     vllm_importance_sampling_correction=True)

    def run(cls, **kwargs):
        return train(cls, model_dir, tokenizer, grpo_args(tmp_path, **overrides), **kwargs)

    theirs = run(trl.GRPOTrainer)
    composed = run(GRPOTrainer, fused=False)
    assert not fused_calls
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fused = run(GRPOTrainer)
    assert not _fused_warnings(record)
    assert fused_calls and all(fused_calls)
    ratios = [h["sampling/importance_sampling_ratio/min"] for h in theirs.state.log_history
              if "sampling/importance_sampling_ratio/min" in h]
    assert ratios and min(ratios) < 0.9  # the correction is away from 1
    for ours in (fused, composed):
        assert_same_logs(ours.state.log_history, theirs.state.log_history, loss_atol=2e-6)
        assert_same_parameters(ours.model, theirs.model)
    assert_same_logs(fused.state.log_history, composed.state.log_history, loss_atol=2e-6)
    assert_same_parameters(fused.model, composed.model)
    assert_moved(fused.model, initial_parameters(model_dir), at_least=1e-4)


ON_POLICY = [
    pytest.param(dict(loss_type="dapo"), id="dapo"),
    pytest.param(dict(loss_type="grpo", beta=0.04), id="grpo-beta0.04"),
    pytest.param(dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05,
                      use_bias_correction_kl=True), id="gspo-bias-corrected-kl"),
    pytest.param(dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.02),
                 id="dapo-top-entropy-bonus"),
    pytest.param(dict(loss_type="grpo", delta=1.5, off_policy_mask_threshold=0.01),
                 id="grpo-delta-opsm"),
    pytest.param(dict(loss_type="vespo"), id="vespo"),
]


@pytest.mark.parametrize("overrides", ON_POLICY)
def test_on_policy_runs_fused(overrides, tmp_path, model_dir, tokenizer, fused_calls):
    """TRL's default: num_iterations=1 with the accumulation equal to steps_per_generation, so
    TRL makes no old-policy pass (its old logprobs are the current ones, detached). The loss
    is still one fused_policy_loss call (on-policy, ``old_logprobs=None``), with no warning,
    and equals stock TRL's: losses, logged metrics, parameters."""
    overrides = dict(overrides, num_iterations=1)
    theirs = train(trl.GRPOTrainer, model_dir, tokenizer, grpo_args(tmp_path, **overrides))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = train(GRPOTrainer, model_dir, tokenizer, grpo_args(tmp_path, **overrides))
    assert not _fused_warnings(record)
    assert fused_calls and all(fused_calls)
    # loss values near 0 (on-policy steps: +-A terms that cancel): see test_fused_equals_stock_trl
    assert_same_logs(ours.state.log_history, theirs.state.log_history, loss_atol=2e-6)
    assert_same_parameters(ours.model, theirs.model)
    assert_moved(ours.model, initial_parameters(model_dir), at_least=1e-4)


def test_fused_must_be_a_bool(tmp_path, model_dir, tokenizer):
    with pytest.raises(ValueError, match="fused: expected True or False"):
        GRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=grpo_args(tmp_path),
                    train_dataset=prompt_dataset(), processing_class=tokenizer, fused="yes")


# -- matmul FLOPs of the loss step ---------------------------------------------------------

def _counting(cls):
    """``cls`` counting matmul FLOPs in each training step's ``compute_loss`` and backward
    (not in generation or TRL's old-policy and reference passes, made in `_prepare_inputs`)."""

    class Counting(cls):
        flops: list

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.counter.counting = True
            with self.counter:
                out = super().training_step(model, inputs, num_items_in_batch)
            self.flops.append(self.counter.flops)
            self.counter.flops = 0
            return out

        def _prepare_inputs(self, generation_batch):
            self.counter.counting = False
            try:
                return super()._prepare_inputs(generation_batch)
            finally:
                self.counter.counting = True

    return Counting


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory):
    """The issue's head-dominated model: a word-level tokenizer of V=4099, hidden 32."""
    tok = tiny.tokenizer(4099)
    path = tmp_path_factory.mktemp("tiny-qwen2-v4099")
    tiny.qwen2(tok, hidden=32).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


@pytest.mark.parametrize("num_iterations", [1, 2], ids=["on-policy", "old-policy-pass"])
@pytest.mark.parametrize("overrides", [dict(loss_type="dapo"),
                                       dict(loss_type="grpo", beta=0.04)],
                         ids=["dapo", "grpo-beta0.04"])
def test_loss_step_matmul_flops(overrides, num_iterations, tmp_path, wide_vocab_dir):
    """8 completions of 62 tokens, one optimizer step: the fused loss step does at most 0.82x
    the matmul FLOPs of stock TRL's (its chunked head: 4 GEMM passes; fused: 3), in TRL's
    default (``num_iterations=1``: no old-policy pass, the loss on-policy) and with TRL's
    old-policy pass."""
    path, tok = wide_vocab_dir
    args = dict(per_device_train_batch_size=8, num_generations=8, max_completion_length=62,
                gradient_accumulation_steps=1, num_iterations=num_iterations, max_steps=1,
                **overrides)
    flops = {}
    for name, cls in (("stock", trl.GRPOTrainer), ("fused", GRPOTrainer)):
        counting = _counting(cls)
        counting.counter, counting.flops = MatmulFlops(), []
        trainer = counting(model=path, reward_funcs=vowel_reward,
                           args=grpo_args(tmp_path / name, **args),
                           train_dataset=prompt_dataset(), processing_class=tok)
        trainer.train()
        flops[name] = sum(counting.flops)
    assert flops["stock"] > 0
    assert flops["fused"] <= 0.82 * flops["stock"], flops


# Two GRPO configurations of the FSDP2 trainer run: TRL's default loss on-policy (no old-policy
# pass), and DAPO with a KL term and TRL's old-policy pass (num_iterations=2).
_FSDP2_CONFIGS = (dict(num_iterations=1, gradient_accumulation_steps=1),
                  dict(loss_type="dapo", beta=0.04, num_iterations=2))


def _fsdp2_trainer_worker(rank, world, model_dir, tokenizer, out_dir):
    """One rank of `test_fsdp2_trainer_fused_equals_composed`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    for i, overrides in enumerate(_FSDP2_CONFIGS):
        args = grpo_args(f"{out_dir}/{rank}-{i}", **overrides)
        trainers = {fused: GRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=args,
                                       train_dataset=prompt_dataset(),
                                       processing_class=tokenizer, fused=fused)
                    for fused in (True, False)}
        # each rank generates its own batch (own seed), before the head is sharded: generation
        # runs the head module, FSDP2's gathers, a count of calls each rank would have its own
        torch.manual_seed(100 + rank)
        first = trainers[False]
        first.model.train()
        inputs = first._generate_and_score_completions(next(iter(first.get_train_dataloader())))
        results = {}
        for fused, trainer in trainers.items():
            fully_shard(trainer.model.lm_head, mesh=init_device_mesh("cpu", (world,)))
            assert type(trainer.model.lm_head.weight).__name__ == "DTensor"
            trainer.model.train()
            trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
            trainer._metrics["train"].clear()  # the generation's, logged by one of the two
            calls, gathers = [], []
            inner, full = trl_module._FusedLoss.apply, DTensor.full_tensor
            trl_module._FusedLoss.apply = lambda self, *a, _i=inner, _c=calls, **k: (
                _c.append(1), _i(self, *a, **k))[1]
            DTensor.full_tensor = lambda self, *a, _g=gathers, _f=full, **k: (
                _g.append(1), _f(self, *a, **k))[1]
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    loss = trainer.compute_loss(trainer.model, inputs)
                    loss.backward()
            finally:
                trl_module._FusedLoss.apply, DTensor.full_tensor = inner, full
            assert not gathers  # the head stayed sharded
            fallbacks = [str(w.message) for w in caught if "not fused" in str(w.message)]
            # the fused trainer ran the loss as one fused_policy_loss call, without a fallback
            assert (fallbacks, len(calls)) == (([], 1) if fused else ([], 0)), (fallbacks, calls)
            grads = {}
            for name, param in trainer.model.named_parameters():
                grad = param.grad
                # the head's gradient stays sharded: this rank's rows
                grads[name] = grad.to_local() if type(grad).__name__ == "DTensor" else grad
            results[fused] = (loss.detach(), grads, {k: v[-1] for k, v in
                                                     trainer._metrics["train"].items()})
        (loss, grads, logged), (loss_c, grads_c, logged_c) = results[True], results[False]
        torch.testing.assert_close(loss, loss_c, rtol=1e-5, atol=1e-7)
        assert grads.keys() == grads_c.keys()
        for name, grad in grads_c.items():
            err = float((grads[name] - grad).abs().max() / grad.abs().max().clamp(min=1e-30))
            assert err <= 1e-5, (i, name, err)
        assert grads_c["lm_head.weight"].abs().max() > 0
        for key, value in logged_c.items():
            assert abs(logged[key] - value) <= 1e-5 * abs(value) + 1e-7, (i, key)


@pytest.mark.dist
def test_fsdp2_trainer_fused_equals_composed(model_dir, tokenizer, tmp_path):
    """Our `GRPOTrainer` with its head sharded by FSDP2 (``fully_shard(model.lm_head)``) on two
    gloo ranks, each rank its own batch: the fused loss runs (no fallback warning) with the
    head sharded and gives the composed path's loss, logged metrics and gradients, the head's
    (each rank's shard: FSDP2's mean over the ranks) and the backbone's (each rank's own)."""
    run_on_gloo(2, _fsdp2_trainer_worker, model_dir, tokenizer, str(tmp_path))
