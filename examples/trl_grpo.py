"""GRPO with TRL and logitless, offline on a CPU: a tiny Qwen2 built from its config, a word-level
tokenizer, an in-memory prompt set and a Python reward (``logitless.tools.tiny``).

    python examples/trl_grpo.py                 # TRL's own loss (dapo), computed by logitless
    python examples/trl_grpo.py --objective gmpo
    python examples/trl_grpo.py --objective dapo --attention-entropy   # anchors / explorers
    python examples/trl_grpo.py --beta 0.04     # a KL term to the reference model

With a real model, pass its name or path as ``model`` and drop the tiny pieces; the trainer
line is the only change from a TRL script.

A KL term (``beta > 0``) needs TRL's reference model, which TRL 1.16 rebuilds from the
policy's name or path (``model.config._name_or_path``; it takes no reference model of its
own). A model built in memory has none, so the example saves it to a folder and passes the
folder, as you would with a model you changed in memory.
"""

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trl import GRPOConfig

from logitless import PolicyLossConfig
from logitless.integrations.trl import GRPOTrainer, config_from_grpo
from logitless.tools import tiny  # tiny offline stand-ins for a real setup


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objective", default=None,
                        help="a logitless objective (gmpo, minpro, ctpo, ...); default: TRL's")
    parser.add_argument("--attention-entropy", action="store_true",
                        help="weight tokens by their attention entropy (1 + 0.5 tanh z)")
    parser.add_argument("--beta", type=float, default=0.0,
                        help="KL coefficient to the reference model (GRPOConfig.beta)")
    parser.add_argument("--steps", type=int, default=6)
    cli = parser.parse_args()

    tokenizer = tiny.tokenizer()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=8, num_generations=4,
            max_completion_length=16, max_steps=cli.steps, num_iterations=2,
            learning_rate=5e-3, logging_steps=1, report_to=[], bf16=False, use_cpu=True,
            save_strategy="no", loss_type="dapo", beta=cli.beta,
        )
        # Default: TRL's loss for `args` (config_from_grpo). Anything else: a PolicyLossConfig,
        # whose fields override the GRPOConfig's (beta, the clip range... come from `args`).
        loss_config = config_from_grpo(args)
        if cli.objective or cli.attention_entropy:
            extra = dict(attn_entropy_weighting="tanh") if cli.attention_entropy else {}
            loss_config = PolicyLossConfig(objective=cli.objective or "dapo", **extra)
        model = tiny.qwen2(tokenizer)
        if cli.beta:  # TRL builds the reference model from a path: give it one
            model.save_pretrained(os.path.join(out, "policy"))
            model = os.path.join(out, "policy")
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=tiny.vowel_reward,
            args=args,
            train_dataset=tiny.prompts(),
            processing_class=tokenizer,
            loss_config=loss_config,
        )
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:  # rewards are logged on the steps that generate
            reward = f"{entry['reward']:.3f}" if "reward" in entry else "-"
            kl = f" kl {entry['kl']:.4f}" if "kl" in entry else ""
            print(f"step {entry['step']}: loss {entry['loss']:+.4f} reward {reward} "
                  f"ratio max {entry['logitless/ratio/max']:.3f}{kl}")


if __name__ == "__main__":
    main()
