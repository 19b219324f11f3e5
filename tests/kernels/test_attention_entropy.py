"""The attention-entropy kernels at their own contract (segment bounds, key/query validity):
the chunked torch twin at tiny chunk sizes (many chunks, partial ones, skipped ones), the Triton
kernel on strided views, and both against the fp64 reference; keys a query cannot see never
influence it, even when they hold NaN."""

import os
import subprocess
import sys

import pytest
import torch

from logitless import reference
from logitless.kernels.attention_entropy_torch import _key_range, attention_entropy_chunked

from testing import requires_triton

TOL = 2e-5


def problem(b=2, hq=4, hk=2, t=67, d=20):
    q = torch.randn(b, hq, t, d) * 2
    k = torch.randn(b, hk, t, d)
    return q, k


def segments(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    n = torch.tensor(lengths)
    start = torch.repeat_interleave(cu[:-1], n)[None].int()
    end = torch.repeat_interleave(cu[1:], n)[None].int()
    return cu, start, end


@pytest.mark.parametrize("block_q,block_k", [(8, 8), (5, 7), (67, 3)])
@pytest.mark.parametrize(
    "opts",
    [{"causal": True}, {"causal": False}, {"causal": True, "window": 6},
     {"causal": False, "window": 9, "softcap": 2.5}],
    ids=["causal", "bidir", "window6", "bidir-window9-softcap"],
)
def test_chunked_any_chunking_matches_reference(block_q, block_k, opts):
    q, k = problem()
    mask = torch.ones(2, 67, dtype=torch.bool)
    mask[0, :10] = False
    mask[1, 50:] = False
    out = attention_entropy_chunked(
        q, k, scale=0.2, key_valid=mask, query_valid=mask, block_q=block_q, block_k=block_k,
        **opts,
    )
    ref = reference.attention_entropy(q.double(), k.double(), scale=0.2, attention_mask=mask,
                                      **opts)
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("block_q,block_k", [(8, 8), (16, 5)])
def test_chunked_packed_segments(block_q, block_k):
    lengths = [3, 20, 1, 30, 13]
    cu, start, end = segments(lengths)
    q, k = problem(b=1, t=67)
    for causal, window in [(True, None), (False, None), (True, 4)]:
        out = attention_entropy_chunked(q, k, scale=0.3, causal=causal, window=window,
                                        seg_start=start, seg_end=end, block_q=block_q,
                                        block_k=block_k)
        ref = reference.attention_entropy(
            q[0].transpose(0, 1).double(), k[0].transpose(0, 1).double(), scale=0.3,
            causal=causal, window=window, cu_seqlens=cu,
        )
        torch.testing.assert_close(out[0].T.double(), ref, atol=TOL, rtol=0)


def test_key_range_skips_what_no_query_sees():
    assert _key_range(64, 96, 200, True, None, None, None) == (0, 96)
    assert _key_range(64, 96, 200, True, 8, None, None) == (57, 96)
    assert _key_range(64, 96, 200, False, 8, None, None) == (57, 103)
    assert _key_range(64, 96, 200, False, None, None, None) == (0, 200)
    _, start, end = segments([50, 30, 120])
    assert _key_range(60, 70, 200, False, None, start, end) == (50, 80)
    assert _key_range(60, 90, 200, True, None, start, end) == (50, 90)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_invisible_keys_never_matter(backend):
    """NaN in padding keys: masked out exactly, not multiplied by a zero probability."""
    q, k = problem(b=1, t=67)
    mask = torch.ones(1, 67, dtype=torch.bool)
    mask[0, 20:31] = False
    k_bad = k.clone()
    k_bad[:, :, 20:31] = float("nan")
    kwargs = dict(scale=0.25, causal=True, window=40, key_valid=mask, query_valid=mask)
    if backend == "torch":
        out = attention_entropy_chunked(q, k_bad, block_q=16, block_k=16, **kwargs)
    else:
        from logitless.kernels.attention_entropy import attention_entropy_triton

        out = attention_entropy_triton(
            q, k_bad, **{**kwargs, "key_valid": mask.view(torch.uint8),
                         "query_valid": mask.view(torch.uint8)}
        )
    assert torch.isfinite(out).all()
    ref = reference.attention_entropy(q.double(), k.double(), scale=0.25, window=40,
                                      attention_mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=0)


@requires_triton
def test_triton_strided_views_and_segments():
    """q and k as views of a [B, T, H, d] buffer (transformers' pre-transpose layout) and of a
    packed buffer: the kernel reads any strides, with int64 offsets."""
    from logitless.kernels.attention_entropy import attention_entropy_triton

    base_q = torch.randn(1, 67, 4, 20) * 2
    base_k = torch.randn(1, 67, 2, 20)
    q, k = base_q.transpose(1, 2), base_k.transpose(1, 2)
    assert not q.is_contiguous()
    cu, start, end = segments([3, 20, 1, 30, 13])
    query_valid = (torch.rand(1, 67) < 0.6)
    out = attention_entropy_triton(q, k, scale=0.3, causal=True, window=12, seg_start=start,
                                   seg_end=end, query_valid=query_valid.view(torch.uint8))
    ref = reference.attention_entropy(
        base_q[0].double(), base_k[0].double(), scale=0.3, window=12, cu_seqlens=cu,
        query_mask=query_valid[0],
    )
    torch.testing.assert_close(out[0].T.double(), ref, atol=TOL, rtol=0)


# Compiles the kernel for sm_90 (no GPU needed) with the largest GPU tile and every feature
# flag on: the interpreter accepts programs the GPU compiler rejects (types, layouts, int64
# offsets, dynamic loop bounds). A subprocess, because TRITON_INTERPRET=1 replaces the JIT.
_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from logitless.kernels import attention_entropy as ae

fn = ae._attention_entropy_fwd
while not isinstance(fn, triton.runtime.jit.JITFunction):
    fn = fn.fn
config = max(ae._configs(), key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
consts = dict(config.kwargs, BLOCK_D=128, IS_CAUSAL=False, HAS_WINDOW=True, HAS_SOFTCAP=True,
              HAS_SEG=True, HAS_KEY_VALID=True, HAS_QUERY_VALID=True, UPCAST_DOT=False,
              stride_qd=1, stride_kd=1)
types = {"Q": "*bf16", "K": "*bf16", "OUT": "*fp32", "SEG_START": "*i32", "SEG_END": "*i32",
         "KEY_VALID": "*u8", "QUERY_VALID": "*u8", "scale": "fp32", "softcap": "fp32"}
signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})
assert compiled.asm["cubin"]
"""


def test_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
