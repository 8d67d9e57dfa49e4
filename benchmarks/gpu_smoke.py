"""Compiles every Pallas kernel on the GPU at small and model shapes and checks it against its
reference twin (the CPU tests run them in interpret mode only)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.kda import (KDADecodeInputs, KDADecodeWeights, kda_chunk_pallas, kda_decode_pallas,  # noqa: E402
                                kda_decode_xla, kda_recurrent_reference)
from pallas_kernels.mla_decode import mla_decode_pallas, mla_decode_reference  # noqa: E402


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    print("devices:", jax.devices(), flush=True)
    failures = 0
    rng = np.random.default_rng(0)
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    for (b, t, h, kd, lo) in [(1, 200, 2, 128, -1.0), (2, 64, 4, 64, -30.0), (1, 1000, 32, 128, -1.0)]:
        try:
            q, k = (l2(rng.standard_normal((b, t, h, kd))).astype(np.float32) for _ in range(2))
            v = rng.standard_normal((b, t, h, kd)).astype(np.float32)
            g = rng.uniform(lo, 0, (b, t, h, kd)).astype(np.float32)
            beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
            s0 = rng.standard_normal((b, h, kd, kd)).astype(np.float32)
            o, s = kda_chunk_pallas(q, k, v, g, beta, initial_state=s0)
            o_r, s_r = jax.jit(kda_recurrent_reference)(q, k, v, g, beta, initial_state=s0)
            print(f"kda_chunk b{b} t{t} h{h} k{kd}: err o {rel(o, o_r):.2e} state {rel(s, s_r):.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"kda_chunk FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    for (b, h, kd) in [(1, 2, 16), (8, 32, 128)]:
        try:
            r = lambda *sh, dt=jnp.float32, sc=1.0: jnp.asarray(sc * rng.standard_normal(sh), dt)
            inputs = KDADecodeInputs(r(b, 3, h, kd, dt=jnp.bfloat16), r(b, h, kd, dt=jnp.bfloat16),
                                     r(b, h, dt=jnp.bfloat16), r(b, h, kd, dt=jnp.bfloat16))
            conv, state = r(b, 3, 3, h, kd, dt=jnp.bfloat16), r(b, h, kd, kd)
            for lb in (None, -5.0):
                weights = KDADecodeWeights(*(r(4, h, kd, sc=0.5) for _ in range(3)), r(h, kd), r(h, kd), r(kd),
                                           lower_bound=lb)
                ref = jax.jit(kda_decode_xla)(inputs, weights, conv, state)
                out = kda_decode_pallas(inputs, weights, conv, state + 0)
                print(f"kda_decode b{b} h{h} k{kd} lb={lb}: err out {rel(out[0], ref[0]):.2e} "
                      f"conv {rel(out[1], ref[1]):.2e} state {rel(out[2], ref[2]):.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"kda_decode FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    for (b, sq, h, s) in [(2, 1, 32, 1024), (3, 2, 12, 4096), (1, 1, 96, 8192)]:
        try:
            q = jnp.asarray(rng.standard_normal((b, sq, h, 512)), jnp.bfloat16)
            qp = jnp.asarray(rng.standard_normal((b, sq, h, 64)), jnp.bfloat16)
            c = jnp.asarray(rng.standard_normal((b, s, 576)), jnp.bfloat16)
            n = jnp.asarray(rng.integers(sq, s + 1, b), jnp.int32)
            out = mla_decode_pallas(q, qp, c, n, scale=0.07)
            ref = jax.jit(lambda *a: mla_decode_reference(*a, scale=0.07))(q, qp, c, n)
            print(f"mla_decode b{b} sq{sq} h{h} s{s}: err {rel(out, ref):.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"mla_decode FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    print("smoke failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
