"""Two calls of the chunked KDA prefill and nothing else: the program that `ncu` profiles
(gpu_session step `kda-ncu`; the full benchmark, with torch and the profiler in its process, crashed
under ncu).

    python3 benchmarks/kda_prefill_once.py --heads 32 [--tokens 8192]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.kda import ChunkBlocks, kda_chunk_pallas  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    b, t, h, d = 1, args.tokens, args.heads, args.dim
    keys = jax.random.split(jax.random.key(0), 5)
    unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    q = unit(jax.random.normal(keys[0], (b, t, h, d))).astype(jnp.bfloat16)
    k = unit(jax.random.normal(keys[1], (b, t, h, d))).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, h, d), jnp.bfloat16)
    g = -jax.random.uniform(keys[3], (b, t, h, d), jnp.float32, 0.01, 0.5)
    beta = jax.random.uniform(keys[4], (b, t, h), jnp.float32, 0.1, 0.9)
    call = jax.jit(lambda *a: kda_chunk_pallas(*a, blocks=ChunkBlocks()))
    for _ in range(2):
        o, s = jax.block_until_ready(call(q, k, v, g, beta))
    print(f"B={b} T={t} H={h}: o {o.shape} finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}, "
          f"state {s.shape}")


if __name__ == "__main__":
    main()
