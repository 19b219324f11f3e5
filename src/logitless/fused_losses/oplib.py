"""What every op module shares: the leaf under the head ops, the objective library and the
fused loss. It imports nothing of logitless but the kernels' dtype rule, so any module may
import it and no circle can run through it.

Each public op is a ``torch.library`` custom op defined beside its implementation (its
module declares it with :class:`Op` at import: its arguments written once, by name), so
``torch.compile`` and ``torch.export`` see it as one graph node:

- the Python function (``linear_logprobs``, ...) checks its arguments *statically*: types,
  shapes, dtypes and scalar ranges, nothing that reads a tensor's values, so dynamo traces it
  without a graph break;
- it then calls one op ``torch.ops.logitless.<name>`` whose implementation does everything
  that depends on values: validation of token ids (it may raise ``ValueError`` from inside the
  op), compaction of ignored rows, chunk plans, the choice of backend;
- the op's fake implementation (``register_fake``, which also serves meta tensors) gives the
  shape and dtype of every output from the inputs' shapes alone;
- its autograd registration saves what the backward needs, and the backward is itself a
  custom op with a fake implementation, so compiled backward graphs capture it as one node.

Configuration crosses the op boundary as ``int``/``float``/``bool``/``ScalarType`` arguments;
a dataclass with more fields than a schema holds crosses as four lists (:func:`config_layout`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import math
import numbers
import types
import typing
import warnings
from dataclasses import dataclass

import torch

from logitless.kernels.linear_softmax_torch import acc_dtype

__all__ = ["FLOAT_DTYPES", "HEAD_DTYPES", "OPS", "Arg", "DivergenceOutput", "LogprobOutput", "Op",
           "Record", "check_devices", "check_head", "check_head_dtype", "check_temperature",
           "compact_rows", "compute_dtype", "config_args", "config_from_args", "config_layout",
           "declare", "define", "distinct", "grads_fake", "grads_or_empty", "head_precision",
           "is_compiling", "mask_rows", "precision_gather", "put_rows",
           "renamed_keyword", "take_rows", "under_head_precision"]


def is_compiling() -> bool:
    """True while dynamo traces (``torch.compile``, ``torch.export``): code that would read a
    tensor's value on the host (a check, a count turned into a float) takes its traceable
    form then."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    return False


OPS: list[str] = []  # qualified names of the ops defined so far (``torch.library.opcheck``)


