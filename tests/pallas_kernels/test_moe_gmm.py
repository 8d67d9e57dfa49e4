"""Grouped matmul: the Hopper Mosaic GPU kernel (GPU-interpret mode on CPU) against lax.ragged_dot."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

from pallas_kernels.moe_gmm import GmmBlocks, grouped_matmul, grouped_matmul_reference


@pytest.mark.parametrize("sizes", [[64, 0, 100, 92], [3, 5, 0, 40]])   # an empty group; fewer rows than M
def test_mgpu_kernel_matches_ragged_dot(rng, sizes):
    m, k, n = 256, 128, 128
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / 8, jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    out = grouped_matmul(lhs, rhs, gs, impl="mgpu", blocks=GmmBlocks(block_m=64, block_n=64, block_k=64,
                                                                       max_concurrent_steps=2))
    ref = grouped_matmul_reference(lhs, rhs, gs)
    assert_close("mgpu vs ragged_dot", out, ref, dtype="bfloat16")
    assert not np.asarray(out[sum(sizes):], np.float32).any()  # rows past the groups are zero


def test_shape_errors():
    with pytest.raises(ValueError, match="expected lhs"):
        grouped_matmul(jnp.zeros((4, 8)), jnp.zeros((2, 4, 8)), jnp.array([2, 2]))
