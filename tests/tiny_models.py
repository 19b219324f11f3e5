"""Test fixtures for the TRL tests: a tiny Qwen2 built from its config, a byte-level BPE
tokenizer trained here on made-up words, an in-memory prompt set and a Python reward, so the
tests train offline on a CPU."""

from __future__ import annotations

import random

import torch

SENTENCE = ("the cat sat on a mat while one dog ran to the red house and two birds sang "
            "about blue water under a tall green tree near seven old stones")
PROMPTS = ["the cat", "a dog ran", "two birds", "seven old", "blue water", "the red house",
           "one tall tree", "under a mat"]


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained here on made-up words (``<pad>``, ``<eos>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    made_up = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
               for _ in range(4 * vocab_size)]
    corpus = [SENTENCE] + [" ".join(made_up[i:i + 16]) for i in range(0, len(made_up), 16)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_qwen2(tokenizer, *, hidden: int = 32, layers: int = 2, seed: int = 0):
    """A randomly initialised fp32 Qwen2 causal LM over ``tokenizer``'s vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def prompt_dataset(n: int = len(PROMPTS)):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def vowel_reward(completions, **kwargs) -> list[float]:
    """Reward: the fraction of vowels in the completion's text (varies between samples)."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


class RecordingHeadCalls:
    """Mixin for a ``GRPOTrainer`` subclass: keeps, for every forward-helper call, what the
    head returned and ``self.oracle(h, weight, bias, labels, model, kwargs)`` (a dict) of the
    same call, computed in fp64 from the model's own final hidden states ``h`` and LM head at
    that moment, at the completion positions (``labels`` -100 at padding)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
            compute_entropy=compute_entropy, **kwargs)
        module = self.accelerator.unwrap_model(model)
        if hasattr(module, "get_base_model"):  # PEFT: the model with its adapters injected
            module = module.get_base_model()
        with torch.no_grad():
            hidden = module.model(input_ids=input_ids,
                                  attention_mask=attention_mask).last_hidden_state[:, :-1]
            labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
            keep = (slice(None), slice(-logits_to_keep, None))
            h, y = hidden[keep].double(), labels[keep]
            head = module.lm_head
            bias = None if head.bias is None else head.bias.double()
            oracle = self.oracle(h, head.weight.double(), bias, y, model,
                                 dict(kwargs, logits_to_keep=logits_to_keep))
        self.calls.append(dict(
            reference=model is self.ref_model or self._reference_pass,
            grad=torch.is_grad_enabled(),
            logps=logps.detach(), entropy=None if entropies is None else entropies.detach(),
            mask=y != -100, **oracle))
        return logps, entropies, aux
