"""Hugging Face safetensors (either family) -> k3jax Orbax checkpoint, streaming and resumable.

Tensors are read, transformed (the shared name map and hooks; MXFP4 experts kept packed or
dequantised), checked to be finite and written one file at a time (a tensor, or the experts one file
of a stacked weight holds: `orbax_format.experts_per_file`, at most 64 MiB), so peak memory is a few
times the larger of the largest tensor and one expert file, per worker, whatever the model size.
Work goes to `DST.partial/` (k3jax.checkpoint.workdir: owned, locked against a second conversion,
journalled with a fingerprint of the source); a restarted run of the same source and options (after
a crash or SIGKILL) skips the files the journal lists whole, and the directory is renamed to DST only
when complete and, with `verify`, verified. Source problems (corrupt or truncated files, missing
shards or tensors, wrong shapes or dtypes) are found from the headers before anything is written;
non-finite weights are found while converting and leave nothing behind.
"""

from __future__ import annotations

import argparse
import logging
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from flax import nnx

from k3jax.checkpoint.integrity import NonFiniteError, array_digest, combined_digest
from k3jax.checkpoint.name_map import mtp_embedding_name
from k3jax.checkpoint.orbax_format import (FORMAT, PARAMS_DIR, READ_PIECES, ArrayWriter, array_layout, chunk_shape,
                                           param_name, write_manifest, write_orbax_metadata)
from k3jax.checkpoint.plan import plan_tensors, progress_bar, read_param_slice, stored_nbytes, with_packed_experts
from k3jax.checkpoint.safetensors_io import FLOAT_DTYPES, CheckpointError, SafetensorsCheckpoint, open_regular
from k3jax.checkpoint.verify import verify_checkpoint
from k3jax.checkpoint.workdir import WorkDir
from k3jax.config import COLUMN_LAYOUTS, PACKED_LAYOUTS
from k3jax.hf_config import from_hf_config
from k3jax.model import abstract_model
from k3jax.sharding import split_dims
from pallas_kernels.moe_gmm.hopper_mxfp4_decode import SCALED_MAX_SCALE

