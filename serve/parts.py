"""The job directory beside the output: the job's fingerprint, the part files its replicas commit,
and the final merge into the output.

    results.jsonl.job/
        job.json         {"format": 1, "fingerprint": {...}, "complete": false}
        parts/r0003-9f2c41d0-000012.jsonl
                         a committed part: finished records of replica 3 sorted by input line
                         (named by replica, its writer's random token and sequence number)
        parts/.tmp-...   a part being written (removed when the job starts again)

Every file appears complete or not at all: it is written under a temporary name, fsynced and
renamed (then the directory is fsynced). The committed parts are the record of finished requests:
a restarted job skips every key they hold. job.json is written once when the job is created (the
fingerprint a restart must match) and rewritten when the output is complete (the parts are then
deleted; the small job.json stays, so a re-run of the finished job is recognised, and a job with
another fingerprint refused).
"""

from __future__ import annotations

import glob
import heapq
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Iterator

from serve.records import completion_tokens

FORMAT = 1
FAN_IN = 256  # part files merged at once (open files)
_PART = re.compile(r"r\d{4}-[0-9a-f]{8}-\d{6}\.jsonl$")


class JobError(ValueError):
    """The job cannot start or finish as asked (another job's output, a changed input, ...)."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, lines: Iterator[str]) -> None:
    """Writes `lines` to `path` through a temporary file in the same directory: fsync, rename,
    fsync of the directory."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".tmp-{name}-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory or ".")


@dataclass(frozen=True)
class Summary:
    """What the final output holds."""

    requests: int
    failed: int
    tokens: int


