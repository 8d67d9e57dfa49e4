"""The routed experts from unsorted pairs through the GLU hand-off (`hopper_mxfp4_routed.routed_mlp_hopper_mxfp4`):
bit for bit what it replaces (a stable sort by expert, `grouped_mlp_hopper_mxfp4(hand_off="glu")` on the sorted
rows with the sorted routing weights, the rows put back in token order and summed), and close to each pair's MLP
on the dequantised weights. Interpret mode on the CPU; compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

from pallas_kernels.moe_gmm import GluSpec, Mxfp4Weight, glu
from pallas_kernels.moe_gmm.hopper_mxfp4 import HandOffColumns, HopperMxfp4Blocks, Mxfp4Columns, to_columns
from pallas_kernels.moe_gmm.hopper_mxfp4_decode import SCALED_MAX_SCALE
from pallas_kernels.moe_gmm.hopper_mxfp4_mlp import grouped_mlp_hopper_mxfp4, hand_off_columns
from pallas_kernels.moe_gmm.hopper_mxfp4_routed import COUNT_MAX_PAIRS, routed_mlp_hopper_mxfp4, routing_order
from pallas_kernels.moe_gmm.mxfp4 import dequantize

SITU = GluSpec("situ", situ_beta=4.0, situ_linear_beta=8.0)


def _weight(rng, g, k, n) -> Mxfp4Weight:
    """Every E2M1 code; scales around 2^0 up to the compiled default decode's largest."""
    return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (g, k // 2, n), dtype=np.uint8)),
                       jnp.asarray(rng.integers(122, SCALED_MAX_SCALE + 1, (g, k // 32, n), dtype=np.uint8)))


def _problem(rng, n, k, g, d, f, d_out, dtype, outside: int, crowded: int):
    """x [n, d], routing weights [n, k] and experts [n, k] (`outside` pairs set to an expert of another shard: -1,
    g or g + 3; expert 0 chosen by the first `crowded` tokens), packed weights."""
    experts = np.stack([rng.permutation(g)[:k] for _ in range(n)])
    experts[:crowded, 0] = 0
    experts[:crowded, 1:] = np.where(experts[:crowded, 1:] == 0, 1 + experts[:crowded, :1], experts[:crowded, 1:])
    flat = experts.reshape(-1)
    flat[rng.choice(flat.size, outside, replace=False)] = rng.choice([-1, g, g + 3], outside)
    weights = rng.uniform(0.1, 1.0, (n, k))
    x = jnp.asarray(rng.standard_normal((n, d)) * 0.05, dtype)
    packed = (_weight(rng, g, d, f), _weight(rng, g, d, f), _weight(rng, g, f, d_out))
    return x, jnp.asarray(weights, jnp.float32), jnp.asarray(experts, jnp.int32), packed


def _sorted_call(x, weights, experts, columns, spec, blocks, interpret):
    """What the routed call replaces: numpy's stable sort by expert (other shards' pairs last, out of the groups),
    the hand-off on the sorted rows with the sorted routing weights (zero for other shards' pairs), the rows put
    back in token order and summed over each token's pairs."""
    n, k = experts.shape
    g = columns[0].shape[0]
    flat = np.asarray(experts).reshape(-1)
    local = (flat >= 0) & (flat < g)
    key = np.where(local, flat, g)
    order = np.argsort(key, kind="stable")
    sizes = jnp.asarray(np.bincount(key[local], minlength=g), jnp.int32)
    scale = jnp.where(jnp.asarray(local[order]), weights.reshape(-1)[order], 0.0)
    y = grouped_mlp_hopper_mxfp4(x[order // k], *columns, sizes, scale, spec=spec, blocks=blocks,
                                 interpret=interpret, hand_off="glu")
    return jnp.sum(y[np.argsort(order)].reshape(n, k, -1), axis=1)


def _pairs_reference(x, weights, experts, packed, spec):
    """Each pair's MLP on the dequantised weights (x and h rounded to bf16 as the MMA takes them), weighted and
    summed over the token's pairs of this shard."""
    dg, du, dd = (dequantize(w, jnp.float32) for w in packed)
    g = dg.shape[0]
    inside = (experts >= 0) & (experts < g)
    e = jnp.clip(experts, 0, g - 1)
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    h = glu(jnp.einsum("nd,nkdf->nkf", xb, dg[e]), jnp.einsum("nd,nkdf->nkf", xb, du[e]), spec)
    y = jnp.einsum("nkf,nkfd->nkd", h.astype(jnp.bfloat16).astype(jnp.float32), dd[e])
    return jnp.sum(jnp.where(inside[..., None], weights[..., None] * y, 0.0), axis=1)


# (tokens, pairs a token, experts, tile rows, GLU, activations' dtype, other shards' pairs, tokens on expert 0):
# a group longer than a tile (expert 0), experts no pair chose, pairs of other shards, every pair another shard's
# (no tile, no row of the down launch written: the output is zeros).
CASES = [(12, 2, 5, 8, GluSpec(), jnp.bfloat16, 3, 10), (9, 3, 6, 16, SITU, jnp.float32, 4, 0),
         (5, 2, 8, 8, GluSpec(), jnp.bfloat16, 0, 0), (4, 2, 4, 8, GluSpec(), jnp.bfloat16, 8, 0)]


@pytest.mark.parametrize("n,k,g,rows,spec,dtype,outside,crowded", CASES)
def test_routed_equals_the_sorted_call_and_each_pairs_mlp(rng, interpret, n, k, g, rows, spec, dtype, outside,
                                                          crowded):
    x, weights, experts, packed = _problem(rng, n, k, g, 256, 256, 128, dtype, outside, crowded)
    wg, wu, wd = (to_columns(w) for w in packed)
    columns = (hand_off_columns(wg), hand_off_columns(wu), wd)
    blocks = HopperMxfp4Blocks.for_backend(interpret, rows=rows, block_k=128)
    out = routed_mlp_hopper_mxfp4(x, weights, experts, *columns, spec=spec, blocks=blocks, interpret=interpret)
    assert out.shape == (n, 128) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_sorted_call(x, weights, experts, columns, spec,
                                                                           blocks, interpret)))
    assert_close("routed", out, _pairs_reference(x, weights, experts, packed, spec), dtype=jnp.bfloat16)
    if outside == n * k:
        assert not np.asarray(out).any()


@pytest.mark.parametrize("order_by", ["auto", "sort"])
def test_routed_defaults(rng, interpret, order_by):
    """No settings given: the hand-off's defaults for N*X sorted rows (the down launch writing rows on a GPU), the
    pairs put in order by counting ("auto" at 20 pairs) and by the sort."""
    x, weights, experts, packed = _problem(rng, 10, 2, 4, 256, 256, 128, jnp.bfloat16, 2, 6)
    wg, wu, wd = (to_columns(w) for w in packed)
    columns = (hand_off_columns(wg), hand_off_columns(wu), wd)
    out = routed_mlp_hopper_mxfp4(x, weights, experts, *columns, interpret=interpret, order_by=order_by)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_sorted_call(x, weights, experts, columns, GluSpec(),
                                                                           None, interpret)))


@pytest.mark.parametrize("num_keys, method", [(9, "count"), (9, "sort"), (2 ** 28, "sort"), (9, "auto")])
def test_routing_order_is_a_stable_sort_and_its_inverse(rng, num_keys, method):
    """Counting, the packed single-operand sort (keys that fit) and the argsort past int32: numpy's stable order."""
    key = rng.integers(0, 9, (300,)).astype(np.int32)
    order, rank = jax.jit(routing_order, static_argnums=(1, 2))(jnp.asarray(key), num_keys, method)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(key, kind="stable"))
    np.testing.assert_array_equal(np.asarray(rank), np.argsort(np.argsort(key, kind="stable")))


