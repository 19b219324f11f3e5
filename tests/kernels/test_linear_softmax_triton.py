"""Triton linear-softmax kernels against the fp64 reference (run under TRITON_INTERPRET=1 on CPU).

Shapes are odd on purpose (partial row, vocab and D tiles) and small, because the interpreter
runs every program in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from logitless.kernels import linear_softmax as kernel
from logitless.kernels.softmax_partials import finish
from logitless.reference.linear_softmax import linear_logits, linear_softmax_stats

from testing import assert_close_to_oracle, requires_triton

pytestmark = requires_triton

N, D, V = 37, 80, 1007
STATS = ("lse", "logprobs", "entropy", "sum_p_sq", "mean_logit")
GRADS = ("g_lp", "g_entropy", "g_sum_p_sq", "g_mean_logit")
STAT_OF_GRAD = dict(zip(GRADS, ("logprobs", "entropy", "sum_p_sq", "mean_logit")))


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _problem(n, dtype, *, bias, outside, contiguous=True, d=D, **opts):
    """Fresh random inputs; a third of the targets are the argmax (so is_top1 is exercised),
    ``outside`` of them are -1 (target in another vocabulary slice)."""
    dev = _device()
    hidden = torch.randn(n, d, device=dev).to(dtype)
    if contiguous:
        weight = (0.2 * torch.randn(V, d, device=dev)).to(dtype)
    else:
        weight = (0.2 * torch.randn(d, V, device=dev)).to(dtype).t()
    b = torch.randn(V, device=dev).to(dtype) if bias else None
    z = linear_logits(
        hidden.double(), weight.double(), None if b is None else b.double(),
        temperature=opts["temperature"], softcap_value=opts["softcap"],
        logit_scale=opts["logit_scale"],
    )
    targets = torch.randint(0, V, (n,), device=dev)
    targets[::3] = z.argmax(-1)[::3]
    targets[1:1 + 3 * outside:3] = -1
    return hidden, weight, b, targets


def _reference(hidden, weight, bias, targets, dtype=torch.float64, **opts):
    """Reference statistics in ``dtype``; rows with target -1 get ``z_y = 0`` like the kernel."""
    out = linear_softmax_stats(
        hidden.to(dtype), weight.to(dtype), targets.clamp(min=0),
        None if bias is None else bias.to(dtype), **opts,
    )
    out["logprobs"] = torch.where(targets < 0, -out["lse"], out["logprobs"])
    return out


def _kernel_stats(hidden, weight, bias, targets, want=True, **opts):
    parts = kernel.forward(hidden, weight, bias, targets, want_s2=want, want_sum_z=want, **opts)
    return finish(parts, weight.shape[0])


OPTIONS = {
    "plain": dict(temperature=1.0, softcap=None, logit_scale=1.0),
    "T0.7-cap3-scale1.3": dict(temperature=0.7, softcap=3.0, logit_scale=1.3),
    "T1.5": dict(temperature=1.5, softcap=None, logit_scale=1.0),
}

FORWARD_CASES = [
    pytest.param(N, D, "plain", False, 0, True, True, id="N37-plain"),
    pytest.param(N, D, "T0.7-cap3-scale1.3", True, 4, True, True,
                 id="N37-bias-T0.7-cap3-scale1.3"),
    pytest.param(5, 64, "T1.5", True, 1, False, True, id="N5-D64-bias-T1.5-noncontigW"),
    pytest.param(N, D, "T0.7-cap3-scale1.3", False, 2, True, False, id="N37-cap-no_s2_sum_z"),
]


@pytest.mark.parametrize(("n", "d", "option", "bias", "outside", "contiguous", "want"),
                         FORWARD_CASES)
def test_forward_fp32_matches_reference(n, d, option, bias, outside, contiguous, want,
                                       monkeypatch):
    # Allow one-tile splits, so that a GPU run splits this small vocabulary too.
    monkeypatch.setattr(kernel, "_MIN_TILES_PER_SPLIT", 1)
    opts = OPTIONS[option]
    hidden, weight, b, targets = _problem(
        n, torch.float32, bias=bias, outside=outside, contiguous=contiguous, d=d, **opts
    )
    # The vocabulary must really be split across programs, and the last split is partial.
    splits, per_split = kernel._vocab_splits(n, V, hidden.device)
    assert splits > 1 and V % per_split != 0

    got = _kernel_stats(hidden, weight, b, targets, want=want, **opts)
    ref = _reference(hidden, weight, b, targets, **opts)
    for name in STATS if want else ("lse", "logprobs", "entropy"):
        torch.testing.assert_close(got[name].double(), ref[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    inside = targets >= 0
    assert torch.equal(got["is_top1"][inside], ref["is_top1"][inside])
    assert ref["is_top1"].any()
    # A target outside this slice contributes exactly nothing: z_y = 0.
    assert torch.equal(got["logprobs"][~inside], -got["lse"][~inside])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_low_precision_three_way(dtype):
    opts = OPTIONS["T0.7-cap3-scale1.3"]
    hidden, weight, b, targets = _problem(N, dtype, bias=True, outside=2, **opts)
    got = _kernel_stats(hidden, weight, b, targets, **opts)
    oracle = _reference(hidden, weight, b, targets, **opts)
    same_dtype = _reference(hidden, weight, b, targets, dtype=dtype, **opts)
    for name in STATS:
        assert_close_to_oracle(got[name], oracle[name], same_dtype[name], tol=2e-5, name=name)
    inside = targets >= 0
    assert torch.equal(got["is_top1"][inside], oracle["is_top1"][inside])


def _upstream(n, names):
    return {g: (torch.randn(n, device=_device()) if g in names else None) for g in GRADS}


def _reference_grads(hidden, weight, bias, targets, upstream, dtype=torch.float64, **opts):
    """Autograd of ``sum_k g_k * stat_k`` through the reference, in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight)]
    if bias is not None:
        leaves.append(bias.detach().to(dtype).requires_grad_())
    stats = _reference(leaves[0], leaves[1], leaves[2] if bias is not None else None, targets,
                       dtype=dtype, **opts)
    loss = sum((g.to(dtype) * stats[STAT_OF_GRAD[k]]).sum()
               for k, g in upstream.items() if g is not None)
    loss.backward()
    grads = [leaf.grad for leaf in leaves]
    return grads + [None] * (3 - len(grads))


