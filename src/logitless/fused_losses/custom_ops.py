"""The public ops as ``torch.library`` custom ops, so ``torch.compile`` and ``torch.export``
see each as one graph node.

The pattern, for every public op:

- the Python function (``linear_logprobs``, ...) checks its arguments *statically*: types,
  shapes, dtypes and scalar ranges, nothing that reads a tensor's values, so dynamo traces it
  without a graph break;
- it then calls one op ``torch.ops.logitless.<name>`` whose implementation does everything
  that depends on values: validation of token ids (it may raise ``ValueError`` from inside
  the op), compaction of ignored rows, chunk plans, the choice of backend;
- the op's fake implementation (``register_fake``, which also serves meta tensors) gives the
  shape and dtype of every output from the inputs' shapes alone;
- its autograd registration saves what the backward needs, and the backward is itself a
  custom op with a fake implementation, so compiled backward graphs capture it as one node.

Configuration crosses the op boundary as ``int``/``float``/``bool``/``ScalarType`` arguments.
``fused_policy_loss`` differs in three ways: its `PolicyLossConfig` crosses as four lists
(numbers, strings, flags, tensors, in the config's field order: a schema holds at most 64
arguments); its metrics come back as one tensor whose entries the wrapper names (the names
follow from the objective and ``rollout_is``, `fused_policy_loss.metric_names`, and the op
raises if the objective gives others); and its op computes the gradients in its forward, as
the eager chunked strategy does, so that its backward is two or three multiplications by
the loss's incoming gradient rather than an op of its own. Every argument of
``fused_policy_loss`` crosses.

A process group is no op argument, but its name is (``ProcessGroup.group_name``, a string, as
torch's functional collectives take it; dynamo reads it while tracing): ``linear_logprobs``'s
``vocab_parallel`` group crosses as ``group_name`` (with ``hidden_grad``), and the forward and
backward ops resolve it and run the group's collectives inside (an all-gather of the slice
sizes in each, the all-reduces of the partials and of the hidden gradient), so the compiled
graph holds them in the op's node. A callable cannot cross: ``linear_logprobs``'s
``gather_weight`` keeps the eager path.
"""

import torch

from logitless.kernels.linear_softmax_torch import acc_dtype


