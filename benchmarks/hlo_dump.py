"""The XLA flags that dump the optimized HLO, which `profile_summary` maps kernels to the model's scopes
with. Imports no JAX: XLA reads its flags once, when the backend starts, so a benchmark calls this
before importing jax."""

from __future__ import annotations

import os


def request_hlo_dump(name: str, module_re: str) -> str:
    """Adds flags dumping the modules matching `module_re` as text into $OUT/name (OUT defaults to
    /tmp); returns that directory."""
    path = os.path.join(os.environ.get("OUT", "/tmp"), name)
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), f"--xla_dump_to={path}",
                                                      "--xla_dump_hlo_as_text", f"--xla_dump_hlo_module_re={module_re}"]))
    return path
