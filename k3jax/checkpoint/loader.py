"""Loads a Hugging Face Kimi checkpoint directory into a `CausalLM`, tensor by tensor.

All names, shapes and dtypes are checked against the model config from the headers alone; any
mismatch raises one `CheckpointError` listing every missing, unexpected and mis-shaped tensor.
Parameters are then filled one at a time (stacked experts included, MXFP4 experts dequantised),
so host memory holds at most one parameter beyond what is already on the device.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import defaultdict
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.causal_lm import CausalLM, resolve_dtype
from k3jax.checkpoint.mxfp4 import dequantize_mxfp4
from k3jax.checkpoint.name_map import (TensorRule, is_skipped, mtp_embedding_name, tensor_aliases,
                                       tensor_rules)
from k3jax.checkpoint.orbax_format import is_k3jax_checkpoint, read_manifest, restore_params
from k3jax.checkpoint.safetensors_io import FLOAT_DTYPES, CheckpointError, SafetensorsCheckpoint
from k3jax.checkpoint.transforms import HOOKS
from k3jax.config import ModelConfig
from k3jax.hf_config import from_hf_config, load_hf_config
from k3jax.model import KimiForCausalLM

_SHOW = 8


@dataclass(frozen=True)
class LoadReport:
    """What a load consumed: tensors used, tensors deliberately skipped (vision tower, ...), bytes read."""

    tensors: int
    skipped: int
    bytes_read: int


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOW])
    return shown + (f", ... and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


def plan_tensors(cfg: ModelConfig, ckpt: SafetensorsCheckpoint, param_shapes: dict[tuple, tuple]
                 ) -> tuple[dict[tuple, list[tuple[str, TensorRule]]], int]:
    """Matches stored tensors to parameters.

    Returns (parameter path -> [(stored name, rule)], number of skipped tensors). Raises
    CheckpointError naming every missing, unexpected, duplicated, mis-shaped or mis-typed tensor.
    """
    rules = tensor_rules(cfg)
    aliases = tensor_aliases(cfg)
    seen: dict[str, str] = {}
    unexpected, bad_shape, bad_dtype, duplicate = [], [], [], []
    skipped = 0
    plan: dict[tuple, list] = defaultdict(list)
    for name in ckpt.names():
        canon = aliases.get(name, name)
        rule = rules.get(canon)
        if rule is None:
            if is_skipped(cfg, name):
                skipped += 1
            else:
                unexpected.append(name)
            continue
        if canon in seen:
            duplicate.append(f"{name} (same tensor as {seen[canon]})")
            continue
        seen[canon] = name
        info = ckpt.info(name)
        hook = HOOKS[rule.hook]
        shape = param_shapes[rule.path][1:] if rule.expert is not None else param_shapes[rule.path]
        if not hook.accepts(info.shape, shape):
            note = f" {hook.note}" if hook.note else ""
            bad_shape.append(f"{name} {list(info.shape)} (expected {list(hook.expected(shape))}{note})")
        elif hook.stored == "uint8" and info.dtype != np.uint8:
            bad_dtype.append(f"{name} {info.dtype} (expected uint8)")
        elif hook.stored == "float" and info.dtype not in FLOAT_DTYPES:
            bad_dtype.append(f"{name} {info.dtype} (expected a float dtype)")
        if hook.name != "mxfp4_scale":  # scales are read together with their packed codes
            plan[rule.path].append((name, rule))
    missing = [n for n in rules if n not in seen]
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("duplicated", duplicate),
                         ("wrong shape", bad_shape), ("wrong dtype", bad_dtype)):
        if items:
            problems.append(f"{len(items)} {label}: {_listing(items)}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt.path} does not match its config: " + "; ".join(problems))
    return plan, skipped


def _read(ckpt: SafetensorsCheckpoint, name: str, rule: TensorRule, shape: tuple) -> np.ndarray:
    """One stored tensor (or MXFP4 pair) transformed to its parameter (slice) layout."""
    if rule.hook == "mxfp4_packed":
        try:
            return dequantize_mxfp4(ckpt.read(name), ckpt.read(rule.partner)).T
        except ValueError as e:
            raise CheckpointError(f"{ckpt.info(name).file}: tensor '{name}': {e}") from None
    return HOOKS[rule.hook].apply(ckpt.read(name), shape)


def _progress(total_bytes: int, show: bool | None):
    if show is None:
        show = sys.stderr.isatty() and total_bytes > (1 << 28)
    from tqdm.auto import tqdm
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading", disable=not show)


def load_causal_lm(path: str | os.PathLike, dtype="float32", *, kda_impl: str | None = None,
                   mla_impl: str | None = None, moe_impl: str | None = None, attn_res_impl: str | None = None,
                   a_log_policy: str | None = None, progress: bool | None = None, mesh=None) -> CausalLM:
    """Loads `path` (config.json + *.safetensors [+ index]) as a `CausalLM`.

    dtype: "float32" or "bfloat16" for the weights and activations; A_log, dt_bias, conv taps,
    o_norm and the router correction bias always stay fp32.
    kda_impl / mla_impl / moe_impl / attn_res_impl: implementation choices (see the sub-configs).
    a_log_policy: how a K3 A_log longer than the head count is read ("per_head" or "per_channel").
    mesh: place every parameter directly in its sharding (k3jax.sharding rules) as it is read.
    """
    dt = resolve_dtype(dtype)
    impls = dict(kda=kda_impl, mla=mla_impl, moe=moe_impl, attn_res=attn_res_impl)
    if is_k3jax_checkpoint(path):
        return _load_converted(path, dt, impls, a_log_policy, mesh)
    cfg = load_hf_config(path).with_impls(**impls)
    if a_log_policy is not None and cfg.kda is not None:
        cfg = cfg.replace(kda=dataclasses.replace(cfg.kda, a_log_policy=a_log_policy))
    ckpt = SafetensorsCheckpoint(path)
    if cfg.num_mtp_layers and mtp_embedding_name(cfg, cfg.num_mtp_layers) in ckpt.tensors:
        cfg = cfg.replace(mtp_own_embedding=True)
    abstract = nnx.eval_shape(lambda: KimiForCausalLM(cfg, dtype=dt, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    shapes = {p: tuple(v.get_value().shape) for p, v in flat}
    plan, skipped = plan_tensors(cfg, ckpt, shapes)
    if mesh is not None:
        from k3jax.sharding import param_shardings
        shardings = dict(nnx.to_flat_state(param_shardings(state, mesh)))

    def nbytes(name, rule):
        return ckpt.info(name).nbytes + (ckpt.info(rule.partner).nbytes if rule.partner else 0)

    bar = _progress(sum(nbytes(n, r) for entries in plan.values() for n, r in entries), progress)
    loaded, read = [], 0
    for p, var in flat:
        np_dtype = np.dtype(var.get_value().dtype)
        entries = plan[p]
        if entries[0][1].expert is None:
            (name, rule), = entries
            value = _read(ckpt, name, rule, shapes[p]).astype(np_dtype)
        else:
            value = np.empty(shapes[p], np_dtype)
            for name, rule in entries:
                value[rule.expert] = _read(ckpt, name, rule, shapes[p][1:])
        step = sum(nbytes(n, r) for n, r in entries)
        read += step
        bar.update(step)
        value = jax.device_put(value, shardings[p]) if mesh is not None else jnp.asarray(value)
        loaded.append((p, var.replace(value)))
    bar.close()
    module = nnx.merge(graphdef, nnx.from_flat_state(loaded))
    model = CausalLM(module, mesh=mesh)
    model.load_report = LoadReport(tensors=sum(len(v) for v in plan.values()), skipped=skipped, bytes_read=read)
    return model


def _load_converted(path, dt, impls: dict, a_log_policy, mesh) -> CausalLM:
    """A k3jax (Orbax) checkpoint written by `convert`, restored with Orbax into the shardings."""
    manifest = read_manifest(path)
    cfg = from_hf_config(manifest["hf_config"]).with_impls(**impls)
    cfg = cfg.replace(mtp_own_embedding=bool(manifest.get("mtp_own_embedding", False)))
    if a_log_policy is not None and cfg.kda is not None and a_log_policy != cfg.kda.a_log_policy:
        raise CheckpointError(f"{path}: converted with a_log_policy={cfg.kda.a_log_policy!r}; convert again to "
                              f"use {a_log_policy!r}")
    abstract = nnx.eval_shape(lambda: KimiForCausalLM(cfg, dtype=dt, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    if mesh is not None:
        from k3jax.sharding import param_shardings
        shardings = param_shardings(state, mesh)
    else:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda v: device, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    expected = {".".join(str(k) for k in p): list(v.get_value().shape) for p, v in nnx.to_flat_state(state)}
    stored = {name: meta["shape"] for name, meta in manifest["params"].items()}
    if expected != stored:
        diff = sorted(n for n in set(expected) | set(stored) if expected.get(n) != stored.get(n))
        raise CheckpointError(f"{path}: parameters do not match the config: {_listing(diff)}")
    values = restore_params(path, state, shardings)
    loaded = [(p, var.replace(values[p])) for p, var in nnx.to_flat_state(state)]
    model = CausalLM(nnx.merge(graphdef, nnx.from_flat_state(loaded)), mesh=mesh)
    model.load_report = LoadReport(tensors=len(loaded), skipped=int(manifest.get("skipped_tensors", 0)),
                                   bytes_read=0)
    return model