def test_routing_order_counts_up_to_its_bound_and_sorts_past_it():
    """"auto" lowers to [P, P] comparisons (no sort) up to COUNT_MAX_PAIRS pairs and to one sort past them."""
    for pairs, sorts in ((COUNT_MAX_PAIRS, False), (COUNT_MAX_PAIRS + 8, True)):
        text = jax.jit(routing_order, static_argnums=1).lower(jnp.zeros((pairs,), jnp.int32), 9).as_text()
        assert ("stablehlo.sort" in text) == sorts, (pairs, sorts)
    with pytest.raises(ValueError, match="routing_order: method must be one of"):
        routing_order(jnp.zeros((4,), jnp.int32), 9, "radix")


def test_refuses_what_it_cannot_route(rng):
    x, weights, experts, packed = _problem(rng, 4, 2, 4, 256, 128, 128, jnp.bfloat16, 0, 0)
    wg, wu, wd = (to_columns(w) for w in packed)
    hg, hu = hand_off_columns(wg), hand_off_columns(wu)
    with pytest.raises(ValueError, match=r"expected x \[N, D\] with weights and experts \[N, X\]"):
        routed_mlp_hopper_mxfp4(x[:3], weights, experts, hg, hu, wd, interpret=True)
    with pytest.raises(ValueError, match="hand_off='glu' takes the gate and up weights from hand_off_columns"):
        routed_mlp_hopper_mxfp4(x, weights, experts, wg, wu, wd, interpret=True)
    with pytest.raises(ValueError, match=r"different hand-off orders \(HandOffColumns, WordHandOffColumns\)"):
        routed_mlp_hopper_mxfp4(x, weights, experts, hg, hand_off_columns(wu, "words"), wd, interpret=True)
    with pytest.raises(ValueError, match="w_down must be plain Mxfp4Columns"):
        routed_mlp_hopper_mxfp4(x, weights, experts, hg, hu, hand_off_columns(wd), interpret=True)
    with pytest.raises(ValueError, match=r"expected x \[N, D\] with weights and experts \[N, X\]"):
        routed_mlp_hopper_mxfp4(x, weights.reshape(-1), experts.reshape(-1), hg, hu, wd, interpret=True)
    exact = dict(decode="exact", a_operand="smem", block_k=128)
    with pytest.raises(ValueError, match="routed_mlp_hopper_mxfp4: the hand-off builds slabs; .* got 'rows'"):
        routed_mlp_hopper_mxfp4(x, weights, experts, hg, hu, wd, interpret=True,
                                blocks=HopperMxfp4Blocks(activations="rows", **exact))
    with pytest.raises(ValueError, match="routed_mlp_hopper_mxfp4: hand_off='glu' writes h's slabs .* "
                                         "code_load='words' does not read"):
        routed_mlp_hopper_mxfp4(x, weights, experts, hg, hu, wd, interpret=True,
                                blocks=HopperMxfp4Blocks(code_load="words", **exact))


