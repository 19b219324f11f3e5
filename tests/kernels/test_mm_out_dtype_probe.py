"""The fp32-output GEMM (`addmm_acc_`, issue 22): whether ``torch.addmm(fp32, bf16, bf16,
out_dtype=torch.float32)`` works is decided by one probe per device and dtype, which makes that
very call and caches the answer; where the probe says no, the operands are upcast and the sums
are the same."""

import pytest
import torch

from logitless.kernels import linear_softmax_torch as lst


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(lst, "_MM_OUT_DTYPE", {})


def _counting_addmm(monkeypatch, works: bool):
    """torch.addmm as seen by the module, counting the out_dtype calls; ``works``: whether
    they succeed (computed exactly, in fp32) or raise as a build without the kernel does."""
    real = torch.addmm
    calls = []

    def addmm(acc, a, b, *, beta=1.0, out=None, out_dtype=None, **kw):
        if out_dtype is None:
            return real(acc, a, b, beta=beta, out=out, **kw)
        calls.append((a.dtype, out_dtype))
        if not works:
            raise NotImplementedError("Could not run 'aten::addmm.dtype_out' here")
        return real(acc, a.to(out_dtype), b.to(out_dtype), beta=beta, out=out, **kw)

    monkeypatch.setattr(lst.torch, "addmm", addmm)
    return calls


def test_the_probe_runs_once_per_device_and_dtype(monkeypatch):
    calls = _counting_addmm(monkeypatch, works=True)
    cpu = torch.device("cpu")
    assert lst.mm_out_dtype(cpu, torch.bfloat16) is True
    assert lst.mm_out_dtype(cpu, torch.bfloat16) is True
    assert calls == [(torch.bfloat16, torch.float32)]
    assert lst.mm_out_dtype(cpu, torch.float16) is True
    assert len(calls) == 2


def test_a_working_probe_sends_the_gemm_through_out_dtype(monkeypatch):
    calls = _counting_addmm(monkeypatch, works=True)
    a, b = torch.randn(8, 40).bfloat16(), torch.randn(40, 6).bfloat16()
    acc = torch.full((8, 6), float("nan"))
    lst.addmm_acc_(acc, a, b, beta=0.0)
    assert len(calls) == 2  # the probe, then the GEMM itself
    torch.testing.assert_close(acc.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-5)


def test_a_failing_probe_falls_back_to_upcast_operands(monkeypatch):
    calls = _counting_addmm(monkeypatch, works=False)
    a, b = torch.randn(8, 40).bfloat16(), torch.randn(40, 6).bfloat16()
    acc = torch.full((8, 6), 1.0)
    lst.addmm_acc_(acc, a, b, beta=1.0)
    lst.addmm_acc_(acc, a, b, beta=1.0)
    assert len(calls) == 1  # the probe only, once
    want = 1.0 + 2 * (a.double() @ b.double())
    torch.testing.assert_close(acc.double(), want, rtol=1e-5, atol=1e-5)


def test_this_cpu_build_has_no_fp32_output_kernel():
    """The real probe on this machine's CPU build: the keyword exists, the kernel does not."""
    assert lst.mm_out_dtype(torch.device("cpu")) is False


def test_meta_tensors_never_probe(monkeypatch):
    calls = _counting_addmm(monkeypatch, works=True)
    assert lst.mm_out_dtype(torch.device("meta")) is False
    assert calls == []
