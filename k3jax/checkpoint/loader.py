"""Loads a Hugging Face Kimi checkpoint directory into a `CausalLM`, tensor by tensor.

All names, shapes and dtypes are checked against the model config from the headers alone; any
mismatch raises one `CheckpointError` listing every missing, unexpected and mis-shaped tensor.
Parameters are then filled one at a time (stacked experts included), so host memory holds at
most one parameter beyond what is already on the device.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.causal_lm import CausalLM, resolve_dtype
from k3jax.checkpoint.name_map import TensorRule, tensor_aliases, tensor_rules
from k3jax.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from k3jax.checkpoint.transforms import HOOKS
from k3jax.config import ModelConfig
from k3jax.hf_config import load_hf_config
from k3jax.model import KimiForCausalLM

_FLOAT_KINDS = ("F32", "F16", "BF16", "F64")
_SHOW = 8


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOW])
    return shown + (f", ... and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


def plan_tensors(cfg: ModelConfig, ckpt: SafetensorsCheckpoint, param_shapes: dict[tuple, tuple]
                 ) -> dict[tuple, list[tuple[str, TensorRule]]]:
    """Matches stored tensors to parameters. Returns parameter path -> [(stored name, rule)].

    Raises CheckpointError naming every missing, unexpected, duplicated, mis-shaped or
    non-float tensor.
    """
    rules = tensor_rules(cfg)
    aliases = tensor_aliases(cfg)
    seen: dict[str, str] = {}
    unexpected, bad_shape, bad_dtype, duplicate = [], [], [], []
    plan: dict[tuple, list] = defaultdict(list)
    for name in ckpt.names():
        canon = aliases.get(name, name)
        rule = rules.get(canon)
        if rule is None:
            unexpected.append(name)
            continue
        if canon in seen:
            duplicate.append(f"{name} (same tensor as {seen[canon]})")
            continue
        seen[canon] = name
        info = ckpt.info(name)
        shape = param_shapes[rule.path]
        if rule.expert is not None:
            shape = shape[1:]
        accepted = HOOKS[rule.hook].source_shapes(shape)
        if info.shape not in accepted:
            bad_shape.append(f"{name} {list(info.shape)} (expected {list(accepted[0])})")
        elif not np.issubdtype(info.dtype, np.floating):
            bad_dtype.append(f"{name} {info.dtype} (expected a float dtype)")
        plan[rule.path].append((name, rule))
    missing = [n for n in rules if n not in seen]
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("duplicated", duplicate),
                         ("wrong shape", bad_shape), ("wrong dtype", bad_dtype)):
        if items:
            problems.append(f"{len(items)} {label}: {_listing(items)}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt.path} does not match its config: " + "; ".join(problems))
    return plan


def _progress(total_bytes: int, show: bool | None):
    if show is None:
        show = sys.stderr.isatty() and total_bytes > (1 << 28)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with transformers
        return None
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading", disable=not show)


def load_causal_lm(path: str | os.PathLike, dtype="float32", *, kda_impl: str | None = None,
                   mla_impl: str | None = None, moe_impl: str | None = None,
                   progress: bool | None = None) -> CausalLM:
    """Loads `path` (config.json + *.safetensors [+ index]) as a `CausalLM`.

    dtype: "float32" or "bfloat16" for the weights and activations; A_log, dt_bias, conv taps,
    o_norm and the router correction bias always stay fp32.
    kda_impl / mla_impl / moe_impl: implementation choices (see the sub-configs).
    """
    dt = resolve_dtype(dtype)
    cfg = load_hf_config(path).with_impls(kda=kda_impl, mla=mla_impl, moe=moe_impl)
    ckpt = SafetensorsCheckpoint(path)
    abstract = nnx.eval_shape(lambda: KimiForCausalLM(cfg, dtype=dt, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    shapes = {p: tuple(v.get_value().shape) for p, v in flat}
    plan = plan_tensors(cfg, ckpt, shapes)

    bar = _progress(ckpt.total_bytes, progress)
    loaded = []
    for p, var in flat:
        abstract_value = var.get_value()
        np_dtype = np.dtype(abstract_value.dtype)
        entries = plan[p]
        if entries[0][1].expert is None:
            (name, rule), = entries
            value = HOOKS[rule.hook].apply(ckpt.read(name), shapes[p]).astype(np_dtype)
        else:
            value = np.empty(shapes[p], np_dtype)
            for name, rule in entries:
                value[rule.expert] = HOOKS[rule.hook].apply(ckpt.read(name), shapes[p][1:])
        if bar is not None:
            bar.update(sum(ckpt.info(n).nbytes for n, _ in entries))
        loaded.append((p, var.replace(jnp.asarray(value))))
    if bar is not None:
        bar.close()
    module = nnx.merge(graphdef, nnx.from_flat_state(loaded))
    return CausalLM(module, cfg)
