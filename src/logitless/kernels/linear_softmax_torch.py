"""Chunked PyTorch twin of the Triton linear-softmax kernels (the CPU path).

Same contract as ``kernels/linear_softmax.py``: the forward streams tiles of bounded size
through ``torch.mm`` and keeps only per-token partial statistics; the backward recomputes each
tile, turns it into the logit gradient in place, and feeds it to two GEMMs. At no point does
more than one tile of logits (plus its in-place transforms) exist.

The backward recomputes each tile with the forward's own GEMM (token-major, ``h @ W_c^T``, the
same shapes), so its logits are the forward's bits: ``z - m`` is then exactly 0 at each row's
maximum, and ``p = exp((z - m) - log l)`` as accurate as ``log_softmax`` on the materialised
logits at any temperature (``softmax_partials.normaliser``). It works on the tile through its
**vocab-major** view, ``[cols, rows]``, which the gradient GEMMs read as a transposed operand.
The tile buffers are allocated once per call and every elementwise step writes into them: no
tile-sized temporaries, so glibc does not map and fault in fresh pages for each tile.
"""

from __future__ import annotations

import torch

from logitless.kernels import constants
from logitless.kernels.softmax_partials import Partials, empty, merge, stack

# Default bound on the bytes of one call's tile buffers: the logits and a scratch tile in fp32
# (fp64 for fp64 inputs), a third when soft-capping, the GEMM's output in the input dtype when
# that is bf16/fp16, and a byte per element for the forward's top-1 mask.
DEFAULT_TILE_BYTES = 64 * 2**20
# Token rows per tile (the GEMMs' M), the fewest vocab columns a tile is cut to before rows are
# given up (small tile budgets), and the most.
ROW_BLOCK = 1024
MIN_COLS = 1024
MAX_COLS = 16384
# The last row block is padded with zero rows to a multiple of this many (or to a whole block
# when blocks are smaller), so no GEMM ever sees fewer rows: BLAS takes other paths, with
# other reduction orders, for a handful of rows (MKL: 1 or 2 rows, 8 vocab-major), and a
# token's results would then depend on the size of its batch. A whole 1024-row block of
# padding instead would make a 64-token call 16 times the work.
_ROW_GRANULE = 64
# Whether ``torch.addmm(fp32, bf16, bf16, out_dtype=torch.float32)`` works, per (device, input
# dtype): decided by `_probe_out_dtype` the first time a device asks, then cached.
_MM_OUT_DTYPE: dict[tuple[str, int | None, torch.dtype], bool] = {}


def _bytes_per_element(dtype: torch.dtype, softcap: float | None) -> int:
    """Bytes the tile buffers (see ``Tiles``) take per logit of a tile."""
    acc = acc_dtype(dtype)
    size = acc.itemsize * (3 if softcap is not None else 2) + 1  # + the top-1 mask
    return size + (dtype.itemsize if acc != dtype else 0)


