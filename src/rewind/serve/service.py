"""The verbs the HTTP API and the MCP server share, each a call into the SDK or the engine.

They are blocking (they talk to guests and the store); callers run them off the event loop.
Every one returns JSON-ready data, so both faces answer with the same shapes.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rewind.engine import DEFAULT_MEMORY_MIB, timeline
from rewind.engine.engine import Engine
from rewind.engine.machine import check_ttl
from rewind.engine.network.netrules import NetworkRules
from rewind.engine.pointmeta import PointMeta
from rewind.errors import InvalidArgument
from rewind.guard.classify import Decision, Kind, classify
from rewind.guard.userrules import find_rules
from rewind.home import Home
from rewind.results import LOCAL_HOST, Checkpoint, Command, ExecResult, Refused
from rewind.sandbox import Sandbox, history_of, store_of, try_in_copy
from rewind.serve import wire
from rewind.serve.budget import Admission, Budget
from rewind.serve.metrics import Metrics, measured
from rewind.serve.policy import Policy, StepPolicy
from rewind.signers import import_signed, signer_of
from rewind.store import Store, export_checkpoint

MAX_FORKS = 64


@dataclass
class DaemonConfig:
    """What an operator sets for a daemon (flags of `rewind serve`, GET/PATCH /config): its
    budget, and the time to live of machines made through it that were given none."""

    budget: Budget = field(default_factory=Budget.for_host)
    default_ttl: float | None = None
    on_expiry: str = "stop"
    policy: Policy = field(default_factory=Policy)  # set by flags only: see serve/policy.py

    def to_json(self) -> dict[str, Any]:
        return {"max_machines": self.budget.machines, "max_memory_mib": self.budget.memory_mib,
                "default_ttl": self.default_ttl, "on_expiry": self.on_expiry, "policy": self.policy.to_json()}

    def change(self, max_machines: int | None = None, max_memory_mib: int | None = None,
               default_ttl: float | None = None, on_expiry: str | None = None) -> None:
        check_ttl(default_ttl, on_expiry)
        self.budget.change(max_machines, max_memory_mib)
        self.default_ttl = default_ttl if default_ttl is not None else self.default_ttl
        self.on_expiry = on_expiry or self.on_expiry


@dataclass(frozen=True)
class Service:
    home: Home
    store_path: str | os.PathLike[str] | None = None
    config: DaemonConfig = field(default_factory=DaemonConfig)
    metrics: Metrics = field(init=False, repr=False, compare=False)
    admission: Admission = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", Metrics(self))  # counts what both faces do
        object.__setattr__(self, "admission", Admission(self.home, self.config.budget))

    @classmethod
    def from_env(cls, store: str | os.PathLike[str] | None = None,
                 config: DaemonConfig | None = None) -> Service:
        return cls(Home.from_env(), store, config or DaemonConfig())

    def sandbox(self, name: str) -> Sandbox:
        return Sandbox.get(name, home=self.home, store=self.store_path)

    def store(self, settled: bool = False) -> Store:
        """The store; `settled`: once every checkpoint still being written is in it."""
        if settled:
            Engine(self.home).settle()
        return store_of(self.home, self.store_path)

    # ---- machines ----

    @measured("create")
    def create(self, name: str | None = None, *, memory: int | None = None, cpus: int | None = None,
               disk: int = 0, labels: dict[str, str] | None = None, image: str | None = None,
               from_checkpoint: str | None = None, at: str | None = None, network: dict | None = None,
               host_trust: bool | None = None, ttl: float | None = None, on_expiry: str | None = None,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """A new machine; without `ttl`, it gets the daemon's default time to live, if any."""
        sizes = {k: v for k, v in (("memory", memory), ("cpus", cpus)) if v is not None}
        ttl = {"ttl": ttl or self.config.default_ttl, "on_expiry": on_expiry or self.config.on_expiry} \
            if ttl or self.config.default_ttl else {}
        with self.admission.admit(1, self._memory_of(memory, from_checkpoint, at)):
            sbx = Sandbox.create(name, disk=disk, labels=labels, image=image, from_checkpoint=from_checkpoint,
                                 at=at, network=network, host_trust=host_trust, home=self.home,
                                 store=self.store_path, progress=progress, **sizes, **ttl)
        return wire.info_json(sbx.info())

    def _memory_of(self, memory: int | None, from_checkpoint: str | None, at: str | None) -> int:
        """The guest memory a new machine will have: asked for, its point's, or the default."""
        if from_checkpoint is None:
            return memory or DEFAULT_MEMORY_MIB
        engine = Engine(self.home)
        found = engine.find_point(self.store(), from_checkpoint)
        if at is not None:
            found = engine.find_point(self.store(), at, relative_to=found.point.id)
        return PointMeta.from_json(found.point.id, found.point.meta).memory_mib

    def set_ttl(self, name: str, seconds: float | None, on_expiry: str | None = None) -> dict[str, Any]:
        return wire.info_json(self.sandbox(name).set_ttl(seconds, on_expiry))

    def list(self, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        return [wire.info_json(m.info()) for m in Engine(self.home).list(labels)]

    def info(self, name: str) -> dict[str, Any]:
        return wire.info_json(self.sandbox(name).info())

    @measured("stop")
    def stop(self, name: str) -> dict[str, Any]:
        sbx = self.sandbox(name)
        sbx.stop()
        return wire.info_json(sbx.info())

    @measured("start")
    def start(self, name: str, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        sbx = self.sandbox(name)
        info = sbx.info()
        with self.admission.admit(0 if info.status == "running" else 1, 0 if info.status == "running"
                                  else info.memory_mib):
            sbx.start(progress)
        return wire.info_json(sbx.info())

    def set_labels(self, name: str, changes: dict[str, str | None]) -> dict[str, str]:
        return self.sandbox(name).set_labels(changes)

    @measured("delete")
    def delete(self, name: str) -> None:
        self.sandbox(name).delete()

    def images(self) -> list[dict[str, Any]]:
        from rewind.image import list_images

        return [i.to_json() for i in list_images(self.home.images)]

    # ---- commands ----

    @measured("exec")
    def exec(self, name: str, cmd: Command, *, cwd: str | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None, stdin: str | bytes | None = None, max_output: int | None = None,
             on_stdout: Callable[[str], None] | None = None,
             on_stderr: Callable[[str], None] | None = None) -> dict[str, Any]:
        """The command's result, with the guard's verdict on it (what undo it would need), run
        as the daemon's policy for the machine says (serve/policy.py)."""
        policy = self.config.policy.of(name)
        decision = self.decision(cmd, cwd, env)
        verdict = None if decision is None else decision.to_json()
        if policy is StepPolicy.GUARDED:
            return self._exec_guarded(name, cmd, cwd, env, timeout, stdin, on_stdout, on_stderr, decision)
        point = None
        if policy is StepPolicy.CHECKPOINT_EACH:
            self._refuse_external(name, decision)
            point = self.sandbox(name).checkpoint(labels={"rewind.policy": policy.value}).id
        result = self.sandbox(name).exec(cmd, cwd=cwd, env=env, timeout=timeout, stdin=stdin,
                                         max_output=max_output, on_stdout=on_stdout, on_stderr=on_stderr)
        return {**wire.exec_json(result), "verdict": verdict, "policy": policy.value,
                **({"checkpoint": point} if point else {})}

    def _exec_guarded(self, name: str, cmd: Command, cwd: str | None, env: dict[str, str] | None,
                      timeout: float | None, stdin: str | bytes | None,
                      on_stdout: Callable[[str], None] | None, on_stderr: Callable[[str], None] | None,
                      decision: Decision | None) -> dict[str, Any]:
        """exec under the guarded policy: as guarded_exec, answered in exec's shape."""
        if stdin is not None:
            raise InvalidArgument(f"machine {name} runs every step guarded (the daemon's policy), and a "
                                  "guarded step takes no stdin: put the input in the command")
        self._refuse_external(name, decision)
        step = _with_env(cmd, env)
        done = self.sandbox(name).guarded(step, cwd=cwd, timeout=timeout,
                                          allow_external=self.config.policy.allows_external(name))
        result = done.result
        if result is not None:
            for sink, text in ((on_stdout, result.stdout), (on_stderr, result.stderr)):
                if sink is not None and text:
                    sink(text)
        ran = wire.exec_json(result or ExecResult(exit_code=-1, stdout="", stderr=done.note))
        verdict = None if decision is None else decision.to_json()
        return {**ran, "verdict": verdict, "policy": StepPolicy.GUARDED.value, "guarded": done.to_json()}

    def _refuse_external(self, name: str, decision: Decision | None) -> None:
        """Under a policy, a step that acts outside the machine runs only where the operator allowed it."""
        if decision is None or decision.kind is not Kind.EXTERNAL or self.config.policy.allows_external(name):
            return
        raise Refused(f"refused by the daemon's policy for machine {name}: {'; '.join(decision.reasons)}; it "
                      "acts outside the machine, where no checkpoint can take it back (the operator allows "
                      "such steps with `rewind serve --allow-external NAME`)", decision)

    @staticmethod
    def decision(cmd: Command, cwd: str | None, env: dict[str, str] | None = None) -> Decision | None:
        """classify's answer for a shell string (with the call's `env` as the shell would see it);
        an argv list or an unreadable command has none."""
        if not isinstance(cmd, str):
            return None
        rules = find_rules()  # outside the try: a bad rules file is the caller's to hear of
        try:
            return classify(_with_env(cmd, env), cwd=cwd or "/root", rules=rules)
        except InvalidArgument:
            return None

    @measured("guarded")
    def guarded(self, name: str, cmd: str, *, verify: str | None = None, allow_external: bool = False,
                cwd: str | None = None, timeout: float | None = None, offline: bool = False
                ) -> dict[str, Any]:
        if self.config.policy.of(name) is not StepPolicy.OPEN:  # the operator's word, not the agent's
            self._refuse_external(name, self.decision(cmd, cwd))
            allow_external = self.config.policy.allows_external(name)
        return self.sandbox(name).guarded(cmd, verify=verify, allow_external=allow_external, cwd=cwd,
                                          timeout=timeout, offline=offline).to_json()

    @measured("try")
    def try_in_copy(self, name: str, step: str, verify: str | None = None, *, offline: bool = True,
                    cwd: str | None = None, timeout: float = 600.0, diff: bool = True) -> dict[str, Any]:
        sbx = self.sandbox(name)
        return try_in_copy(sbx, step, verify, offline=offline, cwd=cwd, timeout=timeout, diff=diff).to_json()

    def diff(self, name: str, before: str = "~0", after: str | None = None, *, all: bool = False,
             paths: list[str] | None = None) -> dict[str, Any]:
        return self.sandbox(name).diff(before, after, noise=all, paths=paths or None).to_json()

    def diff_content(self, name: str, path: str, before: str = "~0", after: str | None = None) -> str:
        return self.sandbox(name).diff_content(path, before, after)

    @staticmethod
    def classify(command: str, cwd: str | None = None) -> dict[str, Any]:
        return classify(command, cwd=cwd, rules=find_rules()).to_json()

    # ---- files and network ----

    def read_file(self, name: str, path: str) -> bytes:
        return self.sandbox(name).files.read(path)

    def write_file(self, name: str, path: str, data: bytes, mode: int | None = None) -> None:
        self.sandbox(name).files.write(path, data, mode)

    def download(self, name: str, path: str, out: Path, max_bytes: int | None = None) -> None:
        """A guest file copied to `out` on the host, with its permission bits."""
        self.sandbox(name).files.download(path, out, max_bytes)

    def upload(self, name: str, src: Path, path: str) -> None:
        """A host file written into the guest, with its permission bits."""
        self.sandbox(name).files.upload(src, path)

    def upload_dir(self, name: str, local: str, path: str) -> dict[str, Any]:
        """A folder on the server's host copied into the guest, as `cp -r` (see Files.upload_dir)."""
        return self.sandbox(name).files.upload_dir(_host_path(local), path).to_json()

    def download_dir(self, name: str, path: str, local: str) -> dict[str, Any]:
        """A guest folder copied to the server's host, as `cp -r` (see Files.download_dir)."""
        return self.sandbox(name).files.download_dir(path, _host_path(local)).to_json()

    def upload_tar(self, name: str, src: Path, path: str, folder: str | None = None) -> dict[str, Any]:
        """The tar stream in `src` unpacked into a new guest folder (see Files.upload_tar)."""
        with open(src, "rb") as source:
            return self.sandbox(name).files.upload_tar(source, path, folder).to_json()

    def download_tar(self, name: str, path: str, out: Path, max_bytes: int | None = None) -> None:
        """A guest folder written to `out` as a tar stream."""
        with open(out, "wb") as sink:
            self.sandbox(name).files.download_tar(path, sink, max_bytes)

    def network(self, name: str) -> dict[str, Any]:
        return self.sandbox(name).network.get()

    def set_network(self, name: str, internet: bool = True, allow: list[str] | None = None,
                    deny: list[str] | None = None) -> dict[str, Any]:
        return self.sandbox(name).network.set(internet=internet, allow=allow, deny=deny)

    def ports(self, name: str) -> list[dict[str, Any]]:
        return [f.to_json() for f in self.sandbox(name).ports.list()]

    def forward_port(self, name: str, guest_port: int, host_port: int | None = None,
                     host: str = LOCAL_HOST) -> dict[str, Any]:
        return self.sandbox(name).ports.forward(guest_port, host_port, host).to_json()

    def remove_port(self, name: str, guest_port: int) -> dict[str, Any]:
        return self.sandbox(name).ports.remove(guest_port).to_json()

    # ---- checkpoints ----

    @measured("checkpoint")
    def checkpoint(self, name: str, point_name: str | None = None, labels: dict[str, str] | None = None,
                   wait: bool | Literal["local"] = False, context: str | None = None) -> dict[str, Any]:
        point = self.sandbox(name).checkpoint(point_name, labels, wait=wait, context=context)
        return wire.checkpoint_json(point)

    def history(self, name: str) -> list[dict[str, Any]]:
        return [wire.checkpoint_json(c) for c in self.sandbox(name).history()]

    @measured("restore")
    def restore(self, name: str, ref: str) -> dict[str, Any]:
        return wire.checkpoint_json(self.sandbox(name).restore(ref))

    @measured("fork")
    def fork(self, name: str, count: int = 1, names: list[str] | None = None,
             labels: dict[str, str] | None = None, network: dict | None = None) -> list[dict[str, Any]]:
        """`count` live copies from one capture (or one per name in `names`), one result each."""
        wanted: list[str | None] = list(names) if names else [None] * count
        if not 1 <= len(wanted) <= MAX_FORKS:
            raise InvalidArgument(f"a fork makes 1 to {MAX_FORKS} copies (asked for {len(wanted)})")
        engine = Engine(self.home)
        rules = NetworkRules.from_json(network) if network is not None else None
        source = engine.get(name)
        with self.admission.admit(len(wanted), len(wanted) * source.record.memory_mib):
            children = timeline.fork(engine, source, self.store(), wanted, labels=labels, network=rules)
        if self.config.default_ttl:
            for child in children:
                child.set_ttl(self.config.default_ttl, self.config.on_expiry)
        return [wire.info_json(child.info()) for child in children]

    def checkpoints(self) -> list[dict[str, Any]]:
        return [wire.checkpoint_json(Checkpoint.of(m, ref="", signer=signer_of(self.home, m)))
                for m in self.store(settled=True).list()]

    def lineage(self, ref: str) -> dict[str, Any]:
        """A checkpoint with its parent, its children, and the history it keeps."""
        store = self.store(settled=True)
        point = store.get(ref)
        children = [Checkpoint.of(m, ref="") for m in store.list() if m.parent == point.id]
        history = [wire.checkpoint_json(c) for c in history_of(point, self.home)]
        return {**wire.checkpoint_json(Checkpoint.of(point, signer=signer_of(self.home, point))),
                "history": history,
                "children": [wire.checkpoint_json(c) for c in children]}

    @measured("export")
    def export(self, ref: str, out: Path) -> dict[str, Any]:
        manifest = export_checkpoint(self.store(settled=True), ref, out)
        return {"id": manifest.id, "name": manifest.name}

    @measured("import")
    def import_(self, src: Path) -> dict[str, Any]:
        manifest = import_signed(self.home, self.store(), src)
        return {"id": manifest.id, "name": manifest.name}


def _host_path(path: str) -> str:
    """A path on the server's host, given by a client that cannot know the server's working folder."""
    if not os.path.isabs(path):
        raise InvalidArgument(f"a path on the server's host must be absolute: {path!r}")
    return path


def _with_env(cmd: Command, env: dict[str, str] | None) -> str:
    """A shell string that sets `env` for the whole of `cmd` (an argv list is quoted into one),
    so the guard reads the variables that aim clients elsewhere, and the step runs with them."""
    line = cmd if isinstance(cmd, str) else shlex.join(cmd)
    if not env:
        return line
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + "; " + line
