"""A full host says so: the daemon's budget of machines and guest memory.

Each start through the daemon (create, create-from, fork, start) is admitted only if the
machines running in its home, with those still being started, stay within the budget;
otherwise it is refused at once with OverBudget (HTTP 429 with Retry-After), before any QEMU
starts: a full host answers, instead of hanging, failing half way or meeting the OOM killer.
Starts admitted together are counted as they run, so concurrent ones cannot pass it together.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from rewind.engine.engine import Engine
from rewind.errors import InvalidArgument, OverBudget
from rewind.home import Home

MACHINES_PER_CORE = 4  # under emulation an idle guest costs little CPU; a busy one a core
MEMORY_SHARE = 0.75  # of the host's memory, for guests: QEMU, the store and the host need the rest
RETRY_AFTER_S = 10


@dataclass
class Budget:
    machines: int
    memory_mib: int

    @classmethod
    def for_host(cls) -> Budget:
        host_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
        return cls(machines=MACHINES_PER_CORE * (os.cpu_count() or 1),
                   memory_mib=int(host_mib * MEMORY_SHARE))

    def to_json(self) -> dict:
        return asdict(self)

    def change(self, machines: int | None = None, memory_mib: int | None = None) -> None:
        for what, value in (("machines", machines), ("memory_mib", memory_mib)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidArgument(f"the budget's {what} must be a whole number of at least 1 "
                                      f"(got {value!r})")
        self.machines = machines or self.machines
        self.memory_mib = memory_mib or self.memory_mib


class Admission:
    """Admits starts within `budget`, counting the home's running machines and the starts
    under way."""

    def __init__(self, home: Home, budget: Budget) -> None:
        self.home, self.budget = home, budget
        self._lock = threading.Lock()
        self._starting = [0, 0]  # machines, MiB

    @contextmanager
    def admit(self, machines: int, memory_mib: int) -> Iterator[None]:
        """Hold room for `machines` more of `memory_mib` MiB in all while the block starts them."""
        with self._lock:
            running = [m for m in Engine(self.home).list() if m.status() in ("running", "creating")]
            count = len(running) + self._starting[0] + machines
            used = sum(m.record.memory_mib for m in running) + self._starting[1] + memory_mib
            if count > self.budget.machines:
                raise OverBudget(f"this daemon runs at most {self.budget.machines} machines and would run "
                                 f"{count}: stop or delete some, or retry later", RETRY_AFTER_S)
            if used > self.budget.memory_mib:
                raise OverBudget(f"this daemon gives guests at most {self.budget.memory_mib} MiB and would "
                                 f"give {used} MiB: stop or delete some, or retry later", RETRY_AFTER_S)
            self._starting = [self._starting[0] + machines, self._starting[1] + memory_mib]
        try:
            yield
        finally:
            with self._lock:
                self._starting = [self._starting[0] - machines, self._starting[1] - memory_mib]
