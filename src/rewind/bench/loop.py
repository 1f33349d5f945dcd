"""The loop an agent runs, with no idle time between steps: work, checkpoint, a destructive
step, restore, exec, a failed try, a passed try and a guarded git step, round after round.
Each operation alone (ours.py) is measured on an idle machine after the previous round's
background work has finished; here background commits and first checkpoints land on the
next step, as they do for an agent.

The loop with real steps does the same with steps that do real work: each round copies a
30 MiB library tree of 1,390 files (as an install writes), checkpoints, deletes the work,
restores and checks it, then tries a step that deletes a system folder and fails. Its
restores come right after a step that wrote much, its tries right after a restore."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rewind.bench.model import Report
from rewind.bench.ours import PROJECT, Progress, close_home, timed
from rewind.engine import pending
from rewind.engine.engine import Engine
from rewind.home import Home
from rewind.sandbox import Sandbox, try_in_copy

STEPS = ("checkpoint_s", "restore_to_exec_s", "failed_try_s", "passed_try_s", "guarded_git_s")
WHAT = {
    "checkpoint_s": ("checkpoint call", 0.15),
    "restore_to_exec_s": ("restore in place until the first exec", 0.4),
    "failed_try_s": ("failed `try_in_copy`", 1.0),
    "passed_try_s": ("passed `try_in_copy`", 2.0),
    "guarded_git_s": ("guarded project edit (git tier)", None),
}
AGENTS_WORK = "work_s"  # the agent's own step, timed to show what it costs, held to no target
REAL_STEPS = (AGENTS_WORK, "checkpoint_s", "restore_to_exec_s", "failed_try_s")
REAL_WHAT = {
    AGENTS_WORK: ("the step: copy a 30 MiB library tree", None),
    "checkpoint_s": ("checkpoint call right after it", 0.15),
    "restore_to_exec_s": ("restore in place until the first exec", 0.4),
    "failed_try_s": ("failed `try_in_copy` deleting a system folder", 1.0),
}
REAL_WORK = "rm -rf /root/work && mkdir -p /root/work && cp -a /usr/lib/python3.11 /root/work/r{i}"
REAL_CHECK = "test -f /root/work/r{i}/json/__init__.py"
REAL_BREAK = "rm -rf /usr/lib/python3.11/json && python3 -c 'import json'"
DRIFT_TARGET = 1.1  # the last five rounds over the first five


class ShmPeak:
    """Samples how much of /dev/shm is used, in a thread, and keeps the peak above the start."""

    def __init__(self, interval: float = 0.05) -> None:
        self.start = self.used()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    @staticmethod
    def used() -> int:
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, self.used())

    def stop(self) -> float:
        """The peak added over the start, in MiB."""
        self._stop.set()
        self._thread.join()
        return (self.peak - self.start) / (1 << 20)


@dataclass
class LoopResult:
    rounds: list[dict[str, float]] = field(default_factory=list)
    background_cpu_s: list[float] = field(default_factory=list)  # per point stored
    shm_peak_mib: float = 0.0


def run_loop(home: Home, rounds: int, progress: Progress) -> LoopResult:
    """`rounds` rounds of the agent's loop on one new machine; the machine is deleted after."""
    return _run(home, "loop", "agent loop", rounds, progress, _agent_round, setup=_project)


def run_real_loop(home: Home, rounds: int, progress: Progress) -> LoopResult:
    """`rounds` rounds of the loop with real steps (see the module's text) on one new machine;
    the machine is deleted after."""
    return _run(home, "loop-real", "agent loop with real steps", rounds, progress, _real_round)


def _run(home: Home, name: str, label: str, rounds: int, progress: Progress,
         one_round: Callable[[Sandbox, int], dict[str, float]],
         setup: Callable[[Sandbox], None] = lambda _: None) -> LoopResult:
    result = LoopResult()
    Engine(home).settle()  # the loop's background work is its own
    pending.commit_stats_path(home).unlink(missing_ok=True)
    sbx = Sandbox.create(name, home=home)
    shm = ShmPeak()
    try:
        setup(sbx)
        for i in range(rounds):
            progress(f"{label}: round {i + 1} of {rounds}")
            result.rounds.append(one_round(sbx, i))
        progress(f"{label}: waiting for the background work to finish")
        sbx._engine.settle()
    finally:
        result.shm_peak_mib = shm.stop()
        sbx.delete()
    result.background_cpu_s = [entry.cpu_s for entry in pending.read_commit_stats(home)]
    return result


def _project(sbx: Sandbox) -> None:
    sbx.exec(f"mkdir -p {PROJECT} && cd {PROJECT} && git init -q && echo start > notes.txt && "
             f"git add . && git -c user.name=b -c user.email=b@b commit -qm init", check=True)


