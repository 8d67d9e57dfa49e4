"""Where a generate call's decode time goes besides the model steps: a straight-line fit of the decode
time against the number of new tokens (slope = cost per token in the loop, intercept = cost per
call), and one call taken apart (dispatching the compiled chunk, running it, reading back).

    python benchmarks/decode_overhead.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas --moe auto \
        --variants loop_unroll=1 loop_unroll=8                                         # on the H200
    python benchmarks/decode_overhead.py --tokens 1 2 4 8 16                          # CPU smoke run

Every length uses one token buffer (the step buckets are pinned to the longest), so one program
serves them all. Each number: median of --repeats calls after a compiling one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402

generate_module = sys.modules["k3jax.generate"]   # the attribute k3jax.generate is the function
from benchmarks.common import environment, table, write  # noqa: E402
from benchmarks.decode import add_model_arguments, build, parse_variant  # noqa: E402


class TimedChunk:
    """Stands in for Generator.compiled_chunk: times each call's dispatch (until the call returns) and
    run (until the carry is ready), and first runs the chunk once with no step left (what one call
    costs with no model step in it). The host view's read is in the generate call's remainder."""

    def __init__(self, chunk):
        self.chunk, self.calls = chunk, []

    def __call__(self, leaves, carry, inputs, step_limit, **options):
        now = np.int32(jax.device_get(carry.step))
        t0 = time.perf_counter()
        carry, view = self.chunk(leaves, carry, inputs, now, **options)   # zero steps: cond is false at once
        jax.block_until_ready(view)
        t1 = time.perf_counter()
        out = self.chunk(leaves, carry, inputs, step_limit, **options)
        t2 = time.perf_counter()
        jax.block_until_ready(out[1])
        t3 = time.perf_counter()
        self.calls.append({"empty_call_ms": 1e3 * (t1 - t0), "dispatch_ms": 1e3 * (t2 - t1), "run_ms": 1e3 * (t3 - t2)})
        return out


def measure(gen: k3jax.Generator, prompts: list, tokens: list[int], repeats: int) -> dict:
    decode = {}
    for n in tokens:
        sp = k3jax.SamplingParams(max_new_tokens=n, ignore_eos=True)
        gen.generate(prompts, sp)
        times = []
        for _ in range(repeats):
            out = gen.generate(prompts, sp)
            assert out.timings.steps == n, (out.timings.steps, n)
            times.append(out.timings.decode_s)
        decode[n] = statistics.median(times)
        print(f"  {n} new tokens: decode {decode[n] * 1e3:.2f} ms ({decode[n] / n * 1e3:.3f} ms per token)", flush=True)
    ns = [n for n in tokens if n >= 2] or tokens
    slope, intercept = np.polyfit(ns, [decode[n] for n in ns], 1) if len(ns) > 1 else (decode[ns[0]] / ns[0], 0.0)
    row = {"decode_ms": {n: t * 1e3 for n, t in decode.items()}, "per_token_ms": slope * 1e3,
           "per_call_ms": intercept * 1e3}
    n = max(tokens) if max(tokens) <= generate_module.CHUNK_STEPS else generate_module.CHUNK_STEPS
    original = gen.compiled_chunk
    gen.compiled_chunk = timed = TimedChunk(original)
    try:
        sp = k3jax.SamplingParams(max_new_tokens=n, ignore_eos=True)
        parts = []
        for _ in range(repeats):
            timed.calls.clear()
            out = gen.generate(prompts, sp)
            call = timed.calls[0]
            call["decode_s_ms"] = out.timings.decode_s * 1e3
            call["rest_ms"] = call["decode_s_ms"] - sum(call[k] for k in ("empty_call_ms", "dispatch_ms", "run_ms"))
            parts.append(call)
    finally:
        gen.compiled_chunk = original
    row["one_call"] = {"new_tokens": n, **{k: statistics.median(p[k] for p in parts) for k in parts[0]}}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, default="tiny-kimi-linear")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", nargs="*", default=[], help="more option sets, as in decode.py")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variants]
    model = build(args)
    generate_module.STEP_BUCKETS = (max(16, 1 << (max(args.tokens) - 1).bit_length()),)
    prompts = np.random.default_rng(0).integers(3, model.config.vocab_size - 300,
                                                (args.batch, args.prompt_len)).tolist()
    rows = []
    for label, impls in [("base", {})] + variants:
        print(f"{label}:", flush=True)
        t0 = time.perf_counter()
        gen = k3jax.Generator(model.with_impls(**impls) if impls else model)
        gen.generate(prompts, k3jax.SamplingParams(max_new_tokens=1, ignore_eos=True))
        first = time.perf_counter() - t0
        row = {"variant": label, "batch": args.batch, "first_call_s": first, **measure(gen, prompts, args.tokens,
                                                                                          args.repeats)}
        print(f"  per token {row['per_token_ms']:.3f} ms, per call {row['per_call_ms']:.2f} ms; one call of "
              f"{row['one_call']['new_tokens']}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["one_call"].items()
                                                            if k != "new_tokens"), flush=True)
        rows.append(row)
        del gen
    flat = [{"variant": r["variant"], "per_token_ms": r["per_token_ms"], "per_call_ms": r["per_call_ms"],
             **{k: v for k, v in r["one_call"].items()}} for r in rows]
    print(table(flat, list(flat[0])))
    path = write(args.name or f"decode_overhead_{args.model}_b{args.batch}",
                 {"benchmark": "decode_overhead", "model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len,
                  "env": environment(), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
