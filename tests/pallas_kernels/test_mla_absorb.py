"""The absorbed MLA projection kernels (`pallas_kernels.mla_absorb`; interpret mode on the CPU,
compiled on a GPU) against einsums over the kv_b_proj kernel written out here in float64, and their
Triton lowering for CUDA at the Kimi-Linear-48B shapes on any host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close, kernel_dtype

from pallas_kernels.mla_absorb import (AbsorbBlocks, absorb_query_pallas, absorb_query_reference,
                                       absorb_value_pallas, absorb_value_reference, padded_tokens)
from pallas_kernels.mla_decode.hopper import combine_splits, mla_decode_hopper_splits, query_rows

SHAPES = [(1, 1, 4), (5, 1, 32), (1, 5, 4), (4, 4, 32), (16, 1, 4), (2, 8, 32)]   # (B, T, H): B * T = 1, 5, 16


def _weights(rng, h, r, n, v, dtype):
    w = rng.standard_normal((r, h * (n + v))) / np.sqrt(r)
    return jnp.asarray(w, dtype), np.asarray(jnp.asarray(w, dtype), np.float64).reshape(r, h, n + v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("b,t,h", SHAPES)
def test_absorbed_queries_and_latents(rng, interpret, dtype, b, t, h):
    """q_lat = q_nope @ W_UK_h^T beside q_pe, read from a wider buffer at column offsets, in the
    Hopper tile layout (token slots padded so slots x heads is a multiple of 64); the new latents
    normalised in the same launch."""
    r, n, p, v, m = 64, 32, 16, 32, b * t
    w, w64 = _weights(rng, h, r, n, v, dtype)
    q_col, kv_col = 3, 7 + h * (n + p)
    buf = jnp.asarray(rng.standard_normal((m, kv_col + r + p + 5)) * 2, dtype)
    gamma = jnp.asarray(rng.standard_normal(r), dtype)
    kw = dict(heads=h, tokens=t, nope=n, rope=p, v_dim=v, q_col=q_col, multiple=64)
    rows, latent = absorb_query_pallas(buf, w, **kw, kv=buf, kv_col=kv_col, norm_weight=gamma, eps=1e-5,
                                       interpret=interpret)
    t_pad = padded_tokens(t, h, 64)
    assert rows.shape == (b * t_pad, h, r + p) and (t_pad * h) % 64 == 0 and rows.dtype == jnp.dtype(dtype)
    got = np.asarray(rows, np.float64).reshape(b, t_pad, h, r + p)[:, :t]

    x = np.asarray(buf, np.float64)
    q = x[:, q_col:q_col + h * (n + p)].reshape(b, t, h, n + p)
    expect_lat = np.einsum("bthn,rhn->bthr", q[..., :n], w64[..., :n])
    assert_close("q_lat", got[..., :r], expect_lat, dtype=kernel_dtype(dtype, interpret))
    np.testing.assert_array_equal(got[..., r:], q[..., n:])                      # q_pe copied as is

    c = x[:, kv_col:kv_col + r]
    normed = np.asarray(jnp.asarray(c / np.sqrt(np.mean(c * c, -1, keepdims=True) + 1e-5), dtype), np.float64)
    assert_close("normed latents", latent[:, :r], normed * np.asarray(gamma, np.float64), dtype=dtype)
    np.testing.assert_array_equal(np.asarray(latent[:, r:], np.float64), x[:, kv_col + r:kv_col + r + p])

    # Unpadded layout, queries alone, another output dtype: the twin agrees.
    out = absorb_query_pallas(buf, w, **dict(kw, multiple=1), out_dtype=jnp.float32, interpret=interpret)
    assert_close("twin", out, absorb_query_reference(buf, w, **dict(kw, multiple=1), out_dtype=jnp.float32),
                 dtype=kernel_dtype(dtype, interpret))


@pytest.mark.parametrize("kv_dtype,cache_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16")])
@pytest.mark.parametrize("b,t", [(1, 1), (3, 2), (2, 8)])
def test_latents_written_into_the_cache(rng, interpret, kv_dtype, cache_dtype, b, t):
    """With a cache and slots, the normalised latents land at cache[b, slot] (cast to the cache's
    dtype) and nothing else changes: slots -1 (padding) and S (past the end) write nothing (interpret
    mode drops stores past the buffer by itself; the compiled test on the GPU is what checks that the
    kernel masks them). The queries are the same as without the cache; the written cache equals the
    twin's (a scatter of the twin's latents) and the kernel's own latents scattered by hand."""
    h, r, n, p, v, s, m = 4, 64, 32, 16, 32, 24, b * t
    w, _ = _weights(rng, h, r, n, v, kv_dtype)
    kv_col = h * (n + p)
    buf = jnp.asarray(rng.standard_normal((m, kv_col + r + p)) * 2, kv_dtype)
    gamma = jnp.asarray(1 + 0.1 * rng.standard_normal(r), kv_dtype)
    cache = rng.standard_normal((b, s, r + p)).astype(np.float32)
    slots = rng.permutation(s)[:m].astype(np.int32)
    slots[0] = -1
    if m > 2:
        slots[2] = s
    kw = dict(heads=h, tokens=t, nope=n, rope=p, v_dim=v, multiple=64, kv=buf, kv_col=kv_col, norm_weight=gamma,
              eps=1e-5, interpret=interpret)
    rows, latent = absorb_query_pallas(buf, w, **kw)
    rows_c, new_cache = absorb_query_pallas(buf, w, **kw, cache=jnp.asarray(cache, cache_dtype),
                                            slots=jnp.asarray(slots))
    t_pad = padded_tokens(t, h, 64)   # token slots past t are padding, never written: compared only below t
    real = lambda x: np.asarray(x, np.float32).reshape(b, t_pad, h, r + p)[:, :t]   # noqa: E731
    np.testing.assert_array_equal(real(rows_c), real(rows))
    expect = np.asarray(jnp.asarray(cache, cache_dtype), np.float32)
    lat = np.asarray(jnp.asarray(latent, cache_dtype), np.float32)
    for i, slot in enumerate(slots):
        if 0 <= slot < s:
            expect[i // t, slot] = lat[i]
    assert new_cache.dtype == jnp.dtype(cache_dtype)
    np.testing.assert_array_equal(np.asarray(new_cache, np.float32), expect)
    _, twin = absorb_query_reference(buf, w, **{k: v for k, v in kw.items() if k != "interpret"},
                                     cache=jnp.asarray(cache, cache_dtype), slots=jnp.asarray(slots))
    written = np.zeros(expect.shape[:2], bool)
    written[[i // t for i, sl in enumerate(slots) if 0 <= sl < s], [sl for sl in slots if 0 <= sl < s]] = True
    np.testing.assert_array_equal(np.asarray(new_cache, np.float32)[~written], np.asarray(twin, np.float32)[~written])
    assert_close("written latents vs twin", np.asarray(new_cache, np.float32)[written],
                 np.asarray(twin, np.float32)[written], dtype=cache_dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("b,t,h", SHAPES)
def test_absorbed_values_from_latents(rng, interpret, dtype, b, t, h):
    """out = lat @ W_UV_h from fp32 latents (what the attention kernels return) into the model dtype."""
    r, n, v, m = 64, 32, 48, b * t
    w, w64 = _weights(rng, h, r, n, v, dtype)
    lat = rng.standard_normal((m, h, r)).astype(np.float32)
    out = absorb_value_pallas(jnp.asarray(lat), w, heads=h, tokens=t, nope=n, v_dim=v, out_dtype=dtype,
                              interpret=interpret)
    assert out.shape == (m, h, v) and out.dtype == jnp.dtype(dtype)
    assert_close("values", out, np.einsum("mhr,rhv->mhv", lat.astype(np.float64), w64[..., n:]),
                 dtype=kernel_dtype(dtype, interpret))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("b,t,h,splits", [(1, 1, 4, 70), (5, 1, 32, 3), (1, 5, 4, 1), (4, 4, 32, 17), (16, 1, 4, 2)])
def test_absorbed_values_merge_the_splits(rng, interpret, dtype, b, t, h, splits):
    """From a split kernel's per-split latents and base-2 log-sum-exps (Hopper row layout, padding
    rows poisoned, one split empty): the splits merged by weight, then W_UV."""
    r, n, v = 64, 32, 32
    w, w64 = _weights(rng, h, r, n, v, dtype)
    rows = padded_tokens(t, h, 64) * h
    o = rng.standard_normal((b, splits, rows, r)).astype(np.float32)
    lse = (rng.standard_normal((b, splits, rows)) * 4).astype(np.float32)
    lse[:, -1] = -0.7 * np.finfo(np.float32).max                    # a split that saw no slot
    o[:, :, t * h:] = np.nan                                        # padding rows are never read
    lse[:, :, t * h:] = np.nan
    o_k = jnp.asarray(o, dtype)
    o64, live = np.asarray(o_k, np.float64)[:, :, :t * h], lse[:, :, :t * h].astype(np.float64)
    weight = np.exp2(live - live.max(1, keepdims=True))
    merged = ((o64 * weight[..., None]).sum(1) / weight.sum(1)[..., None]).reshape(b * t, h, r)   # row t * H + h
    expect = np.einsum("mhr,rhv->mhv", merged, w64[..., n:])
    for blocks in (AbsorbBlocks(), AbsorbBlocks(block_splits=16, block_v=16)):   # one product, or several merged
        got = absorb_value_pallas(o_k, w, lse=jnp.asarray(lse), heads=h, tokens=t, nope=n, v_dim=v, blocks=blocks,
                                  interpret=interpret)
        assert got.shape == (b * t, h, v) and got.dtype == jnp.dtype(dtype)
        assert_close(f"merged values {blocks}", got, expect, dtype=kernel_dtype(dtype, interpret))
    # The Hopper wrapper's own merge and the twin say the same.
    via_combine = combine_splits(o_k[:, :, :t * h], jnp.asarray(lse[:, :, :t * h]))
    assert_close("combine_splits", via_combine.reshape(b * t, h, r), merged, dtype="float32")
    twin = absorb_value_reference(o_k[:, :, :t * h], w, lse=jnp.asarray(lse[:, :, :t * h]), heads=h, tokens=t,
                                  nope=n, v_dim=v)
    assert_close("twin", twin, expect, dtype=dtype)


def test_padded_tokens():
    assert padded_tokens(1, 32, 64) == 2 and padded_tokens(3, 32, 64) == 4 and padded_tokens(1, 96, 64) == 2
    assert padded_tokens(1, 12, 64) == 16 and padded_tokens(5, 4, 1) == 5
    for h, t in [(32, 1), (32, 3), (96, 1), (12, 2), (8, 16)]:
        assert padded_tokens(t, h, 64) * h >= query_rows(h, t)       # the Hopper kernel reads whole tiles


def test_refusals():
    w = jnp.zeros((64, 4 * 64))
    with pytest.raises(ValueError, match="at most 16"):
        absorb_query_pallas(jnp.zeros((17, 4 * 48)), w, heads=4, tokens=1, nope=32, rope=16, v_dim=32)
    with pytest.raises(ValueError, match="power of two"):
        absorb_query_pallas(jnp.zeros((1, 4 * 64)), jnp.zeros((64, 4 * 72)), heads=4, tokens=1, nope=48, rope=16,
                            v_dim=24)
    with pytest.raises(ValueError, match="do not match"):
        absorb_value_pallas(jnp.zeros((2, 3, 64)), w, heads=4, tokens=1, nope=32, v_dim=32)
    with pytest.raises(ValueError, match="norm weight"):
        absorb_query_pallas(jnp.zeros((1, 4 * 48)), w, heads=4, tokens=1, nope=32, rope=16, v_dim=32,
                            kv=jnp.zeros((1, 80)), norm_weight=jnp.zeros((8,)))
    with pytest.raises(ValueError, match="writing the latents needs kv"):
        absorb_query_pallas(jnp.zeros((1, 4 * 48)), w, heads=4, tokens=1, nope=32, rope=16, v_dim=32,
                            kv=jnp.zeros((1, 80)), norm_weight=jnp.zeros((64,)), cache=jnp.zeros((1, 8, 70)),
                            slots=jnp.zeros((1,), jnp.int32))


def _export_for_cuda(fn, *args):
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()


@pytest.mark.parametrize("b,t", [(1, 1), (8, 1), (2, 4)])
def test_decode_chain_lowers_for_cuda_at_the_48b_shapes(triton_for_hopper, b, t):
    """Kimi-Linear-48B MLA (H = 32, R = 512, rope 64, nope 128, v 128), bf16: the query launch reading a
    fused projection output in place, the Hopper kernel on its rows as they are, and the value launch
    merging the splits lower for CUDA (Triton and Mosaic GPU), with no pad or concatenate between."""
    h, r, n, p, v, s = 32, 512, 128, 64, 128, 4096
    bf, sds = jnp.bfloat16, jax.ShapeDtypeStruct

    def step(buf, w, gamma, cache, lengths, slots):   # the new latents written into the cache by the query launch
        rows, cache = absorb_query_pallas(buf, w, heads=h, tokens=t, nope=n, rope=p, v_dim=v, multiple=64,
                                          out_dtype=bf, kv=buf, kv_col=h * (n + p), norm_weight=gamma, cache=cache,
                                          slots=slots, interpret=False)
        o, lse = mla_decode_hopper_splits(rows.reshape(b, -1, r + p), cache, lengths, heads=h, sq=t, latent_dim=r,
                                          scale=0.07)
        return absorb_value_pallas(o, w, lse=lse, heads=h, tokens=t, nope=n, v_dim=v, out_dtype=bf,
                                   interpret=False), cache

    module = _export_for_cuda(step, sds((b * t, h * (n + p) + r + p), bf), sds((r, h * (n + v)), bf), sds((r,), bf),
                              sds((b, s, r + p), bf), sds((b,), jnp.int32), sds((b * t,), jnp.int32))
    assert module.count("__gpu$xla.gpu.triton") == 2 and "mosaic_gpu" in module
    assert "stablehlo.pad" not in module and "stablehlo.concatenate" not in module
    assert "stablehlo.scatter" not in module and "dynamic_update_slice" not in module
    # The plain value launch (the Triton decode form's latents) lowers too.
    plain = _export_for_cuda(lambda lat, w: absorb_value_pallas(lat, w, heads=h, tokens=t, nope=n, v_dim=v,
                                                                out_dtype=bf, interpret=False),
                             sds((b * t, h, r), jnp.float32), sds((r, h * (n + v)), bf))
    assert plain.count("__gpu$xla.gpu.triton") == 1
