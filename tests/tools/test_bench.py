"""``logitless bench``, the demo's table and the GPU script's dry run, on tiny CPU shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logitless import reference
from logitless.tools.bench.measure import Figures, block_errors, measure, quantiles
from logitless.tools.bench.ops_logprobs import TorchLinearCrossEntropy, torch_linear_logprobs
from logitless.tools.bench.registry import Provider, get_op, get_providers
from logitless.tools.bench.report import format_table
from logitless.tools.cli import main
from logitless.tools.demo import side_by_side

from testing import assert_close_to_oracle

ROOT = Path(__file__).resolve().parents[2]
N, D, V = 48, 32, 3000
# PyTorch's chunked F.linear_cross_entropy (the "torch" provider) exists from torch 2.13.
HAS_TORCH_LCE = hasattr(torch.nn, "LinearCrossEntropyOptions")
needs_torch_lce = pytest.mark.skipif(not HAS_TORCH_LCE,
                                     reason="F.linear_cross_entropy needs torch >= 2.13")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One isolated (child process per row) fwd-bwd run of three providers, JSON and plot."""
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--op", "logprobs", "--device", "cpu", "--tokens", str(N), "--hidden",
            str(D), "--vocab", str(V), "--providers", "logitless,naive,gemm,verl,torch",
            "--repeats", "2", "--warmup", "1", "--no-progress", "--json", str(out / "r.json"),
            "--plot", str(out / "r.png")]
    assert main(argv) == 0
    return json.loads((out / "r.json").read_text()), out


def test_records(bench_run):
    records, out = bench_run
    by = {r["provider"]: r for r in records}
    assert set(by) == {"logitless", "naive", "gemm", "verl", "torch"}
    for name in ("logitless", "naive", "gemm", *(("torch",) if HAS_TORCH_LCE else ())):
        r = by[name]
        assert r["status"] == "ok", r["reason"]
        assert r["op"] == "logprobs" and r["mode"] == "fwd-bwd" and r["device"] == "cpu"
        assert r["shape"] == {"tokens": N, "hidden": D, "vocab": V}
        assert r["dtype"] == "float32" and r["versions"]["torch"] == torch.__version__
        t = r["time_ms"]
        assert 0 < t["p20"] <= t["median"] <= t["p80"]
        assert r["grad_bytes"] == (N * D + V * D) * 4
    assert by["gemm"]["floor_ratio"] == pytest.approx(1.0)
    assert by["logitless"]["floor_ratio"] > 0
    # The naive provider holds at least the fp32 [N, V] logits beyond inputs and gradients:
    # a probe that missed the child's allocations would report less.
    assert by["naive"]["peak_bytes"] >= N * V * 4
    for name in ("logitless", "naive"):
        errs = by[name]["errors"]
        assert set(errs) == {"logprobs", "entropy", "d_hidden", "d_weight"}
        assert max(errs.values()) < 1e-4, errs
    if HAS_TORCH_LCE:
        assert set(by["torch"]["errors"]) == {"logprobs", "d_hidden", "d_weight"}
        assert max(by["torch"]["errors"].values()) < 1e-4, by["torch"]["errors"]
    else:
        assert by["torch"]["status"] == "unavailable" and "2.13" in by["torch"]["reason"]
    # A provider that cannot run is listed with its reason, not dropped.
    reason = by["verl"]["reason"]
    assert by["verl"]["status"] == "unavailable" and ("CUDA" in reason or "installed" in reason)
    assert "unavailable: verl" in format_table(records)
    assert (out / "r.png").stat().st_size > 10_000


def test_demo_table(bench_run):
    records, _ = bench_run
    text = side_by_side(records)
    assert "naive PyTorch" in text and "logitless/naive" in text


