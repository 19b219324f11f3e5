"""Real megatron-core on CPU over gloo, for the tests only (never the library): the install
folders `make test-dist` fills, and the three stand-ins Megatron needs off CUDA."""

import contextlib
import os
import sys
from pathlib import Path
from types import SimpleNamespace

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
    for package in ("megatron/core", "mbridge"):
        if not (path / package / "__init__.py").is_file():
            pytest.fail(f"{package.split('/')[0]} is not installed in {path}, beside "
                        f"megatron-core {version}: `make test-dist` installs them there (or "
                        f"set {var} to a --target folder holding them)")
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


def _masked_attention(forward):
    """Megatron's local attention given what verl gives Transformer Engine's: BSHD's ``[b, s]``
    keep mask (TE's ``padding_causal``) becomes the ``[b, 1, s, s]`` masked-out one the local
    attention takes, a pair masked when it looks ahead or either end is padding; THD's packed
    ``[t, heads, dim]`` rows (``packed_seq_params``) become one ``[t, 1, ...]`` row whose mask
    also keeps each packed sequence to itself (the padded boundaries, as TE's)."""

    def wrapped(self, query, key, value, attention_mask, *args, packed_seq_params=None,
                **kwargs):
        if packed_seq_params is not None:
            bounds = packed_seq_params.cu_seqlens_q_padded
            bounds = packed_seq_params.cu_seqlens_q if bounds is None else bounds
            t = query.shape[0]
            seq = torch.bucketize(torch.arange(t, device=query.device), bounds[1:].long(),
                                  right=True)
            ahead = torch.ones(t, t, dtype=torch.bool, device=query.device).triu(1)
            attention_mask = (ahead | (seq[:, None] != seq[None, :]))[None, None]
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        elif attention_mask is not None and attention_mask.dim() == 2:
            keep = attention_mask.bool()
            s = keep.shape[1]
            ahead = torch.ones(s, s, dtype=torch.bool, device=keep.device).triu(1)
            attention_mask = ahead | ~(keep[:, None, :, None] & keep[:, None, None, :])
        return forward(self, query, key, value, attention_mask, *args, **kwargs)

    return wrapped


def _cuda_to_cpu(factory):
    def wrapped(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapped


def save_tiny_hf_model(path: str, heads: int = 4) -> None:
    """A tiny random Qwen2 and its tokenizer in ``path`` (built here, nothing downloaded), for
    verl's engine to read as its ``model.path``."""
    from logitless.tools import tiny

    tok = tiny.tokenizer(120)
    tiny.qwen2(tok, hidden=48, layers=2, heads=heads).save_pretrained(path)
    tok.save_pretrained(path)


@contextlib.contextmanager
def verl_megatron_engine(model_path: str, world: int, remove_padding: bool,
                        fused_kernels: bool = False):
    """verl 0.9.1's ``MegatronEngineWithLMHead`` (vanilla mbridge, TP ``world``, SP on, bf16:
    the engine takes nothing else; THD with ``remove_padding``, else BSHD; verl's fused forward
    with ``fused_kernels``, which needs THD) over the model in ``model_path``, initialised on
    CPU after `start_megatron`. What CPU lacks, each stand-in undone on exit (docs/megatron.md,
    "verl's Megatron actor", lists where each one sits in verl, mbridge and Megatron):
    mbridge's Transformer Engine layer spec becomes the local one, and its ``.cuda()`` and
    weight loading (Transformer Engine's parameter names only) are skipped, so the weights are
    Megatron's random ones; the optimizer (``device='cuda'`` buffers) is not built, so the
    engine runs forward and backward but no step; Megatron's schedule's ``device="cuda"``
    counters go to the CPU; verl's attention inputs, meant for Transformer Engine, reach the
    local attention as a mask it takes (`_masked_attention`)."""
    from unittest import mock

    import verl.workers.engine.megatron.transformer_impl as impl
    from mbridge.core import bridge, llm_bridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import dot_product_attention as dpa
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig

    attention = dpa.DotProductAttention
    with contextlib.ExitStack() as stack:
        # a GPTModel built before with another attention backend leaves its choice here
        stack.enter_context(mock.patch.dict(os.environ))
        for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(name, None)
        for target, name, value in (
                (llm_bridge.LLMBridge, "_get_transformer_layer_spec",
                 lambda self, vp_stage=None: get_gpt_layer_local_spec()),
                (bridge.Bridge, "load_weights", lambda self, *args, **kwargs: None),
                (torch.nn.Module, "cuda", lambda self, *args, **kwargs: self),
                (impl.MegatronEngine, "_build_optimizer", lambda self: None),
                (impl.MegatronEngine, "_build_lr_scheduler", lambda self: None),
                (impl, "log_gpu_memory_usage", lambda *args, **kwargs: None),
                (impl, "get_device_id", lambda: "cpu"),
                (torch, "zeros", _cuda_to_cpu(torch.zeros)),
                (attention, "forward", _masked_attention(attention.forward))):
            stack.enter_context(mock.patch.object(target, name, value))
        engine = impl.MegatronEngineWithLMHead(
            HFModelConfig(path=model_path),
            McoreEngineConfig(tensor_model_parallel_size=world, sequence_parallel=True,
                              use_mbridge=True, vanilla_mbridge=True, dtype="bfloat16",
                              use_remove_padding=remove_padding, use_fused_kernels=fused_kernels,
                              use_distributed_optimizer=False,
                              override_transformer_config={"attention_backend": "local"}),
            McoreOptimizerConfig(lr=1e-3), CheckpointConfig())
        engine.initialize()
        # no optimizer: zeroing the gradients is the DDP buffers' own
        engine.optimizer = SimpleNamespace(zero_grad=lambda *args, **kwargs: None)
        yield engine
