"""logitless.integrations.megatron against real megatron-core (0.16.1 and 0.19.2, installed by
`make test-dist`), on 2 and 3 gloo ranks: a ColumnParallelLinear output layer against Megatron's
`vocab_parallel_cross_entropy`, and a tiny GPTModel's every parameter gradient against the
model's own loss, through the output_processor hook (>= 0.18) and `forward` (any version).

Each spawned group runs every case of its version and world size (the imports cost ~20 s a
group). Rank 0 writes the comparison table (max relative error per case) to
LOGITLESS_MEGATRON_TABLE when it is set:
`LOGITLESS_MEGATRON_TABLE=/tmp/t.json make test-dist PYTEST_ARGS="-k megatron"`.
"""

import functools
import json
import os
import tempfile
import warnings
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import logitless.reference as reference
from logitless import PolicyLossConfig, policy_loss
from logitless.integrations.megatron import FusedLoss, MegatronHead, forward, output_processor
from megatron_cpu import megatron_dir, save_tiny_hf_model, start_megatron, verl_megatron_engine

from testing import run_on_gloo

V_REAL = 101  # padded to a multiple of 8 * world: the last rank holds Megatron's padding rows
# max relative error (max |a - b| / max |b|) of logitless against Megatron, by dtype
TOL = {torch.float32: 2e-7}
# the entropy against the fp64 reference (bf16: the head's logits are rounded to bf16)
ENTROPY_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def _rel(a, b):
    """max |a - b| / max |b| over the entries where they differ (a -inf equals a -inf)."""
    a, b = a.detach().double(), b.detach().double()
    diff = torch.where(a == b, 0.0, a - b)
    return float(diff.abs().max() / b[b.isfinite()].abs().max())


def _padded(world):
    step = 8 * world
    return (V_REAL + step - 1) // step * step


def _slice(full, world):
    rank = dist.get_rank()
    rows = full.shape[0] // world
    return full[rank * rows:(rank + 1) * rows]


def _output_layer(world, sp, dtype, weight):
    """A ColumnParallelLinear output layer (gather_output=False) holding this rank's slice of
    ``weight``."""
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sp,
                                 params_dtype=dtype, use_cpu_initialization=True)
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0], config=config,
                                 init_method=torch.nn.init.zeros_, bias=False,
                                 gather_output=False)
    with torch.no_grad():
        layer.weight.copy_(_slice(weight, world).to(dtype))
    return layer, config


def _check_reference(name, rows, out, ref, h, h_ref, layer, w_ref, world, sp):
    """logitless's results and gradients against the fp64 reference's, to 1e-12."""
    h_grad_ref = _slice(h_ref.grad, world) if sp else h_ref.grad
    for what, ours, oracle in (("logprob", out.logprobs, ref.logprobs),
                               ("entropy", out.entropy, ref.entropy),
                               ("hidden grad", h.grad, h_grad_ref),
                               ("weight grad", layer.weight.grad, _slice(w_ref.grad, world))):
        err = _rel(ours, oracle)
        rows.append((name, what, None, err, None))
        assert err <= 1e-12, (name, what, err)


