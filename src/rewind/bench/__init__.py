"""`rewind bench`: what each step costs, measured side by side with the engines users would
pick instead, in one run. Times here are medians over rounds; these machines are noisy, so
compare the ratios of one run rather than absolute times across runs."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rewind.bench import diffs, faces, loop, ours, work, world
from rewind.bench.model import Metric, Report
from rewind.bench.ours import Progress
from rewind.bench.peers import PEERS, run_peers
from rewind.engine import DEFAULT_CPUS, DEFAULT_MEMORY_MIB
from rewind.engine.engine import Engine
from rewind.engine.process.qemu import qemu_build
from rewind.home import Home

__all__ = ["Metric", "Report", "run", "run_work"]

LOOP_ROUNDS = 20
QUICK_PEERS = "not run: --quick measures rewind alone"


def describe_host(home: Home) -> dict[str, str]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    runsc = shutil.which("runsc")
    gvisor = subprocess.run([runsc, "--version"], capture_output=True, text=True, check=False).stdout \
        if runsc else ""
    memory = next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal:"))
    return {"cpu": cpu, "cores": str(os.cpu_count()), "memory_mib": str(int(memory) // 1024),
            "kernel": platform.release(),
            "accel": Engine(home).accel().accel, "qemu": qemu_build().banner,
            "runsc": (gvisor.splitlines() or ["not installed"])[0], "python": platform.python_version(),
            "machine": f"{DEFAULT_MEMORY_MIB} MiB, {DEFAULT_CPUS} vCPUs"}


def _store_in_a_bucket(tmp: Path, images: Path, report: Report, rounds: int, progress: Progress) -> None:
    """The S3 section (bench/s3.py), last: its uploads must not run beside other figures.
    Skipped, with a line, where rclone is not installed (it comes with the bench extras)."""
    from rewind.bench import s3  # boto3 is a slow import

    try:
        s3.run_s3(tmp, images, report, rounds, progress)
    except FileNotFoundError as e:
        progress(f"store in a bucket: skipped ({e})")


@contextlib.contextmanager
def _scratch(images: Path | None, quick: bool, rounds: int,
             progress: Progress) -> Iterator[tuple[Home, Report]]:
    """A scratch home sharing the built image, with its template saved, and an empty report
    timed from here; nothing of the home is left behind."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rewind-bench-") as tmp:
        home = Home(root=Path(tmp), images=images or Home.from_env().images)
        report = Report(machine=describe_host(home), quick=quick, rounds=rounds)
        try:
            progress("saving the booted template (not measured)")
            Engine(home).template(DEFAULT_MEMORY_MIB, DEFAULT_CPUS)
            yield home, report
        finally:
            ours.close_home(home)
    report.seconds = time.monotonic() - started


def run(*, quick: bool = False, rounds: int | None = None, progress: Progress = lambda _: None,
        images: Path | None = None) -> Report:
    """Measure everything in a scratch home that shares the built image; nothing is left behind."""
    rounds = rounds or (1 if quick else 5)
    with _scratch(images, quick, rounds, progress) as (home, report):
        tmp = home.root
        ours.machines_and_exec(home, report, rounds, progress)
        faces.run_faces(home, report, rounds, quick, progress)
        bench = ours.checkpoints(home, report, rounds, quick, progress)
        ours.guard(bench, report, quick, progress)
        diffs.flush_cost(bench, report, rounds, progress)
        diffs.diff_times(bench, report, rounds, progress, quick)
        bench.delete()  # the loop's figures are of one machine alone
        loop.agent_loop(home, report, 2 if quick else LOOP_ROUNDS, progress)
        big, touched = ours.curve_machine(home, quick)
        ours.memory_curve(big, touched, report, progress)
        if quick:  # the peers take half a minute and measure nothing of ours
            report.peers = dict.fromkeys(PEERS, QUICK_PEERS)
        else:
            run_peers(big, report, touched, rounds, progress)
        big.delete()
        world.own_image(home, report, quick, progress)
        work.work(home, report, quick, rounds, progress, gvisor=QUICK_PEERS if quick else None)
        if quick:  # a minute of uploads; tests/test_s3_store.py covers what they exercise
            progress("store in a bucket: not run with --quick")
        else:
            _store_in_a_bucket(tmp / "s3", home.images, report, 3, progress)
    return report


def run_work(*, quick: bool = False, rounds: int | None = None, progress: Progress = lambda _: None,
             images: Path | None = None) -> Report:
    """The work section alone (bench/work.py), gVisor included even with `quick`."""
    rounds = rounds or (2 if quick else 5)
    with _scratch(images, quick, rounds, progress) as (home, report):
        work.work(home, report, quick, rounds, progress)
    return report
