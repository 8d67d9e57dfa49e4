"""MLA decode attention over the latent cache: the kernels beside the plain-jnp absorbed form.

    python benchmarks/mla_decode.py                          # on the H200: Triton-lowered and Hopper kernels
    python benchmarks/mla_decode.py --impl hopper --q 1 4    # the Hopper kernel, one and four query tokens
    python benchmarks/mla_decode.py --impl hopper --splits 0 2 4 --profile   # split counts, device time per kernel
    python benchmarks/mla_decode.py --small                  # CPU smoke run (interpret mode, Triton form)

bf16 cache [B, ctx, 576] (512 latent + 64 rope), q query tokens per row, every row at full
length. `ms` is the time per call with 20 calls chained in one compiled loop (the host's dispatch
amortised, but each loop iteration waits on the host for its condition), `call_ms` the same 20 calls
unrolled in one program (no loop), `host_ms` one call timed from the host. TB/s counts the cache bytes read once (the
floor); outputs are checked against the reference in the same run. `--profile` adds the device
time of each kernel a call launches (a profiler trace): `kernel_ms` is the longest (the attention
kernel), `device_ms` all of them (with the query layout and the split merge), `span_ms` the device
timeline per call over 20 calls dispatched back to back (first kernel start to last kernel end: the kernels
plus the idle gaps between them, without the chain's own nudge and read-back kernels that `call_ms` has).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import HBM_ACHIEVABLE, chained_time, environment, median_time, table, write  # noqa: E402
from benchmarks.kernel_profile import kernel_trace  # noqa: E402
from pallas_kernels.mla_decode import MLADecodeBlocks, mla_decode_pallas, mla_decode_reference  # noqa: E402
from pallas_kernels.mla_decode.hopper import TILE_ROWS, HopperMLABlocks, mla_decode_hopper, query_rows  # noqa: E402
from pallas_kernels.mla_decode.hopper_columns import column_tiles  # noqa: E402


# --impl names of the Hopper kernel's forms -> their HopperMLABlocks settings (besides the splits).
HOPPER_FORMS = {"hopper": {}, "hopper-alternate": {"scoring": "alternate"}, "hopper-each": {"scoring": "each"},
                "hopper-one-buffer": {"query_buffers": 1}, "hopper-merge-pallas": {"merge": "pallas"},
                "hopper-merge-xla": {"merge": "xla"}, "hopper-columns": {"query_side": "n"}}


def sweep(iters):
    """Times launch settings at 64 x 4K (H=32) and returns the fastest (block_h, block_k, warps, stages)."""
    b, ctx, h = 64, 4096, 32
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (b, 1, h, 512), jnp.bfloat16)
    qp = jax.random.normal(ks[1], (b, 1, h, 64), jnp.bfloat16)
    cache = jax.random.normal(ks[2], (b, ctx, 576), jnp.bfloat16)
    lengths = jnp.full((b,), ctx, jnp.int32)
    results = {}
    for bh in (16, 32):
        for bk in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    blocks = MLADecodeBlocks(block_h=bh, block_k=bk, num_warps=warps, num_stages=stages)
                    try:
                        fn = jax.jit(lambda q, qp, c, n, blocks=blocks: mla_decode_pallas(q, qp, c, n, scale=0.07, blocks=blocks))
                        t, _ = median_time(lambda: fn(q, qp, cache, lengths), iters=iters)
                    except Exception as e:  # noqa: BLE001 - a setting the compiler rejects
                        print(f"sweep {bh, bk, warps, stages}: failed {type(e).__name__}", flush=True)
                        continue
                    results[(bh, bk, warps, stages)] = t
                    print(f"sweep {bh, bk, warps, stages}: {t * 1e3:.3f} ms, "
                          f"{b * ctx * 576 * 2 / t / 1e12:.2f} TB/s", flush=True)
    return min(results, key=results.get)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--block-h", type=int, default=32)
    ap.add_argument("--block-k", type=int, default=64)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="try launch settings at B x ctx = 64 x 4K first")
    ap.add_argument("--impl", nargs="+", default=["triton", "hopper"],
                    choices=["triton", *HOPPER_FORMS],
                    help="hopper: the Hopper kernel (warpgroup 0 scores every block); -alternate: the warpgroups "
                         "take turns; -each: both score every block; -one-buffer: queries laid out by XLA into one "
                         "[64, 576] buffer, one score MMA; -merge-pallas / -merge-xla: the splits merged in one Pallas "
                         "launch / by XLA (hopper merges by the one launch from 64 splits on, else by XLA); "
                         "-columns: the query rows on the MMAs' N side (tiles of up to 64 rows in multiples of 8: "
                         "96 heads as two of 48)")
    ap.add_argument("--q", nargs="+", type=int, default=[1], help="query tokens per row")
    ap.add_argument("--shapes", nargs="*", default=None, help="HxBxCTX entries, e.g. 32x64x4096")
    ap.add_argument("--name", default=None, help="name of the JSON record (default mla_decode)")
    ap.add_argument("--splits", nargs="+", type=int, default=[0],
                    help="Hopper kernel: sequence splits per row to try (0 = its own choice)")
    ap.add_argument("--profile", action="store_true", help="device time per kernel of each call (profiler trace)")
    args = ap.parse_args(argv)
    if args.sweep:
        best = sweep(args.iters)
        args.block_h, args.block_k, args.num_warps, args.num_stages = best
    r, p = (32, 16) if args.small else (512, 64)
    grid = ([(2, 16, 128), (1, 4, 256)] if args.small else
            [(h, b, ctx) for h in (32, 96) for b, ctx in
             ((1, 1024), (1, 32768), (1, 131072), (8, 4096), (8, 131072), (64, 1024), (64, 4096), (64, 32768))])
    if args.shapes:
        grid = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes]
    impls = ["triton"] if args.small else args.impl
    blocks = MLADecodeBlocks(block_h=args.block_h, block_k=args.block_k, num_warps=args.num_warps,
                             num_stages=args.num_stages)
    rows = []
    scale = 192 ** -0.5
    kernels = {("triton", 0): lambda q, qp, c, n: mla_decode_pallas(q, qp, c, n, scale=scale, blocks=blocks)}
    for n_splits in args.splits:
        for impl, form in HOPPER_FORMS.items():
            hb = HopperMLABlocks(num_splits=n_splits, **form)
            kernels[impl, n_splits] = lambda q, qp, c, n, hb=hb: mla_decode_hopper(q, qp, c, n, scale=scale, blocks=hb)
    runs = [(impl, n) for impl in impls for n in ([0] if impl == "triton" else args.splits)]
    ref = jax.jit(lambda q, qp, c, n: mla_decode_reference(q, qp, c, n, scale=scale))
    for h, b, ctx in grid:
        ks = jax.random.split(jax.random.key(ctx + b + h), 3)
        cache = jax.random.normal(ks[2], (b, ctx, r + p), jnp.bfloat16)
        lengths = jnp.full((b,), ctx, jnp.int32)
        for sq in args.q:
            q = jax.random.normal(ks[0], (b, sq, h, r), jnp.bfloat16)
            qp = jax.random.normal(ks[1], (b, sq, h, p), jnp.bfloat16)
            expect = ref(q, qp, cache, lengths)
            for impl, n_splits in runs:
                kernel = kernels[impl, n_splits]
                fn = jax.jit(kernel)
                try:
                    host, _ = median_time(lambda: fn(q, qp, cache, lengths), iters=args.iters)
                    t = chained_time(kernel, (q, qp, cache, lengths), iters=max(3, args.iters // 5))
                    t_call = chained_time(kernel, (q, qp, cache, lengths), iters=max(3, args.iters // 5), unroll=True)
                    per_kernel, span = kernel_trace(kernel, (q, qp, cache, lengths)) if args.profile else ({}, 0.0)
                except Exception as e:  # noqa: BLE001 - report and go on to the next shape
                    print(f"{impl} H={h} B={b} ctx={ctx} q={sq}: failed: {str(e)[:300]}", flush=True)
                    continue
                out = fn(q, qp, cache, lengths)
                err = float(jnp.linalg.norm(out - expect) / jnp.linalg.norm(expect))
                nbytes = b * ctx * (r + p) * 2
                columns = HOPPER_FORMS.get(impl, {}).get("query_side") == "n"
                tiles = column_tiles(h * sq) if columns else query_rows(h, sq) // TILE_ROWS
                launched = (0 if impl == "triton" else
                            HopperMLABlocks(num_splits=n_splits).split_layout(b * tiles, ctx)[0])
                row = {"impl": impl, "splits": n_splits, "launched_splits": launched, "H": h, "B": b, "ctx": ctx, "q": sq,
                       "ms": t * 1e3,
                       "host_ms": host * 1e3, "TB_s": nbytes / t / 1e12,
                       "pct_4.3TB_s": nbytes / t / HBM_ACHIEVABLE * 100, "call_ms": t_call * 1e3,
                       "call_pct_4.3TB_s": nbytes / t_call / HBM_ACHIEVABLE * 100, "err_vs_ref": err}
                if per_kernel:
                    kernel_us = max(per_kernel.values())
                    row.update({"kernel_ms": kernel_us / 1e3, "device_ms": sum(per_kernel.values()) / 1e3,
                                "span_ms": span / 1e3, "span_pct_4.3TB_s": nbytes / (span * 1e-6) / HBM_ACHIEVABLE * 100,
                                "kernel_pct_4.3TB_s": nbytes / (kernel_us * 1e-6) / HBM_ACHIEVABLE * 100,
                                "kernels_us": {k: round(v, 2) for k, v in per_kernel.items()}})
                rows.append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    record = {"benchmark": "mla_decode", "env": environment(), "blocks": vars(args), "rows": rows}
    path = write(args.name or "mla_decode" + ("_small" if args.small else ""), record)
    print(table(rows, ["impl", "splits", "launched_splits", "H", "B", "ctx", "q", "ms", "host_ms", "pct_4.3TB_s", "call_ms",
                       "call_pct_4.3TB_s", "kernel_ms", "device_ms", "span_ms", "kernel_pct_4.3TB_s", "err_vs_ref"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
