"""Prefill benchmark: time to first token, compiled memory and a device profile by category.

    python benchmarks/prefill.py --model tiny-kimi-linear --prefill 1x256 4x128                 # CPU smoke run
    python benchmarks/prefill.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas --moe auto \
        --prefill 1x8192 64x1024 1x32768 1x131072 --profile 1x8192                           # on the H200

Each row times `Generator.generate` with one new token (TTFT = its prefill time: every prefill
call of the prompt, chunked or not), median of 3 after a compiling call (1 for prompts over 64K
tokens). Memory: XLA's compiled
memory analysis of each distinct prefill call the prompt needs (temporaries, and the state it
writes), so the peak is known before anything runs; `peak_gb` = weights + state + the largest
temporaries; `device_peak_gb` is the allocator's peak so far in the process (run the rows in
increasing size). A row that fails (out of memory, refused) is recorded with its message.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hlo_dump import request_hlo_dump  # noqa: E402

# Only when run as the script: a benchmark importing this one sets its own dump.
_DUMP = request_hlo_dump("hlo_dump_prefill", ".*prefill.*") if __name__ == "__main__" and "--profile" in sys.argv else None

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from benchmarks.common import environment, table, write  # noqa: E402
from benchmarks.decode import add_model_arguments, build  # noqa: E402
from benchmarks.profile_summary import markdown, summarize  # noqa: E402
from k3jax.state import init_decode_state  # noqa: E402

GB = 1e9


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def compiled_memory(model, batch: int, width: int) -> dict:
    """XLA's memory analysis of the prefill calls a [batch, width] prompt runs (largest temporaries
    over the calls), without running them."""
    calls = model.prefill_calls(batch, width)
    # generate's state: the prompt bucket plus the smallest step bucket
    state = jax.eval_shape(lambda: init_decode_state(model.config, batch, width + 16, model.dtype))
    worst = {"temp_gb": 0.0}
    for chunk, fresh in calls:
        ids = jax.ShapeDtypeStruct((batch, chunk), np.int32)
        mask = jax.ShapeDtypeStruct((batch, chunk), bool)
        with model.placement.context():
            compiled = model.steps.prefill_donated.lower(model.params, ids, mask, state, fresh=fresh,
                                                         all_logits=False).compile()
        mem = compiled.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", 0) / GB
        if temp >= worst["temp_gb"]:
            worst = {"temp_gb": temp, "chunk": chunk, "fresh": fresh}
    weights, state_b = _bytes(model.params) / GB, _bytes(state) / GB
    return {"calls": len(calls), "chunk": calls[0][0], "largest_temp_gb": worst["temp_gb"], "weights_gb": weights,
            "state_gb": state_b, "peak_gb": weights + state_b + worst["temp_gb"]}


def prefill_row(gen, spec: str, rng, profile_dir: str | None) -> dict:
    b, t = (int(x) for x in spec.split("x"))
    cfg = gen.model.config
    row = {"batch": b, "prompt_len": t}
    try:
        row.update(compiled_memory(gen.model, b, t))
    except Exception as e:  # noqa: BLE001 - a failed analysis must not lose the timing
        row["memory_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    prompts = rng.integers(3, cfg.vocab_size - 300, (b, t)).tolist()
    sp = k3jax.SamplingParams(max_new_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    try:
        gen.generate(prompts, sp)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it, keep the other rows
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"prefill {spec}: failed ({row['error']})", flush=True)
        return row
    row["first_call_s"] = time.perf_counter() - t0
    repeats = 3 if b * t <= 65536 else 1  # long prompts: one timed call after the compiling one
    times = [gen.generate(prompts, sp).timings.prefill_s for _ in range(repeats)]
    row["repeats"] = repeats
    ids = np.asarray(prompts, np.int32)  # the prefill calls alone, without generate's set-up and first token
    calls = []
    for _ in range(repeats):
        t1 = time.perf_counter()
        jax.block_until_ready(gen.model.prefill(ids, max_len=t + 16))
        calls.append(time.perf_counter() - t1)
    row["prefill_call_ms"] = statistics.median(calls) * 1e3
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:  # the process's peak so far (rows run in increasing size)
        row["device_peak_gb"] = stats["peak_bytes_in_use"] / GB
    row["ttft_ms"] = statistics.median(times) * 1e3
    row["tok_per_s"] = b * t / statistics.median(times)
    print(f"prefill {spec}: TTFT {row['ttft_ms']:.1f} ms ({row['tok_per_s']:.0f} tok/s) in {row.get('calls', '?')} "
          f"call(s), peak ~{row.get('peak_gb', float('nan')):.1f} GB, first call {row['first_call_s']:.1f} s", flush=True)
    if profile_dir is not None:
        shutil.rmtree(profile_dir, ignore_errors=True)
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            gen.generate(prompts, sp)
        try:
            row["profile"] = summarize(profile_dir, _DUMP, "prefill", 1)
            print(f"profile {spec}:\n{markdown(row['profile'])}", flush=True)
            for k in row["profile"]["top_kernels"][:15]:
                print(f"  {k['us']:10.0f} us {k['count']:5d}x  {k['category']:22s} {k['kernel']}", flush=True)
        except Exception as e:  # noqa: BLE001 - a profile that cannot be read must not lose the timings
            row["profile"] = {"error": str(e)}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, default="tiny-kimi-linear")
    ap.add_argument("--prefill", nargs="+", default=["1x256", "4x128"], help="rows as BxT, e.g. 1x8192 64x1024")
    ap.add_argument("--profile", nargs="*", default=[], help="rows (BxT) to profile, e.g. 1x8192")
    ap.add_argument("--mla-prefill", default=None,
                    help="MLA prefill implementation (k3jax option 'mla_prefill'; 'cudnn' also takes the chunks over the cache)")
    ap.add_argument("--chunk-tokens", type=int, default=None,
                    help="prompt tokens per prefill call (rows x chunk; the config's prefill_chunk_tokens)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)

    model = build(args)
    if args.chunk_tokens is not None:
        model = model.with_config(model.config.replace(prefill_chunk_tokens=args.chunk_tokens))
    gen = k3jax.Generator(model)
    rng = np.random.default_rng(0)
    name = args.name or f"prefill_{args.model}_{args.dtype}_{args.kernels}"
    record = {"benchmark": "prefill", "model": args.model, "dtype": args.dtype, "mla_prefill": model.config.mla.prefill_impl,
              "chunk_tokens": model.config.prefill_chunk_tokens, "env": environment(), "rows": []}
    out_dir = os.environ.get("OUT", "/tmp")
    for spec in args.prefill:
        profile_dir = os.path.join(out_dir, f"trace_prefill_{spec}") if spec in args.profile else None
        record["rows"].append(prefill_row(gen, spec, rng, profile_dir))
        write(name, record)
    print(table(record["rows"], ["batch", "prompt_len", "calls", "chunk", "ttft_ms", "prefill_call_ms", "tok_per_s", "largest_temp_gb",
                                 "state_gb", "peak_gb", "device_peak_gb", "first_call_s", "error"]))
    print(f"wrote {write(name, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
