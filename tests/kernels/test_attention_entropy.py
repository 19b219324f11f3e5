"""The attention-entropy kernels at their own contract (segment bounds, key/query validity):
the chunked torch twin at tiny chunk sizes (many chunks, partial ones, skipped ones), the Triton
kernel on strided views, and both against the fp64 reference; keys a query cannot see never
influence it, even when they hold NaN."""


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


@requires_triton
@pytest.mark.parametrize("block_m,block_n", [(32, 16), (64, 16)])
@pytest.mark.parametrize(
    "opts",
    [{"causal": True}, {"causal": False}, {"causal": True, "window": 21},
     {"causal": False, "window": 19, "softcap": 2.5}],
    ids=["causal", "bidir", "window21", "bidir-window19-softcap"],
)
def test_triton_other_block_shapes(block_m, block_n, opts):
    """Block shapes with several key blocks per query block (BLOCK_M = 2, 4 BLOCK_N) put the
    causal diagonal and the window's far edge across several boundary blocks, and leave the
    wholly visible blocks between them: the three key ranges of the kernel meet exactly.
    T = 83 spans 6 key blocks; padding and a packed segment layout cover the masks."""
    from logitless.kernels.attention_entropy import BlockConfig, attention_entropy_triton

    q, k = problem(b=2, t=83)
    mask = torch.ones(2, 83, dtype=torch.bool)
    mask[0, :13] = False
    mask[1, 70:] = False
    config = BlockConfig(block_m, block_n, 4, 1)
    out = attention_entropy_triton(q, k, scale=0.2, key_valid=mask.view(torch.uint8),
                                   query_valid=mask.view(torch.uint8), config=config, **opts)
    ref = reference.attention_entropy(q.double(), k.double(), scale=0.2, attention_mask=mask,
                                      **opts)
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=0)
    cu, start, end = segments([3, 40, 1, 39])
    out = attention_entropy_triton(q[:1], k[:1], scale=0.2, seg_start=start, seg_end=end,
                                   config=config, **opts)
    ref = reference.attention_entropy(q[0].transpose(0, 1).double(),
                                      k[0].transpose(0, 1).double(), scale=0.2,
                                      cu_seqlens=cu, **opts)
    torch.testing.assert_close(out[0].T.double(), ref, atol=TOL, rtol=0)


def test_key_span_is_each_rows_valid_range_and_whether_it_is_whole():
    from logitless.kernels.attention_entropy import key_span

    mask = torch.ones(5, 9, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, 6:] = False  # right padding
    mask[2, [0, 4, 8]] = False  # holes
    mask[3] = False  # no valid key
    got = key_span(mask.view(torch.uint8))
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert got.tolist() == [[3, 9, 1], [0, 6, 1], [1, 8, 0], [9, 0, 0], [0, 9, 1]]


@requires_triton
@pytest.mark.parametrize(
    "opts", [{"causal": True}, {"causal": False}, {"causal": True, "window": 37},
             {"causal": False, "softcap": 3.0}],
    ids=["causal", "bidir", "window37", "bidir-softcap"],
)
def test_triton_padding_spans_and_holes(opts):
    """Rows padded on the left and on the right (a contiguous span: the wholly visible blocks
    take no select), rows with holes (one select per score), a row with no valid key, and NaN
    in every padded key: 16-key blocks put the span's ends and the holes inside whole blocks
    and across their edges."""
    from logitless.kernels.attention_entropy import BlockConfig, attention_entropy_triton

    t = 101
    q, k = problem(b=5, t=t)
    mask = torch.ones(5, t, dtype=torch.bool)
    mask[0, :37] = False
    mask[1, 70:] = False
    mask[2, 20:23] = False
    mask[2, 50:51] = False
    mask[2, 64:80] = False
    mask[3] = False
    mask[4, :5] = False
    mask[4, 90:] = False
    mask[4, 40:44] = False
    k_bad = k.clone()
    k_bad.transpose(1, 2)[~mask] = float("nan")
    out = attention_entropy_triton(q, k_bad, scale=0.2, key_valid=mask.view(torch.uint8),
                                   query_valid=mask.view(torch.uint8),
                                   config=BlockConfig(32, 16, 4, 1), **opts)
    ref = reference.attention_entropy(q.double(), k.double(), scale=0.2, attention_mask=mask,
                                      **opts)
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=0)


@requires_triton
def test_triton_a_query_that_sees_only_padding_gets_zero():
    """Every query computed (no query mask), a window of 60 and a 61-key hole: query 64's
    window holds only padding, across whole key blocks that take the per-score select, so its
    running max stays at its floor and it must come out 0, not the log of the keys it
    skipped. The other queries, padded ones included, against the torch twin in fp64."""
    from logitless.kernels.attention_entropy import BlockConfig, attention_entropy_triton

    t = 101
    q, k = problem(b=1, t=t)
    mask = torch.ones(1, t, dtype=torch.bool)
    mask[0, 4:65] = False
    mask[0, 90:93] = False
    k_bad = k.clone()
    k_bad.transpose(1, 2)[~mask] = float("nan")
    out = attention_entropy_triton(q, k_bad, scale=0.2, causal=True, window=60,
                                   key_valid=mask.view(torch.uint8),
                                   config=BlockConfig(32, 16, 4, 1))
    assert (out[0, :, 64] == 0).all()
    want = attention_entropy_chunked(q.double(), k.double(), scale=0.2, causal=True, window=60,
                                     key_valid=mask, query_valid=None, block_q=16, block_k=16)
    torch.testing.assert_close(out.double(), want.double(), atol=TOL, rtol=0)


