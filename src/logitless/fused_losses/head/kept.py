"""Logprobs renormalised over a recorded kept set: ``linear_logprobs(kept_ids=...)``.

A rollout engine that reports the set of vocabulary ids it kept for each sampled token (vLLM's
and SGLang's sampling masks, a replayed sampler) fixes the distribution the token was drawn
from: the tempered softmax restricted to that set. Nothing is recomputed from settings, so no
boundary rounding and no version drift.

Per token with kept ids ``S`` (``[..., K]``, padded with -1): the logits of ``S`` only,
``z_S = logit_scale * softcap(h . W_S + b_S) / T``, from a gather of at most ``K`` weight rows,
in row chunks whose gathered rows stay under ``max_tile_bytes``. Outputs: ``log q(y) = z_y -
logsumexp(z_S)`` (``-inf`` when ``y`` is not in ``S``, NaN when a logit of ``S`` is not
finite), the entropy of ``q`` and, on request,
``log_kept_mass = logsumexp(z_S) - logsumexp(z)``, whose second term is one streamed pass of
the whole head (the plain ``linear_logprobs``'s ``lse``). The backward regathers each chunk's
rows: nothing of size ``K x D`` per token is kept between forward and backward.

The same gather gives ``linear_logprobs(ids=...)`` its logits at given ids (`id_logits`), from
which the caller subtracts the whole head's lse.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from logitless.fused_losses.oplib import (
    check_temperature,
    compact_rows,
    is_compiling,
    put_rows,
    take_rows,
)
from logitless.kernels.linear_softmax_torch import acc_dtype

DEFAULT_GATHER_BYTES = 64 * 2**20


def check_kept_ids(kept_ids, targets: torch.Tensor, vocab: int, ignore_index: int, *,
                   name: str = "kept_ids", as_set: bool = True):
    """``kept_ids`` must be an int64 tensor ``[*targets.shape, K]`` (``K >= 1``) of ids in
    ``[0, V)`` or -1 (padding); ``as_set`` (a kept set): no id twice for a token, and at least
    one id for every token whose target is not ``ignore_index``. Errors name ``name``. Reads
    the values (eager calls only)."""
    if not isinstance(kept_ids, torch.Tensor) or kept_ids.dtype != torch.int64:
        got = type(kept_ids).__name__ if not isinstance(kept_ids, torch.Tensor) else kept_ids.dtype
        raise ValueError(f"{name} must be an int64 tensor, got {got}")
    if kept_ids.dim() != targets.dim() + 1 or kept_ids.shape[:-1] != targets.shape:
        raise ValueError(f"{name} must have shape [*targets.shape, K] = "
                         f"[{', '.join(map(str, targets.shape))}, K], got "
                         f"{list(kept_ids.shape)}")
    if kept_ids.shape[-1] < 1:
        raise ValueError(f"{name} must hold at least one id per token (K >= 1), got K = 0")
    if kept_ids.device != targets.device:
        raise ValueError(f"{name} must be on targets' device {targets.device}, got "
                         f"{kept_ids.device}")
    if is_compiling():
        return
    ids = kept_ids.reshape(-1, kept_ids.shape[-1])
    bad = (ids < -1) | (ids >= vocab)
    if bool(bad.any()):
        raise ValueError(f"{name} must be vocabulary ids in [0, {vocab}) or -1 (padding), got "
                         f"{int(ids[bad][0])}")
    if not as_set:
        return
    ordered = ids.sort(dim=-1).values
    twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(twice.any()):
        row = int(twice.any(-1).nonzero()[0])
        raise ValueError(f"{name} must name each id at most once per token; token {row} "
                         f"holds id {int(ordered[row, 1:][twice[row]][0])} twice")
    live = targets.reshape(-1) != ignore_index
    empty = live & (ids < 0).all(-1)
    if bool(empty.any()):
        raise ValueError(f"{name} must hold at least one id for every token whose target is "
                         f"not ignore_index; token {int(empty.nonzero()[0])} has none")


def _chunk_plan(hidden, ids, dtype, budget: int) -> tuple[torch.dtype, int, int]:
    """``(acc, n, step)`` of a gather over ``ids`` ``[n, K]``: the accumulation dtype of the
    compute ``dtype``, the row count and the rows per chunk whose ``K`` gathered rows of
    ``hidden``'s width (three copies in ``acc``) stay within ``budget`` bytes."""
    acc = acc_dtype(dtype)
    n, k = ids.shape
    row_bytes = k * hidden.shape[-1] * (8 if acc == torch.float64 else 4) * 3
    return acc, n, max(1, budget // max(1, row_bytes))


def _kept_logits(h, weight, bias, ids, temp, softcap, scale, low=None):
    """``(z, raw, valid, w)`` for one chunk: the transformed logits of the kept ids ``[n, K]``
    (-inf at padding), the pre-transform logits, the padding mask and the gathered rows, in
    the accumulation dtype, ``h`` (``[n, D]``, the rows in the compute dtype) and ``temp``
    (``[n]``)'s. ``low``: a 16-bit compute dtype whose GEMM the logits copy (the weight and
    bias rows cast to it, the pre-transform logits rounded to it, as the plain path's tiles
    are), for logits that meet the plain path's ``lse``; None: fp32 from the rows as given."""
    valid = ids >= 0
    safe = ids.clamp_min(0)
    # The gathered rows in the accumulation dtype: K rows per token are a matrix-vector product
    # bound by the gather, so fp32 costs nothing and no logit is rounded to bf16 (unless
    # ``low`` asks for the plain path's rounding).
    acc = h.dtype
    cast = (lambda x: x.to(acc)) if low is None else (lambda x: x.to(low).to(acc))
    w = cast(weight.index_select(0, safe.reshape(-1)).view(*safe.shape, -1))  # [n, K, D]
    raw = torch.bmm(w, h.unsqueeze(-1)).squeeze(-1)
    if bias is not None:
        raw = raw + cast(bias.index_select(0, safe.reshape(-1)).view(safe.shape))
    if low is not None:
        raw = raw.to(low).to(acc)
    z = raw if softcap is None else softcap * torch.tanh(raw / softcap)
    z = z * (scale / temp.unsqueeze(-1))
    return z.masked_fill(~valid, float("-inf")), raw, valid, w


def check_kept_temperature(temperature, targets: torch.Tensor, dtype: torch.dtype) -> None:
    """A per-token temperature with ``kept_ids``: ``targets``' shape, floating point, values
    in the range every path takes (`check_temperature`, for the compute dtype ``dtype``)."""
    if not isinstance(temperature, torch.Tensor):
        return
    if temperature.shape != targets.shape or not temperature.is_floating_point():
        raise ValueError(f"temperature as a tensor must be floating point with targets' shape "
                         f"{tuple(targets.shape)}, got {temperature.dtype} "
                         f"{tuple(temperature.shape)}")
    if not is_compiling():
        check_temperature(temperature, dtype)


class _KeptLogprobs(torch.autograd.Function):
    """Rows ``[n, D]`` with their kept ids ``[n, K]`` and targets ``[n]`` (all live) ->
    ``(lp, entropy, lse_kept)`` in the accumulation dtype; the backward regathers by chunk.
    ``hidden`` is cast to the compute ``dtype`` here, inside, so that its gradient comes back in
    its own dtype from the fp32 accumulator (as on the plain path)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, targets, temp, dtype, softcap, scale, budget,
                gather):
        acc, n, step = _chunk_plan(hidden, ids, dtype, budget)
        lp = torch.empty(n, dtype=acc, device=hidden.device)
        ent, lse_k = torch.empty_like(lp), torch.empty_like(lp)
        hit = ids == targets.unsqueeze(-1)
        # Autocast off, as on the plain path: the logits are fp32 (not autocast's bf16 from
        # bmm), the same ones the backward recomputes.
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, step):
                e = min(n, s + step)
                z, _, valid, _ = _kept_logits(hidden[s:e].to(dtype).to(acc), weight, bias,
                                              ids[s:e], temp[s:e], softcap, scale)
                lse = torch.logsumexp(z, dim=-1)
                log_p = (z - lse.unsqueeze(-1)).masked_fill(~valid, 0.0)
                p = torch.exp(log_p).masked_fill(~valid, 0.0)
                ent[s:e] = -(p * log_p).sum(-1)
                z_y = torch.where(hit[s:e], z, torch.zeros((), dtype=acc, device=z.device))
                lp[s:e] = torch.where(hit[s:e].any(-1), z_y.sum(-1) - lse,
                                      torch.full((), float("-inf"), dtype=acc, device=z.device))
                lse_k[s:e] = lse
        # A row with a NaN or inf logit in its set has no distribution: NaN (as the sampler
        # path's), not the -inf that means "outside the kept set".
        lp = torch.where(torch.isfinite(lse_k), lp, torch.nan)
        ctx.save_for_backward(hidden, weight, bias, ids, temp, lp, ent, lse_k, hit)
        ctx.transform = (dtype, softcap, scale, step, acc, gather)
        return lp, ent, lse_k

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_lse):
        hidden, weight, bias, ids, temp, lp, ent, lse_k, hit = ctx.saved_tensors
        dtype, softcap, scale, step, acc, gather = ctx.transform
        # The same fp32 logits as the forward's (autocast off), from the weight as the gather
        # makes it available (the caller ran the forward inside the same context).
        with torch.autocast(hidden.device.type, enabled=False), \
                (nullcontext() if gather is None else gather()):
            grads = _kept_grads(hidden, weight, bias, ids, temp, lp, ent, lse_k, hit,
                                (g_lp, g_ent, g_lse), ctx.needs_input_grad[:3], dtype, softcap,
                                scale, step, acc)
        return (*grads, *(None,) * 8)


def _kept_grads(hidden, weight, bias, ids, temp, lp, ent, lse_k, hit, grads, needs, dtype,
                softcap, scale, step, acc):
    """``(d_hidden, d_weight, d_bias)`` of `_KeptLogprobs`, each in its input's dtype (None
    where ``needs`` says it is not wanted), regathering the rows chunk by chunk."""
    g_lp, g_ent, g_lse = grads
    n = ids.shape[0]
    zero = torch.zeros((), dtype=acc, device=hidden.device)
    g_lp = zero.expand(n) if g_lp is None else torch.where(torch.isinf(lp), zero, g_lp)
    g_ent = zero.expand(n) if g_ent is None else g_ent
    g_lse = zero.expand(n) if g_lse is None else g_lse

    def dz_of(s, e, z, valid):
        log_p = (z - lse_k[s:e].unsqueeze(-1)).masked_fill(~valid, 0.0)
        p = torch.exp(log_p).masked_fill(~valid, 0.0)
        # d lp / dz = 1[j = y] - p;  d H / dz = -p (log p + H);  d lse / dz = p
        gl, gh, gs = g_lp[s:e, None], g_ent[s:e, None], g_lse[s:e, None]
        return gl * (hit[s:e].to(acc) - p) - gh * p * (log_p + ent[s:e, None]) + gs * p

    return _gathered_grads(hidden, weight, bias, ids, temp, dz_of, needs, dtype, softcap, scale,
                           step, acc)


def _gathered_grads(hidden, weight, bias, ids, temp, dz_of, needs, dtype, softcap, scale, step,
                    acc, low=None):
    """``(d_hidden, d_weight, d_bias)`` from the gradients with respect to the transformed
    logits of gathered ids, ``dz_of(s, e, z, valid) -> [e - s, K]`` for each chunk of rows
    ``s:e`` (given its logits ``z`` and padding mask), regathering the rows chunk by chunk;
    each in its input's dtype, None where ``needs`` says it is not wanted. ``low``: as
    `_kept_logits`' (the logits the forward gathered)."""
    need_h, need_w, need_b = needs
    d_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
    d_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    d_b = (torch.zeros(bias.shape, dtype=acc, device=bias.device)
           if need_b and bias is not None else None)
    for s in range(0, ids.shape[0], step):
        e = min(ids.shape[0], s + step)
        h = hidden[s:e].to(dtype).to(acc)
        z, raw, valid, w = _kept_logits(h, weight, bias, ids[s:e], temp[s:e], softcap, scale,
                                        low)
        dz = dz_of(s, e, z, valid)
        dz = dz.masked_fill(~valid, 0.0) * (scale / temp[s:e, None])
        if softcap is not None:
            dz = dz * (1 - torch.tanh(raw.to(acc) / softcap) ** 2)
        safe = ids[s:e].clamp_min(0).reshape(-1)
        if d_h is not None:
            d_h[s:e] = torch.bmm(dz.unsqueeze(1), w).squeeze(1)
        if d_w is not None:
            rows = dz.unsqueeze(-1) * h.unsqueeze(1)  # [n, K, D]
            d_w.index_add_(0, safe, rows.reshape(-1, rows.shape[-1]))
        if d_b is not None:
            d_b.index_add_(0, safe, dz.reshape(-1))
    return (None if d_h is None else d_h.to(hidden.dtype),
            None if d_w is None else d_w.to(weight.dtype),
            None if d_b is None else d_b.to(bias.dtype))


