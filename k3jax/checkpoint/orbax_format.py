"""The k3jax checkpoint: an Orbax PyTree checkpoint (zarr3 arrays, no OCDBT) written slice by
slice, plus a manifest.

    DST/k3jax.json      format, the model's Hugging Face config, dtypes, per-parameter SHA-256,
                        and a SHA-256 of all of that (checked on every load)
    DST/params/         an Orbax checkpoint of the parameter tree ('model.layers.0....kernel')
    DST/config.json, tokenizer files copied from the source

Orbax's own savers need each array whole in memory; a K3 layer's stacked experts are 20 GB, so
the arrays are written here with tensorstore in exactly the layout Orbax writes (zarr3,
sharding_indexed + zstd chunks, `_METADATA`, `array_metadatas`, `_CHECKPOINT_METADATA`), each
expert its own inner chunk (up to 16 experts to a file), and Orbax restores them, directly into any
sharding. Inside each array's file the dimensions a mesh can split (tensor parallel) are stored in
up to 16 inner chunks, so a process restoring a tensor-parallel slice reads that slice's chunks, not
the whole array. Every chunk ends in a crc32c of its compressed bytes (zarr v3's crc32c codec), which
tensorstore checks on every read, so a damaged array fails its restore instead of loading garbage
(format 2; format 1 had none).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from typing import Iterable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import nnx

from k3jax.checkpoint.safetensors_io import CheckpointError

FORMAT = "k3jax-orbax/2"
OLD_FORMATS = ("k3jax-orbax/1",)
MANIFEST = "k3jax.json"
PARAMS_DIR = "params"
CHECKSUM_KEY = "manifest_sha256"
_ARRAY_DIR = re.compile("/" + PARAMS_DIR + "/([^/\"']+)")  # a parameter's directory in tensorstore's messages
# Manifest key -> JSON type; the manifest is refused unless all are present with these types.
_MANIFEST_KEYS = {"format": str, "hf_config": dict, "mtp_own_embedding": bool, "dtype": str, "skipped_tensors": int,
                  "params": dict, CHECKSUM_KEY: str}
_PARAM_KEYS = {"shape": list, "dtype": str, "sha256": str, "stacked": bool}


def param_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _zarr_metadata(shape, dtype: np.dtype, chunk, inner) -> dict:
    return {
        "chunk_grid": {"configuration": {"chunk_shape": list(chunk)}, "name": "regular"},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"configuration": {
            "chunk_shape": list(inner),
            "codecs": [{"configuration": {"endian": "little"}, "name": "bytes"},
                       {"configuration": {"checksum": False, "level": 3}, "name": "zstd"},
                       {"name": "crc32c"}],
            "index_codecs": [{"configuration": {"endian": "little"}, "name": "bytes"}, {"name": "crc32c"}]},
            "name": "sharding_indexed"}],
        "data_type": np.dtype(dtype).name, "fill_value": 0.0, "node_type": "array",
        "shape": list(shape), "zarr_format": 3,
    }


# Stacked expert weights: up to this many experts share a file (each its own inner chunk), within
# FILE_BYTES a file (an expert larger than that has a file to itself): a K3 conversion with packed
# experts writes ~52K files instead of ~500K with one per expert and array; a converter task reads and
# writes one file's experts together (its memory per worker).
EXPERTS_PER_FILE = 16
FILE_BYTES = 64 << 20


def experts_per_file(num_experts: int, expert_bytes: int) -> int:
    """The experts one file holds: the largest divisor of `num_experts` up to EXPERTS_PER_FILE whose
    experts (`expert_bytes` each) fit FILE_BYTES; at least one."""
    fits = lambda d: d == 1 or d * expert_bytes <= FILE_BYTES
    return max(d for d in range(1, min(num_experts, EXPERTS_PER_FILE) + 1) if num_experts % d == 0 and fits(d))


def chunk_shape(shape: tuple, stacked: bool, itemsize: int) -> tuple:
    """The chunk one file holds: `experts_per_file` experts of a stacked expert weight (elements of
    `itemsize` bytes), or the whole array."""
    if not stacked:
        return tuple(shape)
    return (experts_per_file(shape[0], math.prod(shape[1:]) * itemsize),) + tuple(shape[1:])


READ_PIECES = 16   # a power of two: a tensor-parallel degree dividing it reads exactly its own bytes


def read_chunk_shape(shape: tuple, stacked: bool, split: tuple[int, ...] = ()) -> tuple:
    """The unit a read fetches (zarr3's inner chunk inside each file): one expert of a stacked weight,
    and each dimension in `split` (dimensions a mesh can split, other than the expert axis) cut into
    the most pieces, up to READ_PIECES, a power of two that divides it."""
    inner = [1, *shape[1:]] if stacked else list(shape)
    for d in split:
        if not (stacked and d == 0):
            inner[d] //= math.gcd(shape[d], READ_PIECES)
    return tuple(inner)


def array_layout(shape: tuple, stacked: bool, split: tuple[int, ...], itemsize: int) -> tuple[tuple, tuple]:
    """(file chunk shape, read chunk shape) of the array `ArrayWriter` writes for a parameter."""
    return chunk_shape(shape, stacked, itemsize), read_chunk_shape(shape, stacked, split)


class ArrayWriter:
    """Creates (or reopens, when resuming) one parameter's zarr3 array and writes slices of it.
    split: the dimensions a mesh can split (k3jax.sharding.split_dims), stored as read pieces."""

    def __init__(self, params_dir: str, path: tuple, shape: tuple, dtype: np.dtype, stacked: bool,
                 split: tuple[int, ...] = ()):
        self.name = param_name(path)
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.chunk, inner = array_layout(self.shape, stacked, split, self.dtype.itemsize)
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(params_dir, self.name)},
                "metadata": _zarr_metadata(self.shape, self.dtype, self.chunk, inner),
                "store_data_equal_to_fill_value": True}  # as Orbax writes: every chunk exists on disk
        self.array = ts.open(spec, create=True, open=True).result()

    def write(self, index, value: np.ndarray) -> None:
        """Writes `value` at `index` (None: the whole array) and waits for it. The caller leaves
        `value` unchanged until this returns, so tensorstore encodes it without a copy of its own."""
        target = self.array[index] if index is not None else self.array
        source = np.ascontiguousarray(value, dtype=self.dtype)
        target.write(source, can_reference_source_data_indefinitely=True).result()


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


def _manifest_checksum(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON, without the checksum itself."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(path, manifest: dict) -> None:
    """Writes `path/k3jax.json` with its checksum added."""
    with open(os.path.join(os.fspath(path), MANIFEST), "w") as f:
        json.dump({**manifest, CHECKSUM_KEY: _manifest_checksum(manifest)}, f, indent=1)


def _is(value, kind: type) -> bool:
    """isinstance for JSON values, where a bool is not an int."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _check_manifest_types(file: str, manifest) -> None:
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file}: corrupt k3jax manifest (not a JSON object)")
    fmt = manifest.get("format")
    if fmt in OLD_FORMATS:
        raise CheckpointError(f"{file}: written by an older k3jax (format {fmt}, without chunk checksums); "
                              f"convert the source again")
    if fmt is not None and fmt != FORMAT:
        raise CheckpointError(f"{file}: unknown checkpoint format {fmt!r} (expected {FORMAT})")
    for key, kind in _MANIFEST_KEYS.items():
        if key not in manifest:
            raise CheckpointError(f"{file}: corrupt k3jax manifest (key {key!r} is missing)")
        if not _is(manifest[key], kind):
            raise CheckpointError(f"{file}: corrupt k3jax manifest (key {key!r} is not a {kind.__name__})")
    for name, meta in manifest["params"].items():
        if not isinstance(meta, dict) or any(not _is(meta.get(k), t) for k, t in _PARAM_KEYS.items()) \
                or not all(_is(d, int) and d >= 0 for d in meta["shape"]):
            raise CheckpointError(f"{file}: corrupt k3jax manifest (entry of parameter {name} is malformed)")


