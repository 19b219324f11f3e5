"""`fused_policy_loss`'s plan: whole sequences grouped into chunks within the memory budget,
and the store (`ChunkStore`) that keeps a dense chunk's logits between its statistics and its
gradient."""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Protocol

import torch

from logitless.fused_losses.backend import triton_selected
from logitless.fused_losses.fused import gpu_chunks
from logitless.kernels import sampler_torch, stored_logits_torch

if TYPE_CHECKING:
    from logitless.fused_losses.fused.validation import Call


CPU_MEMORY_BUDGET = 256 * 2**20


def default_budget(device: torch.device) -> int:
    """A fixed number of bytes per device type, never read off the allocator: on CUDA the one
    the cost model chooses (``gpu_chunks.CUDA_MEMORY_BUDGET``)."""
    if device.type == "cuda":
        return gpu_chunks.CUDA_MEMORY_BUDGET
    return CPU_MEMORY_BUDGET


def rows_cap(device: torch.device, budget: int, row_bytes: int, hidden_size: int) -> int:
    """The most loss rows a dense chunk holds: what the budget holds, and on CUDA the height
    below it whose hidden-gradient GEMM fills whole waves best (``gpu_chunks.wave_rows``)."""
    cap = max(1, budget // row_bytes)
    if device.type == "cuda":
        cap = gpu_chunks.wave_rows(cap, hidden_size)
    return cap


def plan_chunks(tokens_per_sequence: list[int], max_rows: int) -> list[tuple[int, int, bool]]:
    """Group consecutive sequences into chunks of at most ``max_rows`` loss tokens.

    Returns ``(first_sequence, end_sequence, streamed)`` triples; a sequence alone longer than
    the budget forms its own chunk, marked to be streamed. Between streamed sequences, the
    fewest chunks that fit are formed and then evened out: cut at the sequence boundaries
    nearest to equal shares (when those cuts fit), so that no chunk is left with a thin tail of
    rows (a thin GEMM is a slow one).
    """
    plan, run = [], []
    for i, n in enumerate(tokens_per_sequence):
        if n > max_rows:
            plan += _even_chunks(run, tokens_per_sequence, max_rows)
            plan.append((i, i + 1, True))
            run = []
        else:
            run.append(i)
    return plan + _even_chunks(run, tokens_per_sequence, max_rows)


def _greedy_chunks(first: int, sizes: list[int], max_rows: int) -> list[tuple[int, int]]:
    cuts, rows = [], 0
    for j, n in enumerate(sizes):
        if rows + n > max_rows and j > 0 and rows > 0:
            cuts.append(j)
            rows = 0
        rows += n
    bounds = [0, *cuts, len(sizes)]
    return [(first + a, first + b) for a, b in itertools.pairwise(bounds)]


def _even_chunks(run: list[int], sizes_all: list[int], max_rows: int):
    """Consecutive sequences ``run`` (each within the budget) as evened-out chunks."""
    if not run:
        return []
    first, sizes = run[0], [sizes_all[i] for i in run]
    greedy = _greedy_chunks(first, sizes, max_rows)
    k = len(greedy)
    cum = [0]
    for n in sizes:
        cum.append(cum[-1] + n)
    cuts, prev = [], 0
    for j in range(1, k):
        ideal = cum[-1] * j / k
        # the boundary nearest the ideal share, leaving a sequence for each later chunk
        best = min(range(prev + 1, len(sizes) - (k - j) + 1),
                   key=lambda c: abs(cum[c] - ideal))
        cuts.append(best)
        prev = best
    bounds = [0, *cuts, len(sizes)]
    if any(cum[b] - cum[a] > max_rows for a, b in itertools.pairwise(bounds)):
        chunks = greedy
    else:
        chunks = [(first + a, first + b) for a, b in itertools.pairwise(bounds)]
    return [(a, b, False) for a, b in chunks]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Sequences ``s0:s1``, their loss rows ``a:b`` (of the call's), the chunk's grid width."""

    s0: int
    s1: int
    a: int
    b: int
    width: int
    streamed: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    chunks: list[Chunk]
    dense_rows: int  # the largest dense chunk's rows: what the store holds


def make_plan(call: Call, memory_budget) -> Plan:
    """Chunks of whole sequences within the memory budget (`plan_chunks`). The only host
    synchronisation besides the checks: the loss tokens and lengths of the sequences."""
    m = call.batch.m
    if call.packed:
        lengths = call.cu_seqlens[1:] - call.cu_seqlens[:-1]
    else:
        lengths = torch.full((m.shape[0],), m.shape[1], device=m.device)
    per_seq, widths = torch.stack([m.sum(1), lengths.to(m.device)]).tolist()
    device = call.head.hidden.device
    budget = memory_budget if memory_budget is not None else default_budget(device)
    head = call.head
    # a vocab-parallel call plans by the largest slice: every rank the same chunks (and
    # collectives)
    vocab = head.vocab if call.shard is None else call.shard.largest
    row_bytes = store_type(device, head.dtype, call.truncation is not None).bytes_per_row(
        vocab, head.dtype, head.softcap, hidden_size=head.weight.shape[1])
    starts = list(itertools.accumulate(per_seq, initial=0))
    cap = rows_cap(device, budget, row_bytes, head.weight.shape[1])
    chunks = [Chunk(s0, s1, starts[s0], starts[s1], max(widths[s0:s1], default=0), streamed)
              for s0, s1, streamed in plan_chunks(per_seq, cap)]
    dense = max((c.b - c.a for c in chunks if not c.streamed), default=0)
    return Plan(chunks, dense)


class ChunkStore(Protocol):
    """Where a dense chunk's logits live between its forward statistics and its gradient.

    Two implementations, chosen by `store_type`: `stored_logits_torch.StoredLogits` (torch, any
    device: fp32 exponentials in vocabulary blocks) and `stored_logits.StoredLogitsTriton`
    (when Triton is selected, i.e. on CUDA: the logits once in the input dtype, Triton passes
    for the statistics and for ``dz``)."""

    @staticmethod
    def bytes_per_row(vocab: int, dtype: torch.dtype, softcap: float | None, *,
                      hidden_size: int) -> int:
        """Bytes one token row of a chunk needs (sizes the chunks within the budget);
        ``hidden_size`` is D, for a store that counts the chunk's hidden rows."""

    def forward(self, hidden, weight, bias, targets, *, temperature, softcap, logit_scale,
                reduce=None):
        """Keep the logits of ``hidden [rows, D]``; return per-token ``(logprobs, entropy,
        lse)`` (fp32; fp64 for fp64 inputs). ``targets`` lie in ``[0, V)``; with ``reduce``
        (a vocabulary slice's partials to the whole vocabulary's) they are local to the
        slice, outside ``[0, V)`` when in another rank's."""

    def backward_(self, hidden, weight, entropy, g_lp, g_entropy, d_weight, d_bias,
                  want_hidden: bool, weight_beta: float = 1.0):
        """Turn the kept logits into their gradient: add to ``d_weight`` (``weight_beta=0``:
        overwrite it) and ``d_bias`` (either may be None); return the hidden-gradient rows
        when ``want_hidden``."""


def store_type(device: torch.device, dtype: torch.dtype,
               truncated: bool = False) -> type[ChunkStore]:
    """The chunk store for tensors of ``device`` and compute ``dtype``: the Triton one where
    `triton_selected` picks Triton (CUDA; ``LOGITLESS_BACKEND=triton`` under the
    interpreter), else the torch one (CPU, fp64). ``truncated`` (a sampler truncation or
    recorded kept sets, which the Triton store lacks: such calls stream there):
    `sampler_torch.StoredSampled`."""
    if truncated:
        return sampler_torch.StoredSampled
    if triton_selected(device, dtype):
        from logitless.kernels import stored_logits  # imports triton

        return stored_logits.StoredLogitsTriton
    return stored_logits_torch.StoredLogits


def new_store(vocab, max_rows, dtype, device, softcap,
              truncated: bool = False) -> ChunkStore | None:
    """A store for chunks of up to ``max_rows`` rows (None when no chunk is dense)."""
    if not max_rows:
        return None
    return store_type(device, dtype, truncated)(vocab, max_rows, dtype, device, softcap)
