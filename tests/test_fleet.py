"""rewind.fleet on a local multi-node Ray cluster (ray.cluster_utils.Cluster: several Ray
nodes on this machine, each with its own rewind home), sharing one store in a bucket served
by rclone on 127.0.0.1. Real QEMU guests.

It takes about a minute on the 2-core host (54 s on 2026-12-03, 5b58234; Ray's processes start slowly)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from rewind import Home  # noqa: E402
from rewind.bench.s3 import RcloneS3  # noqa: E402
from rewind.engine.engine import Engine  # noqa: E402
from rewind.fleet import MACHINES, Fleet, NodeLost  # noqa: E402

NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


@pytest.fixture
def cluster(home: Home, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Cluster, Fleet]]:
    """A head that runs no machines and two nodes that run two each; the nodes' homes are
    cleaned up after (a removed node's QEMUs outlive it here, as they would not on a host)."""
    server = RcloneS3.make(tmp_path / "s3")
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Ray turns 127.0.0.1 into the host's address to connect to; keep everything on loopback.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    monkeypatch.setenv("REWIND_IMAGES", str(home.images))
    homes = tmp_path / "nodes"
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    session = Path(cluster.head_node.get_session_dir_path())  # Ray's logs and sockets, under /tmp/ray
    try:
        for _ in range(2):
            cluster.add_node(**NODE, resources={MACHINES: 2})
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster, Fleet(store=f"s3://{server.bucket}/fleet", homes=str(homes))
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(session, ignore_errors=True)
        server.stop()
        for node_home in homes.glob("*"):
            h = Home(root=node_home, images=home.images)
            for machine in Engine(h).list():
                machine.delete()
            shutil.rmtree(h.runtime, ignore_errors=True)


@pytest.mark.slow  # over 30 s here
def test_machines_spread_a_fork_moves_between_nodes_and_a_dead_node_keeps_its_points(
        cluster: tuple[Cluster, Fleet]) -> None:
    ray_cluster, fleet = cluster
    nodes = fleet.nodes()
    assert len(nodes) == 2
    first, second = fleet.create(), fleet.create()
    assert {first.node, second.node} == set(nodes)  # placed by Ray, one per node
    second.delete()

    first.exec("echo made-on-the-first-node > /root/mark", check=True)
    other = next(n for n in nodes if n != first.node)
    copy = first.fork_to(node=other)  # checkpoint, upload, run on the other node from the bucket
    assert copy.node == other
    assert copy.exec("cat /root/mark", check=True).stdout.strip() == "made-on-the-first-node"
    copy.exec("echo continued-on-the-second > /root/mark", check=True)
    copy.checkpoint(name="before-the-node-dies", uploaded=True)

    dying = next(n for n in ray_cluster.worker_nodes if n.node_id == other)
    ray_cluster.remove_node(dying, allow_graceful=False)
    wait_until(lambda: other not in fleet.nodes(), "Ray noticing the node died", timeout=60, every=0.2)
    with pytest.raises(NodeLost):
        copy.exec("true")
    survivor = fleet.create(from_checkpoint="before-the-node-dies", node=first.node)
    assert survivor.exec("cat /root/mark", check=True).stdout.strip() == "continued-on-the-second"
    survivor.delete()
    first.delete()