def _cpl_cases(world, rows):
    """ColumnParallelLinear (gather_output=False) + vocab_parallel_cross_entropy against the
    processor over the same layer: values, hidden and weight gradients."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    d, s, b, v = 40, 12, 3, _padded(world)  # s divides by 2 and 3 (split under SP)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for sp in (False, True):
            name = f"ColumnParallelLinear {str(dtype)[6:]} sp={int(sp)}"
            gen = torch.Generator().manual_seed(1)
            hidden = torch.randn(s, b, d, generator=gen, dtype=torch.float64)
            weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.4
            targets = torch.randint(0, v, (s, b), generator=gen)
            g = torch.randn(s, b, generator=gen, dtype=torch.float64)
            layer, config = _output_layer(world, sp, dtype, weight)
            local = _slice(hidden, world) if sp else hidden
            # Megatron's own head and loss
            h_meg = local.to(dtype, copy=True).requires_grad_()
            logits, _ = layer(h_meg)
            loss = vocab_parallel_cross_entropy(logits.float() if dtype == torch.bfloat16
                                                else logits, targets)
            (loss.double() * g).sum().backward()
            w_meg, layer.weight.grad = layer.weight.grad, None
            # logitless through the processor, over the same layer
            h_ll = local.to(dtype, copy=True).requires_grad_()
            out = output_processor(hidden_states=h_ll, output_layer=layer, output_weight=None,
                                   labels=targets.t(), context=MegatronHead(), config=config)
            lp = out.logprobs.t()
            (-lp.double() * g).sum().backward()
            # the fp64 oracle over the whole head, from the same (rounded) inputs
            h_ref = hidden.to(dtype).to(torch.float64, copy=True).requires_grad_()
            w_ref = weight.to(dtype).to(torch.float64, copy=True).requires_grad_()
            ref = reference.linear_logprobs(h_ref, w_ref, targets, return_entropy=True)
            (-ref.logprobs * g).sum().backward()
            h_grad_ref = _slice(h_ref.grad, world) if sp else h_ref.grad
            pairs = (("logprob", lp, -loss, ref.logprobs),
                     ("hidden grad", h_ll.grad, h_meg.grad, h_grad_ref),
                     ("weight grad", layer.weight.grad, w_meg, _slice(w_ref.grad, world)))
            for what, ours, meg, oracle in pairs:
                rows.append((name, what, _rel(ours, meg), _rel(ours, oracle), _rel(meg, oracle)))
                if dtype == torch.bfloat16:  # both round logits and gradients to bf16, at
                    # different steps: as close to the oracle as Megatron, to bf16's rounding
                    assert _rel(ours, oracle) <= 2 * _rel(meg, oracle) + 2**-8, (name, what)
                elif dtype == torch.float64:  # Megatron's loss is fp32 inside: the oracle
                    assert _rel(ours, oracle) <= 1e-12, (name, what, _rel(ours, oracle))
                else:
                    assert _rel(ours, meg) <= TOL[dtype], (name, what, _rel(ours, meg))
            err = _rel(out.entropy.t(), ref.entropy)  # Megatron has no entropy
            rows.append((name, "entropy", None, err, None))
            assert err <= ENTROPY_TOL[dtype], (name, err)


def _vocab_size_case(world, rows):
    """vocab_size= leaves Megatron's padding rows out; -100 labels; vLLM's top-p and a
    per-token temperature: against the fp64 reference over the real vocabulary."""

    d, s, b, v = 40, 12, 3, _padded(world)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(s, b, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.4
    labels = torch.randint(0, V_REAL, (b, s), generator=gen)
    labels[0, :3] = -100
    temperature = torch.rand(b, s, generator=gen, dtype=torch.float64) + 0.5
    g = torch.randn(b, s, generator=gen, dtype=torch.float64)
    for sp in (False, True):
        layer, config = _output_layer(world, sp, torch.float64, weight)
        h = (_slice(hidden, world) if sp else hidden).clone().requires_grad_()
        head = MegatronHead(vocab_size=V_REAL, temperature=temperature, top_p=0.9)
        out = output_processor(hidden_states=h, output_layer=layer, output_weight=None,
                               labels=labels, context=head, config=config)
        h_ref = hidden.clone().requires_grad_()
        w_ref = weight.clone().requires_grad_()
        ref = reference.linear_logprobs(h_ref.transpose(0, 1), w_ref[:V_REAL], labels,
                                        temperature=temperature, top_p=0.9,
                                        return_entropy=True)
        kept = ref.logprobs.isfinite()  # -inf: the target is outside the kept set
        assert not kept.all()
        ((ref.logprobs.where(kept, 0.0) + ref.entropy) * g).sum().backward()
        ((out.logprobs.where(kept, 0.0) + out.entropy) * g).sum().backward()
        name = f"vocab_size + top_p + -100 fp64 sp={int(sp)}"
        _check_reference(name, rows, out, ref, h, h_ref, layer, w_ref, world, sp)
        assert (out.logprobs[0, :3] == 0).all() and (out.entropy[0, :3] == 0).all()
        for bad in (v + 1, 0, 3.0):  # every rank refuses alike
            with pytest.raises(ValueError, match="vocab_size"):
                output_processor(hidden_states=h, output_layer=layer, output_weight=None,
                                 labels=labels, context=MegatronHead(vocab_size=bad),
                                 config=config)


def _kept_case(world, rows):
    """kept_ids (recorded kept sets, -1 padded, a target outside its set, -100 labels) over
    the sharded head, with vocab_size and a temperature: against the fp64 reference."""

    d, s, b, k, v = 40, 12, 3, 6, _padded(world)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(s, b, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.4
    kept = torch.rand(b, s, V_REAL, generator=gen).argsort(-1)[..., :k]  # distinct per token
    kept[..., 4:] = torch.where(torch.rand(b, s, 2, generator=gen) < 0.5, -1, kept[..., 4:])
    labels = kept[..., 0].clone()
    labels[1, 2] = (kept[1, 2].max() + 1) % V_REAL  # outside its kept set: -inf
    labels[1, 2] = labels[1, 2] if labels[1, 2] not in kept[1, 2] else -100
    labels[0, :2] = -100
    g = torch.randn(b, s, generator=gen, dtype=torch.float64)
    for sp in (False, True):
        layer, config = _output_layer(world, sp, torch.float64, weight)
        h = (_slice(hidden, world) if sp else hidden).clone().requires_grad_()
        head = MegatronHead(vocab_size=V_REAL, temperature=0.7, kept_ids=kept)
        out = output_processor(hidden_states=h, output_layer=layer, output_weight=None,
                               labels=labels, context=head, config=config)
        h_ref = hidden.clone().requires_grad_()
        w_ref = weight.clone().requires_grad_()
        ref = reference.linear_logprobs(h_ref.transpose(0, 1), w_ref[:V_REAL], labels,
                                        temperature=0.7, kept_ids=kept, return_entropy=True)
        inside = ref.logprobs.isfinite()
        assert not inside.all()
        ((ref.logprobs.where(inside, 0.0) + ref.entropy) * g).sum().backward()
        ((out.logprobs.where(inside, 0.0) + out.entropy) * g).sum().backward()
        name = f"kept_ids + vocab_size + -100 fp64 sp={int(sp)}"
        _check_reference(name, rows, out, ref, h, h_ref, layer, w_ref, world, sp)
        with pytest.raises(ValueError, match="stats"):  # the gathered rows give no lse
            output_processor(hidden_states=h, output_layer=layer, output_weight=None,
                             labels=labels, config=config,
                             context=MegatronHead(kept_ids=kept, stats=("log_kept_mass",)))


def _gpt_model(world, sp, tied, dtype=torch.float32):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(3)  # every rank builds the same master weights, then takes its slice
    config = TransformerConfig(num_layers=2, hidden_size=48, num_attention_heads=6,
                               tensor_model_parallel_size=world, sequence_parallel=sp,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, params_dtype=dtype)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=_padded(world), max_sequence_length=32,
                    share_embeddings_and_output_weights=tied)


def _norm_rel(got, want, names):
    num = sum(float((got[n].double() - want[n].double()).norm() ** 2) for n in names)
    return (num / sum(float(want[n].double().norm() ** 2) for n in names)) ** 0.5


def _fp64_grads(model, world, sp, tied, args, labels, g):
    """Every parameter's gradient of Megatron's own loss, from the same model in fp64."""
    exact = _gpt_model(world, sp, tied, torch.float64)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in exact.named_parameters():
            p.copy_(params[n])
    (exact(**args, labels=labels) * g.double()).sum().backward()
    return {n: p.grad for n, p in exact.named_parameters()}


def _gpt_cases(world, rows, hook):
    """A GPTModel's loss against the processor's -logprob: values and every parameter's
    gradient, through the hook (megatron-core >= 0.18) and through `forward`."""
    b, s = 2, 12
    gen = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, V_REAL, (b, s), generator=gen)
    labels = torch.randint(0, _padded(world), (b, s), generator=gen)
    g = torch.randn(b, s, generator=gen)
    position_ids = torch.arange(s).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True: masked out
    args = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
    ways = ("hook", "forward") if hook else ("forward",)
    for sp, tied in ((False, False), (True, False), (True, True)):
        model = _gpt_model(world, sp, tied)
        loss = model(**args, labels=labels)
        (loss * g).sum().backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        exact = _fp64_grads(model, world, sp, tied, args, labels, g)
        for way in ways:
            model.zero_grad(set_to_none=True)
            head = MegatronHead(return_entropy=False)
            if way == "hook":
                out = model(**args, labels=labels, output_processor=output_processor,
                            output_processor_context=head)
            else:
                out = forward(model, head, labels=labels, **args)
            (-out.logprobs * g).sum().backward()
            name = f"GPTModel {way} fp32 sp={int(sp)} tied={int(tied)}"
            rows.append((name, "logprob", _rel(out.logprobs, -loss), None, None))
            assert _rel(out.logprobs, -loss) <= TOL[torch.float32], name
            # every gradient: norm-wise relative error, of all of them together (the bound)
            # and the worst parameter's, each also against the fp64 model's (Megatron's
            # own fp32 gradients are that far from it too)
            got = {n: p.grad for n, p in model.named_parameters()}
            whole = _norm_rel(got, want, list(want))
            worst = max(list(want), key=lambda n: _norm_rel(got, want, [n]))
            rows.append((name, f"all {len(want)} parameter grads", whole,
                         _norm_rel(got, exact, list(want)), _norm_rel(want, exact, list(want))))
            rows.append((name, f"worst parameter grad ({worst})", _norm_rel(got, want, [worst]),
                         _norm_rel(got, exact, [worst]), _norm_rel(want, exact, [worst])))
            assert whole <= TOL[torch.float32], (name, whole)
            for n in want:  # as close to the fp64 gradient as Megatron's, to fp32 rounding
                assert _norm_rel(got, exact, [n]) <= 2 * _norm_rel(want, exact, [n]) + 1e-6, n


def _fused_loss_case(world, rows, hook):
    """``MegatronHead(loss=FusedLoss(...))``: the fused policy loss over the model's sharded
    output layer (fp64) against `policy_loss` on the processor's own per-token logprobs and
    entropies from the same model: the loss and every parameter's gradient, SP off and on,
    tied, padded vocabulary rows left out (`vocab_size`), through the hook and `forward`."""
    b, s = 3, 12  # s divisible by TP 2 and 3 (sequence parallelism)
    gen = torch.Generator().manual_seed(5)
    f64 = dict(generator=gen, dtype=torch.float64)
    input_ids = torch.randint(0, V_REAL, (b, s), generator=gen)
    labels = torch.randint(0, V_REAL, (b, s), generator=gen)
    labels[1, 7:] = -100  # a shorter response
    old = -torch.rand(b, s, **f64) * 5
    adv = torch.randn(b, **f64)
    ref = old + 0.3 * torch.randn(b, s, **f64)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, 0] = False
    cfg = PolicyLossConfig(objective="gspo", beta=0.1, kl_estimator="k3", entropy_coef=0.02)
    args = dict(input_ids=input_ids, position_ids=torch.arange(s).expand(b, s),
                attention_mask=torch.ones(1, 1, s, s, dtype=torch.bool).triu(1))
    ways = ("hook", "forward") if hook else ("forward",)

    def run(model, head, way):
        model.zero_grad(set_to_none=True)
        if way == "hook":
            return model(**args, labels=labels, output_processor=output_processor,
                         output_processor_context=head)
        return forward(model, head, labels=labels, **args)

    for sp, tied in ((False, False), (True, True)):
        model = _gpt_model(world, sp, tied, torch.float64)
        for way in ways:
            out = run(model, MegatronHead(vocab_size=V_REAL), way)
            want, _ = policy_loss(out.logprobs, old, adv, mask & (labels != -100), cfg,
                                  entropy=out.entropy, ref_logprobs=ref)
            want.backward()
            expected = {n: p.grad.clone() for n, p in model.named_parameters()}
            loss = FusedLoss(cfg, old, adv, mask, dict(ref_logprobs=ref))
            got, metrics = run(model, MegatronHead(vocab_size=V_REAL, loss=loss), way)
            got.backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            name = f"fused loss GPTModel {way} fp64 sp={int(sp)} tied={int(tied)}"
            rows.append((name, "loss", _rel(got, want), None, None))
            rows.append((name, f"all {len(grads)} parameter grads",
                         _norm_rel(grads, expected, list(expected)), None, None))
            assert _rel(got, want) <= 1e-12, name
            assert "kl" in metrics, name
            for n in expected:
                assert _norm_rel(grads, expected, [n]) <= 1e-10, (name, n)


def _verl_case(world, rows, hook):
    """verl 0.9.1's Megatron fused forward with LOGITLESS_VERL_FUSED_HEAD=1, under sequence
    parallelism: through Megatron's output_processor hook (>= 0.18) or verl's patched forward
    (older), against the model's own loss (verl packs sequences into one row: b = 1)."""
    os.environ["LOGITLESS_VERL_FUSED_HEAD"] = "1"  # read when verl loads its plugins
    from verl.models.mcore import model_forward_fused as fused

    import logitless.integrations.verl  # noqa: F401  (loaded by verl's plugins already)
    from logitless.integrations import verl_head

    assert verl_head.fused_head_enabled() and fused.linear_cross_entropy is \
        verl_head.linear_cross_entropy
    s = 12
    gen = torch.Generator().manual_seed(5)
    args = dict(input_ids=torch.randint(0, V_REAL, (1, s), generator=gen),
                position_ids=torch.arange(s).unsqueeze(0),
                attention_mask=torch.ones(1, 1, s, s, dtype=torch.bool).triu(1))
    labels = torch.randint(0, _padded(world), (1, s), generator=gen)
    g = torch.randn(s, generator=gen)
    model = _gpt_model(world, True, False)
    loss = model(**args, labels=labels)[0]
    (loss * g).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fused.patch_fused_forward(model)
    assert fused._use_output_processor_hook(model) == hook
    if hook:
        out = model(**args, labels=labels, output_processor=fused.fused_output_processor,
                    output_processor_context=fused.FusedOutputProcessorContext(1.0))
    else:
        out = model(**args, labels=labels, temperature=1.0)
    fused.unpatch_fused_forward(model)
    (-out.log_probs * g).sum().backward()
    name = f"verl fused forward ({'hook' if hook else 'legacy patch'}) fp32 sp=1"
    got = {n: p.grad for n, p in model.named_parameters()}
    whole = _norm_rel(got, want, list(want))
    rows.append((name, "logprob", _rel(out.log_probs, -loss), None, None))
    rows.append((name, f"all {len(want)} parameter grads", whole, None, None))
    assert _rel(out.log_probs, -loss) <= TOL[torch.float32] and whole <= TOL[torch.float32]


