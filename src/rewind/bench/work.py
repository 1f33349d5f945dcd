"""The work an agent's steps do inside a machine, rather than what rewind adds around them:
ten fixed steps (start Python, a CPU loop, small files, spawns, grep, tar, git, sqlite, a pip
install, a pytest run), each a bash script timed inside its environment: on this host, in a
rewind machine, and in gVisor. The fixtures are made once, untimed, and each environment
works on its own copy of them; the same wrapper runs every step everywhere. A figure is the
ratio to the host of the same repeat; the seconds behind it are kept with each metric."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import random
import shutil
import statistics
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rewind.bench.model import Report
from rewind.bench.ours import Progress
from rewind.bench.peers import GVisor, PeerUnavailable
from rewind.home import Home
from rewind.sandbox import Sandbox

GUEST_WORK = "/root/work"  # on the guest's disk, not a tmpfs, as the host's copy is
STEP_TIMEOUT = 900.0
GVISOR_TIMEOUT = 300.0  # a step stuck under gVisor is given up, not waited on for the whole run
MEDIAN_TARGET = 6.0
SPAWN_TARGET = 5.0
MARK = "work-seconds"
PREFIX = "work_"  # of the section's metric keys
MEDIAN_KEY = f"{PREFIX}median_x"
# The same everywhere: Debian's own programs first (the host's PATH may start with a venv),
# nothing written beside the fixtures' sources, so every repeat does the same work.
ENVIRONMENT = ("export PATH=/usr/bin:/bin:/usr/sbin:/sbin HOME=\"$PWD\" LC_ALL=C.UTF-8 "
               "PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1")
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform",
         "victor", "whiskey", "xray", "yankee", "zulu"]
NEEDLE = "needle"  # in every tenth file of the tree: what the grep step looks for
PYTEST = "pytest"

CPU = """import sys
total = 0
for i in range(int(sys.argv[1])):
    total += i * i % 7
print(total)
"""
WRITE = """import os, sys
data = bytes(range(256)) * 64
for i in range(int(sys.argv[1])):
    with open(f"out/{i:04d}", "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
"""
INSERT = """import sqlite3, sys
db = sqlite3.connect("bench.db")
db.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT, value REAL)")
with db:
    db.executemany("INSERT INTO items (name, value) VALUES (?, ?)",
                   ((f"item-{i}", i * 0.5) for i in range(int(sys.argv[1]))))
db.close()
"""


@dataclass(frozen=True)
class Sizes:
    files: int  # small text files in the tree that grep, tar and git work on
    cpu_rounds: int  # about 0.3 s of pure Python here in full
    written: int  # 16 KiB files written
    rows: int  # sqlite rows
    tests: int = 30
    # The pip and pytest steps, the slowest under TCG: tests/test_bench.py's quick bench took
    # 149 s in a full run of the suite with them (5fb873c), 73 s alone without them.
    packages: bool = True


FULL = Sizes(files=1500, cpu_rounds=5_000_000, written=200, rows=20_000)
QUICK = Sizes(files=300, cpu_rounds=1_000_000, written=50, rows=5_000, packages=False)


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    body: str  # timed
    setup: str = ""  # untimed, before each repeat: takes away what the last one made
    target: float | None = None

    def script(self) -> str:
        """What every environment runs, from the work folder. The body is timed by the
        shell's own clock (EPOCHREALTIME starts no process), so the round trip into the
        environment is not counted; its output is dropped, as an agent's tool would pipe it."""
        return (f"set -e\n{ENVIRONMENT}\n{self.setup}\n"
                f"s=$EPOCHREALTIME\n{{\n{self.body}\n}} > /dev/null\ne=$EPOCHREALTIME\n"
                f'echo "{MARK} $s $e"\n')


