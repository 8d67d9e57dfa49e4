"""Kernels for the Kimi model family, each with a pure-JAX reference twin.

This package takes arrays and small configs only; it knows nothing of `k3jax`.
"""

from pallas_kernels.kda import kda, kda_chunk_reference, kda_recurrent_reference

__all__ = ["kda", "kda_chunk_reference", "kda_recurrent_reference"]
