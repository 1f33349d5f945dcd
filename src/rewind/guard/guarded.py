"""guarded: run an agent's command with the cheapest undo that covers what it can do.

The classifier decides the path:
- none: it only reads, so it runs as is;
- git: it changes only files git can take back, so the project folder is recorded
  by the git tier first and put back if the step (or `verify`) fails;
- fork: it can change anything, so it runs in a copy (try_in_copy) that is kept only
  if the step (and `verify`) pass;
- external: it acts outside the machine, where nothing can take it back, so it is
  refused unless the caller allows it; then the machine is checkpointed first.

Every copy is watched: its network filter refuses and records what the step reaches beyond
fetching code (guard/watch.py: package registries and code hosts the machine may reach; a
fork only because a program is in no table or rule runs offline). If it reached anything,
the copy goes and the step is treated as external: refused (Refused says where it tried to
go) or, when allowed, run on the machine after a checkpoint. So a known tool pointed
somewhere by its configuration is caught by what it does, not by what the tables guess.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rewind.engine import timeline
from rewind.engine.engine import Engine
from rewind.engine.machine import Machine
from rewind.guard import gittier
from rewind.guard.classify import Kind, classify
from rewind.guard.trial import try_in_copy
from rewind.guard.userrules import NO_RULES, UserRules
from rewind.guard.watch import watched_rules
from rewind.results import ExecResult, GuardedResult, Outcome, Refused

if TYPE_CHECKING:
    from rewind.store import Store

DEFAULT_CWD = "/root"  # the guest agent's own default working directory
TRIAL_TIMEOUT = 600.0


def guarded(engine: Engine, machine: Machine, store: Store, command: str, *, verify: str | None = None,
            allow_external: bool = False, cwd: str | None = None, timeout: float | None = None,
            offline: bool = False, rules: UserRules = NO_RULES) -> GuardedResult:
    started = time.monotonic()
    folder = cwd or DEFAULT_CWD
    decision = classify(command, cwd=folder, rules=rules)
    kind = decision.kind
    if kind is Kind.GIT and folder == "/":
        kind = Kind.FORK  # the git tier records one project, not the whole file system

    def done(path: str, step: ExecResult | None, checked: ExecResult | None, undone: bool, note: str,
             outcome: Outcome | None = None, checkpoint: str | None = None) -> GuardedResult:
        return GuardedResult(kind=decision.kind.value, path=path, reasons=list(decision.reasons), result=step,
                             verify=checked, undone=undone, note=note, seconds=time.monotonic() - started,
                             outcome=outcome, checkpoint=checkpoint)

    if kind is Kind.EXTERNAL and not allow_external:
        raise Refused(f"refused: {'; '.join(decision.reasons)}; it acts outside the machine, where no "
                      f"checkpoint can take it back (pass allow_external to run it anyway)", decision)

    watched: Outcome | None = None  # the copy the step ran in first, if it reached outside
    if kind is Kind.FORK:
        unknown = decision.unknown_programs
        offline = offline or bool(unknown)
        outcome = try_in_copy(engine, machine, store, command, verify, offline=offline, cwd=cwd,
                              timeout=timeout or TRIAL_TIMEOUT, watch=True,
                              network=None if offline else watched_rules(machine.network))
        if not outcome.attempted:
            return done("copy", outcome.step.result, outcome.verify.result if outcome.verify else None,
                        undone=outcome.kept != "copy", note=outcome.reason, outcome=outcome)
        if not allow_external:
            who = ", ".join(unknown) if unknown else "the step"
            where = "an offline copy" if offline else "its copy, which may reach only package registries"
            raise Refused(f"refused: {who} tried to reach outside the machine from {where} "
                          f"({', '.join(outcome.attempted)}); the copy was thrown away (pass "
                          f"allow_external to run it on the machine, after a checkpoint)", decision,
                          outcome.attempted)
        kind, watched = Kind.EXTERNAL, outcome  # it reaches outside: run it for real, after a checkpoint

    checkpoint = timeline.checkpoint(machine, store, labels={"auto": "before-external"}).id \
        if kind is Kind.EXTERNAL else None
    with machine.agent() as agent:  # one session: recording, step, check and putting back
        point = gittier.save(agent, folder) if kind is Kind.GIT else None
        step = agent.exec(["bash", "-c", command], cwd=cwd, timeout=timeout)
        checked = agent.exec(["bash", "-c", verify], cwd=cwd, timeout=timeout) \
            if verify is not None and step.ok else None
        passed = step.ok and (checked is None or checked.ok)
        if point is not None and not passed:
            gittier.restore(agent, point)
    if point is None:
        path = "checkpoint" if checkpoint else "direct"
        note = f"saved as {checkpoint[:12]} first" if checkpoint else "ran as is"
        if watched is not None:
            note = f"it tried to reach {', '.join(watched.attempted)} from its copy; {note}"
        return done(path, step, checked, undone=False, note=note, checkpoint=checkpoint, outcome=watched)
    if passed:
        return done("git", step, checked, undone=False, note=f"{folder} recorded first; kept")
    failed = f"step {'timed out' if step.timed_out else f'exited with {step.exit_code}'}" if not step.ok \
        else "verify failed"
    return done("git", step, checked, undone=True, note=f"{failed}; {folder} put back as it was")