# (logitless loss mode, loss_agg_mode, verl's built-in loss mode): the same objective
# the loss: fp32 terms summed in another order than verl's (a few ulp; the gradients are equal)
LOSS_TOL = 1e-6
ENGINE_CASES = (("logitless_grpo", "token-mean", "vanilla"),
                ("logitless_cispo", "seq-mean-token-mean", "cispo"))
# policy_loss.fused on the engine: (loss mode, loss_agg_mode, actor options, calculate_entropy);
# the last with verl's entropy and KL terms, which join the fused call (an entropy coefficient
# that keeps the loss off a cancellation of its terms, where a relative bound on it would
# measure the cancellation: at 0.02 the bf16 model's composed loss and verl's vanilla differ
# by 2e-6 of it)
VERL_TERMS = dict(entropy_coeff=0.002, use_kl_loss=True, kl_loss_type="low_var_kl",
                  kl_loss_coef=0.05)
FUSED_ENGINE_CASES = (("logitless_grpo", "token-mean", {}, False),
                      ("logitless_cispo", "seq-mean-token-mean", {}, False),
                      ("logitless_grpo", "seq-mean-token-mean", VERL_TERMS, True))


def _verl_engine_case(world, rows, model_path):
    """verl 0.9.1's Megatron actor step (`MegatronEngineWithLMHead.forward_backward_batch`,
    verl's `ppo_loss` bound as its actor worker binds it, Megatron's schedule, DDP's gradient
    buffers) with a `logitless_*` loss mode against verl's built-in one: the loss and every
    parameter's gradient. Twice: BSHD with verl's logits, and THD (verl's default) with verl's
    fused forward, whose head is logitless's drop-in; there also `policy_loss.fused` through
    logitless's hook on this engine (`fused_policy_loss(vocab_parallel=)` over the
    tensor-parallel head) against the composed loss, also with verl's entropy and KL terms
    (BSHD: refused, no fused head). The old
    logprobs are the engine's own (its forward-only pass, fp32), a little off, so that some
    ratios clip; both layouts give the same ones."""
    from verl.models.mcore import model_forward_fused
    from verl.utils import tensordict_utils as tu
    from verl.workers import config as verl_config
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from integrations.test_verl_ulysses_adapter import _batch
    from logitless.integrations import verl as verl_adapter
    from logitless.integrations import verl_head
    from logitless.integrations.verl import LogitlessPolicyLossConfig

    verl_head.enable_fused_head()
    assert model_forward_fused.linear_cross_entropy is verl_head.linear_cross_entropy
    current = []
    for fused_kernels in (False, True):

        def data(fused_kernels=fused_kernels, entropy=False):
            batch = _batch()
            tu.assign_non_tensor(batch, calculate_entropy=entropy,
                                 use_fused_kernels=fused_kernels)
            return batch

        with verl_megatron_engine(model_path, world, remove_padding=fused_kernels,
                                  fused_kernels=fused_kernels) as engine:
            with engine.eval_mode():
                out = engine.forward_backward_batch(data(), None, forward_only=True)
            current.append(no_padding_2_padding(out["model_output"]["log_probs"], data()))
            old = current[0] + 0.2 * torch.randn(current[0].shape,
                                                 generator=torch.Generator().manual_seed(8))

            def step(mode, agg, old=old, actor_options=None, entropy=False, **options):
                actor = verl_config.McoreActorConfig(
                    strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                    clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                    loss_agg_mode=agg, **(actor_options or {}),
                    policy_loss=(LogitlessPolicyLossConfig(loss_mode=mode, **options)
                                 if options else verl_config.PolicyLossConfig(loss_mode=mode)))
                batch = data(entropy=entropy)
                batch["old_log_probs"] = old
                # the reference's logprobs, further off than the old ones
                batch["ref_log_prob"] = old + 0.3 * torch.randn(
                    old.shape, generator=torch.Generator().manual_seed(9))
                with engine.train_mode():
                    out = engine.forward_backward_batch(batch, functools.partial(ppo_loss,
                                                                                 config=actor))
                    grads = {n: p.main_grad.clone()
                             for n, p in engine.module[0].named_parameters()}
                clipped = float(out["metrics"]["actor/pg_clipfrac"].aggregate())
                return out["loss"][0], grads, clipped

            layout = "THD, logitless head" if fused_kernels else "BSHD, verl's logits"
            for ours, agg, theirs in ENGINE_CASES:
                loss, grads, clipped = step(ours, agg)
                want_loss, want, _ = step(theirs, agg)
                name = f"verl Megatron engine ({layout}) {ours} vs {theirs}, bf16, TP {world} sp=1"
                whole = _norm_rel(grads, want, list(want))
                rows.append((name, "loss", abs(loss - want_loss) / abs(want_loss), None, None))
                rows.append((name, f"all {len(want)} parameter grads", whole, None, None))
                norms = torch.stack([g.double().norm() for g in want.values()])
                dist.all_reduce(norms)  # a rank's embedding slice may hold no token of the batch
                assert bool((norms > 0).all()) and clipped > 0, name
                assert abs(loss - want_loss) <= LOSS_TOL * abs(want_loss), name
                assert whole <= TOL[torch.float32], (name, whole)
            # policy_loss.fused: it needs the fused head; with it (THD) it runs fused over the
            # tensor-parallel head
            if not fused_kernels:
                with pytest.raises(ValueError, match=r"^policy_loss\.fused: needs .*fused_kern"):
                    step("logitless_grpo", "token-mean", fused=True)
                continue
            for ours, agg, actor_options, entropy in FUSED_ENGINE_CASES:
                spy = mock.patch.object(verl_adapter, "fused_policy_loss",
                                        wraps=verl_adapter.fused_policy_loss)
                with warnings.catch_warnings(record=True) as caught, spy as called:
                    warnings.simplefilter("always")
                    fused_loss, fused, _ = step(ours, agg, actor_options=actor_options,
                                                entropy=entropy, fused=True)
                fell_back = [w for w in caught if "policy_loss.fused" in str(w.message)]
                assert not fell_back and called.call_count == 1, fell_back  # it ran fused
                kwargs = called.call_args.kwargs
                assert kwargs["vocab_parallel"] is not None
                # verl's terms in the one call: the reference logprobs and the entropies
                assert (kwargs.get("ref_logprobs") is not None) == bool(actor_options)
                assert ("out_entropy" in kwargs) == entropy
                composed_loss, composed, _ = step(ours, agg, actor_options=actor_options,
                                                  entropy=entropy, fused=False)
                terms = " with verl's entropy and KL terms" if actor_options else ""
                name = (f"verl Megatron engine (THD) {ours}{terms} fused vs composed, bf16, "
                        f"TP {world}")
                whole = _norm_rel(fused, composed, list(composed))
                rows.append((name, "loss", abs(fused_loss - composed_loss) / abs(composed_loss),
                             None, None))
                rows.append((name, f"all {len(composed)} parameter grads", whole, None, None))
                assert abs(fused_loss - composed_loss) <= LOSS_TOL * abs(composed_loss), name
                assert whole <= TOL[torch.float32], (name, whole)
    # the logitless head's logprobs (THD) against verl's from its logits (BSHD), same weights
    err = _rel(current[1], current[0])
    rows.append(("verl Megatron engine forward-only, bf16, TP 2 sp=1", "logprob THD+logitless "
                 "head vs BSHD+verl's logits", err, None, None))
    assert err <= TOL[torch.float32], err

