"""K3-sized layers on one GPU, and from them a per-token estimate for the 93-layer model (issue 21).

    python benchmarks/k3_layers.py             # on the H200 (bf16, MXFP4 experts kept packed)
    python benchmarks/k3_layers.py --small     # CPU smoke run: tiny-k3 shapes, interpret-mode kernels
    python benchmarks/k3_layers.py --expert-layout columns   # packed experts for the Mosaic GPU kernel

Times, with random weights at K3's published shapes (`kimi_k3()`), the model's own layer modules:
  kda   one KDA mixer (96 heads x 128, K3's bounded gate and full-rank gates), its projections included;
  mla   one MLA mixer (96 heads, 512 + 64 latent, output gate) over a 4K-slot cache (`mla="hopper"`);
  moe   one latent-MoE block (router over 896 experts, the 2 shared experts at 7168, the latent down/up
        projections and norm) with 1/8, 1/16 or 1/32 of the routed experts local as under expert
        parallelism over 8, 16 or 32 GPUs: 112, 56 or 28 experts, each token routed to 16/8 = 2 or 1
        of them (top-k scaled the same way, at least 1: an upper bound at 1/32), MXFP4 kept packed;
at decode (B = 1, 16, 64 rows, one new token) and an 8K-token prefill (B = 1). Decode times are
per call with 20 calls chained in one compiled loop.

The estimate (`estimate`), stated so it can be checked: per decode step of B rows on N GPUs,
  attention layers are tensor-parallel over the 8 GPUs of a host (their weights split 8 ways, so a
  weight-bound decode takes measured / 8) plus one all-reduce of B x 7168 bf16 per layer;
  MoE layers are expert-parallel over all N GPUs (the 1/N share measured; 1/16 bounds 1/32 where that is missing)
  plus two all-to-alls per layer (dispatch and combine) of B x 16 x 7168 bf16;
  a collective costs ALPHA + bytes / BETA, ALPHA = 10 us within a host (NVLink), 25 us across
  hosts; BETA = 450 GB/s within a host, 50 GB/s per GPU across hosts (400 Gb/s InfiniBand).
For N = 16 and 32 (2 and 4 hosts), tokens/s per user = B / step time, compared with vLLM's published
K3 figure (118 tok/s per user).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import chained_time, environment, median_time, table, write  # noqa: E402
from k3jax.config import PACKED_LAYOUTS, kimi_k3, tiny_k3  # noqa: E402
from k3jax.layers.kda import KimiDeltaAttention  # noqa: E402
from k3jax.layers.mla import MultiHeadLatentAttention  # noqa: E402
from k3jax.layers.moe import MoE  # noqa: E402
from k3jax.state import KDAState, MLACache, SeqInfo  # noqa: E402

VLLM_K3_TOK_S_PER_USER = 118.0
ALPHA_HOST, ALPHA_NET = 10e-6, 25e-6
BETA_HOST, BETA_NET = 450e9, 50e9
GPUS_PER_HOST = 8


def _module(cls, cfg, dtype):
    return cls(cfg, dtype=dtype, rngs=nnx.Rngs(0))


def _local_moe(cfg, shards: int, layout: str = "rows"):
    """The routed experts one of `shards` expert-parallel GPUs holds, top-k scaled alike, packed in
    `layout` (k3jax.config.PACKED_LAYOUTS)."""
    moe = cfg.moe
    return dataclasses.replace(moe, num_experts=moe.num_experts // shards, packed_experts=True, packed_layout=layout,
                               num_experts_per_token=max(1, moe.num_experts_per_token // shards),
                               num_expert_group=1, topk_group=1)


def _time_layer(module, x, args=(), kwargs=None, *, reps: int, iters: int) -> float:
    """Seconds per call of module(x, *args, **kwargs); weights, state and inputs are arguments of the
    compiled function (never captured as constants); with reps > 1 the calls are chained in one loop."""
    graphdef, params = nnx.split(module)
    kwargs = kwargs or {}

    def fn(x, params, *args):
        out = nnx.merge(graphdef, params)(x, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    if reps > 1:
        return chained_time(fn, (x, params, *args), reps=reps, iters=iters)
    jitted = jax.jit(fn)
    t, _ = median_time(lambda: jitted(x, params, *args), iters=iters)
    return t


def measure(cfg, batches, prefill_tokens: int, context: int, dtype, reps: int, iters: int,
            layout: str = "rows") -> list[dict]:
    rows = []
    d = cfg.hidden_size
    kda = _module(KimiDeltaAttention, cfg.kda, dtype)
    mla = _module(MultiHeadLatentAttention, cfg.mla, dtype)
    moes = {shards: _module(MoE, _local_moe(cfg, shards, layout), dtype) for shards in (8, 16, 32)
            if cfg.moe.num_experts % shards == 0}
    x_of = lambda b, t: jax.random.normal(jax.random.key(b + t), (b, t, d), dtype)
    for b in batches:
        seq = SeqInfo.make(jnp.ones((b, 1), bool), jnp.full((b,), context - 1, jnp.int32))
        k = cfg.kda
        kda_state = KDAState(conv=jnp.zeros((b, k.conv_size - 1, 3 * k.proj_size), dtype),
                             recurrent=jnp.zeros((b, k.num_heads, k.head_dim, k.head_dim), jnp.float32))
        cache = MLACache(latent=jax.random.normal(jax.random.key(1), (b, context, cfg.mla.latent_size), dtype))
        row = {"phase": "decode", "B": b}
        timed = lambda module, *args, **kw: _time_layer(module, x_of(b, 1), args, kw, reps=reps, iters=iters) * 1e3
        row["kda_ms"] = timed(kda, seq, kda_state, fresh=False)
        row["mla_ms"] = timed(mla, seq, cache, fresh=False)
        for shards, moe in moes.items():
            row[f"moe_1_{shards}_ms"] = timed(moe)
        rows.append(row)
        print(row, flush=True)
    t = prefill_tokens
    seq = SeqInfo.make(jnp.ones((1, t), bool))
    row = {"phase": f"prefill {t}", "B": 1}
    timed = lambda module, *args, **kw: _time_layer(module, x_of(1, t), args, kw, reps=1,
                                                     iters=max(2, iters // 4)) * 1e3
    row["kda_ms"] = timed(kda, seq, None, fresh=True)
    row["mla_ms"] = timed(mla, seq, None, fresh=True)
    for shards, moe in moes.items():
        row[f"moe_1_{shards}_ms"] = timed(moe)
    rows.append(row)
    print(row, flush=True)
    return rows


def _collective(nbytes: float, gpus: int) -> float:
    if gpus <= GPUS_PER_HOST:
        return ALPHA_HOST + nbytes / BETA_HOST
    return ALPHA_NET + nbytes / BETA_NET


def estimate(rows: list[dict], cfg) -> list[dict]:
    """Per-token decode time of the full model from the layer rows (see the module docstring)."""
    n_kda, n_mla, n_moe = cfg.mixers.count("kda"), cfg.mixers.count("mla"), cfg.ffns.count("moe")
    d, top_k = cfg.hidden_size, cfg.moe.num_experts_per_token
    out = []
    for row in (r for r in rows if r["phase"] == "decode"):
        b = row["B"]
        for gpus in (16, 32):
            # Each GPU holds 1/gpus of the experts; without that measurement the 1/16 one (more local
            # experts) bounds it from above.
            shards = gpus if f"moe_1_{gpus}_ms" in row else 16
            key = f"moe_1_{shards}_ms"
            if key not in row:
                continue
            attn = (n_kda * row["kda_ms"] + n_mla * row["mla_ms"]) / 1e3 / GPUS_PER_HOST
            attn_comm = (n_kda + n_mla) * _collective(b * d * 2, GPUS_PER_HOST)
            moe = n_moe * row[key] / 1e3
            moe_comm = n_moe * 2 * _collective(b * top_k * d * 2, gpus)
            step = attn + attn_comm + moe + moe_comm
            out.append({"B": b, "GPUs": gpus, "moe_share": f"1/{shards}", "attention_ms": attn * 1e3,
                        "attention_comm_ms": attn_comm * 1e3, "moe_ms": moe * 1e3, "all_to_all_ms": moe_comm * 1e3,
                        "step_ms": step * 1e3, "tok_s_per_user": 1 / step,
                        "vs_vllm_118": 1 / step / VLLM_K3_TOK_S_PER_USER})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--expert-layout", choices=PACKED_LAYOUTS, default="rows",
                    help="packed experts' layout: rows (Pallas-Triton kernels), columns (the Mosaic GPU kernel) or "
                         "handoff (the same with its GLU hand-off)")
    args = ap.parse_args(argv)
    if args.small:
        cfg = tiny_k3()
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, num_experts=16, num_experts_per_token=4))
        rows = measure(cfg, [1, 2], 64, 128, jnp.float32, reps=2, iters=2, layout=args.expert_layout)
    else:
        cfg = kimi_k3().with_impls(kda="pallas", kda_decode="pallas", mla="hopper", moe="auto")
        rows = measure(cfg, [1, 16, 64], 8192, 4096, jnp.bfloat16, reps=20, iters=args.iters,
                       layout=args.expert_layout)
    est = estimate(rows, cfg)
    record = {"benchmark": "k3_layers", "env": environment(), "expert_layout": args.expert_layout, "rows": rows,
              "estimate": est,
              "cost_model": {"alpha_host_s": ALPHA_HOST, "alpha_net_s": ALPHA_NET, "beta_host_B_s": BETA_HOST,
                             "beta_net_B_s": BETA_NET, "gpus_per_host": GPUS_PER_HOST}}
    layout = "" if args.expert_layout == "rows" else "_" + args.expert_layout
    path = write("k3_layers" + layout + ("_small" if args.small else ""), record)
    print(table(rows, list(rows[0])))
    print(table(est, list(est[0]) if est else ["B"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
