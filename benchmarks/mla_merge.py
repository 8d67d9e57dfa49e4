"""The merge of the Hopper MLA kernel's splits alone: XLA's `combine_splits` against the one-launch
`merge_splits_pallas` at several launch settings, device time per call from a profiler trace.

    python3 benchmarks/mla_merge.py            # on the H200
    python3 benchmarks/mla_merge.py --small    # CPU smoke run (interpret mode; no device times)

Shapes are the kernel's outputs at H = 32, q = 1 (32 real rows of a 64-row tile): 1 x 128K (128
splits) and 64 x 4K (2 splits). Outputs are checked against `combine_splits` in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import environment, table, write  # noqa: E402
from benchmarks.kernel_profile import kernel_times  # noqa: E402
from pallas_kernels.mla_decode.hopper import combine_splits  # noqa: E402
from pallas_kernels.mla_decode.merge import merge_splits_pallas  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)
    shapes = [(1, 3, 64, 64, 32)] if args.small else [(1, 128, 64, 512, 32), (64, 2, 64, 512, 32)]
    settings = ([(32, 8, 4)] if args.small else
                list(itertools.product((16, 32), (8, 16), (4,))) + [(64, 16, 4), (16, 4, 2), (16, 16, 8)])
    rows_out = []
    for b, splits, r_q, c, rows in shapes:
        ks = jax.random.split(jax.random.key(splits), 2)
        o = jax.random.normal(ks[0], (b, splits, r_q, c), jnp.float32).astype(jnp.bfloat16)
        lse = jax.random.normal(ks[1], (b, splits, r_q), jnp.float32) * 4.0
        xla = lambda o, lse: combine_splits(o, lse)[:, :rows]
        want = np.asarray(jax.jit(xla)(o, lse))
        t = kernel_times(xla, (o, lse))
        rows_out.append({"B": b, "splits": splits, "rows": rows, "impl": "xla", "us": sum(t.values()),
                         "kernels": len(t), "err": 0.0})
        print(rows_out[-1], flush=True)
        for block_c, chunk, warps in settings:
            fn = lambda o, lse, block_c=block_c, chunk=chunk, warps=warps: merge_splits_pallas(
                o, lse, rows=rows, block_c=block_c, chunk=chunk, num_warps=warps)
            got = np.asarray(jax.jit(fn)(o, lse))
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            t = kernel_times(fn, (o, lse))
            rows_out.append({"B": b, "splits": splits, "rows": rows, "impl": f"pallas c{block_c}/s{chunk}/w{warps}",
                             "us": sum(t.values()), "kernels": len(t), "err": err})
            print(rows_out[-1], flush=True)
    path = write("mla_merge" + ("_small" if args.small else ""), {"benchmark": "mla_merge", "env": environment(),
                                                                   "rows": rows_out})
    print(table(rows_out, ["B", "splits", "rows", "impl", "us", "kernels", "err"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
