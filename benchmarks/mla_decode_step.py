"""The three launches of one absorbed MLA decode step at few rows: launch settings side by side.

    python benchmarks/mla_decode_step.py                          # on the H200: B=1, 192 and 4,096 slots
    python benchmarks/mla_decode_step.py --batch 1 8 --slots 192  # other shapes

A decode step of an MLA layer on the Hopper path is three launches (`k3jax.layers.mla_attention`):
W_UK folded into the queries (`absorb_query_pallas`), the attention kernel over the latent cache
(`mla_decode_hopper_splits`, split along the sequence) and W_UV applied with the splits merged
(`absorb_value_pallas`). At one row and a short cache all three are latency, not bytes: this times
each kernel alone (device time from a profiler trace) and the three as one call (20 calls unrolled
in one program) under each setting, one setting changed at a time from the defaults. The query launch
runs without the new latents (no norm program, no cache write), as `cache_attention` calls it. Kimi-Linear's
MLA shapes: 32 heads, nope 128, rope 64, value 128, latent 512; every row at full length. Outputs
are checked against the default setting's in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import chained_time, environment, table, write  # noqa: E402
from benchmarks.kernel_profile import kernel_times  # noqa: E402
from pallas_kernels.mla_absorb import AbsorbBlocks, absorb_query_pallas, absorb_value_pallas  # noqa: E402
from pallas_kernels.mla_decode.hopper import TILE_ROWS, HopperMLABlocks, mla_decode_hopper_splits  # noqa: E402

HEADS, NOPE, ROPE, V_DIM, LATENT = 32, 128, 64, 128, 512

# (label, attention settings, query settings, value settings), each one change from the defaults.
SETTINGS = [
    ("default", {}, {}, {}),
    ("min_split_blocks=2", {"min_split_blocks": 2}, {}, {}),
    ("splits=1", {"num_splits": 1}, {}, {}),
    ("stages=1", {"stages": 1}, {}, {}),
    ("query block_r=64", {}, {"block_r": 64}, {}),
    ("value block_k=64", {}, {}, {"block_k": 64}),
    ("value block_k=128", {}, {}, {"block_k": 128}),
    ("value block_k=256", {}, {}, {"block_k": 256}),
    ("value block_k=512", {}, {}, {"block_k": 512}),
    ("value block_v=16,k=512", {}, {}, {"block_v": 16, "block_k": 512}),
    ("value block_v=64,k=256", {}, {}, {"block_v": 64, "block_k": 256}),
]


def step_fn(att: HopperMLABlocks, qb: AbsorbBlocks, vb: AbsorbBlocks, *, batch: int, tokens: int):
    """(q [M, C], w_kv_b [R, H*(nope+v)], cache [B, S, R+P], lengths [B]) -> out [M, H, V] bf16."""
    scale = (NOPE + ROPE) ** -0.5

    def fn(q, w, cache, lengths):
        rows = absorb_query_pallas(q, w, heads=HEADS, tokens=tokens, nope=NOPE, rope=ROPE, v_dim=V_DIM,
                                   multiple=TILE_ROWS, out_dtype=cache.dtype, blocks=qb)
        o, lse = mla_decode_hopper_splits(rows.reshape(batch, -1, LATENT + ROPE), cache, lengths, heads=HEADS,
                                          sq=tokens, latent_dim=LATENT, scale=scale, blocks=att)
        return absorb_value_pallas(o, w, heads=HEADS, tokens=tokens, nope=NOPE, v_dim=V_DIM, lse=lse,
                                   out_dtype=jnp.bfloat16, blocks=vb)
    return fn


def kernel_row(times: dict[str, float]) -> dict:
    """The three kernels' device us (by launch name) and everything else summed."""
    pick = {"query_us": "mla_absorb_query", "attention_us": "mosaic", "value_us": "mla_absorb_value"}
    row, rest = {}, 0.0
    for name, us in times.items():
        key = next((k for k, frag in pick.items() if frag in name), None)
        if key is None:
            rest += us
        else:
            row[key] = row.get(key, 0.0) + us
    row["other_us"] = rest
    row["device_us"] = sum(times.values())
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1])
    ap.add_argument("--slots", nargs="+", type=int, default=[192, 4096], help="cache slots per row (all valid)")
    ap.add_argument("--tokens", type=int, default=1, help="query tokens per row")
    ap.add_argument("--only", nargs="*", default=None, help="labels of SETTINGS to run (default all)")
    ap.add_argument("--name", default="mla_decode_step")
    args = ap.parse_args(argv)
    settings = [s for s in SETTINGS if args.only is None or s[0] in args.only]
    rows = []
    for b in args.batch:
        for s in args.slots:
            ks = jax.random.split(jax.random.key(b * 7919 + s), 3)
            m = b * args.tokens
            q = jax.random.normal(ks[0], (m, HEADS * (NOPE + ROPE)), jnp.bfloat16)
            w = (jax.random.normal(ks[1], (LATENT, HEADS * (NOPE + V_DIM)), jnp.float32) * LATENT ** -0.5
                 ).astype(jnp.bfloat16)
            cache = jax.random.normal(ks[2], (b, s, LATENT + ROPE), jnp.bfloat16)
            lengths = jnp.full((b,), s, jnp.int32)
            operands = (q, w, cache, lengths)
            ref = None
            for label, att, qb, vb in settings:
                fn = step_fn(HopperMLABlocks(**att), AbsorbBlocks(**qb), AbsorbBlocks(**vb), batch=b,
                             tokens=args.tokens)
                try:
                    out = np.asarray(jax.jit(fn)(*operands).astype(jnp.float32))
                except Exception as e:  # noqa: BLE001 - a setting the compiler rejects is reported, not fatal
                    print(f"B={b} slots={s} {label}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                if ref is None:
                    ref = out
                err = float(np.max(np.abs(out - ref)) / (np.max(np.abs(ref)) + 1e-30))
                row = {"batch": b, "slots": s, "tokens": args.tokens, "setting": label,
                       "call_us": chained_time(fn, operands, unroll=True) * 1e6,
                       **kernel_row(kernel_times(fn, operands)), "rel_err_vs_default": err}
                rows.append(row)
                print(table([row], list(row)), flush=True)
                write(args.name, {"benchmark": "mla_decode_step", "env": environment(), "rows": rows, "partial": True})
    path = write(args.name, {"benchmark": "mla_decode_step", "env": environment(), "rows": rows,
                             "settings": [dict(label=l, attention=a, query=q, value=v) for l, a, q, v in settings]})
    print(table(rows, ["batch", "slots", "setting", "call_us", "device_us", "query_us", "attention_us", "value_us",
                       "other_us", "rel_err_vs_default"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
