"""Concurrency soak: workers run random rewind commands at once (checkpoint, restore, branch,
rm, network, try, prune, gc, import, exec, under shared names) on three machines. A command
may be refused, with a one-line error; nothing may crash, hang or be lost. Afterwards the
home is whole (tests/invariants.py) and each machine's network rules are the last change
made to them.

The suite soaks for SUITE_S; scripts/soak (REWIND_SOAK_S=600) for ten minutes, and prints
what ran.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import rewind_cli
from invariants import assert_home_whole, ok

from rewind import Home

SOAK_ENV = "REWIND_SOAK_S"
SUITE_S = 12.0
DURATION_S = float(os.environ.get(SOAK_ENV, SUITE_S))
MACHINES = ["s0", "s1", "s2"]
WORKERS = 3
COMMAND_TIMEOUT_S = 300.0

Command = Callable[[random.Random, str, Path], list[str]]
COMMANDS: dict[str, Command] = {
    "checkpoint": lambda rng, name, tmp: ["checkpoint", name, *(["--name", f"c{rng.randrange(4)}"]
                                                                  if rng.random() < 0.3 else [])],
    "restore": lambda rng, name, tmp: ["restore", name, f"~{rng.randrange(1, 3)}"],
    "branch": lambda rng, name, tmp: ["branch", name, "copy"],  # one name for all: they collide
    "rm": lambda rng, name, tmp: ["rm", "copy"],
    "try": lambda rng, name, tmp: ["try", name, "--", "sh", "-c", f"date > /root/t; exit {rng.randrange(2)}"],
    "prune": lambda rng, name, tmp: ["prune", "--keep-last", "3"],
    "gc": lambda rng, name, tmp: ["gc"],
    "import": lambda rng, name, tmp: ["import", str(tmp / "s0.rwd")],
    "exec": lambda rng, name, tmp: ["exec", name, "--", "sh", "-c", "echo $$ > /root/e"],
}


class Soak:
    """The workers' shared tally. Network changes to one machine are made one at a time, so
    the last one to succeed is known."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ran: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.problems: list[str] = []
        self.internet = dict.fromkeys(MACHINES, True)
        self._network = {name: threading.Lock() for name in MACHINES}
        self._tally = threading.Lock()

    def worker(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until and not self.problems:
            name, verb = rng.choice(MACHINES), rng.choice([*COMMANDS, "network"])
            if verb == "network":
                with self._network[name]:
                    internet = rng.random() < 0.5
                    done = self._run(verb, ["network", name, "--internet" if internet else "--no-internet"])
                    if done.returncode == 0:
                        self.internet[name] = internet
            else:
                self._run(verb, COMMANDS[verb](rng, name, self.tmp))

    def _run(self, verb: str, argv: list[str]):  # noqa: ANN202 - a CompletedProcess
        done = rewind_cli(*argv, timeout=COMMAND_TIMEOUT_S)
        said = done.stderr.decode()
        with self._tally:
            self.ran[verb] += 1
            if "Traceback" in said or "internal error" in said:
                self.problems.append(f"`rewind {' '.join(argv)}`: {said}")
            elif done.returncode != 0:
                lines = [line for line in said.splitlines() if line.startswith("rewind: error:")]
                if lines:
                    self.refused[f"{verb}: {lines[0][len('rewind: error: '):][:60]}"] += 1
                elif not (verb == "try" and done.returncode == 1):  # (a failed step: not kept)
                    self.problems.append(f"`rewind {' '.join(argv)}` exited {done.returncode}: {said!r}")
        return done


@pytest.mark.slow  # over 30 s here
def test_concurrent_commands_lose_nothing(home: Home, tmp_path: Path) -> None:
    for name in MACHINES:
        ok("start", name)
        ok("checkpoint", name)
    ok("export", "s0", str(tmp_path / "s0.rwd"))
    soak = Soak(tmp_path)
    until = time.monotonic() + DURATION_S
    workers = [threading.Thread(target=soak.worker, args=(seed, until)) for seed in range(WORKERS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print(f"\nsoak: {DURATION_S:.0f} s, {sum(soak.ran.values())} commands: {dict(soak.ran)}; "
          f"refused: {dict(soak.refused)}")
    assert not soak.problems, soak.problems[:3]
    assert_home_whole(home, MACHINES, set())
    for name in MACHINES:
        rules = json.loads(ok("network", name, "--json"))
        assert rules["internet"] == soak.internet[name], f"{name}: {rules}, last set {soak.internet[name]}"
