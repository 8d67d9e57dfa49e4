"""The dispatch site of the grouped matmuls (rows sorted by group, `group_sizes` rows per group).

    grouped_matmul(lhs, rhs, sizes, row_scale=None, impl=...)   out[r] = lhs[r] @ rhs[g(r)] (* scale[r])
    grouped_glu(lhs, w_gate, w_up, sizes, spec, impl=...)       out[r] = act(lhs[r] @ w_gate[g], lhs[r] @ w_up[g])

impl "xla": `jax.lax.ragged_dot` (the reference; exact on the CPU, a padded dense fallback on GPU).
impl "pallas": the row-tiled kernel (`kernel.py`): touched groups only, one weight read per tile.
impl "mgpu": JAX's Hopper Mosaic GPU kernel `ragged_dot_mgpu` (GPU-interpret mode on the CPU).
impl "auto": "pallas" on a GPU backend, "xla" elsewhere.
Rows past sum(group_sizes) are zero in all of them. Weights may be `Mxfp4Weight` (packed MXFP4): the
Pallas kernels decode them in registers; the other implementations dequantise them first. Weights given
as `hopper_mxfp4.Mxfp4Columns` (the checkpoint's column-major codes) take the Mosaic GPU kernel
(`hopper_mxfp4.py`) as their "pallas" implementation where it runs (a Hopper GPU or interpret mode, sides
it tiles: `hopper_mxfp4.runs_here`); elsewhere, and in the other implementations, they are dequantised.
Gate and up weights given as `HandOffColumns` (their columns in the down launch's order, permuted once at load)
take `grouped_mlp` through the gated launch's GLU epilogue (`hopper_mxfp4_mlp`, hand_off="glu"); every other
path puts their columns (or h's) back in order.

    grouped_mlp(lhs, w_gate, w_up, w_down, sizes, row_scale, spec, impl=...)   the whole expert MLP
    hand_off_runs(w_gate, w_up, w_down, impl)                                  whether it hands off (GLU epilogue)
"""

from __future__ import annotations

import contextlib
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

from pallas_kernels._util import tiles_by_16
from pallas_kernels.moe_gmm.activation import GluSpec, glu
from pallas_kernels.moe_gmm.kernel import (grouped_glu_pallas, grouped_matmul_pallas, pair_glu_pallas,
                                           pair_matmul_pallas)
from pallas_kernels.moe_gmm.reference import (grouped_glu_reference, grouped_matmul_reference, pair_glu_reference,
                                              pair_matmul_reference)
from pallas_kernels.moe_gmm.hopper_mxfp4 import (HandOffColumns, Mxfp4Columns, grouped_glu_hopper_mxfp4,
                                                 grouped_matmul_hopper_mxfp4, natural_columns, natural_order,
                                                 pair_glu_hopper_mxfp4, pair_matmul_hopper_mxfp4, runs_here, to_rows)
from pallas_kernels.moe_gmm.hopper_mxfp4_mlp import grouped_mlp_hopper_mxfp4
from pallas_kernels.moe_gmm.mxfp4 import Mxfp4Weight, dequantize
from pallas_kernels.moe_gmm.tuning import GmmBlocks

GmmImpl = Literal["auto", "xla", "pallas", "mgpu"]
GMM_IMPLS: tuple[str, ...] = get_args(GmmImpl)


def resolve_gmm_impl(impl: GmmImpl, k_dim: int | None = None, n_dim: int | None = None, columns: bool = False) -> str:
    """"auto" -> "pallas" on a GPU backend when the weight's sides [K, N] (if given) tile, else "xla";
    other names unchanged. `columns`: the weights are `Mxfp4Columns` (their kernel's own tiling)."""
    if impl == "auto":
        takes = runs_here if columns else tiles_by_16
        fits = k_dim is None or n_dim is None or takes(k_dim, n_dim)
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


