"""Two changes to triton's CPU interpreter (``TRITON_INTERPRET=1``), applied only there.

**The scalar conversion.** triton 3.6's interpreter converts a scalar to a Python int with
``int(data)`` where ``data`` is a one-element array of shape ``(1,)``, which numpy 2.4 and
later refuse ("only 0-dimensional arrays can be converted to Python scalars"). Every kernel
whose loop runs to a runtime bound (``range(0, n_cols, BLOCK)``) then fails under the
interpreter, so the test suite and ``logitless check --backend triton`` fail on the H200's
stack (triton 3.6 with a new numpy). Later triton versions convert the element instead
(``int(data.squeeze())``); this applies the same conversion to the interpreter of an older
triton. Compiled kernels are untouched: the interpreter is only ever the CPU stand-in for them.

**Nested device calls.** The interpreter patches ``triton.language`` (every builtin of ``tl``,
``tl.tensor``, ``tl.math``, ...) when a kernel launch starts and restores it when the launch
ends. It also runs the same patch at every call of a ``@triton.jit`` helper inside the kernel
(``_keys``, ``_trial_z``, ``tl.max``, ...), once per program and call, and never restores it: a
no-op where the launch (or an earlier helper call) has already patched the same modules (a
patched builtin is no longer a builtin, so nothing is patched twice), but one that lists every
member of those modules each time. In the sampler's passes that took about 64% of the
interpreter's time. Here such a call skips the patch; a launch, and a helper that reaches a
module not yet patched, patch as before. What runs is unchanged, so are the results.

**Who applies it.** Not the library on import (it would change the interpreter for every
Triton kernel of the process, a peer's too): the test suite (``tests/conftest.py`` and the
processes it spawns) and the ``logitless`` CLI call :func:`apply`; so does a user's script that
runs the kernels on the interpreter.
"""

from __future__ import annotations

import inspect
import os


def _index(self) -> int:
    data = self.handle.data
    return int(data.reshape(-1)[0]) if data.size == 1 else int(data)


def _skip_nested_patches(interpreter) -> None:
    """Wrap the interpreter's launch (``GridExecutor.__call__``) and its ``_patch_lang``: inside
    a launch, after the launch's own patch, a device call whose language modules are already
    patched gets an empty scope (which it drops, as before); any other call patches as before."""
    executor = getattr(interpreter, "GridExecutor", None)
    original = getattr(interpreter, "_patch_lang", None)
    if executor is None or original is None or getattr(original, "logitless_nested_skip", False):
        return
    tl = interpreter.tl
    launches: list[set[int]] = []  # per running launch: the language modules patched so far
    launch = executor.__call__

    def call(self, *args, **kwargs):
        launches.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values()
                 if inspect.ismodule(v) and (v is tl or v is tl.core)}
        if launches and launches[-1] and langs <= launches[-1]:
            return interpreter._LangPatchScope()  # empty: nothing to restore
        scope = original(fn)
        if launches:
            launches[-1] |= langs
        return scope

    patch_lang.logitless_nested_skip = True
    executor.__call__ = call
    interpreter._patch_lang = patch_lang


def apply() -> bool:
    """Patch the interpreter's scalar conversion when it runs (``TRITON_INTERPRET=1``) and has
    the old form, and skip the redundant patch of nested device calls; return whether the
    scalar conversion's patch is in place."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    _skip_nested_patches(interpreter)
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "logitless_index_fix", False):
        return True

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patch_lang_tensor.logitless_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
