"""Chunked PyTorch path of the sampler-matched logprobs (top-k, top-p, min-p, per-token
temperature as vLLM applies them; the semantics are in ``logitless.reference.sampler``).

**Forward.** Rows go through in chunks of ``R`` whole-vocabulary rows, ``R`` from the byte
budget and the vocabulary only (never from the number of tokens, so a token's results do not
depend on its batch). A chunk's logits ``z`` are held vocabulary-major, ``[V, R]`` in the
accumulation dtype, written slice by slice by ``[cols, D] x [D, R]`` GEMMs; every pass over
them then walks the same ``cols``-row slices, so its temporaries (keys, masks, weights, tie
ranks) are ``[cols, R]``, never ``[V, R]``. Peak extra memory: ``R V`` logits plus one slice's
temporaries, within ``tile_bytes``. Per chunk, each step a pass or a few over the slices:

1. the row maximum ``m``;
2. min-p: candidates ``z >= m + log(min_p)`` (``min_p = 0``: ``log 0 = -inf``, all);
3. top-k: the ``k``-th largest candidate by a radix select over the **ordered integer keys**
   of the logits (the float's bit pattern, negatives flipped, so integer order is float
   order): the largest key ``t`` with ``#{key >= t} >= k``, found 11 bits at a time from the
   top with a per-row 2048-bin histogram of the keys sharing the digits chosen so far (3
   passes for fp32 keys, 6 for fp64); the count strictly above ``t`` falls out of the last
   pass; the ``k - #{key > t}`` tokens tied at ``t`` with the lowest vocabulary ids are kept
   (their ranks are running counts carried from slice to slice, slices in id order);
4. top-p: the same select with each candidate weighted by ``exp(z - m)`` in fp64, the target
   ``p L`` from the first pass's total ``L``: the largest key ``t`` whose candidates at or
   above it hold at least ``p`` of the candidates' mass; the ``ceil((p L - G) / e_t)`` tokens
   tied at ``t`` with the lowest ids are kept (``G``: the mass strictly above ``t``, from the
   last pass; ``e_t``: a tied token's weight, from ``t``). Rows with ``p = 1`` are left
   alone;
5. the kept set is now a prefix of the vocabulary ordered by (logit descending, id
   ascending): it is stored as two numbers per row, the key ``t`` of its smallest logit and how
   many of the tokens at ``t`` it holds (lowest ids first); the backward rebuilds it from them;
6. ``log q_y``, the kept distribution's entropy and ``log_kept_mass`` (one pass, with 5).

**Engines** (``RowParams.engine``; the rules in ``logitless.reference.sampler``, and as both
paths read them, the table of :func:`engine_rules`). Steps 2-4 are vLLM's. The other engines
change three things, and their kept sets stay prefixes of the same order, so step 5's two
numbers and the backward serve every engine unchanged:

- ``"transformers"``: top-k keeps every token tied at the ``k``-th value (its cut's tie
  count is "all"); min-p is applied last, to the top-p survivors, so the passes of steps 3-4
  run without it and only step 6's pass applies it.
- ``"sglang"``: both top-k and top-p keep every tied token (FlashInfer's thresholds compare
  with "strictly larger"); a row without min-p searches its top-p key over the whole row, not
  over the top-k survivors (the joint filter; the kept set is then the intersection of the
  two cuts); a row with min-p filters sequentially, with min-p last as for transformers.

**Backward**, vocabulary-outer as the Triton path's: per ``cols``-column slice of the head,
per ``R``-row block, the forward's GEMM (the same shapes and operands, so the same bits, so
the same kept set) gives the slice's logits; with ``q`` (the kept distribution, 0 outside it)
and ``p`` (the full softmax)
``dz = g_lp (1[j=y] - q) - g_H q (log q + H) + g_kept (q - p) + g_lse p``,
then the transform's derivative, ``d_hidden[block] += dz^T W_slice`` and ``d_weight[slice]
+= dz h_block``, accumulating in fp32 (fp64 for fp64 inputs). A weight slice and its
gradient stay in cache while every row block uses them, where a row-outer loop would stream
the whole head and its gradient once per chunk. ``g_lp`` must already be 0 on rows whose
target is outside the kept set (their logprob is ``-inf`` and carries no gradient;
``fused_losses/head/sampled.py`` passes it so to both paths).

**A vocabulary sharded over ranks** (``vocab_parallel``): ``forward`` takes a
:class:`Reduction`, the hook through which every pass combines the ranks' partial results
(the default, :data:`LOCAL`, is the identity: one process holds the whole vocabulary). Each
rank holds a contiguous slice of the head, slices in id order by rank, and runs the same
passes over its slice: the row maximum is all-reduced (max); each radix pass's histogram is
all-reduced (sum), so every rank chooses the same digits, the same ``t`` and the same count
(or mass) above it; a cut's tie count ``c`` (how many of the tokens at ``t`` are kept, lowest
ids first) is then made the rank's own, ``c`` minus the ties on the lower ranks (an exclusive
prefix sum over ranks of each rank's ties at ``t``), so the rank's kept tokens at ``t`` are
again the first ``c`` of its slice; the sums of step 6 are all-reduced, the key of the kept set
is the smallest over ranks, and the stored count is the rank's own kept tokens at that key. The
kept set and the results are those of one process on the whole head; the backward needs no
communication (the caller sums the hidden gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from logitless.kernels import constants
from logitless.kernels.linear_softmax_torch import (
    DEFAULT_TILE_BYTES,
    acc_dtype,
    addmm_acc_,
    head_slice,
    logits_into,
    pad_rows,
    row_blocks,
    through_transform_,
)

__all__ = ["ENGINES", "LOCAL", "EngineRules", "Reduction", "RowParams", "backward",
           "engine_rules", "forward", "rows_per_chunk", "select"]


@dataclass(frozen=True)
class EngineRules:
    """What an engine's filtering changes of vLLM's (module doc, "Engines"); the one table
    both paths read (the Triton passes in ``kernels/sampler.py`` too)."""

    min_p_first: bool  # min-p selects top-k's and top-p's candidates (else it is applied last)
    top_k_ties: bool  # top-k keeps every token tied at the k-th value
    top_p_ties: bool  # top-p keeps every token tied at its cut
    joint_top_p: bool  # a row without min-p searches top-p over the whole row (FlashInfer's)


# The engines whose filtering rules the selection follows, and their rules.
_RULES = {
    "vllm": EngineRules(min_p_first=True, top_k_ties=False, top_p_ties=False,
                        joint_top_p=False),
    "sglang": EngineRules(min_p_first=False, top_k_ties=True, top_p_ties=True,
                          joint_top_p=True),
    "transformers": EngineRules(min_p_first=False, top_k_ties=True, top_p_ties=False,
                                joint_top_p=False),
}
ENGINES = tuple(_RULES)


def engine_rules(engine: str) -> EngineRules:
    """The rules of ``engine`` (one of :data:`ENGINES`, else ``ValueError``)."""
    if engine not in _RULES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return _RULES[engine]

# Vocabulary columns per slice: per GEMM of a chunk's logits and per step of every pass.
_COLS = 1024
# Most rows per chunk: the Triton sampler's (kernels/constants.py).
_MAX_ROWS = constants.SAMPLER_ROWS
# Bits of the key the radix select settles per pass: 3 passes for fp32 keys (6 for fp64),
# with a 2048-bin histogram per row.
_DIGIT_BITS = 11


@dataclass
class RowParams:
    """Per-row sampler settings, each ``[N]`` (None: off). ``temperature`` and ``min_p`` in the
    accumulation dtype, ``top_p`` fp64, ``top_k`` int64 (values above ``V`` mean all).
    ``engine``: whose rules (``ENGINES``; module doc, "Engines")."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    engine: str = "vllm"

    def rows(self, sl: slice, padded: int) -> RowParams:
        """The settings of rows ``sl``, padded with no-op values up to ``padded`` rows."""
        def cut(x, fill):
            return None if x is None else pad_rows(x[sl], padded, fill)
        return RowParams(cut(self.temperature, 1.0), cut(self.top_k, 2**62),
                         cut(self.top_p, 1.0), cut(self.min_p, 0.0), self.engine)