def is_compiling() -> bool:
    """True while dynamo traces (``torch.compile``, ``torch.export``): code that would read a
    tensor's value on the host (a check, a count turned into a float) takes its traceable
    form then."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    return False


OPS: list[str] = []  # qualified names of the ops defined here (``torch.library.opcheck``)


def _define(name: str, schema: str, impl, fake):
    """Register ``logitless::<name>`` with its implementation and fake implementation."""
    op = torch.library.custom_op(f"logitless::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    OPS.append(f"logitless::{name}")
    return op


def _distinct(outs) -> tuple[torch.Tensor, ...]:
    """An op's outputs, each in its own storage (an op's outputs may not alias one another:
    a kernel may return one tensor for two results, e.g. the divergence as its own ``aux``)."""
    seen, result = set(), []
    for x in outs:
        ptr = x.untyped_storage().data_ptr() if x.numel() else None
        result.append(x.clone() if ptr in seen else x)
        seen.add(ptr)
    return tuple(result)


def _none_grads(n: int) -> tuple[None, ...]:
    return (None,) * n


# --- linear_logprobs ----------------------------------------------------------------------

_LP_CONFIG = ("float temperature, float? softcap, float logit_scale, int ignore_index, "
              "int? tile_bytes, ScalarType dtype")
# vocab parallelism: the process group by name (``ProcessGroup.group_name``, as torch's
# functional collectives take it), resolved inside the op; None: the vocabulary is whole
_LP_GROUP = 'str? group_name=None, str hidden_grad="sum"'


def _lp_spec(hidden, weight, temperature, softcap, logit_scale, tile_bytes, dtype, want_s2,
             want_sum_z, group_name, hidden_grad):
    """``(spec, offset)``: the call's spec and the first global id of this rank's vocabulary
    slice. ``group_name`` names the process group the vocabulary is sharded over (None: not
    sharded, offset 0); the group's all-gather of slice sizes and its all-reduces run here,
    inside the op."""
    import dataclasses

    from logitless.fused_losses import logprobs as lp

    spec = lp._local_spec(hidden, weight, temperature, softcap, logit_scale, want_s2, want_sum_z,
                          tile_bytes, dtype)
    if group_name is None:
        return spec, 0
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    offset, v_total = lp._vocab_offset(weight.shape[0], group, hidden.device)
    return dataclasses.replace(spec, vocab_total=v_total, group=group,
                               hidden_grad=hidden_grad), offset


def _lp_forward(hidden, weight, bias, targets, temperature, softcap, logit_scale, ignore_index,
                tile_bytes, dtype, want_s2, want_sum_z, group_name=None, hidden_grad="sum"):
    from logitless.fused_losses import logprobs as lp

    spec, offset = _lp_spec(hidden, weight, temperature, softcap, logit_scale, tile_bytes, dtype,
                            want_s2, want_sum_z, group_name, hidden_grad)
    return _distinct(lp._logprobs_impl(hidden, weight, bias, targets, spec, ignore_index, offset,
                                       lambda h, w, b, t, s: lp._rows_forward(s, h, w, b, t)))


def _lp_forward_fake(hidden, weight, bias, targets, temperature, softcap, logit_scale,
                     ignore_index, tile_bytes, dtype, want_s2, want_sum_z, group_name=None,
                     hidden_grad="sum"):
    acc = acc_dtype(dtype)
    floats = [hidden.new_empty(targets.shape, dtype=acc) for _ in range(4)]
    top1 = hidden.new_empty(targets.shape, dtype=torch.bool)
    return (*floats, top1, hidden.new_empty(targets.shape, dtype=acc))


def _lp_backward_impl(hidden, weight, bias, targets, lse, entropy, sum_p_sq, g_lp, g_entropy,
                      g_sum_p_sq, g_mean_logit, g_lse, temperature, softcap, logit_scale,
                      ignore_index, tile_bytes, dtype, need_hidden, need_weight, need_bias,
                      group_name=None, hidden_grad="sum"):
    from logitless.fused_losses import logprobs as lp

    spec, offset = _lp_spec(hidden, weight, temperature, softcap, logit_scale, tile_bytes, dtype,
                            False, False, group_name, hidden_grad)
    flat_t, rows = lp.compact_rows(targets, ignore_index, spec.vocab_total)
    per_row = [lp.take_rows(x, rows) for x in (flat_t - offset, lse, entropy, sum_p_sq, g_lp,
                                               g_entropy, g_sum_p_sq, g_mean_logit, g_lse)]
    d_hidden, d_weight, d_bias = lp._rows_backward(
        spec, lp.take_rows(hidden, rows, hidden.shape[-1]), weight, bias, *per_row[:4],
        tuple(per_row[4:]), (need_hidden, need_weight, need_bias))
    return _grads_or_empty(hidden, weight, rows, d_hidden, d_weight, d_bias)


def _lp_backward_fake(hidden, weight, bias, targets, lse, entropy, sum_p_sq, g_lp, g_entropy,
                      g_sum_p_sq, g_mean_logit, g_lse, temperature, softcap, logit_scale,
                      ignore_index, tile_bytes, dtype, need_hidden, need_weight, need_bias,
                      group_name=None, hidden_grad="sum"):
    return _grads_fake(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _lp_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets = inputs[:4]
    ctx.config, ctx.group = inputs[4:10], inputs[12:14]  # (group_name, hidden_grad)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, bias, targets, output[5], output[1], output[2])


def _lp_backward(ctx, g_lp, g_entropy, g_sum_p_sq, g_mean_logit, _g_top1, g_lse):
    n_inputs = 14
    if all(g is None for g in (g_lp, g_entropy, g_sum_p_sq, g_mean_logit, g_lse)):
        return _none_grads(n_inputs)
    hidden, weight, bias, targets, lse, entropy, sum_p_sq = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = need_bias and bias is not None
    d_hidden, d_weight, d_bias = linear_logprobs_backward(
        hidden, weight, bias, targets, lse, entropy if g_entropy is not None else None,
        sum_p_sq if g_sum_p_sq is not None else None, g_lp, g_entropy, g_sum_p_sq, g_mean_logit,
        g_lse, *ctx.config, need_hidden, need_weight, need_bias, *ctx.group)
    return (d_hidden if need_hidden else None, d_weight if need_weight else None,
            d_bias if need_bias else None, *_none_grads(n_inputs - 3))


linear_logprobs_backward = _define(
    "linear_logprobs_backward",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor lse, "
    "Tensor? entropy, Tensor? sum_p_sq, Tensor? g_lp, Tensor? g_entropy, "
    "Tensor? g_sum_p_sq, Tensor? g_mean_logit, Tensor? g_lse, " + _LP_CONFIG
    + ", bool need_hidden, bool need_weight, bool need_bias, " + _LP_GROUP
    + ") -> (Tensor, Tensor, Tensor)",
    _lp_backward_impl, _lp_backward_fake)
linear_logprobs = _define(
    "linear_logprobs",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, " + _LP_CONFIG
    + ", bool want_s2, bool want_sum_z, " + _LP_GROUP
    + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _lp_forward, _lp_forward_fake)
linear_logprobs.register_autograd(_lp_backward, setup_context=_lp_setup_context)


# --- linear_logprobs with the sampler's settings (sampled.py) --------------------------------

_SP_CONFIG = ("float? softcap, float logit_scale, int ignore_index, int? tile_bytes, "
              "ScalarType dtype")


def _sp_rows(targets, temperature, top_k, top_p, min_p, weight, ignore_index):
    """``(flat targets, rows, RowParams of the rows)``: ids validated, the settings' rows."""
    from logitless.fused_losses import logprobs as lp
    from logitless.kernels.sampler_torch import RowParams

    flat_t, rows = lp.compact_rows(targets, ignore_index, weight.shape[0])
    params = RowParams(*(lp.take_rows(x, rows) for x in (temperature, top_k, top_p, min_p)))
    return lp.take_rows(flat_t, rows), rows, params


