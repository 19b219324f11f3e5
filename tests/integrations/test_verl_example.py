"""``examples/verl_loss.py``: the registered losses called as verl's actor calls them equal
verl's own built-ins (issue 24)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("verl")

SCRIPT = Path(__file__).parents[2] / "examples" / "verl_loss.py"


def test_the_example_matches_verls_own_losses(capsys):
    spec = importlib.util.spec_from_file_location("verl_loss_example", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.main()
    assert {name for name, _, _ in rows} == {"vanilla", "gpg", "cispo", "gspo"}
    for name, d_loss, d_grad in rows:
        assert d_loss < 1e-12 and d_grad < 1e-12, name
    out = capsys.readouterr().out
    assert "logitless_ppo" in out and out.count("\n") == len(rows) + 1
