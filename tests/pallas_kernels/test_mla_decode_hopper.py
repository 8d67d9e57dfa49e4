"""Hopper (Mosaic GPU) MLA decode kernel against its reference twin.

Compiled on the GPU only: Mosaic GPU does not lower for the CPU. The query_side="m" form cannot run in
Mosaic GPU's interpret mode (it lacks `run_state`, the accumulator update); the query_side="n" form
(`hopper_columns.py`) runs there, on the CPU, against the reference. On the CPU every form is also
lowered for CUDA (cross-platform export: the whole Pallas -> Mosaic GPU lowering, which catches layout
and shape errors), and the split merge is checked against the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

from pallas_kernels.mla_decode import mla_decode_reference
from pallas_kernels.mla_decode.hopper import (PALLAS_MERGE_FROM_SPLITS, TILE_ROWS, HopperMLABlocks, combine_splits,
                                              hopper_takes, mla_decode_hopper, mla_decode_hopper_splits, query_rows)
from pallas_kernels.mla_decode.hopper_columns import column_smem_bytes, column_tile_rows, column_tiles
from pallas_kernels.mla_decode.merge import merge_settings, merge_splits_pallas

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU kernels compile on a GPU only")


def _inputs(rng, b, sq, h, s, lengths, poison):
    q = jnp.asarray(rng.standard_normal((b, sq, h, 512)), jnp.bfloat16)
    qp = jnp.asarray(rng.standard_normal((b, sq, h, 64)), jnp.bfloat16)
    cache = rng.standard_normal((b, s, 576)).astype(np.float32)
    inside = np.arange(s)[None, :, None] < lengths[:, None, None]
    clean = jnp.asarray(np.where(inside, cache, 0.0), jnp.bfloat16)
    dirty = jnp.asarray(np.where(inside, cache, np.nan if poison else 0.0), jnp.bfloat16)
    return q, qp, clean, dirty


VARIANTS = {"default": HopperMLABlocks(), "splits3": HopperMLABlocks(num_splits=3),
            "splits1": HopperMLABlocks(num_splits=1), "alternate": HopperMLABlocks(scoring="alternate"),
            # one or two splits: many blocks per split, so the alternating steady state and ring reuse run
            "alternate_splits1": HopperMLABlocks(scoring="alternate", num_splits=1),
            "alternate_splits2": HopperMLABlocks(scoring="alternate", num_splits=2),
            "each": HopperMLABlocks(scoring="each"), "each_stages1": HopperMLABlocks(block_kv=128, stages=1, scoring="each"),
            "one_query_buffer": HopperMLABlocks(query_buffers=1),
            "merge_pallas": HopperMLABlocks(merge="pallas"), "merge_xla": HopperMLABlocks(merge="xla"),
            "columns": HopperMLABlocks(query_side="n"),
            "columns_splits1": HopperMLABlocks(query_side="n", num_splits=1),
            "columns_one_buffer": HopperMLABlocks(query_side="n", query_buffers=1)}


@on_gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("b,sq,h,s,lengths", [
    (4, 1, 32, 1024, [1024, 700, 65, 3]),      # full, ragged, just past one block, shorter than a block
    (3, 1, 96, 512, [512, 300, 64]),           # 96 heads: two query tiles
    (2, 4, 32, 512, [512, 129]),               # four query tokens per row (verify step)
    (2, 8, 16, 256, [256, 100]),               # eight query tokens, 16 heads
    (2, 3, 24, 256, [256, 70]),                # 72 query rows: a second tile past the last row (zero-filled)
    (2, 1, 12, 256, [256, 100]),               # 12 rows: laid out by XLA (not whole 8-row groups)
    (2, 4, 32, 256, [256, 2]),                 # query tokens 0 and 1 of row 1 see no slot: zeros
    (1, 1, 32, 8192, [8000]),                  # one row split over many programs
])
def test_matches_reference_with_ragged_lengths_and_poisoned_tail(rng, b, sq, h, s, lengths, variant):
    lengths = np.asarray(lengths, np.int32)
    q, qp, clean, dirty = _inputs(rng, b, sq, h, s, lengths, poison=True)
    ref = mla_decode_reference(q, qp, clean, jnp.asarray(lengths), scale=0.07)
    out = mla_decode_hopper(q, qp, dirty, jnp.asarray(lengths), scale=0.07, blocks=VARIANTS[variant])
    assert_close(variant, out, ref, dtype="bfloat16")


@on_gpu
@pytest.mark.parametrize("sq,h,rows", [(1, 12, 192), (2, 32, 128), (3, 8, 96)])
def test_splits_on_query_rows_as_laid_out(rng, sq, h, rows):
    """The kernel on query rows that are already laid out (row t * H + h; more rows than whole tiles,
    NaN in the padding rows), its splits merged by `combine_splits`: equal to the reference."""
    lengths = np.asarray([512, 77], np.int32)
    q, qp, clean, dirty = _inputs(rng, 2, sq, h, 512, lengths, poison=True)
    packed = np.full((2, rows, 576), np.nan, np.float32)
    packed[:, :sq * h] = np.asarray(jnp.concatenate([q, qp], -1), np.float32).reshape(2, sq * h, 576)
    assert rows >= query_rows(h, sq)
    o, lse = mla_decode_hopper_splits(jnp.asarray(packed, jnp.bfloat16), dirty, jnp.asarray(lengths), heads=h, sq=sq,
                                      latent_dim=512, scale=0.07)
    assert o.shape[2] == rows and lse.shape[2] == rows
    out = combine_splits(o[:, :, :sq * h], lse[:, :, :sq * h]).reshape(2, sq, h, 512)
    assert_close("splits", out, mla_decode_reference(q, qp, clean, jnp.asarray(lengths), scale=0.07), dtype="bfloat16")


@pytest.mark.parametrize("b,sq,h,s,lengths,blocks", [
    (3, 1, 24, 192, [192, 70, 3], HopperMLABlocks(query_side="n", num_splits=1)),   # ragged, one tile of 24 rows
    (2, 1, 24, 320, [320, 130], HopperMLABlocks(query_side="n", num_splits=3)),     # splits merged by XLA
    (2, 1, 96, 128, [128, 65], HopperMLABlocks(query_side="n")),                    # 96 heads: two tiles of 48
    (2, 4, 8, 128, [128, 2], HopperMLABlocks(query_side="n")),      # verify step; tokens 0-1 of row 1 see nothing
    (2, 3, 24, 128, [128, 100], HopperMLABlocks(query_side="n")),   # 72 rows: two tiles of 40, the last one short
    (2, 1, 12, 128, [128, 50], HopperMLABlocks(query_side="n")),    # 12 rows: laid out by XLA into a 16-row tile
    (2, 1, 16, 128, [128, 77], HopperMLABlocks(query_side="n", query_buffers=1)),   # one [T, R + P] query buffer
    (1, 1, 8, 2048, [2000], HopperMLABlocks(query_side="n", merge="pallas")),       # 32 splits, the one-launch merge
])
def test_columns_form_in_interpret_mode_matches_reference(rng, b, sq, h, s, lengths, blocks):
    """query_side="n" in Mosaic GPU's interpret mode (R = 128, P = 64 to keep it quick): ragged lengths, the
    cache poisoned with NaN past each row's length, query rows not filling a tile, several splits."""
    lengths = np.asarray(lengths, np.int32)
    q = jnp.asarray(rng.standard_normal((b, sq, h, 128)), jnp.bfloat16)
    qp = jnp.asarray(rng.standard_normal((b, sq, h, 64)), jnp.bfloat16)
    cache = rng.standard_normal((b, s, 192)).astype(np.float32)
    inside = np.arange(s)[None, :, None] < lengths[:, None, None]
    clean = jnp.asarray(np.where(inside, cache, 0.0), jnp.bfloat16)
    dirty = jnp.asarray(np.where(inside, cache, np.nan), jnp.bfloat16)
    ref = mla_decode_reference(q, qp, clean, jnp.asarray(lengths), scale=0.09)
    out = mla_decode_hopper(q, qp, dirty, jnp.asarray(lengths), scale=0.09, blocks=blocks, interpret=True)
    for i in range(b):                        # row by row: a wrong short row is not hidden by the long ones
        assert_close(f"columns row {i}", out[i], ref[i], dtype="bfloat16")
    blind = np.arange(sq)[None, :] < (sq - lengths)[:, None]     # query tokens that see no slot: exactly 0
    assert not np.any(np.asarray(out)[blind])


