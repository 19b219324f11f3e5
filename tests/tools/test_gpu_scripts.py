"""benchmarks/gpu/invariance.py and passes.py, the device run's batch-invariance check and its
measured-beside-predicted table, run on CPU: the invariance check on the Triton path under the
interpreter with the head's tiles shrunk (so the probe crosses real chunk boundaries), and
shown to catch a row that depends on its place; the per-pass table's grouping and its
predicted column."""

import importlib.util
import json
import pathlib

import pytest
import torch

from logitless.kernels import linear_softmax as kernel
from logitless.tools import gpu_plan

from testing import requires_triton

ROOT = pathlib.Path(__file__).parents[2]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@requires_triton
def test_invariance_holds_across_the_triton_heads_chunks(monkeypatch):
    inv = _script("invariance")
    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    monkeypatch.setattr(kernel, "VOCAB_TILE", 448)
    # The probe, the row chunk and the granule shrunk together (each Triton program here is
    # one interpreted row): the probe still straddles a chunk boundary and sits in a later and
    # in a padded last chunk of each height, over three vocabulary tiles (the last ragged) of
    # two and one 256-column blocks.
    monkeypatch.setattr(inv, "PROBE", 16)
    monkeypatch.setattr(kernel, "ROW_CHUNK", 32)
    monkeypatch.setattr(kernel, "ROW_GRANULE", 16)
    monkeypatch.setattr(kernel, "_BLOCK_V", 256)
    results = inv.check("cpu", 2 * 32 + inv.PROBE + 3, 32, 1007, torch.bfloat16, 32,
                        ops=("plain",))
    # placements (5, then the last chunk at each height, 16 and 32) x (logprobs, entropy,
    # d_hidden)
    assert len(results) == (5 + 2) * 3
    assert {where for _, where, *_ in results} >= {"last chunk 16", "last chunk 32"}
    assert all(rows == 0 for *_, rows, _ in results), results


def test_invariance_catches_a_row_that_depends_on_its_place(monkeypatch):
    inv = _script("invariance")
    run = inv._run

    def drifting(op, hidden, weight, targets, upstream):
        out = run(op, hidden, weight, targets, upstream)
        if hidden.shape[0] > inv.PROBE:  # in a batch: results drift with the row's index
            out["entropy"] = out["entropy"] + 1e-3 * torch.arange(hidden.shape[0]) / hidden.shape[0]
        return out

    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    monkeypatch.setattr(inv, "_run", drifting)
    results = inv.check("cpu", 195, 32, 500, torch.float32, 64, ops=("plain",), granule=32)
    differs = {(where, key) for _, where, key, rows, _ in results if rows}
    # the probe's first row at index 0 does not drift, every other row does: five placements
    # and the last chunk at heights 32 and 64
    assert {key for _, key in differs} == {"entropy"}
    assert len(differs) == 7


def test_invariance_refuses_a_batch_too_small_for_its_placements():
    inv = _script("invariance")
    with pytest.raises(SystemExit):
        inv.main(["--device", "cpu", "--tokens", "100", "--chunk", "64"])
    with pytest.raises(SystemExit):
        inv.main(["--device", "cpu", "--tokens", "1000", "--chunk", "16"])


def test_passes_groups_kernels_as_the_cost_model_groups_passes(tmp_path):
    ps = _script("passes")
    assert ps.group_of_kernel("tile_stats_kernel_0d1d2d") == "statistics pass"
    assert ps.group_of_kernel("tile_grad_kernel") == "dz pass"
    for name in ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64",
                 "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT", "cutlass_80_tensorop_s16816gemm",
                 "ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3_nn"):
        assert ps.group_of_kernel(name) == "GEMMs", name
    assert ps.group_of_kernel("vectorized_elementwise_kernel<4, ...>") == "other"
    n, d, v = gpu_plan.REFERENCE_SHAPE
    for path in ps.PATHS.values():
        pred = ps.predicted(path, n, d, v)
        assert sum(pred.values()) == pytest.approx(gpu_plan.gpu_plan(n, d, v, "bfloat16",
                                                                     path).seconds * 1e3)
        assert pred["GEMMs"] > 0 and pred["statistics pass"] > 0
    out = tmp_path / "passes.json"
    assert ps.main(["--device", "cpu", "--tokens", "64", "--hidden", "32", "--vocab", "500",
                    "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["path"] for r in records] == list(ps.PATHS.values())
    assert all(r["measured_ms"] is None and r["status"].startswith("not run") for r in records)


def test_passes_calls_run_each_path(monkeypatch):
    """The profiled calls themselves, on CPU tensors (the profiler is CUDA-only)."""
    ps = _script("passes")
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4, 8, 16, generator=g), torch.randn(101, 16, generator=g)
    targets = torch.randint(0, 101, (4, 8), generator=g)
    extra = (-torch.rand(4, 8, generator=g), torch.randn(4, generator=g),
             torch.ones(4, 8, dtype=torch.bool))
    for label in ps.PATHS:
        if label.startswith("fused"):
            ps._call(label, hidden, weight, targets, extra)
        else:
            ps._call(label, hidden.view(32, 16), weight, targets.view(32), ())
