"""Accuracy of a bf16 KDA recurrent state against the fp32 state over long decodes (issue 16).

    python benchmarks/kda_state_dtype.py            # CPU: ~2 minutes
    python benchmarks/kda_state_dtype.py --steps 512 --small

Two measurements, both over `--steps` (4,096) one-token decode steps:
  layer: the fused decode step (`kda_decode_xla`) at Kimi-Linear's head size (K = V = 128), random
         fp32 token inputs (so the outputs differ only through the state), forget gates spread from fast (e^-1.6 per token) to slow (e^-0.001) decay,
         the same inputs through an fp32 and a bf16 state: relative error of the outputs and of the
         state, by decode position;
  model: the trained tiny-k3, teacher-forced on the fp32-state model's own greedy continuation of
         a held-out prompt: relative error of the logits and top-1 agreement, by position.
The speed side (half the state bytes at decode) is measured on the GPU (`benchmarks/kda.py`).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from benchmarks.common import environment, table, write  # noqa: E402
from pallas_kernels.kda import KDADecodeInputs, KDADecodeWeights, kda_decode_xla  # noqa: E402

MARKS = (1, 16, 64, 256, 1024, 2048, 4096)


def _rel(a, b, axes):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=axes) / np.maximum(np.linalg.norm(b, axis=axes), 1e-30)


def layer_errors(steps: int, heads: int, kd: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    b, width = 2, 4
    f32 = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
    a_log = jnp.asarray(np.log(rng.uniform(1.0, 16.0, (heads, 1))), jnp.float32)   # per head
    # softplus(dt_bias) in [1e-4, 0.1]: per-token decays from e^-1.6 (fast) to e^-1e-4 (slow).
    dt = np.log(np.expm1(np.exp(rng.uniform(np.log(1e-4), np.log(0.1), (heads, kd)))))
    weights = KDADecodeWeights(*(f32(width, heads, kd, scale=0.5) for _ in range(3)), dt_bias=jnp.asarray(dt, jnp.float32),
                               a_log=a_log, o_norm_w=jnp.ones((kd,), jnp.float32))
    xs = KDADecodeInputs(x_qkv=f32(steps, b, 3, heads, kd), f=f32(steps, b, heads, kd, scale=0.5),
                         beta_logit=f32(steps, b, heads), z=f32(steps, b, heads, kd))

    def run(state_dtype):
        def step(carry, inp):
            conv, s = carry
            out, conv, s = kda_decode_xla(inp, weights, conv, s)
            return (conv, s), out

        conv0 = jnp.zeros((b, width - 1, 3, heads, kd), jnp.float32)
        s0 = jnp.zeros((b, heads, kd, kd), state_dtype)
        outs, states = [], []
        carry = (conv0, s0)
        done = 0
        for mark in [m for m in MARKS if m <= steps]:
            chunk = jax.tree.map(lambda x: x[done:mark], xs)
            carry, out = jax.jit(lambda c, i: jax.lax.scan(step, c, i))(carry, chunk)
            outs.append(out[-1])
            states.append(carry[1])
            done = mark
        return outs, states

    outs32, states32 = run(jnp.float32)
    outs16, states16 = run(jnp.bfloat16)
    rows = []
    for mark, o32, o16, s32, s16 in zip([m for m in MARKS if m <= steps], outs32, outs16, states32, states16):
        rows.append({"what": "layer", "step": mark,
                     "out_rel_err": float(np.mean(_rel(o16, o32, (-1,)))),
                     "state_rel_err": float(np.mean(_rel(s16, s32, (-2, -1))))})
    return rows


def model_errors(steps: int) -> list[dict]:
    model32 = k3jax.load_model("tiny-k3")
    model16 = model32.with_impls(kda_state="bfloat16")
    tok = model32.tokenizer
    prompt = tok.encode("def merge_sorted(a, b):\n    ")
    steps = min(steps, model32.config.max_position_embeddings - len(prompt))   # tiny-k3's context: 4,096
    params = k3jax.SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    tokens = k3jax.generate(model32, [prompt], params)[0].token_ids
    ids = np.asarray([prompt])
    marks = [m for m in MARKS if m <= len(tokens)] + ([len(tokens)] if len(tokens) not in MARKS else [])
    out = []
    for model in (model32, model16):
        logits, state = model.prefill(ids, max_len=len(prompt) + len(tokens))
        per_step = [np.asarray(logits[0])]
        for t in tokens[:-1]:
            logits, state = model.decode_step(state, np.asarray([t]))
            per_step.append(np.asarray(logits[0]))
        out.append(np.stack(per_step))
    l32, l16 = out
    err = _rel(l16, l32, (-1,))
    agree = np.argmax(l16, -1) == np.argmax(l32, -1)
    rows = []
    for mark in marks:
        lo = max(0, mark // 2)
        rows.append({"what": "tiny-k3", "step": mark, "logit_rel_err": float(np.mean(err[lo:mark])),
                     "top1_agree": float(np.mean(agree[lo:mark]))})
    rows.append({"what": "tiny-k3", "step": "all", "logit_rel_err": float(np.mean(err)),
                 "top1_agree": float(np.mean(agree)), "tokens": len(tokens)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--small", action="store_true", help="head dim 32, fewer steps (a smoke run)")
    args = ap.parse_args(argv)
    rows = layer_errors(args.steps, args.heads, 32 if args.small else 128)
    for r in rows:
        print(r, flush=True)
    model_rows = model_errors(args.steps)
    for r in model_rows:
        print(r, flush=True)
    record = {"benchmark": "kda_state_dtype", "env": environment(), "steps": args.steps, "rows": rows + model_rows}
    path = write("kda_state_dtype" + ("_small" if args.small else ""), record)
    print(table(rows, ["what", "step", "out_rel_err", "state_rel_err"]))
    print(table(model_rows, ["what", "step", "logit_rel_err", "top1_agree"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
