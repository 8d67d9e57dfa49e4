"""k3jax: Kimi K3 and Kimi-Linear inference in JAX/Flax."""

import os

from k3jax._version import __version__
from k3jax.runtime import enable_compilation_cache

from k3jax.causal_lm import CausalLM
from k3jax.checkpoint.loader import load_causal_lm
from k3jax.config import (IMPL_OPTIONS, RENAMED_IMPL_OPTIONS, Activation, AttnResConfig, ConfigError, KDAConfig,
                          MLAConfig, MLPConfig, ModelConfig, MoEConfig, tiny_k3, tiny_kimi_linear)
from k3jax.generate import GenerationInterrupted, Generator, generate
from k3jax.outputs import CompletionOutput, GenerationOutput, GenerationResult, SpeculativeStats, StreamChunk
from k3jax.hf_config import from_hf_config, load_hf_config, read_generation_config, to_hf_config
from k3jax.sampling import SamplingParams
from k3jax.speculative import SpeculativeConfig
from k3jax.state import DecodeState, KDAState, MLACache, init_decode_state
from k3jax.tiny import BUILTIN, TRAINED, builtin_config, trained_path
from k3jax.tokenizer import KimiTokenizer

enable_compilation_cache()

__all__ = [
    "__version__",
    # Models
    "CausalLM", "load", "load_model",
    # Generation
    "generate", "Generator", "SamplingParams", "GenerationOutput", "GenerationResult", "StreamChunk",
    "GenerationInterrupted", "CompletionOutput", "SpeculativeConfig", "SpeculativeStats",
    "KimiTokenizer",
    # Configuration
    "ModelConfig", "KDAConfig", "MLAConfig", "MLPConfig", "MoEConfig", "AttnResConfig", "Activation",
    "ConfigError", "from_hf_config", "load_hf_config", "to_hf_config", "tiny_kimi_linear", "tiny_k3",
    # Decode state
    "DecodeState", "KDAState", "MLACache", "init_decode_state",
]


def load(path, dtype="auto", **options) -> CausalLM:
    """Loads a checkpoint directory: Hugging Face (config.json + safetensors [+ index]) or a k3jax
    checkpoint written by `k3jax convert`, in `dtype` ("auto": the checkpoint's own, bf16 for the
    released models; "float32" or "bfloat16" on request). Options: see `k3jax.checkpoint.loader.load_causal_lm`
    (a_log_policy=, progress=, mesh=, packed_experts=, and implementation choices kda=, kda_decode=, mla=, moe=,
    gmm=, attn_res=). The model carries the directory's tokenizer when it holds tiktoken.model."""
    model = load_causal_lm(path, dtype=dtype, **options)
    tokenizer = (KimiTokenizer.from_pretrained(path)
                 if os.path.exists(os.path.join(os.fspath(path), "tiktoken.model")) else None)
    return CausalLM(model.module, mesh=model.mesh, load_report=model.load_report, tokenizer=tokenizer,
                    generation_config=read_generation_config(path))


def load_model(name_or_path, dtype="auto", *, seed: int = 0, **options) -> CausalLM:
    """A built-in tiny model by name ("tiny-k3": trained on the Python standard library, shipped in the
    package; "tiny-k3-random", "tiny-kimi-linear": random weights) or a checkpoint directory
    (`load`). Built-in models carry their tokenizer (`model.tokenizer`); "auto" is float32 for them."""
    if name_or_path in TRAINED:
        return load(trained_path(name_or_path), dtype=dtype, **options)
    if name_or_path in BUILTIN:
        cfg, tok = builtin_config(name_or_path)
        model = CausalLM.random(cfg, seed=seed, dtype="float32" if dtype == "auto" else dtype, tokenizer=tok)
        impls = {k: options.pop(k) for k in list(options) if k in IMPL_OPTIONS or k in RENAMED_IMPL_OPTIONS}
        if options:
            raise ValueError(f"options {sorted(options)} apply to checkpoint directories, not built-in models")
        return model.with_impls(**impls) if impls else model
    if os.path.isdir(os.fspath(name_or_path)):
        return load(name_or_path, dtype=dtype, **options)
    raise ValueError(f"unknown model {name_or_path!r}: not a built-in model ({', '.join(BUILTIN + tuple(TRAINED))}) "
                     "and not a checkpoint directory")
