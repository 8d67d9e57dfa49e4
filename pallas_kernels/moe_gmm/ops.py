"""The dispatch site of the grouped matmuls (rows sorted by group, `group_sizes` rows per group).

    grouped_matmul(lhs, rhs, sizes, row_scale=None, impl=...)   out[r] = lhs[r] @ rhs[g(r)] (* scale[r])
    grouped_glu(lhs, w_gate, w_up, sizes, spec, impl=...)       out[r] = act(lhs[r] @ w_gate[g], lhs[r] @ w_up[g])

impl "xla": `jax.lax.ragged_dot` (the reference; exact on the CPU, a padded dense fallback on GPU).
impl "pallas": the row-tiled kernel (`kernel.py`): touched groups only, one weight read per tile.
impl "mgpu": JAX's Hopper Mosaic GPU kernel `ragged_dot_mgpu` (GPU-interpret mode on the CPU).
impl "auto": "pallas" on a GPU backend, "xla" elsewhere.
Rows past sum(group_sizes) are zero in all of them.
"""

from __future__ import annotations

import contextlib
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

from pallas_kernels.moe_gmm.activation import GluSpec, glu
from pallas_kernels.moe_gmm.kernel import grouped_glu_pallas, grouped_matmul_pallas, tiles
from pallas_kernels.moe_gmm.reference import grouped_glu_reference, grouped_matmul_reference
from pallas_kernels.moe_gmm.tuning import GmmBlocks, TileBlocks

GmmImpl = Literal["auto", "xla", "pallas", "mgpu"]
GMM_IMPLS: tuple[str, ...] = get_args(GmmImpl)
# Projections with few rows (decode): "xla" (a dot; XLA turns one-row dots into multiply + reduce
# kernels), "pallas" (the row-tiled kernel with one group, streaming the weight once) or "auto"
# ("pallas" on a GPU backend, "xla" elsewhere). Rows beyond SKINNY_MAX_ROWS, or sides the kernel's
# blocks do not tile, always take the dot.
SkinnyImpl = Literal["auto", "xla", "pallas"]
SKINNY_IMPLS: tuple[str, ...] = get_args(SkinnyImpl)
SKINNY_MAX_ROWS = 16


def resolve_gmm_impl(impl: GmmImpl, k_dim: int | None = None, n_dim: int | None = None) -> str:
    """"auto" -> "pallas" on a GPU backend when the weight's sides [K, N] (if given) tile, else "xla";
    other names unchanged."""
    if impl == "auto":
        fits = k_dim is None or n_dim is None or tiles(k_dim, n_dim)
        return "pallas" if jax.default_backend() == "gpu" and fits else "xla"
    if impl not in GMM_IMPLS:
        raise ValueError(f"grouped_matmul: unknown impl {impl!r}; expected one of {GMM_IMPLS}")
    return impl


def _mgpu(lhs, rhs, group_sizes, blocks: GmmBlocks):
    m = lhs.shape[0]
    pad = -m % blocks.block_m
    padded = jnp.pad(lhs, ((0, pad), (0, 0)))
    interpret = plgpu.force_gpu_interpret_mode() if jax.default_backend() != "gpu" else contextlib.nullcontext()
    with interpret:
        out = ragged_dot_mgpu.ragged_dot(
            padded, rhs, group_sizes=group_sizes.astype(jnp.int32), block_m=blocks.block_m, block_n=blocks.block_n,
            block_k=blocks.block_k, max_concurrent_steps=blocks.max_concurrent_steps,
            grid_block_n=blocks.grid_block_n)
    rows = jnp.arange(m + pad)[:, None] < jnp.sum(group_sizes)
    return jnp.where(rows, out, 0)[:m].astype(lhs.dtype)  # rows past the groups are undefined in the kernel


def _check(lhs, rhs, group_sizes) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul: expected lhs [M, K], rhs [G, K, N], group_sizes [G]; got "
                         f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")


