"""How ``fused_policy_loss`` sizes its chunks on CUDA: the default memory budget and the chunk
height whose hidden-gradient GEMM fills whole waves of the chip.

The two numbers the runtime takes from the GPU cost model (``tools/gpu_plan.py``, which prices
every pass and writes the tables of ``docs/gpu.md``); the model itself, and its report, are
tooling and live in ``tools/``. Pure arithmetic: no tensor is made and no device is asked
anything.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["CUDA_MEMORY_BUDGET", "H200", "Hardware", "wave_efficiency", "wave_rows"]

# The default memory budget of ``fused_policy_loss`` on CUDA, in bytes: the smallest power of
# two at which the model puts the fused loss within issue 22's 1.15x of its three GEMMs at the
# reference shape once its targets are met (epilogues at their instruction budget, 25
# objective launches a chunk): 1.11x in 16 chunks of 1024 rows; 256 MiB gives 1.24x. With
# today's compiled epilogues and 90 launches a chunk the model says 1.21x. Fixed, not a
# fraction of free memory: the chunking must not depend on what the caching allocator happens
# to hold.
CUDA_MEMORY_BUDGET = 512 * 2**20


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Rates of one GPU: FLOP/s of the tensor cores (bf16/fp16, and TF32 for fp32 inputs) and of
    the fp32 vector units, HBM bytes/s (read plus write), and seconds each launch adds (the
    kernel's ramp-up and tail, and the host's launch when it cannot run ahead)."""

    name: str
    matmul_flops: float
    tf32_flops: float
    vector_flops: float
    bandwidth: float
    launch_seconds: float
    sms: int = 132
    # warp instructions issued per second: 4 schedulers per SM, one each per cycle
    issue_rate: float = 132 * 4 * 1.98e9
    gemm_tile: tuple[int, int] = (128, 256)


# 790 TFLOP/s and 4.3 TB/s were measured on this workplace's H200 (8192^3 bf16 GEMM on random
# data; a device-to-device copy); TF32 at half the bf16 rate and 67 TFLOP/s fp32 vector are
# the datasheet's ratios; 5 us per launch is an estimate.
H200 = Hardware("H200", 790e12, 395e12, 67e12, 4.3e12, 5e-6)


def wave_efficiency(m: int, n: int, hardware: Hardware = H200) -> float:
    """The share of a GEMM's ``[m, n]`` output tiles' waves that is real output: ``m n /
    (waves x SMs x tile area)``, ``waves = ceil(tiles / SMs)``. 1.0 only for whole waves of
    whole tiles."""
    tm, tn = hardware.gemm_tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / hardware.sms)
    return m * n / (waves * hardware.sms * tm * tn)


def wave_rows(max_rows: int, d: int, hardware: Hardware = H200) -> int:
    """The fused loss's chunk height on CUDA: of the heights in ``(max_rows / 2, max_rows]``
    (whole 128-row tiles, and ``max_rows`` itself), the one whose ``[rows, d]`` hidden-gradient
    GEMM (``dz @ W``, the chunk's only GEMM with a small output) fills its waves best, the
    tallest of equals. The other two GEMMs of a chunk have ``V``-wide outputs, hundreds of tiles
    a row: any height fills their waves. At D=4096 a 1639-row cap gives 1024 rows (128 tiles on
    132 SMs, 97%) where 1639 rows would be 208 tiles, 1.58 waves (79%)."""
    tm = hardware.gemm_tile[0]
    heights = {max_rows, *range(tm * (max_rows // (2 * tm) + 1), max_rows + 1, tm)}
    return max(heights, key=lambda r: (round(wave_efficiency(r, d, hardware), 6), r))
