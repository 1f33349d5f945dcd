"""The `rewind` command line: a thin face over the SDK and the engine.

Every verb that reports something takes --json. Errors are one line on
stderr and a non-zero exit (1 for rewind's errors, 2 for bad usage).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from rewind.engine.machine import DEFAULT_CPUS, DEFAULT_MEMORY_MIB, Engine
from rewind.engine.qemu import QEMU_BINARY
from rewind.engine.template import find_template
from rewind.errors import ImageError, InvalidArgument, RewindError
from rewind.image import build_image, find_image, import_image, list_images, recipe_id
from rewind.sandbox import Sandbox

err_console = Console(stderr=True)
_SIZE = re.compile(r"(\d+)\s*([MG]i?B?)?", re.IGNORECASE)


def parse_mib(text: str) -> int:
    """'512', '512M', '1G', '2GiB' -> MiB."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (examples: 512M, 1G)")
    value = int(m.group(1))
    return value * 1024 if (m.group(2) or "M").upper().startswith("G") else value


def parse_pairs(pairs: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{what} must look like KEY=VALUE, not {pair!r}")
        out[key] = value
    return out


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@contextmanager
def progress(enabled: bool) -> Iterator[Callable[[str], None]]:
    """Steps of long work on stderr, each with the time it started."""
    if not enabled:
        yield lambda _: None
        return
    started = time.monotonic()
    with err_console.status("working...") as status:
        def report(step: str) -> None:
            err_console.print(f"[dim]{time.monotonic() - started:6.1f}s[/dim] {step}")
            status.update(step)
        yield report


json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rewind")
def cli() -> None:
    """rewind: real machines for AI agents, with an undo button."""


@cli.command()
@click.argument("name")
@click.option("--memory", default=f"{DEFAULT_MEMORY_MIB}M", show_default=True, help="Guest memory.")
@click.option("--cpus", default=DEFAULT_CPUS, show_default=True, type=int, help="Virtual CPUs.")
@click.option("--disk", default=None, help="Root disk size (default: the image's, 8G).")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE; repeatable.")
@click.option("--image", "image_name", default=None, help="An imported image (default: the built one).")
@json_option
def start(name: str, memory: str, cpus: int, disk: str | None, labels: tuple[str, ...],
          image_name: str | None, as_json: bool) -> None:
    """Start machine NAME: a new one, or a stopped one again."""
    engine = Engine()
    existing = {m.name for m in engine.list()}
    with progress(not as_json) as report:
        if name in existing:
            sbx = Sandbox.get(name)
            sbx.start(report)
        else:
            sbx = Sandbox.create(name, memory=parse_mib(memory), cpus=cpus,
                                 disk=parse_mib(disk) if disk else 0, image=image_name,
                                 labels=parse_pairs(labels, "--label"), progress=report)
    info = sbx.info()
    if as_json:
        emit_json(dataclasses.asdict(info))
    else:
        click.echo(f"{info.name} is {info.status} ({info.memory_mib} MiB, {info.cpus} vCPUs, {info.accel})")


@cli.command(name="exec")
@click.argument("name")
@click.argument("command", nargs=-1, required=True)
@click.option("--cwd", default=None, help="Working directory in the guest (default /root).")
@click.option("--env", "envs", multiple=True, help="KEY=VALUE; repeatable.")
@click.option("--timeout", type=float, default=None, help="Kill the command after this many seconds.")
@click.option("-i", "--interactive", is_flag=True, help="Pass this process's stdin to the command.")
@json_option
def exec_(name: str, command: tuple[str, ...], cwd: str | None, envs: tuple[str, ...],
          timeout: float | None, interactive: bool, as_json: bool) -> None:
    """Run COMMAND in machine NAME: `rewind exec NAME -- CMD ARGS...`.

    One argument runs under `bash -c`; several run the program directly.
    Output streams as it comes; rewind exits with the command's exit code.
    """
    cmd: str | list[str] = command[0] if len(command) == 1 else list(command)
    stdin = sys.stdin.buffer.read() if interactive else None

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def err(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    result = Sandbox.get(name).exec(cmd, cwd=cwd, env=parse_pairs(envs, "--env"), timeout=timeout,
                                    stdin=stdin, on_stdout=None if as_json else out,
                                    on_stderr=None if as_json else err)
    if as_json:
        emit_json(dataclasses.asdict(result))
    elif result.timed_out:
        err_console.print(f"rewind: the command timed out after {timeout:g} s and was killed")
    sys.exit(result.exit_code)


def _split_remote(spec: str) -> tuple[str, str] | None:
    name, sep, path = spec.partition(":")
    if sep and name and "/" not in name and path.startswith("/"):
        return name, path
    return None


@cli.command()
@click.argument("source")
@click.argument("dest")
@json_option
def cp(source: str, dest: str, as_json: bool) -> None:
    """Copy a file between this host and a machine: `cp FILE NAME:/path` or `cp NAME:/path FILE`."""
    src_remote, dst_remote = _split_remote(source), _split_remote(dest)
    if bool(src_remote) == bool(dst_remote):
        raise InvalidArgument("exactly one of SOURCE and DEST must be NAME:/absolute/path")
    started = time.monotonic()
    if dst_remote:
        Sandbox.get(dst_remote[0]).files.upload(source, dst_remote[1])
    else:
        assert src_remote
        Sandbox.get(src_remote[0]).files.download(src_remote[1], dest)
    if as_json:
        emit_json({"source": source, "dest": dest, "seconds": round(time.monotonic() - started, 3)})


@cli.command(name="ls")
@click.option("--label", "labels", multiple=True, help="Only machines with KEY=VALUE; repeatable.")
@json_option
def ls(labels: tuple[str, ...], as_json: bool) -> None:
    """List machines and their status (running, stopped, dead)."""
    infos = [m.info() for m in Engine().list(parse_pairs(labels, "--label"))]
    if as_json:
        emit_json([dataclasses.asdict(i) for i in infos])
        return
    table = Table(box=None)
    for column in ("NAME", "STATUS", "MEMORY", "CPUS", "PID", "LABELS"):
        table.add_column(column)
    for i in infos:
        style = {"running": "green", "dead": "red"}.get(i.status, "")
        table.add_row(i.name, f"[{style}]{i.status}[/]" if style else i.status, f"{i.memory_mib}M",
                      str(i.cpus), str(i.pid or "-"), ",".join(f"{k}={v}" for k, v in i.labels.items()))
    Console().print(table)


@cli.command()
@click.argument("name")
@json_option
def stop(name: str, as_json: bool) -> None:
    """Stop machine NAME (its disk is kept)."""
    Sandbox.get(name).stop()
    if as_json:
        emit_json({"name": name, "status": "stopped"})


@cli.command()
@click.argument("names", nargs=-1, required=True)
@json_option
def rm(names: tuple[str, ...], as_json: bool) -> None:
    """Delete machines: stop them and remove all they had."""
    for name in names:
        Sandbox.get(name).delete()
    if as_json:
        emit_json({"removed": list(names)})


@cli.group()
def image() -> None:
    """The guest image."""


@image.command(name="build")
@click.option("--force", is_flag=True, help="Rebuild even if the current recipe is built.")
@json_option
def image_build(force: bool, as_json: bool) -> None:
    """Build the default guest image (Debian packages) and its booted template."""
    engine = Engine()
    started = time.monotonic()
    with progress(not as_json) as report:
        built = build_image(engine.home.images, force=force, report=report)
        accel = engine.accel()
        report(f"accelerator: {accel.accel} ({accel.reason})")
        engine.template(DEFAULT_MEMORY_MIB, DEFAULT_CPUS, report=report)
    data = {"id": built.id, "path": str(built.path), "kernel": built.kernel_version,
            "accel": accel.accel, "seconds": round(time.monotonic() - started, 1)}
    if as_json:
        emit_json(data)
    else:
        click.echo(f"image {built.id} ready at {built.path}")


@image.command(name="import")
@click.argument("name")
@click.option("--kernel", required=True, type=click.Path(dir_okay=False), help="The guest kernel.")
@click.option("--initrd", required=True, type=click.Path(dir_okay=False), help="Its initramfs.")
@click.option("--disk", required=True, type=click.Path(dir_okay=False), help="Root disk, raw or qcow2.")
@json_option
def image_import(name: str, kernel: str, initrd: str, disk: str, as_json: bool) -> None:
    """Add an image of your own as NAME (use it with `rewind start --image NAME`).

    The guest must mount /dev/vda as its root and run rewind's guest agent as root
    (see the README); the default image shows how.
    """
    imported = import_image(Engine().home.images, name, Path(kernel), Path(initrd), Path(disk))
    if as_json:
        emit_json({"id": imported.id, "path": str(imported.path), "disk_size_mib": imported.disk_size_mib})
    else:
        click.echo(f"image {imported.id} imported at {imported.path}")


@image.command(name="ls")
@json_option
def image_ls(as_json: bool) -> None:
    """List images; the default one is the built recipe's."""
    default = recipe_id()
    rows = [{"id": i.id, "default": i.id == default, "kernel": i.kernel_version,
             "disk_size_mib": i.disk_size_mib, "path": str(i.path)}
            for i in list_images(Engine().home.images)]
    if as_json:
        emit_json(rows)
        return
    for row in rows:
        click.echo(f"{row['id']:20} {'default' if row['default'] else '':8} {row['kernel']:16} {row['path']}")


@cli.command()
@json_option
def doctor(as_json: bool) -> None:
    """What this host gives rewind: QEMU, accelerator, image, templates."""
    engine = Engine()
    qemu = subprocess.run([QEMU_BINARY, "--version"], capture_output=True, text=True, check=False)
    report: dict[str, Any] = {
        "home": str(engine.home.root),
        "images": str(engine.home.images),
        "qemu": qemu.stdout.splitlines()[0] if qemu.returncode == 0 else None,
        "image_recipe": recipe_id(),
    }
    try:
        img = find_image(engine.home.images)
        choice = engine.accel()
        report.update(image="built", image_path=str(img.path), kernel=img.kernel_version,
                      accel=choice.accel, accel_reason=choice.reason, accel_source=choice.source,
                      default_template="ready" if find_template(img, choice.accel, DEFAULT_MEMORY_MIB,
                                                                DEFAULT_CPUS) else "not saved yet")
    except ImageError as e:
        report.update(image=str(e), accel=None)
    report["machines"] = {m.name: m.status() for m in engine.list()}
    if as_json:
        emit_json(report)
        return
    for key, value in report.items():
        click.echo(f"{key:>16}: {value}")


@cli.command()
@click.option("--keep", is_flag=True, help="Leave the demo machine running afterwards.")
def demo(keep: bool) -> None:
    """Start a machine, run a few commands in it, show what they print."""
    engine = Engine()
    with progress(True) as report:
        build_image(engine.home.images, report=report)
        engine.template(DEFAULT_MEMORY_MIB, DEFAULT_CPUS, report=report)
    started = time.monotonic()
    sbx = Sandbox.create(labels={"role": "demo"})
    click.echo(f"started machine {sbx.name} in {time.monotonic() - started:.2f} s")
    try:
        for cmd in ["uname -srm && hostname", "python3 -c 'import sys; print(sys.version)'",
                    "mkdir -p /work && cd /work && git init -q && echo hi > a.txt && git add a.txt"
                    " && git -c user.email=a@b -c user.name=demo commit -qm first && git log --oneline",
                    "echo to stderr >&2; exit 3"]:
            click.echo(click.style(f"$ {cmd}", bold=True))
            t = time.monotonic()
            r = sbx.exec(cmd, on_stdout=lambda s: click.echo(s, nl=False),
                         on_stderr=lambda s: click.echo(click.style(s, fg="red"), nl=False, err=True))
            click.echo(click.style(f"  exit {r.exit_code} in {time.monotonic() - t:.2f} s", dim=True))
    finally:
        if keep:
            click.echo(f"machine {sbx.name} is still running; `rewind rm {sbx.name}` removes it")
        else:
            sbx.delete()
            click.echo(f"deleted {sbx.name}")


def main() -> None:
    logging.basicConfig(format="rewind: %(message)s", level=logging.WARNING)
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("rewind: interrupted")
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"rewind: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except RewindError as e:
        click.echo(f"rewind: error: {e}", err=True)
        sys.exit(1)
    except OSError as e:
        click.echo(f"rewind: error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", err=True)
        sys.exit(1)
    except Exception as e:  # a bug of ours: still one line, the traceback on request
        if os.environ.get("REWIND_DEBUG"):
            raise
        click.echo(f"rewind: internal error: {type(e).__name__}: {e} (REWIND_DEBUG=1 shows where)", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("rewind: interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
