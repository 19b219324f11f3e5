"""Triton kernels for the fused linear softmax statistics: the GPU path of core op 1.

Logits ``z = logit_scale * softcap(hidden @ W^T + b) / temperature`` exist only as
``[BLOCK_N, BLOCK_V]`` register tiles; the ``[N, V]`` matrix is never written.

Forward (``forward``): grid ``(row blocks, vocab splits)``. Each program streams the vocab tiles
of its split through ``tl.dot`` (fp32 accumulation over D chunks) and keeps flash-attention
style running statistics per row: max ``m``, ``l = sum e^(z-m)``, ``a = sum e^(z-m) (z-m)``,
``s2 = sum e^(2(z-m))``, ``sum z`` and the target logit, rescaling ``l, a, s2`` whenever the
max grows. The target logit is picked from the same tile the max sees, so ``z_y >= m`` is an
exact top-1 test. Splitting the vocabulary keeps the GPU busy when there are few row blocks;
the ``[S, N]`` partials are merged by ``softmax_partials.merge`` (a tiny torch epilogue, the
same one vocab-parallel ranks use).

Backward (``backward``): one program per ``(row block, vocab block)`` tile, ordered in groups
of ``GROUP_N`` row blocks so that concurrently running programs share weight tiles in L2. A
program recomputes its logits tile, turns it into ``dx = dL/dx`` in registers, then loops over
D chunks and adds ``dx @ W`` into ``d_hidden`` and ``dx^T @ hidden`` into ``d_weight`` with
fp32 ``tl.atomic_add`` (and ``sum_rows dx`` into ``d_bias``). This is Cut Cross-Entropy's
shape: one logits recompute plus the two gradient GEMMs (3 GEMM-equivalents), against 4 for
separate d_hidden and d_weight kernels, each of which would have to recompute the logits
(a per-program ``[BLOCK, D]`` accumulator does not fit in registers for D in the thousands).
The cost is atomic traffic of ``D (BLOCK_N + BLOCK_V)`` adds per tile (amortised by large
tiles) and a run-to-run nondeterministic summation order.

Addressing: every tile's first row / column and every D-chunk step is an int64 scalar
(``N * V`` passes 2^31 at 16k tokens x 152k vocabulary, ``N * D`` at long batches); offsets
inside a tile are int32 (bounded by tile size x stride), because a 64-bit pointer per element
carried through the GEMM loop spills registers on Hopper. tanh is written with ``tl.exp``: the
CPU interpreter cannot run libdevice calls.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from logitless.kernels.softmax_partials import Partials, empty, merge

__all__ = ["backward", "forward"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _config(block_n, block_v, block_d, warps, stages, pre_hook=None):
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_V": block_v, "BLOCK_D": block_d},
        num_warps=warps, num_stages=stages, pre_hook=pre_hook,
    )


# (BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages). The interpreter gets one small config:
# it runs every program in Python, and autotuning there would only measure numpy. The GPU
# lists hold tiles that compile for sm_90 (triton 3.9, bf16, every feature flag on) without
# register spills, or with a few dozen bytes at most; 64-wide D chunks and 256 x 128 tiles
# spill hundreds of bytes once the online-softmax or dz temporaries sit beside the fp32 tile.
_FORWARD_TILES = [(32, 128, 64, 1, 1)] if _INTERPRET else [
    (32, 128, 32, 4, 4),
    (64, 64, 64, 4, 4),
    (64, 128, 32, 4, 3),
    (64, 256, 32, 8, 3),
    (128, 64, 32, 4, 4),
    (128, 128, 32, 8, 3),
]
_BACKWARD_TILES = [(32, 128, 64, 1, 1)] if _INTERPRET else [
    (32, 128, 32, 4, 4),
    (64, 64, 64, 4, 4),
    (64, 128, 32, 4, 3),
    (64, 256, 32, 8, 3),
    (128, 128, 32, 8, 3),
    (128, 128, 32, 8, 4),
]
_GROUP_N = 8
# A vocab split is a whole number of the largest forward vocab tile, so every config tiles it.
_SPLIT_GRANULE = max(t[1] for t in _FORWARD_TILES)
# Row block used only to estimate how many programs a grid has when choosing the split count:
# the largest, so the estimate errs towards more splits (cheap) rather than idle SMs.
_SPLIT_ROW_BLOCK = max(t[0] for t in _FORWARD_TILES)
# Programs to aim for per streaming multiprocessor; on the interpreter a small fixed count that
# still splits the vocabulary of test-sized problems.
_PROGRAMS_PER_SM = 2
_INTERPRET_PROGRAMS = 8
_MIN_TILES_PER_SPLIT = 1 if _INTERPRET else 4


def _bucket(x: int) -> int:
    """Power-of-two bucket of a size, so autotuning runs once per bucket and not per N."""
    return triton.next_power_of_2(max(int(x), 1))


def _prune_row_blocks(configs, named_args, **kwargs):
    """Drop configs whose row block is far larger than N (all-masked rows are wasted work)."""
    # N arrives as a keyword, which some Triton versions keep out of named_args.
    limit = max(32, _bucket({**named_args, **kwargs}["N"]))
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= limit]
    return kept or configs[:1]


def _zero_grads(nargs):
    # Backward accumulates with atomics: each autotuning trial must start from zeros. A config
    # pre_hook (unlike autotune's reset_to_zero in older Triton) tolerates the None outputs;
    # it also runs before the real launch, so the zeros are written twice there (one memset).
    for name in ("d_hidden", "d_weight", "d_bias"):
        if nargs[name] is not None:
            nargs[name].zero_()


_INPUT_FLAGS = {
    "HAS_BIAS": lambda args: args["bias"] is not None,
    "HAS_SOFTCAP": lambda args: args["softcap"] is not None,
    "INTERPRET_BF16": lambda args: _INTERPRET and args["hidden"].dtype == torch.bfloat16,
    "EVEN_D": lambda args: args["D"] % args["BLOCK_D"] == 0,
}


@triton.jit
def _tanh(x):
    # exp(-2|x|) <= 1 never overflows; libdevice tanh is not available to the interpreter.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b, acc, INTERPRET_BF16: tl.constexpr):
    # Triton's CPU interpreter multiplies the raw bits of bf16 operands (it stores them as
    # uint16); exact fp32 copies give it the product a GPU forms with fp32 accumulation.
    if INTERPRET_BF16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # "ieee": fp32 inputs stay exact (no TF32); bf16/fp16 inputs use tensor cores as usual.
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _round_to_input(x, dtype: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in the input dtype, for a tensor-core GEMM."""
    if INTERPRET_BF16:
        # The interpreter truncates fp32 -> bf16; round with integer ops and keep fp32 storage
        # (``_dot`` upcasts there anyway).
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _tile_offsets(local_rows, stride_row, stride_d, BLOCK_D: tl.constexpr):
    """int32 offsets ``[rows, BLOCK_D]`` of a row tile's first D chunk, from its first row.

    Pointer math splits into an int64 scalar (the tile's first row, done once) and these
    in-tile int32 offsets: a 64-bit pointer per element, carried through the GEMM loop,
    costs enough registers to spill on Hopper.
    """
    return local_rows[:, None] * stride_row + tl.arange(0, BLOCK_D)[None, :] * stride_d


