"""The CUDA launchers' tiling, written once: the Triton kernels and their torch twins bind their
shapes from here, and the GPU cost model (``tools/gpu_plan.py``) prices the same shapes. Plain
numbers and the row plan they make (``row_blocks``), no Triton or torch import, so the cost
model reads them on any machine.

Tests shrink a kernel's own binding (``linear_softmax.VOCAB_TILE``, ``sampler.SLICE_COLS``, ...) to
cross its boundaries at small shapes; the values here are the shipped ones.
"""

__all__ = ["HEAD_TILE_BUDGET", "ROW_CHUNK", "ROW_GRANULE", "SAMPLER_ROWS", "SAMPLER_SLICE",
           "SAMPLER_TILE_BUDGET", "VOCAB_TILE", "row_blocks"]

# The head (kernels/linear_softmax.py, and kernels/divergence.py on the same plan).
# Vocabulary columns per tile: fixed, so tile boundaries (and the fold order of the statistics)
# never depend on N (batch invariance), and wide enough that a tile's 1024-row GEMM fills the
# chip (8 x 32 output tiles of 128 x 256).
VOCAB_TILE = 8192
# Most rows of a head GEMM: N is cut into chunks of this many rows, one GEMM each (a chunk's
# 8192-column tile fills the chip: 8 x 32 output tiles of 128 x 256 on 132 SMs).
ROW_CHUNK = 1024
# The last, partial chunk is padded with zero rows to a multiple of this many (the GEMM tile's
# height), never to a whole chunk: a call pads at most ROW_GRANULE - 1 rows. Every head GEMM is
# then one of ROW_CHUNK / ROW_GRANULE heights (128, 256, ..., 1024) per tile width, a finite
# family on which a row's bits must not depend on the height (docs/gpu.md, "Determinism and
# batch invariance"; benchmarks/gpu/invariance.py checks every height on a device).
ROW_GRANULE = 128
# Default bytes of the head's logits tile (a row group of whole chunks by VOCAB_TILE columns in
# the input dtype): 16384 bf16 rows.
HEAD_TILE_BUDGET = 256 * 2**20

# The sampler (kernels/sampler.py and its twin kernels/sampler_torch.py).
# Most rows per chunk: one GEMM of the whole head each.
SAMPLER_ROWS = 1024
# Vocabulary columns per program of a pass (its slice; 19 slices at V=151936, so a 1024-row
# chunk's pass runs 19456 programs).
SAMPLER_SLICE = 8192
# Default budget of one chunk's buffers (and of the backward's tile): at V=151936 in bf16 a
# chunk of 1024 rows (its logits, 311 MB, and their tempered fp32 copy, 622 MB), so that every
# GEMM is 1024 rows tall and the head is read once per 1024 rows.
SAMPLER_TILE_BUDGET = 2**30


def row_blocks(n: int, rows: int, granule: int):
    """``(first row, real rows, padded rows)`` of each block of ``n`` rows cut into blocks of
    ``rows``: every block whole but the last, which is padded to a multiple of ``granule`` (of
    ``rows`` itself when ``granule`` is larger). From ``n``, ``rows`` and ``granule`` only: a
    row's block height depends on where the batch ends, never on the batch's other rows."""
    granule = min(granule, rows)
    for r0 in range(0, n, rows):
        real = min(rows, n - r0)
        yield r0, real, min(rows, -(-real // granule) * granule)
