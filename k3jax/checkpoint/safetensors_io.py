"""safetensors files: a lazy, validating reader for checkpoints (single file or sharded with an
index) and a writer.

Headers are parsed up front (names, dtypes, shapes, byte ranges checked against the file size);
tensor data is read one tensor at a time on request.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}


_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
FLOAT_DTYPES = frozenset(_DTYPES[n] for n in ("F64", "F32", "F16", "BF16"))  # bf16 is not np.floating


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int   # absolute byte offset in the file
    nbytes: int


def read_header(file: str) -> dict[str, TensorInfo]:
    """Parses and validates one safetensors header. Raises CheckpointError naming the file."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file (no header length)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > size - 8 or hlen > 1 << 30:
                raise CheckpointError(f"{file}: corrupt safetensors header (length {hlen} exceeds the file)")
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{file}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt header entry for tensor '{name}'") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(f"{file}: tensor '{name}' has {end - begin} bytes for shape {shape} {meta['dtype']}")
        if data_start + end > size:
            raise CheckpointError(f"{file}: truncated file (tensor '{name}' ends at byte {data_start + end}, "
                                  f"file has {size})")
        out[name] = TensorInfo(name, file, dtype, shape, data_start + begin, nbytes)
    return out


class SafetensorsCheckpoint:
    """All tensors of a checkpoint directory, by name."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a directory")
        self.path = path
        index_file = os.path.join(path, INDEX_NAME)
        if os.path.exists(index_file):
            try:
                with open(index_file) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index_file}: corrupt index (expected a 'weight_map' object)") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
            if missing:
                raise CheckpointError(f"{index_file}: shard file(s) listed in the index are missing: {missing}")
        else:
            weight_map = None
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_NAME}")
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            for name, info in read_header(os.path.join(path, fname)).items():
                if name in self.tensors:
                    raise CheckpointError(f"{info.file}: tensor '{name}' also appears in {self.tensors[name].file}")
                if weight_map is not None and weight_map.get(name) != fname:
                    raise CheckpointError(f"{info.file}: tensor '{name}' is not listed for this file in {INDEX_NAME}")
                self.tensors[name] = info
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.tensors))
            if absent:
                raise CheckpointError(f"{index_file}: tensors listed in the index are missing from their "
                                      f"shards: {absent[:5]}{' ...' if len(absent) > 5 else ''}")

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def read(self, name: str) -> np.ndarray:
        """Reads one tensor from disk as a numpy array of its stored dtype and shape."""
        info = self.tensors[name]
        with open(info.file, "rb") as f:
            f.seek(info.start)
            buf = f.read(info.nbytes)
        if len(buf) != info.nbytes:
            raise CheckpointError(f"{info.file}: truncated while reading tensor '{name}'")
        return np.frombuffer(buf, dtype=info.dtype).reshape(info.shape)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def write_safetensors(file: str | os.PathLike, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes `tensors` (any dtype the reader knows, bf16 included) to `file` atomically."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise ValueError(f"cannot write tensor '{name}' of dtype {arr.dtype} to safetensors")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = f"{os.fspath(file)}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, file)
