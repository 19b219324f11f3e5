"""AttentionEntropyRecorder on tiny random transformers models (built from configs, nothing
downloaded): entropies equal those of the attention probabilities eager attention returns, for
models running eager and sdpa; logits bit-identical with and without the recorder; padding
left and right, packed inputs, sliding windows, GQA; the config restored on exit."""

import copy

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    flash_attention_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

import logitless
from logitless.integrations.transformers import AttentionEntropyRecorder

SMALL = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)
ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    # Sliding window on the last two layers (window 4 < T): a different mask per layer.
    "qwen2-sliding": (Qwen2Config, Qwen2ForCausalLM,
                      {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
}


def build(arch, impl):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    config = config_cls(**SMALL, **extra)
    return model_cls._from_config(config, attn_implementation=impl).eval()


def eager_twin(model):
    config = copy.deepcopy(model.config)  # _from_config would switch the model's own config
    twin = type(model)._from_config(config, attn_implementation="eager").eval()
    twin.load_state_dict(model.state_dict())
    return twin


def entropy_of(probs):
    """[L, B, H, T, T] probabilities -> [L, B, H, T] entropies in fp64."""
    p = probs.double()
    return -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)


def batch(padding, b=3, t=13):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (b, t), generator=gen)
    mask = torch.ones(b, t, dtype=torch.long)
    lengths = torch.tensor([t, t - 4, 6])
    pos = torch.arange(t)[None]
    if padding == "right":
        mask = (pos < lengths[:, None]).long()
    elif padding == "left":
        mask = (pos >= t - lengths[:, None]).long()
    return ids, mask


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_recorder_matches_eager_probabilities(arch, impl, padding):
    model = build(arch, impl)
    ids, mask = batch(padding)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with AttentionEntropyRecorder(model) as rec:
            recorded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        twin = eager_twin(model)
        probs = twin(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
    assert torch.equal(plain, recorded)  # bit-identical
    assert model.config._attn_implementation == impl
    expected = entropy_of(torch.stack(probs.attentions))
    got = rec.per_layer()
    assert got.shape == (3, 3, 4, 13) and got.dtype == torch.float32
    valid = mask.bool()[None, :, None, :].expand_as(got)
    torch.testing.assert_close(got.double()[valid], expected[valid], atol=2e-6, rtol=0)
    assert (got[~valid] == 0).all()
    torch.testing.assert_close(rec.per_token(), got.mean(dim=(0, 2)))


@pytest.mark.parametrize("padding", ["left", "right"])
def test_softcap_and_scaling_gemma2(padding):
    """Gemma2 (eager only: sdpa has no softcap): logit softcap, query_pre_attn_scalar scaling,
    alternating sliding-window layers."""
    torch.manual_seed(0)
    config = Gemma2Config(**SMALL, head_dim=8, attn_logit_softcapping=1.5, sliding_window=4,
                          query_pre_attn_scalar=3, final_logit_softcapping=None,
                          initializer_range=0.5)  # scores of a few units: the cap bites
    model = Gemma2ForCausalLM._from_config(config, attn_implementation="eager").eval()
    ids, mask = batch(padding)
    with torch.no_grad(), AttentionEntropyRecorder(model) as rec:
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
    expected = entropy_of(torch.stack(out.attentions))
    got = rec.per_layer()
    valid = mask.bool()[None, :, None, :].expand_as(got)
    torch.testing.assert_close(got.double()[valid], expected[valid], atol=2e-6, rtol=0)


def test_recorder_with_output_attentions_in_eager():
    """Inside the recorder, eager still returns its probabilities; the two agree."""
    model = build("qwen2", "eager")
    ids, mask = batch("left")
    with torch.no_grad(), AttentionEntropyRecorder(model, layers=[0, 2]) as rec:
        # With the default cache, as a scoring pass runs.
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    expected = entropy_of(torch.stack(out.attentions)[[0, 2]])
    valid = mask.bool()[None, :, None, :].expand(2, 3, 4, 13)
    torch.testing.assert_close(rec.per_layer().double()[valid], expected[valid], atol=2e-6,
                               rtol=0)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_packed_inputs_equal_separate_sequences(impl):
    model = build("qwen2", impl)
    lengths = [5, 7, 4]
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, SMALL["vocab_size"], (1, n), generator=gen) for n in lengths]
    ids = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad(), AttentionEntropyRecorder(model, heads=[1, 2]) as rec:
        model(input_ids=ids, position_ids=position_ids, use_cache=False)
        packed = rec.per_layer()
        alone = []
        for s in seqs:
            model(input_ids=s, use_cache=False)
            alone.append(rec.per_layer())
    assert packed.shape == (3, 1, 2, 16)
    torch.testing.assert_close(packed, torch.cat(alone, dim=-1), atol=2e-6, rtol=0)


