"""The Triton chunk store of fused_policy_loss (``kernels/stored_logits.py``): its two
passes compiled for sm_90 at the configurations it launches (rerun under triton 3.6.0 by
``test_compile_triton36.py``), and one chunk against the fp64 reference under the interpreter.
Its end-to-end tests are in ``tests/fused_losses/test_fused_policy_loss_triton.py``."""

from __future__ import annotations

import inspect

import pytest
import torch

from logitless.kernels import linear_softmax
from logitless.reference.linear_softmax import linear_softmax_stats

from testing import requires_triton

# Argument types of the two passes (pointers to per-row fp32 values unless named here).
_TYPES = dict(stride_row="i32", targets="*i64", plane="i32", n_rows="i32", width="i32",
              v0="i32", softcap="fp32", z_scale="fp32", inv_vocab_total="fp32")


def _signature(kernel, logits_type: str, constexprs: dict) -> dict:
    """Every runtime argument of ``kernel`` in its own order, typed."""
    fn = kernel
    while not inspect.isfunction(fn):
        fn = fn.fn
    names = [n for n in inspect.signature(fn).parameters if n not in constexprs]
    return {n: logits_type if n == "logits" else _TYPES.get(n, "*fp32") for n in names}


@pytest.mark.compile_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_store_kernels_compile_for_sm90(dtype):
    """Soft-cap on and off; the dz pass with and without the entropy term."""
    pytest.importorskip("triton.backends.nvidia")
    from logitless.kernels import stored_logits as st

    from sm90 import compile_sm90

    ty = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    g = torch.zeros(1)
    launches = []
    for cap in (3.0, None):
        launches.append((linear_softmax.tile_stats_kernel, st.stats_meta(dtype, cap)))
        for g_entropy in (g, None):
            launches.append((linear_softmax.tile_grad_kernel,
                             st.grad_meta(dtype, cap, g, g_entropy)))
    for kernel, meta in launches:
        meta = dict(meta)
        warps = meta.pop("num_warps")
        compiled = compile_sm90(kernel, _signature(kernel, ty, meta), meta, num_warps=warps)
        assert compiled.asm["cubin"]


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_statistics_and_logit_gradient(monkeypatch, dtype):
    """One chunk: lp, H, lse against the fp64 reference of the stored (rounded) logits, and the
    gradients of ``sum g_lp lp + g_H H`` into fresh buffers against fp64 autograd."""
    from logitless.kernels.stored_logits import StoredLogitsTriton

    monkeypatch.setattr(linear_softmax, "_BLOCK_V", 128)
    n, d, v, opts = 37, 64, 509, dict(temperature=0.8, softcap=4.0, logit_scale=1.2)
    hidden = torch.randn(n, d).to(dtype)
    weight = (0.3 * torch.randn(v, d)).to(dtype)
    bias = torch.randn(v).to(dtype)
    targets = torch.randint(0, v, (n,))
    store = StoredLogitsTriton(v, n + 3, dtype, "cpu", opts["softcap"])
    lp, ent, lse = store.forward(hidden, weight, bias, targets, **opts)
    x = torch.addmm(bias, hidden, weight.t()).double()  # the logits as stored
    eye = torch.eye(v, dtype=torch.float64)
    ref = linear_softmax_stats(x, eye, targets, None, **opts)
    for name, got in (("logprobs", lp), ("entropy", ent), ("lse", lse)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref[name], rtol=1e-5, atol=2e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")

    g_lp, g_ent = torch.randn(n), torch.randn(n)
    d_weight = torch.full((v, d), float("nan"))  # beta=0 overwrites whatever it holds
    d_bias = torch.zeros(v)
    d_hidden = store.backward_(hidden, weight, ent, g_lp, g_ent, d_weight, d_bias,
                               want_hidden=True, weight_beta=0.0)
    x64 = x.clone().requires_grad_()
    stats = linear_softmax_stats(x64, eye, targets, None, **opts)
    (stats["logprobs"] * g_lp.double() + stats["entropy"] * g_ent.double()).sum().backward()
    dx = x64.grad
    u = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    # dx rounded once to the inputs' dtype bounds each product's error by u |dx| |operand|
    for name, got, want, bound in (
        ("d_hidden", d_hidden, dx @ weight.double(), dx.abs() @ weight.double().abs()),
        ("d_weight", d_weight, dx.t() @ hidden.double(), dx.abs().t() @ hidden.double().abs()),
        ("d_bias", d_bias, dx.sum(0), dx.abs().sum(0)),
    ):
        err = (got.double() - want).abs()
        assert (err <= 2 * u * bound + 1e-6).all(), f"{name}: max err {float(err.max()):.2e}"
    assert d_hidden.dtype == dtype and d_weight.dtype == torch.float32


@requires_triton
def test_a_chunk_makes_no_tensor_from_python_data_and_reads_nothing_back(monkeypatch):
    """The store's forward and backward never build a tensor from Python data (on CUDA that is
    a host-to-device copy the stream waits for) nor read a value back to the host. Regression:
    the partials' -inf planes were set by an index made from a Python list, twice a chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from logitless.kernels.stored_logits import StoredLogitsTriton

    class Watch(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bad = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "lift_fresh" in name or "_local_scalar_dense" in name or "item" in name:
                self.bad.append(name)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(linear_softmax, "_BLOCK_V", 128)
    n, d, v = 9, 32, 300
    hidden, weight = torch.randn(n, d).bfloat16(), (0.3 * torch.randn(v, d)).bfloat16()
    targets = torch.randint(0, v, (n,))
    store = StoredLogitsTriton(v, n, torch.bfloat16, "cpu", None)
    d_weight = torch.zeros(v, d)
    with Watch() as watch:
        for _ in range(2):  # a second chunk through the same store
            lp, ent, _ = store.forward(hidden, weight, None, targets, temperature=0.9,
                                         softcap=None, logit_scale=1.0)
            store.backward_(hidden, weight, ent, torch.ones(n), None, d_weight, None,
                            want_hidden=True)
    assert watch.bad == []
    assert torch.isfinite(lp).all() and torch.isfinite(d_weight).all()


@requires_triton
def test_nan_left_in_the_row_padding_never_reaches_the_gradients():
    """The store's rows are 16-aligned (509 columns, 512 apart). torch's CPU GEMM in bf16
    reads an operand's row padding (times zero; torch 2.13), so NaN that the allocator or an
    earlier use left there gave NaN rows of ``dx @ W`` (seen in CI after another test had
    freed a NaN-filled tensor). The padding is zeroed on CPU: the results are those of a
    store whose buffer held zeros."""
    from logitless.kernels.stored_logits import StoredLogitsTriton

    n, d, v = 37, 64, 509
    hidden = torch.randn(n, d).bfloat16()
    weight = (0.3 * torch.randn(v, d)).bfloat16()
    targets = torch.randint(0, v, (n,))
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    runs = []
    for fill in (0.0, float("nan")):
        store = StoredLogitsTriton(v, n, torch.bfloat16, "cpu", None)
        store._logits.fill_(fill)
        lp, ent, lse = store.forward(hidden, weight, None, targets, temperature=1.0,
                                     softcap=None, logit_scale=1.0)
        d_weight = torch.zeros(v, d)
        d_hidden = store.backward_(hidden, weight, ent, g_lp, g_ent, d_weight, None,
                                   want_hidden=True)
        runs.append((lp, ent, lse, d_hidden, d_weight))
    assert torch.isfinite(runs[1][3]).all()
    for got, want in zip(runs[1], runs[0]):
        assert torch.equal(got, want)


def test_tile_rows_zero_the_row_padding_on_cpu():
    buf = torch.full((4 * 32,), float("nan"), dtype=torch.bfloat16)
    x = linear_softmax.tile_rows(buf, 4, 30)
    assert x.shape == (4, 30) and x.stride() == (32, 1)
    assert (buf.view(4, 32)[:, 30:] == 0).all() and x.isnan().all()
    w = torch.randn(30, 8).bfloat16()
    x.copy_(torch.randn(4, 30))
    assert torch.equal(torch.mm(x, w), torch.mm(x.contiguous(), w))
