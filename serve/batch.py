"""The offline batch job: JSONL requests in, one JSONL result per request out, exactly once.

    python -m serve.batch --model tiny-k3 --input requests.jsonl --output results.jsonl
    k3jax run-batch --model DIR --input requests.jsonl --output results.jsonl --mesh data=8 --dtype bfloat16

One process per host (or per GPU) under `jax.distributed`; the mesh's `data` axis makes replicas,
each a continuous-batching engine (k3jax.engine) over its (expert, tensor) sub-mesh, each taking
its share of the ids by a stable hash (serve.replicas). A replica feeds its engine from the input
as slots free up (a bounded number of requests in memory), steps it, and commits finished records
to its part files (serve.parts). When every replica is done (a barrier across processes), process
0 merges the parts into the output in input order. A re-run of the same command skips the ids
already committed; one with another model, sampling defaults or input is refused.

Exit status: 0 when every request succeeded, 1 when the output holds failed requests, 2 when the
job could not run (bad arguments, unreadable input, duplicate ids, another job's output), 130 on
Ctrl-C (what was committed stays; re-run to resume).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import k3jax
from k3jax.cli import add_impl_arguments, impl_choices
from k3jax.engine import Engine, EngineConfig
from k3jax.hf_config import read_generation_config
from k3jax.sampling import SamplingParams
from k3jax.tiny import BUILTIN, TRAINED, builtin_config, trained_path

from serve.parts import JobDir, JobError, PartWriter, Summary
from serve.records import error_record, result_record
from serve.replicas import Topology, parse_mesh, replica_of
from serve.requests_file import Defaults, InputError, InputScan, Request, read_requests, scan

DEFAULT_MAX_LEN = 4096
_HASHED_FILE_BYTES = 16 << 20  # checkpoint files up to this size enter the fingerprint by content


def build_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description="Run a JSONL file of requests through the continuous-batching engine, sharded over "
                               "data-parallel replicas, resumable after a crash.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               f"  {prog} --model tiny-k3 --input requests.jsonl --output results.jsonl\n"
               f"  {prog} --model /data/kl-k3jax --dtype bfloat16 --input in.jsonl --output out.jsonl --mesh data=8\n"
               f"  {prog} ... --mesh data=2,expert=8 --coordinator-address host0:12355 --num-processes 2 "
               "--process-id $RANK\n"
               "Input lines: OpenAI batch lines ({\"custom_id\", \"body\": {\"messages\" | \"prompt\", ...}}) or "
               "{\"id\", \"prompt\", ...}.\nRe-running the same command resumes an interrupted job.")
    ap.add_argument("--model", required=True,
                    help="checkpoint directory, or a built-in model: tiny-k3, tiny-k3-random, tiny-kimi-linear")
    ap.add_argument("--input", required=True, help="JSONL file of requests")
    ap.add_argument("--output", required=True,
                    help="JSONL file of results (its job directory OUTPUT.job holds the parts meanwhile)")
    ap.add_argument("--mesh", default=None,
                    help="data=..,expert=..,tensor=.. over all devices of the job; replicas over data (default: one "
                         "replica per device; without data=, replicas fill the devices)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                     help="weights and activations (auto: the checkpoint's own, bf16 for the released "
                          "models; float32 for the built-in tiny models)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="tokens per request that gives no max_tokens (default: the model's generation config, or 64)")
    ap.add_argument("--seed", type=int, default=0,
                    help="job seed: a sampled request without a seed gets one derived from this and its id (default 0)")
    engine = ap.add_argument_group("engine size (per replica)")
    engine.add_argument("--max-slots", type=int, default=64, help="completions decoding together (default 64)")
    engine.add_argument("--max-len", type=int, default=None,
                        help=f"tokens per completion, prompt included (default: {DEFAULT_MAX_LEN}, or the model's "
                             "limit when lower)")
    engine.add_argument("--chunk-steps", type=int, default=16, help="decode steps between admissions (default 16)")
    job = ap.add_argument_group("job")
    job.add_argument("--commit-every", type=int, default=256,
                     help="commit a replica's results after this many (default 256), and at least every 30 s")
    job.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    dist = ap.add_argument_group("several processes (jax.distributed)",
                                 "Give all three, or --distributed alone where JAX detects them (SLURM, Open MPI).")
    dist.add_argument("--distributed", action="store_true", help="join a jax.distributed job")
    dist.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0")
    dist.add_argument("--num-processes", type=int, default=None)
    dist.add_argument("--process-id", type=int, default=None)
    dist.add_argument("--local-device-ids", default=None,
                      help="comma-separated devices of this process (SLURM's default is one GPU per process)")
    add_impl_arguments(ap)
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m serve.batch") -> int:
    args = build_parser(prog).parse_args(argv)
    for name in ("max_slots", "chunk_steps", "commit_every", "max_tokens", "max_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"{prog}: error: --{name.replace('_', '-')} must be a positive integer, got {value}", file=sys.stderr)
            return 2
    distributed = args.distributed or any(v is not None for v in (args.coordinator_address, args.num_processes,
                                                                   args.process_id, args.local_device_ids))
    joined = False
    try:
        if distributed:
            _join(args)
            joined = True
        return Job(args, prog).run()
    except (JobError, InputError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; committed results are kept, run the same command to resume", file=sys.stderr)
        return 130
    finally:
        if joined:
            jax.distributed.shutdown()


def _join(args) -> None:
    try:
        ids = None if args.local_device_ids is None else [int(i) for i in args.local_device_ids.split(",")]
    except ValueError:
        given = args.local_device_ids
        raise ValueError(f"--local-device-ids must be comma-separated integers, got {given!r}") from None
    try:
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id, local_device_ids=ids)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"cannot join the distributed job: {e}") from None


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ----- what the job is -----
def model_identity(name: str, dtype: str, impls: dict) -> dict:
    """The model part of the fingerprint: a built-in name, or a checkpoint directory's files
    (small ones by content, large ones by size), with the dtype and implementation choices."""
    if name in BUILTIN:
        files = {"builtin": name}
    elif name in TRAINED or os.path.isdir(name):
        name = trained_path(name) if name in TRAINED else name
        files = {}
        for entry in sorted(os.scandir(name), key=lambda e: e.name):
            if entry.is_dir():
                files[entry.name + "/"] = "directory"
            elif entry.stat().st_size <= _HASHED_FILE_BYTES:
                with open(entry.path, "rb") as f:
                    files[entry.name] = hashlib.file_digest(f, "sha256").hexdigest()
            else:
                files[entry.name] = entry.stat().st_size
    else:
        raise ValueError(f"unknown model {name!r}: not a built-in model ({', '.join((*TRAINED, *BUILTIN))}) "
                         "and not a checkpoint directory")
    return {"files": files, "dtype": dtype, "impls": impls}


def default_sampling(args) -> SamplingParams:
    """Sampling of a request that leaves fields out: the checkpoint's generation config (else
    greedy, 64 tokens), with --max-tokens."""
    config = read_generation_config(args.model) if os.path.isdir(args.model) else None
    sp = SamplingParams.from_generation_config(config) if config else SamplingParams()
    if args.max_tokens is not None:
        sp = dataclasses.replace(sp, max_tokens=args.max_tokens, max_new_tokens=args.max_tokens)
    return sp


@dataclass
class _Counts:
    requests: int = 0
    tokens: int = 0


class _Progress:
    """A progress bar over this process's requests with tokens/s, shared by its replica threads."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, disable=not enabled, unit="req", file=sys.stderr, dynamic_ncols=True,
                        desc="requests", smoothing=0.1)
        self.lock = threading.Lock()
        self.tokens, self.start, self.shown = 0, time.monotonic(), 0.0

    def update(self, requests: int, tokens: int) -> None:
        with self.lock:
            self.tokens += tokens
            self.bar.update(requests)
            now = time.monotonic()
            if now - self.shown > 0.5:
                self.shown = now
                self.bar.set_postfix_str(f"{self.tokens / max(now - self.start, 1e-9):.1f} tok/s")

    def close(self) -> None:
        self.shown = 0.0
        self.update(0, 0)   # the final rate
        self.bar.close()


