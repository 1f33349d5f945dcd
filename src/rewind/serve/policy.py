"""The operator's policy for the steps agents run through a daemon (`rewind serve`, `rewind mcp`).

An agent on HTTP or MCP may call `exec` (unguarded: the verdict only comes along) or
`guarded_exec`; under the `open` policy undo happens only if the agent asks for it. The
operator can take that choice away, for the whole daemon or per machine:

- `guarded`: every exec runs as `guarded_exec` does: the cheapest undo that covers the step,
  and a failed step leaves the machine as it was;
- `checkpoint-each`: a point is taken before every exec, which then runs as it is.

Under both, a step that acts outside the machine (the guard's `external`) is refused unless
the operator allowed external steps for that machine; an agent's own `allow_external` does not
count. The policy is set by flags when the daemon starts, never through the API it governs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rewind.errors import InvalidArgument

ALL_MACHINES = "*"


class StepPolicy(enum.StrEnum):
    OPEN = "open"
    GUARDED = "guarded"
    CHECKPOINT_EACH = "checkpoint-each"


@dataclass(frozen=True)
class Policy:
    """The daemon's policy: a default, policies of named machines, and the machines whose
    steps may act outside them (ALL_MACHINES: every one)."""

    default: StepPolicy = StepPolicy.OPEN
    machines: dict[str, StepPolicy] = field(default_factory=dict)
    external: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, default: str, per_machine: tuple[str, ...] = (), external: tuple[str, ...] = ()) -> Policy:
        """From the flags: `default`, NAME=POLICY pairs, and machine names (or *)."""
        machines = {}
        for pair in per_machine:
            name, sep, value = pair.partition("=")
            if not sep or not name:
                raise InvalidArgument(f"--machine-policy takes NAME=POLICY, not {pair!r}")
            machines[name] = _policy(value)
        return cls(_policy(default), machines, frozenset(external))

    def of(self, machine: str) -> StepPolicy:
        return self.machines.get(machine, self.default)

    def allows_external(self, machine: str) -> bool:
        return ALL_MACHINES in self.external or machine in self.external

    def to_json(self) -> dict[str, Any]:
        machines = {name: policy.value for name, policy in sorted(self.machines.items())}
        return {"default": self.default.value, "machines": machines, "allow_external": sorted(self.external)}


def _policy(value: str) -> StepPolicy:
    try:
        return StepPolicy(value)
    except ValueError as e:
        raise InvalidArgument(f"no policy {value!r}: open, guarded or checkpoint-each") from e