def test_gpu_script_dry_run(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh"), str(tmp_path),
                           "--dry-run"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the sweeps merged into <tag>.json (passes-<tag>.json is the per-pass profile)
    (merged,) = [p for p in tmp_path.glob("*-dry-run.json") if not p.name.startswith("passes-")]
    records = json.loads(merged.read_text())
    sweeps = {r["sweep"] for r in records}
    assert sweeps == {"logprobs-16k", "policy-loss-16k", "logprobs-sweep", "divergence-4k",
                      "logprobs-topp-4k", "attention-entropy"}
    assert {r["op"] for r in records} == {"logprobs", "policy-loss", "divergence",
                                          "attention-entropy"}
    for r in records:
        if r["provider"] == "torch" and not HAS_TORCH_LCE:
            assert r["status"] == "unavailable"
            continue
        assert r["status"] == "ok", (r["provider"], r["reason"])
        if r["provider"] != "gemm":
            # bf16 inputs: errors at bf16 rounding, far below what a wrong result gives
            assert max(r["errors"].values()) < 0.1, (r["op"], r["provider"], r["errors"])
    assert len(list(tmp_path.glob("*.png"))) == 6
    # The GEMM floor runs first in every sweep (a sweep cut short keeps its ratios).
    for sweep in sweeps:
        assert next(r for r in records if r["sweep"] == sweep)["provider"] == "gemm"
    assert "torch" in {r["provider"] for r in records if r["op"] == "logprobs"}
    assert "== check: exit 0" in done.stdout
    # check runs first, before any sweep, and its log holds its streamed rows and its tally
    steps = [ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("== ")
             and "(limit" in ln]
    assert steps[:3] == ["check", "invariance", "passes"], steps
    assert "== invariance: exit 0" in done.stdout and "== passes: exit 0" in done.stdout
    invariance = (tmp_path / "invariance.log").read_text()
    assert invariance.rstrip().endswith("all bitwise equal")
    # ops x placements (five, then the last chunk padded to 64 rows: the one height of a
    # 64-row chunk's family, its granule capped at the chunk) x outputs
    assert invariance.count(" ok\n") == 2 * (5 + 1) * 3
    assert "last chunk 64" in invariance
    (passes,) = tmp_path.glob("passes-*.json")
    assert [r["path"] for r in json.loads(passes.read_text())] == [
        "logprobs-nograd", "logprobs-fwd-bwd", "fused-policy-loss"]
    check_log = (tmp_path / "check.log").read_text().splitlines()
    assert check_log[0].split()[:3] == ["op", "case", "backend"]
    assert sum(ln.endswith(" ok") for ln in check_log) > 20
    assert check_log[-1].endswith("0 failed")
    # The summary table comes last: its header, one line per record, then the closing line.
    lines = done.stdout.rstrip().splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("== summary"))
    assert lines[head + 1].split()[:4] == ["sweep", "shape", "mode", "provider"]
    assert len(lines) == head + 2 + len(records) + 1 and lines[-1].startswith("done in")


def test_wheel_plan_leaves_out_what_the_gpu_machine_has(tmp_path):
    # --list prints the plan from this environment's metadata and fetches nothing.
    done = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/download_wheels.sh"), "--list",
                           sys.executable], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = [ln.split() for ln in done.stdout.splitlines()]
    present = {ln.strip() for ln in (ROOT / "benchmarks/gpu/device_packages.txt").read_text()
               .splitlines() if ln.strip() and not ln.startswith("#")}
    assert {"torch", "triton", "transformers", "matplotlib", "pytest"} <= present
    names = [pin.split("==")[0] for _, pin in plan]
    assert len(names) == len(set(names)), "a package planned twice"
    assert not set(names) & present
    assert not {n for n in names if n.startswith(("torch", "triton", "nvidia-"))}
    groups = list(dict.fromkeys(g for g, _ in plan))
    order = ["base", "trl", "liger", "cce", "verl"]
    assert groups == [g for g in order if g in groups]
    from importlib.metadata import version

    assert ["trl", f"trl=={version('trl')}"] in plan
    assert ["liger", f"liger-kernel=={version('liger-kernel')}"] in plan


