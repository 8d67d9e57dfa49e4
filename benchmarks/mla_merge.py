"""The merge of the Hopper MLA kernel's splits alone: XLA's `combine_splits` against the one-launch
`merge_splits_pallas` at several launch settings, device time per call from a profiler trace.

    python3 benchmarks/mla_merge.py            # on the H200
    python3 benchmarks/mla_merge.py --small    # CPU smoke run (interpret mode; no device times)

Shapes are the kernel's outputs at H = 32, q = 1 (32 real rows of a 64-row tile): 1 x 128K (128
splits) and 64 x 4K (2 splits). Outputs are checked against `combine_splits` in the same run.
"""

from __future__ import annotations

import argparse
import functools
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
    # (block_r, block_c, chunk, num_warps); the first is the form measured in MLA run 9
    settings = ([(16, 32, 8, 4), (4, 16, 4, 4)] if args.small else
                [(16, 32, 8, 4)] + list(itertools.product((8, 4), (32, 16), (16, 32), (4,)))
                + [(4, 32, 128, 8), (2, 32, 64, 4), (2, 64, 32, 4), (4, 64, 32, 4), (8, 64, 16, 4)])
    rows_out = []
    for b, splits, r_q, c, rows in shapes:
        ks = jax.random.split(jax.random.key(splits), 2)
        o = jax.random.normal(ks[0], (b, splits, r_q, c), jnp.float32).astype(jnp.bfloat16)
        lse = jax.random.normal(ks[1], (b, splits, r_q), jnp.float32) * 4.0
        xla_padded = lambda o, lse: combine_splits(o, lse)[:, :rows]            # the form before (MLA run 9)
        xla = lambda o, lse: combine_splits(o[:, :, :rows], lse[:, :, :rows])   # the real rows only
        want = np.asarray(jax.jit(xla_padded)(o, lse))
        fns = {"xla padded": xla_padded, "xla": xla}
        for block_r, block_c, chunk, warps in settings:
            fns[f"pallas r{block_r}/c{block_c}/s{chunk}/w{warps}"] = functools.partial(
                merge_splits_pallas, rows=rows, block_r=block_r, block_c=block_c, chunk=chunk, num_warps=warps)
        for impl, fn in fns.items():
            got = np.asarray(jax.jit(fn)(o, lse))
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            t = kernel_times(fn, (o, lse))
            rows_out.append({"B": b, "splits": splits, "rows": rows, "impl": impl, "us": sum(t.values()),
                             "kernels": len(t), "err": err})
            print(rows_out[-1], flush=True)
    path = write("mla_merge" + ("_small" if args.small else ""), {"benchmark": "mla_merge", "env": environment(),
                                                                   "rows": rows_out})
    print(table(rows_out, ["B", "splits", "rows", "impl", "us", "kernels", "err"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