@triton.jit
def _load_chunk(chunk, offsets, d_left, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr):
    """One D chunk of a row tile: ``chunk`` points at its first element, ``d_left`` columns
    remain (zeros past D)."""
    if EVEN_D:
        tile = tl.load(chunk + offsets)
    else:
        tile = tl.load(chunk + offsets, mask=(tl.arange(0, BLOCK_D) < d_left)[None, :], other=0.0)
    return tile


@triton.jit
def _valid(first, size, BLOCK: tl.constexpr):
    """In-tile lanes, their validity, and lanes clamped into range (rows past the end are
    computed from the last real one, so loads need no mask)."""
    lanes = tl.arange(0, BLOCK)
    count = (size - first).to(tl.int32)
    return lanes, lanes < count, tl.minimum(lanes, count - 1)


@triton.jit
def _local_targets(targets, v0, BLOCK_V: tl.constexpr):
    """Targets as int32 lanes of the vocab tile starting at ``v0``; -1 when not in it."""
    inside = (targets >= v0) & (targets < v0 + BLOCK_V)
    return tl.where(inside, targets - v0, -1).to(tl.int32)


@triton.jit
def _logits_tile(
    h_tile, h_offsets, w_tile, w_offsets, bias, v0, cols, D, stride_hd, stride_wd,
    softcap, z_scale,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):
    """fp32 tile ``z [BLOCK_N, BLOCK_V]`` of tempered logits.

    Rows past N and columns past V repeat the last real row / column (finite values);
    callers mask them.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_D)):
        h = _load_chunk(h_tile, h_offsets, D - k * BLOCK_D, BLOCK_D, EVEN_D)
        w = _load_chunk(w_tile, w_offsets, D - k * BLOCK_D, BLOCK_D, EVEN_D)
        acc = _dot(h, tl.trans(w), acc, INTERPRET_BF16)
        # Scalar (64-bit) pointer steps: the in-tile offsets stay int32.
        h_tile += BLOCK_D * stride_hd
        w_tile += BLOCK_D * stride_wd
    if HAS_BIAS:
        acc += tl.load(bias + v0 + cols).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        acc = softcap * _tanh(acc / softcap)
    return acc * z_scale


@triton.autotune(
    configs=[_config(*t) for t in _FORWARD_TILES],
    key=["N_BIN", "D_BIN", "V_BIN"],
    prune_configs_by={"early_config_prune": _prune_row_blocks},
)
@triton.heuristics(_INPUT_FLAGS)
@triton.jit
def _forward_kernel(
    hidden, weight, bias, targets, out,
    N, D, V, vocab_per_split,
    stride_hn, stride_hd, stride_wv, stride_wd,
    softcap, z_scale,
    N_BIN, D_BIN, V_BIN,
    WANT_S2: tl.constexpr, WANT_SUM_Z: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):
    split = tl.program_id(1).to(tl.int64)
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_N
    rows, mask_n, local_rows = _valid(row0, N, BLOCK_N)
    h_tile = hidden + row0 * stride_hn
    h_offsets = _tile_offsets(local_rows, stride_hn, stride_hd, BLOCK_D)
    tgt = tl.load(targets + row0 + rows, mask=mask_n, other=-1)

    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
    s2_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sum_z = tl.zeros((BLOCK_N,), dtype=tl.float32)
    z_y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    m_before = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)

    v_start = split * vocab_per_split
    n_tiles = tl.cdiv(tl.minimum(v_start + vocab_per_split, V) - v_start, BLOCK_V)
    for t in range(0, n_tiles):
        v0 = v_start + t * BLOCK_V
        lanes, mask_v, cols = _valid(v0, V, BLOCK_V)
        z = _logits_tile(
            h_tile, h_offsets, weight + v0 * stride_wv,
            _tile_offsets(cols, stride_wv, stride_wd, BLOCK_D), bias, v0, cols, D,
            stride_hd, stride_wd, softcap, z_scale,
            BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, HAS_BIAS, HAS_SOFTCAP, INTERPRET_BF16,
        )
        z = tl.where(mask_v[None, :], z, float("-inf"))
        # Every tile holds at least one real column, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(z, 1))
        shift = m_i - m_new
        alpha = tl.exp(shift)
        d = z - m_new[:, None]
        e = tl.exp(d)
        # First tile: l = 0 and shift = -inf; 0 * -inf would poison a with NaN.
        a_i = (a_i + l_i * tl.where(l_i > 0, shift, 0.0)) * alpha
        a_i += tl.sum(e * tl.where(mask_v[None, :], d, 0.0), 1)
        l_i = l_i * alpha + tl.sum(e, 1)
        if WANT_S2:
            s2_i = s2_i * (alpha * alpha) + tl.sum(e * e, 1)
        if WANT_SUM_Z:
            sum_z += tl.sum(tl.where(mask_v[None, :], z, 0.0), 1)
        # targets == -1 (or in another tile) match no lane, so they add nothing to z_y.
        hit = lanes[None, :] == _local_targets(tgt, v0, BLOCK_V)[:, None]
        z_y += tl.sum(tl.where(hit, z, 0.0), 1)
        # [head] is_top1 tie rule: the largest logit left of the target (first maximum wins).
        before = (v0 + lanes)[None, :] < tgt[:, None]
        m_before = tl.maximum(m_before, tl.max(tl.where(before, z, float("-inf")), 1))
        m_i = m_new

    # out is [7, S, N]: one plane per Partials field.
    plane = tl.num_programs(1).to(tl.int64) * N
    ptrs = out + split * N + row0 + rows
    tl.store(ptrs, m_i, mask=mask_n)
    tl.store(ptrs + plane, l_i, mask=mask_n)
    tl.store(ptrs + 2 * plane, a_i, mask=mask_n)
    tl.store(ptrs + 3 * plane, s2_i, mask=mask_n)
    tl.store(ptrs + 4 * plane, sum_z, mask=mask_n)
    tl.store(ptrs + 5 * plane, z_y, mask=mask_n)
    tl.store(ptrs + 6 * plane, m_before, mask=mask_n)


@triton.autotune(
    configs=[_config(*t, pre_hook=_zero_grads) for t in _BACKWARD_TILES],
    key=["N_BIN", "D_BIN", "V_BIN"],
    prune_configs_by={"early_config_prune": _prune_row_blocks},
)
@triton.heuristics({
    **_INPUT_FLAGS,
    "HAS_G_LP": lambda args: args["g_lp"] is not None,
    "HAS_G_ENTROPY": lambda args: args["g_entropy"] is not None,
    "HAS_G_SUM_P_SQ": lambda args: args["g_sum_p_sq"] is not None,
    "HAS_G_MEAN": lambda args: args["g_mean_logit"] is not None,
    "HAS_G_LSE": lambda args: args["g_lse"] is not None,  # [head]: lse is differentiable
    "NEED_HIDDEN": lambda args: args["d_hidden"] is not None,
    "NEED_WEIGHT": lambda args: args["d_weight"] is not None,
    "NEED_BIAS": lambda args: args["d_bias"] is not None,
})
@triton.jit
def _backward_kernel(
    hidden, weight, bias, targets, lse, entropy, sum_p_sq,
    g_lp, g_entropy, g_sum_p_sq, g_mean_logit, g_lse,
    d_hidden, d_weight, d_bias,
    N, D, V,
    stride_hn, stride_hd, stride_wv, stride_wd,
    softcap, z_scale, inv_vocab_total,
    N_BIN, D_BIN, V_BIN,
    GROUP_N: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, INTERPRET_BF16: tl.constexpr,
    HAS_G_LP: tl.constexpr, HAS_G_ENTROPY: tl.constexpr,
    HAS_G_SUM_P_SQ: tl.constexpr, HAS_G_MEAN: tl.constexpr, HAS_G_LSE: tl.constexpr,
    NEED_HIDDEN: tl.constexpr, NEED_WEIGHT: tl.constexpr, NEED_BIAS: tl.constexpr,
):
    # Grouped tile order: GROUP_N row blocks walk the vocabulary together (L2 reuse of W tiles).
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_N * tl.cdiv(V, BLOCK_V)
    first_row_block = (pid // per_group) * GROUP_N
    group_rows = tl.minimum(n_row_blocks - first_row_block, GROUP_N)
    row0 = (first_row_block + (pid % per_group) % group_rows).to(tl.int64) * BLOCK_N
    v0 = ((pid % per_group) // group_rows).to(tl.int64) * BLOCK_V

    rows, mask_n, local_rows = _valid(row0, N, BLOCK_N)
    lanes, mask_v, cols = _valid(v0, V, BLOCK_V)
    h_tile = hidden + row0 * stride_hn
    h_offsets = _tile_offsets(local_rows, stride_hn, stride_hd, BLOCK_D)
    w_tile = weight + v0 * stride_wv
    w_offsets = _tile_offsets(cols, stride_wv, stride_wd, BLOCK_D)
    z = _logits_tile(
        h_tile, h_offsets, w_tile, w_offsets, bias, v0, cols, D, stride_hd, stride_wd,
        softcap, z_scale,
        BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, HAS_BIAS, HAS_SOFTCAP, INTERPRET_BF16,
    )

    row_ptrs = row0 + rows
    logp = z - tl.load(lse + row_ptrs, mask=mask_n, other=0.0)[:, None]
    p = tl.exp(logp)
    dz = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if HAS_G_LP:
        g = tl.load(g_lp + row_ptrs, mask=mask_n, other=0.0)[:, None]
        tgt = tl.load(targets + row_ptrs, mask=mask_n, other=-1)
        hit = lanes[None, :] == _local_targets(tgt, v0, BLOCK_V)[:, None]
        dz += g * (tl.where(hit, 1.0, 0.0) - p)
    if HAS_G_ENTROPY:
        g = tl.load(g_entropy + row_ptrs, mask=mask_n, other=0.0)[:, None]
        h_ent = tl.load(entropy + row_ptrs, mask=mask_n, other=0.0)[:, None]
        dz -= g * p * (logp + h_ent)
    if HAS_G_SUM_P_SQ:
        g = tl.load(g_sum_p_sq + row_ptrs, mask=mask_n, other=0.0)[:, None]
        s2 = tl.load(sum_p_sq + row_ptrs, mask=mask_n, other=0.0)[:, None]
        dz += 2.0 * g * p * (p - s2)
    if HAS_G_MEAN:
        dz += tl.load(g_mean_logit + row_ptrs, mask=mask_n, other=0.0)[:, None] * inv_vocab_total
    if HAS_G_LSE:  # d lse / dz_j = p_j
        dz += tl.load(g_lse + row_ptrs, mask=mask_n, other=0.0)[:, None] * p
    # Through the transform: dz/dx = z_scale * (1 - tanh(x/c)^2), tanh(x/c) = z / (z_scale c).
    dx = dz * z_scale
    if HAS_SOFTCAP:
        t = z / (z_scale * softcap)
        dx *= 1.0 - t * t
    dx = tl.where(mask_n[:, None] & mask_v[None, :], dx, 0.0)

    if NEED_BIAS:
        tl.atomic_add(d_bias + v0 + lanes, tl.sum(dx, 0), mask=mask_v, sem="relaxed")
    # The gradient GEMMs run in the input dtype (tensor cores) and accumulate in fp32.
    dx_in = _round_to_input(dx, hidden.dtype.element_ty, INTERPRET_BF16)
    for k in range(0, tl.cdiv(D, BLOCK_D)):
        offs_d = k * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        if NEED_HIDDEN:
            w = _load_chunk(w_tile, w_offsets, D - k * BLOCK_D, BLOCK_D, EVEN_D)
            tl.atomic_add(
                d_hidden + row0 * D + (rows[:, None] * D + offs_d[None, :]),
                _dot(dx_in, w, None, INTERPRET_BF16),
                mask=mask_n[:, None] & mask_d[None, :], sem="relaxed",
            )
        if NEED_WEIGHT:
            h = _load_chunk(h_tile, h_offsets, D - k * BLOCK_D, BLOCK_D, EVEN_D)
            tl.atomic_add(
                d_weight + v0 * D + (lanes[:, None] * D + offs_d[None, :]),
                _dot(tl.trans(dx_in), h, None, INTERPRET_BF16),
                mask=mask_v[:, None] & mask_d[None, :], sem="relaxed",
            )
        w_tile += BLOCK_D * stride_wd
        h_tile += BLOCK_D * stride_hd


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _vocab_splits(n_rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """Number of vocab splits and vocabulary per split for the forward grid.

    Enough splits that row blocks x splits reaches ~``_PROGRAMS_PER_SM`` programs per SM, each
    split a whole number of ``_SPLIT_GRANULE`` columns and at least ``_MIN_TILES_PER_SPLIT``
    of them (so a program's epilogue stays small next to its GEMM work).
    """
    if device.type == "cuda":
        target = _PROGRAMS_PER_SM * _sm_count(device.index)
    else:
        target = _INTERPRET_PROGRAMS
    row_blocks = triton.cdiv(max(n_rows, 1), _SPLIT_ROW_BLOCK)
    max_splits = max(1, triton.cdiv(vocab, _SPLIT_GRANULE * _MIN_TILES_PER_SPLIT))
    splits = max(1, min(triton.cdiv(target, row_blocks), max_splits))
    per_split = triton.cdiv(triton.cdiv(vocab, splits), _SPLIT_GRANULE) * _SPLIT_GRANULE
    return triton.cdiv(vocab, per_split), per_split


def _check_inputs(hidden, weight, bias, targets):
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, D], got shape {tuple(hidden.shape)}")
    n, d = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be [V, {d}], got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(
            f"hidden, weight and bias must share a dtype, got {hidden.dtype}, {weight.dtype}"
            f", {None if bias is None else bias.dtype}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    if targets.shape != (n,) or targets.dtype != torch.int64:
        raise ValueError(
            f"targets must be int64 [{n}], got {targets.dtype} shape {tuple(targets.shape)}"
        )


def _common_args(hidden, weight, temperature, softcap, logit_scale):
    n, d = hidden.shape
    v = weight.shape[0]
    return dict(
        N=n, D=d, V=v,
        stride_hn=hidden.stride(0), stride_hd=hidden.stride(1),
        stride_wv=weight.stride(0), stride_wd=weight.stride(1),
        softcap=None if softcap is None else float(softcap),
        z_scale=float(logit_scale) / float(temperature),
        N_BIN=_bucket(n), D_BIN=_bucket(d), V_BIN=_bucket(v),
    )


def forward(hidden, weight, bias, targets, *, temperature: float, softcap: float | None,
            logit_scale: float, want_s2: bool, want_sum_z: bool) -> Partials:
    """Per-token partial softmax statistics of ``z = logit_scale * softcap(h W^T + b) / T``.

    hidden ``[N, D]``, weight ``[V, D]`` (any strides), bias ``[V]`` or None, all one dtype
    (fp32/bf16/fp16); targets int64 ``[N]`` local to this vocabulary slice (below 0 / at least
    V: the target lies in a slice before / after it, ``z_y = 0``). Returns fp32 ``[N]``
    partials relative to the row max ``m`` (see ``softmax_partials``); ``s2`` / ``sum_z`` are
    zeros unless asked for.
    """
    _check_inputs(hidden, weight, bias, targets)
    n, v = hidden.shape[0], weight.shape[0]
    if n == 0:
        return empty(hidden.device)
    splits, per_split = _vocab_splits(n, v, hidden.device)
    out = torch.empty(len(Partials._fields), splits, n, dtype=torch.float32, device=hidden.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)
    _forward_kernel[grid](
        hidden, weight, None if bias is None else bias.contiguous(), targets.contiguous(), out,
        vocab_per_split=per_split, WANT_S2=want_s2, WANT_SUM_Z=want_sum_z,
        **_common_args(hidden, weight, temperature, softcap, logit_scale),
    )
    parts = Partials(*out)
    if splits == 1:
        return Partials(*(field[0] for field in parts))
    return merge(parts)


def backward(hidden, weight, bias, targets, lse, entropy, sum_p_sq,
             g_lp, g_entropy, g_sum_p_sq, g_mean_logit, *, temperature: float,
             softcap: float | None, logit_scale: float, vocab_total: int,
             need_hidden: bool, need_weight: bool, need_bias: bool, g_lse=None,
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of hidden, weight and bias from per-token upstream gradients, in fp32.

    lse, entropy, sum_p_sq: fp32 ``[N]`` global statistics (entropy / sum_p_sq may be None
    when their upstream gradient is). g_*: fp32 ``[N]`` or None (that term is skipped). With
    ``p = exp(z - lse)`` recomputed per tile,
    ``dz = g_lp (1[j=y] - p) - g_entropy p (log p + H) + 2 g_sum_p_sq p (p - S2)
    + g_mean_logit / vocab_total + g_lse p``, ``dx = dz * logit_scale / T * (1 - tanh(x/c)^2)``, and
    ``d_hidden = dx @ W [N, D]``, ``d_weight = dx^T @ hidden [V, D]``, ``d_bias = sum dx [V]``
    (None where not needed).
    """
    _check_inputs(hidden, weight, bias, targets)
    if g_entropy is not None and entropy is None:
        raise ValueError("entropy is required when g_entropy is given")
    if g_sum_p_sq is not None and sum_p_sq is None:
        raise ValueError("sum_p_sq is required when g_sum_p_sq is given")
    n, v = hidden.shape[0], weight.shape[0]
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=hidden.device)
    d_hidden = zeros(hidden.shape) if need_hidden else None
    d_weight = zeros(weight.shape) if need_weight else None
    d_bias = zeros(v) if need_bias else None
    if need_bias and bias is None:
        raise ValueError("need_bias=True but bias is None")
    if n == 0 or not (need_hidden or need_weight or need_bias):
        return d_hidden, d_weight, d_bias
    per_row = lambda t: None if t is None else t.float().contiguous()
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(v, meta["BLOCK_V"]),)
    _backward_kernel[grid](
        hidden, weight, None if bias is None else bias.contiguous(), targets.contiguous(),
        per_row(lse), per_row(entropy), per_row(sum_p_sq),
        per_row(g_lp), per_row(g_entropy), per_row(g_sum_p_sq), per_row(g_mean_logit),
        per_row(g_lse), d_hidden, d_weight, d_bias,
        inv_vocab_total=1.0 / vocab_total, GROUP_N=_GROUP_N,
        **_common_args(hidden, weight, temperature, softcap, logit_scale),
    )
    return d_hidden, d_weight, d_bias
