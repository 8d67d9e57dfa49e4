"""The README's Python example runs as written (on the built-in tiny K3)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_generation_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "k3jax.generate(" in b)
    exec(compile(example.replace('"path/to/checkpoint"', '"tiny-k3-random"'), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "GenerationTimings(" in printed and printed.count("\n") >= 4
