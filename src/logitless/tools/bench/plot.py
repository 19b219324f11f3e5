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
    from matplotlib.ticker import FuncFormatter

    from logitless.tools.bench.report import skipped

    op = get_op(records[0]["op"])
    x_dim = swept_dim(records, op.x_dims or tuple(records[0]["shape"]))
    modes = list(dict.fromkeys(r["mode"] for r in records))
    providers = list(dict.fromkeys(r["provider"] for r in records))
    one_shape = len({r["shape"][x_dim] for r in records}) == 1
    fig, axes = plt.subplots(len(modes), 3, figsize=(15, 3.8 * len(modes)), squeeze=False)
    decimal = FuncFormatter(lambda v, _: f"{v:g}")
    for row, mode in zip(axes, modes):
        ran = []
        for name in providers:
            ok = sorted((r for r in records if r["provider"] == name and r["mode"] == mode
                         and r["status"] == "ok"), key=lambda r: r["shape"][x_dim])
            if ok:
                ran.append((name, ok))
        for k, (name, ok) in enumerate(ran):
            panels = ([r["time_ms"]["median"] for r in ok],
                      [max(r["peak_bytes"], 1) / _MB for r in ok],
                      [r.get("floor_ratio") for r in ok])
            if one_shape:  # one shape: bars, one per provider
                for ax, values in zip(row, panels):
                    if values[0] is not None:
                        ax.bar(k, values[0], label=name,
                               hatch="//" if name == "gemm" else None)
                continue
            xs = [r["shape"][x_dim] for r in ok]
            style = dict(marker="o", label=name, linestyle="--" if name == "gemm" else "-")
            row[0].plot(xs, panels[0], **style)
            row[0].fill_between(xs, [r["time_ms"]["p20"] for r in ok],
                                [r["time_ms"]["p80"] for r in ok], alpha=0.15)
            row[1].plot(xs, panels[1], **style)
            pairs = [(x, v) for x, v in zip(xs, panels[2]) if v is not None]
            if pairs:
                row[2].plot(*zip(*pairs), **style)
        row[0].set_ylabel(f"{mode}: time (ms, median, p20-p80)")
        row[1].set_ylabel(f"{mode}: peak MB beyond inputs+grads")
        row[2].set_ylabel(f"{mode}: time / the plain GEMMs' time")
        for ax in row:
            ax.grid(True, which="both", alpha=0.3)
            if one_shape:
                ax.set_xticks(range(len(ran)), [n for n, _ in ran], rotation=30, fontsize=8)
                continue
            ax.set_xscale("log", base=2)
            ax.set_xlabel(x_dim)
            ax.xaxis.set_major_formatter(decimal)
        for ax in row[:2]:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(decimal)
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        row[2].axhline(1.0, color="grey", linewidth=0.8)
        row[0].legend(fontsize=8)
    fixed = {k: v for k, v in records[0]["shape"].items() if k != x_dim or one_shape}
    r = records[0]
    fig.suptitle(f"{r['op']}, {r['dtype']}, on {r['device_name'] or r['device']}: "
                 + ", ".join(f"{k}={v}" for k, v in fixed.items()), fontsize=10)
    gone = skipped(records)
    if gone:
        fig.text(0.01, 0.005, "not run: " + "; ".join(f"{n} ({why})" for n, why in gone.items()),
                 fontsize=7, wrap=True)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