def steps(sizes: Sizes) -> list[Step]:
    git = "git -c user.name=bench -c user.email=bench@localhost -c init.defaultBranch=main"
    return [
        Step("python_start", "start Python 5 times (`python3 -c pass`)",
             "for i in 1 2 3 4 5; do python3 -c pass; done"),
        Step("cpu", f"a pure-Python loop of {sizes.cpu_rounds:,} rounds",
             f"python3 cpu.py {sizes.cpu_rounds}"),
        Step("file_write", f"write {sizes.written} files of 16 KiB, each fsynced",
             f"python3 write.py {sizes.written}", setup="rm -rf out; mkdir out"),
        Step("spawn", "100 process spawns (`/bin/true`)", "for i in $(seq 100); do /bin/true; done",
             target=SPAWN_TARGET),
        Step("grep", f"`grep -r` a word over {sizes.files:,} small text files", f"grep -rl {NEEDLE} tree"),
        Step("tar", "tar czf and tar xf of that tree", "tar czf tree.tgz tree\ntar xf tree.tgz -C untar",
             setup="rm -rf tree.tgz untar; mkdir untar"),
        Step("git", "git init, add, commit and status on a copy of that tree",
             f"cd repo\n{git} init -q\n{git} add -A\n{git} commit -qm tree\n{git} status --short",
             setup="rm -rf repo; cp -r tree repo"),
        Step("sqlite", f"insert {sizes.rows:,} rows in one transaction (python3's sqlite3)",
             f"python3 insert.py {sizes.rows}", setup="rm -f bench.db"),
    ] + ([
        Step("pip", "`python3 -m venv`, then `pip install` of two local wheels",
             "python3 -m venv venv\nvenv/bin/pip install -q --no-index --find-links wheels benchpkg",
             setup="rm -rf venv"),
        Step(PYTEST, f"`python3 -m pytest -q` on {sizes.tests} trivial tests",
             "cd project\nPYTHONPATH=../pylib python3 -m pytest -q -p no:cacheprovider"),
    ] if sizes.packages else [])


# ---- fixtures ----

def make_fixtures(root: Path, sizes: Sizes, progress: Progress) -> list[Step]:
    """Everything the steps work on, in `root`; the steps that can run (pytest's needs the
    pytest beside rewind, to copy)."""
    root.mkdir(parents=True)
    for name, text in (("cpu.py", CPU), ("write.py", WRITE), ("insert.py", INSERT)):
        (root / name).write_text(text)
    _tree(root / "tree", sizes.files)
    plan = steps(sizes)
    if not sizes.packages:
        return _compiled(root, plan)
    (root / "wheels").mkdir()
    _wheel(root / "wheels", "benchdep", [])
    _wheel(root / "wheels", "benchpkg", ["benchdep"])
    try:
        _copy_distributions(PYTEST, root / "pylib")
        _tests(root / "project", sizes.tests)
    except importlib.metadata.PackageNotFoundError as e:
        progress(f"work: no pytest step (the pytest to copy is not installed beside rewind: {e})")
        plan = [step for step in plan if step.name != PYTEST]
    return _compiled(root, plan)


def _compiled(root: Path, plan: list[Step]) -> list[Step]:
    """`plan`, once the fixtures' Python is compiled."""
    # Compiled once here with the Python the steps run, so no repeat compiles them (steps
    # write no bytecode); the copies keep mtimes, so the compiled files stay valid in each.
    subprocess.run(["/usr/bin/python3", "-m", "compileall", "-q", str(root)], check=True, capture_output=True)
    return plan


def _tree(root: Path, files: int) -> None:
    rng = random.Random(files)  # the same tree on every run of one size
    for i in range(files):
        lines = [" ".join(rng.choices(WORDS, k=8)) for _ in range(24)]
        if i % 10 == 0:
            lines.insert(rng.randrange(len(lines)), NEEDLE)
        path = root / f"d{i // 50:02d}" / f"f{i:04d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")


def _wheel(folder: Path, name: str, requires: list[str]) -> None:
    """A pure-Python wheel of one module, its files dated alike, so it is the same every run."""
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": f"NAME = {name!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: rewind-bench\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0)), text)


