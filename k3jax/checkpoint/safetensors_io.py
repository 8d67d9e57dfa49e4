"""safetensors files: a lazy, validating reader for checkpoints (single file or sharded with an
index) and a writer.

Headers are parsed up front (names, dtypes, shapes, byte ranges checked against the file size);
tensor data is read one tensor at a time on request.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import stat
import struct
import threading
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


_MAX_BYTES = 1 << 62  # no array (nor numpy) holds more
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
FLOAT_DTYPES = frozenset(_DTYPES[n] for n in ("F64", "F32", "F16", "BF16"))  # bf16 is not np.floating


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and tensor."""


@dataclass(frozen=True)
class ShardInfo:
    """What identifies one safetensors file's content cheaply: its size, modification time and the
    SHA-256 of its header (length prefix and JSON)."""

    file: str
    size: int
    mtime_ns: int
    header_sha256: str


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int   # absolute byte offset in the file
    nbytes: int


def open_regular(file: str):
    """Opens `file` for binary reading if it is a regular file (or a link to one). Never blocks: a
    FIFO or device named like a checkpoint file is refused. Returns (file object, os.stat_result)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{file}: not a regular file")
    return os.fdopen(fd, "rb"), st


def _parse_json(raw: bytes):
    """json.loads that reports any malformed input (bad UTF-8, too deeply nested) as ValueError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _is_size(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _tensor_info(file: str, name: str, meta, data_start: int, size: int) -> TensorInfo:
    """One header entry, validated: a known dtype, non-negative integer dims, a byte range of
    exactly the tensor's size that lies inside the file."""
    if not isinstance(meta, dict) or not isinstance(meta.get("shape"), list) \
            or not isinstance(meta.get("data_offsets"), list) or len(meta["data_offsets"]) != 2 \
            or not all(_is_size(x) for x in meta["shape"] + meta["data_offsets"]) \
            or not isinstance(meta.get("dtype"), str) or meta["dtype"] not in _DTYPES \
            or math.prod(max(d, 1) for d in meta["shape"]) * _DTYPES[meta["dtype"]].itemsize >= _MAX_BYTES:
        raise CheckpointError(f"{file}: corrupt header entry for tensor {name!r}")
    dtype, shape = _DTYPES[meta["dtype"]], tuple(meta["shape"])
    begin, end = meta["data_offsets"]
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointError(f"{file}: tensor {name!r} has {end - begin} bytes for shape {shape} {meta['dtype']}")
    if data_start + end > size:
        raise CheckpointError(f"{file}: truncated file (tensor {name!r} ends at byte {data_start + end}, "
                              f"file has {size})")
    return TensorInfo(name, file, dtype, shape, data_start + begin, nbytes)


def read_shard(file: str) -> tuple[ShardInfo, dict[str, TensorInfo]]:
    """Parses and validates one safetensors header. Raises CheckpointError naming the file."""
    f, st = open_regular(file)
    try:
        with f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file (no header length)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > st.st_size - 8 or hlen > 1 << 30:
                raise CheckpointError(f"{file}: corrupt safetensors header (length {hlen} exceeds the file)")
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None
    try:
        header = _parse_json(raw)
    except ValueError:
        raise CheckpointError(f"{file}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    shard = ShardInfo(file, st.st_size, st.st_mtime_ns, hashlib.sha256(head + raw).hexdigest())
    tensors = {name: _tensor_info(file, name, meta, 8 + hlen, st.st_size)
               for name, meta in header.items() if name != "__metadata__"}
    return shard, tensors


def _box(info: TensorInfo, region) -> list[tuple[int, int]]:
    """`region` (None: the whole tensor) as [(start, stop)] per axis; ValueError unless it is one
    step-1 slice per axis."""
    if region is None:
        return [(0, n) for n in info.shape]
    if len(region) != len(info.shape) or any(not isinstance(r, slice) or r.step not in (None, 1) for r in region):
        raise ValueError(f"tensor {info.name!r} {list(info.shape)}: region {region} is not one step-1 slice per axis")
    box = [r.indices(n)[:2] for r, n in zip(region, info.shape)]
    return [(start, max(start, stop)) for start, stop in box]


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fills `view` from `fd` at `offset` (one read can return less, at most about 2 GB on Linux);
    returns the bytes read, short only at the end of the file."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def read_header(file: str) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its validated header."""
    return read_shard(file)[1]


def _shard_file(root: str, index_file: str, name) -> str:
    """The path of a shard the index names: a relative path that stays inside the checkpoint
    directory (symlinks placed in the directory, as the Hugging Face cache uses, are followed)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{index_file}: invalid shard name {name!r} in 'weight_map'")
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        raise CheckpointError(f"{index_file}: invalid shard name {name!r} in 'weight_map'") from None
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm.split(os.sep)[0] in (os.curdir, os.pardir):
        raise CheckpointError(f"{index_file}: shard {name!r} is outside the checkpoint directory")
    return os.path.join(root, norm)


def read_index(path: str) -> dict[str, str]:
    """The `weight_map` of `path`'s index (tensor name -> shard file path). Raises CheckpointError."""
    index_file = os.path.join(path, INDEX_NAME)
    f, _ = open_regular(index_file)
    try:
        with f:
            index = _parse_json(f.read())
    except (OSError, ValueError):
        raise CheckpointError(f"{index_file}: corrupt index (not valid JSON)") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file}: corrupt index (expected a 'weight_map' object)")
    return {tensor: _shard_file(path, index_file, name) for tensor, name in weight_map.items()}


class SafetensorsCheckpoint:
    """All tensors of a checkpoint directory, by name; only regular files inside it are read."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a directory")
        self.path = path
        index_file = os.path.join(path, INDEX_NAME)
        if os.path.lexists(index_file):
            weight_map = read_index(path)
            files = sorted(set(weight_map.values()))
            missing = [os.path.relpath(f, path) for f in files if not os.path.exists(f)]
            if missing:
                raise CheckpointError(f"{index_file}: shard file(s) listed in the index are missing: {missing}")
        else:
            weight_map = None
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_NAME}")
        self.tensors: dict[str, TensorInfo] = {}
        shards = []
        for file in files:
            shard, tensors = read_shard(file)
            shards.append(shard)
            for name, info in tensors.items():
                if name in self.tensors:
                    raise CheckpointError(f"{info.file}: tensor {name!r} also appears in {self.tensors[name].file}")
                if weight_map is not None and weight_map.get(name) != file:
                    raise CheckpointError(f"{info.file}: tensor {name!r} is not listed for this file in {INDEX_NAME}")
                self.tensors[name] = info
        self.shards: tuple[ShardInfo, ...] = tuple(shards)
        self.bytes_read = 0   # tensor bytes read so far by `read` (from any thread)
        self._count_lock = threading.Lock()
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.tensors))
            if absent:
                raise CheckpointError(f"{index_file}: tensors listed in the index are missing from their "
                                      f"shards: {absent[:5]}{' ...' if len(absent) > 5 else ''}")

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> np.ndarray:
        """Reads one tensor, or the box `region` of it (one step-1 slice per axis), from disk as a
        numpy array of its stored dtype. Only the box's bytes are read: one read per contiguous run
        (a row of the box where it splits the last axes, one read when it splits only the first).
        Every byte read is added to `bytes_read`."""
        info = self.tensors[name]
        box = _box(info, region)
        out_shape = tuple(stop - start for start, stop in box)
        if 0 in out_shape:
            return np.empty(out_shape, info.dtype)
        # Runs: the last axis the box cuts, with every axis after it whole.
        cut = max((i for i, (start, stop) in enumerate(box) if (start, stop) != (0, info.shape[i])), default=-1)
        run_bytes = math.prod(out_shape[max(cut, 0):]) * info.dtype.itemsize
        strides = [math.prod(info.shape[i + 1:]) * info.dtype.itemsize for i in range(len(info.shape))]
        lead = [range(start, stop) for start, stop in box[:max(cut, 0)]]
        base = info.start + (box[cut][0] * strides[cut] if cut >= 0 else 0)
        out = bytearray(math.prod(out_shape) * info.dtype.itemsize)
        f, _ = open_regular(info.file)
        with f:
            for n, index in enumerate(itertools.product(*lead)):
                offset = base + sum(i * s for i, s in zip(index, strides))
                got = _pread_into(f.fileno(), memoryview(out)[n * run_bytes:(n + 1) * run_bytes], offset)
                if got != run_bytes:
                    raise CheckpointError(f"{info.file}: truncated while reading tensor {name!r}")
                with self._count_lock:
                    self.bytes_read += got
        return np.frombuffer(out, dtype=info.dtype).reshape(out_shape)

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
