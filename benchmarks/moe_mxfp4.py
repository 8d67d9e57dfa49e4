"""Routed-expert kernels on MXFP4 weights kept packed, beside the same kernels on bf16 weights.

    python benchmarks/moe_mxfp4.py            # on the H200: Kimi-Linear and K3-latent expert shapes
    python benchmarks/moe_mxfp4.py --sweep    # also the packed kernels' tile settings
    python benchmarks/moe_mxfp4.py --tokamax  # also one projection against tokamax's quantized ragged_dot
    python benchmarks/moe_mxfp4.py --hopper   # also the Mosaic GPU kernel (`moe_gmm/hopper_mxfp4.py`)
    python benchmarks/moe_mxfp4.py --hopper-sweep   # ... over HOPPER_SWEEP's settings too
    python benchmarks/moe_mxfp4.py --hopper-handoff # ... and each through grouped_mlp_hopper_mxfp4 (> 8 tokens)
    python benchmarks/moe_mxfp4.py --hopper --profile   # ... with each call's kernels from a profiler trace
    python benchmarks/moe_mxfp4.py --small    # CPU smoke run (interpret mode)

Uniform random top-k routing. Decode sizes (1, 8 tokens) run the unsorted pair kernels, larger ones
the grouped kernels over rows sorted by expert. `pct` = bytes of the touched experts' gate, up and
down weights (packed: half a byte per value plus one scale byte per 32) over the time, against
4.3 TB/s; outputs are checked against the bf16 kernels on the dequantised weights. K3's latent experts
run at 1/8 of their number (112: one GPU's share under 8-way expert parallelism).

`--tokamax` times one gate projection over sorted rows, ours (`grouped_matmul_pallas` on the packed
weight) against tokamax's Mosaic GPU quantized ragged_dot on the same values as a qwix QArray (float4_e2m1fn
values, bf16 per-32 scales: its sm90 kernel reads 4-bit values and scales the dequantised tile).

`--hopper` times the same routed-expert MLP through the Mosaic GPU kernel on the same packed values (pairs
up to 8 tokens, sorted rows above), beside the Pallas-Triton MXFP4 kernels of the same run
(`hopper_vs_mxfp4` > 1: the Mosaic GPU kernel is faster); `--hopper-sweep` also over HOPPER_SWEEP;
`--hopper-handoff` also each setting that reads slabs with the gated launch handing its tiles to the down launch
(`hopper_mxfp4_mlp.grouped_mlp_hopper_mxfp4`), rows marked "handoff": "products"; with the GLU in the gated
launch's epilogue, "handoff": "glu"; and (`--handoff-forms routed`) the GLU hand-off from the unsorted pairs
(`hopper_mxfp4_routed.routed_mlp_hopper_mxfp4`, the model's path), "handoff": "routed"; `routed_sort`: the same
with the pairs ordered by its sort (the reference) instead of counting.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import HBM_ACHIEVABLE, chained_time, environment, table, write  # noqa: E402
from benchmarks.kernel_profile import kernel_trace  # noqa: E402
from k3jax.layers.moe_experts import sort_by_expert, unsort_and_sum  # noqa: E402
from pallas_kernels.moe_gmm import (grouped_glu_pallas, grouped_matmul_pallas, pair_glu_pallas,  # noqa: E402
                                    pair_matmul_pallas)
from pallas_kernels.moe_gmm.hopper_mxfp4 import (HopperMxfp4Blocks, grouped_glu_hopper_mxfp4,  # noqa: E402
                                                  grouped_matmul_hopper_mxfp4, pair_glu_hopper_mxfp4,
                                                  pair_matmul_hopper_mxfp4, to_columns)
from pallas_kernels.moe_gmm.hopper_mxfp4_mlp import grouped_mlp_hopper_mxfp4, hand_off_columns  # noqa: E402
from pallas_kernels.moe_gmm.hopper_mxfp4_routed import routed_mlp_hopper_mxfp4  # noqa: E402
from pallas_kernels.moe_gmm.mxfp4 import E2M1, GROUP, Mxfp4Weight, dequantize  # noqa: E402
from pallas_kernels.moe_gmm.tuning import TileBlocks  # noqa: E402

MODELS = {"kimi-linear": (256, 2304, 1024, 8), "k3-latent-1/8": (112, 3584, 3072, 16)}  # E, D, F, top-k
# Pairs (<= 8 tokens): CUDA-core rows by decode and reduction parts, then 16-row tensor-core tiles.
SWEEP = ([TileBlocks(16, 64, 128, 4, 3, gemv=True, e2m1="asm", split_k=sk) for sk in (1, 0)]
         + [TileBlocks(16, n, k, w, 3, gemv=True, e2m1="asm", split_k=0)
            for n, k, w in ((64, 256, 8), (32, 128, 4), (128, 128, 8))]
         + [TileBlocks(16, 64, 128, 4, 3, gemv=True, e2m1="bits")]
         + [TileBlocks(16, n, 128, w, s, e2m1="asm") for n, w, s in ((64, 4, 3), (64, 4, 5), (128, 8, 3))])
GROUPED_SWEEP = [TileBlocks(64, 128, 128, 4, 3, e2m1=d) for d in ("table", "asm")] + [
    TileBlocks(m, n, 128, w, s, e2m1="asm") for m, n, w, s in ((128, 128, 8, 3), (64, 64, 4, 4), (64, 256, 8, 3))]

# The Mosaic GPU kernel: K split over programs (0: auto), inputs per MMA call (0: the whole step), step depth.
# Hopper run 1 timed the decode and operand forms (ptx / exact x registers / smem: ptx in registers fastest by
# 1.33-4.6x) and 16-row tiles (no change).
# activations="rows": the tiles read the sorted rows in place instead of XLA's per-tile slabs (their gather
# took 36 + 14 us of 462 at 64 tokens in run 30); outputs="rows": each program writes its own rows' products
# into [M, N] rows, so XLA gathers nothing after the launch (both slower at 64 tokens in run 31: 0.517 / 0.490 ms
# against 0.436 / 0.411 without). decode="bits" (five integer-ALU instructions per four codes instead of eight) was
# the default from run 31 (3-9% faster at 1-64 tokens) to run 41, and stays the dataclass's own; entries 9-11 time
# the table decode ("ptx"). Since run 41 compiled decode tiles default to "scaled": the default row is entry 21's
# settings, and entry 18 is the "bits" form of it. Run 33
# (H100): with the slab gather's indices written out first, outputs="rows" 0.414 / 0.135 ms at 64 / 8 tokens
# against 0.424 / 0.145 for "tiles", so `for_backend` picks "rows" for decode tiles since. The entries are built
# with the dataclass, whose own default is still "tiles": entries 0-5 and 9 differ from the default call in their
# outputs too, so compare them with entry 12 (the "tiles" form with every other setting the default's).
HOPPER_SWEEP = [HopperMxfp4Blocks(block_k=bk, stages=st, splits=sp, mma_inputs=mi)
                for bk, st, sp, mi in ((256, 3, 0, 16), (256, 3, 0, 0), (256, 3, 0, 32), (128, 4, 0, 16))] + [
    HopperMxfp4Blocks(activations="rows"), HopperMxfp4Blocks(splits=0, activations="rows"),
    HopperMxfp4Blocks(outputs="rows"), HopperMxfp4Blocks(activations="rows", outputs="rows"),
    HopperMxfp4Blocks(splits=0, activations="rows", outputs="rows"),
    HopperMxfp4Blocks(decode="ptx"), HopperMxfp4Blocks(decode="ptx", activations="rows", outputs="rows"),
    HopperMxfp4Blocks(decode="ptx", splits=0, activations="rows", outputs="rows"), HopperMxfp4Blocks(outputs="tiles")]
# Entries 13-17: the persistent launch (one warp-specialized program a multiprocessor walking tiles x 128-column
# blocks in one pipeline; sorted rows only, so above 8 tokens), at ring depths whose shared memory holds both
# the gate and up weights.
HOPPER_SWEEP += [HopperMxfp4Blocks(launch="persistent", outputs="rows", stages=st, block_k=bk)
                 for st, bk in ((3, 256), (5, 256), (8, 128))] + [
    HopperMxfp4Blocks(launch="persistent", stages=4), HopperMxfp4Blocks(launch="persistent", outputs="rows",
                                                                        stages=4, mma_inputs=32)]
# Entries 18-21: the default's settings (rows out) with fewer MMA calls (one a scale group, one a step) and the
# scale folded into the decode's multiply ("scaled"). Nsight Compute at 64 tokens (run 38): both launches issue-bound
# (74% / 82% of issue slots), about 18 instructions per four codes, of which the per-16-input MMA calls' descriptor
# arithmetic and fences take about 4 and the separate scale multiplies 2.
HOPPER_SWEEP += [HopperMxfp4Blocks(outputs="rows", decode=d, mma_inputs=mi)
                 for d, mi in (("bits", 0), ("bits", 32), ("scaled", 16), ("scaled", 0))]
# Entries 22-23: the codes loaded four bytes a thread and decoded a word (eight codes) at a time, no `prmt`
# (`code_load="words"`): half the code loads; with the scale folded in about 12% fewer instructions a step than the
# default by count. Compiled only. Run 39 (H100, 64 tokens): launches 324.4 / 339.7 us (bits / scaled) against the
# default's 326.0.
HOPPER_SWEEP += [HopperMxfp4Blocks(outputs="rows", decode=d, mma_inputs=0, code_load="words")
                 for d in ("bits", "scaled")]
# Entries 24-27: four gated programs a multiprocessor instead of three (52 KB of shared memory each, not 73; the
# down launch's seven, not five), where run 38 found the launches at 74% / 82% of their issue slots with three
# (12 warps, 3 a scheduler): steps of 128 inputs in 4 stages with one MMA call a step (half the decoded operand's
# registers of a 256-input step: ptxas must also come in at <= 128 registers a thread for four), in the bits,
# scaled and scaled word forms; and 256-input steps in 2 stages with an MMA call a scale group. Entry 28: five
# (42 KB; a call a scale group holds a sixth of the decoded operand's registers), 128-input steps in 3 stages.
HOPPER_SWEEP += [HopperMxfp4Blocks(outputs="rows", mma_inputs=0, block_k=128, stages=4, decode=d, code_load=c)
                 for d, c in (("bits", "pairs"), ("scaled", "pairs"), ("scaled", "words"))]
HOPPER_SWEEP += [HopperMxfp4Blocks(outputs="rows", mma_inputs=32, stages=2, decode="scaled"),
                 HopperMxfp4Blocks(outputs="rows", mma_inputs=32, block_k=128, stages=3, decode="scaled")]


def packed(rng, e, k, n) -> Mxfp4Weight:
    """Random codes with scales near 2^-6 (weights of about 0.02)."""
    return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (e, k // 2, n), dtype=np.uint8)),
                       jnp.asarray(rng.integers(118, 123, (e, k // 32, n), dtype=np.uint8)))


# How the calls order the pairs by expert (`sort_by_expert`'s method; --routing).
ROUTING = {"method": "sort"}

PALLAS_KERNELS = (pair_glu_pallas, pair_matmul_pallas, grouped_glu_pallas, grouped_matmul_pallas)
HOPPER_KERNELS = (pair_glu_hopper_mxfp4, pair_matmul_hopper_mxfp4, grouped_glu_hopper_mxfp4,
                  grouped_matmul_hopper_mxfp4)


def experts_mlp(x, weights, experts, w1, w3, w2, blocks=None, kernels=PALLAS_KERNELS):
    """The routed-expert MLP through `kernels` (pair glu, pair matmul, grouped glu, grouped matmul: the
    Pallas-Triton ones, or HOPPER_KERNELS on `Mxfp4Columns` weights): pairs for a few tokens, sorted rows
    above."""
    pair_glu, pair_matmul, grouped_glu, grouped_matmul = kernels
    n, k = experts.shape
    if n <= 8:
        group, valid = experts.reshape(-1), jnp.ones((n * k,), bool)
        h = pair_glu(x, w1, w3, group, valid, repeat=k, blocks=blocks)
        y = pair_matmul(h, w2, group, valid, weights.reshape(-1), blocks=blocks)
        return y.reshape(n, k, -1).sum(axis=1)
    order, sizes, _ = sort_by_expert(experts, w1.shape[0], method=ROUTING["method"])
    h = grouped_glu(x[order // k], w1, w3, sizes, blocks=blocks)
    y = grouped_matmul(h, w2, sizes, weights.reshape(-1)[order], blocks=blocks)
    return unsort_and_sum(y, order, k)   # as the model combines them (until run 31: a scatter-add, 12.9 us at 64)


def experts_mlp_hopper(x, weights, experts, c1, c3, c2, blocks=None):
    """`experts_mlp` through the Mosaic GPU kernel (`Mxfp4Columns` weights)."""
    return experts_mlp(x, weights, experts, c1, c3, c2, blocks, HOPPER_KERNELS)


def experts_mlp_handoff(x, weights, experts, c1, c3, c2, blocks=None, hand_off="products"):
    """`experts_mlp_hopper` with the gated launch handing its tiles (`hand_off="products"`) or h's slabs with
    the GLU in its epilogue ("glu": c1, c3 as `hand_off_columns` gives them) to the down launch
    (`grouped_mlp_hopper_mxfp4`) above 8 tokens."""
    n, k = experts.shape
    if n <= 8:
        return experts_mlp_hopper(x, weights, experts, c1, c3, c2, blocks)
    order, sizes, _ = sort_by_expert(experts, c1.shape[0], method=ROUTING["method"])
    y = grouped_mlp_hopper_mxfp4(x[order // k], c1, c3, c2, sizes, weights.reshape(-1)[order], blocks=blocks,
                                 hand_off=hand_off)
    return unsort_and_sum(y, order, k)


def experts_mlp_handoff_glu(x, weights, experts, c1, c3, c2, blocks=None):
    """`experts_mlp_handoff` with the GLU in the gated launch's epilogue."""
    return experts_mlp_handoff(x, weights, experts, c1, c3, c2, blocks, hand_off="glu")


