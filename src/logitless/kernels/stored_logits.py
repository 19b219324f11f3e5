"""One chunk's logits, computed once and turned into the logit gradient in place (torch).

The sequence-aligned chunks of ``fused_policy_loss`` hold a chunk's whole ``[rows, V]`` logits
between the forward statistics and the gradient, so the head is multiplied three times in all
(logits, hidden gradient, weight gradient) instead of four. This module is that buffer.

Layout: **vocab-major**, ``[V, rows]``. A chunk has a few hundred rows, so every GEMM has one
thin side. With the vocabulary as the GEMMs' long dimension (``W_b @ h^T``, ``dz_b^T @ W_b``,
``dz_b @ h``) each one runs at the speed of the full-batch GEMM on CPU BLAS, while
``h @ W^T`` with 128 to 384 rows runs 15 to 50% slower (MKL, 2 cores). Slices of vocabulary
rows are contiguous, so the work goes block by block: a block of ``VOCAB_BLOCK`` vocabulary
rows is written by its GEMM and reduced to partial statistics while it is still in cache, and
in the backward it becomes ``dz`` and feeds its two GEMMs in one visit.

Storage: the buffer keeps ``z - m_b`` (the logits minus the block's per-token maximum ``m_b``),
which the partial ``a = sum e (z - m_b)`` needs anyway; the block maxima are kept per token, so
``z - lse = (z - m_b) + (m_b - lse)`` in the backward. Beside the buffer: one block of scratch
for the exponentials, one more when soft-capping (``1 - tanh^2``, recomputed from the stored
logit rather than stored), and one block in the input dtype for bf16/fp16 GEMMs.
"""

from __future__ import annotations

import torch

from logitless.kernels.linear_softmax_torch import acc_dtype, addmm_acc_
from logitless.kernels.softmax_partials import Partials, finish, merge

# Vocabulary rows per block: 4096 x 384 tokens x 4 bytes is 6 MB, within the last-level cache.
VOCAB_BLOCK = 4096


