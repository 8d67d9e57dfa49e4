"""serve: the runtime fronts around k3jax's continuous-batching engine (k3jax.engine). It imports
k3jax; k3jax never imports it (the `k3jax` console script, serve.cli, adds these commands).

* the OpenAI-compatible HTTP server (`python -m serve`, `k3jax serve`): `server` (the command),
  `openai_api` (the FastAPI routes, errors, streams), `protocol` (request bodies -> sampling),
  `engine_service` (the engine on its own thread, metrics), `k3_output` (K3's answer -> reasoning,
  content, tool calls).
* the sharded, resumable offline batch job (`python -m serve.batch`, `k3jax run-batch`): JSONL
  requests in, one JSONL result per request out, exactly once. `batch` (the job), `requests_file`
  (input lines -> requests or error records, the up-front scan), `records` (the output line of a
  result or an error), `parts` (the job directory: fingerprint, atomic part files, the final merge),
  `replicas` (mesh -> data-parallel replicas and their share of ids).
"""
