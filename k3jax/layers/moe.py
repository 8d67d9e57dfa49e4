"""Mixture of experts: sigmoid router with correction bias and grouped top-k, routed experts
(k3jax.layers.moe_experts, expert-parallel through k3jax.layers.moe_parallel) and shared experts
(arch §6.3-6.5).

Checkpoint names under `block_sparse_moe.`: gate.weight, gate.e_score_correction_bias,
experts.{e}.w1/w3/w2 (gate/up/down), shared_experts.{gate,up,down}_proj, and for K3's latent MoE
routed_expert_down_proj, routed_expert_norm, routed_expert_up_proj.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import COLUMN_LAYOUTS, MoEConfig
from k3jax.layers.activation import gated_activation
from k3jax.layers.linear import Linear, linears, takes_fused_kernel
from k3jax.layers.mlp import MLP
from k3jax.layers.moe_experts import local_experts, resolve_expert_impl
from k3jax.layers.moe_parallel import expert_parallel
from k3jax.layers.norms import RMSNorm
from k3jax.layers.params import normal, param, random_bytes, zeros
from k3jax.layers.residual import SplitSum
from pallas_kernels.moe_gmm.mxfp4 import GROUP as MXFP4_GROUP
from pallas_kernels.moe_gmm.hopper_mxfp4 import HandOffColumns, Mxfp4Columns
from pallas_kernels.moe_gmm.mxfp4 import Mxfp4Weight
from pallas_kernels.router import RouterSpec, route_topk
from pallas_kernels.skinny import SkinnyImpl

_HIGHEST = jax.lax.Precision.HIGHEST


def route(x_ND: jax.Array, w_DE: jax.Array, bias_E: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Selects experts per token.

    Args:
      x_ND: normed FFN input. w_DE: router weight (used in fp32). bias_E: e_score_correction_bias,
        added to the scores for SELECTION only.
    Returns:
      (weights_NX fp32, experts_NX int32): unbiased scores of the chosen experts, renormalised
      (+1e-20) when configured, times routed_scaling_factor.

    The logits are fp32 sums of exact products: bf16 inputs and weights take a bf16 matmul with
    fp32 accumulation (the same products as upcasting both, without an fp32 GEMM: 5.4 ms of an
    8K-token prefill of the 48B shape on an H200), other dtypes an fp32 one at full precision.
    """
    if x_ND.dtype == w_DE.dtype == jnp.bfloat16:
        logits = jnp.einsum("nd,de->ne", x_ND, w_DE, preferred_element_type=jnp.float32)
        return route_logits(logits, bias_E, cfg)
    logits = jnp.einsum("nd,de->ne", x_ND.astype(jnp.float32), w_DE.astype(jnp.float32), precision=_HIGHEST)
    return route_logits(logits, bias_E, cfg)


def route_logits(logits: jax.Array, bias_E: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """`route` from the router logits [N, E] fp32 on."""
    if cfg.score_function == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores + bias_E.astype(jnp.float32)
    if cfg.num_expert_group > 1:
        n, g = choice.shape[0], cfg.num_expert_group
        grouped = choice.reshape(n, g, cfg.num_experts // g)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)           # [N, G]
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)                      # [N, topk_group]
        keep_mask = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], keep].set(True)
        grouped = jnp.where(keep_mask[:, :, None], grouped, -jnp.inf)
        choice = grouped.reshape(n, cfg.num_experts)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32)


def route_partial_logits(partials_SNE: jax.Array, bias_E: jax.Array, cfg: MoEConfig,
                         always: int = 0) -> tuple[jax.Array, jax.Array]:
    """`route` from fp32 partial sums of the router logits [S, N, E] (the few-row projection
    kernel's slices of the reduction axis): one top-k kernel launch for ungrouped routers
    (cfg.router_impl, `pallas_kernels.router`), else `route_logits` on their sum. always: that
    many always-active experts E, E + 1, .. appended to each token's choices with weight 1 (the
    shared expert riding in the pair kernels)."""
    if cfg.num_expert_group == 1:
        spec = RouterSpec(k=cfg.num_experts_per_token, score=cfg.score_function, renormalize=cfg.renormalize,
                          scale=cfg.routed_scaling_factor, always=always)
        return route_topk(partials_SNE, bias_E, spec, impl=cfg.router_impl)
    weights, experts = route_logits(jnp.sum(partials_SNE, axis=0), bias_E, cfg)
    if always:
        n, e = weights.shape[0], partials_SNE.shape[-1]
        weights = jnp.concatenate([weights, jnp.ones((n, always), weights.dtype)], axis=1)
        experts = jnp.concatenate([experts, jnp.broadcast_to(e + jnp.arange(always, dtype=experts.dtype),
                                                             (n, always))], axis=1)
    return weights, experts


