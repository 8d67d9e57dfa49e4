"""PNG plots from the benchmark JSON (matplotlib needed; `pip install matplotlib`).

    python benchmarks/plot.py decode   # TPOT against batch, before / after, with the floors
    python benchmarks/plot.py moe      # routed-expert MLP time against tokens, every implementation
    python benchmarks/plot.py speculative  # verify cost against q; speed-up against accepted length
    python benchmarks/plot.py prefill  # time to first token against prompt length
    python benchmarks/plot.py server   # server load: throughput, TPOT and TTFT against concurrent clients
    python benchmarks/plot.py mla      # MLA decode: share of the bandwidth floor per shape, both kernels
    python benchmarks/plot.py mla-step # an MLA decode step at B=1: device time of its three launches, before / after
    python benchmarks/plot.py kda-intra # KDA chunked prefill at T = 8192: the two kernels per variant, and fla
    python benchmarks/plot.py kda-kernels  # the same by kernel (profiled run), beside fla's kernels
    python benchmarks/plot.py kda-stages   # the sequential pass's pipeline stages (KDA run 10)
    python benchmarks/plot.py kda-tiles    # the tiled intra forms against the default (KDA run 12)
    python benchmarks/plot.py kda-diagonal # device time per kernel: diagonal blocks per token, joint, fla (run 19)
    python benchmarks/plot.py kda-band     # by kernel: the band, the cumsum inside, wide factors (run 21)
    python benchmarks/plot.py kda-tile-solve  # by kernel: 16 x 16 tiles across sub-blocks, W, U in a loop (run 27)
    python benchmarks/plot.py kda-handoff     # by kernel: q, k handed on in bf16, 2^x, one warp (run 28, H100)
    python benchmarks/plot.py kda-sweep       # by kernel: the settings around those defaults (run 29, H100)
    python benchmarks/plot.py kda-run30       # by kernel: today's defaults, run 29's and 27's, fla (run 30, H100)
    python benchmarks/plot.py kda-run31       # by kernel: the tile pairs launch's forms, fla (run 31, H200, H = 32)
    python benchmarks/plot.py run32           # KDA decode at B = 1 by launches a call; the MXFP4 call by kernel (H100)
    python benchmarks/plot.py run33           # KDA decode at B = 1 (60 layers) and 64; MXFP4 tiles / rows (H100, H200)
    python benchmarks/plot.py run37           # MXFP4 experts: the two hand-offs, grid and persistent launches (H100)
    python benchmarks/plot.py run38           # MXFP4 experts: issue slots by kind, MMA calls, the scaled decode (H100)
    python benchmarks/plot.py run39           # MXFP4 experts: device time by part, word loads, the GLU hand-off (H100)
    python benchmarks/plot.py run40           # MXFP4 experts: the glue by kernel; the model's decode by layout (H100)
    python benchmarks/plot.py kda-scaling  # prefill time against T, decode bandwidth against batch, beside fla
    python benchmarks/plot.py mla-merge    # the MLA split merge alone per launch setting (merge sweep 2)
    python benchmarks/plot.py mxfp4        # packed experts: share of the floor before / after the PTX decode
    python benchmarks/plot.py load-processes  # two-process loads: bytes and seconds per process, per mesh (CPU)
    python benchmarks/plot.py all

Inputs are the JSON records under benchmarks/results/h200/ (h100/ for kda-handoff, kda-sweep and kda-run30, cpu/ for
load-processes); the PNGs are written beside RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
H200 = os.path.join(HERE, "results", "h200")
H100 = os.path.join(HERE, "results", "h100")
CPU = os.path.join(HERE, "results", "cpu")


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _load(name: str, folder: str = H200) -> dict:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def _tpot(name: str) -> dict:
    return {r["batch"]: r["tpot_ms"] for r in _load(name)["rows"]}


def _variant_tpot(name: str, variant: str | None, batch: int) -> float:
    """TPOT of one (variant, batch) row of a decode.py record (variant None: the base options)."""
    return next(r["tpot_ms"] for r in _load(name)["rows"] if r.get("variant") == variant and r["batch"] == batch)


DECODE_SWEEP = "decode_sweep_run1_2f1af95.json"
DECODE_SWEEP_2 = "decode_sweep_run2_ea4a268.json"


def plot_decode(out: str) -> str:
    """TPOT against batch for the Kimi-Linear-48B shape: each recorded run, and the floors."""
    runs = [("before (gather experts, XLA dots)", {1: 9.05, 64: 220.56}, "o--"),  # 2026-11-29 baseline runs
            ("+ row-tiled expert kernel", {r["batch"]: r["tpot_ms"] for r in _load("decode_run3_measured_experts.json")["rows"]},
             "s-"),
            ("+ few-row projections through the kernel", {1: 5.10, 64: 20.60}, "D-"),  # decode_run4_skinny.log
            ("+ one launch per shared input", _tpot("decode_run5_fused_projections.json"), "^-"),
            ("+ unsorted expert pairs, router in the shared launch", _tpot("decode_run6_pairs_router.json"), "v-"),
            ("+ expert glue, Hopper MLA decode kernel", _tpot("decode_run8_mla_hopper.json"), "P-"),
            ("+ router and norm kernels, unsplit KDA launch", _tpot("decode_run10_glue_9c783c7.json"), "X-"),
            ("+ shared expert as a pair, add+norm, pair tiles, 4 steps per loop iteration",
             _tpot("decode_run14_defaults_21c2203.json"), "*-"),
            ("+ flat dispatch, one read-back per chunk, first token with the prefill, 1 step per iteration",
             {1: _variant_tpot("decode_run19_b1_sampled_first_ed80dc8.json", "loop_unroll=1", 1),
              64: _variant_tpot("decode_run19_b64_sampled_first_ed80dc8.json", None, 64)}, "h-"),
            ("+ fused token draw, 4 steps per iteration up to 16 rows (B = 1-256 sweep)",
             _tpot(DECODE_SWEEP), "o-"),
            ("+ Hopper MLA at short caches, first chunk started during the first token's read (sweep 2)",
             _tpot(DECODE_SWEEP_2), "d-")]
    fig, ax = plt.subplots(figsize=(6.4, 6.8))
    fig.subplots_adjust(bottom=0.42)
    for label, points, style in runs:
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], style, label=label)
    # bytes that must move / 4.3 TB/s, at each batch's measured count of distinct experts per layer
    floors = {r["batch"]: r["floor_ms"] for r in _load(DECODE_SWEEP_2)["rows"]}
    ax.plot(sorted(floors), [floors[x] for x in sorted(floors)], "k:", label="memory floor (4.3 TB/s)")
    return _finish(fig, ax, "batch (rows decoding together)", "time per output token step (ms)",
                   "Kimi-Linear-48B shape, bf16, one H200", os.path.join(out, "decode_tpot.png"), legend_below=True)


def _axes(ax, xlabel: str, ylabel: str, title: str, log_y: bool = True, title_size=None) -> None:
    """Log-2 x axis (and log y unless `log_y` is False), labels, title and grid."""
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))
    ax.grid(True, which="both", alpha=0.3)


def _bar_axes(ax, x, labels, ylabel: str, title: str, legend: bool = True, tick_size=None) -> None:
    """A bar panel's categories, y label, title (10 pt), legend (8 pt) and horizontal grid."""
    ax.set_xticks(x, labels, **({} if tick_size is None else {"fontsize": tick_size}))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if legend:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, path: str, legend_below: bool = False) -> str:
    """Log-log axes, labels, grid and legend (inside, or under the axes); saves the PNG and returns
    its path."""
    _axes(ax, xlabel, ylabel, title)
    if legend_below:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    else:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_moe(out: str) -> str:
    """Routed-expert MLP time against tokens for each implementation, with the floor."""
    rows = [r for r in _load("moe_run2.json")["rows"] if r["model"] == "kimi-linear"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, style in (("pallas", "D-"), ("mgpu", "s--"), ("tokamax", "^--"), ("xla", "o:"), ("gather", "v:")):
        pts = [(r["tokens"], r[f"{name}_ms"]) for r in rows if isinstance(r.get(f"{name}_ms"), float)]
        if pts:
            ax.plot(*zip(*pts), style, label=name)
    ax.plot([r["tokens"] for r in rows], [r["floor_ms"] for r in rows], "k:", label="floor (bytes or FLOPs)")
    return _finish(fig, ax, "tokens (top-8 of 256 experts, 2304 x 1024)", "routed-expert MLP (ms, host-timed)",
                   "Routed experts on one H200, bf16", os.path.join(out, "moe_experts.png"))


SPECULATIVE_BEFORE = "speculative_run2_planted.json"          # scan of one-token kernels (cb323b6)
SPECULATIVE_VERIFY = "speculative_run5_verify.json"           # window kernels, outputs-only verify (14a47ea)
SPECULATIVE_E2E = "speculative_run5_e2e_b1.json"              # same commit, B = 1, k = 4
SPECULATIVE_NOW = "speculative_run6_dfe8354.json"             # B = 1, verify q = 1, 4, 5 and k = 4 end to end
SPECULATIVE_NOW_ROWS = "speculative_run7_verify_1814494.json"  # B = 8, 64, verify q = 1, 2, 4, 8


def plot_speculative(out: str) -> str:
    """Left: verify + commit time over one decode step against q (runs 5-7; dotted: the memory-floor
    ratio). Right: end-to-end speed-up over plain decoding against tokens per verify step (replay
    drafts), runs 5 and 6 at B = 1 beside run 2."""
    before, verify, e2e = _load(SPECULATIVE_BEFORE), _load(SPECULATIVE_VERIFY), _load(SPECULATIVE_E2E)
    now = _load(SPECULATIVE_NOW)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for b, style in ((1, "o"), (8, "s"), (64, "D")):
        rows = [r for r in verify["verify"] if r["batch"] == b]
        if rows:
            line, = left.plot([r["q"] for r in rows], [r["ratio_to_decode"] for r in rows], style + "-",
                              label=f"B={b} (run 5)")
            left.plot([r["q"] for r in rows], [r["floor_ratio"] for r in rows], style + ":", color=line.get_color(),
                      label=f"B={b} floor ratio (uniform routing)")
    rows = [r for r in now["verify"] if r["batch"] == 1]
    left.plot([r["q"] for r in rows], [r["ratio_to_decode"] for r in rows], "o-", color="tab:red", label="B=1 (run 6)")
    now_rows = _load(SPECULATIVE_NOW_ROWS)["verify"]
    for b, style in ((8, "s"), (64, "D")):
        rows = [r for r in now_rows if r["batch"] == b]
        left.plot([r["q"] for r in rows], [r["ratio_to_decode"] for r in rows], style + "-", color="tab:red",
                  alpha=0.55, label=f"B={b} (run 7)")
    left.axhline(1.3, color="k", lw=0.8, ls="--", label="target q=4, B=1")
    left.set_xscale("log", base=2)
    left.set_xlabel("q (tokens verified per row)")
    left.set_ylabel("verify + commit / one decode step")
    left.set_title("Verify cost, Kimi-Linear-48B shape, bf16 (runs 5-7)")
    series = [(before, 1, "o--", "run 2"), (before, 8, "s--", "run 2"), (e2e, 1, "o-", "run 5"),
              (now, 1, "o-", "run 6")]
    for record, b, style, tag in series:
        rows = sorted((r for r in record["end_to_end"] if r["batch"] == b), key=lambda r: r["mean_accepted_length"])
        if rows:
            right.plot([r["mean_accepted_length"] for r in rows], [r["speedup"] for r in rows], style,
                       label=f"B={b}, k={rows[0]['k']} ({tag})")
    right.plot([1, 5], [1 / 2.73, 5 / 2.73], "k:", lw=0.8, label="both steps at their floors (B=1, k=4)")
    # run 6 estimate: the q = 5 step with no work beyond a plain step's non-expert part (1.58 ms) and its experts at
    # 90% of 4.3 TB/s (3.58 ms), against plain decoding at 2.418 ms (RESULTS.md, speculative runs 6-7)
    step = 1.58 + 3.58
    right.plot([1, 5], [2.418 / step, 5 * 2.418 / step], "-.", color="tab:red", lw=0.8,
               label="run 6 estimate: no verify work, experts at 90%")
    right.axhline(2.0, color="k", lw=0.8, ls="--", label="target at 4 tokens/step, B=1")
    right.axvline(4.0, color="k", lw=0.5, ls=":")
    right.set_xlabel("tokens per verify step (accepted drafts + 1)")
    right.set_ylabel("tokens/s over plain decoding")
    right.set_title("Replay drafts, greedy, 64 new tokens")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, os.path.join(out, "speculative.png"))


