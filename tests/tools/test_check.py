"""``logitless check``: every public op passes against the fp64 reference on the CPU backends,
and a deliberately corrupted op is caught, in the quantity that was corrupted."""

from __future__ import annotations

import os

import pytest
import torch

import logitless
from logitless.tools.check import CASES, Shape, run_checks
from logitless.tools.cli import main

SMALL = Shape(batch=2, seq_len=9, hidden=40, vocab=300, attn_seq_len=70)
SMALL_ARGS = ["--batch", "2", "--seq-len", "9", "--hidden", "40", "--vocab", "300",
              "--attn-seq-len", "70"]
QUANTITIES = {
    "linear_logprobs": {"logprobs", "entropy", "sum_p_sq", "mean_logit", "is_top1", "lse",
                        "d_hidden", "d_weight", "d_bias"},
    "sampled_logprobs": {"logprobs", "entropy", "log_kept_mass", "d_hidden", "d_weight",
                         "d_bias"},
    "policy_loss": {"loss", "d_logprobs", "d_entropy"},
    "fused_policy_loss": {"loss", "d_hidden", "d_weight", "d_bias"},
    "attention_entropy": {"entropy"},
    "linear_divergence": {"divergence", "d_hidden", "d_weight", "d_bias"},
    "linear_topk_distill": {"loss", "d_hidden", "d_weight", "d_bias"},
}