@pytest.mark.parametrize("rows,tile,tiles", [(96, 48, 2), (32, 32, 1), (12, 16, 1), (72, 40, 2), (128, 64, 2),
                                             (384, 64, 6), (120, 64, 2), (8, 8, 1)])
def test_column_tiles_spread_rows_evenly_in_multiples_of_8(rows, tile, tiles):
    assert (column_tile_rows(rows), column_tiles(rows)) == (tile, tiles)


def test_columns_form_refusals():
    q, qp = jnp.zeros((1, 1, 32, 512), jnp.bfloat16), jnp.zeros((1, 1, 32, 64), jnp.bfloat16)
    cache = jnp.zeros((1, 256, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match="scoring='first' only"):
        HopperMLABlocks(query_side="n", scoring="each")
    with pytest.raises(ValueError, match="query_side must be one of"):
        HopperMLABlocks(query_side="k")
    with pytest.raises(ValueError, match="query_side='n': .* shared memory for tiles of 32 query rows"):
        mla_decode_hopper(q, qp, cache, jnp.array([3]), scale=1.0, blocks=HopperMLABlocks(query_side="n", stages=3))
    assert column_smem_bytes(32, 576, 64, 3) > 227 * 1024 >= column_smem_bytes(64, 576, 64, 2)
    with pytest.raises(ValueError, match="interpret mode runs query_side='n' only"):
        mla_decode_hopper(q, qp, cache, jnp.array([3]), scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="64-row tiles"):
        mla_decode_hopper_splits(jnp.zeros((1, 64, 576), jnp.bfloat16), cache, jnp.array([3]), heads=32, sq=1,
                                 latent_dim=512, scale=1.0, blocks=HopperMLABlocks(query_side="n"))


@pytest.mark.parametrize("variant,sq,h", [(v, 2, 32) for v in VARIANTS]
                         + [(v, sq, h)
                            for v in ("default", "one_query_buffer", "columns", "columns_one_buffer")
                            for sq, h in ((1, 12), (3, 24), (1, 96), (1, 100))])
def test_lowers_for_cuda_on_any_host(variant, sq, h):
    """The full Pallas -> Mosaic GPU lowering runs (no GPU needed) and emits the Mosaic GPU kernel, for
    every variant and for query rows of whole tiles (64), fewer (12), past them (72) and 96 (the columns
    form's two 48-row tiles); with
    merge="pallas" (or "auto" at 64 or more splits) the merge launch is there too (off a GPU in its interpret form, on one as a Triton
    call: see `test_merge_kernel_lowers_for_cuda` for its Triton lowering on any host)."""
    args = (jax.ShapeDtypeStruct((2, sq, h, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2, sq, h, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 1024, 576), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32))
    exported = jax.export.export(jax.jit(lambda *a: mla_decode_hopper(*a, scale=0.1, blocks=VARIANTS[variant])),
                                 platforms=["cuda"], disabled_checks=[
                                     jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    module = exported.mlir_module()
    assert "mosaic_gpu" in module
    merge_launch = "mla_merge_splits" in module or "__gpu$xla.gpu.triton" in module   # interpret form / Triton call
    blocks = VARIANTS[variant]
    tiles = column_tiles(sq * h) if blocks.query_side == "n" else query_rows(h, sq) // TILE_ROWS
    splits = blocks.split_layout(2 * tiles, 1024)[0]
    assert merge_launch == (splits > 1 and (blocks.merge == "pallas" or (
        blocks.merge == "auto" and splits >= PALLAS_MERGE_FROM_SPLITS)))


@pytest.mark.parametrize("slots,merge_launch", [(8192, True), (1024, False)])
def test_auto_merge_takes_the_one_launch_at_many_splits(slots, merge_launch):
    """merge="auto" (the default): one row over a long cache (128 splits) merges in the Pallas launch, over
    a short one (16 splits) in XLA's kernels."""
    assert HopperMLABlocks().split_layout(1, slots)[0] == slots // 64
    args = (jax.ShapeDtypeStruct((1, 1, 32, 512), jnp.bfloat16), jax.ShapeDtypeStruct((1, 1, 32, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, slots, 576), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32))
    module = jax.export.export(jax.jit(lambda *a: mla_decode_hopper(*a, scale=0.1)), platforms=["cuda"],
                               disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
                               )(*args).mlir_module()
    assert ("mla_merge_splits" in module or "__gpu$xla.gpu.triton" in module) == merge_launch
    assert (slots // 64 >= PALLAS_MERGE_FROM_SPLITS) == merge_launch


@pytest.mark.parametrize("b,splits,rows", [(1, 128, 32), (64, 2, 32)])   # 1 x 128K and 64 x 4K at H = 32
def test_merge_kernel_lowers_for_cuda(triton_for_hopper, b, splits, rows):
    args = (jax.ShapeDtypeStruct((b, splits, 64, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, splits, 64), jnp.float32))
    module = jax.export.export(jax.jit(lambda o, lse: merge_splits_pallas(o, lse, rows=rows, interpret=False)),
                               platforms=["cuda"], disabled_checks=[
                                   jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert module.mlir_module().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("variant", ["default", "alternate"])
def test_lowers_laid_out_rows_for_cuda_on_any_host(variant):
    args = (jax.ShapeDtypeStruct((2, 1024, 576), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32))
    # Query rows laid out by the caller, past whole tiles (12 heads: 16 token slots x 12 = 192 rows).
    splits = jax.export.export(jax.jit(lambda q, c, n: mla_decode_hopper_splits(
        q, c, n, heads=12, sq=1, latent_dim=512, scale=0.1, blocks=VARIANTS[variant])), platforms=["cuda"])(
        jax.ShapeDtypeStruct((2, 192, 576), jnp.bfloat16), *args)
    assert splits.out_avals[0].shape[2] == 192


def test_combine_splits_equals_one_softmax(rng):
    """Per-split normalised outputs and base-2 log-sum-exps merge into the softmax over all slots;
    a split that saw nothing weighs zero."""
    rows, slots, r, splits = 5, 24, 8, 3
    s = rng.standard_normal((rows, slots)).astype(np.float32)
    v = rng.standard_normal((slots, r)).astype(np.float32)
    parts, lses = [], []
    for j in range(splits):
        sl = slice(j * 8, (j + 1) * 8)
        w = np.exp(s[:, sl] - s[:, sl].max(1, keepdims=True))
        parts.append((w / w.sum(1, keepdims=True)) @ v[sl])
        lses.append((s[:, sl].max(1) + np.log(w.sum(1))) / np.log(2.0))
    parts.append(np.full((rows, r), 7.0, np.float32))          # an empty split: any output, lse = -huge
    lses.append(np.full((rows,), -0.7 * np.finfo(np.float32).max, np.float32))
    o = jnp.asarray(np.stack(parts, 0)[None])
    lse = jnp.asarray(np.stack(lses, 0)[None])
    p = np.exp(s - s.max(1, keepdims=True))
    expect = (p / p.sum(1, keepdims=True)) @ v
    assert_close("combine", combine_splits(o, lse)[0], expect, dtype="float32")


@pytest.mark.parametrize("b,splits,q_rows,rows,cols", [(1, 128, 64, 32, 512), (2, 5, 64, 40, 64), (3, 2, 24, 24, 32),
                                                       (1, 3, 5, 5, 16)])
def test_merge_kernel_equals_combine_splits(rng, interpret, b, splits, q_rows, rows, cols):
    """The one-launch merge (`merge_splits_pallas`) against `combine_splits` on random per-split
    outputs (bf16) and log-sum-exps, some splits empty (lse -huge) and one row empty in every split;
    only the first `rows` query rows are merged, NaN past them is never read."""
    o = rng.standard_normal((b, splits, q_rows, cols)).astype(np.float32)
    lse = (rng.standard_normal((b, splits, q_rows)) * 4).astype(np.float32)
    lse[:, -1, :3] = -0.7 * np.finfo(np.float32).max
    lse[:, :, 1] = -0.7 * np.finfo(np.float32).max
    o[:, :, rows:], lse[:, :, rows:] = np.nan, np.nan
    o, lse = jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse)
    want = combine_splits(o[:, :, :rows], lse[:, :, :rows])
    for settings in ({}, dict(block_r=4, block_c=16, chunk=32), dict(block_r=2, block_c=64, chunk=4, num_warps=8),
                     merge_settings(128), merge_settings(2)):
        got = merge_splits_pallas(o, lse, rows=rows, interpret=interpret, **settings)
        assert got.shape == (b, rows, cols) and got.dtype == jnp.float32
        assert_close(f"merge {settings}", got, want, dtype="float32")
    with pytest.raises(ValueError, match="do not match"):
        merge_splits_pallas(o, lse[:, :1], rows=rows)
    for bad in (dict(block_r=6), dict(block_c=48), dict(block_c=8), dict(num_warps=3), dict(chunk=0)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a power of two"):
            merge_splits_pallas(o, lse, rows=rows, **bad)


def test_rejects_what_it_cannot_run():
    q, qp = jnp.zeros((1, 1, 4, 512), jnp.bfloat16), jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="queries"):   # fewer rows than one tile
        mla_decode_hopper_splits(jnp.zeros((1, 4, 576), jnp.bfloat16), jnp.zeros((1, 128, 576), jnp.bfloat16),
                                 jnp.array([3]), heads=4, sq=1, latent_dim=512, scale=1.0)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mla_decode_hopper(q, qp, jnp.zeros((1, 128, 576), jnp.float32), jnp.array([3]), scale=1.0)
    with pytest.raises(ValueError, match="multiple of block_kv"):
        mla_decode_hopper(q, qp, jnp.zeros((1, 96, 576), jnp.bfloat16), jnp.array([3]), scale=1.0)
    with pytest.raises(ValueError, match="stages >= 2"):
        mla_decode_hopper(q, qp, jnp.zeros((1, 256, 576), jnp.bfloat16), jnp.array([3]), scale=1.0,
                          blocks=HopperMLABlocks(block_kv=128, stages=1, scoring="alternate"))
    with pytest.raises(ValueError, match="scoring must be one of"):
        HopperMLABlocks(scoring="both")
    with pytest.raises(ValueError, match="query_buffers must be 1 or 2"):
        HopperMLABlocks(query_buffers=3)
    with pytest.raises(ValueError, match="merge must be one of"):
        HopperMLABlocks(merge="sum")
    with pytest.raises(ValueError, match="min_split_blocks must be >= 1"):
        HopperMLABlocks(min_split_blocks=0)
    with pytest.raises(ValueError, match="shared memory"):
        mla_decode_hopper(q, qp, jnp.zeros((1, 256, 576), jnp.bfloat16), jnp.array([3]), scale=1.0,
                          blocks=HopperMLABlocks(block_kv=128, stages=2))


def test_split_layout_launches_whole_blocks():
    assert HopperMLABlocks().split_layout(1, 131072) == (128, 1024)        # 132 asked, 16 blocks each
    assert HopperMLABlocks(num_splits=66).split_layout(64, 4096) == (64, 64)
    assert HopperMLABlocks().split_layout(64, 4096) == (2, 2048)
    assert HopperMLABlocks().split_layout(1, 192) == (3, 64)                # a short cache: a program per block
    assert HopperMLABlocks(min_split_blocks=2).split_layout(1, 192) == (1, 192)
    assert HopperMLABlocks().split_layout(1, 4096) == (64, 64)


def test_hopper_takes_names_what_it_runs():
    assert hopper_takes((2, 4096, 576), jnp.bfloat16, 512)
    assert not hopper_takes((2, 4096, 576), jnp.float32, 512)        # fp32 cache: the Triton form
    assert not hopper_takes((2, 4000, 576), jnp.bfloat16, 512)       # not whole blocks
    assert not hopper_takes((2, 4096, 48), jnp.bfloat16, 32)         # the tiny model's latent