def _row_temperature(temperature, rows, n: int, acc: torch.dtype, device) -> torch.Tensor:
    """The temperature of each of the ``n`` kept rows, ``[n]`` in the accumulation dtype,
    never rounded to a 16-bit input dtype (0.7 would read 0.69921875 in bf16): a per-token
    tensor cast once, a number from its Python float."""
    if isinstance(temperature, torch.Tensor):
        return take_rows(temperature, rows).to(acc)
    return torch.full((n,), float(temperature), dtype=acc, device=device)


def kept_logprobs(hidden, weight, targets, kept_ids, *, bias, temperature, softcap,
                  logit_scale, ignore_index, dtype, return_entropy, want_mass, full_lse,
                  max_tile_bytes, gather_weight=None):
    """The results of ``linear_logprobs(kept_ids=...)`` as ``(logprobs, entropy,
    log_kept_mass)`` shaped like ``targets`` (0 at ignored positions; None where not asked
    for). ``full_lse`` gives the untruncated head's per-token lse when ``want_mass``;
    ``gather_weight``, the ZeRO-3 hook, is entered by the backward."""
    flat_t, rows = compact_rows(targets, ignore_index, weight.shape[0])
    check_kept_ids(kept_ids, targets, weight.shape[0], ignore_index)
    h = take_rows(hidden, rows, hidden.shape[-1])
    ids = take_rows(kept_ids, rows, kept_ids.shape[-1])
    temp = _row_temperature(temperature, rows, h.shape[0], acc_dtype(dtype), h.device)
    budget = DEFAULT_GATHER_BYTES if max_tile_bytes is None else max_tile_bytes
    lp, ent, lse_k = _KeptLogprobs.apply(h, weight, bias, ids, take_rows(flat_t, rows), temp,
                                         dtype, softcap, logit_scale, budget, gather_weight)
    mass = None
    if want_mass:
        live = (flat_t != ignore_index).view(targets.shape)
        full = torch.where(live, full_lse(), 0.0).to(lse_k.dtype)
        mass = put_rows(lse_k, rows, targets.shape) - full
    return (put_rows(lp, rows, targets.shape),
            put_rows(ent, rows, targets.shape) if return_entropy else None, mass)