def bytes_per_row(vocab: int, dtype: torch.dtype, softcap: float | None,
                  block: int | None = None) -> int:
    """Bytes one token row of a chunk needs: its ``vocab`` logits and its share of the scratch
    blocks (exponentials; ``1 - tanh^2`` when soft-capping; a low-precision copy for the GEMMs
    when the inputs are bf16/fp16)."""
    block = min(vocab, block or VOCAB_BLOCK)
    acc = torch.finfo(acc_dtype(dtype)).bits // 8
    scratch = block * acc * (2 if softcap is not None else 1)
    if acc_dtype(dtype) != dtype:
        scratch += block * (torch.finfo(dtype).bits // 8)
    return vocab * acc + scratch


class StoredLogits:
    """Buffers for chunks of up to ``max_rows`` tokens, reused by every chunk of a call."""

    def __init__(self, vocab: int, max_rows: int, dtype: torch.dtype, device,
                 softcap: float | None, block: int | None = None):
        self.vocab, self.dtype = vocab, dtype
        self.block = min(vocab, block or VOCAB_BLOCK)
        self.acc = acc_dtype(dtype)
        self._z = torch.empty(vocab * max_rows, dtype=self.acc, device=device)
        self._p = torch.empty(self.block * max_rows, dtype=self.acc, device=device)
        self._cap = (torch.empty_like(self._p) if softcap is not None else None)
        self._low = (torch.empty(self.block * max_rows, dtype=dtype, device=device)
                     if self.acc != dtype else None)

    def _blocks(self):
        for v0 in range(0, self.vocab, self.block):
            yield v0, min(v0 + self.block, self.vocab)

    def _scratch(self, buf, v0, v1, rows):
        return buf[:(v1 - v0) * rows].view(v1 - v0, rows)

    def forward(self, hidden, weight, bias, targets, *, temperature, softcap, logit_scale):
        """Compute and keep the logits of ``hidden [rows, D]``; return per-token ``logprobs``,
        ``entropy`` and ``lse`` (fp32; fp64 for fp64 inputs)."""
        rows = hidden.shape[0]
        self.rows, self.head = rows, (temperature, softcap, logit_scale)
        self.z = self._z[:self.vocab * rows].view(self.vocab, rows)
        h_t = hidden.t()
        factor = logit_scale / temperature
        maxima, sums, a_parts = [], [], []
        for v0, v1 in self._blocks():
            zb = self.z[v0:v1]
            b = None if bias is None else bias[v0:v1].unsqueeze(1)
            out = zb if self._low is None else self._scratch(self._low, v0, v1, rows)
            if b is None:
                torch.mm(weight[v0:v1], h_t, out=out)
            else:
                torch.addmm(b, weight[v0:v1], h_t, out=out)
            if self._low is not None:
                zb.copy_(out)
            if softcap is not None:
                torch.tanh(zb.div_(softcap), out=zb).mul_(softcap * factor)
            elif factor != 1.0:
                zb.mul_(factor)
            m = zb.amax(0)
            zb.sub_(m)
            e = torch.exp(zb, out=self._scratch(self._p, v0, v1, rows))
            maxima.append(m)
            sums.append(e.sum(0))
            a_parts.append(e.mul_(zb).sum(0))  # in the scratch: no block-sized temporary
        self.block_max = torch.stack(maxima)
        cols = torch.arange(rows, device=hidden.device)
        z_y = self.z[targets, cols] + self.block_max[targets // self.block, cols]
        zeros = torch.zeros_like(self.block_max)
        parts = merge(Partials(self.block_max, torch.stack(sums), torch.stack(a_parts), zeros,
                               zeros, zeros))
        stats = finish(parts._replace(z_y=z_y), self.vocab)
        self.targets = targets
        return stats["logprobs"], stats["entropy"], stats["lse"]

    def backward_(self, hidden, weight, lse, entropy, g_lp, g_entropy, d_weight, d_bias,
                  want_hidden: bool, weight_beta: float = 1.0):
        """Turn the stored logits into ``d loss / d x`` (``x`` the untransformed logits) block by
        block, add ``dx @ hidden`` to ``d_weight`` (``weight_beta=0``: overwrite it) and ``dx``
        summed to ``d_bias`` (either may be None), and return ``dx^T W`` when ``want_hidden``
        (fp32; fp64 for fp64 inputs).

        ``g_lp``, ``g_entropy``: per-token upstream gradients (None: zero). With
        ``p = exp((z - m_b) + (m_b - lse))``:
        ``dz = p * (-g_lp - g_H (log p + H)) + g_lp 1[j = y]``, times ``scale / T`` and, when
        soft-capping, ``1 - tanh^2``.
        """
        temperature, softcap, logit_scale = self.head
        rows = self.rows
        factor = logit_scale / temperature
        shift = self.block_max - lse  # [blocks, rows]: log p = stored + shift
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        if g_entropy is None:
            alpha, beta = None, -g_lp * factor
            beta = beta.expand_as(shift)
        else:
            g_entropy = g_entropy.to(lse.dtype)
            alpha = -g_entropy * factor
            beta = (-g_lp - g_entropy * (shift + entropy)) * factor
        one_hot = g_lp * factor
        target_block = self.targets // self.block
        d_hidden = (torch.zeros(rows, weight.shape[1], dtype=self.acc, device=weight.device)
                    if want_hidden else None)
        cap_scale = None if softcap is None else softcap * factor
        for i, (v0, v1) in enumerate(self._blocks()):
            s = self.z[v0:v1]
            if softcap is not None:  # 1 - tanh^2 from the stored logit z = m_b + s
                t = torch.add(s, self.block_max[i], out=self._scratch(self._cap, v0, v1, rows))
                t.div_(cap_scale).square_().neg_().add_(1.0)
            p = torch.add(s, shift[i], out=self._scratch(self._p, v0, v1, rows)).exp_()
            if alpha is None:
                dz = torch.mul(p, beta[i], out=s)
            else:
                dz = s.mul_(alpha).add_(beta[i]).mul_(p)
            # += g_lp at each token's target (no host read: the others add 0 at a clamped row)
            here = target_block == i
            index = torch.where(here, self.targets - v0, 0).unsqueeze(0)
            dz.scatter_add_(0, index, torch.where(here, one_hot, 0.0).unsqueeze(0))
            if softcap is not None:
                dz.mul_(t)
            if d_bias is not None:
                d_bias[v0:v1] += dz.sum(1)
            if self._low is not None:
                dz = self._scratch(self._low, v0, v1, rows).copy_(dz)
            if d_hidden is not None:
                addmm_acc_(d_hidden, dz.t(), weight[v0:v1])
            if d_weight is not None:
                addmm_acc_(d_weight[v0:v1], dz, hidden, beta=weight_beta)
        return d_hidden
