"""Every invalid draw raises ``ValueError`` naming the argument: config fields, policy-loss
tensors and counts, linear_logprobs and fused_policy_loss arguments, attention_entropy options.

A valid call is drawn, then one argument is replaced by a value from the tables below. Values
the library once accepted (issue 12) are in the tables too, or in ``FIXED`` (fixed calls)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import logitless
from logitless import PolicyLossConfig, fused_policy_loss, linear_logprobs, policy_loss
from properties.harness import configs
from properties.strategies import layouts, policy_batches, policy_configs, seeds

NAN, INF = math.nan, math.inf

# PolicyLossConfig: field -> values invalid whatever the other fields are.
BAD_FIELDS = {
    "objective": ["nope", 3],
    "ratio_level": ["bogus"],
    "loss_agg": ["mean"],
    "entropy_agg": ["mean"],
    "eps_low": [-0.1, NAN, "0.2"],
    "eps_high": [-0.5, NAN],
    "beta": [-1.0, NAN, INF, "0.1"],
    "kl_estimator": ["k4"],
    "entropy_coef": [NAN, INF, "0.1", True],
    "top_entropy_quantile": [1.5, -0.1, NAN, "0.5"],
    "adv_entropy_top_fraction": [0.0, 1.5],
    "attn_entropy_quantile": [0.0, 2.0],
    "attn_entropy_weighting": ["loud"],
    "attn_entropy_standardize": ["token"],
    "cov_fraction": [0.0],
    "sapo_tau_pos": [0.0, -1.0],
    "dppo_ratio_cap": [0.0],
    "delight_eta": [0.0],
    "prob_reweight_alpha": [1.5, -0.1],
    "dual_clip_c": [1.0, 0.5, NAN],
    "delta": [1.0, NAN],
    "rollout_is": ["bogus"],
    "rollout_is_mode": ["clip"],
    "rollout_is_max": [0.0, -1.0, "2"],
    "seq_count": ["some"],
    "cispo_clip": ["lower"],
    "prefix_bound_growth": ["cubic"],
    "minpro_prefix": ["following"],
    "dhpo_mix": [1.5, "max", True],
    "dp_size": [0, 1.5, True],
    "grad_accum_steps": [0, 2.5],
    "max_response_length": [0, 2.5, True],
    "cov_seed": [1.5, "3"],
    "length_power_alpha": [-0.1, NAN],
    "future_kl_coef": [NAN, -1.0],
    "log_ratio_clamp": [-1.0, NAN],
}

# Once accepted (or failing with another error), now refused with a ValueError naming the
# argument: calls beyond the config (whose values are in BAD_FIELDS).
FIXED = [
    ("attention", "scale", "1"),
    ("fused", "max_tile_bytes", 0),
    ("fused", "max_tile_bytes", -1),
    ("fused", "max_tile_bytes", 0.5),
    ("fused", "max_tile_bytes", "1GB"),
    ("fused", "max_tile_bytes", True),
    ("logprobs", "max_tile_bytes", 0),
    ("logprobs", "max_tile_bytes", -8),
    ("logprobs", "max_tile_bytes", 1.5),
    ("logprobs", "max_tile_bytes", "64"),
    ("logprobs", "ignore_index", 0.5),
    ("logprobs", "ignore_index", "x"),
    ("logprobs", "softcap", "30"),
    ("logprobs", "hidden", "D=0"),
]


@given(policy_configs(), st.sampled_from([(k, v) for k, vs in BAD_FIELDS.items() for v in vs]))
def test_config_rejects_every_invalid_field(kw, bad):
    field, value = bad
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**dict(kw, **{field: value}))


def _policy_mutations(batch, cu):
    """(argument name, the call's keyword arguments with that argument made invalid)."""
    lp = batch.pack(batch.lp)
    n = lp.shape[0]
    longer = lp.new_zeros(*lp.shape[:-1], lp.shape[-1] + 1)
    nan_at_0 = lambda x: torch.where(torch.arange(x.numel()).view(x.shape) == 0, NAN, x)
    out = [
        ("old_logprobs", dict(old_logprobs=longer)),
        ("ref_logprobs", dict(ref_logprobs=lp.unsqueeze(-1))),
        ("token_weights", dict(token_weights=longer)),
        ("advantages", dict(advantages=torch.zeros(n + 5, 7))),
        ("mask", dict(mask=batch.pack(batch.mask).unsqueeze(0))),
        ("num_items_in_batch", dict(num_items_in_batch=NAN)),
        ("num_items_in_batch", dict(num_items_in_batch="8")),
        ("num_items_in_batch", dict(num_items_in_batch=-1)),
        ("global_batch_size", dict(global_batch_size=NAN)),
        ("global_batch_size", dict(global_batch_size=torch.ones(2))),
    ]
    if lp.numel():  # a NaN needs an element to sit in
        out += [("old_logprobs", dict(old_logprobs=nan_at_0(lp))),
                ("entropy", dict(entropy=nan_at_0(lp))),
                ("advantages", dict(advantages=nan_at_0(batch.pack(batch.adv))))]
    if cu is not None:
        out += [("cu_seqlens", dict(cu_seqlens=cu + 1)),
                ("cu_seqlens", dict(cu_seqlens=cu.float()))]
        if n:
            out.append(("cu_seqlens", dict(cu_seqlens=cu.flip(0))))
    return out


@given(policy_batches(layouts(min_b=1)), st.data())
def test_policy_loss_rejects_every_invalid_input(batch, data):
    layout = batch.layout
    if layout.packed:  # per sequence here ([B, 1] from `pack` when N == B)
        batch.adv = batch.adv[:, 0] if batch.adv.dim() == 2 else batch.adv
    cfg, _ = configs(dict(objective="grpo"), batch)
    cu = layout.cu_seqlens if layout.packed else None
    args = dict(old_logprobs=batch.pack(batch.old), advantages=batch.pack(batch.adv),
                mask=batch.pack(batch.mask), ref_logprobs=batch.pack(batch.ref),
                entropy=batch.pack(batch.entropy), token_weights=batch.pack(batch.old).exp(),
                cu_seqlens=cu)
    cases = _policy_mutations(batch, cu)
    name, change = data.draw(st.sampled_from(cases))
    with pytest.raises(ValueError, match=name):
        policy_loss(batch.pack(batch.lp), config=cfg, **dict(args, **change))


@st.composite
def head_calls(draw):
    n, d, v = draw(st.integers(1, 6)), draw(st.integers(1, 8)), draw(st.integers(2, 12))
    gen = torch.Generator().manual_seed(draw(seeds))
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen)
    bias = torch.randn(v, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, bias, targets


HEAD_BAD = [
    ("targets", lambda h, w, b, t: dict(targets=t.float())),
    ("targets", lambda h, w, b, t: dict(targets=t[:-1])),
    ("targets", lambda h, w, b, t: dict(targets=torch.full_like(t, w.shape[0]))),
    ("targets", lambda h, w, b, t: dict(targets=torch.full_like(t, -5))),
    ("weight", lambda h, w, b, t: dict(weight=torch.cat([w, w], 1))),
    ("weight", lambda h, w, b, t: dict(weight=w.double())),
    ("weight", lambda h, w, b, t: dict(weight=w[0])),
    ("bias", lambda h, w, b, t: dict(bias=torch.cat([b, b]))),
    ("bias", lambda h, w, b, t: dict(bias=b.half())),
    ("hidden", lambda h, w, b, t: dict(hidden=h.long())),
    ("temperature", lambda h, w, b, t: dict(temperature=0.0)),
    ("temperature", lambda h, w, b, t: dict(temperature=NAN)),
    ("temperature", lambda h, w, b, t: dict(temperature="1")),
    ("softcap", lambda h, w, b, t: dict(softcap=-1.0)),
    ("softcap", lambda h, w, b, t: dict(softcap=INF)),
    ("logit_scale", lambda h, w, b, t: dict(logit_scale=0.0)),
    ("stats", lambda h, w, b, t: dict(stats=("median",))),
]


@given(head_calls(), st.sampled_from(HEAD_BAD))
def test_linear_logprobs_rejects_every_invalid_input(call, bad):
    hidden, weight, bias, targets = call
    name, change = bad
    args = dict(hidden=hidden, weight=weight, targets=targets, bias=bias)
    with pytest.raises(ValueError, match=name):
        linear_logprobs(**dict(args, **change(hidden, weight, bias, targets)))


@given(head_calls(), st.sampled_from(["strategy", "targets", "hidden"]))
def test_fused_policy_loss_rejects_every_invalid_input(call, name):
    hidden, weight, _, targets = call
    n = hidden.shape[0]
    args = dict(hidden=hidden[None], weight=weight, targets=targets[None],
                old_logprobs=-torch.ones(1, n), advantages=torch.ones(1),
                mask=torch.ones(1, n, dtype=torch.bool), config=PolicyLossConfig())
    change = {"strategy": dict(strategy="fast"),
              "targets": dict(targets=torch.full((1, n), weight.shape[0])),
              "hidden": dict(hidden=hidden)}[name]
    with pytest.raises(ValueError, match=name):
        fused_policy_loss(**dict(args, **change))


def _call_with(what, name, value):
    hidden, weight = torch.randn(4, 8), torch.randn(11, 8)
    targets = torch.tensor([0, 1, 2, 3])
    if what == "fused":
        fused_policy_loss(hidden[None], weight, targets[None], -torch.ones(1, 4), torch.ones(1),
                          torch.ones(1, 4, dtype=torch.bool), PolicyLossConfig(),
                          **{name: value})
    elif what == "logprobs":
        if name == "hidden":
            linear_logprobs(torch.randn(4, 0), torch.randn(11, 0), targets)
        else:
            linear_logprobs(hidden, weight, targets, **{name: value})
    else:
        q = torch.randn(1, 2, 5, 4)
        logitless.attention_entropy(q, q.clone(), **{name: value})


@pytest.mark.parametrize(("what", "name", "value"), FIXED,
                         ids=[f"{w}-{n}={v!r}" for w, n, v in FIXED])
def test_formerly_unvalidated_arguments_are_refused(what, name, value):
    with pytest.raises(ValueError, match=name):
        _call_with(what, name, value)
