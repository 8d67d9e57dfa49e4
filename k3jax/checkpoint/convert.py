"""Hugging Face safetensors (either family) -> k3jax Orbax checkpoint, streaming and resumable.

Tensors are read, transformed (the shared name map and hooks, MXFP4 dequantised) and written one
at a time, so peak memory is about the largest tensor times the number of workers, whatever the
model size. Work goes to `DST.partial/`; each finished tensor is journalled, a restarted run
(after a crash or SIGKILL) skips what the journal lists, and the directory is renamed to DST only
when complete. Source problems (corrupt or truncated files, missing shards or tensors, wrong shapes
or dtypes) are found from the headers before anything is written.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
import tensorstore as ts
from flax import nnx

from k3jax.checkpoint.loader import load_causal_lm
from k3jax.checkpoint.name_map import mtp_embedding_name
from k3jax.checkpoint.orbax_format import (FORMAT, MANIFEST, PARAMS_DIR, ArrayWriter, chunk_shape, param_name,
                                           read_manifest, write_orbax_metadata)
from k3jax.checkpoint.plan import plan_tensors, progress_bar, read_param_slice, stored_nbytes
from k3jax.checkpoint.safetensors_io import FLOAT_DTYPES, CheckpointError, SafetensorsCheckpoint
from k3jax.hf_config import from_hf_config
from k3jax.model import abstract_model

DTYPES = ("bfloat16", "float32", "keep")
COPIED_FILES = ("config.json", "generation_config.json", "tiktoken.model", "tokenizer_config.json",
                "tokenizer.json", "special_tokens_map.json", "chat_template.jinja")
JOURNAL = "progress.jsonl"


@dataclass
class ConvertReport:
    tensors: int
    skipped: int
    bytes_read: int
    seconds: float
    resumed: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / 1e6 / self.seconds if self.seconds > 0 else float("nan")


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _source_config(src: str) -> dict:
    file = os.path.join(src, "config.json")
    if not os.path.exists(file):
        raise CheckpointError(f"{src}: no config.json")
    try:
        return _read_json(file)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def _param_dtype(choice: str, ckpt: SafetensorsCheckpoint):
    if choice == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    if choice == "float32":
        return np.dtype(np.float32)
    floats = [t.dtype for t in ckpt.tensors.values() if t.dtype in FLOAT_DTYPES]
    return np.dtype(floats[0]) if floats else np.dtype(ml_dtypes.bfloat16)


def _abstract_params(cfg, dtype) -> dict[tuple, tuple[tuple, np.dtype]]:
    """Parameter path -> (shape, dtype) of the model `cfg` builds in `dtype`."""
    return {p: (tuple(v.get_value().shape), np.dtype(v.get_value().dtype))
            for p, v in nnx.to_flat_state(nnx.state(abstract_model(cfg, dtype)))}


def _digest(value: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()


def _combined(digests: list[str]) -> str:
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def convert(src, dst, *, dtype: str = "bfloat16", workers: int = 1, verify: bool = False,
            progress: bool | None = None) -> ConvertReport:
    """Converts the Hugging Face directory `src` into the k3jax checkpoint `dst` (must not exist)."""
    src, dst = os.fspath(src), os.fspath(dst).rstrip("/")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be a positive integer, got {workers!r}")
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} already exists; remove it or choose another destination")
    raw_config = _source_config(src)
    cfg = from_hf_config(raw_config)
    ckpt = SafetensorsCheckpoint(src)
    own_embedding = bool(cfg.num_mtp_layers) and mtp_embedding_name(cfg, cfg.num_mtp_layers) in ckpt.tensors
    cfg = cfg.replace(mtp_own_embedding=own_embedding)
    pdtype = _param_dtype(dtype, ckpt)
    params = _abstract_params(cfg, pdtype)
    plan, skipped = plan_tensors(cfg, ckpt, {p: s for p, (s, _) in params.items()})

    work = dst + ".partial"
    identity = {"format": FORMAT, "source": os.path.abspath(src), "dtype": str(pdtype),
                "source_bytes": ckpt.total_bytes, "tensors": sum(len(v) for v in plan.values())}
    done = _resume_journal(work, identity)
    os.makedirs(os.path.join(work, PARAMS_DIR), exist_ok=True)
    journal = open(os.path.join(work, JOURNAL), "a")
    if not done:
        journal.write(json.dumps({"identity": identity}) + "\n")
        journal.flush()
    lock = threading.Lock()

    writers = {p: ArrayWriter(os.path.join(work, PARAMS_DIR), p, shape, dt, stacked=plan[p][0][1].expert is not None)
               for p, (shape, dt) in params.items()}
    tasks = [(p, name, rule) for p in params for name, rule in plan[p] if name not in done]
    nbytes = lambda name, rule: stored_nbytes(ckpt, name, rule)
    total = sum(nbytes(n, r) for p in params for n, r in plan[p])
    bar = progress_bar(total, "converting", progress)
    bar.update(sum(nbytes(n, r) for p in params for n, r in plan[p] if n in done))
    start = time.perf_counter()

    def run(task):
        p, name, rule = task
        shape, dt = params[p]
        if rule.expert is None:
            value = read_param_slice(ckpt, name, rule, shape).astype(dt)
            writers[p].write(None, value)
        else:
            value = read_param_slice(ckpt, name, rule, shape[1:]).astype(dt)
            writers[p].write(rule.expert, value)
        digest = _digest(value)
        with lock:
            journal.write(json.dumps({"tensor": name, "sha256": digest}) + "\n")
            journal.flush()
            os.fsync(journal.fileno())
            done[name] = digest
            bar.update(nbytes(name, rule))

    try:
        if workers == 1:
            for task in tasks:
                run(task)
        else:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                for future in [pool.submit(run, t) for t in tasks]:
                    future.result()
    finally:
        journal.close()
        bar.close()

    manifest_params = {}
    for p, (shape, dt) in params.items():
        entries = sorted(plan[p], key=lambda e: -1 if e[1].expert is None else e[1].expert)
        manifest_params[param_name(p)] = {"shape": list(shape), "dtype": dt.name,
                                          "sha256": _combined([done[n] for n, _ in entries]),
                                          "stacked": entries[0][1].expert is not None}
    manifest = {"format": FORMAT, "hf_config": raw_config, "mtp_own_embedding": own_embedding,
                "dtype": pdtype.name, "skipped_tensors": skipped, "source": os.path.abspath(src),
                "params": manifest_params}
    with open(os.path.join(work, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    write_orbax_metadata(os.path.join(work, PARAMS_DIR),
                         ((p, shape, chunk_shape(shape, manifest_params[param_name(p)]["stacked"]))
                          for p, (shape, _) in params.items()))
    for name in COPIED_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(work, name))
    os.remove(os.path.join(work, JOURNAL))
    os.rename(work, dst)  # the commit: DST appears complete or not at all
    report = ConvertReport(tensors=len(done), skipped=skipped, bytes_read=total,
                           seconds=time.perf_counter() - start, resumed=len(done) - len(tasks))
    if verify:
        verify_checkpoint(dst, src)
    return report


def _resume_journal(work: str, identity: dict) -> dict[str, str]:
    """Finished tensors of an interrupted run of the same conversion (else starts over)."""
    journal = os.path.join(work, JOURNAL)
    if not os.path.exists(journal):
        shutil.rmtree(work, ignore_errors=True)
        return {}
    done, ok = {}, False
    with open(journal) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by the kill: everything after it is redone
            if "identity" in entry:
                ok = entry["identity"] == identity
            elif ok and "tensor" in entry:
                done[entry["tensor"]] = entry["sha256"]
    if not ok:
        shutil.rmtree(work, ignore_errors=True)
        return {}
    return done


def verify_checkpoint(dst, src=None, *, prompt_len: int = 8) -> None:
    """Re-reads every array and checks its checksum; with `src`, also compares a short logits run
    of the source (loaded directly) and the converted checkpoint. Raises CheckpointError."""
    dst = os.fspath(dst)
    manifest = read_manifest(dst)
    for name, meta in manifest["params"].items():
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                      "path": os.path.join(dst, PARAMS_DIR, name)}}).result()
        if list(arr.shape) != meta["shape"]:
            raise CheckpointError(f"{dst}: parameter {name} has shape {list(arr.shape)}, manifest says {meta['shape']}")
        if meta["stacked"]:
            digests = [_digest(arr[e].read().result()) for e in range(arr.shape[0])]
        else:
            digests = [_digest(arr.read().result())]
        if _combined(digests) != meta["sha256"]:
            raise CheckpointError(f"{dst}: parameter {name} does not match its checksum")
    if src is not None:
        direct = load_causal_lm(src, dtype=manifest["dtype"] if manifest["dtype"] in ("bfloat16", "float32")
                                else "float32")
        converted = load_causal_lm(dst, dtype=direct.dtype.name)
        ids = np.random.default_rng(0).integers(0, direct.config.vocab_size, (1, prompt_len))
        a, b = np.asarray(direct.logits(ids)), np.asarray(converted.logits(ids))
        if not np.array_equal(a, b):
            raise CheckpointError(f"{dst}: logits differ from the source (max abs diff {np.abs(a - b).max():.3g})")


def main(argv=None, prog: str = "convert") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Convert a Hugging Face Kimi-Linear / K3 checkpoint into a "
                                                       "k3jax (Orbax) checkpoint, streaming and resumable.")
    ap.add_argument("src", help="Hugging Face directory: config.json + *.safetensors [+ index]")
    ap.add_argument("dst", help="output directory (must not exist; a re-run after a crash resumes DST.partial)")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                    help="parameter dtype (keep = the source's; A_log, dt_bias, conv, o_norm, router bias stay fp32)")
    ap.add_argument("--workers", type=int, default=1, help="tensors read/transformed/written in parallel")
    ap.add_argument("--verify", action="store_true", help="re-read and checksum the output, compare a short logits run")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        report = convert(args.src, args.dst, dtype=args.dtype, workers=args.workers, verify=args.verify,
                         progress=False if args.quiet else None)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    resumed = f", {report.resumed} reused from an interrupted run" if report.resumed else ""
    print(f"converted {report.tensors} tensors ({report.bytes_read / 1e6:.1f} MB, {report.skipped} skipped{resumed}) "
          f"in {report.seconds:.1f} s ({report.mb_per_s:.0f} MB/s) -> {args.dst}" + (" (verified)" if args.verify else ""))
    return 0
