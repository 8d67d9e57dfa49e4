"""The package version (read by pyproject.toml and `k3jax --version`)."""

__version__ = "0.2.0"
