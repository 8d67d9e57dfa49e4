"""`k3jax serve` / `python -m serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over the
continuous-batching engine."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

import k3jax
from k3jax.cli import add_impl_arguments, impl_choices
from k3jax.engine import Engine, EngineConfig
from k3jax.sharding import MeshSpec, make_mesh
from serve.engine_service import EngineService
from serve.openai_api import OpenAIServer


def build_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Serve a model over OpenAI's HTTP API (/v1/completions, "
                                 "/v1/chat/completions, /v1/models, /health, /metrics).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=f"examples:\n  {prog} --model tiny-k3 --port 8000\n"
                                        f"  {prog} --model /data/Kimi-Linear-48B-A3B-Instruct --dtype bfloat16 "
                                        "--max-num-seqs 64 --max-model-len 8192\n"
                                        "  then: curl localhost:8000/v1/chat/completions -H 'Content-Type: "
                                        "application/json' -d '{\"model\": \"tiny-k3\", \"messages\": "
                                        "[{\"role\": \"user\", \"content\": \"Hi\"}]}'")
    ap.add_argument("--model", required=True, help="checkpoint directory, or a built-in model: tiny-k3, tiny-k3-random, tiny-kimi-linear")
    ap.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                     help="weights and activations (auto: the checkpoint's own, bf16 for the released "
                          "models; float32 for the built-in tiny models)")
    ap.add_argument("--mesh", default=None, help="e.g. data=1,expert=4,tensor=2 over this host's devices")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="completions decoding together (engine slots)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="tokens per sequence, prompt plus output")
    ap.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 429")
    ap.add_argument("--chunk-steps", type=int, default=8, help="decode steps between admissions")
    ap.add_argument("--max-logprobs", type=int, default=None, help="allow logprobs up to this many (default: off)")
    ap.add_argument("--enable-penalties", action="store_true", help="allow repetition/presence/frequency penalties")
    add_impl_arguments(ap)
    return ap


def build_engine(model: k3jax.CausalLM, args: argparse.Namespace, *, tokenizer=None) -> Engine:
    """The continuous-batching engine over a loaded model, from `build_parser`'s settings
    (`tokenizer`: one to use instead of the model's)."""
    return Engine(model, EngineConfig(max_slots=args.max_num_seqs, max_len=args.max_model_len,
                                      chunk_steps=args.chunk_steps, max_logprobs=args.max_logprobs,
                                      penalties=args.enable_penalties), tokenizer=tokenizer)


def build_server(engine: Engine, args: argparse.Namespace) -> OpenAIServer:
    """The engine's service thread and the OpenAI app over it (`.app`); close `.service` when done.
    benchmarks/server_load.py builds a server this way around a random-weight model."""
    service = EngineService(engine, max_waiting=args.max_waiting)
    return OpenAIServer(service, model_name=args.served_model_name or args.model, max_model_len=args.max_model_len)


def main(argv=None, prog: str = "k3jax serve") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s", level=logging.INFO)
    try:
        mesh = make_mesh(MeshSpec.parse(args.mesh)) if args.mesh else None
        model = k3jax.load_model(args.model, dtype=args.dtype, **impl_choices(args))
        if mesh is not None:
            model = model.shard(mesh)
        server = build_server(build_engine(model, args), args)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning")
    finally:
        server.service.close()
    return 0