def _sp_forward(hidden, weight, bias, targets, temperature, top_k, top_p, min_p, softcap,
                logit_scale, ignore_index, tile_bytes, dtype):
    from logitless.fused_losses import logprobs as lp
    from logitless.fused_losses import sampled

    sampled.check_values(temperature, top_k, top_p, min_p)
    t, rows, params = _sp_rows(targets, temperature, top_k, top_p, min_p, weight, ignore_index)
    outs = sampled.rows_forward(lp.take_rows(hidden, rows, hidden.shape[-1]), weight, bias, t,
                                params, softcap, logit_scale, tile_bytes, dtype)
    return _distinct(lp.put_rows(x, rows, targets.shape) for x in outs)


def _sp_forward_fake(hidden, weight, bias, targets, temperature, top_k, top_p, min_p, softcap,
                     logit_scale, ignore_index, tile_bytes, dtype):
    acc = acc_dtype(dtype)
    floats = [hidden.new_empty(targets.shape, dtype=acc) for _ in range(5)]
    return (*floats, *(hidden.new_empty(targets.shape, dtype=torch.int64) for _ in range(2)))


def _sp_backward_impl(hidden, weight, bias, targets, temperature, top_k, top_p, min_p, key,
                      count, lse, lse_kept, entropy, logprobs, g_lp, g_entropy, g_kept, g_lse,
                      softcap, logit_scale, ignore_index, tile_bytes, dtype, need_hidden,
                      need_weight, need_bias):
    from logitless.fused_losses import logprobs as lp
    from logitless.fused_losses import sampled

    t, rows, params = _sp_rows(targets, temperature, top_k, top_p, min_p, weight, ignore_index)
    saved = [lp.take_rows(x, rows) for x in (key, count, lse, lse_kept, entropy, logprobs)]
    grads = tuple(lp.take_rows(g, rows) for g in (g_lp, g_entropy, g_kept, g_lse))
    d_hidden, d_weight, d_bias = sampled.rows_backward(
        lp.take_rows(hidden, rows, hidden.shape[-1]), weight, bias, t, params, *saved, grads,
        (need_hidden, need_weight, need_bias), softcap, logit_scale, tile_bytes, dtype)
    return _grads_or_empty(hidden, weight, rows, d_hidden, d_weight, d_bias)


