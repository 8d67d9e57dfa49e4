"""Per-device memory of a model on a mesh: weights (sharded by the rules table of k3jax.sharding),
decode state (KDA recurrent and conv state, MLA latent cache) and an activation estimate, against
what one device holds.

    plan = plan_memory(kimi_linear_48b_a3b(), MeshSpec(expert=2), batch=64, context=4096, dtype="bfloat16")
    print(format_plan(plan))

Everything is computed from shapes (`abstract_model`, `jax.eval_shape`): nothing is allocated, so
a 2.8T-parameter K3 plans on a laptop. Used by `k3jax plan` and by `k3jax.load`, which refuses a
mesh whose weights cannot fit before reading any tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.moe import is_routed_expert_param
from k3jax.model import abstract_model
from k3jax.sharding import MeshSpec, logical_spec
from k3jax.state import KDAState, MLACache, init_decode_state

GB = 1e9
H200_BYTES = 141 * GB  # an H200's HBM (nominal; about 139.4 GiB are usable)
# Bits per routed-expert weight when packed as MXFP4: a 4-bit value plus one 8-bit scale per 32.
MXFP4_BITS = 4 + 8 / 32


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device (the most loaded device where the split is uneven) and what they hold."""

    config_name: str
    mesh: MeshSpec
    batch: int
    context: int
    dtype: str
    weights: int
    routed_experts: int          # part of `weights`
    routed_experts_mxfp4: int    # the same experts packed as MXFP4 (what a packed layout would need)
    kda_state: int
    mla_cache: int
    activations: int
    capacity: int
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        return self.weights + self.kda_state + self.mla_cache + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def _split(axes, shape, sizes: dict[str, int]) -> int:
    """How many ways a parameter of these logical axes is split over the mesh (k3jax.sharding.logical_spec)."""
    return math.prod(sizes[axis] for axis in logical_spec(axes, shape, sizes=sizes) if axis is not None)


def weight_bytes(cfg: ModelConfig, mesh: MeshSpec, dtype) -> tuple[int, int]:
    """(all weights, the routed experts among them) in bytes per device."""
    return _weight_bytes(cfg, mesh, jnp.dtype(dtype).name)


