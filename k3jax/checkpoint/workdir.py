"""DST.partial, the converter's work directory: owned, locked and journalled.

A conversion works in `DST.partial/` and renames it to DST when complete. The directory counts as
the converter's only when it holds the marker file (created first thing), or the journal of an
older k3jax, or nothing at all; anything else of that name is left alone with an error. The marker
is also the lock: an exclusive `flock` on it, held for the whole run, makes a second conversion
into the same DST fail at once. The journal begins with the run's identity (format, options and a
fingerprint of the source) and lists every finished tensor; only a run of the same identity
resumes from it, so tensors of two sources or two option sets are never mixed.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat

from k3jax.checkpoint.safetensors_io import CheckpointError

MARKER = ".k3jax-convert"
JOURNAL = "progress.jsonl"
_MARKER_TEXT = "work directory of a running or interrupted `k3jax convert` into {}; remove it to start over\n"


def _journal_lines(file: str):
    """(entry, byte offset of the line's end) of the journal's whole lines, up to the first line cut by
    a kill or a full disk (everything after it is redone)."""
    end = 0
    with open(file, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            try:
                entry = json.loads(raw.decode("utf-8", errors="replace"))
            except json.JSONDecodeError:
                return
            end += len(raw)
            if isinstance(entry, dict):
                yield entry, end


def _journal_entries(file: str):
    """The journal's entries up to the first line cut by a kill (everything after it is redone)."""
    for entry, _ in _journal_lines(file):
        yield entry


def _has_our_journal(path: str) -> bool:
    """A journal whose first entry is a k3jax conversion identity (as older k3jax versions wrote)."""
    file = os.path.join(path, JOURNAL)
    if not os.path.isfile(file):
        return False
    first = next(_journal_entries(file), {})
    identity = first.get("identity")
    return isinstance(identity, dict) and str(identity.get("format", "")).startswith("k3jax-orbax/")


def _differences(old: dict, new: dict) -> str:
    """What differs between two run identities, for the refusal message."""
    changed, parts = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key):
            continue
        if key == "shards" and isinstance(old.get(key), list):
            before = {s.get("file"): s for s in old[key] if isinstance(s, dict)}
            after = {s["file"]: s for s in new[key]}
            changed += sorted(str(f) for f in set(before) | set(after) if before.get(f) != after.get(f))
        elif key == "config_sha256":
            changed.append("config.json")
        elif key == "chunks_sha256":
            parts.append("the arrays' chunk layout differs (written by another k3jax version)")
        else:
            parts.append(f"{key} was {old.get(key)!r}, now {new.get(key)!r}")
    return "; ".join(([f"source changed since: {', '.join(changed)}"] if changed else []) + parts)


class WorkDir:
    """DST.partial for one conversion run: create or adopt it with `acquire`, then `resume`, and end
    with `commit` (rename to DST), `remove` or `release` (keep it for a later run)."""

    def __init__(self, dst: str):
        self.dst = dst
        self.path = dst + ".partial"
        self.created = False  # this run made the directory
        self._lock: int | None = None

    def acquire(self) -> None:
        """Creates DST.partial, or adopts one this converter made, and locks it.

        Raises CheckpointError, deleting nothing, when DST.partial is not the converter's or another
        conversion holds it."""
        try:
            os.mkdir(self.path)
            self.created = True
        except FileExistsError:
            self._check_ours()
        marker = os.path.join(self.path, MARKER)
        busy = CheckpointError(f"another conversion into {self.dst} is running ({self.path} is locked); "
                               f"wait for it to finish or stop it")
        try:
            fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            raise busy from None  # the directory was just committed or removed by the run holding it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not os.path.samestat(os.fstat(fd), os.stat(marker, follow_symlinks=False)):
                raise FileNotFoundError
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            raise busy from None
        if os.fstat(fd).st_size == 0:
            os.write(fd, _MARKER_TEXT.format(self.dst).encode())
        self._lock = fd

    def _check_ours(self) -> None:
        st = os.lstat(self.path)
        ours = stat.S_ISDIR(st.st_mode) and (
            os.path.isfile(os.path.join(self.path, MARKER)) and not os.path.islink(os.path.join(self.path, MARKER))
            or _has_our_journal(self.path) or not os.listdir(self.path))
        if not ours:
            raise CheckpointError(f"{self.path} exists and was not created by k3jax convert; move it away or "
                                  f"remove it yourself")

    def resume(self, identity: dict, restart: bool) -> dict[str, str]:
        """Finished tensors (name -> sha256) an interrupted run of the same `identity` journalled;
        an empty journal beginning with `identity` otherwise. Raises CheckpointError, keeping
        everything, when the directory holds work of another identity and `restart` is False."""
        identity = json.loads(json.dumps(identity))  # as the journal stores it
        file = os.path.join(self.path, JOURNAL)
        recorded, done, good = None, {}, 0
        if os.path.isfile(file):
            for entry, good in _journal_lines(file):
                if "identity" in entry and recorded is None:
                    recorded = entry["identity"]
                elif isinstance(entry.get("tensor"), str) and isinstance(entry.get("sha256"), str):
                    done[entry["tensor"]] = entry["sha256"]
        if recorded is not None and recorded != identity and done and not restart:
            raise CheckpointError(f"{self.path} holds an interrupted conversion of another source or with other "
                                  f"options ({_differences(recorded, identity)}); run again with --restart to "
                                  f"discard it, or choose another destination")
        if recorded != identity or restart or not done:
            self.clear()
            with open(file, "w") as f:
                f.write(json.dumps({"identity": identity}) + "\n")
            return {}
        if os.path.getsize(file) > good:   # a cut last line: entries appended after it would be unreadable
            os.truncate(file, good)
        return done

    def journal(self):
        """The journal, opened for appending finished tensors."""
        return open(os.path.join(self.path, JOURNAL), "a")

    def clear(self) -> None:
        """Deletes everything in DST.partial but the marker (the lock)."""
        for name in os.listdir(self.path):
            if name != MARKER:
                target = os.path.join(self.path, name)
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                else:
                    os.remove(target)

    def remove(self) -> None:
        """Deletes DST.partial (the marker last, so no other run mistakes it for a foreign directory)."""
        try:
            self.clear()
            os.remove(os.path.join(self.path, MARKER))
            os.rmdir(self.path)
        finally:
            self.release()

    def commit(self) -> None:
        """Renames the finished DST.partial to DST (DST appears complete or not at all), then drops
        the journal and the marker from it."""
        try:
            os.rename(self.path, self.dst)
            for name in (JOURNAL, MARKER):
                os.remove(os.path.join(self.dst, name))
        finally:
            self.release()

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
