"""RMSNorm of a few rows in one launch (`pallas_kernels.rms_norm`): the kernel (interpret mode on
the CPU, compiled on a GPU) equals the model's norm (`k3jax.layers.norms`, the Hugging Face order)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_close

from k3jax.layers.norms import RMSNorm, rms_normalize
from pallas_kernels.rms_norm import add_rms_norm, add_rms_norm_pallas, rms_norm, rms_norm_pallas, rms_norm_reference


@pytest.mark.parametrize("m,d,dtype", [(1, 2304, "bfloat16"), (5, 7168, "bfloat16"), (16, 96, "float32"),
                                       (3, 64, "bfloat16")])
def test_kernel_matches_the_models_norm(rng, interpret, m, d, dtype):
    x = jnp.asarray(rng.standard_normal((m, d)) * 3, dtype)
    w = jnp.asarray(rng.standard_normal(d), dtype)
    got = rms_norm_pallas(x, w, eps=1e-6, interpret=interpret)
    model = (w * rms_normalize(x, 1e-6).astype(x.dtype)).astype(x.dtype)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert_close("kernel vs model norm", got, model, dtype=dtype)
    assert_close("twin vs model norm", rms_norm_reference(x, w, 1e-6), model, dtype=dtype)


def test_module_dispatch(rng):
    """RMSNorm(impl="pallas") on decode rows takes the kernel, on prompt rows the twin; both equal impl="xla"."""
    for shape in [(2, 1, 64), (2, 40, 64)]:
        x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        ref = RMSNorm(64, 1e-5, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        ref.weight[...] = jnp.asarray(rng.standard_normal(64), jnp.bfloat16)
        fast = RMSNorm(64, 1e-5, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), impl="pallas")
        fast.weight[...] = ref.weight[...]
        assert_close(f"module {shape}", fast(x), ref(x), dtype="bfloat16")


def test_errors():
    with pytest.raises(ValueError, match="expected rows"):
        rms_norm_pallas(jnp.ones((2, 8)), jnp.ones((7,)), eps=1e-6)
    with pytest.raises(ValueError, match="unknown impl"):
        rms_norm(jnp.ones((2, 8)), jnp.ones((8,)), 1e-6, impl="cuda")


@pytest.mark.parametrize("m,d,parts,axis,dtype", [(1, 2304, 8, 0, "bfloat16"), (3, 2304, 9, 1, "bfloat16"),
                                                  (5, 96, 1, 0, "float32"), (16, 64, 4, 1, "bfloat16")])
def test_add_norm_matches_add_then_norm(rng, interpret, m, d, parts, axis, dtype):
    """The residual add from fp32 partial sums (a split projection's slices, axis 0; a token's
    expert pairs, axis 1), then the norm: equal to the model's add (sum, cast, add) and norm."""
    h = jnp.asarray(rng.standard_normal((m, d)) * 2, dtype)
    shape = (parts, m, d) if axis == 0 else (m, parts, d)
    p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(d), dtype)
    new_h, normed = add_rms_norm_pallas(h, p, w, eps=1e-6, parts_axis=axis, interpret=interpret)
    want_h = (h + jnp.sum(p, axis=axis).astype(h.dtype)).astype(h.dtype)
    assert new_h.dtype == normed.dtype == h.dtype
    assert_close("residual", new_h, want_h, dtype=dtype)
    assert_close("normed", normed, (w * rms_normalize(want_h, 1e-6).astype(h.dtype)).astype(h.dtype), dtype=dtype)
    for impl in ("xla", "pallas"):
        got_h, got_n = add_rms_norm(h[None], p if axis == 1 else p[:, None], w, 1e-6, parts_axis=axis, impl=impl)
        assert got_h.shape == (1, m, d)
        assert_close(f"dispatch {impl}", got_n[0], normed, dtype=dtype)


def test_add_norm_errors():
    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm_pallas(jnp.ones((2, 8)), jnp.ones((3, 4, 8)), jnp.ones((8,)), eps=1e-6)
    with pytest.raises(ValueError, match="expected rows"):
        add_rms_norm_pallas(jnp.ones((2, 8)), jnp.ones((2, 8)), jnp.ones((8,)), eps=1e-6)