def experts_mlp_routed(x, weights, experts, c1, c3, c2, blocks=None, order_by="auto"):
    """The GLU hand-off from the unsorted pairs (`routed_mlp_hopper_mxfp4`: its own ordering, slabs and combine, as
    the model runs it) above 8 tokens; c1, c3 as `hand_off_columns` gives them. order_by: `routing_order`'s method."""
    if experts.shape[0] <= 8:
        return experts_mlp_hopper(x, weights, experts, c1, c3, c2, blocks)
    return routed_mlp_hopper_mxfp4(x, weights, experts, c1, c3, c2, blocks=blocks, order_by=order_by)


# the same with the pairs put in expert order by the packed-key sort (the reference) instead of counting
experts_mlp_routed_sort = functools.partial(experts_mlp_routed, order_by="sort")


def profile(fn, args) -> dict:
    """The device microseconds of each kernel one call launches (every one, longest first) and the call's device
    span (kernels plus the gaps between them); {} off a GPU, the error where the trace fails."""
    try:
        times, span = kernel_trace(fn, args, calls=10)
    except Exception as exc:  # noqa: BLE001 - a failed trace must not stop the timings
        return {"failed": f"{type(exc).__name__}: {str(exc)[:200]}"}
    if not times:
        return {}
    mosaic = sum(v for k, v in times.items() if "mosaic" in k)
    return {"span_us": round(span, 1), "kernels_us": {k: round(v, 1) for k, v in times.items()},
            "kernel_names": len(times), "all_kernels_us": round(sum(times.values()), 1),
            "mosaic_us": round(mosaic, 1), "glue_us": round(sum(times.values()) - mosaic, 1),
            "idle_us": round(span - sum(times.values()), 1)}


