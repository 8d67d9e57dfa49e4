"""The README's main command and the CLI's errors."""

from __future__ import annotations

import pytest
from checkpoints import builtin_checkpoint

from k3jax.cli import main


def test_generate_on_the_builtin_model(capsys):
    assert main(["generate", "--model", "tiny-kimi-linear", "--prompt", "Hello", "--prompt", "Hi there",
                 "--max-new-tokens", "5", "--chat"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt 0 (" in out and "--- prompt 1 (" in out
    assert "tok/s" in out


def test_generate_errors_are_one_line(capsys):
    assert main(["generate", "--model", "tiny-gpt", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3jax generate: error: unknown model 'tiny-gpt'") and "\n" not in err
    assert main(["generate", "--model", "tiny-k3-random", "--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p must be a finite number in (0.0, 1.0], got 0.0" in capsys.readouterr().err


def test_speculative_flags(tmp_path, capsys):
    k3 = str(builtin_checkpoint(tmp_path / "k3", "tiny-k3-random", 4))   # MTP in 4 layers, not 13
    assert main(["generate", "--model", k3, "--prompt", "def f(x):", "--max-tokens", "6", "--speculative", "mtp",
                 "--num-speculative-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "speculative mtp:" in out and "tokens per verify step" in out
    assert main(["generate", "--model", "tiny-kimi-linear", "--prompt", "x", "--speculative", "mtp"]) == 2
    assert "needs MTP layers" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-k3-random", "--prompt", "x", "--speculative", "ngram",
                 "--num-speculative-tokens", "0"]) == 2
    assert "num_draft_tokens must be an integer in [1, 16], got 0" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-k3-random", "--prompt", "x", "--num-speculative-tokens", "2"]) == 2
    assert "--num-speculative-tokens needs --speculative" in capsys.readouterr().err


def test_implementation_flags_use_the_option_names(capsys):
    assert main(["generate", "--model", "tiny-kimi-linear", "--prompt", "Hi", "--max-new-tokens", "3",
                 "--kda", "recurrent", "--mla", "naive", "--moe", "dense"]) == 0
    assert "tok/s" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "tiny-k3-random", "--prompt", "x", "--kda", "fast"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_verify_subcommand(oracle_dir, tmp_path, capsys):
    from k3jax.checkpoint.convert import convert

    convert(oracle_dir / "hf" / "kl_alt", tmp_path / "ck")
    assert main(["verify", str(tmp_path / "ck")]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["verify", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("k3jax verify: error:")


@pytest.mark.parametrize("command", [[], ["generate"], ["convert"], ["verify"]])
def test_every_help_has_examples(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main(command + ["--help"])
    assert exit_info.value.code == 0
    assert "examples:" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [["--log-level", "info"], ["--log-level=info"]])
def test_the_log_level_reaches_delegated_commands(tmp_path, capsys, flag):
    import logging

    logger = logging.getLogger("k3jax")
    before = logger.level
    try:
        assert main([*flag, "verify", str(tmp_path / "missing")]) == 1   # verification failed: no manifest
        assert logger.level == logging.INFO
        assert "k3jax verify: error:" in capsys.readouterr().err
    finally:
        logger.setLevel(before)
    with pytest.raises(SystemExit):
        main(["--log-level", "loud", "verify", str(tmp_path)])
    assert "invalid choice: 'loud'" in capsys.readouterr().err
