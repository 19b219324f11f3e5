"""Shape sweeps: presets for real heads, scaled to the device, or explicit sizes.

Vocabulary sizes are the real ones (Qwen2.5/Qwen3 151936, Llama-3 128256, Gemma 2/3 256000);
hidden size and token counts are scaled to what the device does in reasonable time: the CPU
sweeps stay at a few hundred tokens (one fwd+bwd at 256 x 896 x 151936 is ~0.2 TFLOP), the
CUDA sweeps go to the 16k-token micro-batches of RL training at the models' real widths.
"""

from __future__ import annotations

import itertools

# name -> op -> device kind ("cpu" | "cuda") -> {dim: list of sizes}; the sweep is the product.
PRESETS: dict[str, dict[str, dict[str, dict[str, list[int]]]]] = {
    # Qwen2.5-0.5B's head (D=896); on CUDA Qwen2.5-7B's width.
    "qwen-small": {
        "logprobs": {
            "cpu": {"tokens": [64, 128, 256], "hidden": [896], "vocab": [151936]},
            "cuda": {"tokens": [1024, 4096, 16384], "hidden": [896], "vocab": [151936]},
        },
    },
    "qwen": {
        "logprobs": {
            "cpu": {"tokens": [256, 512, 1024], "hidden": [1024], "vocab": [151936]},
            "cuda": {"tokens": [2048, 8192, 16384], "hidden": [4096], "vocab": [151936]},
        },
    },
    "llama": {
        "logprobs": {
            "cpu": {"tokens": [256, 512, 1024], "hidden": [1024], "vocab": [128256]},
            "cuda": {"tokens": [2048, 8192, 16384], "hidden": [4096], "vocab": [128256]},
        },
    },
    "gemma": {
        "logprobs": {
            "cpu": {"tokens": [256, 512, 1024], "hidden": [1152], "vocab": [256000]},
            "cuda": {"tokens": [2048, 8192, 16384], "hidden": [2304], "vocab": [256000]},
        },
    },
    # Vocabulary sweep at a fixed token count: how each provider scales with V.
    "vocab-sweep": {
        "logprobs": {
            "cpu": {"tokens": [128], "hidden": [896], "vocab": [32000, 128256, 151936, 256000]},
            "cuda": {"tokens": [8192], "hidden": [4096],
                     "vocab": [32000, 128256, 151936, 256000]},
        },
    },
    "attn-small": {
        "attention-entropy": {
            "cpu": {"batch": [1], "heads": [8], "kv_heads": [2], "seq": [512, 1024, 2048],
                    "head_dim": [64]},
            "cuda": {"batch": [1], "heads": [32], "kv_heads": [8], "seq": [4096, 8192, 16384],
                     "head_dim": [128]},
        },
    },
}

DEFAULT_PRESET = {"logprobs": "qwen-small", "attention-entropy": "attn-small",
                  "policy-loss": "qwen-small", "divergence": "qwen-small"}
# Ops that run on the head's shapes (the presets' "logprobs" sizes).
HEAD_OPS = ("policy-loss", "divergence")


def device_kind(device: str) -> str:
    return "cpu" if device == "cpu" else "cuda"


def preset_shapes(preset: str, op: str, device: str) -> list[dict[str, int]]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    by_op = PRESETS[preset]
    key = "logprobs" if op in HEAD_OPS else op
    if key not in by_op:
        have = sorted(p for p, v in PRESETS.items() if key in v)
        raise ValueError(f"preset {preset!r} has no shapes for op {op!r}; use one of {have}")
    return product(by_op[key][device_kind(device)])


def product(sizes: dict[str, list[int]]) -> list[dict[str, int]]:
    names = list(sizes)
    return [dict(zip(names, combo)) for combo in itertools.product(*(sizes[n] for n in names))]


def explicit_shapes(dims: tuple[str, ...], given: dict[str, list[int] | None],
                    preset: list[dict[str, int]]) -> list[dict[str, int]]:
    """The sweep with ``given`` sizes (e.g. ``--tokens 512 1024``) replacing the preset's."""
    sizes: dict[str, list[int]] = {}
    for dim in dims:
        if given.get(dim):
            sizes[dim] = list(given[dim])
        else:
            sizes[dim] = sorted({s[dim] for s in preset})
    return product(sizes)


def label(shape: dict[str, int]) -> str:
    short = {"tokens": "N", "hidden": "D", "vocab": "V", "batch": "B", "heads": "H",
             "kv_heads": "Hk", "seq": "T", "head_dim": "d"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in shape.items())