def _verl_cp_case(world, rows):
    """verl's Megatron context-parallel THD data path (zigzag, CP = world, jagged sequences)
    around the head drop-in, as verl's fused forward runs it: labels rolled within each sequence
    and split with the tokens (`preprocess_thd_engine`), each rank's rows through the head, the
    logprobs gathered back into whole sequences (`postprocess_thd_engine`). A per-token stand-in
    for the decoder (an embedding), so the split changes nothing: against one process; the
    gradients summed over the CP ranks are one process's."""
    from megatron.core import parallel_state
    from verl.models.mcore.util import postprocess_thd_engine, preprocess_thd_engine

    from logitless.integrations.verl_head import linear_cross_entropy

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             context_parallel_size=world)
    v, d = 53, 24
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, v, (n,), generator=gen) for n in (5, 11, 8)]
    emb = torch.randn(v, d, generator=gen, dtype=torch.float64)
    weight = (torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5).requires_grad_()
    # a sequence's last label is the next row's id (padding, or the sequence's first one): verl
    # masks it out of the loss, and so does the check
    g = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in seqs]
    for w in g:
        w[-1] = 0.0
    emb_cp = emb.clone().requires_grad_()
    input_ids = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    ids, packed, _ = preprocess_thd_engine(input_ids, pre_process=True)
    labels, _, _ = preprocess_thd_engine(input_ids, pre_process=True, need_roll=True)
    assert ids.shape[1] < sum(map(len, seqs))  # each rank holds part of the tokens
    lp, _ = linear_cross_entropy(emb_cp[ids], weight, labels)
    lp = postprocess_thd_engine(lp.unsqueeze(0), packed, input_ids, len(seqs))
    sum((x * w).sum() for x, w in zip(lp.unbind(), g, strict=True)).backward()
    grads = [emb_cp.grad, weight.grad]
    for x in grads:
        dist.all_reduce(x)
    # one process, whole sequences
    emb_one = emb.clone().requires_grad_()
    weight_one = weight.detach().clone().requires_grad_()
    want = [reference.linear_logprobs(emb_one[s], weight_one, torch.roll(s, -1)).logprobs
            for s in seqs]
    sum((x * w).sum() for x, w in zip(want, g, strict=True)).backward()
    name = f"verl CP THD data path, CP {world}, zigzag, fp64"
    pairs = (("logprob", torch.cat([x[:-1] for x in lp.unbind()]),
              torch.cat([x[:-1] for x in want])),
             ("hidden (embedding) grad", grads[0], emb_one.grad),
             ("weight grad", grads[1], weight_one.grad))
    for what, ours, oracle in pairs:
        rows.append((name, what, None, _rel(ours, oracle), None))
        assert _rel(ours, oracle) <= 1e-12, (name, what, _rel(ours, oracle))


