"""``python -m logitless.tools.sass --out DIR``: the sm_90 machine code of the streaming passes.

Each Triton pass that streams a tile of logits is compiled for sm_90 (no GPU needed: the whole
pipeline down to ``ptxas``), with the constexprs and warps its launcher uses and the argument
specialisation the runtime gives it: every pointer 16-byte aligned, and the integer arguments
divisible by 16 where they are at the shape (the tiles' row stride is always a multiple of 16,
``linear_softmax.row_stride``; the width is V's remainder, divisible at V=151936 and not at
V=151655; both are compiled). The cubins go to ``DIR`` and
``DIR/sass.json`` holds, per kernel: registers and spills (from the compiled metadata), and
the streaming loop's length in SASS instructions, read from the disassembly by triton's own
``nvdisasm`` (the longest loop: a backward branch to a label; the loop body is the
instructions from the label to the branch).

Budget (docs/gpu.md, "SASS report"): the warp instructions a pass issues per element,
``loop_instructions * warps / elements_per_iteration``, against the bytes it moves per
element. At 4 schedulers x 1.98 GHz x 132 SMs (1.05e12 warp instructions per second) and
4.3 TB/s, issue time stays under 75% of HBM time when instructions per element are at most
0.18 x bytes per element (0.36 for a bf16 read, 0.72 for a bf16 read and write).
The attention-entropy kernel streams no logits: its clock is the tensor cores' (``bound``
"tensor"), and its ``bytes_per_element`` is the HBM traffic of the same time.

Besides the logits passes the report holds the plain KLs' pair passes, attention entropy and
the segment passes (the per-sequence sums, prefix sums and spreads of the objectives).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ISSUE_BUDGET = 0.18  # warp instructions per element, per byte moved per element
SHAPES = {"V=151936": 151936, "V=151655": 151655}  # divisible by 16, and not
# The pair kernels' per-row normalisers (each head's max logit and log of its sum).
NORMALISERS = ("top_s", "log_l_s", "top_t", "log_l_t")


@dataclasses.dataclass
class Variant:
    """One compiled kernel: which pass (``role``), its kernel, signature and constexprs."""

    name: str
    role: str
    dtype: str
    module: str
    kernel: str
    signature: dict
    constexprs: dict
    warps: int
    elements_per_iteration: int
    bytes_per_element: float
    divisible: tuple[str, ...] = ()  # integer arguments the runtime finds divisible by 16
    stages: int = 3
    # Which loop is the streaming one: the longest, or (the attention kernel) the shortest,
    # its loop over the key blocks every query of the block sees; the boundary blocks' loops
    # add the visibility mask and run on a few blocks per query block. With a padding mask
    # the attention kernel has two such loops: the shortest for rows whose valid keys are
    # contiguous (left or right padding), "next_shortest" (one select per score) for others.
    loop: str = "longest"
    # What the budget is relative to: HBM bytes ("memory"), or the tensor cores' time
    # expressed as the bytes HBM moves in it ("tensor", the attention kernel).
    bound: str = "memory"


def _split(meta: dict) -> tuple[int, dict]:
    meta = dict(meta)
    return meta.pop("num_warps"), meta


def variants(vocab: int) -> list[Variant]:
    """The streaming passes the reference-shape calls launch (bf16), at vocabulary ``vocab``."""
    import torch

    from logitless.kernels import divergence as dv
    from logitless.kernels import linear_softmax as ls
    from logitless.kernels import stored_logits as st

    tile = ls.VOCAB_TILE
    last = vocab % tile or tile
    # Tiles' rows are ls.row_stride apart (a multiple of 16); the last tile's width is V's
    # remainder, the fused store's width V itself (the same residue mod 16).
    aligned = tuple(n for n, v in (("stride_row", ls.row_stride(last)), ("width", last))
                    if v % 16 == 0)
    g = torch.zeros(1)
    out = []
    head_stats_sig = dict(logits="*bf16", stride_row="i32", targets="*i64", state="*fp32",
                          plane="i32", width="i32", v0="i32", softcap="fp32", z_scale="fp32")
    head_grad_sig = dict(logits="*bf16", stride_row="i32", targets="*i64",
                         **dict.fromkeys(("top", "log_l", "entropy", "sum_p_sq", "g_lp",
                                          "g_entropy", "g_sum_p_sq", "g_mean_logit", "g_lse"),
                                         "*fp32"),
                         n_rows="i32", width="i32", v0="i32", softcap="fp32", z_scale="fp32",
                         inv_vocab_total="fp32")
    for role, meta, sig, nbytes in (
        ("head_stats", ls.stats_meta(torch.bfloat16, None, False, False), head_stats_sig, 2),
        ("head_grad", ls.grad_meta(torch.bfloat16, None, g, g, None, None, None),
         head_grad_sig, 4),
        ("fused_stats", st.stats_meta(torch.bfloat16, None), head_stats_sig, 2),
        ("fused_grad", st.grad_meta(torch.bfloat16, None, g, g), head_grad_sig, 4),
    ):
        warps, consts = _split(meta)
        kernel = "tile_stats_kernel" if "stats" in role else "tile_grad_kernel"
        out.append(Variant(f"{kernel}[{role}]", role, "bfloat16", ls.__name__, kernel, sig,
                           consts, warps, consts["BLOCK_V"], nbytes, aligned))
    pair = dict(zs_ptr="*fp32", stride_s="i32", zt_ptr="*fp32", stride_t="i32")
    # Both heads' fp32 tiles: rows ls.row_stride apart, the last tile's width V's remainder.
    pair_aligned = ("stride_s", "stride_t", *(("width",) if "width" in aligned else ()))
    warps, consts = _split(dv.stats_meta(0.5))
    out.append(Variant("_pair_stats_kernel[jsd]", "divergence_stats", "float32", dv.__name__,
                       "_pair_stats_kernel",
                       dict(pair, state="*fp32", plane="i32", width="i32", z_scale="fp32"),
                       consts, warps, consts["BLOCK_V"], 8, pair_aligned))
    warps, consts = _split(dv.jsd_meta())
    out.append(Variant("_pair_jsd_kernel", "divergence_jsd", "float32", dv.__name__,
                       "_pair_jsd_kernel",
                       dict(pair, **dict.fromkeys(NORMALISERS, "*fp32"), acc="*fp32",
                            plane="i32", width="i32", z_scale="fp32", log_b="fp32",
                            log_1mb="fp32"),
                       consts, warps, consts["BLOCK_V"], 8, pair_aligned))
    warps, consts = _split(dv.grad_meta(0.5, torch.bfloat16))
    out.append(Variant("_pair_grad_kernel[jsd]", "divergence_grad", "float32", dv.__name__,
                       "_pair_grad_kernel",
                       dict(pair, **dict.fromkeys((*NORMALISERS, "aux", "grad"), "*fp32"),
                            width="i32", z_scale="fp32", log_b="fp32", log_1mb="fp32",
                            one_minus_beta="fp32"),
                       consts, warps, consts["BLOCK_V"], 12, pair_aligned))
    warps, consts = _split(dv.topk_grad_meta(torch.bfloat16, 8))  # check's k=8
    out.append(Variant("_topk_grad_kernel", "divergence_topk_grad", "bfloat16", dv.__name__,
                       "_topk_grad_kernel",
                       dict(z_ptr="*bf16", stride_row="i32", ids="*i64", grad="*fp32", k="i32",
                            top="*fp32", log_l="*fp32", width="i32", v0="i32",
                            z_scale="fp32"),
                       consts, warps, consts["BLOCK_V"], 4, aligned))
    out += _kl_variants(pair, pair_aligned) + _attention_variants() + _segment_variants()
    out += sampler_variants(vocab, aligned)
    return out


def sampler_variants(vocab: int, aligned: tuple[str, ...]) -> list[Variant]:
    """The sampler's streaming passes (``kernels/sampler.py``) as a top-p call launches them
    at the reference shape (bf16, no softcap): the transform (bf16 logits read, fp32 written),
    the search's weighted and counting passes and the statistics pass (fp32 read), and the
    backward's ``dx`` pass (bf16 read and written). Every slice starts at a multiple of
    ``SLICE_COLS`` and the chunk's rows are ``V`` elements apart: ``width`` and the strides are
    divisible by 16 when V is."""
    import torch

    from logitless.kernels import sampler as sp

    # the chunk's and the tempered copy's rows are linear_softmax.row_stride apart (a multiple
    # of 16); the width is V
    div = ("stride_x", "stride_z", "span", *(("width",) if "width" in aligned else ()))
    scal = dict(softcap="fp32", scale="fp32")
    out = []
    warps = sp.WARPS
    out.append(Variant("_transform_kernel", "sampler_transform", "bfloat16", sp.__name__,
                       "_transform_kernel",
                       dict(x="*bf16", stride_x="i32", temperature="*fp32", z="*fp32",
                            stride_z="i32", part_m="*fp32", part_k="*i32",
                            n_slices="i32", width="i32", span="i32", **scal),
                       dict(HAS_SOFTCAP=False, SLICE=sp.SLICE_COLS, BLOCK_V=sp.TRANSFORM_BLOCK),
                       warps,
                       sp.TRANSFORM_BLOCK, 6, div))
    import triton.language as tl

    # the search passes, their trials in the bf16 logits' own values (the loop is the same
    # with fp32 keys: the trials are formed before it)
    for weighted in (True, False):
        out.append(Variant(f"_fan_kernel[{'mass' if weighted else 'count'}]",
                           f"sampler_fan_{'mass' if weighted else 'count'}", "float32",
                           sp.__name__, "_fan_kernel",
                           dict(z="*fp32", stride_z="i32", m_in="*fp32", base="*i64",
                                step="*i64", part="*fp32", n_slices="i32", span="i32",
                                temperature="*fp32", mag="fp32", like="*bf16"),
                           dict(WEIGHTED=weighted, VALUE_KEYS=True, MASK=0x7FFF,
                                KEY_TY=tl.int16, HI=0x7F80, FAN=sp.FAN_KEYS, SLICE=sp.SLICE_COLS,
                                BLOCK_S=sp.SEARCH_BLOCK), warps, sp.SEARCH_BLOCK, 4, div))
    out.append(Variant("_stats_kernel", "sampler_stats", "float32", sp.__name__,
                       "_stats_kernel",
                       dict(z="*fp32", stride_z="i32", targets="*i64", m_in="*fp32",
                            t_in="*i64", part="*fp32", part_k="*i32", n_slices="i32",
                            width="i32", span="i32"),
                       dict(CANONICAL=False, SLICE=sp.SLICE_COLS, BLOCK_V=sp.BLOCK_COLS), warps,
                       sp.BLOCK_COLS, 4, div))
    g = torch.zeros(1)
    meta = sp.grad_meta(torch.bfloat16, None, g, None, None, None)
    warps_g, consts = _split(meta)
    out.append(Variant("_grad_kernel[sampler]", "sampler_grad", "bfloat16", sp.__name__,
                       "_grad_kernel",
                       dict(x="*bf16", stride_x="i32", targets="*i64", temperature="*fp32",
                            key="*i64", cut="*i32", u_at="*fp32", u_above="*fp32",
                            **dict.fromkeys(("top", "log_kept", "log_full", "entropy", "g_lp",
                                             "g_entropy", "g_kept", "g_lse"), "*fp32"),
                            n_rows="i32", width="i32", span="i32", v0="i32", **scal,
                            sign="fp32"),
                       consts, warps_g, consts["BLOCK_V"], 4, (div[0], *div[2:])))
    out.append(Variant("_cut_kernel[sampler]", "sampler_cut", "bfloat16", sp.__name__,
                       "_cut_kernel",
                       dict(x="*bf16", stride_x="i32", temperature="*fp32", key="*i64",
                            count="*i64", seen="*i64", u_at="*fp32", u_above="*fp32",
                            cut="*i32", n_rows="i32", width="i32", span="i32", **scal,
                            sign="fp32"),
                       dict(HAS_SOFTCAP=False, BLOCK_V=sp.CUT_BLOCK), warps_g,
                       sp.CUT_BLOCK, 2, (div[0], *div[2:])))
    return out


def _kl_variants(pair: dict, pair_aligned: tuple[str, ...]) -> list[Variant]:
    """The pair passes of the plain KLs (beta 0: forward, beta 1: reverse), whose ``GAP``
    constexpr drops the mixture's terms."""
    import torch

    from logitless.kernels import divergence as dv

    out = []
    for beta, tag in ((0.0, "kl_forward"), (1.0, "kl_reverse")):
        warps, consts = _split(dv.stats_meta(beta))
        out.append(Variant(f"_pair_stats_kernel[{tag}]", "divergence_stats", "float32",
                           dv.__name__, "_pair_stats_kernel",
                           dict(pair, state="*fp32", plane="i32", width="i32", z_scale="fp32"),
                           consts, warps, consts["BLOCK_V"], 8, pair_aligned))
        warps, consts = _split(dv.grad_meta(beta, torch.bfloat16))
        out.append(Variant(f"_pair_grad_kernel[{tag}]", "divergence_grad", "float32",
                           dv.__name__, "_pair_grad_kernel",
                           dict(pair, **dict.fromkeys((*NORMALISERS, "aux", "grad"), "*fp32"),
                                width="i32", z_scale="fp32", log_b="fp32", log_1mb="fp32",
                                one_minus_beta="fp32"),
                           consts, warps, consts["BLOCK_V"], 12, pair_aligned))
    return out


