"""Small helpers shared by the kernels."""

from __future__ import annotations

import jax


def default_interpret() -> bool:
    """Pallas kernels run compiled on GPU and in interpret mode everywhere else (CPU CI)."""
    return jax.default_backend() != "gpu"


SM_COUNT = 132   # streaming multiprocessors of an H100 / H200 SXM: one wave of one-program-per-SM launches


def multiprocessor_count(default: int = SM_COUNT) -> int:
    """Streaming multiprocessors of the first device (SM_COUNT where the backend does not say, e.g. on the
    CPU, where launch settings do not matter)."""
    count = getattr(jax.devices()[0], "core_count", None)
    return int(count) if isinstance(count, int) and count > 0 else default


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): a block that covers n lanes with masked loads."""
    return 1 << max(0, n - 1).bit_length()


def largest_block(dim: int, block: int) -> int | None:
    """The largest power of two in [16, block] dividing dim (None when dim is not a multiple of 16)."""
    b = block
    while b >= 16 and dim % b:
        b //= 2
    return b if b >= 16 else None


def tiles_by_16(k_dim: int, n_dim: int) -> bool:
    """Whether a [K, N] weight can run in the row-tiled kernels: both sides multiples of 16."""
    return k_dim % 16 == 0 and n_dim % 16 == 0
