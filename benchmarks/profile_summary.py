"""Summarises a jax.profiler trace of the decode loop into a per-category table.

    python benchmarks/profile_summary.py TRACE_DIR HLO_DUMP_DIR --module decode_chunk --steps 16

Device events (GPU kernels, or XLA:CPU thunks on the CPU) carry the HLO instruction that launched
them (`hlo_op`); the optimized HLO dumped by XLA (`--xla_dump_to`) gives each instruction's
`op_name`, which holds the model's named scopes (kda, mla, router, routed_experts, ...). A kernel's
category is its scope, split into matmuls and the rest; "gaps" is the time the device sat idle
between kernels inside the measured window. Kernels whose events name no instruction of the dump
(Pallas and Mosaic GPU launches) take the scope their name spells, else the one the named kernels
on either side of them on their stream share (`scoped_op_names`; counted as `stood_in_ops`).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
from collections import defaultdict

# Scope names the model sets (jax.named_scope), most specific first.
SCOPES = ("sampling", "lm_head", "embed", "router", "routed_experts", "shared_experts", "dense_mlp", "attn_res",
          "kda", "mla", "norm")
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name="([^"]*)"')
_MATMUL = ("dot_general", "dot", "gemm", "gemv", "cublas", "matmul", "grouped_matmul", "grouped_glu")
# Control flow executes its body's kernels: on the CPU its thunk spans them (counted twice otherwise).
_CONTAINERS = re.compile(r"^(while|cond|conditional|call)(\.\d+)?$")


def hlo_op_names(dump_dir: str, module: str) -> dict[str, str]:
    """Instruction name -> op_name from XLA's optimized HLO dumps of modules matching `module`."""
    names = {}
    for path in glob.glob(os.path.join(dump_dir, "*.txt")):
        base = os.path.basename(path)
        if module not in base or "after_optimizations" not in base or "buffer-assignment" in base:
            continue
        with open(path) as f:
            for line in f:
                m = _INSTR.match(line)
                if m:
                    names[m.group(1)] = m.group(2)
    return names


def _op_name(event: dict, op_names: dict[str, str]) -> str:
    """The op_name of the HLO instruction behind a device event ("" when unknown). Kernel names
    spell an instruction's ".N" suffix as "_N"."""
    for name in (str(event.get("args", {}).get("hlo_op", "")), event["name"]):
        if name in op_names:
            return op_names[name]
        dotted = re.sub(r"_(\d+)$", r".\1", name)
        if dotted in op_names:
            return op_names[dotted]
    return ""


def _scope(op_name: str) -> str | None:
    """The most specific model scope in an op_name's path, or None."""
    parts = op_name.split("/")
    return next((s for s in SCOPES if s in parts), None)


def _kernel_scope(kernel: str) -> str | None:
    """A scope the kernel's own name spells ("kda_decode" -> "kda", "add_rms_norm" -> "norm",
    "routed_experts_gmm" -> "routed_experts"), or None."""
    name = kernel.lower()
    return next((s for s in SCOPES if re.search(rf"(^|[^a-z0-9]){s}([^a-z0-9]|$)", name)), None)


def scoped_op_names(events: list[dict], op_names: dict[str, str]) -> tuple[list[str], int]:
    """Each event's op_name; for kernels whose trace event names no HLO instruction of the dump (Pallas and
    Mosaic GPU launches) a stand-in scope: the one their name spells, else the one the nearest kernels with an
    op_name before and after them on their stream share (a launch between two kernels of the routed experts is
    theirs; one between two layers' kernels stays unscoped). Returns (op_names in the events' order, how many
    were stood in)."""
    named = [_op_name(e, op_names) for e in events]
    lanes: dict[object, list[int]] = defaultdict(list)
    for i in sorted(range(len(events)), key=lambda j: events[j]["ts"]):
        lanes[(events[i].get("pid"), events[i].get("tid"))].append(i)
    stood: dict[int, str] = {}
    for order in lanes.values():
        scopes = [_scope(named[i]) if named[i] else None for i in order]
        before, after = [None] * len(order), [None] * len(order)
        for j in range(1, len(order)):                  # the scope of the nearest named kernel before j
            before[j] = scopes[j - 1] if named[order[j - 1]] else before[j - 1]
        for j in range(len(order) - 2, -1, -1):         # ... and after j
            after[j] = scopes[j + 1] if named[order[j + 1]] else after[j + 1]
        for j, i in enumerate(order):
            if not named[i]:
                scope = _kernel_scope(str(events[i]["name"]))
                if scope is None and before[j] is not None and before[j] == after[j]:
                    scope = before[j]
                if scope is not None:
                    stood[i] = scope
    for i, scope in stood.items():
        named[i] = scope
    return named, len(stood)


def _category(op_name: str, kernel: str) -> str:
    parts = op_name.split("/")
    scope = _scope(op_name)
    matmul = any(k in (parts[-1] if parts else "") for k in _MATMUL) or any(k in kernel.lower() for k in _MATMUL)
    if scope is None:
        return "unscoped matmul" if matmul else "unscoped other"
    if scope in ("routed_experts", "shared_experts", "dense_mlp", "lm_head", "router", "sampling", "embed",
                 "attn_res", "norm"):
        return scope
    return f"{scope} {'matmul' if matmul else 'other'}"


