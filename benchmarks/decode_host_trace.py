"""Where the host's time goes in one generate call's decode: a jax.profiler trace of the call, its host
events inside the decode window summed by name, the device's busy and idle time in the same window,
and the lead and tail around the device's work (first chunk call -> the chunk's first kernel, last
kernel -> results on the host).

    python benchmarks/decode_host_trace.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas --moe auto
    python benchmarks/decode_host_trace.py --tokens 8          # CPU smoke run on the tiny model

The decode window runs from the first chunk call to the end of generate's last host read; the
phases are marked with profiler annotations (`k3jax.chunk_call`, `k3jax.read_host_view`). Host
event totals are inclusive (nested events are counted in each of their parents). With
loop_start="overlap" the first chunk is called before the first token is read, so the window also
holds that read and the prefill's last kernels.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import k3jax  # noqa: E402

generate_module = sys.modules["k3jax.generate"]   # the attribute k3jax.generate is the function
from benchmarks.common import environment, table, write  # noqa: E402
from benchmarks.decode import add_model_arguments, build, warmed_generator  # noqa: E402
from benchmarks.profile_summary import latest_trace  # noqa: E402

CHUNK, READ, CALL = "k3jax.chunk_call", "k3jax.read_host_view", "k3jax.generate_call"


class Annotated:
    """Wraps a callable in a profiler annotation of the given name."""

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name

    def __call__(self, *args, **kwargs):
        with jax.profiler.TraceAnnotation(self.name):
            return self.fn(*args, **kwargs)


def _events(trace_file: str) -> tuple[list[dict], dict[int, str]]:
    with gzip.open(trace_file) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: str(e["args"]["name"]) for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X" and "dur" in e], procs


def _is_device(pid: int, procs: dict[int, str]) -> bool:
    name = procs.get(pid, "")
    return "GPU" in name or "gpu" in name or "/device:" in name


def _norm(name: str) -> str:
    """An event name without its per-instance arguments ("Thunk:#hlo_op=fusion.3#" -> "Thunk")."""
    return re.sub(r"[:#].*$", "", name)[:90] or name[:90]


def summarize(trace_file: str) -> dict:
    """The last generate call of the trace: its decode window's host events, device time, lead and tail."""
    events, procs = _events(trace_file)
    calls = [e for e in events if e["name"] == CALL]
    if not calls:
        raise ValueError(f"no {CALL} annotation in {trace_file}")
    call = max(calls, key=lambda e: e["ts"])
    inside = [e for e in events if call["ts"] <= e["ts"] and e["ts"] + e["dur"] <= call["ts"] + call["dur"]]
    chunks = [e for e in inside if e["name"] == CHUNK]
    reads = [e for e in inside if e["name"] == READ]
    if not chunks or not reads:
        raise ValueError(f"no {CHUNK} / {READ} annotations inside the last generate call in {trace_file}")
    start = min(e["ts"] for e in chunks)
    end = max(e["ts"] + e["dur"] for e in reads)
    main = call["tid"], call["pid"]       # the thread that called generate (the chunk may run on it or not)
    host = [e for e in events if not _is_device(e["pid"], procs) and start <= e["ts"] and e["ts"] + e["dur"] <= end]
    device = sorted((e for e in events if _is_device(e["pid"], procs) and start <= e["ts"] <= end),
                    key=lambda e: e["ts"])
    by_name = defaultdict(lambda: {"count": 0, "total_us": 0.0, "max_us": 0.0, "main_thread": False})
    for e in host:
        r = by_name[_norm(e["name"])]
        r["count"] += 1
        r["total_us"] += e["dur"]
        r["max_us"] = max(r["max_us"], e["dur"])
        r["main_thread"] |= (e["tid"], e["pid"]) == main
    rows = sorted(({"event": k, **v} for k, v in by_name.items()), key=lambda r: -r["total_us"])
    busy, last = 0.0, None
    for e in device:
        a, b = e["ts"], e["ts"] + e["dur"]
        if last is None or a >= last:
            busy += b - a
            last = b
        elif b > last:
            busy += b - last
            last = b
    # The main thread's events of 50 us or more, in order: the call's structure at a glance.
    timeline = [{"start_us": e["ts"] - start, "dur_us": e["dur"], "event": e["name"][:100]}
                for e in sorted(host, key=lambda e: e["ts"]) if (e["tid"], e["pid"]) == main and e["dur"] >= 50]
    return {"window_us": end - start, "chunk_calls": len(chunks), "chunk_call_us": sum(e["dur"] for e in chunks),
            "read_us": sum(e["dur"] for e in reads), "device_busy_us": busy, "device_kernels": len(device),
            "lead_us": next((e["ts"] - start for e in device
                             if "decode_chunk" in str(e.get("args", {}).get("hlo_module", ""))), None),
            "tail_us": (end - last) if last is not None else None,
            "host_events": rows[:60], "main_timeline": timeline[:200]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, default="tiny-kimi-linear")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3, help="traced generate calls (the summary is of the last)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    model = build(args)
    gen, prompts, sp = warmed_generator(model, args.batch, args.prompt_len, args.tokens)
    untraced = [gen.generate(prompts, sp).timings for _ in range(3)]
    gen.compiled_chunk = Annotated(gen.compiled_chunk, CHUNK)
    original_read = generate_module.read_host_view
    generate_module.read_host_view = Annotated(original_read, READ)
    try:
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for _ in range(args.calls):
                    with jax.profiler.TraceAnnotation(CALL):
                        traced = gen.generate(prompts, sp).timings
            summary = summarize(latest_trace(trace_dir))
    finally:
        generate_module.read_host_view = original_read
    print(f"untraced decode_s {[round(t.decode_s * 1e3, 2) for t in untraced]} ms "
          f"(TPOT {[round(t.tpot_s * 1e3, 3) for t in untraced]} ms); traced {traced.decode_s * 1e3:.2f} ms")
    print(f"decode window {summary['window_us'] / 1e3:.2f} ms: chunk calls {summary['chunk_calls']} "
          f"({summary['chunk_call_us'] / 1e3:.2f} ms), host reads {summary['read_us'] / 1e3:.2f} ms, device busy "
          f"{summary['device_busy_us'] / 1e3:.2f} ms in {summary['device_kernels']} kernels, lead {summary['lead_us']} us "
          f"(first chunk call -> its first kernel), tail {summary['tail_us']} us (last kernel -> read done)")
    print(table(summary["host_events"][:40], ["event", "count", "total_us", "max_us", "main_thread"]))
    print(table(summary["main_timeline"][:80], ["start_us", "dur_us", "event"]))
    path = write(args.name or f"decode_host_trace_{args.model}_b{args.batch}",
                 {"benchmark": "decode_host_trace", "model": args.model, "dtype": args.dtype, "batch": args.batch,
                  "prompt_len": args.prompt_len, "new_tokens": args.tokens, "env": environment(),
                  "untraced_decode_ms": [t.decode_s * 1e3 for t in untraced],
                  "untraced_tpot_ms": [t.tpot_s * 1e3 for t in untraced], "traced_decode_ms": traced.decode_s * 1e3,
                  **summary})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
