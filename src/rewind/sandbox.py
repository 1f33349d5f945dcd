"""The public Python API: `from rewind import Sandbox`.

A Sandbox is a handle on one machine. It holds no connection between calls:
every call takes the machine's lock, talks to its guest agent and lets go, so
several handles (in several processes) can share one machine safely.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal

from rewind.engine import DEFAULT_CPUS, DEFAULT_MEMORY_MIB
from rewind.engine.agent import exec_deadline
from rewind.engine.engine import Engine
from rewind.engine.machine import Machine, check_ttl
from rewind.engine.network.netrules import NetworkRules
from rewind.engine.pointmeta import PointMeta
from rewind.errors import InvalidArgument
from rewind.folders import packed, unpacked
from rewind.guard.trial import try_in_copy as _try_in_copy
from rewind.guest.protocol import CHUNK
from rewind.home import Home
from rewind.results import (
    DEFAULT_READ_MAX,
    LOCAL_HOST,
    TRY_TIMEOUT,
    Checkpoint,
    Command,
    ExecResult,
    MachineInfo,
    PortForward,
    TreeCopy,
    checked,
    command_argv,
)
from rewind.store.model import DEFAULT_HISTORY, is_int

# The store, the guard's classifier and the checkpoint machinery are imported where they
# are used, as in engine/machine.py: exec through a new process (the CLI) starts sooner.
if TYPE_CHECKING:
    from rewind.guard.userrules import UserRules
    from rewind.results import Diff, GuardedResult, Outcome
    from rewind.serve.client import Remote, RemoteSandbox
    from rewind.store import CheckpointManifest, Store
    from rewind.store.crypto import PasswordSource

__all__ = ["Checkpoint", "ExecResult", "Files", "Network", "Sandbox", "TreeCopy", "try_in_copy"]


def check_context(context: object) -> None:
    """A checkpoint's context is text, small enough to be copied into the history its
    descendants keep (up to DEFAULT_HISTORY of them)."""
    if context is None:
        return
    if not isinstance(context, str):
        raise InvalidArgument(f"a checkpoint's context must be text, not {type(context).__name__} "
                              "(encode bytes or JSON as text)")
    size = len(context.encode("utf-8", "surrogatepass"))
    if size > MAX_CONTEXT:
        raise InvalidArgument(f"a checkpoint's context holds at most {MAX_CONTEXT} bytes (got {size}); "
                              "keep larger state in a file in the machine, which the checkpoint keeps")


def history_of(manifest: CheckpointManifest, home: Home, store: Store | None = None) -> list[Checkpoint]:
    """A checkpoint and the points before it, newest first, named ~0, ~1, ...; each with the
    signer of `manifest`, which vouches for the history it keeps; with `store`, each says
    whether it is uploaded, if the store is in a bucket."""
    from rewind.signers import signer_of

    signer = signer_of(home, manifest)
    points = [Checkpoint.of(e, f"~{i}", signer) for i, e in enumerate([manifest.entry(), *manifest.history])]
    return with_upload_state(points, store)


def with_upload_state(points: list[Checkpoint], store: Store | None) -> list[Checkpoint]:
    """`points`, each saying whether it is in the bucket yet, if `store` is in one."""
    from rewind.store.cache import CachedStore

    if not isinstance(store, CachedStore):
        return points
    queued = set(store.queued())
    return [dataclasses.replace(c, uploaded=c.id not in queued) for c in points]


def store_of(home: Home, store: str | os.PathLike[str] | None, password: PasswordSource = None) -> Store:
    """The store named (a folder or s3://bucket/prefix), else $REWIND_STORE, else the home's.
    An encrypted one takes its password from `password`, else $REWIND_PASSWORD_FILE, else
    $REWIND_PASSWORD (open_store): every process of the home that opens it (its committers
    too) needs one of those."""
    from rewind.store import open_store

    return open_store(store or os.environ.get("REWIND_STORE") or home.store, create=True, home=home.root,
                      password=password)

MAX_CONTEXT = 64 * 1024


def _positive(what: str, value: object) -> int:
    if not is_int(value) or value <= 0:
        raise InvalidArgument(f"{what} must be a positive whole number (got {str(value)[:40]!r})")
    return value


def _engine(home: Home | str | os.PathLike[str] | None) -> Engine:
    if isinstance(home, Home):
        return Engine(home)
    return Engine(Home.from_env(home))


class Sandbox:
    """A machine you can run commands in. Create with `Sandbox.create()`, find with `Sandbox.get()`.

    Used as a context manager, the machine is deleted when the block ends.
    """

    def __init__(self, machine: Machine, store: str | os.PathLike[str] | None = None) -> None:
        self._machine = machine
        self._engine = Engine(machine.home)  # the machines of its home: copies, diffs, the guard
        self._store_path = store
        self.files = Files(machine)
        self.network = Network(machine)
        self.ports = Ports(machine)

    @property
    def _store(self) -> Store:
        return store_of(self._machine.home, self._store_path)

    # ---- finding and creating ----

    @classmethod
    def create(cls, name: str | None = None, *, memory: int = DEFAULT_MEMORY_MIB, cpus: int = DEFAULT_CPUS,
               disk: int = 0, labels: dict[str, str] | None = None, image: str | None = None,
               from_checkpoint: str | Checkpoint | None = None, at: str | None = None,
               network: dict | None = None, host_trust: bool | None = None,
               ttl: float | None = None, on_expiry: str = "stop",
               home: Home | str | os.PathLike[str] | None = None,
               store: str | os.PathLike[str] | None = None,
               progress: Callable[[str], None] | None = None,
               allow_unsigned: bool | None = None) -> Sandbox:
        """Start a new machine. `memory` and `disk` are in MiB (`disk=0`: the image's size);
        `image` names an imported image (`rewind image import`), default the built one.

        With `from_checkpoint` (a Checkpoint, or its id, id prefix or name; `at="~2"` counts back
        from it), the machine runs from that point instead, sharing its memory and disk
        read-only; memory and vCPUs are then the checkpoint's.

        `network` gives the machine's first rules, as for `sbx.network.set`:
        `{"internet": False, "allow": ["pypi.org"]}`; by default it reaches the internet
        but not the host's loopback services.

        `host_trust`: the machine takes this host's CA certificates and proxy settings (for a
        host behind a TLS-inspecting proxy); default: $REWIND_HOST_TRUST (`1` turns it on).

        `ttl`: seconds it may live; then `on_expiry` (stop, checkpoint or delete) is done to it
        by `rewind serve`, or `rewind expire` (see set_ttl).

        A stored checkpoint runs only if this home or a key it trusts signed it (`rewind trust
        add`); an unsigned one (written before signing) runs from the home's own store, and
        from elsewhere with `allow_unsigned` (default: $REWIND_ALLOW_UNSIGNED)."""
        check_ttl(ttl, on_expiry)
        engine = _engine(home)
        if host_trust is None:
            host_trust = os.environ.get("REWIND_HOST_TRUST", "") in ("1", "true", "yes")
        rules = NetworkRules.from_json(network) if network is not None else None
        if isinstance(from_checkpoint, Checkpoint):
            from_checkpoint = from_checkpoint.id
        if from_checkpoint is not None:
            from rewind.engine import timeline  # the capture and commit code: 30-44 ms to import

            machine = timeline.create_from(engine, store_of(engine.home, store), from_checkpoint, name=name,
                                           labels=labels, at=at, network=rules, allow_unsigned=allow_unsigned)
        else:
            machine = engine.create(name, memory_mib=memory, cpus=cpus, disk_mib=disk, labels=labels,
                                    image=image, network=rules, host_trust=host_trust,
                                    report=progress or (lambda _: None))
        if ttl is not None:
            machine.set_ttl(ttl, on_expiry)
        return cls(machine, store)

    @staticmethod
    def connect(url: str | None = None, token: str | None = None) -> Remote:
        """The machines of a `rewind serve` daemon (`url` default $REWIND_URL, `token` default
        $REWIND_TOKEN): `.create()`, `.get()` and `.list()` give handles with this class's methods."""
        from rewind.serve.client import Remote

        return Remote(url, token)

    @classmethod
    def get(cls, name: str, *, home: Home | str | os.PathLike[str] | None = None,
            store: str | os.PathLike[str] | None = None) -> Sandbox:
        return cls(_engine(home).get(name), store)

    @classmethod
    def list(cls, labels: dict[str, str] | None = None, *,
             home: Home | str | os.PathLike[str] | None = None) -> list[Sandbox]:
        return [cls(m) for m in _engine(home).list(labels)]

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"Sandbox({self.name!r}, status={self.status!r})"

    # ---- state ----

    @property
    def name(self) -> str:
        return self._machine.name

    @property
    def labels(self) -> dict[str, str]:
        return dict(self._machine.record.labels)

    def set_ttl(self, seconds: float | None, on_expiry: str | None = None) -> MachineInfo:
        """Its time to live ends `seconds` from now (None: never; call again to extend it);
        then `on_expiry` (stop, checkpoint and stop, or delete; default: as set before, else
        stop) is done to it by `rewind serve` watching its home, or by `rewind expire`."""
        self._machine.set_ttl(seconds, on_expiry)
        return self.info()

    def set_labels(self, changes: dict[str, str | None]) -> dict[str, str]:
        """Add or change labels; a None value removes one. Returns the labels it has now."""
        return self._machine.set_labels(changes)

    @property
    def status(self) -> str:
        """running, stopped, or dead (its QEMU exited without being asked to)."""
        self._machine.reload()
        return self._machine.status()

    def info(self) -> MachineInfo:
        self._machine.reload()
        return self._machine.info()

    # ---- running commands ----

    def exec(self, cmd: Command, *, cwd: str | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None, stdin: str | bytes | None = None, check: bool = False,
             on_stdout: Callable[[str], None] | None = None,
             on_stderr: Callable[[str], None] | None = None,
             max_output: int | None = None) -> ExecResult:
        """Run a command in the machine and wait for it.

        A non-zero exit is returned, not raised, unless `check=True`. At
        `timeout` seconds the command's whole process group is killed and the
        result has `timed_out=True`. Output is streamed to `on_stdout` /
        `on_stderr` as it comes; each stream keeps at most `max_output` bytes
        (16 MiB by default) and says if it was truncated.
        """
        argv = command_argv(cmd)
        if timeout is not None and not timeout > 0:
            raise InvalidArgument(f"timeout must be a positive number of seconds (got {timeout})")
        if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise InvalidArgument("env must map strings to strings")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        deadline = exec_deadline(timeout)
        with self._machine.agent(deadline=deadline) as client:
            result = client.exec(argv, cwd=cwd, env=env, timeout=timeout, stdin=data, max_output=max_output,
                                 on_stdout=on_stdout, on_stderr=on_stderr, deadline=deadline)
        return checked(result, cmd, check)

    def guarded(self, cmd: str, *, verify: str | None = None, allow_external: bool = False,
                cwd: str | None = None, timeout: float | None = None, offline: bool = False,
                rules: UserRules | None = None) -> GuardedResult:
        """Run `cmd` with the cheapest undo that covers what it can do (see rewind.classify):
        reads run as is; changes to project files (`cwd`, default /root) are recorded by git
        first and put back on failure; anything else runs in a copy kept only if it passes;
        commands acting outside the machine are refused unless `allow_external` (then the
        machine is checkpointed first). `verify` is a check that must pass too. The result
        says which path was taken. `rules` come before the guard's table; by default the
        rewind.toml files found from the current folder and in the user's config folder."""
        from rewind.guard.guarded import guarded
        from rewind.guard.userrules import find_rules

        if not isinstance(cmd, str):
            raise InvalidArgument("a guarded command must be a shell command string")
        return guarded(self._engine, self._machine, self._store, cmd, verify=verify,
                       allow_external=allow_external, cwd=cwd, timeout=timeout, offline=offline,
                       rules=find_rules() if rules is None else rules)

    # ---- checkpoints ----

    def checkpoint(self, name: str | None = None, labels: dict[str, str] | None = None,
                   history: int = DEFAULT_HISTORY, wait: bool | Literal["local"] = False,
                   context: str | None = None) -> Checkpoint:
        """Save the whole machine (memory, processes, disk) as of now; it runs on. The new point
        records as its parent the point this machine was last saved to or restored from.

        It returns once the moment is captured (the guest runs again); memory is written and
        stored in the background, and anything that reads checkpoints waits for that. With
        `wait`, it returns once the point is in the store (own_bytes then known): for a store
        in a bucket, once it is uploaded there (any host can then use it). With
        wait="local", once it is stored on this host; the upload goes on in the background
        (the point's `uploaded` says whether it is done).

        `context` is the caller's own state at this point (the conversation so far, a plan):
        text of up to 64 KiB, kept with the point, exported with it, and given back by
        history() and restore()."""
        from rewind.engine.points import Point
        from rewind.store.cache import CachedStore

        check_context(context)
        if wait not in (False, True, "local"):
            raise InvalidArgument(f"wait must be true, false or 'local' (got {str(wait)[:40]!r})")
        from rewind.engine import timeline  # the capture and commit code: 30-44 ms to import

        store = self._store
        point = timeline.checkpoint(self._machine, store, name=name, labels=labels, history=history,
                                    context=context)
        pause_ms = (PointMeta.from_json(point.id, point.meta).pause_s or 0.0) * 1000
        if wait:
            self._machine.settle()
            done = dataclasses.replace(Checkpoint.of(store.get(point.id)), pause_ms=pause_ms)
            if wait is True and isinstance(store, CachedStore):
                store.wait_uploaded(point.id)
            return with_upload_state([done], store)[0]
        return dataclasses.replace(Checkpoint.of(Point.of_pending(point)), own_bytes=None, pause_ms=pause_ms)

    def history(self) -> list[Checkpoint]:
        """This machine's points, newest first: its last point as ~0, then its ancestors."""
        from rewind.engine import pending

        engine = self._engine
        engine.settle()
        self._machine.reload()
        parent = pending.surviving(engine.home, self._machine.record.parent)
        return history_of(self._store.get(parent), engine.home, self._store) if parent else []

    def restore(self, ref: str | Checkpoint, *, allow_unsigned: bool | None = None) -> Checkpoint:
        """Put this machine back to a point (a Checkpoint, `~N`, an id prefix or a name):
        processes, memory and disk; same name and identity. The state it leaves is saved first.
        The point must be signed by a key this home trusts (`allow_unsigned`: see create)."""
        from rewind.engine import timeline  # the capture and commit code: 30-44 ms to import

        ref = ref.id if isinstance(ref, Checkpoint) else ref
        return Checkpoint.of(timeline.restore(self._machine, self._store, ref, allow_unsigned))

    def diff(self, a: str | Checkpoint = "~0", b: str | Checkpoint | None = None, *, noise: bool = False,
             paths: list[str] | None = None) -> Diff:
        """What changed from point `a` to point `b`, or to this machine as it is now (b=None):
        files, packages, processes and listening sockets, network rules and labels. Refs are
        as restore's (`~N` counts back from this machine's last point; `NAME~N`, ids, names).
        `noise`: also files in the noise list (logs, caches: filediff.NOISE); `paths`: globs."""
        from rewind.engine.changes.diff import diff

        self._machine.reload()
        return diff(self._engine, self._store, _ref(a), self._machine if b is None else _ref(b),
                    relative_to=self._machine.record.parent, include_noise=noise, globs=paths)

    def diff_content(self, path: str, a: str | Checkpoint = "~0", b: str | Checkpoint | None = None) -> str:
        """A unified diff of one text file from point `a` to point `b` (None: now)."""
        from rewind.engine.changes.diff import content

        self._machine.reload()
        return content(self._engine, self._store, _ref(a), self._machine if b is None else _ref(b),
                       path, relative_to=self._machine.record.parent)

    def fork(self, name: str | None = None, labels: dict[str, str] | None = None,
             network: dict | None = None) -> Sandbox:
        """A live copy of this machine from this moment, with its own name and identity.
        It has this machine's network rules unless `network` gives others (from its first packet)."""
        [child] = self.fork_many(names=[name], labels=labels, network=network)
        return child

    def fork_many(self, count: int = 1, *, names: list[str | None] | None = None,
                  labels: dict[str, str] | None = None, network: dict | None = None) -> list[Sandbox]:
        """`count` live copies from one capture (or one per name in `names`): the machine
        pauses once however many there are."""
        if names is None:
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise InvalidArgument(f"count must be a whole number of copies, at least 1 (got {count!r})")
            names = [None] * count
        from rewind.engine import timeline  # the capture and commit code: 30-44 ms to import

        rules = NetworkRules.from_json(network) if network is not None else None
        children = timeline.fork(self._engine, self._machine, self._store, list(names), labels=labels,
                                 network=rules)
        return [Sandbox(child, self._store_path) for child in children]

    # ---- lifecycle ----

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        """Start a stopped machine again (it boots from its disk)."""
        self._machine.start(progress or (lambda _: None))

    def stop(self) -> None:
        """Stop the machine. Its disk is kept; running processes end."""
        self._machine.stop()

    def delete(self) -> None:
        """Stop the machine if it runs and remove everything it had."""
        self._machine.delete()


def _ref(ref: str | Checkpoint) -> str:
    return ref.id if isinstance(ref, Checkpoint) else ref


def try_in_copy(sbx: Sandbox | RemoteSandbox, step: str, verify: str | None = None, *, offline: bool = True,
                cwd: str | None = None, timeout: float = TRY_TIMEOUT, diff: bool = True) -> Outcome:
    """Run `step`, then `verify`, in a live copy of `sbx` (cut off from the network unless
    `offline=False`). If both exit 0 the copy takes over `sbx`'s name, identity and network
    rules (the same handle now reaches it) and the original is deleted; otherwise the copy
    is deleted and `sbx` never saw the step. `verify=None`: the step's exit code decides.
    `diff`: Outcome.diff says what the step changed in the copy (it costs a try about 0.7 s
    here). A machine reached through Sandbox.connect runs it on its server."""
    if not isinstance(sbx, Sandbox):
        return sbx.try_in_copy(step, verify, offline=offline, cwd=cwd, timeout=timeout, diff=diff)
    return _try_in_copy(sbx._engine, sbx._machine, sbx._store, step, verify, offline=offline, cwd=cwd,
                        timeout=timeout, diff=diff)












class Files:
    """Files inside a machine: `sbx.files.read/write/upload/download`, and folders
    (`upload_dir/download_dir`, as `cp -r`)."""

    def __init__(self, machine: Machine) -> None:
        self._machine = machine

    def read(self, path: str, max_bytes: int = DEFAULT_READ_MAX) -> bytes:
        """A whole file, in memory: GuestFileError if it holds more than `max_bytes`."""
        buf = io.BytesIO()
        with self._machine.agent() as agent:
            agent.read_file(path, buf, _positive("max_bytes", max_bytes))
        return buf.getvalue()

    def read_text(self, path: str, encoding: str = "utf-8", max_bytes: int = DEFAULT_READ_MAX) -> str:
        return self.read(path, max_bytes).decode(encoding)

    def write(self, path: str, data: str | bytes, mode: int | None = None) -> None:
        """Write a whole file (parents are created); it appears whole or not at all."""
        raw = data.encode() if isinstance(data, str) else data
        with self._machine.agent() as agent:
            agent.write_file(path, io.BytesIO(raw), mode)

    def upload(self, local: str | os.PathLike[str], path: str) -> None:
        """Copy a host file into the machine, keeping its permission bits."""
        local = Path(local)
        if not local.is_file():
            raise InvalidArgument(f"not a file on this host: {local}")
        with open(local, "rb") as src, self._machine.agent() as agent:
            agent.write_file(path, src, local.stat().st_mode & 0o7777)

    def download(self, path: str, local: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        """Copy a file out of the machine; the host file appears only once complete. At most
        `max_bytes` are taken (by default the machine's disk size, more than any file on it
        holds but a sparse one): a guest cannot fill the host's disk."""
        local = Path(local)
        if local.is_dir():
            local = local / Path(path).name
        tmp = local.with_name(f".{local.name}.rewind-partial")
        try:
            with open(tmp, "wb") as sink, self._machine.agent() as agent:
                mode = agent.read_file(path, sink, self._most(max_bytes))
            os.chmod(tmp, mode & 0o777)
            shutil.move(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def upload_dir(self, local: str | os.PathLike[str], path: str,
                   progress: Callable[[str], None] | None = None) -> TreeCopy:
        """Copy a host folder into the machine, as `cp -r` does: to `path` if nothing is there
        (parents are made), into it as `path/NAME` if it is a folder. A place already taken is
        refused (AlreadyExists): a copy never merges into a folder. Files, folders (empty ones
        too) and links (kept as links) keep their modes and mtimes and belong to root; the
        copy appears whole or not at all. `progress` hears what has moved, once a second."""
        name, blocks = packed(local, progress)
        return self._untar(path, name, blocks)

    def download_dir(self, path: str, local: str | os.PathLike[str], max_bytes: int | None = None,
                     progress: Callable[[str], None] | None = None) -> TreeCopy:
        """Copy a folder out of the machine by upload_dir's rules; the host files belong to the
        caller. At most `max_bytes` of tar stream are taken (as download's)."""
        started = time.monotonic()
        with self._machine.agent() as agent:
            return TreeCopy.of(unpacked(agent.tar(path, self._most(max_bytes)), path, local, progress),
                               started)

    def upload_tar(self, source: BinaryIO, path: str, name: str | None = None) -> TreeCopy:
        """Unpack a tar stream into a new folder: `path`, or `path/name` if `path` is a folder
        (upload_dir's rule). Only files, folders and links; nothing may land outside it."""
        return self._untar(path, name, iter(lambda: source.read(CHUNK), b""))

    def download_tar(self, path: str, sink: BinaryIO, max_bytes: int | None = None) -> None:
        """Write a guest folder into `sink` as a tar stream (at most `max_bytes` of it)."""
        with self._machine.agent() as agent:
            for chunk in agent.tar(path, self._most(max_bytes)):
                sink.write(chunk)

    def _untar(self, path: str, name: str | None, blocks: Iterator[bytes]) -> TreeCopy:
        started = time.monotonic()
        with self._machine.agent() as agent:
            return TreeCopy.of(agent.untar(path, name, blocks), started)

    def _most(self, max_bytes: int | None) -> int:
        """What a download takes at most: by default the machine's disk size, more than any
        file or folder on it holds but a sparse one (a guest cannot fill the host's disk)."""
        if max_bytes is None:
            return max(self._machine.record.disk_size_mib << 20, DEFAULT_READ_MAX)
        return _positive("max_bytes", max_bytes)


class Network:
    """A machine's network rules, enforced on the host where root in the guest cannot
    change them: `sbx.network.get()`, `.set(...)`, `.off()`. They hold from the next
    packet on and survive checkpoint, restore and fork."""

    def __init__(self, machine: Machine) -> None:
        self._machine = machine

    def get(self) -> dict:
        """`{"internet": bool, "allow": [...], "deny": [...]}`."""
        self._machine.reload()
        return self._machine.network.to_json()

    def set(self, internet: bool = True, allow: list[str] | None = None,
            deny: list[str] | None = None) -> dict:
        """With `internet`, every destination except `deny`; without, only `allow`. Rules are
        host names, wildcards (`*.example.com`) or CIDR ranges (`10.0.0.0/8`, `1.2.3.4`);
        `deny` wins. The host's loopback services (10.0.2.2 in the guest) are reachable
        only when an allow rule covers 127.0.0.1. A blocked connection is refused at once."""
        rules = NetworkRules.parse(internet=internet, allow=allow, deny=deny)
        self._machine.set_network(rules)
        return rules.to_json()

    def off(self) -> dict:
        """Cut the machine off: nothing in or out, names do not resolve."""
        return self.set(internet=False)


class Ports:
    """Guest services from the host: `sbx.ports.forward(8000).url` is an address on this
    host that leads to the guest's port 8000. A forward belongs to the machine: it answers
    again after restore, stop and start. The guest's service must listen on its network
    address or on 0.0.0.0 (not only on 127.0.0.1)."""

    def __init__(self, machine: Machine) -> None:
        self._machine = machine

    def forward(self, guest_port: int, host_port: int | None = None,
                host: str = LOCAL_HOST) -> PortForward:
        """Forward `host:host_port` (default: a free port on 127.0.0.1; another host address
        makes the guest's service reachable from outside this host) to `guest_port`."""
        return self._machine.forward_port(guest_port, host_port, host)

    def list(self) -> list[PortForward]:
        self._machine.reload()
        return list(self._machine.record.ports)

    def remove(self, guest_port: int) -> PortForward:
        """End the forward to `guest_port`; the forward it was."""
        return self._machine.remove_forward(guest_port)
