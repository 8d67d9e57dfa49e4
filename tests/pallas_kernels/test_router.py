"""Top-k routing in one launch (`pallas_kernels.router`): the kernel (interpret mode on the CPU,
compiled on a GPU) picks the same experts as `lax.top_k` (ties to the lowest index) with the same
weights, from logits or their partial sums; and both equal the model's own router (`route_logits`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

from k3jax.config import MoEConfig
from k3jax.layers.moe import route_logits, route_partial_logits
from pallas_kernels.router import RouterSpec, route_topk, route_topk_pallas, route_topk_reference


@pytest.mark.parametrize("splits,m,experts,k,score,renormalize", [
    (9, 1, 256, 8, "sigmoid", True),      # Kimi-Linear's router at decode, partial sums of the fused launch
    (1, 3, 896, 16, "sigmoid", True),     # K3's 896 experts (not a power of two)
    (2, 16, 64, 6, "softmax", False),
    (1, 5, 8, 8, "sigmoid", True),        # every expert chosen
])
def test_kernel_matches_top_k(rng, interpret, splits, m, experts, k, score, renormalize):
    logits = jnp.asarray(rng.standard_normal((splits, m, experts)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(experts) * 0.1, jnp.float32)
    spec = RouterSpec(k=k, score=score, renormalize=renormalize, scale=2.446)
    w, e = route_topk_pallas(logits, bias, spec=spec, interpret=interpret)
    w_ref, e_ref = route_topk_reference(logits, bias, spec)
    assert w.shape == (m, k) and w.dtype == jnp.float32 and e.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(e), np.asarray(e_ref))
    assert_close("weights", w, w_ref, dtype="float32")


@pytest.mark.parametrize("always", [1, 2])
def test_always_active_experts_follow_the_choices(rng, interpret, always):
    """RouterSpec.always appends experts E, E + 1, .. with weight 1 after the k chosen (unscaled,
    outside the renormalisation)."""
    logits = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(64) * 0.1, jnp.float32)
    spec = RouterSpec(k=6, scale=2.5, always=always)
    w, e = route_topk_pallas(logits, bias, spec=spec, interpret=interpret)
    w_ref, e_ref = route_topk_reference(logits, bias, spec)
    base_w, base_e = route_topk_reference(logits, bias, RouterSpec(k=6, scale=2.5))
    assert w.shape == e.shape == (3, 6 + always)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(e_ref))
    np.testing.assert_array_equal(np.asarray(e[:, :6]), np.asarray(base_e))
    np.testing.assert_array_equal(np.asarray(e[:, 6:]), np.broadcast_to(64 + np.arange(always), (3, always)))
    assert_close("chosen weights", w[:, :6], base_w, dtype="float32")
    np.testing.assert_array_equal(np.asarray(w[:, 6:]), 1.0)
    assert_close("reference", w, w_ref, dtype="float32")


def test_ties_go_to_the_lowest_index(interpret):
    logits = jnp.asarray(np.repeat(np.array([[0.5, 1.0, 1.0, 0.2, 1.0, 0.5, 0.0, 1.0]], np.float32), 2, 0))
    bias = jnp.zeros((8,), jnp.float32)
    w, e = route_topk_pallas(logits, bias, spec=RouterSpec(k=5), interpret=interpret)
    np.testing.assert_array_equal(np.asarray(e), [[1, 2, 4, 7, 0]] * 2)
    np.testing.assert_array_equal(np.asarray(route_topk_reference(logits, bias, RouterSpec(k=5))[1]), np.asarray(e))
    assert_close("tied weights", w, route_topk_reference(logits, bias, RouterSpec(k=5))[0], dtype="float32")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_equals_the_models_router(rng, impl):
    """The model's route_logits on the summed logits (grouped routers keep it)."""
    cfg = MoEConfig(hidden_size=32, num_experts=64, num_experts_per_token=6, expert_intermediate_size=16,
                    routed_scaling_factor=1.7, router_impl=impl)
    partials = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(64) * 0.1, jnp.float32)
    w, e = route_partial_logits(partials, bias, cfg)
    w_ref, e_ref = route_logits(jnp.sum(partials, axis=0), bias, cfg)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(e_ref))
    assert_close("weights", w, w_ref, dtype="float32")
    grouped = MoEConfig(hidden_size=32, num_experts=64, num_experts_per_token=6, expert_intermediate_size=16,
                        num_expert_group=4, topk_group=2, router_impl=impl)
    w, e = route_partial_logits(partials, bias, grouped)
    w_ref, e_ref = route_logits(jnp.sum(partials, axis=0), bias, grouped)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(e_ref))


def test_errors():
    with pytest.raises(ValueError, match="unknown score function"):
        RouterSpec(k=2, score="relu")
    with pytest.raises(ValueError, match="k=9 exceeds the 8 experts"):
        route_topk_pallas(jnp.ones((1, 8)), jnp.zeros((8,)), spec=RouterSpec(k=9))
    with pytest.raises(ValueError, match="expected logits"):
        route_topk_pallas(jnp.ones((1, 8)), jnp.zeros((7,)), spec=RouterSpec(k=2))
    with pytest.raises(ValueError, match="unknown impl"):
        route_topk(jnp.ones((1, 8)), jnp.zeros((8,)), RouterSpec(k=2), impl="cuda")
