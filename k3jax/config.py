"""Frozen configuration tree for Kimi-Linear and Kimi K3 text models.

Each module receives only its own sub-config. `ModelConfig` holds the per-layer plan (mixer kind
and FFN kind per layer) and the shared sub-configs. Implementation choices (`impl` fields) live in
the sub-configs; the pure-JAX reference is always one of the choices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from k3jax.errors import ConfigError, require, require_choice, require_positive
from k3jax.layers.activation import Activation
from k3jax.layers.attn_res import ATTN_RES_IMPLS, AttnResImpl
from k3jax.layers.mla_attention import (MLA_DECODE_IMPLS, MLA_MERGE_IMPLS, MLA_PREFILL_IMPLS, MLADecodeImpl,
                                        MLAPrefillImpl)
from k3jax.layers.moe_experts import EXPERT_IMPLS, ExpertImpl
from pallas_kernels.kda import (KDA_DECODE_IMPLS, KDA_IMPLS, HopperDecodeBlocks, KDADecodeImpl, KDAImpl,
                                hopper_decode_runs_here, value_blocks_fit)
from pallas_kernels.moe_gmm import GMM_IMPLS, GmmImpl
from pallas_kernels.rms_norm import NORM_IMPLS, NormImpl
from pallas_kernels.router import ROUTER_IMPLS, RouterImpl
from pallas_kernels.skinny import SKINNY_IMPLS, SkinnyImpl

# Decode steps per iteration of the compiled decode loop ("1": the reference form; "auto":
# `decode_loop.loop_steps`).
LOOP_UNROLLS: tuple[str, ...] = ("auto", "1", "2", "4", "8")
# How an iteration runs its steps: "loop", an inner loop of a known trip count (the host launches the
# next step while the GPU runs one); "unrolled", copies of the step in one body (the reference).
LOOP_INNERS: tuple[str, ...] = ("loop", "unrolled")
# How generate starts its first decode chunk (`Generator.generate`): "overlap" dispatches it from a
# helper thread while the first token is read back, "serial" after the read (the reference).
LOOP_STARTS: tuple[str, ...] = ("overlap", "serial")

__all__ = ["Activation", "AttnResConfig", "ConfigError", "ExpertParallel", "KDAConfig", "MLAConfig", "MLPConfig",
           "ModelConfig", "MoEConfig", "IMPL_OPTIONS", "kimi_linear_48b_a3b", "tiny_k3", "tiny_kimi_linear"]

QUANTIZATIONS = (None, "mxfp4")
A_LOG_POLICIES = ("per_head", "per_channel")

KDA_STATE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
# Programs per (row, head) of the Pallas one-token KDA step, each over a block of the state's columns
# ("auto": `DecodeBlocks.value_blocks_for`; "1": one program per head, the output norm fused).
KDA_DECODE_SPLITS: tuple[str, ...] = ("auto", "1", "2", "4", "8")
EP_DISPATCHES: tuple[str, ...] = ("gather", "ragged")
# How packed (MXFP4) routed experts lie on the device (MoEConfig.packed_layout): "rows" = codes
# [E, in/2, out] (the Pallas-Triton kernels, pallas_kernels.moe_gmm.mxfp4.Mxfp4Weight); "columns" =
# codes [E, out, in/2] as the checkpoint stores each expert (the Mosaic GPU kernel,
# pallas_kernels.moe_gmm.hopper_mxfp4.Mxfp4Columns); "handoff" = "columns" with the gate and up weights' output
# columns reordered within each 32 (`HandOffColumns`: the Mosaic GPU kernel's gated launch then writes h as the down
# launch reads it, the GLU in its epilogue). Scales are [E, in/32, out] in all (in the same column order).
PACKED_LAYOUTS: tuple[str, ...] = ("rows", "columns", "handoff")
COLUMN_LAYOUTS: tuple[str, ...] = ("columns", "handoff")      # the Mosaic GPU kernel's (codes [E, out, in/2])


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention layer (arch §4). P = num_heads * head_dim."""

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_size: int = 4
    norm_eps: float = 1e-5                 # o_norm epsilon (rms_norm_eps)
    gate_lower_bound: float | None = None  # None: -exp(A)*softplus gate; K3: lb*sigmoid(exp(A)*u)
    use_full_rank_gate: bool = False       # K3 g_proj (D->P) instead of g_a_proj/g_b_proj
    a_log_policy: str = "per_head"         # how an A_log longer than num_heads is read (arch §4.5.3)
    impl: KDAImpl = "chunked"              # multi-token path (pallas_kernels.kda.KDA_IMPLS)
    decode_impl: KDADecodeImpl = "xla"     # single-token steps (pallas_kernels.kda.KDA_DECODE_IMPLS)
    chunk_size: int = 64
    # dtype the recurrent state is kept in between calls (the math is fp32 either way): "bfloat16"
    # halves the state's bytes and its decode traffic, rounding it after every token.
    state_dtype: str = "float32"
    decode_split: str = "auto"             # KDA_DECODE_SPLITS (decode_impl "pallas" only)

    def __post_init__(self):
        for f in ("hidden_size", "num_heads", "head_dim", "conv_size", "chunk_size"):
            require_positive(getattr(self, f), f"linear_attn_config.{f}" if f != "hidden_size" else f)
        require(self.conv_size >= 2, "linear_attn_config.short_conv_kernel_size",
                 f"must be >= 2, got {self.conv_size}")
        require_choice(self.impl, KDA_IMPLS, "kda.impl")
        require(self.decode_impl != "reference", "kda.decode_impl", "'reference' is now called 'xla'")
        require_choice(self.decode_impl, KDA_DECODE_IMPLS, "kda.decode_impl")
        require_choice(self.state_dtype, KDA_STATE_DTYPES, "kda.state_dtype")
        require_choice(self.decode_split, KDA_DECODE_SPLITS, "kda.decode_split")
        if self.decode_split != "auto":
            blocks = int(self.decode_split)
            require(value_blocks_fit(self.head_dim, blocks), "kda.decode_split",
                    f"{blocks} column blocks of a {self.head_dim}-wide head are not whole blocks of >= 16 columns")
        if self.decode_impl == "hopper":
            require(hopper_decode_runs_here(self.head_dim, self.state_dtype), "kda.decode_impl",
                    f"'hopper' needs a head_dim that is a multiple of 64, got {self.head_dim}")
            require(HopperDecodeBlocks().fits(self.head_dim, self.conv_size, {"state": self.state_dtype}),
                    "kda.decode_impl", f"'hopper' at head_dim {self.head_dim} ({self.state_dtype} state) needs more "
                    f"shared memory than one block has")
        require(self.a_log_policy in A_LOG_POLICIES, "kda.a_log_policy",
                 f"expected one of {A_LOG_POLICIES}, got {self.a_log_policy!r}")
        if self.gate_lower_bound is not None:
            require(self.gate_lower_bound < 0, "linear_attn_config.gate_lower_bound",
                     f"must be negative, got {self.gate_lower_bound}")

    @property
    def proj_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MLAConfig:
    """NoPE multi-head latent attention (arch §5)."""

    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    use_output_gate: bool = False
    latent_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm (HF default; arch §5.5)
    decode_impl: MLADecodeImpl = "absorbed"  # attention over the latent cache (MLA_DECODE_IMPLS)
    prefill_impl: MLAPrefillImpl = "auto"    # a fresh prompt over its own tokens (MLA_PREFILL_IMPLS)
    # W_UK / W_UV (with kv_a_layernorm and the split merge) around the "pallas"/"hopper" decode forms:
    # "xla" (einsums, the reference), "pallas" (the few-row kernels of pallas_kernels.mla_absorb),
    # "auto" ("pallas" on a GPU: about 5 us less per MLA layer at the 48B decode).
    absorb_impl: SkinnyImpl = "auto"
    # How the "hopper" form merges its sequence splits where the absorb kernels do not (more than 16
    # query rows): "xla" (combine_splits, the reference), "pallas" (one launch) or "auto" (pallas from 64
    # splits on, where it measured faster; MLA_MERGE_IMPLS).
    merge_impl: str = "auto"

    def __post_init__(self):
        for f in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            require_positive(getattr(self, f), f if f != "num_heads" else "num_attention_heads")
        require(isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0,
                 "qk_rope_head_dim", f"expected an integer >= 0, got {self.qk_rope_head_dim!r}")
        if self.q_lora_rank is not None:
            require_positive(self.q_lora_rank, "q_lora_rank")
        require_choice(self.decode_impl, MLA_DECODE_IMPLS, "mla.decode_impl")
        require_choice(self.prefill_impl, MLA_PREFILL_IMPLS, "mla.prefill_impl")
        require_choice(self.absorb_impl, SKINNY_IMPLS, "mla.absorb_impl")
        require_choice(self.merge_impl, MLA_MERGE_IMPLS, "mla.merge_impl")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Width of one cached token: normalised latent plus the un-rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5


