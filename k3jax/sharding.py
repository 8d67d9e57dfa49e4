"""Meshes and the one logical-axis rules table.

Layers name their parameter axes logically (k3jax.layers.params); this module alone maps those
names to mesh axes. Layout per layer kind (tensor = the "tensor" mesh axis):

* embedding and LM head: the vocabulary over tensor;
* KDA: q/k/v/gate projections column-parallel over tensor (head-major channels), o_proj
  row-parallel (its input channels over tensor); the fp32 recurrent state over (data, tensor) on
  the head axis;
* MLA: q / kv_b projections column-parallel, o_proj row-parallel; the latent projections and the
  latent cache stay whole (576 wide, shared by every head);
* dense MLP and shared experts: gate/up column-parallel, down row-parallel;
* routed experts: the expert axis over "expert" (k3jax.layers.moe_parallel); the expert FFN
  width stays whole;
* norms, routers, AttnRes vectors and small gate tensors: replicated.

Batch rows of activations and decode state go over "data". XLA's sharding propagation
(`AxisType.Auto`) inserts the collectives of the tensor-parallel layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "expert", "tensor")

# logical axis -> mesh axis (None = replicated)
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": None,
    "norm": None,
    "kda_proj": "tensor",
    "kda_heads": "tensor",
    "head_dim": None,
    "conv_width": None,
    "a_log": None,
    "mla_q": "tensor",
    "mla_kv": "tensor",
    "mla_o": "tensor",
    "q_lora": None,
    "kv_lora": None,
    "kv_latent": None,
    "mlp": "tensor",
    "experts": "expert",
    "experts_router": None,
    "expert_mlp": None,
    "moe_latent": None,
    "mtp_concat": None,
    # activations and decode state
    "batch": "data",
}


@dataclass(frozen=True)
class MeshSpec:
    """Device counts per mesh axis; their product must equal the devices used."""

    data: int = 1
    expert: int = 1
    tensor: int = 1

    @property
    def size(self) -> int:
        return self.data * self.expert * self.tensor

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """'data=2,expert=4' -> MeshSpec(data=2, expert=4)."""
        sizes = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name not in MESH_AXES or not value.isdigit() or int(value) < 1:
                raise ValueError(f"bad mesh spec {text!r}: expected comma-separated axis=size with axes {MESH_AXES}")
            sizes[name] = int(value)
        return cls(**sizes)


def make_mesh(spec: MeshSpec, devices=None) -> Mesh:
    """A (data, expert, tensor) mesh with Auto axis types (XLA propagates shardings)."""
    devices = list(jax.devices() if devices is None else devices)
    if spec.size != len(devices):
        raise ValueError(f"mesh {spec} needs {spec.size} devices, {len(devices)} given")
    grid = np.array(devices).reshape(spec.data, spec.expert, spec.tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def logical_spec(axes, shape=None, mesh: Mesh | None = None) -> P:
    """PartitionSpec for logical axis names; an axis whose size the mesh axis does not divide stays whole."""
    out = []
    for i, name in enumerate(axes):
        axis = LOGICAL_RULES.get(name) if name is not None else None
        if axis is not None and mesh is not None:
            n = mesh.shape[axis]
            if n == 1 or (shape is not None and shape[i] % n):
                axis = None
        out.append(axis)
    return P(*out)


def param_shardings(params: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding per parameter from its `logical_axes` metadata."""
    def one(var):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes", (None,) * len(value.shape))
        return NamedSharding(mesh, logical_spec(axes, value.shape, mesh))
    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int, batch: int) -> NamedSharding:
    """Rows over "data" (when divisible), everything else whole."""
    axis = "data" if mesh.shape["data"] > 1 and batch % mesh.shape["data"] == 0 else None
    return NamedSharding(mesh, P(axis, *([None] * (ndim - 1))))


def state_shardings(state, mesh: Mesh):
    """Decode state: rows over data; the KDA recurrent state's heads over tensor."""
    from k3jax.state import DecodeState, KDAState, MLACache

    def rows(x):
        return batch_sharding(mesh, x.ndim, x.shape[0])

    layers = []
    for layer in state.layers:
        if isinstance(layer, KDAState):
            batch, heads = layer.recurrent.shape[:2]
            row_axis = rows(layer.recurrent).spec[0]
            head_axis = "tensor" if mesh.shape["tensor"] > 1 and heads % mesh.shape["tensor"] == 0 else None
            recurrent = NamedSharding(mesh, P(row_axis, head_axis, None, None))
            layers.append(KDAState(conv=rows(layer.conv), recurrent=recurrent))
        else:
            layers.append(MLACache(latent=rows(layer.latent)))
    return DecodeState(layers=tuple(layers), lengths=rows(state.lengths))