def define(name: str, schema: str, impl, fake):
    """Register ``logitless::<name>`` with its implementation and fake implementation."""
    op = torch.library.custom_op(f"logitless::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    OPS.append(f"logitless::{name}")
    return op


# --- an op from one declaration of its arguments ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument of an op: its schema type, name and default (schema text, "" when
    required)."""

    type: str
    name: str
    default: str = ""

    @property
    def tensor(self) -> bool:
        return self.type in ("Tensor", "Tensor?")

    def __str__(self) -> str:
        return f"{self.type} {self.name}" + (f"={self.default}" if self.default else "")


def declare(*entries: str | Arg | tuple[Arg, ...]) -> tuple[Arg, ...]:
    """An op's arguments from entries written as in a schema, one each (``"Tensor? bias"``,
    ``'str hidden_grad="sum"'``), or `Arg` tuples (a `Record`'s)."""
    args = []
    for e in entries:
        if isinstance(e, str):
            kind, decl = e.split(" ", 1)
            name, _, default = decl.partition("=")
            args.append(Arg(kind, name, default))
        else:
            args.extend([e] if isinstance(e, Arg) else e)
    return tuple(args)


def _bind(args, values) -> types.SimpleNamespace:
    """Arguments by name: ``values`` in order, then the defaults of those not given (an op
    passes its implementation the arguments its caller gave)."""
    named = {a.name: ast.literal_eval(a.default) for a in args[len(values):]}
    return types.SimpleNamespace(**dict(zip((a.name for a in args), values)), **named)


def _schema(args, n_out: int) -> str:
    outs = "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"
    return "(" + ", ".join(map(str, args)) + ") -> " + outs


class Op:
    """``logitless::<name>`` defined from one declaration of its arguments (`declare`): its
    implementation and fake implementation take them by name, as one namespace ``a``
    (``a.hidden``, ``a.temperature``), and return the outputs named in ``outputs``.

    With ``wrt`` (the inputs that get gradients, in practice ``("hidden", "weight",
    "bias")``), the op is differentiable through the outputs named in ``grads``. Its
    autograd registration saves every input by name and the outputs named in ``saved``;
    the backward passes when no gradient comes in or none is needed, and returns None for
    every other input. Then either

    - ``backward`` (with ``backward_fake``, default `grads_fake`) is the implementation of
      the op ``logitless::<name>_backward``, whose arguments are, in this order, the
      forward's tensors, the saved outputs, each incoming gradient ``g_<output>``, the
      forward's other arguments without a default (less ``forward_only``), ``need_<input>``
      for each of ``wrt`` (given to the implementations as the tuple ``a.need``), and the
      forward's arguments with a default; it returns one tensor per ``wrt``, empty where not
      needed (`grads_or_empty`);
    - or ``autograd(a)`` is a plain function of the saved outputs, the forward's arguments
      other than tensors (which are not saved then), the incoming gradients and ``a.need``
      (no op of its own), returning None where not needed.

    So an argument added to the declaration reaches both implementations and the backward
    by its name, and nothing counts positions. An op declaring ``head_dtype`` (the head's
    GEMM precision) runs its implementation and its backward under `head_precision`."""

    def __init__(self, name: str, args, outputs, impl, fake, *, wrt=(), grads=(), saved=(),
                 backward=None, backward_fake=None, forward_only=(), autograd=None,
                 non_differentiable=()):
        self.name, self.args, self.outputs = name, declare(*args), tuple(outputs)
        self.names = tuple(a.name for a in self.args)
        self.wrt, self.grads, self.saved = tuple(wrt), tuple(grads), tuple(saved)
        self.save_inputs, self.autograd = autograd is None, autograd
        self.non_differentiable = tuple(non_differentiable)
        if "head_dtype" in self.names:
            impl, backward, self.autograd = (under_head_precision(f)
                                             for f in (impl, backward, autograd))
        self.impl = impl
        self.op = define(name, _schema(self.args, len(self.outputs)),
                         lambda *xs: impl(self.bind(xs)), lambda *xs: fake(self.bind(xs)))
        if backward is not None:
            required = [a for a in self.args if not a.tensor and not a.default
                        and a.name not in forward_only]
            self.backward_args = declare(
                tuple(a for a in self.args if a.tensor),
                *(f"Tensor? {x}" for x in self.saved), *(f"Tensor? g_{x}" for x in self.grads),
                tuple(required), *(f"bool need_{x}" for x in self.wrt),
                tuple(a for a in self.args if a.default))
            fake_b = backward_fake or grads_fake
            self.backward_op = define(
                f"{name}_backward", _schema(self.backward_args, len(self.wrt)),
                lambda *xs: backward(self._bind_backward(xs)),
                lambda *xs: fake_b(self._bind_backward(xs)))
        if self.wrt:
            self.op.register_autograd(self.backward, setup_context=self.setup_context)

    def __call__(self, *args, **kwargs):
        """The op on its arguments, positional or by name."""
        return getattr(torch.ops.logitless, self.name)(*args, **kwargs)

    def bind(self, values) -> types.SimpleNamespace:
        """The op's positional arguments by name (the defaults of those not given)."""
        return _bind(self.args, values)

    def run(self, *values):
        """The implementation on the op's positional arguments, eagerly (no op)."""
        return self.impl(self.bind(values))

    def _bind_backward(self, values) -> types.SimpleNamespace:
        a = _bind(self.backward_args, values)
        a.need = tuple(getattr(a, f"need_{x}") for x in self.wrt)
        return a

    def setup_context(self, ctx, inputs, output) -> None:
        """Saves the inputs (tensors with ``save_for_backward``) and the outputs of ``saved``
        by name, whether each of ``wrt`` is given, and which inputs need a gradient."""
        named = vars(self.bind(inputs))
        ctx.set_materialize_grads(False)
        if self.non_differentiable:
            ctx.mark_non_differentiable(*(output[self.outputs.index(x)]
                                          for x in self.non_differentiable))
        tensors = [a.name for a in self.args if a.tensor] if self.save_inputs else []
        ctx.saved_names = (*tensors, *self.saved)
        ctx.save_for_backward(*(named[x] for x in tensors),
                              *(output[self.outputs.index(x)] for x in self.saved))
        ctx.others = {a.name: named[a.name] for a in self.args if "Tensor" not in a.type}
        ctx.given = tuple(named[x] is not None for x in self.wrt)

    def backward(self, ctx, *grads):
        """The inputs' gradients (None for every input not in ``wrt`` or not needed)."""
        where = [self.names.index(x) for x in self.wrt]
        need = tuple(bool(ctx.needs_input_grad[i]) and given
                     for i, given in zip(where, ctx.given))
        incoming = {f"g_{x}": grads[self.outputs.index(x)] for x in self.grads}
        result = [None] * len(self.names)
        if not any(need) or all(g is None for g in incoming.values()):
            return tuple(result)
        a = types.SimpleNamespace(**ctx.others, **dict(zip(ctx.saved_names, ctx.saved_tensors)),
                                  **incoming, need=need)
        if self.autograd is not None:
            got = self.autograd(a)
        else:
            flags = {f"need_{x}": n for x, n in zip(self.wrt, need)}
            got = self.backward_op(*(flags[x.name] if x.name in flags else getattr(a, x.name)
                                     for x in self.backward_args))
        for i, g, n in zip(where, got, need):
            result[i] = g if n else None
        return tuple(result)


def under_head_precision(f):
    """``f(a, ...)`` run under `head_precision` of ``a.head_dtype`` (an op's arguments, a
    `fused_policy_loss` request); None stays None."""
    if f is None:
        return None

    @functools.wraps(f)
    def run(a, *args, **kwargs):
        with head_precision(a.head_dtype):
            return f(a, *args, **kwargs)

    return run


# --- a dataclass as an op's arguments -----------------------------------------------------

_SCHEMA_TYPES = {torch.Tensor: "Tensor", float: "float", int: "int", str: "str", bool: "bool",
                 torch.dtype: "ScalarType"}


class Record:
    """The init fields of a dataclass ``cls`` as flat op arguments: every field's tensor slot
    first, in field order, then its other slots, so a tensor-or-number field (``Tensor |
    float | None``) crosses as ``Tensor? <name>_tensor`` and ``Scalar? <name>``, at most one
    of them set. A ``NamedTuple`` of flags crosses as ``bool <name>_<flag>`` each, a
    ``tuple[str, ...]`` as ``str[]``, a nested dataclass as four lists (`config_layout`)."""

    def __init__(self, cls):
        self.cls, hints = cls, typing.get_type_hints(cls)
        tensors, others, self.slots = [], [], []  # slots: (field, how) in argument order
        for f in dataclasses.fields(cls):
            if not f.init or f.metadata.get("op") is False:  # not an op argument
                continue
            hint = hints[f.name]
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            kinds = [k for k in (typing.get_args(hint) if union else (hint,))
                     if k is not type(None)]
            kind = kinds[0]
            opt = "?" if union and len(kinds) < len(typing.get_args(hint)) else ""
            if torch.Tensor in kinds:
                rest = [k for k in kinds if k is not torch.Tensor]
                suffix = "_tensor" if rest else ""
                tensors.append((Arg(f"Tensor{'?' if rest else opt}", f.name + suffix),
                                (f.name, "tensor")))
                if rest:
                    others.append((Arg("Scalar?", f.name), (f.name, "number")))
            elif dataclasses.is_dataclass(kind):
                layout = config_layout(kind)
                names = [f"{f.name}_{x}" for x in ("numbers", "strings", "flags", "tensors")]
                others.extend((Arg(t, n), (f.name, ("config", kind, layout, i)))
                              for i, (t, n) in enumerate(zip(CONFIG_TYPES, names)))
            elif isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "_fields"):
                others.extend((Arg("bool", f"{f.name}_{x}"), (f.name, ("flag", kind, i)))
                              for i, x in enumerate(kind._fields))
            elif typing.get_origin(kind) is tuple:
                others.append((Arg("str[]", f.name), (f.name, "list")))
            elif len(kinds) == 1 and kind in _SCHEMA_TYPES:
                others.append((Arg(_SCHEMA_TYPES[kind] + opt, f.name), (f.name, "value")))
            else:
                raise TypeError(f"{cls.__name__}.{f.name}: no op argument for {f.type}")
        self.args = tuple(a for a, _ in tensors + others)
        self.slots = [s for _, s in tensors + others]

    def values(self, record) -> list:
        """The record's fields as the op's arguments, in order (reads nothing of a tensor's
        values)."""
        out, configs = [], {}
        for name, how in self.slots:
            value = getattr(record, name)
            if how == "tensor":
                out.append(value if isinstance(value, torch.Tensor) else None)
            elif how == "number":
                out.append(None if isinstance(value, torch.Tensor) else value)
            elif how == "list":
                out.append(list(value))
            elif how == "value":
                out.append(value)
            elif how[0] == "flag":
                out.append(value is not None and bool(value[how[2]]))
            else:  # one of a config's four lists
                if name not in configs:
                    configs[name] = config_args(value, how[2])
                out.append(configs[name][how[3]])
        return out

    def field(self, a: types.SimpleNamespace, name: str):
        """One field back from the op's arguments by name (`Op`'s ``a``)."""
        got = [(how, getattr(a, arg.name)) for arg, (f, how) in zip(self.args, self.slots)
               if f == name]
        how = got[0][0]
        if how in ("tensor", "number"):
            return next((v for _, v in got if v is not None), None)
        if how == "list":
            return tuple(got[0][1])
        if how == "value":
            return got[0][1]
        values = [v for _, v in got]
        return how[1](*values) if how[0] == "flag" else config_from_args(how[1], how[2], *values)

    def record(self, a: types.SimpleNamespace):
        """The record back from the op's arguments by name (`Op`'s ``a``)."""
        return self.cls(**{name: self.field(a, name) for name in dict.fromkeys(
            f for f, _ in self.slots)})


