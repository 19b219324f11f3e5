"""verl's Ulysses data path end to end through the logitless adapters, on gloo ranks.

verl's FSDP engine itself (``FSDPEngineWithLMHead.forward_backward_batch``: the normalisers,
``prepare_model_inputs``, the model call, ``prepare_model_outputs``, verl's ``ppo_loss`` and
the backward), on a stand-in engine object holding the attributes it reads. verl packs the
micro-batch, rolls the labels over the whole stream, pads and slices it per Ulysses rank
(``ulysses_pad_and_slice_inputs``); verl's fused forward (``forward_with_triton_backend``, on a
tiny model whose body gives one hidden row per token) calls our ``linear_cross_entropy`` drop-in
on the rank's slice; verl's ``gather_outputs_and_unpad`` (with its backward) gives whole
sequences to verl's ``ppo_loss``, which calls the ``logitless_<objective>`` loss through verl's
policy-loss registry and adds verl's entropy term.

Compared in fp64 with one process running the whole sequences without Ulysses (the same engine
code, ``use_ulysses_sp`` off): the loss, the gathered logprobs, each rank's hidden-state
gradient and the parameters' gradients under verl's convention (FSDP averages every gradient
over all ranks; the gather's backward multiplies by the Ulysses size to make up for it). The
logitless losses are also compared with verl's built-in losses they reproduce, on the same path.
"""

import functools
import warnings
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is installed by `make test`")
import torch
import torch.distributed as dist
import verl.workers.config as verl_config
import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
from tensordict import TensorDict
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.flop_counter import FlopCounterMode
from transformers.modeling_outputs import BaseModelOutputWithPast
from verl.models.transformers.dense_common import forward_with_triton_backend
from verl.utils import tensordict_utils as tu
from verl.utils.ulysses import set_ulysses_sequence_parallel_group, slice_input_tensor
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from logitless.integrations.verl import (
    LogitlessPolicyLossConfig,
    disable_fused_head,
    enable_fused_head,
)

from testing import run_on_gloo

V, D, TEMPERATURE = 37, 13, 0.9
# (prompt, response) lengths: 25 packed tokens, which neither 2 nor 3 divides (verl pads).
# Rank slices of 13 (2 ranks) or 9 (3 ranks) positions: the first sequence lies wholly on rank
# 0, the third crosses ranks with a response token at the cut (a rank's last row is scored
# against the next rank's first token), the last lies wholly on the last rank.
SEQS = [(3, 4), (2, 3), (1, 9), (2, 1)]
WIDTH_P, WIDTH_R = 3, 9
RTOL, ATOL = 1e-11, 1e-13
VERL_GSPO = dict(ratio_level="sequence_token", seq_log_ratio_max=10.0, log_ratio_clamp=None)
KL = dict(use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.07)
# name -> (policy_loss config, loss_agg_mode[, actor options])
RUNS = {
    "logitless_gspo": (lambda: LogitlessPolicyLossConfig(loss_mode="logitless_gspo"),
                       "seq-mean-token-mean"),
    "logitless_gspo/token-mean": (lambda: LogitlessPolicyLossConfig(loss_mode="logitless_gspo"),
                                  "token-mean"),
    "logitless_gspo/verl": (lambda: LogitlessPolicyLossConfig(loss_mode="logitless_gspo",
                                                              **VERL_GSPO),
                            "seq-mean-token-mean"),
    "gspo": (lambda: verl_config.PolicyLossConfig(loss_mode="gspo"), "seq-mean-token-mean"),
    "logitless_grpo": (lambda: LogitlessPolicyLossConfig(loss_mode="logitless_grpo"),
                       "seq-mean-token-mean"),
    # policy_loss.fused under Ulysses: fused_policy_loss with cp_group, each rank its rows
    "logitless_grpo/fused": (lambda: LogitlessPolicyLossConfig(loss_mode="logitless_grpo",
                                                               fused=True),
                             "seq-mean-token-mean"),
    "logitless_gspo/verl/fused": (lambda: LogitlessPolicyLossConfig(
        loss_mode="logitless_gspo", fused=True, **VERL_GSPO), "seq-mean-token-mean"),
    "logitless_grpo/kl/fused": (lambda: LogitlessPolicyLossConfig(loss_mode="logitless_grpo",
                                                                  fused=True),
                                "seq-mean-token-sum-norm", KL),
    "vanilla": (lambda: verl_config.PolicyLossConfig(loss_mode="vanilla"),
                "seq-mean-token-mean"),
    "vanilla/kl": (lambda: verl_config.PolicyLossConfig(loss_mode="vanilla"),
                   "seq-mean-token-sum-norm", KL),
}
SAME_AS_VERL = {"logitless_gspo/verl": "gspo", "logitless_grpo": "vanilla",
                "logitless_grpo/fused": "vanilla", "logitless_gspo/verl/fused": "gspo",
                "logitless_grpo/kl/fused": "vanilla/kl"}