PREFILL_RUNS = (("prefill_run1_chunked.json", "JAX flash attention (ed15f97)"),
                ("prefill_run2_cudnn.json", "cuDNN flash attention (a43cd23)"),
                ("prefill_run3_cudnn_chunks.json", "+ cuDNN for continuation chunks (4a6d98f)"))


def plot_prefill(out: str) -> str:
    """Time to first token against prompt tokens at B = 1 (and 64 x 1K), one line per run."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, label in PREFILL_RUNS:
        if not os.path.exists(os.path.join(H200, name)):
            continue
        rows = [r for r in _load(name)["rows"] if "ttft_ms" in r]
        ones = sorted((r for r in rows if r["batch"] == 1), key=lambda r: r["prompt_len"])
        line, = ax.plot([r["prompt_len"] for r in ones], [r["ttft_ms"] / 1e3 for r in ones], "o-", label=f"B=1, {label}")
        for r in rows:
            if r["batch"] > 1:
                ax.plot([r["batch"] * r["prompt_len"]], [r["ttft_ms"] / 1e3], "s", color=line.get_color(),
                        label=f"{r['batch']} x {r['prompt_len']}")
    ax.plot([8192], [0.25], "k*", label="target: 8K in 250 ms")
    return _finish(fig, ax, "prompt tokens (all rows)", "time to first token (s)",
                   "Prefill, Kimi-Linear-48B shape, bf16, one H200", os.path.join(out, "prefill_ttft.png"))


MLA_DECODE = "mla_decode_run4_hopper.json"
# 2026-12-03: the whole call unrolled 20 times in one program (run 8), and the kernel alone from a profile
# (run 8, else run 5, the launch-order change alone).
MLA_DECODE_LATER = ("mla_decode_run8_final.json", "mla_decode_run5_grid.json")


def plot_mla_decode(out: str) -> str:
    """Share of 4.3 TB/s (cache bytes read once) for each shape: the Triton-lowered kernel, the Hopper
    kernel as first measured (20 calls in a device loop), and later the Hopper call unrolled and the
    kernel alone."""
    import numpy as np

    rows = [r for r in _load(MLA_DECODE)["rows"] if r["impl"] in ("triton", "hopper")]
    latest = {}
    for r in rows:                                  # run 4 supersedes run 3 where both measured a shape
        latest[(r["impl"], r["H"], r["B"], r["ctx"], r["q"])] = r
    call, kernel = {}, {}
    for name in reversed(MLA_DECODE_LATER):         # the first named wins where both measured a shape
        if os.path.exists(os.path.join(H200, name)):
            for r in _load(name)["rows"]:
                if r["impl"] == "hopper" and r.get("splits", 0) == 0:
                    key = (r["H"], r["B"], r["ctx"], r["q"])
                    if "call_pct_4.3TB_s" in r:
                        call[key] = r["call_pct_4.3TB_s"]
                    if "kernel_pct_4.3TB_s" in r:
                        kernel[key] = r["kernel_pct_4.3TB_s"]
    shapes = sorted({k[1:] for k in latest}, key=lambda k: (k[3], k[0], -k[1], k[2]))
    fig, ax = plt.subplots(figsize=(9, 4.4))
    x = np.arange(len(shapes))
    series = [("Triton lowering (before)", [latest.get(("triton", *k), {}).get("pct_4.3TB_s", 0) for k in shapes]),
              ("Hopper kernel, 2026-12-02 (device loop)",
               [latest.get(("hopper", *k), {}).get("pct_4.3TB_s", 0) for k in shapes]),
              ("Hopper call, 2026-12-03 (unrolled)", [call.get(k, 0) for k in shapes]),
              ("Hopper kernel alone, 2026-12-03 (profile)", [kernel.get(k, 0) for k in shapes])]
    for j, (label, ys) in enumerate(series):
        ax.bar(x + (j - 1.5) * 0.2, ys, 0.2, label=label)
    ax.axhline(70, color="k", linestyle=":", label="target 70%")
    ax.set_xticks(x, [f"H{h} {b}x{c // 1024}K q{q}" for h, b, c, q in shapes], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("% of 4.3 TB/s (cache read once)")
    ax.set_title("MLA decode over a bf16 latent cache, one H200")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, os.path.join(out, "mla_decode.png"))


MLA_STEP = [("before (e1fcd4c)", "mla_decode_step_run1_e1fcd4c.json"),
            ("after (5ffe468)", "mla_decode_step_run2_5ffe468.json")]


def plot_mla_step(out: str) -> str:
    """Device time of the three launches of one MLA decode step at B=1 (default settings), per cache
    length, before and after this change of splits and value steps."""
    import numpy as np

    bars = []
    for i, (label, name) in enumerate(MLA_STEP):
        for r in _load(name)["rows"]:
            if r["setting"] == "default" and r["batch"] == 1:
                bars.append((f"{r['slots']} slots\n{label}", r, i))
    bars.sort(key=lambda b: (b[1]["slots"], b[2]))
    fig, ax = plt.subplots(figsize=(7, 4.4))
    x = np.arange(len(bars))
    bottom = np.zeros(len(bars))
    for key, label in (("query_us", "W_UK into the queries"), ("attention_us", "attention kernel (Hopper)"),
                       ("value_us", "W_UV and the split merge")):
        ys = np.array([b[1].get(key, 0.0) for b in bars])
        ax.bar(x, ys, 0.6, bottom=bottom, label=label)
        bottom += ys
    ax.set_xticks(x, [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("device us per MLA layer step")
    ax.set_title("MLA decode step at B = 1, H = 32 (one H200)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    return _save(fig, os.path.join(out, "mla_decode_step.png"))


KDA_PREFILL = "kda_prefill_run2_7c7aec2.json"


KDA_STAGES = "kda_prefill_run10_stages_a078edf.json"   # the sequential pass's pipeline stages (RESULTS.md)


def plot_kda_stages(out: str) -> str:
    return plot_kda_intra(out, KDA_STAGES, "kda_stages.png")


KDA_TILES = "kda_prefill_run12_tiles_17f8ec0.json"    # the tiled intra forms timed (RESULTS.md, KDA run 12)


def plot_kda_tiles(out: str) -> str:
    return plot_kda_intra(out, KDA_TILES, "kda_tiles.png")


MLA_MERGE = "mla_merge_sweep2_7bd4157.json"


def plot_mla_merge(out: str) -> str:
    """The MLA split merge alone: device time per launch setting, XLA's kernels first, at both shapes."""
    import numpy as np

    rows = _load(MLA_MERGE)["rows"]
    shapes = sorted({(r["B"], r["splits"]) for r in rows}, key=lambda bs: -bs[1])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 5))
    for ax, (b, splits) in zip(np.atleast_1d(axes), shapes):
        mine = [r for r in rows if (r["B"], r["splits"]) == (b, splits)]
        y = np.arange(len(mine))
        ax.barh(y, [r["us"] for r in mine], 0.6, color=["C1" if r["impl"].startswith("xla") else "C0" for r in mine])
        ax.set_yticks(y, [f"{r['impl']} ({r['kernels']} kernels)" for r in mine], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("us per merge (device time)")
        ax.set_title(f"MLA split merge, B = {b}, {splits} splits, 32 rows x 512 (one H200)", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, os.path.join(out, "mla_merge.png"))


MXFP4_BEFORE, MXFP4_AFTER = "moe_mxfp4_run4_f2d4966.json", "moe_mxfp4_run8_defaults_b226bf0.json"


def plot_mxfp4(out: str) -> str:
    """Routed-expert MLP on MXFP4 weights kept packed: share of 4.3 TB/s (packed bytes) per model and token
    count, before (run 4) and after (run 8) the inline-PTX decode, beside the same kernels on bf16 weights."""
    import numpy as np

    before = {(r["model"], r["tokens"]): r for r in _load(MXFP4_BEFORE)["rows"]}
    after = [r for r in _load(MXFP4_AFTER)["rows"] if (r["model"], r["tokens"]) in before]
    x = np.arange(len(after))
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, (label, values) in enumerate((
            ("bf16 weights (run 8)", [r["bf16_pct_4.3TB_s"] for r in after]),
            ("MXFP4, run 4", [before[(r["model"], r["tokens"])]["mxfp4_pct_4.3TB_s"] for r in after]),
            ("MXFP4, run 8 (inline PTX)", [r["mxfp4_pct_4.3TB_s"] for r in after]))):
        ax.bar(x + (i - 1) * 0.27, values, 0.27, label=label)
    ax.axhline(60, color="k", ls="--", lw=1, label="issue target for MXFP4 (60%)")
    ax.set_xticks(x, [f"{r['model']}\n{r['tokens']} tok" for r in after], fontsize=8)
    ax.set_ylabel("% of 4.3 TB/s (bytes of the touched experts)")
    ax.set_title("Routed-expert MLP (gate, up, down), one H200", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)
    return _save(fig, os.path.join(out, "moe_mxfp4.png"))


def plot_kda_intra(out: str, record: str = KDA_PREFILL, png: str = "kda_intra.png") -> str:
    """KDA chunked prefill at T = 8192: intra-chunk + sequential kernel time per variant and head
    count (one run), with fla's whole chunk_kda where the run timed it."""
    import numpy as np

    shapes = _load(record)["prefill"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.2))
    for ax, shape in zip(np.atleast_1d(axes), shapes):
        names = list(shape["variants"])
        y = np.arange(len(names))
        intra = np.array([shape["variants"][n]["intra_ms"] for n in names])
        inter = np.array([shape["variants"][n]["inter_ms"] for n in names])
        ax.barh(y, intra, 0.6, label="intra-chunk kernels")
        ax.barh(y, inter, 0.6, left=intra, label="sequential kernel")
        if "fla_ms" in shape:
            ax.axvline(shape["fla_ms"], color="k", ls="--", label=f"fla chunk_kda {shape['fla_ms']:.2f} ms")
        ax.set_yticks(y, names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms (each kernel alone)")
        ax.set_title(f"KDA prefill, B = 1, T = 8192, H = {shape['H']} (one H200)", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    return _save(fig, os.path.join(out, png))


KDA_KERNELS = "kda_prefill_run5_2e4e042.json"
KDA_KERNEL_PARTS = (  # (label, name fragments of ours, of fla's)
    ("A_kk, A_qk", ("kda_chunk_pairs", "kda_chunk_akk", "kda_chunk_aqk"), ("intra_token_parallel",)),
    ("intra, one kernel", ("kda_chunk_intra",), ()),
    ("(I + A)^-1, W, U", ("kda_chunk_solve",), ("inter_solve_fused", "recompute_w_u")),
    ("sequential pass (+ outputs)", ("kda_chunk_inter",), ("fwd_kernel_h", "fwd_kernel_o")),
    ("local cumsum", ("local_cumsum", "reduce_window"), ("local_cumsum",)),
)


def _kernel_bars(ax, bars, parts, rest_label: str) -> None:
    """Horizontal stacked bars of device ms per call: bars = [(label, {kernel name: us})], parts = [(label, our
    kernel-name substrings, fla's)]; what no part claims is the grey `rest_label` segment (host events such as
    "$..." and "Pjit..." entries of a trace left out)."""
    import numpy as np

    y = np.arange(len(bars))
    left = np.zeros(len(bars))
    for i, (label, ours, theirs) in enumerate(parts):
        names = ours + theirs
        xs = np.array([sum(us for k, us in times.items() if any(p in k for p in names)) / 1e3 for _, times in bars])
        ax.barh(y, xs, 0.6, left=left, label=label, color=f"C{i}")
        left += xs
    kernels = [sum(us for k, us in t.items() if not k.startswith("$") and "Pj" not in k) / 1e3 for _, t in bars]
    ax.barh(y, np.array(kernels) - left, 0.6, left=left, label=rest_label, color="0.7")
    ax.set_yticks(y, [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("device ms per call (sum of its kernels)")


def plot_kda_kernels(out: str) -> str:
    """KDA chunked prefill at T = 8192, H = 32: device time per kernel of each setting and of fla's
    chunk_kda, from one run's profiles (`kda.py --profile`)."""
    shape = _load(KDA_KERNELS)["prefill"][0]
    bars = [(n, v["kernel_us"]) for n, v in shape["variants"].items() if "kernel_us" in v]
    if "fla_kernel_us" in shape:
        bars.append(("fla chunk_kda", shape["fla_kernel_us"]))
    fig, ax = plt.subplots(figsize=(9, 4.6))
    _kernel_bars(ax, bars, KDA_KERNEL_PARTS, "other (L2 norm, layout, fills)")
    ax.set_title("KDA prefill by kernel, B = 1, T = 8192, H = 32, K = V = 128 (one H200, one run)", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    return _save(fig, os.path.join(out, "kda_kernels.png"))


KDA_DIAGONAL = ("kda_prefill_run19_h32_3a7dfb2.json", "kda_prefill_run19_h96_3a7dfb2.json")   # RESULTS.md, KDA run 19
KDA_DIAGONAL_PARTS = [   # (label, our kernels, fla's kernels): substrings of the kernel names
    ("local cumsum", ("local_cumsum",), ("local_cumsum",)),
    ("diagonal 16 x 16 blocks, per token", ("kda_chunk_diagonal",), ("intra_token_parallel",)),
    ("A_kk, A_qk (joint: all levels; default: across sub-blocks + inverse)", ("kda_chunk_pairs",),
     ("inter_solve_fused",)),
    ("(joint: inverse +) W, U, q e^G, k e^(G_C - G)", ("kda_chunk_solve", "kda_chunk_factors"), ("recompute_w_u",)),
    ("sequential pass (+ outputs)", ("kda_chunk_inter",), ("fwd_kernel_h", "fwd_kernel_o")),
    ("q, k L2 norm", ("triton_softmax",), ("l2norm",)),
]


def plot_kda_diagonal(out: str, records=KDA_DIAGONAL, variants=None, png: str = "kda_diagonal.png",
                      run: str = "KDA run 19", folder: str = H200, device: str = "H200", all_rows: bool = False) -> str:
    """KDA chunked prefill at T = 8192, H = 32 and 96: device time per kernel of each variant in `records`
    (those named in `variants`, as {name: label}; None: all) and of fla's chunk_kda, from profiled runs (run 19:
    the diagonal blocks per token and the sliced solve against the joint launch). A record's first prefill row,
    or with `all_rows` each of them."""
    bars = []
    for name in records:
        rows = _load(name, folder)["prefill"]
        for shape in rows if all_rows else rows[:1]:
            bars += [(f"H = {shape['H']}, {n if variants is None else variants[n]}", v["kernel_us"])
                     for n, v in shape["variants"].items() if variants is None or n in variants]
            bars.append((f"H = {shape['H']}, fla chunk_kda", shape["fla_kernel_us"]))
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    _kernel_bars(ax, bars, KDA_DIAGONAL_PARTS, "other (fills)")
    ax.set_xlim(0, 1.03 * ax.get_xlim()[1])
    ax.set_title(f"KDA prefill by kernel, B = 1, T = 8192, K = V = 128, bf16 (one {device}, {run})", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    return _save(fig, os.path.join(out, png))


KDA_BAND = ("kda_prefill_run21_h32_fa3e5f0.json", "kda_prefill_run21_h96_fa3e5f0.json")   # RESULTS.md, KDA run 21


def plot_kda_band(out: str) -> str:
    """Run 21: the defaults of run 20 against the band, the cumsum in the per-token launch and the wide factors
    launch, by kernel, beside fla."""
    return plot_kda_diagonal(out, KDA_BAND, {"run20": "run 20's defaults", "default/rows": "whole rows, new cumsum "
                             "and factors", "default": "default (band, cumsum inside, factors 128 x 8 warps)"},
                             "kda_band.png", "KDA run 21")


KDA_TILE_SOLVE = ("kda_prefill_run27_h32_7145f0b.json", "kda_prefill_run27_h96_7145f0b.json")   # KDA run 27


def plot_kda_tile_solve(out: str) -> str:
    """Run 27: run 24's defaults against the W, U launch as a pipelined loop and the pairs across sub-blocks with
    the inverse by 16 x 16 tiles, by kernel, beside fla (q and k normalised inside, as the model calls it)."""
    return plot_kda_diagonal(out, KDA_TILE_SOLVE, {
        "run24@norm-in": "run 24's defaults", "default/across-levels@norm-in": "levels + W, U loop",
        "default@norm-in": "default (16 x 16 tiles + W, U loop)"}, "kda_tile_solve.png", "KDA run 27")


KDA_HANDOFF = ("kda_prefill_run28a_2140d4f.json", "kda_prefill_run28b_2140d4f_h96.json")   # KDA run 28 (H100)


def plot_kda_handoff(out: str) -> str:
    """Run 28 (H100): run 27's defaults against q, k handed on in bf16 with the per-token walk in 2^x at one warp
    (the defaults since), by kernel, beside fla."""
    return plot_kda_diagonal(out, KDA_HANDOFF, {
        "default@norm-in": "run 27's defaults", "default/qk-bf16/exp2/dw1@norm-in": "bf16 q, k; 2^x; 1 warp"},
        "kda_handoff.png", "KDA run 28", H100, "H100")


KDA_RUN29 = ("kda_prefill_run29a_8243c0c.json", "kda_prefill_run29b_8243c0c_h96_sweep.json",
             "kda_prefill_run29c_8243c0c_h96.json")   # KDA run 29 (H100): H = 32 with fla; H = 96 sweep; H = 96 fla


def plot_kda_sweep(out: str) -> str:
    """Run 29 (H100): run 28's new defaults against run 27's at H = 32, and the settings around them at H = 96, by
    kernel, beside fla's chunk_kda of the same runs (29a at H = 32, 29c at H = 96)."""
    h32, sweep, h96 = (_load(name, H100)["prefill"] for name in KDA_RUN29)
    labels = {"default": "default then (W, U in 2 stages)", "run27": "run 27's defaults",
              "default/dw1/factors-loop64/fw8/s3": "W, U in 3 stages (the default since)"}
    short = lambda n: (lambda m: labels.get(m, m))(n.removesuffix("@norm-in").replace("default/qk-bf16/exp2/",
                                                                                        "default/"))
    bars = [(f"H = 32, {short(n)}", v["kernel_us"]) for n, v in h32[0]["variants"].items()]
    bars.append(("H = 32, fla chunk_kda", h32[0]["fla_kernel_us"]))
    bars += [(f"H = 96, {short(n)}", v["kernel_us"]) for n, v in sweep[0]["variants"].items()]
    bars.append(("H = 96, fla chunk_kda (29c)", h96[0]["fla_kernel_us"]))
    fig, ax = plt.subplots(figsize=(9.5, 5.4))
    _kernel_bars(ax, bars, KDA_DIAGONAL_PARTS, "other (fills)")
    ax.set_xlim(0, 1.03 * ax.get_xlim()[1])
    ax.set_title("KDA prefill by kernel, B = 1, T = 8192, K = V = 128, bf16 (one H100, KDA run 29)", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2)
    return _save(fig, os.path.join(out, "kda_sweep.png"))


KDA_RUN30 = "kda_prefill_run30a_c47874c.json"   # KDA run 30 (H100): today's defaults, run 29's and 27's, fla


def plot_kda_run30(out: str) -> str:
    """Run 30 (H100): the defaults (the W, U loop in 3 stages) against run 29's (2 stages) and run 27's, by kernel,
    beside fla's chunk_kda in the same process, at H = 32 and 96."""
    return plot_kda_diagonal(out, (KDA_RUN30,), {
        "default@norm-in": "default (W, U in 3 stages)", "run29@norm-in": "run 29's defaults (2 stages)",
        "run27@norm-in": "run 27's defaults"}, "kda_run30.png", "KDA run 30", H100, "H100", all_rows=True)


KDA_RUN31 = "kda_prefill_run31_h32_4272224.json"       # RESULTS.md, run 31 (H200): the tile pairs launch's forms


def plot_kda_run31(out: str) -> str:
    """Run 31 (H200, H = 32): the defaults of run 30 against the tile pairs launch in 2^x and in 2^x with one loop
    (today's defaults), by kernel, beside fla's chunk_kda in the same process."""
    return plot_kda_diagonal(out, (KDA_RUN31,), {
        "default@norm-in": "run 30's defaults", "default/pairs-exp2@norm-in": "pairs launch in 2^x",
        "default/pairs-exp2/one-loop@norm-in": "2^x, one loop (the defaults since)"}, "kda_run31.png", "KDA run 31")


MXFP4_RUN32 = "moe_mxfp4_run32a_6d227d2.json"         # RESULTS.md, run 32 (H100): the MXFP4 call by kernel
KDA_B1_RUN30 = "kda_decode_hopper_run30b_c47874c.json"  # run 30 (H100): the decode step, one step a call
KDA_B1_RUN32 = "kda_decode_run32b_6d227d2_b1_steps10.json"  # run 32 (H100): 10 steps a call


def plot_run32(out: str) -> str:
    """Run 32 (H100). Left: the KDA decode step at B = 1, us a launch, with 20 launches a call (run 30) and 200
    (run 32, `kda.py --steps 10`): pipelined, device span, the kernel. Right: the 64-token MXFP4 call of
    Kimi-Linear's experts by kernel, for the default and the two `rows` forms."""
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
    launch = "4w/1v"
    runs = [("20 launches a call (run 30)", KDA_B1_RUN30), ("200 launches a call (run 32)", KDA_B1_RUN32)]
    measures = [("pipelined", "pipelined_us_per_layer_by_launch"), ("device span", "device_span_us_per_layer_by_launch"),
                ("decode kernel", "device_us_per_layer_by_launch")]
    x = np.arange(len(measures))
    for i, (label, name) in enumerate(runs):
        row = next(r for r in _load(name, H100)["decode"] if r["B"] == 1)
        left.bar(x + (i - 0.5) * 0.38, [row[key][launch] for _, key in measures], 0.38, label=label, color=f"C{i}")
    left.axhline(10, color="k", ls=":", lw=1, label="issue 16: <= 10 us a layer")
    left.set_xticks(x, [m for m, _ in measures])
    left.set_ylabel("us per layer (launch)")
    left.set_title("KDA decode step, B = 1, H = 32, fp32 state (H100)", fontsize=10)
    left.legend(fontsize=8)
    left.grid(axis="y", alpha=0.3)
    record = _load(MXFP4_RUN32, H100)
    base = next(r for r in record["rows"] if r["tokens"] == 64)
    bars = [("default (slabs in, tiles out)", base["hopper_profile"]["kernels_us"])] + [
        (("outputs=rows" if "outputs='rows'" in r["blocks"] else "activations=rows"), r["profile"]["kernels_us"])
        for r in record["hopper"] if r["tokens"] == 64 and "profile" in r]
    _kernel_bars(right, bars, [("Mosaic GPU kernels", ["mosaic_gpu"], []), ("slab gathers", ["select_fusion"], []),
                               ("row gathers, GLU, combine", ["convert_fusion", "reduce_fusion"], []),
                               ("sort", ["sort"], [])], "other (copies, ...)")
    right.set_title("MXFP4 experts, 64 tokens of Kimi-Linear, device time by kernel (H100)", fontsize=10)
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.45, -0.16), ncol=5)
    return _save(fig, os.path.join(out, "run32.png"))


KDA_B1_RUN33 = {"H100": ("kda_decode_run33a_e5a3165_b1_b8_layers60.json", H100),
                "H200": ("kda_decode_run33d_49a42c6_b1_layers60.json", H200)}     # run 33: 60 layers x 4 steps
KDA_B64_RUN33 = [("H100 (b)", "kda_decode_run33b_e5a3165_b64_b256.json", H100),
                 ("H200 (d)", "kda_decode_run33d_49a42c6_b64_b256.json", H200),
                 ("H200 (f)", "kda_decode_run33f_49a42c6_b64_repeat.json", H200)]
MXFP4_RUN33 = [("H100 (b)", "moe_mxfp4_run33b_e5a3165.json", H100), ("H200 (c)", "moe_mxfp4_run33c_49a42c6.json", H200)]


def plot_run33(out: str) -> str:
    """Run 33. Left: the KDA decode step at B = 1 inside 240-launch programs whose states (126 MB) do not fit
    the L2, us a launch pipelined, by column blocks, H100 and H200. Middle: B = 64, share of 4.3 TB/s of the
    4-warp one-block launch, pipelined and by device time. Right: the MXFP4 call of Kimi-Linear's experts with
    outputs "tiles" and "rows" at 64 and 8 tokens."""
    import numpy as np

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    launches = ["4w/1v", "4w/2v", "4w/4v"]
    x = np.arange(len(launches))
    for i, (gpu, (name, folder)) in enumerate(KDA_B1_RUN33.items()):
        row = next(r for r in _load(name, folder)["decode"] if r["B"] == 1)
        left.bar(x + (i - 0.5) * 0.38, [row["pipelined_us_per_layer_by_launch"][k] for k in launches], 0.38,
                 label=gpu, color=f"C{i}")
    left.axhline(10, color="k", ls=":", lw=1, label="issue 16: <= 10 us a layer")
    left.set_xticks(x, ["1 block", "2 column blocks", "4 column blocks"])
    left.set_ylabel("us per layer, pipelined")
    left.set_title("KDA decode, B = 1, 60 layers x 4 steps a call", fontsize=10)
    left.legend(fontsize=8)
    left.grid(axis="y", alpha=0.3)
    measures = [("pipelined", "pipelined_us_per_layer_by_launch"), ("device", "device_us_per_layer_by_launch")]
    x = np.arange(len(KDA_B64_RUN33))
    for j, (label, key) in enumerate(measures):
        pcts = []
        for _, name, folder in KDA_B64_RUN33:
            row = next(r for r in _load(name, folder)["decode"] if r["B"] == 64)
            # the share scales as 1 / time: the device time's share, rescaled to this measure's time
            pcts.append(row["device_pct_4.3TB_s_by_launch"]["4w/1v"] * row["device_us_per_layer_by_launch"]["4w/1v"]
                        / row[key]["4w/1v"])
        mid.bar(x + (j - 0.5) * 0.38, pcts, 0.38, label=label, color=f"C{j + 2}")
    mid.axhline(70, color="k", ls=":", lw=1, label="issue 16: >= 70%")
    mid.set_xticks(x, [g for g, _, _ in KDA_B64_RUN33])
    mid.set_ylim(40, 85)
    mid.set_ylabel("% of 4.3 TB/s")
    mid.set_title("KDA decode, B = 64, 4 warps, one block (H = 32)", fontsize=10)
    mid.legend(fontsize=8, loc="upper left", ncol=3)
    mid.grid(axis="y", alpha=0.3)
    labels, tiles, rows = [], [], []
    for gpu, name, folder in MXFP4_RUN33:
        for tokens in (64, 8):
            entries = [r for r in _load(name, folder)["hopper"] if r["tokens"] == tokens and "ms" in r]
            default = next((r["ms"] for r in entries if r["blocks"] == "None"), None)
            picked = next((r for r in entries if r["blocks"] != "None"), None)
            if default is None or picked is None:
                continue
            # each run timed its default against the other form (b: default "tiles"; c: default "rows")
            picked_rows = "outputs='rows'" in picked["blocks"]
            labels.append(f"{gpu}\n{tokens} tokens")
            tiles.append(default if picked_rows else picked["ms"])
            rows.append(picked["ms"] if picked_rows else default)
    x = np.arange(len(labels))
    right.bar(x - 0.19, tiles, 0.38, label='outputs="tiles"', color="C5")
    right.bar(x + 0.19, rows, 0.38, label='outputs="rows" (the decode default since)', color="C6")
    right.set_ylim(0, 0.52)
    _bar_axes(right, x, labels, "ms a call", "MXFP4 experts, Kimi-Linear, one call", tick_size=8)
    return _save(fig, os.path.join(out, "run33.png"))


MLA_RUN34 = "mla_decode_run34c_f9d7ee9_dedicated.json"
MXFP4_RUN34 = "moe_mxfp4_run34d_df362e3_rows_1_8_tokens.json"
KDA_W8_RUN34 = "kda_decode_run34d_df362e3_8warps.json"


def plot_run34(out: str) -> str:
    """Run 34, one H100. Left: the MLA kernel alone (device time) with warpgroup 0 scoring and adding half of
    P @ V ("first", the default) against warpgroup 0 scoring and issuing the copies while the two others only add
    P @ V ("dedicated", measured and removed). Middle: the KDA decode state's error against the XLA reference after
    two steps, by launch (4 warps from run 33 on the same GPU model). Right: the MXFP4 call with outputs "tiles"
    over the decode default "rows" at 1 and 8 tokens, Kimi-Linear and K3's 1/8 of the experts."""
    import numpy as np

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    rows = _load(MLA_RUN34, H100)["rows"]
    shapes = [(96, 1), (96, 4), (32, 1), (32, 4)]
    x = np.arange(len(shapes))
    for j, (impl, label) in enumerate([("hopper", '"first" (default)'), ("hopper-dedicated", '"dedicated"')]):
        us = [next(r["kernel_ms"] for r in rows if r["impl"] == impl and r["H"] == h and r["q"] == q) * 1e3
              for h, q in shapes]
        left.bar(x + (j - 0.5) * 0.38, us, 0.38, label=label, color=f"C{j}")
    _bar_axes(left, x, [f"H = {h}, q = {q}" for h, q in shapes], "kernel us (device time)",
              "MLA decode, 64 x 4K, who scores a block (H100)", tick_size=8)
    errors = {}
    for name, launches in ((KDA_B64_RUN33[0][1], {"4w/1v": "4 warps, 1 block (run 33)"}),
                           (KDA_W8_RUN34, {"8w/1v": "8 warps, 1 block", "8w/2v": "8 warps, 2 blocks"})):
        decode = next(r for r in _load(name, H100)["decode"] if r["B"] == 64)
        errors.update({label: decode["err_state_vs_ref_by_launch"][k] * 100 for k, label in launches.items()})
    x = np.arange(len(errors))
    mid.bar(x, list(errors.values()), color=["C2", "C3", "C2"])
    _bar_axes(mid, x, list(errors), "state error vs XLA reference, %", "KDA decode, B = 64, after 2 steps (H100)",
              legend=False, tick_size=8)
    entries = _load(MXFP4_RUN34, H100)["hopper"]
    labels, default, tiles = [], [], []
    for model in ("kimi-linear", "k3-latent-1/8"):
        for tokens in (1, 8):
            here = [r for r in entries if r["model"] == model and r["tokens"] == tokens and "ms" in r]
            labels.append(f"{model}\n{tokens} token{'s' if tokens > 1 else ''}")
            default.append(next(r["ms"] for r in here if r["blocks"] == "None"))
            tiles.append(next(r["ms"] for r in here if "outputs='tiles'" in r["blocks"]))
    x = np.arange(len(labels))
    right.bar(x, [t / d for t, d in zip(tiles, default)], 0.5, label='"tiles" / "rows"', color="C5")
    right.axhline(1, color="k", ls=":", lw=1)
    right.set_ylim(0.9, 1.25)
    _bar_axes(right, x, labels, 'time with outputs="tiles" / the default ("rows")', "MXFP4 experts, one call (H100)",
              tick_size=8)
    return _save(fig, os.path.join(out, "run34.png"))


MLA_RUN35 = (("mla_decode_run35a_4a3fd2f_ahead.json", "hopper-ahead", '"ahead"', "C4"),
             ("mla_decode_run35c_cc60ca2_halves.json", "hopper-halves", '"halves"', "C3"))


def _form_pairs(out: str, png: str, pairs, title: str) -> str:
    """One panel a (record, --impl form, label, colour) of `pairs`: the MLA kernel alone (device time) by shape, the
    default ("first") against that form, measured beside it in the same process on an H100."""
    import numpy as np

    fig, axes = plt.subplots(1, len(pairs), figsize=(6 * len(pairs), 4.2))
    for ax, (name, impl, label, color) in zip(np.atleast_1d(axes), pairs):
        rows = _load(name, H100)["rows"]
        shapes = [(r["H"], r["B"], r["ctx"], r["q"]) for r in rows if r["impl"] == "hopper"]
        x = np.arange(len(shapes))
        for j, (form, text, c) in enumerate([("hopper", '"first" (default)', "C0"), (impl, label, color)]):
            us = [next(r["kernel_ms"] for r in rows if r["impl"] == form and (r["H"], r["B"], r["ctx"], r["q"]) == s)
                  * 1e3 for s in shapes]
            ax.bar(x + (j - 0.5) * 0.38, us, 0.38, label=text, color=c)
        _bar_axes(ax, x, [f"H {h}, q {q}\n{b} x {ctx // 1024}K" for h, b, ctx, q in shapes], "kernel us (device time)",
                  title.format(label=label), tick_size=7)
    return _save(fig, os.path.join(out, png))


def plot_run35(out: str) -> str:
    """Run 35, one H100: left, warpgroup 0 issuing block i + 1's score MMA before block i's softmax ("ahead");
    right, each warpgroup scoring half of a block's slots ("halves"). Both measured and removed."""
    return _form_pairs(out, "run35.png", MLA_RUN35, "MLA decode, {label} against the default (H100)")


MLA_RUN36 = (("mla_decode_run36a_ce457f6_scorer.json", "hopper-scorer", '"scorer", 200 / 152 (ignored)', "C4"),
             ("mla_decode_run36b_scorer184.json", "hopper-scorer", '"scorer", 184 / 160', "C3"))


def plot_run36(out: str) -> str:
    """Run 36, one H100: the scorer form (warpgroup 0 only scores, its latent queries in registers, three ring
    slots) at two register splits, each against the default measured in the same process."""
    return _form_pairs(out, "run36.png", MLA_RUN36, "MLA decode, {label} against the default (H100)")


KDA_LENGTHS = "kda_prefill_lengths_run22_182d874.json"         # RESULTS.md, KDA run 22: prefill over T, H = 32
KDA_BATCHES = "kda_decode_run8_batches_b777e8c.json"    # KDA decode run 8: one layer's step over B, H = 32


def plot_kda_scaling(out: str) -> str:
    """Issue 16's two curves: prefill time against T (ours and fla's chunk_kda in one process, B = 1, H = 32) and
    the decode step's state bandwidth against batch (ours, fla's fused_recurrent_kda, the bare state stream and
    XLA's elementwise pass over the same bytes), as a share of 4.3 TB/s."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    rows = sorted(_load(KDA_LENGTHS)["prefill"], key=lambda r: r["T"])
    ts = [r["T"] for r in rows]
    left.plot(ts, [r["ours_ms"] for r in rows], "o-", label="k3jax (Pallas), default")
    left.plot(ts, [r["fla_ms"] for r in rows], "s--", label="fla chunk_kda")
    for r in rows:
        left.annotate(f"{r['speedup_vs_fla']:.2f}x", (r["T"], r["ours_ms"]), textcoords="offset points",
                      xytext=(0, 7), ha="center", fontsize=7)
    _axes(left, "T (tokens, B = 1)", "ms per call (host-timed)",
          "KDA prefill, H = 32, K = V = 128, bf16 (labels: fla's time / ours)", title_size=9)
    left.legend(fontsize=7)
    left.set_xticks(ts, [str(t) for t in ts])
    left.set_yticks([0.25, 0.5, 1, 2, 4], ["0.25", "0.5", "1", "2", "4"])
    left.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    dec = sorted(_load(KDA_BATCHES)["decode"], key=lambda r: r["B"])
    bs = [r["B"] for r in dec]
    pct = lambda tb: 100 * tb / 4.3
    right.plot(bs, [r["pct_4.3TB_s"] for r in dec], "o-", label="k3jax one-token kernel")
    right.plot(bs, [pct(r["fla_TB_s"]) for r in dec], "s--", label="fla fused_recurrent_kda")
    right.plot(bs, [r["ceiling_pct_4.3TB_s"]["pallas stream 4w"] for r in dec], ":", label="state read + write only "
               "(Pallas, same grid)")
    right.plot(bs, [r["ceiling_pct_4.3TB_s"]["xla scale"] for r in dec], ":", label="XLA elementwise over the state")
    right.axhline(70, color="grey", ls="--", lw=0.8, label="issue 16 target (70%)")
    _axes(right, "batch (rows)", "% of 4.3 TB/s (state bytes)", "KDA decode step per layer, H = 32, fp32 state",
          log_y=False, title_size=9)
    right.legend(fontsize=7)
    right.set_xticks(bs, [str(b) for b in bs])
    return _save(fig, os.path.join(out, "kda_scaling.png"))


SERVER_LOAD = "server_load_kimi-linear-48b.json"
SERVER_LOAD_MORE = "server_load_run2_64_256.json"  # 64 and 256 clients, a later commit (e10e856)


def plot_server_load(path: str, record: dict | None = None) -> str:
    """Output tokens/s and p50/p99 TPOT and TTFT against concurrent clients (benchmarks/server_load.py)."""
    if record is None:  # the first run's levels, then any levels a later run added
        record = _load(SERVER_LOAD)
        more = os.path.join(H200, SERVER_LOAD_MORE)
        if os.path.exists(more):
            with open(more) as f:
                record = {**record, "levels": record["levels"] + json.load(f)["levels"]}
    rows = sorted((r for r in record["levels"] if r["completed"]), key=lambda r: r["concurrency"])
    xs = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    left.plot(xs, [r["tok_per_s"] for r in rows], "o-", label="output tokens/s")
    slots = record["settings"]["max_num_seqs"]
    if xs and max(xs) > slots:
        left.axvline(slots, color="grey", ls=":", label=f"engine slots ({slots}); more clients queue")
    for key, label, style in (("tpot_p50_ms", "TPOT p50", "o-"), ("tpot_p99_ms", "TPOT p99", "o--"),
                              ("ttft_p50_ms", "TTFT p50", "s-"), ("ttft_p99_ms", "TTFT p99", "s--")):
        right.plot(xs, [float("nan") if r[key] is None else r[key] for r in rows], style, label=label)
    st = record["settings"]
    title = f"{record['model']} {record['dtype']}, {st['prompt_len']} + {st['max_tokens']} tokens, streamed"
    for ax, ylabel in ((left, "output tokens/s (server)"), (right, "ms (client-side)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_yscale("log")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_load_processes(out: str) -> str:
    """benchmarks/multiprocess_read.py: per format, each mesh's share of the checkpoint one process read
    (left) and its load time (right), process 0 (both processes read the same amount here)."""
    with open(os.path.join(CPU, "multiprocess_read.json")) as f:
        record = json.load(f)
    rows = record["rows"]
    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(formats)
    for ax, key, label in ((axes[0], "share_p0", "share of the checkpoint read by a process"),
                           (axes[1], "seconds_p0", "load time of a process (s)")):
        for i, fmt in enumerate(formats):
            values = [next(r[key] for r in rows if r["format"] == fmt and r["mesh"] == m) for m in meshes]
            ax.bar([j + i * width for j in range(len(meshes))], values, width, label=fmt)
        ax.set_xticks([j + width * (len(formats) - 1) / 2 for j in range(len(meshes))], meshes)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Kimi-Linear-48B's first 4 layers, {record['experts']} experts, bf16: two processes, one CPU device "
                 "each", fontsize=10)
    return _save(fig, os.path.join(out, "load_processes.png"))


RUN37 = ("moe_mxfp4_run37a_65a3b0f.json", "moe_mxfp4_run37b_65a3b0f.json", "moe_mxfp4_run37c_65a3b0f.json")


def plot_run37(out: str) -> str:
    """Run 37 (H100). Left: Kimi-Linear's routed-expert call at 16-256 tokens, the two calls against both
    hand-offs (each run's own default beside them). Right: at 64 tokens, the grid and persistent launches, each as
    the two calls, the products hand-off and the GLU hand-off."""
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    forms = [(False, "two calls"), ("products", "products hand-off"), ("glu", "GLU hand-off")]
    cases = []                                       # (label, {form: ms}) per run and token count, default settings
    for name in RUN37:
        hopper = _load(name, H100)["hopper"]
        for tokens in sorted({r["tokens"] for r in hopper}):
            ms = {r["handoff"]: r["ms"] for r in hopper
                  if r["tokens"] == tokens and r["blocks"] == "None" and "ms" in r}
            cases.append((f"{tokens} ({name[15]})", ms))
    cases.sort(key=lambda c: int(c[0].split()[0]))
    x = np.arange(len(cases))
    for j, (form, label) in enumerate(forms):
        left.bar(x + (j - 1) * 0.27, [c[1][form] for c in cases], 0.27, label=label, color=f"C{j}")
    left.set_xticks(x, [c[0] for c in cases])
    left.set_xlabel("tokens (run)")
    left.set_ylabel("ms a call")
    left.set_title("Kimi-Linear routed experts, MXFP4, default settings (H100)", fontsize=10)
    left.legend(fontsize=8)
    left.grid(axis="y", alpha=0.3)
    rows = [r for r in _load(RUN37[0], H100)["hopper"] if r["tokens"] == 64 and "ms" in r]
    settings = list(dict.fromkeys(r["blocks"] for r in rows))
    names = {"None": "grid, default"}
    for b in settings[1:]:
        names[b] = ("persistent" if "persistent" in b else "grid") + (", rows out" if "outputs='rows'" in b
                                                                     else ", tiles out")
        names[b] += ", 4 stages" if "stages=4" in b else ""
    x = np.arange(len(settings))
    for j, (form, label) in enumerate(forms):
        ms = [next((r["ms"] for r in rows if r["blocks"] == b and r["handoff"] == form), np.nan) for b in settings]
        right.bar(x + (j - 1) * 0.27, ms, 0.27, label=label, color=f"C{j}")
    right.set_xticks(x, [names[b] for b in settings], fontsize=7)
    right.set_ylim(0.35, 0.5)
    right.set_ylabel("ms a call")
    right.set_title("64 tokens: grid and persistent launches (run 37a, H100)", fontsize=10)
    right.legend(fontsize=8)
    right.grid(axis="y", alpha=0.3)
    return _save(fig, os.path.join(out, "run37.png"))


# Each record with what its default call ("None") was: (decode, mma_inputs).
RUN38_SWEEPS = (("moe_mxfp4_run38c_f572b10.json", ("bits", 16)), ("moe_mxfp4_run38d_f572b10.json", ("bits", 16)),
                ("moe_mxfp4_run38g_aca5b6c.json", ("bits", 0)))
RUN38_TOKENS = "moe_mxfp4_run38e_c9276b3.json"
RUN38_SASS = (("moe_ncu_src_run38b_5f2b5de_gate_sass.csv.gz", "an MMA call a 16 inputs (38b)"),
              ("moe_ncu_src_run38f_c9276b3_gate_sass.csv.gz", "one MMA call a step (38f)"))


def _sass_per_step(path: str) -> dict:
    """Warp instructions a pipeline step of the gated MXFP4 launch, by kind, from an ncu source page (gzipped CSV):
    each SASS line's executed count over the loop's trip count (the most executed line's)."""
    import gzip

    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.ncu_source_summary import read

    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        lines = [(i["source"], i["executed"]) for i in read(f.read())[0]]
    trips = max(e for _, e in lines)
    kinds = {"E2M1 decode": 0.0, "scale multiplies": 0.0, "shared-memory loads": 0.0, "MMA, descriptors": 0.0,
             "other": 0.0}
    for text, e in lines:
        op = text.split()[1] if text.startswith("@") else text.split()[0]
        if op.startswith(("LOP3", "PRMT")) or op == "IMAD":
            kind = "E2M1 decode"
        elif op.startswith("HMUL2"):      # half x 2^126 (the decode's), half x the group's scale
            kinds["E2M1 decode"] += e / trips / 2
            kind = "scale multiplies"
            e /= 2
        elif op.startswith("LDS"):
            kind = "shared-memory loads"
        elif op.startswith(("HGMMA", "WARPGROUP", "U", "R2UR")) and not op.startswith(("UTMA", "USYNC")):
            kind = "MMA, descriptors"
        else:
            kind = "other"
        kinds[kind] += e / trips
    return kinds


def plot_run38(out: str) -> str:
    """Run 38 (H100). Left: warp instructions a pipeline step of the gated launch at 64 tokens by kind (Nsight
    Compute), an MMA call a 16 inputs against one a step. Middle: the 64-token call by MMA calls and decode, three
    runs (the same routing). Right: the call at 16-256 tokens as % of 4.3 TB/s (the runs' routings differ after their
    first token count), run 37's default against run 38's (one MMA call a step), the GLU hand-off and the scaled
    decode."""
    import numpy as np

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(17, 4.4))
    steps = [(_sass_per_step(os.path.join(H100, f)), label) for f, label in RUN38_SASS]
    bottom = np.zeros(len(steps))
    for j, kind in enumerate(steps[0][0]):
        values = np.array([k[kind] for k, _ in steps])
        left.bar(range(len(steps)), values, 0.5, bottom=bottom, label=kind, color=f"C{j}")
        bottom += values
    for i, total in enumerate(bottom):
        left.text(i, total + 10, f"{total:.0f}", ha="center", fontsize=8)
    _bar_axes(left, range(len(steps)), [label for _, label in steps], "warp instructions a step (2 x 64 x 256 codes)",
              "Gated launch, 64 tokens: issue slots by kind", tick_size=8)
    forms = [("bits", 16, "bits, a call a 16 (old default)"), ("bits", 32, "bits, a call a 32"),
             ("bits", 0, "bits, a call a step"), ("scaled", 16, "scaled, a call a 16"),
             ("scaled", 0, "scaled, a call a step")]

    def ms_of(rows, default, decode, mma):
        for r in rows:
            b = r["blocks"]
            if r["tokens"] != 64 or r.get("handoff") or "ms" not in r:
                continue
            if b == "None" and (decode, mma) == default:
                return r["ms"]
            if f"decode='{decode}'" in b and f"mma_inputs={mma}," in b and "outputs='rows'" in b:
                return r["ms"]
        return np.nan

    x = np.arange(len(forms))
    for j, (name, default) in enumerate(RUN38_SWEEPS):
        rows = _load(name, H100)["hopper"]
        mid.bar(x + (j - 1) * 0.27, [ms_of(rows, default, d, m) for d, m, _ in forms], 0.27,
                label="run " + name.split("_")[2][3:], color=f"C{j}")
    mid.set_ylim(0.38, 0.45)
    _bar_axes(mid, x, [label for _, _, label in forms], "ms a call", "64 tokens: MMA calls and the decode",
              tick_size=7)
    plt.setp(mid.get_xticklabels(), rotation=15)
    old = {}
    for name in ("moe_mxfp4_run37b_65a3b0f.json", "moe_mxfp4_run37c_65a3b0f.json"):
        for r in _load(name, H100)["hopper"]:
            if r["blocks"] == "None" and not r["handoff"] and "ms" in r:
                old.setdefault(r["tokens"], r["pct_4.3TB_s"])
    new = _load(RUN38_TOKENS, H100)["hopper"]
    tokens = sorted({r["tokens"] for r in new})
    series = [("run 37 default", [old.get(t, np.nan) for t in tokens])]
    for label, pick in (("run 38 default (a call a step)", lambda r: r["blocks"] == "None" and not r["handoff"]),
                        ("... GLU hand-off", lambda r: r["blocks"] == "None" and r["handoff"] == "glu"),
                        ("scaled, a call a 16", lambda r: "scaled" in r["blocks"] and not r["handoff"])):
        series.append((label, [next((r["pct_4.3TB_s"] for r in new if r["tokens"] == t and pick(r)), np.nan)
                               for t in tokens]))
    x = np.arange(len(tokens))
    for j, (label, ms) in enumerate(series):
        right.bar(x + (j - 1.5) * 0.2, ms, 0.2, label=label, color=f"C{j}")
    _bar_axes(right, x, [str(t) for t in tokens], "% of 4.3 TB/s (the touched experts' packed bytes)",
              "Kimi-Linear routed experts, MXFP4, by tokens")
    right.set_ylim(30, 55)
    right.set_xlabel("tokens")
    fig.suptitle("Run 38, one H100: the MXFP4 routed-expert kernel issue-bound; one MMA call a step", fontsize=10)
    return _save(fig, os.path.join(out, "run38.png"))


HBM = 4.3e12          # the achievable HBM bandwidth, bytes a second
RUN39 = ("moe_mxfp4_run39a_cc2ecea.json", "moe_mxfp4_run39b_cc2ecea_sort.json")


def plot_run39(out: str) -> str:
    """Run 39 (H100, 64 tokens of Kimi-Linear, one routing). Left: each call's device span split into the two Mosaic
    GPU launches, the XLA glue and the idle time. Right: ms a call chained in a device loop and unrolled in one
    program, beside the issue's target (60% of 4.3 TB/s in the touched experts' packed bytes)."""
    import numpy as np

    counted, sorted_run = (_load(name, H100) for name in RUN39)
    forms = []
    for r in counted["hopper"]:
        if r.get("handoff") == "products" or "ms" not in r:
            continue
        name = "default" if r["blocks"] == "None" else ("words, scaled" if "scaled" in r["blocks"] else "words")
        profile = r.get("profile") or counted["rows"][0]["hopper_profile"]
        forms.append((name + (", GLU hand-off" if r.get("handoff") == "glu" else ""), r, profile))
    base = sorted_run["rows"][0]
    forms.append(("default, XLA's sort (b)", {"ms": base["hopper_ms"], "ms_unrolled": base["hopper_ms_unrolled"],
                                              "pct_4.3TB_s": base["hopper_pct_4.3TB_s"]}, base["hopper_profile"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.6))
    x = np.arange(len(forms))
    bottom = np.zeros(len(forms))
    for j, (key, label) in enumerate((("mosaic_us", "the two launches"), ("glue_us", "XLA glue"),
                                      ("idle_us", "idle"))):
        values = np.array([p[key] for _, _, p in forms])
        left.bar(x, values, 0.6, bottom=bottom, label=label, color=f"C{j}")
        bottom += values
    nbytes = forms[0][1]["pct_4.3TB_s"] / 100 * HBM * forms[0][1]["ms"] / 1e3
    target_us = nbytes / (0.6 * HBM) * 1e6
    left.axhline(target_us, color="k", ls="--", lw=1, label=f"60% of 4.3 TB/s ({target_us:.0f} us)")
    _bar_axes(left, x, [f for f, _, _ in forms], "us a call (device span of 10 back-to-back calls)",
              "64 tokens: where the device time goes", tick_size=7)
    plt.setp(left.get_xticklabels(), rotation=20)
    left.set_ylim(0, 450)
    for j, (key, label) in enumerate((("ms", "chained in a device loop"), ("ms_unrolled", "unrolled in one program"))):
        right.bar(x + (j - 0.5) * 0.35, [r[key] for _, r, _ in forms], 0.35, label=label, color=f"C{j}")
    right.axhline(target_us / 1e3, color="k", ls="--", lw=1, label="60% of 4.3 TB/s")
    _bar_axes(right, x, [f for f, _, _ in forms], "ms a call (median)", "64 tokens: the chained timings",
              tick_size=7)
    plt.setp(right.get_xticklabels(), rotation=20)
    right.set_ylim(0.3, 0.42)
    fig.suptitle("Run 39, one H100: MXFP4 routed experts of Kimi-Linear; the launches near the card's memory",
                 fontsize=10)
    return _save(fig, os.path.join(out, "run39.png"))


RUN40 = ("moe_mxfp4_run40a_6d13f56.json", "decode_packed_columns_run40c_6d13f56.json",
         "decode_packed_handoff_run40c_6d13f56.json")


def plot_run40(out: str) -> str:
    """Run 40 (H100). Left: the XLA glue of each 64-token call of Kimi-Linear's MXFP4 experts, by kernel (the slab
    gather, XLA's sort, the combine, the rest). Right: the model's decode (48B shape, experts packed) in ms a token
    with the experts in the "columns" and "handoff" layouts."""
    import numpy as np

    moe, columns, handoff = (_load(name, H100) for name in RUN40)
    forms = []
    for r in moe["hopper"]:
        if r.get("handoff") == "products" or "ms" not in r or r["tokens"] != 64:
            continue
        blocks = r["blocks"]
        name = "default" if blocks == "None" else ("words" if "words" in blocks else "pairs") + (
            ", scaled" if "scaled" in blocks else "")
        profile = r.get("profile") or moe["rows"][0]["hopper_profile"]
        forms.append((name + (", GLU" if r.get("handoff") == "glu" else ""), profile["kernels_us"]))
    parts = (("selects (the slab gathers)", lambda k: k.startswith("loop_select_fusion")),
             ("sort", lambda k: k.startswith("sort")), ("transposes", lambda k: "transpose" in k),
             ("combine (gather and sum)", lambda k: k == "loop_reduce_fusion"),
             ("the rest (1-3 us each)", lambda k: True))

    def part(kernel: str) -> str:
        return next(label for label, test in parts if test(kernel))

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.6))
    x = np.arange(len(forms))
    bottom = np.zeros(len(forms))
    for j, (label, _) in enumerate(parts):
        values = np.array([sum(v for k, v in kernels.items() if "mosaic" not in k and part(k) == label)
                           for _, kernels in forms])
        left.bar(x, values, 0.6, bottom=bottom, label=label, color=f"C{j}")
        bottom += values
    _bar_axes(left, x, [f for f, _ in forms], "us a call (device time)", "64 tokens: the XLA glue by kernel",
              tick_size=7)
    plt.setp(left.get_xticklabels(), rotation=20)
    left.set_ylim(0, 80)
    batches = [r["batch"] for r in columns["rows"]]
    xb = np.arange(len(batches))
    for j, (label, record) in enumerate((("columns", columns), ("handoff", handoff))):
        tpot = {r["batch"]: r["tpot_ms"] for r in record["rows"]}
        bars = right.bar(xb + (j - 0.5) * 0.35, [tpot[b] for b in batches], 0.35, label=f'expert_layout="{label}"',
                         color=f"C{j}")
        right.bar_label(bars, fmt="%.2f", fontsize=8)
    _bar_axes(right, xb, [f"B = {b}" for b in batches], "ms a token (TPOT, median)",
              "Kimi-Linear-48B shape, random weights, experts packed", tick_size=8)
    fig.suptitle("Run 40, one H100: the MXFP4 experts' glue; the model's decode with both column layouts",
                 fontsize=10)
    return _save(fig, os.path.join(out, "run40.png"))


RUN41 = ("moe_mxfp4_run41a_451c37c.json", "moe_mxfp4_run41b_451c37c.json", "moe_mxfp4_run41c1_451c37c.json",
         "moe_mxfp4_run41c2_451c37c.json", "moe_mxfp4_run41c3_451c37c.json")


def _run41_form(blocks: str) -> str:
    """A short name of a run 41 setting: the default, else its step, stages, MMA inputs, decode and code load."""
    if blocks == "None":
        return "default (bits)"
    fields = dict(re.findall(r"(\w+)='?(\w+)'?", blocks))
    mma = {"0": "a call a step", "32": "a call a group", "16": "a call a 16"}[fields["mma_inputs"]]
    return f"k{fields['block_k']} s{fields['stages']}, {mma}, {fields['decode']}" + (
        ", words" if fields["code_load"] == "words" else "")


def plot_run41(out: str) -> str:
    """Run 41 (H200, 64 tokens of Kimi-Linear's MXFP4 experts). Left: each setting's call with the GLU hand-off, %
    of 4.3 TB/s unrolled (bars: call a; dots: the repeats in b and c), against the issue's 60%. Right: the same
    calls' device time by part (the two launches, the XLA glue, the idle gaps) from a's profiles."""
    import numpy as np

    records = [_load(name) for name in RUN41]
    pct: dict[str, list[float]] = {}
    parts: dict[str, tuple[float, float, float]] = {}
    for i, record in enumerate(records):
        for r in record["hopper"]:
            if r.get("handoff") != "glu" or "pct_unrolled" not in r:
                continue
            name = _run41_form(r["blocks"])
            pct.setdefault(name, []).append(r["pct_unrolled"])
            if i == 0 and r.get("profile"):
                p = r["profile"]
                parts[name] = (p["mosaic_us"], p["glue_us"], p["idle_us"])
    names = list(pct)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    x = np.arange(len(names))
    bars = left.bar(x, [pct[n][0] for n in names], 0.6, color="C0", label="call a")
    left.bar_label(bars, fmt="%.1f", fontsize=7)
    repeated = [(j, n) for j, n in enumerate(names) if len(pct[n]) > 1]
    for first, (j, n) in enumerate(repeated):
        left.plot([j] * (len(pct[n]) - 1), pct[n][1:], "o", color="C3", ms=4,
                  label="repeats (b, c)" if first == 0 else None)
    left.axhline(60, color="k", ls="--", lw=1, label="issue 21: 60%")
    _bar_axes(left, x, names, "% of 4.3 TB/s in packed bytes (unrolled)", "the call with the GLU hand-off",
              tick_size=7)
    plt.setp(left.get_xticklabels(), rotation=25, ha="right")
    left.set_ylim(40, 65)
    xs = np.arange(len(parts))
    bottom = np.zeros(len(parts))
    for j, label in enumerate(("the two launches", "XLA glue", "idle")):
        values = np.array([parts[n][j] for n in parts])
        right.bar(xs, values, 0.6, bottom=bottom, label=label, color=f"C{j}")
        bottom += values
    _bar_axes(right, xs, list(parts), "us a call (device span, call a's profile)", "where the call's time goes",
              tick_size=7)
    plt.setp(right.get_xticklabels(), rotation=25, ha="right")
    fig.suptitle("Run 41, one H200: Kimi-Linear's MXFP4 experts at 64 tokens, 224 experts touched", fontsize=10)
    return _save(fig, os.path.join(out, "run41.png"))


RUN42_MEDIANS = "moe_hopper_median_run42a_0933548.json"
RUN42_PROFILE = "moe_mxfp4_run42b_0933548.json"
# The routed call's XLA kernels in run 42b's profile by what they do (names from its optimised HLO).
RUN42_ROLES = {"ordering (sort)": ("sort", "loop_add_broadcast_fusion", "MemcpyD2D", "loop_compare_select_fusion",
                                   "input_scatter_fusion"),
               "tile schedule": ("loop_compare_fusion", "input_reduce_fusion", "loop_select_fusion_1",
                                 "input_concatenate_fusion", "loop_compare_gather_fusion"),
               "slabs": ("loop_transpose_fusion", "loop_select_fusion"),
               "combine": ("loop_reduce_fusion",)}


def _run42_role(kernel: str) -> str:
    for role, names in RUN42_ROLES.items():
        if any(kernel == n or (n in ("sort", "input_reduce_fusion") and kernel.startswith(n)) for n in names):
            return role
    return "other"


def plot_run42(out: str) -> str:
    """Run 42 (H100, 64 tokens of Kimi-Linear's MXFP4 experts). Left: each form's call, % of 4.3 TB/s unrolled in
    five runs (dots) and their median (bars). Right: the routed call's XLA kernels (its glue) from 42b's profile,
    coloured by what they do."""
    import numpy as np

    rows = _load(RUN42_MEDIANS, H100)["rows"]
    names = {"none": "sorted rows,\nno hand-off", "glu": "GLU hand-off", "routed": "routed (sort)"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    x = np.arange(len(rows))
    bars = left.bar(x, [r["pct_unrolled_median"] for r in rows], 0.6, color="C0", label="median of five")
    left.bar_label(bars, fmt="%.1f", fontsize=8)
    for j, r in enumerate(rows):
        left.plot([j] * len(r["pct_unrolled_each"]), r["pct_unrolled_each"], "o", color="C3", ms=4,
                  label="each run" if j == 0 else None)
    _bar_axes(left, x, [names.get(r["handoff"], r["handoff"]) for r in rows],
              "% of 4.3 TB/s in packed bytes (unrolled)", "the call, five runs (42a)")
    left.set_ylim(45, 60)
    profile = next(r["profile"] for r in _load(RUN42_PROFILE, H100)["hopper"] if r.get("handoff") == "routed")
    glue = sorted(((k, v) for k, v in profile["kernels_us"].items() if "mosaic" not in k),
                  key=lambda kv: (list(RUN42_ROLES).index(_run42_role(kv[0])) if _run42_role(kv[0]) in RUN42_ROLES
                                  else len(RUN42_ROLES), -kv[1]))
    roles = list(RUN42_ROLES) + ["other"]
    colors = [f"C{roles.index(_run42_role(k))}" for k, _ in glue]
    y = np.arange(len(glue))
    right.barh(y, [v for _, v in glue], color=colors)
    right.set_yticks(y, [k for k, _ in glue], fontsize=7)
    right.invert_yaxis()
    for i, role in enumerate(roles):
        if any(_run42_role(k) == role for k, _ in glue):
            right.barh([0], [0], color=f"C{i}", label=role)
    right.legend(fontsize=8)
    right.set_xlabel("us a call")
    right.set_title(f"the routed call's glue: {profile['glue_us']} us in {len(glue)} kernel names, idle "
                    f"{profile['idle_us']} us (42b)", fontsize=10)
    fig.suptitle("Run 42, one H100: Kimi-Linear's MXFP4 experts at 64 tokens, 224 experts touched", fontsize=10)
    return _save(fig, os.path.join(out, "run42.png"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["decode", "moe", "speculative", "prefill", "mla", "mla-step", "kda-intra",
                                      "kda-kernels", "kda-diagonal", "kda-band", "kda-tile-solve", "kda-handoff",
                                      "kda-sweep", "kda-run30", "kda-run31", "run32", "run33", "run34",
                                      "run35", "run36", "run37", "run38", "run39", "run40", "run41", "run42",
                                      "kda-scaling", "kda-stages",
                                      "kda-tiles",
                                      "mla-merge", "mxfp4", "load-processes",
                                      "server", "all"])
    ap.add_argument("--out", default=HERE)
    args = ap.parse_args(argv)
    for name, fn in (("decode", plot_decode), ("moe", plot_moe), ("speculative", plot_speculative),
                     ("prefill", plot_prefill), ("mla", plot_mla_decode), ("mla-step", plot_mla_step),
                     ("kda-intra", plot_kda_intra), ("kda-kernels", plot_kda_kernels),
                     ("kda-diagonal", plot_kda_diagonal), ("kda-band", plot_kda_band),
                     ("kda-tile-solve", plot_kda_tile_solve), ("kda-handoff", plot_kda_handoff),
                     ("kda-sweep", plot_kda_sweep), ("kda-run30", plot_kda_run30), ("kda-run31", plot_kda_run31),
                     ("run32", plot_run32), ("run33", plot_run33), ("run34", plot_run34),
                     ("run35", plot_run35), ("run36", plot_run36), ("run37", plot_run37),
                     ("run38", plot_run38), ("run39", plot_run39), ("run40", plot_run40), ("run41", plot_run41),
                     ("run42", plot_run42),
                     ("kda-scaling", plot_kda_scaling),
                     ("kda-stages", plot_kda_stages), ("kda-tiles", plot_kda_tiles), ("mla-merge", plot_mla_merge),
                     ("mxfp4", plot_mxfp4), ("load-processes", plot_load_processes)):
        if args.which in (name, "all"):
            print("wrote", fn(args.out))
    if args.which == "server" or (args.which == "all" and os.path.exists(os.path.join(H200, SERVER_LOAD))):
        print("wrote", plot_server_load(os.path.join(args.out, "server_load.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
