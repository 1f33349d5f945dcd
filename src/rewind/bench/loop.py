"""The loop an agent runs, with no idle time between steps: work, checkpoint, a destructive
step, restore, exec, a failed try, a passed try and a guarded git step, round after round.
Each operation alone (ours.py) is measured on an idle machine after the previous round's
background work has finished; here background commits and first checkpoints land on the
next step, as they do for an agent."""

from __future__ import annotations

import os
import statistics
import threading
import time
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
    "restore_to_exec_s": ("restore in place until the first exec", 0.5),
    "failed_try_s": ("failed `try_in_copy`", 1.5),
    "passed_try_s": ("passed `try_in_copy`", 2.0),
    "guarded_git_s": ("guarded project edit (git tier)", None),
}


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
    result = LoopResult()
    Engine(home).settle()  # the loop's background work is its own
    pending.commit_stats_path(home).unlink(missing_ok=True)
    sbx = Sandbox.create("loop", home=home)
    shm = ShmPeak()
    try:
        sbx.exec(f"mkdir -p {PROJECT} && cd {PROJECT} && git init -q && echo start > notes.txt && "
                 f"git add . && git -c user.name=b -c user.email=b@b commit -qm init", check=True)
        for i in range(rounds):
            progress(f"agent loop: round {i + 1} of {rounds}")
            times: dict[str, float] = {}
            sbx.exec(f"mkdir -p /root/work && head -c 1M /dev/urandom > /root/work/r{i}", check=True)
            started = time.perf_counter()
            point = sbx.checkpoint()
            times["checkpoint_s"] = time.perf_counter() - started
            sbx.exec("rm -rf /root/work", check=True)
            started = time.perf_counter()
            sbx.restore(point.id)
            back = sbx.exec(f"test -f /root/work/r{i}")
            times["restore_to_exec_s"] = time.perf_counter() - started
            if not back.ok:
                raise RuntimeError(f"round {i}: the restore did not bring the work back")
            failed = try_in_copy(sbx, "rm -rf /root/work && false")
            times["failed_try_s"] = failed.seconds
            passed = try_in_copy(sbx, f"echo ok > /root/work/try{i}", verify=f"test -f /root/work/try{i}")
            times["passed_try_s"] = passed.seconds
            if failed.passed or not passed.passed:
                raise RuntimeError(f"round {i}: tries gave {failed.reason!r} and {passed.reason!r}")
            times["guarded_git_s"] = timed(lambda n=i: sbx.guarded(f"echo {n} >> notes.txt", cwd=PROJECT))
            result.rounds.append(times)
        progress("agent loop: waiting for the background work to finish")
        sbx._engine.settle()
    finally:
        result.shm_peak_mib = shm.stop()
        sbx.delete()
    result.background_cpu_s = [entry.cpu_s for entry in pending.read_commit_stats(home)]
    return result


def drift(samples: list[float]) -> float | None:
    """The median of the last five rounds over that of the first five; None for under ten rounds."""
    if len(samples) < 10:
        return None
    return statistics.median(samples[-5:]) / statistics.median(samples[:5])


def agent_loop(home: Home, report: Report, rounds: int, progress: Progress) -> None:
    """Add the loop's figures to `report`: each step's median over all rounds, the last five
    rounds against the first five, background CPU per point and peak /dev/shm use."""
    loop = run_loop(home, rounds, progress)
    for key in STEPS:
        what, target = WHAT[key]
        samples = [r[key] for r in loop.rounds]
        report.add(f"loop_{key}", f"in the agent loop: {what}", "s", samples, target=target)
        if (ratio := drift(samples)) is not None:
            report.add(f"loop_{key}_drift", f"in the agent loop: {what}, last five rounds / first five", "x",
                       [ratio], target=1.2)
    report.add("loop_background_cpu_s", "in the agent loop: background CPU per point stored", "s",
               loop.background_cpu_s, target=0.2)
    report.add("loop_shm_peak_mib", "in the agent loop: peak /dev/shm use above the start", "MiB",
               [loop.shm_peak_mib])


def main() -> None:
    """`python -m rewind.bench.loop [ROUNDS]`: the loop alone, each round's times printed."""
    import sys
    import tempfile

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    with tempfile.TemporaryDirectory(prefix="rewind-loop-") as tmp:
        home = Home(root=Path(tmp), images=Home.from_env().images)
        try:
            loop = run_loop(home, rounds, print)
        finally:
            close_home(home)
    for i, times in enumerate(loop.rounds):
        print(i + 1, "  ".join(f"{k}={v:.3f}" for k, v in times.items()))
    for key in STEPS:
        samples = [r[key] for r in loop.rounds]
        ratio = drift(samples)
        shown = "" if ratio is None else f"  drift {ratio:.2f}x"
        print(f"median {key}={statistics.median(samples):.3f}{shown}")
    cpu = loop.background_cpu_s
    print(f"background cpu per point: median {statistics.median(cpu) if cpu else 0:.2f} s over {len(cpu)};"
          f" shm peak {loop.shm_peak_mib:.0f} MiB")


if __name__ == "__main__":
    main()