# The reference shape of the attention and segment passes: Qwen-style heads (d=128) over
# sequences of 4096 tokens, and per-token values of 16 sequences of 1024 tokens.
HEAD_DIM = 128
SEQ_LEN = 1024


def _attention_variants() -> list[Variant]:
    """``_attention_entropy_fwd`` as ``attention_entropy_triton`` launches it for causal bf16
    attention at d=128 (no window, softcap or segments; with and without a padding mask).
    With a padding mask there are two rows of the same kernel: ``causal_padded`` is the main
    loop of a row whose valid keys are contiguous (left or right padding), and
    ``causal_scattered`` that of a row with holes in its mask (a select per score).

    It streams no logits from memory: each score tile comes from a wgmma of a query block and
    a key block and is used once. Its clock is the tensor cores' ``2 d`` FLOPs per score;
    ``bytes_per_element`` is the HBM traffic that takes the same time at 4.3 TB/s
    (``2 d x 4.3e12 / 790e12``), so the report's budget is the MMA time's, not a memory
    bound."""
    import torch

    from logitless.kernels import attention_entropy as ae

    cfg = ae.block_config(HEAD_DIM, torch.bfloat16)
    equivalent = round(2 * HEAD_DIM * 4.3 / 790, 3)
    sig = dict(Q="*bf16", K="*bf16", OUT="*fp32", SEG_START="constexpr", SEG_END="constexpr",
               KEY_VALID="*i8", QUERY_VALID="*i8", KEY_SPAN="*i32",
               **dict.fromkeys(("stride_qb", "stride_qh", "stride_qt", "stride_kb",
                                "stride_kh", "stride_kt", "T", "HQ", "BH", "GROUP", "D"),
                               "i32"),
               # the head dim is contiguous: strides of 1 are constexprs at run time
               stride_qd="constexpr", stride_kd="constexpr",
               qk_scale="fp32", cap2="fp32", key_floor="fp32", window="i32")
    # [B, H, T, d] contiguous: every stride but the last and T, D are multiples of 16
    divisible = ("stride_qb", "stride_qh", "stride_qt", "stride_kb", "stride_kh", "stride_kt",
                 "T", "D")
    out = []
    for tag, padded, loop in (("causal", False, "shortest"),
                              ("causal_padded", True, "shortest"),
                              ("causal_scattered", True, "next_shortest")):
        consts = dict(SEG_START=None, SEG_END=None, stride_qd=1, stride_kd=1, IS_CAUSAL=True,
                      HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_SEG=False, HAS_KEY_VALID=padded,
                      HAS_QUERY_VALID=padded, FOLD_SCALE=True, EVEN_D=True,
                      UPCAST_DOT=False,
                      BLOCK_D=ae.padded_head_dim(HEAD_DIM), BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n)
        signature = dict(sig)
        if not padded:
            signature.update(KEY_VALID="constexpr", QUERY_VALID="constexpr",
                             KEY_SPAN="constexpr")
            consts.update(KEY_VALID=None, QUERY_VALID=None, KEY_SPAN=None)
        out.append(Variant(f"_attention_entropy_fwd[{tag}]", "attention", "bfloat16",
                           ae.__name__, "_attention_entropy_fwd", signature, consts,
                           cfg.num_warps, cfg.block_m * cfg.block_n, equivalent, divisible,
                           stages=cfg.num_stages, loop=loop, bound="tensor"))
    return out