def _sp_backward_fake(hidden, weight, bias, targets, temperature, top_k, top_p, min_p, key,
                      count, lse, lse_kept, entropy, logprobs, g_lp, g_entropy, g_kept, g_lse,
                      softcap, logit_scale, ignore_index, tile_bytes, dtype, need_hidden,
                      need_weight, need_bias):
    return _grads_fake(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _sp_setup_context(ctx, inputs, output):
    ctx.config = inputs[8:13]
    ctx.set_materialize_grads(False)
    lp_, ent, _, lse, lse_kept, key, count = output
    ctx.save_for_backward(*inputs[:8], key, count, lse, lse_kept, ent, lp_)


def _sp_backward(ctx, g_lp, g_entropy, g_kept, g_lse, *_):
    n_inputs = 13
    if all(g is None for g in (g_lp, g_entropy, g_kept, g_lse)):
        return _none_grads(n_inputs)
    saved = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    need = (need[0], need[1], need[2] and saved[2] is not None)
    grads = sampled_logprobs_backward(*saved, g_lp, g_entropy, g_kept, g_lse, *ctx.config,
                                      *need)
    return (*(g if n else None for g, n in zip(grads, need)), *_none_grads(n_inputs - 3))


_SP_INPUTS = ("Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, "
              "Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor? min_p, ")
sampled_logprobs_backward = _define(
    "sampled_logprobs_backward",
    "(" + _SP_INPUTS + "Tensor key, Tensor count, Tensor lse, Tensor lse_kept, "
    "Tensor entropy, Tensor logprobs, Tensor? g_lp, Tensor? g_entropy, Tensor? g_kept, "
    "Tensor? g_lse, " + _SP_CONFIG + ", bool need_hidden, bool need_weight, "
    "bool need_bias) -> (Tensor, Tensor, Tensor)",
    _sp_backward_impl, _sp_backward_fake)
sampled_logprobs = _define(
    "sampled_logprobs",
    "(" + _SP_INPUTS + _SP_CONFIG + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
    "Tensor)",
    _sp_forward, _sp_forward_fake)
sampled_logprobs.register_autograd(_sp_backward, setup_context=_sp_setup_context)


# --- attention_entropy (forward only) -------------------------------------------------------


def _ae_forward(q, k, cu_seqlens, attention_mask, query_mask, causal, scale, window, softcap,
                reduce_mean):
    from logitless.fused_losses.attention_entropy import _attention_entropy_impl

    return _attention_entropy_impl(q, k, cu_seqlens, attention_mask, query_mask, causal, scale,
                                   window, softcap, reduce_mean)


def _ae_forward_fake(q, k, cu_seqlens, attention_mask, query_mask, causal, scale, window,
                     softcap, reduce_mean):
    if cu_seqlens is not None:  # packed [total, Hq, d] -> [total, Hq]
        shape = q.shape[:2]
    else:  # padded [B, Hq, T, d] -> [B, Hq, T]
        shape = q.shape[:3]
    if reduce_mean:
        shape = (shape[0], *shape[2:])
    return q.new_empty(shape, dtype=torch.float32)


_define("attention_entropy",
        "(Tensor q, Tensor k, Tensor? cu_seqlens, Tensor? attention_mask, Tensor? query_mask, "
        "bool causal, float scale, int? window, float? softcap, bool reduce_mean) -> Tensor",
        _ae_forward, _ae_forward_fake)


# --- linear_divergence ----------------------------------------------------------------------

_DIV_CONFIG = "float beta, float temperature, int? tile_bytes"


def _div_spec(beta, temperature, tile_bytes, hidden, t_hidden=None, entropy=False):
    from logitless.fused_losses.divergence import spec_for

    return spec_for(beta, temperature, tile_bytes, hidden, t_hidden, entropy)


def _div_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, mask, beta, temperature,
                 tile_bytes, entropy):
    from logitless.fused_losses import divergence as dv

    spec = _div_spec(beta, temperature, tile_bytes, hidden, t_hidden, entropy)
    return _distinct(dv._divergence_impl(spec, hidden, weight, bias, t_hidden, t_weight, t_bias,
                                         mask))


