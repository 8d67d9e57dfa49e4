"""Batch-job throughput: continuous batching (k3jax.engine, what `k3jax run-batch` runs) against
static batching (k3jax.Generator over fixed batches of the same requests), generated tokens per
second on a workload of mixed prompt and output lengths.

    python benchmarks/batch_job.py --small                                   # CPU, tiny-kimi-linear
    python benchmarks/batch_job.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas --moe auto \
        --requests 1024 --slots 64 --prompt-min 65 --prompt-max 128 --output-min 16 --output-median 32 \
        --output-max 128 --time-limit 235                                    # one H200, random bf16 weights

Workload (seeded): prompt lengths uniform in [--prompt-min, --prompt-max]; output lengths
(max_tokens, ignore_eos, so every request runs to its length) long-tailed: lognormal around
--output-median, clipped to [--output-min, --output-max]; greedy. Continuous batching: one engine
with --slots slots, admitting a waiting request whenever a slot frees. Static batching takes the
requests in input order, --slots at a time, and each batch runs until its longest request is done
(rows stop on the device, the batch's steps do not).

Before either timed run, everything both need is compiled (the warm-up): the engine's admissions
of k prompts at once (k every power of two up to --slots) at every prompt width of the workload,
one token each, and for static batching the first batch of every distinct (rows, prompt width,
steps) shape, run once. With --warmup-threads N > 1 the prefills of the admission sizes and the
static batches run in N threads (XLA compiles in parallel; the engine's own admissions, which
then reuse those prefills, stay on the main thread). Each method then runs the whole workload once,
timed: tokens/s = generated tokens / wall time, prefills included. `timed_compiles` counts XLA
compiles during a timed run (0: nothing recompiled); the warm-up's compiles are listed by function
in the record. `decode_steps`: decode steps run; `ms_per_step`: wall time over them (prefills and
host work included); `useful`: the share of the decode row-steps computed that produced a
requested token (static: rows padded to a power of two x steps of each batch; continuous: slots x
steps); continuous also counts its engine steps (`chunks`), `admissions` and `prefill_rows` (the
admitted prompts padded to powers of two).

The JSON record (benchmarks.common.write: $OUT or benchmarks/results) is rewritten after the model
is built, after the warm-up, after the continuous run and after every static batch, so a run cut
short keeps what it measured. --time-limit S stops the static run between batches when the next batch would end past S
seconds from the start; its row then covers the batches done ("complete": false). Progress lines
carry the seconds since the start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import os
import sys
import time

T0 = time.perf_counter()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from benchmarks.common import environment, table, write  # noqa: E402
from benchmarks.decode import add_build_arguments, build  # noqa: E402
from k3jax.engine import Engine, EngineConfig  # noqa: E402
from k3jax.generate import PROMPT_BUCKETS, STEP_BUCKETS  # noqa: E402

SMALL = dict(model="tiny-kimi-linear", requests=64, slots=8, prompt_min=4, prompt_max=60, output_min=4,
             output_median=24, output_max=96, chunk_steps=16)
COLUMNS = ["method", "tokens", "wall_s", "tok_per_s", "decode_steps", "ms_per_step", "useful", "timed_compiles"]


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {message}", flush=True)


class Compiles:
    """XLA compiles (function name, seconds) seen through jax.monitoring since the process started."""

    def __init__(self):
        self.events: list[tuple[str, float]] = []
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.events.append((str(kwargs.get("fun_name", "?")), duration))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> dict:
        """{"compiles": n, "compile_s": seconds, "compiled": {function: [n, seconds]}} after `mark`."""
        by_name: dict[str, list] = {}
        for name, seconds in self.events[mark:]:
            entry = by_name.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
        return {"compiles": len(self.events) - mark, "compile_s": sum(s for _, s in self.events[mark:]),
                "compiled": dict(sorted(by_name.items(), key=lambda kv: -kv[1][1]))}


def bucket(n: int, buckets) -> int:
    return next(b for b in buckets if b >= n)


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def workload(args, vocab: int) -> list[tuple[list[int], k3jax.SamplingParams]]:
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.prompt_min, args.prompt_max + 1, args.requests)
    outputs = np.clip(np.round(rng.lognormal(np.log(args.output_median), 0.8, args.requests)),
                      args.output_min, args.output_max).astype(int)
    return [(rng.integers(3, vocab - 300, int(t)).tolist(), k3jax.SamplingParams(max_tokens=int(o), ignore_eos=True))
            for t, o in zip(lengths, outputs)]


# ----- warm-up -----
def admission_sizes(slots: int) -> list[int]:
    """The prefill batch sizes the engine uses: admitting n <= slots prompts prefills pow2(n) rows."""
    return sorted({pow2(n) for n in range(1, slots + 1)})


def admission_widths(engine: Engine, requests) -> dict[int, int]:
    """Prompt width the engine prefills at -> the longest prompt of the workload with that width."""
    longest = {}
    for prompt, _ in requests:
        width = min(bucket(len(prompt), PROMPT_BUCKETS + (engine.config.max_len,)), engine.config.max_len)
        longest[width] = max(longest.get(width, 0), len(prompt))
    return dict(sorted(longest.items()))


def admit(engine: Engine, k: int, length: int) -> None:
    """min(k, slots) prompts of `length` tokens admitted together into the idle engine, one token each."""
    one = k3jax.SamplingParams(max_tokens=1, ignore_eos=True)
    for j in range(min(k, engine.config.max_slots)):
        engine.add(f"warm-{length}-{k}-{j}", [3 + j % 50] * length, one)
    while engine.has_work():
        engine.step()


def warm_up(model, engine: Engine | None, gen: k3jax.Generator | None, requests, batches, threads: int) -> None:
    """Compiles what the timed runs need (see the module docstring)."""
    tasks = []   # (what, function), run in the pool
    widths = admission_widths(engine, requests) if engine is not None else {}
    sizes = admission_sizes(engine.config.max_slots) if engine is not None else []
    first = [(width, length, sizes[0]) for width, length in widths.items()]   # on the main thread
    for width in widths:
        for k in sizes[1:]:
            ids = np.full((k, width), 3, np.int32)
            tasks.append((f"prefill of {k} x {width}", functools.partial(
                model.prefill, ids, np.ones_like(ids), max_len=engine.config.max_len)))
    if gen is not None:
        shapes = {}
        for batch in batches:
            shapes.setdefault(static_shape(batch), batch)
        for shape, batch in shapes.items():
            tasks.append((f"static batch of shape (rows, width, steps) {shape}", functools.partial(
                gen.generate, [p for p, _ in batch], [sp for _, sp in batch])))

    def run(what, fn):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        log(f"warm-up: {what} in {time.perf_counter() - t:.1f} s")

    if threads > 1 and tasks:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(run, what, fn) for what, fn in tasks]
            for width, length, k in first:   # meanwhile: the engine's decode chunk and smallest admission
                run(f"engine admission of {k} at width {width}", functools.partial(admit, engine, k, length))
            for f in futures:
                f.result()
    else:
        for what, fn in tasks:
            run(what, fn)
        for width, length, k in first:
            run(f"engine admission of {k} at width {width}", functools.partial(admit, engine, k, length))
    for width, length in widths.items():   # the engine's admissions of every size (their prefills are warm)
        for k in sizes[1:]:
            run(f"engine admission of {k} at width {width}", functools.partial(admit, engine, k, length))


# ----- the timed runs -----
def run_continuous(engine: Engine, requests) -> dict:
    """The workload through the engine, fed from the list as slots free (decode steps and
    admissions read from the engine's loop counter and waiting queue, private fields)."""
    queue = list(enumerate(requests))[::-1]
    tokens = steps = done = chunks = admissions = prefill_rows = 0
    t0 = shown = time.perf_counter()
    while queue or engine.has_work():
        while queue and engine.num_waiting < engine.config.max_slots:
            i, (prompt, sp) = queue.pop()
            engine.add(str(i), prompt, sp)
        waiting = len(engine._waiting)
        for update in engine.step():
            tokens += sum(len(t) for t in update.new_tokens.values())
            done += update.result is not None
        admitted = waiting - len(engine._waiting)
        admissions, prefill_rows = admissions + (admitted > 0), prefill_rows + (pow2(admitted) if admitted else 0)
        chunks += 1
        steps += int(engine._carry.step)
        if time.perf_counter() - shown > 10:
            shown = time.perf_counter()
            log(f"continuous: {done}/{len(requests)} requests, {tokens} tokens, {tokens / (shown - t0):.1f} tok/s")
    wall = time.perf_counter() - t0
    return row("continuous", tokens, wall, steps, steps * engine.config.max_slots, chunks=chunks,
               admissions=admissions, prefill_rows=prefill_rows)


def static_shape(batch) -> tuple[int, int, int]:
    """(rows, prompt width, steps): what Generator.generate compiles for the batch."""
    return (pow2(len(batch)), bucket(max(len(p) for p, _ in batch), PROMPT_BUCKETS),
            bucket(max(sp.max_tokens for _, sp in batch), STEP_BUCKETS))


def run_static(gen: k3jax.Generator, batches, time_limit: float | None, on_batch) -> dict:
    """The batches one after another; `on_batch(row)` after each. Stops early when the next batch
    would end past `time_limit` seconds from the start of the process."""
    tokens = steps = row_steps = 0
    t0 = time.perf_counter()
    result = None
    for i, batch in enumerate(batches):
        if time_limit is not None and i and time.perf_counter() - T0 + (time.perf_counter() - t0) / i > time_limit:
            log(f"static: stopping after {i} of {len(batches)} batches (--time-limit {time_limit:g} s)")
            break
        out = gen.generate([p for p, _ in batch], [sp for _, sp in batch])
        tokens += sum(len(r.token_ids) for r in out)
        steps += out.timings.steps
        row_steps += pow2(len(batch)) * out.timings.steps   # rows padded to a power of two
        wall = time.perf_counter() - t0
        result = row("static", tokens, wall, steps, row_steps, batches=i + 1, complete=i + 1 == len(batches))
        on_batch(result)
        log(f"static: batch {i + 1}/{len(batches)}, {tokens} tokens, {tokens / wall:.1f} tok/s")
    return result


def row(method: str, tokens: int, wall: float, steps: int, row_steps: int, **extra) -> dict:
    return {"method": method, "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall, "decode_steps": steps,
            "ms_per_step": wall / max(steps, 1) * 1e3, "useful": tokens / max(row_steps, 1), **extra}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the CPU workload: " + ", ".join(
        f"{k}={v}" for k, v in SMALL.items()))
    ap.add_argument("--model", default="kimi-linear-48b",
                    help="kimi-linear-48b (random weights), tiny-k3, tiny-k3-random, tiny-kimi-linear or a checkpoint directory")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=64, help="engine slots = static batch size (default 64)")
    ap.add_argument("--prompt-min", type=int, default=65, help="prompt tokens at least (default 65)")
    ap.add_argument("--prompt-max", type=int, default=128, help="... at most (default 128: one prompt width)")
    ap.add_argument("--output-min", type=int, default=16, help="max_tokens at least (default 16)")
    ap.add_argument("--output-median", type=int, default=32, help="median max_tokens before clipping (default 32)")
    ap.add_argument("--output-max", type=int, default=128, help="max_tokens at most (default 128)")
    ap.add_argument("--chunk-steps", type=int, default=16, help="engine decode steps between admissions (default 16)")
    ap.add_argument("--methods", nargs="+", choices=["continuous", "static"], default=["continuous", "static"])
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds from the start: the static run stops between batches before passing it")
    ap.add_argument("--warmup-threads", type=int, default=8,
                    help="threads compiling the warm-up's prefills and static batches (default 8; 1: in turn)")
    ap.add_argument("--seed", type=int, default=0)
    add_build_arguments(ap)
    ap.add_argument("--name", default=None, help="result file name (default batch_job_MODEL_DTYPE)")
    args = ap.parse_args(argv)
    if args.small:
        for k, v in SMALL.items():
            setattr(args, k, v)
    if not 1 <= args.prompt_min <= args.prompt_max or not 1 <= args.output_min <= args.output_max:
        ap.error("need 1 <= --prompt-min <= --prompt-max and 1 <= --output-min <= --output-max")
    name = args.name or f"batch_job_{args.model}_{args.dtype}"
    compiles = Compiles()

    log(f"jax {jax.__version__} on {jax.devices()[0]}; building {args.model} ({args.dtype})")
    t, mark = time.perf_counter(), compiles.mark()
    model = build(args)
    jax.block_until_ready(model.params)
    build_s, build_compiles = time.perf_counter() - t, compiles.since(mark)
    requests = workload(args, model.config.vocab_size)
    max_len = args.prompt_max + args.output_max
    wanted = sum(sp.max_tokens for _, sp in requests)
    batches = [requests[i:i + args.slots] for i in range(0, len(requests), args.slots)]
    record = {"benchmark": "batch_job", "model": args.model, "dtype": args.dtype,
              "impls": {k: getattr(args, k) for k in ("kernels", "moe", "gmm", "linear")},
              "shape": json.loads(json.dumps(dataclasses.asdict(model.config), default=str)),
              "parameters": int(sum(x.size for x in jax.tree.leaves(model.params))),
              "requests": args.requests, "slots": args.slots, "chunk_steps": args.chunk_steps, "max_len": max_len,
              "workload": {k: getattr(args, k) for k in ("prompt_min", "prompt_max", "output_min", "output_median",
                                                         "output_max", "seed")},
              "tokens_requested": wanted, "static_shapes": sorted({static_shape(b) for b in batches}),
              "build_s": build_s, "build_compile_s": build_compiles["compile_s"], "env": environment(),
              "compilation_cache": jax.config.jax_compilation_cache_dir or None, "rows": {},
              "continuous_over_static": None}

    def save(*rows: dict) -> None:
        for r in rows:
            record["rows"][r["method"]] = r
        got = record["rows"]
        if "continuous" in got and "static" in got:
            record["continuous_over_static"] = got["continuous"]["tok_per_s"] / got["static"]["tok_per_s"]
        record["elapsed_s"] = time.perf_counter() - T0
        write(name, record)

    save()
    log(f"built in {build_s:.1f} s; {args.requests} requests, {wanted} tokens to generate, {args.slots} slots, "
        f"{len(batches)} static batches of shapes (rows, width, steps) {record['static_shapes']}")

    engine = gen = None
    if "continuous" in args.methods:
        engine = Engine(model, EngineConfig(max_slots=args.slots, max_len=max_len, chunk_steps=args.chunk_steps))
    if "static" in args.methods:
        gen = k3jax.Generator(model)
    t, mark = time.perf_counter(), compiles.mark()
    warm_up(model, engine, gen, requests, batches, args.warmup_threads)
    record["warmup"] = {"s": time.perf_counter() - t, "threads": args.warmup_threads, **compiles.since(mark)}
    save()
    log(f"warm-up done in {record['warmup']['s']:.1f} s: {record['warmup']['compiles']} compiles taking "
        f"{record['warmup']['compile_s']:.1f} s")

    if engine is not None:
        mark = compiles.mark()
        result = run_continuous(engine, requests)
        result["timed_compiles"] = compiles.since(mark)["compiles"]
        save(result)
        log(f"continuous: {result['tokens']} tokens in {result['wall_s']:.2f} s = {result['tok_per_s']:.1f} tok/s "
            f"({result['decode_steps']} decode steps, {result['timed_compiles']} compiles)")
        del engine

    if gen is not None:
        mark = compiles.mark()

        def on_batch(r: dict) -> None:
            r["timed_compiles"] = compiles.since(mark)["compiles"]
            save(r)

        result = run_static(gen, batches, args.time_limit, on_batch)
        log(f"static: {result['tokens']} tokens in {result['wall_s']:.2f} s = {result['tok_per_s']:.1f} tok/s "
            f"({result['decode_steps']} decode steps over {result['batches']} batches, {result['timed_compiles']} "
            "compiles)")

    print(table(list(record["rows"].values()), COLUMNS), flush=True)
    if record["continuous_over_static"] is not None:
        print(f"continuous / static: {record['continuous_over_static']:.2f}x", flush=True)
    print(f"wrote {write(name, record)} ({time.perf_counter() - T0:.1f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
