"""`logitless.mismatch_metrics` against the formulas of docs/objectives.md#mismatch-metrics,
evaluated token by token in Python floats (fp64), and its input checks."""

import math

import pytest
import torch

import logitless
from logitless import mismatch_metrics


def _batch(seed, shape=(5, 13)):
    """Engine logprobs in fp32, the trainer's in bf16 as a bf16 trainer gives them: most tokens
    within a few 1e-3 nats, some far (ratios outside [0.9, 1.1]), an empty row, int mask."""
    g = torch.Generator().manual_seed(seed)
    engine = -4 * torch.rand(shape, generator=g) - 0.01
    noise = 3e-3 * torch.randn(shape, generator=g)
    far = torch.rand(shape, generator=g) < 0.15
    noise = torch.where(far, 0.4 * torch.randn(shape, generator=g), noise)
    trainer = (engine + noise).clamp(max=-1e-4).to(torch.bfloat16)
    mask = (torch.rand(shape, generator=g) < 0.8).to(torch.int64)
    mask[1] = 0
    kept = -0.3 * torch.rand(shape, generator=g, dtype=torch.float64)
    return trainer, engine, mask, kept


def _oracle(trainer, engine, mask, kept=None):
    """Per token in Python floats: d = trainer - engine, r = exp(d)."""
    ds, masses = [], []
    for t, e, m, k in zip(trainer.double().flatten().tolist(), engine.double().flatten().tolist(),
                          mask.flatten().tolist(),
                          (kept if kept is not None else mask).double().flatten().tolist()):
        if m:
            ds.append(t - e)
            masses.append(math.exp(k))
    n = len(ds)

    def k3(d):  # r - 1 - log r, by its series where exp(d) - 1 - d cancels
        return d * d / 2 + d ** 3 / 6 + d ** 4 / 24 if abs(d) < 1e-4 else math.exp(d) - 1 - d

    out = {
        "abs_diff/mean": sum(abs(d) for d in ds) / n,
        "abs_diff/max": max(abs(d) for d in ds),
        "kl_k1": sum(-d for d in ds) / n,
        "kl_k3": sum(k3(d) for d in ds) / n,
        "ratio_outside": sum(1 for d in ds if not 0.9 <= math.exp(d) <= 1.1) / n,
    }
    if kept is not None:
        out["kept_mass/mean"] = sum(masses) / n
    return out


def _assert_matches(ours, want):
    assert set(ours) == set(want)
    for name, value in want.items():
        got = ours[name]
        assert got.dtype == torch.float64 and got.dim() == 0 and not got.requires_grad, name
        assert float(got) == pytest.approx(value, rel=1e-12, abs=1e-15), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_the_formulas(seed):
    trainer, engine, mask, kept = _batch(seed)
    want = _oracle(trainer, engine, mask)
    assert 0 < want["ratio_outside"] < 0.5  # the band is exercised on both sides of it
    _assert_matches(mismatch_metrics(trainer, engine, mask), want)
    _assert_matches(mismatch_metrics(trainer, engine, mask.bool(), log_kept_mass=kept),
                    _oracle(trainer, engine, mask, kept))
    _assert_matches(mismatch_metrics(trainer, engine, mask.float()), want)


def test_exported_at_the_top_level():
    assert "mismatch_metrics" in logitless.__all__


def test_k3_small_differences_do_not_cancel():
    """|d| ~ 1e-6: k3 ~ 5e-13, where exp(d) - 1 - d in float64 keeps ~3 digits only."""
    g = torch.Generator().manual_seed(3)
    engine = -2 * torch.rand(7, 11, generator=g, dtype=torch.float64) - 0.1
    trainer = engine + 1e-6 * torch.randn(7, 11, generator=g, dtype=torch.float64)
    mask = torch.ones(7, 11, dtype=torch.bool)
    _assert_matches(mismatch_metrics(trainer, engine, mask), _oracle(trainer, engine, mask))


