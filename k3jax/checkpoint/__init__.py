"""Checkpoint reading: safetensors files, the Hugging Face -> k3jax name map, loading."""