def _copy_distributions(name: str, dest: Path, seen: set[str] | None = None) -> None:
    """A distribution installed beside rewind and those it requires here, copied into `dest`
    as they are installed (the guest's Python is Debian's 3.11, as this host's)."""
    from packaging.requirements import Requirement  # pytest requires it: there when pytest is

    seen = set() if seen is None else seen
    dist = importlib.metadata.distribution(name)
    if dist.metadata["Name"].lower() in seen:
        return
    seen.add(dist.metadata["Name"].lower())
    for file in dist.files or []:
        if file.parts[0] == ".." or "__pycache__" in file.parts:  # scripts outside, stale bytecode
            continue
        target = dest / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(str(dist.locate_file(file))), target)
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _copy_distributions(requirement.name, dest, seen)


def _tests(root: Path, count: int) -> None:
    root.mkdir()
    (root / "pytest.ini").write_text("[pytest]\n")  # the project's root: no search above it
    per_file = 10
    for first in range(0, count, per_file):
        tests = range(first, min(count, first + per_file))
        (root / f"test_{first // per_file}.py").write_text(
            "".join(f"def test_{i}():\n    assert {i} + 1 == {i + 1}\n\n\n" for i in tests))


# ---- where the steps run ----

class StepFailed(Exception):
    """A step did not finish well in one environment; the message says how."""


def _seconds(code: int, stdout: str, stderr: str) -> float:
    if code != 0:
        lines = stderr.strip().splitlines()
        raise StepFailed(f"exit {code}: {lines[-1] if lines else 'no message'}")
    for line in stdout.splitlines():
        if line.startswith(MARK + " "):
            _, start, end = line.split()
            return float(end) - float(start)
    raise StepFailed(f"no timing in its output: {stdout[-200:]!r}")


class Environment(Protocol):
    name: str

    def run(self, script: str) -> float:
        """Seconds the step's body took, timed inside; StepFailed if it failed."""
        ...


class Host:
    name = "host"

    def __init__(self, work: Path) -> None:
        self.work = work

    def run(self, script: str) -> float:
        try:
            done = subprocess.run(["/bin/bash", "-c", script], cwd=self.work, env={}, capture_output=True,
                                  text=True, timeout=STEP_TIMEOUT, check=False)
        except subprocess.TimeoutExpired as e:
            raise StepFailed(f"timed out after {STEP_TIMEOUT:.0f} s") from e
        return _seconds(done.returncode, done.stdout, done.stderr)


class Machine:
    name = "rewind"

    def __init__(self, sbx: Sandbox) -> None:
        self.sbx = sbx

    def run(self, script: str) -> float:
        result = self.sbx.exec(["/bin/bash", "-c", script], cwd=GUEST_WORK, timeout=STEP_TIMEOUT)
        if result.timed_out:
            raise StepFailed(f"timed out after {STEP_TIMEOUT:.0f} s")
        return _seconds(result.exit_code, result.stdout, result.stderr)


class HostRootGVisor(GVisor):
    """A gVisor container over this host's own root, read-only: the host step's very
    programs. Its work folder is bound in writable and /tmp is in its memory. Without
    --overlay the work folder's writes reach this host's disk (through gVisor's file
    proxy), as a machine's reach its disk."""

    FLAGS = ["--platform=ptrace", "--network=none"]

    def __init__(self, work: Path) -> None:
        self.source = work
        super().__init__()

    def make_root(self, spec: dict) -> None:
        spec["root"] = {"path": "/", "readonly": True}
        spec["mounts"] += [
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
            {"destination": GUEST_WORK, "type": "bind", "source": str(self.source),
             "options": ["rbind", "rw"]},
        ]

    def run(self, script: str) -> float:
        assert self.container
        try:
            # Not through _runsc's one output file: the sandbox writes each of its standard
            # streams at an offset of its own, so two of them sharing a file overwrite each other.
            done = subprocess.run(["runsc", f"--root={self.root}", *self.FLAGS, "exec", f"--cwd={GUEST_WORK}",
                                   self.container, "/bin/bash", "-c", script], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=GVISOR_TIMEOUT, check=False)
        except subprocess.TimeoutExpired as e:
            raise StepFailed(f"timed out after {GVISOR_TIMEOUT:.0f} s") from e
        return _seconds(done.returncode, done.stdout, done.stderr)