def _kernel_grads(hidden, weight, bias, targets, upstream, need, **opts):
    # The statistics the backward consumes come from the fp64 reference rounded to fp32, so
    # the backward is tested on its own (and the interpreter runs one kernel, not two).
    stats = {k: v.float() for k, v in _reference(hidden, weight, bias, targets, **opts).items()}
    return kernel.backward(
        hidden, weight, bias, targets, stats["lse"],
        stats["entropy"] if upstream["g_entropy"] is not None else None,
        stats["sum_p_sq"] if upstream["g_sum_p_sq"] is not None else None,
        *upstream.values(), vocab_total=weight.shape[0],
        need_hidden=need[0], need_weight=need[1], need_bias=need[2], **opts,
    )


BACKWARD_CASES = [
    pytest.param(N, D, "plain", False, 0, True, ("g_lp",), id="N37-plain-lp"),
    pytest.param(N, D, "T0.7-cap3-scale1.3", True, 3, True, GRADS,
                 id="N37-bias-cap-all_grads"),
    pytest.param(N, D, "T0.7-cap3-scale1.3", True, 0, False, ("g_entropy",),
                 id="N37-bias-cap-entropy-noncontigW"),
    pytest.param(5, 64, "T1.5", True, 1, True, ("g_lp", "g_sum_p_sq", "g_mean_logit"),
                 id="N5-D64-bias-T1.5-lp_sq_mean"),
]


@pytest.mark.parametrize(("n", "d", "option", "bias", "outside", "contiguous", "grads"),
                         BACKWARD_CASES)
def test_backward_fp32_matches_reference(n, d, option, bias, outside, contiguous, grads):
    opts = OPTIONS[option]
    hidden, weight, b, targets = _problem(
        n, torch.float32, bias=bias, outside=outside, contiguous=contiguous, d=d, **opts
    )
    upstream = _upstream(n, grads)
    need = (True, True, bias)
    got = _kernel_grads(hidden, weight, b, targets, upstream, need, **opts)
    ref = _reference_grads(hidden, weight, b, targets, upstream, **opts)
    for name, g, r in zip(("d_hidden", "d_weight", "d_bias"), got, ref):
        if r is None:
            assert g is None, name
            continue
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_backward_only_requested_grads():
    opts = OPTIONS["T1.5"]
    hidden, weight, b, targets = _problem(5, torch.float32, bias=True, outside=0, **opts)
    upstream = _upstream(5, ("g_lp", "g_entropy"))
    ref = _reference_grads(hidden, weight, b, targets, upstream, **opts)
    d_hidden, d_weight, d_bias = _kernel_grads(
        hidden, weight, b, targets, upstream, (False, True, False), **opts
    )
    assert d_hidden is None and d_bias is None
    torch.testing.assert_close(d_weight.double(), ref[1], rtol=1e-5, atol=1e-5)


