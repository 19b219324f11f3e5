"""Recorded kept sets for ``match_sampler="replay"`` (issue 25, item 3): the per-token vocabulary
ids a rollout engine kept after its top-k / top-p / min-p, turned into the ``kept_ids`` tensor
:func:`logitless.linear_logprobs` takes (int64 ``[B, T, K]``, padded with -1).

Where the sets come from (docs/sampler.md, "Replay"):

- vLLM 0.34.0, started with ``LLM(..., return_sampling_mask=True)`` (engine argument
  ``--return-sampling-mask``; it then needs ``top_k > 0`` and a temperature > 0 per request):
  each ``CompletionOutput`` of a ``RequestOutput`` carries ``sampling_mask``, a
  ``SamplingMask`` whose ``token_ids`` is one list of ids per generated token
  (``vllm/outputs.py``). :func:`masks_from_request_outputs` reads them.
- SGLang 0.5.23, a ``/generate`` request with ``return_sampling_mask: true``: each output's
  ``meta_info["output_token_sampling_mask"]`` is one list of ids per output token, aligned
  with ``output_ids``. :func:`masks_from_sglang_outputs` reads them.

A completion's sets are a list with one entry per completion token: the list of kept ids, or
None for a token the engine did not sample (a tool or environment token a rollout inserted).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

__all__ = [
    "KEPT_IDS_KEY",
    "SAMPLING_MASK_KEY",
    "kept_ids_from_masks",
    "masks_from_request_outputs",
    "masks_from_sglang_outputs",
]

# The key a TRL ``rollout_func`` returns the recorded sets under: per completion, one entry per
# completion token (a list of kept vocabulary ids, or None for a token not sampled).
SAMPLING_MASK_KEY = "sampling_mask"
# The tensor key the sets travel under afterwards: TRL's generation batch, verl's DataProto.
KEPT_IDS_KEY = "kept_ids"


def _shown(value) -> str:
    """``value`` for an error message: its repr when short and simple, else its type."""
    if value is None or isinstance(value, (numbers.Number, str, bytes)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__name__}"


def _listed(value, where: str, what: str) -> list:
    """``value`` (any iterable but a string or a dict) as a list; else ``ValueError``
    "``where``: expected ``what``, got ..." (``where`` starts with the argument's name)."""
    error = ValueError(f"{where}: expected {what}, got {_shown(value)}")
    if value is None or isinstance(value, (str, bytes, dict)):
        raise error
    try:
        return list(value)
    except TypeError:  # not iterable: a number, a 0-d tensor, an object
        raise error from None


def _is_int(i) -> bool:
    """A python or numpy integer, or a 0-d integer tensor; not a bool (nor a float, even
    an integral one)."""
    if isinstance(i, torch.Tensor):
        return (i.dim() == 0 and not i.dtype.is_floating_point and not i.dtype.is_complex
                and i.dtype != torch.bool)
    return isinstance(i, numbers.Integral) and not isinstance(i, bool)


def _kept_set(ids, name: str, where: str) -> list[int]:
    """One recorded set as a list of python ints; ``ValueError`` naming ``name`` and
    ``where`` for anything but a sequence of integer ids."""
    ids = _listed(ids, f"{name}: {where}", "a list of kept vocabulary ids")
    if all(type(i) is int for i in ids):  # the common case, without a call per id
        return ids
    for i in ids:
        if not _is_int(i):
            raise ValueError(f"{name}: {where}: ids must be ints (python or numpy integers, "
                             f"or 0-d integer tensors; not bools or floats), got {_shown(i)}")
    return [int(i) for i in ids]


def masks_from_request_outputs(request_outputs) -> list[list[list[int]]]:
    """The recorded sets of vLLM ``RequestOutput``s, one entry per completion, in the order of
    ``request_outputs`` and of each request's ``outputs`` (the order TRL flattens them in).

    Reads ``request.outputs[i].sampling_mask.token_ids`` and ``.token_ids`` only. Raises
    ``ValueError`` naming ``request_outputs`` when it is not a list of ``RequestOutput``s (one
    alone included), a completion carries no set (vLLM was not started with
    ``return_sampling_mask=True``), its set count differs from its token count, or a set is
    not a list of integer ids."""
    name = "request_outputs"
    masks = []
    for r, request in enumerate(_listed(request_outputs, name, "a list of vLLM RequestOutputs")):
        completions = _listed(getattr(request, "outputs", None), f"{name}: request {r}",
                              "a vLLM RequestOutput (with .outputs)")
        for c, completion in enumerate(completions):
            where = f"completion {c} of request {r}"
            mask = getattr(completion, "sampling_mask", None)
            if mask is None:
                raise ValueError(
                    f"{name}: {where} has no sampling_mask; start vLLM with "
                    f"return_sampling_mask=True (--return-sampling-mask)")
            sets = _listed(getattr(mask, "token_ids", None), f"{name}: {where}",
                           "sampling_mask.token_ids to be one list of ids per token")
            tokens = _listed(getattr(completion, "token_ids", None), f"{name}: {where}",
                             "token_ids to be a list of ids")
            if len(sets) != len(tokens):
                raise ValueError(f"{name}: {where} has {len(sets)} kept sets for {len(tokens)} "
                                 f"tokens")
            masks.append([_kept_set(ids, name, f"{where}, token {t}")
                          for t, ids in enumerate(sets)])
    return masks


def masks_from_sglang_outputs(outputs) -> list[list[list[int]]]:
    """The recorded sets of SGLang ``/generate`` outputs (the response's list of dicts, or one
    dict), one entry per output: ``meta_info["output_token_sampling_mask"]``, checked against
    ``output_ids``. Raises ``ValueError`` naming ``outputs`` when it is not a list of dicts
    (or one dict), an output has no set (the request lacked ``return_sampling_mask: true``),
    a count differs from its tokens, or a set is not a list of integer ids."""
    name = "outputs"
    if isinstance(outputs, dict):
        outputs = [outputs]
    masks = []
    for i, output in enumerate(_listed(outputs, name, "SGLang's /generate answer (a list of "
                                                      "dicts, or one dict)")):
        if not isinstance(output, dict):
            raise ValueError(f"{name}: output {i}: expected a dict (one /generate output), got "
                             f"{_shown(output)}")
        meta = output.get("meta_info") or {}
        if not isinstance(meta, dict):
            raise ValueError(f"{name}: output {i}: expected meta_info to be a dict, got "
                             f"{_shown(meta)}")
        sets = meta.get("output_token_sampling_mask")
        if sets is None:
            raise ValueError(
                f"{name}: output {i} has no meta_info['output_token_sampling_mask']; send the "
                f"request with return_sampling_mask=true")
        sets = _listed(sets, f"{name}: output {i}", "meta_info['output_token_sampling_mask'] "
                                                    "to be one list of ids per output token")
        ids = output.get("output_ids")
        if ids is not None:
            ids = _listed(ids, f"{name}: output {i}", "output_ids to be a list of ids")
            if len(sets) != len(ids):
                raise ValueError(f"{name}: output {i} has {len(sets)} kept sets for {len(ids)} "
                                 f"output ids")
        masks.append([_kept_set(s, name, f"output {i}, token {t}") for t, s in enumerate(sets)])
    return masks


def kept_ids_from_masks(masks: Sequence[Sequence[Sequence[int] | None]], length: int,
                        vocab_size: int | None = None,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """The kept sets as int64 ``[B, length, K]`` padded with -1, aligned with right-padded
    completion ids of ``length`` columns. ``K`` is the largest set. Positions without a set
    (past a completion's end, or a None entry) hold -1 only.

    Ids are python or numpy integers or 0-d integer tensors (a set may be a 1-D integer
    tensor); floats, even integral ones, and bools are refused. Raises ``ValueError`` naming
    ``masks`` for anything but a list of completions each holding a list of sets (or None),
    a completion with more sets than ``length`` columns, an empty set, an id that is not an
    int, duplicate ids, or ids outside ``[0, vocab_size)``."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length: expected an int >= 0, got {length!r}")
    flat, sizes, where = [], [], []  # every id, each set's size, each set's (completion, token)
    count = 0
    for b, sets in enumerate(_listed(masks, "masks", "a list of completions, each a list of "
                                                     "kept sets")):
        sets = _listed(sets, f"masks: completion {b}", "a list of kept sets (one per token, "
                                                       "or None)")
        count += 1
        if len(sets) > length:
            raise ValueError(f"masks: completion {b} has {len(sets)} kept sets for {length} "
                             f"completion columns")
        for t, ids in enumerate(sets):
            if ids is None:
                continue
            ids = _kept_set(ids, "masks", f"completion {b}, token {t}")
            if not ids:
                raise ValueError(f"masks: completion {b}, token {t}: empty kept set")
            flat.extend(ids)
            sizes.append(len(ids))
            where.append((b, t))
    k = max(sizes, default=1)
    out = torch.full((count, length, k), -1, dtype=torch.int64)
    if flat:
        ids = torch.tensor(flat, dtype=torch.int64)
        size = torch.tensor(sizes)
        owner = torch.repeat_interleave(torch.arange(len(sizes)), size)
        bad = (ids < 0) | (ids >= vocab_size if vocab_size is not None else False)
        if bool(bad.any()):
            b, t = where[int(owner[bad.nonzero()[0]])]
            raise ValueError(f"masks: completion {b}, token {t}: ids outside "
                             f"[0, {vocab_size if vocab_size is not None else 'V'})")
        column = torch.arange(len(flat)) - torch.repeat_interleave(size.cumsum(0) - size, size)
        rows = torch.tensor(where, dtype=torch.int64).reshape(-1, 2)[owner]
        out[rows[:, 0], rows[:, 1], column] = ids
        ordered = out.sort(dim=-1).values
        twice = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(-1)
        if bool(twice.any()):
            b, t = twice.nonzero()[0].tolist()
            raise ValueError(f"masks: completion {b}, token {t}: duplicate ids")
    return out if device is None else out.to(device)
