"""The booted template: a guest booted once and saved running, so machines start by loading it.

Booting under TCG takes seconds. So for each (image, accelerator, memory,
vCPUs) the guest is booted once with its RAM in a file (shared mapping), and
once the agent answers it is stopped and its device state saved with the
`x-ignore-shared` capability (RAM stays in the file, not in the stream). Its
disk overlay is frozen as the template's disk. A new machine maps that RAM
file privately (copy-on-write: the page cache is shared between machines),
loads the small device stream and runs on.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rewind.engine.agent import AgentClient
from rewind.engine.locks import file_lock
from rewind.engine.memory.memfiles import on_tmpfs
from rewind.engine.memory.snapshot import SavedState
from rewind.engine.process.qemu import (
    QMP_SOCKET,
    VmSpec,
    agent_socket,
    kill,
    launch,
    process_alive,
    qemu_build,
    wait_exit,
)
from rewind.engine.process.qmp import Monitor
from rewind.errors import ImageError, MachineDied
from rewind.image import Image

TEMPLATE_MAC = "52:54:00:00:00:01"
BOOT_TIMEOUT = 180.0
TEMPLATE_VERSION = 4  # bump when the way templates are made changes: old ones are then ignored


@dataclass(frozen=True)
class Template:
    path: Path
    accel: str
    memory_mib: int
    cpus: int
    board: str  # the versioned board of the QEMU that saved it: templates are per QEMU

    @property
    def ram(self) -> Path:
        return self.path / "ram"

    @property
    def devstate(self) -> Path:
        return self.path / "devstate"

    @property
    def disk(self) -> Path:
        return self.path / "disk.qcow2"



def template_dir(image: Image, accel: str, memory_mib: int, cpus: int, board: str) -> Path:
    return image.path / "templates" / f"{accel}-{memory_mib}m-{cpus}c-v{TEMPLATE_VERSION}-{board}"


def find_template(image: Image, accel: str, memory_mib: int, cpus: int) -> Template | None:
    """The template the QEMU in use saved for these settings, if it did."""
    board = qemu_build().board
    path = template_dir(image, accel, memory_mib, cpus, board)
    if (path / "template.json").is_file():
        return Template(path, accel, memory_mib, cpus, board)
    return None


def ensure_template(image: Image, accel: str, memory_mib: int, cpus: int,
                    report: Callable[[str], None] = lambda _: None) -> Template:
    """The template for these settings, booting and saving it first if needed."""
    found = find_template(image, accel, memory_mib, cpus)
    if found:
        return found
    board = qemu_build().board
    final = template_dir(image, accel, memory_mib, cpus, board)
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / ".lock", timeout=BOOT_TIMEOUT * 2, what="the template store"):
        found = find_template(image, accel, memory_mib, cpus)
        if found:
            return found
        report(f"booting a {memory_mib} MiB, {cpus}-vCPU guest once to save it running ({accel})")
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=final.parent))
        try:
            _boot_and_save(Template(staging, accel, memory_mib, cpus, board), image)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return Template(final, accel, memory_mib, cpus, board)


def template_state(template: Template, runtime: Path, image: Image) -> SavedState:
    """The template as a state machines start from (its memory brought to tmpfs)."""
    ram = on_tmpfs(runtime, f"template-{image.id}-{template.path.name}.ram", template.ram)
    # The image's root disk is named as a layer too, so checkpoints carry it (they are then
    # complete on a host that never built this image).
    return SavedState(ram=ram, devstate=template.devstate, disks=[image.disk, template.disk],
                      board=template.board)


def _warm_up(agent: AgentClient) -> None:
    """Walk the paths a new machine takes first (identity, exec, files), so that what the
    guest loads lazily (Python modules, binaries, directory entries) is already in the
    saved state instead of being loaded by every new machine."""
    agent.set_identity(hostname="rewind", machine_id="0" * 32, mac=TEMPLATE_MAC, seed="00" * 32,
                       time=time.time())
    for argv in (["true"], ["bash", "-c", "true"]):
        agent.exec(argv)
    agent.write_file("/tmp/.rewind-warm-up", io.BytesIO(b"x"))
    agent.read_file("/tmp/.rewind-warm-up", io.BytesIO(), max_bytes=1)
    agent.exec(["rm", "-f", "/tmp/.rewind-warm-up"])


def _boot_and_save(tmpl: Template, image: Image) -> None:
    out, accel, memory_mib, cpus = tmpl.path, tmpl.accel, tmpl.memory_mib, tmpl.cpus
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b",
                    str(image.disk.resolve()), str(tmpl.disk)], check=True, capture_output=True)
    tag = str(uuid.uuid4())
    spec = VmSpec(tag=tag, memory_mib=memory_mib, cpus=cpus, accel=accel, kernel=image.kernel,
                  initrd=image.initrd, disks=[(0, tmpl.disk)], ram_file=tmpl.ram, ram_shared=True,
                  mac=TEMPLATE_MAC, vmgenid=str(uuid.uuid4()), console_to_file=True,
                  runtime_disk=image.runtime_disk, board=tmpl.board)
    pid = launch(spec, out)
    try:
        def alive() -> None:
            if not process_alive(pid, tag):
                raise MachineDied("the template guest's QEMU exited during boot; see "
                                  f"{out / 'console.log'}")

        started = time.monotonic()
        with AgentClient(out / agent_socket(0), alive=alive, connect_timeout=BOOT_TIMEOUT) as agent:
            agent.ping()
            boot_seconds = time.monotonic() - started
            _warm_up(agent)
        with Monitor(out / QMP_SOCKET) as mon:
            mon.cmd("stop")
            mon.cmd("migrate-set-capabilities",
                    capabilities=[{"capability": "x-ignore-shared", "state": True}])
            mon.cmd("migrate", uri=f"exec:cat > {shlex.quote(str(tmpl.devstate))}")
            mon.wait_migration()
            mon.quit()
        if not wait_exit(pid, tag, 30):
            raise ImageError("the template guest's QEMU did not exit after saving")
    finally:
        kill(pid, tag)
    for leftover in out.glob("*.sock"):
        leftover.unlink()
    (out / "template.json").write_text(json.dumps(
        {"accel": accel, "memory_mib": memory_mib, "cpus": cpus, "image": image.id, "board": tmpl.board,
         "boot_seconds": round(boot_seconds, 2), "created": time.time()}, indent=2))
