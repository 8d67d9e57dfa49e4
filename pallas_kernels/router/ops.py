"""The dispatch site of the top-k router.

impl "xla": the twin (`lax.top_k`, a sort on the GPU). impl "pallas": the one-launch kernel.
impl "auto": "pallas" on a GPU backend for at most MAX_ROWS tokens (decode), "xla" otherwise.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax

from pallas_kernels.router.kernel import route_topk_pallas
from pallas_kernels.router.reference import route_topk_reference
from pallas_kernels.router.spec import RouterSpec

RouterImpl = Literal["auto", "xla", "pallas"]
ROUTER_IMPLS: tuple[str, ...] = get_args(RouterImpl)
MAX_ROWS = 64    # one program per token; beyond a decode batch the sort is as good


def route_topk(logits, bias_E, spec: RouterSpec, *, impl: RouterImpl = "auto"):
    """(weights [M, k] fp32, experts [M, k] int32) from logits [M, E] or partial sums [S, M, E]."""
    if impl not in ROUTER_IMPLS:
        raise ValueError(f"router: unknown impl {impl!r}; expected one of {ROUTER_IMPLS}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" and logits.shape[-2] <= MAX_ROWS else "xla"
    if impl == "pallas":
        return route_topk_pallas(logits, bias_E, spec=spec)
    return route_topk_reference(logits, bias_E, spec)