def distinct(outs) -> tuple[torch.Tensor, ...]:
    """An op's outputs, each in its own storage (an op's outputs may not alias one another:
    a kernel may return one tensor for two results, e.g. the divergence as its own ``aux``)."""
    seen, result = set(), []
    for x in outs:
        ptr = x.untyped_storage().data_ptr() if x.numel() else None
        result.append(x.clone() if ptr in seen else x)
        seen.add(ptr)
    return tuple(result)


def grads_or_empty(hidden, weight, rows, d_hidden, d_weight, d_bias):
    """A backward op's three outputs: the hidden gradient scattered back to ``hidden``'s shape,
    and an empty tensor for each gradient not computed (an op returns no None)."""
    return (hidden.new_empty(0) if d_hidden is None else put_rows(d_hidden, rows, hidden.shape),
            weight.new_empty(0) if d_weight is None else d_weight,
            weight.new_empty(0) if d_bias is None else d_bias)


def grads_fake(a) -> tuple[torch.Tensor, ...]:
    """The fake implementation of a backward op's three outputs (`grads_or_empty`): ``a`` the
    backward's arguments (`Op`), ``a.need`` the flags of hidden, weight and bias."""
    return tuple(torch.empty_like(x) if n else (a.hidden if x is a.hidden else a.weight)
                 .new_empty(0) for x, n in zip((a.hidden, a.weight, a.bias), a.need))