@requires_triton
def test_triton_tiny_scale_scales_scores_before_the_padding_select():
    """Below qk_scale 1e-8 the invisible score before the scale (-2e30 / qk_scale) would not
    be a finite fp32: the kernel scales the scores first. Entropies are then log(visible)."""
    from logitless.kernels.attention_entropy import BlockConfig, attention_entropy_triton

    q, k = problem(b=2, t=67)
    mask = torch.ones(2, 67, dtype=torch.bool)
    mask[0, 10:14] = False
    mask[1, :20] = False
    for scale in (5e-9, 0.2):
        out = attention_entropy_triton(q, k, scale=scale, causal=False,
                                       key_valid=mask.view(torch.uint8),
                                       query_valid=mask.view(torch.uint8),
                                       config=BlockConfig(32, 16, 4, 1))
        ref = reference.attention_entropy(q.double(), k.double(), scale=scale, causal=False,
                                          attention_mask=mask)
        torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=0)


def test_grid_is_one_dimensional_for_any_batch_times_heads():
    """B * Hq folded into grid dimension 0 (up to 2^31 - 1 programs), so B * Hq above 65535
    (the limit of grid dimensions 1 and 2) launches."""
    from logitless.kernels.attention_entropy import grid_size

    assert grid_size(2048, 64, 300, 128) == (3 * 2048 * 64,)
    assert grid_size(1, 1, 1, 128) == (1,)


def test_block_config_fixed_per_head_dim_and_dtype():
    """No autotuning over data: the configuration is a function of (head dim, dtype)."""
    from logitless.kernels.attention_entropy import block_config

    for d in (8, 20, 64, 96, 128, 200, 256):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            c = block_config(d, dtype)
            assert c == block_config(d, dtype)
            assert c.block_m % c.block_n == 0
    with pytest.raises(ValueError, match="head dim of at most 256"):
        block_config(320, torch.bfloat16)


# sm_90 compile checks (no GPU): the interpreter accepts programs the GPU compiler rejects
# (types, layouts, int64 offsets, dynamic loop bounds), and register spills only show in
# ptxas's report. Each head dim's launch configuration is compiled with the flags that make
# the most code (every mask on) or the heaviest unmasked loop (causal only).
_ALL_FLAGS = dict(IS_CAUSAL=False, HAS_WINDOW=True, HAS_SOFTCAP=True, HAS_SEG=True,
                  HAS_KEY_VALID=True, HAS_QUERY_VALID=True)
_CAUSAL_ONLY = dict(IS_CAUSAL=True, HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_SEG=False,
                    HAS_KEY_VALID=False, HAS_QUERY_VALID=False)
_TRITON_TYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.mark.compile_sm90
@pytest.mark.parametrize(
    "dtype,head_dim,flags",
    [(torch.bfloat16, 64, _ALL_FLAGS), (torch.float16, 128, _CAUSAL_ONLY),
     (torch.bfloat16, 128, _ALL_FLAGS), (torch.bfloat16, 256, _CAUSAL_ONLY),
     (torch.float32, 64, _CAUSAL_ONLY), (torch.float32, 128, _CAUSAL_ONLY),
     (torch.float32, 256, _CAUSAL_ONLY)],
    ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, dict) else
    ("all-masks" if v["HAS_SEG"] else "causal"),
)
def test_kernel_compiles_for_sm90_without_spills(dtype, head_dim, flags):
    pytest.importorskip("triton.backends.nvidia")
    from logitless.kernels import attention_entropy as ae

    from sm90 import compile_sm90, ptxas_report

    config = ae.block_config(head_dim, dtype)
    ty = _TRITON_TYPE[dtype]
    ints = ["stride_qb", "stride_qh", "stride_qt", "stride_kb", "stride_kh", "stride_kt", "T",
            "HQ", "BH", "GROUP", "D", "window"]
    signature = {"Q": f"*{ty}", "K": f"*{ty}", "OUT": "*fp32", "SEG_START": "*i32",
                 "SEG_END": "*i32", "KEY_VALID": "*u8", "QUERY_VALID": "*u8", "KEY_SPAN": "*i32",
                 "qk_scale": "fp32", "cap2": "fp32", "key_floor": "fp32",
                 **dict.fromkeys(ints, "i32")}
    constexprs = dict(flags, FOLD_SCALE=True, EVEN_D=True, UPCAST_DOT=False, BLOCK_D=head_dim,
                      BLOCK_M=config.block_m, BLOCK_N=config.block_n, stride_qd=1, stride_kd=1)
    compiled = compile_sm90(ae._attention_entropy_fwd, signature, constexprs,
                            config.num_warps, config.num_stages)
    assert compiled.asm["cubin"]
    if dtype != torch.float32:  # 16-bit tiles run on the tensor cores (wgmma)
        assert "wgmma" in compiled.asm["ptx"]
    report = ptxas_report(compiled)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report
