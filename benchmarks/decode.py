"""End-to-end decode benchmark: TPOT, throughput and MBU of the compiled generate loop.

    python benchmarks/decode.py --model tiny-kimi-linear --batch 1 4                 # CPU smoke run
    python benchmarks/decode.py --model kimi-linear-48b --batch 1 64 --dtype bfloat16  # H200 baseline

kimi-linear-48b is the released Kimi-Linear-48B-A3B shape with random weights (about 98 GB in
bf16). TPOT = decode loop time / generated steps (median over repeats after a compiling warm-up).
MBU follows performance.md §5.1-5.2: bytes that must move per step = weights touched (non-routed
+ experts touched, uniform-routing estimate) + KDA state read+write + MLA latent cache read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from benchmarks.common import HBM_ACHIEVABLE, HBM_DATASHEET, environment, table, write  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.config import kimi_linear_48b_a3b  # noqa: E402
from k3jax.model import abstract_model  # noqa: E402


def step_bytes(cfg, batch: int, ctx: int, dtype_bytes: int) -> dict:
    """Bytes that must move in one decode step (performance.md §5.1)."""
    abstract = abstract_model(cfg, np.float32)
    counts = {"routed": 0, "other": 0}
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        n = int(np.prod(var.get_value().shape))
        if "embed_tokens" in path:
            n = batch * cfg.hidden_size  # a lookup reads only the rows of this step's tokens
        counts["routed" if "experts" in path and path[-1] in ("w1", "w2", "w3") else "other"] += n
    moe = cfg.moe
    layers_moe = cfg.ffns.count("moe")
    per_expert = counts["routed"] / max(1, layers_moe * moe.num_experts)
    touched = moe.num_experts * (1 - (1 - moe.num_experts_per_token / moe.num_experts) ** batch)
    weights = dtype_bytes * (counts["other"] + layers_moe * touched * per_expert)
    n_kda, n_mla = cfg.mixers.count("kda"), cfg.mixers.count("mla")
    kda_state = batch * 2 * n_kda * cfg.kda.num_heads * cfg.kda.head_dim ** 2 * 4
    mla_kv = batch * ctx * n_mla * cfg.mla.latent_size * dtype_bytes
    return {"weights": weights, "kda_state": kda_state, "mla_kv": mla_kv, "experts_touched": touched,
            "total": weights + kda_state + mla_kv}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-kimi-linear", help="tiny-k3, tiny-kimi-linear or kimi-linear-48b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--moe-impl", default=None, choices=["ragged", "gather", "dense", "auto"])
    ap.add_argument("--kernels", choices=["reference", "pallas"], default="reference",
                    help="pallas: KDA prefill and decode and MLA decode through the Pallas kernels")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)

    impls = {"moe": args.moe_impl}
    if args.kernels == "pallas":
        impls.update(kda="pallas", kda_decode="pallas", mla="pallas")
    if args.model == "kimi-linear-48b":
        model = k3jax.CausalLM.random(kimi_linear_48b_a3b().with_impls(**impls), seed=0, dtype=args.dtype)
    else:
        model = k3jax.load_model(args.model, dtype=args.dtype).with_impls(**impls)
    cfg = model.config
    gen = k3jax.Generator(model)
    rng = np.random.default_rng(0)
    dtype_bytes = 2 if args.dtype == "bfloat16" else 4
    rows = []
    for b in args.batch:
        prompts = rng.integers(3, cfg.vocab_size - 300, (b, args.prompt_len)).tolist()
        sp = k3jax.SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        gen.generate(prompts, sp)  # compile
        tpots, prefills = [], []
        for _ in range(args.repeats):
            out = gen.generate(prompts, sp)
            tpots.append(out.timings.decode_s / out.timings.steps)
            prefills.append(out.timings.prefill_s)
        tpot = statistics.median(tpots)
        ctx = args.prompt_len + args.new_tokens // 2
        moved = step_bytes(cfg, b, ctx, dtype_bytes)
        rows.append({"batch": b, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "tpot_ms": tpot * 1e3, "tok_per_s": b / tpot, "prefill_ms": statistics.median(prefills) * 1e3,
                     "bytes_per_step_gb": moved["total"] / 1e9, "experts_touched": moved["experts_touched"],
                     "floor_ms": moved["total"] / HBM_ACHIEVABLE * 1e3,
                     "mbu_achievable": moved["total"] / tpot / HBM_ACHIEVABLE,
                     "mbu_datasheet": moved["total"] / tpot / HBM_DATASHEET,
                     "tpot_all_ms": [t * 1e3 for t in tpots]})
        print(f"batch {b}: TPOT {tpot * 1e3:.2f} ms, {b / tpot:.1f} tok/s, MBU {rows[-1]['mbu_achievable']:.1%}",
              flush=True)
    record = {"benchmark": "decode", "model": args.model, "dtype": args.dtype, "moe_impl": cfg.moe.impl,
              "kda_impl": cfg.kda.impl, "kda_decode_impl": cfg.kda.decode_impl, "mla_impl": cfg.mla.decode_impl,
              "env": environment(), "rows": rows}
    path = write(args.name or f"decode_{args.model}_{args.dtype}_{args.kernels}_{cfg.moe.impl}", record)
    print(table(rows, ["batch", "prompt_len", "new_tokens", "tpot_ms", "tok_per_s", "prefill_ms",
                       "bytes_per_step_gb", "floor_ms", "mbu_achievable"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
