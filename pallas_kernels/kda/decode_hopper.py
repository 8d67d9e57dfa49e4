"""The one-token KDA decode step for Hopper in Pallas Mosaic GPU: the states streamed through a TMA ring.

At B >= 64 a decode step is the recurrent state's traffic: each (row, head) reads and writes a [K, V]
state (64 KB in fp32 at K = V = 128) and does a few multiply-adds per element. The Triton kernel
(`decode.py`) gives each (row, head) a program that loads its whole state into registers, updates it
and stores it: nothing overlaps a program's loads, and the same grid with no math at all reads and
writes at 65% of the bandwidth (H200, RESULTS.md, KDA decode runs 5-7). Here a few persistent programs
(one per multiprocessor) each walk a strided share of the (row, head) tiles, tile = row * H + head,
with `stages` tiles in flight:

    for tile i of this program:
        wait for tile i's state and inputs (TMA, issued `stages` - 1 tiles ahead)
        factors: conv window + SiLU, q / k L2 norm, d = e^g, beta     ("kernel"; "xla": read, made before)
        once tile i-1's stores have read their buffers: fetch tile i + stages - 1 into tile i-1's slot
                                                        (refill "before"; "after": at the end of the step)
        pred = sum_k (d k)[k] S[k, :]                  two 64-row halves read from shared memory
        S'   = d S + (beta k) (v - pred)^T             written back in place
        out  = w * rmsnorm(o) * sigmoid(z),  o = sum_k q[k] S'[k, :]
        TMA-store S', out (and the new conv window)

The state (fp32 or bf16; the math in fp32) and the conv window are updated in place (the kernel writes
through `jax.new_ref`s of them); the state's shared-memory buffer is tiled and swizzled for
conflict-free [64, V] loads in the warpgroup-MMA register layout. `HopperDecodeBlocks.factors` says
where the per-token [K] vectors come from: "kernel" computes them from the raw inputs and the head's
weights, "xla" reads one [6, K] fp32 block a tile that XLA made before the launch with the twin's own
`decode_xla.decode_factors` (q normalised and scaled, d, d k, beta k, v, z).

Twin: `decode_xla.kda_decode_xla`. Runs on Hopper GPUs, and in Mosaic GPU's interpret mode on the CPU
(the tests, also under its race detector).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._util import default_interpret, multiprocessor_count
from pallas_kernels.kda.decode_xla import decode_factors, validate_decode_inputs
from pallas_kernels.kda.gate import L2_EPS, forget_gate, log1p_by_log
from pallas_kernels.kda.params import KDADecodeInputs, KDADecodeWeights

ROWS = 64                   # state rows a step holds in registers: the warpgroup-MMA layout's row tile
FACTORS = 6                 # rows of the per-tile factor block: q, d, d k, beta k, v, z
FACTOR_FORMS = ("auto", "kernel", "xla")
KERNEL_FACTORS_K = 128      # "kernel" takes K a multiple of this: at K = 64 and 192 Mosaic GPU's layout inference
                            # finds no layouts for its [K]-vector math (it lowers at 128; "xla" at 64, 128 and 192)
_SMEM_BYTES = 227 * 1024    # shared memory one H100 / H200 block may take
_SWIZZLE = 128              # bytes: the state buffer's swizzle (tiles of 8 rows x 128 bytes)
STATE_DTYPES = ("float32", "bfloat16")
_MAX_STAGES = 3
REFILLS = ("before", "after")
_ALIGN = 1024               # Pallas Mosaic GPU aligns every scratch buffer to 1 KB
_RESERVED = 2048 + 1024     # its cross-warp reduction scratch (CompilerParams default), and the barriers


@dataclass(frozen=True)
class HopperDecodeBlocks:
    """Launch settings of the Mosaic GPU decode step.

    factors:  "kernel": the conv window, SiLU, q / k norms, gate and beta inside the kernel, from the raw
              inputs and one [3W + 2, K] block of the head's weights (one launch a step; K a multiple of 128);
              "xla": computed by XLA before the launch (`decode_xla.decode_factors`) and read as a [6, K] block
              a tile (the default); "auto": "kernel" where it takes K, else "xla". H100, B = 1 / 8 / 64 / 256,
              H = 32, fp32 state, 20 layers in one program (KDA run 28): "xla" 34 / 46 / 153 / 503 us a
              layer with its fusion, "kernel" 38 / 64 / 159 / 507; the Triton step (`decode.py`) 25 / 41 / 150 / 491.
    stages:   tiles in flight per program, each with a [K, V] state buffer; 0 = as many as fit (at most 3; at
              K = V = 128 with an fp32 state: 2 for "kernel", 3 for "xla"; with a bf16 state 3 for both).
    programs: persistent programs; 0 = one per multiprocessor (at most one per tile).
    refill:   when step i refills tile i - 1's slot (after waiting for that tile's stores to read it): "before"
              its state pass (the load issued early, the wait right after the stores were issued) or "after" it
              (the stores given the pass's time to drain, the load issued later: with 2 stages the next step then
              waits for a load issued just before it, so "after" overlaps loads only from 3 stages on).
    The stages and refill defaults are the design's ("kernel" with refill "after" in run 28: slower at B = 1,
    64 and 256)."""

    factors: str = "xla"
    stages: int = 0
    programs: int = 0
    refill: str = "before"

    def __post_init__(self):
        if self.factors not in FACTOR_FORMS:
            raise ValueError(f"HopperDecodeBlocks: factors must be one of {FACTOR_FORMS}, got {self.factors!r}")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages == 1 or self.stages < 0:
            raise ValueError(f"HopperDecodeBlocks: stages must be 0 (as many as fit) or an int >= 2, "
                             f"got {self.stages!r}")
        if isinstance(self.programs, bool) or not isinstance(self.programs, int) or self.programs < 0:
            raise ValueError(f"HopperDecodeBlocks: programs must be an int >= 0 (0 = one per multiprocessor), "
                             f"got {self.programs!r}")
        if self.refill not in REFILLS:
            raise ValueError(f"HopperDecodeBlocks: refill must be one of {REFILLS}, got {self.refill!r}")

    def programs_for(self, tiles: int) -> int:
        return min(tiles, self.programs or multiprocessor_count())

    def factors_for(self, k_dim: int) -> str:
        """`factors` at K = k_dim ("auto" resolved); raises for "kernel" where it does not lower."""
        if self.factors == "auto":
            return "kernel" if k_dim % KERNEL_FACTORS_K == 0 else "xla"
        if self.factors == "kernel" and k_dim % KERNEL_FACTORS_K:
            raise ValueError(f"kda_decode_hopper: factors='kernel' needs K a multiple of {KERNEL_FACTORS_K} (Mosaic "
                             f"GPU's layout inference finds no layouts at K={k_dim}); use 'xla' or 'auto'")
        return self.factors

    def buffers(self, stages: int, k_dim: int, width: int, dtypes: dict) -> list[tuple[tuple[int, ...], object]]:
        """The kernel's shared-memory buffers as (shape, dtype), in allocation order (the state buffer first).
        dtypes: "state", and the inputs' "act" (x_qkv and the output), "conv", "f", "z" (default float32)."""
        dt = lambda name: jnp.dtype(dtypes.get(name, jnp.float32))
        f32, k, per = jnp.dtype(jnp.float32), k_dim, lambda *shape: (stages, *shape)
        state = (per(k, k), dt("state"))
        if self.factors_for(k_dim) == "xla":
            return [state, (per(FACTORS, k), f32), (per(k), dt("act")), ((k,), f32)]
        return [state, (per(3, k), dt("act")), (per(width - 1, 3, k), dt("conv")), (per(3 * width + 2, k), f32),
                (per(k), dt("f")), (per(k), dt("z")), (per(width - 1, 3, k), dt("conv")), (per(k), dt("act")),
                ((FACTORS, k), f32), ((k,), f32)]

    def smem_bytes(self, stages: int, k_dim: int, width: int, dtypes: dict) -> int:
        """Shared memory of `buffers` as Pallas Mosaic GPU allocates it (each aligned to 1 KB), with its reduction
        scratch and the barriers."""
        return _RESERVED + sum(-(-int(np.prod(shape)) * dtype.itemsize // _ALIGN) * _ALIGN
                               for shape, dtype in self.buffers(stages, k_dim, width, dtypes))

    def fits(self, k_dim: int, width: int, dtypes: dict) -> bool:
        """Whether `stages` (or with 0 the fewest, 2) fit the shared memory of one block (dtypes as in `buffers`:
        the ones not given count as fp32, an upper bound)."""
        return self.smem_bytes(self.stages or 2, k_dim, width, dtypes) <= _SMEM_BYTES

    def stages_for(self, k_dim: int, width: int, dtypes: dict) -> int:
        """`stages`, or with 0 the most (2..3) that fit the shared memory; raises when even 2 do not."""
        fits = lambda n: self.smem_bytes(n, k_dim, width, dtypes) <= _SMEM_BYTES
        stages = self.stages or max([2] + [n for n in range(2, _MAX_STAGES + 1) if fits(n)])
        if not fits(stages):
            raise ValueError(f"kda_decode_hopper: stages={stages} at K=V={k_dim} need "
                             f"{self.smem_bytes(stages, k_dim, width, dtypes)} B of shared memory, more than the "
                             f"{_SMEM_BYTES} B a block has")
        return stages


def _gated_rms_norm(o, z, weight, eps: float):
    """`gate.gated_rms_norm` of one [V] fp32 vector, its mean written as a whole-vector sum (the form
    Mosaic GPU's layout inference takes: a kept-dims mean does not lower)."""
    inv = lax.rsqrt(jnp.sum(o * o) * (1.0 / o.shape[0]) + eps)
    return o * inv * weight * jax.nn.sigmoid(z)


def _l2_normalize(x):
    """`gate.l2_normalize` of one [K] fp32 vector (a whole-vector sum, as above)."""
    return x * lax.rsqrt(jnp.sum(x * x) + L2_EPS)


def _factors(x_smem, conv_smem, w_smem, f_smem, z_smem, beta_logit, factor_ref, conv_out_ref, *, width, scale,
             lower_bound, dtype):
    """The per-token math of one tile inside the kernel, as `decode_xla.decode_factors` does it: x [3, K],
    conv [W-1, 3, K] (activation dtype), w [3W + 2, K] fp32 (the q, k and v taps, then dt_bias and a =
    exp(A_log)), f, z [K], beta_logit a scalar. Writes the factor rows (q, d, d k, beta k, v, z) to
    factor_ref [6, K] and the new conv window to conv_out_ref [W-1, 3, K]."""
    f32 = jnp.float32
    acts = []
    for i in range(3):                                  # conv + SiLU of q, k, v, rounded as the twin rounds them
        pre = w_smem[i * width + width - 1].astype(f32) * x_smem[i].astype(f32)
        for j in range(width - 1):
            pre = pre + w_smem[i * width + j].astype(f32) * conv_smem[j, i].astype(f32)
        acts.append(jax.nn.silu(pre).astype(dtype).astype(f32))
    q, k = _l2_normalize(acts[0]) * scale, _l2_normalize(acts[1])
    u = f_smem[...].astype(f32) + w_smem[3 * width]
    decay = jnp.exp(forget_gate(u, w_smem[3 * width + 1], lower_bound, log1p=log1p_by_log))
    beta = jax.nn.sigmoid(beta_logit.astype(f32))
    for r, row in enumerate((q, decay, decay * k, beta * k, acts[2], z_smem[...].astype(f32))):
        factor_ref[r] = row
    for j in range(width - 2):
        for i in range(3):
            conv_out_ref[j, i] = conv_smem[j + 1, i]
    for i in range(3):
        conv_out_ref[width - 2, i] = x_smem[i].astype(conv_out_ref.dtype)


def _state_pass(state_halves, factor_ref, nw_ref, out_ref, *, norm_eps: float, dtype):
    """The delta rule on one tile's state, in place: state_halves the [64, V] row blocks of its shared-memory
    buffer (fp32 or bf16: the math in fp32, the new state rounded to it once, as the twin stores it), factor_ref
    [6, K] (q, d, d k, beta k, v, z); writes the gated, normalised output to out_ref [V]."""
    f32 = jnp.float32
    state_layout = plgpu.Layout.WGMMA
    row_layout, col_layout = state_layout.reduce(1), state_layout.reduce(0)
    row = lambda r, half: plgpu.load(factor_ref.at[r, pl.ds(half * ROWS, ROWS)], layout=row_layout)
    col = lambda r: plgpu.load(factor_ref.at[r], layout=col_layout)
    products = None
    for half, state in enumerate(state_halves):                     # pred = (d k)^T S
        part = plgpu.load(state, layout=state_layout).astype(f32) * row(2, half)[:, None]
        products = part if products is None else products + part  # the halves summed first: one reduction
    u = col(4) - jnp.sum(products, axis=0)
    products = None
    for half, state in enumerate(state_halves):                     # S' = d S + (beta k) u^T, o = q^T S'
        new = (plgpu.load(state, layout=state_layout).astype(f32) * row(1, half)[:, None]
               + row(3, half)[:, None] * u[None, :])
        state[...] = new.astype(state.dtype)
        part = new * row(0, half)[:, None]
        products = part if products is None else products + part
    o = jnp.sum(products, axis=0)
    o = o.astype(dtype).astype(jnp.float32)                         # the twin rounds o before the norm
    out_ref[...] = _gated_rms_norm(o, col(5), plgpu.load(nw_ref, layout=col_layout), norm_eps).astype(out_ref.dtype)


def _kernel(*refs, factors: str, tiles: int, heads: int, programs: int, stages: int, refill: str, norm_eps: float,
            factor_settings: dict):
    """A persistent program over tiles program, program + programs, ... (tile = row * H + head).

    factors "xla":    inputs f [N, 6, K] fp32, norm weight [V] fp32, state [N, K, V] (a ref, written in place);
                      output out [N, V].
    factors "kernel": inputs x_qkv [B, 3, H, K], weights [H, 3W + 2, K] fp32, f [B, H, K], beta_logit [B, H],
                      z [B, H, K], norm weight [V] fp32, conv_state [B, W-1, 3, H, K] and state [N, K, V] (refs,
                      written in place); output out [N, V].
    Scratch (`HopperDecodeBlocks.buffers`): per stage the state buffer (tiled and swizzled) and the tile's input
    and output buffers; the factor block (per stage with "xla", once with "kernel"), the norm weight; a barrier
    per stage and one for the norm weight.

    Step i of the program: wait for tile i's inputs; ("kernel") its factors and conv window; (refill "before") wait
    until tile i - 1's stores have read their buffers, then fetch tile i + stages - 1 into tile i - 1's slot; the
    state pass in place; TMA-store the state, the output (and the conv window); (refill "after") the wait and the
    fetch."""
    fused = factors == "kernel"
    if fused:
        (x_ref, w_ref, f_ref, bl_ref, z_ref, nw_ref, conv_ref, s_ref, out_ref,
         s_smem, x_smem, c_smem, w_smem, f_smem, z_smem, c_out, o_smem, factor_smem, nw_smem, ready, nw_ready) = refs

        def ins(tile):
            row, head = tile // heads, tile % heads
            return ((x_ref.at[row, :, head], x_smem), (conv_ref.at[row, :, :, head], c_smem), (w_ref.at[head], w_smem),
                    (f_ref.at[row, head], f_smem), (z_ref.at[row, head], z_smem))
    else:
        f_ref, nw_ref, s_ref, out_ref, s_smem, factor_smem, o_smem, nw_smem, ready, nw_ready = refs
        ins = lambda tile: ((f_ref.at[tile], factor_smem),)
    program = lax.axis_index("program")
    count = (tiles - program + programs - 1) // programs          # this program's tiles: program + i * programs
    k_dim = s_smem.shape[1]
    tile_of = lambda i: program + i * programs

    def fetch(i, slot):
        tile = tile_of(i)
        plgpu.copy_gmem_to_smem(s_ref.at[tile], s_smem.at[slot], ready.at[slot])
        for src, dst in ins(tile):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], ready.at[slot])

    def beta_logit(i):                                             # a scalar read from memory, one tile ahead
        tile = tile_of(jnp.minimum(i, count - 1))
        return bl_ref[tile // heads, tile % heads].astype(jnp.float32)

    plgpu.copy_gmem_to_smem(nw_ref, nw_smem, nw_ready)
    for i in range(stages - 1):
        @pl.when(i < count)
        def _():
            fetch(i, i)

    plgpu.barrier_wait(nw_ready)

    def step(i, beta_now):
        slot, tile = lax.rem(i, stages), tile_of(i)
        plgpu.barrier_wait(ready.at[slot])
        beta_next = None
        if fused:
            beta_next = beta_logit(i + 1)
            _factors(x_smem.at[slot], c_smem.at[slot], w_smem.at[slot], f_smem.at[slot], z_smem.at[slot], beta_now,
                     factor_smem, c_out.at[slot], dtype=out_ref.dtype, **factor_settings)
            plgpu.commit_smem()
        def refill_slot(pending: int):
            ahead = i + stages - 1                                  # into tile i - 1's slot

            @pl.when(ahead < count)
            def _():
                plgpu.wait_smem_to_gmem(pending, wait_read_only=True)   # tile i - 1's stores have read their buffers
                fetch(ahead, lax.rem(ahead, stages))

        if refill == "before":
            refill_slot(0)
        halves = [s_smem.at[slot, pl.ds(half * ROWS, ROWS)] for half in range(k_dim // ROWS)]
        _state_pass(halves, factor_smem if fused else factor_smem.at[slot], nw_smem, o_smem.at[slot],
                    norm_eps=norm_eps, dtype=out_ref.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s_smem.at[slot], s_ref.at[tile])
        plgpu.copy_smem_to_gmem(o_smem.at[slot], out_ref.at[tile])
        if fused:
            plgpu.copy_smem_to_gmem(c_out.at[slot], conv_ref.at[tile // heads, :, :, tile % heads])
        if refill == "after":
            refill_slot(3 if fused else 2)                          # this tile's stores may stay in flight
        return beta_next if fused else beta_now

    lax.fori_loop(0, count, step, beta_logit(0) if fused else jnp.float32(0))
    plgpu.wait_smem_to_gmem(0)


def _interpret_params(interpret):
    """interpret: False (compiled), True (Mosaic GPU's interpret mode) or its InterpretGPUParams (e.g. with the
    race detector on)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else False


def hopper_decode_runs_here(k_dim: int, state_dtype) -> bool:
    """Whether the kernel takes this shape: an fp32 or bf16 state with K a multiple of 64 (the register layout's
    row tile)."""
    return jnp.dtype(state_dtype).name in STATE_DTYPES and k_dim % ROWS == 0


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def kda_decode_hopper(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array, state: jax.Array,
                      *, blocks: HopperDecodeBlocks = HopperDecodeBlocks(), interpret: bool | None = None):
    """One KDA decode step per row with the state pass in Mosaic GPU; same contract as `kda_decode_xla`.

    Args:
      inputs: KDADecodeInputs (x_qkv [B, 3, H, K], f [B, H, K], beta_logit [B, H], z [B, H, K]).
      weights: KDADecodeWeights of the layer. conv_state: [B, W-1, 3, H, K]; with factors "kernel" updated in
        place (donate it).
      state: [B, H, K, K] fp32 or bf16 (the math in fp32), K a multiple of 64; updated in place (donate it to
        avoid a copy).
      blocks: launch settings. interpret: Mosaic GPU's interpret mode (default: off the GPU), or its
        InterpretGPUParams.
    Returns:
      (out [B, H, K] in x_qkv's dtype, new conv_state, new state in state's dtype)
    """
    validate_decode_inputs(inputs, weights, conv_state, state)
    b, _, h, kd = inputs.x_qkv.shape
    width = weights.q_conv.shape[0]
    if not hopper_decode_runs_here(kd, state.dtype):
        raise ValueError(f"kda_decode_hopper: needs an fp32 or bf16 state with K a multiple of {ROWS}, got "
                         f"{state.dtype} and K={kd}")
    dtypes = dict(state=state.dtype, act=inputs.x_qkv.dtype, conv=conv_state.dtype, f=inputs.f.dtype, z=inputs.z.dtype)
    factors = blocks.factors_for(kd)
    stages = blocks.stages_for(kd, width, dtypes)
    interpret = default_interpret() if interpret is None else interpret
    tiles, dtype, f32 = b * h, inputs.x_qkv.dtype, jnp.float32
    programs = blocks.programs_for(tiles)
    state_ref = jax.new_ref(state.reshape(tiles, kd, kd))
    swizzled = (plgpu.TilingTransform((8, _SWIZZLE // state.dtype.itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    (state_shape, _), *others = blocks.buffers(stages, kd, width, dtypes)
    scratch = [plgpu.SMEM(state_shape, state.dtype, transforms=swizzled),
               *(plgpu.SMEM(shape, dt) for shape, dt in others),
               plgpu.Barrier(num_arrivals=2 if factors == "xla" else 6, num_barriers=stages), plgpu.Barrier()]
    scale = kd ** -0.5 if weights.scale is None else weights.scale
    factor_settings = {}
    if factors == "xla":
        q, k, v, decay, beta, new_conv = decode_factors(inputs, weights, conv_state)
        factor_rows = jnp.stack([q, decay, decay * k, beta[..., None] * k, v, inputs.z.astype(f32)], axis=2)
        operands = (factor_rows.reshape(tiles, FACTORS, kd), weights.o_norm_w.astype(f32), state_ref)
    else:
        a = jnp.broadcast_to(jnp.exp(weights.a_log.astype(f32)), (h, kd))
        head_weights = jnp.concatenate([jnp.moveaxis(taps.astype(f32), 1, 0) for taps in weights.conv_taps]
                                       + [weights.dt_bias.astype(f32)[:, None], a[:, None]], axis=1)  # [H, 3W+2, K]
        conv_ref = jax.new_ref(conv_state)
        operands = (inputs.x_qkv, head_weights, inputs.f, inputs.beta_logit, inputs.z, weights.o_norm_w.astype(f32),
                    conv_ref, state_ref)
        factor_settings = dict(width=width, scale=scale, lower_bound=weights.lower_bound)
    kernel = functools.partial(_kernel, factors=factors, tiles=tiles, heads=h, programs=programs,
                               stages=stages, refill=blocks.refill, norm_eps=weights.norm_eps,
                               factor_settings=factor_settings)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((tiles, kd), dtype),
        grid=(programs,),
        grid_names=("program",),
        scratch_types=scratch,
        interpret=_interpret_params(interpret),
        kernel_name="kda_decode_hopper",
    )(*operands)
    if factors == "kernel":
        new_conv = jax.freeze(conv_ref)
    return out.reshape(b, h, kd), new_conv, jax.freeze(state_ref).reshape(b, h, kd, kd)
