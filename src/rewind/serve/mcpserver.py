"""The MCP server: rewind's verbs as tools an agent's tool layer can call.

`rewind mcp` serves it over stdio; `rewind serve` mounts it at /mcp (streamable HTTP).
Every tool is a call into the shared Service; results are structured (JSON objects), and a
rewind error comes back as a tool error whose text starts with the error's class name.
The annotations say which tools only read and which can destroy state.
"""

from __future__ import annotations

import base64
import binascii
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.from_thread
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from rewind.errors import InvalidArgument, RewindError
from rewind.serve.policy import StepPolicy
from rewind.serve.service import Service

INSTRUCTIONS = """\
rewind runs commands in real Linux microVMs whose whole state (memory, processes, disk) can be
saved and taken back. Before a risky step, `checkpoint`; if it goes wrong, `restore` puts the
machine back in place. `try_in_copy` runs a step in a live copy and keeps it only if it (and a
check) pass. `classify` says what undo a command needs; `guarded_exec` runs it with that undo.
`exec` results carry the same verdict."""

# What the tools say of the operator's policy (serve/policy.py), added to their descriptions.
_GUARDED = """

This server's operator runs every step guarded: there is no raw `exec`; use `guarded_exec`."""
_CHECKPOINT_EACH = """

This server's operator has a checkpoint taken before every step (its id is in the result):
`restore` it to take the step back."""
_POLICY_EXTERNAL = """
Whether a step may act outside the machine is the operator's choice here: `allow_external`
is ignored, and such a step is refused unless the operator allowed it for the machine."""

F = TypeVar("F", bound=Callable[..., Any])

READ = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
WRITE = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
DESTROY = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)
# A command in the guest can do anything, including reach the internet.
RUN = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=True)


def _errors_as_tool_errors(fn: F) -> F:
    """A RewindError becomes a ToolError the model reads: 'NotFound: no machine named x'."""
    def name_it(e: RewindError) -> ToolError:
        return ToolError(f"{type(e).__name__}: {e}")

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except RewindError as e:
                raise name_it(e) from e
        return run_async  # type: ignore[return-value]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RewindError as e:
            raise name_it(e) from e
    return run  # type: ignore[return-value]


