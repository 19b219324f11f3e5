"""Raw kernels and their launchers: Triton, plus the chunked torch twins. No autograd here."""

from logitless.kernels import interpreter_compat

# Under TRITON_INTERPRET=1 only: the fix to triton 3.6's interpreter applies to every Triton
# kernel the process runs (a peer's too, in `logitless bench`), not only to ours.
interpreter_compat.apply()