class JobDir:
    """`<output>.job/`: see the module docstring."""

    def __init__(self, output: str):
        self.output = os.path.abspath(output)
        self.path = self.output + ".job"
        self.parts = os.path.join(self.path, "parts")
        self.manifest = os.path.join(self.path, "job.json")

    # ----- state -----
    def read(self) -> dict | None:
        """job.json, or None when there is no job directory."""
        if not os.path.lexists(self.path):
            return None
        try:
            with open(self.manifest, encoding="utf-8") as f:
                state = json.load(f)
            if not isinstance(state, dict) or state.get("format") != FORMAT:
                raise ValueError("not a batch-job manifest")
            return state
        except (OSError, ValueError):
            raise JobError(f"{self.path} exists but is not a batch-job directory (no readable job.json); "
                           "remove it or choose another --output") from None

    def check(self, fingerprint: dict) -> str:
        """"new", "resume" or "complete" for a job of `fingerprint`; raises JobError when the output or
        the job directory belongs to another job."""
        state = self.read()
        if state is None:
            if not os.path.isdir(os.path.dirname(self.output)):
                raise JobError(f"the directory of {self.output} does not exist")
            if os.path.lexists(self.output):
                raise JobError(f"{self.output} exists and was not written by a batch job ({self.path} is missing); "
                               "remove it or choose another --output")
            return "new"
        recorded = state.get("fingerprint", {})
        differ = [k for k in sorted(set(recorded) | set(fingerprint)) if recorded.get(k) != fingerprint.get(k)]
        kind = "a finished" if state.get("complete") else "an unfinished"
        if differ:
            raise JobError(f"{self.path} holds {kind} job with another {', '.join(differ)}; run that job again, "
                           f"or remove {self.output} and {self.path} to start over")
        if state.get("complete"):
            if not os.path.exists(self.output):
                raise JobError(f"{self.path} records a finished job but {self.output} is missing; "
                               f"remove {self.path} to run it again")
            return "complete"
        return "resume"

    def create(self, fingerprint: dict) -> None:
        """Creates the job directory with its manifest, atomically (a directory renamed into place)."""
        for stale in glob.glob(f"{glob.escape(self.path)}.tmp-*"):  # from a start that was killed
            shutil.rmtree(stale, ignore_errors=True)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        os.makedirs(os.path.join(tmp, "parts"))
        write_atomic(os.path.join(tmp, "job.json"), [json.dumps(self._state(fingerprint), indent=1)])
        try:
            os.rename(tmp, self.path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise JobError(f"{self.path} appeared while this job started (another job on the same output?)") from None
        fsync_dir(os.path.dirname(self.path))

    @staticmethod
    def _state(fingerprint: dict, summary: Summary | None = None) -> dict:
        state = {"format": FORMAT, "fingerprint": fingerprint, "complete": summary is not None}
        if summary is not None:
            state["summary"] = {"requests": summary.requests, "failed": summary.failed, "tokens": summary.tokens}
        return state

    def summary(self) -> Summary:
        s = self.read()["summary"]
        return Summary(s["requests"], s["failed"], s["tokens"])

    # ----- parts -----
    def clear_temps(self) -> None:
        """Removes the temporary files of interrupted commits and merges (call before anyone commits)."""
        output_dir, name = os.path.split(self.output)
        for pattern in (os.path.join(glob.escape(self.parts), ".tmp-*"),
                        os.path.join(glob.escape(output_dir), f".tmp-{glob.escape(name)}-*")):
            for path in glob.glob(pattern):
                os.unlink(path)

    def part_files(self) -> list[str]:
        return sorted(p for p in glob.glob(os.path.join(glob.escape(self.parts), "r*.jsonl")) if _PART.search(p))

    def finished(self) -> set[str]:
        """The keys of every committed record (all replicas)."""
        return {entry["key"] for path in self.part_files() for entry in _entries(path)}

    # ----- the end -----
    def merge(self, expected: int) -> Summary:
        """Writes the output from the parts, in input order, each key once; refuses (JobError, the
        output untouched) when the parts do not hold `expected` records."""
        counts = [0, 0, 0]

        def lines() -> Iterator[str]:
            previous = None
            for entry in self._merged(self.part_files()):
                if entry["key"] == previous:
                    continue
                previous, record = entry["key"], entry["record"]
                counts[0] += 1
                counts[1] += record.get("error") is not None
                counts[2] += completion_tokens(record)
                yield json.dumps(record, ensure_ascii=False) + "\n"
            if counts[0] != expected:
                raise JobError(f"the parts in {self.parts} hold {counts[0]} of the {expected} results; "
                               "run the job again to finish it")

        write_atomic(self.output, lines())
        return Summary(*counts)

    def finish(self, fingerprint: dict, summary: Summary) -> None:
        """Marks the job complete and deletes its parts (after the output is in place)."""
        write_atomic(self.manifest, [json.dumps(self._state(fingerprint, summary), indent=1)])
        self.drop_parts()

    def drop_parts(self) -> None:
        """Deletes the parts of a complete job (also what a kill during `finish` left)."""
        shutil.rmtree(self.parts, ignore_errors=True)

    def _merged(self, files: list[str]) -> Iterator[dict]:
        """Entries of sorted part files as one sorted stream, FAN_IN files open at most."""
        while len(files) > FAN_IN:  # merge groups into temporary parts first
            groups = [files[i:i + FAN_IN] for i in range(0, len(files), FAN_IN)]
            files = []
            for n, group in enumerate(groups):
                path = os.path.join(self.parts, f".tmp-merge-{time.monotonic_ns()}-{n}")
                write_atomic(path, (json.dumps(e, ensure_ascii=False) + "\n"
                                    for e in heapq.merge(*map(_entries, group), key=lambda e: e["line"])))
                files.append(path)
        return heapq.merge(*map(_entries, files), key=lambda e: e["line"])


def _entries(path: str) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for text in f:
            yield json.loads(text)


class PartWriter:
    """Collects the finished records of one replica and commits them as part files: when `every`
    records are waiting or `interval_s` has passed since the last commit, and at the end. A
    replica's lockstep partners (processes that run it but do not lead it) keep nothing. Part names
    carry a random token, so a commit never replaces another's part (not even that of a process of
    an earlier run still alive); a key committed twice is merged once."""

    def __init__(self, job: JobDir, replica: int, *, every: int = 256, interval_s: float = 30.0,
                 enabled: bool = True):
        self.job, self.replica, self.every, self.interval_s, self.enabled = job, replica, every, interval_s, enabled
        self.token, self.seq = secrets.token_hex(4), 0   # names no other writer, this run or another, can take
        self.pending: list[dict] = []
        self.last = time.monotonic()

    def add(self, line: int, key: str, record: dict) -> None:
        if self.enabled:
            self.pending.append({"line": line, "key": key, "record": record})
        if len(self.pending) >= self.every or time.monotonic() - self.last >= self.interval_s:
            self.commit()

    def commit(self) -> None:
        self.last = time.monotonic()
        if not self.pending:
            return
        entries = sorted(self.pending, key=lambda e: e["line"])
        path = os.path.join(self.job.parts, f"r{self.replica:04d}-{self.token}-{self.seq:06d}.jsonl")
        write_atomic(path, (json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
        self.seq += 1
        self.pending = []
