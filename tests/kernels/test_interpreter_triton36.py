"""The Triton kernels under triton 3.6.0's CPU interpreter with this environment's numpy
(issue 22): triton 3.6 converts a runtime loop bound with ``int()`` of a one-element array,
which numpy >= 2.4 refuses; `kernels/interpreter_compat.py` converts the element instead."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from logitless.kernels import interpreter_compat

triton = pytest.importorskip("triton")
tl = triton.language

ROOT = Path(__file__).resolve().parents[2]
TRITON36 = ROOT / ".venv" / "triton-3.6.0"


class _Handle:
    def __init__(self, data):
        self.data = data


class _Scalar:
    def __init__(self, data):
        self.handle = _Handle(data)


def test_the_conversion_takes_the_one_element():
    assert interpreter_compat._index(_Scalar(np.array([7], dtype=np.int32))) == 7
    assert interpreter_compat._index(_Scalar(np.array(9, dtype=np.int64))) == 9


def test_apply_is_off_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert interpreter_compat.apply() is False


@pytest.mark.slow
def test_segment_and_head_kernels_run_under_the_triton_3_6_interpreter():
    import triton

    if triton.__version__ == "3.6.0":
        pytest.skip("this environment's triton is 3.6.0: the whole suite runs under it")
    if not (TRITON36 / "triton").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{TRITON36} is missing: `make setup` installs triton 3.6.0 there")
        pytest.skip(f"{TRITON36} is missing (make setup installs it)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TRITON36), str(ROOT / "src"), str(ROOT / "tests")])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         str(ROOT / "tests" / "kernels" / "test_segments_triton.py"),
         str(ROOT / "tests" / "kernels" / "test_stored_logits_triton.py")],
        env=env, capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


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


def test_nested_device_calls_do_not_repatch_the_language(monkeypatch):
    """Under the interpreter a launch patches ``triton.language`` once; the helpers it calls
    (ours and triton's own ``tl.max``) reuse that patch instead of listing every member of the
    language modules again per program and call. The results are the same, and the language
    is restored after the launch."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter runs only under TRITON_INTERPRET=1 (make test sets it)")
    import torch
    from triton.runtime import interpreter

    assert interpreter_compat.apply()
    patched = []
    builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin",
                        lambda *a, **k: patched.append(1) or builtin(*a, **k))
    x = torch.randn(128)
    counts = {}
    for kernel in (_plain_kernel, _nested_kernel):
        for programs in (8, 16):
            out = torch.empty_like(x)
            before = len(patched)
            kernel[(programs,)](x, out, BLOCK=8)
            counts[kernel.__name__, programs] = len(patched) - before
            n = programs * 8
            torch.testing.assert_close(out[:n], x[:n] * 2.0, rtol=0, atol=0)
    # a launch patches once, whatever its programs; its helpers (3 calls a program, each a
    # patch of 4-5 module lists before) add fewer patches than the 8 programs more (115 more
    # without the shortcut)
    assert counts["_plain_kernel", 8] == counts["_plain_kernel", 16], counts
    assert counts["_nested_kernel", 16] - counts["_nested_kernel", 8] < 8, counts
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.core.tensor.__add__)
