"""The ``logitless`` command: ``check``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys


def _check(args: argparse.Namespace) -> int:
    from logitless.checks import run

    return run(args)


def _demo(args: argparse.Namespace) -> int:
    from logitless.demo import run_demo

    status = _check(args)
    if status:
        return status
    return run_demo()


def _bench(args: argparse.Namespace) -> int:
    from logitless.tools.bench.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    from logitless.checks import add_arguments as add_check_arguments
    from logitless.tools.bench.cli import add_arguments

    parser = argparse.ArgumentParser(prog="logitless", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_check_arguments(sub.add_parser(
        "check", help="every op against the fp64 reference on each backend present"))
    add_check_arguments(sub.add_parser(
        "demo", help="check (its options apply), then logitless side by side with plain PyTorch"))
    add_arguments(sub.add_parser(
        "bench", help="time, peak memory and error of an op, side by side with its peers"))
    args = parser.parse_args(argv)
    return {"check": _check, "demo": _demo, "bench": _bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