def _megatron_rank(rank, world, path, table, model_path):
    version = start_megatron(path, world)
    torch.set_num_threads(1)
    rows = []
    try:
        _cpl_cases(world, rows)
        _vocab_size_case(world, rows)
        _kept_case(world, rows)
        hook = tuple(map(int, version.split(".")[:2])) >= (0, 18)
        _gpt_cases(world, rows, hook)
        _fused_loss_case(world, rows, hook)
        _verl_case(world, rows, hook)
        if world == 2:
            _verl_engine_case(world, rows, model_path)
            _verl_cp_case(world, rows)
    finally:  # the table so far, also when a case fails
        if rank == 0:
            with open(table, "w") as f:
                json.dump({"megatron_core": version, "tp": world, "rows": rows}, f)


@pytest.mark.dist
@pytest.mark.parametrize("version, world", [("0.16.1", 2), ("0.19.2", 3)])
def test_megatron_head(version, world):
    path = megatron_dir(version)
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "table.json")
        model_path = os.path.join(tmp, "model")
        save_tiny_hf_model(model_path)
        try:
            run_on_gloo(world, _megatron_rank, path, table, model_path)
        finally:
            out = os.environ.get("LOGITLESS_MEGATRON_TABLE")
            if out and os.path.exists(table):
                with open(table) as f, open(out, "a") as g:
                    g.write(f.read() + "\n")


