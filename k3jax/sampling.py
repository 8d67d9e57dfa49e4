"""Sampling parameters (vLLM-style) and the on-device token sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

_INT32_MAX = (1 << 31) - 1
_UINT32_MAX = (1 << 32) - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off.

    max_new_tokens: tokens to generate at most. stop_token_ids: extra ids that end a row (the
    model's eos ids always do unless ignore_eos). seed: makes sampling reproducible per prompt,
    independent of batch composition. skip_special_tokens: leave special tokens out of the text.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or not 0 < self.max_new_tokens <= _INT32_MAX:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.seed) or not 0 <= self.seed <= _UINT32_MAX:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                _is_int(t) and 0 <= t <= _INT32_MAX for t in tuple(self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be non-negative integer token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def filters(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)


@jax.tree_util.register_dataclass
@dataclass
class SamplerInputs:
    """Per-row sampling settings as arrays (so one compiled loop serves every setting)."""

    temperature: jax.Array   # [B] fp32, 0 = greedy
    top_k: jax.Array         # [B] int32, 0 = off
    top_p: jax.Array         # [B] fp32, 1 = off
    seed: jax.Array          # [B] uint32


def sample(logits_BV: jax.Array, params: SamplerInputs, position_B: jax.Array, *, filters: bool) -> jax.Array:
    """Picks one token per row. The random stream of a row depends only on (seed, position).

    filters (static): apply top-k / top-p (one sort of the vocabulary); off compiles them away.
    """
    logits = logits_BV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temp = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled = logits / temp
    if filters:
        order = jnp.argsort(-scaled, axis=-1)
        ranked = jnp.take_along_axis(scaled, order, axis=-1)
        rank = jnp.arange(ranked.shape[-1])[None, :]
        keep = (params.top_k[:, None] <= 0) | (rank < params.top_k[:, None])
        probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs   # mass of strictly better tokens
        keep &= (before < params.top_p[:, None]) | (rank == 0)
        masked = jnp.where(keep, ranked, -jnp.inf)
        scaled = jnp.full_like(scaled, -jnp.inf).at[jnp.arange(scaled.shape[0])[:, None], order].set(masked)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(params.seed, position_B)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled).astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)
