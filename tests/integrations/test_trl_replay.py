"""``GRPOTrainer(match_sampler="replay")``: the policy's and old policy's logprobs and entropies
are renormalised over the kept sets the engine recorded, which a ``rollout_func`` returns under
``"sampling_mask"``; checked against the fp64 oracle (``logitless.reference.kept_set_logprobs``)
on the model's own hidden states, values and the gradients of hidden, weight and bias, through
TRL's own forward helper, its batch chunking and its generation-batch splitting.

The "engine" is a sampling loop here over the tiny model: at each step it draws a random kept
set (not a top-k / top-p set: any set), samples from the tempered softmax renormalised over it
and records the set, as vLLM's ``return_sampling_mask`` does.
"""

import math
import os
import re
from types import SimpleNamespace

import pytest
import torch

from integrations.test_trl_sampler import train_fused_and_composed
from integrations.test_trl_trainer import (  # noqa: F401 (fused_calls: a fixture)
    assert_same_logs,
    assert_same_parameters,
    fused_calls,
)
from logitless.reference.sampler import kept_set_logprobs

from tiny_models import RecordingHeadCalls, prompt_dataset, tiny_qwen2, tiny_tokenizer, vowel_reward

trl = pytest.importorskip("trl", reason="TRL is installed by `make test`")

from logitless.integrations.replay import (  # noqa: E402
    KEPT_IDS_KEY,
    SAMPLING_MASK_KEY,
    kept_ids_from_masks,
    masks_from_request_outputs,
    masks_from_sglang_outputs,
)
from logitless.integrations.trl import GRPOTrainer  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEMPERATURE = 0.7
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, tokenizer); the model's LM head gets a random bias, so that the
    bias's gradient is checked too."""
    tokenizer = tiny_tokenizer()
    path = tmp_path_factory.mktemp("tiny-qwen2-replay")
    model = tiny_qwen2(tokenizer)
    model.save_pretrained(path)
    return str(path), tokenizer


def with_bias(model, seed=1):
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.copy_(torch.randn(head.out_features, generator=g) * 0.3)
    model.lm_head = biased
    return model


def random_set(g, vocab, target=None, outside=False):
    """A random kept set of 3 to 11 ids; holds ``target`` unless ``outside``."""
    size = int(torch.randint(3, 12, (1,), generator=g))
    ids = torch.randperm(vocab, generator=g)[:size].tolist()
    if target is not None:
        ids = [i for i in ids if i != target]
        if not outside:
            ids[int(torch.randint(0, len(ids), (1,), generator=g))] = target
    return ids


class Engine:
    """A rollout_func: samples each completion token from the tempered softmax renormalised
    over a random set, and returns the sets under ``"sampling_mask"`` with the sampled
    logprobs. ``corrupt`` breaks the output for the refusal tests."""

    def __init__(self, seed=0, corrupt=None):
        self.g = torch.Generator().manual_seed(seed)
        self.corrupt = corrupt
        self.outputs = []

    @torch.no_grad()
    def __call__(self, prompts, trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        vocab = model.get_output_embeddings().weight.shape[0]
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], SAMPLING_MASK_KEY: []}
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            completion, logps, sets = [], [], []
            for _ in range(MAX_TOKENS):
                logits = model(input_ids=torch.tensor([ids + completion])).logits[0, -1].double()
                kept = random_set(self.g, vocab)
                z = torch.full_like(logits, -math.inf)
                z[kept] = logits[kept] / TEMPERATURE
                logq = torch.log_softmax(z, -1)
                token = int(torch.multinomial(logq.exp(), 1, generator=self.g))
                completion.append(token)
                logps.append(float(logq[token]))
                sets.append(kept)
                if token == tokenizer.eos_token_id:
                    break
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append(logps)
            out[SAMPLING_MASK_KEY].append(sets)
        if self.corrupt == "missing":
            del out[SAMPLING_MASK_KEY]
        elif self.corrupt == "short":
            out[SAMPLING_MASK_KEY][0] = out[SAMPLING_MASK_KEY][0][:-1]
        elif self.corrupt == "none":
            out[SAMPLING_MASK_KEY][0][0] = None
        elif self.corrupt == "outside":  # each first completion's token 1 misses its set
            for b in range(0, len(prompts), 4):
                if len(out["completion_ids"][b]) > 1:
                    out[SAMPLING_MASK_KEY][b][1] = random_set(
                        self.g, vocab, out["completion_ids"][b][1], outside=True)
        elif self.corrupt == "env":  # token 1 of completion 0 came from an environment
            out[SAMPLING_MASK_KEY][0][1] = None
            out["env_mask"] = [[int((b, t) != (0, 1)) for t in range(len(c))]
                               for b, c in enumerate(out["completion_ids"])]
        self.outputs.append(out)
        return out


