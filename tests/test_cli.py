"""The README's main command."""

from __future__ import annotations

import pytest

from k3jax.cli import main


def test_demo_runs_forward_and_greedy(capsys):
    assert main(["demo", "--prompt-len", "5", "--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "logits (1, 5, 512) float32" in out
    greedy = out.split("greedy ids: ")[1].splitlines()[0]
    assert len(eval(greedy)) == 3


def test_demo_rejects_bad_lengths():
    with pytest.raises(SystemExit):
        main(["demo", "--new-tokens", "0"])
