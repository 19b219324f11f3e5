"""Compile a Triton kernel for sm_90 (Hopper) without a GPU.

Tests marked ``compile_sm90`` call :func:`compile_sm90` on every kernel of a kernel file with
the configurations the launchers use; ``tests/kernels/test_compile_triton36.py`` reruns them
under triton 3.6.0 (the version on the lent H200). Compilation runs the whole Triton pipeline
down to a cubin with ``ptxas``, so layout, shared-memory and register problems show up here.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object],
                 num_warps: int = 4, num_stages: int = 3):
    """Compile ``kernel`` (a ``@triton.jit`` function, or an autotuned one) for sm_90.

    ``signature`` maps every non-constexpr argument to its Triton type (``"*bf16"``,
    ``"i32"``, ``"fp32"``...); ``constexprs`` gives every ``tl.constexpr`` argument's value.
    Returns the compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``).
    """
    fn = kernel
    while not isinstance(fn, JITFunction):  # unwrap @triton.autotune / @triton.heuristics
        fn = fn.fn
    full = dict(signature)
    full.update({name: "constexpr" for name in constexprs})
    src = ASTSource(fn=fn, signature=full, constexprs=dict(constexprs))
    return triton.compile(src, target=SM90,
                          options={"num_warps": num_warps, "num_stages": num_stages})