logger = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float32", "keep")
COPIED_FILES = ("config.json", "generation_config.json", "tiktoken.model", "tokenizer_config.json",
                "tokenizer.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass
class ConvertReport:
    """tensors written in all (resumed ones included), source tensors skipped, bytes read from the
    source by this run (a resumed run reads only what was left), its seconds, tensors reused."""

    tensors: int
    skipped: int
    bytes_read: int
    seconds: float
    resumed: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / 1e6 / self.seconds if self.seconds > 0 else float("nan")


@dataclass(frozen=True)
class _Source:
    """A validated source directory: its raw config (and that file's SHA-256) and its tensors."""

    path: str
    raw_config: dict
    config_sha256: str
    ckpt: SafetensorsCheckpoint


def _read_source(src: str) -> _Source:
    file = os.path.join(src, "config.json")
    if not os.path.lexists(file):
        raise CheckpointError(f"{src}: no config.json")
    f, _ = open_regular(file)
    with f:
        raw = f.read()
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({str(e).splitlines()[0] if str(e) else 'too deep'})") from None
    for name in COPIED_FILES:  # found before anything is written, not at the end
        if os.path.lexists(os.path.join(src, name)):
            open_regular(os.path.join(src, name))[0].close()
    return _Source(src, config, hashlib.sha256(raw).hexdigest(), SafetensorsCheckpoint(src))


def _identity(source: _Source, pdtype: np.dtype, tensors: int, packed_experts: bool, layout: dict) -> dict:
    """What a resumed run must share with the interrupted one: format, options, the arrays' chunk
    layout, and a fingerprint of the source (per shard: name, size, mtime_ns and the SHA-256 of its
    header)."""
    shards = [{"file": os.path.relpath(s.file, source.path), "size": s.size, "mtime_ns": s.mtime_ns,
               "header_sha256": s.header_sha256} for s in source.ckpt.shards]
    chunks = hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()
    return {"format": FORMAT, "source": os.path.abspath(source.path), "dtype": str(pdtype), "tensors": tensors,
            "packed_experts": packed_experts, "chunks_sha256": chunks, "config_sha256": source.config_sha256,
            "shards": shards}


def _chunk_layout(plan, params, splits) -> dict[str, list]:
    """Parameter name -> [file chunk shape, read chunk shape] of the array `convert` writes for it."""
    layout = {}
    for p, (shape, _) in params.items():
        layout[param_name(p)] = [list(c) for c in array_layout(shape, plan[p][0][1].expert is not None, splits[p],
                                                               np.dtype(params[p][1]).itemsize)]
    return layout


def _param_dtype(choice: str, ckpt: SafetensorsCheckpoint):
    if choice == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    if choice == "float32":
        return np.dtype(np.float32)
    floats = [t.dtype for t in ckpt.tensors.values() if t.dtype in FLOAT_DTYPES]
    return np.dtype(floats[0]) if floats else np.dtype(ml_dtypes.bfloat16)


def _abstract_params(cfg, dtype) -> tuple[dict[tuple, tuple[tuple, np.dtype]], dict[tuple, tuple[int, ...]]]:
    """Parameter path -> (shape, dtype) of the model `cfg` builds in `dtype`, and path -> the
    dimensions a mesh can split (k3jax.sharding.split_dims)."""
    flat = list(nnx.to_flat_state(nnx.state(abstract_model(cfg, dtype))))
    params = {p: (tuple(v.get_value().shape), np.dtype(v.get_value().dtype)) for p, v in flat}
    return params, {p: split_dims(v.get_metadata().get("logical_axes", ())) for p, v in flat}


def _run_all(run, tasks: list, workers: int) -> None:
    """run(task) for every task, on `workers` threads; the first error cancels what has not started."""
    if workers == 1:
        for task in tasks:
            run(task)
        return
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(run, t) for t in tasks]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()