@functools.lru_cache(maxsize=32)
def _weight_bytes(cfg: ModelConfig, mesh: MeshSpec, dtype: str) -> tuple[int, int]:
    """`weight_bytes`, kept per (config, mesh, dtype): every generate call checks it."""
    sizes = {"data": mesh.data, "expert": mesh.expert, "tensor": mesh.tensor}
    total = experts = 0
    for axes, shape, nbytes, is_expert in _param_table(cfg, jnp.dtype(dtype).name):
        share = -(-nbytes // _split(axes, shape, sizes))
        total += share
        experts += share if is_expert else 0
    return total, experts


@functools.lru_cache(maxsize=8)
def _param_table(cfg: ModelConfig, dtype: str) -> tuple:
    """Per parameter: (logical axes, shape, bytes, whether it is a routed expert weight), from the
    abstract model (building K3's takes seconds, so the table is kept per config)."""
    _, state = nnx.split(abstract_model(cfg, dtype))
    table = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        axes = tuple(var.get_metadata().get("logical_axes", (None,) * len(value.shape)))
        nbytes = math.prod(value.shape) * np.dtype(value.dtype).itemsize
        table.append((axes, tuple(value.shape), nbytes, is_routed_expert_param(path)))
    return tuple(table)


def state_bytes(cfg: ModelConfig, mesh: MeshSpec, batch: int, context: int, dtype) -> tuple[int, int]:
    """(KDA state, MLA latent cache) bytes per device for `batch` rows of `context` tokens: rows over
    "data" when they divide, the KDA recurrent state's heads over "tensor" (k3jax.sharding)."""
    return _state_bytes(cfg, mesh, batch, context, jnp.dtype(dtype).name)


@functools.lru_cache(maxsize=64)
def _state_bytes(cfg: ModelConfig, mesh: MeshSpec, batch: int, context: int, dtype: str) -> tuple[int, int]:
    """`state_bytes`, kept per arguments (it traces the state's construction)."""
    shapes = jax.eval_shape(lambda: init_decode_state(cfg, batch, context, jnp.dtype(dtype)))
    rows = mesh.data if batch % mesh.data == 0 else 1
    kda = mla = 0
    for layer in shapes.layers:
        if isinstance(layer, KDAState):
            heads = layer.recurrent.shape[1]
            head_ways = mesh.tensor if heads % mesh.tensor == 0 else 1
            kda += _nbytes(layer.recurrent) // (rows * head_ways) + _nbytes(layer.conv) // rows
        elif isinstance(layer, MLACache):
            mla += _nbytes(layer.latent) // rows
    return kda, mla


def _nbytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


# XLA's compiled temporaries of the 48B shape's prefill on an H200 were 2.4-4.3x the widest-layer
# width below per token (1.8 GB for 1 x 8K, 4.5 GB for 1 x 16K, 6.4 GB for 64 x 256; RESULTS.md, prefill).
ACTIVATION_FACTOR = 4.5


def activation_bytes(cfg: ModelConfig, mesh: MeshSpec, batch: int, tokens: int, dtype) -> int:
    """An estimate of the live activations of one forward over `tokens` new tokens per row (prefill
    chunk or decode step): per token the widest layer's inputs and outputs in fp32 (KDA's q|k|v and
    gates, the dense or expert MLP) and the AttnRes sources, times ACTIVATION_FACTOR (measured), plus
    the fp32 logits of each row's last token. Rows over "data"; the vocabulary over "tensor"."""
    rows = -(-batch // mesh.data)
    widths = [cfg.hidden_size * 4]
    if cfg.kda is not None:
        widths.append(5 * cfg.kda.proj_size)
    if cfg.mla is not None:
        widths.append(cfg.mla.num_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) + cfg.mla.latent_size)
    if cfg.mlp is not None:
        widths.append(2 * cfg.mlp.intermediate_size)
    if cfg.moe is not None:
        moe = cfg.moe
        widths.append(moe.num_experts_per_token * 2 * moe.expert_intermediate_size
                      + (2 * moe.shared.intermediate_size if moe.shared is not None else 0))
    sources = cfg.attn_res.num_blocks(cfg.num_layers) + 1 if cfg.attn_res is not None else 1
    per_token = int(ACTIVATION_FACTOR * 4 * (max(widths) + sources * cfg.hidden_size))
    logits = rows * -(-cfg.vocab_size // mesh.tensor) * 4
    return rows * tokens * per_token + logits


MIN_PREFILL_CHUNK = 64  # tokens per row of one prefill chunk, however many rows share the call


def prefill_chunk_length(batch: int, width: int, tokens_per_call: int) -> int:
    """Tokens per row of each prefill call for a [batch, width] prompt: the whole width when
    batch * width <= tokens_per_call (or tokens_per_call is 0), else the largest power of two with
    batch * chunk <= tokens_per_call (at least MIN_PREFILL_CHUNK)."""
    if tokens_per_call == 0 or batch * width <= tokens_per_call:
        return width
    chunk = max(tokens_per_call // batch, 1)
    return min(width, max(1 << (chunk.bit_length() - 1), MIN_PREFILL_CHUNK))


def plan_memory(cfg: ModelConfig, mesh: MeshSpec, *, batch: int, context: int, dtype="bfloat16",
                capacity: int = H200_BYTES, name: str = "model") -> MemoryPlan:
    """Per-device bytes of `cfg` on `mesh` decoding `batch` rows with `context` tokens each; the
    activation estimate is for one prefill call of a `context`-token prompt (chunked by the
    config's prefill_chunk_tokens, `prefill_chunk_length`)."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be positive, got {batch} and {context}")
    weights, experts = weight_bytes(cfg, mesh, dtype)
    kda, mla = state_bytes(cfg, mesh, batch, context, dtype)
    acts = activation_bytes(cfg, mesh, batch, prefill_chunk_length(batch, context, cfg.prefill_chunk_tokens), dtype)
    packed_now = cfg.moe is not None and cfg.moe.packed_experts
    packed = experts if packed_now else int(experts / np.dtype(jnp.dtype(dtype)).itemsize * MXFP4_BITS / 8)
    notes = []
    if cfg.quantization == "mxfp4" and not packed_now:
        notes.append("routed experts are dequantised to the model dtype at load; load(..., packed_experts=True) "
                     "keeps them as MXFP4")
    if mesh.expert > 1 and cfg.moe is not None and cfg.moe.num_experts % mesh.expert:
        notes.append(f"{cfg.moe.num_experts} experts do not divide over expert={mesh.expert}: they stay whole")
    return MemoryPlan(config_name=name, mesh=mesh, batch=batch, context=context, dtype=str(jnp.dtype(dtype)),
                      weights=weights, routed_experts=experts, routed_experts_mxfp4=packed, kda_state=kda,
                      mla_cache=mla, activations=acts, capacity=capacity, notes=tuple(notes))


def format_plan(plan: MemoryPlan) -> str:
    """A short table of the plan, GB per device."""
    m = plan.mesh
    g = lambda n: f"{n / GB:,.2f} GB" if n >= GB / 10 else f"{n / 1e6:,.2f} MB"
    lines = [f"{plan.config_name} ({plan.dtype}) on data={m.data},expert={m.expert},tensor={m.tensor} "
             f"({m.size} device{'s' if m.size > 1 else ''}), batch {plan.batch}, context {plan.context}: per device",
             f"  weights        {g(plan.weights)}  (routed experts {g(plan.routed_experts)}; "
             f"as packed MXFP4 they would take {g(plan.routed_experts_mxfp4)})",
             f"  KDA state      {g(plan.kda_state)}",
             f"  MLA cache      {g(plan.mla_cache)}",
             f"  activations    {g(plan.activations)}  (estimate)",
             f"  total          {g(plan.total)} of {g(plan.capacity)}: "
             + ("fits" if plan.fits else f"does NOT fit ({plan.total / plan.capacity:.1f}x)")]
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def check_weights_fit(cfg: ModelConfig, mesh: MeshSpec, dtype, capacity: int | None) -> None:
    """Raises ValueError with the numbers when the weights alone exceed one device's memory."""
    if capacity is None:
        return
    weights, experts = weight_bytes(cfg, mesh, dtype)
    if weights > capacity:
        raise ValueError(
            f"the weights need {weights / GB:,.1f} GB per device on data={mesh.data},expert={mesh.expert},"
            f"tensor={mesh.tensor} ({jnp.dtype(dtype)}; routed experts {experts / GB:,.1f} GB), but a device holds "
            f"{capacity / GB:,.1f} GB; use more expert or tensor shards (`k3jax plan` shows the split)")


def mesh_spec_of(mesh) -> MeshSpec:
    """The MeshSpec of a (data, expert, tensor) jax Mesh, or one device for None."""
    return MeshSpec() if mesh is None else MeshSpec(**{a: int(mesh.shape[a]) for a in ("data", "expert", "tensor")})


def check_generation_fits(cfg: ModelConfig, mesh: MeshSpec, dtype, *, batch: int, capacity_tokens: int,
                          prompt_tokens: int, capacity: int | None) -> None:
    """Raises ValueError with the numbers when the weights, the decode state of `batch` rows with
    `capacity_tokens` cache slots and a prefill call of `prompt_tokens` tokens per row cannot fit one
    device (nothing is checked where the device memory is unknown)."""
    if capacity is None:
        return
    weights, _ = weight_bytes(cfg, mesh, dtype)
    kda, mla = state_bytes(cfg, mesh, batch, capacity_tokens, dtype)
    acts = activation_bytes(cfg, mesh, batch, prompt_tokens, dtype)
    if weights + kda + mla + acts > capacity:
        raise ValueError(
            f"{batch} rows ({capacity_tokens} cache slots each, prefill calls of {prompt_tokens} tokens per row) "
            f"do not fit one device: "
            f"weights {weights / GB:,.1f} GB + KDA state {kda / GB:,.1f} GB + MLA cache {mla / GB:,.1f} GB + "
            f"prefill activations ~{acts / GB:,.1f} GB > {capacity / GB:,.1f} GB; use fewer or shorter prompts "
            f"or more devices (`k3jax plan`)")


def device_capacity(device=None) -> int | None:
    """Bytes one accelerator holds (its allocator limit), None where unknown (the CPU)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        return None
    return stats.get("bytes_limit")
