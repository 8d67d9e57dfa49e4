"""Registers, spills, shared memory and layout traffic of the Triton-lowered Pallas kernels, for an
sm_90 GPU, on any host (no GPU, no device time).

Each case is lowered by JAX for CUDA (`jax.export`, the GPU taken to be sm_90), its Triton IR kept,
then compiled by the `triton` package to PTX (whose layout conversions and barriers are counted) and
by its ptxas (`-v`: registers per thread, spill bytes, stack). The `triton` package is not one of
the project's dependencies; give a Python that has it (any machine, no GPU needed):

    python3.12 -m venv /tmp/tritonenv && /tmp/tritonenv/bin/pip install triton==3.6.0
    python benchmarks/triton_resources.py --triton-python /tmp/tritonenv/bin/python --cases kda-chunk-blocked

A kernel whose threads hold 255 registers and spill is latency-bound whatever its arithmetic: the
H200 gives one SM 64K registers, so 255 per thread at 4 warps allows two programs per SM at most,
and every spilled value is a round trip to local memory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_CASES = None


def _cases():
    """name -> (jitted function, argument shapes), built once. Imported lazily: the compile step runs
    without jax."""
    global _CASES
    if _CASES is None:
        _CASES = _build_cases()
    return _CASES


def _build_cases():
    import jax
    import jax.numpy as jnp

    from benchmarks.kda import FP32_FACTORS, VARIANTS, state_stream
    from pallas_kernels.kda import ChunkBlocks, kda_chunk_pallas

    spec = jax.ShapeDtypeStruct
    b, t, h, kd = 1, 256, 4, 128
    kda_args = (spec((b, t, h, kd), jnp.bfloat16),) * 3 + (spec((b, t, h, kd), jnp.float32),
                                                          spec((b, t, h), jnp.float32))

    def kda(normalize_qk=False, blocks=None, values=jnp.bfloat16, **kw):
        blocks = blocks or ChunkBlocks(**kw)
        args = (spec((b, t, h, kd), values),) * 3 + kda_args[3:]
        return (jax.jit(lambda q, k, v, g, beta: kda_chunk_pallas(q, k, v, g, beta, blocks=blocks, interpret=False,
                                                                  normalize_qk=normalize_qk)), args)

    factors_loop = lambda columns, warps, stages: dict(factors_loop=True, factors_slice=columns,
                                                       factors_num_warps=warps, factors_num_stages=stages)

    from pallas_kernels.kda import DecodeBlocks, KDADecodeInputs, KDADecodeWeights, kda_decode_pallas
    from pallas_kernels.mla_decode.merge import merge_splits_pallas
    from pallas_kernels.moe_gmm.kernel import pair_glu_pallas
    from pallas_kernels.moe_gmm.mxfp4 import Mxfp4Weight
    from pallas_kernels.moe_gmm.tuning import TileBlocks
    from pallas_kernels.rms_norm.kernel import add_rms_norm_pallas
    from pallas_kernels.router.kernel import route_topk_pallas
    from pallas_kernels.router.spec import RouterSpec
    from pallas_kernels.skinny.kernel import fused_projections_pallas

    f32, bf16 = jnp.float32, jnp.bfloat16

    def kda_decode(rows, **blocks):
        hd, w = 32, 4
        inputs = KDADecodeInputs(x_qkv=spec((rows, 3, hd, kd), bf16), f=spec((rows, hd, kd), bf16),
                                 beta_logit=spec((rows, hd), bf16), z=spec((rows, hd, kd), bf16))
        weights = KDADecodeWeights(q_conv=spec((w, hd, kd), f32), k_conv=spec((w, hd, kd), f32),
                                   v_conv=spec((w, hd, kd), f32), dt_bias=spec((hd, kd), f32),
                                   a_log=spec((hd, 1), f32), o_norm_w=spec((kd,), f32))
        call = jax.jit(lambda i, wt, c, st: kda_decode_pallas(i, wt, c, st, blocks=DecodeBlocks(**blocks),
                                                                       interpret=False))
        return call, (inputs, weights, spec((rows, w - 1, 3, hd, kd), bf16), spec((rows, hd, kd, kd), f32))

    def pairs(mxfp4: bool, **blocks):
        experts, d, ff, k = 256, 2304, 1024, 8     # Kimi-Linear's routed experts, one token's 8 pairs
        if mxfp4:
            w = Mxfp4Weight(spec((experts, d // 2, ff), jnp.uint8), spec((experts, d // 32, ff), jnp.uint8))
        else:
            w = spec((experts, d, ff), bf16)
        tile = TileBlocks(**{**dict(block_m=16, block_n=64, block_k=128, num_stages=3, gemv=mxfp4), **blocks}) \
            if blocks else None
        call = jax.jit(lambda x, wg, wu, g, v: pair_glu_pallas(x, wg, wu, g, v, repeat=k, blocks=tile,
                                                               interpret=False))
        return call, (spec((1, d), bf16), w, w, spec((k,), jnp.int32), spec((k,), jnp.bool_))

    return {
        # fp32 factors, three-TF32 inverse, XLA cumsum: the dtypes before the bf16 factors (runs 1-4); the pair and
        # solve forms are today's defaults unless named
        "kda-chunk-blocked": kda(intra="blocked", **FP32_FACTORS),
        "kda-chunk-parallel": kda(intra="parallel", **FP32_FACTORS),
        "kda-chunk-parallel-ks16": kda(intra="parallel", key_slice=16, **FP32_FACTORS),
        "kda-chunk-parallel-ks64": kda(intra="parallel", key_slice=64, **FP32_FACTORS),
        "kda-chunk-parallel-w8": kda(intra="parallel", num_warps=8, **FP32_FACTORS),
        "kda-chunk-split": kda(inter="split", **FP32_FACTORS),
        "kda-chunk-default": kda(),     # ChunkBlocks() on bf16 values: parallel, bf16 factors, cumsum per token
        "kda-chunk-tiles": kda(pairs="tiles"),
        "kda-chunk-tiles-w2": kda(pairs="tiles", pairs_num_warps=2),
        "kda-chunk-tiles-w1": kda(pairs="tiles", pairs_num_warps=1),
        "kda-chunk-joint": kda(pairs="joint", solve="whole"),    # the default before the diagonal form
        "kda-chunk-diagonal-whole": kda(solve="whole"),
        "kda-chunk-dh4": kda(diagonal_heads=4),
        "kda-chunk-pallas-cumsum": kda(cumsum="pallas"),     # the local cumsum in a launch of its own
        "kda-chunk-norm-in": kda(normalize_qk=True),     # q and k L2-normalised in the per-token launch
        "kda-chunk-norm-in-run27": kda(normalize_qk=True, blocks=VARIANTS["run27"]),   # ... as before KDA run 28
        "kda-chunk-norm-in-bf16": kda(normalize_qk=True, qk_norm="diagonal-bf16"),
        "kda-chunk-norm-in-after": kda(normalize_qk=True, qk_norm="diagonal-after"),
        "kda-chunk-norm-scales": kda(normalize_qk=True, qk_norm="scales"),   # only 1 / |q|, 1 / |k| handed on
        "kda-chunk-norm-scales-after": kda(normalize_qk=True, qk_norm="scales-after"),
        # the pairs across sub-blocks and the inverse by 16 x 16 tiles, at the settings of kda.py's variants so named
        # (kda-chunk-across-tiles-ks16-pw1-ps3: the default since KDA run 27)
        **{"kda-chunk-" + name.removeprefix("default/").replace("/", "-"): kda(blocks=VARIANTS[name])
           for name in VARIANTS if name.startswith("default/across-tiles")},
        "kda-chunk-stages2": kda(num_stages=2),
        "kda-chunk-norm-in-dw1": kda(normalize_qk=True, diagonal_num_warps=1),   # per-token launch: 2 heads, 1 warp
        "kda-chunk-norm-in-dh4-dw1": kda(normalize_qk=True, diagonal_heads=4, diagonal_num_warps=1),
        "kda-chunk-norm-in-dh4-dw2": kda(normalize_qk=True, diagonal_heads=4, diagonal_num_warps=2),
        "kda-chunk-norm-in-exp2": kda(normalize_qk=True, diagonal_exp2=True),   # the walk's exponentials as 2^x
        "kda-chunk-norm-in-exp2-dw1": kda(normalize_qk=True, diagonal_exp2=True, diagonal_num_warps=1),
        # the tile pairs launch: 2^x and one loop over key slices (the defaults since KDA run 31, so "kda-chunk-norm-in"
        # has both), the run-30 form (neither) and each alone; q e^G from the pairs launch with each
        "kda-chunk-norm-in-run30": kda(normalize_qk=True, pairs_exp2=False, pairs_one_loop=False),
        "kda-chunk-norm-in-pairs-exp2": kda(normalize_qk=True, pairs_exp2=True, pairs_one_loop=False),
        "kda-chunk-norm-in-pairs-one-loop": kda(normalize_qk=True, pairs_exp2=False, pairs_one_loop=True),
        "kda-chunk-norm-in-pairs-exp2-one-loop": kda(normalize_qk=True, pairs_exp2=True, pairs_one_loop=True),
        "kda-chunk-norm-in-qg-in-pairs": kda(normalize_qk=True, pairs_exp2=False, pairs_one_loop=False,
                                             qg_in_pairs=True),
        "kda-chunk-norm-in-pairs-exp2-qg-in-pairs": kda(normalize_qk=True, pairs_exp2=True, pairs_one_loop=False,
                                                        qg_in_pairs=True),
        "kda-chunk-norm-in-pairs-exp2-one-loop-qg-in-pairs": kda(normalize_qk=True, pairs_exp2=True,
                                                                 pairs_one_loop=True, qg_in_pairs=True),
        # W, U, ... with q, k normalised inside: 32 columns a loop step at 8 warps (87 registers) against the
        # default's 64 at 8 (139 with fp32 q, k: one program a multiprocessor; the case kda-chunk-norm-in-run27;
        # the -bf16 cases and, since KDA run 28, kda-chunk-norm-in take bf16 q, k)
        # the W, U loop's stages at the default 64 columns, 8 warps (3 since KDA run 29), bf16 and fp32 values
        "kda-chunk-norm-in-factors-s2": kda(normalize_qk=True, factors_num_stages=2),
        "kda-chunk-norm-in-factors-s3": kda(normalize_qk=True, factors_num_stages=3),
        "kda-chunk-f32-norm-in-factors-s2": kda(normalize_qk=True, values=jnp.float32, factors_num_stages=2),
        "kda-chunk-f32-norm-in-factors-s3": kda(normalize_qk=True, values=jnp.float32, factors_num_stages=3),
        "kda-chunk-norm-in-factors-loop32-w8-s2": kda(normalize_qk=True, **factors_loop(32, 8, 2)),
        "kda-chunk-norm-in-factors-loop32-w8-s3": kda(normalize_qk=True, **factors_loop(32, 8, 3)),
        "kda-chunk-norm-in-bf16-factors-loop32-w8-s2": kda(normalize_qk=True, qk_norm="diagonal-bf16",
                                                           **factors_loop(32, 8, 2)),
        "kda-chunk-norm-in-bf16-factors-loop32-w8-s3": kda(normalize_qk=True, qk_norm="diagonal-bf16",
                                                           **factors_loop(32, 8, 3)),
        # W, U, ... one program a chunk walking (columns, warps, stages) slices in a loop (the default: 64, 8, 3 since
        # KDA run 29 with bf16 values; 2 before)
        "kda-chunk-factors-loop32-s2": kda(**factors_loop(32, 4, 2)),
        "kda-chunk-factors-loop32-s3": kda(**factors_loop(32, 4, 3)),
        "kda-chunk-factors-loop64-s2": kda(**factors_loop(64, 4, 2)),
        "kda-chunk-factors-loop64-w8-s2": kda(**factors_loop(64, 8, 2)),
        "kda-chunk-rows": kda(diagonal_band=False),     # the per-token launch writing whole [C, C] rows
        "kda-chunk-fs32": kda(factors_slice=32, factors_num_warps=4),   # W, U, ... launch at 32 / 64 / 128 key
        "kda-chunk-fs64": kda(factors_slice=64, factors_num_warps=4),   # columns a program, 4 warps (the default:
        "kda-chunk-fs128-w4": kda(factors_slice=128, factors_num_warps=4),   # 128 at 8 warps)
        "kda-chunk-tiles-ks64": kda(pairs="tiles", key_slice=64),
        "kda-decode-b1": kda_decode(1),
        "kda-decode-b64": kda_decode(64),
        "kda-decode-b64-w8-v2": kda_decode(64, num_warps=8, value_blocks=2),   # 8 warps over one program: refused
        "kda-decode-b64-loop32": kda_decode(64, column_block=32),
        "kda-decode-b64-loop64": kda_decode(64, column_block=64),
        "kda-state-stream-b64": (jax.jit(lambda d, st: state_stream(d, st, num_warps=4, interpret=False)),
                                 (spec((64, 32, kd), bf16), spec((64, 32, kd, kd), f32))),
        "moe-pairs-bf16": pairs(False),
        "moe-pairs-mxfp4": pairs(True),                  # the default settings (since b226bf0: PTX, parts)
        "moe-pairs-mxfp4-bits": pairs(True, e2m1="bits"),  # the JAX bit decode, the default before 2011a7c
        "moe-pairs-mxfp4-asm": pairs(True, e2m1="asm"),
        "moe-pairs-mxfp4-asm-split": pairs(True, e2m1="asm", split_k=0),
        "moe-pairs-mxfp4-tile": pairs(True, gemv=False),
        "moe-pairs-mxfp4-tile-asm": pairs(True, gemv=False, e2m1="asm"),
        "o-proj-b1": (jax.jit(lambda x, w: fused_projections_pallas((x,), (w,), counts=(1,), interpret=False)),
                      (spec((1, 4096), bf16), spec((4096, 2304), bf16))),
        "add-rms-norm-b1": (jax.jit(lambda h, p, w: add_rms_norm_pallas(h, p, w, eps=1e-6, interpret=False)),
                            (spec((1, 2304), bf16), spec((8, 1, 2304), f32), spec((2304,), bf16))),
        "route-topk-b1": (jax.jit(lambda lg, bias: route_topk_pallas(lg, bias, spec=RouterSpec(k=8), interpret=False)),
                          (spec((4, 1, 256), f32), spec((256,), f32))),
        "mla-merge-1x128k": (jax.jit(lambda o, lse: merge_splits_pallas(o, lse, rows=32, interpret=False)),
                             (spec((1, 128, 64, 512), bf16), spec((1, 128, 64), f32))),
    }


def lower(name: str, out_dir: str) -> list[dict]:
    """Lower one case for sm_90: one record per Triton kernel, its TTIR written under out_dir."""
    from types import SimpleNamespace

    import jax
    import jax._src.pallas.triton.pallas_call_registration as reg

    reg.gpu_info_lib.get_gpu_info = lambda: SimpleNamespace(compute_capability="9.0")
    captured = []
    original = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        fn, args = _cases()[name]
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original
    configs = re.findall(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    if not configs or len(configs) != len(captured):
        raise RuntimeError(f"{name}: {len(captured)} Triton modules but {len(configs)} launch configs in the export")
    records = []
    for i, (ttir, (kernel, stages, warps)) in enumerate(zip(captured, configs)):
        func = re.search(r"tt\.func (?:public )?@(\w+)", ttir)
        if func is None or func.group(1) != kernel:     # modules and launch configs paired by order: check it
            raise RuntimeError(f"{name}: launch {i} is {kernel!r} but its Triton module is "
                               f"{func.group(1) if func else None!r}")
        path = os.path.join(out_dir, f"{name}_{i}_{kernel}.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        records.append({"case": name, "kernel": kernel, "num_warps": int(warps), "num_stages": int(stages),
                        "ttir": path})
    return records


def ptx_counts(ptx: str) -> dict:
    """Static PTX counts: every instruction, those in loop bodies (from a label to a branch back to it, each
    such body once; a nested loop counts in its own body and its parent's) and the 2^x ones (ex2.approx)."""
    lines = [line.strip() for line in ptx.splitlines()]
    instruction = lambda s: s.endswith(";") and not s.startswith((".", "//", "{", "}", "(", ")", "$"))
    labels = {m.group(1): i for i, s in enumerate(lines) if (m := re.match(r"(\$L__\w+):", s))}
    in_loops = 0
    for i, s in enumerate(lines):
        if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", s)) and labels.get(m.group(1), i) < i:
            in_loops += sum(map(instruction, lines[labels[m.group(1)]:i + 1]))
    return {"ptx_instructions": sum(map(instruction, lines)), "loop_instructions": in_loops,
            "ex2": sum("ex2.approx" in s for s in lines if instruction(s))}


def compile_ttir(path: str, warps: int, stages: int) -> dict:
    """(Run under a Python with `triton`.) TTIR -> PTX -> ptxas -v for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        done = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                              text=True)
    finally:
        os.unlink(f.name)
    if done.returncode:
        raise RuntimeError(f"ptxas failed on {path}: {done.stderr.strip()[-500:]}")
    info = done.stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, info)) else None
    return {"registers": number(r"Used (\d+) registers"), "spill_store_bytes": number(r"(\d+) bytes spill stores"),
            "spill_load_bytes": number(r"(\d+) bytes spill loads"), "stack_bytes": number(r"(\d+) bytes stack frame"),
            "shared_bytes": kernel.metadata.shared, "layout_conversions": ttgir.count("ttg.convert_layout"),
            "warpgroup_mmas": ttgir.count("ttng.warp_group_dot"), "barriers": ptx.count("bar.sync"), **ptx_counts(ptx)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=None, help="cases to lower and compile (default all)")
    ap.add_argument("--triton-python", help="a Python interpreter with the triton package")
    ap.add_argument("--compile", nargs=3, metavar=("TTIR", "WARPS", "STAGES"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if args.compile:
        print(json.dumps(compile_ttir(args.compile[0], int(args.compile[1]), int(args.compile[2]))))
        return 0
    if not args.triton_python:
        ap.error("--triton-python is required (a Python with the triton package; see the module docstring)")
    try:
        has_triton = subprocess.run([args.triton_python, "-c", "import triton"], capture_output=True).returncode == 0
    except OSError as e:
        ap.error(f"--triton-python {args.triton_python}: {e.strerror}")
    if not has_triton:
        ap.error(f"--triton-python {args.triton_python} cannot import triton (pip install triton==3.6.0 there)")
    from benchmarks.common import environment, table, write

    names = args.cases or list(_cases())
    unknown = sorted(set(names) - set(_cases()))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {sorted(_cases())}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for record in lower(name, tmp):
                done = subprocess.run([args.triton_python, os.path.abspath(__file__), "--compile", record["ttir"],
                                       str(record["num_warps"]), str(record["num_stages"])],
                                      capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{name}/{record['kernel']}: compile failed: {done.stderr.strip()[-500:]}")
                record.update(json.loads(done.stdout.strip().splitlines()[-1]))
                del record["ttir"]
                rows.append(record)
                print(record, flush=True)
    path = write("triton_resources", {"benchmark": "triton_resources", "env": environment(), "target": "sm_90a",
                                      "rows": rows}, args.out)
    print(table(rows, ["case", "kernel", "num_warps", "num_stages", "registers", "spill_store_bytes",
                       "spill_load_bytes", "shared_bytes", "layout_conversions", "warpgroup_mmas", "barriers",
                       "ptx_instructions", "loop_instructions", "ex2"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
