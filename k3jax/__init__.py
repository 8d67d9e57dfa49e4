"""k3jax: Kimi K3 and Kimi-Linear inference in JAX/Flax."""

from k3jax.causal_lm import CausalLM
from k3jax.config import (Activation, AttnResConfig, ConfigError, KDAConfig, MLAConfig, MLPConfig, ModelConfig,
                          MoEConfig, tiny_k3, tiny_kimi_linear)
from k3jax.hf_config import from_hf_config, load_hf_config, to_hf_config
from k3jax.state import DecodeState, KDAState, MLACache, init_decode_state

__all__ = [
    # Models
    "CausalLM", "load",
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