def _agent_round(sbx: Sandbox, i: int) -> dict[str, float]:
    sbx.exec(f"mkdir -p /root/work && head -c 1M /dev/urandom > /root/work/r{i}", check=True)
    times = _undo(sbx, i, f"test -f /root/work/r{i}")
    failed = try_in_copy(sbx, "rm -rf /root/work && false")
    times["failed_try_s"] = failed.seconds
    passed = try_in_copy(sbx, f"echo ok > /root/work/try{i}", verify=f"test -f /root/work/try{i}")
    times["passed_try_s"] = passed.seconds
    if failed.passed or not passed.passed:
        raise RuntimeError(f"round {i}: tries gave {failed.reason!r} and {passed.reason!r}")
    times["guarded_git_s"] = timed(lambda: sbx.guarded(f"echo {i} >> notes.txt", cwd=PROJECT))
    return times


def _undo(sbx: Sandbox, i: int, check: str) -> dict[str, float]:
    """Checkpoint, delete the work, restore and run `check`: the checkpoint call's time and
    the restore's until `check` answered."""
    started = time.perf_counter()
    point = sbx.checkpoint()
    times = {"checkpoint_s": time.perf_counter() - started}
    sbx.exec("rm -rf /root/work", check=True)
    started = time.perf_counter()
    sbx.restore(point.id)
    back = sbx.exec(check)
    times["restore_to_exec_s"] = time.perf_counter() - started
    if not back.ok:
        raise RuntimeError(f"round {i}: the restore did not bring the work back")
    return times


def _real_round(sbx: Sandbox, i: int) -> dict[str, float]:
    work = timed(lambda: sbx.exec(REAL_WORK.format(i=i), check=True, timeout=600))
    times = {AGENTS_WORK: work, **_undo(sbx, i, REAL_CHECK.format(i=i))}
    failed = try_in_copy(sbx, REAL_BREAK)
    times["failed_try_s"] = failed.seconds
    if failed.passed or not sbx.exec("python3 -c 'import json'").ok:
        raise RuntimeError(f"round {i}: the breaking step was kept ({failed.reason!r})")
    return times


def drift(samples: list[float]) -> float | None:
    """The median of the last five rounds over that of the first five; None for under ten rounds."""
    if len(samples) < 10:
        return None
    return statistics.median(samples[-5:]) / statistics.median(samples[:5])


def agent_loop(home: Home, report: Report, rounds: int, progress: Progress) -> None:
    """Add both loops' figures to `report`: each step's median over all rounds, the last five
    rounds against the first five, background CPU per point and peak /dev/shm use."""
    _add(report, "loop", "in the agent loop", run_loop(home, rounds, progress), STEPS, WHAT,
         background_target=0.2)
    _add(report, "real_loop", "in the loop with real steps", run_real_loop(home, rounds, progress),
         REAL_STEPS, REAL_WHAT, background_target=None)


def _add(report: Report, prefix: str, where: str, loop: LoopResult, steps: tuple[str, ...],
         what_of: dict[str, tuple[str, float | None]], background_target: float | None) -> None:
    for key in steps:
        what, target = what_of[key]
        samples = [r[key] for r in loop.rounds]
        report.add(f"{prefix}_{key}", f"{where}: {what}", "s", samples, target=target)
        if (ratio := drift(samples)) is not None:
            report.add(f"{prefix}_{key}_drift", f"{where}: {what}, last five rounds / first five", "x",
                       [ratio], target=None if key == AGENTS_WORK else DRIFT_TARGET)
    report.add(f"{prefix}_background_cpu_s", f"{where}: background CPU per point stored", "s",
               loop.background_cpu_s, target=background_target)
    report.add(f"{prefix}_shm_peak_mib", f"{where}: peak /dev/shm use above the start", "MiB",
               [loop.shm_peak_mib])


def main() -> None:
    """`python -m rewind.bench.loop [ROUNDS] [--real]`: the loop alone (or the one with real
    steps), each round's times printed."""
    import sys
    import tempfile

    real = "--real" in sys.argv[1:]
    numbers = [arg for arg in sys.argv[1:] if arg != "--real"]
    rounds = int(numbers[0]) if numbers else 6
    with tempfile.TemporaryDirectory(prefix="rewind-loop-") as tmp:
        home = Home(root=Path(tmp), images=Home.from_env().images)
        try:
            loop = (run_real_loop if real else run_loop)(home, rounds, print)
        finally:
            close_home(home)
    for i, times in enumerate(loop.rounds):
        print(i + 1, "  ".join(f"{k}={v:.3f}" for k, v in times.items()))
    for key in REAL_STEPS if real else STEPS:
        samples = [r[key] for r in loop.rounds]
        ratio = drift(samples)
        shown = "" if ratio is None else f"  drift {ratio:.2f}x"
        print(f"median {key}={statistics.median(samples):.3f}{shown}")
    cpu = loop.background_cpu_s
    print(f"background cpu per point: median {statistics.median(cpu) if cpu else 0:.2f} s over {len(cpu)};"
          f" shm peak {loop.shm_peak_mib:.0f} MiB")


if __name__ == "__main__":
    main()
