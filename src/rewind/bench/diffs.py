"""What `diff` costs: between two points 1 MiB and 100 MiB of file changes apart (read on the
host from the layers that differ), against the machine now, and what the guest's flush adds
to a checkpoint call. `scripts/bench-diff` runs this section alone (main)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from rewind.bench.model import Report
from rewind.bench.ours import Progress, close_home, timed
from rewind.engine import gueststate
from rewind.guard.trial import try_in_copy
from rewind.home import Home
from rewind.sandbox import Sandbox

SIZES_MIB = (1, 100)


def _write(sbx: Sandbox, mib: int, tag: str) -> None:
    """`mib` MiB of changes in files of 1 MiB, in a folder of their own."""
    sbx.exec(f"mkdir -p /root/d-{tag} && for i in $(seq {mib}); do "
             f"head -c 1M /dev/urandom > /root/d-{tag}/f$i; done", check=True, timeout=600)


def diff_times(sbx: Sandbox, report: Report, rounds: int, progress: Progress, quick: bool = False) -> None:
    progress("diff: the first one in a home (it indexes the image's directories)")
    sbx.checkpoint()
    report.add("diff_first_s", "first diff in a home: the image's directories are indexed once", "s",
               [timed(lambda: sbx.diff())])
    for mib in SIZES_MIB[:1] if quick else SIZES_MIB:
        progress(f"diff: two points {mib} MiB of changes apart")
        samples = []
        for r in range(rounds if mib == 1 else max(1, rounds // 2)):
            a = sbx.checkpoint()
            _write(sbx, mib, f"{mib}-{r}")
            b = sbx.checkpoint()
            samples.append(timed(lambda a=a, b=b: sbx.diff(a, b)))
        report.add(f"diff_points_{mib}mib_s", f"diff of two points {mib} MiB of file changes apart", "s",
                   samples, target=1.0 if mib == 1 else None)
    progress("diff: a point against the machine now, 1 MiB of changes apart")
    live = []
    for r in range(rounds):
        sbx.checkpoint()
        _write(sbx, 1, f"live-{r}")
        live.append(timed(lambda: sbx.diff()))
    report.add("diff_live_1mib_s", "diff of the last point against the machine now, 1 MiB apart", "s", live)


def flush_cost(sbx: Sandbox, report: Report, rounds: int, progress: Progress) -> None:
    """What a checkpoint call pays for its guest's flush, right after 1 MiB was written: the
    flush alone (as the call makes it), and the whole call."""
    progress("diff: what the guest's flush adds to a checkpoint call")
    flushes, calls = [], []
    for r in range(rounds):
        _write(sbx, 1, f"flush-{r}")
        flushes.append(timed(lambda: gueststate.flush(sbx._machine.path)) * 1000)
        _write(sbx, 1, f"call-{r}")
        calls.append(timed(sbx.checkpoint))
        sbx._machine.settle()
    report.add("checkpoint_flush_ms", "the guest's flush and process list, just after 1 MiB was written",
               "ms", flushes)
    report.add("checkpoint_call_after_write_s",
               "checkpoint call just after 1 MiB was written (flush included)", "s", calls)


def try_cost(sbx: Sandbox, report: Report, rounds: int, progress: Progress) -> None:
    """A failed try of a 1 MiB step, with the copy's diff (the default) and without."""
    progress("diff: what the copy's diff adds to a try")
    engine, store = sbx._engine, sbx._store

    def attempt(with_diff: bool) -> None:
        try_in_copy(engine, sbx._machine, store, "head -c 1M /dev/urandom > /root/t && false", None,
                    diff=with_diff)
    for with_diff in (True, False):
        samples = [timed(lambda: attempt(with_diff)) for _ in range(rounds)]  # noqa: B023 (called at once)
        report.add(f"try_{'with' if with_diff else 'without'}_diff_s",
                   f"a failed try of a 1 MiB step, {'with' if with_diff else 'without'} the copy's diff", "s",
                   samples)


def main(args: list[str]) -> None:
    rounds = int(args[0]) if args else 5
    with tempfile.TemporaryDirectory(prefix="rewind-bench-diff-") as tmp:
        home = Home(root=Path(tmp), images=Home.from_env().images)
        report = Report(machine={}, quick=False, rounds=rounds)
        sbx = Sandbox.create("bench-diff", home=home)
        try:
            sbx.checkpoint()
            sbx.exec("true")
            progress = lambda step: print(f"  {step}", file=sys.stderr, flush=True)  # noqa: E731
            flush_cost(sbx, report, rounds, progress)
            diff_times(sbx, report, rounds, progress)
            try_cost(sbx, report, rounds, progress)
        finally:
            close_home(home)
    for m in report.metrics:
        samples = " ".join(f"{s:.3f}" for s in m.samples)
        print(f"{m.key:28} median {m.median:8.3f} {m.unit:3}  ({samples})  {m.what}")

