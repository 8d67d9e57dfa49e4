"""Load test of the OpenAI-compatible server: throughput and latency against concurrent clients.
Closed-loop streaming clients against the real HTTP stack (FastAPI + uvicorn + the engine's service thread).

    python benchmarks/server_load.py --model tiny-k3 --concurrency 1 4 --duration 5           # CPU smoke run
    python benchmarks/server_load.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas --moe auto \
        --concurrency 1 4 16 64 256 --duration 15                                             # on the H200

One process: the model (random weights for kimi-linear-48b, as benchmarks/decode.py builds it), the
engine, service and app exactly as `k3jax serve` builds them (serve.server.build_engine /
build_server), uvicorn on a free loopback port in a background thread, and the clients (asyncio +
httpx) in the main thread. Each level runs N clients for --duration seconds; each client sends one
streamed /v1/completions request at a time (a random --prompt-len token-id prompt, --max-tokens
tokens, greedy, ignore_eos) and sends the next when the last has finished; requests still running at
the end of the window finish and count. Levels above --max-num-seqs queue in the server: that is
what the top levels measure.

Per request: TTFT (send -> first streamed token), TPOT ((last token - first token) / (tokens - 1)),
end-to-end latency, tokens. The engine hands tokens to the server every --chunk-steps decode steps,
so they arrive in groups: TTFT is the time to the first group (prefill plus one chunk), and TPOT by
this usual definition comes out (chunk_steps - 1) / chunk_steps of the decode step time when every
request runs to max_tokens. Per level: completed requests and errors, output tokens/s over the
window (the server's k3jax_generation_tokens_total counter, scraped from /metrics at the start and
the end of the window: every client is busy throughout it), requests/s (completed / the level's wall
time), p50/p90/p99 of TTFT, TPOT and latency, the running/waiting gauges at the end of the window,
the server's own mean TTFT/TPOT over the level (its /metrics histograms), and the XLA compiles that
happened during the level (must be 0: every admission size is compiled before the first level).

The random-weight model has no tokenizer, and the server detokenizes what it streams. The engine
gets an "ids" tokenizer instead (every id of the model's vocabulary is a base token whose text is
" <id>"): the server does the same detokenizing work per chunk as with a real BPE of that size, and
each streamed chunk's token count is exact (the number of spaces), so TTFT is the arrival of the
first token. The clients share the process (and its GIL) with the server; at these rates (a few
hundred SSE events per second) that costs little, but it is not a separate client machine.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import numpy as np  # noqa: E402
import uvicorn  # noqa: E402

try:
    import httpx
except ImportError:  # the CPU environment has the fork of the same API under another name
    import httpx2 as httpx

import k3jax  # noqa: E402
from benchmarks.common import environment, table, write  # noqa: E402
from benchmarks.decode import add_model_arguments, build  # noqa: E402
from k3jax.generate import PROMPT_BUCKETS  # noqa: E402
from k3jax.tokenizer import KimiTokenizer  # noqa: E402
from serve.server import build_engine, build_parser, build_server  # noqa: E402

COLUMNS = ["concurrency", "completed", "errors", "tok_per_s", "req_per_s", "ttft_p50_ms", "ttft_p99_ms",
           "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "latency_p50_ms", "latency_p99_ms", "running", "waiting",
           "compiles"]


def ids_tokenizer(vocab: int) -> KimiTokenizer:
    """Every id below `vocab` a base token whose text is " <id>" (the 256 reserved ids lie past it)."""
    return KimiTokenizer({f" {i}".encode(): i for i in range(vocab)}, {}, name="ids")


class CompileCounter:
    """XLA backend compiles (count, seconds) seen by jax.monitoring since the start."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1
            self.seconds += duration


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def warm_engine(engine, model, args, rng) -> dict:
    """Compiles every admission size the levels can use (the engine pads a group of admitted prompts
    to a power of two, up to its slots) and the decode chunk, before the service thread starts.
    The prefills are first compiled in parallel threads with the shapes the engine's admission
    builds (prompts left-padded to the bucket); the engine's own warm-up then runs each size through
    the real path, where anything the threads missed still compiles."""
    top = _pow2(min(args.max_num_seqs, max(args.concurrency)))
    sizes = [1 << i for i in range(top.bit_length())]
    width = next(b for b in PROMPT_BUCKETS + (args.max_model_len,) if b >= args.prompt_len)
    pad = model.config.pad_token_id or 0
    vocab = model.config.vocab_size

    def prefill(k: int) -> None:
        ids = np.full((k, width), pad, np.int32)
        mask = np.zeros((k, width), np.int32)
        ids[:, width - args.prompt_len:] = rng_prompts(np.random.default_rng(k), k, args.prompt_len, vocab)
        mask[:, width - args.prompt_len:] = 1
        jax.block_until_ready(model.prefill(ids, mask, max_len=args.max_model_len))

    sampling = k3jax.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def through_engine(k: int) -> float:
        t0 = time.perf_counter()
        for j, prompt in enumerate(rng_prompts(rng, k, args.prompt_len, vocab)):
            engine.add(f"warmup-{k}-{j}", prompt, sampling)
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    seconds = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, len(sizes) - 1)) as pool:
        pending = [pool.submit(prefill, k) for k in reversed(sizes[1:])]  # the largest compiles take longest
        seconds[1] = through_engine(1)  # meanwhile: size 1 and the decode chunk through the engine
        for f in pending:
            f.result()
    for k in sizes[1:]:
        seconds[k] = through_engine(k)
    again = {k: through_engine(k) for k in sizes}  # warm: what an admission of k plus one chunk costs
    total = time.perf_counter() - t0
    print(f"warm-up: admission sizes {sizes} compiled in {total:.1f} s; warm admission + chunk: "
          + ", ".join(f"{k}: {s * 1e3:.0f} ms" for k, s in again.items()), flush=True)
    return {"sizes": sizes, "prefill_width": width, "seconds": total, "first_s": seconds, "warm_s": again}


