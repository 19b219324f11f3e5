"""policy_loss against TRL 1.16's own GRPOTrainer._compute_loss (and GMPO's), called on the same
tensors: loss and gradients to 1e-10 relative in fp64, logged metrics to 1e-6.

The trainer is an uninitialised instance (no model, no accelerate launch) carrying only the
attributes `_compute_loss` reads; its forward helper is replaced by one returning our tensors.
"""

import math
import zlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from logitless import PolicyLossConfig, policy_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
GRPOTrainer = trl_grpo.GRPOTrainer
GRPOConfig = pytest.importorskip("trl").GRPOConfig

from logitless.integrations.trl import config_from_grpo  # noqa: E402

B, T, GA = 6, 9, 2


class _SingleProcess:
    """accelerate's collectives on one process (num_processes is what the loss divides by)."""

    process_index = 0
    sync_gradients = True
    device = torch.device("cpu")

    def __init__(self, num_processes):
        self.num_processes = num_processes

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def make_trainer(cls=GRPOTrainer, *, num_processes=2, **attrs):
    trainer = object.__new__(cls)
    args = SimpleNamespace(
        use_bias_correction_kl=False,
        delta=None,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=GA,
    )
    for key in list(attrs):
        if key in vars(args):
            setattr(args, key, attrs.pop(key))
    state = dict(
        args=args,
        accelerator=_SingleProcess(num_processes),
        model=SimpleNamespace(training=True),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=0.0,
        loss_type="grpo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=GA,
        max_completion_length=T + 3,
        _entropy_bonus_enabled=False,
        use_adaptive_entropy=False,
        entropy_coef=0.0,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    state.update(attrs)
    state["_entropy_bonus_enabled"] = state["entropy_coef"] != 0.0
    trainer.__dict__.update(state)
    return trainer


def make_batch(seed, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0  # a sequence with no valid token
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    lp = old + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lp = lp.clamp(max=-1e-3)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    # fp32-representable entropies: TRL takes its quantile in fp32. The tests' quantiles keep
    # (n - 1)(1 - q) away from integers, where fp32 and fp64 round the boundary differently.
    entropy = (torch.rand(B, T, generator=g) * 2).double()
    adv_shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(adv_shape, generator=g, dtype=torch.float64)
    return SimpleNamespace(
        lp=lp, old=old, ref=ref, sampling=sampling, entropy=entropy, adv=adv, mask=mask
    )


def run_trl(trainer, batch, **extra_inputs):
    lp = batch.lp.clone().requires_grad_()
    entropy = batch.entropy.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (lp, entropy, None)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": batch.mask,
        "advantages": batch.adv,
        "old_per_token_logps": batch.old,
        "ref_per_token_logps": batch.ref,
        "num_items_in_batch": batch.mask.sum() * 3,
        **extra_inputs,
    }
    loss = type(trainer)._compute_loss(trainer, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grad_h = entropy.grad if entropy.grad is not None else torch.zeros_like(entropy)
    return loss.detach(), lp.grad, grad_h, metrics


def run_ours(config, batch, **kwargs):
    lp = batch.lp.clone().requires_grad_()
    entropy = batch.entropy.clone().requires_grad_()
    loss, metrics = policy_loss(
        lp,
        batch.old,
        batch.adv,
        batch.mask,
        config,
        ref_logprobs=batch.ref,
        entropy=entropy,
        num_items_in_batch=batch.mask.sum() * 3,
        **kwargs,
    )
    loss.backward()
    grad_h = entropy.grad if entropy.grad is not None else torch.zeros_like(entropy)
    return loss.detach(), lp.grad, grad_h, metrics


def assert_rel(ours, theirs, tol, name):
    scale = theirs.abs().max().clamp(min=1e-30)
    err = (ours - theirs).abs().max() / scale
    assert err <= tol, f"{name}: relative error {float(err):.3e}"


TRL_METRICS = {
    "kl": "kl",
    "entropy": "entropy/mean",
    "clip_ratio/low_mean": "clip_ratio/low",
    "clip_ratio/high_mean": "clip_ratio/high",
    "clip_ratio/region_mean": "clip_ratio/region",
    "cispo_clip_ratio": "clip_ratio/high",
}


def compare(trainer, config, batch, trl_inputs=None, our_kwargs=None):
    loss_t, g_t, gh_t, met_t = run_trl(trainer, batch, **(trl_inputs or {}))
    loss_o, g_o, gh_o, met_o = run_ours(config, batch, **(our_kwargs or {}))
    assert_rel(loss_o, loss_t, 1e-10, "loss")
    assert_rel(g_o, g_t, 1e-10, "d loss / d logprobs")
    assert_rel(gh_o, gh_t, 1e-10, "d loss / d entropy")
    checked = 0
    for trl_name, our_name in TRL_METRICS.items():
        if trl_name in met_t:
            assert abs(float(met_o[our_name]) - met_t[trl_name]) <= 1e-6, trl_name
            checked += 1
    assert checked >= 1


def our_config(loss_type, *, epsilon=0.2, epsilon_high=None, level="token", **trl_fields):
    """Our config for the same TRL settings, through the public translation (the trainer's
    world size is 2 here: ``num_processes`` of `_SingleProcess`)."""
    args = GRPOConfig(
        output_dir="unused",
        bf16=False,
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        importance_sampling_level=level,
        gradient_accumulation_steps=GA,
        max_completion_length=T + 3,
        **trl_fields,
    )
    return config_from_grpo(args, dp_size=2)

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_types(loss_type, level):
    if loss_type == "vespo" and level == "sequence":
        pytest.skip("TRL's vespo computes its own sequence weights from token ratios")
    eps_high = 4.0 if loss_type == "cispo" else 0.28
    batch = make_batch(zlib.crc32(f"{loss_type}-{level}".encode()) % 1000)
    trainer = make_trainer(
        loss_type=loss_type, importance_sampling_level=level, epsilon_low=0.2, epsilon_high=eps_high
    )
    config = our_config(loss_type, epsilon_high=eps_high, level=level)
    compare(trainer, config, batch)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize(
    "option",
    [
        "delta",
        "beta",
        "beta_bias_corrected",
        "top_entropy",
        "entropy_bonus",
        "off_policy_mask",
        "per_token_adv",
        "top_entropy_zero",
    ],
)
def test_options(loss_type, option):
    batch = make_batch(7 + len(option), per_token_adv=option == "per_token_adv")
    eps_high = 4.0 if loss_type == "cispo" else 0.28
    trl_kw, our_call = {}, {}
    if option == "delta":
        trl_kw = dict(delta=1.5)
        batch.lp = batch.old + 0.6 * torch.randn_like(batch.old)  # ratios beyond delta
        batch.lp = batch.lp.clamp(max=-1e-3)
    elif option.startswith("beta"):
        trl_kw = dict(beta=0.07, use_bias_correction_kl=option == "beta_bias_corrected")
    elif option == "top_entropy":
        trl_kw = dict(top_entropy_quantile=0.37)
    elif option == "top_entropy_zero":  # TRL: "0.0 masks all but the highest entropy token"
        trl_kw = dict(top_entropy_quantile=0.0)
    elif option == "entropy_bonus":
        trl_kw = dict(entropy_coef=0.03, top_entropy_quantile=0.61)
    elif option == "off_policy_mask":
        trl_kw = dict(off_policy_mask_threshold=0.05)
        our_call = dict(rollout_logprobs=batch.sampling)
    trainer = make_trainer(loss_type=loss_type, epsilon_high=eps_high, **trl_kw)
    config = our_config(loss_type, epsilon_high=eps_high, **trl_kw)
    trl_inputs = {"sampling_per_token_logps": batch.sampling} if option == "off_policy_mask" else {}
    compare(trainer, config, batch, trl_inputs, our_call)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("epsilon_high", [0.5, 0.9, 1.0, 5.0])
def test_cispo_cap_is_trl_epsilon_high(epsilon_high, level):
    """TRL's cispo weight is ``min(r, epsilon_high)`` for any epsilon_high, below 1 included;
    its ``epsilon`` is read by no other part of the cispo loss (here -1, which TRL runs with)."""
    batch = make_batch(int(epsilon_high * 10) + len(level))
    batch.lp = (batch.old + 0.5 * torch.randn_like(batch.old)).clamp(max=-1e-3)
    if level == "sequence":
        # TRL's cispo_clip_ratio counts an empty sequence (ratio exp(0) = 1) as clipped when
        # the cap is below 1; ours flags no empty sequence (it has no ratio). The loss agrees.
        batch.mask[2, 0] = 1
    trainer = make_trainer(loss_type="cispo", importance_sampling_level=level, epsilon_low=-1.0,
                           epsilon_high=epsilon_high)
    config = our_config("cispo", epsilon=-1.0, epsilon_high=epsilon_high, level=level)
    assert (config.cispo_clip, config.cispo_cap) == ("upper", epsilon_high)
    compare(trainer, config, batch)
    _, _, _, metrics = run_trl(trainer, batch)
    assert 0 < metrics["cispo_clip_ratio"] < 1 or epsilon_high == 5.0  # the cap is reached


def test_cispo_epsilon_high_defaults_to_epsilon():
    config = our_config("cispo", epsilon=0.3)
    assert config.cispo_cap == 0.3


# Settings GRPOConfig and TRL's loss accept, each of which we must accept with TRL's numbers.
TRL_ACCEPTS = {
    "epsilon_above_1": ("dapo", dict(epsilon=1.5, epsilon_high=0.28)),
    "epsilon_high_0": ("dapo", dict(epsilon_high=0.0)),
    "cispo_cap_0": ("cispo", dict(epsilon_high=0.0)),
    "delta_below_1_plus_eps": ("grpo", dict(delta=1.1)),
    "negative_entropy_coef": ("grpo", dict(entropy_coef=-0.02)),
    "negative_opsm_threshold": ("dapo", dict(off_policy_mask_threshold=-0.01)),
    "vespo_negative_k": ("vespo", dict(vespo_k_pos=-1.0, vespo_lambda_neg=0.0)),
}


@pytest.mark.parametrize("case", sorted(TRL_ACCEPTS))
def test_accepts_what_trl_accepts(case):
    loss_type, trl_fields = TRL_ACCEPTS[case]
    batch = make_batch(zlib.crc32(case.encode()) % 1000)
    config = our_config(loss_type, **trl_fields)
    attrs = dict(trl_fields)
    epsilon = attrs.pop("epsilon", 0.2)
    trainer = make_trainer(loss_type=loss_type, epsilon_low=epsilon,
                           epsilon_high=attrs.pop("epsilon_high", epsilon), **attrs)
    opsm = "off_policy_mask_threshold" in attrs
    trl_inputs = {"sampling_per_token_logps": batch.sampling} if opsm else {}
    compare(trainer, config, batch, trl_inputs, dict(rollout_logprobs=batch.sampling) if opsm
            else None)


# Settings TRL runs with that have no meaning as a loss: refused, naming TRL's argument.
TRL_REFUSED = {
    "epsilon": ("grpo", dict(epsilon=-0.1)),
    "epsilon_high": ("dapo", dict(epsilon_high=float("nan"))),
    "epsilon_high ": ("cispo", dict(epsilon_high=-1.0)),  # a negative weight
    "beta": ("grpo", dict(beta=-0.04)),
    "delta": ("grpo", dict(delta=0.9)),
    "sapo_temperature_pos": ("sapo", dict(sapo_temperature_pos=0.0)),
    "vespo_lambda_pos": ("vespo", dict(vespo_lambda_pos=float("inf"))),
    "top_entropy_quantile": ("grpo", dict(top_entropy_quantile=1.5)),
    "entropy_coef": ("grpo", dict(entropy_coef=float("nan"))),
    "off_policy_mask_threshold": ("grpo", dict(off_policy_mask_threshold=float("nan"))),
    "vllm_importance_sampling_mode": ("grpo", dict(
        use_vllm=True, vllm_importance_sampling_mode="token")),
}


@pytest.mark.parametrize("argument", sorted(TRL_REFUSED))
def test_refusals_name_trl_argument(argument):
    loss_type, trl_fields = TRL_REFUSED[argument]
    with pytest.raises(ValueError, match=rf"^GRPOConfig\.{argument.strip()}: "):
        our_config(loss_type, **trl_fields)


def test_refused_override_names_our_field():
    args = GRPOConfig(output_dir="unused", bf16=False)
    with pytest.raises(ValueError, match=r"^PolicyLossConfig\.eps_low: "):
        config_from_grpo(args, eps_low=-0.1)


def loss_inputs(batch, num_items):
    return {"prompt_ids": torch.zeros(B, 1, dtype=torch.long),
            "prompt_mask": torch.ones(B, 1, dtype=torch.long),
            "completion_ids": torch.zeros(B, T, dtype=torch.long),
            "completion_mask": batch.mask, "advantages": batch.adv,
            "old_per_token_logps": batch.old, "num_items_in_batch": num_items}


def our_trainer_loss(trainer, batch, num_items):
    """logitless's GRPOTrainer._compute_loss on the state `make_trainer` gives TRL's."""
    from logitless.integrations.trl import GRPOTrainer as OurTrainer

    ours = make_trainer(OurTrainer, loss_type=trainer.loss_type,
                        epsilon_high=trainer.epsilon_high,
                        steps_per_generation=trainer.args.steps_per_generation)
    ours.args.gradient_accumulation_steps = GA
    ours.__dict__.update(
        loss_config=our_config(trainer.loss_type, epsilon_high=trainer.epsilon_high),
        _configs={}, _entropy_control=None, _sampler=None,
        state=SimpleNamespace(max_steps=1, global_step=0))
    lp = batch.lp.clone().requires_grad_()
    ours._get_per_token_logps_and_entropies = lambda *a, **k: (lp, batch.entropy, None)
    inputs = loss_inputs(batch, num_items)
    loss = OurTrainer._compute_loss(ours, None, inputs)
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("case", ["one_token", "no_token"])
def test_trainer_token_count_clamped_before_rescaling(case):
    """TRL clamps ``num_items_in_batch`` at 1 and then rescales it to one accumulation window
    (``* GA / steps_per_generation``), so a small count gives a normaliser below 1; a batch of
    empty completions (count 0) has loss 0."""
    batch = make_batch(5)
    batch.mask = torch.zeros_like(batch.mask)
    if case == "one_token":
        batch.mask[1, 0] = 1
    num_items = batch.mask.sum()
    trainer = make_trainer(loss_type="dapo", epsilon_high=0.28, steps_per_generation=4 * GA)
    lp = batch.lp.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (lp, batch.entropy, None)
    inputs = loss_inputs(batch, num_items)
    want = GRPOTrainer._compute_loss(trainer, None, inputs)
    want.backward()
    ours = our_trainer_loss(trainer, batch, num_items)
    assert_rel(ours[0], want.detach(), 1e-12, "loss")
    assert_rel(ours[1], lp.grad, 1e-12, "d loss / d logprobs")
    assert (float(want.detach()) != 0) == (case == "one_token")


def test_gmpo():
    gmpo = pytest.importorskip("trl.experimental.gmpo.gmpo_trainer")
    for seed, extra in [(1, {}), (2, dict(beta=0.05)), (3, dict(top_entropy_quantile=0.53))]:
        batch = make_batch(seed)
        batch.mask[2, 0] = 1  # TRL's GMPO counts an empty sequence as -A; we do not (see notes)
        trainer = make_trainer(gmpo.GMPOTrainer, epsilon_low=0.4, epsilon_high=0.3, **extra)
        config = PolicyLossConfig(
            objective="gmpo", eps_low=0.4, eps_high=0.3, grad_accum_steps=GA, **extra
        )
        compare(trainer, config, batch)


def trl_generation(trainer, batch, nan_tokens):
    """Run TRL's `_generate_and_score_completions` on stubbed generation and rewards: it computes
    the vLLM importance-sampling ratio from our old and sampling logprobs."""
    lengths = batch.mask.sum(-1).tolist()
    sampling = [
        [None if (i, j) in nan_tokens else float(batch.sampling[i, j]) for j in range(n)]
        for i, n in enumerate(lengths)
    ]
    completion_ids = [[1] * n for n in lengths]
    trainer._generate = lambda prompts: (
        [[0]] * B,
        completion_ids,
        None,
        ["c"] * B,
        sampling,
        {},
        None,
        None,
    )
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (batch.old, None, None)
    trainer._calculate_rewards = lambda *a: torch.arange(B, dtype=torch.float64)[:, None]
    trainer.__dict__.update(
        environment_factories=None,
        tools=None,
        environments=[],
        pad_to_multiple_of=None,
        _tokenizer=SimpleNamespace(pad_token_id=0),
        mask_truncated_completions=False,
        num_iterations=1,
        num_generations=B,
        multi_objective_aggregation="sum_then_normalize",
        reward_weights=torch.ones(1),
        scale_rewards="group",
        reward_func_names=["r"],
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
        },
        _pending_extra_logs={},
        _pending_metrics={},
        log_multimodal=False,
    )
    trainer.model.is_gradient_checkpointing = False
    trainer.args.per_device_train_batch_size = B
    trainer.args.gradient_accumulation_steps = GA
    trainer.args.gradient_checkpointing_kwargs = None
    return GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": "p"}] * B)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo", "vespo"])
