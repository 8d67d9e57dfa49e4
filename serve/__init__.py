"""serve: the runtime fronts around k3jax's continuous-batching engine (k3jax.engine).

* `serve.batch`: the sharded, resumable offline batch job (`python -m serve.batch`, `k3jax run-batch`):
  JSONL requests in, one JSONL result per request out, exactly once.

Modules, one job each: `requests_file` (input lines -> requests or error records, the up-front
scan), `records` (the output line of a result or an error), `parts` (the job directory: fingerprint,
atomic part files, the final merge), `replicas` (mesh -> data-parallel replicas and their share of
ids), `batch` (the job itself).
"""