BASE_ARGS = dict(
    per_device_train_batch_size=4, num_generations=4, max_completion_length=MAX_TOKENS,
    max_steps=1, gradient_accumulation_steps=2, num_iterations=2, learning_rate=0.5,
    optim="sgd", logging_steps=1, report_to=[], bf16=False, use_cpu=True, seed=0,
    save_strategy="no", disable_tqdm=True, temperature=TEMPERATURE,
)


def grpo_args(tmp_path, **overrides):
    return trl.GRPOConfig(output_dir=str(tmp_path), **{**BASE_ARGS, **overrides})


class Recording(RecordingHeadCalls, GRPOTrainer):
    """Keeps, for every forward-helper call, the head's output, the sets it was given and the
    fp64 oracle over those sets on the model's own final hidden states and LM head."""

    def oracle(self, h, w, bias, y, model, kwargs):
        reference = model is self.ref_model or self._reference_pass
        kept = kwargs.get("kept_ids")
        if kept is None and (not reference or self._truncate_reference):
            kept = self._generation_kept_ids(kwargs["logits_to_keep"])
        if kept is None:
            return dict(kept=None, oracle=None)
        return dict(kept=kept, oracle=kept_set_logprobs(h, w, y, kept, bias,
                                                        temperature=TEMPERATURE))


def make_trainer(tiny, args, cls=Recording, engine=None, **kwargs):
    model_dir, tokenizer = tiny
    return cls(model=model_dir, reward_funcs=vowel_reward, args=args,
               train_dataset=prompt_dataset(4), processing_class=tokenizer,
               rollout_func=Engine() if engine is None else engine, **kwargs)


def _close(actual, expected, mask, name):
    a, e = actual[mask].double(), expected[mask]
    torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)


def test_replay_trains_on_the_recorded_sets(tiny, tmp_path):
    """Policy and old-policy passes equal the oracle over the recorded sets; the old policy at
    the first step is the sampling model, so its logprobs are the engine's own; the generation
    batch carries the sets as ``kept_ids`` through TRL's shuffle and split."""
    engine = Engine()
    # the composed head (fused=False), whose policy calls Recording sees; the fused loss step
    # equals it (test_replay_runs_fused)
    trainer = make_trainer(tiny, grpo_args(tmp_path), engine=engine, match_sampler="replay",
                           fused=False)
    trainer.train()
    policy = [c for c in trainer.calls if not c["reference"] and c["grad"]]
    old = [c for c in trainer.calls if not c["reference"] and not c["grad"]]
    assert policy and old
    for c in policy + old:
        assert torch.isfinite(c["oracle"]["logprobs"][c["mask"]]).all()
        _close(c["logps"], c["oracle"]["logprobs"], c["mask"], "logprobs")
    for c in policy:
        _close(c["entropy"], c["oracle"]["entropy"], c["mask"], "entropy")
        # the sets were far from the whole vocabulary
        assert float(c["oracle"]["log_kept_mass"][c["mask"]].max()) < -0.5
    # the old-policy pass ran before any update: the engine's sampled logprobs
    sampled = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(lp, dtype=torch.float64) for lp in engine.outputs[0]["logprobs"]],
        batch_first=True)
    first = old[0]
    t = sampled.shape[1]
    _close(first["logps"][:, :t], sampled, first["mask"][:, :t], "engine logprobs")
    # the policy passes got the batch's sets, the old-policy pass the generation's: the same
    # sets, shuffled and split by TRL
    generated = {tuple(map(tuple, row.tolist())) for row in old[0]["kept"]}
    for c in policy:
        assert {tuple(map(tuple, row.tolist())) for row in c["kept"]} <= generated
    logged = trainer.state.log_history[0]
    assert logged["logitless/sampler/outside_kept"] == 0.0
    assert math.isfinite(logged["loss"])
    # the engine's logprobs are the replayed distribution's: no mismatch beyond fp32 rounding
    assert logged["logitless/mismatch/abs_diff/max"] < 1e-4
    assert 0 <= logged["logitless/mismatch/kl_k3"] < 1e-8
    assert logged["logitless/mismatch/ratio_outside"] == 0.0


