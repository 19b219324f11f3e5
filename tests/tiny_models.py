"""Test fixtures for the TRL tests: the tiny Qwen2, prompt set and reward of
``logitless.tools.tiny`` (the demo's), and what only the tests need: a byte-level BPE tokenizer
trained here on made-up words (it encodes any text, the tests' made-up completions too) and a
trainer mixin recording the head's calls. The tests train offline on a CPU."""

from __future__ import annotations

import random

import torch

from logitless.tools import tiny
from logitless.tools.tiny import prompts as prompt_dataset
from logitless.tools.tiny import vowel_reward

__all__ = ["RecordingHeadCalls", "prompt_dataset", "tiny_qwen2", "tiny_tokenizer", "vowel_reward"]

SENTENCE = ("the cat sat on a mat while one dog ran to the red house and two birds sang "
            "about blue water under a tall green tree near seven old stones")


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
    """``tiny.qwen2`` with 4 attention heads (2 key/value heads) at every ``hidden``."""
    return tiny.qwen2(tokenizer, hidden=hidden, layers=layers, seed=seed, heads=4)


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
