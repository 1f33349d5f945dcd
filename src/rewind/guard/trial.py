"""try_in_copy: run a risky step in a live copy of the machine, keep it only if a check passes.

The copy is a fork (it shares the machine's memory and disk as of now and stores
only what it changes), by default cut off from the network. If the step and then
the check exit 0 in the copy, the copy takes over the machine's name, identity and
network rules and the original is deleted; otherwise the copy is deleted and the
original never saw the step. Either way the outcome carries both outputs.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import TYPE_CHECKING

from rewind.engine.agent import exec_deadline
from rewind.engine.engine import Engine
from rewind.engine.machine import Machine
from rewind.engine.network.netrules import NetworkRules
from rewind.errors import InvalidArgument, RewindError
from rewind.results import TRY_TIMEOUT, Outcome, StepRun

if TYPE_CHECKING:
    from rewind.results import Diff
    from rewind.store import Store


def run_in(machine: Machine, command: str, cwd: str | None, timeout: float) -> StepRun:
    """Run `command` under bash in `machine`; a guest that dies or loses its agent is an
    outcome to report, not an error of ours."""
    deadline = exec_deadline(timeout)
    try:
        with machine.agent(deadline=deadline) as agent:
            return StepRun(command, agent.exec(["bash", "-c", command], cwd=cwd, timeout=timeout,
                                               deadline=deadline))
    except RewindError as e:
        return StepRun(command, None, str(e))


def _attempts(copy: Machine) -> tuple[str, ...]:
    """What the copy tried to reach; nothing known if the step killed it (its filter ends with
    its QEMU), and then it is not kept anyway: the step failed."""
    try:
        return tuple(copy.network_attempts())
    except RewindError:
        return ()


def _diff(engine: Engine, store: Store, copy: Machine) -> Diff | None:
    """The copy against the moment it was made; None if it cannot be read (the step killed it)."""
    from rewind.engine.changes.diff import diff

    try:
        copy.reload()
        return diff(engine, store, copy.record.parent, copy)
    except RewindError as e:
        logging.getLogger("rewind").warning("the copy's changes could not be read: %s", e)
        return None


def _log(*runs: StepRun | None) -> str:
    parts = []
    for run in runs:
        if run is None:
            continue
        if run.result is not None:
            parts += [run.result.stdout, run.result.stderr]
        if run.error is not None:
            parts.append(f"[rewind] {run.error}\n")
    return "".join(parts)


def try_in_copy(engine: Engine, machine: Machine, store: Store, step: str, verify: str | None,
                offline: bool = True, cwd: str | None = None,
                timeout: float = TRY_TIMEOUT, watch: bool = False, diff: bool = True,
                network: NetworkRules | None = None) -> Outcome:
    """Run `step` then `verify` (None: the step's own exit code decides) in a copy of `machine`.
    `watch`: the copy is not kept if it tried to reach anything its rules refused (the guard,
    for programs it does not know); Outcome.attempted says what. `diff`: Outcome.diff says
    what the step changed in the copy (it costs a flush of the copy and a read of its disk).
    `network`: the copy's rules when not `offline` (default: the machine's own)."""
    from rewind.guard.classify import checked_command  # its parser: 40 ms to load

    step = checked_command(step, "the step")
    if verify is not None:
        verify = checked_command(verify, "the verify command")
    if not timeout > 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds (got {timeout})")
    started = time.monotonic()
    copy_name = f"{machine.name[:40]}.try-{secrets.token_hex(3)}"
    rules = NetworkRules(internet=False) if offline else network or machine.network
    from rewind.engine import timeline  # the capture and commit code: 30-44 ms to import

    # The caller waits for the copy: its memory image is made before fork returns, which is
    # quicker than a background capture (see snapshot.capture's `held`).
    [copy] = timeline.fork(engine, machine, store, [copy_name],
                           labels={"role": "trial-step", "trial-of": machine.name},
                           network=rules, hold_source=True)
    try:
        ran = run_in(copy, step, cwd, timeout)
        checked = run_in(copy, verify, cwd, timeout) if ran.ok and verify is not None else None
        passed = ran.ok and (checked is None or checked.ok)
        attempted = _attempts(copy) if watch else ()
        changes = _diff(engine, store, copy) if diff else None
        if passed and not attempted:
            engine.replace(machine, copy)
            reason = "step passed" + (" and verify passed" if checked else "") + "; the copy is kept"
        else:
            copy.delete()
            failed = f"it tried to reach outside the machine ({', '.join(attempted)})" if attempted \
                else ran.describe("step") if not ran.ok else checked.describe("verify")  # type: ignore[union-attr]
            reason = f"{failed}; the original is kept, untouched"
    except BaseException:
        copy.delete()
        raise
    kept = passed and not attempted
    return Outcome(kept="copy" if kept else "original", passed=passed, log=_log(ran, checked),
                   reason=reason, step=ran, verify=checked, copy_name=copy_name,
                   seconds=time.monotonic() - started, attempted=attempted, diff=changes)
