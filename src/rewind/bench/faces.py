"""The faces agents reach rewind through, beside the SDK: exec, checkpoint and restore
through the HTTP API (a `rewind serve` on loopback, via Sandbox.connect) and through MCP
(a `rewind mcp` on stdio, via the official client), and what a CLI command costs on its own.

Each figure is the time a face adds over the same call through the SDK, measured in pairs
on one machine that take turns to go first, so the guest's drift cancels out. A TCG guest's
own calls vary by tens of ms from one to the next (`exec true` 85-150 ms here), which no
number of pairs brings under a 5 ms target; so each face's own cost is also measured on a
call that reads the machine's record but not its guest (its network rules): that figure
is the one held to the target.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from anyio.from_thread import start_blocking_portal
from mcp import Client, StdioServerParameters

from rewind.bench.model import Report
from rewind.bench.ours import Progress, timed
from rewind.home import Home
from rewind.sandbox import Sandbox
from rewind.serve.process import home_env, serve_process

ADDED_TARGET_MS = 5.0  # what a face may add to a call on loopback
CLI_TARGET_S = 0.15  # a CLI command's own cost, before it does anything


@contextlib.contextmanager
def _mcp(home: Home) -> Iterator[Callable[..., Any]]:
    """A blocking `call(tool, **args)` into a `rewind mcp` subprocess on stdio."""
    env = {k: v for k, v in home_env(home).items() if k.startswith(("REWIND_", "PYTHON"))}
    params = StdioServerParameters(command=sys.executable, args=["-m", "rewind.cli", "mcp"], env=env)
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(Client(params)) as client:
        def call(tool: str, **args: Any) -> Any:
            result = portal.call(client.call_tool, tool, args)
            if result.is_error:
                raise RuntimeError(f"MCP {tool} failed: {result.content}")
            return result.structured_content
        yield call


def _added(n: int, sdk: Callable[[], object], face: Callable[[], object],
           between: Callable[[], object] = lambda: None) -> list[float]:
    """ms `face` takes over `sdk`, in `n` pairs taking turns to go first."""
    samples = []
    for i in range(n):
        runs = (face, sdk) if i % 2 else (sdk, face)
        first = timed(runs[0])
        between()
        second = timed(runs[1])
        between()
        samples.append(((first - second) if i % 2 else (second - first)) * 1000)
    return samples


def run_faces(home: Home, report: Report, rounds: int, quick: bool, progress: Progress) -> None:
    progress("faces: exec, checkpoint and restore through HTTP and MCP beside the SDK; the CLI's cost")
    sbx = Sandbox.create("faces", home=home)
    try:
        base = sbx.checkpoint(name="faces-base", wait=True)

        def settle() -> None:
            """Between calls: a restore's background commit is not the next call's cost."""
            sbx._engine.settle()
        light, heavy = (10, 1) if quick else (40, rounds)
        with serve_process(home, home.root / "bench-serve.log", ["--no-auth"]) as url, \
                Sandbox.connect(url) as remote, _mcp(home) as mcp:
            far = remote.get(sbx.name)
            # MCP's exec takes a shell string: the SDK runs the same one (bash in the guest costs).
            execs = {"http": (lambda: sbx.exec(["true"]), lambda: far.exec(["true"])),
                     "mcp": (lambda: sbx.exec("true"), lambda: mcp("exec", name=sbx.name, command="true"))}
            points = {"http": lambda: far.checkpoint(), "mcp": lambda: mcp("checkpoint", name=sbx.name)}
            restores = {"http": lambda: far.restore(base.id),
                        "mcp": lambda: mcp("restore", name=sbx.name, ref=base.id)}
            reads = {"http": (sbx.network.get, far.network.get),
                     "mcp": (sbx.network.get, lambda: mcp("network", name=sbx.name))}
            for face in ("http", "mcp"):
                what = "the HTTP API" if face == "http" else "MCP (stdio)"
                report.add(f"{face}_call_added_ms", f"a call through {what} that does not reach the guest "
                           "(network rules read), over the SDK", "ms", _added(light * 5, *reads[face]),
                           target=ADDED_TARGET_MS)
                report.add(f"{face}_exec_added_ms", f"exec round trip through {what}, over the SDK", "ms",
                           _added(light, *execs[face]))
                report.add(f"{face}_checkpoint_added_ms", f"checkpoint call through {what}, over the SDK",
                           "ms", _added(heavy * 2, sbx.checkpoint, points[face], settle))
                report.add(f"{face}_restore_added_ms", f"restore in place through {what}, over the SDK", "ms",
                           _added(heavy, lambda: sbx.restore(base.id), restores[face], settle))
        settle()  # the restores' background work is not the CLI's cost
        _cli(home, sbx, report, light)
    finally:
        sbx.delete()


def _cli(home: Home, sbx: Sandbox, report: Report, n: int) -> None:
    """A CLI command's own cost: `rewind --help`, and `rewind exec NAME -- true` over the SDK's exec."""
    def cli(*args: str) -> Callable[[], object]:
        return lambda: subprocess.run([sys.executable, "-m", "rewind.cli", *args], env=home_env(home),
                                      check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report.add("cli_help_s", "`rewind --help` (the CLI's imports and start)", "s",
               [timed(cli("--help")) for _ in range(max(3, n // 4))], target=CLI_TARGET_S)
    # Each call follows the same idle time: the CLI's exec reaches a guest that has idled
    # through the CLI's start, and an idle TCG guest answers 50-80 ms later than a busy one.
    report.add("cli_exec_added_s", "`rewind exec NAME -- true`, over the SDK's exec after the same idle time",
               "s", [ms / 1000 for ms in _added(max(3, n // 4), lambda: sbx.exec(["true"]),
                                                cli("exec", sbx.name, "--", "true"),
                                                between=lambda: time.sleep(0.3))], target=CLI_TARGET_S)

