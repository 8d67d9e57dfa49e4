"""Few-row projections in one launch (`pallas_kernels.skinny`): the launch plan covers every
weight's columns and reduction axis exactly once, and the fused kernel (interpret mode on the CPU,
compiled on a GPU) matches one XLA dot per weight."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close, kernel_dtype

from pallas_kernels.skinny import (SkinnyBlocks, fused_projections, fused_projections_pallas,
                                   fused_projections_reference, plan, skinny_matmul)

SMALL = SkinnyBlocks(block_n=32, block_k=32, target_programs=24, min_split_k=32)


def test_plan_covers_every_block_once():
    rng = np.random.default_rng(0)
    for _ in range(50):
        groups = tuple((16 * int(rng.integers(1, 40)), tuple(16 * int(rng.integers(1, 20)) for _ in
                                                               range(int(rng.integers(1, 4)))))
                       for _ in range(int(rng.integers(1, 4))))
        segments = plan(groups, SMALL)
        assert [s.weight for s in segments] == list(range(sum(len(w) for _, w in groups)))
        nxt, seen = 0, set()
        for s in segments:
            assert s.first == nxt and s.programs == s.n_dim // s.bn * s.splits
            assert s.n_dim % s.bn == 0 and (s.k_dim // s.splits) % s.bk == 0 and s.k_dim % s.splits == 0
            nxt = s.first + s.programs
            for c in range(s.n_dim // s.bn):
                for part in range(s.splits):
                    key = (s.group, s.out_col + c * s.bn, part)
                    assert key not in seen
                    seen.add(key)
        for g, (k, widths) in enumerate(groups):  # every output column of every group, every slice
            splits = {s.splits for s in segments if s.group == g}
            assert len(splits) == 1
            cols = sorted(c for (gg, c, p) in seen if gg == g and p == 0)
            assert sum(s.bn for s in segments if s.group == g for _ in range(s.n_dim // s.bn)) == sum(widths)
            assert len(cols) == len(set(cols))


def test_narrow_weights_split_the_reduction_axis():
    """4096 -> 2304 (an output projection of the 48B shape): 36 column blocks alone would leave most
    SMs idle, so the reduction axis is cut until there are about two programs per SM. KDA's
    q|k|v|f_a|b|g has one column block per SM already: no split (no partial sums to add up). With
    min_block_n=32 it reaches two per SM with 32-wide blocks instead; without the unsplit rule it splits."""
    (seg,) = plan(((4096, (2304,)),), SkinnyBlocks())
    assert seg.splits == 8 and seg.programs == 288 and seg.bn == 64
    kda = ((2304, (4096, 4096, 4096, 128, 32, 128)),)
    fused = plan(kda, SkinnyBlocks())
    assert {s.splits for s in fused} == {1} and sum(s.programs for s in fused) == 192 + 2 + 1 + 2
    narrow = plan(kda, SkinnyBlocks(min_block_n=32))
    assert {s.splits for s in narrow} == {1} and {s.bn for s in narrow} == {32}
    assert sum(s.programs for s in narrow) == 3 * 128 + 4 + 1 + 4
    split = plan(kda, SkinnyBlocks(unsplit_programs=1000))
    assert {s.splits for s in split} == {2} and sum(s.programs for s in split) == 2 * (192 + 2 + 1 + 2)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_kernel_matches_the_dots(rng, interpret, m, dtype):
    """Three groups in one launch: two weights on one input (one split over K), one on another
    input with a different K, one whose K is too short to split."""
    xs = (jnp.asarray(rng.standard_normal((m, 256)), dtype), jnp.asarray(rng.standard_normal((m, 64)), dtype),
          jnp.asarray(rng.standard_normal((m, 32)), dtype))
    weights = (jnp.asarray(rng.standard_normal((256, 96)) / 16, dtype),
               jnp.asarray(rng.standard_normal((256, 32)) / 16, dtype),
               jnp.asarray(rng.standard_normal((64, 64)) / 8, dtype),
               jnp.asarray(rng.standard_normal((32, 16)) / 8, dtype))
    counts = (2, 1, 1)
    assert [s.splits for s in plan(((256, (96, 32)), (64, (64,)), (32, (16,))), SMALL)] == [4, 4, 2, 1]
    for out_dtype in (None, jnp.float32):
        got = fused_projections_pallas(xs, weights, counts=counts, out_dtype=out_dtype, blocks=SMALL,
                                       interpret=interpret)
        want = fused_projections_reference(xs, weights, counts=counts, out_dtype=out_dtype)
        for g, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert_close(f"group {g}", a, b, dtype=kernel_dtype(dtype, interpret))


@pytest.mark.parametrize("m", [1, 7])
def test_partial_sums_add_up_to_the_dots(rng, interpret, m):
    """partial_groups: a split group comes back as its fp32 slices of the reduction axis, an unsplit
    one as a single slice; their sums are the dots. Through the dispatch site, a group with a weight
    off the kernel is one XLA slice."""
    xs = (jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16), jnp.asarray(rng.standard_normal((m, 32)), jnp.bfloat16))
    weights = (jnp.asarray(rng.standard_normal((256, 96)) / 16, jnp.bfloat16),
               jnp.asarray(rng.standard_normal((32, 16)) / 8, jnp.bfloat16))
    got = fused_projections_pallas(xs, weights, counts=(1, 1), blocks=SMALL, partial_groups=(0, 1), interpret=interpret)
    want = fused_projections_reference(xs, weights, counts=(1, 1), out_dtype=jnp.float32)
    splits = [s.splits for s in plan(((256, (96,)), (32, (16,))), SMALL)]
    assert splits[0] > 1 and splits[1] == 1
    assert got[0].shape == (splits[0], m, 96) and got[1].shape == (1, m, 16) and {g.dtype for g in got} == {jnp.dtype("float32")}
    for g, (a, b) in enumerate(zip(got, want)):
        assert_close(f"group {g}", jnp.sum(a, axis=0), b, dtype="bfloat16")
    w7 = jnp.asarray(rng.standard_normal((256, 7)), jnp.bfloat16)
    kernel, dots = fused_projections([(xs[0], (weights[0],)), (xs[0], (weights[0], w7))], impl="pallas",
                                     partial_groups=(0, 1))
    assert dots.shape == (1, m, 103) and dots.dtype == jnp.float32
    assert_close("kernel group", jnp.sum(kernel, axis=0), want[0], dtype="bfloat16")
    assert_close("dot group", dots[0], jnp.concatenate([want[0], jnp.dot(xs[0], w7, preferred_element_type=jnp.float32)],
                                                       axis=-1), dtype="bfloat16")


@pytest.mark.parametrize("m,k,n", [(1, 256, 512), (5, 128, 96), (16, 64, 32)])
def test_one_weight_through_the_dispatch_site(rng, interpret, m, k, n):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    out = skinny_matmul(x, w, impl="pallas", out_dtype=jnp.float32)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert_close("skinny", out, jnp.dot(x, w, preferred_element_type=jnp.float32), dtype="bfloat16")


def test_weights_that_do_not_tile_take_the_dot(rng):
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    w7 = jnp.asarray(rng.standard_normal((64, 7)), jnp.float32)
    w32 = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    odd, even, mixed = fused_projections([(x, (w7,)), (x, (w32,)), (x, (w32, w7, w32))], impl="pallas")
    assert_close("n=7", odd, x @ w7, dtype="float32")
    assert_close("n=32", even, x @ w32, dtype="float32")
    assert_close("32|7|32", mixed, jnp.concatenate([x @ w32, x @ w7, x @ w32], axis=-1), dtype="float32")
    many = jnp.asarray(rng.standard_normal((17, 64)), jnp.float32)   # more rows than a tile: the dot
    assert_close("17 rows", skinny_matmul(many, w32, impl="pallas"), many @ w32, dtype="float32")


def test_errors():
    x = jnp.zeros((2, 64))
    with pytest.raises(ValueError, match="unknown impl"):
        fused_projections([(x, (jnp.zeros((64, 32)),))], impl="cuda")
    with pytest.raises(ValueError, match="does not match"):
        fused_projections_pallas((x,), (jnp.zeros((32, 32)),), counts=(1,))
