"""Helpers of the benchmark scripts that decide what a record says: the decode step's byte count
(`benchmarks/decode.py`) and the Nsight Compute source-page summary (`benchmarks/ncu_source_summary.py`)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.decode import step_bytes
from benchmarks.median_runs import main as median_main
from benchmarks.median_runs import median_rows
from benchmarks.ncu_source_summary import main as ncu_source_main
from benchmarks.ncu_source_summary import barrier_waits, opcode, read, summarise
from benchmarks.profile_summary import scoped_op_names
from k3jax.config import tiny_kimi_linear
from pallas_kernels.moe_gmm.hopper_mxfp4_step import launch_name

HEADER = ('"# Address","Source","Warp Stall Sampling (Not-issued Samples)","Warp Stall Sampling (All Samples)",'
          '"stall_long_sb","stall_barrier"')
ROWS = ['"0x00","MOV R1, c[0x0][0x28]","1","3","0","0"',
        '"0x10","@P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R3","1,100","1,300","900","40"',
        '"0x20","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24","250","400","0","0"',
        '"0x30","@!P1 HGMMA.64x64x16.F32.BF16 R56, gdesc[UR8], R56","20","97","0","0"']


def test_packed_experts_are_counted_at_their_bytes():
    """The routed experts' bytes at 2 bytes a weight against MXFP4's 1/2 + 1/32 (codes, one E8M0 scale per 32):
    the difference over the touched experts, everything else unchanged."""
    cfg = tiny_kimi_linear()
    packed = cfg.replace(moe=dataclasses.replace(cfg.moe, packed_experts=True, packed_layout="columns"))
    touched = 3.0
    plain, mx = step_bytes(cfg, 2, 16, 2, touched=touched), step_bytes(packed, 2, 16, 2, touched=touched)
    moe = cfg.moe
    weights_touched = cfg.ffns.count("moe") * touched * 3 * moe.expert_input_size * moe.expert_intermediate_size
    assert plain["weights"] - mx["weights"] == pytest.approx(weights_touched * (2 - 17 / 32), rel=1e-12)
    assert (plain["kda_state"], plain["mla_kv"]) == (mx["kda_state"], mx["mla_kv"])
    fp32 = step_bytes(cfg, 2, 16, 4, touched=touched)       # unpacked: every weight at the model dtype's bytes
    assert fp32["weights"] == pytest.approx(2 * plain["weights"], rel=1e-12)


def test_source_page_summary_takes_the_all_samples_column():
    instructions, stall_columns = read("\n".join(['"Kernel Name","k"', HEADER, *ROWS]) + "\n")
    assert [i["samples"] for i in instructions] == [3, 1300, 400, 97]      # not the not-issued column before it
    assert stall_columns == ["stall_long_sb", "stall_barrier"]
    s = summarise(instructions, top=2)
    assert [t["address"] for t in s["top"]] == ["0x10", "0x20"]
    assert s["top"][0]["stalls"] == {"stall_long_sb": 900.0, "stall_barrier": 40.0}
    by_op = {o["opcode"]: o["samples"] for o in s["by_opcode"]}
    assert by_op == {"SYNCS.PHASECHK.TRANS64.TRYWAIT": 1300, "HGMMA.64x64x16.F32.BF16": 497, "MOV": 3}
    assert opcode("@!UP0 BRA 0x40") == "BRA"
    assert s["executed_by_opcode"] == []          # no "Instructions Executed" column in this page


def test_source_page_summary_counts_executed_instructions_by_opcode():
    """With ncu's "Instructions Executed" column: warp instructions summed by opcode (what an issue-bound kernel
    spends its issue slots on), predicated ones under their opcode; shared-memory excess wavefronts summed."""
    header = HEADER + ',"Instructions Executed","L1 Wavefronts Shared Excessive"'
    extra = ['"10","0"', '"1,000","0"', '"600","8"', '"400","2"']
    instructions, _ = read("\n".join([header, *(r + "," + e for r, e in zip(ROWS, extra))]) + "\n")
    s = summarise(instructions, top=2)
    assert s["executed"] == 2010 and s["shared_excess_wavefronts"] == 10
    assert [(o["opcode"], o["executed"]) for o in s["executed_by_opcode"]] == [
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT", 1000), ("HGMMA.64x64x16.F32.BF16", 1000), ("MOV", 10)]
    assert sum(o["pct"] for o in s["executed_by_opcode"]) == pytest.approx(100)


def test_source_page_summary_refuses_what_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("==ERROR== Could not open report file 'x.ncu-rep'.\n")
    assert ncu_source_main([str(bad)]) == 1
    err = capsys.readouterr().err
    assert "no header row" in err and "Could not open report file" in err
    good = tmp_path / "good.csv"
    good.write_text("\n".join([HEADER, *ROWS]) + "\n")
    assert ncu_source_main([str(good), "--top", "1", "--json", str(tmp_path / "s.json")]) == 0
    assert "SYNCS.PHASECHK" in capsys.readouterr().out and (tmp_path / "s.json").exists()


def test_source_page_summary_gives_each_barrier_wait_its_retry_loop():
    """A try-wait, other work the scheduler put before its branch, and the retry loop the branch goes to: one wait
    site with all their samples; the retry loop's own check is no site of its own."""
    sass = [("0x100", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8+0x38818], R3", 2),
            ("0x110", "ISETP.GT.AND P2, PT, R0, RZ, PT", 5),
            ("0x120", "@!P1  BRA 0x200", 300),
            ("0x130", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 50),
            ("0x140", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R2", 1),
            ("0x150", "@!P0  BRA 0x240", 90),
            ("0x200", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R9+URZ+0x38818], R3", 10),
            ("0x210", "@!P1  NANOSLEEP.SYNCS 0x989680", 4),
            ("0x220", "@!P1  SYNCS.PHASECHK.TRANS64 P1, [R9+URZ+0x38818], R3", 3),
            ("0x230", "@!P1  BRA 0x200", 6),
            ("0x238", "BRA 0x130", 1),
            ("0x240", "BRA 0x160", 0)]
    instructions = [{"address": a, "source": src, "samples": float(n), "stalls": {}} for a, src, n in sass]
    waits = barrier_waits(instructions)
    assert [(w["address"], w["barrier"], w["samples"]) for w in waits] == [
        ("0x100", "[UR8+0x38818]", 2 + 300 + 10 + 4 + 3 + 6 + 1), ("0x140", "[R3+URZ]", 1 + 90)]
    total = sum(n for _, _, n in sass)
    assert summarise(instructions, top=3)["barrier_waits"][0]["pct"] == pytest.approx(100 * 326 / total)


def test_ptxas_summary_reads_the_recorded_logs():
    """The ptxas logs Mosaic GPU wrote for the MLA kernels on an H100 (run 35's default, run 36's scorer form):
    the default kept its register split; the scorer's first split was dropped and its MMAs serialised."""
    import os

    from benchmarks.mla_ptxas import summarise

    here = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "h100")
    with open(os.path.join(here, "mla_ptxas_run35", "first.ptxas")) as f:
        first = summarise(f.read())
    with open(os.path.join(here, "mla_ptxas_run36", "scorer_regs_200_152.ptxas")) as f:
        scorer = summarise(f.read())
    assert first == {"registers": 168, "spill_stores": 128, "spill_loads": 204, "setmaxnreg_ignored": False,
                     "mma_serialised": False}
    assert scorer == {"registers": 168, "spill_stores": 148, "spill_loads": 144, "setmaxnreg_ignored": True,
                      "mma_serialised": True}


