"""The engines users would pick instead, run on the same work in the same invocation.

- plain QEMU, done the obvious way: stop the guest, migrate its whole memory to a file,
  copy its disk with `qemu-img convert`, go on; restore by starting a new QEMU with
  `-incoming` on that file and disk.
- gVisor (`runsc`, ptrace platform, overlay root): checkpoint and restore a container
  holding the same kind of workload (memory filled with random data).

Each peer measures what it can and says why when it cannot run at all.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from rewind.bench.model import Report
from rewind.bench.ours import Progress, curve_keys, du_mib, timed, touch_memory
from rewind.engine.agent import AgentClient
from rewind.engine.memory.snapshot import UNLIMITED_BANDWIDTH
from rewind.engine.process.qemu import QMP_SOCKET, VmSpec, agent_socket, kill, launch
from rewind.engine.process.qmp import Monitor
from rewind.home import Home
from rewind.image import find_image
from rewind.sandbox import Sandbox

BUSYBOX = Path("/bin/busybox")


class PeerUnavailable(Exception):
    """The peer cannot run here; the message says why."""


def _chain_json(disks: list[str]) -> str:
    """qemu-img's name for a layer chain given explicitly (the paths inside the files may be stale)."""
    node: dict | None = None
    for path in disks:
        layer: dict = {"driver": "qcow2", "file": {"driver": "file", "filename": path}}
        if node is not None:
            layer["backing"] = node
        node = layer
    return "json:" + json.dumps(node)


