"""Kernels for the Kimi model family, each beside a pure-JAX twin.

This package takes arrays and small configs only; it knows nothing of `k3jax`.

    kda/         KDA sequence and decode ops (reference, pure-JAX forms, Pallas kernels)
    mla_decode/  absorbed MLA attention over a latent cache
    moe_gmm/     grouped matmul for routed experts
"""

from pallas_kernels.kda import kda, kda_decode, kda_recurrent_reference
from pallas_kernels.mla_decode import mla_decode_pallas, mla_decode_reference
from pallas_kernels.moe_gmm import grouped_matmul, grouped_matmul_reference

__all__ = ["kda", "kda_decode", "kda_recurrent_reference", "mla_decode_pallas", "mla_decode_reference",
           "grouped_matmul", "grouped_matmul_reference"]
