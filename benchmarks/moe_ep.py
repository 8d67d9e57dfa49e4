"""Expert-parallel routed experts over the local GPUs: the all_gather / psum_scatter dispatch against
the ragged_all_to_all one, and one GPU holding every expert (issue 20).

    python benchmarks/moe_ep.py                        # on nvidia-h200-x2 (or more GPUs)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/moe_ep.py --small   # CPU smoke

Kimi-Linear-48B's expert shape (256 experts of 2304 x 1024, top-8), bf16, uniform random routing.
Tokens are split over the expert shards (what the dispatch choice applies to); `tokens` counts all of
them. Each row: ms per call (20 calls chained in one compiled loop), the output's relative error
against one device, and the speed-up of each dispatch over one device.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.common import chained_time, environment, table, write  # noqa: E402
from k3jax.config import ExpertParallel  # noqa: E402
from k3jax.layers.activation import Activation  # noqa: E402
from k3jax.layers.moe_experts import local_experts  # noqa: E402
from k3jax.layers.moe_parallel import expert_parallel  # noqa: E402
from k3jax.sharding import MeshSpec, make_mesh  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tokens", nargs="*", type=int, default=None)
    args = ap.parse_args(argv)
    shards = len(jax.devices())
    e, d, f, k = (16, 64, 32, 4) if args.small else (256, 2304, 1024, 8)
    token_counts = args.tokens or ([2, 64] if args.small else [2, 16, 64, 256, 1024, 8192])
    dtype = jnp.float32 if args.small else jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 3)
    w1, w3 = (jax.random.normal(kk, (e, d, f), jnp.float32).astype(dtype) * 0.02 for kk in keys[:2])
    w2 = (jax.random.normal(keys[2], (e, f, d), jnp.float32) * 0.02).astype(dtype)
    act = Activation("silu")
    mesh = make_mesh(MeshSpec(expert=shards))
    ep = ExpertParallel(expert_shards=shards)
    sharded = [jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (w1, w3, w2)]
    rng = np.random.default_rng(0)
    rows = []
    for tokens in token_counts:
        x = jax.random.normal(jax.random.key(tokens), (tokens, d), jnp.float32).astype(dtype)
        experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]), jnp.int32)
        weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, k)), jnp.float32)
        one = lambda x, wts, exps, a, b, c: local_experts("auto", x, wts, exps, a, b, c, act)
        ref = jax.jit(one)(x, weights, experts, w1, w3, w2)
        row = {"devices": shards, "tokens": tokens,
               "one_device_ms": chained_time(one, (x, weights, experts, w1, w3, w2)) * 1e3}
        for dispatch in ("gather", "ragged"):
            fn = lambda x, wts, exps, a, b, c, dispatch=dispatch: expert_parallel(x, wts, exps, a, b, c, act, ep=ep,
                                                                                 impl="auto", dispatch=dispatch)
            with jax.set_mesh(mesh):
                out = jax.jit(fn)(x, weights, experts, *sharded)
                row[f"{dispatch}_ms"] = chained_time(fn, (x, weights, experts, *sharded)) * 1e3
            a, b = np.asarray(out, np.float64), np.asarray(ref, np.float64)
            row[f"{dispatch}_err"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
            row[f"{dispatch}_speedup"] = row["one_device_ms"] / row[f"{dispatch}_ms"]
        rows.append(row)
        print({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
    record = {"benchmark": "moe_ep", "env": environment(), "shape": {"E": e, "D": d, "F": f, "top_k": k},
              "rows": rows}
    path = write("moe_ep" + ("_small" if args.small else ""), record)
    print(table(rows, ["devices", "tokens", "one_device_ms", "gather_ms", "ragged_ms", "gather_speedup",
                       "ragged_speedup", "gather_err", "ragged_err"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
