"""fused_policy_loss with the sampler's truncation (``top_k`` / ``top_p`` / ``min_p`` under each
engine's rules) and with recorded kept sets (``kept_ids``): equal to the composed
``policy_loss(linear_logprobs(...))`` with the trainers' `drop_outside_kept`, and to the fp64
oracle (``reference.linear_logprobs`` on the full logits); values, metrics and the gradients of
hidden, weight and bias; odd sizes, chunk boundaries inside the batch, ties at the threshold,
targets outside the kept set (issue 36)."""

from __future__ import annotations

import pytest
import torch

from logitless import PolicyLossConfig, linear_logprobs, policy_loss, reference
from logitless.fused_losses.fused import chunks
from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss
from logitless.fused_losses.head.sampled import drop_outside_kept
from logitless.kernels import sampler_torch

from testing import assert_close_to_oracle, requires_triton

B, T, D, V, K = 5, 37, 96, 1007, 29
TEMPERATURE = 0.8
CFG = PolicyLossConfig(objective="ppo", entropy_coef=0.01, loss_agg="seq-mean-token-mean")


def make_batch(seed, dtype=torch.float64, ties=False, v=V):
    """Random head and batch; most targets among each row's most probable tokens (inside the
    kept sets), some anywhere (outside them). ``ties``: pairs of equal weight rows, so that
    tied logits meet the top-k and top-p boundaries. ``v``: the vocabulary size."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(v, D, generator=g, dtype=torch.float64) / D**0.5 * 3
    bias = torch.randn(v, generator=g, dtype=torch.float64) * 0.5
    if ties:
        bias[:] = 0.0
        weight[1::2] = weight[0::2][:v // 2]
    with torch.no_grad():
        z = hidden @ weight.T + bias
    top = z.argsort(-1, descending=True)[..., :6]
    near = top.gather(-1, torch.randint(0, 6, (B, T, 1), generator=g)).squeeze(-1)
    targets = torch.where(torch.rand(B, T, generator=g) < 0.85, near,
                          torch.randint(0, v, (B, T), generator=g))
    lengths = torch.tensor([37, 11, 0, 23, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask[3, 4] = False
    old = -2.0 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old[1, 2] = float("-inf")  # the old policy's set left this one out
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    # recorded sets: each token's K most probable ids, a random share of them, shuffled with
    # the padding; the target inside most of them
    sizes = torch.randint(1, K + 1, (B, T), generator=g)
    ranked = z.argsort(-1, descending=True)[..., :K]
    ids = torch.where(torch.arange(K) < sizes[..., None], ranked, -1)
    ids = ids.gather(-1, torch.argsort(torch.rand(B, T, K, generator=g), dim=-1))
    cast = lambda x: x.to(dtype)
    return dict(hidden=cast(hidden), weight=cast(weight), bias=cast(bias), targets=targets,
                mask=mask, old=old, adv=adv, kept_ids=ids)


def leaves(batch):
    return [batch[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]


def fused(batch, trunc, budget=None, old=True, cfg=CFG, **kw):
    x = leaves(batch)
    out = torch.zeros(B, T, dtype=torch.float64)
    loss, metrics = fused_policy_loss(
        x[0], x[1], batch["targets"], batch["old"] if old else None, batch["adv"],
        batch["mask"], cfg, bias=x[2], temperature=TEMPERATURE, max_tile_bytes=budget,
        out_logprobs=out, **trunc, **kw)
    return loss, metrics, torch.autograd.grad(loss, x), out


def composed(batch, trunc, head=linear_logprobs, old=True, cfg=CFG, **kw):
    """What the trainers compose: the head's truncated logprobs and entropies, the tokens
    outside a kept set out of the loss (`drop_outside_kept`), `policy_loss`."""
    x = leaves(batch)
    out = head(x[0], x[1], batch["targets"], bias=x[2], temperature=TEMPERATURE,
               return_entropy=True, **trunc, **kw)
    old_lp = batch["old"] if old else out.logprobs.detach()
    lp, old_lp, mask, _ = drop_outside_kept(out.logprobs, old_lp, batch["mask"])
    loss, metrics = policy_loss(lp, old_lp, batch["adv"], mask, cfg, entropy=out.entropy)
    return loss, metrics, torch.autograd.grad(loss, x), out.logprobs


def dense_rows(n, dtype=torch.float64):
    """A budget of ``n`` rows of the truncated store: sequences of up to ``n`` loss rows run
    as dense chunks, longer ones stream."""
    return n * sampler_torch.StoredSampled.bytes_per_row(V, dtype, None)


TRUNCATIONS = [
    dict(top_k=7),
    dict(top_p=0.85),
    dict(min_p=0.08),
    dict(top_k=13, top_p=0.9, min_p=0.02),
    dict(top_k=13, top_p=0.9, min_p=0.02, sampler="transformers"),
    dict(top_k=13, top_p=0.8, sampler="sglang"),
    dict(top_p=0.9, min_p=0.05, sampler="sglang"),
    "kept_ids",
]
IDS = ["top_k", "top_p", "min_p", "vllm-all", "transformers-all", "sglang-joint",
       "sglang-min_p", "kept_ids"]


def truncation(spec, batch):
    return dict(kept_ids=batch["kept_ids"]) if spec == "kept_ids" else dict(spec)


def assert_same(a, b, rtol, atol):
    """Loss, metrics and gradients of two runs (compared in fp64)."""
    (l1, m1, g1, _), (l2, m2, g2, _) = a, b
    close = lambda x, y, name: torch.testing.assert_close(
        x.double(), y.double(), rtol=rtol, atol=atol, msg=name)
    close(l1, l2, "loss")
    assert list(m1) == list(m2)
    for k in m1:
        close(m1[k], m2[k], k)
    for name, x, y in zip(("hidden", "weight", "bias"), g1, g2):
        close(x, y, name)


@pytest.mark.parametrize("spec", TRUNCATIONS, ids=IDS)
@pytest.mark.parametrize("rows", [None, 40], ids=["one-chunk", "chunks-of-40"])
def test_equals_the_composed_path_and_the_oracle(spec, rows):
    """Dense chunks (the whole batch in one; chunks of at most 40 rows, the 37-row sequence
    alone): the fused loss, its metrics and gradients equal the composed path's, and the
    composed path on the fp64 oracle's full logits; targets outside a kept set leave the loss
    (the share is not small here) and read -inf in ``out_logprobs``."""
    batch = make_batch(1)
    trunc = truncation(spec, batch)
    budget = None if rows is None else dense_rows(rows)
    got = fused(batch, trunc, budget)
    want = composed(batch, trunc)
    oracle = composed(batch, trunc, head=reference.linear_logprobs)
    assert_same(got, want, 1e-10, 1e-12)
    assert_same(got, oracle, 1e-10, 1e-12)
    lp = want[3].detach()
    outside = torch.isneginf(lp) & batch["mask"]
    assert outside.any() and (outside.sum() < batch["mask"].sum() / 2)
    # (a token whose old logprob is -inf leaves the loss before the head runs: 0 there)
    old_inf = torch.isneginf(batch["old"])
    assert torch.equal(torch.isneginf(got[3]), outside & ~old_inf)
    loss_tokens = batch["mask"] & ~outside & ~old_inf
    torch.testing.assert_close(got[3][loss_tokens], lp[loss_tokens], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", [dict(top_p=0.9, min_p=0.02), "kept_ids"], ids=["top_p", "kept"])
@pytest.mark.parametrize("how", ["streaming", "entropy-selection", "clip_cov"])
def test_whole_batch_and_entropy_selection(spec, how):
    """The batch streamed in one call (``strategy="streaming"``, and ``clip_cov``, which
    needs the whole batch), and the top-entropy selection, whose no-grad pass before the
    chunks reads the kept distribution's entropies: equal to the composed path."""
    batch = make_batch(12)
    trunc, kw, cfg = truncation(spec, batch), {}, CFG
    if how == "streaming":
        kw = dict(strategy="streaming")
    elif how == "entropy-selection":
        cfg = PolicyLossConfig(objective="ppo", top_entropy_quantile=0.5)
    else:
        cfg = PolicyLossConfig(objective="clip_cov", cov_fraction=0.2, cov_seed=3)
    got = fused(batch, trunc, dense_rows(40), cfg=cfg, **kw)
    assert_same(got, composed(batch, trunc, cfg=cfg), 1e-10, 1e-12)


