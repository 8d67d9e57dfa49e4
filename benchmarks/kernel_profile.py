"""Device time per kernel of one jitted call, from a jax.profiler trace.

A chained or host timer gives the time of a whole call; this says which kernels it is made of
(the Pallas kernel itself, the small XLA fusions around it) and how long each runs on the device:

    times = kernel_times(fn, args, calls=20)   # {kernel name: us per call}
    main_us = max(times.values())
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from typing import Callable

import jax

from benchmarks.profile_summary import device_events, latest_trace


def kernel_times(fn: Callable, args: tuple, *, calls: int = 20) -> dict[str, float]:
    """Mean device microseconds per call of each kernel that `fn(*args)` launches, longest first
    ({} off a GPU, where the trace has no device lanes). `fn` is jitted and warmed up first."""
    if jax.default_backend() != "gpu":
        return {}
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                out = jitted(*args)
            jax.block_until_ready(out)
        events = device_events(latest_trace(trace_dir), None)
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        totals[str(e["name"])[:100]] += e["dur"]
    return {name: us / calls for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}
