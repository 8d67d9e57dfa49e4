"""Summarises an Nsight Compute CSV (`ncu --csv --page raw --metrics ...`) into one markdown row per kernel:
duration, registers, occupancy, the busiest pipes and the main stall reasons.

    ncu --clock-control none -k regex:kda_chunk --launch-count 4 --csv --page raw --metrics $(python3 \\
        benchmarks/ncu_summary.py --metrics) python3 benchmarks/kda_prefill_once.py --heads 32 > ncu.csv
    python3 benchmarks/ncu_summary.py ncu.csv [--json out.json]

Stall columns are warps stalled per issued instruction (`smsp__average_warps_issue_stalled_*_per_issue_active`):
the cycles an instruction waits, summed over the warps that wait; the largest says what the kernel waits on
(long_scoreboard: global/local memory, short_scoreboard: shared memory and special functions, mio_throttle:
the shared-memory queue, math_pipe_throttle: a busy pipe, barrier: __syncthreads, wait: fixed latencies).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys

BASE = {
    "gpu__time_duration.sum": "us",
    "launch__registers_per_thread": "regs",
    "launch__block_size": "threads",
    "launch__grid_size": "blocks",
    "launch__occupancy_limit_registers": "blocks/SM by regs",
    "launch__shared_mem_per_block_static": "smem static",
    "launch__shared_mem_per_block_dynamic": "smem dyn",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem %",
    "dram__bytes.sum": "DRAM bytes",
    "smsp__inst_executed.sum": "instructions",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue %",
}
PIPES = {
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "fma",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active": "alu",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "xu",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": "lsu",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed": "shared",
}
STALLS = ["long_scoreboard", "short_scoreboard", "mio_throttle", "math_pipe_throttle", "barrier", "wait",
          "not_selected", "lg_throttle", "dispatch_stall", "no_instruction", "selected", "tex_throttle", "membar",
          "branch_resolving", "drain", "sleeping", "misc"]
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def metric_names() -> list[str]:
    return list(BASE) + list(PIPES) + [STALL_METRIC.format(s) for s in STALLS]


def number(text: str) -> float | None:
    """An ncu CSV cell as a float (thousands separators dropped), or None."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_rows(text: str) -> list[dict]:
    """ncu's raw CSV (a header row, a units row, one row per profiled launch) -> one dict per launch."""
    start = text.find('"ID"')
    if start < 0:
        raise ValueError("no ncu CSV header (a line starting with \"ID\") in the input")
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    units = next((r for r in rows if not r.get("ID", "").strip()), {})
    launches = [r for r in rows if r.get("ID", "").strip().isdigit()]
    for r in launches:
        r["_units"] = units
    return launches


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        name = r.get("Kernel Name", "?")
        entry: dict = {"kernel": name[:60]}
        for metric, label in BASE.items():
            entry[label] = number(r.get(metric, ""))
        if entry.get("us") is not None:
            unit = r["_units"].get("gpu__time_duration.sum", "nsecond")
            entry["us"] *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
        entry["pipes"] = {label: number(r.get(m, "")) for m, label in PIPES.items()}
        stalls = {s: number(r.get(STALL_METRIC.format(s), "")) for s in STALLS}
        entry["stalls"] = {s: v for s, v in sorted(stalls.items(), key=lambda kv: -(kv[1] or 0)) if v}
        out.append(entry)
    return out


def markdown(entries: list[dict]) -> str:
    lines = ["| kernel | us | regs | threads | shared KB | occupancy % | issue % | SM % | mem % | pipes % (busiest) "
             "| stalls per issue (top 4) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"
    for e in entries:
        pipes = ", ".join(f"{k} {v:.0f}" for k, v in sorted(e["pipes"].items(), key=lambda kv: -(kv[1] or 0))[:4]
                          if v is not None)
        stalls = ", ".join(f"{k} {v:.2f}" for k, v in list(e["stalls"].items())[:4])
        smem = [e[k] for k in ("smem static", "smem dyn") if e[k] is not None]
        shared = sum(smem) / 1024 if smem else None
        lines.append(f"| {e['kernel']} | {fmt(e['us'])} | {fmt(e['regs'], 0)} | {fmt(e['threads'], 0)} | "
                     f"{fmt(shared)} | "
                     f"{fmt(e['occupancy %'])} | {fmt(e['issue %'])} | {fmt(e['SM %'])} | {fmt(e['mem %'])} | "
                     f"{pipes} | {stalls} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?", help="ncu --csv --page raw output")
    ap.add_argument("--metrics", action="store_true", help="print the --metrics list for ncu and exit")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args()
    if args.metrics:
        print(",".join(metric_names()))
        return
    if not args.csv:
        ap.error("give the ncu CSV file (or --metrics)")
    with open(args.csv, encoding="utf-8", errors="replace") as f:
        entries = summarise(read_rows(f.read()))
    if not entries:
        sys.exit(f"{args.csv}: no profiled kernels in it")
    print(markdown(entries))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(entries, f, indent=1)


if __name__ == "__main__":
    main()