def convert(src, dst, *, dtype: str = "bfloat16", workers: int = 1, verify: bool = False,
            progress: bool | None = None, restart: bool = False, packed_experts: bool | None = None,
            expert_layout: str = "rows") -> ConvertReport:
    """Converts the Hugging Face directory `src` into the k3jax checkpoint `dst` (must not exist).

    MXFP4 routed experts are written packed (uint8 codes and scales, loaded as `packed_experts`)
    unless `packed_experts=False` dequantises them to `dtype`; None = packed when the source is MXFP4.
    `expert_layout` (k3jax.config.PACKED_LAYOUTS) is the packed codes' device layout, fixed by the
    conversion: "rows" for the Pallas-Triton expert kernels, "columns" (the stored orientation, copied
    as it is) for the Mosaic GPU kernel, "handoff" ("columns" with the gate and up columns reordered within each
    32) for the Mosaic GPU kernel with the GLU in its gated launch.

    An interrupted run of the same source and options resumes from `dst.partial`; one of another
    source or other options is refused unless `restart` discards it. Raises CheckpointError (one
    line naming file and tensor) for source problems, leaving no `dst` and no new `dst.partial`.
    """
    src, dst = os.fspath(src), os.fspath(dst).rstrip("/")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be a positive integer, got {workers!r}")
    if os.path.lexists(dst):
        raise FileExistsError(f"{dst} already exists; remove it or choose another destination")
    source = _read_source(src)
    cfg = from_hf_config(source.raw_config)
    ckpt = source.ckpt
    own_embedding = bool(cfg.num_mtp_layers) and mtp_embedding_name(cfg, cfg.num_mtp_layers) in ckpt.tensors
    cfg = cfg.replace(mtp_own_embedding=own_embedding)
    if packed_experts is None:
        packed_experts = cfg.quantization == "mxfp4" and cfg.moe is not None
    if expert_layout not in PACKED_LAYOUTS:
        raise ValueError(f"--expert-layout must be one of {PACKED_LAYOUTS}, got {expert_layout!r}")
    if packed_experts:
        cfg = with_packed_experts(cfg, src)
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, packed_layout=expert_layout))
    elif expert_layout != "rows":
        raise ValueError(f"--expert-layout {expert_layout} needs packed experts: an MXFP4 source converted "
                         "without --dequantize-experts")
    layout_key = {"packed_layout": expert_layout} if expert_layout != "rows" else {}
    # The column layouts' scale check (`_convert_tensors`) is part of what a resumed run must have run on every
    # tensor it reuses: an interrupted run recorded without this key (or with another bound) counts as one with
    # other options. (Other layouts take any scale: their identity is unchanged.)
    scale_layout = expert_layout if packed_experts and expert_layout in COLUMN_LAYOUTS else None
    scale_key = {"scale_max": SCALED_MAX_SCALE} if scale_layout else {}
    pdtype = _param_dtype(dtype, ckpt)
    params, splits = _abstract_params(cfg, pdtype)
    plan, skipped = plan_tensors(cfg, ckpt, {p: s for p, (s, _) in params.items()})
    layout = _chunk_layout(plan, params, splits)

    work = WorkDir(dst)
    work.acquire()
    try:
        if os.path.lexists(dst):  # committed by the run that held the lock before us
            raise FileExistsError(f"{dst} already exists; remove it or choose another destination")
        done = work.resume({**_identity(source, pdtype, sum(len(v) for v in plan.values()), packed_experts, layout),
                            **layout_key, **scale_key}, restart)
    except BaseException:
        work.remove() if work.created else work.release()  # a refused resume keeps everything
        raise
    # tensors reused: those of files the journal lists whole (a file's other tensors are written again)
    files = [(p, group) for p in params for group in _file_groups(plan[p], *params[p])]
    resumed = sum(len(group) for _, group in files if all(name in done for name, _ in group))
    start = time.perf_counter()
    try:
        read = _convert_tensors(ckpt, plan, params, splits, files, work, done, workers, progress, scale_layout)
        _write_metadata(work.path, source, plan, params, done, own_embedding, pdtype, skipped, packed_experts,
                        layout_key)
    except (NonFiniteError, ScaleRangeError):  # the source cannot be converted (as asked): nothing is kept
        work.remove()
        raise
    except BaseException:  # a crash, Ctrl-C, an unreadable file, a full disk: finished tensors are kept
        work.release() if done else work.remove()
        raise
    if verify:
        try:
            verify_checkpoint(work.path, src)  # before the commit: a failed check leaves no DST
        except CheckpointError:
            work.remove()
            raise
        except BaseException:
            work.release()
            raise
    work.commit()
    logger.info("converted %s -> %s: %d tensors (%.1f MB read), %d reused from an interrupted run", src, dst,
                len(done), read / 1e6, resumed)
    return ConvertReport(tensors=len(done), skipped=skipped, bytes_read=read,
                         seconds=time.perf_counter() - start, resumed=resumed)


class ScaleRangeError(CheckpointError):
    """An MXFP4 scale the asked expert layout's kernel does not decode exactly: the conversion keeps nothing."""


