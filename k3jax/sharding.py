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
* routed experts: the expert axis over "expert" (k3jax.layers.moe_parallel, switched on in the
  config by `config_for_mesh`); the expert FFN width stays whole;
* norms, routers, AttnRes vectors and small gate tensors: replicated.

Batch rows of activations and decode state go over "data". XLA's sharding propagation
(`AxisType.Auto`) inserts the collectives of the tensor-parallel layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.config import ExpertParallel, ModelConfig
from k3jax.state import DecodeState, KDAState, MLACache

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


def logical_spec(axes, shape=None, mesh: Mesh | None = None, *, sizes=None) -> P:
    """PartitionSpec for logical axis names; an axis whose size the mesh axis does not divide stays whole.
    `sizes` (mesh axis -> devices) stands in for a mesh that has no devices here (planning)."""
    sizes = mesh.shape if mesh is not None else sizes
    out = []
    for i, name in enumerate(axes):
        axis = LOGICAL_RULES.get(name) if name is not None else None
        if axis is not None and sizes is not None:
            n = sizes[axis]
            if n == 1 or (shape is not None and shape[i] % n):
                axis = None
        out.append(axis)
    return P(*out)


def split_dims(axes) -> tuple[int, ...]:
    """The dimensions of a parameter with logical `axes` that some mesh axis can split."""
    return tuple(i for i, name in enumerate(axes) if name is not None and LOGICAL_RULES.get(name) is not None)


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


@dataclass(frozen=True)
class Placement:
    """Where a model's inputs and state live: one device (mesh None) or a mesh, rows over "data"."""

    mesh: Mesh | None = None

    def context(self):
        """The context the model's compiled functions run under (the mesh, when there is one)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    @property
    def spans_processes(self) -> bool:
        """Whether the mesh holds devices of several `jax.distributed` processes."""
        return self.mesh is not None and len({d.process_index for d in self.mesh.devices.flat}) > 1

    def from_first_process(self, values: np.ndarray) -> np.ndarray:
        """`values` as the process holding the mesh's first device has them, on every process of the
        mesh (a collective among those processes); unchanged unless the mesh spans processes."""
        if not self.spans_processes:
            return values
        spread = NamedSharding(self.mesh, P(self.mesh.axis_names))    # row i on the mesh's device i
        each = jax.make_array_from_callback((self.mesh.size,) + values.shape, spread, lambda index: values[None])
        first = jax.jit(lambda a: a[0], out_shardings=NamedSharding(self.mesh, P()))(each)
        return np.asarray(first.addressable_data(0)).astype(values.dtype)

    def to_host(self, tree):
        """Host (numpy) values of the arrays in `tree`, read-only. An array whose shards lie on several
        processes' devices and differ is gathered from them (a collective among the mesh's processes);
        the host copies of the others all start before any is waited for."""
        if isinstance(tree, jax.Array) and tree.is_fully_addressable:   # the decode loop's per-chunk reads
            return np.asarray(tree)
        leaves, treedef = jax.tree.flatten(tree)
        local = [not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves]
        fetched = iter(jax.device_get([x for x, ok in zip(leaves, local) if ok]))
        out = []
        for x, ok in zip(leaves, local):
            if ok:
                out.append(np.asarray(next(fetched)))
            elif x.is_fully_replicated:
                out.append(np.asarray(x.addressable_data(0)))
            else:
                out.append(np.asarray(multihost_utils.process_allgather(x, tiled=True)))
        return jax.tree.unflatten(treedef, out)

    def put_rows(self, array) -> jax.Array:
        """A host array [B, ...] on the device(s), rows over the data axis when sharded."""
        if self.mesh is None:
            return jnp.asarray(array)
        array = np.asarray(array)
        return jax.device_put(array, batch_sharding(self.mesh, array.ndim, array.shape[0]))

    def put_state(self, state: DecodeState) -> DecodeState:
        """A decode state placed like the model's rows (see `state_shardings`)."""
        return state if self.mesh is None else jax.device_put(state, state_shardings(state, self.mesh))

    def put_params(self, params: nnx.State) -> nnx.State:
        """Parameters in their shardings (the rules table), or unchanged without a mesh."""
        return params if self.mesh is None else jax.device_put(params, param_shardings(params, self.mesh))


def state_shardings(state: DecodeState, mesh: Mesh) -> DecodeState:
    """Decode state: rows over data; the KDA recurrent state's heads over tensor."""
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


def config_for_mesh(cfg: ModelConfig, mesh: Mesh | None) -> ModelConfig:
    """The config a model runs with on `mesh`: expert parallelism on when the mesh's expert axis
    has more than one device and the experts split over it, off otherwise (also for mesh=None);
    with a tensor axis, the few-row kernels that need whole weights step aside: projections take
    XLA's dot, MLA's W_UK / W_UV the einsums, and the shared expert stays its own MLP."""
    if mesh is not None and mesh.shape.get("tensor", 1) > 1:
        if cfg.linear_impl != "xla":
            cfg = cfg.replace(linear_impl="xla")
        if cfg.mla is not None and cfg.mla.absorb_impl != "xla":
            cfg = cfg.replace(mla=dataclasses.replace(cfg.mla, absorb_impl="xla"))
        if cfg.moe is not None and cfg.moe.shared_impl != "mlp":
            cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, shared_impl="mlp"))
    if cfg.moe is None:
        return cfg
    ep = None
    if mesh is not None and mesh.shape.get("expert", 1) > 1 and cfg.moe.num_experts % mesh.shape["expert"] == 0:
        ep = ExpertParallel(expert_shards=int(mesh.shape["expert"]), data_shards=int(mesh.shape.get("data", 1)))
    if ep == cfg.moe.expert_parallel:
        return cfg
    return cfg.replace(moe=dataclasses.replace(cfg.moe, expert_parallel=ep))
