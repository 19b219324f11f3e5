import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from logitless.kernels import interpreter_compat

# Under TRITON_INTERPRET=1 the suite runs every Triton kernel on triton's CPU interpreter, with
# the fix triton 3.6's interpreter needs under numpy >= 2.4 (and without its redundant nested
# patches). The library never applies it on import; the suite does, before any kernel module
# is imported, and so do the scripts it spawns (tests/testing.py's ranks, zero3_worker.py).
interpreter_compat.apply()

# Hypothesis profiles for the property tests (tests/properties/), chosen by
# LOGITLESS_HYPOTHESIS_PROFILE: "default" (= "ci") draws a few examples from a fixed seed, so
# the suite stays quick and a failure reproduces on every run; "nightly" draws many more from
# fresh seeds and prints the blob that reproduces a failure.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=10, derandomize=True, deadline=None, database=None,
                          suppress_health_check=_QUIET)
settings.register_profile("default", parent=settings.get_profile("ci"))
settings.register_profile("nightly", max_examples=300, derandomize=False, deadline=None,
                          print_blob=True, suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("LOGITLESS_HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# The processes the suite starts (gloo ranks, scripts, the bench's children) read this when they
# import torch: one intra-op thread each, as `_one_thread` gives the suite's own. Three ranks of
# two threads each on two cores spin-wait in OpenMP (a 3-rank test: 35 s of CPU against 26 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The suite runs small shapes on a 2-core machine: one intra-op thread avoids OpenMP
    spin-waits (measured 5x to 20x faster on the tiny-model tests). A test that needs the
    cores (the 2**31-logits case) raises it for itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
