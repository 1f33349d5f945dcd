"""The one surface of a machine handle: the verbs `Sandbox` (this host), `RemoteSandbox` (a
daemon, over HTTP) and `FleetSandbox` (a node of a Ray fleet) offer, each with the signature
below. A face that lacks a verb, or takes other parameters, says so on purpose in its
`DIFFERS` (verb: why); tests/test_faces.py holds every face to this, so a verb added to one
face is added to all or declared missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

from rewind.results import Checkpoint, Command, Diff, ExecResult, GuardedResult, MachineInfo
from rewind.store.model import DEFAULT_HISTORY

if TYPE_CHECKING:
    from rewind.guard.userrules import UserRules


class MachineHandle(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def labels(self) -> dict[str, str]: ...

    def info(self) -> MachineInfo: ...

    def set_labels(self, changes: dict[str, str | None]) -> dict[str, str]: ...

    def set_ttl(self, seconds: float | None, on_expiry: str | None = None) -> MachineInfo: ...

    def exec(self, cmd: Command, *, cwd: str | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None, stdin: str | bytes | None = None, check: bool = False,
             on_stdout: Callable[[str], None] | None = None, on_stderr: Callable[[str], None] | None = None,
             max_output: int | None = None) -> ExecResult: ...

    def guarded(self, cmd: str, *, verify: str | None = None, allow_external: bool = False,
                cwd: str | None = None, timeout: float | None = None, offline: bool = False,
                rules: UserRules | None = None) -> GuardedResult: ...

    def checkpoint(self, name: str | None = None, labels: dict[str, str] | None = None,
                   history: int = DEFAULT_HISTORY, wait: bool | Literal["local"] = False,
                   context: str | None = None) -> Checkpoint: ...

    def history(self) -> list[Checkpoint]: ...

    def restore(self, ref: str | Checkpoint, *, allow_unsigned: bool | None = None) -> Checkpoint: ...

    def fork(self, name: str | None = None, labels: dict[str, str] | None = None,
             network: dict | None = None) -> MachineHandle: ...

    def fork_many(self, count: int = 1, *, names: list[str | None] | None = None,
                  labels: dict[str, str] | None = None,
                  network: dict | None = None) -> list[MachineHandle]: ...

    def diff(self, a: str | Checkpoint = "~0", b: str | Checkpoint | None = None, *, noise: bool = False,
             paths: list[str] | None = None) -> Diff: ...

    def diff_content(self, path: str, a: str | Checkpoint = "~0",
                     b: str | Checkpoint | None = None) -> str: ...

    def start(self, progress: Callable[[str], None] | None = None) -> None: ...

    def stop(self) -> None: ...

    def delete(self) -> None: ...
