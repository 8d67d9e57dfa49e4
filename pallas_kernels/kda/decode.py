"""Fused KDA decode steps as Pallas kernels (Triton lowering): per (row, head) program, the conv
window update + SiLU, q/k L2 norm, forget gate, beta, delta-rule update of the fp32 [K, V] state
(in place) and the sigmoid-gated output RMSNorm. `kda_decode_pallas` runs one token (twin:
`decode_xla.kda_decode_xla`); `kda_decode_steps_pallas` runs T tokens with the state kept on chip
(twin: the scan of one-token steps in `decode_steps.kda_decode_steps`).

The one-token kernel can split each head's state into `value_blocks` column blocks, one program
each (`DecodeBlocks.value_blocks_for`): the delta rule is independent per state column, so a
program needs only its [K, V / n] slice (q, k and the decay are recomputed per program, cheaply).
The output norm is over a head's whole V, so the split kernel writes the un-normalised output and
the gated norm runs after it as one XLA fusion; every program reads the head's whole q/k conv
history, so the new conv state goes to a fresh buffer (not in place).

Or one program per (row, head) walks the state in a loop of column blocks (`DecodeBlocks.column_block`):
the same launch, outputs and in-place writes as the whole-state kernel, with one block of the state held
at a time (fewer registers, more programs per SM).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret, is_pow2
from pallas_kernels.kda.decode_xla import validate_decode_inputs
from pallas_kernels.kda.gate import forget_gate, gated_rms_norm, l2_normalize
from pallas_kernels.kda.params import KDADecodeInputs, KDADecodeWeights
from pallas_kernels.kda.tuning import DecodeBlocks


def _conv_silu(x, hist, taps, width):
    """Short causal conv + SiLU of one channel block: x [C] this token's pre-conv input, hist
    [W-1][C] the previous inputs (oldest first), taps [W, C]. -> [C] in x's dtype."""
    f32 = jnp.float32
    pre = taps[width - 1].astype(f32) * x.astype(f32)
    for j in range(width - 1):
        pre += taps[j].astype(f32) * hist[j].astype(f32)
    return jax.nn.silu(pre).astype(x.dtype)


def _rule_factors(q_act, k_act, f, dt, a, beta_logit, *, lower_bound, scale):
    """What every state column's update shares: q_act, k_act [K] conv outputs, f / dt [K] ->
    (q scaled and normalised, k normalised, the decay e^g, beta), fp32."""
    f32 = jnp.float32
    q, k = l2_normalize(q_act) * scale, l2_normalize(k_act)
    g = forget_gate(f.astype(f32) + dt.astype(f32), a, lower_bound)
    return q, k, jnp.exp(g), jax.nn.sigmoid(beta_logit.astype(f32))


def _state_update(k, decay, beta, v, s):
    """The delta rule's new state for a block of columns: k, decay [K], beta (scalar), v [Vb], s [K, Vb] fp32 ->
    s [K, Vb]."""
    s = s * decay[:, None]                                   # [K, Vb]
    pred = jnp.sum(s * k[:, None], axis=0)                   # [Vb]
    return s + k[:, None] * (beta * (v.astype(jnp.float32) - pred))[None, :]


def _column_update(q, k, decay, beta, v, s):
    """The delta rule on a block of state columns: q, k, decay [K], v [Vb], s [K, Vb] fp32 ->
    (o [Vb] fp32, new s)."""
    s = _state_update(k, decay, beta, v, s)
    return jnp.sum(s * q[:, None], axis=0), s


def _delta_rule(q_act, k_act, v, f, dt, a, beta_logit, s, *, lower_bound, scale):
    """The state update and raw output of one (row, head) over a block of state columns: q_act,
    k_act [K] conv outputs, v [Vb], f / dt [K], s [K, Vb] fp32. -> (o [Vb] fp32, new s)."""
    factors = _rule_factors(q_act, k_act, f, dt, a, beta_logit, lower_bound=lower_bound, scale=scale)
    return _column_update(*factors, v, s)