def _segment_variants() -> list[Variant]:
    """The segment passes of a padded ``[16, 1024]`` fp32 batch with a mask, as
    ``kernels.segments`` launches them (its ``launch_blocks``): the masked sum (the aggregations'
    numerators), the prefix sum (prefix ratios) and the spread back to tokens (the
    sequence-level ratios' broadcast)."""
    from logitless.kernels import segments as sg

    block_b, block_t, warps = sg.launch_blocks(SEQ_LEN)
    # contiguous rows: the token strides are 1, which the runtime turns into constexprs
    strides = dict(stride_xb="i32", stride_xt="constexpr", stride_mb="i32",
                   stride_mt="constexpr")
    base = dict(CU="constexpr", B="i32", T="i32")
    divisible = ("stride_xb", "stride_mb", "T")
    common = dict(CU=None, stride_xt=1, stride_mt=1, PACKED=False, FP64=False,
                  BLOCK_B=block_b, BLOCK_T=block_t)
    elements = block_b * block_t
    return [
        Variant("_segment_reduce_kernel[sum]", "segments_reduce", "float32", sg.__name__,
                "_segment_reduce_kernel",
                dict(X="*fp32", M="*u8", **base, OUT="*fp32", CNT="constexpr", **strides,
                     empty="fp32"),
                dict(common, CNT=None, OP=sg.OP_SUM, HAS_MASK=True), warps, elements, 5,
                divisible),
        Variant("_segment_scan_kernel[prefix_sum]", "segments_scan", "float32", sg.__name__,
                "_segment_scan_kernel",
                dict(X="*fp32", M="*u8", **base, OUT="*fp32", IDX="constexpr", **strides,
                     stride_ob="i32"),
                dict(common, IDX=None, OP=sg.OP_SUM, REVERSE=False, EXCLUSIVE=False,
                     MASK_IN=True, MASK_OUT=False, WANT_INDEX=False), warps, elements, 9,
                (*divisible, "stride_ob")),
        Variant("_segment_spread_kernel", "segments_spread", "float32", sg.__name__,
                "_segment_spread_kernel",
                dict(V="*fp32", CNT="constexpr", X="constexpr", REF="constexpr", M="*u8",
                     **base, OUT="*fp32", **strides, stride_ob="i32"),
                dict(common, CNT=None, X=None, REF=None, HAS_CNT=False, HAS_REF=False,
                     HAS_MASK=True), warps, elements, 5, (*divisible, "stride_ob")),
    ]


