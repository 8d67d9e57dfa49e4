"""The k3jax checkpoint: an Orbax PyTree checkpoint (zarr3 arrays, no OCDBT) written slice by
slice, plus a manifest.

    DST/k3jax.json      format, the model's Hugging Face config, dtypes, per-parameter checksums
    DST/params/         an Orbax checkpoint of the parameter tree ('model.layers.0....kernel')
    DST/config.json, tokenizer files copied from the source

Orbax's own savers need each array whole in memory; a K3 layer's stacked experts are 20 GB, so
the arrays are written here with tensorstore in exactly the layout Orbax writes (zarr3,
sharding_indexed + zstd chunks, `_METADATA`, `array_metadatas`, `_CHECKPOINT_METADATA`), one chunk
per expert, and Orbax restores them, directly into any sharding.
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import nnx

from k3jax.checkpoint.safetensors_io import CheckpointError

FORMAT = "k3jax-orbax/1"
MANIFEST = "k3jax.json"
PARAMS_DIR = "params"


def param_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _zarr_metadata(shape, dtype: np.dtype, chunk) -> dict:
    return {
        "chunk_grid": {"configuration": {"chunk_shape": list(chunk)}, "name": "regular"},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"configuration": {
            "chunk_shape": list(chunk),
            "codecs": [{"configuration": {"endian": "little"}, "name": "bytes"},
                       {"configuration": {"checksum": False, "level": 3}, "name": "zstd"}],
            "index_codecs": [{"configuration": {"endian": "little"}, "name": "bytes"}, {"name": "crc32c"}]},
            "name": "sharding_indexed"}],
        "data_type": np.dtype(dtype).name, "fill_value": 0.0, "node_type": "array",
        "shape": list(shape), "zarr_format": 3,
    }


def chunk_shape(shape: tuple, stacked: bool) -> tuple:
    """One chunk per expert for stacked expert weights, one chunk for everything else."""
    return (1,) + tuple(shape[1:]) if stacked else tuple(shape)


class ArrayWriter:
    """Creates (or reopens, when resuming) one parameter's zarr3 array and writes slices of it."""

    def __init__(self, params_dir: str, path: tuple, shape: tuple, dtype: np.dtype, stacked: bool):
        self.name = param_name(path)
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.chunk = chunk_shape(shape, stacked)
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(params_dir, self.name)},
                "metadata": _zarr_metadata(self.shape, self.dtype, self.chunk),
                "store_data_equal_to_fill_value": True}  # as Orbax writes: every chunk exists on disk
        self.array = ts.open(spec, create=True, open=True).result()

    def write(self, index, value: np.ndarray) -> None:
        target = self.array[index] if index is not None else self.array
        target.write(np.ascontiguousarray(value, dtype=self.dtype)).result()


def write_orbax_metadata(params_dir: str, arrays: Iterable[tuple[tuple, tuple, tuple]]) -> None:
    """The Orbax metadata files for arrays given as (path, shape, chunk)."""
    arrays = list(arrays)
    tree, metas = {}, []
    for path, shape, chunk in arrays:
        keys = [str(p) for p in path]
        tree[str(tuple(keys))] = {"key_metadata": [{"key": k, "key_type": 2} for k in keys],
                                  "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                                     "write_shape": list(shape)}}
        metas.append({"array_metadata": {"param_name": param_name(path), "write_shape": list(shape),
                                         "chunk_shape": list(chunk), "ext_metadata": None}})
    with open(os.path.join(params_dir, "_METADATA"), "w") as f:
        json.dump({"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": True,
                   "store_array_data_equal_to_fill_value": True, "custom_metadata": None}, f)
    os.makedirs(os.path.join(params_dir, "array_metadatas"), exist_ok=True)
    with open(os.path.join(params_dir, "array_metadatas", "process_0"), "w") as f:
        json.dump({"array_metadatas": metas}, f)
    now = time.time_ns()
    with open(os.path.join(params_dir, "_CHECKPOINT_METADATA"), "w") as f:
        json.dump({"item_handlers": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
                   "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now,
                   "commit_timestamp_nsecs": now, "custom_metadata": {}}, f)
    with open(os.path.join(params_dir, "commit_success.txt"), "w") as f:
        f.write(f"Checkpoint commit was successful to {params_dir}")


def is_k3jax_checkpoint(path) -> bool:
    return os.path.exists(os.path.join(os.fspath(path), MANIFEST))


def read_manifest(path) -> dict:
    file = os.path.join(os.fspath(path), MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read the k3jax manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: unknown checkpoint format {manifest.get('format')!r} (expected {FORMAT})")
    return manifest


def restore_params(path, abstract_params, shardings):
    """Restores the parameter tree with Orbax, each array straight into its sharding.

    abstract_params: nnx State of ShapeDtypeStruct leaves; shardings: matching tree of Shardings.
    Returns {path tuple: jax.Array}.
    """
    flat = list(nnx.to_flat_state(abstract_params))
    flat_shardings = dict(nnx.to_flat_state(shardings))
    item, restore_args = {}, {}
    for p, var in flat:
        value = var.get_value()
        node, args_node = item, restore_args
        keys = [str(k) for k in p]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            args_node = args_node.setdefault(k, {})
        node[keys[-1]] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=flat_shardings[p])
        args_node[keys[-1]] = ocp.ArrayRestoreArgs(sharding=flat_shardings[p], global_shape=value.shape,
                                                   dtype=value.dtype)
    restored = ocp.PyTreeCheckpointer().restore(os.path.join(os.fspath(path), PARAMS_DIR),
                                                args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
    out = {}
    for p, _ in flat:
        node = restored
        for k in p:
            node = node[str(k)]
        out[p] = node
    return out