@pytest.mark.parametrize("spec", [dict(top_p=0.9, min_p=0.02), "kept_ids"], ids=["top_p", "kept"])
def test_softcap_and_logit_scale(spec):
    """A soft-capped, scaled head: the stored chunk's ``1 - tanh^2`` is read back from its
    logits; equal to the composed path and the oracle."""
    batch = make_batch(10)
    trunc, head = truncation(spec, batch), dict(softcap=3.0, logit_scale=0.7)
    got = fused(batch, trunc, dense_rows(40), **head)
    assert_same(got, composed(batch, trunc, **head), 1e-10, 1e-12)
    assert_same(got, composed(batch, trunc, head=reference.linear_logprobs, **head), 1e-10,
                1e-12)


@pytest.mark.parametrize("spec", [dict(top_p=0.9, top_k=50), "kept_ids"], ids=["top_p", "kept"])
def test_on_policy_fp32_and_a_streamed_sequence(spec):
    """fp32, on-policy (old logprobs the current ones), chunks of 12 rows: the 37- and 23-row
    sequences stream (4 passes), the others run dense; equal to the composed fp32 path and
    close to the fp64 oracle."""
    batch = make_batch(2, torch.float32)
    trunc = truncation(spec, batch)
    got = fused(batch, trunc, dense_rows(12, torch.float32), old=False)
    want = composed(batch, trunc, old=False)
    assert_same(got, want, 2e-5, 2e-6)
    batch64 = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    oracle = composed(batch64, trunc, head=reference.linear_logprobs, old=False)
    assert_same(got, oracle, 2e-4, 2e-5)


