"""One training step on CPU: eager wall time, and optionally compiled.

The step (``--step logprobs``, the default): ``linear_logprobs(hidden [N, D], weight [V, D],
targets, return_entropy=True)`` (one target in ten ignored), a loss of the logprobs and
entropies, its backward to ``hidden`` and ``weight``. With ``--step fused``: a GRPO
``fused_policy_loss`` (k3 KL at beta 0.04, entropy bonus 0.01) over N tokens as sequences of
256 (the last 20 of each masked), and its backward. Prints one JSON line: the median and
minimum of ``--repeats`` eager steps after one warm-up, and with ``--compile BACKEND`` the
first compiled call's time (tracing and compiling included) and the compiled steps' median.

Usage: ``python benchmarks/compile_step_cpu.py [--step logprobs|fused] [--n 2048] [--d 1024]
[--v 32000] [--repeats 5] [--compile aot_eager|inductor]``. Run it against two checkouts
(``PYTHONPATH``) to compare eager speed before and after a change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from logitless.fused_losses.head.logprobs import linear_logprobs


def loss_of(hidden, weight, targets):
    out = linear_logprobs(hidden, weight, targets, return_entropy=True)
    return out.logprobs.sum() + 0.1 * out.entropy.sum()


def fused_inputs(n, gen):
    """Targets, mask, old and reference logprobs and advantages of ``n`` tokens as sequences
    of 256 (``n`` a multiple of 256)."""
    b, t = n // 256, 256
    mask = torch.ones(b, t)
    mask[:, -20:] = 0
    old = torch.randn(b, t, generator=gen) - 3
    return mask, old, old + 0.1, torch.randn(b, generator=gen)


def fused_loss_of(extra):
    from logitless import PolicyLossConfig
    from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss

    config = PolicyLossConfig(objective="grpo", beta=0.04, entropy_coef=0.01)
    mask, old, ref, adv = extra

    def loss(hidden, weight, targets):
        b = mask.shape[0]
        value, _ = fused_policy_loss(hidden.view(b, -1, hidden.shape[-1]), weight,
                                     targets.view(b, -1), old, adv, mask, config,
                                     ref_logprobs=ref)
        return value

    return loss


def step(forward, hidden, weight, targets):
    forward(hidden, weight, targets).backward()
    hidden.grad = weight.grad = None


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", choices=("logprobs", "fused"), default="logprobs")
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--v", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", choices=("aot_eager", "inductor"), default=None)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.n, args.d, generator=g).requires_grad_()
    weight = (torch.randn(args.v, args.d, generator=g) / args.d**0.5).requires_grad_()
    targets = torch.randint(0, args.v, (args.n,), generator=g)
    if args.step == "fused":
        if args.n % 256:
            parser.error("--step fused takes --n as a multiple of 256")
        fn = fused_loss_of(fused_inputs(args.n, g))
    else:
        targets[::10] = -100
        fn = loss_of
    result = dict(step=args.step, n=args.n, d=args.d, v=args.v,
                  threads=torch.get_num_threads())
    timed(step, fn, hidden, weight, targets)  # warm-up
    eager = [timed(step, fn, hidden, weight, targets) for _ in range(args.repeats)]
    result.update(eager_median_s=statistics.median(eager), eager_min_s=min(eager))
    if args.compile:
        compiled = torch.compile(fn, backend=args.compile, fullgraph=True)
        result["compile_first_call_s"] = timed(step, compiled, hidden, weight, targets)
        runs = [timed(step, compiled, hidden, weight, targets) for _ in range(args.repeats)]
        result.update(backend=args.compile, compiled_median_s=statistics.median(runs),
                      compiled_min_s=min(runs))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                      for k, v in result.items()}))


if __name__ == "__main__":
    main()
