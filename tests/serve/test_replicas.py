"""Replica assignment: a stable hash (not Python's), an even spread, meshes laid over processes
with spanning replicas kept apart."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import pytest

from k3jax.sharding import MeshSpec
from serve.replicas import Topology, parse_mesh, replica_of


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def devices(processes: int, per_process: int) -> list[FakeDevice]:
    out = [FakeDevice(p * 1000 + i, p) for p in range(processes) for i in range(per_process)]
    return out[::-1]   # the plan orders them itself


def test_replica_of_is_a_stable_sha256_and_spreads_evenly():
    assert [replica_of(f"id:{i}", 4) for i in range(8)] == [replica_of(f"id:{i}", 4) for i in range(8)]
    assert replica_of("id:a", 1) == 0
    assert replica_of("id:request-1", 7) == int.from_bytes(hashlib.sha256(b"id:request-1").digest()[:8], "big") % 7
    spread = Counter(replica_of(f"id:{i}", 4) for i in range(4000))
    assert set(spread) == {0, 1, 2, 3} and min(spread.values()) > 900


def test_parse_mesh_fills_data_from_the_devices():
    assert parse_mesh(None, 8) == MeshSpec(data=8)
    assert parse_mesh("expert=2,tensor=2", 8) == MeshSpec(data=2, expert=2, tensor=2)
    assert parse_mesh("data=1", 8) == MeshSpec(data=1)
    with pytest.raises(ValueError, match="does not divide the 8 devices"):
        parse_mesh("expert=3", 8)
    with pytest.raises(ValueError, match="needs 16 devices; the job has 8"):
        parse_mesh("data=4,expert=4", 8)
    with pytest.raises(ValueError, match="bad mesh spec"):
        parse_mesh("data=two", 8)


def test_replicas_within_processes():
    t = Topology.plan(MeshSpec(data=4, expert=2), devices(2, 4), process=1)
    assert t.replicas == 4 and t.local() == [2, 3]
    assert [t.processes(r) for r in range(4)] == [[0], [0], [1], [1]]
    assert t.leads(2) and not t.spans(2)
    assert [d.id for d in t.grid[2].flat] == [1000, 1001]


def test_replicas_spanning_processes_run_in_lockstep():
    t = Topology.plan(MeshSpec(data=2, expert=4), devices(4, 2), process=1)
    assert t.local() == [0] and t.processes(0) == [0, 1] and t.spans(0) and not t.leads(0)
    assert Topology.plan(MeshSpec(data=2, expert=4), devices(4, 2), process=0).leads(0)


def test_a_process_in_a_spanning_replica_and_another_is_refused():
    with pytest.raises(ValueError, match="replica 1 spans processes \\[0, 1\\] and process 0 also runs replica 0"):
        Topology.plan(MeshSpec(data=3, tensor=2), devices(2, 3), process=0)


def test_a_smaller_mesh_uses_the_first_devices():
    t = Topology.plan(MeshSpec(data=1), devices(2, 4), process=1)
    assert t.local() == [] and [d.id for d in t.grid.flat] == [0]
