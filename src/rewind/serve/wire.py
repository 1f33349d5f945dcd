"""What travels over HTTP and MCP: results as JSON and back, errors as problem+json and back.

The server side turns the SDK's typed results into JSON with the to_json the CLI already
prints; the client side (Sandbox.connect) rebuilds the same dataclasses from it, so code
written against the local SDK reads the same fields. Errors keep their class: the problem's
`title` is the class name and the client raises that class again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rewind import errors
from rewind.errors import NeedsNewerQemu
from rewind.guard.classify import Decision, Kind
from rewind.results import Checkpoint, Diff, ExecResult, GuardedResult, MachineInfo, Outcome, Refused, StepRun
from rewind.store import errors as store_errors

PROBLEM_TYPE = "application/problem+json"

# The status of an error is that of the first class in its MRO found here, so a subclass
# (StoreBusy is a Busy) answers like its family unless it is listed itself.
STATUS: dict[type[BaseException], int] = {
    store_errors.BadExport: 400,
    store_errors.UntrustedCheckpoint: 403,
    errors.InvalidArgument: 400,
    Refused: 403,
    errors.NotFound: 404,
    errors.AlreadyExists: 409,
    errors.Busy: 409,
    errors.MachineNotRunning: 409,
    errors.PortError: 409,
    NeedsNewerQemu: 409,
    errors.OverBudget: 429,
    errors.GuestFileError: 422,
    errors.AgentError: 502,
    errors.ImageError: 503,
    errors.RewindError: 500,
}

# Every error class a server may name, so the client can raise the same one.
ERROR_CLASSES: dict[str, type[errors.RewindError]] = {
    cls.__name__: cls
    for module in (errors, store_errors)
    for cls in vars(module).values()
    if isinstance(cls, type) and issubclass(cls, errors.RewindError)
} | {"Refused": Refused}


def status_of(exc: BaseException) -> int:
    return next((STATUS[c] for c in type(exc).__mro__ if c in STATUS), 500)


def problem(exc: errors.RewindError) -> dict[str, Any]:
    """RFC 9457 problem details for a typed error; `type` and `title` name its class."""
    name = type(exc).__name__
    body: dict[str, Any] = {"type": f"/errors/{name}", "title": name, "status": status_of(exc),
                            "detail": str(exc)}
    if isinstance(exc, Refused):
        body["decision"] = exc.decision.to_json()
        body["attempted"] = list(exc.attempted)
    return body


def internal_problem(exc: BaseException) -> dict[str, Any]:
    """Problem details for a failure that is no RewindError: a bug of ours, or the host failing."""
    return {"type": "/errors/InternalError", "title": "InternalError", "status": 500,
            "detail": f"{type(exc).__name__}: {exc}"}


def error_from(body: dict[str, Any], status: int) -> errors.RewindError:
    """The exception a problem document describes (RewindError if its class is unknown here)."""
    cls = ERROR_CLASSES.get(str(body.get("title")), errors.RewindError)
    detail = str(body.get("detail") or f"HTTP {status}")
    exc = cls.__new__(cls)  # some classes take extra arguments; they are set below
    errors.RewindError.__init__(exc, detail)
    if isinstance(exc, Refused):
        exc.decision = decision_from(body.get("decision") or {"kind": "external", "reasons": []})
        exc.attempted = tuple(body.get("attempted") or ())
    return exc


# ---- results ----

def exec_json(r: ExecResult) -> dict[str, Any]:
    return {**dataclasses.asdict(r), "ok": r.ok}


def exec_from(d: dict[str, Any]) -> ExecResult:
    return ExecResult(**{f.name: d[f.name] for f in dataclasses.fields(ExecResult) if f.name in d})


def checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    return dataclasses.asdict(c)


def checkpoint_from(d: dict[str, Any]) -> Checkpoint:
    return Checkpoint(**{f.name: d[f.name] for f in dataclasses.fields(Checkpoint) if f.name in d})


def info_json(i: MachineInfo) -> dict[str, Any]:
    return dataclasses.asdict(i)


def info_from(d: dict[str, Any]) -> MachineInfo:
    return MachineInfo(**{f.name: d[f.name] for f in dataclasses.fields(MachineInfo) if f.name in d})


def decision_from(d: dict[str, Any]) -> Decision:
    return Decision(Kind(d["kind"]), tuple(d["reasons"]), tuple(d.get("decided_by", ())),
                    tuple(d.get("unknown_programs", ())))


def _run_from(d: dict[str, Any] | None) -> StepRun | None:
    if d is None:
        return None
    result = None if d["exit_code"] is None else exec_from(d)
    return StepRun(d["command"], result, d["error"])


def outcome_from(d: dict[str, Any]) -> Outcome:
    step = _run_from(d["step"])
    assert step is not None
    return Outcome(kept=d["kept"], passed=d["passed"], log=d["log"], reason=d["reason"], step=step,
                   verify=_run_from(d["verify"]), copy_name=d["copy"], seconds=d["seconds"],
                   attempted=tuple(d.get("attempted", ())),
                   diff=None if d.get("diff") is None else Diff.from_json(d["diff"]))


def guarded_from(d: dict[str, Any]) -> GuardedResult:
    def res(r: dict[str, Any] | None) -> ExecResult | None:
        return None if r is None else exec_from(r)
    return GuardedResult(kind=d["kind"], path=d["path"], reasons=d["reasons"], result=res(d["result"]),
                         verify=res(d["verify"]), undone=d["undone"], note=d["note"], seconds=d["seconds"],
                         outcome=None if d["outcome"] is None else outcome_from(d["outcome"]),
                         checkpoint=d["checkpoint"])
