"""The chunked divergence kernels' intermediate results (both heads' logsumexp, the per-token
KL(student || m) the backward reuses, the top-k log-probs) against plain fp64 formulas, at
tile budgets that split rows and vocabulary unevenly."""

import math

import pytest
import torch

from logitless.kernels import divergence_torch

N, D, D_T, V = 37, 96, 64, 1007


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=gen)
    return (r(N, D), r(V, D) * 2 / D**0.5, r(V) * 0.5, r(N, D_T), r(V, D_T) * 2 / D_T**0.5,
            r(V) * 0.5)


@pytest.mark.parametrize("tile_bytes", [1024, 5 * 4096 + 8, 64 * 2**20])
@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])
def test_forward_statistics(beta, tile_bytes):
    h, w, b, th, tw, tb = inputs()
    temperature = 0.7
    div, lse_s, lse_t, aux = divergence_torch.divergence_forward(
        h, w, b, th, tw, tb, beta=beta, temperature=temperature, tile_bytes=tile_bytes)
    zs, zt = (h @ w.t() + b) / temperature, (th @ tw.t() + tb) / temperature
    torch.testing.assert_close(lse_s, zs.logsumexp(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_t, zt.logsumexp(-1), rtol=1e-12, atol=1e-12)
    log_s, log_t = zs.log_softmax(-1), zt.log_softmax(-1)
    if 0 < beta < 1:
        log_m = torch.log(beta * log_t.exp() + (1 - beta) * log_s.exp())
        expect_aux = (log_s.exp() * (log_s - log_m)).sum(-1)
        expect_div = beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1 - beta) * expect_aux
    else:
        p, q = (log_t, log_s) if beta == 0 else (log_s, log_t)
        expect_div = expect_aux = (p.exp() * (p - q)).sum(-1)
    torch.testing.assert_close(aux, expect_aux, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(div, expect_div, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tile_bytes", [1024, 5 * 4096 + 8, 64 * 2**20])
def test_topk_logprobs(tile_bytes):
    h, w, b, *_ = inputs(1)
    ids = torch.randint(0, V, (N, 5), generator=torch.Generator().manual_seed(2))
    ids[:, -1] = ids[:, 0]  # a repeated id
    logprobs, lse = divergence_torch.topk_forward(h, w, b, ids, temperature=1.3,
                                                  tile_bytes=tile_bytes)
    z = (h @ w.t() + b) / 1.3
    torch.testing.assert_close(lse, z.logsumexp(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logprobs, z.log_softmax(-1).gather(-1, ids), rtol=1e-12,
                               atol=1e-12)


def test_tiles_fit_the_budget():
    """The four tile buffers of one call fit the budget, split into several tiles."""
    heads = divergence_torch._Heads(N, V, torch.empty(N, D), torch.empty(N, D_T), 96 * 1024)
    assert 4 * heads.rows * heads.cols * 4 <= 96 * 1024
    assert math.ceil(N / heads.rows) * math.ceil(V / heads.cols) > 1
