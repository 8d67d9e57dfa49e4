"""Synthetic weights for tests and benchmarks.

`plant_greedy_chain` turns a random model into one whose greedy continuation is known and robust:
on plain random weights the top logits are near-ties, so two summation orders (a q-token verify
window against q one-token steps, bf16 against fp32) can pick different tokens, and a recorded
continuation or a prompt-lookup draft stops matching after the first such tie.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.causal_lm import CausalLM


def plant_greedy_chain(model: CausalLM, *, seed: int = 0, embed_std: float = 1.0) -> tuple[CausalLM, np.ndarray]:
    """The model with a planted greedy chain: embeddings ~ N(0, embed_std^2) (they dominate the
    residual stream) and unembedding column perm[t] = embedding t / |embedding t|, so greedy
    decoding after token t picks perm[t] by a wide margin. Every weight keeps its shape, dtype and
    placement, so a step costs what it did; the given model is left unchanged.

    Returns:
      (model, perm [V] int: the greedy successor of each token)
    """
    module = nnx.clone(model.module)
    emb, head = module.model.embed_tokens.embedding, module.lm_head.kernel
    v, d = emb.shape
    key = jax.random.key(seed)
    e = jax.random.normal(key, (v, d), jnp.float32) * embed_std
    perm = jax.random.permutation(jax.random.fold_in(key, 1), v)
    unit = e / jnp.linalg.norm(e, axis=1, keepdims=True)
    emb[...] = e.astype(emb.dtype)
    head[...] = jnp.zeros((d, v), head.dtype).at[:, perm].set(unit.T.astype(head.dtype))
    return CausalLM(module, mesh=model.mesh, **model._extras()), np.asarray(perm)
