"""``GRPOTrainer(match_sampler=True)``: the policy and old-policy logprobs (and entropies) are
those of the distribution the generation backend samples from, checked against the fp64
sampler oracle (``logitless.reference.sampler``, which follows vLLM's V1 sampler) on the same
model's hidden states; the reference model's stay untruncated; what cannot be honoured is
refused at construction.
"""

import math
import os
import re
import warnings

import pytest
import torch

from integrations.test_trl_trainer import (  # noqa: F401 (fused_calls, wide_vocab_dir: fixtures)
    MatmulFlops,
    _counting,
    assert_same_logs,
    assert_same_parameters,
    fused_calls,
    wide_vocab_dir,
)
from logitless.reference.sampler import sampler_logprobs

from tiny_models import (
    RecordingHeadCalls,
    prompt_dataset,
    tiny_qwen2,
    tiny_tokenizer,
    vowel_reward,
)

trl = pytest.importorskip("trl", reason="TRL is installed by `make test`")

from logitless.integrations.sampler_config import (  # noqa: E402
    SamplerTruncation,
    drop_outside_kept,
)
from logitless.integrations.trl import GRPOTrainer, sampler_from_grpo  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEMPERATURE, TOP_K, TOP_P = 0.7, 8, 0.9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, tokenizer): a path, as TRL builds the reference model from it."""
    tokenizer = tiny_tokenizer()
    path = tmp_path_factory.mktemp("tiny-qwen2-sampler")
    tiny_qwen2(tokenizer).save_pretrained(path)
    return str(path), tokenizer


# gradient_accumulation_steps=2 with num_iterations=2: TRL makes an old-policy pass.
BASE_ARGS = dict(
    per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=1,
    gradient_accumulation_steps=2, num_iterations=2, learning_rate=0.5, optim="sgd",
    logging_steps=1, report_to=[], bf16=False, use_cpu=True, seed=0, save_strategy="no",
    disable_tqdm=True, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
)


def grpo_args(tmp_path, **overrides):
    return trl.GRPOConfig(output_dir=str(tmp_path), **{**BASE_ARGS, **overrides})


def make_trainer(cls, tiny, args, **kwargs):
    model_dir, tokenizer = tiny
    return cls(model=model_dir, reward_funcs=vowel_reward, args=args,
               train_dataset=prompt_dataset(4), processing_class=tokenizer, **kwargs)


class Recording(RecordingHeadCalls, GRPOTrainer):
    """Keeps, for every forward-helper call, what the head returned and the oracle of the
    same call: the fp64 sampler-matched and full-distribution logprobs and entropies computed
    from the model's own final hidden states and LM head at that moment."""

    def oracle(self, h, w, bias, y, model, kwargs):
        # TRL without vLLM samples with transformers' generate and its rules
        matched = sampler_logprobs(h, w, y, temperature=TEMPERATURE, top_k=TOP_K,
                                   top_p=TOP_P, min_p=self.args.min_p or None,
                                   sampler="transformers")
        return dict(matched=matched, full=sampler_logprobs(h, w, y, temperature=TEMPERATURE))


def _close(actual, expected, mask, name):
    a, e = actual[mask].double(), expected[mask]
    assert torch.isfinite(e).all(), f"{name}: a sampled token outside the oracle's kept set"
    torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["reference-model", "lora"])