class Reduction:
    """How the passes combine partial per-row results over the slices of a sharded vocabulary
    (module doc, last part). This base class is one process holding the whole vocabulary:
    every method is the identity (and ``before`` is 0). A subclass for a process group
    (``fused_losses/head/shards.py``) all-reduces; every rank calls the methods in the same
    order with tensors of the same shapes."""

    sharded = False

    def vocab(self, v_local: int) -> int:
        """The whole vocabulary's size, from this rank's slice's."""
        return v_local

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def min(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def before(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks whose slices come before this one's."""
        return torch.zeros_like(x)


LOCAL = Reduction()


def _slice_bytes(dtype: torch.dtype, softcap: float | None) -> int:
    """Bytes per element of one slice's temporaries at their peak: the keys and their shifted
    copies, fp64 weights, histogram indices (int64), masks and tie ranks, the GEMM's output in
    the input dtype, and ``tanh`` when soft-capping."""
    acc = acc_dtype(dtype).itemsize
    return 4 * acc + 40 + dtype.itemsize + (acc if softcap is not None else 0)


def rows_per_chunk(v: int, tile_bytes: int, dtype: torch.dtype, softcap: float | None) -> int:
    """Rows per chunk so that a chunk's ``[V, R]`` logits in the accumulation dtype and one
    slice's temporaries fit in ``tile_bytes``. From the vocabulary, the budget and the dtype
    only."""
    per_row = v * acc_dtype(dtype).itemsize + min(v, _COLS) * _slice_bytes(dtype, softcap)
    return max(1, min(_MAX_ROWS, tile_bytes // per_row))


class _Buffers:
    """One slice's GEMM scratch: the output in the input dtype when that is not the
    accumulation dtype, and ``tanh`` when soft-capping (flat, viewed per slice)."""

    def __init__(self, rows, cols, dtype, device, softcap):
        acc = acc_dtype(dtype)
        self.low = torch.empty(rows * cols, dtype=dtype, device=device) if acc != dtype \
            else None
        self.cap = torch.empty(rows * cols, dtype=acc, device=device) if softcap is not None \
            else None

    def logits(self, x, h, w, b, softcap, logit_scale):
        """Write the slice's logits ``[cols, R]`` into ``x``; ``tanh`` (a view) or None. The
        GEMM's output goes through ``low`` when ``h`` has the input dtype, straight into ``x``
        when it has ``x``'s."""
        def view(buf):
            return None if buf is None else buf[:x.numel()].view(x.shape)
        low = None if h.dtype == x.dtype else view(self.low)
        return logits_into(x, low, view(self.cap), h, w, b, 1.0, softcap, logit_scale,
                           vocab_major=True)


def ordered_keys(z: torch.Tensor) -> torch.Tensor:
    """Integers ordered as the floats ``z`` are (``-0.0`` taken as ``+0.0``): the bit
    pattern, with every bit but the sign flipped on negatives (shift, mask and xor: on CPU a
    ``torch.where`` costs several times as much)."""
    return _flip_negatives((z + 0.0).view(_key_dtype(z.dtype)))


def key_floats(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The floats of ``dtype`` whose ordered keys are ``keys`` (``ordered_keys``' inverse:
    the flip is its own inverse)."""
    return _flip_negatives(keys).view(dtype)


def _flip_negatives(bits: torch.Tensor) -> torch.Tensor:
    """``bits`` with every bit but the sign flipped where the sign bit is set."""
    last = torch.iinfo(bits.dtype).bits - 1
    return bits ^ ((bits >> last) & ((1 << last) - 1))


def _prefix_slice(keys, t, c, seen):
    """Of one vocab-major slice ``[cols, R]``: the tokens with key above ``t`` and those with
    key ``t`` among the first ``c`` (lowest ids) of the row, ``seen`` of which came in earlier
    slices. Returns the mask and the new ``seen``."""
    at = keys == t
    rank = at.cumsum(0, dtype=torch.int32).add_(seen)
    kept = (keys > t) | (at & (rank <= c))
    return kept, rank[-1] if rank.shape[0] else seen


class _Selection:
    """The kept set of one chunk's tempered logits ``z`` (``[V, R]``, vocab-major), found by
    passes over ``cols``-row slices (module doc, steps 1-4, and "Engines")."""

    def __init__(self, z: torch.Tensor, params: RowParams, cols: int,
                 reduce: Reduction = LOCAL):
        rules = engine_rules(params.engine)
        self.z, self.cols, self.reduce = z, cols, reduce
        self.m = reduce.max(z.amax(0))
        self.floor = None if params.min_p is None else self.m + torch.log(params.min_p)
        # vLLM's min-p selects the candidates; the others apply it last
        self.floor_first = rules.min_p_first
        v = reduce.vocab(z.shape[0])
        all_ties = v + 1  # a tie count no row reaches: every tied token kept
        self.cuts = []  # (t, c) of top-k then top-p, each [R] (c int32, at most V + 1)
        if params.top_k is not None:
            t, above = self._largest_key(params.top_k, weighted=False)
            c = (params.top_k - above).clamp(0, v + 1).int()
            # every tie kept: no count to share out between the ranks
            c = torch.full_like(c, all_ties) if rules.top_k_ties else self._own_ties(t, c)
            self.cuts.append((t, c))
        if params.top_p is not None:
            p = params.top_p.double()
            top_k_cuts = self.cuts
            if rules.joint_top_p and self.cuts:
                # rows without min-p: top-p on the whole row (FlashInfer's joint filter)
                t_k, c_k = self.cuts[0]
                joint = torch.ones_like(p, dtype=torch.bool) if params.min_p is None \
                    else params.min_p <= 0
                self.cuts = [(torch.where(joint, torch.iinfo(t_k.dtype).min, t_k), c_k)]
            t, g, target = self._largest_key(p, weighted=True)
            self.cuts = top_k_cuts
            if rules.top_p_ties:
                c = torch.full_like(t, all_ties, dtype=torch.int32)
            else:
                e_t = self._weight(key_floats(t, z.dtype))
                big = float(v + 1)  # a tied weight underflowing to 0: keep every tie
                c = torch.ceil((target - g) / e_t).clamp(1, big).nan_to_num(nan=big).int()
            # rows with p = 1 keep every candidate: a cut no token reaches
            t = torch.where(p < 1, t, torch.iinfo(t.dtype).min)
            c = torch.where(p < 1, c, v + 1)
            self.cuts.append((t, c if rules.top_p_ties else self._own_ties(t, c)))

    def _own_ties(self, t, c):
        """A cut's tie count ``c`` made this rank's own: minus the tokens at ``t`` on the lower
        ranks' slices (unchanged on one process; a pass over the slice otherwise)."""
        if not self.reduce.sharded:
            return c
        ties = torch.zeros_like(c)
        for c0 in range(0, self.z.shape[0], self.cols):
            ties += (ordered_keys(self.z[c0:c0 + self.cols]) == t).sum(0, dtype=c.dtype)
        return (c - self.reduce.before(ties)).clamp(min=0)

    def _weight(self, zs):
        return torch.exp(zs - self.m).double()

    def slices(self, final: bool = False):
        """``(c0, z slice, keys, candidates)`` of every slice in id order, with min-p and the
        cuts found so far applied (candidates None: all); min-p only in the ``final`` pass
        where the engine applies it last."""
        seen = [torch.zeros(self.z.shape[1], dtype=torch.int32, device=self.z.device)
                for _ in self.cuts]
        floor = self.floor if final or self.floor_first else None
        for c0 in range(0, self.z.shape[0], self.cols):
            zs = self.z[c0:c0 + self.cols]
            keys = ordered_keys(zs)
            cand = None if floor is None else zs >= floor
            for i, (t, c) in enumerate(self.cuts):
                cut, seen[i] = _prefix_slice(keys, t, c, seen[i])
                cand = cut if cand is None else cand & cut
            yield c0, zs, keys, cand

    def _largest_key(self, target, weighted: bool):
        """Per row, the largest key ``t`` with ``sum(w[candidates, key >= t]) >= target``
        (``w``: ``exp(z - m)`` in fp64 when ``weighted``, else 1); ``target`` is a count, or
        for ``weighted`` the fraction of the candidates' total. Radix select, ``_DIGIT_BITS``
        bits a pass from the top: a per-row histogram of the next digit of the candidates
        whose higher digits are those chosen so far; the chosen digit is the largest whose bins
        from it upward, plus what already lies above, reach the target. Returns ``t``, the
        weight strictly above ``t``, and the target (``weighted``: the absolute one)."""
        z = self.z
        rows, dev = z.shape[1], z.device
        kd = _key_dtype(z.dtype)
        bits, sign = torch.iinfo(kd).bits, torch.iinfo(kd).min
        wd = torch.float64 if weighted else torch.int64
        prefix = torch.zeros(rows, dtype=kd, device=dev)
        above = torch.zeros(rows, dtype=wd, device=dev)
        nbins = 1 << _DIGIT_BITS
        offset = torch.arange(rows, device=dev) * nbins
        for shift in range(bits - _DIGIT_BITS, -_DIGIT_BITS, -_DIGIT_BITS):
            width = _DIGIT_BITS + min(shift, 0)  # the last digit may be narrower
            shift = max(shift, 0)
            high = shift + width  # bits above this digit: chosen already
            hist = torch.zeros(rows * nbins, dtype=wd, device=dev)
            # the chosen digits as a signed key's high bits (as ``keys >> high`` has them)
            chosen_high = (prefix ^ sign) >> high if high < bits else None
            for _, zs, keys, cand in self.slices():
                # the digit of the unsigned order (sign bit flipped): below the top digit the
                # signed key's bits are the same
                digit = (keys >> shift) & ((1 << width) - 1)
                if high == bits:
                    digit ^= 1 << (width - 1)
                idx = digit.long() + offset
                ok = cand
                if chosen_high is not None:
                    match = (keys >> high) == chosen_high
                    ok = match if ok is None else ok & match
                # weights, 0 off the candidates (products: cheaper than torch.where on CPU)
                if weighted:
                    w = self._weight(zs)
                    if ok is not None:
                        w *= ok
                else:
                    w = torch.ones_like(idx) if ok is None else ok.long()
                hist.scatter_add_(0, idx.reshape(-1), w.reshape(-1))
            hist = self.reduce.sum(hist).view(rows, nbins)[:, :1 << width]
            if weighted and high == bits:
                target = target * hist.sum(1)  # the candidates' total mass
            # weight at or above each digit: suffix sums, plus what lies above the prefix
            upward = hist.flip(1).cumsum(1).flip(1) + above.unsqueeze(1)
            reach = upward >= target.unsqueeze(1)
            # the largest digit that reaches (0 when none does: only when it is the answer)
            top = (1 << width) - 1
            chosen = torch.where(reach, torch.arange(top + 1, device=dev), 0).amax(1)
            nxt = (chosen + 1).clamp(max=top)
            above = torch.where(chosen < top, upward.gather(1, nxt.unsqueeze(1)).squeeze(1),
                                above)
            prefix = prefix | (chosen.to(kd) << shift)
        t = prefix ^ sign
        return (t, above, target) if weighted else (t, above)


def _chunk_stats(sel: _Selection, targets):
    """Steps 5 and 6 in one pass: per row ``(logprobs, entropy, log_kept_mass, lse, m,
    log_kept, key, count)`` (``m``: the row maximum, ``log_kept``: ``log sum_K exp(z -
    m)``). ``targets`` are ids in the slice (outside ``[0, V_slice)``: on another rank's);
    ``count`` is the slice's own kept tokens at ``key``."""
    z, m = sel.z, sel.m
    rows = z.shape[1]
    cols = torch.arange(rows, device=z.device)
    l_full = torch.zeros_like(m)
    l_kept = torch.zeros_like(m)
    s_kept = torch.zeros_like(m)
    y_kept = torch.zeros(rows, dtype=torch.bool, device=z.device)
    kd = _key_dtype(z.dtype)
    top = torch.iinfo(kd).max
    key = torch.full((rows,), top, dtype=kd, device=z.device)
    count = torch.zeros(rows, dtype=torch.int64, device=z.device)
    for c0, zs, keys, kept in sel.slices(final=True):
        zm = zs - m
        e = torch.exp(zm)
        l_full += e.sum(0)
        if kept is not None:
            e *= kept
        l_kept += e.sum(0)
        s_kept += (e * zm).sum(0)
        local = targets - c0
        here = (local >= 0) & (local < zs.shape[0])
        if kept is None:
            y_kept |= here
        else:
            y_kept |= here & kept[local.clamp(0, zs.shape[0] - 1), cols]
        smallest = keys if kept is None else torch.where(kept, keys, top)
        k_s = smallest.amin(0)
        n_s = torch.where(k_s < top, (smallest == k_s).sum(0), 0)
        count = torch.where(k_s < key, n_s, torch.where(k_s == key, count + n_s, count))
        key = torch.minimum(key, k_s)
    here = (targets >= 0) & (targets < z.shape[0])
    z_y = torch.where(here, z[targets.clamp(0, z.shape[0] - 1), cols], 0.0)
    if sel.reduce.sharded:
        sums = sel.reduce.sum(torch.stack([l_full, l_kept, s_kept, z_y, y_kept.to(z.dtype)]))
        l_full, l_kept, s_kept, z_y, y_kept = *sums[:4], sums[4] > 0
        total = sel.reduce.min(key)
        count = torch.where(key == total, count, 0)
        key = total
    log_kept = torch.log(l_kept)
    log_full = torch.log(l_full)
    entropy = log_kept - s_kept / l_kept
    # relative to m: no rounding of a number of m's size (``m + log l``) in log q or the mass
    lp = torch.where(y_kept, (z_y - m) - log_kept, -math.inf)
    return lp, entropy, log_kept - log_full, m + log_full, m, log_kept, key.long(), count


def select(z: torch.Tensor, targets: torch.Tensor, params: RowParams):
    """The kept set (bool ``[R, V]``) and the per-row results ``(logprobs, entropy,
    log_kept_mass, lse, m, log_kept, key, count)`` of tempered logits ``z`` ``[R, V]`` (row-major,
    as a reference would hold them), by the chunk algorithm above."""
    sel = _Selection(z.t().contiguous(), params, min(z.shape[1], _COLS))
    kept = torch.cat([torch.ones_like(zs, dtype=torch.bool) if c is None else c
                      for _, zs, _, c in sel.slices(final=True)]).t()
    return kept, _chunk_stats(sel, targets)


def forward(hidden, weight, bias, targets, params: RowParams, *, softcap, logit_scale,
            tile_bytes: int = DEFAULT_TILE_BYTES, reduce: Reduction = LOCAL):
    """Sampler-matched statistics of ``z = logit_scale * softcap(hidden W^T + b) / T_row``.

    hidden ``[N, D]`` in the compute dtype, weight ``[V, D]`` and bias in any float dtype,
    targets int64 ``[N]`` in ``[0, V)``. Returns ``(logprobs, entropy, log_kept_mass, lse, m,
    log_kept, key, count)``, each ``[N]``: ``m`` is the row maximum of ``z`` and ``log_kept``
    is ``log sum_K exp(z - m)`` (the kept set's normaliser relative to ``m``, what the backward
    takes); the last two describe the kept set (step 5).
    ``reduce``: with a sharded vocabulary, weight and bias are this rank's slice, targets are
    ids in it (outside ``[0, V_slice)`` on other ranks) and ``count`` is the slice's own (what
    ``backward`` on the slice takes); see the module doc."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    dev = hidden.device
    outs = [torch.empty(n, dtype=acc, device=dev) for _ in range(6)]
    outs += [torch.empty(n, dtype=torch.int64, device=dev) for _ in range(2)]
    if n == 0:
        return tuple(outs)
    # from the whole vocabulary: every rank runs the same chunks (and collectives)
    rows = rows_per_chunk(reduce.vocab(v), tile_bytes, hidden.dtype, softcap)
    cols = min(v, _COLS)
    zbuf = torch.empty(v * rows, dtype=acc, device=dev)
    bufs = _Buffers(rows, cols, hidden.dtype, dev, softcap)
    for r0, real, padded in row_blocks(n, rows):
        sl = slice(r0, r0 + real)
        h = pad_rows(hidden[sl], padded).contiguous()
        p = params.rows(sl, padded)
        z = zbuf[:v * padded].view(v, padded)
        for c0 in range(0, v, cols):
            w, b = head_slice(weight, bias, c0, cols, hidden.dtype)
            bufs.logits(z[c0:c0 + w.shape[0]], h, w, b, softcap, logit_scale)
        z /= p.temperature
        stats = _chunk_stats(_Selection(z, p, cols, reduce), pad_rows(targets[sl], padded, 0))
        for out, x in zip(outs, stats):
            out[sl] = x[:real]
    # A row with a NaN or inf logit has no distribution: its logprob is NaN (as the plain
    # path's, and the Triton sampler's), not the -inf that means "outside the kept set".
    outs[0] = torch.where(torch.isfinite(outs[3]), outs[0], torch.nan)
    return tuple(outs)


def backward(hidden, weight, bias, targets, params: RowParams, key, count, m, log_kept,
             log_kept_mass, entropy, g_lp, g_entropy, g_kept, g_lse, *, softcap, logit_scale,
             need_hidden, need_weight, need_bias, tile_bytes: int = DEFAULT_TILE_BYTES):
    """Gradients of hidden, weight and bias (fp32; fp64 for fp64 inputs) from the per-row
    upstream gradients (``[N]`` or None; ``g_lp`` 0 where the target is outside the kept
    set) and the forward's ``m``, ``log_kept`` and ``log_kept_mass``; see the module doc."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    dev = hidden.device
    d_hidden = hidden.new_zeros(hidden.shape, dtype=acc) if need_hidden else None
    d_weight = weight.new_zeros(weight.shape, dtype=acc) if need_weight else None
    d_bias = weight.new_zeros(v, dtype=acc) if need_bias else None
    if not (need_hidden or need_weight or need_bias) or n == 0:
        return d_hidden, d_weight, d_bias
    rows = rows_per_chunk(v, tile_bytes, hidden.dtype, softcap)
    cols = min(v, _COLS)
    blocks = []
    for r0, real, padded in row_blocks(n, rows):
        sl = slice(r0, r0 + real)
        per_row = [None if g is None else pad_rows(g[sl], padded)
                   for g in (targets, key.to(_key_dtype(acc)), m, log_kept,
                             log_kept - log_kept_mass, entropy, g_lp, g_entropy, g_kept,
                             g_lse)]
        c = pad_rows(count[sl].clamp(max=v + 1).int(), padded)
        blocks.append((sl, real, pad_rows(hidden[sl], padded).contiguous(),
                       params.rows(sl, padded).temperature, c, per_row))
    seen = [torch.zeros(b[2].shape[0], dtype=torch.int32, device=dev) for b in blocks]
    x_buf = torch.empty(cols * rows, dtype=acc, device=dev)
    bufs = _Buffers(rows, cols, hidden.dtype, dev, softcap)
    for c0 in range(0, v, cols):
        w, b = head_slice(weight, bias, c0, cols, hidden.dtype)
        width = w.shape[0]
        for i, (sl, real, h, temperature, c, per_row) in enumerate(blocks):
            x = x_buf[:width * h.shape[0]].view(width, h.shape[0])
            cap = bufs.logits(x, h, w, b, softcap, logit_scale)
            x /= temperature
            tgt, t, *rest = per_row
            kept, seen[i] = _prefix_slice(ordered_keys(x), t, c, seen[i])
            dx = _logit_grad_(x, tgt - c0, kept, *rest)
            dx[:, real:] = 0.0  # padding rows
            through_transform_(dx, cap, logit_scale, 1.0)
            dx /= temperature
            if d_bias is not None:
                d_bias[c0:c0 + width] += dx[:, :real].sum(1)
            if acc != hidden.dtype:
                dx = dx.to(hidden.dtype)
            if d_hidden is not None:
                addmm_acc_(d_hidden[sl], dx[:, :real].t(), w)
            if d_weight is not None:
                addmm_acc_(d_weight[c0:c0 + width], dx[:, :real], h[:real])
    return d_hidden, d_weight, d_bias


def _key_dtype(dtype: torch.dtype) -> torch.dtype:
    """The ordered keys' integer dtype for logits of ``dtype``."""
    return torch.int64 if dtype == torch.float64 else torch.int32


def _logit_grad_(z, local_targets, kept, m, log_kept, log_full, entropy, g_lp, g_entropy,
                 g_kept, g_lse):
    """``d loss / d z`` of one slice ``[cols, R]`` (vocab-major; ``z`` is overwritten);
    ``local_targets``: the targets' positions in the slice (outside ``[0, cols)``: not in it).
    ``log q = (z - m) - log_kept`` and ``log p = (z - m) - log_full``: each formed from the
    forward's own ``z`` and ``m`` (the same bits) and a normaliser of the size of a log-count,
    never through a number of ``m``'s size (``lse``), whose fp32 rounding, times ``1 / T``,
    would be the gradient's error at a low temperature (a one-token set: ``q = 1`` exactly)."""
    z.sub_(m)
    log_q = z - log_kept
    q = torch.exp(log_q).mul_(kept)  # at most 1: the kept set holds the largest logits
    coef = None  # of q: -g_lp + g_kept
    if g_lp is not None:
        coef = -g_lp
    if g_kept is not None:
        coef = g_kept if coef is None else coef + g_kept
    g_p = None  # of the full softmax p: -g_kept + g_lse
    if g_kept is not None:
        g_p = -g_kept
    if g_lse is not None:
        g_p = g_lse if g_p is None else g_p + g_lse
    dz = z
    if g_p is not None:
        dz.sub_(log_full).exp_().mul_(g_p)
    else:
        dz.zero_()
    if coef is not None:
        dz.addcmul_(q, coef.expand_as(q))
    if g_entropy is not None:
        dz.sub_(q * log_q.add_(entropy).mul_(g_entropy))  # q is 0 off the kept set
    if g_lp is not None:  # the one-hot term, where a row's target lies in this slice
        here = (local_targets >= 0) & (local_targets < z.shape[0])
        at = local_targets.clamp(0, z.shape[0] - 1)
        rows = torch.arange(z.shape[1], device=z.device)
        dz.index_put_((at, rows), torch.where(here, g_lp, 0.0), accumulate=True)
    return dz


# Below a recorded set's largest logit by this much, a logit's exponential is exactly 0 in
# fp32 and fp64: what the ids outside a recorded set are given in a stored chunk.
_OUTSIDE_GAP = 1e4


class _Recorded:
    """A recorded kept set (``kept_ids``) of one stored chunk, with `_Selection`'s interface
    (``z``, ``m``, ``reduce``, ``slices``). The logits outside the set are overwritten with
    ``_OUTSIDE_GAP`` below the set's largest, whose exponentials are exactly 0: the statistics
    and the gradient are then those of the set alone, ``m`` the set's maximum (a set far below
    the row's maximum neither underflows nor meets an overflowed exponential)."""

    def __init__(self, z: torch.Tensor, kept: torch.Tensor, cols: int):
        self.z, self.kept, self.cols, self.reduce = z, kept, cols, LOCAL
        self.m = torch.where(kept, z, -math.inf).amax(0)
        fill = (self.m - _OUTSIDE_GAP).expand(min(cols, z.shape[0]), -1)
        for c0 in range(0, z.shape[0], cols):
            zs = z[c0:c0 + cols]
            torch.where(kept[c0:c0 + cols], zs, fill[:zs.shape[0]], out=zs)

    def slices(self, final: bool = False):
        del final
        for c0 in range(0, self.z.shape[0], self.cols):
            zs = self.z[c0:c0 + self.cols]
            yield c0, zs, ordered_keys(zs), self.kept[c0:c0 + self.cols]


class StoredSampled:
    """One chunk's tempered logits kept between its statistics and its gradient, under a
    sampler's truncation (`RowParams`) or a recorded kept set (``kept_ids``): the ``ChunkStore``
    of ``fused_policy_loss`` for such calls on the torch path (``fused/plan.py``).

    The chunk's logits ``[V, R]`` (vocab-major, the accumulation dtype) come from the
    forward's own GEMMs and transform (``cols``-row slices, the temperature divided in
    afterwards); the kept set is found from them by `_Selection`, the code and tie rules of
    `forward` (or read from ``kept_ids``), and `_chunk_stats` gives ``log q_y`` and the kept
    distribution's entropy. ``backward_`` turns each stored slice into ``dz`` in place by
    `_logit_grad_` (the kept set rebuilt by the same slices) and feeds it to the two gradient
    GEMMs: three GEMM passes over the head for the chunk, where `forward` and `backward`
    make four. Peak memory: ``R V`` logits, ``R V`` bytes of kept-set mask with ``kept_ids``,
    one slice's temporaries."""

    def __init__(self, vocab: int, max_rows: int, dtype: torch.dtype, device,
                 softcap: float | None):
        self.vocab, self.dtype, self.acc = vocab, dtype, acc_dtype(dtype)
        self.cols = min(vocab, _COLS)
        self._z = torch.empty(vocab * max_rows, dtype=self.acc, device=device)
        self._kept = None  # the recorded sets' mask, made when a chunk has them
        self._max_rows = max_rows
        self._bufs = _Buffers(max_rows, self.cols, dtype, device, softcap)

    @staticmethod
    def bytes_per_row(vocab: int, dtype: torch.dtype, softcap: float | None,
                      hidden_size: int = 0) -> int:
        """Bytes one token row of a chunk needs: its logits in the accumulation dtype, a byte
        per logit for a recorded set's mask, and its share of one slice's temporaries."""
        del hidden_size
        return (vocab * (acc_dtype(dtype).itemsize + 1)
                + min(vocab, _COLS) * _slice_bytes(dtype, softcap))

    def forward(self, hidden, weight, bias, targets, *, temperature, softcap, logit_scale,
                reduce=None, select=None):
        """Store the tempered logits of ``hidden [rows, D]`` and return per-token ``(logprobs,
        entropy, lse)`` of the kept distribution (``logprobs`` ``-inf`` for a target outside
        the kept set, NaN for a row with a non-finite logit); ``select`` is the rows'
        `RowParams` (their ``temperature`` is the one applied; ``temperature`` here is
        ignored) or their recorded sets, int64 ``[rows, K]`` padded with -1 (``temperature``
        applied). ``lse`` is the kept set's log-normaliser. No ``reduce``: one process holds
        the vocabulary."""
        if reduce is not None:
            raise ValueError("vocab_parallel: a sampler truncation or kept_ids in "
                             "fused_policy_loss needs the whole vocabulary on one process")
        rows, v, cols = hidden.shape[0], self.vocab, self.cols
        self.rows, self.targets, self.head = rows, targets, (softcap, logit_scale)
        # a recorded set's logits in the accumulation dtype, from the inputs' values, as
        # `linear_logprobs(kept_ids=...)` computes them (no rounding to 16 bits); the sampler's
        # in the input dtype, as its own forward rounds them
        sampled = isinstance(select, RowParams)
        self.gemm = hidden.dtype if sampled else self.acc
        hidden = hidden.to(self.gemm)
        z = self._z[:v * rows].view(v, rows)
        for c0 in range(0, v, cols):
            w, b = head_slice(weight, bias, c0, cols, self.gemm)
            self._bufs.logits(z[c0:c0 + w.shape[0]], hidden, w, b, softcap, logit_scale)
        if sampled:
            self.temperature = select.temperature
            z /= self.temperature
            self.sel = _Selection(z, select, cols)
        else:
            self.temperature = torch.full((rows,), float(temperature), dtype=self.acc,
                                          device=z.device)
            z /= self.temperature
            self.sel = _Recorded(z, self._recorded(select, v, rows), cols)
        lp, ent, _, lse, m, log_kept, _, _ = _chunk_stats(self.sel, targets)
        self.m, self.log_kept = m, log_kept
        lp = torch.where(torch.isfinite(lse), lp, torch.nan)
        return lp, ent, m + log_kept

    def _recorded(self, ids, v: int, rows: int) -> torch.Tensor:
        """The kept mask ``[V, rows]`` of the rows' recorded ids ``[rows, K]`` (-1: padding)."""
        if self._kept is None:
            self._kept = torch.empty(v * self._max_rows, dtype=torch.bool, device=ids.device)
        kept = self._kept[:v * rows].view(v, rows).zero_()
        valid = ids >= 0
        row = torch.arange(rows, device=ids.device).unsqueeze(1).expand_as(ids)
        kept[ids[valid], row[valid]] = True
        return kept

    def backward_(self, hidden, weight, entropy, g_lp, g_entropy, d_weight, d_bias,
                  want_hidden: bool, weight_beta: float = 1.0):
        """Turn the stored logits into ``d loss / d x`` slice by slice (`_logit_grad_`, ``K``
        held fixed; ``g_lp`` must be 0 on rows whose target is outside the kept set), add
        ``dx^T`` times ``hidden`` to ``d_weight`` (``weight_beta=0``: overwrite it) and
        ``dx``'s sum to ``d_bias`` (either may be None); return ``dx^T W`` when
        ``want_hidden`` (the accumulation dtype)."""
        softcap, logit_scale = self.head
        temperature, rows = self.temperature, self.rows
        acc, hidden = self.acc, hidden.to(self.gemm)
        g_lp, g_entropy, entropy = (None if g is None else g.to(acc)
                                    for g in (g_lp, g_entropy, entropy))
        d_hidden = (torch.zeros(rows, weight.shape[1], dtype=acc, device=weight.device)
                    if want_hidden else None)
        cap = self._bufs.cap
        for c0, zs, _, kept in self.sel.slices(final=True):
            width = zs.shape[0]
            t = None
            if softcap is not None:  # tanh(x / c) = z T / (c scale), before zs becomes dz
                t = torch.mul(zs, temperature, out=cap[:zs.numel()].view(zs.shape))
                t.div_(softcap * logit_scale).clamp_(-1.0, 1.0)
            if kept is None:
                kept = torch.ones_like(zs, dtype=torch.bool)
            dx = _logit_grad_(zs, self.targets - c0, kept, self.m, self.log_kept, None,
                              entropy, g_lp, g_entropy, None, None)
            through_transform_(dx, t, logit_scale, 1.0)
            dx /= temperature
            if d_bias is not None:
                d_bias[c0:c0 + width] += dx.sum(1)
            w, _ = head_slice(weight, None, c0, self.cols, self.gemm)
            if acc != self.gemm:
                dx = dx.to(self.gemm)
            if d_hidden is not None:
                addmm_acc_(d_hidden, dx.t(), w)
            if d_weight is not None:
                addmm_acc_(d_weight[c0:c0 + width], dx, hidden, beta=weight_beta)
        return d_hidden
