"""logitless.attention_entropy against the fp64 reference (full softmax probabilities,
-sum p log p): odd sizes, GQA groups, causal and not, windows, softcap, padding, packed
varlen, query selection, both backends (Triton under the interpreter), and the input
contract."""

import pytest
import torch

import logitless
from logitless import reference

from testing import assert_close_to_oracle, requires_triton

BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]
# fp32 inputs, fp32 accumulation, entropies of order log T: a few ulps of 5.
TOL = 2e-5


def padded(b=2, hk=2, group=2, t=37, d=24, dtype=torch.float32, spread=2.0):
    q = torch.randn(b, hk * group, t, d, dtype=torch.float64) * spread
    k = torch.randn(b, hk, t, d, dtype=torch.float64)
    return q.to(dtype), k.to(dtype)


def check(q, k, backend, monkeypatch, tol=TOL, **opts):
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    out = logitless.attention_entropy(q, k, **opts)
    ref = reference.attention_entropy(q.double(), k.double(), **opts)
    assert out.dtype == torch.float32
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    return out, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "t,group,causal",
    [(37, 1, True), (37, 2, False), (37, 4, True), (130, 1, False), (130, 2, True),
     (130, 4, False)],
    ids=lambda v: f"{v}",
)
def test_padded_matches_reference(backend, t, group, causal, monkeypatch):
    q, k = padded(b=2 if t < 64 else 1, t=t, group=group)
    check(q, k, backend, monkeypatch, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "opts",
    [
        {"window": 5},
        {"window": 17, "causal": False},
        {"window": 1},
        {"softcap": 3.0},
        {"scale": 0.3, "softcap": 1.5, "window": 40},
    ],
    ids=["window5", "window17-bidir", "window1", "softcap", "scale-softcap-window"],
)
def test_options_match_reference(backend, opts, monkeypatch):
    q, k = padded(b=1, t=130, group=2)
    check(q, k, backend, monkeypatch, **opts)


