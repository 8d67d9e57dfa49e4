"""Top-k expert routing of a few tokens in one launch (decode), with its XLA twin."""

from pallas_kernels.router.kernel import route_topk_pallas
from pallas_kernels.router.ops import ROUTER_IMPLS, RouterImpl, route_topk
from pallas_kernels.router.reference import route_topk_reference
from pallas_kernels.router.spec import RouterSpec

__all__ = ["route_topk", "route_topk_pallas", "route_topk_reference", "RouterSpec", "RouterImpl", "ROUTER_IMPLS"]
