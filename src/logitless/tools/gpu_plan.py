"""The plan of each GPU path and its predicted cost, computed without a GPU.

For a shape ``(N, D, V)``, a dtype and a memory budget, :func:`gpu_plan` lays out what the CUDA
path of ``linear_logprobs`` or ``fused_policy_loss`` launches (row chunks, vocabulary tiles,
GEMMs and one-pass Triton epilogues), counts each pass's FLOPs and HBM bytes, and predicts its
time on a :class:`Hardware` (an H200 by default). Pure arithmetic: no tensor is made and no
device is asked anything, so the model runs and is tested on CPU.

The model, stated once:

- A launch costs ``max(flops / rate, bytes / bandwidth) + launch_seconds``: GEMMs at the
  tensor-core rate (bf16/fp16; TF32 for fp32 inputs), epilogue passes at the fp32 vector rate.
- A GEMM's rate is derated by its **wave quantisation**: its ``[m, n]`` output is cut into
  ``128 x 256`` tiles, one per SM at a time, so it takes ``ceil(tiles / SMs)`` waves of whole
  tiles; the rate is multiplied by ``m n / (waves x SMs x 128 x 256)`` (the share of the
  waves' tile area that is real output).
- A streaming epilogue is also bounded by its **instruction issue**: its warp instructions
  per logits element, read off its compiled sm_90 loop (``tools/sass.py`` under triton 3.6.0,
  :data:`EPILOGUE_INSTRUCTIONS`), over the chip's issue rate (4 warp instructions per cycle
  per SM).
- Bytes are the fewest a launch must move: each operand read once, each output written once, an
  accumulator (``C += A @ B``) read and written. A GEMM's operand re-reads from L2 are not
  counted; neither are cuBLAS's losses on thin or oddly shaped tiles, which only a measurement
  shows.
- The plain GEMMs of a path (its floor) are the same products over the whole shape, one launch
  each, wave-quantised the same way: no-grad one (``2 N D V`` FLOPs), head forward+backward
  four, fused loss three.
- Peak memory is what a path holds beyond its inputs and their gradients: the logits tile or
  the stored chunk, per-row state, fp32 accumulators.

Paths:

- ``"logprobs-nograd"``: hidden cut into ``ROW_CHUNK``-row chunks, the last one padded to a
  multiple of ``ROW_GRANULE`` rows (``row_blocks``, the launcher's own plan), the chunks grouped
  within the tile budget; per vocabulary tile and row group, one GEMM per chunk writes the
  group's logits tile in the input dtype and one Triton pass folds it into the per-row
  statistics (a fixed merge order).
- ``"logprobs-fwd-bwd"``: that forward, then vocabulary-outer: per tile and group the chunks'
  GEMMs again, one pass turning the tile into ``dz`` in place, per chunk
  ``d_hidden += dz @ W_tile`` into an fp32 ``[N, D]`` accumulator, and ``d_weight[tile] =
  dz^T @ hidden`` written once (summed in an fp32 tile accumulator when there are several
  row groups).
- ``"fused-policy-loss"``: sequence-aligned chunks of rows (at most :func:`wave_rows` of what
  the budget holds; no padding), each chunk's ``[rows, V]`` logits stored once in the input
  dtype; a
  statistics pass, the objective on ``(lp, H)``, a pass turning the stored logits into ``dz``
  in place, ``dz @ W`` for the chunk's hidden gradient and
  ``dz^T @ hidden`` added into the one fp32 weight-gradient accumulator.

The bias and the logit transform (temperature, soft-cap) are not counted: O(V) bytes and a few
FLOPs per logit inside passes that are bound by their bytes. The tiling it prices
(:data:`VOCAB_TILE`, :data:`ROW_CHUNK`, :data:`ROW_GRANULE`, :data:`HEAD_TILE_BUDGET` and the
sampler's
:data:`SAMPLER_ROWS`, :data:`SAMPLER_SLICE`, :data:`SAMPLER_TILE_BUDGET`) is
``kernels/constants.py``'s, the numbers the launchers tile by; the chunk height and default
budget of the fused loss (:func:`wave_rows`, :data:`CUDA_MEMORY_BUDGET`) are
``fused/gpu_chunks.py``'s, what the runtime reads. The model and its report are tooling: the
runtime imports neither. ``scripts/gpu_cost_table.py`` prints the tables that ``docs/gpu.md``
holds.
"""

from __future__ import annotations

import dataclasses
import math

from logitless.fused_losses.fused.gpu_chunks import (
    CUDA_MEMORY_BUDGET,
    H200,
    Hardware,
    wave_efficiency,
    wave_rows,
)
from logitless.kernels.constants import (
    HEAD_TILE_BUDGET,
    ROW_CHUNK,
    ROW_GRANULE,
    SAMPLER_ROWS,
    SAMPLER_SLICE,
    SAMPLER_TILE_BUDGET,
    VOCAB_TILE,
    row_blocks,
)

