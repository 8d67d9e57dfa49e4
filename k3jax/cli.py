"""`k3jax` command line: generate text, convert and verify checkpoints."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import k3jax
from k3jax.checkpoint.convert import main as convert_main
from k3jax.checkpoint.loader import checkpoint_dtype
from k3jax.checkpoint.orbax_format import is_k3jax_checkpoint, read_manifest
from k3jax.checkpoint.safetensors_io import CheckpointError
from k3jax.checkpoint.verify import verify_main
from k3jax.config import IMPL_OPTIONS, kimi_k3, kimi_linear_48b_a3b
from k3jax.hf_config import from_hf_config, load_hf_config
from k3jax.memory_plan import GB, format_plan, plan_memory
from k3jax.sharding import MeshSpec
from k3jax.tiny import BUILTIN, TRAINED, builtin_config, trained_path
from k3jax.generate import GenerationInterrupted
from k3jax.speculative import SpeculativeConfig

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_impl_arguments(parser: argparse.ArgumentParser) -> None:
    """--kda, --kda-decode, --mla, --moe, --gmm, --attn-res: the implementation options, named as in
    `ModelConfig.with_impls` and `k3jax.load`."""
    group = parser.add_argument_group("implementation choices (default: the model's own)")
    for name, (_, _, choices) in IMPL_OPTIONS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=f"impl_{name}", choices=choices, default=None)
    group.add_argument("--packed-experts", action="store_true",
                       help="keep an MXFP4 checkpoint's routed experts packed on the device (decoded in the kernels)")


def impl_choices(args: argparse.Namespace) -> dict:
    """The implementation options set on the command line, plus packed_experts when asked for."""
    out = {name: getattr(args, f"impl_{name}") for name in IMPL_OPTIONS if getattr(args, f"impl_{name}") is not None}
    return {**out, "packed_experts": True} if getattr(args, "packed_experts", False) else out


def _print_results(out, stream: bool) -> None:
    for i, r in enumerate(out):
        print(f"--- prompt {i} ({len(r.prompt_token_ids)} tokens) -> {len(r.token_ids)} tokens, {r.finish_reason}")
        if not stream:
            print(r.text)


def _generate(args: argparse.Namespace) -> int:
    try:
        sampling = k3jax.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                        top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                                        stop=tuple(args.stop or ()), repetition_penalty=args.repetition_penalty,
                                        presence_penalty=args.presence_penalty,
                                        frequency_penalty=args.frequency_penalty)
        if args.speculative is None and args.num_speculative_tokens is not None:
            raise ValueError("--num-speculative-tokens needs --speculative mtp|ngram")
        drafts = 3 if args.num_speculative_tokens is None else args.num_speculative_tokens
        speculative = None if args.speculative is None else SpeculativeConfig.parse(args.speculative, drafts)
        model = k3jax.load_model(args.model, dtype=args.dtype, **impl_choices(args))
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
        out = k3jax.generate(model, prompts, sampling, stream=stream, chat_options=chat_options,
                             speculative=speculative)
    except (ValueError, OSError) as e:
        if isinstance(e, BrokenPipeError):
            return _broken_pipe()
        print(f"k3jax generate: error: {e}", file=sys.stderr)
        return 2
    except GenerationInterrupted as e:
        if args.stream:
            print()
        _print_results(e.partial, args.stream)
        print(f"k3jax generate: interrupted after {e.partial.timings.new_tokens} tokens", file=sys.stderr)
        return 130
    if args.stream:
        print()
    _print_results(out, args.stream)
    t = out.timings
    print(f"prefill and first token {t.prefill_s * 1e3:.0f} ms, decode {t.decode_s * 1e3:.0f} ms for the "
          f"{t.new_tokens - t.first_tokens} tokens after it ({t.tokens_per_s:.1f} tok/s; first call includes "
          f"compilation)")
    if t.speculative is not None:
        s = t.speculative
        rates = ", ".join(f"{r:.2f}" for r in s.acceptance_rate)
        print(f"speculative {s.method}: {s.mean_accepted_length:.2f} tokens per verify step over {s.steps} steps, "
              f"acceptance by draft position [{rates}]")
    return 0


def _broken_pipe() -> int:
    """stdout was closed by the reader (e.g. `| head`): one line on stderr, no traceback at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    print("k3jax generate: error: output closed while writing (broken pipe)", file=sys.stderr)
    return 2


PLAN_PRESETS = {"kimi-linear-48b": kimi_linear_48b_a3b, "k3": kimi_k3}


def _plan_config(name: str, dtype: str):
    """(config, dtype) of a preset, a built-in tiny model or a checkpoint directory."""
    if name in PLAN_PRESETS:
        return PLAN_PRESETS[name](), "bfloat16" if dtype == "auto" else dtype
    if name in BUILTIN:
        return builtin_config(name)[0], "float32" if dtype == "auto" else dtype
    path = trained_path(name) if name in TRAINED else name
    if not os.path.isdir(path):
        raise ValueError(f"unknown model {name!r}: not a preset ({', '.join(PLAN_PRESETS)}), a built-in model "
                         f"({', '.join((*TRAINED, *BUILTIN))}) or a checkpoint directory")
    cfg = (from_hf_config(read_manifest(path)["hf_config"]) if is_k3jax_checkpoint(path) else load_hf_config(path))
    return cfg, checkpoint_dtype(path) if dtype == "auto" else dtype


