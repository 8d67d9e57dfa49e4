"""MLA attention: absorbed == naive == numpy, every latent-cache implementation agrees, the
blockwise prefill equals the naive one without a [T, T] buffer, and so does the blockwise attention
of a continuation chunk over the cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_close, xla_dtype

from k3jax.config import tiny_k3, tiny_kimi_linear
from k3jax.layers.mla import MultiHeadLatentAttention
from k3jax.layers.mla_attention import (MLA_DECODE_IMPLS, attention_absorbed, attention_cudnn, attention_cudnn_cache,
                                        attention_flash, attention_flash_cache,
                                        attention_naive, cache_attention, chunk_attention, prefill_attention)
from k3jax.state import MLACache, SeqInfo


def test_mla_absorbed_equals_naive(rng):
    b, t, s, h, n, p, r, v = 2, 3, 11, 4, 16, 8, 12, 10
    q_nope = jnp.asarray(rng.standard_normal((b, t, h, n)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((b, t, h, p)), jnp.float32)
    latent = jnp.asarray(rng.standard_normal((b, s, r + p)), jnp.float32)
    w_kv_b = jnp.asarray(rng.standard_normal((r, h * (n + v))) / np.sqrt(r), jnp.float32)
    lengths = np.array([[5, 6, 7], [9, 10, 11]])
    mask = jnp.arange(s)[None, None, :] < lengths[:, :, None]
    kw = dict(scale=(n + p) ** -0.5, v_dim=v)
    with jax.default_matmul_precision("highest"):    # fp32 products on a GPU too (not TF32)
        naive = attention_naive(q_nope, q_pe, latent, w_kv_b, mask, **kw)
        absorbed = attention_absorbed(q_nope, q_pe, latent, w_kv_b, mask, **kw)
    assert_close("absorbed vs naive", absorbed, naive)
    # And against a plain numpy softmax attention with the per-head keys expanded by hand.
    c, kpe = np.asarray(latent[..., :r], np.float64), np.asarray(latent[..., r:], np.float64)
    w = np.asarray(w_kv_b, np.float64).reshape(r, h, n + v)
    keys = np.concatenate([np.einsum("bsr,rhn->bshn", c, w[..., :n]), np.repeat(kpe[:, :, None], h, 2)], -1)
    vals = np.einsum("bsr,rhv->bshv", c, w[..., n:])
    q = np.concatenate([q_nope, q_pe], -1).astype(np.float64)
    sc = np.einsum("bthd,bshd->bhts", q, keys) * (n + p) ** -0.5
    sc = np.where(np.asarray(mask)[:, None], sc, -np.inf)
    pr = np.exp(sc - sc.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    assert_close("naive vs numpy", naive, np.einsum("bhts,bshv->bthv", pr, vals))



@pytest.mark.parametrize("impl", MLA_DECODE_IMPLS)
def test_cache_attention_implementations_agree(rng, impl):
    """Two query tokens per row over a 64-slot cache at ragged lengths, slots past them poisoned."""
    b, t, s, h, n, p, r, v = 2, 2, 64, 4, 16, 16, 32, 16
    q_nope = jnp.asarray(rng.standard_normal((b, t, h, n)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((b, t, h, p)), jnp.float32)
    last = np.array([[20, 21], [40, 41]], np.int32)
    cache = rng.standard_normal((b, s, r + p)).astype(np.float32)
    clean = jnp.asarray(np.where(np.arange(s)[None, :, None] <= last[:, -1:, None], cache, 0.0))
    poisoned = jnp.asarray(np.where(np.arange(s)[None, :, None] <= last[:, -1:, None], cache, np.nan))
    w_kv_b = jnp.asarray(rng.standard_normal((r, h * (n + v))) / np.sqrt(r), jnp.float32)
    kw = dict(scale=(n + p) ** -0.5, v_dim=v)
    ref = cache_attention("naive", q_nope, q_pe, clean, w_kv_b, jnp.asarray(last), **kw)
    out = cache_attention(impl, q_nope, q_pe, poisoned if impl in ("pallas", "hopper") else clean, w_kv_b,
                          jnp.asarray(last), **kw)
    assert_close(impl, out, ref, dtype=xla_dtype("float32"))     # fp32 dots run on TF32 units on a GPU


@pytest.mark.parametrize("impl", ["pallas", "hopper"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_absorb_kernels_around_the_kernel_forms(rng, impl, dtype):
    """W_UK and W_UV through the few-row kernels (absorb="pallas"; interpret mode off the GPU, where
    "hopper" stands in with the Triton form): equal to the naive expansion, ragged rows, poisoned
    tails, three query tokens per row."""
    b, t, s, h, n, p, r, v = 3, 3, 64, 4, 16, 16, 32, 16
    dt = jnp.dtype(dtype)
    q_nope = jnp.asarray(rng.standard_normal((b, t, h, n)), dt)
    q_pe = jnp.asarray(rng.standard_normal((b, t, h, p)), dt)
    last = np.array([[0, 1, 2], [30, 31, 32], [61, 62, 63]], np.int32)
    cache = rng.standard_normal((b, s, r + p))
    inside = np.arange(s)[None, :, None] <= last[:, -1:, None]
    w_kv_b = jnp.asarray(rng.standard_normal((r, h * (n + v))) / np.sqrt(r), dt)
    kw = dict(scale=(n + p) ** -0.5, v_dim=v)
    ref = cache_attention("naive", q_nope, q_pe, jnp.asarray(np.where(inside, cache, 0.0), dt), w_kv_b,
                          jnp.asarray(last), **kw)
    out = cache_attention(impl, q_nope, q_pe, jnp.asarray(np.where(inside, cache, np.nan), dt), w_kv_b,
                          jnp.asarray(last), absorb="pallas", **kw)
    assert out.dtype == dt
    assert_close(f"{impl} with the absorb kernels", out, ref, dtype=xla_dtype(dtype))


@pytest.mark.parametrize("make", [tiny_kimi_linear, tiny_k3])
@pytest.mark.parametrize("decode_impl", ["pallas", "hopper"])
def test_layer_decode_through_the_absorb_kernels(rng, make, decode_impl):
    """A decode step (two tokens per row, one row left-padded) with absorb_impl and linear_impl
    "pallas": the input launch, the query launch (absorbed queries and the normalised latents, read
    from the input launch's output in place), the attention kernel and the value launch; output and
    written cache equal "xla" (the einsums and the XLA norm)."""
    cfg = dataclasses.replace(make().mla, decode_impl=decode_impl)
    b, t, s = 3, 2, 64
    x = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), jnp.float32)
    cache = MLACache(latent=jnp.asarray(rng.standard_normal((b, s, cfg.latent_size)), jnp.float32))
    seq = SeqInfo.make(jnp.asarray(np.array([[1, 1], [0, 1], [1, 1]])), jnp.asarray([5, 20, 62]))
    outs = {}
    for impl in ("xla", "pallas"):
        layer = MultiHeadLatentAttention(dataclasses.replace(cfg, absorb_impl=impl), dtype=jnp.float32,
                                         rngs=nnx.Rngs(0), linear_impl=impl)
        outs[impl] = layer(x, seq, cache, fresh=False)
        jaxpr = str(jax.make_jaxpr(lambda x: layer(x, seq, cache, fresh=False))(x))
        assert ("mla_absorb_query" in jaxpr and "mla_absorb_value" in jaxpr) == (impl == "pallas")
        assert ("scatter" in jaxpr) == (impl == "xla")   # the query launch writes the cache itself
    (out, new_cache), (ref, ref_cache) = outs["pallas"], outs["xla"]
    assert_close("cache", new_cache.latent, ref_cache.latent)
    assert_close("layer output", out, ref)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Mosaic GPU kernel runs on a GPU only")
@pytest.mark.parametrize("absorb", ["xla", "pallas"])
def test_hopper_cache_attention_at_the_models_latent_width(rng, absorb):
    """bf16, R = 512 latent + 64 rope (the kernel itself, not its fallback), 3 query tokens per
    row, ragged lengths, slots past them poisoned: equal to the naive expansion, with W_UK / W_UV as
    einsums or as the few-row kernels (which also merge the kernel's splits)."""
    b, t, s, h, n, p, r, v = 3, 3, 512, 8, 128, 64, 512, 128
    q_nope = jnp.asarray(rng.standard_normal((b, t, h, n)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((b, t, h, p)), jnp.bfloat16)
    last = np.array([[2, 3, 4], [297, 298, 299], [509, 510, 511]], np.int32)
    cache = rng.standard_normal((b, s, r + p)).astype(np.float32)
    inside = np.arange(s)[None, :, None] <= last[:, -1:, None]
    clean = jnp.asarray(np.where(inside, cache, 0.0), jnp.bfloat16)
    poisoned = jnp.asarray(np.where(inside, cache, np.nan), jnp.bfloat16)
    w_kv_b = jnp.asarray(rng.standard_normal((r, h * (n + v))) / np.sqrt(r), jnp.bfloat16)
    kw = dict(scale=(n + p) ** -0.5, v_dim=v)
    ref = cache_attention("naive", q_nope, q_pe, clean, w_kv_b, jnp.asarray(last), **kw)
    assert_close("hopper", cache_attention("hopper", q_nope, q_pe, poisoned, w_kv_b, jnp.asarray(last), absorb=absorb,
                                           **kw), ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("blocks", [dict(block_q=8, block_k=16), dict(block_q=64, block_k=7), {}])
def test_chunk_attention_over_the_cache_equals_naive(rng, dtype, blocks):
    """A continuation chunk: 40 query tokens per row at the end of ragged histories (row 2 has 9
    padding queries), slots past each row's last token poisoned with NaN, several query and key
    blocks (sizes that do not divide T or S)."""
    b, t, s, h, n, p, r, v = 3, 40, 150, 4, 16, 8, 32, 16
    dt = jnp.dtype(dtype)
    q_nope = jnp.asarray(rng.standard_normal((b, t, h, n)), dt)
    q_pe = jnp.asarray(rng.standard_normal((b, t, h, p)), dt)
    first = np.array([60, 40, 100])  # slot of each row's first query; row 2 has 9 left pads
    pads = np.array([0, 0, 9])
    cols = np.arange(t)
    last = np.where(cols[None] >= pads[:, None], first[:, None] + cols[None] - pads[:, None], -1).astype(np.int32)
    cache = rng.standard_normal((b, s, r + p))
    ok = np.arange(s)[None, :, None] <= last.max(axis=1)[:, None, None]
    w_kv_b = jnp.asarray(rng.standard_normal((r, h * (n + v))) / np.sqrt(r), dt)
    kw = dict(scale=(n + p) ** -0.5, v_dim=v)
    ref = cache_attention("naive", q_nope, q_pe, jnp.asarray(np.where(ok, cache, 0.0), dt), w_kv_b, jnp.asarray(last),
                          **kw)
    out = attention_flash_cache(q_nope, q_pe, jnp.asarray(np.where(ok, cache, np.nan), dt), w_kv_b, jnp.asarray(last),
                                **kw, **blocks)
    real = last >= 0
    assert out.dtype == dt
    assert_close("flash over the cache vs naive", out[real], ref[real], dtype=xla_dtype(dtype))
    np.testing.assert_array_equal(np.asarray(out[~real], np.float32), 0.0)  # padding queries: zeros, not NaN
    dispatched = chunk_attention("flash", q_nope, q_pe, jnp.asarray(np.where(ok, cache, 0.0), dt), w_kv_b,
                                 jnp.asarray(last), **kw)
    assert_close("chunk_attention('flash')", dispatched[real], ref[real], dtype=xla_dtype(dtype))


@pytest.mark.parametrize("dtype,implementation", [("float32", "xla"), ("bfloat16", "xla"), ("bfloat16", "cudnn")])
def test_two_part_chunk_form_equals_naive(rng, dtype, implementation):
    """The cuDNN form of a continuation chunk (history without a mask, the chunk causally, merged by
    their log-sum-exps), through jax.nn.dot_product_attention's XLA implementation anywhere and
    cuDNN's on the GPU: equal to the naive attention over the cache. Rows with 60 and 25 tokens of
    history, and one whose prompt starts inside this chunk (no history, 9 padding queries); slots
    past each row's tokens hold NaN."""
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        pytest.skip("cuDNN runs on NVIDIA GPUs only; the same form runs through XLA in the other cases")
    b, t, s, h, n, p, r, v = 3, 24, 100, 4, 16, 8, 32, 16
    if implementation == "cudnn":  # the 48B model's head widths
        n, p, v = 128, 64, 128
    dt = jnp.dtype(dtype)
    q_nope = jnp.asarray(rng.standard_normal((b, t, h, n)), dt)
    q_pe = jnp.asarray(rng.standard_normal((b, t, h, p)), dt)
    start, pads = np.array([60, 25, 0]), np.array([0, 0, 9])
    cols = np.arange(t)
    last = np.where(cols[None] >= pads[:, None], start[:, None] + cols[None] - pads[:, None], -1).astype(np.int32)
    latent = rng.standard_normal((b, t, r + p))
    cache = np.full((b, s, r + p), np.nan)
    cache[:, :, :] = np.where(np.arange(s)[None, :, None] < start[:, None, None], rng.standard_normal((b, s, r + p)),
                              np.nan)
    for i in range(b):  # the chunk's own latents are in the cache already (written before attention)
        real = last[i] >= 0
        cache[i, last[i][real]] = latent[i][real]
    w_kv_b = jnp.asarray(rng.standard_normal((r, h * (n + v))) / np.sqrt(r), dt)
    kw = dict(scale=(n + p) ** -0.5, v_dim=v)
    clean = jnp.asarray(np.nan_to_num(cache, nan=0.0), dt)
    ref = cache_attention("naive", q_nope, q_pe, clean, w_kv_b, jnp.asarray(last), **kw)
    valid = last >= 0
    out = attention_cudnn_cache(q_nope, q_pe, jnp.asarray(latent, dt), jnp.asarray(cache, dt), w_kv_b,
                                jnp.asarray(valid), jnp.asarray(start, jnp.int32), **kw, implementation=implementation)
    assert out.dtype == dt
    assert_close("two-part chunk form vs naive", out[valid], ref[valid], dtype=xla_dtype(dtype))
    np.testing.assert_array_equal(np.asarray(out[~valid], np.float32), 0.0)


def _prefill_inputs(rng, b, t, dtype, h=4, n=16, p=8, r=12, v=10):
    """Random prefill operands for left-padded rows (pads 0, t // 3, t - 1) with huge garbage in the
    padding of the queries and latents."""
    pads = np.array([0, t // 3, t - 1][:b])
    valid = np.arange(t)[None, :] >= pads[:, None]

    def garbage(shape):
        return rng.standard_normal(shape) * np.where(valid, 1.0, 1e4).reshape(b, t, *[1] * (len(shape) - 2))

    q_nope = jnp.asarray(garbage((b, t, h, n)), dtype)
    q_pe = jnp.asarray(garbage((b, t, h, p)), dtype)
    latent = jnp.asarray(garbage((b, t, r + p)), dtype)
    w_kv_b = jnp.asarray(rng.standard_normal((r, h * (n + v))) / np.sqrt(r), dtype)
    return (q_nope, q_pe, latent, w_kv_b, jnp.asarray(valid)), dict(scale=(n + p) ** -0.5, v_dim=v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t,blocks", [
    (37, dict(block_q=8, block_k=8)),    # several blocks, T not a multiple of the block
    (50, dict(block_q=16, block_k=6)),   # query and key blocks of different sizes
    (29, dict(block_q=6, block_k=16)),
    (20, {}),                            # T smaller than the default block
    (1, {}),                             # one query token
])
def test_flash_prefill_equals_naive(rng, dtype, t, blocks):
    args, kw = _prefill_inputs(rng, 3, t, jnp.dtype(dtype))
    valid = np.asarray(args[-1])
    ref = prefill_attention("naive", *args, **kw)
    out = attention_flash(*args, **kw, **blocks)
    assert out.dtype == ref.dtype == jnp.dtype(dtype)
    assert_close("flash vs naive (real tokens)", out[valid], ref[valid], dtype=xla_dtype(dtype))
    # Padding queries see no key: zeros, not NaN and not the garbage.
    np.testing.assert_array_equal(np.asarray(out[~valid], np.float32), 0.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotated_padding_form_equals_naive(rng, dtype):
    """The cuDNN form's own work (left-padded rows rotated to lead with their real tokens, sequence
    lengths, rotated back, padding queries zeroed) through jax.nn.dot_product_attention's XLA
    implementation, which runs anywhere; cuDNN itself is compared on the GPU
    (`test_cudnn_prefill_equals_naive`)."""
    args, kw = _prefill_inputs(rng, 3, 37, jnp.dtype(dtype))
    valid = np.asarray(args[-1])
    ref = prefill_attention("naive", *args, **kw)
    out = attention_cudnn(*args, **kw, implementation="xla")
    assert out.dtype == ref.dtype
    assert_close("rotated form vs naive", out[valid], ref[valid], dtype=xla_dtype(dtype))
    np.testing.assert_array_equal(np.asarray(out[~valid], np.float32), 0.0)
    # A row all padding (the first chunk of a prompt that starts later): zeros, the others unchanged.
    empty = valid.copy()
    empty[2] = False
    out = attention_cudnn(*args[:-1], jnp.asarray(empty), **kw, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out[2], np.float32), 0.0)
    assert_close("rows beside an empty one", out[:2][valid[:2]], ref[:2][valid[:2]], dtype=xla_dtype(dtype))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention runs on NVIDIA GPUs only; the "
                    "rotation and masking around it are tested on the CPU (test_rotated_padding_form_equals_naive)")
def test_cudnn_prefill_equals_naive(rng):
    """bf16 at the 48B model's head widths (192 / 128), left-padded rows."""
    args, kw = _prefill_inputs(rng, 3, 300, jnp.bfloat16, h=4, n=128, p=64, r=64, v=128)
    valid = np.asarray(args[-1])
    ref = prefill_attention("naive", *args, **kw)
    for impl in ("cudnn", "auto"):
        out = prefill_attention(impl, *args, **kw)
        assert_close(impl, out[valid], ref[valid])


def test_auto_prefill_is_flash_off_the_gpu(rng):
    if jax.default_backend() == "gpu":
        pytest.skip("on the GPU auto takes cuDNN (test_cudnn_prefill_equals_naive)")
    args, kw = _prefill_inputs(rng, 2, 20, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(prefill_attention("auto", *args, **kw), np.float32),
                                  np.asarray(prefill_attention("flash", *args, **kw), np.float32))


def test_layer_prefill_impls_agree(rng):
    """The layer dispatches on prefill_impl; two blocks of the default size, left-padded rows."""
    cfg = tiny_kimi_linear().mla
    x = jnp.asarray(rng.standard_normal((2, 600, cfg.hidden_size)), jnp.float32)
    seq = SeqInfo.make(jnp.asarray(np.arange(600)[None, :] >= np.array([[0], [170]])))
    outs = {}
    for impl in ("naive", "flash"):
        layer = MultiHeadLatentAttention(dataclasses.replace(cfg, prefill_impl=impl), dtype=jnp.float32,
                                         rngs=nnx.Rngs(0))
        outs[impl], _ = layer(x, seq, None, fresh=True)
    valid = np.asarray(seq.valid)
    assert_close("layer flash vs naive", outs["flash"][valid], outs["naive"][valid])


def _largest_intermediate(jaxpr) -> int:
    """Elements of the largest array any equation of a jaxpr (and of its sub-jaxprs) produces."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    largest = max(largest, _largest_intermediate(inner))
    return largest


def test_flash_prefill_memory_is_linear_in_tokens(rng):
    """At T = 4096 (tiny MLA shape) no [T, T]-sized array is traced, and XLA's compiled temporary
    memory grows about linearly from T = 2048 to 4096 (the naive form: about 4x)."""
    def temp_bytes(impl, t):
        args, kw = _prefill_inputs(rng, 1, t, jnp.float32)
        fn = jax.jit(lambda *a: prefill_attention(impl, *a, **kw))
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes, jax.make_jaxpr(fn)(*args)

    (flash_2k, _), (flash_4k, jaxpr) = temp_bytes("flash", 2048), temp_bytes("flash", 4096)
    (naive_2k, _), (naive_4k, naive_jaxpr) = temp_bytes("naive", 2048), temp_bytes("naive", 4096)
    assert _largest_intermediate(jaxpr.jaxpr) < 4096 * 4096 <= _largest_intermediate(naive_jaxpr.jaxpr)
    assert flash_4k < 2.5 * flash_2k, f"flash temp {flash_2k} -> {flash_4k} bytes from T = 2048 to 4096"
    assert naive_4k > 3.5 * naive_2k  # the check can see quadratic growth
    assert flash_4k < 4096 * 4096 * 4 // 2  # well under one fp32 [T, T] buffer
