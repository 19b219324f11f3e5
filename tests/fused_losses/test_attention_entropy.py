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
        ("softcap must be > 0", (q, k), {"softcap": 0.0}),
        ("scale must be > 0", (q, k), {"scale": -1.0}),
        ("reduce_heads must be", (q, k), {"reduce_heads": "sum"}),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_names_the_argument(case, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    match, args, opts = _bad_cases()[case]
    with pytest.raises(ValueError, match=match):
        logitless.attention_entropy(*args, **opts)
