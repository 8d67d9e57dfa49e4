"""The dispatch site of the KDA ops: each implementation choice is named here, once.

    kda(q, k, v, g, beta, impl=...)                 a whole sequence (prefill, chunked prefill)
    kda_varlen(q, k, v, g, beta, cu_seqlens, impl=) several sequences packed in one row
    kda_decode(inputs, weights, conv, state, impl=) one fused decode step
"""

from __future__ import annotations

from typing import Literal, get_args

import jax

from pallas_kernels.kda.chunk import kda_chunk_pallas
from pallas_kernels.kda.chunk_xla import kda_chunk_xla
from pallas_kernels.kda.decode import kda_decode_pallas
from pallas_kernels.kda.decode_hopper import HopperDecodeBlocks, kda_decode_hopper
from pallas_kernels.kda.decode_xla import kda_decode_xla
from pallas_kernels.kda.gate import l2_normalize
from pallas_kernels.kda.params import KDADecodeInputs, KDADecodeWeights
from pallas_kernels.kda.reference import kda_recurrent_reference, kda_varlen_reference
from pallas_kernels.kda.tuning import ChunkBlocks, DecodeBlocks
from pallas_kernels.kda.varlen import kda_varlen_pallas

# "chunked": pure-JAX WY form; "recurrent": token loop (the reference); "pallas": the Pallas chunked prefill.
KDAImpl = Literal["chunked", "recurrent", "pallas"]
KDA_IMPLS: tuple[str, ...] = get_args(KDAImpl)
# "pallas": the chunked kernels over chunk-aligned sequences; "recurrent": token loop with resets (the reference).
KDAVarlenImpl = Literal["pallas", "recurrent"]
KDA_VARLEN_IMPLS: tuple[str, ...] = get_args(KDAVarlenImpl)
# "xla": the fused step in pure JAX (the kernels' twin); "pallas": one fused kernel (Triton lowering); "hopper": one
# fused kernel in Mosaic GPU, persistent programs streaming the states through a TMA ring (`decode_hopper.py`; K a
# multiple of 64; several tokens per call run "pallas"'s kernel: `decode_steps`).
KDADecodeImpl = Literal["xla", "pallas", "hopper"]
KDA_DECODE_IMPLS: tuple[str, ...] = get_args(KDADecodeImpl)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, impl: KDAImpl = "chunked", chunk_size: int = 64,
        normalize_qk: bool = False):
    """KDA over a sequence.

    Args:
      q, k: [B, T, H, K] L2-normalised, or with `normalize_qk` not yet (normalised here: inside the Pallas
        kernels where they allow it, else by `l2_normalize` first). v: [B, T, H, V]. g: [B, T, H, K] log
        decay (<= 0). beta: [B, T, H] in (0, 1). scale: q multiplier (default K^-1/2).
      initial_state: [B, H, K, V] or None (zeros).
      impl: one of KDA_IMPLS. chunk_size: tokens per chunk of the chunked forms (a power of two
        for "pallas").
    Returns:
      (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32)
    """
    if impl == "pallas":
        return kda_chunk_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                blocks=ChunkBlocks(chunk=chunk_size), normalize_qk=normalize_qk)
    if impl in KDA_IMPLS and normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    if impl == "chunked":
        return kda_chunk_xla(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size)
    if impl == "recurrent":
        return kda_recurrent_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    raise ValueError(f"kda: unknown impl {impl!r}; expected one of {KDA_IMPLS}")


def kda_varlen(q, k, v, g, beta, cu_seqlens, *, scale=None, initial_state=None, impl: KDAVarlenImpl = "pallas",
               chunk_size: int = 64):
    """KDA over S sequences packed in one row (sequence i = tokens cu_seqlens[i]:cu_seqlens[i+1]).

    Args:
      q, k: [1, T, H, K] L2-normalised (no `normalize_qk` here yet: no caller packs raw q, k).
      v: [1, T, H, V]. g: [1, T, H, K] log decay. beta: [1, T, H].
      cu_seqlens: [S + 1] int offsets from 0 to T. initial_state: [S, H, K, V] or None (zeros).
      impl: one of KDA_VARLEN_IMPLS. chunk_size: tokens per chunk ("pallas", a power of two).
    Returns:
      (o [1, T, H, V] in v's dtype, final states [S, H, K, V] fp32)
    """
    if impl == "pallas":
        return kda_varlen_pallas(q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state,
                                 blocks=ChunkBlocks(chunk=chunk_size))
    if impl == "recurrent":
        return kda_varlen_reference(q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state)
    raise ValueError(f"kda_varlen: unknown impl {impl!r}; expected one of {KDA_VARLEN_IMPLS}")


def kda_decode(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array, state: jax.Array, *,
               impl: KDADecodeImpl = "xla", blocks: DecodeBlocks | HopperDecodeBlocks | None = None,
               interpret: bool | None = None):
    """One KDA decode step per row (conv, gates, delta rule and output norm fused).

    Args:
      inputs: KDADecodeInputs of this token. weights: the layer's KDADecodeWeights.
      conv_state: [B, W-1, 3, H, K]. state: [B, H, K, V] fp32 or bf16 (the math in fp32).
      impl: one of KDA_DECODE_IMPLS. blocks: launch settings of the kernel impl names (DecodeBlocks for
        "pallas", HopperDecodeBlocks for "hopper"; None: its defaults). interpret: kernels only.
    Returns:
      (out [B, H, K], new conv_state, new state in state's dtype)
    """
    if impl not in KDA_DECODE_IMPLS:
        raise ValueError(f"kda_decode: unknown impl {impl!r}; expected one of {KDA_DECODE_IMPLS}")
    wanted = {"pallas": DecodeBlocks, "hopper": HopperDecodeBlocks}.get(impl)
    if blocks is not None and not isinstance(blocks, wanted or ()):
        raise TypeError(f"kda_decode: impl {impl!r} takes "
                        f"{wanted.__name__ + ' or None' if wanted else 'no blocks'}, got {type(blocks).__name__}")
    if impl == "pallas":
        return kda_decode_pallas(inputs, weights, conv_state, state, blocks=blocks or DecodeBlocks(),
                                 interpret=interpret)
    if impl == "hopper":
        return kda_decode_hopper(inputs, weights, conv_state, state, blocks=blocks or HopperDecodeBlocks(),
                                 interpret=interpret)
    return kda_decode_xla(inputs, weights, conv_state, state)
