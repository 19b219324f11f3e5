"""The cases `logitless check` runs: each public op's calls on fp64 inputs (`Case`), with the
plain-PyTorch reference beside it, at the sizes of a `Shape`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch

import logitless
from logitless import PolicyLossConfig, reference

# Bound on the torch twin's temporary logits: tiles of 64 rows by 1024 vocabulary columns, so
# the default shape (148 rows, V=4099) spans 3 x 5 of them (the Triton kernels' tiles are
# smaller still).
TILE_BYTES = 512 * 2**10


@dataclass(frozen=True)
class Shape:
    """Sizes of the checked problems: ``batch`` sequences of up to ``seq_len`` tokens through a
    ``[vocab, hidden]`` head; attention over ``attn_seq_len`` positions, ``heads`` query and
    ``kv_heads`` key heads of ``head_dim``."""

    batch: int = 4
    seq_len: int = 37
    hidden: int = 96
    vocab: int = 4099
    attn_seq_len: int = 520
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 40

    def __post_init__(self):
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be a positive size, got {getattr(self, f.name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")


@dataclass
class Case:
    """One call of an op: fp64 ``inputs`` (the floating ones are rounded to the dtype under
    test), ``leaves`` differentiated, ``upstream`` gradients of named outputs, and the op and
    the reference as functions of the inputs returning named outputs."""

    op: str
    name: str
    shape: str
    inputs: dict[str, torch.Tensor]
    leaves: tuple[str, ...]
    upstream: dict[str, torch.Tensor]
    ours: Callable[..., dict[str, torch.Tensor]]
    plain: Callable[..., dict[str, torch.Tensor]]
    # The dtypes the case is checked in (None: all).
    dtypes: tuple[str, ...] | None = None


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lengths_mask(shape: Shape, gen: torch.Generator) -> torch.Tensor:
    """``[B, T]`` right-padded mask with lengths in ``[1, T]``, the first sequence full."""
    lengths = torch.randint(1, shape.seq_len + 1, (shape.batch,), generator=gen)
    lengths[0] = shape.seq_len
    return torch.arange(shape.seq_len)[None] < lengths[:, None]


def linear_logprobs_cases(shape: Shape) -> Iterator[Case]:
    """Every statistic, with and without the bias, the logit transform and ignored rows."""
    n, d, v = shape.batch * shape.seq_len, shape.hidden, shape.vocab
    stats = ("sum_p_sq", "mean_logit", "is_top1", "lse")
    for name, transform, bias, ignored in (
        ("plain", {}, False, False),
        ("bias, T=0.9, softcap=8, scale=1.3, ignored rows",
         dict(temperature=0.9, softcap=8.0, logit_scale=1.3), True, True),
    ):
        gen = _gen(n * 1000 + v + len(name))
        inputs = {"hidden": torch.randn(n, d, generator=gen, dtype=torch.float64),
                  "weight": torch.randn(v, d, generator=gen, dtype=torch.float64) * 2 / d**0.5,
                  "targets": torch.randint(0, v, (n,), generator=gen)}
        if bias:
            inputs["bias"] = torch.randn(v, generator=gen, dtype=torch.float64)
        if ignored:
            inputs["targets"][::7] = -100
        upstream = {k: torch.randn(n, generator=gen, dtype=torch.float64)
                    for k in ("logprobs", "entropy", "sum_p_sq", "mean_logit")}

        def ours(hidden, weight, targets, bias=None, transform=transform):
            o = logitless.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                          stats=stats, max_tile_bytes=TILE_BYTES, **transform)
            return {"logprobs": o.logprobs, "entropy": o.entropy, "sum_p_sq": o.sum_p_sq,
                    "mean_logit": o.mean_logit, "is_top1": o.is_top1, "lse": o.lse}

        def plain(hidden, weight, targets, bias=None, transform=transform):
            r = reference.linear_softmax_stats(hidden, weight, targets, bias, **transform)
            return {k: r[k] for k in ("logprobs", "entropy", "sum_p_sq", "mean_logit",
                                      "is_top1", "lse")}

        yield Case("linear_logprobs", name, f"N={n} D={d} V={v}", inputs,
                   tuple(k for k in ("hidden", "weight", "bias") if k in inputs), upstream,
                   ours, plain)


def sampled_logprobs_cases(shape: Shape) -> Iterator[Case]:
    """Sampler-matched logprobs (vLLM's truncations, see ``docs/sampler.md``): each
    truncation, then all of them with a per-token temperature and the bias. Targets are drawn
    near the top so most lie in the kept set; a target outside it (``-inf``) is reported as 0
    by both sides, so a kept set that differs shows as an error. fp32 only: the kept set is
    discontinuous in the logits, and rounding them to bf16/fp16 moves tokens across its
    boundary, a difference no tolerance covers (the tests check bf16 on the rows where the set
    is stable)."""
    n, d, v = shape.batch * shape.seq_len, shape.hidden, shape.vocab
    outs = ("logprobs", "entropy", "log_kept_mass")
    for name, settings, bias in (
        ("top_k=50", dict(top_k=50), False),
        ("top_p=0.9", dict(top_p=0.9), False),
        ("min_p=0.05", dict(min_p=0.05), False),
        ("top_k=200 top_p=0.95 min_p=0.01, per-token T, bias",
         dict(top_k=200, top_p=0.95, min_p=0.01), True),
    ):
        gen = _gen(n * 1000 + v + len(name))
        inputs = {"hidden": torch.randn(n, d, generator=gen, dtype=torch.float64),
                  "weight": torch.randn(v, d, generator=gen, dtype=torch.float64) * 2 / d**0.5}
        if bias:
            inputs["bias"] = torch.randn(v, generator=gen, dtype=torch.float64)
            inputs["temperature"] = 0.6 + torch.rand(n, generator=gen, dtype=torch.float64)
        logits = inputs["hidden"] @ inputs["weight"].t()
        top = logits.topk(8, dim=-1).indices
        inputs["targets"] = top.gather(1, torch.randint(0, 8, (n, 1), generator=gen)).squeeze(1)
        upstream = {k: torch.randn(n, generator=gen, dtype=torch.float64) for k in outs}

        def finite(x):
            return torch.where(torch.isfinite(x), x, 0.0)

        def ours(hidden, weight, targets, bias=None, temperature=1.0, settings=settings):
            o = logitless.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                          stats=("log_kept_mass",), temperature=temperature,
                                          max_tile_bytes=TILE_BYTES, **settings)
            return {"logprobs": finite(o.logprobs), "entropy": o.entropy,
                    "log_kept_mass": o.log_kept_mass}

        def plain(hidden, weight, targets, bias=None, temperature=1.0, settings=settings):
            r = reference.sampler_logprobs(hidden, weight, targets, bias,
                                           temperature=temperature, **settings)
            return {"logprobs": finite(r["logprobs"]), "entropy": r["entropy"],
                    "log_kept_mass": r["log_kept_mass"]}

        yield Case("sampled_logprobs", name, f"N={n} D={d} V={v}", inputs,
                   tuple(k for k in ("hidden", "weight", "bias") if k in inputs), upstream,
                   ours, plain, dtypes=("float32",))


def _two_heads(shape: Shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Student and teacher heads over one vocabulary; the teacher's hidden size is 3/4 of the
    student's (at least 1)."""
    n, d, v = shape.batch * shape.seq_len, shape.hidden, shape.vocab
    d_t = max(1, 3 * d // 4)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    return {"hidden": r(n, d), "weight": r(v, d) * 2 / d**0.5, "bias": r(v) * 0.5,
            "teacher_hidden": r(n, d_t), "teacher_weight": r(v, d_t) * 2 / d_t**0.5,
            "teacher_bias": r(v) * 0.5}


def linear_divergence_cases(shape: Shape) -> Iterator[Case]:
    """Forward KL, the generalized JSD and reverse KL between two heads, masked rows."""
    n = shape.batch * shape.seq_len
    for beta, temperature in ((0.0, 1.0), (0.5, 0.8), (1.0, 1.3)):
        gen = _gen(n * 1000 + shape.vocab + int(beta * 10))
        inputs = _two_heads(shape, gen)
        inputs["mask"] = _lengths_mask(shape, gen).reshape(-1)
        upstream = {"divergence": torch.randn(n, generator=gen, dtype=torch.float64)}
        kw = dict(beta=beta, temperature=temperature)

        def ours(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask,
                 kw=kw):
            return {"divergence": logitless.linear_divergence(
                hidden, weight, teacher_hidden, teacher_weight, mask, bias=bias,
                teacher_bias=teacher_bias, max_tile_bytes=TILE_BYTES, **kw).divergence}

        def plain(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask,
                  kw=kw):
            return {"divergence": reference.linear_divergence(
                hidden, weight, teacher_hidden, teacher_weight, mask, bias=bias,
                teacher_bias=teacher_bias, **kw).divergence}

        yield Case("linear_divergence", f"beta={beta}, T={temperature}, masked rows",
                   f"N={n} D={shape.hidden} V={shape.vocab}", inputs,
                   ("hidden", "weight", "bias"), upstream, ours, plain)


def linear_topk_distill_cases(shape: Shape) -> Iterator[Case]:
    """verl's top-k forward KL: k=8 teacher ids (half the student's top ids), masked rows."""
    n, v, k = shape.batch * shape.seq_len, shape.vocab, min(8, shape.vocab)
    gen = _gen(n * 1000 + v + 77)
    heads = _two_heads(shape, gen)
    inputs = {key: heads[key] for key in ("hidden", "weight", "bias")}
    student = reference.linear_logits(inputs["hidden"], inputs["weight"], inputs["bias"])
    ids = torch.cat([student.topk(k // 2, -1).indices,
                     torch.randint(0, v, (n, k - k // 2), generator=gen)], -1)
    teacher = reference.linear_logits(heads["teacher_hidden"], heads["teacher_weight"])
    inputs.update(teacher_ids=ids, teacher_logprobs=teacher.log_softmax(-1).gather(-1, ids),
                  mask=_lengths_mask(shape, gen).reshape(-1))
    upstream = {"loss": torch.randn(n, generator=gen, dtype=torch.float64)}

    def ours(hidden, weight, bias, teacher_ids, teacher_logprobs, mask):
        return {"loss": logitless.linear_topk_distill(
            hidden, weight, teacher_ids, teacher_logprobs, mask, temperature=0.9, bias=bias,
            max_tile_bytes=TILE_BYTES)}

    def plain(hidden, weight, bias, teacher_ids, teacher_logprobs, mask):
        return {"loss": reference.linear_topk_distill(
            hidden, weight, teacher_ids, teacher_logprobs, mask, temperature=0.9, bias=bias)}

    yield Case("linear_topk_distill", f"k={k}, T=0.9, verl's clamps, masked rows",
               f"N={n} D={shape.hidden} V={v}", inputs, ("hidden", "weight", "bias"),
               upstream, ours, plain)


# The policy-loss cases: a token-level objective with a KL penalty and an entropy bonus, and a
# sequence-level one (per-sequence reductions, the segment kernels).
POLICY_CASES = {
    "grpo, KL k3, entropy bonus": dict(objective="grpo", beta=0.1, entropy_coef=0.02),
    "gspo (sequence ratio)": dict(objective="gspo"),
}


def _policy_inputs(shape: Shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    b, t = shape.batch, shape.seq_len
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 2.5 - 0.05
    return {"old_logprobs": old,
            "ref_logprobs": old + 0.2 * torch.randn(b, t, generator=gen, dtype=torch.float64),
            "advantages": torch.randn(b, generator=gen, dtype=torch.float64),
            "mask": _lengths_mask(shape, gen)}


def _cu_seqlens(mask: torch.Tensor) -> torch.Tensor:
    return torch.cat([mask.new_zeros(1, dtype=torch.long), mask.sum(-1).cumsum(0)])


def policy_loss_cases(shape: Shape) -> Iterator[Case]:
    """Each of ``POLICY_CASES``, padded and packed (``cu_seqlens``)."""
    b, t = shape.batch, shape.seq_len
    for name, options in POLICY_CASES.items():
        config = PolicyLossConfig(**options)
        for packed in (False, True):
            gen = _gen(b * t + len(name) + packed)
            inputs = _policy_inputs(shape, gen)
            inputs["logprobs"] = (inputs["old_logprobs"] + 0.3 * torch.randn(
                b, t, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
            inputs["entropy"] = torch.rand(b, t, generator=gen, dtype=torch.float64) * 2

            def ours(logprobs, old_logprobs, ref_logprobs, advantages, mask, entropy,
                     config=config, packed=packed):
                tokens = dict(logprobs=logprobs, old_logprobs=old_logprobs,
                              ref_logprobs=ref_logprobs, entropy=entropy, mask=mask)
                extra = {}
                if packed:
                    tokens = {k: x[mask] for k, x in tokens.items()}
                    extra["cu_seqlens"] = _cu_seqlens(mask)
                loss, _ = logitless.policy_loss(
                    tokens.pop("logprobs"), tokens.pop("old_logprobs"), advantages,
                    tokens.pop("mask"), config, **tokens, **extra)
                return {"loss": loss}

            def plain(logprobs, old_logprobs, ref_logprobs, advantages, mask, entropy,
                      config=config):
                return {"loss": reference.policy_loss_reference(
                    logprobs, old_logprobs, advantages, mask, config, ref=ref_logprobs,
                    entropy=entropy)}

            layout = "packed" if packed else "padded"
            yield Case("policy_loss", f"{name}, {layout}", f"B={b} T={t}", inputs,
                       ("logprobs", "entropy"), {"loss": torch.ones((), dtype=torch.float64)},
                       ours, plain)


def fused_policy_loss_cases(shape: Shape) -> Iterator[Case]:
    """Each of ``POLICY_CASES`` from the head: padded and chunked (a memory budget of a few
    dozen rows, so several chunks), packed and streaming."""
    b, t, d, v = shape.batch, shape.seq_len, shape.hidden, shape.vocab
    head = dict(temperature=0.9, softcap=8.0)
    budget = 48 * v * 4
    for (name, options), (packed, strategy) in zip(POLICY_CASES.items(),
                                                   ((False, "chunked"), (True, "streaming"))):
        config = PolicyLossConfig(**options)
        gen = _gen(b * t * v + len(name))
        inputs = _policy_inputs(shape, gen)
        inputs.update(hidden=torch.randn(b, t, d, generator=gen, dtype=torch.float64),
                      weight=torch.randn(v, d, generator=gen, dtype=torch.float64) * 2 / d**0.5,
                      bias=torch.randn(v, generator=gen, dtype=torch.float64),
                      targets=torch.randint(0, v, (b, t), generator=gen))
        # Old and reference logprobs near the head's own, as in training: ratios near 1.
        current = reference.linear_softmax_stats(inputs["hidden"], inputs["weight"],
                                                 inputs["targets"], inputs["bias"],
                                                 **head)["logprobs"]
        for key, noise in (("old_logprobs", 0.3), ("ref_logprobs", 0.2)):
            inputs[key] = current + noise * torch.randn(b, t, generator=gen, dtype=torch.float64)

        def ours(hidden, weight, bias, targets, old_logprobs, ref_logprobs, advantages, mask,
                 config=config, packed=packed, strategy=strategy):
            extra = {}
            if packed:
                hidden, targets, old_logprobs, ref_logprobs = (
                    x[mask] for x in (hidden, targets, old_logprobs, ref_logprobs))
                extra["cu_seqlens"] = _cu_seqlens(mask)
                mask = mask[mask]
            loss, _ = logitless.fused_policy_loss(
                hidden, weight, targets, old_logprobs, advantages, mask, config, bias=bias,
                ref_logprobs=ref_logprobs, max_tile_bytes=budget, strategy=strategy, **head,
                **extra)
            return {"loss": loss}

        def plain(hidden, weight, bias, targets, old_logprobs, ref_logprobs, advantages, mask,
                  config=config):
            stats = reference.linear_softmax_stats(hidden, weight, targets, bias, **head)
            return {"loss": reference.policy_loss_reference(
                stats["logprobs"], old_logprobs, advantages, mask, config, ref=ref_logprobs,
                entropy=stats["entropy"])}

        layout = "packed" if packed else "padded"
        yield Case("fused_policy_loss", f"{name}, {layout}, {strategy}",
                   f"B={b} T={t} D={d} V={v}", inputs, ("hidden", "weight", "bias"),
                   {"loss": torch.ones((), dtype=torch.float64)}, ours, plain)
    yield exact_kl_case(shape)


def exact_kl_case(shape: Shape) -> Case:
    """``kl_estimator="exact"``: the full-vocabulary KL to a reference head in the chunked loss,
    several chunks, against both heads' fp64 logits. As in training the reference is near the
    policy: the policy's head seen through a random rotation of the hidden space (the
    reference's hidden size 3/4 of the policy's) and perturbed (a KL of a few tenths)."""
    b, t, d, v = shape.batch, shape.seq_len, shape.hidden, shape.vocab
    config = PolicyLossConfig(objective="grpo", beta=0.2, kl_estimator="exact")
    gen = _gen(b * t * v + 5)
    d_ref = max(1, 3 * d // 4)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    inputs = {"hidden": r(b, t, d), "weight": r(v, d) * 2 / d**0.5, "bias": r(v) * 0.5}
    proj = torch.linalg.qr(r(d, d))[0][:, :d_ref]  # orthonormal columns: norms kept
    inputs.update(teacher_hidden=inputs["hidden"] @ proj + 0.2 * r(b, t, d_ref),
                  teacher_weight=inputs["weight"] @ proj + 0.2 * r(v, d_ref) / d_ref**0.5,
                  teacher_bias=inputs["bias"] + 0.2 * r(v))
    inputs.update(_policy_inputs(shape, gen), targets=torch.randint(0, v, (b, t), generator=gen))
    inputs.pop("ref_logprobs")
    current = reference.linear_softmax_stats(inputs["hidden"], inputs["weight"],
                                             inputs["targets"], inputs["bias"],
                                             temperature=0.9)["logprobs"]
    # Ratios within [0.9, 1.1], inside the clip range: a reduced-precision logprob then cannot
    # move a token across a clip bound (a jump in the gradient, not an error of the KL).
    inputs["old_logprobs"] = current + (0.05 * r(b, t)).clamp(-0.1, 0.1)

    def ours(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, targets,
             old_logprobs, advantages, mask):
        loss, _ = logitless.fused_policy_loss(
            hidden, weight, targets, old_logprobs, advantages, mask, config, bias=bias,
            ref_hidden=teacher_hidden, ref_weight=teacher_weight, ref_bias=teacher_bias,
            temperature=0.9, max_tile_bytes=48 * v * 4)
        return {"loss": loss}

    def plain(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, targets,
              old_logprobs, advantages, mask):
        lp = reference.linear_softmax_stats(hidden, weight, targets, bias,
                                            temperature=0.9)["logprobs"]
        kl = reference.linear_divergence(hidden, weight, teacher_hidden, teacher_weight, mask,
                                         beta=1.0, temperature=0.9, bias=bias,
                                         teacher_bias=teacher_bias).divergence
        return {"loss": reference.policy_loss_reference(lp, old_logprobs, advantages, mask,
                                                        config, kl=kl)}

    return Case("fused_policy_loss", "grpo, exact KL to a reference head, padded, chunked",
                f"B={b} T={t} D={shape.hidden} V={v}", inputs, ("hidden", "weight", "bias"),
                {"loss": torch.ones((), dtype=torch.float64)}, ours, plain)


def attention_entropy_cases(shape: Shape) -> Iterator[Case]:
    """Causal GQA over padded rows (left and right padding), and a sliding window with a
    soft cap over packed sequences; forward only (the op has no backward)."""
    b, t, hq, hk, hd = shape.batch, shape.attn_seq_len, shape.heads, shape.kv_heads, \
        shape.head_dim
    for packed in (False, True):
        gen = _gen(b * t + packed)
        q = torch.randn(b, hq, t, hd, generator=gen, dtype=torch.float64) * 1.5
        k = torch.randn(b, hk, t, hd, generator=gen, dtype=torch.float64)
        if packed:
            lengths = torch.randint(1, t + 1, (b,), generator=gen)
            lengths[0] = t
            cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
            rows = torch.arange(t)[None] < lengths[:, None]
            inputs = {"q": q.transpose(1, 2)[rows], "k": k.transpose(1, 2)[rows],
                      "cu_seqlens": cu}
            options = dict(window=t // 3, softcap=20.0)
            name, dims = "window, softcap, packed", f"total={int(cu[-1])} (B={b} T<={t})"
        else:
            inputs = {"q": q, "k": k, "attention_mask": torch.ones(b, t, dtype=torch.bool)}
            inputs["attention_mask"][0, : t // 4] = False
            inputs["attention_mask"][-1, -(t // 5):] = False
            options = {}
            name, dims = "causal, padded", f"B={b} T={t}"

        def ours(options=options, **tensors):
            return {"entropy": logitless.attention_entropy(**tensors, **options)}

        def plain(options=options, **tensors):
            return {"entropy": reference.attention_entropy(**tensors, **options)}

        yield Case("attention_entropy", name, f"{dims} Hq={hq} Hk={hk} d={hd}", inputs, (),
                   {}, ours, plain)


CASES: dict[str, Callable[[Shape], Iterator[Case]]] = {
    "linear_logprobs": linear_logprobs_cases,
    "sampled_logprobs": sampled_logprobs_cases,
    "policy_loss": policy_loss_cases,
    "fused_policy_loss": fused_policy_loss_cases,
    "attention_entropy": attention_entropy_cases,
    "linear_divergence": linear_divergence_cases,
    "linear_topk_distill": linear_topk_distill_cases,
}
