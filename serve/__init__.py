"""Serving fronts over the k3jax engine: the OpenAI-compatible HTTP server (`python -m serve`)."""
