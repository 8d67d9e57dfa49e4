"""`python -m convert SRC DST`: Hugging Face safetensors -> k3jax (Orbax) checkpoint.

A thin front over `k3jax.checkpoint.convert`, which owns the name map and the formats.
"""

from k3jax.checkpoint.convert import ConvertReport, convert, verify_checkpoint

__all__ = ["ConvertReport", "convert", "verify_checkpoint"]
