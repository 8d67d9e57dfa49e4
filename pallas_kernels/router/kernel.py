"""Top-k routing of a few tokens in one Pallas launch (Triton lowering).

One program per token row: sums the router's fp32 partial logits (the few-row projection kernel
splits its reduction axis), takes the scores (sigmoid or softmax), adds the selection bias, picks
the k largest by repeated arg-max (lowest index on ties, as `lax.top_k`), and writes the chosen
experts' unbiased scores, renormalised and scaled. At decode this replaces XLA's sort-based top-k
and the three fusions around it (about 8 us per MoE layer) with one launch.

Twin: `reference.route_topk_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret, next_pow2
from pallas_kernels.router.spec import RouterSpec


def _kernel(logits_ref, bias_ref, w_ref, e_ref, *, spec: RouterSpec, splits: int, experts: int, width: int,
            k_width: int):
    row = pl.program_id(0)
    lane = jnp.arange(width, dtype=jnp.int32)
    valid = lane < experts
    cols = pl.ds(0, width)
    logits = plt.load(logits_ref.at[jnp.int32(0), row, cols], mask=valid, other=0.0)
    for s in range(1, splits):
        logits = logits + plt.load(logits_ref.at[jnp.int32(s), row, cols], mask=valid, other=0.0)
    if spec.score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        shifted = jnp.where(valid, logits, -jnp.inf)
        e = jnp.exp(shifted - jnp.max(shifted))
        scores = e / jnp.sum(e)
    bias = plt.load(bias_ref.at[cols], mask=valid, other=0.0)
    choice = jnp.where(valid, scores + bias, -jnp.inf)
    slot = jnp.arange(k_width, dtype=jnp.int32)
    out_w = jnp.zeros((k_width,), jnp.float32)
    out_e = jnp.zeros((k_width,), jnp.int32)
    for i in range(spec.k):
        best = jnp.max(choice)
        pick = jnp.min(jnp.where(choice == best, lane, width))
        hit = lane == pick
        out_w = jnp.where(slot == i, jnp.sum(jnp.where(hit, scores, 0.0)), out_w)
        out_e = jnp.where(slot == i, pick, out_e)
        choice = jnp.where(hit, -jnp.inf, choice)
    if spec.renormalize:
        out_w = out_w / (jnp.sum(out_w) + 1e-20)
    out_w = out_w * spec.scale
    if spec.always:   # always-active experts E, E + 1, .. with weight 1 after the k chosen
        extra = (slot >= spec.k) & (slot < spec.k + spec.always)
        out_w = jnp.where(extra, 1.0, out_w)
        out_e = jnp.where(extra, experts + slot - spec.k, out_e)
    used = slot < spec.k + spec.always
    plt.store(w_ref.at[row, pl.ds(0, k_width)], out_w, mask=used)
    plt.store(e_ref.at[row, pl.ds(0, k_width)], out_e, mask=used)


@functools.partial(jax.jit, static_argnames=("spec", "num_warps", "interpret"))
def route_topk_pallas(logits, bias_E, *, spec: RouterSpec, num_warps: int = 1, interpret: bool | None = None):
    """Top-k routing of M tokens over E experts.

    Args:
      logits: router logits [M, E] or fp32 partial sums of them [S, M, E] (added in order s = 0..S-1).
      bias_E: selection bias (e_score_correction_bias) [E], added to the scores for the choice only.
      spec: k, score function, renormalisation, scale. num_warps: of the one program per token (1: the
        reductions stay inside a warp, no barriers).
    Returns:
      (weights [M, k + always] fp32, experts [M, k + always] int32), best first, then the always-
      active experts E, E + 1, .. with weight 1.
    """
    if logits.ndim == 2:
        logits = logits[None]
    if logits.ndim != 3 or bias_E.shape != logits.shape[-1:]:
        raise ValueError(f"router: expected logits [M, E] or partial sums [S, M, E] and a bias [E]; got "
                         f"{logits.shape} and {bias_E.shape}")
    splits, m, experts = logits.shape
    if spec.k > experts:
        raise ValueError(f"router: k={spec.k} exceeds the {experts} experts")
    k_width = next_pow2(spec.k + spec.always)
    width = spec.k + spec.always
    out_shape = (jax.ShapeDtypeStruct((m, width), jnp.float32), jax.ShapeDtypeStruct((m, width), jnp.int32))
    return pl.pallas_call(
        functools.partial(_kernel, spec=spec, splits=splits, experts=experts, width=next_pow2(experts),
                          k_width=k_width),
        grid=(m,),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=default_interpret() if interpret is None else interpret,
        name="route_topk",
    )(logits.astype(jnp.float32), bias_E.astype(jnp.float32))
