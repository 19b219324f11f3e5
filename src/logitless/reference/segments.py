"""Plain-loop reference of the segmented reductions and scans: one sequence, one token at a time.

Inputs are right-padded ``x [B, T]`` with a 0/1 ``mask [B, T]``, meant to run in fp64; the
packed layout is checked by packing these grids (``x[mask]``). Per-token values are torch
scalars, so autograd gives the reference gradients. Masked tokens add nothing to sums and are
skipped by the min; scans write every position, masked ones included.
"""

import math

import torch


def valid_tokens(mask, i):
    """Positions ``t`` of sequence ``i`` with ``mask[i, t]`` set, in order."""
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def segment_sum_loop(x, mask):
    """``[B]``: ``sum_t m x`` per sequence."""
    sums = [sum((x[i, t] for t in valid_tokens(mask, i)), x.new_zeros(()))
            for i in range(x.shape[0])]
    return torch.stack(sums) if sums else x.new_zeros(0)


def prefix_sum_loop(x, mask):
    """Like ``x``: ``sum_{j <= t} m_j x_j`` as a running total."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        run = x.new_zeros(())
        for t in range(x.shape[1]):
            if mask[i, t]:
                run = run + x[i, t]
            out[i, t] = run
    return out


def suffix_sum_loop(x, mask):
    """Like ``x``: ``sum_{j >= t} m_j x_j`` (the prefix sum of the reversed rows)."""
    return prefix_sum_loop(x.flip(-1), mask.flip(-1)).flip(-1)


def prefix_min_loop(x, mask, exclusive=False):
    """Like ``x``: ``min(x_j : m_j, j <= t)`` (``j < t`` when ``exclusive``), ``+inf`` if none."""
    out = torch.full_like(x, math.inf)
    for i in range(x.shape[0]):
        run = math.inf
        for t in range(x.shape[1]):
            if exclusive:
                out[i, t] = run
            if mask[i, t]:
                run = min(run, float(x[i, t]))
            if not exclusive:
                out[i, t] = run
    return out
