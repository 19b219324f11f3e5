"""The CUDA path of linear_divergence and linear_topk_distill (cuBLAS tiles + Triton epilogues)
against the fp64 reference, run under TRITON_INTERPRET=1 on CPU tensors with torch's CPU GEMMs,
through the public functions with ``LOGITLESS_BACKEND=triton`` (the torch twin is made to raise,
so a pass proves the dispatch too).

The interpreter is slow, so the shapes are tiny and the tiles shrunk (``small_tiles``) to cross
every boundary: V=67 spans three 32-column tiles (the last 3 columns wide), N=5 three 2-row
chunks (the last padded), each tile two 16-column epilogue blocks. ``ONE_CHUNK`` puts every
chunk in its own row group.
"""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
import triton
import triton.language as tl

import logitless
from logitless import reference
from logitless.kernels import divergence as kernel
from logitless.kernels import divergence_torch
from logitless.kernels import linear_softmax as head

from sm90 import run_compile_script
from testing import assert_close_to_oracle, requires_triton

N, D, D_T, V, K = 5, 24, 16, 67, 3
TILE, CHUNK, BLOCK = 32, 2, 16
ONE_CHUNK = CHUNK * TILE * 4  # bytes: one chunk of either head per row group


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setattr(head, "VOCAB_TILE", TILE)
    monkeypatch.setattr(head, "ROW_CHUNK", CHUNK)
    monkeypatch.setattr(head, "_BLOCK_V", BLOCK)
    monkeypatch.setattr(kernel, "_BLOCK_V", BLOCK)
    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    for name in ("divergence_forward", "divergence_backward", "topk_forward", "topk_backward"):
        monkeypatch.setattr(divergence_torch, name, _not_here)


def _not_here(*args, **kwargs):
    raise AssertionError("the torch twin ran: the Triton path was not dispatched")


def _heads(dtype, n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=gen)
    x = dict(hidden=r(n, D), weight=r(V, D) * 2 / D**0.5, bias=r(V) * 0.5,
             teacher_hidden=r(n, D_T), teacher_weight=r(V, D_T) * 2 / D_T**0.5,
             teacher_bias=r(V) * 0.5)
    return {k: t.to(dtype).requires_grad_(k in ("hidden", "weight", "bias"))
            for k, t in x.items()}


def _divergence(fn, x, beta, temperature, **kw):
    """``(divergence, entropy)`` of ``fn``'s `DivergenceOutput` (entropy None unless asked)."""
    out = fn(x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], beta=beta,
             temperature=temperature, bias=x["bias"], teacher_bias=x["teacher_bias"], **kw)
    return out.divergence, out.entropy


def _grads(out, x, upstream):
    (out.double() * upstream).sum().backward()
    return [x[k].grad for k in ("hidden", "weight", "bias")]


@requires_triton
@pytest.mark.parametrize(("beta", "tile_bytes", "tile"),
                         [(0.0, None, TILE), (0.5, ONE_CHUNK, TILE), (1.0, None, TILE),
                          # tiles of 40 and 27 columns: a masked first step, whole steps and
                          # a masked last one
                          (0.0, None, 40), (0.5, None, 40), (1.0, None, 40)])
def test_divergence_fp32_matches_reference(triton_path, monkeypatch, beta, tile_bytes, tile):
    """Values, the student's entropy and the student's gradients against fp64 autograd through
    the reference, at T=0.7 with biases and a teacher of another hidden size."""
    monkeypatch.setattr(head, "VOCAB_TILE", tile)
    x = _heads(torch.float32)
    x64 = {k: t.detach().double().requires_grad_(t.requires_grad) for k, t in x.items()}
    out, entropy = _divergence(logitless.linear_divergence, x, beta, 0.7,
                               max_tile_bytes=tile_bytes, return_entropy=True)
    ref, _ = _divergence(reference.linear_divergence, x64, beta, 0.7)
    assert out.dtype == torch.float32 and out.shape == (N,)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    z = reference.linear_logits(x64["hidden"], x64["weight"], x64["bias"]) / 0.7
    ref_entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=1e-5, atol=1e-6)
    upstream = torch.randn(N, dtype=torch.float64)
    for got, want, name in zip(_grads(out, x, upstream), _grads(ref, x64, upstream),
                               ("hidden", "weight", "bias")):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert x["teacher_hidden"].grad is None and x["teacher_weight"].grad is None