def test_processor_refuses_bad_arguments():
    """The context must be a MegatronHead and labels Megatron's [b, s] (no megatron needed)."""
    layer = SimpleNamespace(weight=torch.randn(7, 5), bias=None, sequence_parallel=False,
                            tp_group=object())
    kwargs = dict(hidden_states=torch.randn(3, 2, 5), output_layer=layer, output_weight=None,
                  config=SimpleNamespace())
    with pytest.raises(ValueError, match="output_processor_context"):
        output_processor(labels=torch.zeros(2, 3, dtype=torch.long), context={}, **kwargs)
    with pytest.raises(ValueError, match="labels"):
        output_processor(labels=torch.zeros(6, dtype=torch.long), context=MegatronHead(),
                         **kwargs)
    loss = FusedLoss(PolicyLossConfig(), torch.zeros(2, 3), torch.zeros(2))
    for head, what in ((MegatronHead(loss=loss, top_p=0.9), "top_p"),
                       (MegatronHead(loss=loss, temperature=torch.ones(2, 3)), "temperature"),
                       (MegatronHead(loss={}), "loss must be a FusedLoss")):
        with pytest.raises(ValueError, match=what):
            output_processor(labels=torch.zeros(2, 3, dtype=torch.long), context=head,
                             **kwargs)
    with pytest.raises(ValueError, match="post_process"):
        forward(SimpleNamespace(post_process=False), MegatronHead(), labels=None)
