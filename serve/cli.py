"""The `k3jax` console script: k3jax's own commands (generate, convert, verify) plus the serving
fronts of this package (serve, run-batch), which k3jax itself must not import."""

from __future__ import annotations

import sys

from k3jax import cli
from serve import batch, server

COMMANDS = {"serve": ("serve a model over OpenAI's HTTP API", server.main),
            "run-batch": ("run a JSONL file of requests as a sharded offline job", batch.main)}


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, extra_commands=COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
