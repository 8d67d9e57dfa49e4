"""Verifies a converted k3jax checkpoint as a whole: the manifest against its checksum, then every
array re-read (tensorstore checks each chunk's crc32c) and compared with the SHA-256 the converter
recorded, its shape with the manifest's and its values for NaN / Inf; optionally a short logits run
against the Hugging Face source. `k3jax verify DST` and `python -m convert verify DST` run it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import tensorstore as ts

from k3jax.checkpoint.integrity import array_digest, combined_digest
from k3jax.checkpoint.loader import load_causal_lm
from k3jax.checkpoint.orbax_format import array_spec, read_failure, read_manifest
from k3jax.checkpoint.plan import listing
from k3jax.checkpoint.safetensors_io import CheckpointError
from k3jax.errors import ConfigError


@dataclass(frozen=True)
class VerifyReport:
    parameters: int
    bytes: int
    seconds: float


def _check_array(path: str, name: str, meta: dict) -> tuple[str | None, int]:
    """(problem or None, bytes read) for one stored parameter array."""
    try:
        arr = ts.open(array_spec(path, name)).result()
        if list(arr.shape) != meta["shape"]:
            return f"{name} (shape {list(arr.shape)}, the manifest says {meta['shape']})", 0
        slices = [arr[e].read().result() for e in range(arr.shape[0])] if meta["stacked"] else [arr.read().result()]
    except Exception as e:  # tensorstore reports damaged or missing data with several types
        return f"{name} ({read_failure(e)})", 0
    nbytes = sum(s.nbytes for s in slices)
    if combined_digest([array_digest(s) for s in slices]) != meta["sha256"]:
        return f"{name} (does not match its recorded sha256)", nbytes
    if not all(np.isfinite(s).all() for s in slices):
        return f"{name} (non-finite values)", nbytes
    return None, nbytes


def verify_checkpoint(dst, src=None, *, prompt_len: int = 8) -> VerifyReport:
    """Re-reads every array of the converted checkpoint `dst` and checks it against its recorded
    checksum; with `src`, also compares a short logits run of the source (loaded directly) and
    `dst`. Raises CheckpointError naming every parameter that fails (one line)."""
    dst = os.fspath(dst)
    start = time.perf_counter()
    manifest = read_manifest(dst)
    problems, total = [], 0
    for name, meta in manifest["params"].items():
        problem, nbytes = _check_array(dst, name, meta)
        total += nbytes
        if problem:
            problems.append(problem)
    if problems:
        raise CheckpointError(f"checkpoint {dst}: {len(problems)} parameter(s) failed verification: "
                              f"{listing(problems)}")
    if src is not None:
        direct = load_causal_lm(src, dtype=manifest["dtype"] if manifest["dtype"] in ("bfloat16", "float32")
                                else "float32")
        converted = load_causal_lm(dst, dtype=direct.dtype.name)
        ids = np.random.default_rng(0).integers(0, direct.config.vocab_size, (1, prompt_len))
        a, b = np.asarray(direct.logits(ids)), np.asarray(converted.logits(ids))
        if not np.array_equal(a, b):
            raise CheckpointError(f"{dst}: logits differ from the source (max abs diff {np.abs(a - b).max():.3g})")
    return VerifyReport(len(manifest["params"]), total, time.perf_counter() - start)


def verify_main(argv=None, prog: str = "k3jax verify") -> int:
    """The `verify` command: exit status 0 when the checkpoint is intact, 1 (one line on stderr) if not."""
    ap = argparse.ArgumentParser(prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=f"examples:\n  {prog} /data/kl-k3jax\n"
                                        f"  {prog} /data/kl-k3jax --source /data/Kimi-Linear-48B-A3B-Instruct",
                                 description="Verify a converted k3jax checkpoint: the manifest checksum, "
                                 "and every array re-read (crc32c per chunk) against its recorded SHA-256.")
    ap.add_argument("dst", help="a checkpoint directory written by `k3jax convert`")
    ap.add_argument("--source", help="also compare a short logits run with this Hugging Face directory")
    args = ap.parse_args(argv)
    try:
        report = verify_checkpoint(args.dst, args.source)
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.dst}: OK, {report.parameters} parameters ({report.bytes / 1e6:.1f} MB) match their checksums"
          + (", logits match the source" if args.source else "") + f" ({report.seconds:.1f} s)")
    return 0
