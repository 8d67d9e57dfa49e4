"""Expert parallelism: the only `shard_map` in the model.

Switched on explicitly: a model built, loaded or sharded onto a mesh whose "expert" axis has more
than one device gets `MoEConfig.expert_parallel` set (k3jax.sharding.config_for_mesh); the mesh
itself is the one its compiled functions run under. Routed experts are sharded over that axis
(each shard holds E / n experts). Token dispatch and combine are exact (no capacity, nothing
dropped) and run on every backend:

* tokens divisible over (data x expert): each shard holds its own tokens, `all_gather`s the
  expert group's tokens, computes its local experts for all of them, and `psum_scatter`s the
  partial outputs back to their owners;
* otherwise (e.g. decode with fewer rows than shards): tokens are replicated over the expert axis
  and the partial outputs are `psum`med.

Inside, each shard runs the configured local path (`local_experts`: dense, ragged, gather or auto)
over its own experts. A `ragged_all_to_all` dispatch, which sends each token only to the shards of
its experts, is GPU-only (XLA:CPU cannot run it, environment.md fact 5) and not here yet.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from k3jax.config import ExpertParallel
from k3jax.layers.activation import Activation
from k3jax.layers.moe_experts import ExpertImpl, local_experts
from pallas_kernels.moe_gmm import GmmImpl

EXPERT_AXIS = "expert"
DATA_AXIS = "data"


def _mesh_for(ep: ExpertParallel):
    """The mesh the model runs under, checked against the layout it was sharded for."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        raise ValueError(f"this model was sharded for expert parallelism over {ep.expert_shards} devices; run it "
                         "under its mesh (CausalLM does this; by hand: `with jax.set_mesh(mesh):`)")
    sizes = (int(mesh.shape[EXPERT_AXIS]), int(mesh.shape[DATA_AXIS]) if DATA_AXIS in mesh.axis_names else 1)
    if sizes != (ep.expert_shards, ep.data_shards):
        raise ValueError(f"mesh has expert={sizes[0]}, data={sizes[1]} but the model was sharded for "
                         f"expert={ep.expert_shards}, data={ep.data_shards}; reshard it with model.shard(mesh)")
    return mesh


def expert_parallel(x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD, act: Activation, *, ep: ExpertParallel,
                    impl: ExpertImpl = "ragged", gmm: GmmImpl = "auto") -> jax.Array:
    """Routed-expert output [N, D] fp32 with the experts sharded over the mesh's expert axis.

    Args: as `local_experts`, with w1_EDF / w3_EDF / w2_EFD the full (sharded) expert stacks and
    `ep` the layout the model was sharded for.
    """
    _mesh_for(ep)
    n = x_ND.shape[0]
    data = DATA_AXIS if ep.data_shards > 1 and n % ep.data_shards == 0 else None
    split = n % (ep.data_shards * ep.expert_shards) == 0 and (data is not None or ep.data_shards == 1)
    tokens = P((DATA_AXIS, EXPERT_AXIS) if data else EXPERT_AXIS) if split else P(data)

    def body(x, wts, exps, w1, w3, w2):
        offset = jax.lax.axis_index(EXPERT_AXIS) * w1.shape[0]
        if split:
            x, wts, exps = (jax.lax.all_gather(a, EXPERT_AXIS, tiled=True) for a in (x, wts, exps))
        y = local_experts(impl, x, wts, exps, w1, w3, w2, act, gmm=gmm, expert_offset=offset)
        if split:
            return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, EXPERT_AXIS)

    experts = P(EXPERT_AXIS)
    return jax.shard_map(body, in_specs=(tokens, tokens, tokens, experts, experts, experts), out_specs=tokens,
                         check_vma=False)(x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD)