def read_manifest(path) -> dict:
    """The manifest of a k3jax checkpoint, its keys, types and checksum checked. Raises CheckpointError."""
    file = os.path.join(os.fspath(path), MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{file}: cannot read the k3jax manifest ({e})") from None
    _check_manifest_types(file, manifest)
    if manifest[CHECKSUM_KEY] != _manifest_checksum(manifest):
        raise CheckpointError(f"{file}: the manifest does not match its checksum (the config or parameter table "
                              f"was edited or is damaged)")
    return manifest


def array_spec(path, name: str) -> dict:
    """The tensorstore spec of one stored parameter array."""
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(os.fspath(path), PARAMS_DIR, name)}}


def _causes(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def read_failure(error: BaseException) -> str:
    """What went wrong in a failed tensorstore / Orbax read, in a few words."""
    chain = list(_causes(error))
    if any("Digest mismatch" in str(e) for e in chain):
        return "damaged: crc32c checksum mismatch in its chunk data"
    zstd = next((str(e) for e in chain if "ZSTD_decompressStream() failed" in str(e)), None)
    if zstd is not None:    # a zstd frame broken before the chunk's checksum was reached
        reason = zstd.split("ZSTD_decompressStream() failed:", 1)[1].split(";")[0].strip()
        return f"damaged: its compressed chunk data is corrupt (zstd: {reason})"
    detail = next((str(e) for e in reversed(chain) if str(e)), type(error).__name__).splitlines()[0]
    return f"cannot be read: {detail[:300]}"


def array_error(path, error: BaseException, names) -> CheckpointError:
    """One line for a failed restore: the parameter (found in the error's chain of causes, which
    holds tensorstore's file path) and what went wrong."""
    text = " ".join(str(e) for e in _causes(error))
    found = [m for m in _ARRAY_DIR.findall(text) if m in names]
    what = f"parameter {found[0]}" if found else "a parameter"
    return CheckpointError(f"checkpoint {os.fspath(path)}: {what} {read_failure(error)}")


def file_bytes_read() -> int:
    """Bytes tensorstore's file driver has read in this process so far (its own metric: array
    metadata, chunk indices and chunks, as stored; every thread's reads, so a difference around
    one restore also counts any other tensorstore file reads running at the same time)."""
    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v["value"] for metric in found for v in metric["values"])


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
    try:
        restored = ocp.PyTreeCheckpointer().restore(os.path.join(os.fspath(path), PARAMS_DIR),
                                                    args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
    except Exception as e:  # tensorstore and Orbax raise many types; all mean the stored data is unreadable
        raise array_error(path, e, {param_name(p) for p, _ in flat}) from None
    out = {}
    for p, _ in flat:
        node = restored
        for k in p:
            node = node[str(k)]
        out[p] = node
    return out
