"""Device time per kernel of one jitted call, from a jax.profiler trace.

A chained or host timer gives the time of a whole call; this says which kernels it is made of
(the Pallas kernel itself, the small XLA fusions around it) and how long each runs on the device:

    times = kernel_times(fn, args, calls=20)   # {kernel name: us per call}
    main_us = max(times.values())
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile
from collections import defaultdict
from typing import Callable

import jax


def _gpu_kernel_events(trace_file: str) -> list[dict]:
    """Complete events ("X") on the device lanes of a perfetto trace (kernels and copies)."""
    with gzip.open(trace_file) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in procs.items() if "/device:GPU" in name or "GPU:" in name}
    return [e for e in events if e.get("ph") == "X" and "dur" in e and e["pid"] in device
            and not str(e.get("name", "")).startswith(("while", "cond", "conditional"))]


def kernel_times(fn: Callable, args: tuple, *, calls: int = 20) -> dict[str, float]:
    """Mean device microseconds per call of each kernel that `fn(*args)` launches ({} when the
    trace has no device lane, e.g. on the CPU). `fn` is jitted and warmed up first."""
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                out = jitted(*args)
            jax.block_until_ready(out)
        files = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True))
        if not files:
            return {}
        events = _gpu_kernel_events(files[-1])
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        totals[str(e["name"])[:100]] += e["dur"]
    return {name: us / calls for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}