def padding_mask(b, t, side):
    """Rows of different real lengths, padded on the given side; one row fully padded."""
    lengths = torch.tensor([t - 9, t, 0, 5])[:b]
    pos = torch.arange(t)[None, :]
    if side == "right":
        return (pos < lengths[:, None]).long()
    return (pos >= t - lengths[:, None]).long()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_padding(backend, side, causal, monkeypatch):
    q, k = padded(b=4, t=37, group=2)
    mask = padding_mask(4, 37, side)
    out, _ = check(q, k, backend, monkeypatch, causal=causal, attention_mask=mask, window=11)
    # Padding queries (and the fully padded row) are 0, never NaN.
    assert (out.permute(0, 2, 1)[mask == 0] == 0).all()
    assert (out[2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_mask(backend, monkeypatch):
    q, k = padded(b=2, hk=1, t=130, group=2)
    mask = padding_mask(2, 130, "left")
    query_mask = torch.rand(2, 130) < 0.3
    query_mask[:, 64:96] = False  # whole kernel blocks unselected: they are skipped
    out, _ = check(q, k, backend, monkeypatch, attention_mask=mask, query_mask=query_mask)
    assert (out.permute(0, 2, 1)[~query_mask] == 0).all()
    # Computed rows are not zeroed (the first real token sees only itself: H = 0 there).
    chosen = query_mask & mask.bool() & (mask.cumsum(-1) > 1)
    assert (out.permute(0, 2, 1)[chosen] > 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "opts",
    [{}, {"causal": False}, {"window": 7}, {"causal": False, "window": 3, "softcap": 2.0}],
    ids=["causal", "bidir", "window7", "bidir-window3-softcap"],
)
def test_packed_varlen(backend, opts, monkeypatch):
    lengths = [1, 37, 0, 60, 32]  # an empty sequence and a single token included
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, 2, 24) * 2
    k = torch.randn(total, 1, 24)
    query_mask = torch.rand(total) < 0.7
    out, _ = check(q, k, backend, monkeypatch, cu_seqlens=cu, query_mask=query_mask, **opts)
    assert out.shape == (total, 2)
    # A sequence never sees another: its values equal those of the sequence on its own.
    alone = logitless.attention_entropy(
        q[1:38], k[1:38], cu_seqlens=torch.tensor([0, 37]), query_mask=query_mask[1:38], **opts
    )
    torch.testing.assert_close(out[1:38], alone, atol=1e-6, rtol=0)
    # The packed sequence as a padded batch of one gives the same entropies.
    as_padded = logitless.attention_entropy(
        q[1:38].transpose(0, 1)[None], k[1:38].transpose(0, 1)[None],
        query_mask=query_mask[1:38][None], **opts
    )
    torch.testing.assert_close(out[1:38], as_padded[0].T, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(backend, dtype, monkeypatch):
    """fp32 accumulation from half inputs: exact products of the half values, so the error
    against fp64 on the same values is fp32-sized; torch's same-dtype softmax is the bound."""
    q, k = padded(b=1, t=130, group=2, dtype=dtype)
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    out = logitless.attention_entropy(q, k, window=50)
    ref = reference.attention_entropy(q.double(), k.double(), window=50)
    same = reference.attention_entropy(q, k, window=50)
    assert_close_to_oracle(out, ref, same, tol=TOL, name=f"{backend}-{dtype}")
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_scores_keep_precision(backend, monkeypatch):
    """Peaked rows with scores in the hundreds: keeping a relative to the running max avoids
    the cancellation of lse - sum p s (both ~ 1e3 here)."""
    q, k = padded(t=37, group=1, spread=60.0)
    _, ref = check(q, k, backend, monkeypatch, causal=False)
    assert ref.min() < 1e-3  # the case really is peaked


def test_reduce_heads_mean(monkeypatch):
    q, k = padded(t=37, group=2)
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    full = logitless.attention_entropy(q, k, window=9)
    mean = logitless.attention_entropy(q, k, window=9, reduce_heads="mean")
    torch.testing.assert_close(mean, full.mean(1))
    cu = torch.tensor([0, 10, 37])
    packed = logitless.attention_entropy(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                         cu_seqlens=cu, reduce_heads="mean")
    assert packed.shape == (37,)


def test_uniform_attention_is_log_count(monkeypatch):
    """q = 0: every visible key equally likely, H = log(number of visible keys)."""
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    q = torch.zeros(1, 2, 37, 8)
    k = torch.randn(1, 1, 37, 8)
    out = logitless.attention_entropy(q, k, window=6)
    seen = torch.clamp(torch.arange(37) + 1, max=6).double()
    torch.testing.assert_close(out[0, 0].double(), seen.log(), atol=1e-6, rtol=0)


def test_backend_env_is_read_at_each_call(monkeypatch):
    q, k = padded(t=16)
    monkeypatch.setenv("LOGITLESS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LOGITLESS_BACKEND"):
        logitless.attention_entropy(q, k)
    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        logitless.attention_entropy(q, k)
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    assert logitless.attention_entropy(q, k).shape == (2, 4, 16)


def test_refuses_grad():
    q, k = padded(t=16)
    with pytest.raises(ValueError, match="no backward"):
        logitless.attention_entropy(q.requires_grad_(), k)
    with torch.no_grad():
        assert logitless.attention_entropy(q, k).shape == (2, 4, 16)


def _bad_cases():
    q, k = padded(b=2, hk=2, group=2, t=10, d=8)
    qp, kp = q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous()
    cu = torch.tensor([0, 4, 10])
    mask = torch.ones(2, 10, dtype=torch.long)
    return [
        ("head dim", (q, k[..., :6]), {}),
        ("multiple of k's heads", (q[:, :3], k), {}),
        ("multiple of k's heads", (q, k[:, :0]), {}),
        ("k must be", (q, k[:, :, :9]), {}),
        ("k must be", (q, k[:1]), {}),
        ("attention_mask must have shape", (q, k), {"attention_mask": mask[:, :9]}),
        ("attention_mask must have shape", (q, k), {"attention_mask": mask[0]}),
        ("attention_mask must be bool or integer", (q, k), {"attention_mask": mask.float()}),
        ("query_mask must have shape", (q, k), {"query_mask": mask[:1]}),
        ("query_mask must have shape", (qp, kp), {"cu_seqlens": cu, "query_mask": mask}),
        ("cu_seqlens must start at 0", (qp, kp), {"cu_seqlens": torch.tensor([0, 4, 9])}),
        ("cu_seqlens must start at 0", (qp, kp), {"cu_seqlens": torch.tensor([1, 4, 10])}),
        ("cu_seqlens must start at 0", (qp, kp), {"cu_seqlens": torch.tensor([0, 6, 4, 10])}),
        ("cu_seqlens must be an integer", (qp, kp), {"cu_seqlens": cu.float()}),
        ("cu_seqlens must be a 1-D", (qp, kp), {"cu_seqlens": cu[None]}),
        ("with cu_seqlens, q must be packed", (q, k), {"cu_seqlens": cu}),
        ("attention_mask is for the padded", (qp, kp),
         {"cu_seqlens": cu, "attention_mask": mask[0]}),
        ("k must have q's 10 tokens", (qp, kp[:9]), {"cu_seqlens": cu}),
        ("q must be padded", (qp, kp), {}),
        ("same rank", (q, kp), {}),
        ("k must have q's dtype", (q, k.double()), {}),
        ("q must be float32", (q.double(), k.double()), {}),
        ("window must be >= 1", (q, k), {"window": 0}),
        ("window must be a positive int", (q, k), {"window": 2.5}),
        ("softcap must be a finite number > 0", (q, k), {"softcap": 0.0}),
        ("scale must be a finite number > 0", (q, k), {"scale": -1.0}),
        ("reduce_heads must be", (q, k), {"reduce_heads": "sum"}),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_names_the_argument(case, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    match, args, opts = _bad_cases()[case]
    with pytest.raises(ValueError, match=match):
        logitless.attention_entropy(*args, **opts)


def _bad_numbers():
    return [
        ("scale", float("inf")), ("scale", float("nan")), ("scale", "0.5"), ("scale", True),
        ("softcap", float("inf")), ("softcap", float("nan")), ("softcap", "30"),
        ("softcap", -float("inf")),
    ]


@pytest.mark.parametrize("name,value", _bad_numbers(), ids=repr)
@pytest.mark.parametrize("op", ["op", "reference"])
def test_non_finite_or_non_number_scale_and_softcap_refused(op, name, value, monkeypatch):
    """scale=inf used to give all-zero entropies (every row one-hot) and softcap="30" a
    TypeError from inside; both are refused, naming the argument."""
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    q, k = padded(t=10)
    fn = logitless.attention_entropy if op == "op" else reference.attention_entropy
    with pytest.raises(ValueError, match=f"{name} must be a finite number > 0"):
        fn(q, k, **{name: value})


def _expected_nan(b, hq, group, t, bad_q, bad_k, causal):
    """[B, Hq, T] True where a row sees a NaN: its own query, or a visible NaN key."""
    want = torch.zeros(b, hq, t, dtype=torch.bool)
    for bi, h, i in bad_q:
        want[bi, h, i] = True
    for bi, hk, j in bad_k:
        for h in range(hk * group, (hk + 1) * group):
            want[bi, h, j if causal else 0:] = True
    return want


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_nan_in_gives_nan_out(backend, causal, monkeypatch):
    """A row that sees a NaN query or key is NaN, never 0 (0 would read as the most confident
    token); other rows are unaffected, and hidden or unselected NaN changes nothing."""
    q, k = padded(b=2, hk=2, group=2, t=70, d=24)
    clean_q, clean_k = q.clone(), k.clone()
    bad_q, bad_k = [(0, 1, 5), (1, 3, 66)], [(1, 0, 40)]
    for bi, h, i in bad_q:
        q[bi, h, i, 3] = float("nan")
    for bi, hk, j in bad_k:
        k[bi, hk, j, 0] = float("nan")
    # Padding (hidden keys, unselected queries) full of NaN must not matter.
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[0, 60:] = 0
    q[0, :, 60:] = float("nan")
    k[0, :, 60:] = float("nan")
    opts = dict(causal=causal, attention_mask=mask, window=None if causal else 50)
    if backend == "reference":
        out = reference.attention_entropy(q.double(), k.double(), **opts)
    else:
        monkeypatch.setenv("LOGITLESS_BACKEND", backend)
        out = logitless.attention_entropy(q, k, **opts)
    want = _expected_nan(2, 4, 2, 70, bad_q, bad_k, causal)
    if not causal:  # window 50: key 40 is seen by queries 0..89
        want[1, 0:2, :] = True
    assert torch.equal(out.isnan(), want)
    ref = reference.attention_entropy(clean_q.double(), clean_k.double(), **opts)
    torch.testing.assert_close(out.double()[~want], ref[~want], atol=TOL, rtol=0)
    assert (out[0, :, 60:] == 0).all()


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_nan_packed_and_unselected(backend, monkeypatch):
    """Packed: a NaN key poisons only its own sequence's later queries; a NaN query that
    query_mask leaves out gives 0."""
    cu = torch.tensor([0, 30, 75])
    q = torch.randn(75, 2, 16)
    k = torch.randn(75, 1, 16)
    k[10, 0, 2] = float("nan")
    q[50, 1, 0] = float("nan")
    q[60, 0, 0] = float("nan")
    query_mask = torch.ones(75, dtype=torch.bool)
    query_mask[60] = False
    if backend == "reference":
        out = reference.attention_entropy(q.double(), k.double(), cu_seqlens=cu,
                                          query_mask=query_mask)
    else:
        monkeypatch.setenv("LOGITLESS_BACKEND", backend)
        out = logitless.attention_entropy(q, k, cu_seqlens=cu, query_mask=query_mask)
    want = torch.zeros(75, 2, dtype=torch.bool)
    want[10:30] = True
    want[50, 1] = True
    assert torch.equal(out.isnan(), want)
    assert (out[60] == 0).all()


@pytest.mark.parametrize("standardize", ["sequence", "batch"])
@pytest.mark.parametrize("mode", ["tanh", "softmax", "low_quantile", "high_quantile"])
def test_weights_propagate_nan(mode, standardize):
    """attn_entropy_weighting: a NaN attention entropy at a valid token gives a NaN weight
    (the loss shows the corruption), never a weight of a clean token; padding NaN is ignored."""
    from logitless import PolicyLossConfig
    from logitless.fused_losses.objectives.token_selection import (
        attention_entropy_stats,
        attention_entropy_weights,
    )

    cfg = PolicyLossConfig(attn_entropy_weighting=mode, attn_entropy_standardize=standardize)
    hatt = torch.rand(3, 9, dtype=torch.float64) * 3
    m = torch.ones(3, 9, dtype=torch.bool)
    m[2, 5:] = False
    hatt[2, 7] = float("nan")  # padding: ignored
    clean = attention_entropy_weights(hatt, m, cfg, stats=attention_entropy_stats(hatt, m),
                                      thresholds=(1.0, 2.0))
    assert not clean[m].isnan().any()
    hatt[0, 4] = float("nan")
    w = attention_entropy_weights(hatt, m, cfg, stats=attention_entropy_stats(hatt, m),
                                  thresholds=(1.0, 2.0))
    assert w[0, 4].isnan()
