"""Summarises Nsight Compute's source page of one profiled kernel: the SASS instructions where its warps were
most often sampled stalled, the samples summed by opcode, the instructions executed by opcode (what an issue-bound
kernel spends its issue slots on) and the samples spent waiting on each mbarrier.

    ncu -k regex:mosaic --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats \\
        -o rep -f python3 benchmarks/mla_decode_once.py --impl hopper
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 benchmarks/ncu_source_summary.py sass.csv [--top 25] [--json out.json]

The sample column is ncu's "Warp Stall Sampling (All Samples)" (each sample: one warp found at that instruction,
issuing or stalled); any per-reason stall columns ncu writes beside it are kept, the largest three per row.
An input this parser does not recognise fails with its first lines shown, so the format can be read off them.

A warp waiting on an mbarrier spins in `SYNCS.PHASECHK.TRANS64.TRYWAIT P, [bar], R` followed by `@!P BRA retry`,
and the retry loop it branches to (`NANOSLEEP`, another check, a branch back). ncu files those samples under the
branch, as "long scoreboard" stalls, so by opcode they read as `BRA`. The barrier waits table gives each wait site
(its try-wait's address and barrier operand, whose constant is the barrier's shared-memory offset when the address
is not all in registers) with the samples of the site and of its retry loop together.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.ncu_summary import number  # noqa: E402


def _header_index(rows: list[list[str]]) -> int:
    for i, row in enumerate(rows):
        low = [c.lower() for c in row]
        if any(c == "source" or c.startswith("source") for c in low) and any("sampl" in c for c in low):
            return i
    raise ValueError("no header row with a Source column and a sampling column")


def _pick(header: list[str], *needles: str) -> int | None:
    for i, name in enumerate(header):
        if all(n in name.lower() for n in needles):
            return i
    return None


def read(text: str) -> tuple[list[dict], list[str]]:
    """(one dict per instruction: address, source, samples, stalls {reason: samples}; the stall columns)."""
    rows = list(csv.reader(io.StringIO(text)))
    h = _header_index(rows)
    header = rows[h]
    source = _pick(header, "source")
    samples = _pick(header, "all samples")          # not "Not-issued Samples" ("stall" holds "all")
    samples = samples if samples is not None else _pick(header, "sampl")
    address = _pick(header, "address")
    executed = next((i for i, name in enumerate(header) if name.lower() == "instructions executed"), None)
    shared = _pick(header, "wavefronts shared excessive")
    stall_cols = [i for i, name in enumerate(header) if "stall" in name.lower() and "sampl" not in name.lower()]
    out = []
    for row in rows[h + 1:]:
        if len(row) != len(header):
            if out:
                break          # the next kernel's section, or the end
            continue           # a units row
        n = number(row[samples])
        if n is None:
            continue
        stalls = {header[i]: v for i in stall_cols if (v := number(row[i]))}
        out.append({"address": row[address] if address is not None else str(len(out)),
                    "source": row[source].strip(), "samples": n, "stalls": stalls,
                    "executed": (number(row[executed]) or 0.0) if executed is not None else 0.0,
                    "shared_excess": (number(row[shared]) or 0.0) if shared is not None else 0.0})
    return out, [header[i] for i in stall_cols]


def opcode(sass: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())
    return text.split(" ")[0] if text else "?"


_BRANCH_WITHIN = 8          # instructions after a try-wait searched for the branch on its predicate
_TRY_WAIT = re.compile(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT\s+(\w+),\s*(\[[^\]]*\])")


def _address(text: str) -> int | None:
    try:
        return int(text, 16)
    except ValueError:
        return None


def barrier_waits(instructions: list[dict]) -> list[dict]:
    """One entry per mbarrier wait site (a try-wait followed, within a few instructions, by a branch on its failure):
    {address, barrier (the operand), samples (the try-wait, the branch and the retry loop it branches to)}, most
    first."""
    at = {a: k for k, i in enumerate(instructions) if (a := _address(i["address"])) is not None}
    waits = []
    for k, ins in enumerate(instructions):
        m = _TRY_WAIT.match(ins["source"])
        if not m:
            continue
        b = branch = None
        for branch in instructions[k + 1:k + 1 + _BRANCH_WITHIN]:    # the scheduler may put other work between
            b = re.match(rf"@!{m.group(1)}\s+BRA\s+(0x[0-9a-fA-F]+)", branch["source"])
            if b or re.match(rf"(@!?U?P\w+\s+)?\S+\s+{m.group(1)},", branch["source"]):
                break                 # the branch, or the predicate written again (a retry loop's own check)
        if not b:
            continue
        samples = ins["samples"] + branch["samples"]
        j = at.get(int(b.group(1), 16))
        while j is not None and j < len(instructions):     # the retry loop, up to its unconditional branch back
            samples += instructions[j]["samples"]
            if re.match(r"BRA\s", instructions[j]["source"]):
                break
            j += 1
        waits.append({"address": ins["address"], "barrier": m.group(2), "samples": samples})
    return sorted(waits, key=lambda w: -w["samples"])


def summarise(instructions: list[dict], top: int) -> dict:
    total = sum(i["samples"] for i in instructions) or 1.0
    by_op, run_op = collections.Counter(), collections.Counter()
    for i in instructions:
        by_op[opcode(i["source"])] += i["samples"]
        run_op[opcode(i["source"])] += i.get("executed", 0.0)
    executed = sum(run_op.values())
    hot = sorted(instructions, key=lambda i: -i["samples"])[:top]
    return {"total_samples": total, "instructions": len(instructions),
            "top": [{**i, "pct": 100 * i["samples"] / total,
                     "stalls": dict(sorted(i["stalls"].items(), key=lambda kv: -kv[1])[:3])} for i in hot],
            "by_opcode": [{"opcode": k, "samples": v, "pct": 100 * v / total} for k, v in by_op.most_common(15)],
            "executed": executed,
            "executed_by_opcode": [{"opcode": k, "executed": v, "pct": 100 * v / executed}
                                   for k, v in run_op.most_common(25)] if executed else [],
            "shared_excess_wavefronts": sum(i.get("shared_excess", 0.0) for i in instructions),
            "barrier_waits": [{**w, "pct": 100 * w["samples"] / total} for w in barrier_waits(instructions)]}


def markdown(s: dict) -> str:
    lines = [f"{s['instructions']} SASS instructions, {s['total_samples']:.0f} warp samples", "",
             "| address | SASS | samples % | stall columns (top 3) |", "|---|---|---|---|"]
    for i in s["top"]:
        stalls = ", ".join(f"{k} {v:.0f}" for k, v in i["stalls"].items())
        lines.append(f"| {i['address']} | `{i['source'][:72]}` | {i['pct']:.1f} | {stalls} |")
    lines += ["", "| opcode | samples % |", "|---|---|"]
    lines += [f"| {o['opcode']} | {o['pct']:.1f} |" for o in s["by_opcode"]]
    if s.get("executed_by_opcode"):
        lines += ["", f"{s['executed']:.4g} warp instructions executed; shared-memory wavefronts in excess of ideal "
                  f"(bank conflicts): {s['shared_excess_wavefronts']:.4g}", "",
                  "| opcode | executed % |", "|---|---|"]
        lines += [f"| {o['opcode']} | {o['pct']:.1f} |" for o in s["executed_by_opcode"]]
    if s.get("barrier_waits"):
        lines += ["", "| barrier wait at | barrier | samples % (with its retry loop) |", "|---|---|---|"]
        lines += [f"| {w['address']} | `{w['barrier']}` | {w['pct']:.1f} |" for w in s["barrier_waits"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="instructions listed")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    with open(args.csv, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        instructions, _ = read(text)
    except ValueError as e:
        head = "\n".join(text.splitlines()[:6])
        print(f"{args.csv}: {e}; its first lines:\n{head}", file=sys.stderr)
        return 1
    if not instructions:
        print(f"{args.csv}: no instruction rows under the header", file=sys.stderr)
        return 1
    s = summarise(instructions, args.top)
    print(markdown(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
