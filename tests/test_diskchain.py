"""Frozen disk layers merged for starting QEMU (engine/disk/diskchain.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from invariants import unrecorded_processes

from rewind import Home, Sandbox
from rewind.engine.disk import diskchain
from rewind.engine.disk.qcow2 import Chain
from rewind.engine.engine import Engine


def _files_qemu_opens(sbx: Sandbox) -> int:
    with sbx._machine.monitor() as mon:
        nodes = mon.cmd("query-named-block-nodes", flat=True)
    return sum(1 for n in nodes if n["drv"] == "qcow2")


def _check_files(sbx: Sandbox, count: int) -> None:
    listing = sbx.exec(f"for i in $(seq 0 {count - 1}); do cat /root/f$i; echo; done; cat /root/last").stdout
    assert listing.split() == [*map(str, range(count)), str(count - 1)]


def test_a_deep_chain_runs_from_a_merged_file_with_the_same_disk(home: Home) -> None:
    """Past MERGE_AFTER layers, the committer merges the frozen ones; a restore's QEMU opens
    the merged file in their place and sees the same disk, and so does a later point, whether
    the merged file is there or not."""
    sbx = Sandbox.create("deep", home=home)
    count = diskchain.MERGE_AFTER + 2
    points = []
    for i in range(count):
        sbx.exec(f"echo -n {i} > /root/f{i} && echo -n {i} > /root/last", check=True)
        points.append(sbx.checkpoint())
    Engine(home).settle()
    assert diskchain.usage(home)["files"] >= 1, "no merged file was made"
    _same_blocks(sbx, home)
    merged_diff = [(c.path, c.kind) for c in sbx.diff(points[0]).files]
    assert ("/root/last", "modified") in merged_diff and ("/root/f1", "added") in merged_diff
    sbx.restore(points[-1])
    layers = len(sbx._machine.record.disks)
    assert _files_qemu_opens(sbx) <= layers - diskchain.MERGE_AFTER
    _check_files(sbx, count)
    sbx.exec("echo -n more > /root/f0", check=True)
    after = sbx.checkpoint(wait=True)
    shutil.rmtree(diskchain.folder(home))  # a cache: without it, the whole chain is opened
    assert [(c.path, c.kind) for c in sbx.diff(points[0], points[-1]).files] == merged_diff
    sbx.restore(after)
    assert _files_qemu_opens(sbx) == len(sbx._machine.record.disks)
    assert sbx.files.read_text("/root/f0") == "more"
    sbx.restore(points[-1])
    _check_files(sbx, count)
    sbx.delete()
    Engine(home).settle()  # the restores' captures, written out and ended
    assert not unrecorded_processes(home)


def _same_blocks(sbx: Sandbox, home: Home) -> None:
    """The merged chain QEMU would open reads, block for block, as the whole chain does; so
    does rewind's own reader (a diff's) given the merged files."""
    frozen = [Path(d) for d in sbx._machine.record.disks[:-1]]
    opened = diskchain.reading_files(frozen, home)
    assert len(opened) < len(frozen)
    images = [f"json:{json.dumps(diskchain.blockdev(chain))}" for chain in (frozen, opened)]
    compared = subprocess.run(["qemu-img", "compare", "-U", *images], capture_output=True, text=True)
    assert compared.returncode == 0, compared.stdout + compared.stderr
    with Chain(frozen) as whole, Chain(frozen, reading=opened) as merged:
        size = 1 << whole.cluster_bits
        held = set().union(*(layer.clusters() for layer in whole.layers[1:]))
        assert held and all(whole.read(c * size, size) == merged.read(c * size, size) for c in held)


def test_unused_merged_files_beyond_the_kept_ones_are_removed(tmp_path: Path) -> None:
    """Beyond the KEEP most recently picked, a merged file goes unless a start picked it in
    the last GRACE_S (a QEMU about to open it)."""
    home = Home(root=tmp_path, images=tmp_path / "images")
    folder = diskchain.folder(home)
    folder.mkdir(parents=True)
    now = time.time()
    files = []
    for i in range(diskchain.KEEP + 3):
        path = folder / f"{i:032x}{diskchain.SUFFIX}"
        path.write_bytes(b"x")
        picked = now - diskchain.GRACE_S - 60 if i == 0 else now - 10 + i
        os.utime(path, (picked, picked))
        files.append(path)
    killed = folder / f".{0:032x}.0badf00d.tmp"  # left by a merge killed midway
    killed.write_bytes(b"x")
    os.utime(killed, (now - diskchain.GRACE_S - 60,) * 2)
    running = folder / f".{1:032x}.lock"  # a merge under way
    running.write_bytes(b"")
    assert diskchain.remove_unused(home) == 1
    assert [p.exists() for p in files] == [False, *[True] * (diskchain.KEEP + 2)]
    assert not killed.exists() and running.exists()