__all__ = [
    "BATCH_SIZES",
    "CUDA_MEMORY_BUDGET",
    "EPILOGUE_BUDGET",
    "EPILOGUE_INSTRUCTIONS",
    "H200",
    "HEAD_TILE_BUDGET",
    "OBJECTIVE_LAUNCHES",
    "PATHS",
    "REFERENCE_SHAPE",
    "ROW_CHUNK",
    "ROW_GRANULE",
    "SAMPLER_ROWS",
    "SAMPLER_SEARCH_PASSES",
    "SAMPLER_SLICE",
    "SAMPLER_TILE_BUDGET",
    "TARGET_OBJECTIVE_LAUNCHES",
    "VOCAB_TILE",
    "GpuPlan",
    "Hardware",
    "Pass",
    "batch_size_table",
    "format_passes",
    "format_report",
    "format_table",
    "gpu_plan",
    "reference_plans",
    "sampler_plan",
    "sampler_table",
    "wave_efficiency",
    "wave_rows",
]

PATHS = ("logprobs-nograd", "logprobs-fwd-bwd", "fused-policy-loss")
# The shape of the issue's targets: a 16k-token batch, Qwen-sized hidden and vocabulary.
REFERENCE_SHAPE = (16384, 4096, 151936)
# The micro-batch sizes trainers call the head with (issue 36), priced at D and V of
# REFERENCE_SHAPE by :func:`batch_size_table`.
BATCH_SIZES = (512, 1100, 2048, 3000, 4096, 8192, 16384)

# Epilogue arithmetic per logits element (fp32 vector FLOPs, exp counted as 4): the statistics
# pass (transform, running max, exp, sums of e, e z, e^2, z, target compare) and the dz pass
# (exp(z - lse), the entropy term, the upstream scale, the target's one-hot).
_STATS_FLOPS = 16
_DZ_FLOPS = 12
# Per-row state an epilogue reads and writes: the seven fp32 partials, or lse, entropy and
# the per-token upstream gradients.
_ROW_STATE_BYTES = 7 * 4
# What a path holds per token for its whole duration: statistics, results, targets, per-token
# gradients and the saved forward state (fp32 or int64 each).
_ROW_HELD_BYTES = 64
# The objective on a chunk's (lp, H): policy_loss forward and backward on per-token grids,
# small kernels reading and writing a few fp32 values per token. 24 launches: the 29 an extra
# chunk adds with the objective compiled by inductor (fused/chunk_objective.py;
# benchmarks/chunk_ops.py, GRPO with a KL term and an entropy bonus; 25 for plain GRPO;
# 98-127 eager) less its three GEMMs and its gather and scatter of hidden rows, which the plan
# counts as passes of their own.
# Counted on CPU: inductor's CUDA kernel count is not measured yet.
OBJECTIVE_LAUNCHES = 24
# Issue 22's target of 30 compute ops per extra chunk, less those five.
TARGET_OBJECTIVE_LAUNCHES = 25
_OBJECTIVE_BYTES_PER_ROW = 256

# Warp instructions per logits element in each streaming epilogue's column loop: loop
# instructions x warps / columns per iteration, read off the sm_90 SASS of the bf16 kernels at
# V=151936 under triton 3.6.0 (``python -m logitless.tools.sass``; docs/gpu.md, "SASS
# report"). tests/tools/test_sass.py checks them against a fresh compile.
EPILOGUE_INSTRUCTIONS = {
    "head_stats": 81 * 8 / 2048,
    "head_grad": 120 * 8 / 2048,
    "fused_stats": 81 * 8 / 2048,
    "fused_grad": 120 * 8 / 2048,
    # the sampler's passes (kernels/sampler.py): the transform (bf16 read, fp32 written), the
    # search's mass and count passes and the statistics pass (fp32 read), the backward's
    # tie-cut pass (bf16 read) and dx pass (bf16 read and written)
    "sampler_transform": 126 * 8 / 1024,
    "sampler_fan_mass": 80 * 8 / 1024,
    "sampler_fan_count": 72 * 8 / 1024,
    "sampler_stats": 170 * 8 / 2048,
    "sampler_cut": 159 * 8 / 4096,
    "sampler_grad": 172 * 8 / 2048,
}
# The most each may issue and stay memory-bound (issue time under 75% of HBM time): 0.18 x the
# bytes the pass moves per element, 2 for a pass that reads bf16 logits, 4 for one that reads
# and writes them (docs/gpu.md, "SASS report"; issue 22's target).
EPILOGUE_BUDGET = {"head_stats": 0.36, "head_grad": 0.72, "fused_stats": 0.36,
                   "fused_grad": 0.72, "sampler_transform": 1.08, "sampler_fan_mass": 0.72,
                   "sampler_fan_count": 0.72, "sampler_stats": 0.72, "sampler_cut": 0.36,
                   "sampler_grad": 0.72}

# The sampler's CUDA path (kernels/sampler.py; its rows per chunk, slice and budget are
# kernels/constants.py's): the search's passes per dtype (8 trials a pass divide the range by 9:
# 11 passes over fp32 keys; 16-bit logits without a softcap search their own values, 6 passes).
# The backward's chunks per tile are its budget over a chunk's bf16 logits, rows padded to 4096
# columns.
SAMPLER_SEARCH_PASSES = {"bfloat16": 6, "float16": 6, "float32": 11}
# Small launches besides the Triton passes, counted with tools.launches.LaunchCount on CPU
# (bf16, top-p alone, logprobs' gradient): per chunk of the forward, the [R]-sized torch ops
# of the top-p cut, the search's settle launch and the one launch that merges the statistics
# pass and writes the outputs (``sampler_extra_chunk``; the search merges are Triton launches
# of their own), and once per backward, the two per-row value cuts (one Triton launch) and
# their setup.
SAMPLER_ROW_OPS = 54
SAMPLER_CUT_OPS = 4