# --- rows: the positions an op computes --------------------------------------------------


def compact_rows(targets: torch.Tensor, ignore_index: int, v_total: int):
    """``(flat targets as int64, rows)``: the positions whose target is not ``ignore_index``
    (None when every one is kept). Reads values: a target outside ``[0, v_total)`` that is not
    ``ignore_index`` raises ``ValueError``."""
    flat_t = targets.reshape(-1).long()
    valid = flat_t != ignore_index
    bad = valid & ((flat_t < 0) | (flat_t >= v_total))
    if bool(bad.any()):
        raise ValueError(
            f"targets must lie in [0, {v_total}) or equal ignore_index={ignore_index}; found "
            f"{flat_t[bad][:5].tolist()}"
        )
    return flat_t, None if bool(valid.all()) else torch.nonzero(valid).squeeze(1)


def mask_rows(mask: torch.Tensor | None):
    """The rows a ``mask`` of the token shape keeps (True or 1), as :func:`compact_rows` gives
    them (None when every one is kept, or no mask). Reads values: a mask that is not bool must
    hold 0 and 1 only (``ValueError``: 0.5, 2 or NaN would otherwise read as kept)."""
    if mask is None:
        return None
    flat = mask.reshape(-1)
    if flat.dtype != torch.bool:
        bad = (flat != 0) & (flat != 1)
        if bool(bad.any()):
            raise ValueError(f"mask must be bool or hold 0 and 1 only (1: kept), got "
                             f"{flat[bad][0].item()!r}")
        flat = flat != 0
    return None if bool(flat.all()) else torch.nonzero(flat).squeeze(1)


