"""The batch job in this process (8 CPU devices): results equal static generation, malformed lines
become error records, exactly once across interruptions, and one-line refusals that leave
nothing behind."""

from __future__ import annotations

import json
import os

import pytest
from checkpoints import builtin_checkpoint

import k3jax
from serve import batch, cli
from serve.parts import JobDir, PartWriter
from serve.requests_file import Defaults, parse_line

MODEL = "tiny-kimi-linear"
ENGINE = ["--max-len", "128", "--max-slots", "4", "--chunk-steps", "4", "--no-progress"]

LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6}},
    {"id": "sampled", "prompt": "The quick brown fox", "max_tokens": 7, "temperature": 0.9, "top_p": 0.9, "n": 2},
    {"id": "seeded", "prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 1.0, "seed": 11, "ignore_eos": True},
    "this line is not JSON",
    {"id": "too-long", "prompt": "x", "max_tokens": 500},
    {"custom_id": "stop", "url": "/v1/completions",
     "body": {"prompt": "Hello, world!", "max_tokens": 12, "stop": ["e"], "ignore_eos": True}},
    {"id": "logprobs", "prompt": [9, 10], "max_tokens": 4, "logprobs": 2, "ignore_eos": True},
    "",
    {"custom_id": "typo", "body": {"prompt": "x", "max_tokenz": 3}},
] + [{"id": f"g{i}", "prompt": [3 + i, 40, 50 + i], "max_tokens": 3 + i % 5, "ignore_eos": True} for i in range(7)]


def write_input(path, lines) -> str:
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def run(tmp_path, lines=LINES, *extra, model=MODEL, mesh="data=1", output="out.jsonl", input_name="in.jsonl"):
    inp = write_input(tmp_path / input_name, lines) if lines is not None else str(tmp_path / input_name)
    out = tmp_path / output
    rc = batch.main(["--model", model, "--input", inp, "--output", str(out), "--mesh", mesh, *ENGINE, *extra],
                    prog="run-batch")
    return rc, out


def records(out) -> list[dict]:
    return [json.loads(x) for x in open(out)]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    """tiny-kimi-linear's first two layers (KDA and MLA, dense and MoE) with its tokenizer: the
    model of the tests that generate."""
    return str(builtin_checkpoint(tmp_path_factory.mktemp("batch") / "model", MODEL, 2))


@pytest.fixture(scope="module")
def generator(small):
    return k3jax.Generator(k3jax.load_model(small))