def test_mismatch_without_replay_is_the_truncation(tiny, tmp_path):
    """The same engine without replay: the trainer scores the full tempered softmax, the
    engine's logprobs are renormalised over sets far smaller than the vocabulary, so every
    token's d is the set's log mass (< -0.5): |d| = -d, k1 = mean |d|, and every ratio is
    outside [0.9, 1.1] (docs/mismatch.md)."""
    trainer = make_trainer(tiny, grpo_args(tmp_path), cls=GRPOTrainer)
    trainer.train()
    logged = trainer.state.log_history[0]
    k1, mean = logged["logitless/mismatch/kl_k1"], logged["logitless/mismatch/abs_diff/mean"]
    assert k1 > 0.5
    assert k1 == pytest.approx(mean, rel=1e-6)
    assert logged["logitless/mismatch/ratio_outside"] == 1.0
    assert logged["logitless/mismatch/kl_k3"] > 0


def test_replay_truncates_the_reference_with_the_same_sets(tiny, tmp_path):
    trainer = make_trainer(tiny, grpo_args(tmp_path, beta=0.05), match_sampler="replay",
                           truncate_reference=True)
    trainer.train()
    ref = [c for c in trainer.calls if c["reference"]]
    assert ref
    for c in ref:
        _close(c["logps"], c["oracle"]["logprobs"], c["mask"], "reference logprobs")
    assert abs(trainer.state.log_history[0]["kl"]) < 1e-6


FUSED_CASES = [
    pytest.param(dict(), {}, None, id="replay"),
    pytest.param(dict(beta=0.05, max_steps=2), dict(truncate_reference=True), None,
                 id="truncate-reference"),
    pytest.param(dict(num_iterations=1, gradient_accumulation_steps=1, max_steps=2), {},
                 None, id="on-policy"),
    pytest.param(dict(beta=0.05), dict(truncate_reference=True), "outside",
                 id="targets-outside-their-sets"),
]


