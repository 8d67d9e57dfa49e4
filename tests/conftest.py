"""Test setup: CPU with 8 fake devices (or the GPU with K3JAX_TEST_DEVICE=gpu), persistent
compilation cache, shared fixtures.

Kernel tests take the `interpret` fixture: interpret mode on the CPU, compiled kernels on a GPU, so
the same files run both ways (`K3JAX_TEST_DEVICE=gpu pytest tests/pallas_kernels` on the H200).
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import os
import shutil
import subprocess
import zlib
from pathlib import Path

ON_GPU = os.environ.get("K3JAX_TEST_DEVICE") == "gpu"
if not ON_GPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Tiny shapes: compile time dominates, and LLVM -O0 roughly halves it on the CPU backend.
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                      "--xla_backend_optimization_level=0"]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("K3JAX_TEST_CACHE", ROOT / ".cache"))

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", str(CACHE / "jax-compilation"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from k3jax.config import tiny_kimi_linear  # noqa: E402

ORACLE_SCRIPT = ROOT / "tests" / "oracle" / "make_references.py"
CHAT_TEMPLATE = ROOT / "k3jax" / "templates" / "kimi_linear_chat.jinja"


def oracle_python() -> Path:
    python = Path(os.environ.get("K3JAX_ORACLE_VENV", ROOT / ".venv-oracle")) / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"the oracle venv is missing ({python}); create it with `make oracle-venv` "
                           "(the README's test command does this)")
    return python


# Modules of the longest tests on the CPU (a wheel installed into a fresh venv, jobs of two processes, a server),
# relative to tests/: collected first, so that `pytest -n 2` hands them out early and ends on short tests. In
# collection order most of them came near the end, and one worker could still run a minute or more of them
# while the other had nothing left. The order within a module and among the other modules stays as collected.
RUN_FIRST = ("test_packaging.py", "serve/test_batch_processes.py", "k3jax/test_multiprocess.py",
             "serve/test_server.py")


@pytest.hookimpl(tryfirst=True)     # before the plugins that reorder on request (--failed-first)
def pytest_collection_modifyitems(items):
    rank = {ROOT / "tests" / name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(RUN_FIRST)))


MAPPINGS_BEFORE_RELEASE = 30_000    # a worker's memory mappings; vm.max_map_count is usually 65,530


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:     # not Linux: nothing to count, nothing released
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """After a test, drop JAX's in-memory caches of compiled programs once the worker holds more than
    MAPPINGS_BEFORE_RELEASE memory mappings, so XLA unmaps their code. A worker that runs hundreds of tests keeps
    every program: 57 of the KDA kernel tests leave 19,680 mappings (626 with the caches dropped after each), and
    past the kernel's limit (vm.max_map_count, 65,530 here) XLA's CPU compiler aborted or segfaulted late in the
    run. Only past the threshold, so programs that tests share are not recompiled after every test."""
    yield
    if _mappings() > MAPPINGS_BEFORE_RELEASE:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def oracle_dir() -> Path:
    """Outside-reference data from the torch oracle venv, built once and cached by the content of
    the script and of the chat template it renders."""
    digest = hashlib.sha256(ORACLE_SCRIPT.read_bytes() + CHAT_TEMPLATE.read_bytes()).hexdigest()[:16]
    out = CACHE / "oracle" / digest
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers wait for the first builder
        if not (out / "DONE").exists():
            tmp = out.with_name(digest + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            proc = subprocess.run([str(oracle_python()), str(ORACLE_SCRIPT), str(tmp)], capture_output=True,
                                  text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if proc.returncode != 0:
                raise RuntimeError(f"oracle script failed:\n{proc.stderr[-4000:]}")
            (tmp / "DONE").write_text("ok")
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out


@pytest.fixture(scope="session")
def interpret() -> bool:
    """Pallas kernels in interpret mode off the GPU, compiled on it."""
    return jax.default_backend() != "gpu"


@pytest.fixture
def triton_for_hopper(monkeypatch):
    """Lower Triton kernels for an sm_90 GPU on a host without one (for `jax.export` to "cuda")."""
    from types import SimpleNamespace

    import jax._src.pallas.triton.pallas_call_registration as reg

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: SimpleNamespace(compute_capability="9.0"))


@pytest.fixture(scope="session")
def tiny_config():
    return tiny_kimi_linear()


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's name: fresh inputs per test, reproducible per run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
