"""Segmented Triton kernels (under TRITON_INTERPRET=1 on CPU) against their torch twin: values,
strided inputs, empty batches and refused inputs (sizes in ``tests/segment_cases.py``). Their
autograd Functions are tested in ``tests/fused_losses/test_segments.py``."""

import pytest
import torch

from logitless.fused_losses.objectives import segments
from logitless.kernels import segments as kernels
from logitless.kernels import segments_torch

from segment_cases import PICKS, SUMS, batch, on_torch, on_triton, triton_forced
from testing import assert_close_to_oracle, requires_triton

pytestmark = requires_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [37, 32], ids=["T37", "T32"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("op", SUMS)
def test_sums_and_means_against_the_torch_twin(op, layout, t, dtype):
    x, mask, cu = batch(layout, t, dtype)
    got = on_triton(op, x, mask, cu)
    assert got.dtype == dtype and got.shape == on_torch(op, x, mask, cu).shape
    truth = on_torch(op, x.double(), mask, cu)
    same = on_torch(op, x, mask, cu)
    # Bound of fp32 summation error on the partial sums, plus (bf16) the rounding of the result:
    # the kernels accumulate in fp32 whatever the input dtype.
    scale = on_torch(op, x.double().abs(), mask, cu)
    tol = 1e-6 * scale + (2.0**-8 * truth.abs() if dtype == torch.bfloat16 else 0.0)
    assert_close_to_oracle(got, truth, same, tol, op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("op", PICKS)
def test_max_and_prefix_min_pick_the_same_element(op, layout, dtype):
    x, mask, cu = batch(layout, dtype=dtype)
    got = on_triton(op, x, mask, cu)
    want = on_torch(op, x, mask, cu)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)  # +inf where a prefix has no valid token, `empty` for max


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_count(layout):
    _, mask, cu = batch(layout)
    with triton_forced():
        got = segments.segment_count(mask, cu)
    assert got.dtype == torch.int64
    assert torch.equal(got, segments_torch.segment_count(mask, cu))


def test_strided_padded_inputs_and_non_bool_mask():
    x, mask, _ = batch("padded", t=40)
    x_t = x.t().contiguous().t()[:, 3:]  # column-major slice: strides (1, 5)
    m = mask[:, 3:].to(torch.float32)
    for op in ("segment_sum", "prefix_sum", "suffix_sum", "segment_max", "prefix_min"):
        got = on_triton(op, x_t, m, None)
        want = on_torch(op, x_t.contiguous(), m.bool(), None)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_empty_batches():
    cu = torch.zeros(1, dtype=torch.int64)
    x = torch.zeros(0)
    cu3 = torch.zeros(4, dtype=torch.int64)  # three sequences, none with a token
    with triton_forced():
        assert segments.segment_sum(x, x.bool(), cu).shape == (0,)
        assert segments.prefix_sum(x, x.bool(), cu).shape == (0,)
        assert torch.equal(segments.segment_max(x, x.bool(), cu3, -1.0), torch.full((3,), -1.0))


def test_bad_inputs_are_refused():
    x, mask, cu = batch("packed")
    with pytest.raises(ValueError, match="mask"):
        kernels.segment_reduce(x, mask[:-1], cu, "sum")
    with pytest.raises(ValueError, match="packed"):
        kernels.segment_reduce(x[None], mask[None], cu, "sum")
    with pytest.raises(ValueError, match="cu_seqlens"):
        kernels.segment_scan(x, mask, cu.float(), "prefix_sum")
    with pytest.raises(ValueError, match="op"):
        kernels.segment_scan(x, mask, cu, "prefix_max")


@pytest.mark.compile_sm90
@pytest.mark.parametrize("mean_length", [3, 4096], ids=["short", "long"])
def test_kernels_compile_for_sm90(mean_length, monkeypatch):
    """Each segment kernel at the launchers' GPU block configs (short sequences sharing a
    program, one long sequence per program), with the flags that make the most code."""
    pytest.importorskip("triton.backends.nvidia")
    from logitless.kernels import segments as seg

    from sm90 import compile_sm90

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU configs, not the interpreter's
    block_b, block_t, warps = seg.launch_blocks(mean_length)
    ints = dict.fromkeys(["B", "T", "stride_xb", "stride_xt", "stride_mb", "stride_mt"], "i32")
    tiles = dict(PACKED=True, FP64=False, BLOCK_B=block_b, BLOCK_T=block_t)
    reduce_sig = {"X": "*bf16", "M": "*u8", "CU": "*i32", "OUT": "*bf16", "CNT": "*i64",
                  "empty": "fp32", **ints}
    scan_sig = {"X": "*fp32", "M": "*u8", "CU": "*i64", "OUT": "*fp32", "IDX": "*i64",
                "stride_ob": "i32", **ints}
    kernels = [
        *[(seg._segment_reduce_kernel, reduce_sig, dict(OP=op, HAS_MASK=True))
          for op in seg._REDUCE_OPS.values()],
        (seg._segment_scan_kernel, scan_sig,
         dict(OP=seg.OP_MIN, REVERSE=True, EXCLUSIVE=True, MASK_IN=True, MASK_OUT=False,
              WANT_INDEX=True)),
        # the sums (prefix and suffix, the mask on the input or on the output): the carry is
        # a loop-carried reduction that triton 3.6.0 refused to compile once
        *[(seg._segment_scan_kernel, scan_sig,
           dict(OP=seg.OP_SUM, REVERSE=reverse, EXCLUSIVE=False, MASK_IN=not mask_out,
                MASK_OUT=mask_out, WANT_INDEX=False))
          for reverse in (False, True) for mask_out in (False, True)],
        (seg._segment_spread_kernel,
         {"V": "*fp16", "CNT": "*i64", "X": "*fp16", "REF": "*fp16", "M": "*u8", "CU": "*i32",
          "OUT": "*fp16", "stride_ob": "i32", **ints},
         dict(HAS_CNT=True, HAS_REF=True, HAS_MASK=True)),
    ]
    for kernel, signature, flags in kernels:
        compiled = compile_sm90(kernel, signature, {**flags, **tiles}, warps, 3)  # launch default
        assert compiled.asm["cubin"]