def test_match_sampler_logprobs_are_the_samplers_truncated_distribution(tiny, tmp_path, lora):
    """With LoRA the reference pass is the policy model with its adapter disabled, inside
    TRL's ``use_adapter`` block."""
    kwargs = {}
    if lora:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                           task_type="CAUSAL_LM")
    # the composed head (fused=False), whose policy calls Recording sees; the fused loss step
    # equals it (test_match_sampler_runs_fused)
    trainer = make_trainer(Recording, tiny, grpo_args(tmp_path, beta=0.05), match_sampler=True,
                           fused=False, **kwargs)
    trainer.train()
    policy = [c for c in trainer.calls if not c["reference"] and c["grad"]]
    old = [c for c in trainer.calls if not c["reference"] and not c["grad"]]
    ref = [c for c in trainer.calls if c["reference"]]
    assert policy and old and ref
    for c in policy + old:
        _close(c["logps"], c["matched"]["logprobs"], c["mask"], "logprobs")
    for c in policy:
        _close(c["entropy"], c["matched"]["entropy"], c["mask"], "entropy")
    for c in ref:  # the KL's reference is the reference model's full tempered distribution
        _close(c["logps"], c["full"]["logprobs"], c["mask"], "reference logprobs")
    # the truncation changed the numbers: the kept mass is well below 1
    c = policy[0]
    assert float(c["matched"]["log_kept_mass"][c["mask"]].max()) < -0.05
    logged = trainer.state.log_history[0]
    assert logged["logitless/sampler/outside_kept"] == 0.0
    assert math.isfinite(logged["loss"])


def test_match_sampler_min_p_after_top_p_under_generate(tiny, tmp_path):
    """transformers' generate applies min-p last, on the top-k / top-p survivors: the head
    follows it (``sampler="transformers"``), and every token generate drew is in the set."""
    trainer = make_trainer(Recording, tiny, grpo_args(tmp_path, min_p=0.3), match_sampler=True)
    trainer.train()
    calls = [c for c in trainer.calls if not c["reference"]]
    assert calls
    for c in calls:
        _close(c["logps"], c["matched"]["logprobs"], c["mask"], "logprobs")
    assert trainer.state.log_history[0]["logitless/sampler/outside_kept"] == 0.0


def test_without_match_sampler_the_head_is_untruncated(tiny, tmp_path):
    """The composed head (``fused=False``, whose per-token calls ``Recording`` sees) scores the
    untruncated softmax; the fused step (the default) has no truncation to apply."""
    args = grpo_args(tmp_path, num_iterations=1, gradient_accumulation_steps=1)
    trainer = make_trainer(Recording, tiny, args, fused=False)
    trainer.train()
    assert trainer.calls
    for c in trainer.calls:
        _close(c["logps"], c["full"]["logprobs"], c["mask"], "logprobs")
    assert "logitless/sampler/outside_kept" not in trainer.state.log_history[0]


def train_fused_and_composed(make, calls):
    """Train ``make(fused)``'s trainer composed (``fused=False``: no fused call in ``calls``,
    the `fused_calls` spy) and fused (every loss step one fused_policy_loss call, no fallback
    warning); returns ``(fused, composed)``."""
    composed = make(False)
    composed.train()
    assert not calls
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fused = make(True)
        fused.train()
    assert not [str(w.message) for w in record if "not fused" in str(w.message)]
    assert calls and all(calls)
    return fused, composed


FUSED_CASES = [
    pytest.param(dict(beta=0.05), {}, None, id="untruncated-reference"),
    pytest.param(dict(beta=0.05, min_p=0.3, max_steps=3), dict(truncate_reference=True),
                 "logitless/sampler/outside_kept_reference", id="truncate-reference"),
    pytest.param(dict(min_p=0.3, max_steps=3), {}, "logitless/sampler/outside_kept",
                 id="min_p-three-steps"),
    pytest.param(dict(num_iterations=1, gradient_accumulation_steps=1, max_steps=3), {}, None,
                 id="on-policy"),
]