def rng_prompts(rng, k: int, length: int, vocab: int) -> list[list[int]]:
    return rng.integers(3, max(4, vocab - 300), (k, length)).tolist()


# ----- the server in a background thread -----
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_uvicorn(app, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    # keep-alive far longer than the clients' own expiry, so the server never closes a connection
    # a client is about to reuse (that would be a spurious error, not a server failure)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=600,
                            backlog=4096)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    return server, thread


# ----- clients -----
def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of Prometheus' text format."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


async def scrape(http) -> dict[str, float]:
    r = await http.get("/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


async def one_request(http, body: dict) -> dict:
    """One streamed completion: send, first token and end times, tokens; or an error."""
    sent = time.perf_counter()
    first = last = None
    tokens, usage = 0, None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return {"error": f"stream error: {chunk['error']}"}
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    n = choice.get("text", "").count(" ")  # one space per token of the ids tokenizer
                    if n:
                        last = time.perf_counter()
                        first = first or last
                        tokens += n
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if first is None or usage != tokens:
        return {"error": f"streamed {tokens} tokens, usage says {usage}"}
    return {"sent": sent, "ttft": first - sent, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None,
            "latency": end - sent, "end": end, "tokens": tokens}


async def closed_loop(http, client: int, deadline: float, args, model_name: str, vocab: int, out: list) -> None:
    rng = np.random.default_rng(1000 + client)
    while time.perf_counter() < deadline:
        prompt = rng_prompts(rng, 1, args.prompt_len, vocab)[0]
        out.append(await one_request(http, request_body(model_name, prompt, args.max_tokens)))


def request_body(model_name: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


def _mean_ms(before: dict, after: dict, histogram: str) -> float | None:
    n = after[histogram + "_count"] - before[histogram + "_count"]
    return (after[histogram + "_sum"] - before[histogram + "_sum"]) / n * 1e3 if n else None


async def wait_idle(http, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(http)
        if m.get("k3jax_requests_running", 0) == 0 and m.get("k3jax_requests_waiting", 0) == 0:
            return m
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not drain: {m}")
        await asyncio.sleep(0.1)


async def run_level(http, c: int, args, model_name: str, vocab: int, compiles: CompileCounter) -> dict:
    start_metrics = await wait_idle(http)
    compiles0, compile_s0 = compiles.count, compiles.seconds
    results: list[dict] = []
    t0 = time.perf_counter()
    deadline = t0 + args.duration
    clients = [asyncio.create_task(closed_loop(http, i, deadline, args, model_name, vocab, results))
               for i in range(c)]
    await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
    end_metrics = await scrape(http)
    window = time.perf_counter() - t0
    await asyncio.gather(*clients)
    wall = time.perf_counter() - t0
    after = await scrape(http)
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    latency = [r["latency"] for r in ok]
    window_tokens = end_metrics["k3jax_generation_tokens_total"] - start_metrics["k3jax_generation_tokens_total"]
    row = {"concurrency": c, "completed": len(ok), "errors": len(errors), "window_s": window, "wall_s": wall,
           "tok_per_s": window_tokens / window, "req_per_s": len(ok) / wall,
           "tok_per_s_client": sum(r["tokens"] for r in ok) / wall,
           "requests_in_window": sum(1 for r in ok if r["end"] <= t0 + window),
           "ttft_p50_ms": _pct(ttft, 50), "ttft_p90_ms": _pct(ttft, 90), "ttft_p99_ms": _pct(ttft, 99),
           "tpot_p50_ms": _pct(tpot, 50), "tpot_p90_ms": _pct(tpot, 90), "tpot_p99_ms": _pct(tpot, 99),
           "latency_p50_ms": _pct(latency, 50), "latency_p90_ms": _pct(latency, 90),
           "latency_p99_ms": _pct(latency, 99),
           "running": int(end_metrics.get("k3jax_requests_running", -1)),
           "waiting": int(end_metrics.get("k3jax_requests_waiting", -1)),
           "server_ttft_mean_ms": _mean_ms(start_metrics, after, "k3jax_time_to_first_token_seconds"),
           "server_tpot_mean_ms": _mean_ms(start_metrics, after, "k3jax_time_per_output_token_seconds"),
           "compiles": compiles.count - compiles0, "compile_s": compiles.seconds - compile_s0,
           "error_samples": errors[:5],
           "requests": [[round(r["ttft"] * 1e3, 2), round((r["tpot"] or 0) * 1e3, 3), round(r["latency"] * 1e3, 2),
                         r["tokens"]] for r in ok]}
    return row


async def drive(port: int, args, model_name: str, vocab: int, record: dict, name: str,
                compiles: CompileCounter, started: float) -> str:
    connections = max(args.concurrency) + 8
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=60)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    path = None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=timeout) as http:
        # warm-up over HTTP: one request from each of the largest level's clients at once (connections,
        # the app's first requests); the engine's compiles are already done
        t = time.perf_counter()
        rng = np.random.default_rng(7)
        burst = await asyncio.gather(*[one_request(http, request_body(model_name, p, min(8, args.max_tokens)))
                                       for p in rng_prompts(rng, max(args.concurrency), args.prompt_len, vocab)])
        bad = [r["error"] for r in burst if "error" in r]
        record["http_warmup"] = {"requests": len(burst), "errors": len(bad), "error_samples": bad[:5],
                                 "seconds": time.perf_counter() - t}
        print(f"HTTP warm-up: {len(burst)} requests at once in {time.perf_counter() - t:.1f} s, {len(bad)} errors"
              + (f" ({bad[0]})" if bad else ""), flush=True)
        path = write(name, record)
        for c in args.concurrency:
            if args.budget and time.perf_counter() - started + args.duration > args.budget:
                print(f"concurrency {c}: skipped (--budget {args.budget:.0f} s)", flush=True)
                record["skipped"].append(c)
                continue
            row = await run_level(http, c, args, model_name, vocab, compiles)
            record["levels"].append(row)
            path = write(name, record)
            print(f"concurrency {c}: {row['completed']} requests, {row['errors']} errors, "
                  f"{row['tok_per_s']:.1f} tok/s, {row['req_per_s']:.2f} req/s, TTFT p50 {row['ttft_p50_ms'] or 0:.0f} "
                  f"ms p99 {row['ttft_p99_ms'] or 0:.0f} ms, TPOT p50 {row['tpot_p50_ms'] or 0:.1f} ms p99 "
                  f"{row['tpot_p99_ms'] or 0:.1f} ms, latency p50 {row['latency_p50_ms'] or 0:.0f} ms, running "
                  f"{row['running']} waiting {row['waiting']}, {row['compiles']} compiles"
                  + (f"; first error: {row['error_samples'][0]}" if row["errors"] else ""), flush=True)
    return path


def plot(path: str, record: dict) -> str | None:
    """PNG beside the JSON, when matplotlib is there."""
    try:
        from benchmarks.plot import plot_server_load
    except ImportError as e:
        print(f"no plot ({e})", flush=True)
        return None
    return plot_server_load(os.path.splitext(path)[0] + ".png", record)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, default="tiny-k3")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="clients per level")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds each level's clients keep sending")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="engine slots (levels above it queue)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--chunk-steps", type=int, default=8, help="decode steps between admissions")
    ap.add_argument("--max-waiting", type=int, default=1024, help="queued requests before the server answers 429")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds from the script's start: skip a level whose window would end after it")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    started = time.perf_counter()

    compiles = CompileCounter()
    model = build(args)
    vocab = model.config.vocab_size
    served = build_parser("server_load").parse_args(
        ["--model", args.model, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
         "--chunk-steps", str(args.chunk_steps), "--max-waiting", str(args.max_waiting)])
    engine = build_engine(model, served, tokenizer=ids_tokenizer(vocab))
    warm = warm_engine(engine, model, args, np.random.default_rng(0))
    warm["compiles"], warm["compile_s"] = compiles.count, compiles.seconds  # since the start, the build's too
    server = build_server(engine, served)
    port = _free_port()
    web, thread = start_uvicorn(server.app, port)
    name = args.name or f"server_load_{args.model}"
    cfg = model.config
    record = {"benchmark": "server_load", "model": args.model, "dtype": args.dtype, "moe_impl": cfg.moe.impl,
              "kda_impl": cfg.kda.impl, "mla_impl": cfg.mla.decode_impl, "linear_impl": cfg.linear_impl,
              "settings": {k: getattr(args, k) for k in ("concurrency", "duration", "prompt_len", "max_tokens",
                                                         "max_num_seqs", "max_model_len", "chunk_steps",
                                                         "max_waiting")},
              "env": {**environment(), "uvicorn": uvicorn.__version__,
                      "httpx": f"{httpx.__name__} {httpx.__version__}"},
              "engine_warmup": warm, "levels": [], "skipped": [], "partial": True}
    try:
        path = asyncio.run(drive(port, args, served.model, vocab, record, name, compiles, started))
    finally:
        web.should_exit = True
        thread.join(timeout=10)
        server.service.close()
    record["partial"] = False
    record["total_s"] = time.perf_counter() - started
    path = write(name, record)
    print(table(record["levels"], COLUMNS))
    png = plot(path, record)
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0 if all(r["errors"] == 0 for r in record["levels"]) and not record["http_warmup"]["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
