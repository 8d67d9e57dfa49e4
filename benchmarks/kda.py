"""KDA kernels on the GPU: chunked prefill and fused decode, beside fla-core and the XLA reference.

    python benchmarks/kda.py                 # on the H200 (fla-core importable for the peer columns)
    python benchmarks/kda.py --small         # CPU smoke run (interpret mode, tiny shapes)
    python benchmarks/kda.py --decode-only --no-fla --state-dtype float32 bfloat16   # the bf16 state's speed
    python benchmarks/kda.py --decode-only --no-fla --splits 1 2 4 8 0   # the one-token kernel's column blocks
    python benchmarks/kda.py --decode-only --no-fla --warps 4 --batches 64 256 --ceiling --profile   # beside the
        # state's read and write alone (the access pattern's ceiling), with the kernel's device time per layer

Prefill: B=1, T=8192, H=32 and 96, K=V=128, bf16 q/k/v, fp32 state; ours = q/k L2 norm + the chunked
Pallas kernels (the settings in VARIANTS), fla = chunk_kda(use_qk_l2norm_in_kernel=True). Decode: one fused step per layer
for 20 layers (`--layers`) in one jitted call, `--steps` times over (launch gaps included), B = 1, 8,
64, 256, H=32; GB/s counts the state read + write (fp32, or bf16 with --state-dtype). Outputs are checked against the pure-JAX
reference in the same run.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402

from benchmarks.common import HBM_ACHIEVABLE, environment, median_time, pipelined_time, table, write  # noqa: E402
from benchmarks.kernel_profile import call_trace, kernel_times, kernel_trace  # noqa: E402
from pallas_kernels._util import default_interpret  # noqa: E402
from pallas_kernels.kda import (ChunkBlocks, DecodeBlocks, HopperDecodeBlocks, KDADecodeInputs,  # noqa: E402
                                KDADecodeWeights, hopper_decode_runs_here, kda_chunk_xla, kda_decode_hopper,
                                kda_decode_pallas, kda_decode_xla, value_blocks_fit)
from pallas_kernels.kda.chunk import chunk_inter, chunk_intra, kda_chunk_pallas, to_chunk_rows, to_chunks  # noqa: E402
from pallas_kernels.kda.decode_hopper import KERNEL_FACTORS_K  # noqa: E402


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def l2(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)


def fla_functions():
    try:
        import torch
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        return torch, chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001 - report why the peer column is empty
        print(f"fla not available: {type(e).__name__}: {e}", flush=True)
        return None


def torch_time(torch, fn, warmup=5, iters=50, calls=1) -> float:
    """Median over `iters` of the seconds per call of `calls` eager calls between two CUDA events: one call (the
    default), or several back to back, as `pipelined_time` times ours (the host's launches hidden where the device
    is the slower side)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


# the dtypes before bf16 factors (runs 1-4; also `triton_resources.py`'s older cases); the pair and solve forms are
# today's defaults unless a variant names them ("joint" for the forms of runs 1-18)
FP32_FACTORS = dict(factors="float32", inverse="tf32x3", cumsum="xla")
BF16 = dict(factors="bfloat16", inverse="tf32x3", cumsum="xla")
# the pairs launch's (warps, stages, key columns a step), pinned: `ChunkBlocks.pairs_launch`
TILES = lambda warps, stages, columns: dict(pairs_num_warps=warps, pairs_num_stages=stages, pairs_key_slice=columns)
# the W, U launch as one program a chunk walking (columns, warps, stages) slices in a loop: `ChunkBlocks.factors_launch`
LOOP = lambda columns, warps, stages: dict(factors_loop=True, factors_slice=columns, factors_num_warps=warps,
                                           factors_num_stages=stages)
