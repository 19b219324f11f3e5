"""The CUDA launcher of linear_logprobs (cuBLAS tiles + Triton epilogues) against the fp64
reference, run under TRITON_INTERPRET=1 on CPU tensors with torch's CPU GEMMs.

Tiles, row chunks and epilogue blocks are shrunk (``small_tiles``) so that odd sizes cross all
of their boundaries: V=1007 spans three 448-column tiles (a middle one, the last partial), N=37
three 16-row chunks (the last, 5 rows, padded to an 8-row granule); a full tile is two
256-column blocks (the second partial), the last tile one partial block.
``tile_bytes=ONE_CHUNK`` puts every chunk in its own row group, so the weight gradient is summed
over groups. The interpreter's time grows with rows x blocks, so the blocks are as wide as
these boundaries allow.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logitless.kernels import linear_softmax as kernel
from logitless.kernels.softmax_partials import finish, normaliser
from logitless.reference.linear_softmax import linear_logits, linear_softmax_stats

from sm90 import run_compile_script
from testing import assert_close_to_oracle, requires_triton

N, D, V = 37, 96, 1007
TILE, CHUNK, GRANULE, BLOCK = 448, 16, 8, 256
ONE_CHUNK = CHUNK * TILE * 4  # bytes of one fp32 chunk tile: one chunk per row group
STATS = ("lse", "logprobs", "entropy", "sum_p_sq", "mean_logit")
GRADS = ("g_lp", "g_entropy", "g_sum_p_sq", "g_mean_logit", "g_lse")
STAT_OF_GRAD = dict(zip(GRADS, ("logprobs", "entropy", "sum_p_sq", "mean_logit", "lse")))
OPTIONS = {
    "plain": dict(temperature=1.0, softcap=None, logit_scale=1.0),
    "T0.7-cap3-scale1.3": dict(temperature=0.7, softcap=3.0, logit_scale=1.3),
    "T1.5": dict(temperature=1.5, softcap=None, logit_scale=1.0),
    # z_scale < 0: the epilogue's running max is taken over -x (FLIP)
    "T0.8-scale-1.2": dict(temperature=0.8, softcap=None, logit_scale=-1.2),
}


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(kernel, "VOCAB_TILE", TILE)
    monkeypatch.setattr(kernel, "ROW_CHUNK", CHUNK)
    monkeypatch.setattr(kernel, "ROW_GRANULE", GRANULE)
    monkeypatch.setattr(kernel, "_BLOCK_V", BLOCK)


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _problem(n, dtype, *, bias, outside=0, contiguous=True, **opts):
    """Fresh random inputs; a third of the targets are the argmax (is_top1 is exercised);
    ``outside`` rows have a target before this vocabulary slice (negative) and ``outside``
    after it (>= V)."""
    dev = _device()
    hidden = torch.randn(n, D, device=dev).to(dtype)
    if contiguous:
        weight = (0.2 * torch.randn(V, D, device=dev)).to(dtype)
    else:
        weight = (0.2 * torch.randn(D, V, device=dev)).to(dtype).t()
    b = torch.randn(V, device=dev).to(dtype) if bias else None
    z = _logits64(hidden, weight, b, **opts)
    targets = torch.randint(0, V, (n,), device=dev)
    targets[::3] = z.argmax(-1)[::3]
    targets[1:1 + 3 * outside:3] = -1 - torch.arange(outside)
    targets[2:2 + 3 * outside:3] = V + torch.arange(outside)
    return hidden, weight, b, targets


def _logits64(hidden, weight, bias, **opts):
    return linear_logits(hidden.double(), weight.double(),
                         None if bias is None else bias.double(),
                         temperature=opts["temperature"], softcap_value=opts["softcap"],
                         logit_scale=opts["logit_scale"])


def _reference(hidden, weight, bias, targets, dtype=torch.float64, **opts):
    """Reference statistics in ``dtype``; targets outside the slice get ``z_y = 0``."""
    inside = (targets >= 0) & (targets < V)
    out = linear_softmax_stats(
        hidden.to(dtype), weight.to(dtype), targets.clamp(0, V - 1),
        None if bias is None else bias.to(dtype), **opts,
    )
    out["logprobs"] = torch.where(inside, out["logprobs"], -out["lse"])
    return out


def _max_before(z, targets):
    """fp64 max of each row's logits strictly before its target (-inf if none)."""
    cols = torch.arange(z.shape[1], device=z.device)
    return torch.where(cols < targets[:, None], z, float("-inf")).amax(1)