def _plan(args) -> int:
    try:
        if args.batch < 1 or args.context < 1 or args.device_memory_gb <= 0:
            raise ValueError("--batch, --context and --device-memory-gb must be positive")
        mesh = MeshSpec.parse(args.mesh)
        cfg, dtype = _plan_config(args.model, args.dtype)
        plan = plan_memory(cfg, mesh, batch=args.batch, context=args.context, dtype=dtype,
                           capacity=int(args.device_memory_gb * GB), name=args.model)
    except (ValueError, OSError, CheckpointError) as e:
        print(f"k3jax plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0 if plan.fits else 1


def build_parser(extra_commands: dict | None = None) -> argparse.ArgumentParser:
    """The `k3jax` parser; `extra_commands` (name -> (help, main)) are fronts outside k3jax (serve/)
    that the `k3jax` console script adds (serve.cli)."""
    parser = argparse.ArgumentParser(prog="k3jax", description="Kimi K3 / Kimi-Linear inference in JAX",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="examples:\n  k3jax generate --model tiny-k3 --prompt 'Hello' --stream\n"
                                            "  k3jax convert /data/Kimi-Linear-48B-A3B /data/kl-k3jax --workers 8\n"
                                            "  k3jax --version")
    parser.add_argument("--version", action="version", version=f"k3jax {k3jax.__version__}")
    parser.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                        help="logging level of the k3jax logger (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt", formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="examples:\n  k3jax generate --model tiny-k3 --prompt 'def fibonacci(n):' --stream\n"
                                "  k3jax generate --model DIR --chat --prompt 'Hi!' --temperature 0.7 --seed 1 "
                                "--dtype bfloat16 --kda pallas\n"
                                "  k3jax generate --model tiny-k3 --prompt 'def f(x):' --speculative mtp "
                                "--num-speculative-tokens 3")
    gen.add_argument("--model", required=True,
                     help="checkpoint directory, or a built-in model: tiny-k3 (trained on the Python standard "
                          "library), tiny-k3-random, tiny-kimi-linear (random weights)")
    gen.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="render the prompt as a user chat message")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--no-thinking", action="store_true", help="K3 chat: thinking off")
    gen.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=32,
                     help="tokens to generate at most (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="random seed of sampling (default: fresh)")
    gen.add_argument("--stop", action="append", help="a string that ends generation (repeatable)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--speculative", choices=["mtp", "ngram"], default=None,
                     help="speculative decoding with drafts from the model's MTP layer or prompt lookup")
    gen.add_argument("--num-speculative-tokens", type=int, default=None,
                     help="drafts verified per step (default 3; needs --speculative)")
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                     help="weights and activations (auto: the checkpoint's own, bf16 for the released "
                          "models; float32 for the built-in tiny models)")
    add_impl_arguments(gen)
    gen.set_defaults(func=_generate)
    plan = sub.add_parser("plan", help="per-device memory of a model on a mesh: weights, KDA state, MLA cache, "
                          "activations (exit 1 when it does not fit)", formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog="examples:\n  k3jax plan --model kimi-linear-48b --batch 64 --context 4096\n"
                                 "  k3jax plan --model k3 --mesh expert=32 --batch 16 --context 131072")
    plan.add_argument("--model", required=True,
                      help=f"checkpoint directory, a preset ({', '.join(PLAN_PRESETS)}) or a built-in tiny model")
    plan.add_argument("--mesh", default="", help="e.g. data=1,expert=8,tensor=2 (default: one device)")
    plan.add_argument("--batch", type=int, default=1, help="rows decoding together (default 1)")
    plan.add_argument("--context", type=int, default=4096, help="tokens per row, prompt and output (default 4096)")
    plan.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                      help="auto: the checkpoint's own; bfloat16 for the presets; float32 for the tiny models")
    plan.add_argument("--device-memory-gb", type=float, default=141.0, help="memory of one device (H200: 141)")
    plan.set_defaults(func=_plan)
    sub.add_parser("convert", add_help=False,
                   help="convert a Hugging Face checkpoint to a k3jax (Orbax) checkpoint (see k3jax convert -h)")
    sub.add_parser("verify", add_help=False, help="verify a converted k3jax checkpoint (see k3jax verify -h)")
    for name, (help_text, _) in (extra_commands or {}).items():
        sub.add_parser(name, add_help=False, help=f"{help_text} (see k3jax {name} -h)")
    return parser


def main(argv: list[str] | None = None, extra_commands: dict | None = None) -> int:
    """Runs `k3jax ARGV`. extra_commands: name -> (help, main(argv, prog)) of commands served by
    packages that build on k3jax (the `k3jax` console script passes serve/'s)."""
    if argv is None:
        argv = sys.argv[1:]
    commands = {"convert": convert_main, "verify": verify_main,
                **{name: run for name, (_, run) in (extra_commands or {}).items()}}
    parser = build_parser(extra_commands)
    level = parser.get_default("log_level")
    if argv and argv[0].startswith("--log-level"):  # the global option before a delegated command
        if "=" in argv[0]:
            given, rest = argv[0].split("=", 1)[1], argv[1:]
        else:
            given, rest = (argv[1] if len(argv) > 1 else ""), argv[2:]
        if rest and rest[0] in commands:
            if given not in LOG_LEVELS:
                parser.error(f"argument --log-level: invalid choice: {given!r} (choose from {', '.join(LOG_LEVELS)})")
            level, argv = given, rest
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if argv and argv[0] in commands:
        logging.getLogger("k3jax").setLevel(level.upper())
        return commands[argv[0]](argv[1:], prog=f"k3jax {argv[0]}")
    args = parser.parse_args(argv)
    logging.getLogger("k3jax").setLevel(args.log_level.upper())
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
