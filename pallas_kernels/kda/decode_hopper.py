"""The one-token KDA decode step for Hopper in Pallas Mosaic GPU: the state streamed through a TMA ring.

At B >= 64 a decode step is the fp32 state's traffic: each (row, head) reads and writes a [K, V]
state (64 KB at K = V = 128) and does a few multiply-adds per element. The Triton kernel
(`decode.py`) gives each (row, head) a program that loads its whole state into registers, updates it
and stores it: the loads of one program wait for nothing else, but nothing overlaps them either, and
the same grid with no math at all reads and writes at 65% of the bandwidth (H200, RESULTS.md, KDA
decode runs 5-7). Here a few persistent programs (one per multiprocessor) each walk a strided share
of the (row, head) tiles with `stages` tiles in flight:

    for tile i of this program:
        wait for tile i's state and factors (TMA, issued `stages` - 1 tiles ahead)
        pred = sum_k (d k)[k] S[k, :]                         two 64-row halves, read from shared memory
        u    = v - pred
        S'   = d S + (beta k) u^T,   o = sum_k q[k] S'[k, :]  written back in place
        out  = w * rmsnorm(bf16(o)) * sigmoid(z)
        TMA-store S' and out; once tile i-1's stores have read their buffers, fetch tile i + stages - 1
        into tile i-1's slot

The state is updated in place (the kernel writes through a `jax.new_ref` of it), in a shared-memory
buffer tiled and swizzled for conflict-free [64, V] loads in the warpgroup-MMA register layout.

The per-token factors (conv window + SiLU, q / k L2 norm, decay, beta) are [K] vectors per (row,
head), computed by XLA before the launch exactly as the twin does (`decode_xla.decode_factors`) and
handed over as one [6, K] fp32 block per tile: q (normalised and scaled), d = e^g, d k, beta k, v and
z. Twin: `decode_xla.kda_decode_xla`. Runs on Hopper GPUs, and in Mosaic GPU's interpret mode on the
CPU (the tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._util import default_interpret, multiprocessor_count
from pallas_kernels.kda.decode_xla import decode_factors, validate_decode_inputs
from pallas_kernels.kda.params import KDADecodeInputs, KDADecodeWeights

ROWS = 64                   # state rows a step holds in registers: the warpgroup-MMA layout's row tile
FACTORS = 6                 # rows of the per-tile factor block: q, d, d k, beta k, v, z
_SMEM_BYTES = 227 * 1024    # shared memory one H100 / H200 block may take
_SWIZZLE = 128              # bytes: the state buffer's swizzle (fp32 tiles of 8 x 32)


@dataclass(frozen=True)
class HopperDecodeBlocks:
    """Launch settings of the Mosaic GPU decode step.

    stages:   tiles in flight per program (each a [K, V] fp32 state buffer: 3 x 64 KB at K = V = 128).
    programs: persistent programs; 0 = one per multiprocessor (at most one per tile).
    Not yet timed on a GPU: the defaults are the design's, not a sweep's."""

    stages: int = 3
    programs: int = 0

    def __post_init__(self):
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"HopperDecodeBlocks: stages must be an int >= 2, got {self.stages!r}")
        if isinstance(self.programs, bool) or not isinstance(self.programs, int) or self.programs < 0:
            raise ValueError(f"HopperDecodeBlocks: programs must be an int >= 0 (0 = one per multiprocessor), "
                             f"got {self.programs!r}")

    def programs_for(self, tiles: int) -> int:
        return min(tiles, self.programs or multiprocessor_count())

    def smem_bytes(self, k_dim: int, v_dim: int) -> int:
        """Shared memory of the ring: per stage the state, the factors and the output row (counted at 4 bytes an
        element, fp32 outputs' size), and the norm weight."""
        return self.stages * (4 * k_dim * v_dim + 4 * FACTORS * k_dim + 4 * v_dim) + 4 * v_dim


def _gated_rms_norm(o, z, weight, eps: float):
    """`gate.gated_rms_norm` of one [V] fp32 vector, its mean written as a whole-vector sum (the form
    Mosaic GPU's layout inference takes: a kept-dims mean does not lower)."""
    inv = lax.rsqrt(jnp.sum(o * o) * (1.0 / o.shape[0]) + eps)
    return o * inv * weight * jax.nn.sigmoid(z)


def _kernel(f_ref, nw_ref, s_ref, out_ref, s_smem, f_smem, o_smem, nw_smem, ready, nw_ready, *,
            tiles: int, programs: int, stages: int, norm_eps: float):
    """f_ref [N, 6, K] fp32 factors, nw_ref [V] fp32 norm weight, s_ref [N, K, V] fp32 state (written in
    place), out_ref [N, V] output. Scratch: the ring's state [stages, K, V], factor [stages, 6, K] and
    output [stages, V] buffers, the norm weight [V], a barrier per slot and one for the weight."""
    program = lax.axis_index("program")
    count = (tiles - program + programs - 1) // programs          # this program's tiles: program + i * programs
    k_dim = s_smem.shape[1]
    state_layout = plgpu.Layout.WGMMA
    row_layout, col_layout = state_layout.reduce(1), state_layout.reduce(0)

    def fetch(i, slot):
        tile = program + i * programs
        plgpu.copy_gmem_to_smem(s_ref.at[tile], s_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(f_ref.at[tile], f_smem.at[slot], ready.at[slot])

    plgpu.copy_gmem_to_smem(nw_ref, nw_smem, nw_ready)
    for i in range(stages - 1):
        @pl.when(i < count)
        def _():
            fetch(i, i)

    plgpu.barrier_wait(nw_ready)

    def step(i, carry):
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(ready.at[slot])
        factors = f_smem.at[slot]
        row = lambda r, half: plgpu.load(factors.at[r, pl.ds(half * ROWS, ROWS)], layout=row_layout)
        col = lambda r: plgpu.load(factors.at[r], layout=col_layout)
        halves = [s_smem.at[slot, pl.ds(half * ROWS, ROWS)] for half in range(k_dim // ROWS)]

        pred = None
        for half, state in enumerate(halves):                       # pred = (d k)^T S
            part = jnp.sum(plgpu.load(state, layout=state_layout) * row(2, half)[:, None], axis=0)
            pred = part if pred is None else pred + part
        u = col(4) - pred
        o = None
        for half, state in enumerate(halves):                       # S' = d S + (beta k) u^T, o = q^T S'
            new = (plgpu.load(state, layout=state_layout) * row(1, half)[:, None]
                   + row(3, half)[:, None] * u[None, :])
            state[...] = new
            part = jnp.sum(new * row(0, half)[:, None], axis=0)
            o = part if o is None else o + part
        o = o.astype(out_ref.dtype).astype(jnp.float32)              # the twin rounds o before the norm
        out = _gated_rms_norm(o, col(5), plgpu.load(nw_smem, layout=col_layout), norm_eps)
        o_smem[slot] = out.astype(o_smem.dtype)
        plgpu.commit_smem()
        tile = program + i * programs
        plgpu.copy_smem_to_gmem(s_smem.at[slot], s_ref.at[tile])
        plgpu.copy_smem_to_gmem(o_smem.at[slot], out_ref.at[tile])

        ahead = i + stages - 1                                      # goes into tile i - 1's slot

        @pl.when(ahead < count)
        def _():
            plgpu.wait_smem_to_gmem(2, wait_read_only=True)        # tile i - 1's two stores have read it
            fetch(ahead, lax.rem(ahead, stages))
        return carry

    lax.fori_loop(0, count, step, 0)
    plgpu.wait_smem_to_gmem(0)


def hopper_decode_runs_here(k_dim: int, state_dtype) -> bool:
    """Whether the kernel takes this shape: an fp32 state with K a multiple of 64 (the register layout's
    row tile) and the 8 x 32 swizzle tile."""
    return jnp.dtype(state_dtype) == jnp.float32 and k_dim % ROWS == 0


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def kda_decode_hopper(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array, state: jax.Array,
                      *, blocks: HopperDecodeBlocks = HopperDecodeBlocks(), interpret: bool | None = None):
    """One KDA decode step per row with the state pass in Mosaic GPU; same contract as `kda_decode_xla`.

    Args:
      inputs: KDADecodeInputs (x_qkv [B, 3, H, K], f [B, H, K], beta_logit [B, H], z [B, H, K]).
      weights: KDADecodeWeights of the layer. conv_state: [B, W-1, 3, H, K].
      state: [B, H, K, K] fp32, K a multiple of 64; updated in place (donate it to avoid a copy).
      blocks: launch settings. interpret: Mosaic GPU's interpret mode (default: off the GPU).
    Returns:
      (out [B, H, K] in x_qkv's dtype, new conv_state, new state fp32)
    """
    validate_decode_inputs(inputs, weights, conv_state, state)
    b, _, h, kd = inputs.x_qkv.shape
    if not hopper_decode_runs_here(kd, state.dtype):
        raise ValueError(f"kda_decode_hopper: needs an fp32 state with K a multiple of {ROWS}, got "
                         f"{state.dtype} and K={kd}")
    if blocks.smem_bytes(kd, kd) > _SMEM_BYTES:
        raise ValueError(f"kda_decode_hopper: stages={blocks.stages} at K=V={kd} need "
                         f"{blocks.smem_bytes(kd, kd)} B of shared memory, more than the {_SMEM_BYTES} B a block has")
    interpret = default_interpret() if interpret is None else interpret
    q, k, v, decay, beta, new_conv = decode_factors(inputs, weights, conv_state)
    factors = jnp.stack([q, decay, decay * k, beta[..., None] * k, v, inputs.z.astype(jnp.float32)], axis=2)
    tiles = b * h
    programs = blocks.programs_for(tiles)
    dtype = inputs.x_qkv.dtype
    state_ref = jax.new_ref(state.reshape(tiles, kd, kd))
    swizzled = (plgpu.TilingTransform((8, _SWIZZLE // 4)), plgpu.SwizzleTransform(_SWIZZLE))
    out = plgpu.kernel(
        functools.partial(_kernel, tiles=tiles, programs=programs, stages=blocks.stages, norm_eps=weights.norm_eps),
        out_type=jax.ShapeDtypeStruct((tiles, kd), dtype),
        grid=(programs,),
        grid_names=("program",),
        scratch_types=[plgpu.SMEM((blocks.stages, kd, kd), jnp.float32, transforms=swizzled),
                       plgpu.SMEM((blocks.stages, FACTORS, kd), jnp.float32),
                       plgpu.SMEM((blocks.stages, kd), dtype),
                       plgpu.SMEM((kd,), jnp.float32),
                       plgpu.Barrier(num_arrivals=2, num_barriers=blocks.stages),
                       plgpu.Barrier()],
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        kernel_name="kda_decode_hopper",
    )(factors.reshape(tiles, FACTORS, kd), weights.o_norm_w.astype(jnp.float32), state_ref)
    return out.reshape(b, h, kd), new_conv, jax.freeze(state_ref).reshape(b, h, kd, kd)
