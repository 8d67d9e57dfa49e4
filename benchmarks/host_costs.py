"""Host-side costs of one compiled call on this device, each alone (no model): what a decode chunk
call pays besides its kernels.

    python benchmarks/host_costs.py            # any backend; the GPU machine's numbers are the ones that matter

- read: one small int32 array [1, 36] already computed, back to numpy (np.asarray, jax.device_get,
  copy_to_host_async first, dlpack);
- put: a host scalar to the device (np.int32 argument) against a device scalar kept from before;
- dispatch: a jitted call over N arrays (N = 1, 100, 700) that touches one of them, donating a small
  carry: time until the call returns and until its output is ready; also through the AOT-compiled
  object and with the N arrays as one tuple argument.

Each number: median of --repeats calls after warm-up, in microseconds.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import environment, median_time, table, write  # noqa: E402


def _median_us(fn, repeats: int) -> float:
    """Median microseconds of fn() after one warm-up call (fn returns None: nothing is waited on
    beyond what fn itself waits for)."""
    return 1e6 * median_time(fn, warmup=1, iters=repeats)[0]


def read_costs(repeats: int) -> list[dict]:
    x = jnp.arange(36, dtype=jnp.int32).reshape(1, 36)
    x.block_until_ready()
    fresh = jax.jit(lambda v: v + 1)

    def fresh_read(reader):
        def run():
            y = fresh(x)
            y.block_until_ready()
            reader(y)
        return run

    def async_then(y):
        y.copy_to_host_async()
        return np.asarray(y)

    readers = {"np.asarray": np.asarray, "jax.device_get": jax.device_get, "copy_to_host_async + np.asarray": async_then,
               "from_dlpack": lambda y: np.from_dlpack(y) if y.devices().pop().platform == "cpu" else np.asarray(y)}
    rows = []
    base = _median_us(lambda: fresh(x).block_until_ready(), repeats)
    for name, reader in readers.items():
        rows.append({"what": f"read [1, 36] int32: {name}", "us": _median_us(fresh_read(reader), repeats) - base})
    rows.append({"what": "(the jitted +1 call it reads, ready)", "us": base})
    return rows


def dispatch_costs(repeats: int, counts: list[int]) -> list[dict]:
    rows = []
    for n in counts:
        params = tuple(jnp.full((256,), i, jnp.bfloat16) for i in range(n))
        jax.block_until_ready(params)

        def body(flat, carry, limit):
            return carry + flat[0][:8].astype(jnp.float32).sum() + limit

        jitted = jax.jit(body, donate_argnums=(1,))
        carry = [jnp.zeros((1024,), jnp.float32)]
        limit_dev = jnp.int32(3)

        def call(fn, limit):
            def run():
                carry[0] = fn(params, carry[0], limit)
            return run

        def call_ready(fn, limit):
            def run():
                carry[0] = fn(params, carry[0], limit)
                carry[0].block_until_ready()
            return run

        compiled = jitted.lower(params, carry[0], limit_dev).compile()
        rows += [
            {"what": f"jit call, {n} arrays, device scalar: returns", "us": _median_us(call(jitted, limit_dev), repeats)},
            {"what": f"jit call, {n} arrays, device scalar: ready", "us": _median_us(call_ready(jitted, limit_dev), repeats)},
            {"what": f"jit call, {n} arrays, np.int32 scalar: returns", "us": _median_us(call(jitted, np.int32(3)), repeats)},
            {"what": f"AOT compiled call, {n} arrays: returns", "us": _median_us(call(compiled, limit_dev), repeats)},
        ]
        jax.block_until_ready(carry)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--arrays", type=int, nargs="+", default=[1, 100, 700])
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    rows = read_costs(args.repeats) + dispatch_costs(args.repeats, args.arrays)
    print(table(rows, ["what", "us"]))
    path = write(args.name or f"host_costs_{jax.default_backend()}",
                 {"benchmark": "host_costs", "env": environment(), "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
