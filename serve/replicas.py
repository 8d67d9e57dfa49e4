"""Data-parallel replicas over the mesh's `data` axis, and each replica's share of the requests.

The mesh (data, expert, tensor) is laid over the job's devices in process order; replica r is the
slice data=r, an (expert, tensor) sub-mesh that holds one copy of the model and runs one engine,
model-parallel inside it. A request belongs to replica `sha256(key) mod replicas`: stable across
runs, processes and Python versions (never Python's `hash`).

A replica lies within one process (a process may run several, one thread each), or spans several
processes that run only that replica: they drive identical engines in lockstep (the same requests
in the same order, so the same compiled steps), and the lowest of them writes the replica's parts.
A mesh that would make a process serve a spanning replica and another one is refused (two lockstep
groups sharing a process could wait on each other).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from k3jax.sharding import MeshSpec, make_mesh


def replica_of(key: str, replicas: int) -> int:
    """The replica that runs the request of `key`."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % replicas


def parse_mesh(text: str | None, devices: int) -> MeshSpec:
    """`--mesh` ("data=2,expert=4"): without `data`, the replicas fill the devices that expert x
    tensor leaves. Raises ValueError for a bad spec or one needing more devices than there are."""
    spec = MeshSpec.parse(text or "")
    named = {part.partition("=")[0].strip() for part in (text or "").split(",") if part.strip()}
    if "data" not in named:
        per_replica = spec.expert * spec.tensor
        if devices % per_replica:
            raise ValueError(f"mesh {text!r}: expert x tensor = {per_replica} does not divide the {devices} devices")
        spec = dataclasses.replace(spec, data=devices // per_replica)
    if spec.size > devices:
        raise ValueError(f"mesh {text!r} needs {spec.size} devices; the job has {devices}")
    return spec


@dataclass(frozen=True)
class Topology:
    """Replicas of `spec` over devices (grid [data, expert, tensor]), seen from process `process`."""

    spec: MeshSpec
    grid: np.ndarray
    process: int

    @classmethod
    def plan(cls, spec: MeshSpec, devices, process: int) -> "Topology":
        """The first spec.size devices in (process, id) order; raises ValueError for a mesh whose
        spanning replicas share processes with others (see the module docstring)."""
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))[:spec.size]
        grid = np.empty(len(ordered), dtype=object)
        grid[:] = ordered
        topology = cls(spec, grid.reshape(spec.data, spec.expert, spec.tensor), process)
        for r in range(topology.replicas):
            spanned = topology.processes(r)
            for p in spanned if len(spanned) > 1 else ():
                other = next((q for q in range(topology.replicas) if q != r and p in topology.processes(q)), None)
                if other is not None:
                    raise ValueError(f"mesh {spec}: replica {r} spans processes {spanned} and process {p} also "
                                     f"runs replica {other}; make expert x tensor divide the devices of one process, "
                                     "or a multiple of them")
        return topology

    @property
    def replicas(self) -> int:
        return self.spec.data

    def processes(self, replica: int) -> list[int]:
        return sorted({d.process_index for d in self.grid[replica].flat})

    def local(self) -> list[int]:
        """The replicas this process takes part in."""
        return [r for r in range(self.replicas) if self.process in self.processes(r)]

    def leads(self, replica: int) -> bool:
        """Whether this process writes the replica's parts (the lowest process of the replica)."""
        return self.processes(replica)[0] == self.process

    def spans(self, replica: int) -> bool:
        return len(self.processes(replica)) > 1

    def mesh(self, replica: int) -> Mesh:
        """The replica's (1, expert, tensor) mesh."""
        return make_mesh(MeshSpec(1, self.spec.expert, self.spec.tensor), list(self.grid[replica].flat))
