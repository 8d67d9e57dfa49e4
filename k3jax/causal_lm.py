"""User-facing model object: a thin facade over the pure step functions (k3jax.steps).

    model = k3jax.load(path, dtype="bfloat16")
    logits = model.logits(token_ids)                      # [B, T, Vocab] fp32
    logits, state = model.prefill(token_ids)              # [B, Vocab] (last position), DecodeState
    logits, state = model.decode_step(state, next_ids)    # [B, Vocab], DecodeState

Rows of a batch are LEFT-padded: pass `attention_mask` [B, T] (1 = real token) with padding
before the real tokens. `decode_step` donates the state it is given (its buffers are reused).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.errors import ConfigError
from k3jax.inputs import check_batch, check_token_ids
from k3jax.memory_plan import prefill_chunk_length
from k3jax.model import KimiForCausalLM, abstract_model
from k3jax.sharding import Placement, config_for_mesh, param_shardings
from k3jax.state import DecodeState, init_decode_state
from k3jax.steps import compile_steps
from k3jax.tokenizer import KimiTokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_CACHE_BUCKET = 128


def resolve_dtype(dtype) -> jnp.dtype:
    """"float32" / "bfloat16" (or the dtypes) -> jnp.dtype; anything else raises ValueError."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        return jnp.dtype(DTYPES[dtype])
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"unsupported dtype {dt}; expected float32 or bfloat16")
    return dt


@dataclass(frozen=True)
class LoadReport:
    """What a load consumed: tensors used, tensors deliberately skipped (vision tower, ...), bytes read
    by this process (a Hugging Face checkpoint: tensor bytes; a converted one: file bytes as stored,
    compressed, metadata included, counted by tensorstore for the whole process during the restore)."""

    tensors: int
    skipped: int
    bytes_read: int


