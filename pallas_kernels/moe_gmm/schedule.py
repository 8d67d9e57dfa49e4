"""Row tiles of a grouped matmul: which group and which rows each program handles.

Rows are sorted by group; group g owns rows [start_g, start_g + size_g). Each group is cut into
tiles of at most `block_m` rows, and only non-empty groups get tiles, so work (and weight reads)
scale with the touched groups, not with all G. The number of tiles is bounded statically by
(M + (block_m - 1) min(G, M)) // block_m (`max_tiles`); programs past the real tiles find an empty row range
and exit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def max_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static bound on the tiles of any grouping of at most `num_rows` rows into `num_groups` groups: a group of
    s rows takes ceil(s / block_m) <= (s + block_m - 1) / block_m tiles, and at most min(G, M) groups hold rows, so
    the tiles number at most (M + (block_m - 1) min(G, M)) / block_m, rounded down as a count must be. (At 64
    tokens of Kimi-Linear, 512 rows over 256 experts in 8-row tiles: 288, where ceil(M / block_m) + min(G, M) gave
    320: fewer slab rows to write and programs to start.)"""
    return (num_rows + (block_m - 1) * min(num_groups, num_rows)) // block_m


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """[3, T] int32: per tile its group, first row and end row (exclusive); empty tiles are (0, 0, 0).

    group_sizes: [G] int32 rows per group (their sum may be below num_rows).
    """
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    tiles = (sizes + block_m - 1) // block_m
    return _tiles(ends - sizes, ends, tiles, jnp.cumsum(tiles), num_rows, block_m)


def tile_schedule_of_keys(key: jax.Array, num_groups: int, block_m: int) -> jax.Array:
    """`tile_schedule` of the rows `key` [M] int32 (in [0, G]; G: a row of no group) puts in order, counted from the
    keys themselves: the keys below each g in [0, G] ([G + 1, M] comparisons reduced in one fusion) are group g's
    first row and group g - 1's end row; the tiles before each group's end by a [G, G] triangle. No group sizes
    and no cumulative sums (XLA's reduce-window, a kernel each) on the way. The same [3, T] for
    T = `max_tiles(M, G, block_m)`."""
    key = key.astype(jnp.int32)
    below = jnp.sum(key[None, :] < jnp.arange(num_groups + 1, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
    starts, ends = below[:-1], below[1:]
    g = jnp.arange(num_groups, dtype=jnp.int32)
    tiles = (ends - starts + block_m - 1) // block_m
    tile_end = jnp.sum(jnp.where(g[None, :] <= g[:, None], tiles[None, :], 0), axis=1, dtype=jnp.int32)
    return _tiles(starts, ends, tiles, tile_end, key.shape[0], block_m)


def _tiles(starts, ends, tiles, tile_end, num_rows: int, block_m: int) -> jax.Array:
    """`tile_schedule`'s [3, T] from each group's first and end row, its tiles and the tiles up to its end."""
    g_count = starts.shape[0]
    tile_start = tile_end - tiles
    t = jnp.arange(max_tiles(num_rows, g_count, block_m), dtype=jnp.int32)
    # One comparison matrix [T, G] (a single fused kernel), not a scan of log2(G) small kernels.
    group = jnp.minimum(jnp.sum(tile_end[None, :] <= t[:, None], axis=1), g_count - 1).astype(jnp.int32)
    valid = t < tile_end[-1]
    first = starts[group] + (t - tile_start[group]) * block_m
    last = jnp.minimum(first + block_m, ends[group])
    return jnp.stack([jnp.where(valid, group, 0), jnp.where(valid, first, 0), jnp.where(valid, last, 0)])
