"""Error types shared across k3jax and the small validation helpers that raise them."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid or inconsistent configuration; the message names the offending field."""


def require(cond: bool, field: str, msg: str) -> None:
    """Raises ConfigError naming `field` unless `cond` holds."""
    if not cond:
        raise ConfigError(f"invalid config field '{field}': {msg}")


def require_positive(value, field: str) -> None:
    """Raises ConfigError unless `value` is a positive integer (bools are not integers here)."""
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0, field,
            f"expected a positive integer, got {value!r}")


def require_choice(value, choices: tuple, field: str) -> None:
    """Raises ConfigError unless `value` is one of `choices`."""
    require(value in choices, field, f"expected one of {choices}, got {value!r}")