def _forward(hidden, weight, bias, targets, want=True, **kw):
    return kernel.forward(hidden, weight, bias, targets, want_s2=want, want_sum_z=want, **kw)


FORWARD_CASES = [
    pytest.param("plain", False, 0, True, True, None, id="plain"),
    pytest.param("T0.7-cap3-scale1.3", True, 3, True, True, ONE_CHUNK,
                 id="bias-cap-outside-groups"),
    pytest.param("T1.5", True, 1, False, True, None, id="bias-T1.5-noncontigW"),
    pytest.param("T0.7-cap3-scale1.3", False, 2, True, False, None, id="cap-no_s2_sum_z"),
    pytest.param("T0.8-scale-1.2", True, 2, True, True, None, id="bias-negative_scale"),
]


@requires_triton
@pytest.mark.parametrize(("option", "bias", "outside", "contiguous", "want", "tile_bytes"),
                         FORWARD_CASES)
def test_forward_fp32_matches_reference(small_tiles, option, bias, outside, contiguous, want,
                                        tile_bytes):
    opts = OPTIONS[option]
    hidden, weight, b, targets = _problem(N, torch.float32, bias=bias, outside=outside,
                                          contiguous=contiguous, **opts)
    parts = _forward(hidden, weight, b, targets, want, tile_bytes=tile_bytes, **opts)
    assert len(parts) == 8 and all(f.dtype == torch.float32 and f.shape == (N,) for f in parts)
    got = finish(parts, V)
    ref = _reference(hidden, weight, b, targets, **opts)
    for name in STATS if want else ("lse", "logprobs", "entropy"):
        torch.testing.assert_close(got[name].double(), ref[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    z = _logits64(hidden, weight, b, **opts)
    torch.testing.assert_close(parts.m.double(), z.amax(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parts.m_before.double(), _max_before(z, targets),
                               rtol=1e-6, atol=1e-6)
    inside = (targets >= 0) & (targets < V)
    assert torch.equal(got["is_top1"], inside & (z.argmax(1) == targets))
    assert got["is_top1"].any()
    # A target outside this slice contributes exactly nothing to z_y.
    assert torch.equal(parts.z_y[~inside], torch.zeros_like(parts.z_y[~inside]))
    if outside:
        assert (parts.m_before[targets < 0] == float("-inf")).all()
        assert torch.equal(parts.m_before[targets >= V], parts.m[targets >= V])


def _rounded_logits_reference(hidden, weight, bias, targets, **opts):
    """fp64 statistics of the logits tile the launcher makes: ``h @ W^T + b`` by the same
    torch GEMM in the inputs' dtype (so rounded to it), then everything else in fp64."""
    x = torch.mm(hidden, weight.t()) if bias is None else torch.addmm(bias, hidden, weight.t())
    eye = torch.eye(V, dtype=torch.float64, device=x.device)
    return _reference(x.double(), eye, None, targets, **opts)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_low_precision_three_way(small_tiles, dtype):
    """The tile is rounded to the inputs' dtype, as torch's own GEMM rounds it; everything after
    is fp32: within fp32 rounding of the fp64 statistics of that tile, and within the three-way
    bound of the oracle, the tolerance being what the tile's rounding alone moves each
    statistic by."""
    opts = OPTIONS["T0.7-cap3-scale1.3"]
    hidden, weight, b, targets = _problem(N, dtype, bias=True, outside=2, **opts)
    got = finish(_forward(hidden, weight, b, targets, tile_bytes=ONE_CHUNK, **opts), V)
    oracle = _reference(hidden, weight, b, targets, **opts)
    same_dtype = _reference(hidden, weight, b, targets, dtype=dtype, **opts)
    tile = _rounded_logits_reference(hidden, weight, b, targets, **opts)
    for name in STATS:
        torch.testing.assert_close(got[name].double(), tile[name], rtol=1e-5, atol=2e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert_close_to_oracle(got[name], oracle[name], same_dtype[name],
                               tol=(tile[name] - oracle[name]).abs() + 2e-5, name=name)
        assert _rms(got[name] - oracle[name]) <= _rms(same_dtype[name] - oracle[name]), name


@requires_triton
def test_is_top1_takes_the_first_of_tied_maxima(small_tiles):
    """Two vocabulary rows with equal weights tie for the maximum: the lower index is the top-1
    (argmax's rule), the higher is not; pairs in different tiles and in one tile."""
    dev = _device()
    u = torch.nn.functional.normalize(torch.randn(2, D, device=dev), dim=1)
    hidden = 3.0 * u.repeat_interleave(torch.tensor([19, N - 19], device=dev), 0)
    hidden += 0.05 * torch.randn(N, D, device=dev)
    weight = 0.1 * torch.randn(V, D, device=dev)
    pairs = [(10, 950), (500, 501)]  # across tiles 0 and 2; inside tile 1
    for k, (lo, hi) in enumerate(pairs):
        weight[lo] = weight[hi] = 4.0 * u[k]
    which = (torch.arange(N, device=dev) >= 19).long()
    lo = torch.tensor([p[0] for p in pairs], device=dev)[which]
    hi = torch.tensor([p[1] for p in pairs], device=dev)[which]
    targets = torch.where(torch.arange(N, device=dev) % 2 == 0, lo, hi)
    z = hidden @ weight.t()
    assert torch.equal(z.gather(1, lo[:, None]), z.gather(1, hi[:, None]))
    assert torch.equal(z.argmax(1), lo)
    parts = _forward(hidden, weight, None, targets, **OPTIONS["plain"])
    top1 = finish(parts, V)["is_top1"]
    assert torch.equal(top1, targets == lo)
    assert top1.any() and not top1.all()


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


def _kernel_grads(hidden, weight, bias, targets, upstream, need, tile_bytes=None, **opts):
    # The statistics the backward consumes come from the fp64 reference rounded to fp32, so
    # the backward is tested on its own; the normaliser's parts from the forward, whose
    # maximum they must be (``top``).
    stats = {k: v.float() for k, v in _reference(hidden, weight, bias, targets, **opts).items()}
    parts = _forward(hidden, weight, bias, targets, want=False, tile_bytes=tile_bytes, **opts)
    g = dict(upstream)
    return kernel.backward(
        hidden, weight, bias, targets, *normaliser(parts),
        stats["entropy"] if g["g_entropy"] is not None else None,
        stats["sum_p_sq"] if g["g_sum_p_sq"] is not None else None,
        g["g_lp"], g["g_entropy"], g["g_sum_p_sq"], g["g_mean_logit"], g_lse=g["g_lse"],
        vocab_total=weight.shape[0], need_hidden=need[0], need_weight=need[1],
        need_bias=need[2], tile_bytes=tile_bytes, **opts,
    )


BACKWARD_CASES = [
    pytest.param("plain", False, 0, True, ("g_lp",), None, id="plain-lp"),
    pytest.param("T0.7-cap3-scale1.3", True, 3, True, GRADS, ONE_CHUNK,
                 id="bias-cap-all_grads-groups"),
    pytest.param("T0.7-cap3-scale1.3", True, 0, False, ("g_entropy",), None,
                 id="bias-cap-entropy-noncontigW"),
    pytest.param("T1.5", True, 1, True, ("g_lp", "g_sum_p_sq", "g_mean_logit"), None,
                 id="bias-T1.5-lp_sq_mean"),
    pytest.param("plain", False, 0, True, ("g_lse",), ONE_CHUNK, id="plain-lse-groups"),
    pytest.param("T0.8-scale-1.2", False, 1, True, ("g_lp", "g_lse"), None,
                 id="negative_scale-lp_lse"),
]


@requires_triton
@pytest.mark.parametrize(("option", "bias", "outside", "contiguous", "grads", "tile_bytes"),
                         BACKWARD_CASES)
def test_backward_fp32_matches_reference(small_tiles, option, bias, outside, contiguous, grads,
                                         tile_bytes):
    opts = OPTIONS[option]
    hidden, weight, b, targets = _problem(N, torch.float32, bias=bias, outside=outside,
                                          contiguous=contiguous, **opts)
    upstream = _upstream(N, grads)
    got = _kernel_grads(hidden, weight, b, targets, upstream, (True, True, bias),
                        tile_bytes=tile_bytes, **opts)
    ref = _reference_grads(hidden, weight, b, targets, upstream, **opts)
    for name, g, r in zip(("d_hidden", "d_weight", "d_bias"), got, ref):
        if r is None:
            assert g is None, name
            continue
        assert g.dtype == torch.float32 and g.shape == r.shape, name
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@requires_triton
def test_backward_only_requested_grads(small_tiles):
    opts = OPTIONS["T1.5"]
    hidden, weight, b, targets = _problem(N, torch.float32, bias=True, **opts)
    upstream = _upstream(N, ("g_lp", "g_entropy"))
    ref = _reference_grads(hidden, weight, b, targets, upstream, **opts)
    d_hidden, d_weight, d_bias = _kernel_grads(hidden, weight, b, targets, upstream,
                                               (False, True, False), **opts)
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


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile_bytes", [None, ONE_CHUNK], ids=["one_group", "groups"])
def test_backward_low_precision_three_way(small_tiles, dtype, tile_bytes):
    opts = OPTIONS["T0.7-cap3-scale1.3"]
    hidden, weight, b, targets = _problem(N, dtype, bias=True, outside=2, **opts)
    upstream = _upstream(N, GRADS)
    got = _kernel_grads(hidden, weight, b, targets, upstream, (True, True, True),
                        tile_bytes=tile_bytes, **opts)
    assert got[1].dtype == dtype  # d_weight: written by the GEMMs in the inputs' dtype
    oracle = _reference_grads(hidden, weight, b, targets, upstream, **opts)
    same_dtype = _reference_grads(hidden, weight, b, targets, upstream, dtype=dtype, **opts)
    # Like torch's autograd in this dtype, the kernel rounds dx to it once, for the GEMMs,
    # which bounds its error elementwise by u |dx| @ |W| (and u |dx|^T @ |hidden|, u sum |dx|).
    dx = _oracle_logit_grad(hidden, weight, b, targets, upstream, **opts).abs()
    u = torch.finfo(dtype).eps
    tols = (u * dx @ weight.double().abs(), u * dx.t() @ hidden.double().abs(), u * dx.sum(0))
    for name, g, o, s, tol in zip(("d_hidden", "d_weight", "d_bias"), got, oracle, same_dtype,
                                  tols):
        assert_close_to_oracle(g, o, s, tol=tol, name=name)
        assert _rms(g - o) <= _rms(s - o), name


def _run(hidden, weight, bias, targets, upstream, tile_bytes=None):
    opts = OPTIONS["T0.7-cap3-scale1.3"]
    parts = _forward(hidden, weight, bias, targets, tile_bytes=tile_bytes, **opts)
    stats = finish(parts, V)
    grads = kernel.backward(
        hidden, weight, bias, targets, *normaliser(parts), stats["entropy"], stats["sum_p_sq"],
        *(upstream[k] for k in GRADS[:4]), g_lse=upstream["g_lse"], vocab_total=V,
        need_hidden=True, need_weight=True, need_bias=bias is not None, tile_bytes=tile_bytes,
        **opts)
    return parts, grads


@requires_triton
def test_runs_are_bitwise_identical(small_tiles):
    hidden, weight, b, targets = _problem(N, torch.bfloat16, bias=True, outside=1,
                                          **OPTIONS["T0.7-cap3-scale1.3"])
    upstream = _upstream(N, GRADS)
    first = _run(hidden, weight, b, targets, upstream, ONE_CHUNK)
    second = _run(hidden, weight, b, targets, upstream, ONE_CHUNK)
    for a, c in zip((*first[0], *first[1]), (*second[0], *second[1])):
        assert torch.equal(a, c)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant(small_tiles, dtype):
    """A row's statistics and hidden-gradient row are the same bits whichever rows share its
    batch (37 rows, 20 of them, at another offset in a batch of 50 with other rows) and
    however the rows are grouped (tile_bytes)."""
    hidden, weight, b, targets = _problem(N, dtype, bias=True, outside=1,
                                          **OPTIONS["T0.7-cap3-scale1.3"])
    upstream = _upstream(N, GRADS)
    full = _run(hidden, weight, b, targets, upstream)
    rows = slice(5, 25)
    other_h, _, _, other_t = _problem(30, dtype, bias=False, **OPTIONS["plain"])
    mixed = (torch.cat([other_h[:7], hidden[rows], other_h[7:]]),
             torch.cat([other_t[:7], targets[rows], other_t[7:]]))
    place = slice(7, 27)
    other_up = {k: torch.randn(30) for k in GRADS}
    batches = [
        (hidden[rows], targets[rows], {k: g[rows] for k, g in upstream.items()}, slice(None),
         None),
        (*mixed, {k: torch.cat([other_up[k][:7], g[rows], other_up[k][7:]])
                  for k, g in upstream.items()}, place, None),
        (hidden, targets, upstream, rows, ONE_CHUNK),
    ]
    for h, t, up, at, tile_bytes in batches:
        parts, grads = _run(h, weight, b, t, up, tile_bytes)
        for name, a, c in zip(parts._fields, full[0], parts):
            assert torch.equal(a[rows], c[at]), name
        assert torch.equal(full[1][0][rows], grads[0][at]), "d_hidden"


@requires_triton
@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 70_000), groups_of=st.integers(1, 20))
def test_a_call_pads_less_than_one_granule(n, groups_of):
    """The shipped plan (1024-row chunks, a 128-row granule): the chunks cover the N rows, every
    GEMM is a whole chunk or, for the last one, a multiple of the granule, and a call pads
    fewer than ``ROW_GRANULE`` rows (whole chunks padded a 1100-row call to 2048)."""
    hidden = torch.empty(n, 1)
    weight = torch.empty(3, 1)
    tile_bytes = groups_of * kernel.ROW_CHUNK * 3 * hidden.element_size()
    plan = kernel.TilePlan(hidden, weight, tile_bytes)
    granule = 128
    assert 0 <= plan.n_pad - n < granule
    heights = []
    at = 0
    for r0, rows in plan.groups:
        assert r0 == at
        at += rows
        heights += [min(kernel.ROW_CHUNK, rows - c) for c in range(0, rows, kernel.ROW_CHUNK)]
    assert at == plan.n_pad
    assert all(h == kernel.ROW_CHUNK for h in heights[:-1])
    assert heights[-1] % granule == 0 and 0 < heights[-1] <= kernel.ROW_CHUNK
    assert plan.tile.numel() >= max(rows for _, rows in plan.groups) * kernel.row_stride(3)


@requires_triton
def test_gemms_are_chunks_or_granules(small_tiles, monkeypatch):
    """Every GEMM of a call (forward, recompute, hidden gradient) is ``CHUNK`` rows or, for the
    last chunk, a multiple of the granule: N=37 runs 16, 16 and 8 rows, never a padded 16."""
    heights = []
    real_mm, real_addmm = torch.mm, torch.addmm

    def mm(a, *args, **kw):
        heights.append(a.shape[0])
        return real_mm(a, *args, **kw)

    def addmm(c, a, *args, **kw):
        heights.append(a.shape[0])
        return real_addmm(c, a, *args, **kw)

    hidden, weight, b, targets = _problem(N, torch.float32, bias=False, **OPTIONS["plain"])
    upstream = _upstream(N, ("g_lp",))
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    _run(hidden, weight, b, targets, upstream)
    row_gemms = [h for h in heights if h != V % TILE and h != TILE]  # not the d_weight GEMMs
    assert sorted(set(row_gemms)) == [GRANULE, CHUNK]
    assert row_gemms.count(GRANULE) * 2 == row_gemms.count(CHUNK)


@requires_triton
def test_every_tile_row_starts_16_aligned(small_tiles, monkeypatch):
    """The epilogues read 16-byte vectors with a lane's columns in one thread only when the
    runtime sees the row stride divisible by 16: every tile, the last partial one included
    (V=1007 leaves 111 columns), has its rows a multiple of 16 elements apart."""
    seen = []

    class Recorder:
        def __init__(self, real):
            self.real = real

        def __getitem__(self, grid):
            def launch(z, stride_row, *args, **kw):
                seen.append((z.shape[1], stride_row, z.data_ptr() % 16))
                return self.real[grid](z, stride_row, *args, **kw)
            return launch

    for name in ("tile_stats_kernel", "tile_grad_kernel"):
        monkeypatch.setattr(kernel, name, Recorder(getattr(kernel, name)))
    hidden, weight, b, targets = _problem(N, torch.bfloat16, bias=True, **OPTIONS["plain"])
    upstream = _upstream(N, ("g_lp",))
    _run(hidden, weight, b, targets, upstream)
    assert {w for w, _, _ in seen} == {TILE, V % TILE}
    assert all(stride % 16 == 0 and stride >= w and ptr == 0 for w, stride, ptr in seen), seen


@requires_triton
def test_empty_batch():
    hidden = torch.randn(0, D, device=_device())
    weight = torch.randn(V, D, device=_device())
    targets = torch.zeros(0, dtype=torch.int64, device=_device())
    parts = _forward(hidden, weight, None, targets, **OPTIONS["plain"])
    assert len(parts) == 8 and all(field.shape == (0,) for field in parts)
    d_hidden, d_weight, _ = kernel.backward(
        hidden, weight, None, targets, parts.top, parts.l, None, None, parts.l, None, None, None,
        vocab_total=V, need_hidden=True, need_weight=True, need_bias=False, **OPTIONS["plain"],
    )
    assert d_hidden.shape == (0, D) and torch.equal(d_weight, torch.zeros_like(d_weight))


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=torch.randn(2, 3, D)), "^hidden must be"),
    (dict(hidden=torch.randn(4, D, dtype=torch.float64)), "^hidden must be"),
    (dict(weight=torch.randn(V, D + 1)), "^weight must be"),
    (dict(bias=torch.randn(V - 1)), "^bias must be"),
    (dict(targets=torch.zeros(4, dtype=torch.int32)), "^targets must be"),
])
def test_bad_inputs_raise(kwargs, match):
    args = dict(hidden=torch.randn(4, D), weight=torch.randn(V, D), bias=None,
                targets=torch.zeros(4, dtype=torch.int64)) | kwargs
    with pytest.raises(ValueError, match=match):
        kernel.forward(**args, want_s2=False, want_sum_z=False, **OPTIONS["plain"])