# ---- the section ----

def work(home: Home, report: Report, quick: bool, rounds: int, progress: Progress, *,
         gvisor: str | None = None) -> None:
    """Add the work rows to `report`: per step its ratio to the host, repeat by repeat,
    and the median over the steps. `gvisor`: why gVisor is not run (None: it is)."""
    folder = home.root / "work"
    host_work, gvisor_work = folder / "host", folder / "gvisor"
    progress("work: making the fixtures (not measured)")
    plan = make_fixtures(host_work, QUICK if quick else FULL, progress)
    sbx, peer = None, None
    try:
        progress(f"work: a machine with its copy of the fixtures in {GUEST_WORK} (not measured)")
        sbx = Sandbox.create("work", home=home)
        sbx.files.upload_dir(host_work, GUEST_WORK)
        envs: list[Environment] = [Host(host_work), Machine(sbx)]
        if gvisor is None:
            progress("work: a gVisor container over this host's root, read-only (not measured)")
            shutil.copytree(host_work, gvisor_work, symlinks=True)
            try:
                peer = HostRootGVisor(gvisor_work)
                peer.start()
                envs.append(peer)
            except (PeerUnavailable, OSError, subprocess.SubprocessError) as e:
                gvisor = f"could not start: {e}"
        report.peers.setdefault(GVisor.name, gvisor or "ok")
        seconds: dict[str, dict[str, list[float]]] = {step.name: {env.name: [] for env in envs}
                                                      for step in plan}
        failed: dict[str, str] = {}  # step -> why gVisor could not run it
        for r in range(rounds):
            progress(f"work: round {r + 1} of {rounds}: {len(plan)} steps on "
                     + ", ".join(env.name for env in envs))
            for step in plan:
                script = step.script()
                for env in envs:
                    if env is peer and step.name in failed:
                        continue
                    try:
                        seconds[step.name][env.name].append(env.run(script))
                    except StepFailed as e:
                        if env is not peer:
                            raise StepFailed(f"step {step.name} on {env.name}: {e}") from e
                        failed[step.name] = str(e)
    finally:
        if peer is not None:
            peer.close()
        if sbx is not None:
            sbx.delete()
        shutil.rmtree(folder, ignore_errors=True)
    _add_rows(report, plan, seconds, failed, gvisor)


def _ratios(times: list[float], host: list[float]) -> list[float]:
    return [t / h for t, h in zip(times, host, strict=True)]


def _add_rows(report: Report, plan: list[Step], seconds: dict[str, dict[str, list[float]]],
              failed: dict[str, str], gvisor: str | None) -> None:
    ours, theirs = [], []
    for step in plan:
        times = seconds[step.name]
        host = times["host"]
        metric = report.add(f"{PREFIX}{step.name}_x",
                            f"work step {step.name}: {step.what}, machine time / host time", "x",
                            _ratios(times["rewind"], host), target=step.target)
        metric.seconds = {"host": host, "rewind": times["rewind"]}
        ours.append(metric.median)
        why = gvisor or failed.get(step.name)
        if why:
            metric.peers[GVisor.name] = why
        else:
            metric.seconds[GVisor.name] = times[GVisor.name]
            metric.peers[GVisor.name] = _ratios(times[GVisor.name], host)
            theirs.append(statistics.median(metric.peers[GVisor.name]))
    median = report.add(MEDIAN_KEY, "work steps: the median over the steps of each step's "
                        "median ratio to the host", "x", ours, target=MEDIAN_TARGET)
    median.peers[GVisor.name] = gvisor or (
        f"not every step ran: {', '.join(sorted(failed))}" if failed else theirs)
