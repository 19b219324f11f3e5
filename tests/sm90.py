"""Compile a Triton kernel for sm_90 (Hopper) without a GPU, and read ptxas's resource report.

Tests marked ``compile_sm90`` call :func:`compile_sm90` on every kernel of a kernel file with
the configurations the launchers use; ``tests/kernels/test_compile_triton36.py`` reruns them
under triton 3.6.0 (the version on the lent H200). Compilation runs the whole Triton pipeline
down to a cubin with ``ptxas``, so layout, shared-memory and register problems show up here.

Under ``TRITON_INTERPRET=1`` (``make test``) Triton was imported in interpreter mode: every
``@triton.jit`` function, Triton's own ``tl.standard`` helpers included, is an interpreted
function that the compiler cannot take. The compilation then runs in one helper process
started without ``TRITON_INTERPRET`` (started once, kept for the session, fed one request per
kernel), which imports the kernel's module by name; :func:`run_compile_script` sends its
scripts there too. The ``ASTSource`` / ``GPUTarget`` API used here is the same in triton 3.6.0
and the newest release.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

import triton
import triton.language.standard as tl_standard
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

SM90 = GPUTarget("cuda", 90, 32)
_WORKER: subprocess.Popen | None = None


def _python_function(kernel):
    """The Python function behind ``kernel`` (``@triton.jit`` or interpreted, possibly under
    ``@triton.autotune`` / ``@triton.heuristics``)."""
    fn = kernel
    while not inspect.isfunction(fn):
        fn = fn.fn
    return fn


def _jit_function(kernel) -> JITFunction:
    fn = kernel
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def _compile_here(fn: JITFunction, signature, constexprs, num_warps, num_stages):
    full = dict(signature)
    full.update({name: "constexpr" for name in constexprs})
    missing = [a for a in fn.arg_names if a not in full]
    if missing:
        raise ValueError(f"signature/constexprs must cover every argument; missing {missing}")
    src = ASTSource(fn=fn, signature=full, constexprs=dict(constexprs))
    return triton.compile(src, target=SM90,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _serve() -> None:
    """The helper process: one JSON request per stdin line, one JSON answer per stdout line."""
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write on the answer channel
    for line in sys.stdin:
        req = json.loads(line)
        if "script" in req:
            out.write(json.dumps(_run_here(req["script"])) + "\n")
            out.flush()
            continue
        try:
            fn = getattr(importlib.import_module(req["module"]), req["name"])
            compiled = _compile_here(_jit_function(fn), req["signature"], req["constexprs"],
                                     req["num_warps"], req["num_stages"])
            answer = {"ptx": compiled.asm["ptx"],
                      "cubin": base64.b64encode(compiled.asm["cubin"]).decode(),
                      "shared": compiled.metadata.shared}
        except Exception:  # sent back and raised in the test process
            answer = {"error": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def _worker() -> subprocess.Popen:
    global _WORKER
    if _WORKER is None or _WORKER.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        _WORKER = subprocess.Popen(
            [sys.executable, "-c", "import sm90; sm90._serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            cwd=str(Path(__file__).parent),
        )
    return _WORKER


def _compile_in_worker(kernel, signature, constexprs, num_warps, num_stages):
    fn = _python_function(kernel)
    worker = _worker()
    worker.stdin.write(json.dumps({
        "module": fn.__module__, "name": fn.__name__, "signature": signature,
        "constexprs": constexprs, "num_warps": num_warps, "num_stages": num_stages,
    }) + "\n")
    worker.stdin.flush()
    line = worker.stdout.readline()
    if not line:
        raise RuntimeError("the sm_90 compile helper process died (see stderr)")
    answer = json.loads(line)
    if "error" in answer:
        raise RuntimeError(f"compiling {fn.__name__} for sm_90 failed:\n{answer['error']}")
    return SimpleNamespace(asm={"ptx": answer["ptx"], "cubin": base64.b64decode(answer["cubin"])},
                           metadata=SimpleNamespace(shared=answer["shared"]))


def compile_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object],
                 num_warps: int = 4, num_stages: int = 3):
    """Compile ``kernel`` (a ``@triton.jit`` function, or an autotuned one) for sm_90.

    ``signature`` maps every non-constexpr argument to its Triton type (``"*bf16"``,
    ``"i32"``, ``"fp32"``...); ``constexprs`` gives every ``tl.constexpr`` argument's value
    (and may pin a runtime argument, as the JIT's specialisation does for a stride of 1).
    Returns the compiled kernel, or under the interpreter an object with the same
    ``.asm["ptx"]``, ``.asm["cubin"]`` and ``.metadata.shared``.
    """
    if not isinstance(tl_standard.cdiv, JITFunction):  # Triton imported as the interpreter
        return _compile_in_worker(kernel, signature, constexprs, num_warps, num_stages)
    return _compile_here(_jit_function(kernel), signature, constexprs, num_warps, num_stages)


def ptxas_report(compiled) -> dict[str, int]:
    """Registers, stack frame and spill bytes of a compiled kernel, from ``ptxas -v`` run on
    its PTX (the ptxas that ships inside Triton's NVIDIA backend)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(SM90.arch).path  # get_ptxas(arch) in 3.6.0 and the newest
    ptx = compiled.asm["ptx"]
    arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(path), "-o",
                               str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True, check=True)
    text = done.stderr + done.stdout

    def number(pattern):
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    return {
        "registers": number(r"Used (\d+) registers"),
        "stack": number(r"(\d+) bytes stack frame"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
    }


def _run_here(script: str) -> dict:
    """Run ``script`` in this process (Triton not in interpreter mode), its prints captured:
    ``{"stdout": ...}``, with ``"error"`` (the traceback) where it raised."""
    printed = io.StringIO()
    answer = {}
    with contextlib.redirect_stdout(printed):
        try:
            exec(compile(script, "<compile script>", "exec"), {"__name__": "__compile_script__"})
        except BaseException:  # an assert in the script, as a failed subprocess would report
            answer["error"] = traceback.format_exc()
    answer["stdout"] = printed.getvalue()
    return answer


def run_compile_script(script: str) -> SimpleNamespace:
    """Run ``script`` (Python that imports :mod:`sm90` and compiles kernels) where Triton is
    not the interpreter: in this process when it is not, else in the session's helper process
    (the one :func:`compile_sm90` feeds; a process per script cost an interpreter start and
    the imports each time). Fail with its traceback if it raises, else return its printed
    output as ``.stdout``. Skipped where Triton has no NVIDIA backend."""
    import pytest

    pytest.importorskip("triton.backends.nvidia")
    if isinstance(tl_standard.cdiv, JITFunction):
        answer = _run_here(script)
    else:
        worker = _worker()
        worker.stdin.write(json.dumps({"script": script}) + "\n")
        worker.stdin.flush()
        line = worker.stdout.readline()
        if not line:
            raise RuntimeError("the sm_90 compile helper process died (see stderr)")
        answer = json.loads(line)
    assert "error" not in answer, answer["error"][-4000:]
    return SimpleNamespace(stdout=answer["stdout"])


TRITON36 = Path(__file__).resolve().parents[1] / ".venv" / "triton-3.6.0"


def triton36_env() -> dict:
    """The environment of a subprocess that imports triton 3.6.0 (the H200's) and this
    checkout's sources: this environment's own where its triton is 3.6.0 (``make
    test-compat``), else ``.venv/triton-3.6.0`` first on the path (``make setup`` installs it
    there). Missing: the test fails under CI, where ``make setup`` ran, and skips elsewhere."""
    import pytest

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    extra = [p for p in [os.environ.get("PYTHONPATH")] if p]
    if triton.__version__ == "3.6.0":
        env["PYTHONPATH"] = os.pathsep.join([src, *extra])
        return env
    if not (TRITON36 / "triton").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{TRITON36} is missing: `make setup` installs triton 3.6.0 there")
        pytest.skip(f"{TRITON36} is missing (make setup installs it)")
    env["PYTHONPATH"] = os.pathsep.join([str(TRITON36), src, *extra])
    return env
