"""Benchmark of machines (issue 2): start to first exec, `exec true` round trip, idle host memory.

    .venv/bin/python bench/machines.py [--rounds N] [--json FILE]

Runs on the default machine (512 MiB, 2 vCPUs) in a temporary REWIND_HOME that
shares the built image. Prints median, min and max over the rounds.
"""

from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path

from common import arguments, report, scratch_home, summary

from rewind import Sandbox
from rewind.engine.machine import Engine


def host_memory_kib(pid: int) -> dict[str, int]:
    """RSS and PSS of a process (PSS splits pages shared with other machines fairly)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return {"rss_kib": fields["Rss"], "pss_kib": fields["Pss"]}


def main() -> None:
    args = arguments(__doc__)
    with scratch_home() as home:
        start_to_exec, exec_true, memory = [], [], []
        for i in range(args.rounds):
            t0 = time.perf_counter()
            sbx = Sandbox.create(f"bench-{i}", home=home)
            sbx.exec(["true"])
            start_to_exec.append(time.perf_counter() - t0)
            for _ in range(20):
                t = time.perf_counter()
                sbx.exec(["true"])
                exec_true.append(time.perf_counter() - t)
            time.sleep(5)  # let the guest settle into idle
            memory.append(host_memory_kib(sbx.info().pid))
            sbx.delete()
        accel = Engine(home).accel().accel
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout
    report({
        "machine": {"cpu": platform.processor() or platform.machine(), "accel": accel,
                    "qemu": qemu.splitlines()[0], "kernel": platform.release()},
        "start_to_first_exec_s": summary(start_to_exec),
        "exec_true_s": summary(exec_true),
        "idle_rss_mib": summary([m["rss_kib"] / 1024 for m in memory]),
        "idle_pss_mib": summary([m["pss_kib"] / 1024 for m in memory]),
    }, args.json)


if __name__ == "__main__":
    main()
