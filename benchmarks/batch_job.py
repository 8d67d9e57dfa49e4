"""Batch-job throughput: continuous batching (k3jax.engine, what `k3jax run-batch` runs) against
static batching (k3jax.Generator over fixed batches of the same requests), generated tokens per
second on a workload of mixed prompt and output lengths.

    python benchmarks/batch_job.py --small                                   # CPU, tiny-kimi-linear
    python benchmarks/batch_job.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas --moe auto \
        --requests 1024 --slots 64                                           # one H200, random bf16 weights

Workload (seeded): prompt lengths uniform in [--prompt-min, --prompt-max]; output lengths
(max_tokens, ignore_eos, so every request runs to its length) long-tailed: lognormal around
--output-median, clipped to [--output-min, --output-max]; greedy. Static batching takes the
requests in input order, --slots at a time, and each batch runs until its longest request is done
(rows stop on the device, the batch's steps do not). Continuous batching: one engine with --slots
slots, admitting a waiting request whenever a slot frees. Each method runs the whole workload once
to compile (first_s), then --repeats timed runs (median); tokens/s = generated tokens / wall time
of the workload, prefills included. `decode_steps`: decode-loop steps run; `ms_per_step`: wall time
over them (prefills and host work included); `useful`: the share of the decode row-steps computed
that produced a requested token (static: rows padded to a power of two x steps of each batch;
continuous: slots x steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from benchmarks.common import environment, table, write  # noqa: E402
from benchmarks.decode import add_build_arguments, build  # noqa: E402
from k3jax.engine import Engine, EngineConfig  # noqa: E402

SMALL = dict(model="tiny-kimi-linear", requests=64, slots=8, prompt_min=4, prompt_max=60, output_min=4,
             output_median=24, output_max=96, chunk_steps=16)


def workload(args, vocab: int) -> list[tuple[list[int], k3jax.SamplingParams]]:
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.prompt_min, args.prompt_max + 1, args.requests)
    outputs = np.clip(np.round(rng.lognormal(np.log(args.output_median), 0.8, args.requests)),
                      args.output_min, args.output_max).astype(int)
    return [(rng.integers(3, vocab - 300, int(t)).tolist(), k3jax.SamplingParams(max_tokens=int(o), ignore_eos=True))
            for t, o in zip(lengths, outputs)]


def run_static(gen: k3jax.Generator, requests, slots: int) -> tuple[int, int, int]:
    """(generated tokens, decode steps, decode row-steps computed) of the workload in fixed batches."""
    tokens = steps = row_steps = 0
    for i in range(0, len(requests), slots):
        batch = requests[i:i + slots]
        out = gen.generate([p for p, _ in batch], [sp for _, sp in batch])
        tokens += sum(len(r.token_ids) for r in out)
        steps += out.timings.steps
        row_steps += (1 << (len(batch) - 1).bit_length()) * out.timings.steps   # rows padded to a power of two
    return tokens, steps, row_steps


def run_continuous(engine: Engine, requests) -> tuple[int, int, int]:
    """(generated tokens, decode steps, decode row-steps computed): the engine fed from the list
    as slots free (steps read from the engine's loop counter, a private field)."""
    queue = list(enumerate(requests))[::-1]
    tokens = steps = 0
    while queue or engine.has_work():
        while queue and engine.num_waiting < engine.config.max_slots:
            i, (prompt, sp) = queue.pop()
            engine.add(str(i), prompt, sp)
        for update in engine.step():
            tokens += sum(len(t) for t in update.new_tokens.values())
        steps += int(engine._carry.step)
    return tokens, steps, steps * engine.config.max_slots   # every slot runs every step


def measure(name: str, fn, repeats: int) -> dict:
    t0 = time.perf_counter()
    tokens, steps, row_steps = fn()          # compiles every shape the workload needs
    first = time.perf_counter() - t0
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    row = {"method": name, "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall, "decode_steps": steps,
           "ms_per_step": wall / steps * 1e3, "useful": tokens / row_steps, "first_s": first, "walls_s": walls}
    print(f"{name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s (first run {first:.1f} s)", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the CPU workload: " + ", ".join(
        f"{k}={v}" for k, v in SMALL.items()))
    ap.add_argument("--model", default="kimi-linear-48b",
                    help="kimi-linear-48b (random weights), tiny-k3, tiny-kimi-linear or a checkpoint directory")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=64, help="engine slots = static batch size")
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--output-min", type=int, default=16)
    ap.add_argument("--output-median", type=int, default=192)
    ap.add_argument("--output-max", type=int, default=1024)
    ap.add_argument("--chunk-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    add_build_arguments(ap)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    if args.small:
        for k, v in SMALL.items():
            setattr(args, k, v)

    model = build(args)
    requests = workload(args, model.config.vocab_size)
    max_len = args.prompt_max + args.output_max
    engine = Engine(model, EngineConfig(max_slots=args.slots, max_len=max_len, chunk_steps=args.chunk_steps))
    gen = k3jax.Generator(model)
    wanted = sum(sp.max_tokens for _, sp in requests)
    print(f"{args.requests} requests, {wanted} tokens to generate, {args.slots} slots", flush=True)
    rows = [measure("static", lambda: run_static(gen, requests, args.slots), args.repeats),
            measure("continuous", lambda: run_continuous(engine, requests), args.repeats)]
    speedup = rows[1]["tok_per_s"] / rows[0]["tok_per_s"]
    print(table(rows, ["method", "tokens", "wall_s", "tok_per_s", "decode_steps", "ms_per_step", "useful",
                       "first_s"]))
    print(f"continuous / static: {speedup:.2f}x")
    record = {"benchmark": "batch_job", "model": args.model, "dtype": args.dtype, "requests": args.requests,
              "slots": args.slots, "chunk_steps": args.chunk_steps, "max_len": max_len,
              "workload": {k: getattr(args, k) for k in ("prompt_min", "prompt_max", "output_min", "output_median",
                                                         "output_max", "seed")},
              "tokens_requested": wanted, "speedup": speedup, "env": environment(), "rows": rows}
    print(f"wrote {write(args.name or f'batch_job_{args.model}_{args.dtype}', record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
