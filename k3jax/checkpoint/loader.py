"""Loads a Hugging Face Kimi checkpoint directory into a `CausalLM`, tensor by tensor.

All names, shapes and dtypes are checked against the model config from the headers alone; any
mismatch raises one `CheckpointError` listing every missing, unexpected and mis-shaped tensor.
Parameters are then filled one at a time (stacked experts included; MXFP4 experts dequantised or,
with packed_experts, kept packed), so host memory holds at most one parameter beyond what is already
on the device. Both paths (Hugging Face and converted) end with one reduction per parameter on the
device that refuses NaN or Inf weights, naming the tensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.causal_lm import CausalLM, LoadReport, resolve_dtype
from k3jax.checkpoint.integrity import expert_label, nonfinite, raise_nonfinite
from k3jax.checkpoint.name_map import mtp_embedding_name
from k3jax.checkpoint.orbax_format import (file_bytes_read, is_k3jax_checkpoint, param_name, read_manifest,
                                           restore_params)
from k3jax.checkpoint.plan import (listing, plan_tensors, progress_bar, read_param_slice, stored_nbytes,
                                   with_packed_experts)
from k3jax.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint
from k3jax.config import COLUMN_LAYOUTS
from k3jax.hf_config import from_hf_config, load_hf_config
from k3jax.memory_plan import check_weights_fit, device_capacity, mesh_spec_of
from k3jax.model import abstract_model
from k3jax.sharding import Placement, param_shardings
from pallas_kernels.moe_gmm.hopper_mxfp4_decode import SCALED_MAX_SCALE

logger = logging.getLogger(__name__)

# What dtype="auto" keeps; any other declared or stored dtype (float16, float8, ...) loads as float32.
_AUTO_DTYPES = ("bfloat16", "float32")


def _declared_dtype(path) -> str | None:
    """config.json's `dtype` / `torch_dtype` (top level or text_config), None when absent or unreadable."""
    try:
        with open(os.path.join(os.fspath(path), "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    for cfg in (raw, raw.get("text_config") if isinstance(raw, dict) else None):
        if isinstance(cfg, dict):
            for key in ("dtype", "torch_dtype"):
                if isinstance(cfg.get(key), str):
                    return cfg[key]
    return None


def checkpoint_dtype(path: str | os.PathLike) -> str:
    """What dtype="auto" loads a checkpoint in: a converted checkpoint's stored dtype; a Hugging Face
    checkpoint's declared dtype (config.json), else the floating dtype holding most of its stored
    bytes. bfloat16 and float32 are kept; anything else loads as float32."""
    if is_k3jax_checkpoint(path):
        found = read_manifest(path)["dtype"]
    else:
        found = _declared_dtype(path)
        if found is None:
            by_dtype: dict[str, int] = {}
            for info in SafetensorsCheckpoint(path).tensors.values():
                if np.issubdtype(info.dtype, np.floating) or info.dtype.name == "bfloat16":
                    by_dtype[info.dtype.name] = by_dtype.get(info.dtype.name, 0) + info.nbytes
            found = max(by_dtype, key=by_dtype.get) if by_dtype else None
    return found if found in _AUTO_DTYPES else "float32"


def _refuse_a_mesh_without_this_process(mesh) -> None:
    """A ValueError when `mesh` holds none of this process's devices (such a process has nothing to load)."""
    if mesh is not None and not any(d.process_index == jax.process_index() for d in mesh.devices.flat):
        raise ValueError(f"the mesh holds none of process {jax.process_index()}'s devices; only the processes "
                         f"whose devices it holds load onto it")


def _warn_of_whole_reads(path, manifest: dict, mesh) -> None:
    """A warning when a converted checkpoint written before read pieces loads onto a mesh spanning
    several processes (each then reads tensor-parallel arrays whole)."""
    if Placement(mesh).spans_processes and "read_pieces" not in manifest:
        logger.warning("%s was converted before arrays were stored in read pieces: every process reads whole "
                       "tensor-parallel arrays (convert it again to read only each process's share)", path)


def _refuse_what_cannot_fit(cfg, dtype, mesh) -> None:
    """Before any tensor is read: a ValueError with the numbers when the weights alone exceed one
    device of the mesh (or the default device); nothing is checked where the memory is unknown."""
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    check_weights_fit(cfg, mesh_spec_of(mesh), dtype, device_capacity(device))


def load_causal_lm(path: str | os.PathLike, dtype="auto", *, a_log_policy: str | None = None,
                   progress: bool | None = None, mesh=None, packed_experts: bool = False, _check_finite: bool = True,
                   **impls) -> CausalLM:
    """Loads a checkpoint directory as a `CausalLM`: Hugging Face (config.json + *.safetensors
    [+ index]) tensor by tensor, or a k3jax (Orbax) checkpoint written by `k3jax convert`.

    Args:
      dtype: "auto" (the checkpoint's own, `checkpoint_dtype`: bf16 for the released models),
        "float32" or "bfloat16" for the weights and activations; A_log, dt_bias, conv taps, o_norm
        and the router correction bias always stay fp32.
      a_log_policy: how a K3 A_log longer than the head count is read ("per_head" or "per_channel").
      progress: show a progress bar (default: on a terminal, for checkpoints over 256 MB).
      mesh: place every parameter directly in its sharding (k3jax.sharding rules) as it is read.
      packed_experts: keep a Hugging Face MXFP4 checkpoint's routed experts packed on the device
        (uint8 codes and scales, a quarter of bf16's bytes, decoded inside the expert kernels) instead
        of dequantising them to `dtype`. A converted checkpoint loads as it was written (`convert`
        keeps MXFP4 experts packed unless told to dequantise them).
      **impls: implementation choices by option name (kda=, kda_decode=, mla=, moe=, gmm=,
        attn_res=, ...), as in `ModelConfig.with_impls`; expert_layout= ("rows", "columns" or "handoff",
        k3jax.config.PACKED_LAYOUTS) places packed experts' codes for their kernel (a converted checkpoint keeps
        the layout it was converted with).
      _check_finite: private, for benchmarks/checkpoint_read.py only: False skips the check that
        refuses NaN / Inf weights.

    Raises CheckpointError (one line naming the file, tensor or parameter) for anything the
    checkpoint holds that does not match the config, cannot be read, fails a checksum, or is not
    finite; ConfigError for a bad config; ValueError for a mesh whose weights cannot fit its devices
    or that holds none of this process's devices.
    """
    _refuse_a_mesh_without_this_process(mesh)
    auto = isinstance(dtype, str) and dtype == "auto"
    dt = None if auto else resolve_dtype(dtype)
    if is_k3jax_checkpoint(path):
        if packed_experts and not read_manifest(path).get("packed_experts", False):
            raise CheckpointError(f"{path}: packed_experts=True, but this converted checkpoint holds its experts "
                                  "dequantised (convert the MXFP4 source again without --dequantize-experts)")
        dt = resolve_dtype(checkpoint_dtype(path)) if auto else dt
        return _load_converted(path, dt, impls, a_log_policy, mesh, _check_finite)
    cfg = load_hf_config(path)   # a directory without config.json fails here first
    if packed_experts:
        cfg = with_packed_experts(cfg, path)
    cfg = cfg.with_impls(**impls)
    dt = resolve_dtype(checkpoint_dtype(path)) if auto else dt
    _refuse_what_cannot_fit(cfg, dt, mesh)
    if a_log_policy is not None and cfg.kda is not None:
        cfg = cfg.replace(kda=dataclasses.replace(cfg.kda, a_log_policy=a_log_policy))
    ckpt = SafetensorsCheckpoint(path)
    if cfg.num_mtp_layers and mtp_embedding_name(cfg, cfg.num_mtp_layers) in ckpt.tensors:
        cfg = cfg.replace(mtp_own_embedding=True)
    graphdef, state = nnx.split(abstract_model(cfg, dt))
    flat = list(nnx.to_flat_state(state))
    shapes = {p: tuple(v.get_value().shape) for p, v in flat}
    plan, skipped = plan_tensors(cfg, ckpt, shapes)
    shardings = dict(nnx.to_flat_state(param_shardings(state, mesh))) if mesh is not None else None

    # Over several processes each reads only what its devices hold: stacked experts by expert, other
    # parameters split over the mesh (tensor parallel) by the box of their local shards.
    wanted, boxes = {}, {}
    for p, entries in plan.items():
        stacked = entries[0][1].expert is not None
        keep = None if mesh is None or not stacked else local_rows(shardings[p], shapes[p])
        wanted[p] = [(n, r) for n, r in entries if keep is None or r.expert in keep]
        boxes[p] = None if mesh is None or stacked else local_box(shardings[p], shapes[p])
    bar = progress_bar(sum(stored_nbytes(ckpt, n, r, shapes[p], boxes[p]) for p, entries in wanted.items()
                           for n, r in entries), "loading", progress, min_bytes=1 << 28)
    loaded = []
    for p, var in flat:
        np_dtype = np.dtype(var.get_value().dtype)
        entries = wanted[p]
        before = ckpt.bytes_read
        if plan[p][0][1].expert is None:
            (name, rule), = entries
            value = read_param_slice(ckpt, name, rule, shapes[p], boxes[p]).astype(np_dtype)
            value = jnp.asarray(value) if mesh is None else place_box(value, boxes[p], shapes[p], shardings[p])
        else:
            experts = {rule.expert: read_param_slice(ckpt, name, rule, shapes[p][1:]).astype(np_dtype)
                       for name, rule in entries}
            value = stack_experts(experts, shapes[p], np_dtype, None if mesh is None else shardings[p])
        bar.update(ckpt.bytes_read - before)
        loaded.append((p, var.replace(value)))
    read = ckpt.bytes_read
    bar.close()
    if _check_finite:
        _check_hf_finite(ckpt, plan, {p: v.get_value() for p, v in loaded})
    _refuse_scales_past_the_decode(f"checkpoint {path}", cfg, {p: v.get_value() for p, v in loaded},
                                   "load with packed_experts=False or expert_layout='rows'")
    report = LoadReport(tensors=sum(len(v) for v in wanted.values()), skipped=skipped, bytes_read=read)
    logger.info("loaded %s: %d tensors (%.1f MB, %d skipped) as %s", path, report.tensors, read / 1e6, skipped,
                cfg.model_type)
    return CausalLM(nnx.merge(graphdef, nnx.from_flat_state(loaded)), mesh=mesh, load_report=report)


def local_rows(sharding, shape: tuple) -> set[int]:
    """Indices along the leading (expert) axis held by this process's devices under `sharding`."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])))
    return rows


def local_box(sharding, shape: tuple) -> tuple[slice, ...] | None:
    """The smallest box (a slice per axis) holding every shard of `shape` this process's devices
    hold under `sharding` (typically exactly those shards: with `make_mesh`'s process-major device
    order, when a process's devices fill the mesh's trailing axes); None when that is the whole array."""
    indices = [tuple(i.indices(n)[:2] for i, n in zip(index, shape))
               for index in sharding.addressable_devices_indices_map(shape).values()]
    box = tuple((min(ix[a][0] for ix in indices), max(ix[a][1] for ix in indices)) for a in range(len(shape)))
    return None if box == tuple((0, n) for n in shape) else tuple(slice(*b) for b in box)


def place_box(value: np.ndarray, box: tuple[slice, ...] | None, shape: tuple, sharding) -> jax.Array:
    """The global array of `shape` in `sharding` from `value`, this process's `box` of it (None: all).
    Each local device takes its shard from `value`. (`jax.device_put` of a host array onto a sharding
    spanning several processes first asserts that every process holds the same value, gathering it
    across processes: a 3.3 GB load over two took 37 s instead of 8 s, benchmarks/RESULTS.md.)"""
    starts = [0] * len(shape) if box is None else [b.start for b in box]

    def shard(index):
        return value[tuple(slice(i.indices(n)[0] - s, i.indices(n)[1] - s) for i, n, s in zip(index, shape, starts))]

    return jax.make_array_from_callback(shape, sharding, shard)


def stack_experts(experts: dict[int, np.ndarray], shape: tuple, dtype, sharding) -> jax.Array:
    """A stacked [E, ...] parameter from the experts read here (all of them without a sharding;
    with one, at least those this process's devices hold), placed in `sharding`."""
    if sharding is None:
        return jnp.asarray(np.stack([experts[e] for e in range(shape[0])]).astype(dtype))

    def shard(index):
        rows = range(*index[0].indices(shape[0]))
        return np.stack([experts[e] for e in rows]).astype(dtype)[(slice(None),) + tuple(index[1:])]

    return jax.make_array_from_callback(shape, sharding, shard)


def _refuse_scales_past_the_decode(where: str, cfg, values: dict, advice: str) -> None:
    """Refuses packed routed experts in the column layouts (`expert_layout` "columns" or "handoff": the Mosaic GPU
    kernel's) holding an E8M0 scale byte past SCALED_MAX_SCALE in a uint8 `*_scale` parameter: that kernel's
    compiled decode folds each scale into one bf16 multiply, exact for scales up to 2 (weights up to 12 in
    magnitude; real checkpoints' scales lie far below), inf or NaN past them. The "rows" layout's kernels take any
    scale. One reduction a parameter, on the devices that hold it; `advice`: the way out the message names."""
    if cfg.moe is None or not cfg.moe.packed_experts or cfg.moe.packed_layout not in COLUMN_LAYOUTS:
        return
    found = []
    for p, v in values.items():
        if v.dtype != jnp.uint8 or not str(p[-1]).endswith("_scale"):
            continue
        top = int(np.asarray(jnp.max(v).addressable_data(0)))     # replicated: every process holds the value
        if top > SCALED_MAX_SCALE:
            found.append(f"{param_name(p)} (byte {top})")
    if found:
        raise CheckpointError(f"{where}: packed expert scales past what the expert_layout="
                              f"{cfg.moe.packed_layout!r} kernel decodes exactly (E8M0 bytes up to {SCALED_MAX_SCALE}, "
                              f"scales up to 2) in {listing(found)}; {advice}")


def _check_hf_finite(ckpt: SafetensorsCheckpoint, plan: dict, values: dict) -> None:
    """Refuses NaN / Inf in loaded parameters, naming the stored tensors they came from."""
    stacked = {p for p, entries in plan.items() if entries[0][1].expert is not None}
    names = []
    for p, experts in nonfinite(values, stacked).items():
        stored = {rule.expert: name for name, rule in plan[p]}
        names += [stored[e] for e in experts] if experts else [stored[None]]
    raise_nonfinite(f"checkpoint {ckpt.path}", names)


def _load_converted(path, dt, impls: dict, a_log_policy, mesh, check_finite: bool) -> CausalLM:
    """A k3jax (Orbax) checkpoint written by `convert`, restored with Orbax into the shardings."""
    manifest = read_manifest(path)
    cfg = from_hf_config(manifest["hf_config"])
    cfg = cfg.replace(mtp_own_embedding=bool(manifest.get("mtp_own_embedding", False)))
    _warn_of_whole_reads(path, manifest, mesh)
    if manifest.get("packed_experts", False):   # what the checkpoint holds: MXFP4 experts, kept packed
        cfg = with_packed_experts(cfg, path)
        layout = manifest.get("packed_layout", "rows")
        if impls.get("expert_layout") not in (None, layout):
            raise CheckpointError(f"{path}: converted with expert_layout={layout!r}; convert again with "
                                  f"--expert-layout {impls['expert_layout']} to use it")
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, packed_layout=layout))
    cfg = cfg.with_impls(**impls)
    if a_log_policy is not None and cfg.kda is not None and a_log_policy != cfg.kda.a_log_policy:
        raise CheckpointError(f"{path}: converted with a_log_policy={cfg.kda.a_log_policy!r}; convert again to "
                              f"use {a_log_policy!r}")
    _refuse_what_cannot_fit(cfg, dt, mesh)
    graphdef, state = nnx.split(abstract_model(cfg, dt))
    if mesh is not None:
        shardings = param_shardings(state, mesh)
    else:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda v: device, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    expected = {".".join(str(k) for k in p): list(v.get_value().shape) for p, v in nnx.to_flat_state(state)}
    stored = {name: meta["shape"] for name, meta in manifest["params"].items()}
    if expected != stored:
        diff = sorted(n for n in set(expected) | set(stored) if expected.get(n) != stored.get(n))
        raise CheckpointError(f"{path}: parameters do not match the config: {listing(diff)}")
    before = file_bytes_read()
    values = restore_params(path, state, shardings)
    read = file_bytes_read() - before
    if check_finite:
        stacked = {p for p in values if manifest["params"][param_name(p)]["stacked"]}
        bad = nonfinite(values, stacked)
        raise_nonfinite(f"checkpoint {path}", [param_name(p) + expert_label(e) for p, e in bad.items()])
    _refuse_scales_past_the_decode(f"checkpoint {path}", cfg, values,
                                   "convert again with --dequantize-experts or --expert-layout rows")
    loaded = [(p, var.replace(values[p])) for p, var in nnx.to_flat_state(state)]
    report = LoadReport(tensors=len(loaded), skipped=int(manifest.get("skipped_tensors", 0)), bytes_read=read)
    logger.info("restored %s: %d parameters (k3jax checkpoint)", path, report.tensors)
    return CausalLM(nnx.merge(graphdef, nnx.from_flat_state(loaded)), mesh=mesh, load_report=report)