def build_server(service: Service) -> MCPServer:
    """The MCP server over `service` (its home and store)."""
    # WARNING: the SDK logs every request at INFO, which would flood `rewind serve`'s stderr.
    instructions = INSTRUCTIONS + (_GUARDED if service.config.policy.default is StepPolicy.GUARDED else "")
    server = MCPServer("rewind", instructions=instructions, version="0.1.0", log_level="WARNING")

    def tool(annotations: ToolAnnotations) -> Callable[[F], F]:
        def register(fn: F) -> F:
            server.tool(annotations=annotations)(_errors_as_tool_errors(fn))
            return fn
        return register

    @tool(WRITE)
    async def create(ctx: Context, name: str | None = None, labels: dict[str, str] | None = None,
                     from_checkpoint: str | None = None, at: str | None = None,
                     network: dict | None = None, image: str | None = None,
                     host_trust: bool | None = None, ttl: float | None = None,
                     on_expiry: str | None = None) -> dict[str, Any]:
        """Start a new machine (a few seconds), or one running from a checkpoint (`from_checkpoint`:
        an id, id prefix or name; `at`: such as ~2 to count back from it). `image`: one built
        with `rewind image build --from ...` (default: the built Debian one). `host_trust`: take the
        server host's CA certificates and proxy settings. `ttl`: seconds it may live, then
        `on_expiry` (stop, checkpoint or delete). Progress is reported."""
        steps = 0

        def progress(step: str) -> None:
            nonlocal steps
            steps += 1
            anyio.from_thread.run(ctx.report_progress, steps, None, step)

        return await anyio.to_thread.run_sync(functools.partial(
            service.create, name, labels=labels, from_checkpoint=from_checkpoint, at=at, network=network,
            image=image, host_trust=host_trust, ttl=ttl, on_expiry=on_expiry, progress=progress))

    @tool(WRITE)
    def set_ttl(name: str, ttl: float | None, on_expiry: str | None = None) -> dict[str, Any]:
        """Set or extend the machine's time to live to `ttl` seconds from now (null: none);
        then `on_expiry` (stop, checkpoint or delete) is done to it."""
        return service.set_ttl(name, ttl, on_expiry)

    @tool(READ)
    def list_images() -> dict[str, Any]:
        """The images `create` can make machines of (its `image`): id, default, size, source."""
        return {"images": service.images()}

    @tool(READ)
    def list_machines(labels: dict[str, str] | None = None) -> dict[str, Any]:
        """The machines on this host (optionally only those with all these labels)."""
        return {"machines": service.list(labels)}

    def exec(name: str, command: str, cwd: str | None = None, timeout: float | None = None,
             stdin: str | None = None) -> dict[str, Any]:
        """Run a shell command in machine `name` and wait for it. The result has exit_code, stdout,
        stderr and `verdict`: what undo the command needed (none, git, fork or external), and why."""
        return service.exec(name, command, cwd=cwd, timeout=timeout, stdin=stdin)

    policy = service.config.policy
    if policy.default is StepPolicy.CHECKPOINT_EACH:
        exec.__doc__ = (exec.__doc__ or "") + _CHECKPOINT_EACH
    if policy.default is not StepPolicy.GUARDED:  # under `guarded`, raw exec is not offered
        tool(RUN)(exec)

    def guarded_exec(name: str, command: str, verify: str | None = None, allow_external: bool = False,
                     cwd: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Run a shell command with the cheapest undo that covers it: reads run as is, project file
        changes are recorded by git and put back on failure, anything else runs in a copy kept only
        if it (and `verify`) pass. Commands acting outside the machine are refused unless
        `allow_external` (then the machine is checkpointed first)."""
        return service.guarded(name, command, verify=verify, allow_external=allow_external, cwd=cwd,
                               timeout=timeout)

    if policy.default is not StepPolicy.OPEN:
        guarded_exec.__doc__ = (guarded_exec.__doc__ or "") + _POLICY_EXTERNAL
    tool(RUN)(guarded_exec)

    @tool(RUN)
    def try_in_copy(name: str, step: str, verify: str | None = None, offline: bool = True,
                    cwd: str | None = None, timeout: float = 600.0, diff: bool = True) -> dict[str, Any]:
        """Run `step`, then `verify`, in a live copy of the machine (offline by default). If both
        exit 0 the copy replaces the machine; otherwise the machine never saw the step. `diff`:
        the result says what the step changed in the copy, kept or not."""
        return service.try_in_copy(name, step, verify, offline=offline, cwd=cwd, timeout=timeout, diff=diff)

    @tool(READ)
    def classify(command: str, cwd: str | None = None) -> dict[str, Any]:
        """Say what undo a shell command needs (none, git, fork, external) without running it."""
        return service.classify(command, cwd)

    @tool(WRITE)
    def checkpoint(name: str, point_name: str | None = None, labels: dict[str, str] | None = None,
                   context: str | None = None) -> dict[str, Any]:
        """Save the whole machine (memory, processes, disk) as of now; it runs on. `context` is your
        own state to keep with it (the plan, what you have done so far; up to 64 KiB of text):
        `history` and `restore` give it back."""
        return service.checkpoint(name, point_name, labels, context=context)

    @tool(READ)
    def history(name: str) -> dict[str, Any]:
        """The machine's checkpoints, newest first, as ~0, ~1, ..."""
        return {"checkpoints": service.history(name)}

    @tool(READ)
    def diff(name: str, before: str = "~0", after: str | None = None, all: bool = False,
             paths: list[str] | None = None) -> dict[str, Any]:
        """What changed from checkpoint `before` (default ~0, the last) to checkpoint `after` or,
        without it, the machine now: files added, deleted and modified, Debian packages,
        processes started and ended, listening sockets, network rules, labels. `all` adds the
        noise (logs, caches); `paths` keeps only paths matching these globs."""
        return service.diff(name, before, after, all=all, paths=paths)

    @tool(DESTROY)
    def restore(name: str, ref: str) -> dict[str, Any]:
        """Put the machine back to a checkpoint (~N, an id prefix or a name) in place: processes,
        memory and disk. The state it leaves is saved first, so this too can be undone."""
        return service.restore(name, ref)

    @tool(WRITE)
    def fork(name: str, count: int = 1, labels: dict[str, str] | None = None) -> dict[str, Any]:
        """`count` live copies of the machine from this moment, each its own machine."""
        return {"machines": service.fork(name, count, labels=labels)}

    @tool(WRITE)
    def network(name: str, internet: bool | None = None, allow: list[str] | None = None,
                deny: list[str] | None = None) -> dict[str, Any]:
        """The machine's network rules; given any of internet/allow/deny, set them first. Rules are
        host names, wildcards (*.example.com) or CIDR ranges; deny wins."""
        if internet is None and allow is None and deny is None:
            return service.network(name)
        return service.set_network(name, internet=True if internet is None else internet, allow=allow,
                                   deny=deny)

    @tool(WRITE)
    def port(name: str, guest_port: int | None = None, host_port: int | None = None,
             remove: bool = False) -> dict[str, Any]:
        """Reach a service in the machine from the host: given guest_port, forward a port on the
        host's 127.0.0.1 (host_port, default a free one) to it and give its address; with
        remove, end that forward; without guest_port, list the forwards. The service must
        listen on 0.0.0.0 in the guest. Forwards survive restore, stop and start."""
        if guest_port is None:
            return {"ports": service.ports(name)}
        if remove:
            return service.remove_port(name, guest_port)
        return service.forward_port(name, guest_port, host_port)

    @tool(READ)
    def read_file(name: str, path: str) -> dict[str, Any]:
        """A file of the machine: `text` if it is UTF-8, else `base64`."""
        data = service.read_file(name, path)
        try:
            return {"path": path, "size": len(data), "text": data.decode()}
        except UnicodeDecodeError:
            return {"path": path, "size": len(data), "base64": base64.b64encode(data).decode()}

    @tool(WRITE)
    def write_file(name: str, path: str, text: str | None = None, base64_data: str | None = None,
                   mode: int | None = None) -> dict[str, Any]:
        """Write a whole file (parents are created) from `text` or `base64_data`."""
        if (text is None) == (base64_data is None):
            raise InvalidArgument("give exactly one of text or base64_data")
        try:
            data = text.encode() if text is not None else base64.b64decode(base64_data or "", validate=True)
        except binascii.Error as e:
            raise InvalidArgument(f"base64_data is not base64: {e}") from e
        service.write_file(name, path, data, mode)
        return {"path": path, "size": len(data)}

    @tool(WRITE)
    def upload_dir(name: str, local: str, path: str) -> dict[str, Any]:
        """Copy the folder `local`, on the server's host, into the machine as `cp -r` does: to
        `path` if nothing is there, into it if it is a folder (never merged into an existing
        one). Files, folders and links keep their modes and mtimes. What was copied."""
        return service.upload_dir(name, local, path)

    @tool(WRITE)
    def download_dir(name: str, path: str, local: str) -> dict[str, Any]:
        """Copy the machine's folder `path` to `local` on the server's host, by upload_dir's rules."""
        return service.download_dir(name, path, local)

    @tool(DESTROY)
    def delete(name: str) -> dict[str, Any]:
        """Stop the machine and remove it; its checkpoints stay in the store."""
        service.delete(name)
        return {"deleted": name}

    return server

