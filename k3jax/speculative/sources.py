"""Draft sources behind one interface, chosen by `SpeculativeConfig.method`.

A source is a small frozen dataclass (static in the compiled loop) with `k`, `needs_hidden`, and
    init(graphdef, params, prompt: PromptView, extra) -> (drafts [B, k], source state)
    next(graphdef, params, source state, outcome: VerifyOutcome) -> (drafts [B, k], source state)
`prepare` builds the source and its host-side initial `extra` argument for one batch.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.speculative.config import SpeculativeConfig
from k3jax.speculative.mtp_drafts import MTPDrafts
from k3jax.speculative.ngram import NgramDrafts
from k3jax.speculative.replay import Recording, ReplayDrafts
from k3jax.state import CACHE_ALIGN, MLACache


def check_supported(spec: SpeculativeConfig, cfg: ModelConfig) -> None:
    """Raises ValueError when this model cannot draft with `spec`."""
    if spec.method != "mtp":
        return
    if cfg.num_mtp_layers == 0:
        raise ValueError("speculative method 'mtp' needs MTP layers, and this model has none "
                         "(num_nextn_predict_layers = 0); use 'ngram'")
    if cfg.num_mtp_layers > 1:
        raise ValueError(f"speculative method 'mtp' chains one MTP layer; this model has {cfg.num_mtp_layers}")
    if cfg.mtp_mixers[0] != "mla":
        raise ValueError("speculative method 'mtp' needs an MLA mixer in the MTP layer, this one has "
                         f"{cfg.mtp_mixers[0]!r}")


def prepare(spec: SpeculativeConfig, cfg: ModelConfig, *, batch: int, rows: int, prompt_width: int,
            max_tokens: int, capacity: int, dtype):
    """(source, extra) for a batch of `batch` rows (the first `rows` real) whose prompts are
    `prompt_width` wide, generating up to `max_tokens`, with `capacity` cache slots per row."""
    check_supported(spec, cfg)
    k = spec.num_draft_tokens
    if spec.method == "ngram":
        source = NgramDrafts(k=k, ngram_min=spec.ngram_min, ngram_max=spec.ngram_max,
                             capacity=prompt_width + max_tokens + spec.window)
        return source, None
    if spec.method == "replay":
        if len(spec.replay_tokens) != rows:
            raise ValueError(f"replay_tokens holds {len(spec.replay_tokens)} continuations for {rows} completion rows")
        recorded = np.zeros((batch, max_tokens + spec.window), np.int32)
        for r, seq in enumerate(spec.replay_tokens):
            seq = list(seq)[:recorded.shape[1]]
            recorded[r, :len(seq)] = seq
        return ReplayDrafts(k=k, vocab_size=cfg.vocab_size), Recording(
            tokens=recorded, error_rate=np.float32(spec.replay_error_rate), seed=np.uint32(spec.replay_seed))
    slots = -(-capacity // CACHE_ALIGN) * CACHE_ALIGN
    return MTPDrafts(k=k), MLACache(latent=jnp.zeros((batch, slots, cfg.mla.latent_size), dtype))