@pytest.mark.parametrize("overrides,kwargs,corrupt", FUSED_CASES)
def test_replay_runs_fused(overrides, kwargs, corrupt, tiny, tmp_path,
                           fused_calls):  # noqa: F811
    """``match_sampler="replay"`` runs the loss step as one fused_policy_loss call over the
    recorded sets (``kept_ids``), with no fallback warning: the same losses, logged metrics
    and final parameters as the composed path (``fused=False``), also where recorded sets
    miss their tokens (``outside``: out of the loss, counted in
    ``logitless/sampler/outside_kept`` and ``..._reference``)."""
    def run(fused):
        return make_trainer(tiny, grpo_args(tmp_path / str(fused), **overrides),
                            cls=GRPOTrainer, engine=Engine(corrupt=corrupt),
                            match_sampler="replay", fused=fused, **kwargs)

    fused, composed = train_fused_and_composed(run, fused_calls)
    # on-policy the old logprobs are the current ones: the fused store's GEMM and the composed
    # path's gather of the sets' rows round them apart by an fp32 ulp (5e-7 at |lp| ~ 6), and
    # |old - rollout| (the mismatch's abs_diff, near 0 here) shows exactly that
    ulp = "logitless/mismatch/abs_diff/"
    logs = [[{k: v for k, v in log.items() if not k.startswith(ulp)} for log in t.state.log_history]
            for t in (fused, composed)]
    assert_same_logs(*logs, loss_atol=2e-6)
    for ours, theirs in zip(fused.state.log_history, composed.state.log_history):
        for key in (k for k in theirs if k.startswith(ulp)):
            assert abs(ours[key] - theirs[key]) <= 1e-6, (key, ours[key], theirs[key])
    assert_same_parameters(fused.model, composed.model)
    if corrupt == "outside":
        logged = composed.state.log_history[0]
        assert logged["logitless/sampler/outside_kept"] > 0
        assert "logitless/sampler/outside_kept_reference" in logged


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("compact", [False, True], ids=["every-position", "scored-rows"])
def test_replay_head_gradients_through_trls_chunked_forward(tiny, tmp_path, monkeypatch,
                                                            compact, bf16):
    """TRL's forward helper over 5 sequences in chunks of 2: values, entropy and the gradients
    of the final hidden states, the head weight and its bias equal the fp64 oracle over the
    given sets, a target outside its set reading -inf as the oracle does. TRL's fused head
    passes every position off Triton devices and only the scored rows on them (``compact``:
    its Triton-device path, forced here on the CPU). ``bf16``: ``GRPOConfig(bf16=True)``,
    whose autocast makes the head run in bf16 (the oracle takes the hidden states rounded to
    it) with fp32 kept logits, the bias gradient then summing to 0 over the vocabulary as
    the oracle's does (the forward's bf16 logits made it read -2e-3). The backward enters
    TRL's ZeRO-3 gather (``maybe_gather_lm_head_ctx``, recorded here) as TRL's forward does
    around each chunk; it read the head outside it."""
    import contextlib

    import trl.trainer.utils as trl_utils

    phases, phase = [], ["forward"]

    @contextlib.contextmanager
    def gather(*params):
        phases.append(phase[0])
        yield

    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: compact)
    monkeypatch.setattr(trl_utils, "maybe_gather_lm_head_ctx", gather)
    trainer = make_trainer(tiny, grpo_args(tmp_path, num_iterations=1,
                                           gradient_accumulation_steps=1, bf16=bf16),
                           cls=GRPOTrainer, match_sampler="replay")
    model = with_bias(trainer.model)
    g = torch.Generator().manual_seed(3)
    vocab = model.lm_head.out_features
    b, prompt, t = 5, 3, 7
    input_ids = torch.randint(2, vocab, (b, prompt + t), generator=g)
    attention = torch.ones_like(input_ids)
    lengths = [7, 4, 6, 1, 5]
    for i, n in enumerate(lengths):
        attention[i, prompt + n:] = 0
    sets = [[random_set(g, vocab, int(input_ids[i, prompt + j]), outside=(i, j) == (2, 3))
             for j in range(n)] for i, n in enumerate(lengths)]
    kept = kept_ids_from_masks(sets, t, vocab_size=vocab)
    captured = []

    def keep_hidden(module, args, output):
        output.last_hidden_state.retain_grad()
        captured.append(output.last_hidden_state)

    hook = model.model.register_forward_hook(keep_hidden)
    try:
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention, t, batch_size=2, compute_entropy=True, kept_ids=kept)
    finally:
        hook.remove()
    assert len(captured) == 3  # TRL's loop: chunks of 2, 2 and 1
    mask = attention[:, prompt:].bool()
    finite = mask & torch.isfinite(logps.detach())
    wl = torch.randn(b, t, generator=g, dtype=torch.float64)
    we = torch.randn(b, t, generator=g, dtype=torch.float64)
    phase[0] = "backward"
    (torch.where(finite, logps, 0).double() * wl).sum().add(
        (torch.where(mask, entropy, 0).double() * we).sum()).backward()

    hidden = torch.cat([h.detach() for h in captured])[:, :-1][:, -t:].double().requires_grad_()
    w = model.lm_head.weight.detach().double().requires_grad_()
    bias = model.lm_head.bias.detach().double().requires_grad_()
    labels = input_ids[:, prompt:].masked_fill(~mask, -100)
    # the head's input, with the gradient of the hidden states as they are
    rounded = hidden + (hidden.bfloat16().double() - hidden).detach() if bf16 else hidden
    ref = kept_set_logprobs(rounded, w, labels, kept, bias, temperature=TEMPERATURE)
    assert torch.isneginf(ref["logprobs"][2, 3]) and torch.isneginf(logps[2, 3].detach())
    assert int((mask & ~finite).sum()) == 1
    _close(logps.detach(), ref["logprobs"], finite, "logprobs")
    _close(entropy.detach(), ref["entropy"], mask, "entropy")
    (torch.where(finite, ref["logprobs"], 0) * wl).sum().add(
        (torch.where(mask, ref["entropy"], 0) * we).sum()).backward()
    got_h = torch.cat([h.grad for h in captured])
    # the head reads positions [prompt - 1, prompt - 1 + t) of each chunk's hidden states
    torch.testing.assert_close(got_h[:, :-1][:, -t:].double(), hidden.grad, rtol=1e-5, atol=1e-6)
    assert float(got_h[:, :prompt - 1].abs().max()) == 0.0
    torch.testing.assert_close(model.lm_head.weight.grad.double(), w.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.lm_head.bias.grad.double(), bias.grad, rtol=1e-5, atol=1e-6)
    assert abs(float(model.lm_head.bias.grad.sum())) < 1e-5
    assert phases == ["forward"] * 3 + ["backward"] * 3