def dense_weight(w, dtype):
    """A weight as an array: MXFP4 (`Mxfp4Weight` or `Mxfp4Columns`) dequantised to `dtype` (the paths
    without a kernel that decodes it), else as is."""
    if isinstance(w, Mxfp4Columns):
        w = to_rows(natural_columns(w))
    return dequantize(w, dtype) if isinstance(w, Mxfp4Weight) else w


def _impl(impl: GmmImpl, w) -> str:
    """The implementation that runs on weight `w`: `Mxfp4Columns` take the Mosaic GPU kernel as "pallas"
    only where it runs (`hopper_mxfp4.runs_here`), else the dequantising reference."""
    columns = isinstance(w, Mxfp4Columns)
    resolved = resolve_gmm_impl(impl, *w.shape[1:], columns=columns)
    if columns and resolved == "pallas" and not runs_here(*w.shape[1:]):
        return "xla"
    return resolved


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
    impl = _impl(impl, rhs)
    if impl == "pallas" and isinstance(rhs, Mxfp4Columns):
        return grouped_matmul_hopper_mxfp4(lhs, rhs, group_sizes, row_scale)
    if impl == "pallas":
        return grouped_matmul_pallas(lhs, rhs, group_sizes, row_scale)
    rhs = dense_weight(rhs, lhs.dtype)
    out = grouped_matmul_reference(lhs, rhs, group_sizes) if impl == "xla" else _mgpu(lhs, rhs, group_sizes, blocks)
    return out if row_scale is None else out.astype(jnp.float32) * row_scale.astype(jnp.float32)[:, None]


def grouped_glu(lhs, w_gate, w_up, group_sizes, *, spec: GluSpec = GluSpec(), impl: GmmImpl = "auto",
                blocks: GmmBlocks = GmmBlocks()):
    """act(lhs[r] @ w_gate[g(r)], lhs[r] @ w_up[g(r)]) for rows sorted by group: the gated first
    half of an expert MLP. Shapes as `grouped_matmul` with w_gate, w_up [G, K, F]; -> [M, F]."""
    _check(lhs, w_gate, group_sizes)
    impl = _impl(impl, w_gate)
    if impl == "pallas" and isinstance(w_gate, Mxfp4Columns):
        if isinstance(w_gate, HandOffColumns):
            gate, up = _plain_pair(w_gate, w_up, "grouped_glu")
            return natural_order(grouped_glu_hopper_mxfp4(lhs, gate, up, group_sizes, spec=spec), w_gate)
        return grouped_glu_hopper_mxfp4(lhs, w_gate, w_up, group_sizes, spec=spec)
    if impl == "pallas":
        return grouped_glu_pallas(lhs, w_gate, w_up, group_sizes, spec=spec)
    w_gate, w_up = dense_weight(w_gate, lhs.dtype), dense_weight(w_up, lhs.dtype)
    if impl == "xla":
        return grouped_glu_reference(lhs, w_gate, w_up, group_sizes, spec=spec)
    return glu(_mgpu(lhs, w_gate, group_sizes, blocks), _mgpu(lhs, w_up, group_sizes, blocks), spec)


def _plain_pair(w_gate: HandOffColumns, w_up, op: str) -> tuple[Mxfp4Columns, Mxfp4Columns]:
    """Gate and up hand-off weights as plain `Mxfp4Columns` (the kernel then computes h in their column order)."""
    if type(w_up) is not type(w_gate):
        raise ValueError(f"{op}: the gate and up weights must both be {type(w_gate).__name__}, got "
                         f"{type(w_up).__name__} for up")
    return Mxfp4Columns(*w_gate), Mxfp4Columns(*w_up)


def hand_off_runs(w_gate, w_up, w_down, impl: GmmImpl = "auto") -> bool:
    """Whether `grouped_mlp` on these weights runs the Mosaic GPU kernel's GLU hand-off: `HandOffColumns` gate and
    up weights, plain `Mxfp4Columns` down, and the kernel the implementation for both sides (where the unsorted
    pairs may take `hopper_mxfp4_routed.routed_mlp_hopper_mxfp4`, the same launches with less glue)."""
    return (type(w_gate) is HandOffColumns and type(w_up) is HandOffColumns and type(w_down) is Mxfp4Columns
            and _impl(impl, w_gate) == "pallas" and _impl(impl, w_down) == "pallas")


