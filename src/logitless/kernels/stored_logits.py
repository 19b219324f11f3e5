"""One chunk's logits, stored once in the input dtype, with Triton passes over them (CUDA).

The ``ChunkStore`` of ``fused_policy_loss`` when Triton is selected (``triton_selected``: CUDA
tensors, or ``LOGITLESS_BACKEND=triton`` under ``TRITON_INTERPRET=1``). Per chunk of ``rows``
tokens:

1. **Logits GEMM**: ``x = h @ W^T (+ b)``, ``[rows, V]`` row-major, one ``torch.mm`` /
   ``torch.addmm`` (cuBLAS, fp32 accumulation) written in the input dtype: bf16/fp16 tiles
   are rounded exactly as PyTorch's own ``hidden @ weight.T`` rounds them; fp32 stays fp32 and
   follows ``torch.get_float32_matmul_precision()``.
2. **Statistics pass**: ``linear_softmax.tile_stats_kernel`` over the whole stored row (one
   program a row, the vocabulary folded in fixed ``_BLOCK_V``-column steps): the logit
   transform in fp32, then the row's running max, sum of exponentials and entropy sum, and its
   target logit. ``softmax_partials.finish_logprobs`` gives ``lp``, ``H`` and ``lse``.
3. The objective runs on the chunk's ``(lp, H)`` in ``fused_policy_loss`` and hands back their
   gradients.
4. **dz pass**: ``linear_softmax.tile_grad_kernel`` turns the stored logits into ``dL/dx`` in
   place (the entropy term only when ``H`` receives a gradient; the soft-cap derivative from
   the stored ``x``), rounded once to the input dtype.
5. **Two GEMMs**: the chunk's hidden gradient ``dx @ W`` (fp32 accumulation in cuBLAS,
   written in the input dtype: one rounding, the one ``fused_policy_loss``'s hidden-gradient
   buffer would apply) and ``d_weight += dx^T @ h`` into the call's one fp32 weight-gradient
   accumulator (``addmm`` with an fp32 output). The bias gradient is ``dx``'s fp32 column sum.

Each pass is one launch that runs after the previous one on the stream: no atomics, and the
same inputs give the same bits.
"""

from __future__ import annotations

import torch

from logitless.kernels import linear_softmax as head
from logitless.kernels.softmax_partials import Partials, finish_logprobs, normaliser

__all__ = ["StoredLogitsTriton", "grad_meta", "stats_meta"]

# The partials' planes that start at -inf (the running max and the max before the target).


def stats_meta(dtype: torch.dtype, softcap: float | None, negative_scale: bool = False) -> dict:
    """The constexprs and warps of the statistics pass: ``lp``, ``H`` and ``lse`` only
    (``negative_scale``: ``logit_scale / temperature < 0``)."""
    return head.stats_meta(dtype, softcap, want_s2=False, want_sum_z=False,
                           negative_scale=negative_scale)


def grad_meta(dtype: torch.dtype, softcap: float | None, g_lp, g_entropy) -> dict:
    """The constexprs and warps of the dz pass: the terms of ``g_lp`` and ``g_entropy`` (each
    on when given)."""
    return head.grad_meta(dtype, softcap, g_lp, g_entropy, None, None, None)


