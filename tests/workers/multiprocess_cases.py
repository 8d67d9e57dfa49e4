"""What the two-process worker and its test both run: generation options beyond greedy and sampled
tokens, and how a stream's chunks become token lists."""

import k3jax
from k3jax.speculative.config import SpeculativeConfig

# logprobs, a repetition penalty and a stop id (the 4th greedy token of the first prompt: at least one
# row stops early); streamed in chunks of two decode steps
FEATURES = k3jax.SamplingParams(max_tokens=6, logprobs=2, repetition_penalty=1.3, stop_token_ids=(113,))
SPECULATIVE = SpeculativeConfig(method="ngram", num_draft_tokens=2)


def streamed_tokens(chunks) -> dict[str, list[int]]:
    """Each (prompt, completion)'s tokens, joined from the stream's chunks in arrival order."""
    out: dict[str, list[int]] = {}
    for chunk in chunks:
        key = f"{chunk.index}/{chunk.completion}"
        out.setdefault(key, []).extend(chunk.token_ids)
    return out
