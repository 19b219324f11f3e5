"""Raw kernels and their launchers: Triton, plus the chunked torch twins. No autograd here.

Importing them changes nothing in Triton: the fix to triton 3.6's CPU interpreter
(:mod:`logitless.kernels.interpreter_compat`) is applied by whoever runs the interpreter (the
test suite, ``logitless check`` / ``demo`` / ``bench``), never on import, so a peer's kernels in
the same process meet the interpreter as Triton ships it."""
