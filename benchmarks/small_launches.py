"""The one-program-per-row launches of a decode step (residual add + norm, top-k router) under
their launch settings, at Kimi-Linear-48B's decode shapes.

    python benchmarks/small_launches.py                 # on the H200
    python benchmarks/small_launches.py --rows 1 64

At B = 1 a decode forward runs 53 add + norm launches and 26 router launches; each moves a few KB, so
each costs what its one program's latency chain costs. This times each kernel alone (device time
from a profiler trace, `kernel_us`) and 20 calls one after another in one program (`call_us`: the
kernel, the gap before the next launch and the chain's own small add that feeds each call its
input) for each number of warps. Inputs: the residual rows [M, 2304] bf16 with o_proj's 8 fp32
partial sums ([8, M, 2304]) or the 9 expert pairs' outputs of each token ([M, 9, 2304]); router
partial logits [9, M, 256] fp32, k = 8 by sigmoid score. Outputs are checked against the first setting's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import chained_time, environment, table, write  # noqa: E402
from benchmarks.kernel_profile import kernel_times  # noqa: E402
from pallas_kernels.rms_norm import add_rms_norm_pallas  # noqa: E402
from pallas_kernels.router import RouterSpec, route_topk_pallas  # noqa: E402

D, EXPERTS = 2304, 256
NORM_WARPS = (16, 8, 4, 2)
ROUTER_WARPS = (1, 2, 4)


def cases(m: int):
    """(label, setting, fn, args) for every kernel and setting at m rows."""
    ks = jax.random.split(jax.random.key(m), 5)
    h = jax.random.normal(ks[0], (m, D), jnp.bfloat16)
    w = 1 + 0.1 * jax.random.normal(ks[1], (D,), jnp.bfloat16)
    o_parts = jax.random.normal(ks[2], (8, m, D), jnp.float32)
    pair_parts = jax.random.normal(ks[3], (m, 9, D), jnp.float32)
    logits = jax.random.normal(ks[4], (9, m, EXPERTS), jnp.float32)
    bias = jnp.linspace(-0.1, 0.1, EXPERTS, dtype=jnp.float32)
    spec = RouterSpec(k=8, score="sigmoid", renormalize=True, scale=2.446)
    out = []
    for warps in NORM_WARPS:
        for label, parts, axis in (("add_rms_norm o_proj parts", o_parts, 0),
                                   ("add_rms_norm pair parts", pair_parts, 1)):
            def fn(h, parts, w, axis=axis, warps=warps):
                return add_rms_norm_pallas(h, parts, w, eps=1e-5, parts_axis=axis, num_warps=warps)[1]
            out.append((label, f"warps={warps}", fn, (h, parts, w)))
    for warps in ROUTER_WARPS:
        def fn(logits, bias, warps=warps):
            return route_topk_pallas(logits, bias, spec=spec, num_warps=warps)[0]
        out.append(("route_topk", f"warps={warps}", fn, (logits, bias)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--name", default="small_launches")
    args = ap.parse_args(argv)
    rows, first = [], {}
    for m in args.rows:
        for label, setting, fn, operands in cases(m):
            out = np.asarray(jax.jit(fn)(*operands).astype(jnp.float32))
            ref = first.setdefault((m, label), out)
            times = kernel_times(fn, operands)
            row = {"rows": m, "kernel": label, "setting": setting,
                   "kernel_us": max(times.values()) if times else None,
                   "launches": len(times),
                   "call_us": chained_time(fn, operands, unroll=True) * 1e6,
                   "max_abs_diff_vs_first": float(np.max(np.abs(out - ref)))}
            rows.append(row)
            print(table([row], list(row)), flush=True)
    path = write(args.name, {"benchmark": "small_launches", "env": environment(), "rows": rows})
    print(table(rows, ["rows", "kernel", "setting", "kernel_us", "call_us", "max_abs_diff_vs_first"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