def take_rows(x: torch.Tensor | None, rows: torch.Tensor | None, width: int | None = None):
    """``x`` flattened to ``[N]`` (``[N, width]``), restricted to ``rows`` when given."""
    if x is None:
        return None
    x = x.reshape(-1) if width is None else x.reshape(-1, width)
    return x.contiguous() if rows is None else x.index_select(0, rows)


def put_rows(x: torch.Tensor, rows: torch.Tensor | None, shape) -> torch.Tensor:
    """Inverse of :func:`take_rows`: ``x`` scattered back to ``shape``, 0 at dropped rows."""
    if rows is not None:
        lead = math.prod(shape) // math.prod(x.shape[1:])
        x = x.new_zeros((lead, *x.shape[1:])).index_copy_(0, rows, x)
    return x.reshape(shape)


# --- a dataclass across the op boundary ---------------------------------------------------
#
# A schema holds at most 64 arguments, so a config with more fields crosses as four lists,
# each in the dataclass's field order: the numbers (``Scalar?[]``: ints stay ints, None stays
# None), the strings (``str?[]``), the flags (``bool[]``) and the tensors (``Tensor?[]``). A
# field enters each list whose kind of value it admits, so ``eps_low: float | Tensor | None``
# has a slot among the numbers and one among the tensors, at most one of them set.

CONFIG_TYPES = ("Scalar?[]", "str?[]", "bool[]", "Tensor?[]")  # the four lists' types
_KIND_LIST = {float: 0, int: 0, str: 1, bool: 2, torch.Tensor: 3}  # kind of value -> list


def config_layout(cls) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``(field, lists)`` for each init field of the dataclass ``cls``, in order: the lists
    holding a slot for it, one per kind of value it admits."""
    hints = typing.get_type_hints(cls)
    layout = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kinds = [k for k in (typing.get_args(hints[f.name]) or (hints[f.name],))
                 if k is not type(None)]
        if any(k not in _KIND_LIST for k in kinds) or (bool in kinds and len(kinds) > 1):
            raise TypeError(f"{cls.__name__}.{f.name}: no op argument for {f.type}")
        layout.append((f.name, tuple(dict.fromkeys(_KIND_LIST[k] for k in kinds))))
    return tuple(layout)


def config_args(config, layout) -> tuple[list, list, list, list]:
    """The config's fields as four list arguments (`config_layout`). Reads each field once and
    nothing of a tensor's values: dynamo guards on the fields as it would on any traced use of
    the config."""
    lists = ([], [], [], [])
    for name, kinds in layout:
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


def config_from_args(cls, layout, numbers, strings, flags, tensors):
    """The dataclass back from `config_args`'s lists (its ``__post_init__`` checks it again)."""
    its = [iter(x) for x in (numbers, strings, flags, tensors)]
    fields = {}
    for name, kinds in layout:
        given = [next(its[k]) for k in kinds]
        fields[name] = next((v for v in given if v is not None), None)
    return cls(**fields)


