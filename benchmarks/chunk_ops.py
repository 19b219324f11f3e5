"""Kernel launches per extra chunk of ``fused_policy_loss`` on the Triton store path, counted on
CPU: the same batch with budgets of k and k + 1 chunks under ``logitless.tools.launches.
LaunchCount`` (compute aten ops and Triton launches; views, allocations and the Triton
interpreter's own copies excluded), and the difference taken. On CUDA each counted op is a
kernel launch. Also counts what reads back to the host and the tensors made from Python data.
Each configuration twice: the chunk objective eager (op by op) and compiled as on CUDA (its
inductor kernels counted, here from inductor's C++ backend).

    TRITON_INTERPRET=1 LOGITLESS_BACKEND=triton python benchmarks/chunk_ops.py
"""

from __future__ import annotations

import json

from logitless.tools.launches import CHUNK_CONFIGS, extra_chunk


def main():
    print(json.dumps({f"{name} ({how})": extra_chunk(name, compiled=how == "compiled")
                      for name in CHUNK_CONFIGS for how in ("eager", "compiled")}, indent=1))


if __name__ == "__main__":
    main()
