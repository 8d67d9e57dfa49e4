"""Speculative decoding: a verify step over q = k + 1 tokens per row with exact state commits,
acceptance on the device (greedy: identical output; sampled: the rejection rule that keeps the
target distribution), and draft sources (MTP, prompt lookup, replay) behind one interface."""

from k3jax.speculative.config import SPECULATIVE_METHODS, SpeculativeConfig, SpeculativeMethod

__all__ = ["SpeculativeConfig", "SpeculativeMethod", "SPECULATIVE_METHODS"]
