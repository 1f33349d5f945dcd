"""Benchmark of the guard (issue 4) on the default machine (512 MiB, 2 vCPUs).

    .venv/bin/python bench/guard.py [--rounds N] [--json FILE]

Reports the cost `guarded` adds over a plain exec of the same command, for each
path: `none` (classification only), `git` (the git tier records a small project
before the step, and puts it back after a failing one) and `fork` (the step runs in
a copy that is kept). Also the classifier alone, on the development corpus.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from common import arguments, report, scratch_home, summary

from rewind import Sandbox, classify

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "commands.tsv"
REPO = "/root/project"


def timed(fn) -> float:  # noqa: ANN001 - any callable
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    args = arguments(__doc__)
    results: dict[str, object] = {}
    if CORPUS.is_file():
        commands = [line.split("\t", 1)[1] for line in CORPUS.read_text().splitlines()
                    if line and not line.startswith("#")]
        per_command = [timed(lambda c=c: classify(c, cwd=REPO)) * 1000 for c in commands * 5]
        results["classify_ms"] = summary(per_command)
    with scratch_home() as home:
        sbx = Sandbox.create("bench", home=home)
        sbx.exec(f"mkdir -p {REPO} && cd {REPO} && git init -q && for i in $(seq 50); do "
                 f"head -c 4k /dev/urandom > f$i; done && git add . && "
                 f"git -c user.name=b -c user.email=b@b commit -qm init", check=True)
        rounds = max(args.rounds, 3)
        plain_read = [timed(lambda: sbx.exec("cat f1 > /dev/null", cwd=REPO)) for _ in range(rounds)]
        guarded_read = [timed(lambda: sbx.guarded("cat f1 > /dev/null", cwd=REPO)) for _ in range(rounds)]
        plain_edit = [timed(lambda: sbx.exec("echo x >> f1", cwd=REPO)) for _ in range(rounds)]
        guarded_edit = [timed(lambda: sbx.guarded("echo x >> f1", cwd=REPO)) for _ in range(rounds)]
        guarded_failing = [timed(lambda: sbx.guarded("echo y >> f2 && false", cwd=REPO))
                           for _ in range(rounds)]
        plain_system = [timed(lambda: sbx.exec("touch /etc/bench")) for _ in range(rounds)]
        guarded_system = [timed(lambda: sbx.guarded("touch /etc/bench")) for _ in range(rounds)]
        for key, guarded, plain in (("none", guarded_read, plain_read), ("git", guarded_edit, plain_edit),
                                    ("git_failing_undone", guarded_failing, plain_edit),
                                    ("fork", guarded_system, plain_system)):
            base = statistics.median(plain)
            results[f"guarded_{key}_added_ms"] = summary([(g - base) * 1000 for g in guarded])
        results["plain_exec_ms"] = summary([p * 1000 for p in plain_read])
    report(results, args.json)


if __name__ == "__main__":
    main()