def test_every_op_passes_on_the_torch_twins(capsys):
    assert main(["check", "--device", "cpu", "--backend", "torch", "--dtype", "float32",
                 "bfloat16", *SMALL_ARGS]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "FAIL" not in out
    for op in CASES:
        assert op in out


def test_every_op_and_quantity_is_covered():
    rows = run_checks(devices=["cpu"], backends=["torch"], dtypes=["float32"], shape=SMALL)
    seen: dict[str, set[str]] = {}
    for r in rows:
        seen.setdefault(r.op, set()).add(r.quantity)
    assert seen == QUANTITIES
    assert all(r.ok for r in rows)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on CPU under TRITON_INTERPRET=1")
def test_every_op_passes_on_the_triton_kernels(monkeypatch):
    # The launcher's row chunk shrunk from 1024 to 16: its backward runs one interpreted
    # program per padded row (1024 for these 18 rows; now 32, the last chunk still padded).
    # Likewise the sampler kernels' chunk (every chunk padded to _MAX_ROWS rows at this
    # vocabulary): 16 rows, so the 18 rows still span a full and a padded chunk.
    from logitless.kernels import linear_softmax, sampler

    monkeypatch.setattr(linear_softmax, "ROW_CHUNK", 16)
    monkeypatch.setattr(sampler, "_MAX_ROWS", 16)
    rows = run_checks(devices=["cpu"], backends=["triton"], dtypes=["float32"], shape=SMALL)
    assert {r.op for r in rows} == set(QUANTITIES)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_triton_on_cpu_without_the_interpreter_runs_in_a_child(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["check", "--device", "cpu", "--backend", "triton", "--dtype", "float32",
                 "--op", "policy_loss", *SMALL_ARGS]) == 0
    body = capsys.readouterr().out.splitlines()[2:-2]
    assert body and all(line.split()[0] == "policy_loss" and " triton " in line
                        and line.endswith("ok") for line in body)


def _slow_gradient(x, factor=1.01):
    """``x`` with its value unchanged and its gradient scaled by ``factor``."""
    return x + (factor - 1) * (x - x.detach())


def _corrupt_linear_logprobs(op):
    def corrupted(*args, **kwargs):
        out = op(*args, **kwargs)
        out.logprobs = _slow_gradient(out.logprobs)
        return out
    return corrupted, {"d_hidden", "d_weight", "d_bias"}


def _corrupt_policy_loss(op):
    def corrupted(logprobs, *args, **kwargs):
        return op(_slow_gradient(logprobs, 1.05), *args, **kwargs)
    return corrupted, {"d_logprobs"}


def _corrupt_hidden_gradient(op):
    def corrupted(hidden, *args, **kwargs):
        return op(_slow_gradient(hidden), *args, **kwargs)
    return corrupted, {"d_hidden"}


def _shift_one_value(index, quantity):
    """A corruption adding 1e-3 to the op's output at flat ``index``."""
    def corrupt(op):
        def corrupted(*args, **kwargs):
            out = op(*args, **kwargs).clone()
            out.view(-1)[index] += 1e-3
            return out
        return corrupted, {quantity}
    return corrupt


CORRUPTIONS = {
    "linear_logprobs": _corrupt_linear_logprobs,
    "policy_loss": _corrupt_policy_loss,
    "fused_policy_loss": _corrupt_hidden_gradient,
    "attention_entropy": _shift_one_value(-1, "entropy"),
    "linear_divergence": _corrupt_hidden_gradient,
    "linear_topk_distill": _shift_one_value(0, "loss"),  # the first row is never masked
}


@pytest.mark.parametrize("op", list(CORRUPTIONS))
def test_a_corrupted_op_fails_where_it_was_corrupted(op, monkeypatch, capsys):
    corrupted, wrong = CORRUPTIONS[op](getattr(logitless, op))
    monkeypatch.setattr(logitless, op, corrupted)
    rows = run_checks(devices=["cpu"], backends=["torch"], dtypes=["float32"], ops=[op],
                      shape=SMALL)
    failed = {r.quantity for r in rows if not r.ok}
    assert failed == wrong
    assert main(["check", "--device", "cpu", "--backend", "torch", "--dtype", "float32",
                 "--op", op, *SMALL_ARGS]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_corrupted_sampler_path_fails_where_it_was_corrupted(monkeypatch):
    """The sampled_logprobs rows see the truncated path: shifting its log_kept_mass when
    top-p is set fails exactly those rows."""
    real = logitless.linear_logprobs

    def corrupted(*args, **kwargs):
        out = real(*args, **kwargs)
        if kwargs.get("top_p") is not None:
            out.log_kept_mass = out.log_kept_mass + 1e-2
        return out

    monkeypatch.setattr(logitless, "linear_logprobs", corrupted)
    rows = run_checks(devices=["cpu"], backends=["torch"], dtypes=["float32"],
                      ops=["sampled_logprobs"], shape=SMALL)
    failed = {(r.case, r.quantity) for r in rows if not r.ok}
    assert {q for _, q in failed} == {"log_kept_mass"}
    assert {c for c, _ in failed} == {r.case for r in rows if "top_p" in r.case}


def test_bad_sizes_and_absent_devices_are_refused(capsys):
    assert main(["check", "--vocab", "0"]) == 2
    assert "vocab must be a positive size" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["check", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def _scaled_kl_value(forward):
    def corrupted(*args, **kwargs):
        kl, *rest = forward(*args, **kwargs)
        return 1.01 * kl, *rest
    return corrupted


def _scaled_kl_gradient(backward):
    def corrupted(*args, **kwargs):
        *head, grad = args
        return backward(*head, 1.05 * grad, **kwargs)
    return corrupted


@pytest.mark.parametrize("name,corrupt,wrong", [
    ("divergence_forward", _scaled_kl_value, {"loss"}),
    ("divergence_backward", _scaled_kl_gradient, {"d_hidden", "d_weight", "d_bias"}),
])
def test_the_exact_kl_row_checks_the_kl(name, corrupt, wrong, monkeypatch):
    """The fused policy loss's exact-KL case passes, and fails where the per-token KL's value
    (1% off) or its gradient (5% off) is corrupted, in that case only."""
    from logitless.kernels import divergence_torch

    def rows():
        return run_checks(devices=["cpu"], backends=["torch"], dtypes=["float32"],
                          ops=["fused_policy_loss"], shape=SMALL)

    exact = [r for r in rows() if "exact KL" in r.case]
    assert {r.quantity for r in exact} == QUANTITIES["fused_policy_loss"]
    assert all(r.ok for r in exact)
    monkeypatch.setattr(divergence_torch, name, corrupt(getattr(divergence_torch, name)))
    failed = {(r.case, r.quantity) for r in rows() if not r.ok}
    assert failed == {(exact[0].case, q) for q in wrong}


def test_a_case_that_raises_fails_in_its_own_row_and_the_rest_run(monkeypatch, capsys):
    """One exception never aborts the table: its case gets one ERROR row naming it, the other
    cases and ops still report, and the exit status says failure (issue 22)."""
    def broken(*args, **kwargs):
        raise RuntimeError("deliberately broken")

    monkeypatch.setattr(logitless, "attention_entropy", broken)
    assert main(["check", "--device", "cpu", "--backend", "torch", "--dtype", "float32",
                 "--op", "attention_entropy", "policy_loss", *SMALL_ARGS]) == 1
    lines = capsys.readouterr().out.splitlines()
    errors = [line for line in lines if " ERROR " in line]
    assert errors and all("RuntimeError: deliberately broken" in line for line in errors)
    assert all(line.startswith("attention_entropy") for line in errors)
    assert any(line.startswith("policy_loss") and line.endswith("ok") for line in lines)


def test_rows_stream_as_each_case_finishes(monkeypatch):
    """`iter_checks` yields a case's rows before the next case runs."""
    from logitless.tools import check

    seen = []
    real = check.run_case

    def spy(case, *args):
        seen.append(case.name)
        yield from real(case, *args)

    monkeypatch.setattr(check, "run_case", spy)
    rows = check.iter_checks(devices=["cpu"], backends=["torch"], dtypes=["float32"],
                             ops=["policy_loss"], shape=SMALL)
    first = next(rows)
    assert seen == [first.case]  # only the first case has run
    assert len(list(rows)) > 1 and len(seen) > 1


def test_the_demo_sums_check_up_to_a_line_per_op(capsys):
    """`logitless demo` starts with one line per op (the full table is `logitless check`'s)."""
    import argparse

    from logitless.tools.check import add_arguments
    from logitless.tools.demo import check_summary

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--backend", "torch", "--dtype", "float32",
                              "--op", "policy_loss", "attention_entropy", *SMALL_ARGS])
    assert check_summary(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "full table: logitless check" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["policy_loss", "attention_entropy"]
    assert all(line.endswith(": ok") and "cpu/torch" in line for line in lines[1:])
