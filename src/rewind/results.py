"""The results rewind hands back, typed: what a command did, a machine, a checkpoint, a
copied folder, a forwarded port, a diff, a try in a copy and a guarded step.

The ground floor that the engine, the SDK, the HTTP client and the faces share: it imports
nothing of rewind but the error tree and the guard's verdicts, so a client of a daemon
(rewind.serve.client) loads no engine module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rewind.errors import CommandFailed, InvalidArgument, RewindError
from rewind.guard.verdicts import Decision


@dataclass(frozen=True)
class ExecResult:
    """What a command did. A non-zero exit is a result, not an error."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class MachineInfo:
    """A machine as `rewind ls` shows it."""

    name: str
    status: str  # running | stopped | dead | creating
    memory_mib: int
    cpus: int
    labels: dict[str, str]
    hostname: str
    pid: int | None
    created: float
    accel: str
    expires: float | None = None  # when its time to live ends, if it has one
    on_expiry: str | None = None


LOCAL_HOST = "127.0.0.1"


@dataclass(frozen=True)
class PortForward:
    """`host:port` on the host leads to the guest's `guest_port` (TCP). As JSON (the machine
    record, `rewind port --json`, the HTTP API): `{"host", "port", "guest_port"}`."""

    host: str
    port: int
    guest_port: int

    @classmethod
    def from_json(cls, data: dict) -> PortForward:
        return cls(host=str(data["host"]), port=int(data["port"]), guest_port=int(data["guest_port"]))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def url(self) -> str:
        """`http://host:port`, for a web server behind it."""
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class FileStat:
    """What a diff says of one file."""

    type: str  # file, dir, symlink, fifo, socket, char, block
    mode: int  # permission bits (07777)
    uid: int
    gid: int
    size: int
    mtime_ns: int
    target: str | None = None  # a symlink's

    def to_json(self) -> dict:
        return {"type": self.type, "mode": f"{self.mode:04o}", "uid": self.uid, "gid": self.gid,
                "size": self.size, "mtime_ns": self.mtime_ns,
                **({"target": self.target} if self.target else {})}

    @classmethod
    def from_json(cls, d: dict) -> FileStat:
        return cls(type=d["type"], mode=int(d["mode"], 8), uid=d["uid"], gid=d["gid"], size=d["size"],
                   mtime_ns=d["mtime_ns"], target=d.get("target"))


@dataclass(frozen=True)
class FileChange:
    path: str
    kind: str  # added, deleted, modified
    before: FileStat | None
    after: FileStat | None
    noise: bool = False

    def to_json(self) -> dict:
        return {"path": self.path, "kind": self.kind, "noise": self.noise,
                "before": None if self.before is None else self.before.to_json(),
                "after": None if self.after is None else self.after.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> FileChange:
        def stat(s: dict | None) -> FileStat | None:
            return None if s is None else FileStat.from_json(s)
        return cls(d["path"], d["kind"], stat(d["before"]), stat(d["after"]), d["noise"])


@dataclass(frozen=True)
class PackageChange:
    name: str
    kind: str  # installed, removed, upgraded (or downgraded: any change of version)
    before: str | None  # version
    after: str | None

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "before": self.before, "after": self.after}


@dataclass(frozen=True)
class Diff:
    """From `before` to `after` (each "point ID (machine M)" or "machine M now")."""

    before: str
    after: str
    files: list[FileChange]
    packages: list[PackageChange]
    # None where a side's guest could not say (a point captured while its agent was busy).
    processes_started: list[str] | None = None
    processes_ended: list[str] | None = None
    listening_opened: list[str] | None = None
    listening_closed: list[str] | None = None
    network: dict | None = None  # {"before": rules, "after": rules} if they differ
    labels: dict | None = None  # {"before": labels, "after": labels} if they differ
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"before": self.before, "after": self.after, "files": [f.to_json() for f in self.files],
                "packages": [p.to_json() for p in self.packages],
                "processes": None if self.processes_started is None else
                {"started": self.processes_started, "ended": self.processes_ended},
                "listening": None if self.listening_opened is None else
                {"opened": self.listening_opened, "closed": self.listening_closed},
                "network": self.network, "labels": self.labels, "notes": self.notes}

    @classmethod
    def from_json(cls, d: dict) -> Diff:
        processes, listening = d.get("processes") or {}, d.get("listening") or {}
        return cls(before=d["before"], after=d["after"], files=[FileChange.from_json(f) for f in d["files"]],
                   packages=[PackageChange(**p) for p in d["packages"]],
                   processes_started=processes.get("started"), processes_ended=processes.get("ended"),
                   listening_opened=listening.get("opened"), listening_closed=listening.get("closed"),
                   network=d.get("network"), labels=d.get("labels"), notes=list(d.get("notes", [])))


TRY_TIMEOUT = 600.0  # seconds a try_in_copy's step and check may take, by default


@dataclass(frozen=True)
class StepRun:
    """One command run in the copy; `error` says why it has no result (the guest died...)."""

    command: str
    result: ExecResult | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok

    def describe(self, what: str) -> str:
        if self.error is not None:
            return f"{what} failed: {self.error}"
        assert self.result is not None
        if self.result.timed_out:
            return f"{what} timed out"
        return f"{what} exited with {self.result.exit_code}"