def routed_experts(x_ND, weights_NX, experts_NX, w1, w3, w2, cfg: MoEConfig, shared=None,
                   summed: bool = True, shared_chosen: bool = False) -> jax.Array:
    """The routed experts' combined output [N, D] fp32: the configured local path, expert-parallel
    when the model was sharded for it (cfg.expert_parallel). shared, summed, shared_chosen: see
    `local_experts`."""
    if cfg.expert_parallel is not None:
        return expert_parallel(x_ND, weights_NX, experts_NX, w1, w3, w2, cfg.activation, ep=cfg.expert_parallel,
                               impl=cfg.impl, gmm=cfg.gmm_impl, dispatch=cfg.ep_dispatch)
    return local_experts(cfg.impl, x_ND, weights_NX, experts_NX, w1, w3, w2, cfg.activation, gmm=cfg.gmm_impl,
                         shared=shared, summed=summed, shared_chosen=shared_chosen)


class Router(nnx.Module):
    """Checkpoint names: gate.weight [E, D] and gate.e_score_correction_bias [E] (fp32). `impl`: how
    its logits run on the few-row path (with the shared experts' projections, see MoE)."""

    def __init__(self, cfg: MoEConfig, *, dtype, rngs: nnx.Rngs, impl: SkinnyImpl = "auto"):
        self.cfg = cfg
        self.impl = impl
        self.kernel = param(rngs, (cfg.hidden_size, cfg.num_experts), dtype, normal(), ("embed", "experts_router"))
        self.e_score_correction_bias = param(rngs, (cfg.num_experts,), jnp.float32, zeros(), ("experts_router",))

    def __call__(self, x_ND):
        return route(x_ND, self.kernel[...], self.e_score_correction_bias[...], self.cfg)


def is_routed_expert_param(path) -> bool:
    """Whether an nnx state path names a routed-expert weight (w1/w3/w2, or their _packed/_scale parts)."""
    return "experts" in path and str(path[-1]).split("_")[0] in ("w1", "w2", "w3")


