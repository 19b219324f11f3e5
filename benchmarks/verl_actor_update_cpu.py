"""One verl actor update on CPU through verl's own code: the composed loss against the fused.

The step is verl 0.9.1's FSDP engine training step (``FSDPEngineWithLMHead.forward_backward_batch``
on a stand-in engine object holding the attributes it reads, as in
``tests/integrations/test_verl_fused.py``): verl's normalisers, ``prepare_model_inputs``,
verl's fused forward (``forward_with_triton_backend``) calling logitless's
``linear_cross_entropy`` drop-in, ``prepare_model_outputs``, verl's ``ppo_loss`` bound as its
actor worker binds it (``partial(ppo_loss, config=actor)``), and the backward. The model is a
randomly initialised Qwen2 whose head dominates: ``--layers`` decoder layers (default 1) of
hidden size 896 (Qwen2.5-0.5B's), V=151936, fp32; the batch ``--seqs`` sequences (default 8)
of a 16-token prompt and ``--response`` (default 256) response tokens, GRPO
(``logitless_grpo``, ``seq-mean-token-mean``, no entropy or KL term).

Variants, each in its own process: ``verl`` (verl's built-in ``vanilla`` loss on the logitless
head: verl's own ``linear_cross_entropy`` kernel needs CUDA), ``composed`` (``logitless_grpo``:
the head's logprobs, then the policy loss) and ``fused`` (``logitless_grpo`` with
``policy_loss.fused=True``). For each: the step's wall and process CPU time, the peak
resident memory above the loaded model (``VmHWM`` after ``clear_refs``, as
``logitless.tools.bench`` measures), the step's matmul FLOPs (every ``mm``/``addmm``/``bmm``,
inside logitless's custom ops too, counted by a ``TorchDispatchMode`` over forward and
backward), and the head's: those minus the decoder's own on the same tokens (counted the same
way), also as GEMM passes of ``2 * response tokens * D * V`` FLOPs.

Usage: ``python benchmarks/verl_actor_update_cpu.py`` (all variants, a Markdown table;
``--variants composed,fused`` for some), or ``--variant fused`` for one JSON line.
Environment: no ``TRITON_INTERPRET`` (the head runs its torch path on CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VARIANTS = ("verl", "composed", "fused")
V, D, PROMPT = 151936, 896, 16


class MatmulFlops(TorchDispatchMode):
    """FLOPs of every ``mm``, ``addmm`` and ``bmm`` run while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "logitless":
            # a logitless custom op (the head's linear_logprobs): run its implementation with
            # this mode on, so that its GEMMs are counted too
            from torch._library.custom_ops import OPDEFS

            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
        mats = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1)}.get(name)
        if mats is not None:
            a, b = args[mats[0]], args[mats[1]]
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **(kwargs or {}))


def _backbone_flops(model, data) -> int:
    """The decoder's matmul FLOPs on the step's packed tokens, forward and backward (the step's
    minus these are the head's: the head chunks its vocabulary, so no operand shows V)."""
    ids = data["input_ids"].values().unsqueeze(0)
    pos = data["position_ids"].values().unsqueeze(0)
    counter = MatmulFlops()
    with counter:
        hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False)[0]
        hidden.sum().backward()
    return counter.flops


def _model(layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers.dense_common import forward_with_triton_backend

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=V, hidden_size=D, intermediate_size=4864, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False))
    model.forward = forward_with_triton_backend.__get__(model)  # verl's fused forward
    return model


def _engine(model):
    from types import SimpleNamespace

    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl

    fsdp_impl.get_device_id = lambda: "cpu"
    fsdp_impl.get_device_name = lambda: "cpu"
    engine = fsdp_impl.FSDPEngineWithLMHead.__new__(fsdp_impl.FSDPEngineWithLMHead)
    engine.module = model
    engine.ulysses_device_mesh = None
    engine.ulysses_sequence_parallel_size = 1
    engine.use_ulysses_sp = False
    engine.pad_to_length = False
    engine.pass_packed_cu_seqlens = False
    engine._autocast_dtype = torch.float32
    engine.scaler = None
    engine.engine_config = SimpleNamespace()
    engine.get_data_parallel_size = lambda: 1
    return engine


