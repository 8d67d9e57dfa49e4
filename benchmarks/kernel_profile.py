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
    return kernel_trace(fn, args, calls=calls)[0]


def kernel_trace(fn: Callable, args: tuple, *, calls: int = 20) -> tuple[dict[str, float], float]:
    """(`kernel_times`, the device span per call in us: from the first kernel's start to the last one's end
    over the `calls` back-to-back calls, divided by `calls`). The span less the kernels' sum is the time the
    device sat idle between kernels (launch gaps, or the host not keeping up); 0.0 off a GPU."""
    jitted = jax.jit(fn)
    return call_trace(lambda: jitted(*args), calls=calls)


def call_trace(call: Callable[[], object], *, calls: int = 20) -> tuple[dict[str, float], float]:
    """`kernel_trace` of a call without arguments, which may carry its own state from call to call (donated
    buffers chained through a closure, so no copy of them enters the trace). Warmed up once first."""
    if jax.default_backend() != "gpu":
        return {}, 0.0
    jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                out = call()
            jax.block_until_ready(out)
        events = device_events(latest_trace(trace_dir), None, gpu_only=True)
    if not events:
        print("call_trace: the trace holds no GPU kernels (the device tracer did not start?)", flush=True)
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        totals[str(e["name"])[:100]] += e["dur"]
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / calls if events else 0.0
    return {name: us / calls for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}, span
