"""The median of repeated `moe_mxfp4.py --hopper` runs: one row per Mosaic GPU setting and hand-off form (model,
tokens, blocks, handoff), with each run's time and the median over the runs, in the device loop and unrolled.

    python benchmarks/median_runs.py RUN_DIR/moe_mxfp4.json ... [--json OUT.json]

Single runs of a ~0.33 ms call spread by a few percent (run 41: 56.9-60.6% of 4.3 TB/s for one setting), so a
target is judged on the median of several runs (`gpu_session.sh moe-hopper-repeat` makes them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _key(row: dict) -> tuple:
    return row["model"], row["tokens"], row["blocks"], row.get("handoff") or "none"


def median_rows(runs: list[dict]) -> list[dict]:
    """Per setting of the runs' "hopper" rows (in first-seen order): the runs' times (ms; None where a run lacks the
    setting or failed it) and their medians. `runs`: the JSON records `moe_mxfp4.py` writes."""
    keys: dict[tuple, None] = {}
    for run in runs:
        for row in run.get("hopper", []):
            if "failed" not in row:
                keys.setdefault(_key(row))
    out = []
    for key in keys:
        found = [next((r for r in run.get("hopper", []) if _key(r) == key and "failed" not in r), None)
                 for run in runs]
        entry = {"model": key[0], "tokens": key[1], "blocks": key[2], "handoff": key[3], "runs": sum(map(bool, found))}
        for field in ("ms", "pct_4.3TB_s", "ms_unrolled", "pct_unrolled"):
            values = [r.get(field) if r else None for r in found]
            entry[field + "_each"] = values
            present = [v for v in values if isinstance(v, (int, float))]
            entry[field + "_median"] = statistics.median(present) if present else None
        out.append(entry)
    return out


def _cell(v) -> str:
    return "" if v is None else f"{v:.4f}" if v < 10 else f"{v:.1f}"


def table(rows: list[dict]) -> str:
    lines = ["| model | tokens | blocks | handoff | runs | ms unrolled (each) | median ms unrolled | median % unrolled "
             "| median ms loop | median % loop |", "|" + "---|" * 10]
    for r in rows:
        each = ", ".join(_cell(v) for v in r["ms_unrolled_each"])
        blocks = "default" if r["blocks"] == "None" else r["blocks"]
        lines.append(f"| {r['model']} | {r['tokens']} | {blocks} | {r['handoff']} | {r['runs']} | {each} | "
                     f"{_cell(r['ms_unrolled_median'])} | {_cell(r['pct_unrolled_median'])} | "
                     f"{_cell(r['ms_median'])} | {_cell(r['pct_4.3TB_s_median'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="moe_mxfp4.py JSON records, one a run")
    ap.add_argument("--json", help="also write the rows here, with the runs' environments")
    args = ap.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"median_runs: cannot read {path}: {exc}", file=sys.stderr)
            return 1
    rows = median_rows(runs)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": args.runs, "env": [r.get("env") for r in runs], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