class StoredLogitsTriton:
    """Buffers for chunks of up to ``max_rows`` tokens in the input dtype, reused by every
    chunk of a call (a ``ChunkStore`` of ``fused_policy_loss``)."""

    def __init__(self, vocab: int, max_rows: int, dtype: torch.dtype, device,
                 softcap: float | None):
        del softcap  # recomputed from the stored logits: no extra buffer
        self.vocab, self.dtype = vocab, dtype
        self.ld = head.row_stride(vocab)  # rows 16-element aligned: the passes' vector loads
        self._logits = torch.empty(max_rows * self.ld, dtype=dtype, device=device)
        self._state = torch.empty(8, max_rows, dtype=torch.float32, device=device)
        # The partials' starting values, made once: each chunk copies them in with one op (an
        # index by a Python list would copy that list to the device and wait for it).
        self._state_init = head.new_state(1, device)

    @staticmethod
    def bytes_per_row(vocab: int, dtype: torch.dtype, softcap: float | None,
                      hidden_size: int = 0) -> int:
        """Bytes one token row of a chunk holds: its stored logits in ``dtype`` (the row
        stride, a multiple of 16), and its
        gathered hidden row and hidden-gradient row (``hidden_size`` each), as
        the cost model (``tools/gpu_plan.py``) sizes the chunks."""
        del softcap
        return dtype.itemsize * (head.row_stride(vocab) + 2 * hidden_size)

    def forward(self, hidden, weight, bias, targets, *, temperature, softcap, logit_scale,
                reduce=None):
        """Store the logits of ``hidden [rows, D]``; return per-token fp32 ``(logprobs,
        entropy, lse)``. ``targets`` lie in ``[0, V)``; with ``reduce`` (a vocabulary slice's
        partials to the whole vocabulary's) they are local to this slice, outside ``[0, V)``
        when in another rank's."""
        rows = hidden.shape[0]
        self.rows, self.targets = rows, targets.contiguous()
        self.scalars = dict(softcap=1.0 if softcap is None else float(softcap),
                            z_scale=float(logit_scale) / float(temperature))
        self.softcap = softcap
        x = head.tile_rows(self._logits, rows, self.vocab, self.ld)
        if bias is None:
            torch.mm(hidden, weight.t(), out=x)
        else:
            torch.addmm(bias, hidden, weight.t(), out=x)
        state = self._state[:, :rows]
        state.copy_(self._state_init.expand(-1, rows))
        head.tile_stats_kernel[(rows,)](
            x, x.stride(0), self.targets, state, state.stride(0), self.vocab, 0,
            **self.scalars, **stats_meta(self.dtype, softcap, self.scalars["z_scale"] < 0))
        parts = Partials(*state)
        if reduce is not None:
            parts = reduce(parts)
        # The normaliser as the dz pass reads it (``softmax_partials.normaliser``), kept with
        # the logits it belongs to.
        self.top, self.log_l = normaliser(parts)  # rows of the state: contiguous
        return finish_logprobs(parts, self.log_l)

    def backward_(self, hidden, weight, entropy, g_lp, g_entropy, d_weight, d_bias,
                  want_hidden: bool, weight_beta: float = 1.0):
        """Turn the stored logits into ``dx = d loss / d x`` in place, add ``dx^T @ hidden``
        to the fp32 ``d_weight`` (``weight_beta=0``: overwrite it) and ``dx``'s column sum to
        ``d_bias`` (either may be None); return ``dx @ W`` in the input dtype when
        ``want_hidden``. ``g_lp``, ``g_entropy``: per-token upstream gradients (None: zero).
        ``p`` is recomputed from the normaliser in the two parts the forward kept (``top`` and
        ``log l``), exact at low temperatures where one ``lse`` is not."""
        rows = self.rows
        dx = self._logits[:rows * self.ld].view(rows, self.ld)[:, :self.vocab]  # padding: 0
        top = self.top
        entropy, g_lp, g_entropy = (None if t is None else t.float().contiguous()
                                    for t in (entropy, g_lp, g_entropy))
        meta = grad_meta(self.dtype, self.softcap, g_lp, g_entropy)
        # A pointer whose term is off is never read: top stands in for it.
        ptr = lambda t: top if t is None else t
        head.tile_grad_kernel[(rows,)](
            dx, dx.stride(0), self.targets, top, self.log_l, ptr(entropy), top, ptr(g_lp),
            ptr(g_entropy), top, top, top, rows, self.vocab, 0, **self.scalars,
            inv_vocab_total=1.0 / self.vocab, **meta)
        if d_bias is not None:
            d_bias += dx.sum(0, dtype=d_bias.dtype)
        if d_weight is not None:
            head.addmm_acc_(d_weight, dx.t(), hidden, beta=weight_beta)
        return torch.mm(dx, weight) if want_hidden else None
