"""Where a prompt's time to first token goes outside the prefill kernels: the generate call, the
prefill call alone, and the host cost of dispatching a compiled function over the model's
parameter tree (a no-op that takes the parameters).

    python benchmarks/ttft_overhead.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas --moe auto \
        --tokens 8192                                                                  # on the H200
    python benchmarks/ttft_overhead.py --tokens 256                                   # CPU smoke run

Each number: median of 5 after a compiling call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from benchmarks.common import environment, write  # noqa: E402
from benchmarks.decode import add_model_arguments, build  # noqa: E402


def median_s(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, default="tiny-kimi-linear")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args(argv)
    model = build(args)
    t = args.tokens
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size - 300, (1, t))
    gen = k3jax.Generator(model)
    sp = k3jax.SamplingParams(max_new_tokens=1, ignore_eos=True)
    row = {"tokens": t}
    row["ttft_ms"] = 1e3 * median_s(lambda: gen.generate(ids.tolist(), sp).timings.prefill_s)
    row["generate_prefill_s_ms"] = 1e3 * statistics.median(gen.generate(ids.tolist(), sp).timings.prefill_s
                                                           for _ in range(5))
    row["prefill_call_ms"] = 1e3 * median_s(lambda: jax.block_until_ready(model.prefill(ids, max_len=t + 16)))
    state = model.init_state(1, t + 16)
    put = model.placement.put_rows
    dev_ids, dev_mask = put(ids.astype(np.int32)), put(np.ones((1, t), bool))
    call = lambda: jax.block_until_ready(model.steps.prefill(model.params, dev_ids, dev_mask, state, fresh=True,
                                                             all_logits=False))
    row["compiled_call_ms"] = 1e3 * median_s(call)
    row["init_state_ms"] = 1e3 * median_s(lambda: jax.block_until_ready(model.init_state(1, t + 16)))
    noop = jax.jit(lambda params, x: x + 1)
    x = jnp.zeros((), jnp.float32)
    row["dispatch_params_ms"] = 1e3 * median_s(lambda: jax.block_until_ready(noop(model.params, x)))
    row["leaves"] = len(jax.tree.leaves(model.params))
    flat = jax.tree.leaves(model.params)
    noop_flat = jax.jit(lambda leaves, x: x + 1)
    row["dispatch_leaves_ms"] = 1e3 * median_s(lambda: jax.block_until_ready(noop_flat(flat, x)))
    row["flatten_params_ms"] = 1e3 * median_s(lambda: jax.tree.flatten(model.params))
    for k, v in row.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}", flush=True)
    print("wrote", write(f"ttft_overhead_{args.model}", {"benchmark": "ttft_overhead", "model": args.model,
                                                          "env": environment(), "row": row}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