def test_quantiles():
    q = quantiles([5.0, 1.0, 3.0, 2.0, 4.0])
    assert q["median"] == 3.0 and q["p20"] == pytest.approx(1.8) and q["p80"] == pytest.approx(4.2)
    assert quantiles([7.0]) == {"median": 7.0, "p20": 7.0, "p80": 7.0}


class _Broken(Provider):
    op, name, quantities = "logprobs", "broken", ("logprobs",)

    def forward(self, inputs):
        raise RuntimeError("no kernel for this device")


def test_failing_provider_is_a_row():
    shape = {"tokens": 4, "hidden": 8, "vocab": 16}
    got = measure(get_op("logprobs"), _Broken(), shape, "fwd", torch.float32, "cpu", warmup=0,
                  repeats=1, block_rows=4)
    assert got.status == "failed" and "no kernel for this device" in got.reason
    row = {"op": "logprobs", "provider": "broken", "mode": "fwd", "shape": shape,
           "quantities": ["logprobs"], **Figures(status="failed", reason="boom").to_dict()}
    assert "failed: boom" in format_table([row])


def test_plot_without_matplotlib_says_which_extra(tmp_path, monkeypatch, capsys):
    # None in sys.modules makes `import matplotlib` raise ImportError, as when it is absent.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["bench", "--op", "logprobs", "--device", "cpu", "--tokens", "8", "--hidden", "16",
            "--vocab", "64", "--providers", "gemm", "--mode", "fwd", "--repeats", "1",
            "--no-isolate", "--no-progress", "--json", str(tmp_path / "r.json"),
            "--plot", str(tmp_path / "r.png")]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert err == "logitless bench: --plot needs matplotlib: pip install 'logitless[bench]'"
    assert json.loads((tmp_path / "r.json").read_text())[0]["status"] == "ok"
    assert not (tmp_path / "r.png").exists()