@pytest.mark.parametrize("overrides,kwargs,outside", FUSED_CASES)
def test_match_sampler_runs_fused(overrides, kwargs, outside, tiny, tmp_path,
                                  fused_calls):  # noqa: F811
    """``match_sampler=True`` runs the loss step as one fused_policy_loss call under the
    truncation, with no fallback warning: the same losses, logged metrics
    (``logitless/sampler/outside_kept`` and ``..._reference`` included) and final parameters
    as the composed path (``fused=False``). After the first updates (min-p cuts hard here)
    the kept sets move away from those the tokens were drawn from, so tokens leave the
    loss (``outside``: the metric that counts them)."""
    def run(fused):
        return make_trainer(GRPOTrainer, tiny, grpo_args(tmp_path / str(fused), **overrides),
                            match_sampler=True, fused=fused, **kwargs)

    fused, composed = train_fused_and_composed(run, fused_calls)
    assert_same_logs(fused.state.log_history, composed.state.log_history, loss_atol=2e-6)
    assert_same_parameters(fused.model, composed.model)
    if outside is not None:
        assert max(log.get(outside, 0.0) for log in composed.state.log_history) > 0


def test_match_sampler_loss_step_matmul_flops(tmp_path, wide_vocab_dir):  # noqa: F811
    """The issue's head-dominated model (V=4099, hidden 32), 8 completions of 62 tokens
    sampled by ``generate`` with top-k and top-p, one step: under ``match_sampler`` the fused
    loss step does the matmul FLOPs of the untruncated fused step (three GEMM passes over the
    head: at most 0.82x stock TRL's, test_trl_trainer.py::test_loss_step_matmul_flops). The
    composed sampler head runs inside its custom op, whose GEMMs the dispatch mode does not
    see, so it is no baseline here."""
    path, tok = wide_vocab_dir
    args = dict(per_device_train_batch_size=8, num_generations=8, max_completion_length=62,
                gradient_accumulation_steps=1, num_iterations=1, max_steps=1)
    flops = {}
    for match in (False, True):
        counting = _counting(GRPOTrainer)
        counting.counter, counting.flops = MatmulFlops(), []
        trainer = counting(model=path, reward_funcs=vowel_reward,
                           args=grpo_args(tmp_path / str(match), **args),
                           train_dataset=prompt_dataset(4), processing_class=tok,
                           match_sampler=match)
        trainer.train()
        flops[match] = sum(counting.flops)
    assert trainer.state.log_history[0]["logitless/sampler/outside_kept"] == 0.0
    assert flops[True] == flops[False] > 0, flops


def test_sampler_from_grpo_reads_trl_conventions(tmp_path):
    read = sampler_from_grpo
    assert read(grpo_args(tmp_path)) == SamplerTruncation(top_k=TOP_K, top_p=TOP_P,
                                                          sampler="transformers")
    assert read(grpo_args(tmp_path, use_vllm=True)).sampler == "vllm"
    # TRL's defaults, and every "off" spelling, are no truncation
    assert not read(grpo_args(tmp_path, top_k=0, top_p=1.0, min_p=None)).truncates
    assert not read(grpo_args(tmp_path, top_k=-1, top_p=1.0, min_p=0.0)).truncates
    assert read(grpo_args(tmp_path, top_k=0, top_p=1.0, min_p=0.05)) == SamplerTruncation(
        min_p=0.05, sampler="transformers")
    # min-p with top-k / top-p: first under vLLM, last under transformers' generate
    assert read(grpo_args(tmp_path, use_vllm=True, min_p=0.05)).kwargs() == dict(
        top_k=TOP_K, top_p=TOP_P, min_p=0.05, sampler="vllm")
    assert read(grpo_args(tmp_path, min_p=0.05)).kwargs() == dict(
        top_k=TOP_K, top_p=TOP_P, min_p=0.05, sampler="transformers")
    # keys that leave the distribution alone pass
    read(grpo_args(tmp_path, generation_kwargs={"max_new_tokens": 4, "do_sample": True}))