class _IdLogits(torch.autograd.Function):
    """Rows ``[n, D]`` with ids ``[n, K]`` (-1: padding) -> their transformed logits ``[n, K]``
    in the accumulation dtype (-inf at padding), from a gather of their weight rows by chunk;
    the backward regathers (`_gathered_grads`), inside ``gather`` when given. ``low``: as
    `_kept_logits`'."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temp, dtype, softcap, scale, budget, gather,
                low):
        acc, n, step = _chunk_plan(hidden, ids, dtype, budget)
        z = torch.empty(ids.shape, dtype=acc, device=hidden.device)
        # Autocast off: fp32 logits (not autocast's bf16 from bmm), as the backward's.
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, step):
                e = min(n, s + step)
                z[s:e] = _kept_logits(hidden[s:e].to(dtype).to(acc), weight, bias, ids[s:e],
                                      temp[s:e], softcap, scale, low)[0]
        ctx.save_for_backward(hidden, weight, bias, ids, temp)
        ctx.transform = (dtype, softcap, scale, step, acc, gather, low)
        return z

    @staticmethod
    def backward(ctx, g_z):
        hidden, weight, bias, ids, temp = ctx.saved_tensors
        dtype, softcap, scale, step, acc, gather, low = ctx.transform
        g_z = g_z.to(acc)
        with torch.autocast(hidden.device.type, enabled=False), \
                (nullcontext() if gather is None else gather()):
            grads = _gathered_grads(hidden, weight, bias, ids, temp,
                                    lambda s, e, z, valid: g_z[s:e], ctx.needs_input_grad[:3],
                                    dtype, softcap, scale, step, acc, low)
        return (*grads, *(None,) * 8)


def id_logits(hidden, weight, targets, ids, *, bias, temperature, softcap, logit_scale,
              ignore_index, dtype, max_tile_bytes, gather_weight=None):
    """The transformed logits ``z = logit_scale * softcap(h . W_i + b_i) / T`` at the given
    ``ids`` (``[*targets.shape, K]``, -1 padding, repeats allowed), ``[*targets.shape, K]`` in
    the accumulation dtype with gradient: -inf at padding, 0 on rows whose target is
    ``ignore_index``. ``linear_logprobs(ids=...)`` subtracts the plain path's lse, so for
    16-bit inputs the logits are rounded as that path's tiles round them (`_kept_logits`'
    ``low``): fp32 logits against the lse of rounded ones would read probabilities above 1."""
    check_kept_ids(ids, targets, weight.shape[0], ignore_index, name="ids", as_set=False)
    _, rows = compact_rows(targets, ignore_index, weight.shape[0])
    h = take_rows(hidden, rows, hidden.shape[-1])
    at = take_rows(ids, rows, ids.shape[-1])
    z = gathered_logits(h, weight, bias, at, temperature=_row_temperature(
        temperature, rows, h.shape[0], acc_dtype(dtype), h.device), dtype=dtype,
        softcap=softcap, logit_scale=logit_scale, max_tile_bytes=max_tile_bytes,
        gather_weight=gather_weight, plain_rounding=True)
    return put_rows(z, rows, ids.shape)


def gathered_logits(hidden, weight, bias, ids, *, temperature, dtype, softcap=None,
                    logit_scale=1.0, max_tile_bytes=None, gather_weight=None,
                    plain_rounding=False):
    """The transformed logits of rows ``hidden [n, D]`` (checked, compacted) at ``ids [n, K]``
    (in ``[0, V)`` or -1), ``[n, K]`` in the accumulation dtype of ``dtype`` with gradient
    (-inf at padding): a gather of the ids' weight rows by chunk, never the logits.
    ``temperature``: a number or ``[n]``, entering in the accumulation dtype.
    ``plain_rounding``: for a 16-bit ``dtype``, the logits the plain path's tiles make (its
    weight and bias in ``dtype``, ``h . W_i + b_i`` rounded to it), to meet that path's lse;
    else fp32 logits of the rows as given (sets renormalised over themselves)."""
    acc = acc_dtype(dtype)
    low = dtype if plain_rounding and dtype != acc else None
    if not isinstance(temperature, torch.Tensor):
        temperature = _row_temperature(temperature, None, hidden.shape[0], acc, hidden.device)
    budget = DEFAULT_GATHER_BYTES if max_tile_bytes is None else max_tile_bytes
    return _IdLogits.apply(hidden, weight, bias, ids, temperature.to(acc), dtype, softcap,
                           logit_scale, budget, gather_weight, low)