def _convert_tensors(ckpt, plan, params, splits, files, work: WorkDir, done: dict, workers: int, progress,
                     scale_layout: str | None = None) -> int:
    """Reads, checks, transforms and writes every file (`files`: (parameter, its tensors in the file), from
    `_file_groups`) holding a tensor `done` lacks, journalling its tensors at once. Returns the bytes
    this call read from the source. `scale_layout`: the packed experts' column layout ("columns" or "handoff"),
    whose Mosaic GPU kernel decodes E8M0 scale bytes up to SCALED_MAX_SCALE only (as the load checks): a scale
    tensor past that is refused as it is read."""
    journal = work.journal()
    lock = threading.Lock()
    writers = {p: ArrayWriter(os.path.join(work.path, PARAMS_DIR), p, shape, dt,
                              stacked=plan[p][0][1].expert is not None, split=splits[p])
               for p, (shape, dt) in params.items()}
    tasks = [(p, group) for p, group in files if any(name not in done for name, _ in group)]
    before = ckpt.bytes_read
    nbytes = lambda name, rule: stored_nbytes(ckpt, name, rule)
    total = sum(nbytes(n, r) for p in params for n, r in plan[p])
    bar = progress_bar(total, "converting", progress)
    bar.update(sum(nbytes(n, r) for p in params for n, r in plan[p] if n in done))

    def read(p, name, rule):
        shape, dt = params[p]
        value = read_param_slice(ckpt, name, rule, shape if rule.expert is None else shape[1:]).astype(dt)
        if not np.isfinite(value).all():
            raise NonFiniteError(f"{ckpt.info(name).file}: tensor {name!r} holds non-finite values (NaN or Inf) "
                                  f"as {dt.name}; refusing to convert it")
        if scale_layout and dt == np.uint8 and str(p[-1]).endswith("_scale") and value.size:
            top = int(value.max())
            if top > SCALED_MAX_SCALE:
                raise ScaleRangeError(f"{ckpt.info(name).file}: tensor {name!r} holds E8M0 scale byte {top}, past "
                                      f"what the expert_layout={scale_layout!r} kernel decodes exactly (bytes up to "
                                      f"{SCALED_MAX_SCALE}, scales up to 2); convert with --dequantize-experts or "
                                      f"--expert-layout rows")
        return value

    def run(task):
        """One file's tensors: a parameter, or the experts one file of a stacked parameter holds
        (`orbax_format.experts_per_file`), read, written in one write and journalled together."""
        p, group = task
        first = group[0][1].expert
        if first is None:
            value = read(p, *group[0])
            digests = [array_digest(value)]
            writers[p].write(None, value)
        else:    # each expert read straight into its place in the file's block
            shape, dt = params[p]
            block = np.empty((len(group),) + tuple(shape[1:]), dt)
            digests = []
            for i, (name, rule) in enumerate(group):
                block[i] = read(p, name, rule)
                digests.append(array_digest(block[i]))
            writers[p].write(slice(first, first + len(group)), block)
            del block
        with lock:
            journal.write("".join(json.dumps({"tensor": name, "sha256": d}) + "\n"
                                  for (name, _), d in zip(group, digests)))
            journal.flush()
            os.fsync(journal.fileno())
            for (name, rule), d in zip(group, digests):
                if name not in done:
                    bar.update(nbytes(name, rule))
                done[name] = d

    try:
        _run_all(run, tasks, workers)
    finally:
        journal.close()
        bar.close()
    return ckpt.bytes_read - before


def _file_groups(entries, shape, dtype) -> list[list]:
    """A parameter's plan entries [(tensor name, rule)] in the groups one file takes: the one tensor of
    an unstacked parameter; the experts of each file of a stacked one, in expert order."""
    if entries[0][1].expert is None:
        if len(entries) != 1:
            raise RuntimeError(f"convert: {len(entries)} source tensors planned for one unstacked parameter")
        return [list(entries)]
    per = chunk_shape(shape, True, np.dtype(dtype).itemsize)[0]
    ordered = sorted(entries, key=lambda e: e[1].expert)
    if [rule.expert for _, rule in ordered] != list(range(shape[0])):   # the plan lists every expert once
        raise RuntimeError(f"convert: the plan of a stacked parameter does not hold experts 0..{shape[0] - 1}")
    return [ordered[i:i + per] for i in range(0, len(ordered), per)]