@pytest.mark.parametrize(("overrides", "trainer_kwargs", "named"), [
    (dict(), dict(rollout_func=None), "rollout_func"),
    (dict(repetition_penalty=1.1), dict(), "GRPOConfig.repetition_penalty"),
    (dict(generation_kwargs={"temperature": 0.9}), dict(),
     "GRPOConfig.generation_kwargs['temperature']"),
    (dict(generation_kwargs={"typical_p": 0.5}), dict(),
     "GRPOConfig.generation_kwargs['typical_p']"),
    (dict(temperature=1e-6), dict(), "GRPOConfig.temperature"),
    (dict(), dict(match_sampler="replays"), "match_sampler"),
])
def test_replay_refuses_conflicting_settings(tiny, tmp_path, overrides, trainer_kwargs, named):
    model_dir, tokenizer = tiny
    kwargs = {"rollout_func": Engine(), "match_sampler": "replay", **trainer_kwargs}
    with pytest.raises(ValueError, match=re.escape(named)):
        GRPOTrainer(model=model_dir, reward_funcs=vowel_reward,
                    args=grpo_args(tmp_path, **overrides), train_dataset=prompt_dataset(4),
                    processing_class=tokenizer, **kwargs)


def test_replay_accepts_truncations_in_generation_kwargs(tiny, tmp_path):
    """The recorded set is the truncation: top_k / top_p / min_p in generation_kwargs are the
    engine's business, not a mismatch."""
    args = grpo_args(tmp_path, top_k=5, generation_kwargs={"top_p": 0.8, "min_p": 0.1})
    make_trainer(tiny, args, cls=GRPOTrainer, match_sampler="replay")


@pytest.mark.parametrize(("corrupt", "message"), [
    ("missing", "under the key 'sampling_mask'"),
    ("short", "kept sets for the completion's"),
    ("none", "is None (no set) for a token in the loss"),
])
def test_replay_refuses_a_rollout_without_matching_sets(tiny, tmp_path, corrupt, message):
    trainer = make_trainer(tiny, grpo_args(tmp_path), cls=GRPOTrainer,
                           engine=Engine(corrupt=corrupt), match_sampler="replay")
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.train()


def test_replay_sets_leave_the_reward_functions_alone(tiny, tmp_path):
    seen = []

    def reward(completions, **kwargs):
        seen.append(set(kwargs))
        return vowel_reward(completions)

    model_dir, tokenizer = tiny
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=grpo_args(tmp_path),
                          train_dataset=prompt_dataset(4), processing_class=tokenizer,
                          rollout_func=Engine(), match_sampler="replay")
    batch = trainer._generate_and_score_completions(
        [{"prompt": p} for p in prompt_dataset(4)["prompt"] for _ in range(2)])
    assert seen and all(SAMPLING_MASK_KEY not in keys for keys in seen)
    kept = batch[KEPT_IDS_KEY]
    assert kept.dtype == torch.int64 and kept.shape[:2] == batch["completion_ids"].shape
    # padding columns hold no set
    assert bool((kept[batch["completion_mask"] == 0] == -1).all())


def test_replay_a_token_the_engine_did_not_sample(tiny, tmp_path):
    """A None set where ``env_mask`` is 0 (an environment's token, out of the loss) becomes the
    set {that token}; the other tokens keep their recorded sets."""
    engine = Engine(corrupt="env")
    trainer = make_trainer(tiny, grpo_args(tmp_path), cls=GRPOTrainer, engine=engine,
                           match_sampler="replay")
    batch = trainer._generate_and_score_completions(
        [{"prompt": p} for p in prompt_dataset(4)["prompt"] for _ in range(2)])
    kept = batch[KEPT_IDS_KEY]
    token = int(batch["completion_ids"][0, 1])
    assert kept[0, 1].tolist() == [token] + [-1] * (kept.shape[-1] - 1)
    recorded = engine.outputs[0][SAMPLING_MASK_KEY][0][0]
    assert kept[0, 0, :len(recorded)].tolist() == recorded
    assert int(batch["tool_mask"][0, 1]) == 0