def _check_bf16_three_way(out, low, ref, inputs, name):
    """The value and the student's bf16 gradients of the kernel (``out``), the bf16 torch
    reference (``low``) and the fp64 oracle (``ref``), each from its own copy of the inputs
    (``inputs``, in that order): |kernel - fp64| <= |bf16 torch - fp64| + 1% of the largest."""
    x, same, x64 = inputs
    tol = 1e-2 * float(ref.detach().abs().max())
    assert_close_to_oracle(out, ref.detach(), low.detach(), tol, name)
    upstream = torch.randn(N, dtype=torch.float64)
    for got, lo, want, part in zip(_grads(out, x, upstream), _grads(low, same, upstream),
                                   _grads(ref, x64, upstream), ("hidden", "weight", "bias")):
        assert got.dtype == torch.bfloat16, part
        assert_close_to_oracle(got, want, lo, 1e-2 * float(want.abs().max()), part)


@requires_triton
@pytest.mark.parametrize(("beta", "seed"), [(0.0, 1), (0.5, 1), (1.0, 0)])
def test_divergence_bf16_three_way(triton_path, beta, seed):
    """bf16 heads: |kernel - fp64| <= |bf16 torch reference - fp64| + tol, values and
    gradients (which come back in bf16). The reverse KL (seed 0) failed with bf16 logits
    tiles: its logit gradient is a difference of the two heads' rounded logits."""
    x = _heads(torch.bfloat16, seed=seed)
    same = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in x.items()}
    x64 = {k: t.detach().double().requires_grad_(t.requires_grad) for k, t in x.items()}
    out, _ = _divergence(logitless.linear_divergence, x, beta, 0.8)
    low, _ = _divergence(reference.linear_divergence, same, beta, 0.8)
    ref, _ = _divergence(reference.linear_divergence, x64, beta, 0.8)
    _check_bf16_three_way(out, low, ref, (x, same, x64), "divergence")


@requires_triton
def test_pair_tiles_rows_start_16_aligned(triton_path):
    """Both heads' fp32 tiles have their rows a multiple of 16 elements apart, the last,
    3-column tile too: the runtime's specialisation the SASS report compiles the pair passes
    with."""
    x = {k: t.detach() for k, t in _heads(torch.float32).items()}
    plans = kernel._plans(x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"],
                          None)
    widths = set()
    for v0, v1, _, _, _, zs, zt in kernel._pair_tiles(
            plans, (x["weight"], x["teacher_weight"]), (x["bias"], x["teacher_bias"])):
        widths.add(v1 - v0)
        assert zs.shape[1] == zt.shape[1] == v1 - v0
        assert zs.stride(0) % 16 == 0 and zt.stride(0) % 16 == 0, (zs.stride(), zt.stride())
    assert widths == {TILE, V % TILE}


@triton.jit
def _apply_log2_1p(e_ptr, out_ptr, BLOCK: tl.constexpr):
    at = tl.arange(0, BLOCK)
    tl.store(out_ptr + at, kernel._log2_1p(tl.load(e_ptr + at)))


@requires_triton
def test_log2_1p_is_accurate_on_0_1():
    """The JSD pass's ``log2(1 + 2^-|d|)`` polynomial against fp64 ``log1p``, on a grid of
    ``[0, 1]`` and where ``1 + e`` rounds to 1: absolute error at most 2e-7, relative 2.5e-7."""
    tiny = torch.tensor([0.0, 1e-30, 1e-12, 1e-7, 1e-5, 1e-4, 1e-3])
    e = torch.cat([tiny, torch.linspace(0, 1, 4096 - tiny.numel())]).float()
    out = torch.empty_like(e)
    _apply_log2_1p[(1,)](e, out, BLOCK=e.numel())
    want = torch.log1p(e.double()) / math.log(2.0)
    err = (out.double() - want).abs()
    assert float(err.max()) <= 2e-7
    assert float((err[want > 0] / want[want > 0]).max()) <= 2.5e-7


@requires_triton
def test_rows_are_batch_invariant(triton_path):
    """A row's divergence and hidden-gradient row are bitwise the same alone and among
    others (every GEMM has ROW_CHUNK rows, every fold a fixed order)."""
    x = _heads(torch.float32, seed=2)
    out, _ = _divergence(logitless.linear_divergence, x, 0.5, 1.0)
    out.sum().backward()
    alone = {k: t.detach()[3:4].clone().requires_grad_(True) if "hidden" in k else t
             for k, t in x.items()}
    one, _ = _divergence(logitless.linear_divergence, alone, 0.5, 1.0)
    one.sum().backward()
    assert torch.equal(one[0], out[3])
    assert torch.equal(alone["hidden"].grad[0], x["hidden"].grad[3])