class CausalLM:
    """A model with compiled entry points. Build with `k3jax.load`, `k3jax.load_model` or
    `CausalLM.random`.

    Attributes: config, graphdef / params (nnx.split of the module), dtype, mesh, tokenizer (or
    None), load_report (what loading read, or None), generation_config (the checkpoint's
    generation_config.json as a dict, or None: the default sampling).
    """

    def __init__(self, module: KimiForCausalLM, config: ModelConfig | None = None, *, mesh=None,
                 tokenizer: KimiTokenizer | None = None, load_report: LoadReport | None = None,
                 generation_config: dict | None = None):
        if config is not None and config != module.config:
            raise ValueError("CausalLM: the config differs from the one the module was built with; "
                             "use model.with_config(...) to change it")
        graphdef, params = nnx.split(module)
        config = config_for_mesh(module.config, mesh)
        if config != module.config:  # expert parallelism follows the mesh: the same weights, re-bound
            graphdef, _ = nnx.split(abstract_model(config, params["model"]["embed_tokens"]["embedding"][...].dtype))
        self.config = config
        self.mesh = mesh
        self.placement = Placement(mesh)
        self.graphdef = graphdef
        self.params = self.placement.put_params(params)
        self.dtype = self.params["model"]["embed_tokens"]["embedding"][...].dtype
        self.tokenizer = tokenizer
        self.load_report = load_report
        self.generation_config = generation_config
        self.steps = compile_steps(graphdef)

    @classmethod
    def random(cls, config: ModelConfig, *, seed: int = 0, dtype="float32", mesh=None,
               tokenizer: KimiTokenizer | None = None) -> "CausalLM":
        """A model with deterministic random weights (tests, demos, benchmarks); with `mesh`, the
        parameters are created directly in their shardings (k3jax.sharding rules)."""
        dt = resolve_dtype(dtype)
        if mesh is None:
            return cls(KimiForCausalLM(config, dtype=dt, rngs=nnx.Rngs(seed)), tokenizer=tokenizer)
        config = config_for_mesh(config, mesh)
        build = lambda: KimiForCausalLM(config, dtype=dt, rngs=nnx.Rngs(seed))
        graphdef, abstract = nnx.split(abstract_model(config, dt))
        with jax.set_mesh(mesh):
            params = jax.jit(lambda: nnx.split(build())[1], out_shardings=param_shardings(abstract, mesh))()
        return cls(nnx.merge(graphdef, params), mesh=mesh, tokenizer=tokenizer)

    @property
    def module(self) -> KimiForCausalLM:
        return nnx.merge(self.graphdef, self.params)

    def shard(self, mesh) -> "CausalLM":
        """The same model with its parameters resharded onto `mesh` (k3jax.sharding rules)."""
        return CausalLM(self.module, mesh=mesh, **self._extras())

    def with_config(self, config: ModelConfig) -> "CausalLM":
        """The same weights under another config (implementation choices, stop ids, limits, ...).
        The parameter tree must be unchanged."""
        graphdef, abstract_params = nnx.split(abstract_model(config, self.dtype))
        shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
        if shapes(abstract_params) != shapes(self.params):
            raise ValueError("with_config: the new config changes the parameter tree; load or build a new model")
        return CausalLM(nnx.merge(graphdef, self.params), mesh=self.mesh, **self._extras())

    def _extras(self) -> dict:
        """What travels with the weights when a model is re-bound (tokenizer, reports, defaults)."""
        return dict(tokenizer=self.tokenizer, load_report=self.load_report, generation_config=self.generation_config)

    def with_impls(self, **impls: str | None) -> "CausalLM":
        """Same weights, other implementation choices (kda=, kda_decode=, mla=, moe=, gmm=, attn_res=).
        expert_layout is not one: it decides the packed experts' parameters (set it when loading)."""
        moe = self.config.moe
        layout = impls.get("expert_layout")
        if layout is not None and moe is not None and moe.packed_experts and layout != moe.packed_layout:
            raise ConfigError(f"expert_layout={layout!r}: this model's packed experts lie in the "
                              f"{moe.packed_layout!r} layout; load the checkpoint again with expert_layout={layout!r}")
        return self.with_config(self.config.with_impls(**impls))

    # ----- public API -----
    def init_state(self, batch_size: int, max_len: int, *, scratch: int = 0) -> DecodeState:
        """A fresh state for `batch_size` rows and up to `max_len` tokens per row, plus `scratch`
        cache slots past them for tentative tokens (speculative verify windows)."""
        if max_len > self.config.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's context limit "
                             f"{self.config.max_position_embeddings}")
        return self.placement.put_state(init_decode_state(self.config, batch_size, max_len + scratch, self.dtype))

    def logits(self, token_ids, attention_mask=None) -> jax.Array:
        """Full forward. token_ids [B, T] -> logits [B, T, Vocab] float32."""
        ids, mask = check_batch(token_ids, attention_mask, self.config.vocab_size)
        if ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"prompt of {ids.shape[1]} tokens exceeds the context limit "
                             f"{self.config.max_position_embeddings}")
        put = self.placement.put_rows
        with self.placement.context():
            return self.steps.logits(self.params, put(ids), put(mask))

    def hidden_states(self, token_ids, attention_mask=None) -> jax.Array:
        """Pre-norm final hidden state [B, T, D] (after K3's output AttnRes mix): the MTP input."""
        ids, mask = check_batch(token_ids, attention_mask, self.config.vocab_size)
        put = self.placement.put_rows
        with self.placement.context():
            return self.steps.hidden(self.params, put(ids), put(mask))

    def mtp(self, hidden, next_tokens, *, positions=None, attention_mask=None, layer: int = 0):
        """One MTP draft layer over a window (arch §7).

        Args:
          hidden: [B, T, D] target pre-norm hidden states (or the previous MTP layer's output).
          next_tokens: [B, T] the token following each position.
          positions: [B, T] absolute positions (the embedding is zeroed at position 0); default 0..T-1.
        Returns:
          (MTP pre-norm hidden [B, T, D], draft logits [B, T, Vocab] fp32).
        """
        if not 0 <= layer < self.config.num_mtp_layers:
            raise ValueError(f"MTP layer {layer} requested but the model has {self.config.num_mtp_layers}")
        ids, mask = check_batch(next_tokens, attention_mask, self.config.vocab_size)
        hidden = jnp.asarray(hidden)
        if hidden.shape != ids.shape + (self.config.hidden_size,):
            raise ValueError(f"hidden shape {hidden.shape} does not match next_tokens {ids.shape}")
        if positions is None:
            positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
        put = self.placement.put_rows
        with self.placement.context():
            return self.steps.mtp(self.params, hidden, put(ids), put(np.asarray(positions, np.int32)), put(mask),
                                  layer=layer)

    def prefill_calls(self, batch: int, width: int) -> list[tuple[int, bool]]:
        """The prefill calls a fresh [batch, width] prompt runs: (tokens per row, fresh) each. More
        than one when batch * width exceeds the config's prefill_chunk_tokens: the prompt is
        left-padded to a multiple of the chunk and each chunk continues the state."""
        chunk = prefill_chunk_length(batch, width, self.config.prefill_chunk_tokens)
        return [(chunk, i == 0) for i in range(-(-width // chunk))]

    def prefill(self, token_ids, attention_mask=None, *, state: DecodeState | None = None,
                max_len: int | None = None, all_logits: bool = False):
        """Runs the prompt and returns (logits, state).

        A prompt of more than `config.prefill_chunk_tokens` tokens over all rows runs as chunks of
        the same length (`prefill_calls`), each continuing the state of the one before: the
        result equals one call (tested), and prefill memory stays bounded by the chunk.

        Args:
          token_ids: [B, T] ints (left-padded when rows differ in length).
          attention_mask: [B, T] of 0/1, or None (all real).
          state: continue from this state instead of starting fresh (chunked prefill).
          max_len: tokens per row the new state can hold (prompt + generated); default: the
            prompt rounded up, plus room for 128 tokens. Ignored when `state` is given.
          all_logits: return [B, T, Vocab] instead of the last position's [B, Vocab].
        """
        ids, mask = check_batch(token_ids, attention_mask, self.config.vocab_size)
        b, t = ids.shape
        fresh = state is None
        if fresh:
            if max_len is None:
                max_len = min(-(-(t + _CACHE_BUCKET) // _CACHE_BUCKET) * _CACHE_BUCKET,
                              self.config.max_position_embeddings)
            if t > max_len:
                raise ValueError(f"prompt of {t} tokens exceeds max_len {max_len}")
            state = self.init_state(b, max_len)
        else:
            self._check_room(state, b, mask.sum(axis=1))
        return self.prefill_into(ids, mask, state, fresh=fresh, all_logits=all_logits, donate=fresh)

    def prefill_into(self, ids: np.ndarray, mask: np.ndarray, state: DecodeState, *, fresh: bool,
                     all_logits: bool = False, donate: bool = False):
        """The prefill calls of checked [B, T] ids and bool mask into `state` (`prefill` after its
        checks; generation calls it with states it built): one call, or chunks of
        `prefill_calls` length each continuing the state. fresh: the state holds no history.
        donate: `state` may be consumed by the first call (later calls always consume their input).
        Returns (logits, state) as `prefill`."""
        b, t = ids.shape
        chunk = prefill_chunk_length(b, t, self.config.prefill_chunk_tokens)
        put = self.placement.put_rows
        with self.placement.context():
            if chunk >= t:
                step = self.steps.prefill_donated if donate else self.steps.prefill
                return step(self.params, put(ids), put(mask), state, fresh=fresh, all_logits=all_logits)
            lead = -t % chunk  # left padding up to a multiple of the chunk: rows stay left-padded
            ids = np.pad(ids, ((0, 0), (lead, 0)))
            mask = np.pad(mask, ((0, 0), (lead, 0)))
            parts = []
            for i in range(ids.shape[1] // chunk):
                cols = slice(i * chunk, (i + 1) * chunk)
                step = self.steps.prefill if i == 0 and not donate else self.steps.prefill_donated
                logits, state = step(self.params, put(ids[:, cols]), put(mask[:, cols]), state,
                                     fresh=fresh and i == 0, all_logits=all_logits)
                parts.append(logits)
            return (jnp.concatenate(parts, axis=1)[:, lead:] if all_logits else logits), state

    def decode_step(self, state: DecodeState, next_tokens):
        """Feeds one token per row. next_tokens [B] -> (logits [B, Vocab] fp32, new state)."""
        ids = check_token_ids(next_tokens, self.config.vocab_size, "next_tokens").reshape(-1)
        self._check_room(state, ids.shape[0], np.ones(ids.shape[0], np.int64))
        with self.placement.context():
            return self.steps.decode(self.params, state, self.placement.put_rows(ids))

    def _check_room(self, state: DecodeState, batch: int, new_tokens: np.ndarray) -> None:
        if state.batch_size != batch:
            raise ValueError(f"state holds {state.batch_size} rows but {batch} were given")
        capacity = state.capacity
        if capacity is not None:
            used = self.placement.to_host(state.lengths)   # gathered when rows lie on several processes
            if (used + new_tokens > capacity).any():
                raise ValueError(f"the state's cache is full ({capacity} tokens per row); "
                                 "start from a prefill with a larger max_len")
