"""MoE: the router against numpy, every expert implementation against the dense reference and a
token loop, any implementation per shard under expert parallelism, SiTU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

from k3jax.config import ExpertParallel, MoEConfig
from k3jax.layers.activation import Activation, gated_activation
from k3jax.layers.moe import route
from k3jax.layers.moe_experts import EXPERT_IMPLS, experts_dense, local_experts, sort_by_expert, unsort_and_sum
from k3jax.layers.moe_parallel import emulated_ragged_all_to_all, expert_parallel
from k3jax.sharding import MeshSpec, make_mesh


def _numpy_route(x, w, bias, cfg: MoEConfig):
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ w.astype(np.float64))))
    choice = scores + bias
    if cfg.num_expert_group > 1:
        g = choice.reshape(len(x), cfg.num_expert_group, -1)
        group_score = np.sort(g, -1)[..., -2:].sum(-1)
        keep = np.argsort(-group_score, -1)[:, :cfg.topk_group]
        mask = np.zeros(group_score.shape, bool)
        np.put_along_axis(mask, keep, True, -1)
        choice = np.where(mask[..., None], g, -np.inf).reshape(len(x), -1)
    idx = np.argsort(-choice, -1)[:, :cfg.num_experts_per_token]
    wts = np.take_along_axis(scores, idx, -1)
    if cfg.renormalize:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    return wts * cfg.routed_scaling_factor, idx



@pytest.mark.parametrize("groups,topk_group,renorm", [(1, 1, True), (4, 2, True), (2, 1, False)])
def test_router_matches_numpy(rng, groups, topk_group, renorm):
    cfg = MoEConfig(hidden_size=16, num_experts=16, num_experts_per_token=3, expert_intermediate_size=8,
                    num_expert_group=groups, topk_group=topk_group, renormalize=renorm, routed_scaling_factor=2.446)
    x = rng.standard_normal((40, 16)).astype(np.float32)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    bias = (rng.standard_normal(16) * 0.5).astype(np.float32)
    weights, experts = route(x, w, bias, cfg)
    ref_w, ref_idx = _numpy_route(x, w, bias, cfg)
    order = np.argsort(np.asarray(experts), -1)
    ref_order = np.argsort(ref_idx, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, -1),
                                  np.take_along_axis(ref_idx, ref_order, -1))
    assert_close("weights", np.take_along_axis(np.asarray(weights), order, -1),
                 np.take_along_axis(ref_w, ref_order, -1))



def _expert_problem(rng, n, d=16, f=8, e=6, k=2):
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (n, k)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) / 4, jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
    return x, weights, experts, ws


@pytest.mark.parametrize("act", [Activation("silu"), Activation("situ", 4.0, 25.0)])
def test_expert_implementations_equal_dense_reference(rng, act):
    x, weights, experts, ws = _expert_problem(rng, 37, d=32, f=16)
    n, k = experts.shape
    dense = experts_dense(x, weights, experts, *ws, act)
    for impl in EXPERT_IMPLS:
        assert_close(f"{impl} vs dense", local_experts(impl, x, weights, experts, *ws, act), dense)
    for gmm in ("pallas", "xla"):  # the ragged and pairs paths through each grouped matmul
        for impl in ("ragged", "pairs"):
            assert_close(f"{impl}/{gmm}", local_experts(impl, x, weights, experts, *ws, act, gmm=gmm), dense)
    # Independent loop over tokens.
    ref = np.zeros(x.shape)
    for i in range(n):
        for j in range(k):
            ei = int(experts[i, j])
            h = np.asarray(gated_activation(x[i] @ ws[0][ei], x[i] @ ws[1][ei], act), np.float64)
            ref[i] += float(weights[i, j]) * (h @ np.asarray(ws[2][ei], np.float64))
    assert_close("dense vs loop", dense, ref)


@pytest.mark.parametrize("method", ["count", "sort"])
@pytest.mark.parametrize("tokens,offset", [(64, 0), (37, 5), (300, 0)])
def test_sort_by_expert_is_numpys_stable_sort(rng, method, tokens, offset):
    """Both methods (the counted order and XLA's sort) against numpy's stable argsort of the same keys, another
    shard's pairs last; group sizes by bincount; unsort_and_sum against a loop over tokens."""
    with pytest.raises(ValueError, match="method must be"):
        sort_by_expert(jnp.zeros((2, 2), jnp.int32), 4, method="radix")
    e, local_e, k = 16, 8, 4
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    order, sizes, local = jax.jit(sort_by_expert, static_argnums=(1, 3))(jnp.asarray(experts), local_e, offset,
                                                                         method)
    flat = experts.reshape(-1) - offset
    inside = (flat >= 0) & (flat < local_e)
    want = np.argsort(np.where(inside, flat, local_e), kind="stable")
    np.testing.assert_array_equal(np.asarray(order), want)
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(flat[inside], minlength=local_e))
    np.testing.assert_array_equal(np.asarray(local), inside[want])
    y = jnp.asarray(rng.standard_normal((tokens * k, 3)), jnp.float32)      # rows in sorted order
    summed = jax.jit(unsort_and_sum, static_argnums=(2,))(y, order, k)
    ref = np.zeros((tokens, 3))
    for row, pair in enumerate(want):
        ref[pair // k] += np.asarray(y[row], np.float64)
    assert_close("unsort_and_sum", summed, ref)


@pytest.mark.parametrize("impl", EXPERT_IMPLS)
def test_shards_of_experts_sum_to_the_whole(rng, impl):
    """Each implementation over a slice of the experts (expert_offset) gives that slice's share."""
    x, weights, experts, ws = _expert_problem(rng, 11, d=32, f=16)
    act = Activation("silu")
    whole = experts_dense(x, weights, experts, *ws, act)
    parts = [local_experts(impl, x, weights, experts, *(w[o:o + 3] for w in ws), act, expert_offset=o, gmm="xla")
             for o in (0, 3)]
    for path in ("ragged", "pairs"):
        parts_kernel = [local_experts(path, x, weights, experts, *(w[o:o + 3] for w in ws), act, expert_offset=o,
                                      gmm="pallas") for o in (0, 3)]
        assert_close(f"sum of shards ({path} kernel)", parts_kernel[0] + parts_kernel[1], whole)
    assert_close("sum of shards", parts[0] + parts[1], whole)


@pytest.mark.parametrize("tokens", [64, 6])  # divisible over data x expert (all_gather/psum_scatter), or not (psum)
@pytest.mark.parametrize("spec", [MeshSpec(expert=8), MeshSpec(data=2, expert=4)])
@pytest.mark.parametrize("impl,dispatch", [("ragged", "gather"), ("gather", "gather"), ("dense", "gather"),
                                           ("ragged", "ragged"), ("pairs", "ragged")])
def test_expert_parallel_equals_single_device(rng, tokens, spec, impl, dispatch):
    """"ragged" dispatch: on the CPU through the emulated ragged_all_to_all (same contract)."""
    x, weights, experts, ws = _expert_problem(rng, tokens, d=32, f=16, e=16, k=3)
    act = Activation("silu")
    ref = experts_dense(x, weights, experts, *ws, act)
    mesh = make_mesh(spec)
    ep = ExpertParallel(expert_shards=spec.expert, data_shards=spec.data)
    with jax.set_mesh(mesh):
        ws_sharded = [jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in ws]
        out = jax.jit(lambda *a: expert_parallel(*a, act=act, ep=ep, impl=impl, dispatch=dispatch))(
            x, weights, experts, *ws_sharded)
    assert_close(f"expert parallel ({dispatch})", out, ref)


def test_ragged_dispatch_lowers_to_ragged_all_to_all_for_gpus(monkeypatch):
    """For a GPU the exchange is the primitive itself (XLA:CPU cannot run it): the dispatch lowers
    for CUDA on any host with one ragged_all_to_all per direction and payload."""
    from k3jax.layers import moe_parallel

    monkeypatch.setattr(moe_parallel, "_exchange", lambda: jax.lax.ragged_all_to_all)
    mesh = make_mesh(MeshSpec(expert=8))
    ep = ExpertParallel(expert_shards=8)
    experts = NamedSharding(mesh, P("expert"))
    args = (jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((64, 3), jnp.float32),
            jax.ShapeDtypeStruct((64, 3), jnp.int32), jax.ShapeDtypeStruct((16, 32, 16), jnp.bfloat16, sharding=experts),
            jax.ShapeDtypeStruct((16, 32, 16), jnp.bfloat16, sharding=experts),
            jax.ShapeDtypeStruct((16, 16, 32), jnp.bfloat16, sharding=experts))
    fn = jax.jit(lambda *a: expert_parallel(*a, act=Activation("silu"), ep=ep, impl="ragged", dispatch="ragged"))
    with jax.set_mesh(mesh):
        exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*args)
    assert exported.mlir_module().count("stablehlo.custom_call @ragged_all_to_all") == 3   # rows, ids, results