def _jit(fn):
    from triton.runtime.jit import JITFunction

    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def compile_variant(v: Variant):
    """Compile ``v`` for sm_90 with the runtime's alignment attributes."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit(getattr(importlib.import_module(v.module), v.kernel))
    full = dict(v.signature)
    full.update(dict.fromkeys(v.constexprs, "constexpr"))
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, ty in v.signature.items()
             if ty.startswith("*") or n in v.divisible}
    src = ASTSource(fn=fn, signature=full, constexprs=dict(v.constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": v.warps, "num_stages": v.stages})


def ptxas_resources(ptx: str) -> dict:
    """Registers and spill bytes of ``ptx`` as ``ptxas -v`` reports them (triton's ptxas)."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", f"--gpu-name={arch}", str(path),
                               "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True, check=True)
    text = done.stderr + done.stdout

    def number(pattern):
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"),
            "spills": number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads")}


def nvdisasm() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not path.is_file():
        raise FileNotFoundError(f"triton's nvdisasm is missing: {path}")
    return str(path)


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?);")
_LABEL = re.compile(r"^\s*(\.L_\w+):")
_BRANCH = re.compile(r"\bBRA\b[^`]*`\((\.L_\w+)\)")


def loops(sass: str) -> list[int]:
    """Instruction counts of every loop in ``sass`` (nvdisasm's text), longest first: a loop is
    a branch back to a label at a lower address."""
    labels, instrs = {}, []
    pending = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = _INSTR.search(line)
        if not found:
            continue
        index = len(instrs)
        for name in pending:
            labels[name] = index
        pending = []
        instrs.append(found.group(2))
    out = []
    for i, text in enumerate(instrs):
        branch = _BRANCH.search(text)
        if branch and labels.get(branch.group(1), i + 1) <= i:
            out.append(i - labels[branch.group(1)] + 1)
    return sorted(out, reverse=True)


