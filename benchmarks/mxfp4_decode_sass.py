"""Static instruction counts of the MXFP4 Mosaic GPU kernel's PTX decodes on sm_90a, no GPU needed.

    pip install nvidia-cuda-nvcc-cu12 nvidia-cuda-nvdisasm     # ptxas and nvdisasm (any host)
    python benchmarks/mxfp4_decode_sass.py [--ptxas P] [--nvdisasm P] [--chunks 8]

Each decode of `pallas_kernels/moe_gmm/hopper_mxfp4.py` (its PTX text, as the kernel inlines it) goes
into a small loop that decodes `--chunks` 16-bit chunks of four codes, scales both bf16 pairs as the
kernel does and sums them; ptxas compiles it for sm_90a and nvdisasm lists the SASS. Per chunk of four
codes: instructions by opcode and by the pipe they issue to. On sm_90 the integer ALU (lop3, prmt,
shifts) and the integer multiply-add take 64 lanes a clock per multiprocessor, half the rate of issue and
of bf16x2 arithmetic, so a decode-bound kernel is bound by `alu_clocks` (warp-clocks a multiprocessor
partition spends on the ALU per chunk) or by issue (one instruction a clock: the decode's instructions and
the kernel's two bf16 scale multiplies a chunk, `issue_clocks_with_scale`), whichever is larger. The IMAD
column also counts ptxas's moves and shifts (IMAD.MOV, IMAD.SHL), which run on the same pipe.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.moe_gmm.hopper_mxfp4_decode import PTX_DECODE, PTX_DECODE_BITS  # noqa: E402

DECODES = {"ptx": PTX_DECODE, "bits": PTX_DECODE_BITS}
BASELINE = "{\nmov.b32 $0, $2;\nmov.b32 $1, $2;\n}"     # the loop with no decode: subtracted from each
ALU = {"LOP3", "PRMT", "SHF", "IADD3", "LEA", "SEL", "ISETP", "BFE", "BFI", "FLO", "POPC", "LOP"}
MULTIPLY_ADD = {"IMAD"}   # integer multiply-adds, and ptxas's moves and shifts as IMAD.MOV / IMAD.SHL: FMA pipe
FLOAT16 = {"HFMA2", "HMUL2", "HADD2"}


def micro_kernel(text: str, chunks: int) -> str:
    """PTX of a loop over words of codes: each of `chunks` 16-bit chunks decoded by `text` (with
    $2 the chunk, $0 / $1 the pairs), each pair times its own bf16 factor (two, so that the baseline,
    whose pairs are equal, keeps both multiplies) and summed."""
    body = []
    for c in range(chunks):
        decode = text.replace("$2", "chunk_").replace("$0", "lo_").replace("$1", "hi_")
        body += ["shr.u32 chunk_, word_, 16;" if c % 2 else "mov.b32 chunk_, word_;", decode,
                 "fma.rn.bf16x2 lo_, lo_, factor_, zero_;", "fma.rn.bf16x2 hi_, hi_, factor2_, zero_;",
                 "fma.rn.bf16x2 acc_, lo_, hi_, acc_;"]
        if c % 2:
            body.append("ld.global.u32 word_, [cursor_+4];\nadd.u64 cursor_, cursor_, 4;")
    return "\n".join([
        ".version 8.4", ".target sm_90a", ".address_size 64",
        ".visible .entry decode_loop(.param .u64 inp, .param .u64 outp, .param .u32 n, .param .u32 f, "
        ".param .u32 f2)", "{",
        ".reg .b32 word_, chunk_, lo_, hi_, acc_, factor_, factor2_, zero_, i_, count_;", ".reg .b64 cursor_, out_;",
        ".reg .pred more_;",      # names ending in _ : the decodes' own registers are scoped inside them
        "ld.param.u64 cursor_, [inp];", "ld.param.u64 out_, [outp];", "ld.param.u32 count_, [n];",
        "ld.param.u32 factor_, [f];", "ld.param.u32 factor2_, [f2];", "mov.b32 zero_, 0x80008000;",
        "mov.b32 acc_, 0;", "mov.b32 i_, 0;",
        "ld.global.u32 word_, [cursor_];",
        "LOOP:", *body,
        "add.u32 i_, i_, 1;", "setp.lt.u32 more_, i_, count_;", "@more_ bra LOOP;",
        "st.global.u32 [out_], acc_;", "ret;", "}"])


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes between the loop's label and its backward branch."""
    lines = sass.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*\.L_x_\d+:", line))
    ops = collections.Counter()
    for line in lines[start + 1:]:
        m = re.match(r"\s*/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if not m:
            continue
        if m.group(2) == "BRA":
            break
        ops[m.group(2)] += 1
    return ops


def find_tool(name: str) -> str:
    import nvidia
    for root in nvidia.__path__:
        hits = sorted(glob.glob(os.path.join(root, "*", "bin", name)))
        if hits:
            return hits[-1]
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-nvcc-cu12 nvidia-cuda-nvdisasm, or pass --{name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptxas")
    ap.add_argument("--nvdisasm")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of four codes a loop step (even)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sm90a",
                                                  "mxfp4_decode_sass.json"))
    args = ap.parse_args(argv)
    if args.chunks < 2 or args.chunks % 2:
        ap.error(f"--chunks must be even and >= 2 (two chunks a word of codes), got {args.chunks}")
    ptxas, nvdisasm = args.ptxas or find_tool("ptxas"), args.nvdisasm or find_tool("nvdisasm")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        empty = None
        for name, text in [("loop only", BASELINE), *DECODES.items()]:
            ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            with open(ptx, "w") as f:
                f.write(micro_kernel(text, args.chunks))
            subprocess.run([ptxas, "-arch=sm_90a", "-O3", ptx, "-o", cubin], check=True)
            sass = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
            ops = loop_opcodes(sass)
            if empty is None:
                empty = ops
                continue
            per = {op: (n - empty.get(op, 0)) / args.chunks for op, n in sorted(ops.items())}
            per = {op: v for op, v in per.items() if v}
            alu = sum(v for op, v in per.items() if op in ALU)
            imad = sum(v for op, v in per.items() if op in MULTIPLY_ADD)
            f16 = sum(v for op, v in per.items() if op in FLOAT16)
            rows.append({"decode": name, "per_chunk_of_4_codes": per, "instructions": sum(per.values()),
                         "alu": alu, "imad": imad, "bf16x2": f16, "alu_clocks": 2 * alu,
                         "fma_pipe_clocks": 2 * imad + f16,
                         # with the kernel's two bf16 scale multiplies a chunk: one instruction a clock
                         "issue_clocks_with_scale": sum(per.values()) + 2})
    tools = {t: subprocess.run([p, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
             for t, p in (("ptxas", ptxas), ("nvdisasm", nvdisasm))}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "mxfp4_decode_sass", "arch": "sm_90a", "chunks": args.chunks, "tools": tools,
                   "note": "per 16-bit chunk of four codes, after the loop's own instructions are subtracted; "
                           "the decode, not the bf16 scale multiply or the sum",
                   "rows": rows}, f, indent=1)
    print("| decode | instructions | integer ALU | IMAD | bf16x2 | ALU clocks | issue clocks with scaling | opcodes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ops = ", ".join(f"{op} {v:g}" for op, v in r["per_chunk_of_4_codes"].items())
        print(f"| {r['decode']} | {r['instructions']:g} | {r['alu']:g} | {r['imad']:g} | {r['bf16x2']:g} | "
              f"{r['alu_clocks']:g} | {r['issue_clocks_with_scale']:g} | {ops} |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
