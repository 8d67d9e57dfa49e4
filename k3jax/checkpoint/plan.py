"""Matching a safetensors checkpoint to the model's parameters, and reading one parameter (slice)
from it: shared by direct loading (k3jax.checkpoint.loader) and conversion (.convert).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import defaultdict

import numpy as np
from tqdm.auto import tqdm

from k3jax.checkpoint.mxfp4 import dequantize_mxfp4
from k3jax.checkpoint.name_map import TensorRule, is_skipped, tensor_aliases, tensor_rules
from k3jax.checkpoint.safetensors_io import FLOAT_DTYPES, CheckpointError, SafetensorsCheckpoint
from k3jax.checkpoint.transforms import HOOKS
from k3jax.config import ModelConfig

_SHOW = 8


def listing(items: list[str]) -> str:
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
            problems.append(f"{len(items)} {label}: {listing(items)}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt.path} does not match its config: " + "; ".join(problems))
    return plan, skipped


def with_packed_experts(cfg: ModelConfig, path) -> ModelConfig:
    """`cfg` with its routed experts kept packed; CheckpointError unless the checkpoint at `path`
    stores them as MXFP4."""
    if cfg.quantization != "mxfp4" or cfg.moe is None:
        raise CheckpointError(f"{path}: packed experts need routed experts stored as MXFP4; this checkpoint's "
                              f"quantization is {cfg.quantization or 'none'}")
    return cfg.replace(moe=dataclasses.replace(cfg.moe, packed_experts=True))


def box_shape(box: tuple[slice, ...], shape: tuple) -> tuple[int, ...]:
    """The shape of `box` (one slice per axis) of an array of `shape`."""
    return tuple(len(range(*b.indices(n))) for b, n in zip(box, shape))


def read_param_slice(ckpt: SafetensorsCheckpoint, name: str, rule: TensorRule, shape: tuple,
                     box: tuple[slice, ...] | None = None) -> np.ndarray:
    """One stored tensor (or MXFP4 pair) transformed to its parameter (slice) layout, of `shape`.

    box: only this box of the result (one step-1 slice per axis), reading only the stored bytes
    that make it up where the tensor's hook can say which (everything but A_log per head and
    dequantised MXFP4, which are read whole and cut)."""
    hook = HOOKS[rule.hook]
    if box is not None and hook.region is not None:
        part = box_shape(box, shape)
        return hook.apply(ckpt.read(name, hook.region(box, ckpt.info(name).shape)), part)
    if rule.hook == "mxfp4_packed":
        try:
            value = dequantize_mxfp4(ckpt.read(name), ckpt.read(rule.partner)).T
        except ValueError as e:
            raise CheckpointError(f"{ckpt.info(name).file}: tensor '{name}': {e}") from None
    else:
        value = hook.apply(ckpt.read(name), shape)
    return value if box is None else value[box]


def stored_nbytes(ckpt: SafetensorsCheckpoint, name: str, rule: TensorRule, shape: tuple | None = None,
                  box: tuple[slice, ...] | None = None) -> int:
    """Bytes read for one planned tensor (an MXFP4 packed tensor together with its scales), or for
    the `box` of its parameter `shape` (read_param_slice)."""
    info = ckpt.info(name)
    if box is not None and HOOKS[rule.hook].region is not None:
        return math.prod(box_shape(box, shape)) * info.dtype.itemsize
    return info.nbytes + (ckpt.info(rule.partner).nbytes if rule.partner else 0)


def progress_bar(total_bytes: int, desc: str, show: bool | None, *, min_bytes: int = 0):
    """A byte-counting tqdm bar; by default shown only on a terminal and for at least `min_bytes`."""
    if show is None:
        show = sys.stderr.isatty() and total_bytes >= min_bytes
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=not show)