def grouped_matmul(lhs, rhs, group_sizes, row_scale=None, *, impl: GmmImpl = "auto",
                   blocks: GmmBlocks = GmmBlocks()):
    """out[r] = lhs[r] @ rhs[g(r)] for rows sorted by group.

    Args:
      lhs: [M, K] rows sorted by group. rhs: [G, K, N]. group_sizes: [G] int32 rows per group
        (their sum may be below M: the remaining rows come out zero).
      row_scale: optional [M] per-row factor (the routing weight): the output is then fp32.
      impl: one of GMM_IMPLS. blocks: tile sizes of the Mosaic GPU kernel.
    Returns:
      [M, N] in lhs's dtype (fp32 with row_scale).
    """
    _check(lhs, rhs, group_sizes)
    impl = resolve_gmm_impl(impl, *rhs.shape[1:])
    if impl == "pallas":
        return grouped_matmul_pallas(lhs, rhs, group_sizes, row_scale)
    out = grouped_matmul_reference(lhs, rhs, group_sizes) if impl == "xla" else _mgpu(lhs, rhs, group_sizes, blocks)
    return out if row_scale is None else out.astype(jnp.float32) * row_scale.astype(jnp.float32)[:, None]


def _skinny_blocks(k_dim: int, n_dim: int) -> TileBlocks | None:
    """Tiles for a few rows times one weight, None when the sides do not tile: 64-column blocks
    when they give a program per SM (132 on an H200), else 32 (64-byte rows still stream well)."""
    bn = next((b for b in (64, 32, 16) if n_dim % b == 0 and (b != 64 or n_dim // b >= 128)), None)
    bk = next((b for b in (256, 128, 64, 32, 16) if k_dim % b == 0), None)
    if bn is None or bk is None:
        return None
    return TileBlocks(block_m=16, block_n=bn, block_k=bk, num_warps=4, num_stages=4)


def skinny_matmul(x_MK, w_KN, *, impl: SkinnyImpl = "auto", out_dtype=None):
    """x [M, K] @ w [K, N] for a few rows M (decode-time projections).

    Args:
      impl: one of SKINNY_IMPLS. out_dtype: result dtype (default x's; fp32 accumulation always).
    Returns:
      [M, N].
    """
    m, k_dim = x_MK.shape
    n_dim = w_KN.shape[1]
    if impl not in SKINNY_IMPLS:
        raise ValueError(f"skinny_matmul: unknown impl {impl!r}; expected one of {SKINNY_IMPLS}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    blocks = _skinny_blocks(k_dim, n_dim) if impl == "pallas" and m <= SKINNY_MAX_ROWS else None
    if blocks is None:
        return jnp.dot(x_MK, w_KN, preferred_element_type=out_dtype)
    out = grouped_matmul_pallas(x_MK, w_KN[None], jnp.full((1,), m, jnp.int32), blocks=blocks)
    return out if out_dtype is None else out.astype(out_dtype)


def grouped_glu(lhs, w_gate, w_up, group_sizes, *, spec: GluSpec = GluSpec(), impl: GmmImpl = "auto",
                blocks: GmmBlocks = GmmBlocks()):
    """act(lhs[r] @ w_gate[g(r)], lhs[r] @ w_up[g(r)]) for rows sorted by group: the gated first
    half of an expert MLP. Shapes as `grouped_matmul` with w_gate, w_up [G, K, F]; -> [M, F]."""
    _check(lhs, w_gate, group_sizes)
    impl = resolve_gmm_impl(impl, *w_gate.shape[1:])
    if impl == "pallas":
        return grouped_glu_pallas(lhs, w_gate, w_up, group_sizes, spec=spec)
    if impl == "xla":
        return grouped_glu_reference(lhs, w_gate, w_up, group_sizes, spec=spec)
    return glu(_mgpu(lhs, w_gate, group_sizes, blocks), _mgpu(lhs, w_up, group_sizes, blocks), spec)
