"""Draft acceptance of the shipped trained `tiny-k3` on held-out code: its MTP layer and prompt
lookup (n-gram) as speculative draft sources, greedy, fp32, on any machine (acceptance does not
depend on the device).

    python benchmarks/tiny_acceptance.py                      # 16 prompts from the held-out slice, k = 1, 2, 3

Prompts are cut from the model's shipped held-out text (`eval_slice.txt`, the start of textwrap.py,
a module kept out of training) at line starts; each continues for --new-tokens tokens. Every
speculative run must reproduce the plain greedy output token for token (exactness), and the
table gives tokens per verify step (mean accepted length) and the acceptance rate of each draft
position.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import k3jax  # noqa: E402
from benchmarks.common import environment, table, write  # noqa: E402
from k3jax.tiny import EVAL_SLICE, trained_path  # noqa: E402


def held_out_prompts(text: str, count: int, min_chars: int) -> list[str]:
    """`count` prefixes of `text` ending at line starts, spread evenly from min_chars to the end."""
    starts = [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 >= min_chars]
    step = max(1, len(starts) // count)
    return [text[:s] for s in starts[::step][:count]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--min-prompt-chars", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--methods", nargs="+", default=["mtp", "ngram"])
    ap.add_argument("--name", default="tiny_acceptance")
    args = ap.parse_args(argv)

    path = trained_path("tiny-k3")
    model = k3jax.load_model("tiny-k3", dtype="float32")
    with open(os.path.join(path, EVAL_SLICE), encoding="utf-8") as f:
        prompts = held_out_prompts(f.read(), args.prompts, args.min_prompt_chars)
    params = k3jax.SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    plain = k3jax.generate(model, prompts, params)
    want = [r.outputs[0].token_ids for r in plain.results]

    rows = []
    for method in args.methods:
        for k in args.k:
            out = k3jax.generate(model, prompts, params, speculative=k3jax.SpeculativeConfig(method, k))
            got = [r.outputs[0].token_ids for r in out.results]
            same = sum(g == w for g, w in zip(got, want))
            stats = out.timings.speculative
            rows.append({"method": method, "k": k, "verify steps": stats.steps, "accepted drafts": stats.accepted,
                         "tokens per step": round(stats.mean_accepted_length, 3),
                         "acceptance by position": [round(a, 3) for a in stats.acceptance_rate],
                         "outputs equal to greedy": f"{same}/{len(prompts)}"})
            print(rows[-1], flush=True)
    record = {"benchmark": "tiny_acceptance", "model": "tiny-k3", "dtype": "float32", "prompts": len(prompts),
              "prompt_chars": [len(p) for p in prompts], "new_tokens": args.new_tokens,
              "source": f"{EVAL_SLICE} of the shipped model (held-out textwrap.py)", "rows": rows,
              "environment": environment()}
    print(table(rows, list(rows[0])))
    print("wrote", write(args.name, record, os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
