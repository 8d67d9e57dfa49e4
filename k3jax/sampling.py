"""Sampling parameters (vLLM's names) and the on-device token sampler.

    SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1, stop=["\\n\\n"], logprobs=5,
                   repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2, n=2)

The sampler works on per-row arrays (SamplerInputs), so one compiled decode loop serves any mix of
settings in a batch; the optional parts (top-k / top-p, penalties, logprobs) are static switches
that compile away when no request uses them.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp

_INT32_MAX = (1 << 31) - 1
_UINT32_MAX = (1 << 32) - 1
DEFAULT_MAX_TOKENS = 64
MAX_LOGPROBS = 20


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value, name: str, low: float | None = None, high: float | None = None, *, open_low: bool = False):
    if not _is_real(value) or not math.isfinite(value) or (low is not None and (value <= low if open_low else value < low)) \
            or (high is not None and value > high):
        bounds = f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf'}{']' if high is not None else ')'}"
        raise ValueError(f"{name} must be a finite number in {bounds}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens (vLLM's field names; `max_new_tokens` is accepted as an alias of
    `max_tokens`).

    max_tokens: tokens to generate at most (default 64). n: completions per prompt.
    temperature: 0 is greedy (the default). top_k: 0 (or -1) is off. top_p: 1 is off.
    seed: a row's random stream depends only on (seed, position), so results do not depend on
      batch composition; None draws a fresh seed per completion.
    stop: strings that end a completion; the text is cut just before the first one (or after it
      with include_stop_str_in_output). stop_token_ids: extra ids that end a row; the model's eos
      ids always do unless ignore_eos.
    logprobs: None, or k: the sampled token's log-probability and the k most likely tokens' (k <=
      20), from the model's raw distribution (before temperature and penalties).
    repetition_penalty: > 1 makes tokens of the prompt and the output less likely (logits divided,
      or multiplied when negative). presence_penalty / frequency_penalty: subtracted once / per
      occurrence from the logits of tokens already in the output.
    skip_special_tokens: leave special tokens out of the text.
    """

    max_tokens: int | None = None
    max_new_tokens: int | None = None
    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True

    def __post_init__(self):
        given = [v for v in (self.max_tokens, self.max_new_tokens) if v is not None]
        if len(given) == 2 and given[0] != given[1]:
            raise ValueError(f"max_tokens ({self.max_tokens}) and its alias max_new_tokens ({self.max_new_tokens}) differ")
        limit = given[0] if given else DEFAULT_MAX_TOKENS
        if not _is_int(limit) or not 0 < limit <= _INT32_MAX:
            name = "max_tokens" if self.max_tokens is not None else "max_new_tokens"
            raise ValueError(f"{name} must be a positive integer, got {limit!r}")
        object.__setattr__(self, "max_tokens", limit)
        object.__setattr__(self, "max_new_tokens", limit)
        if not _is_int(self.n) or not 1 <= self.n <= 1024:
            raise ValueError(f"n must be an integer in [1, 1024], got {self.n!r}")
        _finite(self.temperature, "temperature", 0.0)
        if _is_int(self.top_k) and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not _is_int(self.top_k) or not 0 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        _finite(self.top_p, "top_p", 0.0, 1.0, open_low=True)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _UINT32_MAX):
            raise ValueError(f"seed must be None or an integer in [0, 2**32), got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(stop, bytes) or not all(isinstance(s, str) and s for s in tuple(stop)):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                _is_int(t) and 0 <= t <= _INT32_MAX for t in tuple(self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be non-negative integer token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _finite(self.repetition_penalty, "repetition_penalty", 0.0, open_low=True)
        _finite(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _finite(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def from_generation_config(cls, config: dict, **overrides) -> "SamplingParams":
        """Defaults from a checkpoint's generation_config.json (do_sample, temperature, top_k, top_p,
        repetition_penalty, max_new_tokens); `overrides` win."""
        sample = bool(config.get("do_sample", config.get("temperature", 0) not in (0, None)))
        values = {"temperature": float(config.get("temperature", 1.0)) if sample else 0.0}
        for key, name in (("top_k", "top_k"), ("top_p", "top_p"), ("repetition_penalty", "repetition_penalty"),
                          ("max_new_tokens", "max_tokens")):
            if config.get(key) is not None:
                values[name] = config[key]
        values.update(overrides)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @property
    def filters(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def row_seed(self, index: int) -> int:
        """The seed of completion `index` of this request (fresh randomness when seed is None)."""
        return secrets.randbits(32) if self.seed is None else (self.seed + index) & _UINT32_MAX


@jax.tree_util.register_dataclass
@dataclass
class SamplerInputs:
    """Per-row sampling settings as arrays (so one compiled loop serves every setting)."""

    temperature: jax.Array   # [B] fp32, 0 = greedy
    top_k: jax.Array         # [B] int32, 0 = off
    top_p: jax.Array         # [B] fp32, 1 = off
    seed: jax.Array          # [B] uint32
    repetition: jax.Array    # [B] fp32, 1 = off
    presence: jax.Array      # [B] fp32, 0 = off
    frequency: jax.Array     # [B] fp32, 0 = off


def apply_penalties(logits_BV: jax.Array, params: SamplerInputs, counts_BV: jax.Array, seen_BV: jax.Array) -> jax.Array:
    """Repetition penalty over tokens seen in the prompt or output (`seen_BV`), presence and
    frequency penalties over the output's token counts (`counts_BV` int32), in fp32."""
    rep = params.repetition[:, None]
    logits = jnp.where(seen_BV, jnp.where(logits_BV > 0, logits_BV / rep, logits_BV * rep), logits_BV)
    counts = counts_BV.astype(jnp.float32)
    return logits - params.frequency[:, None] * counts - params.presence[:, None] * (counts > 0)


def sampling_logits(logits_BV: jax.Array, params: SamplerInputs, *, filters: bool) -> jax.Array:
    """The log-weights a sampled row draws from: logits / temperature, with tokens outside top-k /
    top-p at -inf (filters, static: one sort of the vocabulary; off compiles it away). fp32 [B, V]."""
    logits = logits_BV.astype(jnp.float32)
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
    return scaled


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = 0x1BD11BDA
_ROW_KEY_SALT = 0x6B336A78


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 with 20 rounds (Salmon et al., SC'11; the block cipher of JAX's default PRNG)
    on uint32 arrays that broadcast together: key (k0, k1), counter (x0, x1) -> two words. Plain
    integer ops, so XLA fuses it into whatever consumes the words."""
    u32 = lambda v: jnp.asarray(v, jnp.uint32)
    k0, k1, x0, x1 = u32(k0), u32(k1), u32(x0), u32(x1)
    ks = (k0, k1, k0 ^ k1 ^ u32(_THREEFRY_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ((x1 << u32(r)) | (x1 >> u32(32 - r))) ^ x0
        x0, x1 = x0 + ks[(i + 1) % 3], x1 + ks[(i + 2) % 3] + u32(i + 1)
    return x0, x1


def gumbel_argmax(scaled_BV: jax.Array, seed_B: jax.Array, position_B: jax.Array) -> jax.Array:
    """One draw per row from softmax(scaled_BV) by the Gumbel-max rule, the noise of vocabulary
    entry i being Threefry(row key, i) with row key = Threefry((seed, salt), (position, 0)): a
    function of (seed, position) only, and one fused XLA reduction on the GPU where
    jax.random.categorical takes several kernels. -> [B] int32."""
    b, v = scaled_BV.shape
    k0, k1 = threefry2x32(seed_B, _ROW_KEY_SALT, position_B.astype(jnp.uint32), 0)
    bits, _ = threefry2x32(k0[:, None], k1[:, None], jax.lax.broadcasted_iota(jnp.uint32, (b, v), 1), 0)
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))     # in (0, 1), never 0 or 1
    return jnp.argmax(scaled_BV - jnp.log(-jnp.log(u)), axis=-1).astype(jnp.int32)


def sampling_keys(params: SamplerInputs, position_B: jax.Array) -> jax.Array:
    """One PRNG key per row: a function of (seed, position) only."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(params.seed, position_B)


def sample(logits_BV: jax.Array, params: SamplerInputs, position_B: jax.Array, *, filters: bool) -> jax.Array:
    """Picks one token per row: argmax where temperature == 0, else a draw from
    `sampling_logits`. The random stream of a row depends only on (seed, position)."""
    greedy = jnp.argmax(logits_BV.astype(jnp.float32), axis=-1).astype(jnp.int32)
    scaled = sampling_logits(logits_BV, params, filters=filters)
    drawn = gumbel_argmax(scaled, params.seed, position_B)
    return jnp.where(params.temperature > 0, drawn, greedy)


def token_logprobs(logits_BV: jax.Array, tokens_B: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logprob of tokens_B [B], top-k ids [B, k] int32, top-k logprobs [B, k]) of the raw logits."""
    logp = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens_B[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(logp, k)
    return chosen, top_ids.astype(jnp.int32), top_vals