class PlainQemu:
    name = "plain QEMU"

    def __init__(self, home: Home) -> None:
        self.home = home
        self.work = Path(tempfile.mkdtemp(prefix="rewind-bench-qemu-"))

    def checkpoint(self, sbx: Sandbox) -> tuple[float, float]:
        """Stop, save memory and disk, go on: (seconds the guest was stopped, MiB written)."""
        machine = sbx._machine
        machine.reload()
        for old in self.work.glob("saved.*"):
            old.unlink()
        started = time.perf_counter()
        with Monitor(machine.path / QMP_SOCKET) as mon:
            # A plain migration: none of the capabilities rewind's own checkpoints turn on, but
            # not held to QEMU's default 128 MiB/s either (a user who times this lifts it).
            mon.cmd("migrate-set-capabilities", capabilities=[
                {"capability": c, "state": False} for c in ("x-ignore-shared", "background-snapshot")])
            mon.cmd("migrate-set-parameters", **UNLIMITED_BANDWIDTH)
            mon.cmd("stop")
            mon.cmd("migrate", uri=f"exec:cat > {self.work / 'saved.mem'}")
            mon.wait_migration()
            subprocess.run(["qemu-img", "convert", "-U", "-O", "qcow2", _chain_json(machine.record.disks),
                            str(self.work / "saved.qcow2")], check=True, capture_output=True)
            mon.cmd("cont")
        stopped = time.perf_counter() - started
        return stopped, du_mib(self.work / "saved.mem") + du_mib(self.work / "saved.qcow2")

    def restore(self, sbx: Sandbox) -> float:
        """A new QEMU from the saved files, until its first exec returns."""
        machine = sbx._machine
        run_dir = self.work / f"run-{uuid.uuid4().hex[:8]}"
        run_dir.mkdir()
        image = find_image(self.home.images, machine.record.image_id)
        tag = str(uuid.uuid4())
        spec = VmSpec(tag=tag, memory_mib=machine.record.memory_mib, cpus=machine.record.cpus,
                      accel=machine.record.accel, kernel=image.kernel, initrd=image.initrd,
                      disks=[(0, self.work / "saved.qcow2")], ram_file=None, ram_shared=False,
                      mac=machine.record.mac, vmgenid=str(uuid.uuid4()), incoming=True,
                      runtime_disk=image.runtime_disk)
        started = time.perf_counter()
        pid = launch(spec, run_dir)
        try:
            with Monitor(run_dir / QMP_SOCKET) as mon:
                mon.cmd("migrate-incoming", uri=f"exec:cat {self.work / 'saved.mem'}")
                mon.wait_migration()
                mon.cmd("cont")
            with AgentClient(run_dir / agent_socket(0), connect_timeout=30) as agent:
                agent.exec(["true"])
            return time.perf_counter() - started
        finally:
            kill(pid, tag)
            shutil.rmtree(run_dir, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


class GVisor:
    name = "gVisor"
    FLAGS = ["--platform=ptrace", "--overlay", "--network=none"]

    def __init__(self) -> None:
        if shutil.which("runsc") is None:
            raise PeerUnavailable("runsc is not installed (apt-get install runsc)")
        self.work = Path(tempfile.mkdtemp(prefix="rewind-bench-gvisor-"))
        self.root = self.work / "state"
        self.bundle = self.work / "bundle"
        self.container: str | None = None
        try:
            self.bundle.mkdir()
            self._runsc("spec", cwd=self.bundle)
            spec = json.loads((self.bundle / "config.json").read_text())
            spec["process"].update(args=["/bin/sleep", "1000000"], terminal=False)
            self.make_root(spec)
            (self.bundle / "config.json").write_text(json.dumps(spec))
        except BaseException:
            self.close()
            raise

    def make_root(self, spec: dict) -> None:
        """The container's root: busybox alone, in the bundle (written to memory, under --overlay)."""
        if not BUSYBOX.is_file():
            raise PeerUnavailable("busybox is needed for its container (apt-get install busybox-static)")
        rootfs = self.bundle / "rootfs"
        (rootfs / "bin").mkdir(parents=True)
        (rootfs / "tmp").mkdir()
        shutil.copy(BUSYBOX, rootfs / "bin" / "busybox")
        for tool in ("sh", "sleep", "true", "head", "wc"):
            (rootfs / "bin" / tool).symlink_to("busybox")
        spec["root"] = {"path": "rootfs", "readonly": False}

    def _runsc(self, *args: str, cwd: Path | None = None, timeout: float = 300) -> str:
        # runsc must not have pipes for stdout/stderr when it detaches (it waits on them): use files.
        with open(self.work / "runsc.out", "w+") as out:
            done = subprocess.run(["runsc", f"--root={self.root}", *self.FLAGS, *args], cwd=cwd,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False)
            out.seek(0)
            text = out.read()
        if done.returncode != 0:
            lines = text.strip().splitlines()
            raise PeerUnavailable(f"runsc {args[0]} failed: {lines[-1] if lines else done.returncode}")
        return text

    def start(self) -> float:
        """Run a new container until its first exec returns."""
        self.container = f"bench-{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        self._runsc("run", "-detach", f"--bundle={self.bundle}", self.container)
        self._runsc("exec", self.container, "/bin/true")
        return time.perf_counter() - started

    def exec_true(self) -> float:
        assert self.container
        return timed(lambda: self._runsc("exec", self.container, "/bin/true"))

    def touch_memory(self, mib: int) -> None:
        assert self.container
        self._runsc("exec", self.container, "/bin/sh", "-c",
                    f"head -c {mib << 20} /dev/urandom > /tmp/ballast")

    def checkpoint(self) -> tuple[float, float]:
        """(seconds the checkpoint took; the container is stopped by it, MiB of image)."""
        assert self.container
        image = self.work / "image"
        shutil.rmtree(image, ignore_errors=True)
        seconds = timed(lambda: self._runsc("checkpoint", f"--image-path={image}", self.container))
        return seconds, du_mib(image)

    def restore(self, expect_mib: int) -> float:
        """Restore the checkpoint as a new container until its first exec; checks its memory came back."""
        assert self.container
        self._runsc("delete", "-force", self.container)
        started = time.perf_counter()
        self._runsc("restore", f"--image-path={self.work / 'image'}", f"--bundle={self.bundle}", "-detach",
                    self.container)
        self._runsc("exec", self.container, "/bin/true")
        seconds = time.perf_counter() - started
        size = self._runsc("exec", self.container, "/bin/sh", "-c", "wc -c < /tmp/ballast").strip()
        if size != str(expect_mib << 20):
            raise PeerUnavailable(f"the restored container lost its data (/tmp/ballast is {size!r} bytes)")
        return seconds

    def close(self) -> None:
        if self.container:
            with contextlib.suppress(PeerUnavailable, subprocess.TimeoutExpired):
                self._runsc("delete", "-force", self.container, timeout=60)
        shutil.rmtree(self.work, ignore_errors=True)


PEERS = (PlainQemu.name, GVisor.name)


def run_peers(sbx: Sandbox, report: Report, touched: list[int], rounds: int, progress: Progress) -> None:
    """Put each peer's figures beside ours in `report`. Plain QEMU works on `sbx`, the machine
    rewind's memory curve ran on, with the same memory in use."""
    start, exec_true = report.metric("start_to_first_exec_s"), report.metric("exec_true_ms")
    restore = report.metric("curve_restore_s")

    def point(engine: str, mib: int, seconds: float, pause_ms: float | str, size_mib: float) -> None:
        call_key, pause_key, size_key = curve_keys(mib)
        report.metric(call_key).peers[engine] = [seconds]
        report.metric(pause_key).peers[engine] = pause_ms if isinstance(pause_ms, str) else [pause_ms]
        report.metric(size_key).peers[engine] = [size_mib]

    progress("peer: plain QEMU (stop, migrate to a file, qemu-img convert, -incoming)")
    peer = PlainQemu(sbx._machine.home)
    try:
        points = []
        for mib in touched:
            touch_memory(sbx, mib)
            stopped, written = peer.checkpoint(sbx)
            points.append((mib, stopped))
            point(peer.name, mib, stopped, stopped * 1000, written)
        restore.peers[peer.name] = [peer.restore(sbx) for _ in range(max(1, rounds // 2))]
        start.peers[peer.name] = "(starts as rewind does; a cold boot is the obvious way, not measured)"
        report.curve[peer.name] = points
        report.peers[peer.name] = "ok"
    except Exception as e:  # noqa: BLE001 - a peer that fails says why in its row; the run goes on
        report.peers[peer.name] = f"failed: {e}"
    finally:
        peer.close()

    progress("peer: gVisor (runsc checkpoint/restore, ptrace platform)")
    gvisor = None
    try:
        gvisor = GVisor()
        start.peers[GVisor.name] = [gvisor.start()]
        exec_true.peers[GVisor.name] = [gvisor.exec_true() * 1000 for _ in range(10)]
        points, restores = [], []
        for mib in touched:
            gvisor.touch_memory(mib)
            seconds, image_mib = gvisor.checkpoint()
            points.append((mib, seconds))
            point(GVisor.name, mib, seconds, "(stopped by the checkpoint: all of it)", image_mib)
            restores.append(gvisor.restore(mib))
        restore.peers[GVisor.name] = restores
        report.curve[GVisor.name] = points
        report.peers[GVisor.name] = "ok"
    except (PeerUnavailable, OSError, subprocess.SubprocessError) as e:
        report.peers[GVisor.name] = str(e)
    finally:
        if gvisor is not None:
            gvisor.close()