def time_hopper(row, x, weights, experts, columns, nbytes, reference, sweep: bool, small: bool,
                with_profile: bool = False, pick: list[int] | None = None, handoff: bool = False,
                unrolled: bool = False, out: list | None = None, saved=None,
                handoff_forms: tuple[str, ...] = ("products", "glu")) -> list[dict]:
    """Adds the Mosaic GPU kernel's time (default settings) to `row`; with `sweep`, returns one row per
    HOPPER_SWEEP setting (those at the indices `pick`, default all); with `handoff`, after each setting that reads
    slabs more rows, through `experts_mlp_handoff` ("handoff": "products"), `experts_mlp_handoff_glu` ("glu": the
    gate and up columns permuted once, outside the timed call, as the loader would; grid launches with `splits` 0
    or 1, and persistent ones), `experts_mlp_routed` ("routed": the same columns and launches) and
    `experts_mlp_routed_sort` ("routed_sort": it with the pairs ordered by a sort); above 8 tokens
    only; `handoff_forms`: which of them. A setting
    that fails to compile or run (K not a multiple of its block_k, say) is recorded with its error. `unrolled`:
    each row also timed with its 20 chained calls one after another in one program (`ms_unrolled`), as the layers of
    a decode step run, without the device loop's per-iteration wait on the host. `out`: the list the rows are
    appended to (a new one by default); `saved`: called after each row, so that a run stopped by its time limit
    keeps the rows it finished."""
    chosen = HOPPER_SWEEP if pick is None else [HOPPER_SWEEP[i] for i in pick]
    settings = [None] + (chosen if sweep else [])
    if small:                        # interpret mode runs the exact decode through shared memory only
        settings = [HopperMxfp4Blocks.for_backend(True, block_k=128)]
    handoff = handoff and experts.shape[0] > 8              # up to 8 tokens the pairs run, with no hand-off
    forms = {experts_mlp_hopper: False, experts_mlp_handoff: "products", experts_mlp_handoff_glu: "glu",
             experts_mlp_routed: "routed", experts_mlp_routed_sort: "routed_sort"}
    glu_takes = lambda b: b is None or b.launch == "persistent" or b.splits in (0, 1)   # the GLU epilogue's launches
    runs = [(mlp, b) for b in settings for mlp in forms
            if mlp is experts_mlp_hopper or (handoff and forms[mlp] in handoff_forms
                                             and (b is None or b.activations == "slab")
                                             and (forms[mlp] == "products" or glu_takes(b)))]
    glu_columns = {}                    # by the down launch's code_load: the gate and up columns in its k_order
    out = [] if out is None else out
    for mlp, blocks in runs:
        label = f"{blocks}" + (f" handoff {forms[mlp]}" if forms[mlp] else "")
        cols = columns
        if forms[mlp] in ("glu", "routed", "routed_sort"):
            load = "pairs" if blocks is None else blocks.code_load
            if load not in glu_columns:
                glu_columns[load] = (hand_off_columns(columns[0], load), hand_off_columns(columns[1], load),
                                     columns[2])
            cols = glu_columns[load]
        try:
            y = jax.jit(mlp, static_argnames="blocks")(x, weights, experts, *cols, blocks=blocks)
            t = chained_time(lambda *a, b=blocks, f=mlp: f(*a, blocks=b), (x, weights, experts, *cols),
                             reps=5 if small else 20, iters=2 if small else 10)
        except Exception as exc:  # noqa: BLE001
            print(f"  hopper {label}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            if blocks is None and mlp is experts_mlp_hopper:
                row["hopper_ms"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            out.append({"model": row["model"], "tokens": row["tokens"], "blocks": str(blocks),
                        "handoff": forms[mlp], "failed": f"{type(exc).__name__}: {str(exc)[:300]}"})
            if saved is not None:
                saved()
            continue
        a, b = np.asarray(y, np.float64), np.asarray(reference, np.float64)
        err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        pct = nbytes / t / HBM_ACHIEVABLE * 100
        if (blocks is None or small) and mlp is experts_mlp_hopper:
            row.update(hopper_ms=t * 1e3, **{"hopper_pct_4.3TB_s": pct}, hopper_err_vs_bf16=err,
                       hopper_vs_mxfp4=row["mxfp4_ms"] / (t * 1e3))
            if with_profile:
                row["hopper_profile"] = profile(experts_mlp_hopper, (x, weights, experts, *columns))
        extra = {}
        if unrolled:
            try:
                t_un = chained_time(lambda *a, b=blocks, f=mlp: f(*a, blocks=b), (x, weights, experts, *cols),
                                    reps=5 if small else 20, iters=2 if small else 10, unroll=True)
            except Exception as exc:  # noqa: BLE001 - recorded; the loop's timing above stands
                t_un = float("nan")
                extra["unrolled_failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            extra.update(ms_unrolled=t_un * 1e3, pct_unrolled=nbytes / t_un / HBM_ACHIEVABLE * 100)
            if (blocks is None or small) and mlp is experts_mlp_hopper:
                row.update(hopper_ms_unrolled=extra["ms_unrolled"], hopper_pct_unrolled=extra["pct_unrolled"])
        print(f"  hopper {label}: {t * 1e3:.4f} ms, {pct:.1f}%, err {err:.2e}"
              + (f"; unrolled {extra['ms_unrolled']:.4f} ms, {extra['pct_unrolled']:.1f}%" if extra else ""),
              flush=True)
        out.append({"model": row["model"], "tokens": row["tokens"], "blocks": str(blocks), "ms": t * 1e3,
                    "pct_4.3TB_s": pct, "err_vs_bf16": err, "handoff": forms[mlp], **extra})
        if with_profile and (blocks is not None or mlp is not experts_mlp_hopper) and not small:
            out[-1]["profile"] = profile(functools.partial(mlp, blocks=blocks), (x, weights, experts, *cols))
        if saved is not None:
            saved()
    return out


def tokamax_projection():
    """(gate projection over sorted rows through tokamax's quantized ragged_dot, QArray builder), or
    None when tokamax does not import."""
    try:
        import qwix  # noqa: PLC0415 - optional peers, brought along as wheels on the GPU machine
        import tokamax  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        print(f"tokamax not available: {type(e).__name__}: {e}", flush=True)
        return None

    def as_qarray(w: Mxfp4Weight):
        g, k, n = w.shape
        codes = jnp.stack([w.packed & 15, w.packed >> 4], axis=2).reshape(g, k, n)
        values = jnp.asarray(E2M1, jnp.float32)[codes].astype(jnp.float4_e2m1fn)
        scale = jnp.ldexp(jnp.float32(1.0), w.scale.astype(jnp.int32) - 127).astype(jnp.bfloat16)
        return qwix.QArray(qvalue=values, scale=scale)

    def run(xs, qarray, sizes):
        return tokamax.ragged_dot(xs, qarray, sizes, implementation="mosaic")
    return run, as_qarray


def compare_tokamax(model, e, d, f, k, token_counts, rng) -> list[dict]:
    """One gate projection [tokens*k sorted rows, D] x [E, D, F]: ours vs tokamax, same packed values."""
    tok = tokamax_projection()
    if tok is None:
        return []
    run, as_qarray = tok
    q1 = packed(rng, e, d, f)
    qa = jax.jit(as_qarray)(q1)
    rows = []
    for tokens in token_counts:
        experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]), jnp.int32)
        order, sizes, _ = sort_by_expert(experts, e)
        xs = jax.random.normal(jax.random.key(tokens), (tokens, d), jnp.bfloat16)[order // k]
        touched = len(np.unique(np.asarray(experts)))
        nbytes = touched * d * f * (0.5 + 1 / GROUP)
        row = {"model": model, "tokens": tokens, "rows": tokens * k, "experts_touched": touched}
        ours = jax.jit(grouped_matmul_pallas)(xs, q1, sizes)
        t = chained_time(grouped_matmul_pallas, (xs, q1, sizes))
        row.update(ours_ms=t * 1e3, ours_pct=nbytes / t / HBM_ACHIEVABLE * 100)
        try:
            theirs = jax.jit(run)(xs, qa, sizes)
            t = chained_time(run, (xs, qa, sizes))
            a, b = (np.asarray(v, np.float64) for v in (theirs, ours))
            row.update(tokamax_ms=t * 1e3, tokamax_pct=nbytes / t / HBM_ACHIEVABLE * 100,
                       tokamax_err=float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
        except Exception as exc:  # noqa: BLE001
            row["tokamax_ms"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--tokens", nargs="*", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help="also time the packed kernels over SWEEP tile settings")
    ap.add_argument("--sweep-tokens", nargs="*", type=int, default=[1, 8],
                    help="token counts the --sweep and --hopper-sweep settings run at")
    ap.add_argument("--tokamax", action="store_true", help="also one projection against tokamax (quantized)")
    ap.add_argument("--hopper", action="store_true", help="also the Mosaic GPU kernel")
    ap.add_argument("--hopper-sweep", action="store_true", help="also the Mosaic GPU kernel over HOPPER_SWEEP")
    ap.add_argument("--hopper-handoff", action="store_true",
                    help="also each Mosaic GPU setting that reads slabs with the gated launch handing its tiles to "
                         "the down launch (grouped_mlp_hopper_mxfp4)")
    ap.add_argument("--handoff-forms", nargs="+", choices=("products", "glu", "routed", "routed_sort"),
                    default=["products", "glu"],
                    help="which hand-offs --hopper-handoff times (default products and glu)")
    ap.add_argument("--hopper-pick", nargs="+", type=int,
                    help="only these indices of HOPPER_SWEEP (implies --hopper-sweep)")
    ap.add_argument("--unrolled", action="store_true",
                    help="also time each Mosaic GPU row with its chained calls unrolled in one program (no device "
                         "loop, whose every iteration waits on the host)")
    ap.add_argument("--routing", choices=("count", "sort"), default="sort",
                    help="how the calls order the pairs by expert (sort_by_expert's method; the 'routed' hand-off "
                         "rows sort packed keys themselves)")
    ap.add_argument("--profile", action="store_true",
                    help="record the kernels of the MXFP4 (and with --hopper the Mosaic GPU) call per row")
    args = ap.parse_args(argv)
    if args.hopper_pick is not None:
        bad = [i for i in args.hopper_pick if not 0 <= i < len(HOPPER_SWEEP)]
        if bad:
            ap.error(f"--hopper-pick: indices {bad} are outside HOPPER_SWEEP's 0..{len(HOPPER_SWEEP) - 1}")
        args.hopper_sweep = True
    args.hopper = args.hopper or args.hopper_sweep or args.hopper_handoff
    ROUTING["method"] = args.routing
    models = {"tiny": (8, 128, 128, 2)} if args.small else {m: MODELS[m] for m in (args.models or MODELS)}
    token_counts = args.tokens or ([1, 16] if args.small else [1, 8, 64, 256, 4096])
    rows, sweep_rows, tokamax_rows, hopper_rows = [], [], [], []

    env = environment()

    def save() -> str:
        return write("moe_mxfp4" + ("_small" if args.small else ""),
                     {"benchmark": "moe_mxfp4", "env": env, "routing": args.routing, "rows": rows,
                      "sweep": sweep_rows, "tokamax": tokamax_rows, "hopper": hopper_rows})
    for model, (e, d, f, k) in models.items():
        rng = np.random.default_rng(e)
        q1, q3, q2 = packed(rng, e, d, f), packed(rng, e, d, f), packed(rng, e, f, d)
        b1, b3, b2 = (dequantize(w) for w in (q1, q3, q2))
        columns = tuple(to_columns(w) for w in (q1, q3, q2)) if args.hopper else None
        for tokens in token_counts:
            experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]), jnp.int32)
            x = jax.random.normal(jax.random.key(tokens), (tokens, d), jnp.bfloat16)
            weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, k)), jnp.float32)
            touched = len(np.unique(np.asarray(experts)))
            row = {"model": model, "tokens": tokens, "experts_touched": touched}
            out = {}
            for name, ws in (("bf16", (b1, b3, b2)), ("mxfp4", (q1, q3, q2))):
                out[name] = jax.jit(experts_mlp)(x, weights, experts, *ws)
                t = chained_time(experts_mlp, (x, weights, experts, *ws), reps=5 if args.small else 20,
                                 iters=2 if args.small else 10)
                per_value = 2 if name == "bf16" else 0.5 + 1 / 32
                nbytes = 3 * touched * d * f * per_value
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_pct_4.3TB_s"] = nbytes / t / HBM_ACHIEVABLE * 100
            a, b = (np.asarray(out[n], np.float64) for n in ("mxfp4", "bf16"))
            row["speedup"] = row["bf16_ms"] / row["mxfp4_ms"]
            if args.profile:
                row["mxfp4_profile"] = profile(experts_mlp, (x, weights, experts, q1, q3, q2))
            row["err_vs_bf16"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
            if args.hopper:
                time_hopper(row, x, weights, experts, columns, 3 * touched * d * f * (0.5 + 1 / 32), out["bf16"],
                            args.hopper_sweep and tokens in args.sweep_tokens, args.small, args.profile,
                            args.hopper_pick, args.hopper_handoff, args.unrolled, out=hopper_rows, saved=save,
                            handoff_forms=tuple(args.handoff_forms))
            if args.sweep and tokens in args.sweep_tokens:
                best = None
                for blocks in (SWEEP if tokens <= 8 else GROUPED_SWEEP):
                    try:
                        t = chained_time(lambda *a, b=blocks: experts_mlp(*a, blocks=b),
                                         (x, weights, experts, q1, q3, q2))
                    except Exception as exc:  # noqa: BLE001
                        print(f"  {blocks}: failed {type(exc).__name__}", flush=True)
                        continue
                    pct = 3 * touched * d * f * (0.5 + 1 / 32) / t / HBM_ACHIEVABLE * 100
                    print(f"  sweep {blocks}: {t * 1e3:.4f} ms, {pct:.1f}%", flush=True)
                    sweep_rows.append({"model": model, "tokens": tokens, "blocks": str(blocks), "ms": t * 1e3,
                                       "pct_4.3TB_s": pct})
                    best = min(best or (t, blocks), (t, blocks), key=lambda p: p[0])
                row["sweep_best_ms"], row["sweep_best"] = best[0] * 1e3, str(best[1])
            rows.append(row)
            print({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
            save()      # after every row: a run stopped by its time limit keeps what it measured
        if args.tokamax and not args.small:
            tokamax_rows += compare_tokamax(model, e, d, f, k, token_counts, rng)
    path = save()
    print(table(rows, ["model", "tokens", "experts_touched", "bf16_ms", "mxfp4_ms", "speedup", "bf16_pct_4.3TB_s",
                       "mxfp4_pct_4.3TB_s", "err_vs_bf16"]))
    if args.hopper:
        print(table(rows, ["model", "tokens", "mxfp4_ms", "hopper_ms", "hopper_vs_mxfp4", "mxfp4_pct_4.3TB_s",
                           "hopper_pct_4.3TB_s", "hopper_ms_unrolled", "hopper_pct_unrolled",
                           "hopper_err_vs_bf16"]))
    if tokamax_rows:
        print(table(tokamax_rows, ["model", "tokens", "rows", "experts_touched", "ours_ms", "ours_pct", "tokamax_ms",
                                   "tokamax_pct", "tokamax_err"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
