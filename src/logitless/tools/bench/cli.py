"""Arguments and entry point of ``logitless bench``."""

from __future__ import annotations

import argparse
import signal
import sys

OPS = ("logprobs", "policy-loss", "attention-entropy", "divergence")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", choices=OPS, default="logprobs")
    p.add_argument("--preset", help="shape sweep (default: the op's small preset); see "
                   "logitless.tools.bench.shapes.PRESETS")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--mode", default="fwd-bwd", choices=("fwd", "fwd-bwd", "both"))
    p.add_argument("--providers", help="comma-separated subset (default: all of the op's)")
    p.add_argument("--top-k", type=int, dest="top_k",
                   help="logprobs: vLLM's top-k truncation (sampler-matched logprobs; only the "
                   "providers that compute them run: logitless, naive)")
    p.add_argument("--top-p", type=float, dest="top_p", help="logprobs: vLLM's top-p")
    p.add_argument("--min-p", type=float, dest="min_p", help="logprobs: vLLM's min-p")
    for dim in ("tokens", "hidden", "vocab", "seq", "heads", "head_dim"):
        p.add_argument(f"--{dim.replace('_', '-')}", type=int, nargs="+", dest=dim,
                       help=f"{dim} sizes, replacing the preset's")
    p.add_argument("--warmup", type=int, default=None, help="calls before measuring (CPU 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (CPU 3, CUDA 20)")
    p.add_argument("--block-rows", type=int, default=32,
                   help="tokens in the block checked against the fp64 reference")
    p.add_argument("--interpret-max-tokens", type=int, default=64,
                   help="largest token count for providers run under the Triton interpreter")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process")
    p.add_argument("--no-isolate", action="store_true",
                   help="measure in this process (default on CUDA; on CPU a child per row)")
    p.add_argument("--json", help="write one record per row to this file")
    p.add_argument("--plot", help="write a PNG of time and memory to this file")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--from-json", metavar="PATH",
                   help="measure nothing: print the table (and --plot) of a saved --json file")


def help_epilog() -> str:
    """The ops, their providers (what each computes) and the shape presets, for ``--help``."""
    from logitless.tools.bench.registry import PROVIDERS, describe_provider, load
    from logitless.tools.bench.shapes import PRESETS

    load()
    lines = ["ops and their providers:"]
    for op in OPS:
        lines.append(f"  {op}: " + ", ".join(p.name for p in PROVIDERS.get(op, [])))
    lines.append("providers:")
    names = dict.fromkeys(p.name for ps in PROVIDERS.values() for p in ps)
    lines += [f"  {n}: {describe_provider(n)}" for n in names]
    lines.append("presets (--preset): " + ", ".join(PRESETS))
    return "\n".join(lines)


def settings_from(args: argparse.Namespace):
    import torch

    from logitless.tools.bench.registry import get_op
    from logitless.tools.bench.runner import Settings
    from logitless.tools.bench.shapes import DEFAULT_PRESET, explicit_shapes, preset_shapes

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    op = get_op(args.op)
    preset = preset_shapes(args.preset or DEFAULT_PRESET[args.op], args.op, device)
    shapes = explicit_shapes(op.dims, {d: getattr(args, d, None) for d in op.dims}, preset)
    cpu = device == "cpu"
    options = {k: getattr(args, k, None) for k in ("top_k", "top_p", "min_p")}
    options = {k: v for k, v in options.items() if v is not None}
    if options and args.op != "logprobs":
        raise ValueError("--top-k/--top-p/--min-p apply to --op logprobs only")
    return Settings(
        op=args.op, shapes=shapes,
        modes=list(op.modes) if args.mode == "both" else [args.mode],
        dtype=args.dtype or ("float32" if cpu else "bfloat16"), device=device,
        providers=args.providers.split(",") if args.providers else None,
        warmup=args.warmup if args.warmup is not None else (1 if cpu else 0),
        repeats=args.repeats if args.repeats is not None else (3 if cpu else 20),
        block_rows=args.block_rows, isolate=False if args.no_isolate else None,
        interpret_max_tokens=args.interpret_max_tokens, timeout_s=args.timeout,
        progress=not args.no_progress, options=options)


def run(args: argparse.Namespace) -> int:
    from logitless.tools.bench.report import describe, format_table, read_json, write_json
    from logitless.tools.bench.runner import run_sweep

    # `timeout` and job control send SIGTERM: exit through Python so that subprocess.run kills
    # the running child measurement instead of leaving it orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.from_json:
        records = read_json(args.from_json)
    else:
        try:
            settings = settings_from(args)
        except ValueError as err:
            print(f"logitless bench: {err}", file=sys.stderr)
            return 2
        records = run_sweep(settings,
                            (lambda rs: write_json(rs, args.json)) if args.json else None)
    print(format_table(records))
    print(describe(records))
    if args.json and not args.from_json:
        print(f"wrote {args.json}")
    if args.plot:
        from logitless.tools.bench.plot import PlotUnavailable, plot

        try:
            plot(records, args.plot)
        except PlotUnavailable as err:
            print(f"logitless bench: {err}", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    failed = [r for r in records if r["status"] == "failed" and r["provider"] == "logitless"]
    return 1 if failed else 0