# -- converters ----------------------------------------------------------------------------
# vLLM is not installable here: these duck-typed objects carry the fields vllm/outputs.py
# (0.34.0) defines and the converter reads: RequestOutput.outputs, CompletionOutput.token_ids
# and .sampling_mask, SamplingMask.token_ids.

def completion(token_ids, sets):
    mask = None if sets is None else SimpleNamespace(token_ids=sets)
    return SimpleNamespace(index=0, text="", token_ids=token_ids, cumulative_logprob=None,
                           logprobs=None, finish_reason="stop", sampling_mask=mask)


def test_masks_from_request_outputs_flattens_in_trls_order():
    requests = [SimpleNamespace(outputs=[completion([5, 7], [[5, 1], [7, 2, 9]]),
                                         completion([3], [[3]])]),
                SimpleNamespace(outputs=[completion([4, 4, 8], [[4], [4, 6], [8, 0, 2, 1]])])]
    masks = masks_from_request_outputs(requests)
    assert masks == [[[5, 1], [7, 2, 9]], [[3]], [[4], [4, 6], [8, 0, 2, 1]]]
    kept = kept_ids_from_masks(masks, 4, vocab_size=10)
    assert kept.tolist() == [
        [[5, 1, -1, -1], [7, 2, 9, -1], [-1] * 4, [-1] * 4],
        [[3, -1, -1, -1], [-1] * 4, [-1] * 4, [-1] * 4],
        [[4, -1, -1, -1], [4, 6, -1, -1], [8, 0, 2, 1], [-1] * 4]]


def test_masks_from_request_outputs_refuses():
    with pytest.raises(ValueError, match=r"request_outputs: .*return_sampling_mask=True"):
        masks_from_request_outputs([SimpleNamespace(outputs=[completion([1], None)])])
    with pytest.raises(ValueError, match=r"request_outputs: .*1 kept sets for 2 tokens"):
        masks_from_request_outputs([SimpleNamespace(outputs=[completion([1, 2], [[1]])])])


@pytest.mark.parametrize(("request_outputs", "message"), [
    (SimpleNamespace(outputs=[completion([1], [[1]])]),
     "request_outputs: expected a list of vLLM RequestOutputs, got a SimpleNamespace"),
    (None, "request_outputs: expected a list of vLLM RequestOutputs, got None"),
    ([[completion([1], [[1]])]], "request_outputs: request 0: expected a vLLM RequestOutput"),
    ([SimpleNamespace(outputs=[completion([1], None)])], "has no sampling_mask"),
    ([SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1], sampling_mask=SimpleNamespace(
        token_ids=None))])],
     "request_outputs: completion 0 of request 0: expected sampling_mask.token_ids"),
    ([SimpleNamespace(outputs=[completion(None, [[1]])])],
     "request_outputs: completion 0 of request 0: expected token_ids"),
    ([SimpleNamespace(outputs=[completion([1], [[1.7]])])],
     "request_outputs: completion 0 of request 0, token 0: ids must be ints"),
    ([SimpleNamespace(outputs=[completion([1], [[True]])])],
     "request_outputs: completion 0 of request 0, token 0: ids must be ints"),
    ([SimpleNamespace(outputs=[completion([1], [["3"]])])],
     "request_outputs: completion 0 of request 0, token 0: ids must be ints"),
    ([SimpleNamespace(outputs=[completion([1], [4])])],
     "request_outputs: completion 0 of request 0, token 0: expected a list of kept"),
], ids=["one-request", "none", "not-a-request", "no-mask", "token-ids-none", "completion-ids-none",
        "float-id", "bool-id", "string-id", "flat"])
def test_masks_from_request_outputs_refuses_malformed(request_outputs, message):
    """What is not a list of RequestOutputs with integer sets is a ValueError naming
    ``request_outputs``, not an AttributeError / TypeError or a truncated id."""
    with pytest.raises(ValueError, match=re.escape(message)):
        masks_from_request_outputs(request_outputs)