@dataclass(frozen=True)
class MLPConfig:
    """Gated dense MLP (dense layers and shared experts)."""

    hidden_size: int
    intermediate_size: int
    activation: Activation = Activation()

    def __post_init__(self):
        require_positive(self.hidden_size, "hidden_size")
        require_positive(self.intermediate_size, "intermediate_size")


@dataclass(frozen=True)
class ExpertParallel:
    """Routed experts sharded over the mesh's "expert" axis (k3jax.layers.moe_parallel), for a mesh
    with these axis sizes; the layer checks the mesh it runs under against them."""

    expert_shards: int
    data_shards: int = 1

    def __post_init__(self):
        require_positive(self.expert_shards, "expert_parallel.expert_shards")
        require_positive(self.data_shards, "expert_parallel.data_shards")


SHARED_IMPLS = ("auto", "mlp")   # MoEConfig.shared_impl

@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with a sigmoid router and shared experts (arch §6)."""

    hidden_size: int
    num_experts: int
    num_experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    score_function: str = "sigmoid"
    activation: Activation = Activation()
    latent_size: int | None = None  # K3: routed experts run in this width (routed_expert_hidden_size)
    latent_use_norm: bool = False   # K3: RMSNorm on the combined latent routed output
    norm_eps: float = 1e-5
    impl: ExpertImpl = "ragged"    # routed-expert path (k3jax.layers.moe_experts.EXPERT_IMPLS)
    gmm_impl: GmmImpl = "auto"     # grouped matmul of the ragged path (pallas_kernels.moe_gmm.GMM_IMPLS)
    # Top-k routing on the few-row (decode) path: one kernel launch or XLA's sort
    # (pallas_kernels.router.ROUTER_IMPLS; ungrouped routers only, grouped ones always take XLA).
    router_impl: RouterImpl = "auto"
    # The shared expert at decode: "auto" runs it as one more pair in the routed experts' pair
    # kernels when it has their shape (one shared expert, no latent, unpacked, unsharded experts:
    # Kimi-Linear), saving its own launches; "mlp" keeps it a separate MLP (the reference).
    shared_impl: str = "auto"
    expert_parallel: ExpertParallel | None = None  # set by k3jax.sharding.config_for_mesh
    # How tokens reach the expert shards when they split over them (k3jax.layers.moe_parallel):
    # "gather" (all_gather + psum_scatter) or "ragged" (each pair only to its expert's shard).
    ep_dispatch: str = "gather"
    # Routed-expert weights kept as the checkpoint's MXFP4 (uint8 codes + E8M0 scales per 32
    # inputs, a quarter of bf16's bytes) and decoded inside the expert kernels; False = dequantised
    # to the model dtype at load time. Only from an MXFP4 checkpoint (`k3jax.load(.., packed_experts=True)`).
    packed_experts: bool = False
    packed_layout: str = "rows"    # PACKED_LAYOUTS: the packed experts' device layout, hence their kernel

    def __post_init__(self):
        require_positive(self.num_experts, "num_experts")
        require_choice(self.gmm_impl, GMM_IMPLS, "moe.gmm_impl")
        require_choice(self.router_impl, ROUTER_IMPLS, "moe.router_impl")
        require_choice(self.shared_impl, SHARED_IMPLS, "moe.shared_impl")
        if self.latent_size is not None:
            require_positive(self.latent_size, "routed_expert_hidden_size")
        require_positive(self.num_experts_per_token, "num_experts_per_token")
        require_positive(self.expert_intermediate_size, "moe_intermediate_size")
        require(isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0,
                 "num_shared_experts", f"expected an integer >= 0, got {self.num_shared_experts!r}")
        require(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                 f"{self.num_experts_per_token} exceeds num_experts={self.num_experts}")
        require_positive(self.num_expert_group, "num_expert_group")
        require(self.num_experts % self.num_expert_group == 0, "num_expert_group",
                 f"num_experts={self.num_experts} is not divisible by {self.num_expert_group}")
        require(1 <= self.topk_group <= self.num_expert_group, "topk_group",
                 f"must be in [1, num_expert_group={self.num_expert_group}], got {self.topk_group}")
        if self.num_expert_group > 1:
            per_group = self.num_experts // self.num_expert_group
            require(per_group >= 2, "num_expert_group", "grouped routing needs >= 2 experts per group")
            require(self.topk_group * per_group >= self.num_experts_per_token, "topk_group",
                     "the kept groups hold fewer experts than num_experts_per_token")
        require(self.score_function in ("sigmoid", "softmax"), "moe_router_activation_func",
                 f"expected 'sigmoid' or 'softmax', got {self.score_function!r}")
        require_choice(self.impl, EXPERT_IMPLS, "moe.impl")
        require_choice(self.ep_dispatch, EP_DISPATCHES, "moe.ep_dispatch")
        require_choice(self.packed_layout, PACKED_LAYOUTS, "moe.packed_layout")
        require(self.packed_layout == "rows" or self.packed_experts, "expert_layout",
                f"{self.packed_layout!r} is a layout of packed experts: load an MXFP4 checkpoint with "
                "packed_experts=True (--packed-experts)")
        if self.packed_experts:
            require(self.expert_input_size % 32 == 0 and self.expert_intermediate_size % 32 == 0, "packed_experts",
                    f"MXFP4 needs expert widths that are multiples of 32, got {self.expert_input_size} and "
                    f"{self.expert_intermediate_size}")
        if self.expert_parallel is not None:
            require(self.num_experts % self.expert_parallel.expert_shards == 0, "num_experts",
                     f"{self.num_experts} experts do not split over {self.expert_parallel.expert_shards} expert shards")

    @property
    def expert_input_size(self) -> int:
        """Width the routed experts see: the latent width (K3) or the hidden size."""
        return self.hidden_size if self.latent_size is None else self.latent_size

    @property
    def shared(self) -> MLPConfig | None:
        """Config of the always-active shared experts (one MLP of the combined width)."""
        if self.num_shared_experts == 0:
            return None
        return MLPConfig(self.hidden_size, self.expert_intermediate_size * self.num_shared_experts,
                         self.activation)


@dataclass(frozen=True)
class AttnResConfig:
    """Attention residuals over depth (K3, arch §3). Blocks of `block_size` decoder layers."""

    block_size: int
    eps: float = 1e-5
    impl: AttnResImpl = "buffer"  # k3jax.layers.attn_res.ATTN_RES_IMPLS

    def __post_init__(self):
        require_positive(self.block_size, "attn_res_block_size")
        require_choice(self.impl, ATTN_RES_IMPLS, "attn_res.impl")

    def num_blocks(self, num_layers: int) -> int:
        """Stored blocks: the embedding plus one per completed block = ceil(L / block_size)."""
        return -(-num_layers // self.block_size)


@dataclass(frozen=True)
class ModelConfig:
    """A whole text model: the per-layer plan plus the sub-config of each layer kind."""

    vocab_size: int
    hidden_size: int
    mixers: tuple[str, ...]         # per layer: "kda" or "mla"
    ffns: tuple[str, ...]           # per layer: "dense" or "moe"
    rms_norm_eps: float = 1e-5
    kda: KDAConfig | None = None
    mla: MLAConfig | None = None
    mlp: MLPConfig | None = None
    moe: MoEConfig | None = None
    attn_res: AttnResConfig | None = None
    mtp_mixers: tuple[str, ...] = ()  # per MTP draft layer (global index L + j): "kda" or "mla"
    mtp_ffns: tuple[str, ...] = ()
    mtp_own_embedding: bool = False   # the checkpoint stores an embedding under the first MTP layer
    quantization: str | None = None   # routed experts stored as "mxfp4" (compressed-tensors)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1 << 20
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    model_type: str = "kimi_linear"
    linear_impl: SkinnyImpl = "auto"  # projections of few rows (pallas_kernels.skinny.SKINNY_IMPLS)
    norm_impl: NormImpl = "auto"      # residual-stream RMSNorms of few rows (pallas_kernels.rms_norm.NORM_IMPLS)
    # Decode steps per iteration of the compiled decode loop (LOOP_UNROLLS; `loop_steps`): each iteration
    # ends in a device-to-host read of the loop condition, which leaves the GPU idle for a moment.
    loop_unroll: str = "auto"
    loop_inner: str = "loop"          # LOOP_INNERS
    loop_start: str = "overlap"       # LOOP_STARTS
    # Prompt tokens per prefill call (rows x chunk length): a longer prompt runs as chunks that continue
    # the state, so prefill memory stays bounded; 0 runs every prompt in one call (the reference).
    prefill_chunk_tokens: int = 16384

    def __post_init__(self):
        require_positive(self.vocab_size, "vocab_size")
        require_choice(self.linear_impl, SKINNY_IMPLS, "linear_impl")
        require_choice(self.loop_unroll, LOOP_UNROLLS, "loop_unroll")
        require_choice(self.loop_inner, LOOP_INNERS, "loop_inner")
        require_choice(self.loop_start, LOOP_STARTS, "loop_start")
        require(isinstance(self.prefill_chunk_tokens, int) and self.prefill_chunk_tokens >= 0, "prefill_chunk_tokens",
                f"must be a non-negative integer, got {self.prefill_chunk_tokens!r}")
        require_positive(self.hidden_size, "hidden_size")
        require(len(self.mixers) > 0, "num_hidden_layers", "the model has no layers")
        require(len(self.ffns) == len(self.mixers), "mlp_layer_types",
                 f"has {len(self.ffns)} entries for {len(self.mixers)} layers")
        for i, m in enumerate(self.mixers):
            require(m in ("kda", "mla"), "layer_types", f"layer {i}: unknown mixer {m!r}")
        for i, f in enumerate(self.ffns):
            require(f in ("dense", "moe"), "mlp_layer_types", f"layer {i}: unknown FFN kind {f!r}")
        require(len(self.mtp_ffns) == len(self.mtp_mixers), "num_nextn_predict_layers",
                 "mtp_mixers and mtp_ffns differ in length")
        require(self.quantization in QUANTIZATIONS, "quantization_config",
                 f"unsupported quantization {self.quantization!r}; supported: mxfp4 (compressed-tensors)")
        if self.quantization == "mxfp4" and self.moe is not None:
            for name, size in (("moe_intermediate_size", self.moe.expert_intermediate_size),
                               ("routed_expert_hidden_size", self.moe.expert_input_size)):
                require(size % 32 == 0, name, f"{size} is not a multiple of the MXFP4 group size 32")
        mixers, ffns = self.mixers + self.mtp_mixers, self.ffns + self.mtp_ffns
        require(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        require(self.tie_word_embeddings is False, "tie_word_embeddings",
                 "tied embeddings are not used by Kimi models and are not supported")
        if "kda" in mixers:
            require(self.kda is not None, "linear_attn_config", "KDA layers need a KDA config")
        if "mla" in mixers:
            require(self.mla is not None, "kv_lora_rank", "MLA layers need an MLA config")
        if "dense" in ffns:
            require(self.mlp is not None, "intermediate_size", "dense layers need intermediate_size")
        if "moe" in ffns:
            require(self.moe is not None, "num_experts", "MoE layers need an MoE config")
        for name in ("kda", "mla", "mlp", "moe"):
            sub = getattr(self, name)
            if sub is not None:
                require(sub.hidden_size == self.hidden_size, f"{name}.hidden_size",
                         f"{sub.hidden_size} != hidden_size {self.hidden_size}")
        for name in ("bos_token_id", "pad_token_id"):
            tok = getattr(self, name)
            require(tok is None or 0 <= tok < self.vocab_size, name,
                     f"{tok} is outside the vocabulary [0, {self.vocab_size})")
        for tok in self.eos_token_id:
            require(0 <= tok < self.vocab_size, "eos_token_id",
                     f"{tok} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp_mixers)

    def mixer_config(self, kind: str) -> KDAConfig | MLAConfig:
        """The sub-config of a mixer kind ("kda" or "mla")."""
        return self.kda if kind == "kda" else self.mla

    def ffn_config(self, kind: str) -> MLPConfig | MoEConfig:
        """The sub-config of an FFN kind ("dense" or "moe")."""
        return self.moe if kind == "moe" else self.mlp

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def with_impls(self, **choices: str | None) -> "ModelConfig":
        """A copy with other implementation choices (the math is unchanged).

        Options (IMPL_OPTIONS): kda, kda_decode, mla, mla_prefill, moe, gmm, attn_res, linear; None
        leaves a choice as it is, and a choice for a part the model lacks is ignored. The same names
        are used by `k3jax.load(...)`, `CausalLM.with_impls(...)` and the CLI.
        """
        out = self
        for name, value in choices.items():
            if name in RENAMED_IMPL_OPTIONS:
                raise ConfigError(f"implementation option '{name}' is now called '{RENAMED_IMPL_OPTIONS[name]}'")
            if name not in IMPL_OPTIONS:
                raise ConfigError(f"unknown implementation option '{name}'; options: {', '.join(IMPL_OPTIONS)}")
            sub_name, field_name, _ = IMPL_OPTIONS[name]
            if value is None:
                continue
            if sub_name is None:
                out = out.replace(**{field_name: value})
            elif getattr(out, sub_name) is not None:
                out = out.replace(**{sub_name: dataclasses.replace(getattr(out, sub_name), **{field_name: value})})
        return out


# Implementation option -> (sub-config or None for ModelConfig itself, field, allowed values): the
# one vocabulary of choices.
IMPL_OPTIONS: dict[str, tuple[str | None, str, tuple[str, ...]]] = {
    "kda": ("kda", "impl", KDA_IMPLS),
    "kda_decode": ("kda", "decode_impl", KDA_DECODE_IMPLS),
    "kda_state": ("kda", "state_dtype", KDA_STATE_DTYPES),
    "kda_split": ("kda", "decode_split", KDA_DECODE_SPLITS),
    "mla": ("mla", "decode_impl", MLA_DECODE_IMPLS),
    "mla_prefill": ("mla", "prefill_impl", MLA_PREFILL_IMPLS),
    "mla_absorb": ("mla", "absorb_impl", SKINNY_IMPLS),
    "mla_merge": ("mla", "merge_impl", MLA_MERGE_IMPLS),
    "moe": ("moe", "impl", EXPERT_IMPLS),
    "gmm": ("moe", "gmm_impl", GMM_IMPLS),
    "router": ("moe", "router_impl", ROUTER_IMPLS),
    "shared": ("moe", "shared_impl", SHARED_IMPLS),
    "ep_dispatch": ("moe", "ep_dispatch", EP_DISPATCHES),
    "expert_layout": ("moe", "packed_layout", PACKED_LAYOUTS),
    "attn_res": ("attn_res", "impl", ATTN_RES_IMPLS),
    "linear": (None, "linear_impl", SKINNY_IMPLS),
    "norm": (None, "norm_impl", NORM_IMPLS),
    "loop_unroll": (None, "loop_unroll", LOOP_UNROLLS),
    "loop_inner": (None, "loop_inner", LOOP_INNERS),
    "loop_start": (None, "loop_start", LOOP_STARTS),
}
RENAMED_IMPL_OPTIONS = {"kda_impl": "kda", "kda_decode_impl": "kda_decode", "mla_impl": "mla", "moe_impl": "moe",
                        "gmm_impl": "gmm", "attn_res_impl": "attn_res"}


def kimi_linear_48b_a3b() -> ModelConfig:
    """The released Kimi-Linear-48B-A3B text model (arch §1.2-1.4): 27 layers, MLA at 1-based
    layers 4, 8, ..., 24, 27, layer 0 dense, 256 experts top-8."""
    hidden = 2304
    full = {4, 8, 12, 16, 20, 24, 27}
    return ModelConfig(
        vocab_size=163840, hidden_size=hidden,
        mixers=tuple("mla" if i + 1 in full else "kda" for i in range(27)),
        ffns=("dense",) + ("moe",) * 26,
        kda=KDAConfig(hidden_size=hidden, num_heads=32, head_dim=128),
        mla=MLAConfig(hidden_size=hidden, num_heads=32, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128),
        mlp=MLPConfig(hidden_size=hidden, intermediate_size=9216),
        moe=MoEConfig(hidden_size=hidden, num_experts=256, num_experts_per_token=8, expert_intermediate_size=1024,
                      num_shared_experts=1, routed_scaling_factor=2.446),
        bos_token_id=163584, eos_token_id=(163586,), pad_token_id=163839,
    )


def kimi_k3() -> ModelConfig:
    """The released Kimi K3 text model as published (arch §1.2-1.5): 93 layers (MLA at 1-based layers
    4, 8, ..., 92 and 93, the other 69 KDA with 96 heads), hidden 7168, layer 0 dense (33792), 896
    routed experts top-16 of width 3072 on a 3584-wide latent, 2 shared experts, SiTU, AttnRes
    blocks of 12, MXFP4 routed experts in the checkpoint; about 2.8T parameters."""
    hidden, layers = 7168, 93
    full = set(range(4, 93, 4)) | {93}
    act = Activation("situ", 4.0, 25.0)
    return ModelConfig(
        vocab_size=163840, hidden_size=hidden,
        mixers=tuple("mla" if i + 1 in full else "kda" for i in range(layers)),
        ffns=("dense",) + ("moe",) * (layers - 1),
        kda=KDAConfig(hidden_size=hidden, num_heads=96, head_dim=128, gate_lower_bound=-5.0, use_full_rank_gate=True),
        mla=MLAConfig(hidden_size=hidden, num_heads=96, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, q_lora_rank=1536, use_output_gate=True),
        mlp=MLPConfig(hidden_size=hidden, intermediate_size=33792, activation=act),
        moe=MoEConfig(hidden_size=hidden, num_experts=896, num_experts_per_token=16, expert_intermediate_size=3072,
                      num_shared_experts=2, activation=act, latent_size=3584, latent_use_norm=True),
        attn_res=AttnResConfig(block_size=12),
        max_position_embeddings=1048576, quantization="mxfp4",
        bos_token_id=163584, eos_token_id=(163586,), pad_token_id=163839, model_type="kimi_k3",
    )


def tiny_kimi_linear(*, vocab_size: int = 512, num_layers: int = 4, hidden: int = 64, num_experts: int = 8,
                     expert_intermediate_size: int = 32) -> ModelConfig:
    """A tiny Kimi-Linear-shaped config for tests and the demo (KDA/MLA alternating, layer 0 dense)."""
    mixers = tuple("mla" if (i % 2 == 1 or i == num_layers - 1) else "kda" for i in range(num_layers))
    ffns = tuple("dense" if i == 0 else "moe" for i in range(num_layers))
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        mixers=mixers,
        ffns=ffns,
        kda=KDAConfig(hidden_size=hidden, num_heads=4, head_dim=16, chunk_size=16),
        mla=MLAConfig(hidden_size=hidden, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16),
        mlp=MLPConfig(hidden_size=hidden, intermediate_size=128),
        moe=MoEConfig(hidden_size=hidden, num_experts=num_experts, num_experts_per_token=2,
                      expert_intermediate_size=expert_intermediate_size, num_shared_experts=1,
                      routed_scaling_factor=2.446),
        bos_token_id=1, eos_token_id=(2,), pad_token_id=0,
    )


def tiny_k3(*, vocab_size: int = 512, num_layers: int = 13, attn_res_block_size: int = 3,
            num_mtp_layers: int = 1) -> ModelConfig:
    """A tiny K3-shaped config: AttnRes, latent MoE with SiTU, bounded KDA gate with a full-rank
    output gate, MLA with q_lora and an output gate, MLA every 4th layer and last, an MTP layer."""
    hidden = 64
    act = Activation("situ", 4.0, 25.0)
    mixers = tuple("mla" if (i % 4 == 3 or i == num_layers - 1) else "kda" for i in range(num_layers))
    ffns = tuple("dense" if i == 0 else "moe" for i in range(num_layers))
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        mixers=mixers,
        ffns=ffns,
        kda=KDAConfig(hidden_size=hidden, num_heads=4, head_dim=16, chunk_size=16, gate_lower_bound=-5.0,
                      use_full_rank_gate=True),
        mla=MLAConfig(hidden_size=hidden, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16, q_lora_rank=32, use_output_gate=True),
        mlp=MLPConfig(hidden_size=hidden, intermediate_size=128, activation=act),
        moe=MoEConfig(hidden_size=hidden, num_experts=8, num_experts_per_token=2, expert_intermediate_size=32,
                      num_shared_experts=2, activation=act, latent_size=32, latent_use_norm=True),
        attn_res=AttnResConfig(block_size=attn_res_block_size),
        mtp_mixers=("mla",) * num_mtp_layers,
        mtp_ffns=("moe",) * num_mtp_layers,
        bos_token_id=1, eos_token_id=(2,), pad_token_id=0, model_type="kimi_k3",
    )
