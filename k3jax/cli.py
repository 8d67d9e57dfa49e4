"""`k3jax` command line."""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    import numpy as np

    import k3jax

    cfg = k3jax.tiny_kimi_linear()
    print(f"k3jax demo: built-in tiny Kimi-Linear model ({cfg.num_layers} layers: "
          f"{'/'.join(cfg.mixers)}; random weights, seed {args.seed}, {args.dtype})")
    model = k3jax.CausalLM.random(cfg, seed=args.seed, dtype=args.dtype)
    prompt = np.random.default_rng(args.seed).integers(3, cfg.vocab_size, (1, args.prompt_len))
    start = time.perf_counter()
    logits = model.logits(prompt)
    print(f"forward: logits {tuple(logits.shape)} {logits.dtype}, "
          f"next-token argmax {int(np.asarray(logits)[0, -1].argmax())}")
    logits, state = model.prefill(prompt, max_len=args.prompt_len + args.new_tokens)
    tokens = []
    for _ in range(args.new_tokens):
        nxt = np.asarray(logits).argmax(-1)
        tokens.append(int(nxt[0]))
        logits, state = model.decode_step(state, nxt)
    elapsed = time.perf_counter() - start
    print(f"prompt ids: {prompt[0].tolist()}")
    print(f"greedy ids: {tokens}")
    print(f"done in {elapsed:.1f}s (includes compilation)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3jax", description="Kimi K3 / Kimi-Linear inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="forward pass and greedy tokens on the built-in tiny model")
    demo.add_argument("--prompt-len", type=int, default=12)
    demo.add_argument("--new-tokens", type=int, default=8)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    if getattr(args, "prompt_len", 1) < 1 or getattr(args, "new_tokens", 1) < 1:
        parser.error("--prompt-len and --new-tokens must be >= 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
