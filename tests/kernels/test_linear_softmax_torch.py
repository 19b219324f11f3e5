"""The chunked torch twin of the linear-softmax kernels, tested directly: its partials and
gradients against the fp64 reference, and the bounds it promises on its tile buffers."""

import pytest
import torch

from logitless import reference
from logitless.kernels import linear_softmax_torch as twin
from logitless.kernels.softmax_partials import normaliser

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _record_tiles(monkeypatch):
    """Every ``Tiles`` a call builds, kept for inspection."""
    built = []
    real_init = twin.Tiles.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(twin.Tiles, "__init__", init)
    return built


def _buffer_bytes(tiles) -> int:
    return sum(buf.numel() * buf.element_size()
               for buf in (tiles.z, tiles.scratch, tiles.cap, tiles.low, tiles.mask)
               if buf is not None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("tile_bytes", [50_000, 200_000])
def test_tile_buffers_fit_max_tile_bytes(dtype, softcap, tile_bytes, monkeypatch):
    """Every buffer of the forward's and the backward's tiles counts against the budget, the
    bf16/fp16 GEMM output included, and the budget is used (not left mostly idle)."""
    built = _record_tiles(monkeypatch)
    n, d, v = 300, 32, 5003
    hidden, weight = torch.randn(n, d, dtype=dtype), torch.randn(v, d, dtype=dtype) / d**0.5
    targets = torch.randint(0, v, (n,))
    opts = dict(temperature=1.0, softcap=softcap, logit_scale=1.0)
    parts = twin.forward(hidden, weight, None, targets, want_s2=True, want_sum_z=True,
                         tile_bytes=tile_bytes, **opts)
    twin.backward(hidden, weight, None, targets, *normaliser(parts), None, None, torch.ones(n),
                  None, None, None, vocab_total=v, need_hidden=True, need_weight=True,
                  need_bias=False,                  tile_bytes=tile_bytes, **opts)
    assert len(built) == 2
    for tiles in built:
        used = _buffer_bytes(tiles)
        # The backward has no top-1 mask: 1 byte of the 9 an fp32 element is counted for.
        assert tile_bytes * 0.85 <= used <= tile_bytes, (used, tile_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("tile_bytes", [None, 2**20], ids=["one-vocab-tile", "split-vocab"])
def test_a_rows_results_do_not_depend_on_its_batch(dtype, tile_bytes, monkeypatch):
    """Batch invariance: one token's logprob, entropy and hidden-gradient row are bitwise the
    same alone, among 37, 300 or 1100 tokens (other row blocks, a padded last block, other
    positions), with the vocabulary in one tile or split into several."""
    import logitless

    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    d, v = 96, 3001
    weight = (torch.randn(v, d) / d**0.5 * 2).to(dtype)
    bias = torch.randn(v).to(dtype)
    probe, probe_target = torch.randn(d).to(dtype), 1234
    seen = []
    for n, at in ((1, 0), (37, 17), (300, 250), (1100, 1050)):
        hidden = torch.randn(n, d).to(dtype)
        hidden[at] = probe
        targets = torch.randint(0, v, (n,))
        targets[at] = probe_target
        upstream = torch.randn(2, n)
        upstream[:, at] = torch.tensor([1.0, -0.5])
        h = hidden.clone().requires_grad_(True)
        out = logitless.linear_logprobs(h, weight, targets, bias=bias, return_entropy=True,
                                        softcap=20.0, max_tile_bytes=tile_bytes)
        (out.logprobs * upstream[0] + out.entropy * upstream[1]).sum().backward()
        seen.append((out.logprobs[at], out.entropy[at], h.grad[at]))
    for n, (lp, ent, grad) in zip((37, 300, 1100), seen[1:]):
        assert torch.equal(lp, seen[0][0]), n
        assert torch.equal(ent, seen[0][1]), n
        assert torch.equal(grad, seen[0][2]), n


def _problem(n=37, d=96, v=1007, bias=True):
    hidden = torch.randn(n, d, dtype=torch.float64)
    weight = torch.randn(v, d, dtype=torch.float64) / d**0.5 * 2
    b = torch.randn(v, dtype=torch.float64) if bias else None
    return hidden, weight, b, torch.randint(0, v, (n,))


OPTS = [dict(temperature=1.0, softcap=None, logit_scale=1.0),
        dict(temperature=0.7, softcap=4.0, logit_scale=1.3)]


@pytest.mark.parametrize("opts", OPTS, ids=["plain", "capped"])
@pytest.mark.parametrize("tile_bytes", [twin.DEFAULT_TILE_BYTES, 17 * 40 * 64])
def test_forward_partials_finish_to_the_reference(opts, tile_bytes):
    """fp64 partials, finished, equal the reference statistics (vocab split or not)."""
    from logitless.kernels.softmax_partials import finish

    hidden, weight, bias, targets = _problem()
    parts = twin.forward(hidden, weight, bias, targets, want_s2=True, want_sum_z=True,
                         tile_bytes=tile_bytes, **opts)
    assert all(f.dtype == torch.float64 and f.shape == (37,) for f in parts[:7])
    stats = finish(parts, weight.shape[0])
    ref = reference.linear_softmax_stats(hidden, weight, targets, bias, softcap=opts["softcap"],
                                         temperature=opts["temperature"],
                                         logit_scale=opts["logit_scale"])
    for k in ("lse", "logprobs", "entropy", "sum_p_sq", "mean_logit"):
        torch.testing.assert_close(stats[k], ref[k], rtol=1e-12, atol=1e-12, msg=k)
    assert torch.equal(stats["is_top1"], ref["is_top1"])


@pytest.mark.parametrize("opts", OPTS, ids=["plain", "capped"])
def test_backward_equals_the_reference_gradients(opts):
    """fp64 gradients of a mix of every statistic, against autograd through the reference."""
    hidden, weight, bias, targets = _problem()
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    ref = reference.linear_softmax_stats(*leaves[:2], targets, leaves[2],
                                         softcap=opts["softcap"],
                                         temperature=opts["temperature"],
                                         logit_scale=opts["logit_scale"])
    g = {k: torch.randn(37, dtype=torch.float64)
         for k in ("logprobs", "entropy", "sum_p_sq", "mean_logit", "lse")}
    want = torch.autograd.grad(sum((ref[k] * g[k]).sum() for k in g), leaves)
    parts = twin.forward(hidden, weight, bias, targets, want_s2=False, want_sum_z=False,
                         tile_bytes=17 * 40 * 64, **opts)
    got = twin.backward(hidden, weight, bias, targets, *normaliser(parts),
                        ref["entropy"].detach(), ref["sum_p_sq"].detach(), g["logprobs"],
                        g["entropy"], g["sum_p_sq"], g["mean_logit"], g_lse=g["lse"],
                        vocab_total=weight.shape[0], need_hidden=True, need_weight=True,
                        need_bias=True, tile_bytes=17 * 40 * 64, **opts)
    for name, a, b in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_targets_outside_the_slice():
    """A slice's local targets below 0 / past its end (another rank's vocabulary): no target
    logit, and m_before is -inf / the slice's max."""
    hidden, weight, _, _ = _problem(n=4, v=50, bias=False)
    targets = torch.tensor([-3, 50, 70, 10])
    parts = twin.forward(hidden, weight, None, targets, want_s2=False, want_sum_z=False,
                         temperature=1.0, softcap=None, logit_scale=1.0)
    logits = hidden @ weight.t()
    assert torch.equal(parts.z_y[:3], torch.zeros(3, dtype=torch.float64))
    assert parts.m_before[0] == float("-inf")
    assert torch.equal(parts.m_before[1:3], logits[1:3].amax(-1))
    assert parts.m_before[3] == logits[3, :10].amax()
