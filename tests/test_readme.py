"""The README's Python example runs as written (on a checkpoint directory of the built-in tiny K3's
first four layers)."""

from __future__ import annotations

import re
from pathlib import Path

from checkpoints import builtin_checkpoint

README = Path(__file__).resolve().parent.parent / "README.md"


def test_generation_example_runs(tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "k3jax.generate(" in b)
    checkpoint = builtin_checkpoint(tmp_path / "checkpoint", "tiny-k3-random", 4)
    exec(compile(example.replace('"path/to/checkpoint"', repr(str(checkpoint))), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "GenerationTimings(" in printed and printed.count("\n") >= 4
