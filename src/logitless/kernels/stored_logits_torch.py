"""One chunk's logits, computed once and turned into the logit gradient in place (torch).

The sequence-aligned chunks of ``fused_policy_loss`` hold a chunk's whole ``[rows, V]`` softmax
between the forward statistics and the gradient, so the head is multiplied three times in all
(logits, hidden gradient, weight gradient) instead of four. This module is that buffer.

Layout: **vocab-major**, ``[V, rows]``, in blocks of ``VOCAB_BLOCK`` vocabulary rows. A chunk
has a few hundred rows, so every GEMM has one thin side. With the vocabulary as the GEMMs' long
dimension (``W_b @ h^T``, ``dz_b^T @ W_b``, ``dz_b @ h``) each one runs at the speed of the
full-batch GEMM on CPU BLAS, while ``h @ W^T`` with 128 to 384 rows runs 15 to 50% slower (MKL,
2 cores). A block is written by its GEMM and reduced to partial statistics while it is still in
cache; in the backward it becomes ``dz`` and feeds its two GEMMs in one visit.

What is kept: each block's **exponentials** ``e = exp(z - m_b)`` relative to the block's
per-token maximum ``m_b``, the maxima and the normaliser ``(top, log l)`` (``lse = top + log l``,
``top`` the largest ``m_b``). Then ``p = e * exp((m_b - top) - log l)`` is one multiply per
element (never ``m_b - lse``: at a low temperature ``lse`` is of the logits' size, 1e4 at
T = 1e-3, and its rounding would be an error of every ``p`` that ``1 / T`` multiplies), and
the common gradient (no entropy term, no soft-capping), ``dz = p * (-g_lp) + g_lp 1[j = y]``,
is that same multiply with a per-token factor: the
backward touches each element once, with no second ``exp``. The entropy term and the
soft-cap derivative need ``log p`` and ``z``, taken back from ``log e`` (a zero ``e`` is a zero
``p``, whose term is zero whatever its logarithm). The forward writes each block's
exponentials into a spare block of the pool, which then becomes that block's storage, so the
logits the GEMM wrote need no copy.
"""

from __future__ import annotations

import torch

from logitless.kernels.linear_softmax_torch import (
    acc_dtype,
    add_one_hot_,
    addmm_acc_,
    logits_into,
    tile_partials,
)
from logitless.kernels.softmax_partials import finish_logprobs, merge, normaliser, stack

# Vocabulary rows per block: 4096 x 384 tokens x 4 bytes is 6 MB, within the last-level cache.
VOCAB_BLOCK = 4096
# log e is clamped here: e = 0 there (p = 0), and the clamp keeps 0 * log e at 0 instead of NaN.
_LOG_FLOOR = -1e4