def _tile_shape(v: int, tile_bytes: int, dtype: torch.dtype,
                softcap: float | None) -> tuple[int, int]:
    """Rows and vocab columns per tile so that the tile buffers fit in ``tile_bytes``; from the
    vocabulary, the budget and the dtype only, never from the number of tokens, so that a
    token's results do not depend on the batch it comes in (see ``forward``).

    Up to ``ROW_BLOCK`` token rows per tile, the vocabulary split to fit: with whole-vocabulary
    rows instead (55 rows at V=152k in 64 MB), every row block would stream the whole head
    through a thin GEMM and the backward would update all of ``d_weight`` with a rank-55
    product, N / 55 passes over ``[V, D]``; with 1024-row tiles each weight tile is read once
    per 1024 tokens and ``d_weight`` is written once per 1024 tokens (fwd+bwd at N=256, D=1024,
    V=152k on CPU: 8 s of CPU time instead of 12.5). The partials of a row's vocab tiles are
    merged exactly as vocab-parallel shards are. At most ``MAX_COLS`` columns.
    """
    elems = max(1, tile_bytes // _bytes_per_element(dtype, softcap))
    rows = max(1, min(ROW_BLOCK, elems // min(v, MIN_COLS)))
    return rows, max(1, min(v, MAX_COLS, elems // rows))


def row_blocks(n: int, rows: int):
    """``(first row, real rows, padded rows)`` of each row block (see ``_ROW_GRANULE``)."""
    return constants.row_blocks(n, rows, _ROW_GRANULE)


def pad_rows(x, size: int, fill=0):
    """``x`` with rows of ``fill`` appended up to ``size`` rows (``x`` itself when it has them;
    None stays None)."""
    if x is None or x.shape[0] == size:
        return x
    out = x.new_full((size, *x.shape[1:]), fill)
    out[:x.shape[0]] = x
    return out


class Tiles:
    """The buffers of one call's tiles: logits, scratch, ``1 - tanh^2`` when soft-capping, the
    GEMM's output in the input dtype when that is bf16/fp16, and (``top1``, the forward) the
    mask of the columns at or after each target."""

    def __init__(self, rows, cols, dtype, device, softcap, top1=False):
        self.acc = acc_dtype(dtype)
        size = rows * cols
        self.z = torch.empty(size, dtype=self.acc, device=device)
        self.scratch = torch.empty(size, dtype=self.acc, device=device)
        self.cap = torch.empty(size, dtype=self.acc, device=device) if softcap is not None \
            else None
        self.low = torch.empty(size, dtype=dtype, device=device) if self.acc != dtype else None
        self.mask = torch.empty(size, dtype=torch.bool, device=device) if top1 else None

    @staticmethod
    def view(buf, cols, rows):
        return buf[:cols * rows].view(cols, rows)

    def logits(self, hidden, weight, bias, temperature, softcap, logit_scale, vocab_major=True):
        """Tempered logits of one tile, ``[cols, rows]`` (``vocab_major``) or ``[rows, cols]``,
        and ``tanh(x / c)`` when soft-capping (for the backward)."""
        cols, rows = weight.shape[0], hidden.shape[0]
        shape = (cols, rows) if vocab_major else (rows, cols)
        low = None if self.low is None else self.view(self.low, *shape)
        cap = None if self.cap is None else self.view(self.cap, *shape)
        t = logits_into(self.view(self.z, *shape), low, cap, hidden, weight, bias, temperature,
                        softcap, logit_scale, vocab_major)
        return self.view(self.z, *shape), t


def logits_into(x, low, cap, hidden, weight, bias, temperature, softcap, logit_scale,
                vocab_major: bool):
    """Write the tempered logits of ``hidden`` against ``weight`` (and ``bias``) into ``x``:
    ``[V_tile, rows]`` when ``vocab_major``, else ``[rows, V_tile]``. ``low`` (same shape, the
    inputs' dtype) takes the GEMM's output when that is not ``x``'s dtype; ``cap`` receives
    ``tanh(x / c)`` when soft-capping, which is returned (else None)."""
    out = x if low is None else low
    if vocab_major:
        a, b, bias = weight, hidden.t(), None if bias is None else bias.unsqueeze(1)
    else:
        a, b = hidden, weight.t()
    if bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)
    if low is not None:
        x.copy_(out)
    if softcap is not None:
        t = torch.tanh(x.div_(softcap), out=cap)
        torch.mul(t, softcap * logit_scale / temperature, out=x)
        return t
    if logit_scale != 1.0 or temperature != 1.0:
        x.mul_(logit_scale / temperature)
    return None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics accumulate in fp32 (fp64 inputs stay fp64, for gradcheck and the oracle)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tile_partials(z: torch.Tensor, local_targets: torch.Tensor, want_s2: bool,
                  want_sum_z: bool, scratch: torch.Tensor, vocab_dim: int = 0,
                  mask: torch.Tensor | None = None) -> Partials:
    """Partial statistics of one logits tile whose vocabulary runs along ``vocab_dim``, using
    ``scratch`` (same shape) for the exponentials and ``mask`` (a bool buffer of at least as
    many elements, else one is allocated) for ``m_before``. ``z`` and ``scratch`` are
    overwritten."""
    cols, n = z.shape[vocab_dim], z.shape[1 - vocab_dim]
    has_y = (local_targets >= 0) & (local_targets < cols)
    idx = local_targets.clamp(0, cols - 1).unsqueeze(vocab_dim)
    z_y = torch.where(has_y, z.gather(vocab_dim, idx).squeeze(vocab_dim), 0.0)
    sum_z = z.sum(vocab_dim) if want_sum_z else z.new_zeros(n)
    m = z.amax(vocab_dim, keepdim=True)
    m_before = _max_before_target(z, local_targets, m.squeeze(vocab_dim), scratch, mask,
                                  vocab_dim)
    z.sub_(m)
    e = torch.exp(z, out=scratch)
    l = e.sum(vocab_dim)
    a = z.mul_(e).sum(vocab_dim)  # sum e (z - m), over the logits (no longer needed)
    s2 = e.square_().sum(vocab_dim) if want_s2 else z.new_zeros(n)
    return Partials(m.squeeze(vocab_dim), l, a, s2, sum_z, z_y, m_before)


def _max_before_target(z, local_targets, m, scratch, mask, vocab_dim):
    """Per row, the largest logit of the tile at an index before the row's target: the tile's
    max ``m`` when the target lies after the tile, -inf when it lies before. Only the rows
    whose target falls inside the tile (about one tile's worth of rows over a whole
    vocabulary) are scanned, copied into ``scratch``."""
    cols = z.shape[vocab_dim]
    out = torch.where(local_targets >= cols, m, float("-inf"))
    inside = ((local_targets > 0) & (local_targets < cols)).nonzero().squeeze(1)
    k = inside.numel()
    if k:
        row_dim = 1 - vocab_dim
        shape = (k, cols) if vocab_dim == 1 else (cols, k)
        picked = torch.index_select(z, row_dim, inside, out=scratch.view(-1)[:k * cols].view(shape))
        col = torch.arange(cols, device=z.device).unsqueeze(row_dim)
        at_or_after = None if mask is None else mask.view(-1)[:k * cols].view(shape)
        at_or_after = torch.ge(col, local_targets[inside].unsqueeze(vocab_dim), out=at_or_after)
        out[inside] = picked.masked_fill_(at_or_after, float("-inf")).amax(vocab_dim)
    return out


def head_slice(weight, bias, c0, cols, dtype):
    """Vocabulary columns ``c0:c0+cols`` of the head in the compute dtype (views when the head
    already has it; else a copy of the slice only, never of the whole head)."""
    w = weight[c0:c0 + cols].to(dtype)
    return w, None if bias is None else bias[c0:c0 + cols].to(dtype)


def add_one_hot_(dz, local_targets, values):
    """``dz[y_j, j] += values[j]`` for the tokens whose target lies in this tile."""
    has_y = (local_targets >= 0) & (local_targets < dz.shape[0])
    index = torch.where(has_y, local_targets, 0).unsqueeze(0)
    dz.scatter_add_(0, index, torch.where(has_y, values, 0.0).unsqueeze(0))


def forward(hidden, weight, bias, targets, *, temperature, softcap, logit_scale, want_s2,
            want_sum_z, tile_bytes: int = DEFAULT_TILE_BYTES) -> Partials:
    """Per-token partial softmax statistics of ``z = transform(hidden @ W^T + b)``.

    hidden ``[N, D]`` in the compute dtype, weight ``[V, D]`` and bias ``[V]`` (or None) in
    any float dtype, cast slice by slice to hidden's, targets int64
    ``[N]``, local to this vocabulary slice: below 0 (or at least V) when the target lies in a
    slice before (after) this one. Returns fp32 partials ``[N]`` relative to each token's
    maximum (see ``softmax_partials``).
    """
    n, v = hidden.shape[0], weight.shape[0]
    if n == 0:
        return empty(hidden.device, acc_dtype(hidden.dtype))
    rows, cols = _tile_shape(v, tile_bytes, hidden.dtype, softcap)
    blocks = list(row_blocks(n, rows))
    tiles = Tiles(blocks[0][2], cols, hidden.dtype, hidden.device, softcap, top1=True)
    out = []
    for r0, real, padded in blocks:
        h = pad_rows(hidden[r0:r0 + real], padded)
        tgt = pad_rows(targets[r0:r0 + real], padded, -1)
        parts = []
        for c0 in range(0, v, cols):
            w, b = head_slice(weight, bias, c0, cols, hidden.dtype)
            # Token-major here: the forward's logits then round as ``h @ W^T`` does in the
            # plain-PyTorch heads this replaces (TRL's, for one); vocab-major rounding moved a
            # near-cancelling loss (VESPO's, in the TRL parity tests) by 2e-4 relative.
            z, _ = tiles.logits(h, w, b, temperature, softcap, logit_scale,
                                vocab_major=False)
            scratch = tiles.view(tiles.scratch, *z.shape)
            parts.append(tile_partials(z, tgt - c0, want_s2, want_sum_z, scratch, vocab_dim=1,
                                       mask=tiles.mask))
        merged = parts[0] if len(parts) == 1 else merge(stack(parts))
        out.append([f[:real] for f in merged[:7]])  # no ``top``: the backward reads ``m``
    return Partials(*(torch.cat(f) for f in zip(*out)))


def backward(hidden, weight, bias, targets, top, log_l, entropy, sum_p_sq, g_lp, g_entropy,
             g_sum_p_sq, g_mean_logit, *, temperature, softcap, logit_scale, vocab_total,
             need_hidden, need_weight, need_bias, g_lse=None,
             tile_bytes: int = DEFAULT_TILE_BYTES):
    """Gradients of hidden, weight and bias from per-token upstream gradients (fp32 results;
    hidden in the compute dtype, the head in any float dtype, as in ``forward``).

    ``top``, ``log_l``: the normaliser ``lse = top + log_l`` in two parts
    (``softmax_partials.normaliser``), ``top`` the row's largest logit as ``forward`` found it
    (its ``m``, at the same ``tile_bytes``). With ``p = exp((z - top) - log_l)`` recomputed per
    tile:
    ``dz = g_lp (1[j=y] - p) - g_entropy p (log p + H) + g_sum_p_sq 2 p (p - S2) + g_mean / V
    + g_lse p``,
    then through the logit transform, then ``d_hidden = dx^T @ W``, ``d_weight = dx @ hidden``,
    ``d_bias = sum dx``, each accumulated in fp32 (fp64 for fp64 inputs): the first product
    into each accumulator overwrites it, so nothing is zeroed first. Upstream gradients that
    are None cost nothing; so do results not asked for.
    """
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    if not (need_hidden or need_weight or need_bias) or n == 0:
        return tuple(hidden.new_zeros(shape, dtype=acc) if need else None
                     for need, shape in ((need_hidden, hidden.shape),
                                         (need_weight, weight.shape), (need_bias, (v,))))
    rows, cols = _tile_shape(v, tile_bytes, hidden.dtype, softcap)
    blocks = list(row_blocks(n, rows))
    tiles = Tiles(blocks[0][2], cols, hidden.dtype, hidden.device, softcap)
    d_hidden = hidden.new_empty(hidden.shape, dtype=acc) if need_hidden else None
    d_weight = weight.new_empty(weight.shape, dtype=acc) if need_weight else None
    d_bias = weight.new_zeros(v, dtype=acc) if need_bias else None
    for r0, real, padded in blocks:
        sl = slice(r0, r0 + real)
        h = pad_rows(hidden[sl], padded)
        tgt = pad_rows(targets[sl], padded, -1)
        per_row = [None if g is None else pad_rows(g[sl], padded)
                   for g in (top, log_l, entropy, sum_p_sq, g_lp, g_entropy, g_sum_p_sq,
                             g_mean_logit, g_lse)]
        # The hidden gradient of a padded block goes through a padded accumulator.
        dh = None if d_hidden is None else pad_rows(d_hidden[sl], padded)
        for c0 in range(0, v, cols):
            w, b = head_slice(weight, bias, c0, cols, hidden.dtype)
            # The forward's GEMM (the forward's bits), then its vocab-major view.
            z, t = tiles.logits(h, w, b, temperature, softcap, logit_scale, vocab_major=False)
            z, t = z.t(), None if t is None else t.t()
            scratch = tiles.view(tiles.scratch, *z.shape[::-1]).t()
            dz = logit_grad_(z, tgt - c0, *per_row, vocab_total, scratch)
            dz[:, real:] = 0.0  # padding rows: whatever their statistics, no gradient
            dx = through_transform_(dz, t, logit_scale, temperature)
            if tiles.low is not None:
                dx = tiles.view(tiles.low, *dx.shape[::-1]).copy_(dx.t()).t()
            if dh is not None:
                addmm_acc_(dh, dx.t(), w, beta=0.0 if c0 == 0 else 1.0)
            if d_weight is not None:
                addmm_acc_(d_weight[c0:c0 + cols], dx, h, beta=0.0 if r0 == 0 else 1.0)
            if d_bias is not None:
                d_bias[c0:c0 + cols] += dz.sum(1)
        if dh is not None and padded > real:
            d_hidden[sl] = dh[:real]
    return d_hidden, d_weight, d_bias


def mm_out_dtype(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a ``dtype`` GEMM writes an fp32 output directly on ``device``
    (``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``). Decided once per device
    and dtype by making exactly that call on 2 x 2 tensors (`_probe_out_dtype`), never from
    the version or the docstring: CPU builds name the keyword but have no kernel for it, and
    older CUDA builds refuse an fp32 ``self`` with bf16 operands. Where it fails the operands
    are upcast instead (exact copies, the same fp32 sums)."""
    key = (device.type, device.index, dtype)
    if key not in _MM_OUT_DTYPE:
        _MM_OUT_DTYPE[key] = _probe_out_dtype(device, dtype)
    return _MM_OUT_DTYPE[key]


def _probe_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "meta":
        return False
    try:
        acc = torch.full((2, 2), 0.5, dtype=torch.float32, device=device)
        a = torch.full((2, 2), 1.5, dtype=dtype, device=device)
        torch.addmm(acc, a, a, beta=1.0, out_dtype=torch.float32, out=acc)
        # 0.5 + 2 * 1.5^2 = 5.0 in every element, in fp32 (one host read per device)
        return acc.dtype == torch.float32 and bool((acc == 5.0).all())
    except (TypeError, RuntimeError, NotImplementedError, ValueError):
        return False


def addmm_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> None:
    """``acc = beta * acc + a @ b`` into an fp32 (fp64) accumulator without rounding ``a @ b``
    to bf16/fp16. ``beta=0`` overwrites ``acc`` (whatever it held, NaN included).

    Rounding each tile's product to the inputs' 8-bit mantissa before summing the tiles biases
    the weight gradient (TRL measured the entropy drifting down over a few dozen steps).
    """
    if a.dtype == acc.dtype:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif mm_out_dtype(acc.device, a.dtype):
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), beta=beta, out=acc)


def through_transform_(dz, t, logit_scale, temperature):
    """``dz -> dx`` in place: ``dz/dx = scale / T * (1 - tanh(x/c)^2)`` (``t`` None: no cap)."""
    if t is not None:
        dz *= t.mul_(t).neg_().add_(1.0)
    factor = logit_scale / temperature
    if factor != 1.0:
        dz *= factor
    return dz


def logit_grad_(z, local_targets, top, log_l, entropy, sum_p_sq, g_lp, g_entropy, g_sum_p_sq,
                g_mean_logit, g_lse, vocab_total, scratch):
    """Overwrite the logits tile ``z [cols, rows]`` with ``d loss / d z`` and return it.

    ``dz = p (g_lse - g_lp - g_H (log p + H) + 2 g_S2 (p - S2)) + g_lp 1[j=y] + g_mean / V``: the
    per-element coefficient is built in ``scratch``, then multiplied into ``p``. Per-token
    arguments are ``[rows]`` (None: zero); ``log p = (z - top) - log_l``, in that order (see
    ``backward``).
    """
    z -= top
    z -= log_l  # log p
    coef = None
    if g_entropy is not None:
        coef = torch.add(z, entropy, out=scratch).mul_(-g_entropy)
    p = z.exp_()
    if g_sum_p_sq is not None:
        two_g = 2.0 * g_sum_p_sq
        coef = torch.mul(p, two_g, out=scratch) if coef is None else coef.addcmul_(p, two_g)
        coef -= two_g * sum_p_sq
    # The per-token part of the coefficient: d lse / dz_j = p_j, d z_y / dz_j = 1[j=y].
    per_token = g_lse if g_lp is None else -g_lp if g_lse is None else g_lse - g_lp
    if coef is None:
        dz = p.mul_(per_token) if per_token is not None else p.zero_()
    else:
        if per_token is not None:
            coef += per_token
        dz = p.mul_(coef)
    if g_mean_logit is not None:
        dz += g_mean_logit / vocab_total
    if g_lp is not None:
        add_one_hot_(dz, local_targets, g_lp)
    return dz
