"""The fused few-row projection launches of one Kimi-Linear-48B decode step (B=1), each under
several launch plans (`pallas_kernels.skinny.SkinnyBlocks`): how narrow column blocks compare with
splitting the reduction axis, including the XLA kernel that adds split partial sums up.

    python benchmarks/skinny.py              # on the H200
    python benchmarks/skinny.py --small      # CPU smoke run (interpret mode, tiny shapes)
    python benchmarks/skinny.py --sweep      # more launch settings on the per-layer launches

Time per launch: REPS launches chained back to back in one compiled program (unrolled: a loop on
the GPU adds ~20 us per iteration, more than these launches take), each input nudged by the previous
output, timed from the host; minus the same chain around a trivial launch (the nudges, the dispatch).
TB/s counts the weights once against 4.3 TB/s; launches whose weights fit the 50 MB L2 (f_b|g_b)
read partly from it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import HBM_ACHIEVABLE, environment, median_time, table, write  # noqa: E402
from pallas_kernels.skinny import SkinnyBlocks, fused_projections, plan  # noqa: E402

# (launch, groups as (K, (N of each weight))): the decode launches of the 48B shape.
LAUNCHES = [
    ("kda x: q|k|v|f_a|b|g_a", ((2304, (4096, 4096, 4096, 128, 32, 128)),)),
    ("kda f_b | g_b", ((128, (4096,)), (128, (4096,)))),
    ("kda/mla o_proj", ((4096, (2304,)),)),
    ("mla q|kv_a", ((2304, (6144, 576)),)),
    ("router | shared gate|up", ((2304, (256,)), (2304, (1024, 1024)))),
    ("router", ((2304, (256,)),)),
    ("shared down", ((1024, (2304,)),)),
]
SMALL = [("small", ((256, (512, 256, 64)),)), ("small split", ((512, (128,)),))]
PLANS = {"default": SkinnyBlocks(),
         "bn 64 then split K": SkinnyBlocks(unsplit_programs=10 ** 6), "bn >= 32 before split": SkinnyBlocks(min_block_n=32),
         "bn >= 16 before split": SkinnyBlocks(min_block_n=16),
         "bn 64, one program per SM": SkinnyBlocks(target_programs=132),
         "bn >= 16, one program per SM": SkinnyBlocks(min_block_n=16, target_programs=132)}
REPS = 50
# --sweep: launch settings beyond the plans above, each launch timed alone (partial sums left to the
# consumer, as the model's o_proj and router leave them), on the launches every decode layer runs.
SWEEP_LAUNCHES = ("kda x: q|k|v|f_a|b|g_a", "kda f_b | g_b", "kda/mla o_proj", "router")
SWEEP = {f"bk {bk} target {target} w{warps} s{stages}": SkinnyBlocks(block_k=bk, target_programs=target,
                                                                    num_warps=warps, num_stages=stages)
         for bk in (128, 256) for target in (264, 528) for warps in (4, 8) for stages in (3, 4)}


def chain_time(launch, args, reps: int = REPS) -> float:
    """Seconds per call of launch(*args) [-> a scalar], `reps` calls unrolled in one program."""
    def chain(first, *rest):
        carry = jnp.float32(0)
        for _ in range(reps):
            carry = launch(first + carry.astype(first.dtype), *rest) * 1e-30
        return carry

    fn = jax.jit(chain)
    t, _ = median_time(lambda: fn(*args), iters=20)
    return t / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--sweep", action="store_true", help="the SWEEP settings on SWEEP_LAUNCHES (20-launch chains)")
    args = ap.parse_args(argv)
    key = jax.random.key(0)
    rows = []
    reps = 20 if args.sweep else REPS
    plans = SWEEP if args.sweep else PLANS
    launches = SMALL if args.small else [(n, s_) for n, s_ in LAUNCHES if not args.sweep or n in SWEEP_LAUNCHES]
    if args.small and args.sweep:
        plans = dict(list(SWEEP.items())[:2])
    base = chain_time(lambda x0: jnp.sum(x0[:, :1].astype(jnp.float32)),
                      (jax.random.normal(key, (args.rows, 2304), jnp.bfloat16),), reps)
    print(f"chain overhead per launch {base * 1e6:.2f} us (subtracted)", flush=True)
    for name, shapes in launches:
        xs = [jax.random.normal(jax.random.fold_in(key, g), (args.rows, k), jnp.bfloat16) for g, (k, _) in enumerate(shapes)]
        ws = [[jax.random.normal(jax.random.fold_in(key, 100 * g + j), (k, n), jnp.bfloat16) * 0.02
               for j, n in enumerate(widths)] for g, (k, widths) in enumerate(shapes)]
        nbytes = sum(w.size * 2 for g in ws for w in g)
        for label, blocks in plans.items():
            segs = plan(shapes, blocks)

            def launch(x0, *rest, blocks=blocks, n=len(shapes)):
                inputs = (x0,) + rest[:n - 1]
                weights = rest[n - 1:]
                groups, at = [], 0
                for g, (_, widths) in enumerate(shapes):
                    groups.append((inputs[g], weights[at:at + len(widths)]))
                    at += len(widths)
                outs = fused_projections(groups, impl="pallas", blocks=blocks,
                                         partial_groups=tuple(range(n)) if args.sweep else ())
                return sum(jnp.sum(o[..., :1].astype(jnp.float32)) for o in outs)

            t = chain_time(launch, (*xs, *[w for g in ws for w in g]), reps) - base
            row = {"launch": name, "plan": label, "bn": "/".join(sorted({str(s.bn) for s in segs})),
                   "splits": segs[0].splits, "programs": sum(s.programs for s in segs), "us": t * 1e6,
                   "tb_s": nbytes / t / 1e12, "pct_4_3": nbytes / t / HBM_ACHIEVABLE}
            rows.append(row)
            print(f"{name:28s} {label:29s} bn {row['bn']:6s} splits {row['splits']} programs {row['programs']:4d} "
                  f"{row['us']:7.2f} us {row['tb_s']:.2f} TB/s", flush=True)
    print(table(rows, ["launch", "plan", "bn", "splits", "programs", "us", "tb_s", "pct_4_3"]))
    print("wrote", write("skinny_sweep" if args.sweep else "skinny", {
        "benchmark": "skinny", "sweep": args.sweep, "rows_per_call": args.rows, "reps": reps,
                                    "chain_overhead_us": base * 1e6, "env": environment(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
