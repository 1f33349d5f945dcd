"""Benchmark of checkpoints (issue 3) on the default machine (512 MiB, 2 vCPUs).

    .venv/bin/python bench/checkpoints.py [--rounds N] [--json FILE]

Reports: guest pause during a checkpoint (QEMU's STOP to RESUME events), time for the
checkpoint call to return, restore in place until the first exec returns (its own
checkpoint of the state it leaves included), branch until the child's first exec (and
the source's pause), store size after 1 and after 10 checkpoints 1 MiB of file changes
apart, and host memory added by each idle branch (the drop in MemAvailable).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from common import arguments, report, scratch_home, summary

from rewind import Sandbox
from rewind.store import Store


def du_mib(path: Path) -> float:
    du = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True)
    return int(du.stdout.split()[0]) / 1024


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable")


def main() -> None:
    args = arguments(__doc__)
    with scratch_home() as home:
        sbx = Sandbox.create("bench", home=home)
        sbx.exec("head -c 64M /dev/urandom > /root/ballast")  # some memory and disk in use
        first = sbx.checkpoint()
        store = Store.open(home.store)
        one = du_mib(home.store)
        pauses, calls, restores, branches, branch_pauses = [], [], [], [], []
        for i in range(10):
            sbx.exec(f"head -c 1M /dev/urandom > /root/change-{i}")
            t = time.perf_counter()
            point = sbx.checkpoint()
            calls.append(time.perf_counter() - t)
            pauses.append(store.get(point.id).meta["pause_s"])
        eleven = du_mib(home.store)
        for _ in range(args.rounds):
            t = time.perf_counter()
            sbx.restore("~1")
            sbx.exec(["true"])
            restores.append(time.perf_counter() - t)
        available = mem_available_mib()
        for i in range(args.rounds):
            t = time.perf_counter()
            child = sbx.fork(f"child-{i}")
            child.exec(["true"])
            branches.append(time.perf_counter() - t)
            branch_pauses.append(store.get(child._machine.record.parent).meta["pause_s"])
        time.sleep(5)
        per_branch = (available - mem_available_mib()) / args.rounds
    report({
        "pause_ms": summary([p * 1000 for p in pauses]),
        "checkpoint_call_s": summary(calls),
        "restore_to_first_exec_s": summary(restores),
        "branch_to_child_exec_s": summary(branches),
        "branch_source_pause_ms": summary([p * 1000 for p in branch_pauses]),
        "store_one_checkpoint_mib": round(one, 1),
        "store_eleven_checkpoints_mib": round(eleven, 1),
        "store_first_checkpoint_own_mib": round(first.own_bytes / (1 << 20), 1),
        "memory_per_idle_branch_mib": round(per_branch, 1),
    }, args.json)


if __name__ == "__main__":
    main()
