"""Grouped matmul: out[r] = lhs[r] @ rhs[g(r)] for rows sorted by group, sizes `group_sizes`.

impl "xla": `jax.lax.ragged_dot` (the reference; exact on CPU, a padded dense fallback on GPU).
impl "mgpu": JAX's Hopper Mosaic GPU kernel `ragged_dot_mgpu` (GPU-interpret mode on the CPU).
impl "auto": "mgpu" on a GPU backend, "xla" elsewhere.
Rows past sum(group_sizes) are zero in both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

GmmImpl = Literal["auto", "xla", "mgpu"]
GMM_IMPLS: tuple[str, ...] = get_args(GmmImpl)


@dataclass(frozen=True)
class GmmBlocks:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """lhs [M, K], rhs [G, K, N], group_sizes [G] int32 -> [M, N] in lhs's dtype."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


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


def grouped_matmul(lhs, rhs, group_sizes, *, impl: GmmImpl = "auto", blocks: GmmBlocks = GmmBlocks()):
    """out[r] = lhs[r] @ rhs[g(r)] for rows sorted by group.

    Args:
      lhs: [M, K] rows sorted by group. rhs: [G, K, N]. group_sizes: [G] int32 rows per group
        (their sum may be below M: the remaining rows come out zero).
      impl: one of GMM_IMPLS. blocks: tile sizes of the Mosaic GPU kernel.
    Returns:
      [M, N] in lhs's dtype.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul: expected lhs [M, K], rhs [G, K, N], group_sizes [G]; got "
                         f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
    if impl == "auto":
        impl = "mgpu" if jax.default_backend() == "gpu" else "xla"
    if impl == "xla":
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    if impl == "mgpu":
        return _mgpu(lhs, rhs, group_sizes, blocks)
    raise ValueError(f"grouped_matmul: unknown impl {impl!r}; expected one of {GMM_IMPLS}")