def test_emulated_ragged_all_to_all_follows_the_contract(rng):
    """Shard i sends i + 1 rows to each of 8 shards j (rows tagged with source and destination), at the
    offsets the receiver reserved: every receiver holds exactly what was sent to it, in order."""
    shards, width = 8, 3
    mesh = make_mesh(MeshSpec(expert=shards))

    def body(_):
        me = jax.lax.axis_index("expert")
        sizes = jnp.full((shards,), me + 1, jnp.int32)
        offsets = jnp.cumsum(sizes) - sizes
        operand = jnp.stack([me * 100 + jnp.arange(shards * shards) // (me + 1) * 10 + jnp.arange(shards * shards)
                             % (me + 1)] * width, axis=1).astype(jnp.float32)
        recv = jax.lax.all_to_all(sizes, "expert", 0, 0, tiled=True)
        recv_off = jnp.cumsum(recv) - recv
        land = jax.lax.all_to_all(recv_off, "expert", 0, 0, tiled=True)
        out = emulated_ragged_all_to_all(operand, jnp.full((shards * shards * 2, width), -1.0), offsets, sizes, land,
                                         recv, axis_name="expert")
        return out[None]

    with jax.set_mesh(mesh):
        got = jax.jit(jax.shard_map(body, in_specs=P("expert"), out_specs=P("expert")))(jnp.zeros((shards,)))
    got = np.asarray(got)
    for j in range(shards):                  # receiver j: from i, rows i*100 + j*10 + 0..i, in source order
        want = [i * 100 + j * 10 + r for i in range(shards) for r in range(i + 1)]
        np.testing.assert_array_equal(got[j, :len(want), 0], want)
        assert (got[j, len(want):] == -1).all()