def check_positive_number(name: str, value) -> None:
    """``value`` must be a real number, finite and > 0 (None is the caller's business): an
    infinite scale or softcap would make every row one-hot or the cap vanish, silently."""
    if not (is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")


def check_temperature(temperature, dtype: torch.dtype) -> None:
    """The temperature of a head computing in ``dtype``, a number or a tensor of per-token
    values (read here, as given: before any cast), must lie in ``[tiny, max]`` of the
    accumulation dtype (fp32 for bf16/fp16/fp32, fp64 for fp64), the normal numbers there: it
    then stays finite, > 0 and no denormal in the kernels, and ``1 / T`` is finite, so ``T``
    alone turns no logit inf or NaN. Every path of the head (plain, sampler-matched,
    ``kept_ids``) and of the divergences takes the same values (``ValueError`` stating the
    range)."""
    acc = acc_dtype(dtype)
    info = torch.finfo(acc)
    low, high = float(info.tiny), float(info.max)
    if isinstance(temperature, torch.Tensor):
        # compared in a dtype holding both bounds (fp16 rounds them to 0 and inf)
        t = temperature.to(torch.promote_types(temperature.dtype, acc))
        bad = ~((t >= low) & (t <= high))  # NaN fails both
        if not bool(bad.any()):
            return
        got, where = temperature[bad].reshape(-1)[0].item(), " at every token"
    elif is_number(temperature) and low <= float(temperature) <= high:  # numpy's too
        return
    else:
        got, where = temperature, ""
    raise ValueError(f"temperature must be a number in [{low!r}, {high!r}] (the normal numbers "
                     f"of {acc}, the accumulation dtype){where}, got {got!r}")


def precision_gather(gather_weight, head_dtype: str | None):
    """A ``gather_weight`` callable (the ZeRO-3 hook an eager backward enters) whose context
    also sets `head_precision`: an eager autograd function's backward then runs its GEMMs in
    the head's precision. ``gather_weight`` itself (None too) unless ``head_dtype`` is
    ``"tf32"``."""
    if head_dtype != "tf32":
        return gather_weight

    def entered():
        stack = contextlib.ExitStack()
        stack.enter_context(head_precision(head_dtype))
        if gather_weight is not None:
            stack.enter_context(gather_weight())
        return stack

    return entered


# --- the head's arguments: the checks every head op and the fused loss share --------------

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# The device types torch.autocast knows (torch.amp's list); "meta" and the others have none.
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla",
                               "ipu", "privateuseone"})


HEAD_DTYPES = (None, "float32", "tf32")  # the values of every head op's ``head_dtype``


def check_head_dtype(head_dtype) -> None:
    """``head_dtype`` must be one of `HEAD_DTYPES` (``ValueError`` naming them)."""
    if not (head_dtype is None or (isinstance(head_dtype, str) and head_dtype in HEAD_DTYPES)):
        raise ValueError(f"head_dtype must be None, 'float32' or 'tf32', got {head_dtype!r}")


def compute_dtype(hidden: torch.Tensor, head_dtype: str | None = None) -> torch.dtype:
    """The dtype the head's GEMMs run in (TRL's rule): autocast's under ``torch.autocast``
    (trainers call the head there with fp32 master weights), else hidden's, whatever the
    weight's and bias's dtypes (they are cast to it). With ``head_dtype`` ``"float32"`` or
    ``"tf32"`` (TRL's ``cast_lm_head_to_fp32``, NeMo-RL's ``fp32_lm_head``) at least fp32:
    the 16-bit operands are upcast, fp64 stays fp64."""
    dev = hidden.device.type
    # A fixed set, not torch.amp.is_autocast_available: dynamo on torch 2.11 refuses to trace
    # the C call behind it, which broke fullgraph=True for every op on the H200's torch.
    if dev in _AUTOCAST_DEVICES and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
    else:
        dtype = hidden.dtype
    return dtype if head_dtype is None else torch.promote_types(dtype, torch.float32)


@contextlib.contextmanager
def head_precision(head_dtype: str | None):
    """The fp32 GEMMs' precision for ``head_dtype``: with ``"tf32"``, torch's fp32 matmul
    precision ``"high"`` (TF32 tensor cores on CUDA; CPUs have no TF32 and compute fp32),
    restored on the way out; otherwise unchanged."""
    if head_dtype != "tf32":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def check_head(hidden, weight, bias, prefix: str = "", lead=None) -> None:
    """Shapes and dtypes of one head's ``hidden [..., D]``, ``weight [V, D]`` and ``bias [V]``
    (``ValueError`` naming the argument, ``prefix`` before each name: ``"teacher_"``);
    ``lead``: the token shape ``hidden`` must have. Any mix of float dtypes: the head is cast
    to the compute dtype (:func:`compute_dtype`)."""
    h, w, b = f"{prefix}hidden", f"{prefix}weight", f"{prefix}bias"
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise ValueError(f"{h} must be a tensor [..., D]")
    if hidden.shape[-1] == 0:
        raise ValueError(f"{h} must have a hidden size D >= 1, got shape {tuple(hidden.shape)}")
    if lead is not None and tuple(hidden.shape[:-1]) != tuple(lead):
        raise ValueError(f"{h} must have hidden's token shape {tuple(lead)} before its "
                         f"hidden size, got {tuple(hidden.shape)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 \
            or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{w} must be a 2-D tensor [V, {hidden.shape[-1]}] matching {h}'s "
                         f"last dimension, got shape {tuple(getattr(weight, 'shape', ()))}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1
                             or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"{b} must be [V] = [{weight.shape[0]}], got shape "
                         f"{tuple(getattr(bias, 'shape', ()))}")
    for name, t in ((h, hidden), (w, weight), (b, bias)):
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be floating point (fp32/bf16/fp16/fp64), got {t.dtype}")