QB = dict(qk_norm="diagonal-bf16", diagonal_exp2=True)   # q, k handed on in bf16, the per-token walk in 2^x
# the per-token launch as before KDA run 28: q, k handed on in fp32, its walk in e^x, a warp a head (at even H)
WALK27 = dict(qk_norm="diagonal", diagonal_exp2=False, diagonal_num_warps=2)
# "default/..." names are today's defaults with the named changes, so they follow the defaults as these move (a
# name timed in an earlier run may now resolve to other launches: since run 29 the W, U loop runs in 3 stages with
# bf16 values); "runNN" names pin the defaults of that run.
RUN30_PAIRS = dict(pairs_exp2=False, pairs_one_loop=False)   # the tile pairs launch before run 31
VARIANTS = {
    "default": ChunkBlocks(),
    # the defaults before 2026-12-04 late (runs 12-18's "default")
    "joint": ChunkBlocks(pairs="joint", solve="whole", **WALK27),
    "default/chunked": ChunkBlocks(layout="chunked"),   # the defaults with XLA's layout copies (before 2026-12-03 late)
    "default/ks64": ChunkBlocks(key_slice=64),
    "default/w8": ChunkBlocks(num_warps=8),
    "default/v64": ChunkBlocks(value_block=64),
    "default/stages2": ChunkBlocks(num_stages=2, inter_num_stages=2),   # 2 stages where a launch has no own setting
    "default/inter-s1": ChunkBlocks(inter_num_stages=1),   # the sequential pass unpipelined (default before run 11)
    "default/inter-s2": ChunkBlocks(inter_num_stages=2),
    "default/inter-s3": ChunkBlocks(inter_num_stages=3),
    "default/stages3": ChunkBlocks(num_stages=3, inter_num_stages=3),
    "default/inter-s2/v64": ChunkBlocks(inter_num_stages=2, value_block=64),
    "default/inter-s2/iw8": ChunkBlocks(inter_num_stages=2, inter_num_warps=8),
    "default/tiles": ChunkBlocks(pairs="tiles"),                        # A_kk, A_qk by 16-row tiles (intra_tiles.py)
    "default/tiles/w2": ChunkBlocks(pairs="tiles", pairs_num_warps=2),
    "default/tiles/w1": ChunkBlocks(pairs="tiles", pairs_num_warps=1),
    # run 16-18's names: "default" was joint, "diagonal" the per-token diagonal blocks (intra_diagonal.py), "dh" heads
    # a program, "dw" its warps, "sliced" the inverse in the pairs launch and W, U by key slices
    "joint/diagonal": ChunkBlocks(pairs="diagonal", solve="whole", diagonal_heads=1, diagonal_num_warps=1),
    "joint/diagonal/dw2": ChunkBlocks(pairs="diagonal", solve="whole", diagonal_heads=1, diagonal_num_warps=2),
    "joint/diagonal/dh2": ChunkBlocks(pairs="diagonal", solve="whole", diagonal_heads=2),
    "joint/diagonal/dh4": ChunkBlocks(pairs="diagonal", solve="whole", diagonal_heads=4),
    "joint/sliced": ChunkBlocks(pairs="joint", solve="sliced"),
    "default/dh1": ChunkBlocks(diagonal_heads=1),
    "default/dh4": ChunkBlocks(diagonal_heads=4),
    # run 20's cumsum and W, U, ... settings against the defaults since (each pins what it varies). Run 20's
    # JSON names: "default/fs128/fw8" and "default/diagonal-cumsum" are today's default, "default/fw2" is fs32/fw2
    "default/pallas-cumsum": ChunkBlocks(cumsum="pallas"),   # the local cumsum in a launch of its own (before run 21)
    "default/fs32": ChunkBlocks(factors_slice=32, factors_num_warps=4),   # W, U, ...: 32 / 64 key columns a program
    "default/fs64": ChunkBlocks(factors_slice=64, factors_num_warps=4),   # at 4 warps (128 at 4 warps spills:
    "default/fs64/fw8": ChunkBlocks(factors_slice=64, factors_num_warps=8),   # triton_resources.py); 128 at 8
    "default/fs32/fw2": ChunkBlocks(factors_slice=32, factors_num_warps=2),   # is the default since run 21
    "default/rows": ChunkBlocks(diagonal_band=False),   # the per-token launch writes whole [C, C] rows (before run 21)
    "default/ks16": ChunkBlocks(key_slice=16),
    "default/pw8": ChunkBlocks(pairs_num_warps=8),
    "default/qk-bf16": ChunkBlocks(qk_norm="diagonal-bf16"),  # with raw q, k: normalised q, k written in bf16
    "default/qk-after": ChunkBlocks(qk_norm="diagonal-after"),  # ... the band scaled by 1 / |k_j| after the walk
    "default/scales": ChunkBlocks(qk_norm="scales"),     # ... only 1 / |q|, 1 / |k| handed on, q, k read as they came
    "default/scales-after": ChunkBlocks(qk_norm="scales-after"),
    "default/scales-after/dh4": ChunkBlocks(qk_norm="scales-after", diagonal_heads=4),
    # runs 25-26's tile forms, pinned (the tile launch's defaults since run 27: 1 warp, 3 stages, 16 key columns)
    "default/across-tiles": ChunkBlocks(across="tiles", **TILES(4, 1, 32)),   # 16 x 16 tiles across sub-blocks
    "default/across-tiles/pw2": ChunkBlocks(across="tiles", **TILES(2, 1, 32)),
    "default/across-tiles/pw1": ChunkBlocks(across="tiles", **TILES(1, 1, 32)),
    "default/across-tiles/ks16": ChunkBlocks(across="tiles", **TILES(4, 1, 16)),
    "default/across-tiles/ks16/pw1": ChunkBlocks(across="tiles", **TILES(1, 1, 16)),
    # ... their key-slice loops' loads pipelined (num_stages), at 1 and 2 warps
    "default/across-tiles/pw1/ps2": ChunkBlocks(across="tiles", **TILES(1, 2, 32)),
    "default/across-tiles/pw1/ps3": ChunkBlocks(across="tiles", **TILES(1, 3, 32)),
    "default/across-tiles/pw2/ps2": ChunkBlocks(across="tiles", **TILES(2, 2, 32)),
    "default/across-tiles/ks16/pw1/ps3": ChunkBlocks(across="tiles", **TILES(1, 3, 16)),   # the default since run 27
    # W, U, ...: one program a chunk walking slices of 32 / 64 columns in a loop whose loads are pipelined
    "default/factors-loop32/s2": ChunkBlocks(**LOOP(32, 4, 2)),
    "default/factors-loop32/s3": ChunkBlocks(**LOOP(32, 4, 3)),
    "default/factors-loop64/fw8/s2": ChunkBlocks(**LOOP(64, 8, 2)),
    "default/across-tiles/pw1/ps3/factors-loop32/s3": ChunkBlocks(across="tiles", pairs_num_warps=1,
                                                                  pairs_num_stages=3, **LOOP(32, 4, 3)),
    # per-token launch with fewer warps than heads (more elements a thread, fewer shuffles a step; prepared after
    # run 27: its loop is 217 PTX instructions a step at 1 warp for 2 heads against 2 x 133 at 2 warps)
    "default/dw1": ChunkBlocks(diagonal_num_warps=1),
    "default/dh4/dw1": ChunkBlocks(diagonal_heads=4, diagonal_num_warps=1),
    "default/dh4/dw2": ChunkBlocks(diagonal_heads=4, diagonal_num_warps=2),
    "default/exp2": ChunkBlocks(diagonal_exp2=True),      # ... its walk's exponentials as 2^x (also prepared)
    "default/exp2/dw1": ChunkBlocks(diagonal_exp2=True, diagonal_num_warps=1),
    # W, U, ... at 32 columns a loop step and 8 warps: 87 registers (sm_90a, q and k normalised inside), so two
    # programs a multiprocessor where 64 columns at 8 warps and 2 stages (139) allow one (timed in run 28, slower)
    "default/factors-loop32/fw8/s2": ChunkBlocks(**LOOP(32, 8, 2)),
    "default/factors-loop32/fw8/s3": ChunkBlocks(**LOOP(32, 8, 3)),
    "default/exp2/dw1/factors-loop32/fw8/s3": ChunkBlocks(diagonal_exp2=True, diagonal_num_warps=1, **LOOP(32, 8, 3)),
    # q, k handed on in bf16 (as fla's norm returns them) under the tile launch: its registers 245 -> 168 at 1 warp
    # (8 -> 12 programs a multiprocessor); "default/qk-bf16" was last timed with the levels launch (run 23)
    "default/qk-bf16/exp2/dw1": ChunkBlocks(**QB, diagonal_num_warps=1),
    "default/qk-bf16/exp2/dw1/factors-loop32/fw8/s2": ChunkBlocks(**QB, diagonal_num_warps=1, **LOOP(32, 8, 2)),
    # around the fastest form of run 28 (H100), the defaults since: q, k handed on in bf16, 2^x, fewer warps in the
    # per-token launch (so on bf16 values "default/qk-bf16/exp2/dw1" above, and also "default/exp2/dw1",
    # "default/exp2", "default/dw1" and "default/qk-bf16" now equal "default": run 28's and earlier runs' names)
    "default/qk-bf16/exp2/dh4/dw1": ChunkBlocks(**QB, diagonal_heads=4, diagonal_num_warps=1),
    "default/qk-bf16/exp2/dh4/dw2": ChunkBlocks(**QB, diagonal_heads=4, diagonal_num_warps=2),
    "default/qk-bf16/exp2/dh1": ChunkBlocks(**QB, diagonal_heads=1),
    "default/qk-bf16/exp2/dw1/inter-s2": ChunkBlocks(**QB, diagonal_num_warps=1, inter_num_stages=2),
    "default/qk-bf16/exp2/dw1/ps2": ChunkBlocks(**QB, diagonal_num_warps=1, across="tiles", **TILES(1, 2, 16)),
    "default/qk-bf16/exp2/dw1/factors-loop64/fw8/s3": ChunkBlocks(**QB, diagonal_num_warps=1, **LOOP(64, 8, 3)),
    # (since run 29 the W, U loop runs in 3 stages by default, so the last equals "default", and "run29" the
    # defaults before, as "default/factors-loop64/fw8/s2" now does)
    "run27": ChunkBlocks(**WALK27, factors_num_stages=2, **RUN30_PAIRS),   # run 27's ("default" in runs 27 and 28)
    "run29": ChunkBlocks(factors_num_stages=2, **RUN30_PAIRS),   # run 29's ("default" there): W, U in 2 stages
    # the tile pairs launch's decays as 2^x and its products in one loop over key slices: the defaults since run 31
    # (so run 31's "default/pairs-exp2/one-loop" is now "default"); "run30" the defaults before, and each alone
    "run30": ChunkBlocks(**RUN30_PAIRS),
    "run30/pairs-exp2": ChunkBlocks(pairs_one_loop=False),
    "run30/pairs-one-loop": ChunkBlocks(pairs_exp2=False),
    # q e^G from the pairs launch, not W, U's: run 31 timed it with run 30's pairs forms ("default/qg-in-pairs"
    # then), 1% slower than without (3.113 against 3.077 ms pipelined at H = 96); with today's, untimed
    "run30/qg-in-pairs": ChunkBlocks(**RUN30_PAIRS, qg_in_pairs=True),
    "default/qg-in-pairs": ChunkBlocks(qg_in_pairs=True),
    # the sequential pass on 64-column state blocks: half the programs, each reading W, q e^G, k e^(G_C - G) for
    # twice the columns (at H = 96: 192 programs, one stage by the auto rule; 2 stages timed in run 10 only)
    "default/v64": ChunkBlocks(value_block=64),
    "default/across-levels": ChunkBlocks(across="levels"),   # the levels and the [C, C] doubling (before run 27)
    "run24": ChunkBlocks(across="levels", factors_loop=False, factors_slice=128, **WALK27),   # run 24's defaults
    "run20": ChunkBlocks(diagonal_band=False, cumsum="pallas", across="levels", factors_loop=False, factors_slice=32,
                         factors_num_warps=4, **WALK27),  # run 20's: the levels, a program a 32-column slice
    "column/v64": ChunkBlocks(intra="column", value_block=64, **FP32_FACTORS),
    "blocked/v64": ChunkBlocks(intra="blocked", value_block=64, **FP32_FACTORS),
    "blocked/v32": ChunkBlocks(intra="blocked", value_block=32, **FP32_FACTORS),
    "parallel/v32": ChunkBlocks(intra="parallel", value_block=32, **FP32_FACTORS),
    "parallel/v32/ks16": ChunkBlocks(intra="parallel", value_block=32, key_slice=16, **FP32_FACTORS),
    "parallel/v32/w8": ChunkBlocks(intra="parallel", value_block=32, num_warps=8, **FP32_FACTORS),
    "parallel/v16": ChunkBlocks(intra="parallel", value_block=16, **FP32_FACTORS),
    "parallel/v32/separate": ChunkBlocks(intra="parallel", value_block=32, pairs="separate", **FP32_FACTORS),
    "parallel/v32/w8/separate": ChunkBlocks(intra="parallel", value_block=32, num_warps=8, pairs="separate", **FP32_FACTORS),
    "parallel/v32/bf16": ChunkBlocks(intra="parallel", value_block=32, **BF16),
    "parallel/v32/bf16/cumsum": ChunkBlocks(intra="parallel", value_block=32, **(BF16 | dict(cumsum="pallas"))),
    "parallel/v32/bf16/tf32": ChunkBlocks(intra="parallel", value_block=32, **(BF16 | dict(inverse="tf32"))),
    "parallel/v64/bf16": ChunkBlocks(intra="parallel", value_block=64, **BF16),
    "parallel/v16/bf16": ChunkBlocks(intra="parallel", value_block=16, **BF16),
    "parallel/v16/default": ChunkBlocks(value_block=16),
    "blocked/v32/bf16": ChunkBlocks(intra="blocked", value_block=32, **BF16),
    "blocked/v32/split": ChunkBlocks(intra="blocked", value_block=32, inter="split", **FP32_FACTORS),
    "parallel/v32/split": ChunkBlocks(intra="parallel", value_block=32, inter="split", **FP32_FACTORS),
}