def _torch_provider_case(dtype):
    gen = torch.Generator().manual_seed(7)
    n, d, v = 37, 96, 1007
    hidden = torch.randn(n, d, generator=gen).to(dtype)
    weight = (torch.randn(v, d, generator=gen) * 2 / d**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    return hidden, weight, targets, upstream


def _lp_and_grads(fn, hidden, weight, targets, upstream):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = fn(h, w, targets)
    (lp * upstream.to(lp.dtype)).sum().backward()
    return lp.detach(), h.grad, w.grad


@needs_torch_lce
def test_torch_provider_matches_the_reference_with_temperature():
    hidden, weight, targets, upstream = _torch_provider_case(torch.float32)

    def ours(h, w, t):
        return torch_linear_logprobs(h, w, t, temperature=0.7)

    def oracle(h, w, t):
        return reference.linear_softmax_stats(h, w, t, temperature=0.7)["logprobs"]

    got = _lp_and_grads(ours, hidden, weight, targets, upstream)
    want = _lp_and_grads(oracle, hidden.double(), weight.double(), targets, upstream.double())
    assert got[0].dtype == torch.float32
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@needs_torch_lce
def test_torch_provider_in_bf16_is_no_worse_than_bf16_logits():
    # PyTorch's op returns the loss in the input dtype (bf16 here), so the same-dtype torch
    # baseline is its documented unchunked equivalent in bf16: cross_entropy of bf16 logits.
    hidden, weight, targets, _ = _torch_provider_case(torch.bfloat16)
    lp = torch_linear_logprobs(hidden, weight, targets, temperature=0.7)
    oracle = reference.linear_softmax_stats(hidden.double(), weight.double(), targets,
                                            temperature=0.7)["logprobs"]
    z16 = (hidden / 0.7) @ weight.t()
    same = -torch.nn.functional.cross_entropy(z16, targets, reduction="none")
    # Both round their result to bf16 once, possibly to neighbouring values: allow that one
    # rounding (bf16's unit roundoff, 2^-8 relative) on top of the baseline's error.
    assert_close_to_oracle(lp, oracle, same, oracle.abs() * 2.0**-8, "torch provider logprobs")


@needs_torch_lce
def test_torch_provider_unavailable_without_the_chunked_api(monkeypatch):
    provider = TorchLinearCrossEntropy()
    assert provider.unavailable("cpu", torch.float32, "fwd-bwd") is None
    monkeypatch.delattr(torch.nn, "LinearCrossEntropyOptions")
    reason = provider.unavailable("cpu", torch.float32, "fwd-bwd")
    assert "LinearCrossEntropyOptions" in reason and "2.13" in reason


def test_reference_in_row_chunks_gives_the_same_errors():
    # The error column at a timed shape runs the fp64 reference a chunk of rows at a time
    # (odd chunk: the last one is short); it must give what one pass over every row gives.
    op, provider = get_op("logprobs"), get_providers("logprobs", ["logitless"])[0]
    shape = {"tokens": 37, "hidden": 96, "vocab": 1007}
    inputs = op.make_inputs(shape, torch.float32, "cpu")
    whole = block_errors(op, provider, inputs, "fwd-bwd", 37, ref_chunk_rows=37)
    chunked = block_errors(op, provider, inputs, "fwd-bwd", 37, ref_chunk_rows=8)
    assert set(whole) == {"logprobs", "entropy", "d_hidden", "d_weight"}
    assert all(0 < e < 1e-4 for e in whole.values()), whole
    for key in whole:
        assert chunked[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-12), key


def test_sampler_options_measure_the_truncated_logprobs():
    """``--top-k/--top-p``: logitless and the materialising provider compute the sampler's
    logprobs (errors against the fp64 sampler reference, every target kept), the peers that
    cannot are unavailable, the GEMM floor still runs."""
    op = get_op("logprobs")
    shape = {"tokens": 17, "hidden": 24, "vocab": 301}
    options = {"top_k": 40, "top_p": 0.9}
    inputs = op.make_inputs(shape, torch.float32, "cpu", **options)
    kept = reference.sampler_logprobs(inputs["hidden"].double(), inputs["weight"].double(),
                                      inputs["targets"], top_k=inputs["top_k"],
                                      top_p=inputs["top_p"].double())["logprobs"]
    assert torch.isfinite(kept).all()
    for name in ("logitless", "naive"):
        (provider,) = get_providers("logprobs", [name])
        errors = block_errors(op, provider, inputs, "fwd-bwd", 17)
        assert all(e < 1e-4 for e in errors.values()), (name, errors)
    for name, status in (("torch", "unavailable"), ("gemm", "ok")):
        (provider,) = get_providers("logprobs", [name])
        figures = measure(op, provider, shape, "fwd", torch.float32, "cpu", warmup=0,
                          repeats=1, block_rows=8, options=options)
        assert figures.status == status, figures.reason


def test_sampler_options_belong_to_logprobs(capsys):
    assert main(["bench", "--op", "policy-loss", "--top-p", "0.9"]) == 2
    assert "--op logprobs only" in capsys.readouterr().err


def test_divergence_op(tmp_path):
    """``--op divergence``: logitless, naive torch (TRL's generalized_jsd_loss), TRL's chunked
    kernel and the floor run; each provider's outputs and student gradients match fp64."""
    n, d, v = 24, 20, 700
    argv = ["bench", "--op", "divergence", "--device", "cpu", "--tokens", str(n), "--hidden",
            str(d), "--vocab", str(v), "--providers", "logitless,naive,trl,gemm", "--repeats",
            "1", "--no-isolate", "--no-progress", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    by = {r["provider"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert all(r["status"] == "ok" and r["op"] == "divergence" for r in by.values()), by
    assert by["gemm"]["floor_ratio"] == pytest.approx(1.0)
    for name in ("logitless", "naive", "trl"):
        errs = by[name]["errors"]
        assert set(errs) == {"divergence", "d_hidden", "d_weight"}
        assert max(errs.values()) < 1e-5, (name, errs)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Liger's JSD is Triton only: on CPU under TRITON_INTERPRET=1")
def test_divergence_liger_is_its_mean():
    op = get_op("divergence")
    liger, = get_providers("divergence", ["liger"])
    if liger.unavailable("cpu", torch.float32, "fwd-bwd"):
        pytest.skip(liger.unavailable("cpu", torch.float32, "fwd-bwd"))
    inputs = op.make_inputs({"tokens": 6, "hidden": 16, "vocab": 300}, torch.float32, "cpu")
    errs = block_errors(op, liger, inputs, "fwd-bwd", rows=6)
    assert set(errs) == {"loss", "d_hidden", "d_weight"}
    assert max(errs.values()) < 1e-5, errs


def test_demo_timer_passes_keywords_to_the_kernel():
    """The demo times our TRL kernel's ``apply``, which our trainer's head calls with
    ``sampler=`` as a keyword: the timer passes it through (``make demo`` died on it with a
    TypeError) and returns the kernel's own result."""
    from logitless.integrations import trl_head
    from logitless.integrations.trl import _Head
    from logitless.tools.demo import _timed

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    t = torch.randint(0, 11, (5,), generator=gen)
    args = (h, w, None, t, 1.0, 4096)
    want = _Head(True, None).apply(*args, outputs=("logprobs", "entropy"))
    with _timed(trl_head.LogitlessChunkedLogProb, "apply") as timer:
        got = _Head(True, None).apply(*args, outputs=("logprobs", "entropy"))
    assert timer.calls == 1 and timer.shape == {"tokens": 5, "hidden": 8, "vocab": 11}
    assert [x is None for x in got] == [y is None for y in want]
    for x, y in zip(got, want):
        assert x is None or torch.equal(x, y)


def test_the_table_says_what_each_provider_is_and_what_did_not_run(bench_run):
    """Issue 24: readable provider names, the skipped ones with their reason, the head's
    forward+backward also against four GEMMs."""
    from logitless.tools.bench.report import four_gemms

    records, _ = bench_run
    text = format_table(records)
    legend = text[text.index("providers:"):]
    assert "F.linear_cross_entropy" in legend and "no entropy" in legend  # "torch"
    assert "materialised" in legend and "floor" in legend  # "naive", "gemm"
    assert "not run:" in legend and "verl" in legend.split("not run:")[1]
    ours = next(r for r in records if r["provider"] == "logitless")
    assert float(four_gemms(ours)) == pytest.approx(ours["floor_ratio"] * 0.75, abs=0.01)
    assert "x 4 GEMMs" in text


def test_the_plot_of_one_shape_has_bars_a_ratio_panel_and_the_skipped(bench_run, tmp_path):
    from matplotlib.figure import Figure

    from logitless.tools.bench import plot as plot_module

    records, _ = bench_run
    seen = {}
    real_savefig = Figure.savefig

    def spy(fig, path, **kw):
        seen["axes"] = fig.axes
        seen["title"] = fig._suptitle.get_text()
        seen["texts"] = [t.get_text() for t in fig.texts]
        return real_savefig(fig, path, **kw)

    Figure.savefig = spy
    try:
        plot_module.plot(records, tmp_path / "one.png")
    finally:
        Figure.savefig = real_savefig
    time_ax, _, ratio_ax = seen["axes"][:3]
    ran = {r["provider"] for r in records if r["status"] == "ok"}
    assert len(time_ax.patches) == len(ran) >= 3  # one bar per provider that ran
    assert "GEMMs" in ratio_ax.get_ylabel()
    assert "))" not in seen["title"]
    assert any("verl" in t and "not run" in t for t in seen["texts"])


def test_bench_help_lists_providers_ops_and_presets():
    from logitless.tools.bench.cli import help_epilog

    text = help_epilog()
    assert "policy-loss:" in text and "qwen-small" in text and "F.linear_cross_entropy" in text