def _div_forward_fake(hidden, weight, bias, t_hidden, t_weight, t_bias, mask, beta,
                      temperature, tile_bytes, entropy):
    acc = acc_dtype(hidden.dtype)
    return tuple(hidden.new_empty(hidden.shape[:-1], dtype=acc) for _ in range(5))


def _div_backward_impl(hidden, weight, bias, t_hidden, t_weight, t_bias, mask, lse_s, lse_t, aux,
                       grad, beta, temperature, tile_bytes, need_hidden, need_weight, need_bias):
    from logitless.fused_losses import divergence as dv
    from logitless.fused_losses import logprobs as lp

    rows = dv._rows(mask, grad.numel())
    per_row = [lp.take_rows(x, rows) for x in (lse_s, lse_t, aux, grad)]
    d_hidden, d_weight, d_bias = dv._divergence_rows_backward(
        _div_spec(beta, temperature, tile_bytes, hidden, t_hidden),
        lp.take_rows(hidden, rows, hidden.shape[-1]),
        weight, bias, lp.take_rows(t_hidden, rows, t_hidden.shape[-1]), t_weight, t_bias,
        *per_row, (need_hidden, need_weight, need_bias))
    return _grads_or_empty(hidden, weight, rows, d_hidden, d_weight, d_bias)


def _grads_or_empty(hidden, weight, rows, d_hidden, d_weight, d_bias):
    """A backward op's three outputs: the hidden gradient scattered back to ``hidden``'s shape,
    and an empty tensor for each gradient not computed (an op returns no None)."""
    from logitless.fused_losses import logprobs as lp

    return (hidden.new_empty(0) if d_hidden is None else lp.put_rows(d_hidden, rows, hidden.shape),
            weight.new_empty(0) if d_weight is None else d_weight,
            weight.new_empty(0) if d_bias is None else d_bias)


def _grads_fake(hidden, weight, bias, need_hidden, need_weight, need_bias):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            torch.empty_like(bias) if need_bias else weight.new_empty(0))


def _div_backward_fake(hidden, weight, bias, t_hidden, t_weight, t_bias, mask, lse_s, lse_t, aux,
                       grad, beta, temperature, tile_bytes, need_hidden, need_weight, need_bias):
    return _grads_fake(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _div_setup_context(ctx, inputs, output):
    ctx.config = inputs[7:10]
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs[:7], *output[2:])


def _div_backward(ctx, grad, *_):
    n_inputs = 11
    need = ctx.needs_input_grad[:3]
    if grad is None or not any(need):
        return _none_grads(n_inputs)
    saved = ctx.saved_tensors
    need = (need[0], need[1], need[2] and saved[2] is not None)
    grads = linear_divergence_backward(*saved, grad, *ctx.config, *need)
    return (*(g if n else None for g, n in zip(grads, need)), *_none_grads(n_inputs - 3))


linear_divergence_backward = _define(
    "linear_divergence_backward",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor t_hidden, Tensor t_weight, "
    "Tensor? t_bias, Tensor? mask, Tensor lse_s, Tensor lse_t, Tensor aux, Tensor grad, "
    + _DIV_CONFIG + ", bool need_hidden, bool need_weight, bool need_bias) "
    "-> (Tensor, Tensor, Tensor)",
    _div_backward_impl, _div_backward_fake)