def test_values_outside_the_mask_are_ignored():
    trainer, engine, mask, kept = _batch(4)
    want = mismatch_metrics(trainer, engine, mask, log_kept_mass=kept)
    out = ~mask.bool()
    trainer, engine, kept = trainer.clone(), engine.clone(), kept.clone()
    trainer[out], engine[out], kept[out] = float("nan"), float("-inf"), float("inf")
    got = mismatch_metrics(trainer, engine, mask, log_kept_mass=kept)
    assert {k: float(v) for k, v in got.items()} == {k: float(v) for k, v in want.items()}


def test_kl_direction_is_engine_against_trainer():
    """Tokens sampled from the engine's distribution q: the k1 and k3 means estimate
    KL(q || p) of the engine q against the trainer p, not KL(p || q)."""
    g = torch.Generator().manual_seed(5)
    q = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01], dtype=torch.float64)
    p = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    tokens = torch.multinomial(q, 200_003, replacement=True, generator=g)
    engine, trainer = q.log()[tokens], p.log()[tokens]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    forward = float((q * (q / p).log()).sum())   # KL(q || p) = 0.442
    reverse = float((p * (p / q).log()).sum())   # KL(p || q) = 0.714
    metrics = mismatch_metrics(trainer, engine, mask)
    for name in ("kl_k1", "kl_k3"):
        assert float(metrics[name]) == pytest.approx(forward, abs=0.015), name
        assert abs(float(metrics[name]) - reverse) > 0.2, name


def test_empty_mask_gives_nan():
    trainer, engine, mask, kept = _batch(6)
    got = mismatch_metrics(trainer, engine, torch.zeros_like(mask), log_kept_mass=kept)
    assert set(got) == {"abs_diff/mean", "abs_diff/max", "kl_k1", "kl_k3", "ratio_outside",
                        "kept_mass/mean"}
    assert all(math.isnan(float(v)) for v in got.values())


def test_no_gradient():
    trainer, engine, mask, _ = _batch(7)
    trainer = trainer.double().requires_grad_()
    with torch.enable_grad():
        got = mismatch_metrics(trainer, engine, mask)
    assert not any(v.requires_grad for v in got.values())


@pytest.mark.parametrize("change, match", [
    (dict(trainer_logprobs=torch.zeros(5, 12)), r"trainer_logprobs: expected shape \[5, 13\]"),
    (dict(engine_logprobs=torch.zeros(13, 5)), r"engine_logprobs: expected shape \[5, 13\]"),
    (dict(trainer_logprobs=torch.zeros(5, 13, dtype=torch.int64)),
     "trainer_logprobs: expected a floating-point tensor"),
    (dict(engine_logprobs=[0.0] * 13), "engine_logprobs: expected a floating-point tensor"),
    (dict(mask=torch.full((5, 13), 2)), "mask: expected values 0 or 1"),
    (dict(mask=torch.full((5, 13), 0.5)), "mask: expected values 0 or 1"),
    (dict(mask=torch.ones(5, 13, dtype=torch.complex64)), "mask: expected a bool"),
    (dict(mask=None), "mask: expected a bool"),
    (dict(log_kept_mass=torch.zeros(5)), r"log_kept_mass: expected shape \[5, 13\]"),
])
def test_bad_inputs_are_refused(change, match):
    trainer, engine, mask, _ = _batch(8)
    kwargs = dict(trainer_logprobs=trainer, engine_logprobs=engine, mask=mask)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        mismatch_metrics(**kwargs)


@pytest.mark.parametrize("name", ["trainer_logprobs", "engine_logprobs", "log_kept_mass"])
@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_non_finite_values_in_the_mask_are_refused(name, value):
    trainer, engine, mask, kept = _batch(9)
    kwargs = dict(trainer_logprobs=trainer, engine_logprobs=engine, mask=mask,
                  log_kept_mass=kept)
    bad = kwargs[name].clone()
    bad[0, mask[0].argmax()] = value
    kwargs[name] = bad
    with pytest.raises(ValueError, match=f"{name}: non-finite"):
        mismatch_metrics(**kwargs)