def test_results_equal_static_generation_and_bad_lines_become_records(tmp_path, small, generator, capsys):
    rc, out = run(tmp_path, LINES, model=small, mesh="data=2")    # two replicas on two devices, one thread each
    err = capsys.readouterr().err
    assert rc == 1, err
    got = records(out)
    numbered = [(n, line) for n, line in enumerate(LINES, 1) if line != ""]
    assert len(got) == len(numbered)                 # one record per line, in input order
    defaults = Defaults(batch.default_sampling(batch.build_parser("x").parse_args(
        ["--model", MODEL, "--input", "i", "--output", "o"])))
    parsed = [parse_line((line if isinstance(line, str) else json.dumps(line)).encode(), n, defaults)
              for n, line in numbered]
    ran = [request for request, rec in zip(parsed, got) if rec["error"] is None]
    # Static generation of every request that ran, in one batch of rows (rows do not interact).
    refs = dict(zip((r.key for r in ran), generator.generate([r.prompt for r in ran], [r.sampling for r in ran])))
    for (n, line), request, rec in zip(numbered, parsed, got):
        assert rec["custom_id"] == request.id
        if rec["error"] is not None:
            assert rec["response"] is None and rec["error"]["line"] == n
            continue
        ref = refs[request.key]
        body = rec["response"]["body"]
        assert body["usage"] == {"prompt_tokens": len(ref.prompt_token_ids),
                                 "completion_tokens": sum(len(c.token_ids) for c in ref.outputs),
                                 "total_tokens": len(ref.prompt_token_ids) + sum(len(c.token_ids) for c in ref.outputs)}
        for choice, c in zip(body["choices"], ref.outputs, strict=True):
            text = choice["message"]["content"] if request.chat else choice["text"]
            assert (text, choice["token_ids"], choice["finish_reason"]) == (c.text, c.token_ids, c.finish_reason)
    by_id = {r["custom_id"]: r for r in got}
    assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["error"]["line"] == 4
    assert "exceeds the engine's max_len 128" in by_id["too-long"]["error"]["message"]
    assert "unsupported field 'max_tokenz'" in by_id["typo"]["error"]["message"]
    assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"
    assert by_id["stop"]["response"]["body"]["object"] == "text_completion"
    assert len(by_id["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]) == 4
    assert [r["custom_id"] for r in got if r["error"]] == [None, "too-long", "typo"]
    assert err.strip().splitlines()[-1].startswith(f"run-batch: {len(numbered)} requests (3 failed)")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl", "out.jsonl.job"]
    assert os.listdir(tmp_path / "out.jsonl.job") == ["job.json"]

    before = out.read_bytes()                       # the same command again: nothing to do, same status
    assert run(tmp_path, LINES, model=small, mesh="data=2")[0] == 1
    assert out.read_bytes() == before and "already complete" in capsys.readouterr().err


def test_interrupted_runs_resume_to_the_same_output(tmp_path, small, monkeypatch, capsys):
    lines = [line for line in LINES if line != "" and not isinstance(line, str)]
    rc, clean = run(tmp_path, lines, output="clean.jsonl", model=small)
    assert rc == 1

    commits = []
    real_commit = PartWriter.commit

    def dies_on_the_third(self):                    # a kill between two commits
        if self.pending and len(commits) == 2:
            raise KeyboardInterrupt
        commits.append(len(self.pending))
        real_commit(self)

    monkeypatch.setattr(PartWriter, "commit", dies_on_the_third)
    assert run(tmp_path, lines, "--commit-every", "2", output="out.jsonl", model=small)[0] == 130
    monkeypatch.undo()
    job = JobDir(str(tmp_path / "out.jsonl"))
    assert len(job.finished()) == 4 and not os.path.exists(job.output)

    def dies_after_the_merge(self, fingerprint, summary):
        raise KeyboardInterrupt

    monkeypatch.setattr(JobDir, "finish", dies_after_the_merge)
    assert run(tmp_path, lines, output="out.jsonl", model=small)[0] == 130
    monkeypatch.undo()
    assert "this run: 6 requests" not in capsys.readouterr().err
    assert run(tmp_path, lines, output="out.jsonl", model=small)[0] == 1   # every id was done: merges again
    assert "this run: 0 requests" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_bytes() == clean.read_bytes()
    assert os.listdir(job.path) == ["job.json"]


def test_a_resume_with_other_settings_is_refused(tmp_path, small, monkeypatch, capsys):
    lines = [{"id": i, "prompt": [5, 6, i + 7], "max_tokens": 4} for i in range(3)]

    def dies(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(PartWriter, "commit", dies)
    assert run(tmp_path, lines, model=small)[0] == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert run(tmp_path, lines, "--seed", "1", model=small)[0] == 2
    assert capsys.readouterr().err.strip() == (
        f"run-batch: error: {tmp_path}/out.jsonl.job holds an unfinished job with another sampling; run that job "
        f"again, or remove {tmp_path}/out.jsonl and {tmp_path}/out.jsonl.job to start over")
    assert run(tmp_path, lines[:2], model=small)[0] == 2
    assert "another input" in capsys.readouterr().err
    assert run(tmp_path, lines, "--dtype", "bfloat16", model=small)[0] == 2
    assert "another model" in capsys.readouterr().err
    assert run(tmp_path, lines, model=small)[0] == 0


def test_an_empty_input_gives_an_empty_output(tmp_path, capsys):
    for lines in ([], ["", "  "]):
        rc, out = run(tmp_path, lines, output=f"out{len(lines)}.jsonl")
        assert rc == 0 and out.read_bytes() == b""
        assert "0 requests (0 failed)" in capsys.readouterr().err


def test_k3jax_run_batch_is_the_job(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_input(tmp_path / "in.jsonl", [])
    argv = ["run-batch", "--model", MODEL, "--input", "in.jsonl", "--output", "out.jsonl", "--mesh", "data=1", *ENGINE]
    assert cli.main(argv) == 0 and (tmp_path / "out.jsonl").read_bytes() == b""
    assert capsys.readouterr().err.startswith("k3jax run-batch: 0 requests (0 failed)")
    assert cli.main([*argv, "--max-slots", "0"]) == 2
    assert capsys.readouterr().err.startswith("k3jax run-batch: error: --max-slots must be a positive integer")


REFUSALS = {  # case: (extra arguments, what the one error line says)
    "duplicate ids": ([], "duplicate id 'a' on lines 1 and 3"),
    "missing input": (["--input", "nowhere.jsonl"], "cannot read nowhere.jsonl"),
    "foreign output": ([], "exists and was not written by a batch job"),
    "no output directory": (["--output", "missing/out.jsonl"], "does not exist"),
    "bad mesh": (["--mesh", "data=x"], "bad mesh spec"),
    "zero slots": (["--max-slots", "0"], "--max-slots must be a positive integer"),
    "unknown model": (["--model", "nope"], "unknown model 'nope'"),
    "max-len over the limit": (["--max-len", str(1 << 21)], "exceeds the model's context limit"),
    "bad device ids": (["--local-device-ids", "0,x"], "--local-device-ids must be"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_are_one_line_and_leave_nothing_behind(tmp_path, capsys, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    extra, expect = REFUSALS[case]
    lines = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}]
    lines += [{"id": "a", "prompt": "z"}] if case == "duplicate ids" else []
    write_input(tmp_path / "in.jsonl", lines)
    if case == "foreign output":
        (tmp_path / "out.jsonl").write_text("keep me\n")
    before = sorted(os.listdir(tmp_path))
    argv = ["--model", MODEL, "--input", "in.jsonl", "--output", "out.jsonl", "--mesh", "data=1", *ENGINE, *extra]
    assert batch.main(argv, prog="run-batch") == 2       # argparse: the last of a repeated option wins
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("run-batch: error: ") and expect in err[0], err
    assert sorted(os.listdir(tmp_path)) == before
    assert case != "foreign output" or (tmp_path / "out.jsonl").read_text() == "keep me\n"
