"""Expert parallelism: the only `shard_map` in the model.

Routed experts are sharded over the mesh's expert axis (each shard holds E / n experts). Token
dispatch and combine are exact (no capacity, nothing dropped) and run on every backend:

* tokens divisible over (data x expert): each shard holds its own tokens, `all_gather`s the
  expert group's tokens, computes its local experts for all of them, and `psum_scatter`s the
  partial outputs back to their owners;
* otherwise (e.g. decode with fewer rows than shards): tokens are replicated over the expert axis
  and the partial outputs are `psum`med.

The local body (`experts_ragged` with an expert offset) runs unsharded in tests. A
`ragged_all_to_all` dispatch, which sends each token only to the shards of its experts, is the
GPU-scale next step; XLA:CPU cannot run it (environment.md fact 5), so it is not here yet.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from k3jax.config import Activation

EXPERT_AXIS = "expert"
DATA_AXIS = "data"


def _mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def expert_shards() -> int:
    """Size of the ambient mesh's expert axis (1 without a mesh)."""
    mesh = _mesh()
    return int(mesh.shape[EXPERT_AXIS]) if mesh is not None and EXPERT_AXIS in mesh.axis_names else 1


def expert_parallel(x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD, act: Activation, *,
                    gmm: str = "auto") -> jax.Array:
    """Routed-expert output [N, D] fp32 with experts sharded over the expert axis."""
    from k3jax.layers.moe import experts_ragged

    mesh = _mesh()
    n_exp = int(mesh.shape[EXPERT_AXIS])
    n_data = int(mesh.shape[DATA_AXIS]) if DATA_AXIS in mesh.axis_names else 1
    n = x_ND.shape[0]
    data = DATA_AXIS if n_data > 1 and n % n_data == 0 else None
    split = n % (n_data * n_exp) == 0 and (data is not None or n_data == 1)
    tokens = P((DATA_AXIS, EXPERT_AXIS) if data else EXPERT_AXIS) if split else P(data)

    def body(x, wts, exps, w1, w3, w2):
        offset = jax.lax.axis_index(EXPERT_AXIS) * w1.shape[0]
        if split:
            x, wts, exps = (jax.lax.all_gather(a, EXPERT_AXIS, tiled=True) for a in (x, wts, exps))
        y = experts_ragged(x, wts, exps, w1, w3, w2, act, gmm=gmm, expert_offset=offset)
        if split:
            return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, EXPERT_AXIS)

    experts = P(EXPERT_AXIS)
    return jax.shard_map(body, in_specs=(tokens, tokens, tokens, experts, experts, experts), out_specs=tokens,
                         check_vma=False)(x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD)
