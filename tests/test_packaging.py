"""Packaging: every third-party import of the packages is a declared dependency, and the built
wheel installs into a clean virtual environment and runs the CLI and the batch job."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("k3jax", "pallas_kernels", "convert", "serve")
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"orbax": "orbax-checkpoint", "jinja2": "jinja2", "ml_dtypes": "ml_dtypes"}


def _third_party_imports() -> set[str]:
    names = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in PACKAGES}


def test_every_import_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!\[ ;]", d)[0].lower() for d in project["dependencies"]}
    missing = sorted(n for n in _third_party_imports() if DISTRIBUTIONS.get(n, n).lower() not in declared)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
    assert all(not re.search(r"==", d) for d in project["dependencies"]), "pin exact versions in constraints.txt"


def test_wheel_installs_into_a_clean_venv_and_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["K3JAX_COMPILATION_CACHE"] = str(tmp_path / "cache")
    run = lambda *cmd: subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT))
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("k3jax-*.whl"))
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert {f"k3jax/models/tiny_k3/{n}" for n in ("model.safetensors", "SHA256SUMS", "tiktoken.model")} <= shipped
    # A venv without pip of its own (no ensurepip: 4 s), filled by this interpreter's pip through --python
    made = run(sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv"))
    assert made.returncode == 0, made.stderr
    pip = run(sys.executable, "-m", "pip", "--python", str(tmp_path / "venv" / "bin" / "python"), "install", "-q",
              "--disable-pip-version-check", "-c", str(ROOT / "requirements" / "constraints.txt"), str(wheel))
    if pip.returncode != 0 and "Could not find a version" in pip.stderr:
        pytest.fail(f"no package index reachable for the clean install: {pip.stderr[-500:]}")
    assert pip.returncode == 0, pip.stderr[-2000:]
    cli = tmp_path / "venv" / "bin" / "k3jax"
    version = run(str(cli), "--version")
    assert version.returncode == 0 and version.stdout.startswith("k3jax "), version.stderr[-2000:]
    out = run(str(cli), "generate", "--model", "tiny-kimi-linear", "--prompt", "Hi", "--chat", "--max-tokens", "3")
    assert out.returncode == 0 and "--- prompt 0" in out.stdout, out.stderr[-2000:]
    (tmp_path / "empty.jsonl").write_text("")
    job = run(str(tmp_path / "venv" / "bin" / "python"), "-m", "serve.batch", "--model", "tiny-kimi-linear",
              "--input", "empty.jsonl", "--output", "out.jsonl")
    assert job.returncode == 0 and (tmp_path / "out.jsonl").read_text() == "", job.stderr[-2000:]
