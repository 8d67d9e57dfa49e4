"""The single import site for KDA: dispatches to an implementation by name."""

from __future__ import annotations

from pallas_kernels.kda.chunk import kda_chunk_pallas
from pallas_kernels.kda.decode import kda_decode
from pallas_kernels.kda.reference import kda_chunk_reference, kda_decode_reference, kda_recurrent_reference

KDA_IMPLS = ("chunked", "recurrent", "pallas")

__all__ = ["KDA_IMPLS", "kda", "kda_chunk_pallas", "kda_decode", "kda_decode_reference"]


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, impl: str = "chunked", chunk_size: int = 64):
    """KDA over a sequence. Shapes as in `kda_recurrent_reference`; returns (o [B,T,H,V], state [B,H,K,V] fp32).

    impl: "chunked" (pure-JAX WY form), "recurrent" (token loop; the reference) or "pallas"
    (the two-kernel chunked prefill; chunk_size is its chunk, a power of two).
    """
    if impl == "pallas":
        from pallas_kernels.kda.tuning import ChunkBlocks
        return kda_chunk_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                blocks=ChunkBlocks(chunk=chunk_size))
    if impl == "chunked":
        return kda_chunk_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   chunk_size=chunk_size)
    if impl == "recurrent":
        return kda_recurrent_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    raise ValueError(f"kda: unknown impl {impl!r}; expected one of {KDA_IMPLS}")
