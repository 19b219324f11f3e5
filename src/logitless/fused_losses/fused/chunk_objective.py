"""The objective's share on one chunk of `fused_policy_loss`: the chunk's loss from its rows'
``(lp, H[, KL])`` (`ChunkObjective.loss`, :func:`batch_policy_loss` with the batch's globals:
the one copy of the math) and its gradients ``d loss / d lp``, ``d loss / d H``, ``d loss / d KL``
(`ChunkObjective.grads`), which the store's gradient pass consumes.

Eagerly, that gradient is autograd on the chunk's small per-token graph: about 60 aten ops
forward and backward, each a kernel launch on CUDA, per chunk. On CUDA the same function is
compiled with inductor (``torch.compile(dynamic=True, fullgraph=True)`` of that loss, and
AOTAutograd's compiled backward of it: a few fused kernels forward and backward), the math
still written once. The first chunk of a call always runs eagerly: it raises what the
objective raises, and it finds which of ``H`` and ``KL`` the loss depends on (autograd's
``allow_unused``), so that the gradient pass skips a term that gets no gradient exactly as
the eager path does. If compiling fails the eager path is used from then on (a warning says
why). ``COMPILE`` forces either way (tests: the compiled path on CPU with inductor's C++
backend)."""

from __future__ import annotations

import warnings

import torch

from logitless.fused_losses.fused.validation import current_tensors
from logitless.fused_losses.objectives.policy_loss import batch_policy_loss

# None: compile on CUDA only; True / False: forced (for tests and measurement).
COMPILE: bool | None = None
# Kernels inductor generated for the latest compiled graph: what one compiled call launches
# (read by `logitless.tools.launches`).
KERNELS = 0
_STATE = {"fn": None, "broken": False}
# Graphs kept for the chunk loss: one per configuration and per branch a number takes (an
# entropy coefficient of 0 or not, ...); dynamo's default of 8 for all the configurations a
# process uses would soon send every call to the eager path.
RECOMPILE_LIMIT = 64


def _chunk_loss(sub, masks, row, col, s0, cfg, glob, num_items_in_batch, global_batch_size,
                training_progress, entropy_coef, lp, ent, kl):
    """The chunk's share of the loss from its loss rows' ``lp``, ``H`` (and exact ``KL``),
    scattered onto the chunk's grid at ``(row - s0, col)``; on-policy its old logprobs are
    ``lp`` detached (`current_tensors`) (the call's numbers one by one:
    under dynamo a number in a dict is a constant of the graph)."""
    where = (row - s0, col)

    def grid(x):
        return x.new_zeros(sub.m.shape).index_put(where, x)

    batch = current_tensors(sub, grid(lp), grid(ent), None if kl is None else grid(kl))
    loss, _ = batch_policy_loss(batch, cfg, glob, masks=masks, compute_metrics=False,
                           num_items_in_batch=num_items_in_batch,
                           global_batch_size=global_batch_size,
                           training_progress=training_progress, entropy_coef=entropy_coef)
    return loss


def _compiled():
    if _STATE["fn"] is None:
        _STATE["fn"] = torch.compile(_chunk_loss, dynamic=True, fullgraph=True)
    return _STATE["fn"]


def run_compiled(args, leaves) -> tuple:
    """The compiled chunk loss and its compiled backward (AOTAutograd's): the gradients in
    ``leaves`` (zeros or None for one the loss does not depend on); `KERNELS` updated when
    it compiled."""
    global KERNELS
    from torch._inductor import metrics

    before = metrics.generated_kernel_count
    # the call's numbers (entropy_coef, training_progress: a new value each step) symbols of
    # the graph, not constants that would recompile it at every step
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(specialize_float=False, **{limit: RECOMPILE_LIMIT}), torch.enable_grad():
        loss = _compiled()(*args, *leaves, *([None] * (3 - len(leaves))))
        got = torch.autograd.grad(loss, leaves, allow_unused=True)
    if metrics.generated_kernel_count != before:
        KERNELS = metrics.generated_kernel_count - before
    return got


class ChunkObjective:
    """The objective of one call on its chunks (`fused_policy_loss`'s `ChunkRunner`)."""

    def __init__(self, call, glob, masks, loss_args, device: torch.device):
        self.call, self.glob, self.masks, self.loss_args = call, glob, masks, loss_args
        self.compile = COMPILE if COMPILE is not None else device.type == "cuda"
        self.used = None  # per leaf: whether the loss depends on it (found on the first chunk)

    def _args(self, chunk):
        sub = self.call.batch.rows(chunk.s0, chunk.s1, chunk.width)
        row, col = (x[chunk.a:chunk.b] for x in self.call.where)
        # the whole batch's masks, sliced: the selections of the thresholds' own comparisons
        masks = self.masks.rows(chunk.s0, chunk.s1, chunk.width)
        la = self.loss_args
        # under cp_group the chunk's whole-sequence lengths (the rank's chunks are its own)
        glob = self.glob.rows(chunk.s0, chunk.s1)
        return (sub, masks, row, col, chunk.s0, self.call.config, glob,
                la["num_items_in_batch"], la["global_batch_size"], la["training_progress"],
                la["entropy_coef"])

    def loss(self, chunk, lp, ent, kl=None):
        """The chunk's share of the loss (differentiable in ``lp``, ``ent``, ``kl``)."""
        return _chunk_loss(*self._args(chunk), lp, ent, kl)

    def grads(self, chunk, lp, ent, kl=None) -> tuple:
        """``(g_lp, g_ent, g_kl)`` of the chunk's loss, None for a leaf it does not depend on
        (``g_kl`` None without ``kl``)."""
        leaves = [x.detach() for x in (lp, ent) + (() if kl is None else (kl,))]
        if self.used is not None and self.compile and not _STATE["broken"]:
            try:
                got = run_compiled(self._args(chunk), [x.requires_grad_(True) for x in leaves])
            except Exception as e:  # any failure to compile or run it: the eager path
                _STATE["broken"] = True
                warnings.warn(f"fused_policy_loss: the compiled chunk objective failed ({e!r});"
                              " running it eagerly from now on", RuntimeWarning, stacklevel=2)
            else:
                got = [g if u else None for g, u in zip(got, self.used)]
                return (*got, None) if kl is None else tuple(got)
        leaves = [x.requires_grad_(True) for x in leaves]
        with torch.enable_grad():
            loss = self.loss(chunk, *leaves)
            got = torch.autograd.grad(loss, leaves, allow_unused=True)
        self.used = [g is not None for g in got]
        return (*got, None) if kl is None else tuple(got)
