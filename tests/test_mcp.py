"""The MCP server through the official MCP client, in memory and as a `rewind mcp` stdio
subprocess, on real guests: create, exec, checkpoint, `rm -rf`, restore, a failed try,
classify, and errors as tool errors naming their class."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from serving import home_env

from rewind import Home, Sandbox
from rewind.serve.mcpserver import build_server
from rewind.serve.service import Service


def _run(home: Home, session: Callable[[Client], Awaitable[None]], stdio: bool = False) -> None:
    """Run `session` against the server over `home`: in memory, or as `rewind mcp` on stdio."""
    async def main() -> None:
        target: Any = build_server(Service(home))
        if stdio:
            env = {k: v for k, v in home_env(home).items() if k.startswith(("REWIND_", "PYTHON"))}
            target = StdioServerParameters(command=sys.executable, args=["-m", "rewind.cli", "mcp"], env=env)
        async with Client(target, read_timeout_seconds=300) as client:
            await session(client)
    anyio.run(main)


async def _call(client: Client, tool: str, **args: Any) -> dict:
    result = await client.call_tool(tool, args)
    assert not result.is_error, result.content
    return result.structured_content


async def _error(client: Client, tool: str, **args: Any) -> str:
    result = await client.call_tool(tool, args)
    assert result.is_error
    return result.content[0].text


@pytest.fixture(scope="module")
def machine(shared_home: Home) -> str:
    return Sandbox.create("mcp", home=shared_home).name


def test_tools_say_which_only_read_and_which_destroy(shared_home: Home) -> None:
    async def session(client: Client) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert {"create", "list_machines", "exec", "guarded_exec", "try_in_copy", "classify", "checkpoint",
                "history", "restore", "fork", "network", "read_file", "write_file", "delete"} <= set(tools)
        for name in ("classify", "history", "list_machines", "read_file"):
            assert tools[name].annotations.read_only_hint, name
        for name in ("restore", "delete", "exec"):
            assert tools[name].annotations.destructive_hint and not tools[name].annotations.read_only_hint
        assert tools["exec"].output_schema is not None
    _run(shared_home, session)


def test_checkpoint_rm_rf_restore_in_memory(shared_home: Home, machine: str) -> None:
    async def session(client: Client) -> None:
        await _call(client, "write_file", name=machine, path="/root/work/plan.md", text="step 1\n")
        point = await _call(client, "checkpoint", name=machine, point_name="before-rm", context="plan v1")
        ran = await _call(client, "exec", name=machine, command="rm -rf /root/work && ls /root")
        assert ran["exit_code"] == 0 and ran["verdict"]["kind"] == "git"
        assert (await _error(client, "read_file", name=machine, path="/root/work/plan.md")).startswith(
            "Error executing tool read_file: GuestFileError")
        restored = await _call(client, "restore", name=machine, ref="before-rm")
        assert (restored["id"], restored["context"]) == (point["id"], "plan v1")
        back = await _call(client, "read_file", name=machine, path="/root/work/plan.md")
        assert back["text"] == "step 1\n"
        history = (await _call(client, "history", name=machine))["checkpoints"]
        assert (history[0]["name"], history[0]["context"]) == ("before-rm", "plan v1")
    _run(shared_home, session)


def test_a_failed_try_leaves_the_machine_untouched(shared_home: Home, machine: str) -> None:
    async def session(client: Client) -> None:
        await _call(client, "write_file", name=machine, path="/root/keep.txt", text="kept\n")
        tried = await _call(client, "try_in_copy", name=machine, step="rm -f /root/keep.txt && exit 7")
        assert (tried["kept"], tried["passed"], tried["step"]["exit_code"]) == ("original", False, 7)
        assert (await _call(client, "read_file", name=machine, path="/root/keep.txt"))["text"] == "kept\n"
        assert (await _call(client, "classify", command="git push origin main"))["kind"] == "external"
        refused = await _error(client, "guarded_exec", name=machine, command="git push origin main")
        assert "Refused: refused:" in refused
        assert "NotFound" in await _error(client, "exec", name="no-such-machine", command="true")
    _run(shared_home, session)


def test_create_and_delete_through_mcp(shared_home: Home) -> None:
    async def session(client: Client) -> None:
        made = await _call(client, "create", name="made-by-mcp", labels={"via": "mcp"})
        assert made["status"] == "running"
        listed = await _call(client, "list_machines", labels={"via": "mcp"})
        assert [m["name"] for m in listed["machines"]] == ["made-by-mcp"]
        ran = await _call(client, "exec", name="made-by-mcp", command="hostname")
        assert ran["stdout"] == "made-by-mcp\n"
        await _call(client, "delete", name="made-by-mcp")
        assert (await _call(client, "list_machines", labels={"via": "mcp"}))["machines"] == []
    _run(shared_home, session)


def test_stdio_subprocess_serves_the_same_tools(shared_home: Home, machine: str) -> None:
    async def session(client: Client) -> None:
        assert (await _call(client, "classify", command="rm -rf /"))["kind"] == "fork"
        await _call(client, "write_file", name=machine, path="/root/stdio.txt", text="over stdio\n")
        point = await _call(client, "checkpoint", name=machine)
        await _call(client, "exec", name=machine, command="rm -rf /root/stdio.txt")
        await _call(client, "restore", name=machine, ref=point["id"])
        ran = await _call(client, "exec", name=machine, command="cat /root/stdio.txt")
        assert ran["stdout"] == "over stdio\n"
        tried = await _call(client, "try_in_copy", name=machine, step="rm /root/stdio.txt", verify="false")
        assert tried["kept"] == "original"
        kept = await _call(client, "read_file", name=machine, path="/root/stdio.txt")
        assert kept["text"] == "over stdio\n"
    _run(shared_home, session, stdio=True)