def report(out_dir: Path, shapes=SHAPES) -> dict:
    """Compile every variant at each shape, write the cubins and ``sass.json``; return it."""
    import triton

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    read = {}  # cubin -> its loops and ptxas's figures: a pass whose code no shape changes
    for shape, vocab in shapes.items():
        for v in variants(vocab):
            compiled = compile_variant(v)
            stem = re.sub(r"[^\w]+", "_", f"{v.name}_{shape}").strip("_")
            cubin = out_dir / f"{stem}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            if compiled.asm["cubin"] not in read:  # the same bytes read once
                text = subprocess.run([nvdisasm(), "-c", str(cubin)], capture_output=True,
                                      text=True, check=True).stdout
                read[compiled.asm["cubin"]] = loops(text), ptxas_resources(compiled.asm["ptx"])
            counted, res = read[compiled.asm["cubin"]]
            # a loop of a few instructions is a trap or a spin, not a pass
            found = [n for n in counted if n >= 8]
            pick = {"longest": 0, "shortest": -1, "next_shortest": -2}[v.loop]
            length = found[pick] if len(found) >= 1 + (pick == -2) else 0
            per_element = length * v.warps / v.elements_per_iteration
            rows.append({
                "name": v.name, "role": v.role, "dtype": v.dtype, "shape": shape,
                "cubin": cubin.name, "registers": res["registers"],
                "spills": res["spills"], "loop_instructions": length,
                "warps": v.warps, "elements_per_iteration": v.elements_per_iteration,
                "bytes_per_element": v.bytes_per_element, "bound": v.bound,
                "instructions_per_element": round(per_element, 4),
                "budget_ratio": round(per_element / v.bytes_per_element, 4),
                "within_budget": per_element <= ISSUE_BUDGET * v.bytes_per_element,
                "divisible_by_16": list(v.divisible),
            })
    result = {"target": "sm_90", "triton": triton.__version__, "issue_budget": ISSUE_BUDGET,
              "kernels": rows}
    (out_dir / "sass.json").write_text(json.dumps(result, indent=1))
    return result


def format_table(result: dict) -> str:
    head = ("kernel", "shape", "regs", "spills", "loop instr", "warps", "elems/iter",
            "instr/elem", "bytes/elem", "ratio", "budget")
    body = [(r["name"], r["shape"], r["registers"], r["spills"], r["loop_instructions"],
             r["warps"], r["elements_per_iteration"], f"{r['instructions_per_element']:.3f}",
             r["bytes_per_element"], f"{r['budget_ratio']:.3f}",
             "ok" if r["within_budget"] else "OVER") for r in result["kernels"]]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([f"sm_90, triton {result['triton']}, budget {ISSUE_BUDGET} x bytes/elem",
                      line(head), line(["-" * w for w in widths]), *map(line, body)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m logitless.tools.sass",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for the cubins and sass.json")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter replaces the compiler
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        rest = sys.argv[1:] if argv is None else list(argv)
        return subprocess.run([sys.executable, "-m", "logitless.tools.sass", *rest],
                              env=env).returncode
    print(format_table(report(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
