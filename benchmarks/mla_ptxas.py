"""ptxas's verdict on each Hopper MLA decode form: registers, spills, and whether it dropped `setmaxnreg` or
serialised the warpgroup MMAs (GPU only: Mosaic GPU builds its PTX when a kernel is compiled).

    python benchmarks/mla_ptxas.py --impl hopper hopper-columns --heads 96    # $OUT/mla_ptxas/<form>/ and a table

Each form is compiled once (B = 4, a 1K cache, one query token) with Mosaic GPU's dumps on; its ptxas log and PTX
stay under $OUT/mla_ptxas/<form>/. Two ptxas notes matter most (run 36): C7507, "'setmaxnreg' ignored to maintain
minimum register requirements" (a warpgroup asked for fewer registers than its code needs, and every `setmaxnreg`
of the kernel was dropped), and C7512, "wgmma.mma_async instructions are serialized due to insufficient register
resources" (a wait after every MMA of the kernel: no MMA overlaps the next).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def compile_one(form: str, heads: int, where: str) -> None:
    """Compiles `form` once in a child process with the dumps on (the dump settings are read at import time)."""
    os.makedirs(where, exist_ok=True)
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=300)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", nargs="+", default=["hopper"], choices=list(HOPPER_FORMS))
    ap.add_argument("--heads", type=int, default=96)
    args = ap.parse_args(argv)
    out = os.path.join(os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"), "mla_ptxas")
    rows = []
    for form in args.impl:
        where = os.path.join(out, form)
        compile_one(form, args.heads, where)
        logs = sorted(glob.glob(os.path.join(where, "*.ptxas")))
        if not logs:
            raise SystemExit(f"mla_ptxas: compiling {form} left no ptxas log in {where}")
        for log in logs:
            with open(log) as f:
                rows.append({"form": form, "kernel": os.path.basename(log), **summarise(f.read())})
        for name in os.listdir(where):          # keep the PTX and the ptxas logs only
            if not name.endswith((".ptx", ".ptxas")):
                os.remove(os.path.join(where, name))
    print(table(rows, ["form", "kernel", "registers", "spill_stores", "spill_loads", *NOTES.values()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
