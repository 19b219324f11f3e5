"""The chunked torch twin of the linear-softmax kernels, tested directly: its partials and
gradients against the fp64 reference, and the bounds it promises on its tile buffers."""

import pytest
import torch

from logitless.kernels import linear_softmax_torch as twin

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _record_tiles(monkeypatch):
    """Every ``_Tiles`` a call builds, kept for inspection."""
    built = []
    real_init = twin._Tiles.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(twin._Tiles, "__init__", init)
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
    lse = parts.m + parts.l.log()
    twin.backward(hidden, weight, None, targets, lse, None, None, torch.ones(n), None, None,
                  None, vocab_total=v, need_hidden=True, need_weight=True, need_bias=False,
                  tile_bytes=tile_bytes, **opts)
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
