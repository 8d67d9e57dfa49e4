"""What ptxas made of the Hopper MXFP4 kernel: registers, spills, wgmma serialisation warnings, and the
SASS instruction mix of each compiled form.

    python3 benchmarks/hopper_mxfp4_sass.py [--out DIR]     # on a Hopper GPU (compiles and runs once)

Each form of `HopperMxfp4Blocks` in FORMS is compiled through the pair GLU entry point at Kimi-Linear's
expert shape (D = 2304, F = 1024, 8 pairs) with Mosaic GPU's dumps on (`MOSAIC_GPU_DUMP_PTXAS`,
`MOSAIC_GPU_DUMP_SASS`, `MOSAIC_GPU_DUMP_TO`); the dumps land in DIR/<form>/, and DIR/sass_summary.md
holds per form the ptxas lines and the count of each SASS opcode (the decode's PRMT / LOP3, the
HGMMA MMAs, the HMUL2 scalings, the shared-memory loads). Mosaic GPU runs nvdisasm from
$MOSAIC_GPU_CUDA_ROOT/bin; where that has none, an nvdisasm on PATH (`gpu_session.sh` puts the
`nvidia-cuda-nvdisasm` wheel's there when .whl/ holds it) is linked into a copy of the root
(`root_with_nvdisasm`). The PTX is kept too, so `ptxas` and `nvdisasm` can also be run on it on any host.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORMS = {"default": {}, "ptx": {"decode": "ptx"}, "mma_step": {"mma_inputs": 0}, "smem": {"a_operand": "smem"},
         "scaled_mma_step": {"decode": "scaled", "mma_inputs": 0},
         "words_scaled_mma_step": {"code_load": "words", "decode": "scaled", "mma_inputs": 0},
         # four programs a multiprocessor by shared memory, if ptxas keeps them at <= 128 registers a thread
         "k128_s4_mma_step": {"block_k": 128, "stages": 4, "mma_inputs": 0},
         "k128_s4_scaled_mma_step": {"block_k": 128, "stages": 4, "mma_inputs": 0, "decode": "scaled"},
         "k128_s4_words_scaled_mma_step": {"block_k": 128, "stages": 4, "mma_inputs": 0, "decode": "scaled",
                                           "code_load": "words"},
         "s2_scaled_mma32": {"stages": 2, "mma_inputs": 32, "decode": "scaled"},
         "k128_s3_scaled_mma32": {"block_k": 128, "stages": 3, "mma_inputs": 32, "decode": "scaled"}}
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
KEY_OPS = ("HGMMA", "WARPGROUP", "PRMT", "LOP3", "HMUL2", "HFMA2", "LDS", "STS", "SHF", "BAR", "SYNCS", "UTMALDG")


def root_with_nvdisasm(scratch: str = "/tmp/mosaic_cuda_root") -> None:
    """Points MOSAIC_GPU_CUDA_ROOT (set when Mosaic GPU is imported) at a root whose bin/ has nvdisasm: the
    same root where it has one, else a copy made of links to its entries and to the nvdisasm on PATH
    (`gpu_session.sh` unpacks the `nvidia-cuda-nvdisasm` wheel there rather than installing it: JAX would take
    the package's `nvidia/cu13`, which has no ptxas, for its CUDA root)."""
    import shutil

    from jax.experimental.mosaic.gpu import core  # noqa: F401  (sets MOSAIC_GPU_CUDA_ROOT)
    root = os.environ.get("MOSAIC_GPU_CUDA_ROOT", "/usr/local/cuda")
    tool = shutil.which("nvdisasm")
    if os.path.exists(os.path.join(root, "bin", "nvdisasm")) or tool is None:
        return
    os.makedirs(os.path.join(scratch, "bin"), exist_ok=True)
    links = [(os.path.join(root, e), os.path.join(scratch, e)) for e in os.listdir(root) if e != "bin"]
    bin_dir = os.path.join(root, "bin")
    links += [(os.path.join(bin_dir, e), os.path.join(scratch, "bin", e))
              for e in (os.listdir(bin_dir) if os.path.isdir(bin_dir) else [])]
    links.append((tool, os.path.join(scratch, "bin", "nvdisasm")))
    for src, dst in links:
        if not os.path.lexists(dst):
            os.symlink(src, dst)
    os.environ["MOSAIC_GPU_CUDA_ROOT"] = scratch
    print(f"nvdisasm: {tool} (through {scratch})", flush=True)


def compile_form(name: str, fields: dict, out_dir: str) -> None:
    """Compiles and runs one form with the dumps sent to out_dir/name (read by the C++ compile step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.moe_gmm.hopper_mxfp4 import HopperMxfp4Blocks, Mxfp4Columns, pair_glu_hopper_mxfp4

    where = os.path.join(out_dir, name)
    os.makedirs(where, exist_ok=True)
    os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTX="1",
                      MOSAIC_GPU_DUMP_TO=where)
    rng = np.random.default_rng(0)
    e, d, f, pairs = 16, 2304, 1024, 8

    def weight():
        return Mxfp4Columns(jnp.asarray(rng.integers(0, 256, (e, f, d // 2), dtype=np.uint8)),
                            jnp.asarray(rng.integers(118, 123, (e, d // 32, f), dtype=np.uint8)))

    x = jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16)
    group = jnp.asarray(rng.choice(e, pairs, replace=False), jnp.int32)
    out = pair_glu_hopper_mxfp4(x, weight(), weight(), group, jnp.ones((pairs,), bool), repeat=pairs,
                                blocks=HopperMxfp4Blocks(**fields), interpret=False)
    jax.block_until_ready(out)


def prune(out_dir: str) -> None:
    """Drops every dump but the PTX, the ptxas log and the SASS (`MOSAIC_GPU_DUMP_TO` also writes the MLIR
    after each pass, which would swell the results archive)."""
    for name in FORMS:
        where = os.path.join(out_dir, name)
        for fname in os.listdir(where) if os.path.isdir(where) else []:
            if not fname.endswith((".ptx", ".ptxas", ".sass")):
                os.remove(os.path.join(where, fname))


def summarise(out_dir: str) -> str:
    lines = ["# Hopper MXFP4 kernel: ptxas and SASS", ""]
    for name in FORMS:
        where = os.path.join(out_dir, name)
        files = sorted(os.listdir(where)) if os.path.isdir(where) else []
        fields = FORMS[name] or "HopperMxfp4Blocks' own field defaults"
        lines += [f"## {name} ({fields})", "", f"files: {', '.join(files) or 'none'}", ""]
        for fname in files:
            text = open(os.path.join(where, fname), errors="replace").read()
            if fname.endswith(".ptxas"):
                lines += ["```", *[ln for ln in text.splitlines() if ln.strip()][:20], "```", ""]
            if fname.endswith(".sass"):
                counts = collections.Counter(m.group(1).split(".")[0] for m in OPCODE.finditer(text))
                total = sum(counts.values())
                lines += [f"SASS instructions: {total}", "", "| opcode | count |", "|---|---|"]
                lines += [f"| {op} | {counts[op]} |" for op in KEY_OPS if counts[op]]
                lines += ["", "most frequent: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(15)), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/hopper_mxfp4_sass"))
    ap.add_argument("--forms", nargs="*", default=["default", "ptx", "mma_step"], choices=list(FORMS))
    args = ap.parse_args(argv)
    try:
        root_with_nvdisasm()
    except Exception as exc:  # noqa: BLE001 - without nvdisasm the ptxas lines and the PTX still come back
        print(f"nvdisasm: not set up ({type(exc).__name__}: {exc})", flush=True)
    for name in args.forms:
        try:
            compile_form(name, FORMS[name], args.out)
        except Exception as exc:  # noqa: BLE001 - one form failing must not hide the others' dumps
            print(f"{name}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    prune(args.out)
    summary = summarise(args.out)
    with open(os.path.join(args.out, "sass_summary.md"), "w") as fh:
        fh.write(summary + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