def test_layer_and_head_selection():
    model = build("qwen2", "sdpa")
    ids, mask = batch("right")
    with torch.no_grad():
        with AttentionEntropyRecorder(model) as full:
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        with AttentionEntropyRecorder(model, layers=[2, 0], heads=[3, 1]) as part:
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    expected = full.per_layer()[[0, 2]][:, :, [1, 3]]
    torch.testing.assert_close(part.per_layer(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(part.per_layer("mean"), expected.mean(2))
    torch.testing.assert_close(part.per_token(), expected.mean(dim=(0, 2)))


def test_with_grad_the_model_still_trains():
    model = build("llama", "sdpa")
    ids, mask = batch("left")
    with AttentionEntropyRecorder(model) as rec:
        loss = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.square().mean()
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert not rec.per_token().requires_grad


def test_restores_config_and_registries_on_error():
    model = build("qwen2", "sdpa")
    ids, _ = batch("none")
    key = None
    with pytest.raises(RuntimeError, match="boom"), AttentionEntropyRecorder(model) as rec:
        key = rec._key
        assert model.config._attn_implementation == key
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert key not in ALL_ATTENTION_FUNCTIONS._global_mapping
    assert key not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    with torch.no_grad():
        model(input_ids=ids)  # still runs with its own attention


def test_bad_input():
    model = build("qwen2", "eager")
    ids, mask = batch("left")
    with pytest.raises(ValueError, match="layers"):
        AttentionEntropyRecorder(model, layers=[3])
    with pytest.raises(ValueError, match="heads"):
        AttentionEntropyRecorder(model, heads=[0, 0])
    with pytest.raises(ValueError, match="model must be"):
        AttentionEntropyRecorder(torch.nn.Linear(2, 2))
    with torch.no_grad(), AttentionEntropyRecorder(model) as rec:
        with pytest.raises(ValueError, match="no attention entropy recorded"):
            rec.per_token()
        with pytest.raises(ValueError, match="2D"):
            model(input_ids=ids, attention_mask=mask[:, None, None, :].float())
        with pytest.raises(ValueError, match="reduce_heads"):
            rec.per_layer("sum")


def test_end_to_end_anchor_explorer_weighting():
    """Scoring pass with the recorder -> per-token attention entropy of the response tokens ->
    the objective library's attention-entropy weighting (anchors / explorers). The loss equals
    the same objective with weights 1 + alpha tanh(z) built by hand from the entropies of the
    eager attention probabilities (z standardised per sequence over the response tokens)."""
    model = build("qwen2", "sdpa")
    prompt, width = 4, 9
    lengths = torch.tensor([9, 6, 3])
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, SMALL["vocab_size"], (3, prompt + width), generator=gen)
    mask = (torch.arange(prompt + width)[None] < prompt + lengths[:, None]).long()
    response = torch.arange(width)[None] < lengths[:, None]  # right-padded [B, width]
    advantages = torch.tensor([1.0, -0.5, 2.0])

    def response_logprobs(logits):
        # token prompt + t is predicted at position prompt + t - 1
        lp = torch.log_softmax(logits[:, prompt - 1 : -1].float(), -1)
        return lp.gather(-1, ids[:, prompt:, None]).squeeze(-1)

    with torch.no_grad(), AttentionEntropyRecorder(model, layers=[1, 2]) as rec:
        old = response_logprobs(model(input_ids=ids, attention_mask=mask).logits)
    hatt = rec.per_token()[:, prompt:]
    logprobs = response_logprobs(model(input_ids=ids, attention_mask=mask,
                                       use_cache=False).logits)

    config = logitless.PolicyLossConfig(attn_entropy_weighting="tanh", attn_entropy_alpha=0.5)
    loss, _ = logitless.policy_loss(logprobs, old, advantages, response, config,
                                    attention_entropy=hatt)

    with torch.no_grad():
        out = eager_twin(model)(input_ids=ids, attention_mask=mask, output_attentions=True)
    h = entropy_of(torch.stack(out.attentions)[[1, 2]]).mean(dim=(0, 2))[:, prompt:]
    n = response.sum(-1, keepdim=True)
    mean = torch.where(response, h, 0).sum(-1, keepdim=True) / n
    std = (torch.where(response, h - mean, 0).square().sum(-1, keepdim=True) / n).sqrt()
    z = torch.where(response, (h - mean) / (std + 1e-8), 0)
    weights = (1 + 0.5 * torch.tanh(z)).float()
    assert (weights[response] - 1).abs().max() > 0.1  # the weighting really acts
    expected, _ = logitless.policy_loss(logprobs, old, advantages, response,
                                        logitless.PolicyLossConfig(), token_weights=weights)
    plain, _ = logitless.policy_loss(logprobs, old, advantages, response,
                                     logitless.PolicyLossConfig())
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(loss, plain)
    loss.backward()
    assert model.lm_head.weight.grad.abs().sum() > 0


# Not named "flash": transformers would try to load a flash kernel by that name.
FAKE_FLASH = "fake_varlen_attention"


@pytest.fixture
def fake_flash():
    """A stand-in for flash-attention (not installed here) with its interface: the 2D padding
    mask (transformers' flash mask function) or, without one, packing read from position_ids;
    causal and sliding window built in. It keeps the probabilities it used."""
    kept = []

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  sliding_window=None, **kwargs):
        b, h, t, _ = query.shape
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = (j <= i)[None].expand(b, t, t).clone()
        if sliding_window is not None:
            allowed &= i - j < sliding_window
        position_ids = kwargs.get("position_ids")
        if attention_mask is not None:
            allowed &= attention_mask.bool()[:, None, :]
        elif position_ids is not None and b == 1:
            seq = (position_ids == position_ids.min()).cumsum(-1)
            allowed &= seq[:, :, None] == seq[:, None, :]
        group = h // key.shape[1]
        k = key.repeat_interleave(group, 1)
        v = value.repeat_interleave(group, 1)
        s = (query @ k.transpose(-1, -2) * scaling).masked_fill(~allowed[:, None], -torch.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        kept.append(p)
        return (p @ v).transpose(1, 2).contiguous(), None

    AttentionInterface.register(FAKE_FLASH, attention)
    AttentionMaskInterface.register(FAKE_FLASH, flash_attention_mask)
    yield kept
    ALL_ATTENTION_FUNCTIONS._global_mapping.pop(FAKE_FLASH)
    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(FAKE_FLASH)


@pytest.mark.parametrize("inputs", ["left", "right", "packed"])
def test_flash_style_implementation(fake_flash, inputs):
    """The flash branch: padding from the 2D mask the attention function receives, packing
    from position_ids; entropies equal those of the implementation's own probabilities."""
    model = build("qwen2-sliding", FAKE_FLASH)
    if inputs == "packed":
        ids = torch.randint(0, SMALL["vocab_size"], (1, 16), generator=torch.Generator())
        mask = torch.ones(1, 16, dtype=torch.long)
        positions = torch.tensor([[*range(5), *range(7), *range(4)]])
        # With the default cache transformers builds no packed mask; flash packs anyway.
        call = dict(input_ids=ids, position_ids=positions)
    else:
        ids, mask = batch(inputs)
        call = dict(input_ids=ids, attention_mask=mask, use_cache=False)
    with torch.no_grad():
        plain = model(**call).logits
        fake_flash.clear()
        with AttentionEntropyRecorder(model) as rec:
            recorded = model(**call).logits
    assert torch.equal(plain, recorded)
    assert model.config._attn_implementation == FAKE_FLASH
    expected = entropy_of(torch.stack(fake_flash))
    got = rec.per_layer()
    valid = mask.bool()[None, :, None, :].expand_as(got)
    torch.testing.assert_close(got.double()[valid], expected[valid], atol=2e-6, rtol=0)


def test_base_model_called_directly():
    """Each forward starts a fresh record, also when the base model is called on its own."""
    model = build("qwen2", "eager")
    ids, mask = batch("left")
    with torch.no_grad(), AttentionEntropyRecorder(model) as rec:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
        via_head = rec.per_layer()
        model(input_ids=ids[:2, :7], use_cache=False)  # a different batch in between
        model.model(input_ids=ids, attention_mask=mask, use_cache=False)
        direct = rec.per_layer()
    torch.testing.assert_close(direct, via_head, atol=0, rtol=0)