@pytest.mark.parametrize(("overrides", "named"), [
    (dict(repetition_penalty=1.1), "GRPOConfig.repetition_penalty"),
    (dict(generation_kwargs={"top_p": 0.5}), "GRPOConfig.generation_kwargs['top_p']"),
    (dict(generation_kwargs={"typical_p": 0.5}), "GRPOConfig.generation_kwargs['typical_p']"),
    (dict(generation_kwargs={"do_sample": False}), "GRPOConfig.generation_kwargs['do_sample']"),
    (dict(use_vllm=True, vllm_structured_outputs_regex="a+"),
     "GRPOConfig.vllm_structured_outputs_regex"),
    (dict(use_transformers_continuous_batching=True),
     "GRPOConfig.use_transformers_continuous_batching"),
    (dict(top_k=-3), "GRPOConfig.top_k"),
    (dict(temperature=1e-6), "GRPOConfig.temperature"),
])
def test_sampler_from_grpo_refuses_what_the_head_cannot_reproduce(tmp_path, overrides, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        sampler_from_grpo(grpo_args(tmp_path, **overrides))


def test_refusal_happens_at_construction(tiny, tmp_path):
    args = grpo_args(tmp_path, repetition_penalty=1.2)
    with pytest.raises(ValueError, match=re.escape("GRPOConfig.repetition_penalty")):
        make_trainer(GRPOTrainer, tiny, args, match_sampler=True)


def test_tokens_outside_the_kept_set_leave_the_loss():
    inf = math.inf
    logps = torch.tensor([[-1.0, -inf, -2.0], [-0.5, -0.7, -inf]], requires_grad=True)
    old = torch.tensor([[-1.1, -inf, -2.1], [-inf, -0.6, -0.1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    new, new_old, kept, fraction = drop_outside_kept(logps, old, mask)
    assert kept.tolist() == [[1, 0, 1], [0, 1, 0]]
    assert torch.isfinite(new).all() and torch.isfinite(new_old).all()
    assert float(fraction) == pytest.approx(2 / 5)
    (new * kept).sum().backward()
    assert logps.grad.tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]


def test_truncate_reference(tiny, tmp_path):
    """``truncate_reference=True``: the reference pass too is the sampler's truncated
    distribution (against the oracle), and the KL at step 1, where the policy is the
    reference, is 0; without it the KL compares the truncated policy with the full reference
    and is far from 0 (the number docs/trl.md quotes)."""
    kls = {}
    for truncate in (False, True):
        trainer = make_trainer(Recording, tiny, grpo_args(tmp_path / str(truncate), beta=0.05),
                               match_sampler=True, truncate_reference=truncate)
        trainer.train()
        ref = [c for c in trainer.calls if c["reference"]]
        assert ref
        for c in ref:
            expected = c["matched"] if truncate else c["full"]
            _close(c["logps"], expected["logprobs"], c["mask"], "reference logprobs")
        logged = trainer.state.log_history[0]
        kls[truncate] = logged["kl"]
        assert ("logitless/sampler/outside_kept_reference" in logged) == truncate
    print(f"kl at step 1: untruncated reference {kls[False]:.4f}, truncated {kls[True]:.2e}")
    assert abs(kls[True]) < 1e-6 < 0.1 < kls[False]


def test_truncate_reference_needs_match_sampler(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"truncate_reference.*match_sampler=True"):
        make_trainer(GRPOTrainer, tiny, grpo_args(tmp_path, beta=0.05), truncate_reference=True)


# -- the model's own generation config (generation_config.json) ------------------------------

def tiny_with_generation_config(tiny, path, **settings):
    """The tiny model saved with ``settings`` in its generation_config.json (which
    transformers writes only for a sampling config), its LM head scaled up so that the
    next-token distributions are peaked enough for min-p to cut (the initialised head's
    logits are nearly flat)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny[0])
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.generation_config.update(do_sample=True, **settings)
    model.save_pretrained(path)
    return str(path), tiny[1]


class RecordingWarpers(RecordingHeadCalls, GRPOTrainer):
    """Keeps, for every forward-helper call, what the head returned and the fp64 distribution
    of transformers' own logits processors: the ``LogitsProcessorList`` that ``generate``
    built for the latest generation (``processors``, filled by the test's spy) applied to the
    model's own logits."""

    processors = None

    def oracle(self, h, w, bias, y, model, kwargs):
        logits = h @ w.T if bias is None else h @ w.T + bias
        rows = logits.reshape(-1, logits.shape[-1])
        no_ids = torch.zeros(rows.shape[0], 1, dtype=torch.long)  # the warpers read no ids
        scores = self.processors(no_ids, rows.clone()).view_as(logits)
        logp = torch.log_softmax(scores, -1)
        p = logp.exp()
        entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
        full = torch.log_softmax(logits / TEMPERATURE, -1)
        at = y.clamp(min=0)[..., None]
        return dict(warped=dict(logprobs=logp.gather(-1, at)[..., 0], entropy=entropy),
                    full=full.gather(-1, at)[..., 0])


def test_match_sampler_follows_the_models_generation_config(tiny, tmp_path, monkeypatch):
    """TRL passes ``min_p=None`` to ``generate``, which then takes ``min_p`` from the model's
    generation_config.json: the head follows what generate samples with, checked against the
    processors generate itself built (spied on), applied to the model's own logits. TRL's
    defaults otherwise (no top-k, no top-p), as in the report: min-p alone cuts deep."""
    from transformers.generation.logits_process import MinPLogitsWarper
    from transformers.generation.utils import GenerationMixin

    model = tiny_with_generation_config(tiny, tmp_path / "model", min_p=0.3)
    args = grpo_args(tmp_path, top_k=0, top_p=1.0)
    trainer = make_trainer(RecordingWarpers, model, args, match_sampler=True)
    build = GenerationMixin._get_logits_processor

    def spy(self, *args, **kwargs):
        trainer.processors = build(self, *args, **kwargs)
        return trainer.processors

    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", spy)
    trainer.train()
    assert any(isinstance(p, MinPLogitsWarper) and p.min_p == 0.3 for p in trainer.processors)
    calls = [c for c in trainer.calls if not c["reference"]]
    assert calls
    for c in calls:
        _close(c["logps"], c["warped"]["logprobs"], c["mask"], "logprobs")
        if c["entropy"] is not None:
            _close(c["entropy"], c["warped"]["entropy"], c["mask"], "entropy")
    # min-p moved the numbers: the untempered-only distribution is far from generate's
    c = calls[0]
    assert float((c["warped"]["logprobs"] - c["full"])[c["mask"]].abs().max()) > 0.1
    assert trainer.state.log_history[0]["logitless/sampler/outside_kept"] == 0.0


def test_grpo_config_min_p_wins_over_the_models(tiny, tmp_path):
    """A setting TRL passes (GRPOConfig.min_p) overrides the model's, as in generate."""
    model = tiny_with_generation_config(tiny, tmp_path / "model", min_p=0.3)
    trainer = make_trainer(GRPOTrainer, model, grpo_args(tmp_path, min_p=0.1),
                           match_sampler=True)
    assert trainer._sampler == SamplerTruncation(top_k=TOP_K, top_p=TOP_P, min_p=0.1,
                                                 sampler="transformers")


@pytest.mark.parametrize(("settings", "named"), [
    (dict(typical_p=0.9), "model.generation_config.typical_p=0.9"),
    (dict(epsilon_cutoff=3e-4), "model.generation_config.epsilon_cutoff"),
    (dict(no_repeat_ngram_size=2), "model.generation_config.no_repeat_ngram_size"),
    (dict(num_beams=2), "model.generation_config.num_beams"),
])
def test_match_sampler_refuses_what_the_models_generation_config_adds(tiny, tmp_path,
                                                                      settings, named):
    model = tiny_with_generation_config(tiny, tmp_path / "model", **settings)
    with pytest.raises(ValueError, match=re.escape(named)):
        make_trainer(GRPOTrainer, model, grpo_args(tmp_path), match_sampler=True)
    make_trainer(GRPOTrainer, model, grpo_args(tmp_path))  # without match_sampler: TRL's own
