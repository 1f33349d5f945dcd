"""Machines across the nodes of a Ray cluster, with one store shared by all (an s3:// one).

- Each node runs one long-lived rewind actor (`NodeAgent`), pinned to it, that owns the
  machines on that node: it runs the engine in the node's own rewind home.
- A new machine is placed by Ray's scheduler: a small `Slot` actor asks for one
  `rewind_machines` unit (give each node as many as it should run machines) and the machine's
  memory, spread over the nodes unless a node is named; it holds them as long as the machine
  lives, and the machine is made on the node Ray put the slot on.
- A handle (`FleetSandbox`) has the Sandbox calls (exec, checkpoint, restore, history,
  delete) and runs them on the machine's node. `fork_to` moves a point between nodes: it is
  checkpointed and uploaded on one node, and a new machine runs from it on another, through
  the shared store. Every node's home signs with the key of the home that drives the fleet,
  so each trusts the points of the others.
- A node that dies takes its running machines with it (their calls raise NodeLost); the
  points they stored are in the shared store and run anywhere else.

Ray is imported here only: `pip install 'rewind[fleet]'`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rewind.engine import DEFAULT_CPUS, DEFAULT_MEMORY_MIB
from rewind.errors import RewindError
from rewind.home import Home
from rewind.results import Checkpoint, Command, ExecResult, MachineInfo
from rewind.sandbox import Sandbox
from rewind.signers import signing_key, use_key
from rewind.store.signing import SigningKey

MACHINES = "rewind_machines"  # the custom resource a node offers: how many machines it runs
NAMESPACE = "rewind"


class NodeLost(RewindError):
    """The Ray node that ran a machine is gone, and the machine with it (not its stored points)."""


@ray.remote(num_cpus=0, max_concurrency=8)
class NodeAgent:
    """Owns the machines of one node, in that node's rewind home."""

    def __init__(self, home: str, store: str, images: str | None, key: bytes) -> None:
        self.home = Home(root=Path(home), images=Path(images) if images else Home.from_env().images)
        self.store = store
        # Every node signs as the fleet's driver: a point made on one node then runs on any other.
        use_key(self.home, SigningKey.from_pem(key))

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def _sbx(self, name: str) -> Sandbox:
        return Sandbox.get(name, home=self.home, store=self.store)

    def create(self, name: str | None, memory: int, cpus: int, from_checkpoint: str | None) -> str:
        return Sandbox.create(name, memory=memory, cpus=cpus, from_checkpoint=from_checkpoint,
                              home=self.home, store=self.store).name

    def exec(self, name: str, cmd: Command, options: dict[str, Any]) -> ExecResult:
        return self._sbx(name).exec(cmd, **options)

    def checkpoint(self, name: str, point: str | None, uploaded: bool) -> Checkpoint:
        """With `uploaded`, return once the point is in the shared store, for other nodes
        (wait=True waits for a bucket's upload)."""
        return self._sbx(name).checkpoint(name=point, wait=uploaded)

    def restore(self, name: str, ref: str) -> Checkpoint:
        return self._sbx(name).restore(ref)

    def history(self, name: str) -> list[Checkpoint]:
        return self._sbx(name).history()

    def info(self, name: str) -> MachineInfo:
        return self._sbx(name).info()

    def delete(self, name: str) -> None:
        self._sbx(name).delete()

    def names(self) -> list[str]:
        return [s.name for s in Sandbox.list(home=self.home)]


@ray.remote(num_cpus=0)
class Slot:
    """Holds a machine's share of its node (one `rewind_machines` unit, its memory) while it lives."""

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())


