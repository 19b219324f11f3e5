"""Shared test helpers (importable as `testing` because pytest puts tests/ on sys.path)."""

import contextlib
import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from logitless.kernels import interpreter_compat


def _triton_runs_here() -> bool:
    if torch.cuda.is_available():
        return True
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


# `make test` sets TRITON_INTERPRET=1, so in CI these never skip; a bare `pytest` run without it
# skips them with this reason instead of failing inside Triton's compiler.
requires_triton = pytest.mark.skipif(
    not _triton_runs_here(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test)"
)


def assert_close_to_oracle(actual, oracle, same_dtype, tol, name=""):
    """Three-way check: |actual - oracle| <= |same_dtype - oracle| + tol, elementwise."""
    actual = actual.double()
    oracle = oracle.double()
    same_dtype = same_dtype.double()
    err = (actual - oracle).abs()
    bound = (same_dtype - oracle).abs() + tol
    bad = err > bound
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} elements exceed the three-way bound; "
        f"max excess {float((err - bound).max()):.3e}, max err {float(err.max()):.3e}"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_entry(rank, world, port, fn, args, timeout=None):
    interpreter_compat.apply()  # a spawned rank runs no conftest: the suite's interpreter here too
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    extra = {} if timeout is None else dict(timeout=datetime.timedelta(seconds=timeout))
    dist.init_process_group("gloo", rank=rank, world_size=world, **extra)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_,
            torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.baddbmm_}
_ADD_MATMULS = {torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.baddbmm,
                torch.ops.aten.baddbmm_}


class MatmulFlops(TorchDispatchMode):
    """2 M N K per matmul while ``counting`` (every overload: ``out=`` and in place too)."""

    def __init__(self):
        super().__init__()
        self.counting, self.flops = False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if self.counting and packet in _MATMULS:
            a, b = args[1:3] if packet in _ADD_MATMULS else args[:2]
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **kwargs)


def run_on_gloo(world: int, fn, *args, timeout: float | None = None) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes of one gloo group on loopback;
    an assertion failing in any of them fails the caller. ``fn`` must be module-level. With
    ``timeout`` (seconds), a collective that waits longer raises instead of hanging (a rank
    left in a collective its peers never join fails the launch)."""
    mp.spawn(_gloo_entry, args=(world, _free_port(), fn, args, timeout), nprocs=world,
             join=True)


def tied_head_inputs(n=37, d=96, v=1007, seed=0):
    """Head inputs whose logits tie exactly: entries in {-1, 0, 1} (every logit an integer of
    magnitude <= d + 1, exact in fp32 and bf16) and every weight row repeated at another
    index, so each token's maximum appears at least twice. Targets: the first maximum, a later
    tied one, or a random id, by turns. Returns fp64 ``hidden, weight, bias, targets``."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda *shape: torch.randint(-1, 2, shape, generator=gen).double()
    half = v // 2
    base, bias_base = pick(v - half, d), pick(v - half)
    order = torch.randperm(v - half, generator=gen)
    twin = order[:half]
    bias_base[order[half:]] = -(d + 2)  # a row without a twin is never the maximum
    weight = torch.cat([base, base[twin]])
    bias = torch.cat([bias_base, bias_base[twin]])
    hidden = pick(n, d)
    logits = hidden @ weight.t() + bias
    first = logits.argmax(-1)
    tied = logits == logits.amax(-1, keepdim=True)
    last = v - 1 - tied.flip(-1).int().argmax(-1)
    assert (last > first).all(), "every maximum has a twin"
    targets = torch.stack([first, last, torch.randint(0, v, (n,), generator=gen)])
    targets = targets.gather(0, (torch.arange(n) % 3).unsqueeze(0)).squeeze(0)
    return hidden, weight, bias, targets


def scaled_head(n, d, v, seed=0, scale=3.0):
    """``(generator, hidden, weight, bias, logits)`` in fp64: a head whose logits spread about
    ``scale``, the generator left ready to draw the targets."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5 * scale
    bias = torch.randn(v, generator=gen, dtype=torch.float64) * scale / 3
    return gen, hidden, weight, bias, hidden @ weight.t() + bias


def sampler_settings(n, max_k, seed=1):
    """Per-token sampler settings for ``n`` tokens, each drawn at random: temperature in
    [0.5, 1.5), top-k in [1, max_k), top-p in [0.1, 1.0), min-p in [0, 0.2) (fp64, int64)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(temperature=torch.rand(n, generator=gen, dtype=torch.float64) + 0.5,
                top_k=torch.randint(1, max_k, (n,), generator=gen),
                top_p=torch.rand(n, generator=gen, dtype=torch.float64) * 0.9 + 0.1,
                min_p=torch.rand(n, generator=gen, dtype=torch.float64) * 0.2)