def check_devices(hidden: torch.Tensor, tensors) -> None:
    """Every tensor of ``tensors`` (``(name, tensor or None)`` pairs) on hidden's device."""
    for name, t in tensors:
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")


def is_number(x) -> bool:
    """A real number (numpy scalars included), not a bool or a string such as ``"30"``."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


# --- what the public ops return, and their renamed keywords (docs/api-changes.md) -----------
# Here, in the leaf, so that `logitless.reference` returns the same objects as the ops.


@dataclass
class LogprobOutput:
    """Per-token results of :func:`linear_logprobs`, each fp32 (fp64 for fp64 inputs; bool for
    ``is_top1``) and shaped like ``targets``; 0 (False) where the target is ``ignore_index``.
    Statistics not requested are None. ``id_logprobs`` (with ``ids``) is ``[*targets.shape,
    K]``: the full-vocabulary logprobs at the given ids."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_p_sq: torch.Tensor | None = None
    mean_logit: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    log_kept_mass: torch.Tensor | None = None
    id_logprobs: torch.Tensor | None = None


def _tensor_use_deprecated():
    warnings.warn("linear_divergence returns a DivergenceOutput: read .divergence (and "
                  ".entropy with return_entropy=True) instead of using the result as the tensor "
                  "or the (divergence, entropy) tuple it was before; that use goes in the next "
                  "release (docs/api-changes.md)", DeprecationWarning, stacklevel=3)


@dataclass
class DivergenceOutput:
    """Per-token results of :func:`linear_divergence`, fp32 (fp64 for fp64 inputs) of the token
    shape, 0 at rows ``mask`` drops: ``divergence`` (with gradient) and the student's
    ``entropy`` (no gradient; None unless ``return_entropy``).

    Deprecated for one release, the uses of the old return value (the divergence tensor, or
    ``(divergence, entropy)`` with ``return_entropy``) still work with a
    ``DeprecationWarning``: unpacking, tensor methods and attributes, arithmetic and torch
    functions act on ``divergence``."""

    divergence: torch.Tensor
    entropy: torch.Tensor | None = None

    def __iter__(self):
        _tensor_use_deprecated()
        return iter(self.divergence if self.entropy is None else (self.divergence, self.entropy))

    def __getattr__(self, name):  # only names the dataclass lacks: the old tensor's
        if name.startswith("_") or name in ("divergence", "entropy"):
            raise AttributeError(name)
        _tensor_use_deprecated()
        return getattr(self.divergence, name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _tensor_use_deprecated()
        args, kwargs = torch.utils._pytree.tree_map(
            lambda x: x.divergence if isinstance(x, cls) else x, (args, kwargs or {}))
        return func(*args, **kwargs)


def _forward_to_divergence(op: str):
    def method(self, *args):
        _tensor_use_deprecated()
        return getattr(self.divergence, op)(*args)

    method.__name__ = op
    return method


for _op in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
            "__rtruediv__", "__pow__", "__neg__", "__getitem__", "__len__"):
    setattr(DivergenceOutput, _op, _forward_to_divergence(_op))


def renamed_keyword(old: str, old_value, new: str, new_value, new_default=None):
    """The value of keyword ``new`` when the caller may still pass its deprecated name ``old``
    (None: not given; given, a ``DeprecationWarning``). Both given, ``new`` not left at its
    default ``new_default``: ``ValueError``."""
    if old_value is None:
        return new_value
    if new_value is not new_default and new_value != new_default:
        raise ValueError(f"{old} is the deprecated name of {new}: pass {new} only")
    warnings.warn(f"{old} is deprecated, renamed {new}; the old name goes in the next release "
                  f"(docs/api-changes.md)", DeprecationWarning, stacklevel=3)
    return old_value