@dataclass(frozen=True)
class Outcome:
    """What try_in_copy did. `kept` is "copy" (the step's machine now runs under the
    original's name) or "original" (the copy was thrown away)."""

    kept: str
    passed: bool
    log: str
    reason: str
    step: StepRun
    verify: StepRun | None
    copy_name: str
    seconds: float
    # With watch: what the step (or verify) tried to reach outside the machine and the copy's
    # network filter refused; any makes the copy go, whatever the exit codes.
    attempted: tuple[str, ...] = ()
    # What the step did to the copy, whether or not it was kept (None: not asked for, or the
    # copy could not be read: its QEMU died).
    diff: Diff | None = None

    def to_json(self) -> dict:
        def run_json(run: StepRun | None) -> dict | None:
            if run is None:
                return None
            r = run.result
            return {"command": run.command, "error": run.error,
                    "exit_code": None if r is None else r.exit_code,
                    "timed_out": None if r is None else r.timed_out,
                    "stdout": None if r is None else r.stdout, "stderr": None if r is None else r.stderr}
        return {"kept": self.kept, "passed": self.passed, "reason": self.reason, "log": self.log,
                "step": run_json(self.step), "verify": run_json(self.verify), "copy": self.copy_name,
                "seconds": round(self.seconds, 3), "attempted": list(self.attempted),
                "diff": None if self.diff is None else self.diff.to_json()}


class Refused(RewindError):
    """A guarded step was not run, or not kept: it acts outside the machine (by the classifier,
    or `attempted`: what it tried to reach from an offline copy) and that was not allowed."""

    def __init__(self, message: str, decision: Decision, attempted: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.decision = decision
        self.attempted = attempted


@dataclass(frozen=True)
class GuardedResult:
    """What a guarded step did. `path` is how it ran: direct, git, copy or checkpoint;
    `undone` says its changes were taken back because it (or verify) failed."""

    kind: str
    path: str
    reasons: list[str]
    result: ExecResult | None  # the step's own result; None if the guest died under it
    verify: ExecResult | None
    undone: bool
    note: str  # what happened, in words
    seconds: float
    outcome: Outcome | None = None  # the copy path's outcome
    checkpoint: str | None = None  # the point saved before an external step

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok and (self.verify is None or self.verify.ok)

    def to_json(self) -> dict:
        def res(r: ExecResult | None) -> dict | None:
            return None if r is None else {"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr,
                                           "timed_out": r.timed_out}
        return {"kind": self.kind, "path": self.path, "reasons": self.reasons, "ok": self.ok,
                "undone": self.undone, "note": self.note, "result": res(self.result),
                "verify": res(self.verify), "checkpoint": self.checkpoint, "seconds": round(self.seconds, 3),
                "outcome": None if self.outcome is None else self.outcome.to_json()}


class PointRecord(Protocol):
    """What Checkpoint.of reads of a point: the store's history entries and the engine's
    points have these (results.py names neither, so it stays below both)."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str | None: ...
    @property
    def machine(self) -> str: ...
    @property
    def parent(self) -> str | None: ...
    @property
    def created(self) -> float: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def own_bytes(self) -> int | None: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Checkpoint:
    """A saved point of a machine. `ref` is how a history listing names it (`~0`, `~1`, ...)."""

    id: str
    name: str | None
    machine: str
    parent: str | None
    created: float
    labels: dict[str, str]
    own_bytes: int | None  # what it added to the store that its parent did not have; None: being stored
    ref: str = "~0"
    pause_ms: float | None = None  # how long the guest was paused, on what checkpoint() returns
    context: str | None = None  # what the caller gave checkpoint(context=...)
    # Who signed it, as this home sees it ("this home (<fingerprint>)", a trusted key's name,
    # "<fingerprint>, not trusted", "unsigned", "bad signature ..."; signers.describe); None:
    # not looked at (a point just taken is this home's).
    signer: str | None = None
    # In a store in a bucket: whether it is there yet (False: stored on this host, uploading).
    # None: a store on this host, or not known yet (still being stored).
    uploaded: bool | None = None

    @classmethod
    def of(cls, entry: PointRecord, ref: str = "~0", signer: str | None = None) -> Checkpoint:
        return cls(id=entry.id, name=entry.name, machine=entry.machine, parent=entry.parent,
                   created=entry.created, labels=dict(entry.labels), own_bytes=entry.own_bytes, ref=ref,
                   context=entry.meta.get("context"), signer=signer)


Command = str | list[str]


DEFAULT_READ_MAX = 256 << 20  # what files.read takes into memory unless told otherwise


def command_argv(cmd: Command) -> list[str]:
    """A string runs under `bash -c`; a list runs the program directly."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("the command is empty")
        return ["bash", "-c", cmd]
    if isinstance(cmd, list | tuple) and cmd and all(isinstance(a, str) for a in cmd) and cmd[0]:
        return list(cmd)
    raise InvalidArgument("the command must be a non-empty string or a non-empty list of strings")


def checked(result: ExecResult, cmd: Command, check: bool) -> ExecResult:
    """`result`, or CommandFailed if `check` and the command did not exit 0 (exec(check=True))."""
    if check and not result.ok:
        why = "timed out" if result.timed_out else f"exited with {result.exit_code}"
        raise CommandFailed(f"command {why}: {command_argv(cmd)!r}", result)
    return result


@dataclass(frozen=True)
class TreeCopy:
    """What a folder copy moved (files.upload_dir, download_dir; `rewind cp -r`)."""

    files: int
    folders: int  # the copied folder too
    links: int
    bytes: int  # the files' contents
    seconds: float

    @classmethod
    def of(cls, counts: dict[str, int], started: float) -> TreeCopy:
        return cls(**counts, seconds=round(time.monotonic() - started, 3))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