@pytest.mark.parametrize("tokens, order_by", [(64, "auto"), (13, "auto"), (64, "sort")])
def test_routed_lowers_for_cuda_on_any_host(tokens, order_by):
    """The compiled defaults (8-row decode tiles at 64 tokens of 8 pairs over 16 experts; 16-row ones at 13 tokens
    of 8 over 4), lowered for CUDA: both Mosaic GPU launches in the module, a sort only where asked for."""
    k, f, d, g = 512, 256, 128, 16 if tokens == 64 else 4
    args = (jax.ShapeDtypeStruct((tokens, k), jnp.bfloat16), jax.ShapeDtypeStruct((tokens, 8), jnp.float32),
            jax.ShapeDtypeStruct((tokens, 8), jnp.int32), jax.ShapeDtypeStruct((g, f, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((g, k // 32, f), jnp.uint8), jax.ShapeDtypeStruct((g, d, f // 2), jnp.uint8),
            jax.ShapeDtypeStruct((g, f // 32, d), jnp.uint8))

    def mlp(x, weights, experts, p, s, p_down, s_down):
        return routed_mlp_hopper_mxfp4(x, weights, experts, HandOffColumns(p, s), HandOffColumns(p, s),
                                       Mxfp4Columns(p_down, s_down), interpret=False, order_by=order_by)

    module = jax.export.export(jax.jit(mlp), platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu") >= 2
    assert ("stablehlo.sort" in module) == (order_by == "sort")
    # named for profiles: the gated launch with the GLU, the down launch (the model's scope in their names)
    assert "routed_experts_mxfp4_glu_mosaic_gpu" in module and "routed_experts_mxfp4_matmul_mosaic_gpu" in module
