"""RMSNorm of a few rows in one Pallas launch (Triton lowering).

XLA runs a row norm as two kernels (the sum of squares, then the scaling); at decode each is a
~1.3 us launch for a 4.6 KB row, twice per layer. One program per row here: the row (padded to a
power of two by masked loads) is read once, normalised in fp32, cast to the input dtype, and
scaled by the weight (the Hugging Face order).

Twin: `reference.rms_norm_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret


def _kernel(x_ref, w_ref, o_ref, *, eps: float, features: int, width: int):
    row = pl.program_id(0)
    valid = jnp.arange(width, dtype=jnp.int32) < features
    cols = pl.ds(0, width)
    x = plt.load(x_ref.at[row, cols], mask=valid, other=0.0).astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(x * x) / features + eps)
    y = (x * inv).astype(o_ref.dtype).astype(jnp.float32)
    w = plt.load(w_ref.at[cols], mask=valid, other=0.0).astype(jnp.float32)
    plt.store(o_ref.at[row, cols], (w * y).astype(o_ref.dtype), mask=valid)


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
        functools.partial(_kernel, eps=eps, features=d, width=1 << (d - 1).bit_length()),
        grid=(m,),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=default_interpret() if interpret is None else interpret,
        name="rms_norm",
    )(x, weight)
