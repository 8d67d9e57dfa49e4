"""Shared benchmark plumbing: environment record, timing, JSON + markdown output."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import time
from typing import Callable

import jax

HBM_ACHIEVABLE = 4.3e12   # measured device copy on the H200 (performance.md)
HBM_DATASHEET = 4.8e12
BF16_ACHIEVABLE = 790e12


def environment() -> dict:
    dev = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
            "jax": jax.__version__, "commit": os.environ.get("K3JAX_COMMIT", commit)}


def median_time(fn: Callable[[], object], *, warmup: int = 3, iters: int = 20) -> tuple[float, list[float]]:
    """Median seconds of `fn()` (its result blocked on) after warm-up calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def pipelined_time(fn: Callable[[], object], *, calls: int = 20, repeats: int = 5, warmup: int = 3) -> float:
    """Median over `repeats` of the seconds per call of `calls` calls of `fn()` issued back to back with one
    block at the end: the host enqueues ahead while the device runs, so its dispatch and synchronisation cost
    is hidden whenever a call runs longer on the device than it takes to launch (as inside a compiled model,
    or a CUDA-event timing of eager calls). Calls of `fn` must be independent or chain their own state."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    per_call = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn()       # earlier outputs freed as they are replaced (the device still runs in order)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t) / calls)
    return statistics.median(per_call)


def chained_time(fn: Callable, args: tuple, *, reps: int = 20, iters: int = 10, unroll: bool = False) -> float:
    """Median seconds per call of `fn(*args)` with `reps` calls chained in one compiled loop (each
    call's first argument nudged by the previous output, so none can be hoisted): the host's
    dispatch and synchronisation cost, which a per-call timer adds to short kernels, is amortised.
    `unroll`: the calls one after another in one program instead of a device loop (whose every
    iteration waits on the host for its condition; for calls of ~100 us that wait is a visible part)."""
    import jax.numpy as jnp

    def chain(first, *rest):
        def body(_, carry):
            # The barrier keeps the whole output computed: taking one element of it directly lets XLA
            # shrink an elementwise tail after the kernel (a cast, a merge) to that one element.
            out = jax.lax.optimization_barrier(fn(first + carry.astype(first.dtype), *rest))
            return jnp.ravel(out)[0].astype(jnp.float32) * 1e-30

        if unroll:
            carry = jnp.float32(0)
            for i in range(reps):
                carry = body(i, carry)
            return carry
        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))

    loop = jax.jit(chain)           # the arrays are arguments, not constants folded into the program
    t, _ = median_time(lambda: loop(*args), iters=iters)
    return t / reps


def write(name: str, record: dict, out_dir: str | None = None) -> str:
    out_dir = out_dir or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