def fla_kernel_times(torch, fn, calls: int = 10) -> dict[str, float]:
    """fla's device microseconds per call by kernel name (torch.profiler over `calls` calls), longest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name[:100]] = totals.get(e.name[:100], 0.0) + e.time_range.elapsed_us() / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def fla_profiles_now(pending) -> None:
    """Profiles fla's kernels for each (row, torch, call) in `pending` into row["fla_kernel_us"]: after every jax
    trace of the process (torch's profiler keeps CUPTI, and a jax trace started after it records host events
    only), so a run cut short before this loses fla's kernel times but nothing else."""
    for row, torch, fla_call in pending:
        row["fla_kernel_us"] = {k_: round(v_, 1) for k_, v_ in fla_kernel_times(torch, fla_call).items()}
        print(f"  fla kernels at H = {row['H']}, T = {row['T']}: {row['fla_kernel_us']}", flush=True)


def prefill_rows(shapes, fla, iters, variants=None, profile=False, qk_dtypes=("float32",), save=None, pending=None):
    """variants: names from VARIANTS to time (None: all). profile: device time per kernel of each
    variant's call (and of fla's) from a profiler trace. qk_dtypes: q and k as our kernels get them after
    the L2 norm (fp32, as the models passed them before normalize_qk, or rounded to bf16 as fla's norm returns
    them; the XLA reference always takes fp32), or "raw": as they leave the conv, the call normalising them
    (`normalize_qk=True`, as the models pass them now); each variant is timed with each, "<name>@qk-bf16" for
    bf16, "<name>@norm-in" for raw. Each call is timed alone (host timer around one call and its
    synchronisation; fla: CUDA events around one call) and pipelined (`iters` calls back to back, one wait at
    the end; fla: between two CUDA events), where the host's dispatch hides behind the device. save: called
    with the rows so far (the shape in progress marked "partial") after every variant and every shape, so a run
    cut short by its time limit keeps what it measured. pending: a list that collects fla's kernel profiles for
    the caller to take with `fla_profiles_now` after its last jax trace (None: taken here after the last shape)."""
    suffix = {"float32": "", "bfloat16": "@qk-bf16", "raw": "@norm-in"}
    chosen = {(n + suffix[qd], qd): VARIANTS[n].resolve("bfloat16")
              for n in (variants or VARIANTS) for qd in qk_dtypes}   # bf16 q, k, v below
    rows, fla_profiles = [], ([] if pending is None else pending)
    for (b, t, h, kd) in shapes:
        key = jax.random.key(h)
        ks = jax.random.split(key, 6)
        q = jax.random.normal(ks[0], (b, t, h, kd), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, t, h, kd), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, t, h, kd), jnp.bfloat16)
        g = -jnp.exp(jax.random.normal(ks[3], (b, t, h, kd), jnp.float32) - 2.0)   # log decay < 0
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h), jnp.float32))
        s0 = jax.random.normal(ks[5], (b, h, kd, kd), jnp.float32) * 0.1
        ref = jax.jit(lambda q, k, v, g, beta, s0: kda_chunk_xla(l2(q), l2(k), v, g, beta, initial_state=s0))
        o_ref, s_ref = ref(q, k, v, g, beta, s0)
        t_ref, _ = median_time(lambda: ref(q, k, v, g, beta, s0), warmup=1, iters=max(3, iters // 10))
        variants = {}
        for (name, qk_dtype), blocks in chosen.items():
            raw = qk_dtype == "raw"     # the call normalises q and k (inside its kernels where it can)
            inside = raw and blocks.normalizes_qk
            # q, k as the intra pass alone gets them (raw where the per-token launch normalises)
            l2_in = (lambda x: x) if inside else l2 if raw else (lambda x, d=qk_dtype: l2(x).astype(d))
            ours = jax.jit(lambda q, k, v, g, beta, s0, blocks=blocks, raw=raw: kda_chunk_pallas(
                q if raw else l2_in(q), k if raw else l2_in(k), v, g, beta, initial_state=s0, blocks=blocks,
                normalize_qk=raw))
            t_v, _ = median_time(lambda: ours(q, k, v, g, beta, s0), iters=iters)
            t_pipe = pipelined_time(lambda: ours(q, k, v, g, beta, s0), calls=iters)
            o, s = ours(q, k, v, g, beta, s0)
            tokens = blocks.reads_tokens    # the two passes timed alone, in the layout the variant's call uses
            split = to_chunk_rows if tokens else to_chunks
            parts = jax.jit(lambda *xs: [split(x, blocks.chunk) for x in xs])(l2_in(q), l2_in(k), v, g, beta)
            intra = jax.jit(lambda *p_, blocks=blocks, tokens=tokens, inside=inside: chunk_intra(
                *p_, scale=kd ** -0.5, blocks=blocks, interpret=default_interpret(), tokens=tokens, normalize=inside))
            t_intra, _ = median_time(lambda: intra(*parts), iters=iters)
            factors = intra(*parts)
            inter = jax.jit(lambda *f_, blocks=blocks, tokens=tokens: chunk_inter(
                *f_, out_dtype=v.dtype, blocks=blocks, interpret=default_interpret(), tokens=tokens))
            t_inter, _ = median_time(lambda: inter(*factors, s0), iters=iters)
            variants[name] = {"ms": t_v * 1e3, "pipelined_ms": t_pipe * 1e3, "intra_ms": t_intra * 1e3,
                              "inter_ms": t_inter * 1e3,
                              "err_o": rel(o, o_ref), "err_state": rel(s, s_ref)}
            if profile:     # span: first kernel's start to last one's end a call (back to back), so idle included
                times, span = kernel_trace(ours, (q, k, v, g, beta, s0), calls=10)
                variants[name]["kernel_us"] = {k_: round(v_, 1) for k_, v_ in times.items()}
                variants[name]["span_us"] = round(span, 1)
            print(f"  {name}: {variants[name]}", flush=True)
            if save is not None:
                save(rows + [{"B": b, "T": t, "H": h, "K": kd, "partial": True, "variants": variants}])
        best = min(variants, key=lambda n_: variants[n_]["ms"])
        t_ours = variants[best]["ms"] / 1e3
        row = {"B": b, "T": t, "H": h, "K": kd, "ours_ms": t_ours * 1e3, "variant": best, "xla_ref_ms": t_ref * 1e3,
               "ours_pipelined_ms": min(v_["pipelined_ms"] for v_ in variants.values()),
               "variant_pipelined": min(variants, key=lambda n_: variants[n_]["pipelined_ms"]),
               "err_o_vs_ref": variants[best]["err_o"], "err_state_vs_ref": variants[best]["err_state"],
               "variants": variants}
        if fla is not None:
            torch, chunk_kda, _ = fla
            tt = lambda x: torch.from_dlpack(x)
            tq, tk, tv, tg, tb, ts = (tt(q), tt(k), tt(v), tt(g), tt(beta), tt(s0))
            t0 = time.perf_counter()
            fo, fs = chunk_kda(tq, tk, tv, tg, tb, initial_state=ts, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
            torch.cuda.synchronize()
            row["fla_first_call_s"] = time.perf_counter() - t0
            fla_call = functools.partial(chunk_kda, tq, tk, tv, tg, tb, initial_state=ts, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)   # this shape's tensors, bound now
            t_fla = torch_time(torch, fla_call, iters=iters)
            t_fla_pipe = torch_time(torch, fla_call, iters=5, calls=iters)
            row.update(fla_ms=t_fla * 1e3, speedup_vs_fla=t_fla / t_ours, fla_pipelined_ms=t_fla_pipe * 1e3,
                       speedup_pipelined_vs_fla=t_fla_pipe / (row["ours_pipelined_ms"] / 1e3),
                       err_fla_vs_ref=rel(fo.float().cpu().numpy(), o_ref))
            if profile:     # after every jax trace (`fla_profiles_now`)
                fla_profiles.append((row, torch, fla_call))
        rows.append(row)
        if save is not None:
            save(rows)
        print("prefill", {k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
    if pending is None:
        fla_profiles_now(fla_profiles)
        if fla_profiles and save is not None:
            save(rows)
    return rows


def _stream_kernel(d_ref, s_ref, o_ref):
    """The state traffic of the one-token kernel alone: s [K, V] -> s * sigmoid(d)[:, None], one (row, head) (a
    decay in (0, 1), so repeated timed calls keep the state finite)."""
    o_ref[...] = (s_ref[...].astype(jnp.float32) * jax.nn.sigmoid(d_ref[...].astype(jnp.float32))[:, None]
                  ).astype(o_ref.dtype)


def state_stream(decay, state, *, num_warps: int, interpret: bool | None = None):
    """`_stream_kernel` over grid (row, head), the state aliased in place: what the decode launch's read and write
    of the state cost with nothing else in the program (the ceiling of its access pattern)."""
    b, h, kd, vd = state.shape
    return pl.pallas_call(
        _stream_kernel, grid=(b, h),
        in_specs=[pl.BlockSpec((None, None, kd), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((None, None, kd, vd), lambda i, j: (i, j, 0, 0))],
        out_specs=pl.BlockSpec((None, None, kd, vd), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(state.shape, state.dtype), input_output_aliases={1: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=default_interpret() if interpret is None else interpret,
        name="kda_state_stream")(decay, state)


def decode_rows(batches, h, kd, layers, fla, iters, warps=(8,), state_dtype=jnp.float32, splits=(1,), columns=(0,),
                ceiling=False, profile=False, hopper_forms=(), decode_steps=1, on_row=None):
    """decode_steps: decode steps a call runs, each over all `layers` (times are per layer and step; the ceilings
    stay one pass a layer): with more steps the host's cost of dispatching a call (its 6 arrays a layer) is shared
    by more launches, as in the model's decode loop, which runs many steps a call. The steps repeat the same
    inputs, so the XLA reference's time (whose steps XLA may fuse) and the errors after several steps are not
    those of one step. on_row: called with each row as it is done (to save partial results).
    hopper_forms: forms of the Mosaic GPU step (`kda_decode_hopper`, labels "hopper/<form>"): a
    HopperDecodeBlocks.factors, optionally "/after" (refill="after"); the stages that fit; skipped where K is not
    a multiple of 64, "kernel" where K is not a multiple of 128;
    with "xla" its time includes the XLA fusion of the factors before it, its device time (profile) the kernel
    alone.
    splits: DecodeBlocks.value_blocks tried with each warp count (0: the auto rule); a split
    launch's time includes the output norm that runs after it. columns: DecodeBlocks.column_block of the
    unsplit launch (0: the whole state at once). ceiling: also time the state's read and write alone
    (`state_stream` at each warp count, and XLA's elementwise scale of the whole state). profile: also the kernel's
    device time per layer from a profiler trace (`device_us_per_layer_by_launch`: free of the host timer's spread),
    and every kernel's device time and the device span a layer over chained calls with the states donated
    (`device_all_kernels_...`, `device_span_...`). Each launch is timed a call at a time (host timer, synchronised
    after each 20-layer call) and pipelined (`iters` calls back to back, one wait at the end, as in a decode loop
    that never waits on the host). Each call carries the layers' recurrent states and conv windows, donated, as
    the model's decode loop does (until run 30 only the states were: XLA then copied every layer's conv window
    before its launch, which updates it in place)."""
    rows, per_call = [], layers * decode_steps     # launches a call (a layer's step each): times are per launch
    for b in batches:
        ks = jax.random.split(jax.random.key(b), 10)
        n = lambda i, shape, dt=jnp.float32, s=1.0: (s * jax.random.normal(ks[i], shape, jnp.float32)).astype(dt)
        per_layer = lambda i, shape, dt=jnp.float32, s=1.0: tuple(
            n(i, shape, dt, s) * 1 for _ in range(layers))  # separate buffers, no slicing in the timed call
        x = per_layer(0, (b, 3, h, kd), jnp.bfloat16)
        conv = per_layer(1, (b, 3, 3, h, kd), jnp.bfloat16)
        w = n(2, (4, 3, h, kd), s=0.5)      # the q, k, v taps
        f = per_layer(3, (b, h, kd), jnp.bfloat16)
        dt_b, a_log = n(4, (h, kd)), n(5, (h, kd))
        bl, z = per_layer(6, (b, h), jnp.bfloat16), per_layer(7, (b, h, kd), jnp.bfloat16)
        nw = n(8, (kd,))
        states = per_layer(9, (b, h, kd, kd), state_dtype, s=0.1)

        weights = KDADecodeWeights(q_conv=w[:, 0], k_conv=w[:, 1], v_conv=w[:, 2], dt_bias=dt_b, a_log=a_log, o_norm_w=nw)

        def fresh():
            """(states, conv windows): copies of the layers' starting ones, to be donated."""
            return tuple(s_ + 0 for s_ in states), tuple(c_ + 0 for c_ in conv)

        def run(step, donate=True):
            def layers_fn(carry, x, f, bl, z):
                # one launch per layer and step; the recurrent states and conv windows carried (and donated) as
                # the model's decode loop carries them, so both are updated in place
                for _ in range(decode_steps):
                    outs = [step(KDADecodeInputs(x[i], f[i], bl[i], z[i]), weights, carry[1][i], carry[0][i])
                            for i in range(layers)]
                    carry = tuple(o[2] for o in outs), tuple(o[1] for o in outs)
                return carry
            return jax.jit(layers_fn, donate_argnums=0 if donate else ())

        def device_us(step):
            """Device time of the decode launches per launch (a layer's step), from a trace (the states not donated,
            so XLA copies them before the kernels; only the kernels named kda_decode* are summed)."""
            times = kernel_times(run(step, donate=False), ((states, conv), x, f, bl, z), calls=5)
            ours_us = [us for name, us in times.items() if name.startswith("kda_decode")]
            return sum(ours_us) / per_call if ours_us else None          # None off a GPU (no device lanes)

        def chained(fn):
            """A call without arguments running `fn` on the states the previous call returned (donated)."""
            st = [fresh()]

            def call():
                st[0] = fn(st[0], x, f, bl, z)
                return st[0]
            return call

        def device_all(fn):
            """(every kernel's device us a launch, the device span a launch) over chained, donated calls: what
            the device does between and around the decode kernels (copies, XLA fusions, idle gaps)."""
            times, span = call_trace(chained(fn), calls=5)
            return (sum(times.values()) / per_call, span / per_call) if times else (None, None)

        def timed(fn):
            st = fresh()
            for _ in range(3):
                st = jax.block_until_ready(fn(st, x, f, bl, z))
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                st = jax.block_until_ready(fn(st, x, f, bl, z))
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        ref = run(kda_decode_xla)
        t_ref = timed(ref)
        s_r, c_r = (part[-1] for part in ref(fresh(), x, f, bl, z))
        by_launch, errs, conv_errs, device = {}, {}, {}, {}
        launches = [(nwarps, split, col) for nwarps in warps for split in splits
                    for col in (columns if split == 1 else (0,))]
        steps = {}
        for nwarps, split, col in launches:
            if (split and not value_blocks_fit(kd, split)) or (col and (col >= kd or kd % col)):
                continue                 # a column block of the whole head (or more) is the whole-state launch
            try:
                blocks = DecodeBlocks(num_warps=nwarps, value_blocks=split, column_block=col)
                label = (f"{nwarps}w/{blocks.value_blocks_for(b, h, kd)}v" + (" (auto)" if split == 0 else "")
                         + (f"/loop{col}" if col else ""))
            except ValueError as e:       # 8 warps over a whole state: refused (a state 3% off, run 34)
                print(f"skipped {nwarps} warps, value_blocks={split}: {e}")
                continue
            steps[label] = lambda *args, blocks=blocks: kda_decode_pallas(*args, blocks=blocks)
        for form in hopper_forms if hopper_decode_runs_here(kd, state_dtype) else ():
            factors, _, refill = form.partition("/")
            blocks = HopperDecodeBlocks(factors=factors, refill=refill or "before")
            if factors == "kernel" and kd % KERNEL_FACTORS_K:
                continue                                            # the "kernel" form does not lower at this K
            steps[f"hopper/{form}"] = lambda *args, blocks=blocks: kda_decode_hopper(*args, blocks=blocks)
        pipelined, device_all_layer, device_span_layer = {}, {}, {}
        for label, step in steps.items():
            ours = run(step)
            by_launch[label] = timed(ours)
            pipelined[label] = pipelined_time(chained(ours), calls=iters) / per_call * 1e6
            if profile and (us := device_us(step)) is not None:
                device[label] = us
                device_all_layer[label], device_span_layer[label] = device_all(ours)
            s_o, c_o = (part[-1] for part in ours(fresh(), x, f, bl, z))
            errs[label], conv_errs[label] = rel(s_o, s_r), rel(c_o, c_r)
        ceilings, ceilings_pipelined = {}, {}
        if ceiling:
            def stream(fn):
                # one pass a layer whatever `decode_steps`: XLA would fuse the elementwise passes of several
                # steps into one, halving the traffic the ceiling is meant to time
                return jax.jit(lambda states, f: tuple(fn(f[i], states[i]) for i in range(layers)), donate_argnums=0)
            for nwarps in warps:
                fn = stream(functools.partial(state_stream, num_warps=nwarps))
                streamed = lambda carry, x_, f_, b_, z_, fn=fn: (fn(carry[0], f_), carry[1])
                ceilings[f"pallas stream {nwarps}w"] = timed(streamed)
                ceilings_pipelined[f"pallas stream {nwarps}w"] = pipelined_time(chained(streamed), calls=iters)
            fn = stream(lambda d, s_: (s_.astype(jnp.float32) * jax.nn.sigmoid(d.astype(jnp.float32))[..., None]
                                       ).astype(s_.dtype))
            streamed = lambda carry, x_, f_, b_, z_, fn=fn: (fn(carry[0], f_), carry[1])
            ceilings["xla scale"] = timed(streamed)
            ceilings_pipelined["xla scale"] = pipelined_time(chained(streamed), calls=iters)
        best = min(by_launch, key=by_launch.get)
        t_ours = by_launch[best]
        bytes_layer = 2 * b * h * kd * kd * jnp.dtype(state_dtype).itemsize
        per = t_ours / per_call
        row = {"B": b, "H": h, "state": jnp.dtype(state_dtype).name, "layers": layers, "steps": decode_steps,
               "us_per_layer": per * 1e6, "launch": best,
               "TB_s": bytes_layer / per / 1e12, "pct_4.3TB_s": bytes_layer / per / HBM_ACHIEVABLE * 100,
               "xla_ref_us_per_layer": t_ref / per_call * 1e6, "err_state_vs_ref": max(errs.values()),
               "err_conv_vs_ref": max(conv_errs.values()), "err_state_vs_ref_by_launch": errs,
               "us_per_layer_by_launch": {str(k_): v_ / per_call * 1e6 for k_, v_ in by_launch.items()},
               "pipelined_us_per_layer_by_launch": pipelined,
               "pipelined_us_per_layer": min(pipelined.values()),   # the fastest launch, as a decode loop runs it
               "pipelined_launch": min(pipelined, key=pipelined.get),
               "pipelined_pct_4.3TB_s": bytes_layer / (min(pipelined.values()) * 1e-6) / HBM_ACHIEVABLE * 100}
        if device:
            row["device_us_per_layer_by_launch"] = device
            row["device_all_kernels_us_per_layer_by_launch"] = device_all_layer
            row["device_span_us_per_layer_by_launch"] = device_span_layer
            row["device_pct_4.3TB_s_by_launch"] = {k_: bytes_layer / (v_ * 1e-6) / HBM_ACHIEVABLE * 100
                                                   for k_, v_ in device.items()}
        if ceilings:
            row["ceiling_us_per_layer"] = {k_: v_ / layers * 1e6 for k_, v_ in ceilings.items()}
            row["ceiling_pipelined_us_per_layer"] = {k_: v_ / layers * 1e6 for k_, v_ in ceilings_pipelined.items()}
            row["ceiling_pct_4.3TB_s"] = {k_: bytes_layer / (v_ / layers) / HBM_ACHIEVABLE * 100
                                          for k_, v_ in ceilings.items()}
        if fla is not None and jnp.dtype(state_dtype) == jnp.float32:
            torch, _, fused_recurrent_kda = fla
            tq = torch.randn(b, 1, h, kd, device="cuda", dtype=torch.bfloat16)
            tk, tv = torch.randn_like(tq), torch.randn_like(tq)
            tg = -torch.rand(b, 1, h, kd, device="cuda")
            tb = torch.rand(b, 1, h, device="cuda")
            ts = torch.randn(b, h, kd, kd, device="cuda")
            t_fla = torch_time(torch, lambda: fused_recurrent_kda(tq, tk, tv, tg, tb, initial_state=ts,
                                                                  output_final_state=True,
                                                                  use_qk_l2norm_in_kernel=True), iters=iters)
            row.update(fla_us=t_fla * 1e6, fla_TB_s=bytes_layer / t_fla / 1e12)
        rows.append(row)
        if on_row is not None:
            on_row(row)
        print("decode", {k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-fla", action="store_true", help="skip the fla columns (its autotune takes ~90 s a shape)")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--heads", nargs="+", type=int, default=[32, 96], help="prefill head counts")
    ap.add_argument("--lengths", nargs="+", type=int, default=[8192], help="prefill sequence lengths T (B = 1)")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="prefill kernel variants to time (default all)")
    ap.add_argument("--qk-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "raw"],
                    help="prefill: q and k after the L2 norm as the kernels get them (each variant timed with each; "
                         "raw: as they leave the conv, normalize_qk=True)")
    ap.add_argument("--name", help="the JSON's file name (default kda, kda_prefill or kda_decode)")
    ap.add_argument("--profile", action="store_true",
                    help="prefill: device time per kernel (ours and fla's); decode: the kernel's device time per layer")
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8, 16], help="num_warps of the decode launches")
    ap.add_argument("--hopper-forms", nargs="*", default=["kernel", "kernel/after", "xla"],
                    choices=["kernel", "kernel/after", "xla", "xla/after"],
                    help="forms of the Mosaic GPU decode step (kda_decode_hopper: HopperDecodeBlocks.factors, "
                         "/after: refill after the state pass); none to skip it")
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 0],
                    help="column blocks per head of the one-token kernel (DecodeBlocks.value_blocks; 0: auto)")
    ap.add_argument("--column-blocks", nargs="+", type=int, default=[0],
                    help="state columns per loop step of the unsplit one-token kernel (DecodeBlocks.column_block: "
                         "a power of two >= 16; 0: the whole state at once)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256], help="decode batch sizes")
    ap.add_argument("--ceiling", action="store_true",
                    help="decode: also time the state's read and write alone (the access pattern's ceiling)")
    ap.add_argument("--steps", type=int, default=1,
                    help="decode: steps a call runs over its layers (more: the call's dispatch shared by more "
                         "launches, as in the model's decode loop)")
    ap.add_argument("--layers", type=int, default=20,
                    help="decode: layers a call runs, each with its own state (more than the L2 holds: no step "
                         "finds the previous step's state of its layer in L2; 2.1 MB a layer at B = 1)")
    ap.add_argument("--state-dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="recurrent state dtypes of the decode rows (bfloat16: the kda_state option)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.layers < 1:
        ap.error(f"--steps and --layers must be >= 1; got {args.steps} and {args.layers}")
    name = args.name or "kda" + ("_small" if args.small else "_decode" if args.decode_only else
                                 "_prefill" if args.prefill_only else "")
    save = lambda pre, dec=(): write(name, {"benchmark": "kda", "env": environment(), "prefill": pre,
                                            "decode": list(dec), "partial": True})
    fla = None if (args.small or args.no_fla) else fla_functions()
    if args.small:
        pre = [] if args.decode_only else prefill_rows([(1, 96, 4, 16)], None, 3, args.variants, args.profile,
                                                       args.qk_dtypes, save)     # H = 4: variants of 4 heads a program
        dec = [] if args.prefill_only else [
            row for sd in args.state_dtype
            for row in decode_rows([1, 2], 2, 64, 3, None, 3, state_dtype=sd, splits=args.splits,
                                   columns=args.column_blocks, ceiling=args.ceiling, profile=args.profile,
                                   hopper_forms=args.hopper_forms, decode_steps=args.steps)]
    else:
        pending = []       # fla's kernel profiles, taken after the decode rows' jax traces
        pre = [] if args.decode_only else prefill_rows([(1, t, h, 128) for h in args.heads for t in args.lengths],
                                                       fla, args.iters, args.variants, args.profile, args.qk_dtypes,
                                                       save, pending)
        done = []       # the decode rows so far, saved after each (a step's time limit keeps what it measured)
        on_row = lambda row: (done.append(row), save(pre, done))
        dec = [] if args.prefill_only else [row for sd in args.state_dtype
               for row in decode_rows(args.batches, 32, 128, args.layers, fla, args.iters, warps=tuple(args.warps),
                                      state_dtype=sd, splits=args.splits, columns=args.column_blocks,
                                      ceiling=args.ceiling, profile=args.profile,
                                      hopper_forms=args.hopper_forms, decode_steps=args.steps, on_row=on_row)]
        fla_profiles_now(pending)
    record = {"benchmark": "kda", "env": environment(), "prefill": pre, "decode": dec}
    path = write(name, record)
    print(table(pre, ["B", "T", "H", "ours_ms", "fla_ms", "speedup_vs_fla", "ours_pipelined_ms", "fla_pipelined_ms",
                      "speedup_pipelined_vs_fla", "err_o_vs_ref"]))
    print(table(dec, ["B", "H", "state", "us_per_layer", "TB_s", "pct_4.3TB_s", "pipelined_us_per_layer",
                      "pipelined_launch", "pipelined_pct_4.3TB_s", "fla_us",
                      "fla_TB_s", "xla_ref_us_per_layer", "err_state_vs_ref"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
