"""`python -m convert SRC DST`: Hugging Face safetensors -> k3jax (Orbax) checkpoint;
`python -m convert verify DST`: check an existing converted checkpoint.

A thin front over `k3jax.checkpoint.convert` and `k3jax.checkpoint.verify`, which own the name map
and the formats.
"""

from k3jax.checkpoint.convert import ConvertReport, convert
from k3jax.checkpoint.verify import verify_checkpoint

__all__ = ["ConvertReport", "convert", "verify_checkpoint"]