_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# The H100 SXM: the same GH100 compute as the H200 (so the H200's measured bf16 rate and the
# datasheet's ratios: TF32 dense at half of bf16, 67 TFLOP/s fp32 on the CUDA cores), with the
# H100's 3.35 TB/s HBM3 derated by the H200's measured share of its own datasheet figure
# (4.3 of 4.8 TB/s).
H100 = Hardware("H100", 790e12, 395e12, 67e12, 3.35e12 * 4.3 / 4.8, 5e-6)

# ``head_dtype``'s GEMM rate: "float32" runs IEEE fp32 on the CUDA cores (torch's default fp32
# matmul precision), "tf32" on the tensor cores in TF32.
_HEAD_DTYPE_RATE = {"float32": "vector_flops", "tf32": "tf32_flops"}


@dataclasses.dataclass(frozen=True)
class Pass:
    """One kind of launch of a plan, summed over its launches: ``unit`` is ``"matmul"`` (cuBLAS
    on the tensor cores) or ``"vector"`` (a Triton or torch elementwise pass)."""

    name: str
    unit: str
    launches: int
    flops: int
    bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """A path's plan for one shape: its chunks and tiles, its passes, and its plain GEMMs.

    ``chunk_rows`` is the largest row chunk (chunks are evened out: sizes differ by at most
    one row) and ``chunks`` their number; ``vocab_tile`` the columns per tile (the whole
    vocabulary for the fused loss, whose chunk stores all of it). ``extra_bytes`` is the peak
    memory beyond inputs and their gradients, ``accumulator_bytes`` the part of it that is the
    fp32 weight-gradient accumulator (fused loss with bf16/fp16 inputs; 0 otherwise).
    """

    path: str
    n: int
    d: int
    v: int
    dtype: str
    memory_budget: int
    chunk_rows: int
    chunks: int
    vocab_tile: int
    vocab_tiles: int
    passes: tuple[Pass, ...]
    gemm_floor: tuple[Pass, ...]
    extra_bytes: int
    accumulator_bytes: int
    head_dtype: str | None = None

    @property
    def flops(self) -> int:
        return sum(p.flops for p in self.passes)

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.passes)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.passes)

    @property
    def floor_seconds(self) -> float:
        return sum(p.seconds for p in self.gemm_floor)

    @property
    def ratio(self) -> float:
        """Predicted time over the predicted time of the path's plain GEMMs."""
        return self.seconds / self.floor_seconds


class _Passes:
    """Launches added one group at a time, summed per pass name in order of first appearance."""

    def __init__(self, hw: Hardware, matmul_flops: float, epilogues: dict | None = None,
                 objective_launches: int = 0):
        self.hw, self.matmul_flops = hw, matmul_flops
        self.epilogues = EPILOGUE_INSTRUCTIONS if epilogues is None else epilogues
        self.objective_launches = objective_launches
        self.totals: dict[str, list] = {}

    def add(self, name: str, unit: str, flops: int, nbytes: int, launches: int = 1, *,
            out: tuple[int, int] | None = None, instructions: float = 0.0) -> None:
        """``launches`` launches of ``flops`` FLOPs and ``nbytes`` bytes each; a GEMM's ``out``
        shape derates its rate by :func:`wave_efficiency`; ``instructions``: warp instructions
        each launch issues (an epilogue's loop)."""
        if unit == "matmul":
            rate = self.matmul_flops * (wave_efficiency(*out, self.hw) if out else 1.0)
        else:
            rate = self.hw.vector_flops
        each = max(flops / rate, nbytes / self.hw.bandwidth,
                   instructions / self.hw.issue_rate) + self.hw.launch_seconds
        t = self.totals.setdefault(name, [unit, 0, 0, 0, 0.0])
        t[1] += launches
        t[2] += launches * flops
        t[3] += launches * nbytes
        t[4] += launches * each

    def result(self) -> tuple[Pass, ...]:
        return tuple(Pass(name, *t) for name, t in self.totals.items())


def _even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """``total`` rows in ``parts`` chunks differing by at most one: ``(size, count)`` pairs."""
    q, r = divmod(total, parts)
    return [(s, c) for s, c in ((q + 1, r), (q, parts - r)) if c]


def _tiles(v: int, tile: int) -> list[tuple[int, int]]:
    """Vocabulary tiles of ``tile`` columns, the last one partial: ``(width, count)`` pairs."""
    full, rest = divmod(v, tile)
    return [(w, c) for w, c in ((tile, full), (rest, 1)) if w and c]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _ELEMENT_BYTES:
        raise ValueError(f"dtype must be one of {tuple(_ELEMENT_BYTES)} (or the torch dtype), "
                         f"got {dtype!r}")
    return name


