"""Reference twin of the top-k router: the scores, the biased choice, `lax.top_k` and the
renormalised, scaled weights, in XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.router.spec import RouterSpec


def route_topk_reference(logits, bias_E, spec: RouterSpec):
    """Same contract as `kernel.route_topk_pallas` (logits [M, E] or fp32 partial sums [S, M, E])."""
    logits = logits.astype(jnp.float32)
    if logits.ndim == 3:
        logits = jnp.sum(logits, axis=0)
    scores = jax.nn.sigmoid(logits) if spec.score == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    _, experts = jax.lax.top_k(scores + bias_E.astype(jnp.float32), spec.k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if spec.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights, experts = weights * spec.scale, experts.astype(jnp.int32)
    if spec.always:
        m, e = logits.shape
        ids = jnp.broadcast_to(e + jnp.arange(spec.always, dtype=jnp.int32), (m, spec.always))
        weights = jnp.concatenate([weights, jnp.ones((m, spec.always), jnp.float32)], axis=1)
        experts = jnp.concatenate([experts, ids], axis=1)
    return weights, experts
