"""MLA prefill attention (a fresh prompt over itself): naive against two blockwise forms.

    python benchmarks/mla_prefill.py                         # tiny config, T = 4096, on the CPU
    python benchmarks/mla_prefill.py --shape 48b --tokens 8192 --dtype bfloat16 --forms naive,cudnn,flash  # H200

Forms: "naive" (the reference, [B, H, T, T] scores), "cudnn" (cuDNN's fused flash attention, the GPU
choice of "auto"; NVIDIA GPUs and 16-bit inputs only), "flash" (per-head keys and values expanded
once, blockwise online softmax in JAX: the choice elsewhere) and "flash_absorbed" (W_UK folded
into the query, MQA over the R + P latents, W_UV after; the same blockwise loop). Reports the compiled
temporary memory (XLA's memory analysis) and the median time of each.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import environment, median_time, table, write  # noqa: E402
from k3jax.layers.flash_attention import flash_attention  # noqa: E402
from k3jax.layers.mla_attention import attention_flash, prefill_attention, split_kv_b  # noqa: E402

# (heads, nope, rope, kv_lora_rank, v_head_dim)
SHAPES = {"tiny": (4, 16, 8, 16, 16), "48b": (32, 128, 64, 512, 128)}


def attention_flash_absorbed(q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, valid_BT, *, scale, v_dim, block_q,
                             block_k):
    """The absorbed alternative: queries in the latent space, keys and values the shared latents."""
    h, n = q_nope_BTHN.shape[2:]
    r = w_kv_b.shape[0]
    w_uk, w_uv = split_kv_b(w_kv_b, h, n, v_dim)
    q_lat = jnp.einsum("bthn,rhn->bthr", q_nope_BTHN, w_uk, preferred_element_type=jnp.float32)
    c_kv = latent_BTL[..., :r].astype(jnp.float32)
    lat = flash_attention((q_lat, q_pe_BTHP), (c_kv, latent_BTL[..., r:]), c_kv, valid_BT, scale=scale,
                          block_q=block_q, block_k=block_k)
    return jnp.einsum("bthr,rhv->bthv", lat, w_uv.astype(jnp.float32)).astype(latent_BTL.dtype)


def forms(block: int) -> dict:
    blocks = dict(block_q=block, block_k=block)
    return {"naive": lambda *a, **kw: prefill_attention("naive", *a, **kw),
            "cudnn": lambda *a, **kw: prefill_attention("cudnn", *a, **kw),
            "flash": lambda *a, **kw: attention_flash(*a, **kw, **blocks),
            "flash_absorbed": lambda *a, **kw: attention_flash_absorbed(*a, **kw, **blocks)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="tiny")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--forms", default="naive,flash,flash_absorbed")
    args = ap.parse_args(argv)
    h, n, p, r, v = SHAPES[args.shape]
    b, t, dtype = args.batch, args.tokens, jnp.dtype(args.dtype)
    ks = jax.random.split(jax.random.key(0), 4)
    q_nope = jax.random.normal(ks[0], (b, t, h, n), dtype)
    q_pe = jax.random.normal(ks[1], (b, t, h, p), dtype)
    latent = jax.random.normal(ks[2], (b, t, r + p), dtype)
    w_kv_b = (jax.random.normal(ks[3], (r, h * (n + v)), jnp.float32) / r ** 0.5).astype(dtype)
    valid = jnp.ones((b, t), bool)
    kw = dict(scale=(n + p) ** -0.5, v_dim=v)
    rows, outs = [], {}
    for name, fn in forms(args.block).items():
        if name not in args.forms.split(","):
            continue
        jitted = jax.jit(lambda *a, fn=fn: fn(*a, **kw))
        mem = jitted.lower(q_nope, q_pe, latent, w_kv_b, valid).compile().memory_analysis()
        sec, _ = median_time(lambda: jitted(q_nope, q_pe, latent, w_kv_b, valid), warmup=1, iters=args.iters)
        outs[name] = jitted(q_nope, q_pe, latent, w_kv_b, valid)
        rows.append({"form": name, "temp_MiB": mem.temp_size_in_bytes / 2 ** 20, "ms": sec * 1e3})
        print(rows[-1], flush=True)
    first = next(iter(outs.values()))
    for row in rows:
        diff = outs[row["form"]].astype(jnp.float32) - first.astype(jnp.float32)
        row["rel_err"] = float(jnp.linalg.norm(diff) / jnp.linalg.norm(first.astype(jnp.float32)))
    print(table(rows, ["form", "temp_MiB", "ms", "rel_err"]))
    write(f"mla_prefill_{args.shape}_{b}x{t}", {"args": vars(args), "env": environment(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
