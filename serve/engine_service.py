"""Runs the continuous-batching engine on its own thread for an asyncio server: requests are
checked and queued from the event loop, the engine thread adds them between steps and hands each
step's updates back to the request's asyncio queue; cancelled requests free their slots at the next
step. Keeps the serving metrics (k3jax.engine is single-threaded; only this thread touches it)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from k3jax.engine import Engine, EngineUpdate
from k3jax.sampling import SamplingParams

logger = logging.getLogger(__name__)

# Histogram bucket bounds in seconds (Prometheus style, cumulative).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class QueueFull(Exception):
    """More requests are waiting than the server accepts (answered with HTTP 429)."""


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1


@dataclass
class _Pending:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    tokens: int = 0


class EngineService:
    """The engine thread. `submit` returns an asyncio.Queue that receives EngineUpdates (and an
    Exception if the request failed inside the engine); `cancel` drops a request."""

    def __init__(self, engine: Engine, *, max_waiting: int = 256):
        self.engine, self.max_waiting = engine, max_waiting
        self._inbox: collections.deque[_Pending] = collections.deque()
        self._cancels: collections.deque[str] = collections.deque()
        self._pending: dict[str, _Pending] = {}
        self._wake = threading.Condition()
        self._ids = itertools.count()
        self._stop = False
        self._counts = (0, 0)  # (running, waiting in the engine), written by the engine thread after each step
        self._live = 0  # requests accepted by submit and not ended yet (under self._wake)
        self.ttft, self.tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)
        self.finished = collections.Counter()
        self.generated_tokens = 0
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="k3jax-engine", daemon=True)
        self._thread.start()

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> asyncio.Queue:
        """Queues a checked request; raises QueueFull when too many are waiting."""
        with self._wake:
            if self.num_waiting >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting")
            self._live += 1
            pending = _Pending(request_id, prompt_ids, sampling, asyncio.get_running_loop(), asyncio.Queue())
            self._inbox.append(pending)
            self._wake.notify()
        return pending.queue

    def cancel(self, request_id: str) -> None:
        with self._wake:
            self._cancels.append(request_id)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    @property
    def num_running(self) -> int:
        return self._counts[0]

    @property
    def num_waiting(self) -> int:
        """Requests not decoding yet: every accepted request that has not ended, less those decoding
        as of the engine's last step (a request handed to the engine since then counts as waiting)."""
        return max(0, self._live - self._counts[0])

    def _ended(self, n: int = 1) -> None:
        with self._wake:
            self._live -= n

    # ----- the engine thread -----
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stop or self._inbox or self._cancels or self.engine.has_work()):
                    self._wake.wait()
                if self._stop:
                    return
                inbox, self._inbox = list(self._inbox), collections.deque()
                cancels, self._cancels = list(self._cancels), collections.deque()
            for pending in inbox:
                try:
                    self.engine.add(pending.request_id, pending.prompt_ids, pending.sampling)
                    self._pending[pending.request_id] = pending
                except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
                    self._deliver(pending, e)
                    self._ended()
            for request_id in cancels:
                if self._pending.pop(request_id, None) is not None:
                    self.engine.abort(request_id)
                    self.finished["cancelled"] += 1
                    self._ended()
            try:
                updates = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail every running request, keep serving
                logger.exception("engine step failed")
                for pending in list(self._pending.values()):
                    self.engine.abort(pending.request_id)
                    self._deliver(pending, e)
                self._ended(len(self._pending))
                self._pending.clear()
                continue
            self._counts = (self.engine.num_running, self.engine.num_waiting)
            now = time.monotonic()
            for update in updates:
                pending = self._pending.get(update.request_id)
                if pending is None:
                    continue
                new = sum(len(t) for t in update.new_tokens.values())
                self.generated_tokens += new
                if new and pending.first_token is None:
                    pending.first_token = now
                    self.ttft.observe(now - pending.submitted)
                pending.tokens += new
                if update.result is not None:
                    del self._pending[update.request_id]
                    self._ended()
                    self.finished[update.result.finish_reason] += 1
                    if pending.first_token is not None and pending.tokens > 1:
                        self.tpot.observe((now - pending.first_token) / (pending.tokens - 1))
                self._deliver(pending, update)

    @staticmethod
    def _deliver(pending: _Pending, item: EngineUpdate | Exception) -> None:
        try:
            pending.loop.call_soon_threadsafe(pending.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone
            pass

    def metrics_text(self) -> str:
        """The metrics in Prometheus' text format."""
        lines = []

        def gauge(name, value, help_text, kind="gauge"):
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"])

        def histogram(name, h: Histogram, help_text):
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} histogram"])
            for bound, count in zip(h.bounds, h.counts):
                lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
            lines.extend([f'{name}_bucket{{le="+Inf"}} {h.n}', f"{name}_sum {h.total}", f"{name}_count {h.n}"])

        gauge("k3jax_requests_running", self.num_running, "requests decoding now")
        gauge("k3jax_requests_waiting", self.num_waiting, "requests queued for a free slot")
        gauge("k3jax_generation_tokens_total", self.generated_tokens, "tokens generated", "counter")
        elapsed = max(time.monotonic() - self.started, 1e-9)
        gauge("k3jax_generation_tokens_per_second", self.generated_tokens / elapsed,
              "tokens generated per second since start")
        for reason, count in sorted(self.finished.items()):
            lines.append(f'k3jax_requests_finished_total{{reason="{reason}"}} {count}')
        histogram("k3jax_time_to_first_token_seconds", self.ttft, "time from arrival to the first token")
        histogram("k3jax_time_per_output_token_seconds", self.tpot, "time per output token after the first")
        return "\n".join(lines) + "\n"
