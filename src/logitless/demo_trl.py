"""GRPO through TRL on a tiny model, stock TRL beside logitless: the LM head's time and memory.

Everything is built in-process (a Qwen2 model from its config, a byte-level BPE tokenizer
trained on made-up words, an in-memory prompt set, a Python reward), so it runs offline on
a CPU. The tests and ``examples/trl_grpo.py`` use the same pieces.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager

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


class _TimedKernel:
    """Wraps a fused-head kernel's ``apply``: forward time, calls, and the training call's
    shape (rows, hidden, vocab)."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls, self.shape = inner, 0.0, 0, None

    def apply(self, hidden, weight, *args):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.inner(hidden, weight, *args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        if torch.is_grad_enabled():
            self.shape = {"tokens": hidden.shape[0], "hidden": weight.shape[1],
                          "vocab": weight.shape[0]}
        return out


@contextmanager
def _timed(owner, name):
    """Times ``owner.name``: TRL's kernel class in its module, or our class's ``apply``."""
    saved = vars(owner)[name]
    if isinstance(saved, staticmethod):
        timer = _TimedKernel(saved.__func__)
        replacement = staticmethod(timer.apply)
    else:
        timer = replacement = _TimedKernel(saved.apply)
    setattr(owner, name, replacement)
    try:
        yield timer
    finally:
        setattr(owner, name, saved)


def _train(trainer_cls, steps, tokenizer, device, workdir):
    from transformers import PrinterCallback
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=workdir, per_device_train_batch_size=16, num_generations=4,
        max_completion_length=48, max_steps=steps, learning_rate=1e-3, logging_steps=1,
        report_to=[], bf16=False, use_cpu=device == "cpu", seed=0, save_strategy="no",
        disable_tqdm=True, num_iterations=2, steps_per_generation=2,
    )
    trainer = trainer_cls(model=tiny_qwen2(tokenizer, hidden=64), reward_funcs=vowel_reward,
                          args=args, train_dataset=prompt_dataset(32),
                          processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_trl_demo(steps: int = 4, vocab_size: int = 8192) -> int:
    """A few GRPO steps with TRL's trainer and with logitless's, then the LM head's time and
    peak memory side by side at the shape those steps sent it (``logitless bench``)."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("trl") is None:
        print("\nGRPO through TRL: skipped, TRL is not installed (pip install 'logitless[trl]')")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import trl.trainer.utils as trl_utils
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer as StockTrainer

    from logitless.integrations import trl_head
    from logitless.integrations.trl import GRPOTrainer
    from logitless.tools.bench.runner import Settings, run_sweep

    hf_logging.set_verbosity_error()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = tiny_tokenizer(vocab_size)
    runs = (("stock TRL", StockTrainer, trl_utils, "_ChunkedLogProbFunction"),
            ("logitless", GRPOTrainer, trl_head.LogitlessChunkedLogProb, "apply"))
    print(f"\nGRPO through TRL: {steps} steps of a tiny Qwen2 (vocab {len(tokenizer)}, hidden "
          f"64, {device}), stock GRPOTrainer beside logitless.integrations.trl.GRPOTrainer")
    print(f"{'trainer':<12}{'head calls':>11}{'head fwd ms':>13}  losses")
    shape = None
    with tempfile.TemporaryDirectory() as workdir:
        for name, cls, owner, attr in runs:
            with _timed(owner, attr) as timer:
                losses = _train(cls, steps, tokenizer, device, workdir)
            shape = shape or timer.shape
            shown = " ".join(f"{x:+.4f}" for x in losses)
            print(f"{name:<12}{timer.calls:>11}{timer.seconds * 1e3:>13.1f}  {shown}")
    print(f"\nthe head, forward+backward with entropy at the training call's shape {shape}, "
          f"fp32, each kernel in its own process (logitless bench):")
    records = run_sweep(Settings(op="logprobs", shapes=[shape], modes=["fwd-bwd"],
                                 providers=["trl", "logitless"], device=device, warmup=1,
                                 repeats=3, progress=False))
    print(f"{'kernel':<12}{'time ms':>10}{'peak MiB':>10}")
    for r in records:
        if r["status"] != "ok":
            print(f"{r['provider']:<12}{r['status']}: {r['reason']}")
            continue
        print(f"{r['provider']:<12}{r['time_ms']['median']:>10.2f}"
              f"{r['peak_bytes'] / 2**20:>10.2f}")
    return 0 if all(r["status"] == "ok" for r in records) else 1