def latest_trace(trace_dir: str) -> str:
    """The newest perfetto trace a `jax.profiler.trace(..., create_perfetto_trace=True)` left under trace_dir."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no perfetto trace under {trace_dir}")
    return files[-1]


def device_events(trace_file: str, module: str | None, *, gpu_only: bool = False) -> list[dict]:
    """Device kernels of the trace (GPU lanes when there are any), of HLO modules whose name holds
    `module` (None: every module), control-flow containers left out. gpu_only: [] where the trace has no GPU
    lane (a GPU trace whose device tracer failed to start holds host events only)."""
    with gzip.open(trace_file) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = any("GPU" in name or "gpu" in name for name in procs.values())
    if gpu_only and not gpu:
        return []
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args", {})
        if module is not None and module not in str(args.get("hlo_module", "")):
            continue
        if gpu and "GPU" not in procs.get(e["pid"], "") and "gpu" not in procs.get(e["pid"], ""):
            continue
        if _CONTAINERS.match(str(args.get("hlo_op", e["name"]))):
            continue
        out.append(e)
    return out


def summarize(trace_dir: str, dump_dir: str, module: str, steps: int) -> dict:
    """{"rows": per-category rows, "step_us", "busy_us", ...} for one decode trace."""
    trace_file = latest_trace(trace_dir)
    events = device_events(trace_file, module)
    if not events:
        raise ValueError(f"no device events of module {module!r} in {trace_file}")
    op_names = hlo_op_names(dump_dir, module)
    by_cat = defaultdict(lambda: {"us": 0.0, "kernels": 0})
    by_kernel = defaultdict(lambda: {"us": 0.0, "count": 0, "category": ""})
    spans = []
    named, stood_in = scoped_op_names(events, op_names)
    for e, op_name in zip(events, named):
        cat = _category(op_name, e["name"])
        by_cat[cat]["us"] += e["dur"]
        by_cat[cat]["kernels"] += 1
        k = by_kernel[e["name"]]
        k["us"] += e["dur"]
        k["count"] += 1
        k["category"] = cat
        k["op_name"] = op_name[-120:]
        spans.append((e["ts"], e["ts"] + e["dur"], e["name"]))
    spans.sort()
    busy, end = 0.0, -1e30
    idle_before = defaultdict(lambda: {"us": 0.0, "count": 0})
    for a, b, name in spans:
        if a > end > -1e30:   # the device sat idle until this kernel started
            idle_before[name[:80]]["us"] += a - end
            idle_before[name[:80]]["count"] += 1
        if b > end:
            busy += b - max(a, end)
            end = b
    window = spans[-1][1] - spans[0][0]
    rows = [{"category": c, "us_per_step": v["us"] / steps, "kernels_per_step": v["kernels"] / steps,
             "pct_of_step": 100 * v["us"] / window} for c, v in by_cat.items()]
    rows.append({"category": "gaps (device idle)", "us_per_step": (window - busy) / steps, "kernels_per_step": 0,
                 "pct_of_step": 100 * (window - busy) / window})
    rows.sort(key=lambda r: -r["us_per_step"])
    top = sorted(({"kernel": n[:80], **v, "us_per_step": v["us"] / steps} for n, v in by_kernel.items()),
                 key=lambda r: -r["us"])   # every kernel: the long tail is where the small fusions hide
    gaps = sorted(({"kernel": n, "idle_us_per_step": v["us"] / steps, "count": v["count"],
                    "mean_idle_us": v["us"] / v["count"]} for n, v in idle_before.items()),
                  key=lambda r: -r["idle_us_per_step"])[:25]   # which launches the device waits for
    return {"steps": steps, "step_us": window / steps, "busy_us": busy / steps, "kernels_per_step": len(events) / steps,
            "mapped_ops": sum(1 for e in events if _op_name(e, op_names)), "stood_in_ops": stood_in,
            "events": len(events), "rows": rows, "top_kernels": top, "idle_before": gaps}


def markdown(summary: dict) -> str:
    lines = [f"step {summary['step_us']:.0f} us, device busy {summary['busy_us']:.0f} us, "
             f"{summary['kernels_per_step']:.0f} kernels per step",
             "", "| category | us / step | % of step | kernels / step |", "|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| {r['category']} | {r['us_per_step']:.1f} | {r['pct_of_step']:.1f} | "
                     f"{r['kernels_per_step']:.0f} |")
    if summary.get("idle_before"):
        lines += ["", "| device idle before | us / step | launches | mean us |", "|---|---|---|---|"]
        for r in summary["idle_before"][:10]:
            lines.append(f"| {r['kernel']} | {r['idle_us_per_step']:.1f} | {r['count']} | {r['mean_idle_us']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir")
    ap.add_argument("dump_dir")
    ap.add_argument("--module", default="decode_chunk")
    ap.add_argument("--steps", type=int, required=True, help="model forwards in the trace")
    args = ap.parse_args(argv)
    summary = summarize(args.trace_dir, args.dump_dir, args.module, args.steps)
    print(markdown(summary))
    print(json.dumps(summary["top_kernels"][:10], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