class Job:
    """One run of the batch job in this process (see the module docstring)."""

    def __init__(self, args, prog: str):
        self.args, self.prog = args, prog
        self.impls = impl_choices(args)
        self.model_name = os.path.basename(os.path.normpath(args.model))
        self.stop = threading.Event()
        self.start = time.perf_counter()

    def run(self) -> int:
        args = self.args
        identity = model_identity(args.model, args.dtype, self.impls)
        self.defaults = Defaults(default_sampling(args), args.seed)
        self.scan: InputScan = scan(args.input, self.defaults)
        spec = parse_mesh(args.mesh, jax.device_count())
        self.topology = Topology.plan(spec, jax.devices(), jax.process_index())
        sampling = {"defaults": dataclasses.asdict(self.defaults.sampling), "seed": args.seed}
        self.fingerprint = json.loads(json.dumps({"model": identity, "sampling": sampling, "input": self.scan.sha256,
                                                  "max_len": args.max_len}))  # as job.json holds it
        self.job = JobDir(args.output)
        state = self.job.check(self.fingerprint)
        if state == "complete":
            if jax.process_index() == 0:
                self.job.drop_parts()  # what a kill during the previous run's last step left
            return self._report(self.job.summary(), None)
        self.finished = self.job.finished() if state == "resume" else set()
        self.pending = collections.Counter(replica_of(key, self.topology.replicas) for key in self.scan.keys
                                           if key not in self.finished)   # requests left per replica
        _barrier("serve.batch: finished ids read")  # nobody commits before every process has read them
        engines = self._engines()                     # errors here leave nothing behind
        if jax.process_index() == 0:
            if state == "new":
                self.job.create(self.fingerprint)
            self.job.clear_temps()
        _barrier("serve.batch: job directory ready")
        counts = self._run_replicas(engines)
        if self.stop.is_set():    # Ctrl-C: the replicas committed what they finished
            raise KeyboardInterrupt
        _barrier("serve.batch: replicas done")
        summary = self._finish()
        return self._report(summary, self._gather(counts))

    # ----- set-up -----
    def _engines(self) -> dict[int, Engine | None]:
        """An engine per local replica with work (None: nothing to run there)."""
        engines, model = {}, None
        for replica in self.topology.local():
            if not self.pending[replica]:
                engines[replica] = None
                continue
            model = self._load(self.topology.mesh(replica), model)
            max_len = self.args.max_len or min(DEFAULT_MAX_LEN, model.config.max_position_embeddings)
            if max_len > model.config.max_position_embeddings:
                raise ValueError(f"--max-len {max_len} exceeds the model's context limit "
                                 f"{model.config.max_position_embeddings}")
            config = EngineConfig(max_slots=self.args.max_slots, max_len=max_len, chunk_steps=self.args.chunk_steps,
                                  max_logprobs=self.scan.max_logprobs, penalties=self.scan.penalties)
            engines[replica] = engine = Engine(model, config)
            if self.topology.spans(replica):
                fetchable_outputs(engine, model.mesh)
        return engines

    def _load(self, mesh, loaded: k3jax.CausalLM | None) -> k3jax.CausalLM:
        """The model on `mesh`: built or read once per process, resharded for further replicas."""
        if loaded is not None:
            return loaded.shard(mesh)
        if self.args.model in BUILTIN:
            if self.impls.get("packed_experts"):
                raise ValueError(f"--packed-experts applies to MXFP4 checkpoints, not the built-in {self.args.model}")
            config, tokenizer = builtin_config(self.args.model)
            dtype = "float32" if self.args.dtype == "auto" else self.args.dtype
            return k3jax.CausalLM.random(config.with_impls(**self.impls), dtype=dtype, mesh=mesh,
                                         tokenizer=tokenizer)
        path = trained_path(self.args.model) if self.args.model in TRAINED else self.args.model
        return k3jax.load(path, dtype=self.args.dtype, mesh=mesh, **self.impls)

    # ----- the work -----
    def _run_replicas(self, engines: dict[int, Engine | None]) -> _Counts:
        total = sum(self.pending[r] for r in engines)
        progress = _Progress(total, not self.args.no_progress and sys.stderr.isatty())
        counts = _Counts()
        try:
            with self._stop_on_sigint():
                if len(engines) <= 1:
                    results = [self._run_replica(r, e, progress) for r, e in engines.items()]
                else:
                    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
                        futures = [pool.submit(self._run_replica_or_stop, r, e, progress) for r, e in engines.items()]
                        results = [f.result() for f in futures]
        finally:
            progress.close()
        for replica, c in zip(engines, results):
            if self.topology.leads(replica):
                counts.requests += c.requests
                counts.tokens += c.tokens
        return counts

    @contextlib.contextmanager
    def _stop_on_sigint(self):
        """Ctrl-C sets the stop flag (replicas commit and return); a second one raises at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.stop.is_set():
                raise KeyboardInterrupt
            self.stop.set()

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _run_replica_or_stop(self, replica: int, engine: Engine | None, progress: _Progress) -> _Counts:
        """A replica thread: a failure stops the other replicas too (they commit and return)."""
        try:
            return self._run_replica(replica, engine, progress)
        except BaseException:
            self.stop.set()
            raise

    def _run_replica(self, replica: int, engine: Engine | None, progress: _Progress) -> _Counts:
        """Feeds the replica's share of the input through its engine; every finished request's
        record goes to the replica's part files."""
        counts = _Counts()
        if engine is None:
            return counts
        writer = PartWriter(self.job, replica, every=self.args.commit_every, enabled=self.topology.leads(replica))
        replicas = self.topology.replicas
        requests = read_requests(self.args.input, self.defaults,
                                 lambda key: key not in self.finished and replica_of(key, replicas) == replica)
        running: dict[str, Request] = {}
        room = 2 * engine.config.max_slots   # requests held at once: the running ones and as many waiting
        exhausted = False

        def finish(request: Request, record: dict) -> None:
            writer.add(request.line, request.key, record)
            counts.requests += 1
            progress.update(1, 0)

        while not self.stop.is_set():
            while not exhausted and len(running) < room:
                request = next(requests, None)
                if request is None:
                    exhausted = True
                elif request.error is not None:
                    finish(request, error_record(request))
                else:
                    try:
                        engine.add(request.key, request.prompt, request.sampling, chat_options=request.chat_options)
                        running[request.key] = request
                    except (ValueError, TypeError) as e:  # the engine refuses it: the request's error
                        finish(request, error_record(request, str(e)))
            if not engine.has_work():
                break
            for update in engine.step():
                new = sum(len(t) for t in update.new_tokens.values())
                counts.tokens += new
                progress.update(0, new)
                if update.result is not None:
                    request = running.pop(update.request_id)
                    finish(request, result_record(request, update.result, self.model_name, engine.tokenizer))
        writer.commit()
        return counts

    # ----- the end -----
    def _finish(self) -> Summary:
        """Process 0 merges the parts into the output; every process learns what it holds."""
        values = np.zeros(3, np.int64)
        if jax.process_index() == 0:
            summary = self.job.merge(self.scan.count)
            self.job.finish(self.fingerprint, summary)
            values[:] = (summary.requests, summary.failed, summary.tokens)
        if jax.process_count() > 1:
            values = np.asarray(multihost_utils.broadcast_one_to_all(values))
        return Summary(*(int(v) for v in values))

    def _gather(self, counts: _Counts) -> _Counts:
        """This run's requests and tokens over all processes."""
        if jax.process_count() == 1:
            return counts
        total = np.asarray(multihost_utils.process_allgather(np.array([counts.requests, counts.tokens], np.int64)))
        return _Counts(int(total[:, 0].sum()), int(total[:, 1].sum()))

    def _report(self, summary: Summary, run: _Counts | None) -> int:
        """The summary line (process 0) and the exit status (every process)."""
        if jax.process_index() == 0:
            wall = time.perf_counter() - self.start
            this_run = ("the job was already complete" if run is None else
                        f"this run: {run.requests} requests, {run.tokens} tokens in {wall:.1f} s, "
                        f"{run.tokens / wall:.1f} tokens/s")
            print(f"{self.prog}: {summary.requests} requests ({summary.failed} failed), {summary.tokens} tokens; "
                  f"{this_run}; output {self.args.output}", file=sys.stderr)
        return 1 if summary.failed else 0


def fetchable_outputs(engine: Engine, mesh) -> None:
    """Makes a decode chunk's outputs readable on every process of a replica that spans several.

    The engine reads arrays spread over processes by gathering them (`Placement.to_host`), one
    collective per array. The engine's compiled chunk is wrapped here so that its host view, tokens,
    counts, finish codes (and log probabilities) come back replicated over the replica's mesh from
    the chunk's own program instead, and every process reads its local copy.
    """
    chunk = engine._chunk
    replicate = jax.jit(lambda *xs: xs, out_shardings=NamedSharding(mesh, P()))

    def run(*args, **kwargs):
        carry, view = chunk(*args, **kwargs)
        tokens, count, finish, view = replicate(carry.tokens, carry.count, carry.finish, view)
        logprobs = carry.logprobs if carry.logprobs is None else replicate(carry.logprobs)[0]
        return dataclasses.replace(carry, tokens=tokens, count=count, finish=finish, logprobs=logprobs), view

    engine._chunk = run


if __name__ == "__main__":
    sys.exit(main())