def _token(x, hist, w_refs, f, dt, a, beta_logit, z, nw, s, *, width, lower_bound, norm_eps, scale,
           store_state=None):
    """One token of one (row, head): x [3][K] pre-conv q | k | v, hist [3][W-1][K] the previous
    pre-conv inputs (oldest first), w_refs the q, k, v taps [W, K], a = exp(A_log) fp32 ([1] or
    [K]), s [K, V] fp32. Returns (out [K] in x's dtype, new s). store_state(new s), if given, runs right after
    the update, before the output's reductions."""
    dtype = x[0].dtype
    q, k, v = (_conv_silu(x[i], hist[i], [w_ref[j, :] for j in range(width)], width) for i, w_ref in enumerate(w_refs))
    q, k, decay, beta = _rule_factors(q, k, f, dt, a, beta_logit, lower_bound=lower_bound, scale=scale)
    s = _state_update(k, decay, beta, v, s)
    if store_state is not None:
        store_state(s)
    o = jnp.sum(s * q[:, None], axis=0)
    return gated_rms_norm(o.astype(dtype), z, nw, norm_eps).astype(dtype), s


def _decode_kernel(x_ref, conv_ref, wq_ref, wk_ref, wv_ref, f_ref, dt_ref, a_log_ref, b_ref, z_ref, nw_ref, s_ref,
                   out_ref, conv_out_ref, s_out_ref, *, width, **settings):
    """One token of one (row, head). conv_out_ref and s_out_ref may alias conv_ref and s_ref: both
    blocks are read whole before anything is written back.

    The order is chosen for the state's traffic: its load is issued first, and it is stored as soon as it is
    updated, before the output's reductions (in the PTX the output's barriers now follow the store); the conv
    window is stored before the state is touched. H200, H = 32 (RESULTS.md, KDA decode runs 5-7): B = 8 32-39 ->
    29-31 us per layer; B = 1, 64 and 256 within the run-to-run spread."""
    s = s_ref[...].astype(jnp.float32)
    x = [x_ref[i, :] for i in range(3)]
    hist = [[conv_ref[j, i, :] for j in range(width - 1)] for i in range(3)]
    for i in range(3):
        window = hist[i][1:] + [x[i]]
        for j in range(width - 1):
            conv_out_ref[j, i, :] = window[j]
    a = jnp.exp(a_log_ref[...].astype(jnp.float32))

    def store_state(new):
        s_out_ref[...] = new.astype(s_out_ref.dtype)

    out, _ = _token(x, hist, (wq_ref, wk_ref, wv_ref), f_ref[...], dt_ref[...], a, b_ref[...], z_ref[...],
                    nw_ref[...], s, width=width, store_state=store_state, **settings)
    out_ref[...] = out.astype(out_ref.dtype)


