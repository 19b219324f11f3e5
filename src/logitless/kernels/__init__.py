"""Raw kernels and their launchers: Triton, plus the chunked torch twins. No autograd here."""
