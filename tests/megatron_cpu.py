"""Real megatron-core on CPU over gloo, for the tests only (never the library): the install
folders `make test-dist` fills, and the three stand-ins Megatron needs off CUDA."""

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# version -> (environment variable, the --target folder `make test-dist` installs it into)
VERSIONS = {"0.16.1": ("LOGITLESS_MEGATRON_016", ".venv-megatron-0.16.1"),
            "0.19.2": ("LOGITLESS_MEGATRON_019", ".venv-megatron-0.19.2")}


def megatron_dir(version: str) -> str:
    """The --target folder holding megatron-core ``version`` (fails when it is missing)."""
    var, folder = VERSIONS[version]
    path = Path(os.environ.get(var, REPO / folder))
    if not (path / "megatron" / "core" / "__init__.py").is_file():
        pytest.fail(f"megatron-core {version} is not installed in {path}: `make test-dist` "
                    f"installs it there (or set {var} to a --target folder holding it)")
    return str(path)


def _torch_norm(cls, config, hidden_size, eps=1e-5, **_unused):
    """A torch LayerNorm that runs under sequence parallelism: Megatron's `WrappedTorchNorm`
    refuses it; marked as Megatron marks its own sequence-parallel norms."""
    norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm


def start_megatron(path: str, world: int):
    """Put megatron-core from ``path`` first on this rank's path, patch what CPU lacks, and
    initialise model parallelism over the gloo group (tensor-parallel size ``world``)."""
    sys.path.insert(0, path)
    torch.cuda.current_device = lambda: "cpu"  # Megatron places its buffers on it
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import torch_norm

    torch_norm.WrappedTorchNorm.__new__ = _torch_norm
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    # Megatron's own no-op tracker: its CUDA RNG states do not exist here
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    import megatron.core

    return megatron.core.__version__
