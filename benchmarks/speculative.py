"""Speculative decoding benchmark: the verify step's cost against one decode step, and end-to-end
tokens/s against acceptance length with the replay draft source (controlled acceptance on random
weights).

    python benchmarks/speculative.py --model tiny-k3 --batch 1 2 --q 1 2 4                  # CPU smoke run
    python benchmarks/speculative.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas \
        --batch 1 8 64 --q 1 2 4 8 --error-rates 1 0.5 0.25 0.1 0                           # on the H200

Verify rows: one verify step of q tokens plus its commit (keeping all q) over a prefilled state,
against one plain decode step of the same batch (median of many calls after warm-up; the issue's
target is q = 4 <= 1.3x at B = 1). Each verify row also
records how often the window's argmax equals that of q one-token decode steps (bf16 random weights
have near-ties, so the two orders of summation disagree now and then).

End-to-end rows: `Generator.generate` with SpeculativeConfig("replay", k) replaying the recorded
greedy continuation with each error rate, against plain decoding in the same run (target: >= 2x at
B = 1 with 3 of 4 drafts accepted). On plain random weights in bf16 one near-tie makes the verify
window's greedy token differ from the recorded one and every later draft misses, so these rows
plant a greedy chain first (`plant_greedy_chain`: large random embeddings and an unembedding whose
column perm[t] is embedding t, so the next greedy token after t is perm[t] with a wide margin);
every weight keeps its shape, dtype and place, so the cost per step is unchanged.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from benchmarks.common import environment, median_time, table, write  # noqa: E402
from benchmarks.common import HBM_ACHIEVABLE  # noqa: E402
from benchmarks.decode import add_model_arguments, build, step_bytes  # noqa: E402
from k3jax.steps import commit_step, decode_step, verify_step  # noqa: E402
from k3jax.synthetic import plant_greedy_chain  # noqa: E402


def verify_and_commit(graphdef, params, state, tokens_BQ):
    logits, _, pending = verify_step(graphdef, params, state, tokens_BQ)
    b, q = tokens_BQ.shape
    return logits, commit_step(graphdef, params, pending, state.lengths, jnp.full((b,), q, jnp.int32))


def verify_rows(model, batches, qs, prompt_len, iters, on_row=lambda rows: None) -> list[dict]:
    cfg, rows = model.config, []
    rng = np.random.default_rng(0)
    decode = jax.jit(functools.partial(decode_step, model.graphdef))
    verify = jax.jit(functools.partial(verify_and_commit, model.graphdef))
    for b in batches:
        ids = rng.integers(3, cfg.vocab_size - 300, (b, prompt_len))
        _, state = model.prefill(ids, max_len=prompt_len + 64)
        tok = jnp.asarray(rng.integers(3, 300, (b,)), jnp.int32)
        decode_s, _ = median_time(lambda: decode(model.params, state, tok), iters=iters)
        for q in qs:
            window = jnp.asarray(rng.integers(3, 300, (b, q)), jnp.int32)
            verify_s, _ = median_time(lambda: verify(model.params, state, window), iters=iters)
            agreement = argmax_agreement(model, decode, verify, state, window)
            size = jnp.dtype(model.dtype).itemsize
            floors = verify_floor_ms(cfg, b, q, prompt_len, size), verify_floor_ms(cfg, b, 1, prompt_len, size)
            row = {"batch": b, "q": q, "decode_ms": decode_s * 1e3, "verify_ms": verify_s * 1e3,
                   "ratio_to_decode": verify_s / decode_s, "floor_ms": floors[0], "floor_ratio": floors[0] / floors[1],
                   "argmax_agreement": agreement}
            print(f"B={b} q={q}: verify+commit {verify_s * 1e3:.3f} ms = {row['ratio_to_decode']:.2f}x one decode step "
                  f"({decode_s * 1e3:.3f} ms); argmax equal to step decoding at {agreement:.0%} of positions",
                  flush=True)
            rows.append(row)
            on_row(rows)
    return rows


def verify_floor_ms(cfg, batch: int, q: int, ctx: int, dtype_bytes: int) -> float:
    """Memory floor of one verify step (ms at 4.3 TB/s): the weights that B*q tokens touch (uniform
    routing: q tokens of a row pick their experts independently on random weights), each row's KDA
    state read and written once, and the MLA latents."""
    tokens, rows = step_bytes(cfg, batch * q, ctx, dtype_bytes), step_bytes(cfg, batch, ctx, dtype_bytes)
    return (tokens["weights"] + rows["kda_state"] + rows["mla_kv"]) / HBM_ACHIEVABLE * 1e3


def argmax_agreement(model, decode, verify, state, window) -> float:
    """Fraction of (row, position) whose verify-window argmax equals that of one-token steps."""
    logits, _ = verify(model.params, state, window)
    step, steps = state, []
    for t in range(window.shape[1]):
        out, step = decode(model.params, step, window[:, t])
        steps.append(np.asarray(out).argmax(-1))
    return float(np.mean(np.asarray(logits).argmax(-1) == np.stack(steps, axis=1)))


def end_to_end_rows(model, batches, k, error_rates, prompt_len, new_tokens, repeats, perm=None,
                    on_row=lambda rows: None) -> list[dict]:
    gen, cfg, rows = k3jax.Generator(model), model.config, []
    rng = np.random.default_rng(1)
    sp = k3jax.SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    def timed(**kw):
        gen.generate(prompts, sp, **kw)  # compiles
        outs = [gen.generate(prompts, sp, **kw) for _ in range(repeats)]
        return statistics.median(o.timings.decode_s for o in outs), outs[-1]

    for b in batches:
        prompts = rng.integers(3, cfg.vocab_size - 300, (b, prompt_len)).tolist()
        plain_s, plain = timed()
        recorded = [r.token_ids for r in plain.results]
        plain_tps = (plain.timings.new_tokens - plain.timings.first_tokens) / plain_s
        chain = None if perm is None else float(np.mean([perm[t] == n for r in recorded for t, n in zip(r, r[1:])]))
        if chain is not None:
            print(f"B={b}: {chain:.0%} of greedy steps follow the planted chain", flush=True)
        for err in error_rates:
            spec = k3jax.SpeculativeConfig("replay", k, replay_tokens=recorded, replay_error_rate=err)
            spec_s, out = timed(speculative=spec)
            same = [r.token_ids for r in out.results] == recorded
            stats = out.timings.speculative
            row = {"batch": b, "k": k, "error_rate": err, "mean_accepted_length": stats.mean_accepted_length,
                   "acceptance_rate": stats.acceptance_rate, "tok_per_s": (out.timings.new_tokens - out.timings.first_tokens) / spec_s,
                   "plain_tok_per_s": plain_tps, "speedup": plain_s / spec_s, "identical_output": same,
                   "acceptance_per_position": stats.acceptance_rate, "planted_chain_fraction": chain}
            print(f"B={b} k={k} error {err}: {stats.mean_accepted_length:.2f} tokens/step, "
                  f"{row['tok_per_s']:.1f} tok/s = {row['speedup']:.2f}x plain ({plain_tps:.1f}); identical: {same}",
                  flush=True)
            rows.append(row)
            on_row(rows)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, default="tiny-k3")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--e2e-batch", type=int, nargs="+", default=None,
                    help="batch sizes of the end-to-end rows (default: those of --batch)")
    ap.add_argument("--q", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--k", type=int, default=3, help="drafts per step in the end-to-end rows")
    ap.add_argument("--error-rates", type=float, nargs="+", default=[1.0, 0.5, 0.0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--embed-std", type=float, default=1.0, help="embedding scale of the planted greedy chain")
    ap.add_argument("--no-plant", action="store_true", help="end-to-end rows on the plain random weights")
    ap.add_argument("--verify-only", action="store_true", help="skip the end-to-end rows")
    ap.add_argument("--e2e-first", action="store_true", help="run the end-to-end rows before the verify rows")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    model = build(args)
    name = args.name or f"speculative_{args.model}_{args.dtype}_{args.kernels}"
    record = {"benchmark": "speculative", "model": args.model, "dtype": args.dtype, "kernels": args.kernels,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "k": args.k,
              "planted_chain": not args.no_plant, "embed_std": args.embed_std, "env": environment(),
              "verify": [], "end_to_end": []}

    def save(key):  # after every row, so a run cut short keeps what it measured
        def on_row(rows):
            record[key] = rows
            record["wall_s"] = time.perf_counter() - t0
            write(name, record)
        return on_row

    def run_verify():
        verify_rows(model, args.batch, args.q, args.prompt_len, args.iters, on_row=save("verify"))

    def run_e2e():
        planted, perm = (model, None) if args.no_plant else plant_greedy_chain(model, embed_std=args.embed_std)
        end_to_end_rows(planted, args.e2e_batch or args.batch, args.k, args.error_rates, args.prompt_len,
                        args.new_tokens, args.repeats, perm=perm, on_row=save("end_to_end"))

    parts = [run_verify] if args.verify_only else [run_e2e, run_verify] if args.e2e_first else [run_verify, run_e2e]
    for part in parts:
        part()
    verify, e2e = record["verify"], record["end_to_end"]
    path = write(name, record)
    print(table(verify, ["batch", "q", "decode_ms", "verify_ms", "ratio_to_decode", "floor_ms", "floor_ratio",
                         "argmax_agreement"]))
    print(table(e2e, ["batch", "k", "error_rate", "mean_accepted_length", "tok_per_s", "plain_tok_per_s", "speedup",
                      "identical_output"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
