"""Tiny offline stand-ins for a real GRPO setup, for ``logitless demo`` and
``examples/trl_grpo.py``: a word-level tokenizer, a randomly initialised Qwen2 built from its
config, an in-memory prompt set and a Python reward. Nothing is downloaded, so the demo trains
on a CPU without a network. With a real model, use its tokenizer, weights and data instead.

Needs the ``trl`` extra (transformers, tokenizers, datasets).
"""

from __future__ import annotations

import random

import torch

PROMPTS = ("the cat", "a dog ran", "two birds", "seven old", "blue water", "the red house",
           "one tall tree", "under a mat")
SPECIAL = ("<pad>", "<eos>", "<unk>")


def tokenizer(vocab_size: int = 300):
    """A word-level tokenizer: the special tokens, the prompts' words, then made-up words (seeded)
    up to ``vocab_size``. Splits on white space; decoding joins words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = dict.fromkeys([*SPECIAL, *" ".join(PROMPTS).split()])
    rng = random.Random(0)
    while len(words) < vocab_size:
        words.setdefault("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 8))))
    vocab = {word: i for i, word in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def qwen2(tok, *, hidden: int = 32, layers: int = 2, seed: int = 0, heads: int | None = None):
    """A randomly initialised fp32 Qwen2 causal LM over ``tok``'s vocabulary (untied head), with
    ``heads`` attention heads (None: ``max(hidden // 16, 2)``) and half as many key/value heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    heads = max(hidden // 16, 2) if heads is None else heads
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None))


def prompts(n: int = len(PROMPTS)):
    """A ``datasets.Dataset`` of ``n`` prompts (``PROMPTS``, repeated)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def vowel_reward(completions, **kwargs) -> list[float]:
    """Reward: the fraction of vowels in each completion's text (it varies between samples)."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]
