"""KDA prefill of unequal prompts: packed in one row (`kda_varlen_pallas`) against padding them to the
longest (`kda_chunk_pallas` on [S, max_len]) and against fla's chunk_kda with cu_seqlens.

    python benchmarks/kda_varlen.py            # on the H200 (fla-core importable for its column)
    python benchmarks/kda_varlen.py --small    # CPU smoke run (interpret mode, tiny shapes)

bf16 q/k/v (L2-normalised first), fp32 log decay and beta, fp32 initial states, H = 32 heads of 128.
`tokens` = the real tokens; `padded_ms` runs max_len x S of them. err = relative error of the packed
outputs against the padded batch's real rows (each sequence computed alone).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import environment, median_time, table, write  # noqa: E402
from benchmarks.kda import fla_functions, l2, rel, torch_time  # noqa: E402
from pallas_kernels.kda import ChunkBlocks, kda_chunk_pallas, kda_varlen_pallas  # noqa: E402

CASES = {"8 x 256..2048": (8, 256, 2048), "16 x 64..4096": (16, 64, 4096), "64 x 64..512": (64, 64, 512)}


def lengths_for(seqs, lo, hi, rng):
    """Lengths uniform in [lo, hi], with one at hi (the longest sets the padded batch's width)."""
    lengths = rng.integers(lo, hi + 1, seqs)
    lengths[0] = hi
    return [int(n) for n in lengths]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-cases", type=int, default=1, help="fla on the first N cases (its autotune: ~90 s a shape)")
    args = ap.parse_args(argv)
    h, kd = (2, 16) if args.small else (32, 128)
    blocks = ChunkBlocks(chunk=16, value_block=16) if args.small else ChunkBlocks()
    cases = {"3 x 5..40": (3, 5, 40)} if args.small else CASES
    fla = None if (args.small or args.no_fla) else fla_functions()
    rng = np.random.default_rng(0)
    rows = []
    for case_index, (name, (seqs, lo, hi)) in enumerate(cases.items()):
        lengths = lengths_for(seqs, lo, hi, rng)
        t = sum(lengths)
        ks = jax.random.split(jax.random.key(seqs), 6)
        q, k, v = (jax.random.normal(kk, (1, t, h, kd), jnp.bfloat16) for kk in ks[:3])
        g = -jnp.exp(jax.random.normal(ks[3], (1, t, h, kd), jnp.float32) - 2.0)
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, t, h), jnp.float32))
        s0 = jax.random.normal(ks[5], (seqs, h, kd, kd), jnp.float32) * 0.1
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)

        packed = jax.jit(lambda q, k, v, g, beta, cu, s0: kda_varlen_pallas(l2(q), l2(k), v, g, beta, cu,
                                                                            initial_state=s0, blocks=blocks))
        o, s = packed(q, k, v, g, beta, cu, s0)
        t_packed, _ = median_time(lambda: packed(q, k, v, g, beta, cu, s0), iters=args.iters)

        # The padded batch: sequence i in row i, zeros (g = beta = 0: no-ops) after its end.
        width = max(lengths)
        idx = np.stack([np.minimum(np.asarray(cu[i]) + np.arange(width), t - 1) for i in range(seqs)])
        real = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
        pad = lambda x: jnp.where(jnp.asarray(real).reshape(seqs, width, *([1] * (x.ndim - 2))), x[0][idx], 0)
        batch = [pad(x) for x in (q, k, v, g, beta)]
        padded = jax.jit(lambda q, k, v, g, beta, s0: kda_chunk_pallas(l2(q), l2(k), v, g, beta, initial_state=s0,
                                                                       blocks=blocks))
        o_pad, s_pad = padded(*batch, s0)
        t_padded, _ = median_time(lambda: padded(*batch, s0), iters=args.iters)
        expect = np.concatenate([np.asarray(o_pad[i, :n], np.float32) for i, n in enumerate(lengths)])
        row = {"case": name, "S": seqs, "tokens": t, "padded_tokens": seqs * width, "packed_ms": t_packed * 1e3,
               "padded_ms": t_padded * 1e3, "speedup_vs_padded": t_padded / t_packed,
               "err_o": rel(np.asarray(o[0], np.float32), expect), "err_states": rel(s, s_pad)}
        if fla is not None and case_index < args.fla_cases:
            torch, chunk_kda, _ = fla
            tt = lambda x: torch.from_dlpack(x)
            tq, tk, tv, tg, tb, ts = (tt(x) for x in (q, k, v, g, beta, s0))
            tcu = torch.from_dlpack(cu).long()
            run = lambda: chunk_kda(tq, tk, tv, tg, tb, initial_state=ts, output_final_state=True, cu_seqlens=tcu,
                                    use_qk_l2norm_in_kernel=True)
            fo, _ = run()
            t_fla = torch_time(torch, run, iters=args.iters)
            row.update(fla_ms=t_fla * 1e3, speedup_vs_fla=t_fla / t_packed,
                       err_fla=rel(fo[0].float().cpu().numpy(), expect))
        rows.append(row)
        print({kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in row.items()}, flush=True)
    path = write("kda_varlen" + ("_small" if args.small else ""), {"benchmark": "kda_varlen", "env": environment(),
                                                                   "H": h, "K": kd, "rows": rows})
    print(table(rows, ["case", "tokens", "padded_tokens", "packed_ms", "padded_ms", "speedup_vs_padded", "fla_ms",
                       "speedup_vs_fla", "err_o", "err_states"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
