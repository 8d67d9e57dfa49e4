"""The job directory: fingerprint checks, atomic parts as the record of finished ids, the merge in
input order (each key once, refused when results are missing), what a crash leaves behind."""

from __future__ import annotations

import json
import os

import pytest

import serve.parts as parts
from serve.parts import JobDir, JobError, PartWriter, Summary

FP = {"model": {"files": {"builtin": "tiny-k3-random"}}, "sampling": {"seed": 0}, "input": "abc", "max_len": None}


def record(key: str, failed: bool = False, tokens: int = 3) -> dict:
    if failed:
        return {"id": key, "custom_id": key, "response": None, "error": {"code": "invalid_request", "message": "no"}}
    return {"id": key, "custom_id": key, "error": None,
            "response": {"status_code": 200, "body": {"usage": {"completion_tokens": tokens}}}}


def test_new_resume_complete_and_refusals(tmp_path):
    out = tmp_path / "out.jsonl"
    job = JobDir(str(out))
    assert job.check(FP) == "new"
    job.create(FP)
    assert job.check(FP) == "resume"
    assert sorted(os.listdir(job.path)) == ["job.json", "parts"]
    with pytest.raises(JobError, match="unfinished job with another input, sampling"):
        job.check({**FP, "input": "other", "sampling": {"seed": 1}})
    w = PartWriter(job, 0)
    w.add(1, "id:a", record("a"))
    w.commit()
    job.finish(FP, job.merge(1))
    assert job.check(FP) == "complete" and not os.path.exists(job.parts)
    assert job.summary() == Summary(1, 0, 3)
    with pytest.raises(JobError, match="finished job with another model"):
        job.check({**FP, "model": "x"})
    out.unlink()
    with pytest.raises(JobError, match="records a finished job but .* is missing"):
        job.check(FP)


def test_foreign_output_and_foreign_job_directory_are_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("mine\n")
    with pytest.raises(JobError, match="exists and was not written by a batch job"):
        JobDir(str(out)).check(FP)
    other = tmp_path / "b.jsonl"
    (tmp_path / "b.jsonl.job").mkdir()
    with pytest.raises(JobError, match="not a batch-job directory"):
        JobDir(str(other)).check(FP)
    assert out.read_text() == "mine\n"


def test_parts_record_finished_ids_and_merge_in_input_order(tmp_path):
    job = JobDir(str(tmp_path / "out.jsonl"))
    job.create(FP)
    a, b = PartWriter(job, 0, every=2), PartWriter(job, 1, every=100)
    a.add(5, "id:e", record("e"))
    a.add(2, "id:b", record("b", failed=True))     # second record: committed, sorted by line
    b.add(1, "id:a", record("a", tokens=7))
    b.add(4, "id:d", record("d"))
    assert job.finished() == {"id:e", "id:b"}       # b's records wait in memory until it commits
    b.commit()
    assert job.finished() == {"id:a", "id:b", "id:d", "id:e"}
    names = sorted(os.path.basename(p) for p in job.part_files())
    assert names == [f"r0000-{a.token}-000000.jsonl", f"r0001-{b.token}-000000.jsonl"] and a.token != b.token
    with pytest.raises(JobError, match="hold 4 of the 5 results"):
        job.merge(5)
    assert not os.path.exists(job.output) and not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]
    summary = job.merge(4)
    assert summary == Summary(4, 1, 13)
    lines = [json.loads(x) for x in open(job.output)]
    assert [x["custom_id"] for x in lines] == ["a", "b", "d", "e"]


def test_merge_drops_a_key_committed_twice_and_handles_many_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(parts, "FAN_IN", 3)
    job = JobDir(str(tmp_path / "out.jsonl"))
    job.create(FP)
    for i in range(10):                            # ten parts: merged three at a time
        w = PartWriter(job, i % 2, every=1)
        w.add(10 - i, f"id:{10 - i}", record(str(10 - i)))
    PartWriter(job, 7, every=1).add(3, "id:3", record("3"))
    assert job.merge(10).requests == 10
    assert [json.loads(x)["custom_id"] for x in open(job.output)] == [str(i) for i in range(1, 11)]


def test_a_killed_commit_leaves_only_a_temporary_file_that_the_next_start_removes(tmp_path, monkeypatch):
    job = JobDir(str(tmp_path / "out.jsonl"))
    job.create(FP)
    w = PartWriter(job, 0)
    w.add(1, "id:a", record("a"))

    def killed(src, dst):
        raise KeyboardInterrupt                    # dies between the write and the rename

    monkeypatch.setattr(os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        w.commit()
    monkeypatch.undo()
    assert job.finished() == set() and job.part_files() == []
    leftover = tmp_path / "out.jsonl.job" / "parts" / ".tmp-stale"
    leftover.write_text("partial")
    (tmp_path / ".tmp-out.jsonl-123").write_text("partial merge")
    job.clear_temps()
    assert os.listdir(job.parts) == [] and not (tmp_path / ".tmp-out.jsonl-123").exists()


def test_create_is_atomic_and_clears_a_killed_start(tmp_path):
    out = tmp_path / "out.jsonl"
    stale = tmp_path / "out.jsonl.job.tmp-999"
    stale.mkdir()
    (stale / "job.json").write_text("{")
    JobDir(str(out)).create(FP)
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl.job"]
    with pytest.raises(JobError, match="appeared while this job started"):
        JobDir(str(out)).create(FP)
