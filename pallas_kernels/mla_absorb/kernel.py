"""The absorbed MLA projections of a decode step as few-row Pallas kernels (Triton lowering).

Both read the kv_b_proj kernel w [R, H * (nope + v)] (head-major, key part first) where it is
stored: head h's W_UK is the column block [h * (nope + v), + nope) and its W_UV the block after it;
no transposed, sliced or converted copy of the weight is made per step. Rows are the M = B * T
query tokens of a call, M <= ROWS (one 16-row tile, masked).

* `absorb_query_pallas`: q_lat[m, h] = q_nope[m, h] @ W_UK_h^T (fp32 accumulation), written with
  q_pe beside it as the [R + P]-wide query rows the latent-attention kernels read, in a token-padded
  layout (`padded_tokens`) so a Hopper query tile needs no padding copy. One program per (head,
  block of R); one more program can normalise the new latents (kv_a_layernorm) in the same launch,
  and write them straight into the latent cache at their slots (the cache aliased in and out).
* `absorb_value_pallas`: out[m, h] = lat[m, h] @ W_UV_h, either from the combined latents or from
  the per-split outputs and log-sum-exps of a split attention kernel (each split projected, then
  merged by its weight: the merge of the splits needs no launch of its own). One program per
  (head, block of V).

Twins: `reference.absorb_query_reference`, `reference.absorb_value_reference`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret, is_pow2, largest_block, next_pow2

ROWS = 16  # query tokens per call at most (B * T): one tile of the matrix units


@dataclass(frozen=True)
class AbsorbBlocks:
    """block_r: latent columns per query program; block_v: output columns per value program;
    block_k: latent columns per step of the value product; block_splits: attention splits per
    value product (its rows). 128 query programs and, at H = 32, 128 value programs (about one per
    SM of an H200); 132 splits (one row) in two products. block_k 128 (was 64): the value kernel at
    B = 1 took 3.1 against 4.4 us over one split and 4.0 against 5.1 us over 32
    (`benchmarks/mla_decode_step.py`)."""

    block_r: int = 128
    block_v: int = 32
    block_k: int = 128
    block_splits: int = 128
    num_warps: int = 4
    num_stages: int = 2


def padded_tokens(tokens: int, heads: int, multiple: int) -> int:
    """The fewest token slots >= tokens whose rows (slots x heads) are a multiple of `multiple`."""
    step = multiple // math.gcd(heads, multiple)
    return -(-tokens // step) * step


def absorb_refusal(rows: int, latent_dim: int, nope: int, v_dim: int) -> str | None:
    """Why the kernels cannot take these sizes (None: they can)."""
    if rows > ROWS:
        return f"{rows} query rows; at most {ROWS}"
    if not (is_pow2(nope) and nope >= 16):
        return f"nope width {nope} must be a power of two >= 16"
    if latent_dim % 16 or v_dim % 16:
        return f"latent width {latent_dim} and value width {v_dim} must be multiples of 16"
    return None


def _dot(x, w):
    """x @ w with fp32 accumulation. An fp32 x against a bf16 weight is split into two bf16 parts
    (high and low bits: ~16 mantissa bits), so the product keeps what an fp32 product would."""
    if x.dtype == w.dtype:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    if w.dtype == jnp.bfloat16:
        xf = x.astype(jnp.float32)
        hi = xf.astype(jnp.bfloat16)
        lo = (xf - hi.astype(jnp.float32)).astype(jnp.bfloat16)
        return (jnp.dot(hi, w, preferred_element_type=jnp.float32)
                + jnp.dot(lo, w, preferred_element_type=jnp.float32))
    dt = jnp.promote_types(x.dtype, w.dtype)
    return jnp.dot(x.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)


def _store_rows(ref, rows, lead: tuple, col, x, mask):
    """ref[rows[i], *lead, col + j] = x[i, j] where mask: rows [ROWS] any row indices (a scatter;
    every index an array or scalar, the form interpret mode stores)."""
    idx = (rows[:, None],) + lead + ((col + jnp.arange(x.shape[1], dtype=jnp.int32))[None, :],)
    plt.store(ref.at[idx], x.astype(ref.dtype), mask=mask)


def _copy_cols(src_ref, src_col, dst_ref, dst_rows, lead: tuple, dst_col, width: int, live):
    """dst[dst_rows, *lead, dst_col:+width] = src[rows, src_col:+width] for the live rows of a tile."""
    wide = next_pow2(width)
    mask = live[:, None] & (jnp.arange(wide) < width)[None, :]
    x = plt.load(src_ref.at[pl.ds(0, ROWS), pl.ds(src_col, wide)], mask=mask, other=0)
    _store_rows(dst_ref, dst_rows, lead, dst_col, x, mask)


def _query_kernel(*refs, heads, tokens, t_pad, nope, rope, v_dim, r, br, rows, q_col, kv_col, eps, latent,
                  into_cache):
    if into_cache:   # the latents go straight into the cache (aliased in and out) at their slots
        q_ref, w_ref, kv_ref, nw_ref, slot_ref, _, out_ref, lat_ref = refs
    elif latent:
        q_ref, w_ref, kv_ref, nw_ref, out_ref, lat_ref = refs
    else:
        q_ref, w_ref, out_ref = refs
    pid = pl.program_id(0)
    m = jnp.arange(ROWS, dtype=jnp.int32)
    live = m < rows
    blocks = r // br

    @pl.when(pid < heads * blocks)
    def _absorb():
        h, j = pid // blocks, pid % blocks
        head = q_col + h * (nope + rope)
        x = plt.load(q_ref.at[pl.ds(0, ROWS), pl.ds(head, nope)], mask=live[:, None], other=0)
        w = w_ref[pl.ds(pl.multiple_of(j * br, br), br), pl.ds(h * (nope + v_dim), nope)]   # W_UK_h rows [br, nope]
        dt = jnp.promote_types(x.dtype, w.dtype)
        y = lax.dot_general(x.astype(dt), w.astype(dt), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)                        # [ROWS, br]
        dst = (m // tokens) * t_pad + m % tokens                                       # token slot of row m
        _store_rows(out_ref, dst, (h,), j * br, y, jnp.broadcast_to(live[:, None], y.shape))

        @pl.when(j == 0)
        def _rope():
            _copy_cols(q_ref, head + nope, out_ref, dst, (h,), r, rope, live)

    if latent:
        @pl.when(pid == heads * blocks)
        def _norm():
            wide = next_pow2(r)
            cols = jnp.arange(wide) < r
            mask = live[:, None] & cols[None, :]
            x = plt.load(kv_ref.at[pl.ds(0, ROWS), pl.ds(kv_col, wide)], mask=mask, other=0).astype(jnp.float32)
            inv = lax.rsqrt(jnp.sum(x * x, axis=1) / r + eps)
            y = (x * inv[:, None]).astype(kv_ref.dtype).astype(jnp.float32)   # the model rounds in kv's dtype
            g = plt.load(nw_ref.at[pl.ds(0, wide)], mask=cols, other=0).astype(jnp.float32)
            if into_cache:   # row m -> cache[m // tokens, slot[m]]; slots outside [0, S) are dropped
                slot = plt.load(slot_ref.at[pl.ds(0, ROWS)], mask=live, other=-1)
                keep = live & (slot >= 0) & (slot < lat_ref.shape[1])
                dst, lead = m // tokens, (jnp.where(keep, slot, 0)[:, None],)
            else:            # row m -> latents[m]
                keep, dst, lead = live, m, ()
            _store_rows(lat_ref, dst, lead, 0, (g[None, :] * y).astype(kv_ref.dtype), keep[:, None] & cols[None, :])
            _copy_cols(kv_ref, kv_col + r, lat_ref, dst, lead, r, rope, keep)


@functools.partial(jax.jit, static_argnames=("heads", "tokens", "nope", "rope", "v_dim", "q_col", "multiple",
                                             "out_dtype", "kv_col", "eps", "blocks", "interpret"))
def absorb_query_pallas(q, w_kv_b, *, heads: int, tokens: int, nope: int, rope: int, v_dim: int, q_col: int = 0,
                        multiple: int = 1, out_dtype=None, kv=None, kv_col: int = 0, norm_weight=None,
                        eps: float = 1e-6, cache=None, slots=None, blocks: AbsorbBlocks = AbsorbBlocks(),
                        interpret: bool | None = None):
    """Absorbed decode queries, and optionally the normalised new latents, in one launch.

    Args:
      q: [M, C] rows holding each head's query [nope | rope] side by side from column q_col
        (M = B * T, row b * T + t; e.g. a fused projection's output, read in place).
      w_kv_b: kv_b_proj kernel [R, H * (nope + v_dim)].
      tokens: T, query tokens per batch row. multiple: the result's rows per batch row (token slots
        x heads) are padded to a multiple of this (`padded_tokens`); padding rows are not written.
      out_dtype: the queries' dtype (default q's); accumulation is fp32.
      kv, kv_col, norm_weight, eps: optional [M, C'] rows holding [c_kv (R) | k_pe (rope)] from
        column kv_col, and the kv_a_layernorm weight [R]: the latents are also returned, c_kv
        RMS-normalised (fp32, cast to kv's dtype, times the weight: the model's order).
      cache, slots: optional, with kv: the latent cache [B, S, R + rope] (updated in place inside a
        caller's jit, which should donate it; a copy when called eagerly) and each query row's slot
        [M] int32. Row m's latents are written to cache[m // T, slots[m]]
        (cast to the cache's dtype) instead of being returned; a slot outside [0, S) writes nothing.
    Returns:
      [B * T_pad, H, R + rope]: row b * T_pad + t, head h = [q_nope @ W_UK_h^T | q_pe]
      (T_pad = padded_tokens(T, H, multiple)); with kv also the latents [M, R + rope] in kv's dtype,
      or with cache the updated cache.
    """
    m, width = q.shape
    r, cols = w_kv_b.shape
    if m % tokens or cols != heads * (nope + v_dim) or width < q_col + heads * (nope + rope) or rope < 1:
        raise ValueError(f"absorbed queries: q {q.shape} (from column {q_col}) and w_kv_b {w_kv_b.shape} do not "
                         f"match {heads} heads of nope {nope} + rope and value {v_dim}, {tokens} tokens per row")
    if (why := absorb_refusal(m, r, nope, v_dim)) is not None:
        raise ValueError(f"absorbed queries: {why}")
    batch = m // tokens
    t_pad = padded_tokens(tokens, heads, multiple)
    br = largest_block(r, blocks.block_r)
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    out_shape = [jax.ShapeDtypeStruct((batch * t_pad, heads, r + rope), out_dtype)]
    operands = [q, w_kv_b]
    latent = kv is not None
    if latent:
        if kv.shape[0] != m or kv.shape[1] < kv_col + r + rope or norm_weight is None or norm_weight.shape != (r,):
            raise ValueError(f"absorbed queries: latents {kv.shape} from column {kv_col} need R + rope = {r + rope} "
                             f"columns and a norm weight [{r}]")
        operands += [kv, norm_weight]
        out_shape.append(jax.ShapeDtypeStruct((m, r + rope), kv.dtype))
    into_cache = cache is not None
    if into_cache:
        if not latent or slots is None or cache.ndim != 3 or cache.shape[0] != batch or cache.shape[2] != r + rope \
                or slots.shape != (m,):
            raise ValueError(f"absorbed queries: writing the latents needs kv, a cache [{batch}, S, {r + rope}] and "
                             f"slots [{m}]; got cache {None if cache is None else cache.shape} and slots "
                             f"{None if slots is None else slots.shape}")
        operands += [slots.astype(jnp.int32), cache]
        out_shape[-1] = jax.ShapeDtypeStruct(cache.shape, cache.dtype)
    kernel = functools.partial(_query_kernel, heads=heads, tokens=tokens, t_pad=t_pad, nope=nope, rope=rope,
                               v_dim=v_dim, r=r, br=br, rows=m, q_col=q_col, kv_col=kv_col, eps=eps, latent=latent,
                               into_cache=into_cache)
    outs = pl.pallas_call(
        kernel,
        grid=(heads * (r // br) + latent,),
        out_shape=out_shape,
        input_output_aliases={len(operands) - 1: 1} if into_cache else {},
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=default_interpret() if interpret is None else interpret,
        name="mla_absorb_query",
    )(*operands)
    return tuple(outs) if latent else outs[0]


def _value_kernel(*refs, heads, tokens, nope, v_dim, r, bv, bk, sb, splits, rows, combine):
    if combine:
        o_ref, lse_ref, w_ref, out_ref = refs
    else:
        o_ref, w_ref, out_ref = refs
    h, jv = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(jv * bv, bv), bv)
    w_col = h * (nope + v_dim) + nope + jv * bv

    def product(load, n_rows):
        """sum_k load(k) [n_rows, bk] @ W_UV_h[k-th block, this program's columns] -> [n_rows, bv] fp32."""
        def step(k, acc):
            w = w_ref[pl.ds(pl.multiple_of(k * bk, bk), bk), pl.ds(w_col, bv)]
            return acc + _dot(load(pl.ds(pl.multiple_of(k * bk, bk), bk)), w)
        return lax.fori_loop(0, r // bk, step, jnp.zeros((n_rows, bv), jnp.float32))

    if not combine:   # o: the combined latents [M, H, R]
        live = (jnp.arange(ROWS) < rows)[:, None]
        acc = product(lambda ks: plt.load(o_ref.at[pl.ds(0, ROWS), h, ks], mask=live, other=0), ROWS)
        plt.store(out_ref.at[pl.ds(0, ROWS), h, cols], acc.astype(out_ref.dtype), mask=live)
        return

    # o: per-split normalised outputs [B, S, rows, R], lse: their log-sum-exps (base 2) [B, S, rows];
    # query row t * H + h. Each split's latents are projected, then the splits are merged by weight.
    chunks = -(-splits // sb)

    def token(i, carry):
        b, row = lax.div(i, tokens), lax.rem(i, tokens) * heads + h

        def merge(c, acc):   # online over chunks of splits: the running sums rescale to each new top
            num, den, top = acc
            s = pl.ds(pl.multiple_of(c * sb, sb), sb)
            ok = (c * sb + jnp.arange(sb)) < splits
            lse = plt.load(lse_ref.at[b, s, row], mask=ok, other=-jnp.inf)
            new_top = jnp.maximum(top, jnp.max(lse))
            weight = jnp.exp2(lse - new_top)                                      # 0 for splits past the last
            keep = jnp.exp2(top - new_top)                                        # 0 before the first chunk
            part = product(lambda ks: plt.load(o_ref.at[b, s, row, ks], mask=ok[:, None], other=0), sb)
            return (num * keep + jnp.sum(weight[:, None] * part, axis=0), den * keep + jnp.sum(weight), new_top)

        init = (jnp.zeros((bv,), jnp.float32), jnp.float32(0), jnp.float32(-jnp.inf))
        num, den, _ = lax.fori_loop(0, chunks, merge, init)
        plt.store(out_ref.at[i, h, cols], (num / den).astype(out_ref.dtype))
        return carry

    lax.fori_loop(0, rows, token, 0)


@functools.partial(jax.jit, static_argnames=("heads", "tokens", "nope", "v_dim", "out_dtype", "blocks", "interpret"))
def absorb_value_pallas(o, w_kv_b, *, heads: int, tokens: int, nope: int, v_dim: int, lse=None, out_dtype=None,
                        blocks: AbsorbBlocks = AbsorbBlocks(), interpret: bool | None = None):
    """The value up-projection of absorbed attention, out[m, h] = lat[m, h] @ W_UV_h.

    Args:
      o: without lse, the attention-weighted latents [M, H, R] (M = B * T, row b * T + t). With lse,
        a split kernel's normalised per-split latents [B, S, rows, R] (query row t * H + h of batch
        row b; rows >= T * H) and lse [B, S, rows] fp32 their base-2 log-sum-exps: the latents are
        the splits merged by weight 2^lse (a split with lse = -huge weighs nothing).
      w_kv_b: kv_b_proj kernel [R, H * (nope + v_dim)]. tokens: T.
      out_dtype: result dtype (default o's); fp32 accumulation (an fp32 o against a bf16 weight
        keeps ~16 mantissa bits of o).
    Returns:
      [M, H, v_dim].
    """
    r, cols = w_kv_b.shape
    combine = lse is not None
    if combine:
        b, splits, q_rows, r_o = o.shape
        m = b * tokens
        ok = lse.shape == (b, splits, q_rows) and q_rows >= tokens * heads
    else:
        m, h_o, r_o = o.shape
        splits = 1
        ok = h_o == heads and m % tokens == 0
    if not ok or r_o != r or cols != heads * (nope + v_dim):
        raise ValueError(f"absorbed values: latents {o.shape}{'' if lse is None else f', lse {lse.shape}'} and "
                         f"w_kv_b {w_kv_b.shape} do not match {heads} heads, {tokens} tokens, value {v_dim}")
    if (why := absorb_refusal(m, r, nope, v_dim)) is not None:
        raise ValueError(f"absorbed values: {why}")
    bv, bk = largest_block(v_dim, blocks.block_v), largest_block(r, blocks.block_k)
    sb = max(16, min(blocks.block_splits, next_pow2(splits)))
    kernel = functools.partial(_value_kernel, heads=heads, tokens=tokens, nope=nope, v_dim=v_dim, r=r, bv=bv, bk=bk,
                               sb=sb, splits=splits, rows=m, combine=combine)
    return pl.pallas_call(
        kernel,
        grid=(heads, v_dim // bv),
        out_shape=jax.ShapeDtypeStruct((m, heads, v_dim), jnp.dtype(out_dtype or o.dtype)),
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=default_interpret() if interpret is None else interpret,
        name="mla_absorb_value",
    )(*((o, lse, w_kv_b) if combine else (o, w_kv_b)))
