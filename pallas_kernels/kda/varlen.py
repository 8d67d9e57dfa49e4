"""KDA prefill over several sequences packed in one row (cumulative offsets), so a batch of unequal
prompts is not padded to the longest.

Packed inputs [1, T, H, ...] with `cu_seqlens` [S + 1] (sequence i is tokens cu[i]:cu[i+1]) are laid
out chunk-aligned: each sequence starts a fresh chunk, so the padding is under one chunk per sequence
(at most S chunks in all, a static bound) instead of (longest - length) tokens per sequence. The
intra-chunk kernel runs unchanged (chunks are independent); the sequential kernel starts each
sequence's first chunk from that sequence's initial state and writes the state after its last chunk
(`chunk._inter_varlen_kernel`). Padding positions carry g = beta = 0: no decay, no update.

Twin: `reference.kda_varlen_reference` (one token scan over the packed row, the state reset at every
sequence start); both equal running each sequence alone through `kda_recurrent_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._util import default_interpret
from pallas_kernels.kda.chunk import check_blocks, chunk_inter, chunk_intra, to_chunks
from pallas_kernels.kda.reference import validate_varlen
from pallas_kernels.kda.tuning import ChunkBlocks


class ChunkLayout:
    """Where each packed token lands when every sequence starts a fresh chunk (all int32, traced).

    n_chunks: the static bound ceil(T / C) + S. source [N * C]: the packed token at each padded
    position (T where padding). target [T]: the padded position of each packed token. first / last
    [N]: the sequence a chunk starts / ends, or -1. lengths [S]."""

    def __init__(self, cu_seqlens, total: int, chunk: int):
        seqs = cu_seqlens.shape[0] - 1
        self.n_chunks = -(-total // chunk) + seqs
        cu = cu_seqlens.astype(jnp.int32)
        self.lengths = cu[1:] - cu[:-1]
        per_seq = (self.lengths + chunk - 1) // chunk                           # chunks of each sequence
        end = jnp.cumsum(per_seq)
        start = end - per_seq
        chunks = jnp.arange(self.n_chunks, dtype=jnp.int32)
        owner = jnp.searchsorted(end, chunks, side="right").astype(jnp.int32)   # S past the last sequence
        owner_c = jnp.minimum(owner, seqs - 1)
        pos = jnp.arange(self.n_chunks * chunk, dtype=jnp.int32)
        seq_of = owner_c[pos // chunk]
        offset = (pos // chunk - start[seq_of]) * chunk + pos % chunk
        real = (owner[pos // chunk] < seqs) & (offset < self.lengths[seq_of])
        self.source = jnp.where(real, cu[seq_of] + offset, total)
        token = jnp.arange(total, dtype=jnp.int32)
        seq_t = jnp.searchsorted(cu[1:], token, side="right").astype(jnp.int32)
        self.target = start[seq_t] * chunk + token - cu[seq_t]
        has = (owner < seqs) & (per_seq[owner_c] > 0)
        self.first = jnp.where(has & (chunks == start[owner_c]), owner_c, -1)
        self.last = jnp.where(has & (chunks == end[owner_c] - 1), owner_c, -1)

    def pad(self, x):
        """[1, T, ...] -> [1, N * C, ...] (zeros at padding)."""
        x = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
        return x[:, self.source]


def kda_varlen_pallas(q, k, v, g, beta, cu_seqlens, *, scale=None, initial_state=None,
                      blocks: ChunkBlocks = ChunkBlocks(), interpret: bool | None = None):
    """Chunked KDA prefill of S packed sequences.

    Args:
      q, k: [1, T, H, K] L2-normalised. v: [1, T, H, V]. g: [1, T, H, K] log decay (<= 0).
      beta: [1, T, H]. cu_seqlens: [S + 1] int, 0 = cu[0] <= cu[1] <= .. <= cu[S] = T (checked when
        concrete). scale: q multiplier (default K^-1/2). initial_state: [S, H, K, V] or None (zeros).
      blocks / interpret: as `kda_chunk_pallas`.
    Returns:
      o [1, T, H, V] in v's dtype, final states [S, H, K, V] fp32 (a sequence of length 0 keeps
      its initial state).
    """
    validate_varlen(q, k, v, g, beta, cu_seqlens, initial_state)
    return _varlen(q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state, blocks=blocks,
                   interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def _varlen(q, k, v, g, beta, cu_seqlens, *, scale, initial_state, blocks: ChunkBlocks, interpret):
    _, t, h, kd = q.shape
    vd, seqs, c = v.shape[-1], cu_seqlens.shape[0] - 1, blocks.chunk
    blocks = blocks.resolve(jnp.dtype(v.dtype).name)
    check_blocks("kda_varlen_pallas", kd, vd, blocks)
    if blocks.inter != "fused":
        raise ValueError(f"kda_varlen_pallas: the sequential pass supports inter='fused' only, got {blocks.inter!r}")
    scale = kd ** -0.5 if scale is None else scale
    interpret = default_interpret() if interpret is None else interpret
    layout = ChunkLayout(cu_seqlens, t, c)
    parts = [to_chunks(layout.pad(x), c) for x in (q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32))]
    s0 = jnp.zeros((seqs, h, kd, vd), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    factors = chunk_intra(*parts, scale=scale, blocks=blocks, interpret=interpret)
    o, s = chunk_inter(*factors, s0, out_dtype=v.dtype, blocks=blocks, interpret=interpret,
                       bounds=(layout.first, layout.last))
    o = jnp.moveaxis(o.reshape(1, h, layout.n_chunks * c, vd), 1, 2)[:, layout.target]
    return o, jnp.where((layout.lengths > 0)[:, None, None, None], s, s0)