def _topk(dtype, seed=3):
    x = _heads(dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (N, K), generator=gen)
    ids[:, -1] = ids[:, 0]  # a repeated id collects both of its gradients
    ids[0, 0] = V - 1  # an id in the last, narrow tile
    teacher_lp = torch.randn(N, K, generator=gen).abs().neg() - 1.0
    return x, ids, teacher_lp


def _topk_call(fn, x, ids, teacher_lp):
    return fn(x["hidden"], x["weight"], ids, teacher_lp, temperature=1.3, bias=x["bias"],
              log_prob_min_clamp=None, loss_max_clamp=None)


@requires_triton
def test_topk_matches_reference(triton_path):
    """The top-k forward KL and the student's gradients (fp32) against fp64 autograd."""
    x, ids, teacher_lp = _topk(torch.float32)
    x64 = {k: t.detach().double().requires_grad_(t.requires_grad) for k, t in x.items()}
    out = _topk_call(logitless.linear_topk_distill, x, ids, teacher_lp)
    ref = _topk_call(reference.linear_topk_distill, x64, ids, teacher_lp.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    upstream = torch.randn(N, dtype=torch.float64)
    for got, want, name in zip(_grads(out, x, upstream), _grads(ref, x64, upstream),
                               ("hidden", "weight", "bias")):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@requires_triton
def test_topk_bf16_three_way(triton_path):
    x, ids, teacher_lp = _topk(torch.bfloat16, seed=4)
    same = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in x.items()}
    x64 = {k: t.detach().double().requires_grad_(t.requires_grad) for k, t in x.items()}
    out = _topk_call(logitless.linear_topk_distill, x, ids, teacher_lp)
    low = _topk_call(reference.linear_topk_distill, same, ids, teacher_lp.bfloat16())
    ref = _topk_call(reference.linear_topk_distill, x64, ids, teacher_lp.double())
    _check_bf16_three_way(out, low, ref, (x, same, x64), "kl")


def test_no_tl_dot_in_the_epilogues():
    """fp32 products follow torch's matmul precision: every product is a torch GEMM."""
    assert "tl.dot(" not in pathlib.Path(kernel.__file__).read_text()


# Compiles the four kernels for sm_90 with the constexprs and warps the launchers use, per
# dtype and mode. Run where Triton is no interpreter.
_COMPILE_SCRIPT = """
import torch
from sm90 import compile_sm90
from logitless.kernels import divergence as k

def split(meta):
    meta = dict(meta)
    return meta.pop("num_warps"), meta

# Every mode in bf16; fp16 and fp32 (other element types, the same code) in the mixture mode.
CASES = [("bfloat16", "bf16", beta) for beta in (0.0, 0.5, 1.0)]
CASES += [("float16", "fp16", 0.5), ("float32", "fp32", 0.5)]
for dtype, ty, beta in CASES:
    dt = getattr(torch, dtype)
    # The pair kernels read and write fp32 logits tiles whatever the heads' dtype.
    pair = dict(zs_ptr="*fp32", stride_s="i32", zt_ptr="*fp32", stride_t="i32")
    warps, consts = split(k.stats_meta(beta))
    sig = dict(pair, state="*fp32", plane="i32", width="i32", z_scale="fp32")
    assert compile_sm90(k._pair_stats_kernel, sig, consts, num_warps=warps).asm["cubin"]
    warps, consts = split(k.grad_meta(beta, torch.float32))
    sig = dict(pair, **dict.fromkeys(("top_s", "log_l_s", "top_t", "log_l_t", "aux", "grad"),
                                     "*fp32"),
               width="i32", z_scale="fp32", log_b="fp32", log_1mb="fp32",
               one_minus_beta="fp32")
    assert compile_sm90(k._pair_grad_kernel, sig, consts, num_warps=warps).asm["cubin"]
    if beta != 0.5:
        continue
    warps, consts = split(k.jsd_meta())
    sig = dict(pair, **dict.fromkeys(("top_s", "log_l_s", "top_t", "log_l_t"), "*fp32"),
               acc="*fp32", plane="i32", width="i32", z_scale="fp32", log_b="fp32",
               log_1mb="fp32")
    assert compile_sm90(k._pair_jsd_kernel, sig, consts, num_warps=warps).asm["cubin"]
    warps, consts = split(k.topk_grad_meta(dt))
    sig = dict(z_ptr="*" + ty, stride_row="i32", ids="*i64", grad="*fp32", k="i32",
               top="*fp32", log_l="*fp32", width="i32", v0="i32", z_scale="fp32")
    assert compile_sm90(k._topk_grad_kernel, sig, consts, num_warps=warps).asm["cubin"]
"""


@pytest.mark.compile_sm90
def test_kernels_compile_for_sm90():
    run_compile_script(_COMPILE_SCRIPT)
