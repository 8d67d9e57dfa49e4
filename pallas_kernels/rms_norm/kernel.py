"""RMSNorm of a few rows in one Pallas launch (Triton lowering).

XLA runs a row norm as two kernels (the sum of squares, then the scaling); at decode each is a
~1.3 us launch for a 4.6 KB row, twice per layer. One program per row here: the row (padded to a
power of two by masked loads) is read once, normalised in fp32, cast to the input dtype, and
scaled by the weight (the Hugging Face order).

`add_rms_norm_pallas` also does the residual add before it, from the fp32 partial sums of the
branch output (a projection's slices of the reduction axis, or the routed experts' pairs of each
token): h + cast(sum of parts) and the norm of that, in the one launch that XLA runs as three.

Twins: `reference.rms_norm_reference`, `reference.add_rms_norm_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret, next_pow2


def _normed(x, w_ref, dtype, *, eps: float, features: int, valid, cols):
    """weight * rmsnorm(x) of one fp32 row, rounded to `dtype` where the model rounds."""
    inv = jax.lax.rsqrt(jnp.sum(x * x) / features + eps)
    y = (x * inv).astype(dtype).astype(jnp.float32)
    w = plt.load(w_ref.at[cols], mask=valid, other=0.0).astype(jnp.float32)
    return (w * y).astype(dtype)


def _kernel(x_ref, w_ref, o_ref, *, eps: float, features: int, width: int):
    row = pl.program_id(0)
    valid = jnp.arange(width, dtype=jnp.int32) < features
    cols = pl.ds(0, width)
    x = plt.load(x_ref.at[row, cols], mask=valid, other=0.0).astype(jnp.float32)
    plt.store(o_ref.at[row, cols], _normed(x, w_ref, o_ref.dtype, eps=eps, features=features, valid=valid, cols=cols),
              mask=valid)


def _add_kernel(h_ref, parts_ref, w_ref, h_out_ref, o_ref, *, eps: float, features: int, width: int, parts: int,
                parts_axis: int):
    row = pl.program_id(0)
    valid = jnp.arange(width, dtype=jnp.int32) < features
    cols = pl.ds(0, width)
    at = (lambda s: parts_ref.at[jnp.int32(s), row, cols]) if parts_axis == 0 else (
        lambda s: parts_ref.at[row, jnp.int32(s), cols])
    delta = plt.load(at(0), mask=valid, other=0.0).astype(jnp.float32)
    for s in range(1, parts):
        delta = delta + plt.load(at(s), mask=valid, other=0.0).astype(jnp.float32)
    h = plt.load(h_ref.at[row, cols], mask=valid, other=0.0).astype(jnp.float32)
    h = (h + delta.astype(h_out_ref.dtype).astype(jnp.float32)).astype(h_out_ref.dtype)
    plt.store(h_out_ref.at[row, cols], h, mask=valid)
    plt.store(o_ref.at[row, cols], _normed(h.astype(jnp.float32), w_ref, o_ref.dtype, eps=eps, features=features,
                                           valid=valid, cols=cols), mask=valid)


@functools.partial(jax.jit, static_argnames=("eps", "parts_axis", "num_warps", "interpret"))
def add_rms_norm_pallas(h, parts, weight, *, eps: float, parts_axis: int = 0, num_warps: int = 16,
                        interpret: bool | None = None):
    """(h + cast(sum of parts), weight * rmsnorm(that)) in one launch.

    Args:
      h: [M, D] residual rows. parts: partial sums of the branch output (fp32; or the output itself
        as one part in any dtype), [S, M, D] (parts_axis 0) or [M, S, D] (parts_axis 1), added in
        fp32 in order s = 0..S-1 and cast to h's dtype before the residual add (the model's
        rounding). weight: [D]. num_warps: of the one program per row (16: many loads in flight; the
        fastest of 2-16 on the H200, `benchmarks/small_launches.py`).
    Returns:
      (new residual [M, D], its norm [M, D]), both in h's dtype.
    """
    if h.ndim != 2 or weight.shape != h.shape[-1:] or parts.ndim != 3 or parts_axis not in (0, 1):
        raise ValueError(f"add rms norm: expected rows [M, D], parts [S, M, D] or [M, S, D] and a weight [D]; got "
                         f"{h.shape}, {parts.shape} (axis {parts_axis}) and {weight.shape}")
    rows_of_parts = parts.shape[1 - parts_axis]
    if rows_of_parts != h.shape[0] or parts.shape[2] != h.shape[1]:
        raise ValueError(f"add rms norm: parts {parts.shape} (axis {parts_axis}) do not match rows {h.shape}")
    m, d = h.shape
    return pl.pallas_call(
        functools.partial(_add_kernel, eps=eps, features=d, width=next_pow2(d),
                          parts=parts.shape[parts_axis], parts_axis=parts_axis),
        grid=(m,),
        out_shape=(jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(h.shape, h.dtype)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=default_interpret() if interpret is None else interpret,
        name="add_rms_norm",
    )(h, parts, weight)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm_pallas(x, weight, *, eps: float, interpret: bool | None = None):
    """weight * rmsnorm(x) over the last axis.

    Args:
      x: [M, D] rows. weight: [D]. eps: added to the mean square.
    Returns:
      [M, D] in x's dtype: x normalised in fp32, cast to x's dtype, times the weight, cast again.
    """
    if x.ndim != 2 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms norm: expected rows [M, D] and a weight [D]; got {x.shape} and {weight.shape}")
    m, d = x.shape
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, features=d, width=next_pow2(d)),
        grid=(m,),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=default_interpret() if interpret is None else interpret,
        name="rms_norm",
    )(x, weight)
