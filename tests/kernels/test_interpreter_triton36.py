"""The Triton kernels under triton 3.6.0's CPU interpreter with this environment's numpy
(issue 22): triton 3.6 converts a runtime loop bound with ``int()`` of a one-element array,
which numpy >= 2.4 refuses; `kernels/interpreter_compat.py` converts the element instead."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from logitless.kernels import interpreter_compat

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


def test_nested_device_calls_do_not_repatch_the_language():
    """Under the interpreter a launch patches ``triton.language`` once; the helpers it calls
    (ours and triton's own ``tl.max``) reuse that patch instead of listing every member of the
    language modules again per program and call. The results are the same, and the language
    is restored after the launch. Run in a process of its own with ``TRITON_INTERPRET=1``
    (``interpreter_nesting.py``), whatever this process runs under."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("interpreter_nesting.py"))],
                          env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    counts = got["counts"]
    assert got["right"] and got["restored"], got
    # a launch patches once, whatever its programs; its helpers (3 calls a program, each a
    # patch of 4-5 module lists before) add fewer patches than the 8 programs more (115 more
    # without the shortcut)
    assert counts["_plain_kernel/8"] == counts["_plain_kernel/16"] > 0, counts
    assert counts["_nested_kernel/16"] - counts["_nested_kernel/8"] < 8, counts


def test_importing_logitless_leaves_the_interpreter_as_triton_ships_it():
    """Importing the library, every kernel module included, under ``TRITON_INTERPRET=1`` patches
    nothing in triton's interpreter (a peer's kernels in the same process meet it unchanged):
    the fix is applied by the test suite and ``logitless check``, never on import. Run in a
    fresh process, since this one's conftest has applied it; the same process then runs the
    CLI, which applies it."""
    script = textwrap.dedent("""
        import importlib, json, pkgutil
        from unittest import mock
        from triton.runtime import interpreter
        before = {k: getattr(interpreter, k, None) for k in ("_patch_lang", "_patch_lang_tensor")}
        launch = interpreter.GridExecutor.__call__
        import logitless, logitless.kernels
        for m in pkgutil.iter_modules(logitless.kernels.__path__):
            importlib.import_module("logitless.kernels." + m.name)
        after = {k: getattr(interpreter, k, None) for k in before}
        print(json.dumps({"same": after == before,
                          "launch": interpreter.GridExecutor.__call__ is launch}))
        # and the CLI's process applies it: `logitless check` under the interpreter
        from logitless.tools import check, cli
        with mock.patch.object(check, "run", lambda args: 0):
            cli.main(["check"])
        print(getattr(interpreter._patch_lang, "logitless_nested_skip", False))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == {"same": True, "launch": True}
    assert lines[-1] == "True"
