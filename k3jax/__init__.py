"""k3jax: Kimi K3 and Kimi-Linear inference in JAX/Flax."""

from k3jax.causal_lm import CausalLM
from k3jax.config import (Activation, AttnResConfig, ConfigError, KDAConfig, MLAConfig, MLPConfig, ModelConfig,
                          MoEConfig, tiny_k3, tiny_kimi_linear)
from k3jax.hf_config import from_hf_config, load_hf_config, to_hf_config
from k3jax.generate import GenerationOutput, GenerationResult, Generator, StreamChunk, generate
from k3jax.sampling import SamplingParams
from k3jax.state import DecodeState, KDAState, MLACache, init_decode_state
from k3jax.tokenizer import KimiTokenizer

__all__ = [
    # Models
    "CausalLM", "load", "load_model",
    # Generation
    "generate", "Generator", "SamplingParams", "GenerationOutput", "GenerationResult", "StreamChunk",
    "KimiTokenizer",
    # Configuration
    "ModelConfig", "KDAConfig", "MLAConfig", "MLPConfig", "MoEConfig", "AttnResConfig", "Activation",
    "ConfigError", "from_hf_config", "load_hf_config", "to_hf_config", "tiny_kimi_linear", "tiny_k3",
    # Decode state
    "DecodeState", "KDAState", "MLACache", "init_decode_state",
]


def load(path, dtype="float32", **kwargs) -> CausalLM:
    """Loads a Hugging Face Kimi-Linear or K3 checkpoint directory (config.json + safetensors
    [+ index]). Keyword options: see `k3jax.checkpoint.loader.load_causal_lm`."""
    from k3jax.checkpoint.loader import load_causal_lm
    return load_causal_lm(path, dtype=dtype, **kwargs)


def load_model(name_or_path, dtype="float32", *, seed: int = 0, **kwargs) -> CausalLM:
    """A built-in tiny model by name ("tiny-k3", "tiny-kimi-linear") or a checkpoint directory.

    The returned model carries its tokenizer as `model.tokenizer` when one exists (built-in models
    always; directories when they hold tiktoken.model).
    """
    import os

    from k3jax.tiny import BUILTIN, builtin_config

    if name_or_path in BUILTIN:
        cfg, tok = builtin_config(name_or_path)
        model = CausalLM.random(cfg, seed=seed, dtype=dtype)
    elif os.path.isdir(name_or_path):
        model = load(name_or_path, dtype=dtype, **kwargs)
        tok = KimiTokenizer.from_pretrained(name_or_path) if os.path.exists(
            os.path.join(name_or_path, "tiktoken.model")) else None
    else:
        raise ValueError(f"unknown model {name_or_path!r}: not a built-in model ({', '.join(BUILTIN)}) "
                         "and not a checkpoint directory")
    model.tokenizer = tok
    return model
