"""Writes a model as a Hugging Face checkpoint directory in the released layout (config.json +
safetensors, sharded with an index when asked): the inverse of the loader, through the same name
map. Used to build tiny checkpoints of either family without downloading anything.
"""

from __future__ import annotations

import json
import os

import numpy as np
from flax import nnx

from k3jax.causal_lm import CausalLM
from k3jax.checkpoint.mxfp4 import quantize_mxfp4
from k3jax.checkpoint.name_map import tensor_rules
from k3jax.checkpoint.safetensors_io import INDEX_NAME, write_safetensors
from k3jax.checkpoint.transforms import HOOKS
from k3jax.hf_config import to_hf_config


def checkpoint_tensors(model: CausalLM) -> dict[str, np.ndarray]:
    """Every checkpoint tensor of `model`, by stored name (MXFP4 experts quantised)."""
    params = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(model.params)}
    out = {}
    for name, rule in tensor_rules(model.config).items():
        value = params[rule.path]
        if rule.expert is not None:
            value = value[rule.expert]
        if rule.hook == "mxfp4_scale":
            continue
        if rule.hook == "mxfp4_packed":
            out[name], out[rule.partner] = quantize_mxfp4(value.astype(np.float32).T)
        else:
            out[name] = np.ascontiguousarray(HOOKS[rule.hook].invert(value))
    return out


def save_checkpoint(model: CausalLM, path: str | os.PathLike, *, shards: int = 1,
                    extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """Writes `model` to the directory `path` (created; must not hold a config.json yet)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, "config.json")):
        raise FileExistsError(f"{path} already holds a checkpoint")
    tensors = checkpoint_tensors(model)
    tensors.update(extra_tensors or {})
    names = sorted(tensors)
    if shards == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            write_safetensors(os.path.join(path, fname), {n: tensors[n] for n in part})
            weight_map.update({n: fname for n in part})
        total = sum(t.nbytes for t in tensors.values())
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(model.config), f, indent=1)