def test_ptxas_register_counts_are_replaced_in_a_recorded_ptx():
    """The run-36 PTX asks for 200 / 152 registers; the rewrite gives every setmaxnreg its new count, and a PTX
    without one is refused."""
    import gzip
    import os
    import re

    from benchmarks.mla_ptxas import with_registers

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "h100", "mla_ptxas_run36",
                        "scorer_regs_200_152.ptx.gz")
    with gzip.open(path, "rt") as f:
        ptx = f.read()
    counts = lambda text: re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+);", text)  # noqa: E731
    assert counts(ptx) == [("inc", "200"), ("dec", "152")]
    changed = with_registers(ptx, 184, 160)
    assert counts(changed) == [("inc", "184"), ("dec", "160")]
    assert len(changed) == len(ptx)
    with pytest.raises(ValueError, match="no setmaxnreg"):
        with_registers(".version 8.0\n", 184, 160)


def test_profile_summary_gives_unnamed_launches_a_scope():
    """Kernels whose trace events name no HLO instruction (Pallas, Mosaic GPU) take the scope their name spells,
    else the one the named kernels on either side of them on their own stream share; nothing when those
    differ or one is missing. Named kernels keep their op_name; a stand-in is a bare scope (no matmul split)."""
    op_names = {"fusion.1": "jit(step)/routed_experts/select_n", "fusion.2": "jit(step)/routed_experts/reduce_sum",
                "fusion.3": "jit(step)/kda/dot_general"}
    lane = {"pid": 1, "tid": 1}
    events = [  # listed out of time order, two streams
        {"name": "anonymous_mosaic_gpu_kernel", "ts": 20, **lane, "args": {}},
        {"name": "fusion_1", "ts": 10, **lane, "args": {"hlo_op": "fusion.1"}},
        {"name": "anonymous_mosaic_gpu_kernel", "ts": 30, **lane, "args": {}},
        {"name": "fusion_2", "ts": 40, **lane, "args": {"hlo_op": "fusion.2"}},
        {"name": "add_rms_norm", "ts": 50, **lane, "args": {}},
        {"name": "fused_projections", "ts": 55, **lane, "args": {}},         # routed before, kda after: neither
        {"name": "fusion_3", "ts": 58, **lane, "args": {"hlo_op": "fusion.3"}},
        {"name": "kda_decode", "ts": 60, **lane, "args": {}},
        {"name": "routed_experts_gmm", "ts": 70, **lane, "args": {}},
        {"name": "anonymous_mosaic_gpu_kernel", "ts": 35, "pid": 1, "tid": 2, "args": {}},   # alone on its stream
        # the MXFP4 kernel's down launch between two kda kernels: the neighbours would say kda, its name tells
        {"name": launch_name(1, False) + "_mosaic_gpu_kernel", "ts": 75, **lane, "args": {}},
        {"name": "fusion_3", "ts": 80, **lane, "args": {"hlo_op": "fusion.3"}},
    ]
    named, stood_in = scoped_op_names(events, op_names)
    assert named == ["routed_experts", op_names["fusion.1"], "routed_experts", op_names["fusion.2"], "norm", "",
                     op_names["fusion.3"], "kda", "routed_experts", "", "routed_experts", op_names["fusion.3"]]
    assert stood_in == 6