def gpu_plan(n: int, d: int, v: int, dtype="bfloat16", path: str = "fused-policy-loss",
             memory_budget: int | None = None, *, vocab_tile: int = VOCAB_TILE,
             row_chunk: int = ROW_CHUNK, row_granule: int = ROW_GRANULE,
             hardware: Hardware = H200,
             epilogues: dict[str, float] | None = None,
             objective_launches: int = OBJECTIVE_LAUNCHES,
             head_dtype: str | None = None) -> GpuPlan:
    """The plan and predicted cost of one GPU path for ``hidden [n, d]``, ``weight [v, d]``.

    Args:
        n, d, v: tokens, hidden size, vocabulary size (positive ints).
        dtype: the inputs' dtype, ``"bfloat16"``, ``"float16"`` or ``"float32"`` (or the torch
            dtype); logits tiles and stored chunks are kept in it.
        path: one of :data:`PATHS`.
        memory_budget: bytes. For the head paths, of its logits tile (default
            :data:`HEAD_TILE_BUDGET`); for the fused loss, of a chunk's stored logits and its
            gathered hidden and hidden-gradient rows (default :data:`CUDA_MEMORY_BUDGET`). It
            must hold at least one row.
        vocab_tile: vocabulary columns per head tile (positive int; the fused loss stores the
            whole vocabulary and ignores it).
        row_chunk: most rows of a head GEMM (positive int; a head tile holds at least one
            chunk; the fused loss ignores it).
        row_granule: the head's last, partial chunk is padded to a multiple of this many rows
            (positive int; ``row_chunk`` or more pads it to a whole chunk, 1 runs exact shapes;
            the fused loss pads nothing and ignores it).
        hardware: the rates the time is predicted at.
        epilogues: warp instructions per element of each streaming pass, by role (default
            :data:`EPILOGUE_INSTRUCTIONS`, today's compiled code; :data:`EPILOGUE_BUDGET`
            predicts the path with every epilogue at its budget).
        objective_launches: launches of the objective per fused chunk (positive int; default
            :data:`OBJECTIVE_LAUNCHES`, measured; issue 22's target is 30 compute ops a chunk
            in all).
        head_dtype: ``linear_logprobs``'s: None (the GEMMs in ``dtype``), ``"float32"``
            (every GEMM in IEEE fp32 on the CUDA cores, ``hardware.vector_flops``) or
            ``"tf32"`` (TF32 tensor cores, ``hardware.tf32_flops``); with either the head
            is upcast to fp32 first (a pass reading the inputs and writing fp32 copies of
            hidden and weight, held beyond the inputs) and the path then runs as for fp32
            inputs: fp32 logits tiles, stored chunks and operands.

    Returns:
        A :class:`GpuPlan`; ``plan.seconds`` is the predicted time, ``plan.ratio`` its ratio to
        the path's plain GEMMs.
    """
    n, d, v = _positive_int("n", n), _positive_int("d", d), _positive_int("v", v)
    dtype = _dtype_name(dtype)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    vocab_tile = _positive_int("vocab_tile", vocab_tile)
    row_chunk = _positive_int("row_chunk", row_chunk)
    row_granule = _positive_int("row_granule", row_granule)
    if memory_budget is None:
        memory_budget = CUDA_MEMORY_BUDGET if path == "fused-policy-loss" else HEAD_TILE_BUDGET
    memory_budget = _positive_int("memory_budget", memory_budget)
    e = _ELEMENT_BYTES[dtype]
    rate = hardware.tf32_flops if dtype == "float32" else hardware.matmul_flops
    if head_dtype is not None:
        if head_dtype not in _HEAD_DTYPE_RATE:
            raise ValueError(f"head_dtype must be None, 'float32' or 'tf32', got {head_dtype!r}")
        upcast = (e + 4) * (n + v) * d  # read the inputs, write their fp32 copies
        e, rate = 4, getattr(hardware, _HEAD_DTYPE_RATE[head_dtype])
    if epilogues is not None and set(epilogues) != set(EPILOGUE_INSTRUCTIONS):
        raise ValueError(f"epilogues must map each of {sorted(EPILOGUE_INSTRUCTIONS)} to warp "
                         f"instructions per element, got keys {sorted(epilogues)}")
    objective_launches = _positive_int("objective_launches", objective_launches)
    build = _fused_plan if path == "fused-policy-loss" else _head_plan
    passes = _Passes(hardware, rate, epilogues, objective_launches)
    if head_dtype is not None:
        passes.add("upcast hidden and weight to fp32", "vector", 0, upcast)
    fields = build(n, d, v, e, path, memory_budget, min(vocab_tile, v), passes, row_chunk,
                   row_granule)
    if head_dtype is not None:
        fields["extra_bytes"] += 4 * (n + v) * d
    floor = _Passes(hardware, rate)
    for name, out in _FLOOR_GEMMS[path]:
        floor.add(name, "matmul", 2 * n * d * v, e * (n * d + v * d + n * v),
                  out={"logits": (n, v), "hidden": (n, d), "weight": (v, d)}[out])
    return GpuPlan(path=path, n=n, d=d, v=v, dtype=dtype, memory_budget=memory_budget,
                   gemm_floor=floor.result(), head_dtype=head_dtype, **fields)


# Each plain GEMM and which output it writes.
_FLOOR_GEMMS = {
    "logprobs-nograd": (("logits", "logits"),),
    "logprobs-fwd-bwd": (("logits", "logits"), ("logits again", "logits"),
                         ("dz @ W", "hidden"), ("dz^T @ hidden", "weight")),
    "fused-policy-loss": (("logits", "logits"), ("dz @ W", "hidden"),
                          ("dz^T @ hidden", "weight")),
}


def _rows_within(budget: int, row_bytes: int, what: str) -> int:
    rows = budget // row_bytes
    if rows == 0:
        raise ValueError(f"memory_budget must hold at least one row of {what} ({row_bytes} "
                         f"bytes), got {budget}")
    return rows


