"""Helpers the tests share for building checkpoints."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import k3jax
from k3jax.checkpoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3jax.checkpoint.safetensors_io import SafetensorsCheckpoint, write_safetensors
from k3jax.checkpoint.writer import save_checkpoint
from k3jax.model import abstract_model
from k3jax.tiny import builtin_config


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


def rewrite_tensors(path, change) -> None:
    """Rewrites `path/model.safetensors` after `change(tensors)` edits its dict of numpy arrays."""
    file = os.path.join(os.fspath(path), "model.safetensors")
    ckpt = SafetensorsCheckpoint(path)
    tensors = {n: np.array(ckpt.read(n)) for n in ckpt.names()}
    change(tensors)
    write_safetensors(file, tensors)


def chunk_files(ckpt, param: str) -> list[Path]:
    """The chunk (shard) files of one parameter array of a converted checkpoint."""
    return sorted(p for p in (Path(ckpt) / "params" / param / "c").rglob("*") if p.is_file())


def flip_byte(file, offset: int | None = None) -> None:
    """Flips one bit of `file` (by default in the middle, inside the chunk data)."""
    data = bytearray(Path(file).read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x10
    Path(file).write_bytes(bytes(data))


def big_kimi_linear_checkpoint(path, experts: int = 48) -> None:
    """A bf16 Kimi-Linear-shaped source with many experts (hidden 128): many tensors, a few MB each layer.
    The weights come from numpy (small normal values; what the converter reads, not what a model
    initialises): JAX's random generator takes several seconds of CPU for the larger ones."""
    cfg = k3jax.tiny_kimi_linear(hidden=128, num_experts=experts, expert_intermediate_size=256)
    graphdef, shapes = nnx.split(abstract_model(cfg, "bfloat16"))   # real checkpoints are bf16
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape, np.float32)).astype(s.dtype), shapes)
    save_checkpoint(k3jax.CausalLM(nnx.merge(graphdef, params), cfg), path, shards=3)


def builtin_model(name: str, num_layers: int, *, seed: int = 0) -> k3jax.CausalLM:
    """The built-in model `name` cut to its first `num_layers` layers (random weights, the built-in's
    tokenizer and special ids, MTP kept): the same kinds of layers, a fraction of the compiling."""
    cfg, tok = builtin_config(name)
    cfg = dataclasses.replace(cfg, mixers=cfg.mixers[:num_layers], ffns=cfg.ffns[:num_layers])
    return k3jax.CausalLM.random(cfg, seed=seed, tokenizer=tok)


def builtin_checkpoint(path, name: str, num_layers: int, *, seed: int = 0) -> Path:
    """`builtin_model` as a checkpoint directory with its tokenizer, for the tests that start
    processes or load by path."""
    model = builtin_model(name, num_layers, seed=seed)
    save_checkpoint(model, path)
    model.tokenizer.save_pretrained(path)
    return Path(path)
