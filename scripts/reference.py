"""Write the generated references: docs/reference/cli.md (every command's help, from the CLI
itself), docs/reference/http.md (every route, from the API's OpenAPI document) and
docs/reference/mcp.md (every MCP tool, from the server's own list). With --check, write
nothing and exit 1 if one is not what the code gives (tests/test_docs.py), so a verb, a
route or a tool cannot come without its page."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import click

from rewind.cli import cli
from rewind.home import Home
from rewind.serve.access import AccessPolicy
from rewind.serve.api import create_app
from rewind.serve.mcpserver import build_server
from rewind.serve.service import Service

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reference"
WIDTH = 100
METHODS = ("get", "post", "put", "patch", "delete")


def cli_page() -> str:
    lines = ["# Command line reference", "",
             "Generated from the CLI by `scripts/reference`; do not edit. The guide is "
             "[usage.md](../usage.md).", ""]

    def walk(command: click.Command, path: list[str], parent: click.Context | None) -> None:
        ctx = click.Context(command, info_name=path[-1], parent=parent, terminal_width=WIDTH,
                            max_content_width=WIDTH)
        lines.extend([f"## `{' '.join(path)}`", "", "```", command.get_help(ctx), "```", ""])
        if isinstance(command, click.Group):
            for name in sorted(command.commands):
                walk(command.commands[name], [*path, name], ctx)

    walk(cli, ["rewind"], None)
    return "\n".join(lines)


def http_page() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        home = Home(root=Path(tmp) / "home", images=Path(tmp) / "images")
        app = create_app(Service(home), None, AccessPolicy.for_bind("127.0.0.1", (), ()))
        while not hasattr(app, "openapi"):  # the FastAPI app, inside its middleware
            app = app.app
        spec = app.openapi()
    lines = ["# HTTP API reference", "",
             "Generated from the API's OpenAPI document by `scripts/reference`; do not edit. The "
             "whole document is served at `/openapi.json` (and `/docs`); the guide is "
             "[operations.md](../operations.md).", ""]
    by_tag: dict[str, list[str]] = {}
    for path, item in sorted(spec["paths"].items()):
        for method in METHODS:
            if method in item:
                op = item[method]
                summary = (op.get("description") or op.get("summary") or "").strip().split("\n\n")[0]
                row = f"| `{method.upper()}` | `{path}` | {' '.join(summary.split())} |"
                by_tag.setdefault((op.get("tags") or ["other"])[0], []).append(row)
    for tag in sorted(by_tag):
        lines.extend([f"## {tag}", "", "| method | path | what it does |", "| --- | --- | --- |",
                      *by_tag[tag], ""])
    return "\n".join(lines)


def mcp_page() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        home = Home(root=Path(tmp) / "home", images=Path(tmp) / "images")
        tools = asyncio.run(build_server(Service(home)).list_tools())
    lines = ["# MCP tools reference", "",
             "Generated from the MCP server's list of tools by `scripts/reference`; do not edit. "
             "`rewind mcp` serves them over stdio, `rewind serve` over HTTP at `/mcp`, under the default "
             "policy (`--policy open`; operations.md says what the others change); the guide is "
             "[operations.md](../operations.md).", ""]
    for tool in sorted(tools, key=lambda t: t.name):
        schema = tool.input_schema
        required = set(schema.get("required", ()))
        lines.extend([f"## `{tool.name}`", "", " ".join((tool.description or "").split()), ""])
        params = {k: v for k, v in schema.get("properties", {}).items() if k != "ctx"}
        if params:
            lines.extend(["| parameter | type | required | default |", "| --- | --- | --- | --- |"])
            for name, spec in params.items():
                default = f"`{json.dumps(spec['default'])}`" if "default" in spec else ""
                needed = "yes" if name in required else ""
                lines.append(f"| `{name}` | {_json_type(spec)} | {needed} | {default} |")
            lines.append("")
    return "\n".join(lines)


def _json_type(spec: dict) -> str:
    """A parameter's JSON type as a person reads it: `string`, `integer or null`."""
    kinds = [s.get("type", "any") for s in spec.get("anyOf", [spec])]
    return " or ".join(dict.fromkeys(kinds))


def main() -> None:
    pages = {DOCS / "cli.md": cli_page(), DOCS / "http.md": http_page(), DOCS / "mcp.md": mcp_page()}
    if "--check" in sys.argv[1:]:
        stale = [str(p.relative_to(DOCS.parent.parent)) for p, text in pages.items()
                 if not p.exists() or p.read_text() != text]
        if stale:
            sys.exit(f"out of date: {', '.join(stale)} (run scripts/reference)")
        return
    DOCS.mkdir(parents=True, exist_ok=True)
    for path, text in pages.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(DOCS.parent.parent)}")


if __name__ == "__main__":
    main()