class PartitionedHead:
    """A ZeRO-3 stand-in for ``gather_weight``: leaf ``weight`` and ``bias`` that hold NaN
    outside ``gather()`` and their values inside it (DeepSpeed swaps a partitioned parameter's
    data the same way); ``entries`` records ``phase`` at each entry."""

    def __init__(self, weight, bias):
        self.full = [weight.detach().clone(), bias.detach().clone()]
        self.weight, self.bias = (x.detach().clone().requires_grad_() for x in self.full)
        self.phase, self.entries = "forward", []
        self._partition()

    def _partition(self):
        for p, full in zip((self.weight, self.bias), self.full):
            p.data = torch.full_like(full, float("nan"))

    @contextlib.contextmanager
    def gather(self):
        self.entries.append(self.phase)
        for p, full in zip((self.weight, self.bias), self.full):
            p.data = full
        try:
            yield
        finally:
            self._partition()


def assert_backward_enters_gather(run, h, w, b, t, kw):
    """``run(hidden, weight, bias, t, gather_weight=...)`` (a sampler-matched head with the
    settings ``kw``) on a `PartitionedHead` of ``w``, ``b``: the forward inside the gather as a
    caller runs it, then the values and gradients against the fp64 reference, which the
    backward reaches only if it enters the gather again."""
    from logitless.reference.sampler import sampler_logprobs

    head = PartitionedHead(w.float(), b.float())
    hidden = h.float().requires_grad_()
    with head.gather():
        out = run(hidden, head.weight, head.bias, t, gather_weight=head.gather)
    head.phase = "backward"
    ref_leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    ref = sampler_logprobs(ref_leaves[0], ref_leaves[1], t, ref_leaves[2], **kw)
    assert_sampler_matches(out, ref, [hidden, head.weight, head.bias], ref_leaves)
    assert head.entries == ["forward", "backward"]


def divergence_heads(n, d, d_t, v, *, batch=None, dtype=torch.float64, seed=0):
    """Student and teacher head inputs (fp64 draws cast to ``dtype``): ``hidden``, ``weight``,
    ``bias`` and their ``teacher_`` twins on a teacher hidden size ``d_t``, scaled so that the
    divergences between the heads are neither 0 nor huge."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n,) if batch is None else (batch, n)
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=gen)
    out = dict(hidden=r(*shape, d), weight=r(v, d) * 2 / d**0.5, bias=r(v) * 0.5,
               teacher_hidden=r(*shape, d_t), teacher_weight=r(v, d_t) * 2 / d_t**0.5,
               teacher_bias=r(v) * 0.5)
    return {k: t.to(dtype) for k, t in out.items()}


class SequenceParallelGather(torch.autograd.Function):
    """Megatron's gather_from_sequence_parallel_region: all-gather the sequence shards along
    dim 0; backward reduce-scatters (gloo has no reduce_scatter: all-reduce, keep our shard)."""

    @staticmethod
    def forward(ctx, shard):
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad.chunk(dist.get_world_size(), dim=0)[dist.get_rank()]


SAMPLER_OUTS = ("logprobs", "entropy", "log_kept_mass")


def finite_sum(outs, upstream):
    """``sum(o * g)`` over the outputs, their ``-inf`` logprobs read as 0."""
    return sum((torch.where(torch.isfinite(o), o, 0.0).double() * g).sum()
               for o, g in zip(outs, upstream))


def assert_sampler_matches(out, ref, leaves, ref_leaves, seed=5, atol=2e-5):
    """A sampler-matched ``LogprobOutput`` ``out`` against the reference's dict ``ref``: the
    same targets outside the kept set (``-inf``), the logprobs, entropies and log kept masses,
    and the gradients of ``leaves`` (hidden, weight, bias) against those of ``ref_leaves``
    under random upstream gradients."""
    finite = torch.isfinite(ref["logprobs"])
    assert torch.equal(torch.isfinite(out.logprobs), finite)
    for name in SAMPLER_OUTS:
        got, want = getattr(out, name).double(), ref[name].detach()
        sel = finite if name == "logprobs" else slice(None)
        torch.testing.assert_close(got[sel], want[sel], rtol=0, atol=atol)
    gen = torch.Generator().manual_seed(seed)
    up = [torch.randn(finite.shape, generator=gen, dtype=torch.float64) for _ in SAMPLER_OUTS]
    grads = torch.autograd.grad(finite_sum([getattr(out, k) for k in SAMPLER_OUTS], up),
                                leaves)
    ref_grads = torch.autograd.grad(finite_sum([ref[k] for k in SAMPLER_OUTS], up),
                                    ref_leaves)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=0, atol=atol * (1 + float(r.abs().max())))
