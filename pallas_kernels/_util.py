"""Small helpers shared by the kernels."""

from __future__ import annotations

import jax


def default_interpret() -> bool:
    """Pallas kernels run compiled on GPU and in interpret mode everywhere else (CPU CI)."""
    return jax.default_backend() != "gpu"


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0
