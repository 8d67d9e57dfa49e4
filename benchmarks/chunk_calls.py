"""What one compiled decode-chunk call costs besides its model steps, untraced: the same carry
handed from call to call (every buffer at the same device address) against a fresh copy of it
before each call (new addresses, as every generate call's new prefill state has), a step limit
kept on the device against a host scalar, and calls of 0 and 1 steps.

    python benchmarks/chunk_calls.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas --moe auto
    python benchmarks/chunk_calls.py                       # CPU smoke run on the tiny model

The carry is captured from a real generate call (B rows, 128-token prompts); each setting is timed
over --calls calls (median, microseconds from the call to its host view being ready).
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

from benchmarks.common import environment, table, write  # noqa: E402
from benchmarks.decode import add_model_arguments, build, warmed_generator  # noqa: E402


class Capture:
    """Stands in for Generator.compiled_chunk once: keeps the first call's arguments, runs it."""

    def __init__(self, chunk):
        self.chunk, self.args = chunk, None

    def __call__(self, leaves, carry, inputs, step_limit, **options):
        if self.args is None:
            self.args = (leaves, jax.tree.map(jnp.copy, carry), inputs, int(step_limit), options)
        return self.chunk(leaves, carry, inputs, step_limit, **options)


@functools.partial(jax.jit, donate_argnums=0)
def rewind(carry, start):
    """`start`'s values (the loop status and the model state: cache lengths, caches, recurrent
    states) written into the donated carry's own buffers, so every buffer keeps its device address
    and no call runs past the cache's slots."""
    return jax.tree.map(lambda old, new: new, carry, start)


def timed_calls(chunk, leaves, carry, start, inputs, options, *, steps: int, calls: int, fresh: bool,
                device_limit: bool):
    """(median us per call, the carry to continue from). Each call runs `steps` steps from `start`
    (0: the loop condition is false at once); the carry is rewound to `start` before each call.
    fresh: copy the carry to new buffers before each call."""
    step0 = int(jax.device_get(start.step))
    limits = {}
    times = []
    for i in range(calls + 1):
        carry = rewind(carry, start)
        if fresh:
            carry = jax.tree.map(jnp.copy, carry)
        jax.block_until_ready(carry)
        limit = step0 + steps
        if device_limit:
            limit = limits.setdefault(limit, jnp.asarray(np.int32(limit)))
            jax.block_until_ready(limit)
        else:
            limit = np.int32(limit)
        t0 = time.perf_counter()
        carry, view = chunk(leaves, carry, inputs, limit, **options)
        jax.block_until_ready(view)
        if i:
            times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times), carry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, default="tiny-kimi-linear")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    model = build(args)
    gen, prompts, sp = warmed_generator(model, args.batch, args.prompt_len, 32)
    capture = Capture(gen.compiled_chunk)
    gen.compiled_chunk = capture
    out = gen.generate(prompts, sp)
    print(f"generate: decode {out.timings.decode_s * 1e3:.2f} ms, TPOT {out.timings.tpot_s * 1e3:.3f} ms", flush=True)
    leaves, carry, inputs, _, options = capture.args
    start = jax.tree.map(jnp.copy, carry)
    rows = []
    for steps in (0, 1, 4):
        for fresh in (False, True):
            for device_limit in (True, False):
                us, carry = timed_calls(capture.chunk, leaves, carry, start, inputs, options, steps=steps, calls=args.calls,
                                        fresh=fresh, device_limit=device_limit)
                rows.append({"steps": steps, "carry": "fresh copy" if fresh else "same buffers",
                             "step_limit": "device" if device_limit else "host", "us_per_call": us})
                print(rows[-1], flush=True)
    print(table(rows, ["steps", "carry", "step_limit", "us_per_call"]))
    path = write(args.name or f"chunk_calls_{args.model}_b{args.batch}",
                 {"benchmark": "chunk_calls", "model": args.model, "dtype": args.dtype, "batch": args.batch,
                  "options": {k: str(v) for k, v in options.items()}, "env": environment(), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
