"""Helpers the tests share for building checkpoints."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

import k3jax
from k3jax.checkpoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def snap_experts_to_mxfp4(model: k3jax.CausalLM) -> k3jax.CausalLM:
    """Replaces routed expert weights by MXFP4-representable values, so a round trip is exact."""
    def snap(path, var):
        if "experts" in path and path[-1] in ("w1", "w2", "w3"):
            w = np.asarray(var.get_value(), np.float32)
            snapped = np.stack([dequantize_mxfp4(*quantize_mxfp4(e.T)).T for e in w])
            return var.replace(jnp.asarray(snapped, var.get_value().dtype))
        return var
    flat = [(p, snap(p, v)) for p, v in nnx.to_flat_state(model.params)]
    return k3jax.CausalLM(nnx.merge(model.graphdef, nnx.from_flat_state(flat)), model.config)
