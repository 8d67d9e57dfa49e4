"""Pallas (Triton lowering) flash-decoding kernel for absorbed MLA over a latent cache.

Grid (row, head block, split): each program streams its share of the row's cache once for all
heads of its block (MQA: every head reads the same latents), keeping online-softmax statistics
in fp32; a small JAX combine merges the splits. Twin: `reference.mla_decode_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret, is_pow2
from pallas_kernels.mla_decode.reference import validate_inputs
from pallas_kernels.mla_decode.tuning import MLADecodeBlocks

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(len_ref, q_ref, qp_ref, c_ref, o_ref, m_ref, l_ref, *, r, p, heads, sq, block_k, split_len,
            scale):
    hb, j = pl.program_id(1), pl.program_id(2)
    bh = q_ref.shape[0]
    length = len_ref[...]
    rows = hb * bh + jnp.arange(bh)
    t = jnp.minimum(rows // heads, sq - 1)
    limit = length - sq + t                                   # last visible slot per query row
    start = j * split_len
    stop = jnp.minimum(start + split_len, length)
    n_blocks = jnp.maximum(0, (stop - start + block_k - 1) // block_k)
    q = q_ref[...]
    qp = qp_ref[...]

    def body(i, carry):
        acc, m, l = carry
        base = start + i * block_k
        lat = c_ref[pl.ds(base, block_k), pl.ds(0, r)]             # [bk, R]
        pe = c_ref[pl.ds(base, block_k), pl.ds(r, p)]              # [bk, P]
        slot = base + jnp.arange(block_k)
        s = (jnp.dot(q, lat.T, preferred_element_type=jnp.float32)
             + jnp.dot(qp, pe.T, preferred_element_type=jnp.float32)) * scale
        s = jnp.where(slot[None, :] <= limit[:, None], s, _NEG)
        lat = jnp.where((slot < length)[:, None], lat, 0)          # stale slots never reach the output
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new[:, None])
        l = l * corr + jnp.sum(e, axis=1)
        acc = acc * corr[:, None] + jnp.dot(e.astype(lat.dtype), lat, preferred_element_type=jnp.float32)
        return acc, m_new, l

    init = (jnp.zeros((bh, r), jnp.float32), jnp.full((bh,), _NEG, jnp.float32), jnp.zeros((bh,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def mla_decode_pallas(q_lat, q_pe, cache, lengths, *, scale: float, blocks: MLADecodeBlocks = MLADecodeBlocks(),
                      interpret: bool | None = None):
    """Absorbed MLA attention over a latent cache, split over the sequence (flash-decoding).

    Args:
      q_lat: [B, Sq, H, R] queries folded into the latent space (q_nope @ W_UK).
      q_pe: [B, Sq, H, P] rope-part queries. cache: [B, S, R + P] latents | k_pe per slot.
      lengths: [B] int32 valid slots per row; query t of a row sees slots [0, lengths - Sq + t].
      scale: softmax scale. blocks: launch settings (S a multiple of block_k; R, P powers of two).
      interpret: run in interpret mode (default: off the GPU).
    Returns:
      [B, Sq, H, R] fp32, the attention-weighted latents (W_UV is applied by the caller).
    """
    validate_inputs(q_lat, q_pe, cache, lengths)
    b, sq, h, r = q_lat.shape
    p = q_pe.shape[3]
    s = cache.shape[1]
    bk = blocks.block_k
    if s % bk or not (is_pow2(r) and is_pow2(p)):
        raise ValueError(f"mla_decode: cache length {s} must be a multiple of block_k={bk}; R={r} and P={p} "
                         "powers of two")
    rows = sq * h
    bh = min(blocks.block_h, max(16, 1 << (rows - 1).bit_length()))
    n_hb = -(-rows // bh)
    pad = n_hb * bh - rows
    dtype = cache.dtype
    q = jnp.pad(q_lat.reshape(b, rows, r).astype(dtype), ((0, 0), (0, pad), (0, 0)))
    qp = jnp.pad(q_pe.reshape(b, rows, p).astype(dtype), ((0, 0), (0, pad), (0, 0)))
    splits = blocks.splits_for(b, n_hb, s)
    split_len = -(-(s // bk) // splits) * bk
    splits = -(-s // split_len)
    interpret = default_interpret() if interpret is None else interpret
    kernel = functools.partial(_kernel, r=r, p=p, heads=h, sq=sq, block_k=bk, split_len=split_len, scale=scale)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, n_hb, splits),
        in_specs=[
            pl.BlockSpec((None,), lambda i, hb, j: (i,)),
            pl.BlockSpec((None, bh, r), lambda i, hb, j: (i, hb, 0)),
            pl.BlockSpec((None, bh, p), lambda i, hb, j: (i, hb, 0)),
            pl.BlockSpec((None, s, r + p), lambda i, hb, j: (i, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bh, r), lambda i, hb, j: (i, j, hb, 0)),
            pl.BlockSpec((None, None, bh), lambda i, hb, j: (i, j, hb)),
            pl.BlockSpec((None, None, bh), lambda i, hb, j: (i, j, hb)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, splits, n_hb * bh, r), jnp.float32),
                   jax.ShapeDtypeStruct((b, splits, n_hb * bh), jnp.float32),
                   jax.ShapeDtypeStruct((b, splits, n_hb * bh), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="mla_decode",
    )(jnp.minimum(lengths, s).astype(jnp.int32), q, qp, cache)  # never read past the cache
    m_all = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - m_all)                                     # [B, splits, rows]
    l_all = jnp.sum(l * w, axis=1)
    out = jnp.sum(o * w[..., None], axis=1) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return out[:, :rows].reshape(b, sq, h, r)