def _num_blocks(vocab: int, block: int) -> int:
    return -(-vocab // block)


def bytes_per_row(vocab: int, dtype: torch.dtype, softcap: float | None,
                  block: int | None = None, *, hidden_size: int = 0) -> int:
    """Bytes one token row of a chunk needs: its share of the pool (a slot per vocabulary block
    and one spare), one more block when soft-capping (``tanh``, then ``1 - tanh^2``), and a
    block in the input dtype for the GEMMs when the inputs are bf16/fp16. The CPU budget
    counts the pool only: ``hidden_size`` (the chunk's hidden rows) is not counted."""
    del hidden_size
    block = min(vocab, block or VOCAB_BLOCK)
    acc = torch.finfo(acc_dtype(dtype)).bits // 8
    slots = _num_blocks(vocab, block) + 1 + (1 if softcap is not None else 0)
    low = block * (torch.finfo(dtype).bits // 8) if acc_dtype(dtype) != dtype else 0
    return slots * block * acc + low


class StoredLogits:
    """Buffers for chunks of up to ``max_rows`` tokens, reused by every chunk of a call (the
    ``ChunkStore`` of ``fused_policy_loss``)."""

    bytes_per_row = staticmethod(bytes_per_row)

    def __init__(self, vocab: int, max_rows: int, dtype: torch.dtype, device,
                 softcap: float | None, block: int | None = None):
        self.vocab, self.dtype = vocab, dtype
        self.block = min(vocab, block or VOCAB_BLOCK)
        self.acc = acc_dtype(dtype)
        n = _num_blocks(vocab, self.block)
        self._pool = torch.empty(n + 1, self.block * max_rows, dtype=self.acc, device=device)
        self._cap = (torch.empty(self.block * max_rows, dtype=self.acc, device=device)
                     if softcap is not None else None)
        self._low = (torch.empty(self.block * max_rows, dtype=dtype, device=device)
                     if self.acc != dtype else None)

    def _blocks(self):
        for i, v0 in enumerate(range(0, self.vocab, self.block)):
            yield i, v0, min(v0 + self.block, self.vocab)

    def _view(self, flat, v0, v1):
        return flat[:(v1 - v0) * self.rows].view(v1 - v0, self.rows)

    def forward(self, hidden, weight, bias, targets, *, temperature, softcap, logit_scale,
                reduce=None):
        """Compute the logits of ``hidden [rows, D]`` block by block and keep their
        exponentials; return per-token ``logprobs``, ``entropy`` and ``lse`` (fp32; fp64 for
        fp64 inputs). ``targets`` lie in ``[0, V)``; with ``reduce`` (a vocabulary slice's
        partials to the whole vocabulary's, over the ranks that hold the other slices) they
        are local to this slice, below 0 or at least ``V`` when in another."""
        rows = hidden.shape[0]
        self.rows, self.head, self.targets = rows, (temperature, softcap, logit_scale), targets
        parts, self.slot = [], []
        spare = len(self._pool) - 1
        for i, v0, v1 in self._blocks():
            zb = self._view(self._pool[i], v0, v1)  # slot i is free: blocks < i moved down one
            logits_into(zb, None if self._low is None else self._view(self._low, v0, v1),
                        None if self._cap is None else self._view(self._cap, v0, v1),
                        hidden, weight[v0:v1], None if bias is None else bias[v0:v1],
                        temperature, softcap, logit_scale, vocab_major=True)
            # The exponentials go to the spare slot, which becomes the block's storage.
            e = self._view(self._pool[spare], v0, v1)
            parts.append(tile_partials(zb, targets - v0, False, False, e, vocab_dim=0))
            self.slot.append(spare)
            spare = i
        self.spare = spare
        stacked = stack(parts)
        self.block_max = stacked.m
        merged = merge(stacked)
        if reduce is not None:
            merged = reduce(merged)
        self.z_y = merged.z_y
        self.top, self.log_l = normaliser(merged)
        return finish_logprobs(merged, self.log_l)

    def backward_(self, hidden, weight, entropy, g_lp, g_entropy, d_weight, d_bias,
                  want_hidden: bool, weight_beta: float = 1.0):
        """Turn the stored exponentials into ``d loss / d x`` (``x`` the untransformed logits)
        block by block, add ``dx @ hidden`` to ``d_weight`` (``weight_beta=0``: overwrite it)
        and ``dx`` summed to ``d_bias`` (either may be None), and return ``dx^T W`` when
        ``want_hidden`` (fp32; fp64 for fp64 inputs).

        ``g_lp``, ``g_entropy``: per-token upstream gradients (None: zero). With ``p = e
        exp((m_b - top) - log l)`` (the forward's normaliser) and ``f = scale / T``:
        ``dz = f p (-g_lp - g_H (log p + H)) + f g_lp 1[j = y]``, times ``1 - tanh^2`` when
        soft-capping (at the target, from its exact logit).
        """
        temperature, softcap, logit_scale = self.head
        f = logit_scale / temperature
        shift = (self.block_max - self.top) - self.log_l  # [blocks, rows]: log p = log e + shift
        scale = torch.exp(shift)  # p = e * scale
        g_lp = torch.zeros_like(self.log_l) if g_lp is None else g_lp.to(self.log_l.dtype)
        if g_entropy is None:  # dz = e * k0
            k1, k0 = None, scale * (-g_lp * f)
        else:  # dz = e * (k1 log e + k0)
            g_entropy = g_entropy.to(self.log_l.dtype)
            k1 = scale * (-g_entropy * f)
            k0 = scale * ((-g_lp - g_entropy * (shift + entropy)) * f)
        one_hot = g_lp * f
        if softcap is not None:
            cap_f = softcap * f
            one_hot = one_hot * (1.0 - (self.z_y / cap_f).square())
        d_hidden = (torch.zeros(self.rows, weight.shape[1], dtype=self.acc, device=weight.device)
                    if want_hidden else None)
        for i, v0, v1 in self._blocks():
            dz = self._view(self._pool[self.slot[i]], v0, v1)  # e, becoming dz
            if k1 is not None or softcap is not None:
                log_e = torch.log(dz, out=self._view(self._pool[self.spare], v0, v1))
                log_e.clamp_(min=_LOG_FLOOR)
            if softcap is not None:  # 1 - tanh^2, tanh = z / cap_f = (m_b + log e) / cap_f
                t = torch.add(log_e, self.block_max[i], out=self._view(self._cap, v0, v1))
                t.div_(cap_f).clamp_(-1.0, 1.0).square_().neg_().add_(1.0)
            if k1 is None:
                dz.mul_(k0[i])
            else:
                dz.mul_(log_e.mul_(k1[i]).add_(k0[i]))
            if softcap is not None:
                dz.mul_(t)
            add_one_hot_(dz, self.targets - v0, one_hot)  # the target's term
            if d_bias is not None:
                d_bias[v0:v1] += dz.sum(1)
            if self._low is not None:
                dz = self._view(self._low, v0, v1).copy_(dz)
            if d_hidden is not None:
                addmm_acc_(d_hidden, dz.t(), weight[v0:v1])
            if d_weight is not None:
                addmm_acc_(d_weight[v0:v1], dz, hidden, beta=weight_beta)
        return d_hidden
