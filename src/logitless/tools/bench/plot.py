"""``--plot``: time and peak memory against the swept dimension, one line per provider.

One row of panels per mode (time on the left, memory on the right), log-log axes. The x axis
is the first of the op's ``x_dims`` that varies in the records (tokens, else vocabulary, ...);
the other dimensions go in the title.
"""

from __future__ import annotations

from pathlib import Path

from logitless.tools.bench.registry import get_op

_MB = 2**20


def swept_dim(records: list[dict], candidates: tuple[str, ...]) -> str:
    for dim in candidates:
        if len({r["shape"][dim] for r in records}) > 1:
            return dim
    return candidates[0]


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (it comes with the ``logitless[bench]`` extra)."""


def plot(records: list[dict], path: str | Path) -> Path:
    try:
        import matplotlib
    except ImportError as err:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'logitless[bench]'"
        ) from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    op = get_op(records[0]["op"])
    x_dim = swept_dim(records, op.x_dims or tuple(records[0]["shape"]))
    modes = list(dict.fromkeys(r["mode"] for r in records))
    providers = list(dict.fromkeys(r["provider"] for r in records))
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 3.8 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes):
        for name in providers:
            ok = sorted((r for r in records if r["provider"] == name and r["mode"] == mode
                         and r["status"] == "ok"), key=lambda r: r["shape"][x_dim])
            if not ok:
                continue
            xs = [r["shape"][x_dim] for r in ok]
            style = dict(marker="o", label=name, linestyle="--" if name == "gemm" else "-")
            row[0].plot(xs, [r["time_ms"]["median"] for r in ok], **style)
            row[0].fill_between(xs, [r["time_ms"]["p20"] for r in ok],
                                [r["time_ms"]["p80"] for r in ok], alpha=0.15)
            row[1].plot(xs, [max(r["peak_bytes"], 1) / _MB for r in ok], **style)
        row[0].set_ylabel(f"{mode}: time (ms, median, p20-p80)")
        row[1].set_ylabel(f"{mode}: peak MB beyond inputs+grads")
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(x_dim)
            ax.grid(True, which="both", alpha=0.3)
        row[0].legend(fontsize=8)
    fixed = {k: v for k, v in records[0]["shape"].items() if k != x_dim}
    r = records[0]
    fig.suptitle(f"{r['op']} on {r['device']} ({r['device_name']}), {r['dtype']}, "
                 + ", ".join(f"{k}={v}" for k, v in fixed.items()), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