def _oracle_logit_grad(hidden, weight, bias, targets, upstream, **opts):
    """fp64 ``dL/dx`` of the pre-transform logits ``x = hidden @ W^T + b``: the reference run
    with ``x`` as its hidden states and an identity head."""
    x = hidden.double() @ weight.double().t()
    if bias is not None:
        x = x + bias.double()
    eye = torch.eye(x.shape[1], dtype=torch.float64, device=x.device)
    return _reference_grads(x, eye, None, targets, upstream, **opts)[0]


def _rms(x):
    return float(x.double().pow(2).mean().sqrt())


def test_backward_bf16_three_way():
    opts = OPTIONS["T0.7-cap3-scale1.3"]
    hidden, weight, b, targets = _problem(N, torch.bfloat16, bias=True, outside=2, **opts)
    upstream = _upstream(N, GRADS)
    got = _kernel_grads(hidden, weight, b, targets, upstream, (True, True, True), **opts)
    oracle = _reference_grads(hidden, weight, b, targets, upstream, **opts)
    same_dtype = _reference_grads(hidden, weight, b, targets, upstream, dtype=torch.bfloat16,
                                  **opts)
    # Like torch's bf16 autograd, the kernel rounds dx to bf16 once, for the tensor-core GEMMs.
    # That rounding bounds its error elementwise by u |dx| @ |W| (and u |dx|^T @ |hidden|);
    # d_bias sums the fp32 dx.
    dx = _oracle_logit_grad(hidden, weight, b, targets, upstream, **opts).abs()
    u = 2.0**-8
    tols = (u * dx @ weight.double().abs(), u * dx.t() @ hidden.double().abs(), 1e-5)
    for name, g, o, s, tol in zip(("d_hidden", "d_weight", "d_bias"), got, oracle, same_dtype,
                                  tols):
        assert_close_to_oracle(g, o, s, tol=tol, name=name)
        assert _rms(g - o) <= _rms(s - o), name


def test_empty_batch():
    hidden = torch.randn(0, D, device=_device())
    weight = torch.randn(V, D, device=_device())
    targets = torch.zeros(0, dtype=torch.int64, device=_device())
    parts = kernel.forward(hidden, weight, None, targets, want_s2=True, want_sum_z=True,
                           **OPTIONS["plain"])
    assert all(field.shape == (0,) for field in parts)
    d_hidden, d_weight, _ = kernel.backward(
        hidden, weight, None, targets, parts.l, None, None, parts.l, None, None, None,
        vocab_total=V, need_hidden=True, need_weight=True, need_bias=False, **OPTIONS["plain"],
    )
    assert d_hidden.shape == (0, D) and torch.equal(d_weight, torch.zeros_like(d_weight))


# Compiles both kernels for sm_90 with the largest GPU tiles and every feature flag on: the
# interpreter accepts programs the GPU compiler rejects (types, layouts, int64 loops), and CI
# has no GPU. Runs in a subprocess because TRITON_INTERPRET=1 replaces the JIT.
_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from logitless.kernels import linear_softmax as k

def jit_fn(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel

def compile_for_sm90(kernel, tile, types, flags):
    fn = jit_fn(kernel)
    block_n, block_v, block_d, warps, stages = tile
    consts = dict(flags, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d, EVEN_D=True,
                  HAS_BIAS=True, HAS_SOFTCAP=True, INTERPRET_BF16=False, stride_hd=1, stride_wd=1)
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    assert compiled.asm["cubin"], fn.__name__

largest = lambda tiles: max(tiles, key=lambda t: t[0] * t[1])
inputs = {"hidden": "*bf16", "weight": "*bf16", "bias": "*bf16", "targets": "*i64",
          "softcap": "fp32", "z_scale": "fp32"}
compile_for_sm90(k._forward_kernel, largest(k._FORWARD_TILES), {**inputs, "out": "*fp32"},
                 dict(WANT_S2=True, WANT_SUM_Z=True))
per_row = ("lse", "entropy", "sum_p_sq", "g_lp", "g_entropy", "g_sum_p_sq", "g_mean_logit",
           "g_lse", "d_hidden", "d_weight", "d_bias")
compile_for_sm90(
    k._backward_kernel, largest(k._BACKWARD_TILES),
    {**inputs, **dict.fromkeys(per_row, "*fp32"), "inv_vocab_total": "fp32"},
    dict(GROUP_N=k._GROUP_N, HAS_G_LP=True, HAS_G_ENTROPY=True, HAS_G_SUM_P_SQ=True,
         HAS_G_MEAN=True, HAS_G_LSE=True, NEED_HIDDEN=True, NEED_WEIGHT=True, NEED_BIAS=True),
)
"""


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
