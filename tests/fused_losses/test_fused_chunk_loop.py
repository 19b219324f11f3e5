"""fused_policy_loss's chunk loop as CUDA runs it (issue 22, item 4): what one more chunk
launches, counted on CPU under the Triton interpreter (`logitless.tools.launches`), with the
chunk objective compiled as on CUDA (``fused.chunk_objective``; inductor's C++ backend here); that
the compiled objective gives the eager one's results; and the eager fallback."""

from __future__ import annotations

import pytest
import torch

from fused_losses.test_fused_policy_loss import (
    assert_same,
    config_for,
    make_batch,
    rows,
    run_fused,
    run_reference,
)
from logitless import PolicyLossConfig
from logitless.fused_losses.fused import chunk_objective
from logitless.tools.launches import CHUNK_CONFIGS, LaunchCount, extra_chunk

from testing import requires_triton


@pytest.fixture
def fresh_objective(monkeypatch):
    """The compiled objective's state as a new process has it, restored afterwards."""
    torch._dynamo.reset()
    monkeypatch.setattr(chunk_objective, "_STATE", {"fn": None, "broken": False})
    return chunk_objective


@requires_triton
@pytest.mark.parametrize("config", sorted(CHUNK_CONFIGS))
def test_an_extra_chunk_launches_at_most_30_and_waits_for_nothing(config, monkeypatch):
    """The Triton store path with the objective compiled (CUDA's): one more chunk adds at most
    30 kernel launches (its three GEMMs, the two Triton passes, the gather and scatter of its
    hidden rows, the statistics' few ops and the compiled objective's kernels), no host read
    and no tensor made from Python data. Eagerly the objective alone was about 60 launches."""
    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    extra = extra_chunk(config, compiled=True)
    assert extra["host_reads"] == 0 and extra["python_data"] == 0, extra
    assert extra["triton"] == {"tile_stats_kernel": 1, "tile_grad_kernel": 1}, extra
    assert 0 < extra["launches"] <= 30, extra


@requires_triton
def test_the_eager_chunk_loop_waits_for_nothing_either(monkeypatch):
    """The fallback (CPU's path, and CUDA's when compiling fails): more launches, but still no
    host read and no tensor from Python data per chunk."""
    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    extra = extra_chunk("grpo-kl-entropy", compiled=False)
    assert extra["host_reads"] == 0 and extra["python_data"] == 0, extra
    assert extra["launches"] > 30  # what compiling saves: the count would see a regression


@requires_triton
def test_the_counter_sees_host_reads_python_data_and_triton_launches(monkeypatch):
    from logitless.kernels import linear_softmax
    from logitless.kernels.stored_logits import StoredLogitsTriton

    monkeypatch.setattr(linear_softmax, "_BLOCK_V", 128)
    x = torch.randn(4, 300)
    with LaunchCount() as count:
        y = x.view(-1)[:10]  # views: nothing
        y = torch.empty(3)  # an allocation: nothing
        y = x.exp()  # one launch
        float(y.sum())  # a launch and a host read
        x[[0, 2]] = 0.0  # an index made from a Python list
        torch.tensor([1.0, 2.0])  # a tensor from Python data
    assert count.ops["aten.exp.default"] == 1 and count.ops["aten.sum.default"] == 1
    assert not any("view" in k or "slice" in k or "empty" in k for k in count.ops), count.ops
    assert sum(count.host.values()) == 1
    assert sum(count.python_data.values()) >= 2
    store = StoredLogitsTriton(300, 4, torch.float32, "cpu", None)
    with LaunchCount() as count:
        store.forward(torch.randn(4, 8), torch.randn(300, 8), None, torch.tensor([0, 5, 7, 299]),
                      temperature=1.0, softcap=None, logit_scale=1.0)
    # one launch for the kernel, its arguments' copies to and from the interpreter not counted
    assert count.triton == {"tile_stats_kernel": 1}
    assert "aten.copy_.default" in count.ops and count.ops["aten.copy_.default"] == 1  # init


# The compiled objective against the eager one and the spec (fp64, several chunks of <= 8 rows,
# CPU's torch store: the objective is the same whichever store).
COMPILED_CASES = {
    "grpo-clip": dict(objective="grpo", beta=0.05),
    "gspo-sequence-ratio": dict(objective="gspo", beta=0.05),
    "kl-entropy-rollout-is": dict(objective="grpo", beta=0.1, kl_estimator="k3+",
                                  entropy_coef=0.01, rollout_is="token"),
    "entropy-selection": dict(objective="dapo", top_entropy_quantile=0.5),
}


@pytest.mark.parametrize("case", sorted(COMPILED_CASES))
def test_the_compiled_objective_gives_the_eager_results(case, fresh_objective, monkeypatch):
    batch = make_batch()
    cfg = PolicyLossConfig(**COMPILED_CASES[case])
    kw = dict(max_tile_bytes=rows(8), with_rollout="rollout_is" in COMPILED_CASES[case])
    monkeypatch.setattr(chunk_objective, "COMPILE", False)
    eager = run_fused(batch, cfg, **kw)
    monkeypatch.setattr(chunk_objective, "COMPILE", True)
    got = run_fused(batch, cfg, **kw)
    assert not chunk_objective._STATE["broken"]
    assert chunk_objective.KERNELS > 0  # it did compile and run a graph
    assert_same(got, eager, rtol=1e-12)
    assert_same(got, run_reference(batch, cfg, with_rollout=kw["with_rollout"]))


def test_a_new_step_numbers_do_not_recompile(fresh_objective, monkeypatch):
    """``entropy_coef`` and ``training_progress`` change every step: symbols of the graph, not
    constants (a recompile per step would run past dynamo's cache and fall back to eager)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(chunk_objective, "COMPILE", True)
    batch = make_batch()
    cfg = config_for("grpo", beta=0.05)
    run_fused(batch, cfg, max_tile_bytes=rows(8), entropy_coef=0.01, training_progress=0.1)
    graphs = counters["stats"]["unique_graphs"]
    for step in range(2, 4):
        got = run_fused(batch, cfg, max_tile_bytes=rows(8), entropy_coef=0.01 * step,
                        training_progress=0.1 * step)
        monkeypatch.setattr(chunk_objective, "COMPILE", False)
        assert_same(got, run_fused(batch, cfg, max_tile_bytes=rows(8), entropy_coef=0.01 * step,
                                   training_progress=0.1 * step), rtol=1e-12)
        monkeypatch.setattr(chunk_objective, "COMPILE", True)
    assert not chunk_objective._STATE["broken"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_failing_compile_falls_back_to_the_eager_objective(fresh_objective, monkeypatch):
    def broken():
        def fail(*args):
            raise RuntimeError("no compiler")
        return fail

    batch = make_batch()
    cfg = config_for("grpo", beta=0.05)
    want = run_fused(batch, cfg, max_tile_bytes=rows(8))
    monkeypatch.setattr(chunk_objective, "COMPILE", True)
    monkeypatch.setattr(chunk_objective, "_compiled", broken)
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        got = run_fused(batch, cfg, max_tile_bytes=rows(8))
    assert chunk_objective._STATE["broken"]
    assert_same(got, want, rtol=0)  # the eager path's very bits
