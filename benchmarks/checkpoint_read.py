"""Cost of the read-time checks: restoring a converted checkpoint with the crc32c chunk check and the
non-finite check on vs off.

    python benchmarks/checkpoint_read.py                 # about 4 GB (GPU machine, under 2 minutes)
    python benchmarks/checkpoint_read.py --size-gb 0.2   # CPU smoke run

Writes a random Kimi-Linear-shaped Hugging Face checkpoint (bf16, `tiny_kimi_linear` with hidden
1024 and as many 1024x1024 experts as the size asks; safetensors written directly, so no model is
built in memory), converts it with `k3jax.checkpoint.convert`, and copies the result once with
the crc32c codec removed from every array (the same data, re-encoded by tensorstore). Then it
times `load_causal_lm` (Orbax restore onto the default device plus, when on, the non-finite
reduction) for four variants: both checks (the default), crc32c only, non-finite only, neither.
The non-finite check is switched by `load_causal_lm`'s private `_check_finite` keyword, which
exists for this script only. Files are read from a warm page cache, so the numbers are the
decode / checksum / transfer cost, not the disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import environment, table, write  # noqa: E402
from k3jax.checkpoint.convert import convert  # noqa: E402
from k3jax.checkpoint.loader import load_causal_lm  # noqa: E402
from k3jax.checkpoint.name_map import tensor_rules  # noqa: E402
from k3jax.checkpoint.orbax_format import PARAMS_DIR, array_spec  # noqa: E402
from k3jax.checkpoint.safetensors_io import INDEX_NAME, write_safetensors  # noqa: E402
from k3jax.checkpoint.transforms import HOOKS  # noqa: E402
from k3jax.config import tiny_kimi_linear  # noqa: E402
from k3jax.hf_config import to_hf_config  # noqa: E402
from k3jax.model import abstract_model  # noqa: E402

HIDDEN = EXPERT_SIZE = 1024
SHARD_BYTES = 1 << 30
VARIANTS = [("crc32c + non-finite (default)", True, True), ("crc32c only", True, False),
            ("non-finite only", False, True), ("neither", False, False)]


def config_for(size_gb: float):
    """A Kimi-Linear-shaped config of about `size_gb` GB in bf16 (3 MoE layers of 1024x1024 experts)."""
    per_expert = 3 * 3 * HIDDEN * EXPERT_SIZE * 2  # 3 MoE layers x (w1, w2, w3), bf16
    experts = max(8, round(size_gb * 1e9 / per_expert))
    return tiny_kimi_linear(hidden=HIDDEN, num_experts=experts, expert_intermediate_size=EXPERT_SIZE)


def stored_shapes(cfg) -> dict[str, tuple]:
    """Every Hugging Face tensor name of `cfg` -> its stored shape."""
    params = {p: tuple(v.get_value().shape) for p, v in nnx.to_flat_state(nnx.state(abstract_model(cfg, np.float32)))}
    return {name: tuple(HOOKS[rule.hook].expected(params[rule.path][1:] if rule.expert is not None
                                                  else params[rule.path]))
            for name, rule in tensor_rules(cfg).items()}


def write_source(path: str, cfg, seed: int = 0) -> int:
    """Writes `cfg` as a sharded bf16 safetensors checkpoint of random weights; returns its bytes.
    Tensors are slices of one random pool at random offsets (or the pool repeated, for a tensor
    larger than it): cheap to make, incompressible."""
    rng = np.random.default_rng(seed)
    pool = (0.02 * rng.standard_normal(1 << 25, dtype=np.float32)).astype(ml_dtypes.bfloat16)
    os.makedirs(path)
    shard, weight_map, total, files = {}, {}, 0, 0

    def flush():
        nonlocal shard, files
        files += 1
        name = f"model-{files:05d}.safetensors"
        write_safetensors(os.path.join(path, name), shard)
        weight_map.update({n: name for n in shard})
        shard = {}

    for name, shape in stored_shapes(cfg).items():
        n = int(np.prod(shape))
        if n <= pool.size:
            start = int(rng.integers(0, pool.size - n + 1))
            shard[name] = pool[start:start + n].reshape(shape)
        else:   # larger than the pool (a real vocabulary's embedding): the pool repeated
            shard[name] = np.resize(pool, n).reshape(shape)
        total += n * 2
        if sum(t.nbytes for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg), f)
    return total


def copy_without_crc32c(src: str, dst: str) -> None:
    """A copy of a converted checkpoint whose arrays carry no crc32c codec (the 'off' variant)."""
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if os.path.isfile(
        os.path.join(d, n, "zarr.json"))] if os.path.basename(d) == PARAMS_DIR else [])
    for name in sorted(os.listdir(os.path.join(src, PARAMS_DIR))):
        zarr_json = os.path.join(src, PARAMS_DIR, name, "zarr.json")
        if not os.path.isfile(zarr_json):
            continue
        with open(zarr_json) as f:
            metadata = json.load(f)
        sharding = metadata["codecs"][0]["configuration"]
        sharding["codecs"] = [c for c in sharding["codecs"] if c["name"] != "crc32c"]
        source = ts.open(array_spec(src, name)).result()
        target = ts.open({**array_spec(dst, name), "metadata": metadata, "store_data_equal_to_fill_value": True},
                         create=True).result()
        target.write(source).result()


def timed_load(path: str, check_finite: bool) -> float:
    start = time.perf_counter()
    model = load_causal_lm(path, dtype="bfloat16", _check_finite=check_finite)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model.module)))
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=4.0, help="source checkpoint size (bf16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed loads per variant (after one warm-up load)")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="conversion workers")
    ap.add_argument("--tmp", default=None, help="directory for the checkpoints (default: the system temp dir)")
    args = ap.parse_args(argv)
    cfg = config_for(args.size_gb)
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        src, dst, plain = (os.path.join(tmp, n) for n in ("src", "converted", "no_crc32c"))
        t = time.perf_counter()
        size = write_source(src, cfg)
        write_s = time.perf_counter() - t
        report = convert(src, dst, dtype="bfloat16", workers=args.workers, progress=False)
        t = time.perf_counter()
        copy_without_crc32c(dst, plain)
        copy_s = time.perf_counter() - t
        print(f"source {size / 1e9:.2f} GB ({cfg.moe.num_experts} experts of {HIDDEN}x{EXPERT_SIZE}) written in "
              f"{write_s:.1f} s; converted in {report.seconds:.1f} s ({report.mb_per_s:.0f} MB/s, "
              f"{args.workers} workers); crc32c-free copy in {copy_s:.1f} s", flush=True)
        timed_load(dst, True)  # warm-up: compiles the model's abstract shapes and the non-finite check
        times = {label: [] for label, _, _ in VARIANTS}
        for _ in range(args.repeats):  # interleaved, so drift affects every variant alike
            for label, crc, finite in VARIANTS:
                times[label].append(timed_load(dst if crc else plain, finite))
    base = statistics.median(times["neither"])
    rows = []
    for label, crc, finite in VARIANTS:
        median = statistics.median(times[label])
        rows.append({"variant": label, "crc32c": crc, "non_finite_check": finite, "median_s": median,
                     "GB_per_s": size / 1e9 / median, "overhead_pct": 100 * (median / base - 1),
                     "times_s": times[label]})
    columns = ["variant", "median_s", "GB_per_s", "overhead_pct"]
    print(table(rows, columns))
    record = {"benchmark": "checkpoint_read", "env": environment(), "size_bytes": size,
              "experts": cfg.moe.num_experts, "repeats": args.repeats, "convert_s": report.seconds, "rows": rows}
    print(f"wrote {write('checkpoint_read', record)} ({time.perf_counter() - begin:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