def test_accumulating_gemm_never_rounds_the_product():
    """bf16 products summed across tiles accumulate in fp32: the result is the fp32 product of
    the (exact) fp32 copies, not a product rounded to bf16 first."""
    a = torch.randn(32, 300).bfloat16()
    b = torch.randn(300, 24).bfloat16()
    acc = torch.full((32, 24), float("nan"))
    kernel.addmm_acc_(acc, a, b, beta=0.0)
    exact = a.double() @ b.double()
    assert (acc.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    assert not torch.equal(acc, (a @ b).float())
    kernel.addmm_acc_(acc, a, b, beta=1.0)
    torch.testing.assert_close(acc.double(), 2 * exact, rtol=1e-5, atol=1e-4)


KERNELS = pathlib.Path(kernel.__file__).parent


def test_no_atomics_in_kernels():
    """Every accumulation happens in a fixed order: no Triton atomics in any kernel file."""
    for path in sorted(KERNELS.glob("*.py")):
        assert "tl.atomic" not in path.read_text(), path.name


def test_fp32_products_go_through_torch_matmul():
    """fp32 inputs follow torch.get_float32_matmul_precision() because every product is a
    torch GEMM: the Triton passes of this launcher hold no tl.dot (whose precision Triton
    would choose instead)."""
    assert "tl.dot(" not in (KERNELS / "linear_softmax.py").read_text()


# Compiles both kernels for sm_90 with the constexprs and warps the launcher uses, for each
# dtype, every feature flag on and off. Run where Triton is no interpreter.
_COMPILE_SCRIPT = """
import torch
from sm90 import compile_sm90
from logitless.kernels import linear_softmax as k

def split(meta):
    meta = dict(meta)
    return meta.pop("num_warps"), meta

for dtype, ty in (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32")):
    dt = getattr(torch, dtype)
    for on in (True, False):
        warps, consts = split(k.stats_meta(dt, 3.0 if on else None, on, on))
        sig = dict(logits="*" + ty, stride_row="i32", targets="*i64", state="*fp32",
                   plane="i32", width="i32", v0="i32", softcap="fp32", z_scale="fp32")
        assert compile_sm90(k.tile_stats_kernel, sig, consts, num_warps=warps).asm["cubin"]
        g = torch.zeros(1) if on else None
        warps, consts = split(k.grad_meta(dt, 3.0 if on else None, g, g, g, g, g))
        sig = dict(logits="*" + ty, stride_row="i32", targets="*i64",
                   **dict.fromkeys(("top", "log_l", "entropy", "sum_p_sq", "g_lp",
                                    "g_entropy", "g_sum_p_sq", "g_mean_logit", "g_lse"), "*fp32"),
                   n_rows="i32", width="i32", v0="i32", softcap="fp32", z_scale="fp32",
                   inv_vocab_total="fp32")
        assert compile_sm90(k.tile_grad_kernel, sig, consts, num_warps=warps).asm["cubin"]
"""


@pytest.mark.compile_sm90
def test_kernels_compile_for_sm90():
    run_compile_script(_COMPILE_SCRIPT)