def _column_loop_kernel(x_ref, conv_ref, wq_ref, wk_ref, wv_ref, f_ref, dt_ref, a_log_ref, b_ref, z_ref, nw_ref,
                        s_ref, out_ref, conv_out_ref, s_out_ref, *, width, block_v, lower_bound, norm_eps, scale):
    """`_decode_kernel` with the state walked in a loop of block_v-column blocks (`DecodeBlocks.column_block`):
    each step reads its columns of the state and of v's conv inputs, updates them and writes them back, so a
    program holds one block of the state instead of all of it. The raw output collects in a [V] vector
    (each block placed by a one-hot product) for the norm after the loop. s_out_ref may alias s_ref (a block
    is read before it is written; blocks are disjoint); conv_out_ref may alias conv_ref (written last)."""
    vd = s_ref.shape[1]
    hist = [[conv_ref[j, i, :] for j in range(width - 1)] for i in range(2)]
    x = [x_ref[i, :] for i in range(2)]
    q, k = (_conv_silu(x[i], hist[i], [w_ref[j, :] for j in range(width)], width)
            for i, w_ref in enumerate((wq_ref, wk_ref)))
    a = jnp.exp(a_log_ref[...].astype(jnp.float32))
    q, k, decay, beta = _rule_factors(q, k, f_ref[...], dt_ref[...], a, b_ref[...], lower_bound=lower_bound,
                                      scale=scale)
    place = jnp.arange(block_v)[:, None]

    def column_block(c, o_all):
        cols = pl.ds(pl.multiple_of(c * block_v, block_v), block_v)
        v = _conv_silu(x_ref[2, cols], [conv_ref[j, 2, cols] for j in range(width - 1)],
                       [wv_ref[j, cols] for j in range(width)], width)
        o, s = _column_update(q, k, decay, beta, v, s_ref[:, cols].astype(jnp.float32))
        s_out_ref[:, cols] = s.astype(s_out_ref.dtype)
        at = jnp.arange(vd)[None, :] == c * block_v + place                     # [Vb, V] one-hot
        return o_all + jnp.sum(jnp.where(at, o[:, None], 0.0), axis=0)

    o = jax.lax.fori_loop(0, vd // block_v, column_block, jnp.zeros((vd,), jnp.float32))
    dtype = x_ref.dtype
    out_ref[...] = gated_rms_norm(o.astype(dtype), z_ref[...], nw_ref[...], norm_eps).astype(out_ref.dtype)
    windows = [hist[i][1:] + [x[i]] for i in range(2)] + [
        [conv_ref[j, 2, :] for j in range(1, width - 1)] + [x_ref[2, :]]]
    for i in range(3):
        for j in range(width - 1):
            conv_out_ref[j, i, :] = windows[i][j]


def _split_kernel(x_ref, conv_ref, wq_ref, wk_ref, wv_ref, f_ref, dt_ref, a_log_ref, b_ref, s_ref,
                  o_ref, conv_out_ref, s_out_ref, *, width, block_v, lower_bound, scale):
    """One token of one (row, head, state column block): the raw output block o [Vb] (un-normalised,
    in x's dtype) and the block's new state columns. conv_out_ref is a fresh buffer (every program of
    the head reads the whole q and k history): block j writes its v columns, block 0 q and k too.
    s_out_ref may alias s_ref (each program reads its own block whole before writing it)."""
    cols = pl.ds(pl.multiple_of(pl.program_id(2) * block_v, block_v), block_v)
    q = _conv_silu(x_ref[0, :], [conv_ref[j, 0, :] for j in range(width - 1)],
                   [wq_ref[j, :] for j in range(width)], width)
    k = _conv_silu(x_ref[1, :], [conv_ref[j, 1, :] for j in range(width - 1)],
                   [wk_ref[j, :] for j in range(width)], width)
    x_v = x_ref[2, cols]
    hist_v = [conv_ref[j, 2, cols] for j in range(width - 1)]
    v = _conv_silu(x_v, hist_v, [wv_ref[j, cols] for j in range(width)], width)
    a = jnp.exp(a_log_ref[...].astype(jnp.float32))
    o, s = _delta_rule(q, k, v, f_ref[...], dt_ref[...], a, b_ref[...], s_ref[...].astype(jnp.float32),
                       lower_bound=lower_bound, scale=scale)
    s_out_ref[...] = s.astype(s_out_ref.dtype)
    o_ref[...] = o.astype(o_ref.dtype)
    window_v = hist_v[1:] + [x_v]
    for j in range(width - 1):
        conv_out_ref[j, 2, cols] = window_v[j]

    @pl.when(pl.program_id(2) == 0)
    def _():
        for i in range(2):
            window = [conv_ref[j, i, :] for j in range(1, width - 1)] + [x_ref[i, :]]
            for j in range(width - 1):
                conv_out_ref[j, i, :] = window[j]


def _steps_kernel(keep_ref, x_ref, conv_ref, wq_ref, wk_ref, wv_ref, f_ref, dt_ref, a_log_ref, b_ref, z_ref, nw_ref,
                  s_ref, out_ref, *state_out_refs, steps, width, **settings):
    """T tokens of one (row, head) with the state held on chip; the conv window and state advance
    over the first keep tokens only and are written when `state_out_refs` (conv, state) are given
    (outputs-only calls, the speculative verify, write nothing else). The state outputs may alias
    conv_ref and s_ref: both are read whole before the token loop."""
    keep = keep_ref[...]
    hist = [[conv_ref[j, i, :] for j in range(width - 1)] for i in range(3)]
    s = s_ref[...].astype(jnp.float32)
    dt, a, nw = dt_ref[...], jnp.exp(a_log_ref[...].astype(jnp.float32)), nw_ref[...]
    for t in range(steps):
        x = [x_ref[t, i, :] for i in range(3)]
        out, s_new = _token(x, hist, (wq_ref, wk_ref, wv_ref), f_ref[t, :], dt, a, b_ref[t], z_ref[t, :], nw, s,
                            width=width, **settings)
        out_ref[t, :] = out.astype(out_ref.dtype)
        advance = t < keep
        s_new = s_new.astype(s_ref.dtype).astype(jnp.float32)   # a bf16 state is rounded after every token,
        s = jnp.where(advance, s_new, s)                          # as T one-token steps would store it
        hist = [[jnp.where(advance, new, old) for new, old in zip(h[1:] + [xi], h)] for h, xi in zip(hist, x)]
    if not state_out_refs:
        return
    conv_out_ref, s_out_ref = state_out_refs
    for i in range(3):
        for j in range(width - 1):
            conv_out_ref[j, i, :] = hist[i][j]
    s_out_ref[...] = s.astype(s_out_ref.dtype)


def _weight_specs(weights: KDADecodeWeights, h: int, kd: int) -> tuple[pl.BlockSpec, pl.BlockSpec, pl.BlockSpec]:
    """Grid (row, head, ...) blocks of one conv tap array ([W, K] of the head), dt_bias and a_log (the
    head's row, or the one row every head shares); later grid axes (column blocks) do not move them."""
    a_rows, a_cols = weights.a_log.shape
    return (pl.BlockSpec((weights.q_conv.shape[0], None, kd), lambda i, j, *_: (0, j, 0)),
            pl.BlockSpec((None, kd), lambda i, j, *_: (j, 0)),
            pl.BlockSpec((None, a_cols), (lambda i, j, *_: (j, 0)) if a_rows == h else (lambda i, j, *_: (0, 0))))


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def kda_decode_pallas(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array, state: jax.Array,
                      *, blocks: DecodeBlocks = DecodeBlocks(), interpret: bool | None = None):
    """Fused KDA decode step as one kernel; same contract as `kda_decode_xla`. The state (fp32 or
    bf16, read and written in its dtype, the math in fp32) is updated in place (input/output
    aliased), and so is the conv state unless the heads are split into column blocks
    (`blocks.value_blocks_for`): donate both to avoid copies.

    Args:
      inputs: KDADecodeInputs (x_qkv [B, 3, H, K], f [B, H, K], beta_logit [B, H], z [B, H, K]).
      weights: KDADecodeWeights of the layer (K a power of two).
      conv_state: [B, W-1, 3, H, K]. state: [B, H, K, K] fp32 or bf16.
      blocks: launch settings. interpret: run in interpret mode (default: off the GPU).
    Returns:
      (out [B, H, K], new conv_state, new state in state's dtype)
    """
    validate_decode_inputs(inputs, weights, conv_state, state)
    b, _, h, kd = inputs.x_qkv.shape
    width = weights.q_conv.shape[0]
    if not is_pow2(kd):
        raise ValueError(f"kda_decode_pallas: the head dim must be a power of two, got {kd}")
    scale = kd ** -0.5 if weights.scale is None else weights.scale
    interpret = default_interpret() if interpret is None else interpret
    splits = blocks.value_blocks_for(b, h, kd)
    if splits > 1 and blocks.column_block:
        raise ValueError(f"kda_decode_pallas: column_block={blocks.column_block} does not combine with the "
                         f"{splits} column blocks per head that value_blocks/split_from chose")
    if splits > 1:
        return _decode_split(inputs, weights, conv_state, state, splits=splits, scale=scale, blocks=blocks,
                             interpret=interpret)
    if blocks.column_block and kd % blocks.column_block:
        raise ValueError(f"kda_decode_pallas: column_block={blocks.column_block} does not divide V={kd}")
    settings = dict(width=width, lower_bound=weights.lower_bound, norm_eps=weights.norm_eps, scale=scale)
    if blocks.column_block and blocks.column_block < kd:
        kernel = functools.partial(_column_loop_kernel, block_v=blocks.column_block, **settings)
    else:
        kernel = functools.partial(_decode_kernel, **settings)
    row_head = lambda i, j: (i, j, 0)
    tap, dt_spec, a_spec = _weight_specs(weights, h, kd)
    out, new_conv, new_state = pl.pallas_call(
        kernel,
        grid=(b, h),
        in_specs=[
            pl.BlockSpec((None, 3, None, kd), lambda i, j: (i, 0, j, 0)),             # x_qkv
            pl.BlockSpec((None, width - 1, 3, None, kd), lambda i, j: (i, 0, 0, j, 0)),  # conv_state
            tap, tap, tap,                                                            # q, k, v conv
            pl.BlockSpec((None, None, kd), row_head),                                 # f
            dt_spec, a_spec,                                                          # dt_bias, a_log
            pl.BlockSpec((None, None), lambda i, j: (i, j)),                          # beta_logit
            pl.BlockSpec((None, None, kd), row_head),                                 # z
            pl.BlockSpec((kd,), lambda i, j: (0,)),                                   # o_norm_w
            pl.BlockSpec((None, None, kd, kd), lambda i, j: (i, j, 0, 0)),            # state
        ],
        out_specs=[
            pl.BlockSpec((None, None, kd), row_head),
            pl.BlockSpec((None, width - 1, 3, None, kd), lambda i, j: (i, 0, 0, j, 0)),
            pl.BlockSpec((None, None, kd, kd), lambda i, j: (i, j, 0, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, h, kd), inputs.x_qkv.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={1: 1, 11: 2},
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode",
    )(inputs.x_qkv, conv_state, *weights.conv_taps, inputs.f, weights.dt_bias, weights.a_log, inputs.beta_logit,
      inputs.z, weights.o_norm_w, state)
    return out, new_conv, new_state


def _decode_split(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array, state: jax.Array, *,
                  splits: int, scale: float, blocks: DecodeBlocks, interpret: bool):
    """kda_decode_pallas over grid (row, head, column block); the gated norm after it in XLA."""
    b, _, h, kd = inputs.x_qkv.shape
    width = weights.q_conv.shape[0]
    bv = kd // splits
    head = lambda i, j, c: (i, 0, j, 0)
    conv_spec = pl.BlockSpec((None, width - 1, 3, None, kd), lambda i, j, c: (i, 0, 0, j, 0))
    tap, dt_spec, a_spec = _weight_specs(weights, h, kd)
    state_spec = pl.BlockSpec((None, None, kd, bv), lambda i, j, c: (i, j, 0, c))
    kernel = functools.partial(_split_kernel, width=width, block_v=bv, lower_bound=weights.lower_bound, scale=scale)
    raw, new_conv, new_state = pl.pallas_call(
        kernel,
        grid=(b, h, splits),
        in_specs=[
            pl.BlockSpec((None, 3, None, kd), head),                                  # x_qkv
            conv_spec,                                                                # conv_state
            tap, tap, tap,                                                            # q, k, v conv
            pl.BlockSpec((None, None, kd), lambda i, j, c: (i, j, 0)),                # f
            dt_spec, a_spec,                                                          # dt_bias, a_log
            pl.BlockSpec((None, None), lambda i, j, c: (i, j)),                       # beta_logit
            state_spec,                                                               # state
        ],
        out_specs=[
            pl.BlockSpec((None, None, bv), lambda i, j, c: (i, j, c)),
            conv_spec,
            state_spec,
        ],
        out_shape=[jax.ShapeDtypeStruct((b, h, kd), inputs.x_qkv.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={9: 2},
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_split",
    )(inputs.x_qkv, conv_state, *weights.conv_taps, inputs.f, weights.dt_bias, weights.a_log, inputs.beta_logit,
      state)
    out = gated_rms_norm(raw, inputs.z, weights.o_norm_w, weights.norm_eps).astype(inputs.x_qkv.dtype)
    return out, new_conv, new_state


@functools.partial(jax.jit, static_argnames=("outputs_only", "blocks", "interpret"))
def kda_decode_steps_pallas(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array,
                            state: jax.Array, keep: jax.Array, *, outputs_only: bool = False,
                            blocks: DecodeBlocks = DecodeBlocks(), interpret: bool | None = None):
    """T fused decode steps per row in one kernel (speculative verify and commit): per (row, head)
    program the state stays on chip across the T tokens; row b's conv window and state advance over
    its first keep[b] tokens only. Same contract as `decode_steps.kda_decode_steps`.

    Args:
      inputs: KDADecodeInputs with a token axis (x_qkv [B, T, 3, H, K], f [B, T, H, K],
        beta_logit [B, T, H], z [B, T, H, K]). weights: KDADecodeWeights (K a power of two).
      conv_state: [B, W-1, 3, H, K] (aliased to the output conv state). state: [B, H, K, K] fp32 or
        bf16 (aliased to the output state; read and written in its dtype, the math in fp32).
      keep: [B] int32 in 0..T.
      outputs_only: write only `out` (the verify step: no state traffic, no aliasing); keep is then
        unused.
    Returns:
      (out [B, T, H, K], conv_state and state after each row's kept tokens), or out alone.
    """
    b, t, _, h, kd = inputs.x_qkv.shape
    width = weights.q_conv.shape[0]
    if not is_pow2(kd):
        raise ValueError(f"kda_decode_steps_pallas: the head dim must be a power of two, got {kd}")
    scale = kd ** -0.5 if weights.scale is None else weights.scale
    interpret = default_interpret() if interpret is None else interpret
    kernel = functools.partial(_steps_kernel, steps=t, width=width, lower_bound=weights.lower_bound,
                               norm_eps=weights.norm_eps, scale=scale)
    row_tokens_head = lambda i, j: (i, 0, j, 0)
    tap, dt_spec, a_spec = _weight_specs(weights, h, kd)
    out_specs = [pl.BlockSpec((None, t, None, kd), row_tokens_head),
                 pl.BlockSpec((None, width - 1, 3, None, kd), lambda i, j: (i, 0, 0, j, 0)),
                 pl.BlockSpec((None, None, kd, kd), lambda i, j: (i, j, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, t, h, kd), inputs.x_qkv.dtype),
                 jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                 jax.ShapeDtypeStruct(state.shape, state.dtype)]
    if outputs_only:
        out_specs, out_shape = out_specs[:1], out_shape[:1]
    results = pl.pallas_call(
        kernel,
        grid=(b, h),
        in_specs=[
            pl.BlockSpec((None,), lambda i, j: (i,)),                                   # keep
            pl.BlockSpec((None, t, 3, None, kd), lambda i, j: (i, 0, 0, j, 0)),         # x_qkv
            pl.BlockSpec((None, width - 1, 3, None, kd), lambda i, j: (i, 0, 0, j, 0)),  # conv_state
            tap, tap, tap,                                                              # q, k, v conv
            pl.BlockSpec((None, t, None, kd), row_tokens_head),                         # f
            dt_spec, a_spec,                                                            # dt_bias, a_log
            pl.BlockSpec((None, t, None), lambda i, j: (i, 0, j)),                      # beta_logit
            pl.BlockSpec((None, t, None, kd), row_tokens_head),                         # z
            pl.BlockSpec((kd,), lambda i, j: (0,)),                                     # o_norm_w
            pl.BlockSpec((None, None, kd, kd), lambda i, j: (i, j, 0, 0)),              # state
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={} if outputs_only else {2: 1, 12: 2},
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_verify_outputs" if outputs_only else "kda_decode_steps",
    )(keep.astype(jnp.int32), inputs.x_qkv, conv_state, *weights.conv_taps, inputs.f, weights.dt_bias, weights.a_log,
      inputs.beta_logit, inputs.z, weights.o_norm_w, state)
    return results[0] if outputs_only else tuple(results)