@pytest.mark.parametrize("spec", [dict(top_k=6), dict(top_k=6, sampler="transformers"),
                                  dict(top_p=0.5), dict(top_p=0.5, sampler="sglang")],
                         ids=["vllm-top_k", "transformers-top_k", "vllm-top_p",
                              "sglang-top_p"])
def test_ties_at_the_threshold(spec):
    """Equal weight rows pair up the logits: the k-th value and the top-p cut fall on ties,
    which vLLM breaks by the lowest ids and transformers and SGLang keep whole; the fused
    chunk keeps the oracle's set (same logprobs, -inf at the same tokens, same gradients)."""
    batch = make_batch(3, ties=True)
    got = fused(batch, dict(spec), dense_rows(40))
    oracle = composed(batch, dict(spec), head=reference.linear_logprobs)
    assert_same(got, oracle, 1e-10, 1e-12)
    assert torch.equal(torch.isneginf(got[3]), torch.isneginf(oracle[3]) & batch["mask"])


def test_no_restart_when_every_target_is_kept(monkeypatch):
    """With every target inside its kept set the chunks run once: no no-grad pass of the head
    (three GEMM passes), and the outside tokens of the recorded sets are known before the
    chunks (no pass either)."""
    batch = make_batch(4)
    calls = []
    real = chunks._outside_current
    monkeypatch.setattr(chunks, "_outside_current",
                        lambda req: calls.append(1) or real(req))
    got = fused(batch, dict(kept_ids=batch["kept_ids"]), dense_rows(40))
    assert torch.isneginf(got[3]).any() and not calls
    with torch.no_grad():
        z = batch["hidden"] @ batch["weight"].T + batch["bias"]
    batch["targets"] = z.argmax(-1)  # kept by every truncation
    got = fused(batch, dict(top_p=0.9, top_k=20), dense_rows(40))
    assert not calls and not torch.isneginf(got[3]).any()


@requires_triton
def test_triton_selected_streams(monkeypatch):
    """Where Triton is selected (CUDA; here the interpreter) the truncated call streams through
    the sampler's Triton passes, equal to the composed path."""
    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    # 263 ids: the interpreter's passes cost per vocabulary tile; the route is what is tested
    batch = make_batch(5, torch.float32, v=263)
    batch = {k: v if k in ("weight", "bias") else v[:2] if k == "adv" else v[:2, :9]
             for k, v in batch.items()}
    trunc = dict(top_k=9, top_p=0.9)

    def run(fn):
        x = leaves(batch)
        if fn is fused_policy_loss:
            loss, _ = fn(x[0], x[1], batch["targets"], batch["old"], batch["adv"], batch["mask"],
                         CFG, bias=x[2], temperature=TEMPERATURE, **trunc)
        else:
            out = linear_logprobs(x[0], x[1], batch["targets"], bias=x[2],
                                  temperature=TEMPERATURE, return_entropy=True, **trunc)
            lp, old, mask, _ = drop_outside_kept(out.logprobs, batch["old"], batch["mask"])
            loss, _ = policy_loss(lp, old, batch["adv"], mask, CFG, entropy=out.entropy)
        return loss, torch.autograd.grad(loss, x)

    (l1, g1), (l2, g2) = run(fused_policy_loss), run(None)
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-7)
    for x, y in zip(g1, g2):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_refusals():
    """linear_logprobs' checks, reused: kept_ids with a truncation, a bad ``top_k`` /
    ``top_p`` / ``sampler``, a bad recorded set; and what the fused loss does not take with
    a truncation."""
    batch = make_batch(6)
    x = leaves(batch)
    args = (x[0], x[1], batch["targets"], batch["old"], batch["adv"], batch["mask"], CFG)
    for kw, match in [
        (dict(kept_ids=batch["kept_ids"], top_k=5), "kept_ids is the kept set itself"),
        (dict(top_k=0), "top_k must be None"),
        (dict(top_p=1.5), "top_p must be None"),
        (dict(top_k=5, sampler="tgi"), "sampler must be one of"),
        (dict(kept_ids=batch["kept_ids"].int()), "kept_ids must be an int64 tensor"),
        (dict(kept_ids=batch["kept_ids"].clamp(max=V + 3).masked_fill(
            batch["kept_ids"] == batch["kept_ids"].max(), V + 3)), "kept_ids must be vocab"),
        (dict(top_p=torch.full((B, T), 2.0)), "top_p must lie in"),
        (dict(top_k=5, ref_hidden=x[0].detach(), ref_weight=x[1].detach()),
         "not supported with the exact KL"),
    ]:
        with pytest.raises(ValueError, match=match):
            fused_policy_loss(*args, **kw)