class _Body(torch.nn.Module):
    """The decoder's place: one hidden row per token from its id and position (the head's
    inputs are all this test is about; Ulysses' attention all-to-all is verl's business)."""

    def __init__(self, embed, pos):
        super().__init__()
        self.embed = torch.nn.Parameter(embed.clone())
        self.pos = torch.nn.Parameter(pos.clone())

    def forward(self, input_ids, position_ids, **_):
        hidden = self.embed[input_ids] + torch.tanh(self.pos[position_ids])  # [1, n, D]
        hidden.retain_grad()
        self.hidden = hidden
        return BaseModelOutputWithPast(last_hidden_state=hidden)


class _CausalLM(torch.nn.Module):
    """A causal LM with verl's fused forward, as verl's monkey patch installs it."""

    forward = forward_with_triton_backend

    def __init__(self, params):
        super().__init__()
        self.config = SimpleNamespace(output_attentions=False, output_hidden_states=False)
        self.model = _Body(params["embed"], params["pos"])
        self.lm_head = torch.nn.Linear(D, V, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.lm_head.weight.copy_(params["head"])


def _params():
    g = torch.Generator().manual_seed(3)
    return dict(embed=torch.randn(V, D, generator=g, dtype=torch.float64),
                pos=torch.randn(16, D, generator=g, dtype=torch.float64),
                head=torch.randn(V, D, generator=g, dtype=torch.float64) / D**0.5 * 2)


def _batch():
    """A left/right padded batch as verl's rollout leaves it, turned into verl's no-padding
    layout by verl, with old logprobs near the current ones (some ratios clip) and one
    advantage per sequence."""
    g = torch.Generator().manual_seed(5)
    b = len(SEQS)
    prompts = torch.zeros(b, WIDTH_P, dtype=torch.long)
    responses = torch.zeros(b, WIDTH_R, dtype=torch.long)
    attention = torch.zeros(b, WIDTH_P + WIDTH_R, dtype=torch.long)
    for i, (p, r) in enumerate(SEQS):
        prompts[i, WIDTH_P - p:] = torch.randint(0, V, (p,), generator=g)
        responses[i, :r] = torch.randint(0, V, (r,), generator=g)
        attention[i, WIDTH_P - p:WIDTH_P + r] = 1
    data = TensorDict({"prompts": prompts, "responses": responses,
                       "input_ids": torch.cat([prompts, responses], 1),
                       "attention_mask": attention,
                       "response_mask": attention[:, WIDTH_P:].clone(),
                       "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)},
                      batch_size=[b])
    data = left_right_2_no_padding(data)
    current = no_padding_2_padding(_oracle_logprobs(data), data)
    data["old_log_probs"] = current + 0.3 * torch.randn(current.shape, generator=g,
                                                        dtype=torch.float64)
    data["advantages"] = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(-1, WIDTH_R)
    tu.assign_non_tensor(data, use_remove_padding=True, use_fused_kernels=True,
                         calculate_entropy=True, temperature=TEMPERATURE, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=b, global_batch_size=b,
                         return_model_output=True)
    return data


def _oracle_logprobs(data):
    """Every packed position's logprob of the next token of the stream, from materialised
    logits (one process, no verl code)."""
    params = _params()
    ids, pos = data["input_ids"].values(), data["position_ids"].values()
    hidden = params["embed"][ids] + torch.tanh(params["pos"][pos])
    logp = torch.log_softmax(hidden @ params["head"].T / TEMPERATURE, dim=-1)
    return logp.gather(-1, torch.roll(ids, -1).unsqueeze(-1)).squeeze(-1)


def _engine(model, mesh, sp):
    """``FSDPEngineWithLMHead`` with the attributes its training step reads (``sp`` Ulysses
    ranks; 1: one process, the whole sequences)."""
    engine = fsdp_impl.FSDPEngineWithLMHead.__new__(fsdp_impl.FSDPEngineWithLMHead)
    engine.module = model
    engine.ulysses_device_mesh = mesh  # ("dp", "sp") = (1, world): the dp group is this rank
    engine.ulysses_sequence_parallel_size = sp
    engine.use_ulysses_sp = sp > 1
    engine.pad_to_length = False
    engine.pass_packed_cu_seqlens = False
    engine._autocast_dtype = torch.float32  # verl skips autocast: fp64 throughout
    engine.scaler = None
    engine.engine_config = SimpleNamespace()
    if sp == 1:
        engine.get_data_parallel_size = lambda: 1  # one process
    return engine


def _step(run, mesh, sp):
    """One verl training step (``forward_backward_batch``, which calls backward) of ``run``;
    the matmul FLOPs it ran and the ``policy_loss.fused`` warnings it gave."""
    policy_loss, agg, *options = RUNS[run]
    actor = verl_config.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
        clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=0.03, loss_agg_mode=agg,
        policy_loss=policy_loss(), **(options[0] if options else {}))
    model = _CausalLM(_params())
    engine = _engine(model, mesh, sp)
    loss_fn = functools.partial(ppo_loss, config=actor)  # as verl's actor worker binds it
    data = _batch()
    g = torch.Generator().manual_seed(23)  # the reference: k3's clamp reached at a few tokens
    old = data["old_log_probs"]
    data["ref_log_prob"] = old + torch.where(
        torch.rand(old.shape, generator=g) < 0.15, torch.full_like(old, -12.0),
        0.4 * torch.randn(old.shape, generator=g, dtype=torch.float64))
    with warnings.catch_warnings(record=True) as caught, FlopCounterMode(display=False) as fl:
        warnings.simplefilter("always")
        out = engine.forward_backward_batch(data, loss_fn)
    (loss,) = out["loss"]
    grads = {name: p.grad for name, p in model.named_parameters()}
    metrics = {k: float(v.aggregate()) if hasattr(v, "aggregate") else float(sum(v) / len(v))
               for k, v in out["metrics"].items()}
    return dict(loss=loss, metrics=metrics, log_probs=out["model_output"]["log_probs"].values(),
                entropy=out["model_output"]["entropy"].values(),
                hidden=model.model.hidden, hidden_grad=model.model.hidden.grad, grads=grads,
                flops=fl.get_total_flops(),
                fallbacks=[str(w.message) for w in caught if "policy_loss.fused" in str(w.message)])


def _worker(rank, world):
    # verl's FSDP engine moves batches to get_device_id(); this is a CPU run
    fsdp_impl.get_device_id = lambda: "cpu"
    fsdp_impl.get_device_name = lambda: "cpu"
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "sp"))
    set_ulysses_sequence_parallel_group(mesh["sp"].get_group())  # verl's train_mode does this
    total = sum(p + r for p, r in SEQS)
    n = -(-total // world)  # each rank's share of the padded stream
    enable_fused_head()
    try:
        got = {run: _step(run, mesh, world) for run in RUNS}
        want = {run: _step(run, mesh, 1) for run in RUNS}
    finally:
        disable_fused_head()
    oracle = _oracle_logprobs(_batch())
    for run in RUNS:
        g, w = got[run], want[run]
        # the forward the step ran: this rank's slice of the padded stream
        assert g["hidden"].shape == (1, n, D) and w["hidden"].shape == (1, total, D), run
        if run.endswith("/fused"):
            # fused under Ulysses too (fused_policy_loss with cp_group): no fallback; the
            # head's work is three GEMM passes over the response rows
            assert g["fallbacks"] == [] and w["fallbacks"] == [], (run, g["fallbacks"])
            assert w["flops"] == 3 * 2 * sum(r for _, r in SEQS) * D * V, run
            if "gspo" not in run:  # GSPO's sequence ratio streams under cp_group (4 passes)
                # and under Ulysses too: each rank's rows in chunks of its own, over the group
                flops = torch.tensor(g["flops"], dtype=torch.float64)
                dist.all_reduce(flops)
                assert flops == w["flops"], (run, flops, w["flops"])
        else:
            torch.testing.assert_close(w["log_probs"], oracle, rtol=RTOL, atol=ATOL)
            # verl's gather: every rank sees the whole sequences' logprobs and entropies
            torch.testing.assert_close(g["log_probs"], w["log_probs"], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(g["entropy"], w["entropy"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(g["loss"], w["loss"], rtol=RTOL, atol=ATOL, msg=run)
        assert g["metrics"].keys() == w["metrics"].keys(), run
        for name, value in g["metrics"].items():
            torch.testing.assert_close(value, w["metrics"][name], rtol=RTOL, atol=ATOL,
                                       msg=f"{run}: {name}")
        # this rank's hidden rows: the whole loss's gradient there, times the Ulysses size
        # (the gather's backward; FSDP's average over the ranks takes it back)
        expected = slice_input_tensor(w["hidden_grad"], dim=1, padding=True)
        torch.testing.assert_close(g["hidden_grad"], world * expected, rtol=RTOL, atol=ATOL,
                                   msg=run)
        for name, grad in g["grads"].items():
            mean = grad.clone()
            dist.all_reduce(mean)
            torch.testing.assert_close(mean / world, w["grads"][name], rtol=RTOL, atol=ATOL,
                                       msg=f"{run}: {name}")
    # the fused step against the composed one on the same Ulysses path: every metric
    f, c = got["logitless_grpo/fused"], got["logitless_grpo"]
    assert f["metrics"].keys() == c["metrics"].keys()
    for name, value in f["metrics"].items():
        torch.testing.assert_close(value, c["metrics"][name], rtol=RTOL, atol=ATOL, msg=name)
    for ours, verls in SAME_AS_VERL.items():  # the adapter against the code it replaces
        o, v = got[ours], got[verls]
        torch.testing.assert_close(o["loss"], v["loss"], rtol=RTOL, atol=ATOL)
        for name in ("actor/pg_loss", "actor/entropy_loss", "kl_loss", "kl_coef"):
            if name in v["metrics"]:
                torch.testing.assert_close(o["metrics"][name], v["metrics"][name], rtol=RTOL,
                                           atol=ATOL, msg=f"{ours}: {name}")
        torch.testing.assert_close(o["hidden_grad"], v["hidden_grad"], rtol=RTOL, atol=ATOL)
        for name, grad in o["grads"].items():
            torch.testing.assert_close(grad, v["grads"][name], rtol=RTOL, atol=ATOL, msg=name)
    # the comparisons are not vacuous: clipping is active, the runs differ, gradients flow
    assert all(got[run]["metrics"]["actor/pg_clipfrac"] > 0 for run in RUNS)
    assert got["logitless_gspo"]["loss"] != got["logitless_gspo/token-mean"]["loss"]
    assert got["logitless_gspo"]["loss"] != got["logitless_grpo"]["loss"]
    assert all(bool(g.abs().sum() > 0) for g in got["logitless_gspo"]["grads"].values())


@pytest.mark.dist  # ~15 s a world size on two cores: make test-dist
@pytest.mark.parametrize("world", [2, 3])
def test_verl_ulysses_step_through_the_adapters(world):
    run_on_gloo(world, _worker)
