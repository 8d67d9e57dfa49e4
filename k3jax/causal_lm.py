"""User-facing model object: compiled full forward, prefill and single-token decode.

    model = k3jax.load(path, dtype="bfloat16")
    logits = model.logits(token_ids)                      # [B, T, Vocab] fp32
    logits, state = model.prefill(token_ids)              # [B, Vocab] (last position), DecodeState
    logits, state = model.decode_step(state, next_ids)    # [B, Vocab], DecodeState

Rows of a batch are LEFT-padded: pass `attention_mask` [B, T] (1 = real token) with padding
before the real tokens. `decode_step` donates the state it is given (its buffers are reused).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.model import KimiForCausalLM
from k3jax.state import DecodeState, SeqInfo, init_decode_state

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_CACHE_BUCKET = 128


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        return jnp.dtype(DTYPES[dtype])
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"unsupported dtype {dt}; expected float32 or bfloat16")
    return dt


def _forward_logits(graphdef, params, tokens, valid):
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens, SeqInfo.make(valid), None, fresh=True)
    return model.logits(hidden)


def _forward_hidden(graphdef, params, tokens, valid):
    model = nnx.merge(graphdef, params)
    return model(tokens, SeqInfo.make(valid), None, fresh=True)[0]


def _mtp(graphdef, params, hidden, tokens, positions, valid, *, layer: int):
    model = nnx.merge(graphdef, params)
    mtp = model.mtp[layer]
    h, _ = mtp.draft(hidden, tokens, positions, model.mtp_embedding(), SeqInfo.make(valid), None, fresh=True)
    return h, mtp.shared_head(h)


def _prefill(graphdef, params, tokens, valid, state, *, fresh: bool, all_logits: bool):
    model = nnx.merge(graphdef, params)
    hidden, state = model(tokens, SeqInfo.make(valid, state.lengths), state, fresh=fresh)
    logits = model.logits(hidden if all_logits else hidden[:, -1])
    return logits, state


def _decode(graphdef, params, state, tokens_B):
    model = nnx.merge(graphdef, params)
    seq = SeqInfo.make(jnp.ones((tokens_B.shape[0], 1), bool), state.lengths)
    hidden, state = model(tokens_B[:, None], seq, state, fresh=False)
    return model.logits(hidden[:, 0]), state


class CausalLM:
    """A loaded model with compiled entry points. Build with `k3jax.load` or `CausalLM.random`."""

    def __init__(self, module: KimiForCausalLM, config: ModelConfig | None = None, *, mesh=None):
        if config is not None and config != module.config:
            raise ValueError("CausalLM: the config differs from the one the module was built with; "
                             "use model.with_config(...) to change it")
        self.config = module.config
        self.mesh = mesh
        self.graphdef, self.params = nnx.split(module)
        if mesh is not None:
            from k3jax.sharding import param_shardings
            self.params = jax.device_put(self.params, param_shardings(self.params, mesh))
        self.dtype = self.params["model"]["embed_tokens"]["embedding"][...].dtype
        self.load_report = None  # set by k3jax.load
        self.tokenizer = None     # set by k3jax.load_model when the checkpoint has one
        self._logits = jax.jit(functools.partial(_forward_logits, self.graphdef))
        self._hidden = jax.jit(functools.partial(_forward_hidden, self.graphdef))
        self._mtp = jax.jit(functools.partial(_mtp, self.graphdef), static_argnames=("layer",))
        self._prefill = jax.jit(functools.partial(_prefill, self.graphdef), static_argnames=("fresh", "all_logits"))
        self._decode = jax.jit(functools.partial(_decode, self.graphdef), donate_argnames=("state",))

    @classmethod
    def random(cls, config: ModelConfig, *, seed: int = 0, dtype="float32", mesh=None) -> "CausalLM":
        """A model with deterministic random weights (tests, demos, benchmarks); with `mesh`, the
        parameters are created directly in their shardings (k3jax.sharding rules)."""
        dt = resolve_dtype(dtype)
        if mesh is None:
            return cls(KimiForCausalLM(config, dtype=dt, rngs=nnx.Rngs(seed)))
        from k3jax.sharding import param_shardings
        build = lambda: KimiForCausalLM(config, dtype=dt, rngs=nnx.Rngs(seed))
        graphdef, abstract = nnx.split(nnx.eval_shape(build))
        with jax.set_mesh(mesh):
            params = jax.jit(lambda: nnx.split(build())[1], out_shardings=param_shardings(abstract, mesh))()
        return cls(nnx.merge(graphdef, params), mesh=mesh)

    def shard(self, mesh) -> "CausalLM":
        """The same model with its parameters resharded onto `mesh` (k3jax.sharding rules)."""
        out = CausalLM(self.module, mesh=mesh)
        out.tokenizer = self.tokenizer
        return out

    def mesh_context(self):
        """Context for running this model's compiled functions (the mesh, when sharded)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _put(self, array, *, rows: bool = True):
        """Host input -> device, rows over the data axis when sharded."""
        if self.mesh is None:
            return jnp.asarray(array)
        from k3jax.sharding import batch_sharding
        array = np.asarray(array)
        return jax.device_put(array, batch_sharding(self.mesh, array.ndim, array.shape[0]))

    @property
    def module(self) -> KimiForCausalLM:
        return nnx.merge(self.graphdef, self.params)

    def with_config(self, config: ModelConfig) -> "CausalLM":
        """The same weights under another config (implementation choices, stop ids, limits, ...).
        The parameter tree must be unchanged."""
        abstract = nnx.eval_shape(lambda: KimiForCausalLM(config, dtype=self.dtype, rngs=nnx.Rngs(0)))
        graphdef, abstract_params = nnx.split(abstract)
        shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
        if shapes(abstract_params) != shapes(self.params):
            raise ValueError("with_config: the new config changes the parameter tree; load or build a new model")
        out = CausalLM(nnx.merge(graphdef, self.params), mesh=self.mesh)
        out.tokenizer = self.tokenizer
        return out

    def with_impls(self, **impls) -> "CausalLM":
        """Same weights, other implementation choices (kda=, kda_decode=, mla=, moe=, attn_res=)."""
        return self.with_config(self.config.with_impls(**impls))

    # ----- input checks (host side, before anything is dispatched) -----
    def _check_tokens(self, token_ids, name: str = "token_ids") -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.size == 0:
            raise ValueError(f"{name} is empty")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise ValueError(f"{name} holds id {int(bad.flat[0])} outside the vocabulary [0, {self.config.vocab_size})")
        return ids.astype(np.int32)

    def _check_batch(self, token_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
        ids = self._check_tokens(token_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise ValueError(f"token_ids must be [B, T] (or [T]), got shape {ids.shape}")
        if attention_mask is None:
            return ids, np.ones(ids.shape, bool)
        mask = np.asarray(attention_mask)
        if mask.ndim == 1:
            mask = mask[None]
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} does not match token_ids shape {ids.shape}")
        if not np.isin(mask, (0, 1)).all():
            raise ValueError("attention_mask must contain only 0 and 1")
        mask = mask.astype(bool)
        if not mask.any(axis=1).all():
            raise ValueError(f"attention_mask row {int(np.argmin(mask.any(axis=1)))} has no real token")
        if (np.diff(mask.astype(np.int8), axis=1) < 0).any():
            raise ValueError("attention_mask must be left-padded (padding before the real tokens of each row)")
        return ids, mask

    # ----- public API -----
    def init_state(self, batch_size: int, max_len: int) -> DecodeState:
        """A fresh state for `batch_size` rows and up to `max_len` tokens per row."""
        if max_len > self.config.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's context limit "
                             f"{self.config.max_position_embeddings}")
        state = init_decode_state(self.config, batch_size, max_len, self.dtype)
        if self.mesh is not None:
            from k3jax.sharding import state_shardings
            state = jax.device_put(state, state_shardings(state, self.mesh))
        return state

    def logits(self, token_ids, attention_mask=None) -> jax.Array:
        """Full forward. token_ids [B, T] -> logits [B, T, Vocab] float32."""
        ids, mask = self._check_batch(token_ids, attention_mask)
        if ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"prompt of {ids.shape[1]} tokens exceeds the context limit "
                             f"{self.config.max_position_embeddings}")
        with self.mesh_context():
            return self._logits(self.params, self._put(ids), self._put(mask))

    def hidden_states(self, token_ids, attention_mask=None) -> jax.Array:
        """Pre-norm final hidden state [B, T, D] (after K3's output AttnRes mix): the MTP input."""
        ids, mask = self._check_batch(token_ids, attention_mask)
        with self.mesh_context():
            return self._hidden(self.params, self._put(ids), self._put(mask))

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
        ids, mask = self._check_batch(next_tokens, attention_mask)
        hidden = jnp.asarray(hidden)
        if hidden.shape != ids.shape + (self.config.hidden_size,):
            raise ValueError(f"hidden shape {hidden.shape} does not match next_tokens {ids.shape}")
        if positions is None:
            positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
        with self.mesh_context():
            return self._mtp(self.params, hidden, self._put(ids), self._put(np.asarray(positions, np.int32)),
                             self._put(mask), layer=layer)

    def prefill(self, token_ids, attention_mask=None, *, state: DecodeState | None = None,
                max_len: int | None = None, all_logits: bool = False):
        """Runs the prompt and returns (logits, state).

        Args:
          token_ids: [B, T] ints (left-padded when rows differ in length).
          attention_mask: [B, T] of 0/1, or None (all real).
          state: continue from this state instead of starting fresh (chunked prefill).
          max_len: tokens per row the new state can hold (prompt + generated); default: the
            prompt rounded up, plus room for 128 tokens. Ignored when `state` is given.
          all_logits: return [B, T, Vocab] instead of the last position's [B, Vocab].
        """
        ids, mask = self._check_batch(token_ids, attention_mask)
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
        with self.mesh_context():
            return self._prefill(self.params, self._put(ids), self._put(mask), state, fresh=fresh,
                                 all_logits=all_logits)

    def decode_step(self, state: DecodeState, next_tokens):
        """Feeds one token per row. next_tokens [B] -> (logits [B, Vocab] fp32, new state)."""
        ids = self._check_tokens(next_tokens, "next_tokens").reshape(-1)
        self._check_room(state, ids.shape[0], np.ones(ids.shape[0], np.int64))
        with self.mesh_context():
            return self._decode(self.params, state, self._put(ids))

    def _check_room(self, state: DecodeState, batch: int, new_tokens: np.ndarray) -> None:
        if state.batch_size != batch:
            raise ValueError(f"state holds {state.batch_size} rows but {batch} were given")
        capacity = state.capacity
        if capacity is not None:
            used = np.asarray(state.lengths)
            if (used + new_tokens > capacity).any():
                raise ValueError(f"the state's cache is full ({capacity} tokens per row); "
                                 "start from a prefill with a larger max_len")