def _head_plan(n, d, v, e, path, budget, tile, passes: _Passes, row_chunk, granule) -> dict:
    """linear_logprobs: vocabulary tiles of ``tile`` columns; rows cut into chunks of
    ``row_chunk`` (one GEMM each), the last padded to a multiple of ``granule``
    (``row_blocks``), chunks grouped within ``budget`` (at least one a group)."""
    _rows_within(budget, tile * e, f"a {tile}-column logits tile")
    blocks = list(row_blocks(n, row_chunk, granule))
    n_chunks = len(blocks)
    n_pad = blocks[-1][0] + blocks[-1][2]
    per_group = max(1, budget // (tile * e * row_chunk))
    groups = math.ceil(n_chunks / per_group)
    group_chunks, tiles = _even_split(n_chunks, groups), _tiles(v, tile)
    backward = path == "logprobs-fwd-bwd"
    # bf16/fp16 gradients accumulate in fp32 buffers; fp32 ones accumulate in place.
    fp32_acc = e < 4
    first = 0
    for k, gc in group_chunks:
        for _ in range(gc):
            chunks = blocks[first:first + k]
            first += k
            real = sum(b[1] for b in chunks)
            r = sum(b[2] for b in chunks)  # the group's rows, its padding included
            for w, tc in tiles:
                for *_, c in chunks:
                    passes.add("logits GEMM", "matmul", 2 * c * d * w,
                               e * (c * d + w * d + c * w), tc, out=(c, w))
                passes.add("statistics pass", "vector", _STATS_FLOPS * real * w,
                           e * real * w + 2 * _ROW_STATE_BYTES * real, tc,
                           instructions=passes.epilogues["head_stats"] * real * w)
                if not backward:
                    continue
                for *_, c in chunks:
                    passes.add("logits GEMM again", "matmul", 2 * c * d * w,
                               e * (c * d + w * d + c * w), tc, out=(c, w))
                passes.add("dz pass (in place)", "vector", _DZ_FLOPS * r * w,
                           2 * e * r * w + _ROW_STATE_BYTES * r, tc,
                           instructions=passes.epilogues["head_grad"] * r * w)
                for *_, c in chunks:
                    passes.add("d_hidden += dz @ W_tile", "matmul", 2 * c * w * d,
                               e * (c * w + w * d) + 2 * 4 * c * d, tc, out=(c, d))
                # written once with one row group; else summed over the groups in an fp32 tile
                out = e * w * d if groups == 1 else 2 * 4 * w * d
                passes.add("d_weight[tile] = dz^T @ hidden", "matmul", 2 * r * w * d,
                           e * (r * w + r * d) + out, tc, out=(w, d))
    passes.add("finish statistics", "vector", 8 * n, _ROW_STATE_BYTES * n + _ROW_HELD_BYTES * n)
    group_rows = min(group_chunks[0][0] * row_chunk, n_pad)
    extra = group_rows * tile * e + _ROW_HELD_BYTES * n
    if n_pad != n:  # hidden copied, its last chunk padded
        passes.add("pad hidden (last chunk)", "vector", 0, 2 * e * n_pad * d)
        extra += e * n_pad * d
    if backward and fp32_acc:
        passes.add("d_hidden fp32 -> dtype", "vector", 0, (4 + e) * n * d)
        extra += 4 * n_pad * d
        if groups > 1:
            for w, tc in tiles:
                passes.add("d_weight tile fp32 -> dtype", "vector", 0, (4 + e) * w * d, tc)
            extra += 4 * tile * d
    return dict(chunk_rows=group_rows, chunks=groups, vocab_tile=tile,
                vocab_tiles=sum(c for _, c in tiles), passes=passes.result(),
                extra_bytes=extra, accumulator_bytes=0)


def _fused_plan(n, d, v, e, path, budget, tile, passes: _Passes, row_chunk, granule) -> dict:
    """fused_policy_loss: evened-out chunks of rows, each storing its ``[rows, V]`` logits."""
    row_bytes = e * (v + 2 * d)  # stored logits, gathered hidden row, hidden-gradient row
    cap = wave_rows(_rows_within(budget, row_bytes, "stored logits and hidden rows"), d,
                    passes.hw)
    chunks = math.ceil(n / cap)
    row_groups = _even_split(n, chunks)
    fp32_acc = e < 4
    first = True
    for r, rc in row_groups:
        passes.add("gather hidden rows", "vector", 0, 2 * e * r * d, rc)
        passes.add("logits GEMM", "matmul", 2 * r * d * v, e * (r * d + v * d + r * v), rc,
                   out=(r, v))
        passes.add("statistics pass", "vector", _STATS_FLOPS * r * v,
                   e * r * v + 2 * _ROW_STATE_BYTES * r, rc,
                   instructions=passes.epilogues["fused_stats"] * r * v)
        launches = passes.objective_launches
        passes.add("objective on (lp, H)", "vector", 0,
                   _OBJECTIVE_BYTES_PER_ROW * r // launches, rc * launches)
        passes.add("dz pass (in place)", "vector", _DZ_FLOPS * r * v,
                   2 * e * r * v + _ROW_STATE_BYTES * r, rc,
                   instructions=passes.epilogues["fused_grad"] * r * v)
        passes.add("d_hidden rows = dz @ W", "matmul", 2 * r * v * d,
                   e * (r * v + v * d + r * d), rc, out=(r, d))
        # the first chunk writes the fp32 accumulator, every later one reads and writes it
        later = rc - 1 if first else rc
        grad = e * (r * v + r * d)
        if first:
            passes.add("d_weight += dz^T @ hidden", "matmul", 2 * r * v * d, grad + 4 * v * d,
                       out=(v, d))
        if later:
            passes.add("d_weight += dz^T @ hidden", "matmul", 2 * r * v * d,
                       grad + 2 * 4 * v * d, later, out=(v, d))
        first = False
        passes.add("scatter hidden-gradient rows", "vector", 0, 2 * e * r * d, rc)
    passes.add("objective on all rows (value, metrics)", "vector", 0,
               _OBJECTIVE_BYTES_PER_ROW * n // passes.objective_launches,
               passes.objective_launches)
    if fp32_acc:
        passes.add("d_weight fp32 -> dtype", "vector", 0, (4 + e) * v * d)
    passes.add("scale gradients by the upstream gradient", "vector", 0,
               2 * e * (v * d + n * d), 2)
    accumulator = 4 * v * d if fp32_acc else 0
    chunk_rows = row_groups[0][0]
    return dict(chunk_rows=chunk_rows, chunks=chunks, vocab_tile=v, vocab_tiles=1,
                passes=passes.result(),
                extra_bytes=chunk_rows * row_bytes + _ROW_HELD_BYTES * n + accumulator,
                accumulator_bytes=accumulator)


def sampler_plan(n: int, d: int, v: int, dtype="bfloat16", *, hardware: Hardware = H200,
                 epilogues: dict[str, float] | None = None) -> GpuPlan:
    """The sampler's top-p forward and backward (``linear_logprobs(top_p=...)``'s CUDA path,
    vLLM's rules, the logprob's gradient) for ``hidden [n, d]``, ``weight [v, d]``.

    Per :data:`SAMPLER_ROWS`-row chunk (the last padded to a multiple of :data:`ROW_GRANULE`
    rows): one GEMM of the whole head, the transform pass writing the tempered fp32 logits,
    the candidates' mass, the search passes (:data:`SAMPLER_SEARCH_PASSES`: 6 in a 16-bit
    dtype's own values, 11 over fp32 keys) and the mass above the cut (8 or 13 mass passes,
    each reading the fp32 logits; a pass is a program per row and :data:`SAMPLER_SLICE`-column
    slice), the statistics pass, and the small merges. Backward, per tile of chunks: the
    GEMMs again, the tie-cut and dx passes, ``d_hidden`` per chunk into an fp32 accumulator
    and ``d_weight`` per tile into the fp32 ``[V, D]`` accumulator (written by the first
    tile, read and written by the others). The plain GEMMs are the head's four."""
    n, d, v = _positive_int("n", n), _positive_int("d", d), _positive_int("v", v)
    dtype = _dtype_name(dtype)
    e = _ELEMENT_BYTES[dtype]
    rate = hardware.tf32_flops if dtype == "float32" else hardware.matmul_flops
    if epilogues is not None and set(epilogues) != set(EPILOGUE_INSTRUCTIONS):
        raise ValueError(f"epilogues must map each of {sorted(EPILOGUE_INSTRUCTIONS)} to warp "
                         f"instructions per element, got keys {sorted(epilogues)}")
    passes = _Passes(hardware, rate, epilogues)
    ins = passes.epilogues
    r = SAMPLER_ROWS
    blocks = list(row_blocks(n, r, ROW_GRANULE))  # the last chunk padded to the granule
    chunks = len(blocks)
    n_pad = blocks[-1][0] + blocks[-1][2]
    span = -(-v // 4096) * 4096
    slices = math.ceil(v / SAMPLER_SLICE)
    search = SAMPLER_SEARCH_PASSES[dtype]
    for *_, r in blocks:
        rv = r * v
        passes.add("logits GEMM", "matmul", 2 * r * d * v, e * (r * d + v * d + rv), out=(r, v))
        passes.add("transform pass (tempered fp32 copy)", "vector", 4 * rv,
                   e * rv + 4 * r * span, instructions=ins["sampler_transform"] * r * span)
        passes.add(f"mass passes (total, {search} search passes, above the cut)", "vector",
                   12 * rv, 4 * r * span, search + 2,
                   instructions=ins["sampler_fan_mass"] * r * span)
        passes.add("search merges (Triton, per pass)", "vector", 0, 4 * 8 * r * slices,
                   search)
        passes.add("statistics pass", "vector", 12 * rv, 4 * r * span,
                   instructions=ins["sampler_stats"] * r * span)
        passes.add("row merges (torch, [R]-sized)", "vector", 0, 64 * r, SAMPLER_ROW_OPS)
    r = SAMPLER_ROWS
    per_tile = max(1, SAMPLER_TILE_BUDGET // (r * span * e))
    tiles = _even_split(chunks, math.ceil(chunks / per_tile))
    passes.add("value cuts (bisection, [N])", "vector", 0, 32 * n, SAMPLER_CUT_OPS)
    first = True
    at = 0
    for k, count in tiles:
        for _ in range(count):
            heights = [b[2] for b in blocks[at:at + k]]
            at += k
            g = sum(heights)
            for c in heights:
                passes.add("logits GEMM again", "matmul", 2 * c * d * v,
                           e * (c * d + v * d + c * v), out=(c, v))
            passes.add("tie-cut pass", "vector", 2 * g * v, e * g * v,
                       instructions=ins["sampler_cut"] * g * span)
            passes.add("dx pass (in place)", "vector", 12 * g * v, 2 * e * g * v,
                       instructions=ins["sampler_grad"] * g * span)
            for c in heights:
                passes.add("d_hidden += dx @ W", "matmul", 2 * c * v * d,
                           e * (c * v + v * d) + 2 * 4 * c * d, out=(c, d))
            acc = 4 * v * d if first else 2 * 4 * v * d
            first = False
            passes.add("d_weight += dx^T @ hidden", "matmul", 2 * g * v * d,
                       e * (g * v + g * d) + acc, out=(v, d))
    if n_pad != n:
        passes.add("pad hidden (last chunk)", "vector", 0, 2 * e * n_pad * d)
    if e < 4:
        passes.add("d_hidden, d_weight fp32 -> dtype", "vector", 0, (4 + e) * (n * d + v * d),
                   2)
    floor = _Passes(hardware, rate)
    for name, out in _FLOOR_GEMMS["logprobs-fwd-bwd"]:
        floor.add(name, "matmul", 2 * n * d * v, e * (n * d + v * d + n * v),
                  out={"logits": (n, v), "hidden": (n, d), "weight": (v, d)}[out])
    k0 = tiles[0][0]
    extra = r * span * (e + 4) + k0 * r * span * e + 4 * (n_pad * d + v * d) \
        + _ROW_HELD_BYTES * n
    return GpuPlan(path="sampler-top-p", n=n, d=d, v=v, dtype=dtype,
                   memory_budget=SAMPLER_TILE_BUDGET, chunk_rows=r, chunks=chunks,
                   vocab_tile=v, vocab_tiles=1, passes=passes.result(),
                   gemm_floor=floor.result(), extra_bytes=extra, accumulator_bytes=4 * v * d)


def sampler_table(hardware: Hardware = H200) -> str:
    """The sampler's top-p row at :data:`REFERENCE_SHAPE` (bf16) beside the plain head's
    forward and backward: its ratio to its four plain GEMMs and to the head (issue 22's
    target: at most 1.5x the head), for today's compiled passes and at their budgets."""
    n, d, v = REFERENCE_SHAPE
    lines = ["| passes | sampler top-p fwd+bwd | plain GEMMs | ratio | head fwd+bwd "
             "| sampler / head | measured |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for label, ep in (("compiled today", None), ("at their budget", EPILOGUE_BUDGET)):
        sp = sampler_plan(n, d, v, "bfloat16", hardware=hardware, epilogues=ep)
        head = gpu_plan(n, d, v, "bfloat16", "logprobs-fwd-bwd", hardware=hardware,
                        epilogues=ep)
        lines.append(f"| {label} | {sp.seconds * 1e3:.1f} ms | {sp.floor_seconds * 1e3:.1f} ms "
                     f"| {sp.ratio:.3f}x | {head.seconds * 1e3:.1f} ms "
                     f"| {sp.seconds / head.seconds:.3f}x | not run |")
    return "\n".join(lines)


def reference_plans(budgets=(256 * 2**20, CUDA_MEMORY_BUDGET, 2**30),
                    hardware: Hardware = H200, *, targets: bool = False) -> list[GpuPlan]:
    """The plans of the docs' table: at :data:`REFERENCE_SHAPE` in bf16, the head without and
    with its backward at its default tile, and the fused loss at each of ``budgets``. With
    ``targets``, as predicted once issue 22's targets are met: every epilogue at
    :data:`EPILOGUE_BUDGET` and :data:`TARGET_OBJECTIVE_LAUNCHES` per fused chunk."""
    n, d, v = REFERENCE_SHAPE
    knobs = dict(hardware=hardware)
    if targets:
        knobs.update(epilogues=EPILOGUE_BUDGET, objective_launches=TARGET_OBJECTIVE_LAUNCHES)
    plans = [gpu_plan(n, d, v, "bfloat16", p, **knobs)
             for p in ("logprobs-nograd", "logprobs-fwd-bwd")]
    return plans + [gpu_plan(n, d, v, "bfloat16", "fused-policy-loss", b, **knobs)
                    for b in budgets]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def _layout(p: GpuPlan) -> str:
    if p.path == "fused-policy-loss":
        return f"{p.chunks} chunk(s) of <= {p.chunk_rows} rows, all {p.v} columns stored"
    return (f"{p.chunks} group(s) of <= {p.chunk_rows} rows x {p.vocab_tiles} tiles of "
            f"<= {p.vocab_tile} columns")


def format_table(plans: list[GpuPlan]) -> str:
    """A markdown table of ``plans``: layout, predicted time, ratio to the plain GEMMs, peak
    memory beyond inputs and gradients, and a column for the measured time (none yet)."""
    lines = [
        "| path | budget (tile or chunk) | plan | plain GEMMs | predicted | ratio "
        "| beyond inputs and gradients | of which fp32 weight-grad accumulator | measured |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for p in plans:
        acc = _mib(p.accumulator_bytes) if p.accumulator_bytes else "-"
        lines.append(
            f"| {p.path} | {_mib(p.memory_budget)} | {_layout(p)} "
            f"| {p.floor_seconds * 1e3:.1f} ms | {p.seconds * 1e3:.1f} ms | {p.ratio:.3f}x "
            f"| {_mib(p.extra_bytes)} | {acc} | not run |")
    return "\n".join(lines)


def batch_size_table(ns=BATCH_SIZES, hardware: Hardware = H200) -> str:
    """Each path at each micro-batch size of ``ns`` (D and V of :data:`REFERENCE_SHAPE`, bf16,
    default budgets): the rows its GEMMs run, its predicted time, the same plan at exact shapes
    (``row_granule=1``: no row padded), their ratio (issue 36's target: at most 1.06 at every
    N >= 1024), that ratio with the last chunk padded to a whole ``ROW_CHUNK`` instead of
    ``ROW_GRANULE`` rows (the head before issue 36), and the ratio to the plain GEMMs."""
    _, d, v = REFERENCE_SHAPE
    lines = ["| path | N | GEMM rows | predicted | exact shapes | over exact "
             "| last chunk whole: over exact | over plain GEMMs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for path in PATHS:
        for n in ns:
            plan, exact, whole = (gpu_plan(n, d, v, "bfloat16", path, hardware=hardware,
                                           row_granule=g)
                                  for g in (ROW_GRANULE, 1, ROW_CHUNK))
            rows = n if path == "fused-policy-loss" else \
                sum(b[2] for b in row_blocks(n, ROW_CHUNK, ROW_GRANULE))
            lines.append(f"| {path} | {n} | {rows} | {plan.seconds * 1e3:.2f} ms "
                         f"| {exact.seconds * 1e3:.2f} ms | {plan.seconds / exact.seconds:.3f}x "
                         f"| {whole.seconds / exact.seconds:.3f}x | {plan.ratio:.3f}x |")
    return "\n".join(lines)


def head_dtype_table(hardwares=(H100, H200)) -> str:
    """The head's precision at :data:`REFERENCE_SHAPE` (bf16 inputs, default budgets): each
    path with ``head_dtype`` None (bf16 GEMMs), ``"tf32"`` and ``"float32"`` on each of
    ``hardwares``: predicted time, its ratio to the bf16 head's, and the memory held beyond
    inputs and gradients."""
    n, d, v = REFERENCE_SHAPE
    lines = ["| GPU | path | head_dtype | GEMM rate | predicted | over bf16 head "
             "| beyond inputs and gradients |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for hw in hardwares:
        for path in ("logprobs-fwd-bwd", "fused-policy-loss"):
            base = gpu_plan(n, d, v, "bfloat16", path, hardware=hw)
            for head_dtype in (None, "tf32", "float32"):
                p = gpu_plan(n, d, v, "bfloat16", path, hardware=hw, head_dtype=head_dtype)
                rate = (hw.matmul_flops if head_dtype is None
                        else getattr(hw, _HEAD_DTYPE_RATE[head_dtype]))
                lines.append(f"| {hw.name} | {path} | {head_dtype or 'None (bf16)'} "
                             f"| {rate / 1e12:.0f} TFLOP/s | {p.seconds * 1e3:.1f} ms "
                             f"| {p.seconds / base.seconds:.2f}x | {_mib(p.extra_bytes)} |")
    return "\n".join(lines)


def format_passes(plan: GpuPlan) -> str:
    """A markdown table of one plan's passes, then its plain GEMMs: launches, FLOPs, bytes and
    predicted time."""
    lines = ["| pass | unit | launches | TFLOP | GB | predicted |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for p in (*plan.passes, *(dataclasses.replace(g, name=f"plain: {g.name}")
                              for g in plan.gemm_floor)):
        lines.append(f"| {p.name} | {p.unit} | {p.launches} | {p.flops / 1e12:.2f} "
                     f"| {p.bytes / 1e9:.2f} | {p.seconds * 1e3:.2f} ms |")
    return "\n".join(lines)


def format_report(hardware: Hardware = H200) -> str:
    """The tables of ``docs/gpu.md``: :func:`reference_plans` side by side, then the passes of
    each path at its default budget."""
    n, d, v = REFERENCE_SHAPE
    parts = [f"N={n}, D={d}, V={v}, bfloat16, predicted on {hardware.name}, for today's "
             f"compiled epilogues and {OBJECTIVE_LAUNCHES} objective launches per fused "
             "chunk:", "", format_table(reference_plans(hardware=hardware)), "",
             "The same once the epilogues are at their instruction budget and a fused chunk "
             f"launches {TARGET_OBJECTIVE_LAUNCHES} objective ops (issue 22's targets):", "",
             format_table(reference_plans(hardware=hardware, targets=True))]
    defaults = [gpu_plan(n, d, v, "bfloat16", path, hardware=hardware) for path in PATHS]
    for plan in defaults:
        parts += ["", f"Passes of {plan.path} at its default budget "
                      f"({_mib(plan.memory_budget)}):", "", format_passes(plan)]
    parts += ["", f"Over the micro-batch sizes trainers call the head with (D={d}, V={v}, "
                  "bfloat16, default budgets; *exact shapes* is the same plan with no row "
                  f"padded, *last chunk whole* pads it to {ROW_CHUNK} rows):", "",
              batch_size_table(hardware=hardware)]
    sampler = sampler_plan(n, d, v, "bfloat16", hardware=hardware)
    parts += ["", "The sampler's top-p forward and backward (`linear_logprobs(top_p=0.9)`, "
                  f"{sampler.chunks} chunks of {sampler.chunk_rows} rows, one GEMM of the "
                  "whole head each):", "", sampler_table(hardware), "",
              "Passes of sampler-top-p:", "", format_passes(sampler)]
    parts += ["", "An fp32 or tf32 head (`head_dtype`; bf16 inputs upcast, fp32 logits), "
                  f"N={n}, D={d}, V={v}, on the H100 and the H200:", "", head_dtype_table()]
    return "\n".join(parts)