@pytest.mark.parametrize("spec", [dict(top_p=0.85, top_k=40), "kept_ids"], ids=["top_p", "kept"])
def test_compiled_matches_eager(spec):
    """Under ``torch.compile`` the call is the one custom op, the truncation (and the recorded
    sets) among its arguments: the same loss, metrics and gradients as eagerly, targets
    outside the kept sets included."""
    batch = make_batch(7)
    trunc = truncation(spec, batch)

    def step(hidden, weight, bias):
        return fused_policy_loss(hidden, weight, batch["targets"], batch["old"], batch["adv"],
                                 batch["mask"], CFG, bias=bias, temperature=TEMPERATURE,
                                 max_tile_bytes=dense_rows(40), **trunc)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
    got, want = [], []
    for fn, out in ((compiled, got), (step, want)):
        x = leaves(batch)
        loss, metrics = fn(*x)
        out.extend([loss, metrics, torch.autograd.grad(loss, x), None])
    assert_same(got, want, 1e-12, 1e-14)


@pytest.mark.parametrize("spec", [dict(top_p=0.9, top_k=50), "kept_ids"], ids=["top_p", "kept"])
def test_bf16_within_the_composed_paths_error(spec):
    """bf16 inputs: the fused loss and gradients are as far from the fp64 oracle as the
    composed bf16 path is (three-way bound): the sampler's chunk logits rounded to bf16 as its
    own forward rounds them, a recorded set's computed in fp32 as ``kept_ids`` computes
    them."""
    batch = make_batch(9, torch.bfloat16)
    wide = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    trunc = truncation(spec, batch)
    got = fused(batch, trunc, dense_rows(40, torch.bfloat16))
    same = composed(batch, trunc)
    oracle = composed(wide, trunc, head=reference.linear_logprobs)
    assert_close_to_oracle(got[0], oracle[0], same[0], 1e-6, "loss")
    for i, name in enumerate(("hidden", "weight", "bias")):
        tol = 1e-2 * float(oracle[2][i].abs().max())  # a bf16 gradient's rounding
        assert_close_to_oracle(got[2][i], oracle[2][i], same[2][i], tol, name)


@pytest.mark.parametrize("spec", [dict(top_p=0.9, top_k=20), "kept_ids"], ids=["top_p", "kept"])
def test_three_gemm_passes(spec):
    """Forward and backward of the truncated loss, every target inside its kept set: three
    GEMM passes over the head for the loss rows (``FlopCounterMode``; a token whose old
    logprob is -inf is not a loss row), where the streamed sampler path makes four."""
    from torch.utils.flop_counter import FlopCounterMode

    batch = make_batch(11)
    with torch.no_grad():
        z = batch["hidden"] @ batch["weight"].T + batch["bias"]
    batch["targets"] = z.argmax(-1)  # kept by every truncation and in every recorded set
    batch["kept_ids"][..., 0] = batch["targets"]
    batch["kept_ids"] = torch.where(
        (batch["kept_ids"] == batch["targets"][..., None]) & (torch.arange(K) > 0), -1,
        batch["kept_ids"])
    rows = int((batch["mask"] & torch.isfinite(batch["old"])).sum())
    with FlopCounterMode(display=False) as flops:
        fused(batch, truncation(spec, batch), dense_rows(40))
    assert flops.get_total_flops() == 3 * 2 * rows * D * V