def test_masks_from_sglang_outputs():
    # SGLang 0.5.23's /generate: meta_info["output_token_sampling_mask"], one list per output id
    outputs = [{"output_ids": [3, 1], "meta_info": {"output_token_sampling_mask": [[3, 2], [1]]}},
               {"output_ids": [0], "meta_info": {"output_token_sampling_mask": [[0, 5, 6]]}}]
    assert masks_from_sglang_outputs(outputs) == [[[3, 2], [1]], [[0, 5, 6]]]
    assert masks_from_sglang_outputs(outputs[1]) == [[[0, 5, 6]]]
    with pytest.raises(ValueError, match=r"outputs: output 0 .*return_sampling_mask"):
        masks_from_sglang_outputs([{"output_ids": [1], "meta_info": {}}])
    with pytest.raises(ValueError, match=r"outputs: output 0 has 1 kept sets for 2"):
        masks_from_sglang_outputs([{"output_ids": [1, 2],
                                    "meta_info": {"output_token_sampling_mask": [[1]]}}])


@pytest.mark.parametrize(("outputs", "message"), [
    ([[3, 1]], "outputs: output 0: expected a dict"),
    (["text"], "outputs: output 0: expected a dict"),
    (None, "outputs: expected SGLang's /generate answer"),
    ([{"output_ids": [1], "meta_info": [[1]]}], "outputs: output 0: expected meta_info"),
    ([{"output_ids": [1], "meta_info": {"output_token_sampling_mask": [[1.7]]}}],
     "outputs: output 0, token 0: ids must be ints"),
    ([{"output_ids": [1], "meta_info": {"output_token_sampling_mask": [[False]]}}],
     "outputs: output 0, token 0: ids must be ints"),
    ([{"output_ids": [1], "meta_info": {"output_token_sampling_mask": [["1"]]}}],
     "outputs: output 0, token 0: ids must be ints"),
    ([{"output_ids": [1], "meta_info": {"output_token_sampling_mask": [1]}}],
     "outputs: output 0, token 0: expected a list of kept vocabulary ids"),
], ids=["list-entry", "string-entry", "none", "meta-not-dict", "float-id", "bool-id",
        "string-id", "flat"])
def test_masks_from_sglang_outputs_refuses_malformed(outputs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        masks_from_sglang_outputs(outputs)


@pytest.mark.parametrize(("masks", "length", "message"), [
    ([[[1.7]]], 3, "masks: completion 0, token 0: ids must be ints"),
    ([[[2.0]]], 3, "masks: completion 0, token 0: ids must be ints"),
    ([[[1, True]]], 3, "masks: completion 0, token 0: ids must be ints"),
    ([[[torch.tensor(1.0)]]], 3, "masks: completion 0, token 0: ids must be ints"),
    ([[["3"]]], 3, "masks: completion 0, token 0: ids must be ints"),
    ([[[1], "ab"]], 3, "masks: completion 0, token 1: expected a list of kept vocabulary ids"),
    ([[[1], 4]], 3, "masks: completion 0, token 1: expected a list of kept vocabulary ids"),
    ([1, 2, 3], 3, "masks: completion 0: expected a list of kept sets"),
    (None, 3, "masks: expected a list of completions"),
    ([[[1], []]], 3, "masks: completion 0, token 1: empty kept set"),
    ([[[1, 1]]], 3, "masks: completion 0, token 0: duplicate ids"),
    ([[[1, 10]]], 3, "ids outside [0, 10)"),
    ([[[-2]]], 3, "ids outside"),
    ([[[1], [2]]], 1, "masks: completion 0 has 2 kept sets for 1 completion columns"),
    ([[[1]]], -1, "length: expected an int >= 0"),
])
def test_kept_ids_from_masks_refuses(masks, length, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        kept_ids_from_masks(masks, length, vocab_size=10)


def test_kept_ids_from_masks_takes_integer_ids_of_any_kind():
    """numpy integers, 0-d integer tensors and 1-D integer tensors read as the python ints."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    sets = [[torch.randperm(13, generator=g)[:int(torch.randint(1, 6, (1,), generator=g))]
             for _ in range(4)] for _ in range(3)]
    plain = [[s.tolist() for s in row] for row in sets]
    expected = kept_ids_from_masks(plain, 5, vocab_size=13)
    assert expected[:, :4].max() >= 0 and (expected[:, 4] == -1).all()
    for kind in (lambda s: s, lambda s: list(s), lambda s: [np.int32(i) for i in s.tolist()],
                 lambda s: s.numpy()):
        kept = kept_ids_from_masks([[kind(s) for s in row] for row in sets], 5, vocab_size=13)
        assert torch.equal(kept, expected)