def test_median_runs_takes_each_settings_median_over_the_runs(tmp_path, capsys):
    """Rows matched by model, tokens, blocks and hand-off across runs; a setting a run failed or lacks counts as
    missing there, not as zero; the median over the runs that have it."""
    row = lambda handoff, ms, **extra: {"model": "kimi-linear", "tokens": 64, "blocks": "None", "handoff": handoff,
                                        "ms": ms, "pct_4.3TB_s": 100 / ms, "ms_unrolled": ms - 0.02,
                                        "pct_unrolled": 100 / (ms - 0.02), **extra}
    runs = [{"hopper": [row("glu", 0.35), row("routed", 0.34)]},
            {"hopper": [row("glu", 0.37), {"model": "kimi-linear", "tokens": 64, "blocks": "None",
                                           "handoff": "routed", "failed": "XlaRuntimeError: ..."}]},
            {"hopper": [row("glu", 0.36), row("routed", 0.32)]}]
    rows = median_rows(runs)
    assert [(r["handoff"], r["runs"]) for r in rows] == [("glu", 3), ("routed", 2)]
    assert rows[0]["ms_median"] == 0.36 and abs(rows[0]["ms_unrolled_median"] - 0.34) < 1e-12
    assert rows[1]["ms_each"] == [0.34, None, 0.32] and abs(rows[1]["ms_median"] - 0.33) < 1e-12
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    assert median_main([str(p) for p in paths] + ["--json", str(tmp_path / "median.json")]) == 0
    assert "| kimi-linear | 64 | default | routed | 2 | 0.3200, , 0.3000 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "median.json").read_text())["rows"] == rows
    assert median_main([str(tmp_path / "missing.json")]) == 1
