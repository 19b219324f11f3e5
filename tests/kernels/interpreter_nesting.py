"""Run by ``test_interpreter_triton36.py`` in a process of its own with ``TRITON_INTERPRET=1``
(Triton decides whether a kernel is interpreted when its module is imported): launches a
kernel with and without nested ``@triton.jit`` helper calls at 8 and 16 programs, counts the
interpreter's language patches per launch and prints them as JSON, with whether the results
were right and the language was restored after."""

import json

import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from logitless.kernels import interpreter_compat


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _plain_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + cols, tl.load(x_ptr + cols) * 2.0)


@triton.jit
def _nested_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = _twice(tl.load(x_ptr + cols))
    tl.store(out_ptr + cols, _twice(x) * 0.5 + tl.max(x, 0) * 0.0)


def main() -> None:
    assert interpreter_compat.apply()
    patched = []
    builtin = interpreter._patch_builtin
    interpreter._patch_builtin = lambda *a, **k: patched.append(1) or builtin(*a, **k)
    x = torch.randn(128)
    counts, right = {}, True
    for kernel in (_plain_kernel, _nested_kernel):
        for programs in (8, 16):
            out = torch.empty_like(x)
            before = len(patched)
            kernel[(programs,)](x, out, BLOCK=8)
            counts[f"{kernel.__name__}/{programs}"] = len(patched) - before
            n = programs * 8
            right &= torch.equal(out[:n], x[:n] * 2.0)
    restored = tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.core.tensor.__add__)
    print(json.dumps({"counts": counts, "right": bool(right), "restored": bool(restored)}))


if __name__ == "__main__":
    main()
