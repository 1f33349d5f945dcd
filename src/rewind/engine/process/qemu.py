"""Launching QEMU: the command line of a rewind machine, and its process.

Every machine is the same small virtual board (q35, virtio disk, network,
serial ports for the agent, RNG and a VM generation id), so that the running
state saved from one QEMU loads into another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rewind.errors import NeedsNewerQemu, QemuError

QEMU_BINARY = "qemu-system-x86_64"
# Another QEMU than the one on PATH, by the path of its qemu-system-x86_64: one unpacked beside
# the system's (its firmware then comes from its own share/qemu).
QEMU_ENV = "REWIND_QEMU"
# TCG's cache of translated code, per QEMU. 64 MiB filled within a few agent steps (python, git,
# pytest) and each time it filled everything was translated again; at 256 the work benchmark's
# median went from 14.8x the host's time to 11.9x (sqlite 20x to 11x), no better at 512 or 1024
# (docs/performance.md). Only what is translated is resident: an idle machine costs no more.
TRANSLATION_CACHE_MIB = 256
LEGACY_BOARD = "pc-q35-7.2"  # states saved before their board was recorded: all by QEMU 7.2
FIRMWARE_DIRS = ("share/qemu", "share/seabios", "lib/ipxe/qemu")  # Debian's, under a QEMU's prefix
BOARD_NAME = re.compile(r"pc-q35-\d{1,3}\.\d{1,3}")
AGENT_PORTS = 4  # concurrent host sessions per machine
AGENT_CHARDEV = "agent"  # QEMU chardev ids agent0..: query-chardev says whether the guest opened each
# hpet=disable: the guest kernel left the HPET's timer 0 periodic at 250 Hz (its interrupt
# off) once its ticks went one-shot, and QEMU woke for it each time: 23 ms of CPU a second
# per idle machine, 2 ms without (it keeps time by the ACPI PM timer instead, as cheap to read).
# dirty_background_bytes: the guest writes its cached writes out as soon as 4 MiB wait, on a
# vCPU the step is not using, instead of keeping them for 30 s; a checkpoint right after a
# step that copied 30 MiB of files then waited 0.07-0.10 s for the guest's sync, not 0.26-0.46 s.
KERNEL_CMDLINE = ("console=ttyS0 quiet panic=-1 root=/dev/vda hpet=disable "
                  "sysctl.vm.dirty_background_bytes=4194304")

# File names inside a machine's run directory (relative: QEMU runs there, and
# unix socket paths must stay short).
QMP_SOCKET = "qmp.sock"
PID_FILE = "qemu.pid"
CONSOLE_LOG = "console.log"
# A machine's serial console goes to its filter process, which keeps console.log bounded (see
# packetfilter.keep_console): root in a guest can write to it without end.
CONSOLE_SOCKET = "console.sock"
QEMU_LOG = "qemu.log"
# The guest's frames go to the network filter (packetfilter.py) and come back through these.
NET_FROM_GUEST = "net-guest.sock"  # frames the guest sent
NET_TO_NET = "net-pass.sock"  # frames the filter lets through to the network
NET_TO_GUEST = "net-reply.sock"  # frames the filter sends to the guest


def agent_socket(i: int) -> str:
    return f"agent-{i}.sock"


@dataclass(frozen=True)
class QemuBuild:
    """The QEMU this host runs machines with."""

    binary: str
    version: tuple[int, int, int]
    banner: str  # the first line of its --version
    # The versioned board its plain `q35` stands for (pc-q35-10.0): a state saved by this QEMU
    # is of that board, and loads only into a QEMU that has it, started with that name.
    board: str
    boards: frozenset[str]  # every versioned q35 board it can run
    # A QEMU unpacked outside /usr: where its firmware is (-L: then only there) and its modules
    # (such as TCG itself).
    firmware: tuple[Path, ...] = ()
    modules: Path | None = None

    def environ(self) -> dict[str, str]:
        """The environment to start it in."""
        if self.modules is None:
            return dict(os.environ)
        return {**os.environ, "QEMU_MODULE_DIR": str(self.modules)}

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))

    def check_board(self, board: str, what: str) -> None:
        """QemuError unless this QEMU can run `what`, a state saved from board `board`."""
        if board not in self.boards:
            raise NeedsNewerQemu(f"{what} was saved by a newer QEMU (board {board}); this host's QEMU "
                            f"{self.version_text} runs {self.board} and older: run it where QEMU is "
                            "that version or newer")


def board_of(meta: dict) -> str:
    """The board a point's meta names (LEGACY_BOARD where it names none); QemuError if it is not
    a board name: it becomes a QEMU option."""
    board = meta.get("board", LEGACY_BOARD)
    if not isinstance(board, str) or not BOARD_NAME.fullmatch(board):
        raise QemuError(f"a checkpoint names no QEMU board rewind runs: {str(board)[:40]!r}")
    return board


def qemu_binary() -> str:
    return os.environ.get(QEMU_ENV) or QEMU_BINARY


def qemu_build() -> QemuBuild:
    """The QEMU in use: REWIND_QEMU's, else the one on PATH; QemuError if there is none."""
    binary = shutil.which(qemu_binary())
    if binary is None:
        raise QemuError(f"{qemu_binary()} is not installed (apt-get install qemu-system-x86)")
    return _build(binary, os.stat(binary).st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _build(binary: str, _mtime: int) -> QemuBuild:
    def ask(*args: str) -> str:
        done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise QemuError(f"{binary} {' '.join(args)} failed: {done.stderr.strip() or done.returncode}")
        return done.stdout

    banner = ask("--version").splitlines()[0]
    found = re.search(r"version (\d+)\.(\d+)\.(\d+)", banner)
    if found is None:
        raise QemuError(f"cannot read the version of {binary}: {banner!r}")
    boards = ask("-machine", "help")
    alias = re.search(r"^q35\s.*\(alias of (pc-q35-[\d.]+)\)", boards, re.MULTILINE)
    versioned = frozenset(re.findall(r"^(pc-q35-[\d.]+)\s", boards, re.MULTILINE))
    if alias is None:
        raise QemuError(f"{binary} has no q35 board")
    build = QemuBuild(binary=binary, version=tuple(int(g) for g in found.groups()), banner=banner,  # type: ignore[arg-type]
                      board=alias.group(1), boards=versioned)
    prefix = Path(binary).resolve().parent.parent
    if prefix == Path("/usr"):
        return build
    return dataclasses.replace(build, firmware=tuple(prefix / d for d in FIRMWARE_DIRS),
                               modules=prefix / f"lib/{platform.machine()}-linux-gnu/qemu")


@dataclass(frozen=True)
class VmSpec:
    """Everything QEMU needs to run one machine."""

    tag: str  # the machine's UUID; also how its QEMU is recognised by PID
    memory_mib: int
    cpus: int
    accel: str  # "kvm" or "tcg"
    kernel: Path
    initrd: Path
    # The disk's qcow2 files, base first, the writable top last, each with its place in the
    # machine's chain (a merged file stands for several layers: see diskchain.py).
    disks: list[tuple[int, Path]]
    ram_file: Path | None  # None: plain anonymous RAM (a cold boot)
    ram_shared: bool  # True: guest RAM is the file itself; False: a private copy-on-write view of it
    mac: str
    vmgenid: str
    incoming: bool = False  # wait for `migrate-incoming` instead of booting
    # False: the device state it loads has no configuration section (a device-only save, see
    # snapshot.capture); QEMU then neither expects one nor writes one in its own migrations.
    configuration: bool = True
    console_to_file: bool = False  # QEMU itself writes console.log, unbounded: only the template's boot
    runtime_disk: Path | None = None  # the guest agent and its own Python, attached read-only (image.build)
    kernel_cmdline: str = KERNEL_CMDLINE
    board: str = "q35"  # a state to load names the versioned one it was saved from


def qemu_argv(spec: VmSpec, build: QemuBuild) -> list[str]:
    accel = "kvm" if spec.accel == "kvm" else f"tcg,thread=multi,tb-size={TRANSLATION_CACHE_MIB}"
    if spec.ram_file is None:
        ram = f"memory-backend-ram,id=ram0,size={spec.memory_mib}M"
    else:
        ram = (f"memory-backend-file,id=ram0,size={spec.memory_mib}M,mem-path={spec.ram_file},"
               f"share={'on' if spec.ram_shared else 'off'}")
    # suppress-vmdesc: no JSON description of the devices at the end of a migration stream (only
    # tools read it). Writing it, QEMU 10.0.2 aborted (json-writer.c: Assertion `depth' failed)
    # in a background snapshot of a QEMU that had loaded a state: a restored machine's big checkpoint.
    machine = f"{spec.board},memory-backend=ram0,suppress-vmdesc=on"
    argv = [
        build.binary, "-name", "rewind", "-nodefaults", "-no-user-config",
        *(arg for d in build.firmware for arg in ("-L", str(d))),
        "-display", "none", "-machine", machine, "-accel", accel, "-cpu", "max",
        "-m", f"{spec.memory_mib}M", "-smp", str(spec.cpus), "-object", ram,
        "-kernel", str(spec.kernel), "-initrd", str(spec.initrd), "-append", spec.kernel_cmdline,
        "-no-reboot",
        *disk_args(spec.disks),
        *runtime_disk_args(spec.runtime_disk),
        # IPv4 only, and every frame the guest sends goes through our filter (packetfilter.py).
        "-netdev", "user,id=net0,ipv6=off", "-device", f"virtio-net-pci,netdev=net0,mac={spec.mac},id=nic0",
        *netfilter_args(),
        "-device", "virtio-serial-pci,id=vser0",
        "-device", "virtio-rng-pci,id=rng0",
        "-device", f"vmgenid,guid={spec.vmgenid},id=vmgenid0",
        "-chardev", (f"file,id=console,path={CONSOLE_LOG}" if spec.console_to_file
                     else f"socket,id=console,path={CONSOLE_SOCKET},server=on,wait=off"),
        "-serial", "chardev:console",
        "-qmp", f"unix:{QMP_SOCKET},server=on,wait=off",
        "-pidfile", PID_FILE, "-daemonize",
        # The machine's UUID doubles as the tag that tells our QEMU from a reused PID.
        "-uuid", spec.tag,
    ]
    for i in range(AGENT_PORTS):
        chardev = f"{AGENT_CHARDEV}{i}"
        argv += ["-chardev", f"socket,id={chardev},path={agent_socket(i)},server=on,wait=off",
                 "-device", f"virtserialport,bus=vser0.0,chardev={chardev},name=rewind.agent.{i},id=port{i}"]
    if spec.incoming:
        argv += ["-incoming", "defer"]
    if not spec.configuration:
        argv += ["-global", "migration.send-configuration=off"]
    return argv


def guest_ram_ranges(memory_mib: int) -> list[tuple[int, int]]:
    """Where q35 puts guest RAM in the physical address space, as (start, size): below the
    PCI hole, and the rest from 4 GiB up (QEMU's pc_q35_init)."""
    size = memory_mib << 20
    low = 0x80000000 if size >= 0xB0000000 else 0xB0000000
    if size <= low:
        return [(0, size)]
    return [(0, low), (1 << 32, size - low)]


def netfilter_args() -> list[str]:
    """Route netdev net0 through the filter: a redirector on its receive queue hands the
    filter what the guest sends and passes on what the filter writes back; one on its
    transmit queue lets the filter answer the guest. No filter connected: no traffic."""
    return [
        "-chardev", f"socket,id=netguest,path={NET_FROM_GUEST},server=on,wait=off",
        "-chardev", f"socket,id=netpass,path={NET_TO_NET},server=on,wait=off",
        "-chardev", f"socket,id=netreply,path={NET_TO_GUEST},server=on,wait=off",
        "-object", "filter-redirector,id=netout,netdev=net0,queue=rx,outdev=netguest,indev=netpass",
        "-object", "filter-redirector,id=netin,netdev=net0,queue=tx,indev=netreply",
    ]


RUNTIME_NODE = "runtime"  # the agent's disk; the root disk's layers are disk_node(i)


def disk_node(i: int) -> str:
    return f"d{i}"


def disk_args(chain: list[tuple[int, Path]]) -> list[str]:
    """One -blockdev per file, named by its place in the chain and naming the one below as
    its backing (the paths recorded inside the files may be stale: layers are moved and
    materialised)."""
    args = []
    below = None
    for place, path in chain:
        backing = "" if below is None else f",backing={disk_node(below)}"
        # Lower layers are shared between machines: read-only, so no one takes their write lock.
        mode = "" if (place, path) == chain[-1] else ",read-only=on"
        args += ["-blockdev", f"node-name={disk_node(place)},driver=qcow2,file.driver=file,"
                              f"file.filename={path}{backing}{mode}"]
        below = place
    return [*args, "-device", f"virtio-blk-pci,drive={disk_node(chain[-1][0])},id=vda"]


def runtime_disk_args(path: Path | None) -> list[str]:
    """The guest agent's disk (the guest's /dev/vdb, after the root disk), read-only: nothing a
    step does in the guest can change what rewind's channel into it runs on."""
    if path is None:
        return []
    return ["-blockdev", f"node-name={RUNTIME_NODE},driver=raw,file.driver=file,file.filename={path},"
                         "read-only=on",
            "-device", f"virtio-blk-pci,drive={RUNTIME_NODE},id=vdb"]


def launch(spec: VmSpec, run_dir: Path, log_dir: Path | None = None) -> int:
    """Start QEMU daemonized in `run_dir` (its sockets and PID file), its log in `log_dir`
    (by default the same); returns its PID once its sockets exist."""
    build = qemu_build()
    for name in (QMP_SOCKET, PID_FILE, CONSOLE_SOCKET, *(agent_socket(i) for i in range(AGENT_PORTS))):
        (run_dir / name).unlink(missing_ok=True)
    with open((log_dir or run_dir) / QEMU_LOG, "ab") as log:
        done = subprocess.run(qemu_argv(spec, build), cwd=run_dir, env=build.environ(),
                              stdin=subprocess.DEVNULL, stdout=log,
                              stderr=subprocess.PIPE, timeout=60, check=False)
        log.write(done.stderr)
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        raise QemuError(f"QEMU did not start: {lines[-1] if lines else f'exit code {done.returncode}'}")
    return int((run_dir / PID_FILE).read_text().strip())


def start_detached(argv: list[str], pass_fds: tuple[int, ...] = ()) -> None:
    """Start a helper that outlives this process and is nobody's zombie (setsid -f: it
    runs in a session of its own, its parent gone). `pass_fds` are inherited by it."""
    subprocess.run(["setsid", "-f", *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True, pass_fds=pass_fds)


def qemu_processes() -> Iterator[Path]:
    """The /proc folders of the QEMU processes on this host (any user's, any home's)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if (proc / "comm").read_text().startswith("qemu"):
                    yield proc


def process_alive(pid: int, tag: str) -> bool:
    """True if `pid` is a live QEMU started with `tag` (PIDs get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and tag.encode() in cmdline


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), None unless it runs: with its PID,
    an identity no later process has."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])  # field 22 of the whole line


def kill(pid: int, tag: str, grace: float = 5.0) -> None:
    """End our QEMU by PID: SIGTERM, then SIGKILL after `grace` seconds."""
    if not process_alive(pid, tag):
        return
    os.kill(pid, signal.SIGTERM)
    if wait_exit(pid, tag, grace):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_exit(pid, tag, float("inf"))


def wait_exit(pid: int, tag: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    poll = 0.001  # most exits take a few milliseconds; a slow one is polled less often
    while process_alive(pid, tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
        poll = min(poll * 2, 0.02)
    return True