def _write_metadata(work: str, source: _Source, plan, params, done: dict, own_embedding: bool, pdtype,
                    skipped: int, packed_experts: bool, layout_key: dict) -> None:
    """The manifest, Orbax's metadata files and the copied config / tokenizer files. `layout_key`:
    {"packed_layout": ...} when the packed experts are not in the default "rows" layout."""
    manifest_params = {}
    for p, (shape, dt) in params.items():
        entries = sorted(plan[p], key=lambda e: -1 if e[1].expert is None else e[1].expert)
        manifest_params[param_name(p)] = {"shape": list(shape), "dtype": dt.name,
                                          "sha256": combined_digest([done[n] for n, _ in entries]),
                                          "stacked": entries[0][1].expert is not None}
    write_manifest(work, {"format": FORMAT, "hf_config": source.raw_config, "mtp_own_embedding": own_embedding,
                          "packed_experts": packed_experts, **layout_key, "read_pieces": READ_PIECES,
                          "dtype": pdtype.name, "skipped_tensors": skipped, "source": os.path.abspath(source.path),
                          "params": manifest_params})
    write_orbax_metadata(os.path.join(work, PARAMS_DIR),
                         ((p, shape, chunk_shape(shape, manifest_params[param_name(p)]["stacked"],
                                                 np.dtype(dt).itemsize))
                          for p, (shape, dt) in params.items()))
    for name in COPIED_FILES:
        if os.path.exists(os.path.join(source.path, name)):
            shutil.copy2(os.path.join(source.path, name), os.path.join(work, name))


def main(argv=None, prog: str = "convert") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Convert a Hugging Face Kimi-Linear / K3 checkpoint into a "
                                                       "k3jax (Orbax) checkpoint, streaming and resumable.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n"
                                        f"  {prog} /data/Kimi-Linear-48B-A3B-Instruct /data/kl-k3jax --workers 8\n"
                                        f"  {prog} /data/Kimi-K3 /data/k3-k3jax --dtype keep --verify\n"
                                        "Check an existing converted checkpoint with `k3jax verify DST` "
                                        "(or `python -m convert verify DST`).")
    ap.add_argument("src", help="Hugging Face directory: config.json + *.safetensors [+ index]")
    ap.add_argument("dst", help="output directory (must not exist; a re-run after a crash resumes DST.partial)")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                    help="parameter dtype (keep = the source's; A_log, dt_bias, conv, o_norm, router bias stay fp32)")
    ap.add_argument("--workers", type=int, default=1, help="tensors read/transformed/written in parallel")
    ap.add_argument("--verify", action="store_true",
                    help="before committing DST, re-read and checksum the output and compare a short logits run")
    ap.add_argument("--restart", action="store_true",
                    help="discard an interrupted conversion in DST.partial instead of resuming it")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--dequantize-experts", action="store_true",
                    help="write MXFP4 routed experts dequantised to --dtype (default: kept packed, a quarter of "
                         "bf16's bytes, decoded inside the expert kernels)")
    ap.add_argument("--expert-layout", choices=PACKED_LAYOUTS, default="rows",
                    help="device layout of packed experts: rows (the Pallas-Triton kernels), columns (the "
                         "checkpoint's own orientation, for the Mosaic GPU kernel) or handoff (columns with the gate "
                         "and up columns in the order that kernel's GLU hand-off writes h); fixed by the conversion")
    args = ap.parse_args(argv)
    try:
        report = convert(args.src, args.dst, dtype=args.dtype, workers=args.workers, verify=args.verify,
                         progress=False if args.quiet else None, restart=args.restart,
                         packed_experts=False if args.dequantize_experts else None,
                         expert_layout=args.expert_layout)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    resumed = f", {report.resumed} reused from an interrupted run" if report.resumed else ""
    print(f"converted {report.tensors} tensors ({report.bytes_read / 1e6:.1f} MB read, {report.skipped} skipped"
          f"{resumed}) in {report.seconds:.1f} s ({report.mb_per_s:.0f} MB/s) -> {args.dst}"
          + (" (verified)" if args.verify else ""))
    return 0
