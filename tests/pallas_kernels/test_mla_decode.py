"""Pallas MLA decode kernel (interpret mode on CPU, compiled on a GPU) against its reference twin."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close, kernel_dtype

from pallas_kernels.mla_decode import MLADecodeBlocks, mla_decode_pallas, mla_decode_reference


@pytest.mark.parametrize("b,sq,h,r,p,s,dtype", [
    (3, 1, 4, 32, 16, 128, "float32"),
    (2, 1, 12, 64, 16, 96, "bfloat16"),   # K3 with 8-way TP: 12 heads
    (2, 3, 5, 32, 16, 64, "float32"),     # three query tokens per row (speculative verification)
])
def test_matches_reference_with_ragged_lengths_and_poisoned_tail(rng, interpret, b, sq, h, r, p, s, dtype):
    q = jnp.asarray(rng.standard_normal((b, sq, h, r)), dtype)
    qp = jnp.asarray(rng.standard_normal((b, sq, h, p)), dtype)
    cache = rng.standard_normal((b, s, r + p)).astype(np.float32)
    lengths = np.array([sq, s, 16 + sq][:b] if b == 3 else [s, sq + 15], np.int32)  # length 1 row, full, edges
    clean = np.where(np.arange(s)[None, :, None] < lengths[:, None, None], cache, 0.0)
    poisoned = np.where(np.arange(s)[None, :, None] < lengths[:, None, None], cache, np.nan)
    ref = mla_decode_reference(q, qp, jnp.asarray(clean, dtype), jnp.asarray(lengths), scale=0.125)
    for splits in (1, 3):
        out = mla_decode_pallas(q, qp, jnp.asarray(poisoned, dtype), jnp.asarray(lengths), scale=0.125,
                                blocks=MLADecodeBlocks(block_h=16, block_k=16, num_splits=splits), interpret=interpret)
        assert_close(f"splits={splits}", out, ref, dtype=kernel_dtype(dtype, interpret))


def test_rejects_bad_shapes(rng, interpret):
    q = jnp.zeros((1, 1, 2, 32))
    with pytest.raises(ValueError, match="cache must be"):
        mla_decode_pallas(q, jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 64, 40)), jnp.array([3]), scale=1.0)
    with pytest.raises(ValueError, match="multiple of block_k"):
        mla_decode_pallas(q, jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 40, 48)), jnp.array([3]), scale=1.0,
                          blocks=MLADecodeBlocks(block_k=16), interpret=interpret)
