"""ptxas's verdict on each Hopper MLA decode form: registers, spills, and whether it dropped `setmaxnreg` or
serialised the warpgroup MMAs (GPU only: Mosaic GPU builds its PTX when a kernel is compiled).

    python benchmarks/mla_ptxas.py --impl hopper hopper-columns --heads 96    # $OUT/mla_ptxas/<form>/ and a table
    python benchmarks/mla_ptxas.py --ptx benchmarks/results/h100/mla_ptxas_run36/scorer_regs_200_152.ptx.gz \
        --setmaxnreg 184 160 --ptxas /usr/local/bin/ptxas                     # any host: a recorded PTX again

Each form is compiled once (B = 4, a 1K cache, one query token) with Mosaic GPU's dumps on; its ptxas log and PTX
stay under $OUT/mla_ptxas/<form>/. Two ptxas notes matter most (run 36): C7507, "'setmaxnreg' ignored to maintain
minimum register requirements" (a warpgroup asked for fewer registers than its code needs, and every `setmaxnreg`
of the kernel was dropped), and C7512, "wgmma.mma_async instructions are serialized due to insufficient register
resources" (a wait after every MMA of the kernel: no MMA overlaps the next).

`--ptx` runs a local ptxas (sm_90a) on a PTX file that such a run recorded, with `--setmaxnreg INC DEC` replacing the
counts of its `setmaxnreg.inc` and `setmaxnreg.dec` instructions: which register split ptxas would honour, no GPU
needed.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import table  # noqa: E402
from benchmarks.mla_decode import HOPPER_FORMS  # noqa: E402

NOTES = {"C7507": "setmaxnreg_ignored", "C7512": "mma_serialised"}


def summarise(log: str) -> dict:
    """The numbers of one ptxas log: registers, spill stores and loads (bytes), and the notes of NOTES."""
    def number(pattern):
        found = re.search(pattern, log)
        return int(found.group(1)) if found else None

    row = {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
           "spill_loads": number(r"(\d+) bytes spill loads")}
    row.update({name: code in log for code, name in NOTES.items()})
    return row


def with_registers(ptx: str, increase: int, decrease: int) -> str:
    """`ptx` with the counts of its `setmaxnreg.inc` / `setmaxnreg.dec` instructions replaced."""
    counts = {"inc": increase, "dec": decrease}
    ptx, found = re.subn(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 \d+;",
                         lambda m: f"setmaxnreg.{m.group(1)}.sync.aligned.u32 {counts[m.group(1)]};", ptx)
    if not found:
        raise ValueError("mla_ptxas: the PTX has no setmaxnreg instruction to change")
    return ptx


def recompile(path: str, ptxas: str, registers: tuple[int, int] | None) -> dict:
    """ptxas -v for sm_90a on a recorded PTX file (plain or .gz), optionally with other setmaxnreg counts."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        ptx = f.read()
    if registers is not None:
        ptx = with_registers(ptx, *registers)
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", source, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"mla_ptxas: ptxas failed on {path}: {done.stderr.strip().splitlines()[-1:]}")
    return summarise(done.stdout + done.stderr)


def compile_one(form: str, heads: int, where: str) -> str | None:
    """Compiles `form` once in a child process with the dumps on (Mosaic GPU reads them as it compiles each kernel;
    MOSAIC_GPU_DUMP_TO alone turns on all of its dumps, the MLIR passes and SASS too, which `main` deletes)."""
    shutil.rmtree(where, ignore_errors=True)     # no log of an earlier run in the table
    os.makedirs(where)
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=where)
    program = f"""
import jax, jax.numpy as jnp
from pallas_kernels.mla_decode.hopper import HopperMLABlocks, mla_decode_hopper
k = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(k[0], (4, 1, {heads}, 512), jnp.bfloat16)
qp = jax.random.normal(k[1], (4, 1, {heads}, 64), jnp.bfloat16)
c = jax.random.normal(k[2], (4, 1024, 576), jnp.bfloat16)
blocks = HopperMLABlocks(**{HOPPER_FORMS[form]!r})
jax.block_until_ready(mla_decode_hopper(q, qp, c, jnp.full((4,), 1000, jnp.int32), scale=0.1, blocks=blocks))
"""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run([sys.executable, "-c", program], env=env, timeout=300)
    except subprocess.TimeoutExpired:
        return f"mla_ptxas: compiling {form} took more than 300 s"
    return f"mla_ptxas: compiling {form} failed (exit status {done.returncode})" if done.returncode else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", nargs="+", default=["hopper"], choices=list(HOPPER_FORMS))
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--ptx", default=None, help="a recorded PTX file (.ptx or .ptx.gz) to run a local ptxas on")
    ap.add_argument("--setmaxnreg", nargs=2, type=int, default=None, metavar=("INC", "DEC"),
                    help="with --ptx: the counts of its setmaxnreg.inc and .dec instructions")
    ap.add_argument("--ptxas", default=shutil.which("ptxas"), help="with --ptx: the ptxas to run (default: on PATH)")
    args = ap.parse_args(argv)
    if args.ptx is not None:
        if not args.ptxas:
            raise SystemExit("mla_ptxas: --ptx needs a ptxas (--ptxas PATH, or one on PATH)")
        row = {"ptx": os.path.basename(args.ptx), "setmaxnreg": " / ".join(map(str, args.setmaxnreg or ["as is"])),
               **recompile(args.ptx, args.ptxas, args.setmaxnreg)}
        print(table([row], list(row)))
        return 0
    if args.setmaxnreg is not None:
        raise SystemExit("mla_ptxas: --setmaxnreg applies to --ptx only")
    out = os.path.join(os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"), "mla_ptxas")
    rows, status = [], 0
    for form in args.impl:
        where = os.path.join(out, form)
        failed = compile_one(form, args.heads, where)
        logs = sorted(glob.glob(os.path.join(where, "*.ptxas")))
        if failed or not logs:
            print(failed or f"mla_ptxas: compiling {form} left no ptxas log in {where}", flush=True)
            status = 1
        for log in logs:
            with open(log) as f:
                rows.append({"form": form, "kernel": os.path.basename(log), **summarise(f.read())})
        for name in os.listdir(where):          # keep the PTX and the ptxas logs only
            if not name.endswith((".ptx", ".ptxas")):
                os.remove(os.path.join(where, name))
    print(table(rows, ["form", "kernel", "registers", "spill_stores", "spill_loads", *NOTES.values()]))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
