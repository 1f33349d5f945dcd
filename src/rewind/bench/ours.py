"""rewind's own figures: machines, exec, files, checkpoints, restores, branches, the store,
checkpoint cost against memory in use, and the guard."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from rewind.bench.model import Report
from rewind.engine.engine import Engine
from rewind.engine.pointmeta import PointMeta
from rewind.errors import RewindError
from rewind.home import Home
from rewind.sandbox import Sandbox
from rewind.store import CheckpointManifest, open_store

Progress = Callable[[str], None]
T = TypeVar("T")

# In the guest: stamp the clock every millisecond and log every gap over 3 ms, so the
# pause a checkpoint causes is seen from inside, as a program in the guest would see it.
STAMPER = r"""
import time
last = time.monotonic()
while True:
    time.sleep(0.001)
    now = time.monotonic()
    if now - last > 0.003:
        with open("/run/gaps", "a") as f:
            f.write(f"{(now - last) * 1000:.3f}\n")
    last = now
"""
PROJECT = "/root/project"


def close_home(home: Home) -> None:
    """Leave nothing of a scratch home running: its machines deleted, then their background
    work waited for (a committer ends the QEMU a restore left behind: removed with the home
    first, that QEMU ran on for good), then its memory files on tmpfs removed."""
    for left in Sandbox.list(home=home):
        left.delete()
    with contextlib.suppress(RewindError):
        Engine(home).settle()
    shutil.rmtree(home.runtime, ignore_errors=True)


def timed(fn: Callable[[], object]) -> float:
    return timed_result(fn)[0]


def timed_result(fn: Callable[[], T]) -> tuple[float, T]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def du_mib(path: Path) -> float:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) / 1024


def _rollup_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return fields


def host_memory_mib(machines: list[Sandbox]) -> float:
    """Host memory these machines add, each: their QEMUs' private pages, their network
    filters' share, and the memory images on tmpfs they map (shared, counted once) unless a
    machine besides them runs on that image too (the machine they were forked from, or any
    machine still on the template): that one is there without them."""
    kib = 0
    names = {sbx._machine.name for sbx in machines}
    others = {m.record.ram for m in machines[0]._engine.list()
              if m.name not in names and m.status() == "running"}
    images = set()
    for sbx in machines:
        record = sbx._machine.record
        qemu = _rollup_kib(record.pid)
        kib += qemu["Private_Clean"] + qemu["Private_Dirty"]
        filter_pid = int((sbx._machine.path / "net.pid").read_text().split()[0])
        kib += _rollup_kib(filter_pid)["Pss"]
        images.add(record.ram)
    kib += sum(os.stat(image).st_blocks // 2 for image in images - others if image)
    return kib / 1024 / len(machines)


def touch_memory(sbx: Sandbox, mib: int) -> None:
    """Fill `mib` of the guest's memory with data that does not compress or dedupe
    (a file on the guest's tmpfs lives in its memory)."""
    sbx.exec(f"mount -o remount,size=95% /dev/shm && rm -f /dev/shm/ballast && "
             f"head -c {mib}M /dev/urandom > /dev/shm/ballast", check=True, timeout=600)


def largest_gap_ms(sbx: Sandbox) -> float:
    text = sbx.exec("cat /run/gaps 2>/dev/null; : > /run/gaps").stdout
    return max((float(line) for line in text.split()), default=0.0)


def machines_and_exec(home: Home, report: Report, rounds: int, progress: Progress) -> None:
    progress("machines: start to first exec, exec round trip, 10 MB files")
    starts, execs, writes, reads = [], [], [], []
    payload = bytes(range(256)) * (10 * 4096)  # 10 MiB
    for i in range(rounds):
        started = time.perf_counter()
        sbx = Sandbox.create(f"start-{i}", home=home)
        sbx.exec(["true"])
        starts.append(time.perf_counter() - started)
        execs += [timed(lambda s=sbx: s.exec(["true"])) * 1000 for _ in range(20)]
        writes.append(timed(lambda s=sbx: s.files.write("/root/blob", payload)))
        reads.append(timed(lambda s=sbx: s.files.read("/root/blob")))
        sbx.delete()
    report.add("start_to_first_exec_s", "new machine until its first exec returns", "s", starts)
    report.add("exec_true_ms", "round trip of `exec true`", "ms", execs)
    report.add("file_write_10mb_s", "write a 10 MB file into the guest", "s", writes)
    report.add("file_read_10mb_s", "read a 10 MB file from the guest", "s", reads)


def checkpoints(home: Home, report: Report, rounds: int, quick: bool, progress: Progress) -> Sandbox:
    """Checkpoints, restores, branches and the store, on one machine (returned, still running)."""
    sbx = Sandbox.create("bench", home=home)
    store = open_store(home.store, create=True)
    progress("checkpoints: the first one (it stores the image's root disk)")
    first = sbx.checkpoint(wait=True)
    one_mib = du_mib(home.store)
    progress("checkpoints: pause seen in the guest, call time, 1 MiB of changes apart")
    # The first half runs the stamper, to see the pause from inside; it keeps a vCPU busy
    # (each wake-up is emulated), so the call is timed in the second half, on an idle guest,
    # and the stamper is gone before the checkpoints that later steps restore and branch.
    stamper = sbx.exec(f"setsid python3 -c '{STAMPER}' > /dev/null 2>&1 < /dev/null & echo $!", check=True)
    pauses, qemu_pauses, calls, stored, idle_gaps = [], [], [], [], []
    count = 2 if quick else 10
    for i in range(count):
        if i == count // 2:
            sbx.exec(f"kill {stamper.stdout.strip()}", check=True)
        sbx.exec(f"head -c 1M /dev/urandom > /root/change-{i}", check=True)
        time.sleep(0.5)
        if i < count // 2:
            idle_gaps.append(largest_gap_ms(sbx))
        started = time.perf_counter()
        point = sbx.checkpoint()
        if i < count // 2:
            time.sleep(0.2)
            pauses.append(largest_gap_ms(sbx))
        else:
            calls.append(time.perf_counter() - started)
            sbx._machine.settle()
            stored.append(time.perf_counter() - started)
        sbx._machine.settle()
        qemu_pauses.append(_pause_ms(store.get(point.id)))
    later_mib = du_mib(home.store)
    progress("checkpoints: a new machine's first one (the image and its template are stored by now)")
    newcomer = Sandbox.create("bench-new", home=home)
    newcomer.exec("head -c 1M /dev/urandom > /root/work", check=True)
    newcomer.checkpoint(wait=True)
    new_machine_mib = du_mib(home.store) - later_mib
    newcomer.delete()
    report.add("checkpoint_pause_guest_ms", "guest pause during a checkpoint (largest gap seen inside)", "ms",
               pauses, target=20)
    report.add("guest_gap_idle_ms", "largest gap seen inside with no checkpoint (noise)", "ms", idle_gaps)
    report.add("checkpoint_pause_qemu_ms", "guest pause during a checkpoint (QEMU STOP to RESUME)", "ms",
               qemu_pauses, target=20)
    report.add("checkpoint_call_s", "checkpoint call until it returns (idle guest)", "s", calls, target=1.0)
    report.add("checkpoint_stored_s", "checkpoint until it is in the store (background work included)", "s",
               stored)
    report.add("store_one_checkpoint_mib", "store after one checkpoint", "MiB", [one_mib])
    report.add(f"store_{count + 1}_checkpoints_mib", f"store after {count} more, 1 MiB of changes apart",
               "MiB", [later_mib], target=1.2 * one_mib + count)
    report.add("first_checkpoint_own_mib", "data of the first checkpoint in a new store (image included)",
               "MiB", [first.own_bytes / (1 << 20)])
    report.add("new_machine_first_checkpoint_mib", "store growth by a new machine's first checkpoint, 1 MiB "
               "of files changed", "MiB", [new_machine_mib], target=20)

    progress("store check --read-data")
    report.add("store_check_read_data_s", "`rewind store check --read-data`", "s",
               [timed(lambda: store.check(read_data=True))])

    heavy = 1 if quick else rounds  # rounds of the slow operations
    progress("restore in place, create from a checkpoint")
    restores, creates = [], []
    # Each round starts with the background work of the one before done (as the branch
    # rounds below): that work is timed on its own, as "until it is in the store".
    for i in range(heavy):
        restores.append(timed(lambda: (sbx.restore("~1"), sbx.exec(["true"]))))
        sbx.exec(f"kill {stamper.stdout.strip()} 2>/dev/null || true")  # back if ~1 had it
        sbx._engine.settle()
        started = time.perf_counter()
        made = Sandbox.create(f"from-{i}", home=home, from_checkpoint=first.id)
        made.exec(["true"])
        creates.append(time.perf_counter() - started)
        made.delete()
    report.add("restore_to_first_exec_s", "restore in place until the first exec (own checkpoint included)",
               "s", restores, target=0.4)
    report.add("create_from_checkpoint_s", "new machine from a checkpoint until its first exec", "s", creates)

    progress("branches: source pause, child's first exec, memory per idle child")
    branch_times, branch_pauses = [], []
    for i in range(heavy):
        started = time.perf_counter()
        child = sbx.fork(f"child-{i}")
        child.exec(["true"])
        branch_times.append(time.perf_counter() - started)
        sbx._engine.settle()
        branch_pauses.append(_pause_ms(store.get(child._machine.record.parent)))
        child.delete()
    report.add("branch_to_child_exec_s", "branch until the child's first exec", "s", branch_times, target=1.0)
    report.add("branch_source_pause_ms", "source pause during a branch", "ms", branch_pauses, target=100)
    progress("fan-out: 1, 4 and 16 copies from one capture until all answered, memory per idle copy")
    for count in (1,) if quick else FAN_OUT:
        started = time.perf_counter()
        children = sbx.fork_many(count, names=[f"idle-{count}-{i}" for i in range(count)])
        with ThreadPoolExecutor(count) as pool:  # each answers as soon as it can, as an agent's would
            list(pool.map(lambda child: child.exec(["true"]), children))
        answered = time.perf_counter() - started
        time.sleep(3 if quick else 10)  # idle
        per_child = host_memory_mib(children)
        for child in children:
            child.delete()
        report.add(f"fan_out_{count}_answered_s", f"fork_many({count}) until every copy answered its exec",
                   "s", [answered], target=FAN_OUT_ANSWERED_S if count == max(FAN_OUT) else None)
        report.add(f"memory_per_idle_child_{count}_mib",
                   f"host memory added per idle child, {count} idle", "MiB", [per_child], target=32)
    return sbx


# Fan-out (tree search, parallel tries, rollouts): copies of one moment, and how soon all of
# them answer; 16 within 4 s is the aim (issue 34).
FAN_OUT = (1, 4, 16)
FAN_OUT_ANSWERED_S = 4.0


# A point with 1 GiB of new memory, stored within (the undo-at-scale target; it must also come
# before plain QEMU's in the same run, which the table shows beside it).
GIB_STORED_S = 2.5


def curve_machine(home: Home, quick: bool) -> tuple[Sandbox, list[int]]:
    """A machine big enough for the most memory the curve puts in use, and those amounts.
    A quick run uses the default machine."""
    if quick:
        sbx = Sandbox.create("curve", home=home)
        sbx.checkpoint(wait=True)
        return sbx, [64, 128]
    sbx = Sandbox.create("curve", memory=1536, home=home)
    sbx.checkpoint(wait=True)  # its first checkpoint stores the image's disk layers: not measured
    return sbx, [128, 512, 1024]


def curve_keys(mib: int) -> tuple[str, str, str]:
    """The metrics of one point of the curve: checkpoint time, guest pause, data written."""
    return f"curve_{mib}_checkpoint_s", f"curve_{mib}_pause_ms", f"curve_{mib}_size_mib"


def memory_curve(sbx: Sandbox, touched: list[int], report: Report, progress: Progress) -> None:
    """Checkpoint cost against guest memory in use; the peers are measured on the same
    machine and amounts (peers.py), so these rows compare like with like."""
    memory = sbx.info().memory_mib
    progress(f"checkpoint cost against memory in use ({', '.join(map(str, touched))} MiB, "
             f"{memory} MiB machine)")
    store = open_store(sbx._machine.home.store)
    points = []
    for mib in touched:
        touch_memory(sbx, mib)
        seconds, point = timed_result(lambda: sbx.checkpoint(wait=True))  # as the peers: all written
        points.append((mib, seconds))
        call, pause, size = curve_keys(mib)
        report.add(call, f"checkpoint with {mib} MiB in use, until stored ({memory} MiB machine)", "s",
                   [seconds], target=GIB_STORED_S if mib == 1024 else None)
        report.add(pause, f"guest pause with {mib} MiB in use (QEMU STOP to RESUME)", "ms",
                   [_pause_ms(store.get(point.id))])
        report.add(size, f"data a checkpoint adds with {mib} MiB in use", "MiB",
                   [point.own_bytes / (1 << 20)])
    report.curve["rewind"] = points
    report.add("curve_restore_s", f"restore in place until the first exec ({memory} MiB machine, "
               f"{touched[-1]} MiB in use, its own checkpoint included)", "s",
               [timed(lambda: (sbx.restore("~0"), sbx.exec(["true"])))])


def guard(sbx: Sandbox, report: Report, quick: bool, progress: Progress) -> None:
    """The guard's added cost on `sbx` (a machine already checkpointed once): a read, an edit
    of a 50-file project, and a system change kept from its copy."""
    progress("guard: added cost of none, git and fork steps")
    sbx.exec(f"mkdir -p {PROJECT} && cd {PROJECT} && git init -q && for i in $(seq 50); do "
             f"head -c 4k /dev/urandom > f$i; done && git add . && "
             f"git -c user.name=b -c user.email=b@b commit -qm init", check=True)
    def added(n: int, step: str, cwd: str | None = None) -> list[float]:
        """Plain and guarded runs in pairs, taking turns to go first, so the guest's drift
        cancels out; a guest command's own time varies by tens of ms, hence many pairs."""
        samples = []
        for i in range(n):
            plain, guarded = (lambda: sbx.exec(step, cwd=cwd)), (lambda: sbx.guarded(step, cwd=cwd))
            first, second = (timed(guarded), timed(plain)) if i % 2 else (timed(plain), timed(guarded))
            samples.append(((first - second) if i % 2 else (second - first)) * 1000)
        return samples

    report.add("guard_none_added_ms", "`guarded` over plain exec: a read (none)", "ms",
               added(10 if quick else 40, "cat f1 > /dev/null", cwd=PROJECT), target=5)
    report.add("guard_git_added_ms", "`guarded` over plain exec: a project edit (git)", "ms",
               added(10 if quick else 40, "echo x >> f1", cwd=PROJECT), target=100)
    report.add("guard_fork_added_ms", "`guarded` over plain exec: a system change (fork, kept)", "ms",
               added(1 if quick else 3, "touch /etc/bench-marker"))


def _pause_ms(manifest: CheckpointManifest) -> float:
    """How long the guest was paused for the point, from its meta."""
    return (PointMeta.from_json(manifest.id, manifest.meta).pause_s or 0.0) * 1000