linear_divergence = _define(
    "linear_divergence",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor t_hidden, Tensor t_weight, "
    "Tensor? t_bias, Tensor? mask, " + _DIV_CONFIG + ", bool entropy) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _div_forward, _div_forward_fake)
linear_divergence.register_autograd(_div_backward, setup_context=_div_setup_context)


# --- linear_topk_distill's student logprobs at the teacher's ids ----------------------------


def _topk_forward(hidden, weight, bias, ids, mask, temperature, tile_bytes):
    from logitless.fused_losses import divergence as dv
    from logitless.fused_losses import logprobs as lp

    rows = dv._rows(mask, ids.numel() // max(ids.shape[-1], 1))
    logprobs, lse = dv._topk_rows(_div_spec(0.0, temperature, tile_bytes, hidden),
                                  lp.take_rows(hidden, rows, hidden.shape[-1]), weight, bias,
                                  dv._topk_ids(ids, rows, weight.shape[0]))
    return lp.put_rows(logprobs, rows, ids.shape), lp.put_rows(lse, rows, ids.shape[:-1])


def _topk_forward_fake(hidden, weight, bias, ids, mask, temperature, tile_bytes):
    acc = acc_dtype(hidden.dtype)
    return hidden.new_empty(ids.shape, dtype=acc), hidden.new_empty(ids.shape[:-1], dtype=acc)


def _topk_backward_impl(hidden, weight, bias, ids, mask, lse, grad, temperature, tile_bytes,
                        need_hidden, need_weight, need_bias):
    from logitless.fused_losses import divergence as dv
    from logitless.fused_losses import logprobs as lp

    rows = dv._rows(mask, ids.numel() // max(ids.shape[-1], 1))
    spec = _div_spec(0.0, temperature, tile_bytes, hidden)
    h = lp.take_rows(hidden, rows, hidden.shape[-1])
    t = dv._topk_ids(ids, rows, weight.shape[0])
    grads = dv._topk_rows_backward(spec, h, weight, bias, t, lp.take_rows(lse, rows),
                                   lp.take_rows(grad, rows, ids.shape[-1]),
                                   (need_hidden, need_weight, need_bias))
    return _grads_or_empty(hidden, weight, rows, *grads)


def _topk_backward_fake(hidden, weight, bias, ids, mask, lse, grad, temperature, tile_bytes,
                        need_hidden, need_weight, need_bias):
    return _grads_fake(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _topk_setup_context(ctx, inputs, output):
    ctx.config = inputs[5:7]
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs[:5], output[1])


def _topk_backward(ctx, grad, _):
    n_inputs = 7
    need = ctx.needs_input_grad[:3]
    if grad is None or not any(need):
        return _none_grads(n_inputs)
    saved = ctx.saved_tensors
    need = (need[0], need[1], need[2] and saved[2] is not None)
    grads = linear_topk_logprobs_backward(*saved, grad, *ctx.config, *need)
    return (*(g if n else None for g, n in zip(grads, need)), *_none_grads(n_inputs - 3))


linear_topk_logprobs_backward = _define(
    "linear_topk_logprobs_backward",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor ids, Tensor? mask, Tensor lse, "
    "Tensor grad, "
    "float temperature, int? tile_bytes, bool need_hidden, bool need_weight, "
    "bool need_bias) -> (Tensor, Tensor, Tensor)",
    _topk_backward_impl, _topk_backward_fake)
linear_topk_logprobs = _define(
    "linear_topk_logprobs",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor ids, Tensor? mask, "
    "float temperature, int? tile_bytes) -> (Tensor, Tensor)",
    _topk_forward, _topk_forward_fake)
linear_topk_logprobs.register_autograd(_topk_backward, setup_context=_topk_setup_context)


# --- clip_cov / kl_cov token selections ------------------------------------------------------
#
# verl's clip_cov and kl_cov pick a number of tokens counted on the host (a fraction of the
# valid ones), clip_cov at random: data-dependent sizes that dynamo cannot trace. Each choice
# is one op whose output, a bool mask shaped like its input, carries no gradient; eager calls
# go through the same op, so the draws (torch's global generator unless a seed is given) are
# the same compiled or not.

def _cov_drop(candidates, valid, fraction, seed):
    """clip_cov's dropped tokens: ``max(int(fraction * #valid), 1)`` of the candidates (all of
    them when fewer), a random permutation of their flat positions deciding which."""
    flat = torch.nonzero(candidates.flatten()).flatten()
    num = max(int(fraction * int(valid.sum())), 1)
    dropped = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    if flat.numel():
        gen = None if seed is None else torch.Generator(device=flat.device).manual_seed(seed)
        perm = torch.randperm(flat.numel(), generator=gen, device=flat.device)
        dropped[flat[perm[:num]]] = True
    return dropped.view_as(candidates)


def _cov_top(cov, valid, fraction):
    """kl_cov's penalised tokens: the ``max(1, int(#valid * fraction))`` valid tokens of
    largest ``cov`` (none when no token is valid)."""
    chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    n = int(valid.sum())
    if n:
        flat_valid = torch.nonzero(valid.flatten()).flatten()
        top = torch.topk(cov.flatten()[flat_valid], max(1, int(n * fraction))).indices
        chosen[flat_valid[top]] = True
    return chosen.view_as(valid)


def _mask_fake(x, valid, *_):
    return torch.empty_like(valid, dtype=torch.bool)


cov_drop_mask = _define("cov_drop_mask",
                        "(Tensor candidates, Tensor valid, float fraction, int? seed) -> Tensor",
                        _cov_drop, _mask_fake)
cov_top_mask = _define("cov_top_mask", "(Tensor cov, Tensor valid, float fraction) -> Tensor",
                       _cov_top, _mask_fake)


# --- fused_policy_loss ----------------------------------------------------------------------
#
# The config crosses the boundary as four lists (a schema holds at most 64 arguments, the
# config alone has over 60 fields), each in `PolicyLossConfig`'s field order: the numbers
# (``Scalar?[]``: ints stay ints, None stays None), the strings (``str?[]``), the flags
# (``bool[]``) and the tensors (``Tensor?[]``). A field enters each list whose kind of value it
# admits, so ``eps_low: float | Tensor | None`` has a slot among the numbers and one among the
# tensors, at most one of them set. The op rebuilds the config from them.

_CFG_LISTS = {float: 0, int: 0, str: 1, bool: 2, torch.Tensor: 3}  # kind -> list


def _config_layout() -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``(field, lists)`` for each init field of `PolicyLossConfig`, in order: the lists
    (`_CFG_LISTS`) holding a slot for it, one per kind of value it admits."""
    import dataclasses
    import typing

    from logitless.fused_losses.config import PolicyLossConfig

    layout = []
    for f in dataclasses.fields(PolicyLossConfig):
        if not f.init:
            continue
        kinds = [k for k in (typing.get_args(f.type) or (f.type,)) if k is not type(None)]
        if any(k not in _CFG_LISTS for k in kinds) or (bool in kinds and len(kinds) > 1):
            raise TypeError(f"PolicyLossConfig.{f.name}: no op argument for {f.type}")
        layout.append((f.name, tuple(dict.fromkeys(_CFG_LISTS[k] for k in kinds))))
    return tuple(layout)


_CONFIG_LAYOUT = _config_layout()


def config_args(config) -> tuple[list, list, list, list]:
    """The config's fields as the op's four list arguments (`_CONFIG_LAYOUT`). Reads each
    field once and nothing of a tensor's values: dynamo guards on the fields as it would on
    any traced use of the config."""
    lists = ([], [], [], [])
    for name, kinds in _CONFIG_LAYOUT:
        value = getattr(config, name)
        for kind in kinds:
            if kind == 2 or value is None:  # a flag; or no value
                fits = True
            elif kind == 3:
                fits = isinstance(value, torch.Tensor)
            elif kind == 1:
                fits = isinstance(value, str)
            else:  # a number: neither a tensor nor a string
                fits = not isinstance(value, torch.Tensor | str)
            lists[kind].append(value if fits else None)
    return lists


def config_from_args(numbers, strings, flags, tensors) -> object:
    """The `PolicyLossConfig` back from `config_args`'s lists (checked again on the way)."""
    from logitless.fused_losses.config import PolicyLossConfig

    its = [iter(x) for x in (numbers, strings, flags, tensors)]
    fields = {}
    for name, kinds in _CONFIG_LAYOUT:
        given = [next(its[k]) for k in kinds]
        fields[name] = next((v for v in given if v is not None), None)
    return PolicyLossConfig(**fields)


# The op's arguments: tensors (the call's, then the global counts given as tensors), then
# the call's scalars, then the config's four lists.
_FPL_TENSORS = ("hidden", "weight", "bias", "targets", "old_logprobs", "advantages", "mask",
                "ref_logprobs", "rollout_logprobs", "token_weights", "attention_entropy",
                "cu_seqlens", "selection_entropy", "ref_hidden", "ref_weight", "ref_bias",
                "num_items_in_batch_tensor", "global_batch_size_tensor")
_FPL_REQUIRED = ("hidden", "weight", "targets", "old_logprobs", "advantages", "mask")
_FPL_SCALARS = ("float temperature, float? softcap, float logit_scale, "
                "Scalar? num_items_in_batch, Scalar? global_batch_size, "
                "float? training_progress, float? entropy_coef, int? memory_budget, "
                "str strategy, ScalarType dtype, bool need_hidden, bool need_weight, "
                "bool need_bias, str[] metric_names")
_FPL_CONFIG = ("Scalar?[] config_numbers, str?[] config_strings, bool[] config_flags, "
               "Tensor?[] config_tensors")
_N_FPL_INPUTS = len(_FPL_TENSORS) + _FPL_SCALARS.count(",") + 1 + 4
_FPL_OPTIONS = len(_FPL_TENSORS) + 9  # dtype, need_hidden, need_weight, need_bias, names


def _fpl_forward(*args):
    from logitless.fused_losses import fused_policy_loss as fpl

    return fpl.op_forward(*args[:-4], config_from_args(*args[-4:]))


def _fpl_forward_fake(*args):
    hidden, weight, bias = args[:3]
    dtype, need_hidden, need_weight, need_bias, names = args[_FPL_OPTIONS:_FPL_OPTIONS + 5]
    acc = acc_dtype(dtype)
    # the gradients contiguous whatever the inputs' strides (the implementation makes them so)
    return (hidden.new_empty((), dtype=acc), hidden.new_empty((len(names),), dtype=acc),
            hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            bias.new_empty(bias.shape) if need_bias else weight.new_empty(0))


def _fpl_setup_context(ctx, inputs, output):
    ctx.need = inputs[_FPL_OPTIONS + 1:_FPL_OPTIONS + 4]
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[2:])


def _fpl_backward(ctx, g_loss, *_):
    """The gradients were computed in the forward: scaled by the loss's incoming gradient.
    Plain multiplications (no op of their own): inductor fuses them into one kernel that
    writes into the stored gradients' buffers (saved tensors the backward donates), so the
    compiled backward allocates no second [V, D] weight gradient."""
    if g_loss is None:
        return _none_grads(_N_FPL_INPUTS)
    need = (a and b for a, b in zip(ctx.need, ctx.needs_input_grad[:3]))
    grads = tuple(d * g_loss.to(d.dtype) if n else None
                  for d, n in zip(ctx.saved_tensors, need))
    return (*grads, *_none_grads(_N_FPL_INPUTS - 3))


fused_policy_loss = _define(
    "fused_policy_loss",
    "(" + ", ".join(f"Tensor{'' if t in _FPL_REQUIRED else '?'} {t}" for t in _FPL_TENSORS)
    + ", " + _FPL_SCALARS + ", " + _FPL_CONFIG
    + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fpl_forward, _fpl_forward_fake)
fused_policy_loss.register_autograd(_fpl_backward, setup_context=_fpl_setup_context)