def test_expert_parallel_checks_its_mesh(rng):
    x, weights, experts, ws = _expert_problem(rng, 4, e=8)
    ep = ExpertParallel(expert_shards=4)
    with pytest.raises(ValueError, match="run it under its mesh"):
        expert_parallel(x, weights, experts, *ws, Activation("silu"), ep=ep)
    with jax.set_mesh(make_mesh(MeshSpec(expert=8))), pytest.raises(ValueError, match="sharded for expert=4"):
        expert_parallel(x, weights, experts, *ws, Activation("silu"), ep=ep)


def test_moe_config_knows_the_choices():
    base = MoEConfig(hidden_size=8, num_experts=4, num_experts_per_token=2, expert_intermediate_size=4)
    with pytest.raises(ValueError, match="moe.gmm_impl"):
        dataclasses.replace(base, gmm_impl="cuda")
    with pytest.raises(ValueError, match="moe.impl"):
        dataclasses.replace(base, impl="fast")
    with pytest.raises(ValueError, match="moe.shared_impl"):
        dataclasses.replace(base, shared_impl="fused")
    with pytest.raises(ValueError, match="moe.router_impl"):
        dataclasses.replace(base, router_impl="sort")
    with pytest.raises(ValueError, match="do not split over 3"):
        dataclasses.replace(base, expert_parallel=ExpertParallel(expert_shards=3))


