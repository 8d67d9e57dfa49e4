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
over its own experts.

`dispatch="ragged"` (MoEConfig.ep_dispatch) replaces the gather/scatter of the first case: each
shard sends every token-expert pair only to the shard that owns the expert (`lax.ragged_all_to_all`,
sizes and offsets agreed by two small all_to_alls), the owner computes its experts on what it
received, and the results travel back the same way. XLA:CPU cannot run `ragged_all_to_all`
(environment.md fact 5), so off the GPU the same exchange is emulated from an all_gather
(`emulated_ragged_all_to_all`: same contract) and the CPU tests check everything around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`lax.ragged_all_to_all`'s contract from an all_gather (for backends without the primitive):
    rows operand[input_offsets[j] : + send_sizes[j]] go to shard j, which writes them at its
    output[output_offsets[j] : ...] (offsets as the sender sees them). recv_sizes is not needed."""
    del recv_sizes
    me = jax.lax.axis_index(axis_name)
    shards = jax.lax.axis_size(axis_name)
    everyone = jax.lax.all_gather(operand, axis_name)                       # [shards, N, ...]
    offsets, sizes, targets = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(operand.shape[0])
    for j in range(shards):
        valid = rows < sizes[j, me]
        src = jnp.clip(offsets[j, me] + rows, 0, operand.shape[0] - 1)
        dst = jnp.where(valid, targets[j, me] + rows, output.shape[0])      # past the end: dropped
        output = output.at[dst].set(everyone[j][src], mode="drop")
    return output


def _exchange():
    return jax.lax.ragged_all_to_all if jax.default_backend() == "gpu" else emulated_ragged_all_to_all


def _ragged_dispatch(x, wts, exps, w1, w3, w2, act, impl, gmm) -> jax.Array:
    """One shard's tokens [n, D] through the experts of every shard: pairs sent only where their
    expert lives, computed there, sent back, weighted and summed. -> [n, D] fp32."""
    exchange = _exchange()
    shards = jax.lax.axis_size(EXPERT_AXIS)
    e_local = w1.shape[0]
    n, k = exps.shape
    flat = exps.reshape(-1)
    dest = flat // e_local                                          # the shard owning each pair's expert
    order = jnp.argsort(dest, stable=True)                          # pairs grouped by destination
    send_sizes = jnp.sum(jax.nn.one_hot(dest, shards, dtype=jnp.int32), axis=0)
    send_offsets = jnp.cumsum(send_sizes) - send_sizes
    swap = lambda a: jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True)   # entry j <-> shard j
    recv_sizes = swap(send_sizes)                                   # pairs each shard sends me
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes              # where they land in my buffer
    land_at = swap(recv_offsets)                                    # where mine land in theirs
    back_at = swap(send_offsets)                                    # where results go back: as each shard sent them
    capacity = n * k * shards                                       # every pair of every shard to me
    local_id = (flat - dest * e_local)[order].astype(jnp.int32)
    x_in = exchange(x[order // k], jnp.zeros((capacity, x.shape[1]), x.dtype), send_offsets, send_sizes, land_at,
                    recv_sizes, axis_name=EXPERT_AXIS)
    id_in = exchange(local_id[:, None], jnp.full((capacity, 1), e_local, jnp.int32), send_offsets, send_sizes,
                     land_at, recv_sizes, axis_name=EXPERT_AXIS)[:, 0]
    # Rows past what arrived carry the id e_local: not a local expert, so they cost nothing and give 0.
    y_in = local_experts(impl, x_in, jnp.ones((capacity, 1), jnp.float32), id_in[:, None], w1, w3, w2, act, gmm=gmm,
                         expert_offset=0)   # ids e_local mark empty rows: masked
    y_back = exchange(y_in, jnp.zeros((n * k, y_in.shape[1]), y_in.dtype), recv_offsets, recv_sizes, back_at,
                      send_sizes, axis_name=EXPERT_AXIS)            # in `order`, as sent
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype), unique_indices=True)
    return jnp.einsum("nk,nkd->nd", wts.astype(jnp.float32), y_back[rank].reshape(n, k, -1),
                      precision=jax.lax.Precision.HIGHEST)


def expert_parallel(x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD, act: Activation, *, ep: ExpertParallel,
                    impl: ExpertImpl = "ragged", gmm: GmmImpl = "auto", dispatch: str = "gather") -> jax.Array:
    """Routed-expert output [N, D] fp32 with the experts sharded over the mesh's expert axis.

    Args: as `local_experts`, with w1_EDF / w3_EDF / w2_EFD the full (sharded) expert stacks and
    `ep` the layout the model was sharded for. dispatch: "gather" (all_gather + psum_scatter) or
    "ragged" (each pair sent only to its expert's shard) when the tokens split over the shards;
    tokens that do not split are replicated and summed either way.
    """
    _mesh_for(ep)
    n = x_ND.shape[0]
    data = DATA_AXIS if ep.data_shards > 1 and n % ep.data_shards == 0 else None
    split = n % (ep.data_shards * ep.expert_shards) == 0 and (data is not None or ep.data_shards == 1)
    tokens = P((DATA_AXIS, EXPERT_AXIS) if data else EXPERT_AXIS) if split else P(data)

    def body(x, wts, exps, w1, w3, w2):
        if split and dispatch == "ragged":
            return _ragged_dispatch(x, wts, exps, w1, w3, w2, act, impl, gmm)
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
