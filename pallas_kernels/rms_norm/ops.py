"""The dispatch site of the row RMSNorm.

impl "xla": the twin (two XLA kernels on the GPU). impl "pallas": one launch for at most MAX_ROWS
rows (decode), the twin beyond. impl "fused": as "pallas", and the residual add before a norm
(`add_rms_norm`) joins its launch. impl "auto": "fused" on a GPU backend (measured at the 48B decode:
one launch of 3.3 us for XLA's add and the norm kernel's 3.4), "xla" elsewhere.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax

from pallas_kernels.rms_norm.kernel import add_rms_norm_pallas, rms_norm_pallas
from pallas_kernels.rms_norm.reference import add_rms_norm_reference, rms_norm_reference

NormImpl = Literal["auto", "xla", "pallas", "fused"]
NORM_IMPLS: tuple[str, ...] = get_args(NormImpl)
MAX_ROWS = 64    # one program per row: a prompt's rows are XLA's (it fuses them well at that size)


def resolve_norm_impl(impl: NormImpl) -> str:
    """"auto" -> "fused" on a GPU backend, "xla" elsewhere; other names unchanged (checked)."""
    if impl not in NORM_IMPLS:
        raise ValueError(f"rms norm: unknown impl {impl!r}; expected one of {NORM_IMPLS}")
    if impl == "auto":
        return "fused" if jax.default_backend() == "gpu" else "xla"
    return impl


def _takes_kernel(impl: NormImpl, rows: int) -> bool:
    """Whether `impl` runs `rows` rows through the kernels (checks the name)."""
    return resolve_norm_impl(impl) in ("pallas", "fused") and rows <= MAX_ROWS


def rms_norm(x, weight, eps: float, *, impl: NormImpl = "auto"):
    """weight * rmsnorm(x) over the last axis of x [..., D]; -> x's shape and dtype."""
    rows = x.size // x.shape[-1]
    if _takes_kernel(impl, rows):
        return rms_norm_pallas(x.reshape(rows, x.shape[-1]), weight, eps=eps).reshape(x.shape)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(h, parts, weight, eps: float, *, parts_axis: int = 0, impl: NormImpl = "auto"):
    """(h + cast(sum of parts), weight * rmsnorm(that)) for h [..., D] and fp32 parts with one extra
    axis at `parts_axis` (0: [S, ..., D]; 1: [rows, S, D] with rows = h's rows flattened)."""
    d = h.shape[-1]
    rows = h.size // d
    flat = parts.reshape((-1, rows, d) if parts_axis == 0 else (rows, -1, d))
    if _takes_kernel(impl, rows):
        new_h, normed = add_rms_norm_pallas(h.reshape(rows, d), flat, weight, eps=eps, parts_axis=parts_axis)
    else:
        new_h, normed = add_rms_norm_reference(h.reshape(rows, d), flat, weight, eps, parts_axis=parts_axis)
    return new_h.reshape(h.shape), normed.reshape(h.shape)
