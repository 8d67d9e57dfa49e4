"""`k3jax` command line."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    import k3jax

    try:
        sampling = k3jax.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        model = k3jax.load_model(args.model, dtype=args.dtype)
        if model.tokenizer is None:
            raise ValueError(f"{args.model} has no tiktoken.model, so text prompts cannot be encoded")
        prompts = args.prompt
        chat_options = None
        if args.chat:
            prompts = [([{"role": "system", "content": args.system}] if args.system else [])
                       + [{"role": "user", "content": p}] for p in prompts]
            chat_options = {"thinking": not args.no_thinking} if model.config.model_type == "kimi_k3" else {}
        stream = None
        if args.stream:
            def stream(chunk):
                prefix = f"[{chunk.index}] " if len(prompts) > 1 else ""
                print(prefix + (chunk.text or ""), end="" if len(prompts) == 1 else "\n", flush=True)
        out = k3jax.generate(model, prompts, sampling, stream=stream, chat_options=chat_options)
    except (ValueError, OSError) as e:
        print(f"k3jax generate: error: {e}", file=sys.stderr)
        return 2
    if args.stream:
        print()
    for i, r in enumerate(out):
        header = f"--- prompt {i} ({len(r.prompt_token_ids)} tokens) -> {len(r.token_ids)} tokens, {r.finish_reason}"
        print(header)
        if not args.stream:
            print(r.text)
    t = out.timings
    print(f"prefill {t.prefill_s * 1e3:.0f} ms, decode {t.decode_s * 1e3:.0f} ms for {t.new_tokens} tokens "
          f"({t.tokens_per_s:.1f} tok/s; first call includes compilation)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3jax", description="Kimi K3 / Kimi-Linear inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", required=True, help="checkpoint directory, or a built-in model: tiny-k3, tiny-kimi-linear")
    gen.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="render the prompt as a user chat message")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--no-thinking", action="store_true", help="K3 chat: thinking off")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.set_defaults(func=_generate)
    sub.add_parser("convert", add_help=False,
                   help="convert a Hugging Face checkpoint to a k3jax (Orbax) checkpoint (see k3jax convert -h)")
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "convert":
        from k3jax.checkpoint.convert import main as convert_main
        return convert_main(argv[1:], prog="k3jax convert")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
