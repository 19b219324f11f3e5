"""The ``logitless`` command: ``check``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys

from logitless.kernels import interpreter_compat
from logitless.tools import check
from logitless.tools.bench import cli as bench


def _demo(args: argparse.Namespace) -> int:
    from logitless.tools.demo import check_summary, run_demo

    return check_summary(args) or run_demo()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="logitless", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check.add_arguments(sub.add_parser(
        "check", help="every op against the fp64 reference on each backend present"))
    check.add_arguments(sub.add_parser(
        "demo", help="check summed up to a line per op (its options apply), then logitless side "
        "by side with plain PyTorch and stock TRL"))
    bench.add_arguments(sub.add_parser(
        "bench", help="time, peak memory and error of an op, side by side with its peers",
        epilog=bench.help_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    # Under TRITON_INTERPRET=1 (a CPU check of the Triton kernels): triton 3.6's interpreter
    # fails on numpy >= 2.4 without this fix. Applied here, for the command's process, never
    # by importing the library.
    interpreter_compat.apply()
    return {"check": check.run, "demo": _demo, "bench": bench.run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