def test_situ_formula(rng):
    gate = rng.standard_normal(50).astype(np.float32) * 10
    up = rng.standard_normal(50).astype(np.float32) * 60
    expected = 4 * np.tanh(gate / 4) / (1 + np.exp(-gate)) * 25 * np.tanh(up / 25)
    assert_close("situ", gated_activation(gate, up, Activation("situ", 4.0, 25.0)), expected)
    assert_close("silu", gated_activation(gate, up, Activation("silu")), gate / (1 + np.exp(-gate)) * up)


@pytest.mark.parametrize("tokens", [1, 3])
def test_shared_expert_in_the_pair_kernels(rng, tokens):
    """shared_impl "auto" on the pairs path runs the shared expert as one more pair per token in the
    routed experts' kernels: the layer equals the separate shared MLP ("mlp"), and a token loop in
    numpy-free jnp (routed choice by choice plus the shared MLP)."""
    from flax import nnx

    from k3jax.layers.moe import MoE
    cfg = MoEConfig(hidden_size=64, num_experts=8, num_experts_per_token=3, expert_intermediate_size=32,
                    routed_scaling_factor=1.5, impl="pairs", gmm_impl="pallas", shared_impl="auto")
    x = jnp.asarray(rng.standard_normal((1, tokens, 64)), jnp.float32)
    layers = {}
    for shared_impl in ("auto", "mlp"):
        layer = MoE(dataclasses.replace(cfg, shared_impl=shared_impl), dtype=jnp.float32, rngs=nnx.Rngs(3))
        layers[shared_impl] = layer
        assert (layer._shared_weights_for_pairs(tokens) is None) == (shared_impl == "mlp")
    folded, separate = layers["auto"](x), layers["mlp"](x)
    assert_close("shared expert as a pair", folded, separate, dtype="float32")
    # The decode path: router logits from the few-row kernel, the router kernel appending the
    # shared expert to each token's choices; and the unsummed pairs for the residual add.
    fast = MoE(dataclasses.replace(cfg, router_impl="pallas"), dtype=jnp.float32, rngs=nnx.Rngs(3),
               linear_impl="pallas")
    assert_close("router kernel appends the shared expert", fast(x), separate, dtype="float32")
    assert_close("unsummed pairs", fast(x, partial=True).value(), separate, dtype="float32")
    m = layers["mlp"]
    weights, experts = route(x[0], m.gate.kernel[...], m.gate.e_score_correction_bias[...], cfg)
    act = cfg.activation
    rows = []
    for t in range(tokens):
        y = m.shared_experts(x[0, t][None])[0]
        for j in range(cfg.num_experts_per_token):
            e = experts[t, j]
            h = gated_activation(x[0, t] @ m.experts.w1[...][e], x[0, t] @ m.experts.w3[...][e], act)
            y = y + weights[t, j] * (h @ m.experts.w2[...][e])
        rows.append(y)
    assert_close("token loop", folded[0], jnp.stack(rows), dtype="float32")


def test_bf16_router_sums_the_same_products(rng):
    """bf16 inputs and router weight take a bf16 matmul with fp32 accumulation: the same exact
    products as upcasting both to fp32 first (the Hugging Face order), summed in fp32."""
    cfg = MoEConfig(hidden_size=256, num_experts=64, num_experts_per_token=6, expert_intermediate_size=16,
                    routed_scaling_factor=2.0)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 64)) * 0.05, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(64) * 0.01, jnp.float32)
    weights, experts = route(x, w, bias, cfg)
    ref_w, ref_e = route(x.astype(jnp.float32), w.astype(jnp.float32), bias, cfg)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(ref_e))
    assert_close("bf16 router", weights, ref_w, dtype="float32")