def _batch(seqs: int, response: int, seed: int = 1):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, V, (seqs, PROMPT), generator=g)
    responses = torch.randint(0, V, (seqs, response), generator=g)
    attention = torch.ones(seqs, PROMPT + response, dtype=torch.long)
    data = TensorDict({"prompts": prompts, "responses": responses,
                       "input_ids": torch.cat([prompts, responses], 1),
                       "attention_mask": attention,
                       "response_mask": torch.ones(seqs, response, dtype=torch.long),
                       "position_ids": attention.cumsum(-1) - 1}, batch_size=[seqs])
    data = left_right_2_no_padding(data)
    # old logprobs near a random model's (about -log V), one advantage per sequence
    data["old_log_probs"] = -12.0 + 0.2 * torch.randn(seqs, response, generator=g)
    data["advantages"] = torch.randn(seqs, 1, generator=g).expand(-1, response)
    tu.assign_non_tensor(data, use_remove_padding=True, use_fused_kernels=True,
                         calculate_entropy=False, temperature=1.0, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=seqs, global_batch_size=seqs)
    return data


def _actor(variant: str):
    import verl.workers.config as verl_config

    from logitless.integrations.verl import LogitlessPolicyLossConfig

    policy_loss = (verl_config.PolicyLossConfig(loss_mode="vanilla") if variant == "verl"
                   else LogitlessPolicyLossConfig(loss_mode="logitless_grpo",
                                                  fused=variant == "fused"))
    return verl_config.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
        clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=0.0,
        loss_agg_mode="seq-mean-token-mean", policy_loss=policy_loss)


def run(variant: str, layers: int, seqs: int, response: int) -> dict:
    import torch.distributed as dist
    from verl.workers.utils.losses import ppo_loss

    from logitless.integrations.verl import enable_fused_head
    from logitless.tools.bench.measure import CpuMemory

    tmp = tempfile.TemporaryDirectory()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp.name, "store"), 1),
                            rank=0, world_size=1)
    enable_fused_head()
    model = _model(layers)
    engine = _engine(model)
    loss_fn = functools.partial(ppo_loss, config=_actor(variant))
    engine.forward_backward_batch(_batch(1, 8), loss_fn)  # warm-up: imports, first calls
    model.zero_grad(set_to_none=True)
    data = _batch(seqs, response)
    memory = CpuMemory()
    memory.start()
    counter = MatmulFlops()
    start, cpu_start = time.perf_counter(), time.process_time()
    with counter:
        out = engine.forward_backward_batch(data, loss_fn)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = memory.peak()
    head = counter.flops - _backbone_flops(model, data)
    dist.destroy_process_group()
    tmp.cleanup()
    (loss,) = out["loss"]
    rows = seqs * response
    return dict(variant=variant, layers=layers, seqs=seqs, response=response, loss=loss,
                seconds=round(seconds, 2), cpu_seconds=round(cpu_seconds, 2),
                peak_mb=round(peak / 2**20, 1),
                memory_probe=memory.name, head_gflops=round(head / 1e9, 1),
                head_passes=round(head / (2 * rows * D * V), 3),
                matmul_gflops=round(counter.flops / 1e9, 1), threads=torch.get_num_threads(),
                torch=torch.__version__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, for the table (default: all)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--response", type=int, default=256)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run(args.variant, args.layers, args.seqs, args.response)))
        return
    rows = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", variant, "--layers", str(args.layers),
               "--seqs", str(args.seqs), "--response", str(args.response)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| variant | step s | CPU s | peak MB | head GFLOP | head passes (of response rows) "
          "| all matmul GFLOP | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['seconds']} | {r['cpu_seconds']} | {r['peak_mb']} "
              f"| {r['head_gflops']} "
              f"| {r['head_passes']} | {r['matmul_gflops']} | {r['loss']:.6f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