def grouped_mlp(lhs, w_gate, w_up, w_down, group_sizes, row_scale=None, *, spec: GluSpec = GluSpec(),
                impl: GmmImpl = "auto"):
    """act(lhs[r] @ w_gate[g(r)], lhs[r] @ w_up[g(r)]) @ w_down[g(r)] (times row_scale[r]) for rows sorted by
    group: `grouped_glu` then `grouped_matmul`, or, with `HandOffColumns` gate and up weights where the Mosaic GPU
    kernel runs, its two launches with the GLU in the gated one's epilogue (h written as the down launch's slabs).
    Shapes as `grouped_glu` and `grouped_matmul`; -> [M, N] in lhs's dtype (fp32 with row_scale)."""
    if hand_off_runs(w_gate, w_up, w_down, impl):
        _check(lhs, w_gate, group_sizes)
        return grouped_mlp_hopper_mxfp4(lhs, w_gate, w_up, w_down, group_sizes, row_scale, spec=spec, hand_off="glu")
    h = grouped_glu(lhs, w_gate, w_up, group_sizes, spec=spec, impl=impl)
    return grouped_matmul(h, w_down, group_sizes, row_scale, impl=impl)


def _pair_impl(impl: GmmImpl, w) -> str:
    """The per-row paths exist as the Pallas kernel and the gather reference ("mgpu" takes the latter)."""
    return "pallas" if _impl(impl, w) == "pallas" else "xla"


def pair_matmul(lhs, rhs, group, valid, row_scale=None, *, repeat: int = 1, extra=None, impl: GmmImpl = "auto"):
    """Unsorted pairs, each with its own group: out[r] = lhs[r // repeat] @ rhs[group[r]] (* row_scale[r])
    where valid[r], else 0. lhs [M / repeat, K], rhs [G, K, N], group [M] int32, valid [M] bool -> [M, N].
    extra: optional [S, K, N] bf16 weights of groups G .. G + S - 1 (the shared experts)."""
    if _pair_impl(impl, rhs) == "pallas":
        if not isinstance(rhs, Mxfp4Columns):
            return pair_matmul_pallas(lhs, rhs, group, valid, row_scale, repeat=repeat, extra=extra)
        if extra is None:        # the Mosaic GPU kernel takes no extra groups: those run the reference
            return pair_matmul_hopper_mxfp4(lhs, rhs, group, valid, row_scale, repeat=repeat)
    return pair_matmul_reference(lhs, dense_weight(rhs, lhs.dtype), group, valid, row_scale, repeat=repeat, extra=extra)


def pair_glu(lhs, w_gate, w_up, group, valid, *, spec: GluSpec = GluSpec(), repeat: int = 1, extra=None,
             impl: GmmImpl = "auto"):
    """Unsorted pairs: act(x @ w_gate[group[r]], x @ w_up[group[r]]) with x = lhs[r // repeat] where
    valid[r], else 0. extra: optional (gate, up) [S, K, F] bf16 weights of groups G .. G + S - 1."""
    if _pair_impl(impl, w_gate) == "pallas":
        if not isinstance(w_gate, Mxfp4Columns):
            return pair_glu_pallas(lhs, w_gate, w_up, group, valid, spec=spec, repeat=repeat, extra=extra)
        if extra is None and isinstance(w_gate, HandOffColumns):
            gate, up = _plain_pair(w_gate, w_up, "pair_glu")
            return natural_order(pair_glu_hopper_mxfp4(lhs, gate, up, group, valid, spec=spec, repeat=repeat), w_gate)
        if extra is None:
            return pair_glu_hopper_mxfp4(lhs, w_gate, w_up, group, valid, spec=spec, repeat=repeat)
    return pair_glu_reference(lhs, dense_weight(w_gate, lhs.dtype), dense_weight(w_up, lhs.dtype), group, valid,
                              spec=spec, repeat=repeat, extra=extra)
