"""verl's Ulysses split reaching ``cp_group=`` (docs/scale.md): the packed stream rolled and
sliced by verl's own ``ulysses_pad_and_slice_inputs``, each rank's ``cu_seqlens`` from
`ulysses_cp_seqlens`, on gloo ranks: the loss and gradients of the whole sequences."""

import pytest

ulysses = pytest.importorskip("verl.utils.ulysses", reason="verl is installed by `make test`")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import logitless  # noqa: E402
from logitless.fused_losses.objectives.config import PolicyLossConfig  # noqa: E402
from logitless.integrations.verl import ulysses_cp_seqlens  # noqa: E402

from testing import run_on_gloo  # noqa: E402

CU = torch.tensor([0, 6, 7, 19, 23, 31])  # 31 tokens: verl pads the stream to a multiple of W


def _worker(rank, world):
    ulysses.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    g = torch.Generator().manual_seed(11)
    n, d, v = int(CU[-1]), 12, 29
    input_ids = torch.randint(0, v, (1, n), generator=g)
    labels = torch.roll(input_ids, shifts=-1, dims=-1)  # rolled before the split (verl #6268)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5
    old = -torch.rand(n, generator=g, dtype=torch.float64) - 0.1
    mask = torch.ones(n)
    mask[CU[1:] - 1] = 0  # the last token of each sequence has no next token
    adv = torch.randn(len(CU) - 1, generator=g, dtype=torch.float64)
    local_cu, tokens = ulysses_cp_seqlens(CU, rank, world)

    def mine(x):  # verl's own slicing of the packed stream, its tail padding dropped
        flat = x.reshape(1, n, -1)
        cut = [ulysses.ulysses_pad_and_slice_inputs(flat[..., j], sp_size=world)[0]
               for j in range(flat.shape[-1])]
        return torch.stack(cut, -1).reshape(-1, *x.shape[1:])[:tokens]

    for cfg in (PolicyLossConfig(objective="gspo", entropy_coef=0.01),
                PolicyLossConfig(objective="grpo", loss_agg="seq-mean-token-mean",
                                 future_kl_coef=0.1, beta=0.05),
                PolicyLossConfig(objective="ctpo", loss_agg="balanced")):
        ref = old + 0.1
        full = [t.clone().requires_grad_(True) for t in (hidden, weight)]
        expected, _ = logitless.fused_policy_loss(full[0], full[1], labels[0], old, adv, mask,
                                                  cfg, cu_seqlens=CU, ref_logprobs=ref)
        expected.backward()
        h = mine(hidden).clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        loss, _ = logitless.fused_policy_loss(h, w, mine(labels[0]), mine(old), adv,
                                              mine(mask), cfg, cu_seqlens=local_cu,
                                              ref_logprobs=mine(ref), cp_group=dist.group.WORLD)
        loss.backward()
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(h.grad, mine(full[0].grad), rtol=1e-11, atol=1e-13)
        dist.all_reduce(w.grad)
        torch.testing.assert_close(w.grad, full[1].grad, rtol=1e-11, atol=1e-13)


@pytest.mark.dist  # over a minute on two cores: make test-dist
@pytest.mark.parametrize("world", [2, 3])
def test_verl_ulysses_split_matches_whole_sequences(world):
    run_on_gloo(world, _worker)


def test_ulysses_cp_seqlens_cover_the_stream():
    """Every rank's pieces, in rank order, make up each sequence; bad arguments are named."""
    pieces = [ulysses_cp_seqlens(CU, r, 3)[0].diff() for r in range(3)]
    assert torch.equal(torch.stack(pieces).sum(0), CU.diff())
    assert [ulysses_cp_seqlens(CU, r, 3)[1] for r in range(3)] == [11, 11, 9]
    with pytest.raises(ValueError, match=r"^sp_rank:"):
        ulysses_cp_seqlens(CU, 3, 3)
    with pytest.raises(ValueError, match=r"^cu_seqlens:"):
        ulysses_cp_seqlens(CU.double(), 0, 2)
