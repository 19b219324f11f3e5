"""linear_divergence against TRL 1.16's own ``generalized_jsd_loss`` and linear_topk_distill
against verl 0.9.1's registered ``forward_kl_topk``, both on materialised logits; gradients
against fp64 autograd, gradcheck, the teacher's lack of a graph, bf16, and the input contract.

Sizes are odd (V=1007, D=96, N=37, the teacher's D=64) and the tile budget is small, so every
call crosses several row and vocabulary tiles."""

import math
import os

import pytest
import torch

import logitless
from logitless import reference

from testing import assert_close_to_oracle, divergence_heads, requires_triton

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

N, D, D_T, V = 37, 96, 64, 1007
TILE = 96 * 1024  # bytes: tiles of 24 x 256, so 2 row blocks x 4 vocab tiles at these sizes
BETAS = [0.0, 0.1, 0.5, 1.0]


def heads(n=N, d=D, d_t=D_T, v=V, batch=None, dtype=torch.float64, seed=0):
    """`divergence_heads` at this file's sizes."""
    return divergence_heads(n, d, d_t, v, batch=batch, dtype=dtype, seed=seed)


def scale(oracle):
    return float(oracle.detach().abs().max())


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def trl_jsd(x, beta, temperature, mask=None):
    """TRL's generalized_jsd_loss on the materialised logits of ``x``, per token (the tests
    that call it skip where TRL is not installed, e.g. verl's environment; the others run)."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    s = reference.linear_logits(x["hidden"], x["weight"], x["bias"])
    t = reference.linear_logits(x["teacher_hidden"], x["teacher_weight"], x["teacher_bias"])
    per_token = gkd.GKDTrainer.generalized_jsd_loss(s, t, beta=beta, temperature=temperature,
                                                    reduction="none").sum(-1)
    return per_token if mask is None else torch.where(mask, per_token, 0.0)


def run(x, mask=None, **kw):
    """`linear_divergence` on the heads ``x``: its `DivergenceOutput`."""
    return logitless.linear_divergence(
        x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], mask,
        bias=x["bias"], teacher_bias=x["teacher_bias"], max_tile_bytes=TILE, **kw)


def ours(x, mask=None, **kw):
    return run(x, mask, **kw).divergence


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_matches_trl_values_and_gradients_fp64(beta, temperature):
    x = heads(batch=2, seed=int(beta * 10) + int(temperature * 10))
    mask = torch.rand(2, N, generator=torch.Generator().manual_seed(1)) > 0.25
    upstream = torch.randn(2, N, dtype=torch.float64)
    mine = {k: leaf(t) for k, t in x.items()}
    theirs = {k: leaf(t) for k, t in x.items()}
    out = ours(mine, mask, beta=beta, temperature=temperature)
    ref = trl_jsd(theirs, beta, temperature, mask)
    assert out.shape == (2, N) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    for name in ("hidden", "weight", "bias"):
        torch.testing.assert_close(mine[name].grad, theirs[name].grad, rtol=1e-9, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert float(mine["hidden"].grad[~mask].abs().max()) == 0.0
    for name in ("teacher_hidden", "teacher_weight", "teacher_bias"):
        assert mine[name].grad is None, name


# Margins of the three-way checks, as the linear_logprobs tests give them: a fraction of the
# largest oracle entry. bf16 logits are rounded to bf16, as a bf16 GEMM rounds them.
MARGINS = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", list(MARGINS))
@pytest.mark.parametrize("beta", BETAS)
def test_low_precision_three_way(beta, dtype):
    """fp32/bf16 inputs, fp32 result; three-way against TRL on same-dtype logits, oracle fp64
    on the same (rounded) inputs; gradients come back in the inputs' dtype."""
    x_low = {k: t.to(dtype) for k, t in heads(seed=3).items()}
    mine, same = ({k: leaf(t) for k, t in x_low.items()} for _ in range(2))
    oracle = {k: leaf(t.double()) for k, t in x_low.items()}
    out = ours(mine, beta=beta, temperature=0.8)
    assert out.dtype == torch.float32
    ref_low, ref64 = trl_jsd(same, beta, 0.8), trl_jsd(oracle, beta, 0.8)
    margin = MARGINS[dtype]
    assert_close_to_oracle(out, ref64, ref_low, tol=margin * scale(ref64), name="divergence")
    upstream = torch.randn(N, dtype=torch.float64)
    for o in (out, ref_low, ref64):
        (o.double() * upstream).sum().backward()
    for name in ("hidden", "weight", "bias"):
        assert mine[name].grad.dtype == dtype
        assert_close_to_oracle(mine[name].grad, oracle[name].grad, same[name].grad,
                               tol=margin * scale(oracle[name].grad), name=name)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gradcheck_fp64(beta):
    x = heads(n=5, d=4, d_t=3, v=11, seed=5)
    teacher = (x["teacher_hidden"], x["teacher_weight"], x["teacher_bias"])
    mask = torch.tensor([True, False, True, True, True])

    def f(h, w, b):
        return logitless.linear_divergence(h, w, *teacher[:2], mask, beta=beta,
                                           temperature=0.9, bias=b, teacher_bias=teacher[2],
                                           max_tile_bytes=64).divergence

    assert torch.autograd.gradcheck(f, (leaf(x["hidden"]), leaf(x["weight"]), leaf(x["bias"])))