@dataclass
class Fleet:
    """Machines on the nodes of the Ray cluster this process is connected to (ray.init).
    `store` is the store every node shares (s3://bucket/prefix); each node's rewind home is
    `<homes>/<node id, 12 hex>`, a local folder on that node."""

    store: str
    homes: str

    def nodes(self) -> list[str]:
        """The live nodes that offer machines."""
        return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(MACHINES)]

    def agent(self, node: str) -> Any:
        """The node's rewind actor, started on first use."""
        return NodeAgent.options(  # type: ignore[attr-defined]
            name=f"agent-{node}", namespace=NAMESPACE, get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(os.path.join(self.homes, node[:12]), self.store, os.environ.get("REWIND_IMAGES"),
                 signing_key(Home.from_env()).to_pem())  # within the cluster, one user's

    def create(self, name: str | None = None, *, memory: int = DEFAULT_MEMORY_MIB, cpus: int = DEFAULT_CPUS,
               from_checkpoint: str | Checkpoint | None = None, node: str | None = None) -> FleetSandbox:
        """Start a machine where Ray places it (or on `node`), from a point of the shared store
        if `from_checkpoint` is given."""
        strategy: Any = "SPREAD" if node is None else NodeAffinitySchedulingStrategy(node, soft=False)
        slot = Slot.options(resources={MACHINES: 1}, memory=memory << 20,  # type: ignore[attr-defined]
                            scheduling_strategy=strategy).remote()
        try:
            placed = ray.get(slot.node.remote())
            agent = self.agent(placed)
            ref = from_checkpoint.id if isinstance(from_checkpoint, Checkpoint) else from_checkpoint
            made = ray.get(agent.create.remote(name, memory, cpus, ref))
        except BaseException:
            ray.kill(slot)
            raise
        return FleetSandbox(self, made, placed, agent, slot)


class FleetSandbox:
    """A machine on a node of the fleet, with the Sandbox calls, run on its node."""

    name: str
    # Where it is not Sandbox's surface (rewind/handle.py), on purpose (tests/test_faces.py):
    # a fleet handle runs an agent's work; what it lacks is done on the node's own host.
    DIFFERS: ClassVar[dict[str, str]] = {
        **{verb: "not offered: a fleet runs steps and their points; manage the machine on its node"
           for verb in ("status", "labels", "set_labels", "set_ttl", "guarded", "fork", "fork_many", "diff",
                        "diff_content", "start", "stop")},
        "exec": "its options go to Sandbox.exec on the node as keywords (`**options`)",
        "checkpoint": "`uploaded`: wait until the point is in the fleet's bucket, for another node",
        "restore": "no `allow_unsigned`: the node's home decides",
        "fork_to": "a copy on another node, through the fleet's store",
    }

    def __init__(self, fleet: Fleet, name: str, node: str, agent: Any, slot: Any) -> None:
        self.fleet, self.name, self.node = fleet, name, node
        self._agent, self._slot = agent, slot

    def __repr__(self) -> str:
        return f"FleetSandbox({self.name!r}, node={self.node[:12]!r})"

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self._agent, method).remote(self.name, *args))
        except RayActorError as e:
            raise NodeLost(f"machine {self.name} is gone with node {self.node[:12]}: its stored "
                           f"checkpoints are in {self.fleet.store}") from e

    def exec(self, cmd: Command, **options: Any) -> ExecResult:
        result: ExecResult = self._call("exec", cmd, options)
        return result

    def checkpoint(self, name: str | None = None, uploaded: bool = False) -> Checkpoint:
        """As Sandbox.checkpoint; with `uploaded`, returns once other nodes can use the point."""
        point: Checkpoint = self._call("checkpoint", name, uploaded)
        return point

    def restore(self, ref: str | Checkpoint) -> Checkpoint:
        point: Checkpoint = self._call("restore", ref.id if isinstance(ref, Checkpoint) else ref)
        return point

    def history(self) -> list[Checkpoint]:
        points: list[Checkpoint] = self._call("history")
        return points

    def fork_to(self, node: str | None = None, name: str | None = None) -> FleetSandbox:
        """A copy of this machine as of now, continued on `node` (or where Ray places it)."""
        point = self.checkpoint(uploaded=True)
        memory = self.info().memory_mib  # a copy runs with its point's memory: reserve that
        return self.fleet.create(name, memory=memory, from_checkpoint=point, node=node)

    def info(self) -> MachineInfo:
        info: MachineInfo = self._call("info")
        return info

    def delete(self) -> None:
        try:
            self._call("delete")
        finally:
            ray.kill(self._slot)
