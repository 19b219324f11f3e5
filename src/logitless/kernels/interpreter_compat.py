"""One fix to triton's CPU interpreter (``TRITON_INTERPRET=1``), applied only there.

triton 3.6's interpreter converts a scalar to a Python int with ``int(data)`` where ``data`` is
a one-element array of shape ``(1,)``, which numpy 2.4 and later refuse ("only 0-dimensional
arrays can be converted to Python scalars"). Every kernel whose loop runs to a runtime bound
(``range(0, n_cols, BLOCK)``) then fails under the interpreter, so the test suite and
``logitless check --backend triton`` fail on the H200's stack (triton 3.6 with a new numpy).
Later triton versions convert the element instead (``int(data.squeeze())``); this applies the
same conversion to the interpreter of an older triton. Compiled kernels are untouched: the
interpreter is only ever the CPU stand-in for them.
"""

from __future__ import annotations

import os


def _index(self) -> int:
    data = self.handle.data
    return int(data.reshape(-1)[0]) if data.size == 1 else int(data)


def apply() -> bool:
    """Patch the interpreter's scalar conversion when it runs (``TRITON_INTERPRET=1``) and has
    the old form; return whether a patch is in place."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
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