def test_teacher_gets_no_graph():
    x = {k: leaf(t) for k, t in heads(n=6, v=50, seed=6).items()}
    out = ours(x, beta=0.5)
    teacher = [x["teacher_hidden"], x["teacher_weight"], x["teacher_bias"]]
    assert all(g is None for g in torch.autograd.grad(out.sum(), teacher, allow_unused=True))
    only_teacher = logitless.linear_divergence(
        x["hidden"].detach(), x["weight"].detach(), x["teacher_hidden"], x["teacher_weight"],
        teacher_bias=x["teacher_bias"]).divergence
    assert not only_teacher.requires_grad


@pytest.mark.parametrize("beta", BETAS)
def test_return_entropy(beta):
    """``return_entropy``: the student's tempered entropy against fp64 softmax, 0 on masked
    rows, no gradient; the divergence and its gradient are those of the plain call."""
    x = heads(batch=2, seed=20)
    mask = torch.rand(2, N, generator=torch.Generator().manual_seed(2)) > 0.3
    mine, plain = ({k: leaf(t) for k, t in x.items()} for _ in range(2))
    out = run(mine, mask, beta=beta, temperature=0.7, return_entropy=True)
    div, ent = out.divergence, out.entropy
    logp = (reference.linear_logits(x["hidden"], x["weight"], x["bias"]) / 0.7).log_softmax(-1)
    exact = torch.where(mask, -(logp.exp() * logp).sum(-1), 0.0)
    assert ent.shape == (2, N) and not ent.requires_grad
    torch.testing.assert_close(ent, exact, rtol=1e-10, atol=1e-12)
    ref = ours(plain, mask, beta=beta, temperature=0.7)
    assert torch.equal(div, ref)
    div.sum().backward()
    ref.sum().backward()
    assert torch.equal(mine["weight"].grad, plain["weight"].grad)


def test_masked_rows_are_skipped():
    """Masked rows are never computed: non-finite hidden states there leave no trace."""
    x = heads(seed=7)
    mask = torch.ones(N, dtype=torch.bool)
    mask[[0, 5, 36]] = False
    for key in ("hidden", "teacher_hidden"):
        x[key][~mask] = float("nan")
    h = leaf(x["hidden"])
    out = logitless.linear_divergence(h, x["weight"], x["teacher_hidden"], x["teacher_weight"],
                                      mask, beta=0.1, max_tile_bytes=TILE).divergence
    assert bool(torch.isfinite(out).all()) and float(out.detach()[~mask].abs().max()) == 0.0
    out.sum().backward()
    assert bool(torch.isfinite(h.grad).all()) and float(h.grad[~mask].abs().max()) == 0.0
    empty = logitless.linear_divergence(h, x["weight"], x["teacher_hidden"], x["teacher_weight"],
                                        torch.zeros(N, dtype=torch.bool)).divergence
    assert float(empty.detach().abs().max()) == 0.0


