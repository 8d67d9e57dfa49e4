"""Several fused KDA decode steps per row in one call (speculative verification and its commit).

With impl "xla", `kda_decode_steps` runs the one-token step (`ops.kda_decode`) over T tokens with
`lax.scan`, so the outputs and states are exactly those of T separate decode calls (the reference);
with "pallas" (and "hopper", whose Mosaic GPU kernel is for one token) it is one kernel per call
(`decode.kda_decode_steps_pallas`) that keeps each (row, head) state on chip across the T tokens.
With `keep` [B], row b only advances its conv window and recurrent state over its first keep[b]
tokens: the commit of a verify step replays the accepted tokens this way instead of storing a state
per token (outputs past a row's keep are then not meaningful).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda.decode import kda_decode_steps_pallas
from pallas_kernels.kda.ops import KDADecodeImpl, kda_decode
from pallas_kernels.kda.params import KDADecodeInputs, KDADecodeWeights


def kda_decode_steps(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array, state: jax.Array,
                     *, keep: jax.Array | None = None, impl: KDADecodeImpl = "xla"):
    """T decode steps per row.

    Args:
      inputs: KDADecodeInputs with a token axis: x_qkv [B, T, 3, H, K], f [B, T, H, K],
        beta_logit [B, T, H], z [B, T, H, K].
      weights: the layer's KDADecodeWeights. conv_state: [B, W-1, 3, H, K]. state: [B, H, K, V] fp32 or bf16.
      keep: [B] int32 tokens each row keeps (0..T); None keeps all T.
      impl: "xla" (a scan of the pure-JAX step) or "pallas" / "hopper" (one kernel over the T tokens).
    Returns:
      (out [B, T, H, K], conv_state and state after each row's kept tokens)
    """
    if inputs.x_qkv.ndim != 5:
        raise ValueError(f"kda_decode_steps: x_qkv must be [B, T, 3, H, K], got {inputs.x_qkv.shape}")
    b, t = inputs.x_qkv.shape[:2]
    if keep is not None and keep.shape != (b,):
        raise ValueError(f"kda_decode_steps: keep must be [{b}], got {keep.shape}")
    if impl in ("pallas", "hopper"):
        keep = jnp.full((b,), t, jnp.int32) if keep is None else keep
        return kda_decode_steps_pallas(inputs, weights, conv_state, state, keep)

    def step(carry, xs):
        conv, s = carry
        token_inputs, index = xs
        out, new_conv, new_s = kda_decode(token_inputs, weights, conv, s, impl=impl)
        if keep is not None:
            advance = index < keep
            new_conv = jnp.where(advance[:, None, None, None, None], new_conv, conv)
            new_s = jnp.where(advance[:, None, None, None], new_s, s)
        return (new_conv, new_s), out

    time_major = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), inputs)
    (conv, s), out = jax.lax.scan(step, (conv_state, state), (time_major, jnp.arange(t, dtype=jnp.int32)))
    return jnp.moveaxis(out, 0, 1), conv, s


def kda_verify_outputs(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array, state: jax.Array,
                       *, impl: KDADecodeImpl = "xla") -> jax.Array:
    """The outputs of T decode steps per row and nothing else (a speculative verify window: the
    commit later replays the kept tokens). Same inputs as `kda_decode_steps`; -> out [B, T, H, K].
    With "pallas" or "hopper" the kernel writes no state, so no state pass and no copy of an aliased input."""
    if impl in ("pallas", "hopper"):
        if inputs.x_qkv.ndim != 5:
            raise ValueError(f"kda_verify_outputs: x_qkv must be [B, T, 3, H, K], got {inputs.x_qkv.shape}")
        keep = jnp.full((inputs.x_qkv.shape[0],), inputs.x_qkv.shape[1], jnp.int32)
        return kda_decode_steps_pallas(inputs, weights, conv_state, state, keep, outputs_only=True)
    return kda_decode_steps(inputs, weights, conv_state, state, impl=impl)[0]
