"""Benchmark of machines (issue 2): start to first exec, `exec true` round trip, idle host memory.

    .venv/bin/python bench/machines.py [--rounds N] [--json FILE]

Runs on the default machine (512 MiB, 2 vCPUs) in a temporary REWIND_HOME that
shares the built image. Prints median, min and max over the rounds.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from rewind import Home, Sandbox
from rewind.engine.machine import Engine


def host_memory_kib(pid: int) -> dict[str, int]:
    """RSS and PSS of a process (PSS splits pages shared with other machines fairly)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return {"rss_kib": fields["Rss"], "pss_kib": fields["Pss"]}


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    default = Home.from_env()
    with tempfile.TemporaryDirectory(prefix="rewind-bench-") as tmp:
        home = Home(root=Path(tmp), images=default.images)
        engine = Engine(home)
        engine.template(512, 2)  # saved once; not part of a start
        start_to_exec, exec_true, memory = [], [], []
        try:
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
        finally:
            for left in Sandbox.list(home=home):
                left.delete()
            shutil.rmtree(home.runtime, ignore_errors=True)
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "accel": engine.accel().accel,
                    "qemu": qemu.splitlines()[0], "kernel": platform.release()},
        "start_to_first_exec_s": summary(start_to_exec),
        "exec_true_s": summary(exec_true),
        "idle_rss_mib": summary([m["rss_kib"] / 1024 for m in memory]),
        "idle_pss_mib": summary([m["pss_kib"] / 1024 for m in memory]),
    }
    print(f"accel {result['machine']['accel']}, {result['machine']['qemu']}")
    for key in ("start_to_first_exec_s", "exec_true_s", "idle_rss_mib", "idle_pss_mib"):
        s = result[key]
        print(f"{key:24} median {s['median']:8.3f}  min {s['min']:8.3f}  max {s['max']:8.3f}  (n={s['n']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