def test_same_result_at_any_tile_budget():
    x = heads(seed=8)
    outs = [logitless.linear_divergence(
        x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], beta=0.5,
        bias=x["bias"], teacher_bias=x["teacher_bias"], max_tile_bytes=t).divergence
        for t in (1024, TILE, 64 * 2**20)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-12, atol=1e-14)


def test_identical_heads_diverge_by_zero():
    x = heads(seed=9, d_t=D)
    x["teacher_hidden"], x["teacher_weight"] = x["hidden"], x["weight"]
    x["teacher_bias"] = x["bias"]
    for beta in BETAS:
        assert float(ours(x, beta=beta).abs().max()) < 1e-12


# --- linear_topk_distill against verl ---------------------------------------------------


def topk_case(seed, k=6, spread=4.0):
    """Packed sequences (prompt lengths 3 and 2, responses 4 and 5) with top-k teacher
    log-probs. Even rows: the teacher's top ids and random ones with the teacher's log-probs
    (student and teacher log-probs cross verl's -10 clamp); odd rows: the student's top ids
    with log-probs 0.5 below the student's (the top-k sum dips below 0, verl floors it)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [3, 2], [4, 5]
    n = sum(prompts) + sum(responses)
    x = heads(n=n, seed=seed)
    x["weight"] = x["weight"] * spread
    teacher_lp = torch.log_softmax(
        reference.linear_logits(x["teacher_hidden"], x["teacher_weight"] * spread), -1)
    student_lp = torch.log_softmax(reference.linear_logits(x["hidden"], x["weight"], x["bias"]),
                                   -1)
    ids = torch.cat([teacher_lp.topk(k // 2, -1).indices,
                     torch.randint(0, V, (n, k - k // 2), generator=gen)], -1)
    logprobs = teacher_lp.gather(-1, ids)
    odd = torch.arange(n) % 2 == 1
    ids[odd] = student_lp[odd].topk(k, -1).indices
    logprobs[odd] = student_lp[odd].gather(-1, ids[odd]) - 0.5
    return x, prompts, responses, ids, logprobs


def verl_topk(logits, ids, teacher_lp, prompts, responses, loss_config):
    """verl's forward_kl_topk: the FSDP logits processor, then the registered loss, then the
    loss_max_clamp that verl's ``distillation_loss`` applies. Returns [B, max_response]."""
    from tensordict import TensorDict
    from verl.trainer.distillation.fsdp import losses as fsdp_losses
    from verl.trainer.distillation.losses import get_distillation_loss_fn
    from verl.workers.config import DistillationConfig

    config = DistillationConfig(distillation_loss=loss_config)
    lengths = [p + r for p, r in zip(prompts, responses)]
    nested = lambda t: torch.nested.nested_tensor_from_jagged(
        t, offsets=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
    outputs = fsdp_losses.compute_forward_kl_topk(
        student_logits=logits.unsqueeze(0), teacher_topk_log_probs=nested(teacher_lp),
        teacher_topk_ids=nested(ids), config=config, data_format="thd")
    jag = lambda sizes: torch.nested.nested_tensor([torch.ones(s, dtype=torch.long)
                                                    for s in sizes], layout=torch.jagged)
    data = TensorDict({"prompts": jag(prompts), "responses": jag(responses),
                       "response_mask": jag(responses)}, batch_size=[len(prompts)])
    model_output = {k: v.squeeze(0) for k, v in outputs.items()}
    losses, _ = get_distillation_loss_fn("forward_kl_topk")(
        config=None, distillation_config=config, model_output=model_output, data=data)
    clamp = loss_config.loss_max_clamp
    return losses if clamp is None else losses.clamp(min=-clamp, max=clamp)


def response_rows(prompts, responses):
    """Packed rows whose logits predict response tokens, in verl's order."""
    rows, start = [], 0
    for p, r in zip(prompts, responses):
        rows += list(range(start + p - 1, start + p + r - 1))
        start += p + r
    return torch.tensor(rows)


@pytest.mark.parametrize("clamps", [(-10.0, 10.0), (None, 10.0), (-10.0, None)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_topk_matches_verl(clamps, temperature):
    pytest.importorskip("verl")  # make setup installs it; the torch 2.11 environment has none
    from verl.workers.config import DistillationLossConfig

    x, prompts, responses, ids, teacher_lp = topk_case(seed=10)
    loss_config = DistillationLossConfig(loss_mode="forward_kl_topk", topk=ids.shape[-1],
                                         log_prob_min_clamp=clamps[0], loss_max_clamp=clamps[1])
    mine = {k: leaf(x[k]) for k in ("hidden", "weight", "bias")}
    theirs = {k: leaf(x[k]) for k in ("hidden", "weight", "bias")}
    rows = response_rows(prompts, responses)
    mask = torch.zeros(ids.shape[0], dtype=torch.bool)
    mask[rows] = True
    out = logitless.linear_topk_distill(
        mine["hidden"], mine["weight"], ids, teacher_lp, mask, temperature=temperature,
        bias=mine["bias"], log_prob_min_clamp=clamps[0], loss_max_clamp=clamps[1],
        max_tile_bytes=TILE)
    logits = reference.linear_logits(theirs["hidden"], theirs["weight"], theirs["bias"],
                                     temperature=temperature)
    ref = verl_topk(logits, ids, teacher_lp, prompts, responses, loss_config)
    ref_rows = torch.cat([ref[i, :r] for i, r in enumerate(responses)])
    # verl sums the KL in fp32 (its kl_divergence casts to float), so it agrees to fp32.
    torch.testing.assert_close(out[rows], ref_rows.double(), rtol=1e-6, atol=1e-6)
    assert float(out.detach()[~mask].abs().max()) == 0.0
    # The case exercises verl's tail handling: sums below 0 floored, and (without the
    # log-prob clamp) sums above the loss clamp capped.
    raw = reference.linear_topk_distill(x["hidden"], x["weight"], ids, teacher_lp,
                                        temperature=temperature, bias=x["bias"],
                                        log_prob_min_clamp=clamps[0], loss_max_clamp=None)
    assert float(raw[rows].min()) == 0.0
    student_at_ids = torch.log_softmax(logits.detach(), -1).gather(-1, ids)[rows]
    assert float(student_at_ids.min()) < -10 and float(teacher_lp[rows].min()) < -10
    if clamps == (None, 10.0):
        assert float(ref_rows.max()) == 10.0
    # And in fp64 to rounding against verl's formula (reference.topk_forward_kl).
    exact = reference.linear_topk_distill(x["hidden"], x["weight"], ids, teacher_lp, mask,
                                          temperature=temperature, bias=x["bias"],
                                          log_prob_min_clamp=clamps[0],
                                          loss_max_clamp=clamps[1])
    torch.testing.assert_close(out, exact, rtol=1e-10, atol=1e-12)
    upstream = torch.randn(len(rows), dtype=torch.float64)
    (out[rows] * upstream).sum().backward()
    (ref_rows.double() * upstream).sum().backward()
    for name in ("hidden", "weight", "bias"):
        torch.testing.assert_close(mine[name].grad, theirs[name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_topk_gradcheck_and_bf16():
    x, _, _, ids, teacher_lp = topk_case(seed=11, spread=1.0)

    def f(h, w, b):
        return logitless.linear_topk_distill(h, w, ids[:4] % 13, teacher_lp[:4],
                                             temperature=0.9, bias=b, log_prob_min_clamp=None,
                                             max_tile_bytes=64)

    small = (x["hidden"][:4, :5], x["weight"][:13, :5], x["bias"][:13])
    assert torch.autograd.gradcheck(f, tuple(leaf(t) for t in small))
    x16 = {k: x[k].bfloat16() for k in ("hidden", "weight", "bias")}
    mine = {k: leaf(t) for k, t in x16.items()}
    oracle = {k: leaf(t.double()) for k, t in x16.items()}
    same = {k: leaf(t) for k, t in x16.items()}
    out = logitless.linear_topk_distill(mine["hidden"], mine["weight"], ids, teacher_lp,
                                        bias=mine["bias"], max_tile_bytes=TILE)
    refs = [reference.linear_topk_distill(t["hidden"], t["weight"], ids, teacher_lp,
                                          bias=t["bias"]) for t in (oracle, same)]
    assert_close_to_oracle(out, refs[0], refs[1], tol=1e-2 * scale(refs[0]), name="topk")
    upstream = torch.randn(ids.shape[0], dtype=torch.float64)
    for o in (out, *refs):
        (o.double() * upstream).sum().backward()
    for name in ("hidden", "weight", "bias"):
        assert_close_to_oracle(mine[name].grad, oracle[name].grad, same[name].grad,
                               tol=1e-2 * scale(oracle[name].grad), name=name)


# --- input contract ----------------------------------------------------------------------


def _div_args(**change):
    x = heads(n=4, v=9, seed=12)
    args = dict(hidden=x["hidden"], weight=x["weight"], teacher_hidden=x["teacher_hidden"],
                teacher_weight=x["teacher_weight"], mask=None, beta=0.5, temperature=1.0,
                bias=None, teacher_bias=None)
    args.update(change)
    return args


@pytest.mark.parametrize("change, match", [
    (dict(beta=-0.1), "beta"),
    (dict(beta=1.5), "beta"),
    (dict(beta=float("nan")), "beta"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(teacher_weight=torch.randn(10, D_T, dtype=torch.float64)), "vocabulary"),
    (dict(teacher_weight=torch.randn(9, D_T + 1, dtype=torch.float64)), "teacher_weight"),
    (dict(teacher_hidden=torch.randn(5, D_T, dtype=torch.float64)), "teacher_hidden"),
    (dict(teacher_weight=torch.ones(9, D_T, dtype=torch.long)), "teacher_weight must be floating"),
    (dict(bias=torch.ones(9, dtype=torch.int32)), "bias must be floating"),
    (dict(teacher_bias=torch.randn(8, dtype=torch.float64)), "teacher_bias"),
    (dict(bias=torch.randn(8, dtype=torch.float64)), "bias"),
    (dict(weight=torch.randn(9, D + 1, dtype=torch.float64)), "weight"),
    (dict(mask=torch.ones(5, dtype=torch.bool)), "mask"),
    (dict(mask=torch.ones(5)), "mask"),
    (dict(mask=torch.ones(4, dtype=torch.complex64)), "mask"),
    (dict(hidden=torch.zeros(4, 0, dtype=torch.float64),
          weight=torch.zeros(9, 0, dtype=torch.float64)), "hidden size"),
    (dict(teacher_hidden=torch.zeros(4, 0, dtype=torch.float64),
          teacher_weight=torch.zeros(9, 0, dtype=torch.float64)), "teacher_hidden must have"),
    (dict(weight=torch.zeros(0, D, dtype=torch.float64),
          teacher_weight=torch.zeros(0, D_T, dtype=torch.float64)), "vocabulary"),
])
def test_divergence_bad_input(change, match):
    with pytest.raises(ValueError, match=match):
        logitless.linear_divergence(**_div_args(**change))


def test_divergence_dtype_rule():
    """TRL's dtype rule, as the head's: each head's weight and bias are cast to its hidden's
    dtype (the teacher's fp64 head with fp32 hidden states runs in fp32)."""
    x = heads(n=4, v=9, seed=12)
    mixed = logitless.linear_divergence(x["hidden"].float(), x["weight"],
                                        x["teacher_hidden"].float(), x["teacher_weight"]).divergence
    cast = logitless.linear_divergence(x["hidden"].float(), x["weight"].float(),
                                       x["teacher_hidden"].float(),
                                       x["teacher_weight"].float()).divergence
    assert mixed.dtype == torch.float32
    assert torch.equal(mixed, cast)


def _topk_args(**change):
    x = heads(n=4, v=9, seed=13)
    args = dict(hidden=x["hidden"], weight=x["weight"], teacher_ids=torch.zeros(4, 3,
                dtype=torch.long), teacher_logprobs=torch.full((4, 3), -1.0), mask=None,
                temperature=1.0, bias=None)
    args.update(change)
    return args


@pytest.mark.parametrize("change, match", [
    (dict(teacher_ids=torch.full((4, 3), 9)), r"teacher_ids must lie in \[0, 9\)"),
    (dict(teacher_ids=torch.full((4, 3), -1)), "teacher_ids"),
    (dict(teacher_ids=torch.zeros(4, 3)), "teacher_ids must be an integer"),
    (dict(teacher_ids=torch.zeros(5, 3, dtype=torch.long)), "teacher_ids"),
    (dict(teacher_ids=torch.zeros(4, dtype=torch.long)), "teacher_ids"),
    (dict(teacher_logprobs=torch.zeros(4, 2)), "teacher_logprobs"),
    (dict(teacher_logprobs=torch.zeros(4, 3, dtype=torch.long)), "teacher_logprobs"),
    (dict(temperature=0), "temperature"),
    (dict(mask=torch.ones(4, 3, dtype=torch.bool)), "mask"),
    (dict(log_prob_min_clamp=float("nan")), "log_prob_min_clamp"),
    (dict(log_prob_min_clamp=float("inf")), "log_prob_min_clamp"),
    (dict(log_prob_min_clamp=0.5), "log_prob_min_clamp"),
    (dict(loss_max_clamp=-1.0), "loss_max_clamp"),
    (dict(loss_max_clamp=0.0), "loss_max_clamp"),
    (dict(loss_max_clamp=float("nan")), "loss_max_clamp"),
    (dict(hidden=torch.zeros(4, 0, dtype=torch.float64),
          weight=torch.zeros(9, 0, dtype=torch.float64)), "hidden size"),
    (dict(weight=torch.zeros(0, D, dtype=torch.float64)), "vocabulary"),
])
def test_topk_bad_input(change, match):
    with pytest.raises(ValueError, match=match):
        logitless.linear_topk_distill(**_topk_args(**change))


def test_numpy_scalars_and_real_masks_accepted():
    """As `linear_logprobs` and `fused_policy_loss` take them: numpy scalars for beta,
    temperature and the clamps, and a float or integer mask of 0 and 1 (1: kept), which gives
    what the bool mask gives."""
    np = pytest.importorskip("numpy")
    args = _div_args(beta=np.float32(0.25), temperature=np.float64(0.7))
    plain = logitless.linear_divergence(**_div_args(beta=0.25, temperature=0.7)).divergence
    torch.testing.assert_close(logitless.linear_divergence(**args).divergence, plain, rtol=0,
                               atol=0)
    keep = torch.tensor([True, False, True, True])
    want = logitless.linear_divergence(**_div_args(mask=keep)).divergence
    assert float(want[1]) == 0.0 and float(want.abs().min()) == 0.0
    for mask in (keep.double(), keep.int(), keep.float()):
        got = logitless.linear_divergence(**_div_args(mask=mask)).divergence
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    topk = dict(temperature=np.float32(0.5), log_prob_min_clamp=np.float64(-8.0),
                loss_max_clamp=np.float32(5.0))
    want = logitless.linear_topk_distill(**_topk_args(mask=keep, **topk))
    got = logitless.linear_topk_distill(**_topk_args(mask=keep.float(), **topk))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, math.nan, "int 2"])
def test_real_mask_other_than_0_or_1_refused(bad, backend, monkeypatch):
    """A float or integer mask holds 0 and 1 only, as documented: one token at 0.5, 2, -1 or
    NaN (or an integer 2) is refused by both ops, naming ``mask``. Before, every nonzero value,
    NaN included, read as kept."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    x = {k: t.float() for k, t in heads(n=4, v=9, seed=12).items()}
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = mask.long().index_fill(0, torch.tensor([2]), 2) if bad == "int 2" else \
        mask.index_fill(0, torch.tensor([2]), bad)
    match = r"mask must be bool or hold 0 and 1 only \(1: kept\), got"
    with pytest.raises(ValueError, match=match):
        logitless.linear_divergence(**_div_args(**x, mask=mask))
    x.pop("teacher_hidden"), x.pop("teacher_weight"), x.pop("teacher_bias")
    with pytest.raises(ValueError, match=match):
        logitless.linear_topk_distill(**_topk_args(**x, mask=mask))


@pytest.mark.parametrize("temperature", [1e300, 1e-300, 1e-40])
def test_temperature_outside_the_accumulation_dtype_refused(temperature):
    """Both ops take `linear_logprobs`'s temperature range: fp32 heads refuse a temperature
    that is not a normal fp32 number, stating the range (before, 1e-300 and 1e-40 gave NaN
    silently and 1e300 was taken); fp64 heads take it and match the fp64 reference."""
    x = heads(n=4, v=9, seed=12)
    x32 = {k: t.float() for k, t in x.items()}
    match = r"temperature must be a number in \[1\.1754943508222875e-38, 3\.40282346"
    with pytest.raises(ValueError, match=match):
        logitless.linear_divergence(**_div_args(**x32, temperature=temperature))
    with pytest.raises(ValueError, match=match):
        logitless.linear_topk_distill(**_topk_args(hidden=x32["hidden"], weight=x32["weight"],
                                                   temperature=temperature))
    got = logitless.linear_divergence(**_div_args(temperature=temperature)).divergence
    want = reference.linear_divergence(x["hidden"], x["weight"], x["teacher_hidden"],
                                       x["teacher_weight"], beta=0.5,
                                       temperature=temperature).divergence
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _disjoint_heads(seed):
    """Sharp, nearly disjoint heads: the student's and the teacher's modes apart, so the JSD
    is near its maximum and its gradient tiny (the case where a cancelling form loses it)."""
    x = heads(n=19, v=301, seed=seed)
    x["teacher_weight"] = x["teacher_weight"] * 20
    x["weight"] = x["weight"] * 20
    return {k: t.float() for k, t in x.items()}


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("beta", [0.3, 0.5, 0.9])
def test_nearly_disjoint_heads_fp32_as_accurate_as_materialised(beta, backend, monkeypatch):
    """Issue 24: for 0 < beta < 1 the gradient of nearly disjoint heads in fp32 is no worse
    than fp32 autograd on the materialised logits (its closed form used to cancel two numbers
    of order 1: d_hidden off by 4e-5 where the true gradient was 1e-12)."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    x = _disjoint_heads(seed=3)
    temperature = 0.05

    def grads(fn, x, dtype):
        leaves = {k: leaf(x[k].to(dtype)) for k in ("hidden", "weight", "bias")}
        inputs = {**{k: v.to(dtype) for k, v in x.items()}, **leaves}
        out = fn(inputs)
        g = torch.autograd.grad(out.sum(), list(leaves.values()))
        return out.detach().double(), [t.double() for t in g]

    def materialised(inputs):
        return reference.linear_divergence(
            inputs["hidden"], inputs["weight"], inputs["teacher_hidden"],
            inputs["teacher_weight"], beta=beta, temperature=temperature, bias=inputs["bias"],
            teacher_bias=inputs["teacher_bias"]).divergence

    def fast(inputs):
        return logitless.linear_divergence(
            inputs["hidden"], inputs["weight"], inputs["teacher_hidden"],
            inputs["teacher_weight"], beta=beta, temperature=temperature,
            bias=inputs["bias"], teacher_bias=inputs["teacher_bias"]).divergence

    exact = grads(materialised, x, torch.float64)
    same = grads(materialised, x, torch.float32)
    got = grads(fast, x, torch.float32)
    # nearly disjoint: the divergence near its bound, the entropy of the weights (beta, 1 - beta)
    bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    assert float(exact[0].mean()) > 0.8 * bound
    for name, g, s, e in zip(("d_hidden", "d_weight", "d_bias"), got[1], same[1], exact[1]):
        err, err_same = float((g - e).abs().max()), float((s - e).abs().max())
        assert err <= 2 * err_same + 1e-12, f"{name}: {err:.2e} vs materialised {err_same:.2e}"
