"""The single import site for MLA decode attention: dispatches by implementation name."""

from __future__ import annotations

from pallas_kernels.mla_decode.kernel import mla_decode_pallas
from pallas_kernels.mla_decode.reference import mla_decode_reference
from pallas_kernels.mla_decode.tuning import MLADecodeBlocks

MLA_DECODE_IMPLS = ("reference", "pallas")


def mla_decode(q_lat, q_pe, cache, lengths, *, scale: float, impl: str = "pallas",
               blocks: MLADecodeBlocks = MLADecodeBlocks(), interpret: bool | None = None):
    """Absorbed MLA decode attention; see `mla_decode_reference` for the contract."""
    if impl == "reference":
        return mla_decode_reference(q_lat, q_pe, cache, lengths, scale=scale)
    if impl == "pallas":
        return mla_decode_pallas(q_lat, q_pe, cache, lengths, scale=scale, blocks=blocks, interpret=interpret)
    raise ValueError(f"mla_decode: unknown impl {impl!r}; expected one of {MLA_DECODE_IMPLS}")
