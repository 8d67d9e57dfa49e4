"""Process-wide defaults k3jax sets when imported: JAX's persistent compilation cache in a user
cache directory (compiles of the large decode programs are reused across processes), and a
`logging` logger that stays silent until the application configures logging.

    K3JAX_COMPILATION_CACHE=/path   cache directory (default: $XDG_CACHE_HOME/k3jax/jax, ~/.cache/k3jax/jax)
    K3JAX_COMPILATION_CACHE=off     leave JAX's cache alone (also when the application set one itself)
"""

from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger("k3jax")
logger.addHandler(logging.NullHandler())

_OFF = ("0", "off", "false", "no", "")


def compilation_cache_dir() -> str | None:
    """The directory k3jax would use for JAX's compilation cache, or None when switched off."""
    choice = os.environ.get("K3JAX_COMPILATION_CACHE")
    if choice is not None:
        return None if choice.strip().lower() in _OFF else os.path.expanduser(choice)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "k3jax", "jax")


def enable_compilation_cache() -> str | None:
    """Points JAX's persistent compilation cache at `compilation_cache_dir()` unless the process
    already chose one or it is switched off; returns the directory in use (or None)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = compilation_cache_dir()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home must not break imports
        logger.warning("compilation cache disabled: cannot create %s (%s)", path, e.strerror)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    return path