class Experts(nnx.Module):
    """Stacked routed expert weights: w1/w3 [E, D, F] (gate/up), w2 [E, F, D] (down).

    With `cfg.packed_experts` each is kept as MXFP4 (`pallas_kernels.moe_gmm.mxfp4`): w1_packed
    uint8 [E, D/2, F] and w1_scale uint8 [E, D/32, F], likewise w3 and w2 ([E, F/2, D], [E, F/32, D]);
    with `cfg.packed_layout` "columns" the codes keep the checkpoint's orientation, w1_packed [E, F, D/2]
    and w2_packed [E, D, F/2] (`pallas_kernels.moe_gmm.hopper_mxfp4.Mxfp4Columns`); "handoff" is "columns" with
    w1's and w3's F columns (codes and scales) reordered within each 32 (`HandOffColumns`).
    Random packed weights draw every code with scales near 2^-6 (weights of about 0.02)."""

    def __init__(self, cfg: MoEConfig, *, dtype, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.expert_input_size, cfg.expert_intermediate_size
        self.packed = cfg.packed_experts
        self.columns = cfg.packed_experts and cfg.packed_layout in COLUMN_LAYOUTS
        self.hand_off = cfg.packed_experts and cfg.packed_layout == "handoff"
        shapes = {"w1": ((e, d, f), ("experts", "embed", "expert_mlp")),
                  "w3": ((e, d, f), ("experts", "embed", "expert_mlp")),
                  "w2": ((e, f, d), ("experts", "expert_mlp", "embed"))}
        for name, ((g, k, n), axes) in shapes.items():
            if not self.packed:
                setattr(self, name, param(rngs, (g, k, n), dtype, normal(), axes))
                continue
            codes, code_axes = ((g, n, k // 2), (axes[0], axes[2], axes[1])) if self.columns else ((g, k // 2, n), axes)
            setattr(self, name + "_packed", param(rngs, codes, jnp.uint8, random_bytes(0, 256), code_axes))
            setattr(self, name + "_scale", param(rngs, (g, k // MXFP4_GROUP, n), jnp.uint8, random_bytes(118, 123),
                                                 axes))

    def weights(self) -> tuple:
        """(w1, w3, w2): arrays, or `Mxfp4Weight`s (`Mxfp4Columns` in the "columns" layout; in "handoff", w1 and
        w3 as `HandOffColumns`) when packed."""
        if not self.packed:
            return self.w1[...], self.w3[...], self.w2[...]
        kind = Mxfp4Columns if self.columns else Mxfp4Weight
        gated = HandOffColumns if self.hand_off else kind
        return tuple(k(getattr(self, n + "_packed")[...], getattr(self, n + "_scale")[...])
                     for n, k in (("w1", gated), ("w3", gated), ("w2", kind)))


class MoE(nnx.Module):
    """Routed experts plus shared experts on the same normed input. x [B, T, D] -> [B, T, D].

    Latent MoE (K3, arch §6.4): the router and shared experts see x at full width; the routed
    experts run on routed_expert_down_proj(x) [.., Dl]; their fp32 weighted sum is normed
    (routed_expert_norm) and projected back by routed_expert_up_proj.
    """

    def __init__(self, cfg: MoEConfig, *, dtype, rngs: nnx.Rngs, linear_impl: SkinnyImpl = "auto"):
        self.cfg = cfg
        self.gate = Router(cfg, dtype=dtype, rngs=rngs, impl=linear_impl)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.shared_experts = (MLP(cfg.shared, dtype=dtype, rngs=rngs, linear_impl=linear_impl)
                               if cfg.shared is not None else None)
        if cfg.latent_size is not None:
            d, dl = cfg.hidden_size, cfg.latent_size
            lin = lambda i, o, axes: Linear(i, o, dtype=dtype, axes=axes, rngs=rngs, impl=linear_impl)
            self.routed_expert_down_proj = lin(d, dl, ("embed", "moe_latent"))
            self.routed_expert_up_proj = lin(dl, d, ("moe_latent", "embed"))
            if cfg.latent_use_norm:
                self.routed_expert_norm = RMSNorm(dl, cfg.norm_eps, dtype=dtype, rngs=rngs, axis_name="moe_latent")

    def _shared_weights_for_pairs(self, tokens: int):
        """(gate [1, D, F], up [1, D, F], down [1, F, D]) when the shared expert rides in the routed
        experts' pair kernels (cfg.shared_impl "auto", one shared expert of the routed experts'
        shape on full-width inputs, unpacked, unsharded experts on the "pairs" path), else None."""
        cfg, shared = self.cfg, self.shared_experts
        if (cfg.shared_impl != "auto" or shared is None or cfg.num_shared_experts != 1 or cfg.latent_size is not None
                or cfg.packed_experts or cfg.expert_parallel is not None):
            return None
        w1 = self.experts.w1[...]
        if resolve_expert_impl(cfg.impl, tokens, w1.shape[1:], cfg.gmm_impl) != "pairs":
            return None
        gate, up, down = (lin.kernel[...] for lin in (shared.gate_proj, shared.up_proj, shared.down_proj))
        if gate.shape != w1.shape[1:] or gate.dtype != w1.dtype:
            return None
        return gate[None], up[None], down[None]

    def __call__(self, x_BTD: jax.Array, *, partial: bool = False):
        """x [B, T, D] -> [B, T, D]. partial: when the shared expert rides in the pair kernels
        (`_shared_weights_for_pairs`), return the weighted pairs unsummed as a
        `k3jax.layers.residual.SplitSum` for the residual add to sum."""
        cfg = self.cfg
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(b * t, d)
        shared = self.shared_experts
        folded = self._shared_weights_for_pairs(b * t)
        separate = shared is not None and folded is None
        fused = [(x_ND, [self.gate], jnp.float32)] + ([(x_ND, [shared.gate_proj, shared.up_proj])] if separate else [])
        if takes_fused_kernel(fused):
            # Decode: the router logits and the shared experts' gate|up read x in one launch (bf16 x
            # and weights, exact products, fp32 sums: the fp32 router up to the order of summation);
            # the top-k kernel adds the router's partial sums itself.
            with jax.named_scope("router"):
                (partials,), *shared_gate_up = linears(fused, partial_sums=(0,))
                always = 0 if folded is None else folded[0].shape[0]   # the shared expert joins the choices
                weights, experts = route_partial_logits(partials, self.gate.e_score_correction_bias[...], cfg,
                                                        always=always)
        else:
            shared_gate_up, always = None, 0
            with jax.named_scope("router"):
                weights, experts = self.gate(x_ND)
        with jax.named_scope("routed_experts"):
            expert_in = x_ND if cfg.latent_size is None else self.routed_expert_down_proj(x_ND)
            if partial and folded is not None:   # every term of the layer's output is a pair
                pairs = routed_experts(expert_in, weights, experts, *self.experts.weights(), cfg, shared=folded,
                                       summed=False, shared_chosen=always > 0)
                return SplitSum(pairs, 1, (b, t, d), x_BTD.dtype)
            routed = routed_experts(expert_in, weights, experts, *self.experts.weights(), cfg,
                                    shared=folded, shared_chosen=always > 0).astype(x_BTD.dtype)
            if cfg.latent_size is not None:
                if cfg.latent_use_norm:
                    routed = self.routed_expert_norm(routed)
                routed = self.routed_expert_up_proj(routed)
        out = routed.reshape(b, t, d)
        if separate:
            with jax.named_scope("shared_experts"):
                if shared_gate_up:
                    gate, up = shared_gate_up[0]
                    y = shared.down_proj(gated_activation(gate, up, shared.activation)).reshape(b, t, d)
                else:
                    y = shared(x_BTD)
                out = out + y
        return out
