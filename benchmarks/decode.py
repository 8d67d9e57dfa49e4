"""End-to-end decode benchmark: TPOT, throughput and MBU of the compiled generate loop, optionally
with a profile of one decode step summarised by category and prefill (TTFT) rows.

    python benchmarks/decode.py --model tiny-kimi-linear --batch 1 4                 # CPU smoke run
    python benchmarks/decode.py --model kimi-linear-48b --batch 1 64 --dtype bfloat16 --kernels pallas \
        --moe auto --profile --prefill 1x8192 64x1024                                  # on the H200
    python benchmarks/decode.py ... --batch 1 --variants loop_unroll=1 --interleave 10   # A/B in alternating rounds
    python benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas --moe auto \
        --packed-experts columns --batch 1 64                                          # fits an 80 GB H100

kimi-linear-48b is the released Kimi-Linear-48B-A3B shape with random weights (about 98 GB in bf16, 29 GB with the
routed experts packed as MXFP4; initialised with the fast `unsafe_rbg` generator). TPOT = decode time / (generated
steps - 1) (the first token comes with the prefill; median over repeats after a compiling warm-up). MBU follows
performance.md §5.1-5.2: bytes that must move per step = weights touched (non-routed + experts touched,
uniform-routing estimate; packed experts at their bytes) + KDA state read+write + MLA latent cache read, over TPOT,
against 4.3 TB/s.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hlo_dump import request_hlo_dump  # noqa: E402

# Only when run as the script: a benchmark importing this one sets its own dump.
_DUMP = request_hlo_dump("hlo_dump", ".*decode_chunk.*") if __name__ == "__main__" and "--profile" in sys.argv else None

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import k3jax  # noqa: E402
from k3jax.layers.moe import is_routed_expert_param  # noqa: E402
from k3jax.sharding import MeshSpec, make_mesh  # noqa: E402
from benchmarks.common import HBM_ACHIEVABLE, HBM_DATASHEET, environment, table, write  # noqa: E402
from benchmarks.profile_summary import markdown, summarize  # noqa: E402
from k3jax.config import kimi_linear_48b_a3b  # noqa: E402
from k3jax.layers.moe import Router  # noqa: E402
from k3jax.model import abstract_model  # noqa: E402


def step_bytes(cfg, batch: int, ctx: int, dtype_bytes: int, touched: float | None = None) -> dict:
    """Bytes that must move in one decode step (performance.md §5.1); `touched` distinct experts
    per layer (default: the uniform-routing expectation)."""
    counts = {"routed": 0, "other": 0}      # bytes: the model dtype's, or one each for packed (MXFP4) experts
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(cfg, np.float32))):
        value = var.get_value()
        n = int(np.prod(value.shape)) * (1 if value.dtype == np.uint8 else dtype_bytes)
        if "embed_tokens" in path:
            n = batch * cfg.hidden_size * dtype_bytes  # a lookup reads only the rows of this step's tokens
        counts["routed" if is_routed_expert_param(path) else "other"] += n
    moe = cfg.moe
    layers_moe = cfg.ffns.count("moe")
    per_expert = counts["routed"] / max(1, layers_moe * moe.num_experts)
    if touched is None:
        touched = moe.num_experts * (1 - (1 - moe.num_experts_per_token / moe.num_experts) ** batch)
    weights = counts["other"] + layers_moe * touched * per_expert
    n_kda, n_mla = cfg.mixers.count("kda"), cfg.mixers.count("mla")
    kda_state = batch * 2 * n_kda * cfg.kda.num_heads * cfg.kda.head_dim ** 2 * 4
    mla_kv = batch * ctx * n_mla * cfg.mla.latent_size * dtype_bytes
    return {"weights": weights, "kda_state": kda_state, "mla_kv": mla_kv, "experts_touched": touched,
            "total": weights + kda_state + mla_kv}


def add_model_arguments(ap: argparse.ArgumentParser, default: str) -> None:
    """The options `build` reads: --model and `add_build_arguments`."""
    ap.add_argument("--model", default=default, help="tiny-k3, tiny-k3-random, tiny-kimi-linear or kimi-linear-48b")
    add_build_arguments(ap)


def add_build_arguments(ap: argparse.ArgumentParser) -> None:
    """The options `build` reads besides --model: --dtype, --moe, --gmm, --linear, --kernels, --packed-experts."""
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--moe", default=None, help="routed-expert implementation (k3jax option 'moe')")
    ap.add_argument("--gmm", default=None, help="grouped matmul implementation (k3jax option 'gmm')")
    ap.add_argument("--linear", default=None, help="few-row projection implementation (k3jax option 'linear')")
    ap.add_argument("--norm", default=None, help="RMSNorm / residual-add implementation (k3jax option 'norm')")
    ap.add_argument("--shared", default=None, help="shared-expert path (k3jax option 'shared')")
    ap.add_argument("--mla-absorb", default=None, help="MLA W_UK/W_UV few-row kernels (k3jax option 'mla_absorb')")
    ap.add_argument("--packed-experts", default=None, choices=["rows", "columns", "handoff"],
                    help="kimi-linear-48b: routed experts kept as MXFP4 on the device in this layout (random codes; "
                         "'columns': the Mosaic GPU kernel, which gmm auto picks on a GPU; 'handoff': with its GLU "
                         "hand-off above 8 tokens): 25 GB of experts, not 94")
    ap.add_argument("--kernels", choices=["xla", "pallas"], default="xla",
                    help="pallas: KDA prefill and decode and MLA decode through the Pallas kernels")
    ap.add_argument("--mesh", default=None, help="run sharded over this many local devices, e.g. expert=2 or data=2 "
                                                 "(k3jax.sharding.MeshSpec.parse)")
    ap.add_argument("--ep-dispatch", default=None, choices=["gather", "ragged"],
                    help="expert-parallel token dispatch (k3jax option 'ep_dispatch')")
    ap.add_argument("--kda-decode", default=None, choices=["xla", "pallas", "hopper"],
                    help="KDA one-token step (k3jax option 'kda_decode'; with --kernels pallas the default is pallas, "
                         "hopper the Mosaic GPU state pass)")
    ap.add_argument("--mla", default=None, choices=["absorbed", "naive", "pallas", "hopper"],
                    help="MLA decode implementation (k3jax option 'mla'; with --kernels pallas the default is hopper, "
                         "the Mosaic GPU kernel)")


def build(args) -> k3jax.CausalLM:
    impls = {"ep_dispatch": getattr(args, "ep_dispatch", None), "mla": args.mla, "moe": args.moe, "gmm": args.gmm,
             "linear": args.linear, "mla_prefill": getattr(args, "mla_prefill", None), "norm": args.norm,
             "shared": args.shared, "mla_absorb": args.mla_absorb, "kda_decode": getattr(args, "kda_decode", None)}
    if args.kernels == "pallas":
        impls.update(kda="pallas", kda_decode=getattr(args, "kda_decode", None) or "pallas",
                     mla=getattr(args, "mla", None) or "hopper")
    packed = getattr(args, "packed_experts", None)
    if args.model == "kimi-linear-48b":
        jax.config.update("jax_default_prng_impl", "unsafe_rbg")  # random weights at memory speed
        t0 = time.perf_counter()
        mesh = make_mesh(MeshSpec.parse(args.mesh)) if getattr(args, "mesh", None) else None
        cfg = kimi_linear_48b_a3b()
        if packed:
            cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, packed_experts=True, packed_layout=packed))
        model = k3jax.CausalLM.random(cfg.with_impls(**impls), seed=0, dtype=args.dtype, mesh=mesh)
        jax.block_until_ready(model.params)
        print(f"built random weights in {time.perf_counter() - t0:.1f} s", flush=True)
        return model
    if packed:
        raise SystemExit(f"--packed-experts: random kimi-linear-48b weights only; for {args.model!r} load an MXFP4 "
                         "checkpoint with packed experts")
    model = k3jax.load_model(args.model, dtype=args.dtype).with_impls(**impls)
    return model.shard(make_mesh(MeshSpec.parse(args.mesh))) if getattr(args, "mesh", None) else model


def touched_experts(model, prompts: list, outputs: list) -> float:
    """Distinct experts per MoE layer per decode step, measured: the router's choices over a full
    forward of the generated sequences (position t of the B rows is what one decode step routes;
    prefill + decode equals the longer prefill), averaged over decode positions and layers."""
    records = []
    original = Router.__call__

    def recording(self, x_ND):
        weights, experts = original(self, x_ND)
        jax.debug.callback(lambda e: records.append(np.asarray(e)), experts)
        return weights, experts

    seqs = np.array([p + o for p, o in zip(prompts, outputs)])
    Router.__call__ = recording
    try:
        with model.placement.context():     # under the model's mesh when it is sharded
            jax.block_until_ready(model.steps.logits(model.params, jnp.asarray(seqs), jnp.ones(seqs.shape, bool)))
    finally:
        Router.__call__ = original
    jax.effects_barrier()
    b, t = seqs.shape
    first = len(prompts[0])
    counts = [len(np.unique(e.reshape(b, t, -1)[:, pos])) for e in records for pos in range(first, t)]
    return float(np.mean(counts))


def warmed_generator(model, batch: int, prompt_len: int, new_tokens: int):
    """(Generator, prompts, SamplingParams) for `batch` random prompts of `prompt_len` tokens and
    `new_tokens` new ones (eos ignored), after one compiling generate call (its time printed)."""
    prompts = np.random.default_rng(0).integers(3, model.config.vocab_size - 300, (batch, prompt_len)).tolist()
    gen = k3jax.Generator(model)
    sp = k3jax.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    gen.generate(prompts, sp)
    print(f"first call {time.perf_counter() - t0:.1f} s", flush=True)
    return gen, prompts, sp


def parse_variant(spec: str) -> tuple[str, dict]:
    """"shared=auto,norm=fused" -> (the spec, {"shared": "auto", "norm": "fused"}), names checked."""
    impls = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"--variants: expected opt=value[,opt=value...], got {spec!r}")
        impls[name.strip()] = value.strip()
    kimi_linear_48b_a3b().with_impls(**impls)   # unknown option names raise here
    return spec, impls


def decode_row(gen, cfg, b, args, dtype_bytes, rng, tag: str = "") -> dict:
    prompts = rng.integers(3, cfg.vocab_size - 300, (b, args.prompt_len)).tolist()
    sp = k3jax.SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = gen.generate(prompts, sp)  # compiles prefill and the decode chunk
    first_s = time.perf_counter() - t0
    tpots, prefills, walls = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = gen.generate(prompts, sp)
        walls.append(time.perf_counter() - t0)
        tpots.append(out.timings.tpot_s)   # the first token comes with the prefill
        prefills.append(out.timings.prefill_s)
    tpot = statistics.median(tpots)
    moved = step_bytes(cfg, b, args.prompt_len + args.new_tokens // 2, dtype_bytes)
    if b > 1:  # bytes from the experts really touched (random routing is far from uniform)
        measured = touched_experts(gen.model, prompts, [r.token_ids for r in out])
        moved = step_bytes(cfg, b, args.prompt_len + args.new_tokens // 2, dtype_bytes, touched=measured)
        print(f"batch {b}: {measured:.1f} distinct experts per layer per step (uniform routing: "
              f"{step_bytes(cfg, b, 0, dtype_bytes)['experts_touched']:.1f})", flush=True)
    row = {"batch": b, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "tpot_ms": tpot * 1e3,
           "tok_per_s": b / tpot, "prefill_ms": statistics.median(prefills) * 1e3,
           "first_call_s": first_s, "compile_s_est": first_s - statistics.median(walls),
           "bytes_per_step_gb": moved["total"] / 1e9, "experts_touched": moved["experts_touched"],
           "floor_ms": moved["total"] / HBM_ACHIEVABLE * 1e3, "ratio_to_floor": tpot / (moved["total"] / HBM_ACHIEVABLE),
           "mbu_achievable": moved["total"] / tpot / HBM_ACHIEVABLE, "mbu_datasheet": moved["total"] / tpot / HBM_DATASHEET,
           "tpot_all_ms": [t * 1e3 for t in tpots], "first_tokens": first[0].token_ids[:8]}
    print(f"{tag + ' ' if tag else ''}batch {b}: TPOT {tpot * 1e3:.2f} ms, {b / tpot:.1f} tok/s, "
          f"MBU {row['mbu_achievable']:.1%}, first call {first_s:.1f} s", flush=True)
    if args.profile:
        suffix = "_" + tag.replace("=", "-").replace(",", "_") if tag else ""
        row["profile"] = profile(gen, prompts, f"b{b}{suffix}")
    return row


def interleaved_rows(gens, cfg, b, args, rng) -> list[dict]:
    """`args.interleave` rounds of one timed generate call per option set on the same prompts, in
    turn (forward, then backward: A B B A ...), so the sets share the machine's drift; per set the
    median TPOT over the rounds. gens: (label, Generator) with label "" for the base options."""
    prompts = rng.integers(3, cfg.vocab_size - 300, (b, args.prompt_len)).tolist()
    sp = k3jax.SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    tpots = {label: [] for label, _ in gens}
    for r in range(args.interleave):
        for label, g in (gens if r % 2 == 0 else gens[::-1]):
            tpots[label].append(g.generate(prompts, sp).timings.tpot_s)
    rows = []
    for label, ts in tpots.items():
        tpot = statistics.median(ts)
        rows.append({**({"variant": label} if label else {}), "batch": b, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "interleaved_rounds": args.interleave, "tpot_ms": tpot * 1e3,
                     "tok_per_s": b / tpot, "tpot_all_ms": [t * 1e3 for t in ts]})
        print(f"interleaved {label or 'base'} batch {b}: TPOT {tpot * 1e3:.3f} ms "
              f"(min {min(ts) * 1e3:.3f}, max {max(ts) * 1e3:.3f} over {len(ts)})", flush=True)
    return rows


def profile(gen, prompts, tag: str) -> dict:
    """One generate call of 16 decode steps (one chunk) under the profiler -> category summary."""
    out_dir = os.environ.get("OUT", "/tmp")
    trace_dir = os.path.join(out_dir, f"trace_{tag}")
    shutil.rmtree(trace_dir, ignore_errors=True)
    sp = k3jax.SamplingParams(max_new_tokens=16, ignore_eos=True)
    gen.generate(prompts, sp)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        out = gen.generate(prompts, sp)
    try:  # the first token comes with the prefill; each later one costs one model forward in the loop
        summary = summarize(trace_dir, _DUMP, "decode_chunk", out.timings.steps - 1)
    except Exception as e:  # noqa: BLE001 - a profile that cannot be read must not lose the timings
        print(f"profile {tag}: could not summarise ({type(e).__name__}: {e})", flush=True)
        return {"error": str(e)}
    print(f"profile {tag}:\n{markdown(summary)}", flush=True)
    return summary


def prefill_row(gen, cfg, spec: str, rng) -> dict:
    b, t = (int(x) for x in spec.split("x"))
    prompts = rng.integers(3, cfg.vocab_size - 300, (b, t)).tolist()
    sp = k3jax.SamplingParams(max_new_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    try:
        gen.generate(prompts, sp)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it, keep the other rows
        print(f"prefill {b}x{t}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
        return {"batch": b, "prompt_len": t, "prefill_ms": f"failed: {type(e).__name__}: {str(e)[:200]}"}
    first_s = time.perf_counter() - t0
    times = [gen.generate(prompts, sp).timings.prefill_s for _ in range(3)]
    row = {"batch": b, "prompt_len": t, "prefill_ms": statistics.median(times) * 1e3, "first_call_s": first_s,
           "tok_per_s": b * t / statistics.median(times)}
    print(f"prefill {b}x{t}: {row['prefill_ms']:.1f} ms ({row['tok_per_s']:.0f} tok/s), first call {first_s:.1f} s",
          flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, default="tiny-kimi-linear")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="profile 16 decode steps per batch size")
    ap.add_argument("--prefill", nargs="*", default=[], help="prefill rows as BxT, e.g. 1x8192 64x1024")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="more option sets timed on the same weights after the base one, each as "
                         "opt=value[,opt=value...], e.g. shared=auto,mla_absorb=pallas norm=fused")
    ap.add_argument("--interleave", type=int, default=0, metavar="R",
                    help="with --variants: then R rounds of one timed call per option set in turn on the same "
                         "prompts (rows marked interleaved_rounds), so the sets are compared without the order "
                         "in which they were timed")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variants]   # bad option names fail before the weights are built

    model = build(args)
    cfg = model.config
    gen = k3jax.Generator(model)
    rng = np.random.default_rng(0)
    dtype_bytes = 2 if args.dtype == "bfloat16" else 4
    packed = f"_packed-{args.packed_experts}" if args.packed_experts else ""
    name = args.name or f"decode_{args.model}_{args.dtype}_{args.kernels}_{cfg.moe.impl}{packed}"
    rows = []
    for b in args.batch:   # written after every row, so a run cut short keeps what it measured
        rows.append(decode_row(gen, cfg, b, args, dtype_bytes, rng))
        write(name, {"benchmark": "decode", "env": environment(), "rows": rows, "partial": True})
    kept = [("", gen)]
    for label, impls in variants:
        if _DUMP:   # the summary maps kernels to scopes through this variant's own HLO
            for old in glob.glob(os.path.join(_DUMP, "*.txt")):
                os.remove(old)
        vgen = k3jax.Generator(model.with_impls(**impls))
        for b in args.batch:
            rows.append({"variant": label, **decode_row(vgen, cfg, b, args, dtype_bytes, rng, tag=label)})
            write(name, {"benchmark": "decode", "env": environment(), "rows": rows, "partial": True})
        if args.interleave:
            kept.append((label, vgen))   # compiled already: the rounds below reuse it
        del vgen
    for b in args.batch if args.interleave and len(kept) > 1 else ():
        rows.extend(interleaved_rows(kept, cfg, b, args, rng))
        write(name, {"benchmark": "decode", "env": environment(), "rows": rows, "partial": True})
    del kept
    pre = [prefill_row(gen, cfg, spec, rng) for spec in args.prefill]
    record = {"benchmark": "decode", "model": args.model, "dtype": args.dtype, "moe_impl": cfg.moe.impl,
              "gmm_impl": cfg.moe.gmm_impl, "kda_impl": cfg.kda.impl, "kda_decode_impl": cfg.kda.decode_impl,
              "mla_impl": cfg.mla.decode_impl, "linear_impl": cfg.linear_impl, "norm_impl": cfg.norm_impl,
              "shared_impl": cfg.moe.shared_impl,
              "packed_experts": cfg.moe.packed_layout if cfg.moe.packed_experts else None,
              "env": environment(), "rows": rows, "prefill": pre}
    path = write(name, record)
    print(table(rows, ["variant", "batch", "prompt_len", "tpot_ms", "tok_per_s", "floor_ms", "ratio_to_floor", "mbu_achievable",
                       "prefill_ms", "first_call_s"] + (["interleaved_rounds"] if args.interleave else [])))
    if pre:
        print(table(pre, ["batch", "prompt_len", "prefill_ms", "tok_per_s", "first_call_s"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
