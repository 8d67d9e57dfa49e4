"""Grouped matmuls: the row-tiled Pallas kernel (interpret mode on CPU, compiled on a GPU) and
JAX's Hopper Mosaic GPU kernel (GPU-interpret mode on CPU) against lax.ragged_dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close, kernel_dtype

from pallas_kernels.moe_gmm import (GluSpec, GmmBlocks, TileBlocks, glu, grouped_glu, grouped_glu_pallas,
                                    grouped_glu_reference, grouped_matmul, grouped_matmul_pallas,
                                    grouped_matmul_reference, max_tiles, pair_glu_pallas, pair_glu_reference,
                                    pair_matmul_pallas, pair_matmul_reference, tile_schedule)
from pallas_kernels.moe_gmm.schedule import tile_schedule_of_keys

SPECS = [GluSpec(), GluSpec("situ", 4.0, 25.0), GluSpec("situ", 2.0, None)]


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


def _grouping(rng, m, g, empty_share=0.5):
    """Random group sizes over g groups (about half empty), summing to at most m."""
    weights = rng.uniform(size=g) * (rng.uniform(size=g) > empty_share)
    weights = weights if weights.sum() else np.eye(g)[0]
    sizes = np.floor(weights / weights.sum() * rng.integers(m // 2, m + 1)).astype(np.int32)
    return jnp.asarray(sizes)


@pytest.mark.parametrize("m,k,n,g,blocks", [
    (8, 64, 32, 16, TileBlocks(16, 32, 32)),        # decode: few rows, most groups empty
    (70, 128, 64, 5, TileBlocks(16, 64, 64)),       # groups longer than a tile
    (300, 64, 128, 4, TileBlocks(64, 128, 64)),     # prefill-shaped tiles
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiled_kernel_matches_ragged_dot(rng, interpret, m, k, n, g, blocks, dtype):
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = [jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype) for _ in range(2)]
    gs = _grouping(rng, m, g)
    scale = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    out = grouped_matmul_pallas(lhs, w[0], gs, blocks=blocks, interpret=interpret)
    dtype = kernel_dtype(dtype, interpret)
    assert_close("matmul", out, grouped_matmul_reference(lhs, w[0], gs), dtype=dtype)
    assert not np.asarray(out[int(gs.sum()):], np.float32).any()  # rows past the groups are zero
    scaled = grouped_matmul_pallas(lhs, w[0], gs, scale, blocks=blocks, interpret=interpret)
    assert scaled.dtype == jnp.float32
    assert_close("scaled", scaled, grouped_matmul_reference(lhs, w[0], gs, scale), dtype=dtype)
    for spec in SPECS:
        out = grouped_glu_pallas(lhs, w[0], w[1], gs, spec=spec, blocks=blocks, interpret=interpret)
        assert_close(f"glu {spec.kind}", out, grouped_glu_reference(lhs, w[0], w[1], gs, spec=spec), dtype=dtype)


def test_rows_poisoned_past_the_groups_never_leak(rng, interpret):
    """NaN rows past sum(group_sizes) (another shard's pairs) must not reach any output row."""
    m, k, n = 40, 32, 32
    gs = jnp.asarray([5, 0, 9, 3], jnp.int32)
    lhs = np.asarray(rng.standard_normal((m, k)), np.float32)
    lhs[17:] = np.nan
    w = jnp.asarray(rng.standard_normal((4, k, n)), jnp.float32)
    out = grouped_matmul_pallas(jnp.asarray(lhs), w, gs, blocks=TileBlocks(16, 32, 32), interpret=interpret)
    clean = jnp.asarray(np.where(np.isnan(lhs), 0.0, lhs))
    assert_close("tiled", out, grouped_matmul_reference(clean, w, gs), dtype=kernel_dtype("float32", interpret))


def _worst_groupings(block_m: int):
    """(sizes, m) that take the most tiles `max_tiles` allows: every group one row past a whole tile, one row each,
    or one group taking what the others leave; with and without rows past the groups. And no row in any group."""
    for g, per in ((5, block_m + 1), (7, 1), (3, 2 * block_m + 1)):
        yield [per] * g, per * g
        yield [per] * g, per * g + 3
    yield [1] * 6 + [3 * block_m + 5], 6 + 3 * block_m + 5
    yield [0] * 4, 5                                        # no row in any group: no tile


@pytest.mark.parametrize("block_m", [1, 4, 8, 16])
def test_tile_schedule_covers_every_row_once(rng, block_m):
    """Worst groupings and random ones; `tile_schedule_of_keys` gives the same schedule from the rows' keys."""
    worst = [(jnp.asarray(s, jnp.int32), m, len(s)) for s, m in _worst_groupings(block_m)]
    schedule = jax.jit(tile_schedule, static_argnums=(1, 2))            # compiled, as in the kernel
    of_keys = jax.jit(tile_schedule_of_keys, static_argnums=(1, 2))
    for case in range(20 + len(worst)):
        if case < len(worst):
            sizes, m, g = worst[case]
        else:
            g = int(rng.integers(1, 12))
            m = int(rng.integers(1, 60))
            sizes = _grouping(rng, m, g)
        sched = np.asarray(schedule(sizes, m, block_m))
        assert sched.shape == (3, max_tiles(m, g, block_m))
        owner = np.full(m, -1)
        for group, first, last in sched.T:
            assert last - first <= block_m
            for r in range(first, last):
                assert owner[r] == -1, "a row in two tiles"
                owner[r] = group
        expected = np.repeat(np.arange(g), np.asarray(sizes))
        np.testing.assert_array_equal(owner[:len(expected)], expected)
        assert (owner[len(expected):] == -1).all()
        if case < len(worst) and len(expected) == m:      # the bound is reached: no tile to spare
            assert int(np.sum(sched[2] > sched[1])) == sched.shape[1]
        # The same schedule counted from the rows' keys (shuffled: the order they come in does not matter; rows
        # past the groups keyed G), as the routed hand-off computes it.
        key = rng.permutation(np.concatenate([np.repeat(np.arange(g), np.asarray(sizes)),
                                              np.full(m - len(expected), g)])).astype(np.int32)
        np.testing.assert_array_equal(np.asarray(of_keys(jnp.asarray(key), g, block_m)), sched)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_dispatch_site(rng, interpret, impl):
    lhs = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
    w = [jnp.asarray(rng.standard_normal((3, 32, 16)), jnp.float32) for _ in range(2)]
    gs = jnp.asarray([10, 0, 14], jnp.int32)
    assert_close(impl, grouped_glu(lhs, w[0], w[1], gs, spec=SPECS[1], impl=impl),
                 grouped_glu_reference(lhs, w[0], w[1], gs, spec=SPECS[1]),
                 dtype=kernel_dtype("float32", interpret or impl == "xla"))


def test_shape_errors():
    with pytest.raises(ValueError, match="expected lhs"):
        grouped_matmul(jnp.zeros((4, 8)), jnp.zeros((2, 4, 8)), jnp.array([2, 2]))
    with pytest.raises(ValueError, match="unknown impl"):
        grouped_matmul(jnp.zeros((4, 8)), jnp.zeros((2, 8, 8)), jnp.array([2, 2]), impl="cuda")
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul_pallas(jnp.zeros((4, 24)), jnp.zeros((2, 24, 16)), jnp.array([2, 2]))


def test_sides_that_are_not_powers_of_two_take_smaller_blocks(rng, interpret):
    """An expert width of 96 (the shipped tiny model's) runs with 32-column blocks, not an error."""
    lhs = jnp.asarray(rng.standard_normal((12, 64)), jnp.float32)
    w = [jnp.asarray(rng.standard_normal((3, 64, 96)) / 8, jnp.float32) for _ in range(2)]
    gs = jnp.asarray([4, 0, 8], jnp.int32)
    out = grouped_glu_pallas(lhs, w[0], w[1], gs, spec=SPECS[1], blocks=TileBlocks(16, 128, 128), interpret=interpret)
    assert_close("n=96", out, grouped_glu_reference(lhs, w[0], w[1], gs, spec=SPECS[1]),
                 dtype=kernel_dtype("float32", interpret))



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pair_tiles_match_ragged_dot(rng, interpret, dtype):
    """One tile per unsorted row (decode's token-expert pairs): equal to sorting the rows by group
    and running lax.ragged_dot; invalid rows (another shard's pairs) come out zero even when NaN."""
    m, k, n, g = 12, 64, 32, 5
    lhs = np.asarray(rng.standard_normal((m, k)), np.float32)
    group = rng.integers(0, g, m).astype(np.int32)
    valid = rng.uniform(size=m) > 0.25
    lhs[~valid] = np.nan
    w = [jnp.asarray(rng.standard_normal((g, k, n)) / 8, dtype) for _ in range(2)]
    scale = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    order = np.argsort(np.where(valid, group, g), kind="stable")
    sizes = jnp.asarray(np.bincount(group[valid], minlength=g), jnp.int32)
    clean = jnp.asarray(np.where(valid[:, None], lhs, 0.0), dtype)
    sorted_lhs = clean[order]
    unsort = np.argsort(order)
    tol = kernel_dtype(dtype, interpret)
    x = jnp.asarray(lhs, dtype)
    got = pair_matmul_pallas(x, w[0], jnp.asarray(group), jnp.asarray(valid), scale, interpret=interpret)
    want = grouped_matmul_reference(sorted_lhs, w[0], sizes, scale[order])[unsort]
    assert_close("pair matmul", got, want, dtype=tol)
    got = pair_glu_pallas(x, w[0], w[1], jnp.asarray(group), jnp.asarray(valid), spec=SPECS[1], interpret=interpret)
    want = grouped_glu_reference(sorted_lhs, w[0], w[1], sizes, spec=SPECS[1])[unsort]
    assert_close("pair glu", got, want, dtype=tol)
    assert not np.asarray(got[~valid], np.float32).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pairs_with_extra_groups(rng, interpret, dtype):
    """`extra` weights hold groups G, G + 1, .. in the same launch (the shared experts beside the
    routed ones): equal to one weight array with both stacked, and to a per-row einsum."""
    tokens, x_per, k, f, g, s = 3, 3, 64, 32, 5, 1
    m = tokens * x_per
    lhs = jnp.asarray(rng.standard_normal((tokens, k)), dtype)
    group = rng.integers(0, g, m).astype(np.int32)
    group[x_per - 1::x_per] = g             # each token's last pair is the extra group (its shared expert)
    group, valid = jnp.asarray(group), jnp.asarray(rng.uniform(size=m) > 0.2)
    w = [jnp.asarray(rng.standard_normal((g, k, f)) / 8, dtype) for _ in range(2)]
    ws = [jnp.asarray(rng.standard_normal((s, k, f)) / 8, dtype) for _ in range(2)]
    w2, w2s = (jnp.asarray(rng.standard_normal((n, f, k)) / 8, dtype) for n in (g, s))
    scale = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    tol = kernel_dtype(dtype, interpret)
    stacked = [jnp.concatenate([a, b]) for a, b in zip(w, ws)]
    h = pair_glu_pallas(lhs, w[0], w[1], group, valid, spec=SPECS[1], repeat=x_per, extra=tuple(ws), interpret=interpret)
    assert_close("glu, extra groups", h, pair_glu_pallas(lhs, *stacked, group, valid, spec=SPECS[1], repeat=x_per,
                                                         interpret=interpret), dtype=tol)
    x = jnp.repeat(lhs, x_per, axis=0).astype(jnp.float32)
    rows = [glu(x[r] @ stacked[0][group[r]].astype(jnp.float32), x[r] @ stacked[1][group[r]].astype(jnp.float32),
                SPECS[1]) * valid[r] for r in range(m)]
    assert_close("glu, extra groups vs rows", h, jnp.stack(rows), dtype=tol)
    y = pair_matmul_pallas(h, w2, group, valid, scale, extra=w2s, interpret=interpret)
    want = pair_matmul_reference(h, jnp.concatenate([w2, w2s]), group, valid, scale)
    assert_close("matmul, extra groups", y, want, dtype=tol)
    assert_close("reference, extra", pair_matmul_reference(h, w2, group, valid, scale, extra=w2s), want, dtype=dtype)
    with pytest.raises(ValueError, match="do not match"):
        pair_matmul_pallas(h, w2, group, valid, scale, extra=w2s[:, :16], interpret=interpret)


@pytest.mark.parametrize("blocks", [TileBlocks(16, 128, 128, 8, 3), TileBlocks(16, 64, 64, 4, 4)])
def test_pairs_under_the_decode_tile_settings(rng, interpret, blocks):
    """The tile settings `TileBlocks.for_pairs` picks at the 48B decode (128-wide, 8 warps; 64-deep
    steps), on sides that are several blocks long and one that is not a multiple of the block:
    equal to a per-row einsum."""
    tokens, x_per, k, f = 2, 3, 320, 256
    m, g = tokens * x_per, 4
    lhs = jnp.asarray(rng.standard_normal((tokens, k)), jnp.bfloat16)
    group = jnp.asarray(rng.integers(0, g, m).astype(np.int32))
    valid = jnp.asarray(rng.uniform(size=m) > 0.2)
    w1, w3 = (jnp.asarray(rng.standard_normal((g, k, f)) / 16, jnp.bfloat16) for _ in range(2))
    w2 = jnp.asarray(rng.standard_normal((g, f, k)) / 16, jnp.bfloat16)
    scale = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    h = pair_glu_pallas(lhs, w1, w3, group, valid, spec=SPECS[1], repeat=x_per, blocks=blocks, interpret=interpret)
    x = jnp.repeat(lhs, x_per, axis=0).astype(jnp.float32)
    rows = [glu(x[r] @ w1[group[r]].astype(jnp.float32), x[r] @ w3[group[r]].astype(jnp.float32), SPECS[1]) * valid[r]
            for r in range(m)]
    tol = kernel_dtype(jnp.bfloat16, interpret)
    assert_close("glu pairs", h, jnp.stack(rows), dtype=tol)
    y = pair_matmul_pallas(h, w2, group, valid, scale, blocks=blocks, interpret=interpret)
    assert_close("matmul pairs", y, pair_matmul_reference(h, w2, group, valid, scale), dtype=tol)


def test_pair_tile_rule():
    """128-wide blocks only where 64-wide ones spill just past one wave of programs; 64-deep steps
    for short reductions; packed weights keep their own form."""
    glu9 = TileBlocks.for_pairs(9, 2304, 1024)
    assert (glu9.block_n, glu9.block_k, glu9.num_warps) == (128, 128, 8)
    glu8 = TileBlocks.for_pairs(8, 2304, 1024)
    assert (glu8.block_n, glu8.block_k) == (64, 128)
    down9 = TileBlocks.for_pairs(9, 1024, 2304)
    assert (down9.block_n, down9.block_k) == (64, 64)
    assert TileBlocks.for_pairs(72, 2304, 1024).block_n == 64
    assert TileBlocks.for_pairs(9, 2304, 1024, packed=True) == TileBlocks.for_rows(1, packed=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pairs_read_each_token_row_for_its_choices(rng, interpret, dtype):
    """repeat = X: pair r reads token r // X (a token's X expert choices, no repeated copy of the
    input); equal to the gather references on the repeated rows. Invalid pairs (another shard's
    experts) come out zero without masking: their routing weight is NaN here and is never read."""
    tokens, x_per, k, n, g = 4, 3, 64, 32, 6
    m = tokens * x_per
    lhs = jnp.asarray(rng.standard_normal((tokens, k)), dtype)
    group = jnp.asarray(rng.integers(0, g, m), jnp.int32)
    valid = rng.uniform(size=m) > 0.3
    w = [jnp.asarray(rng.standard_normal((g, k, n)) / 8, dtype) for _ in range(2)]
    scale = np.asarray(rng.uniform(0.1, 1.0, m), np.float32)
    scale[~valid] = np.nan
    tol = kernel_dtype(dtype, interpret)
    got = pair_glu_pallas(lhs, w[0], w[1], group, jnp.asarray(valid), spec=SPECS[1], repeat=x_per, interpret=interpret)
    want = pair_glu_reference(jnp.repeat(lhs, x_per, axis=0), w[0], w[1], group, jnp.asarray(valid), spec=SPECS[1])
    assert_close("pair glu, repeat", got, want, dtype=tol)
    assert_close("reference repeat", pair_glu_reference(lhs, w[0], w[1], group, jnp.asarray(valid), spec=SPECS[1],
                                                        repeat=x_per), want, dtype=dtype)
    h = jnp.asarray(rng.standard_normal((m, n)), dtype)
    w2 = jnp.asarray(rng.standard_normal((g, n, k)) / 8, dtype)
    got = pair_matmul_pallas(h, w2, group, jnp.asarray(valid), jnp.asarray(scale), interpret=interpret)
    want = pair_matmul_reference(h, w2, group, jnp.asarray(valid), jnp.asarray(np.where(valid, scale, 0.0)))
    assert_close("pair matmul, unmasked scale", got, want, dtype=tol)
    assert not np.asarray(got[~valid]).any()
    with pytest.raises(ValueError, match="lhs rows x repeat"):
        pair_glu_pallas(lhs, w[0], w[1], group[:-1], jnp.asarray(valid[:-1]), repeat=x_per, interpret=interpret)