@pytest.mark.parametrize(
    "mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
def test_vllm_importance_sampling(loss_type, mode):
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL rejects vespo with sequence-level vLLM IS")
    clip_min, clip_max = (0.8, 1.1) if mode.startswith("token") else (0.5, 1.3)
    check_vllm_importance_sampling(loss_type, mode, clip_min, clip_max)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_mask"])
def test_vllm_importance_sampling_negative_clip_min(mode):
    """TRL accepts a negative lower bound (it bounds no ratio); so do we."""
    check_vllm_importance_sampling("dapo", mode, -0.5, 1.1)


def check_vllm_importance_sampling(loss_type, mode, clip_min, clip_max):
    batch = make_batch(11)
    # fp32-representable: TRL builds the sampling logprobs with torch.tensor (default dtype)
    batch.sampling = (batch.old + 0.15 * torch.randn_like(batch.old)).float().double()
    vllm = dict(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    trainer = make_trainer(loss_type=loss_type, epsilon_high=0.28, **vllm)
    nan_tokens = {(0, 0), (3, 1)}
    out = trl_generation(trainer, batch, nan_tokens)
    rollout = batch.sampling.clone()
    for i, j in nan_tokens:
        rollout[i, j] = float("nan")
    config = our_config(loss_type, epsilon_high=0.28, **vllm)
    trl_inputs = {
        "importance_sampling_ratio": out["importance_sampling_ratio"],
        "sampling_per_token_logps": out["sampling_per_token_logps"],
    }
    compare(trainer, config, batch, trl_inputs, dict(rollout_logprobs=rollout))
    _, _, _, ours = run_ours(config, batch, rollout_logprobs=rollout)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for stat in ("min", "mean", "max"):
        theirs = logged[f"sampling/importance_sampling_ratio/{stat}"]
        assert abs(float(ours[f"is_weight/{stat}"]) - theirs) <= 1e-6, stat


def _our_loss_metrics(batch, fields, **extra_inputs):
    """logitless's GRPOTrainer._compute_loss (dapo, TRL's ``fields``) on ``batch``; its log."""
    from logitless.integrations.trl import GRPOTrainer as OurTrainer

    ours = make_trainer(OurTrainer, loss_type="dapo", epsilon_high=0.28, **fields)
    ours.args.gradient_accumulation_steps = GA
    ours.__dict__.update(
        loss_config=our_config("dapo", epsilon_high=0.28, **fields), _configs={},
        _entropy_control=None, _sampler=None, state=SimpleNamespace(max_steps=1, global_step=0))
    lp = batch.lp.clone().requires_grad_()
    ours._get_per_token_logps_and_entropies = lambda *a, **k: (lp, batch.entropy, None)
    inputs = loss_inputs(batch, batch.mask.sum())
    inputs.update(extra_inputs)
    OurTrainer._compute_loss(ours, None, inputs).backward()
    return {k: v[-1] for k, v in ours._metrics["train"].items()}


def test_adapter_logs_mismatch_metrics():
    """With vLLM's logprobs in the batch (TRL's ``sampling_per_token_logps``, NaN where vLLM
    did not score a token), logitless's GRPOTrainer logs ``logitless/mismatch/*`` from the old
    policy's logprobs (the trainer's, at the weights that generated) against vLLM's, over the
    loss mask less the NaN tokens; the mean and max |d| are TRL's own
    ``sampling/sampling_logp_difference``."""
    batch = make_batch(17)
    batch.mask[0] = 1  # a full-length completion: TRL pads the generation to T
    batch.sampling = (batch.old + 0.08 * torch.randn_like(batch.old)).float().double()
    vllm = dict(use_vllm=True, vllm_importance_sampling_correction=True,
                vllm_importance_sampling_mode="token_truncate",
                vllm_importance_sampling_clip_min=0.0, vllm_importance_sampling_clip_max=2.0)
    trainer = make_trainer(loss_type="dapo", epsilon_high=0.28, **vllm)
    nan_tokens = {(0, 0), (3, 1)}
    out = trl_generation(trainer, batch, nan_tokens)
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    logged = _our_loss_metrics(batch, vllm,
                               importance_sampling_ratio=out["importance_sampling_ratio"],
                               sampling_per_token_logps=out["sampling_per_token_logps"])

    ds = [float(batch.old[i, j]) - float(batch.sampling[i, j])
          for i, j in batch.mask.nonzero().tolist() if (i, j) not in nan_tokens]
    want = {
        "abs_diff/mean": sum(abs(d) for d in ds) / len(ds),
        "abs_diff/max": max(abs(d) for d in ds),
        "kl_k1": sum(-d for d in ds) / len(ds),
        "kl_k3": sum(math.exp(d) - 1 - d for d in ds) / len(ds),
        "ratio_outside": sum(not 0.9 <= math.exp(d) <= 1.1 for d in ds) / len(ds),
    }
    assert 0 < want["ratio_outside"] < 1
    for name, value in want.items():
        assert logged[f"logitless/mismatch/{name}"] == pytest.approx(value, rel=1e-6), name
    for stat in ("mean", "max"):
        assert logged[f"logitless/mismatch/abs_diff/{stat}"] == pytest.approx(
            theirs[f"sampling/sampling_logp_difference/{stat}"], rel=1e-6), stat


def test_adapter_logs_no_mismatch_metrics_without_engine_logprobs():
    logged = _our_loss_metrics(make_batch(18), {})
    assert "logitless/approx_kl" in logged
    assert not any(k.startswith("logitless/mismatch/") for k in logged)


def test_adaptive_entropy_coefficient():
    """Three optimizer steps of GA micro-batches: TRL's controller state and our
    AdaptiveEntropyCoef agree, and so do the losses that use them."""
    from logitless import AdaptiveEntropyCoef

    target, delta, coef_max = 1.0, 0.01, 0.035
    trainer = make_trainer(
        loss_type="dapo",
        epsilon_high=0.28,
        use_adaptive_entropy=True,
        entropy_coef=0.02,
        top_entropy_quantile=0.63,
    )
    trainer.__dict__.update(
        _entropy_bonus_enabled=True, _last_world_entropy=float("inf"), _entropy_window_stats=None
    )
    trainer.args.__dict__.update(
        entropy_target=target,
        entropy_coef_delta=delta,
        entropy_coef_min=0.0,
        entropy_coef_max=coef_max,
    )
    controller = AdaptiveEntropyCoef(0.02, target, delta, coef_min=0.0, coef_max=coef_max)
    config = our_config("dapo", epsilon_high=0.28, top_entropy_quantile=0.63)
    applied = []
    for step, scale in enumerate((0.5, 0.6, 1.6)):  # low, low, then high entropy
        for micro in range(GA):
            batch = make_batch(100 + 10 * step + micro)
            batch.entropy = (batch.entropy * scale).float().double()  # TRL: fp32 quantile
            trainer.accelerator.sync_gradients = micro == GA - 1
            applied.append(controller.current())
            compare(trainer, config, batch, our_kwargs=dict(entropy_coef=controller.current()))
            _, _, _, metrics = run_ours(config, batch, entropy_coef=controller.current())
            controller.observe(metrics)
        controller.step()
        assert abs(trainer.entropy_coef - controller.coef) < 1e-12
        assert abs(trainer._last_world_entropy - controller.last_entropy) < 1e-12
    assert applied == [0.0, 0.0, 0.03, 0.03, 0.035, 0.035]  # the gate and both directions act
