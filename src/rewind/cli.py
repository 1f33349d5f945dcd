"""The `rewind` command line: a thin face over the SDK and the engine.

Every verb that reports something takes --json. Errors are one line on
stderr and a non-zero exit (1 for rewind's errors, 2 for bad usage).

With REWIND_URL set, the verbs that act on machines and checkpoints go to that
`rewind serve` daemon (REWIND_TOKEN is its token); the others run on this host.

Each verb imports what it uses: `rewind exec` then starts in about 0.13 s, where
importing everything up front cost 0.4 s (measured on the 2-core host).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rewind import crashpoints
from rewind.engine import DEFAULT_CPUS, DEFAULT_MEMORY_MIB
from rewind.errors import ImageError, InvalidArgument, NotFound, RewindError
from rewind.store.model import DEFAULT_HISTORY

if TYPE_CHECKING:
    from rewind.engine.engine import Engine
    from rewind.results import Checkpoint
    from rewind.sandbox import Sandbox
    from rewind.serve.client import Remote, RemoteSandbox
    from rewind.store import CheckpointManifest, Store

_SIZE = re.compile(r"(\d+)\s*([MG]i?B?)?", re.IGNORECASE)


def parse_mib(text: str) -> int:
    """'512', '512M', '1G', '2GiB' -> MiB."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (examples: 512M, 1G)")
    value = int(m.group(1))
    return value * 1024 if (m.group(2) or "M").upper().startswith("G") else value


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '2h', '1d' -> seconds."""
    m = _DURATION.fullmatch(text.strip())
    if not m:
        raise click.BadParameter(f"{text!r} is not a duration (examples: 90s, 30m, 2h, 1d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2).lower()]


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
    from rich.console import Console

    console = Console(stderr=True)
    started = time.monotonic()
    with console.status("working...") as status:
        def report(step: str) -> None:
            console.print(f"[dim]{time.monotonic() - started:6.1f}s[/dim] {step}")
            status.update(step)
        yield report


def _engine() -> Engine:
    from rewind.engine.engine import Engine

    return Engine()


def _remote() -> Remote | None:
    """The daemon at $REWIND_URL, if one is set: verbs on machines and checkpoints go there."""
    if not os.environ.get("REWIND_URL"):
        return None
    from rewind.serve.client import Remote

    return Remote()


def _sandbox(name: str, store_dir: str | None = None) -> Sandbox | RemoteSandbox:
    """Machine NAME: through the daemon at $REWIND_URL if set, else on this host."""
    remote = _remote()
    if remote is None:
        from rewind.sandbox import Sandbox

        return Sandbox.get(name, store=store_dir)
    if store_dir is not None:
        raise InvalidArgument("--store names a store on this host; unset REWIND_URL to use it")
    return remote.get(name)


def _local_only(what: str) -> None:
    if os.environ.get("REWIND_URL"):
        raise InvalidArgument(f"{what} works on this host's store only; unset REWIND_URL to use it")


json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
store_option = click.option("--store", "store_dir", default=None, type=click.Path(file_okay=False),
                            help="Checkpoint store: a folder, or s3://bucket/prefix "
                                 "(default: $REWIND_STORE, else $REWIND_HOME/store).")
unsigned_option = click.option("--allow-unsigned", is_flag=True,
                               help="Also take a point no one signed (made before signing) from a shared "
                                    "store or a file (default: $REWIND_ALLOW_UNSIGNED; see `rewind trust`).")


def _unsigned(flag: bool) -> bool | None:
    """--allow-unsigned given: True; not given: None, which leaves it to $REWIND_ALLOW_UNSIGNED
    and the store (signers.check_signed). A daemon judges by its own setting."""
    if flag and _remote() is not None:
        raise InvalidArgument("--allow-unsigned works on this host only; unset REWIND_URL to use it")
    return True if flag else None



def policy_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The operator's policy for the steps agents run (docs/operations.md, "Policy")."""
    steps = ["open", "guarded", "checkpoint-each"]
    for option in reversed([
        click.option("--policy", "step_policy", type=click.Choice(steps), default="open", show_default=True,
                     help="open: exec runs as asked; guarded: every exec runs guarded (no raw exec over "
                          "MCP); checkpoint-each: a checkpoint before every exec."),
        click.option("--machine-policy", multiple=True, metavar="NAME=POLICY",
                     help="Another policy for machine NAME; repeatable."),
        click.option("--allow-external", multiple=True, metavar="NAME",
                     help="Under a policy, let machine NAME (or * for all) run steps that act outside it; "
                          "repeatable."),
    ]):
        fn = option(fn)
    return fn


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
@click.option("--internet/--no-internet", default=True, show_default=True,
              help="A new machine's network: everything but --deny, or only --allow.")
@click.option("--allow", multiple=True, help="Host name, *.domain or CIDR it may reach; repeatable.")
@click.option("--deny", multiple=True, help="Host name, *.domain or CIDR it may not reach; repeatable.")
@click.option("--host-trust/--no-host-trust", default=None,
              help="A new machine takes this host's CA certificates and proxy settings "
                   "[default: $REWIND_HOST_TRUST, off].")
@click.option("--ttl", default=None, help="How long a new machine may live (30m, 2h); see `rewind ttl`.")
@click.option("--on-expiry", type=click.Choice(["stop", "checkpoint", "delete"]), default="stop",
              show_default=True, help="What its time's end does to it.")
@json_option
def start(name: str, memory: str, cpus: int, disk: str | None, labels: tuple[str, ...],
          image_name: str | None, internet: bool, allow: tuple[str, ...], deny: tuple[str, ...],
          host_trust: bool | None, ttl: str | None, on_expiry: str, as_json: bool) -> None:
    """Start machine NAME: a new one, or a stopped one again."""
    from rewind.sandbox import Sandbox

    remote = _remote()
    maker: Sandbox | Remote = Sandbox if remote is None else remote  # type: ignore[assignment]
    existing = {m.name for m in (_engine().list() if remote is None else remote.list())}
    with progress(not as_json) as report:
        if name in existing:
            sbx = _sandbox(name)
            sbx.start(report)
        else:
            sbx = maker.create(name, memory=parse_mib(memory), cpus=cpus,
                               disk=parse_mib(disk) if disk else 0, image=image_name,
                               labels=parse_pairs(labels, "--label"), progress=report,
                               network={"internet": internet, "allow": list(allow), "deny": list(deny)},
                               host_trust=host_trust, ttl=parse_duration(ttl) if ttl else None,
                               on_expiry=on_expiry)
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
@click.option("--guard", is_flag=True, help="Undo it if it fails, by the cheapest means that covers it.")
@click.option("--verify", default=None, help="With --guard: a check that must pass too.")
@click.option("--allow-external", is_flag=True, help="With --guard: run steps that act outside the machine.")
@click.option("--offline", is_flag=True, help="With --guard: a step run in a copy gets no network.")
@json_option
def exec_(name: str, command: tuple[str, ...], cwd: str | None, envs: tuple[str, ...],
          timeout: float | None, interactive: bool, guard: bool, verify: str | None, allow_external: bool,
          offline: bool, as_json: bool) -> None:
    """Run COMMAND in machine NAME: `rewind exec NAME -- CMD ARGS...`.

    One argument runs under `bash -c`; several run the program directly.
    Output streams as it comes; rewind exits with the command's exit code.
    With --guard the command is classified first (see `rewind classify`) and
    taken back if it or --verify fails; the path taken is reported on stderr.
    """
    if guard:
        _guarded_exec(name, " ".join(command), cwd=cwd, timeout=timeout, verify=verify,
                      allow_external=allow_external, offline=offline, as_json=as_json)
        return
    if verify or allow_external or offline:
        raise InvalidArgument("--verify, --allow-external and --offline go with --guard")
    cmd: str | list[str] = command[0] if len(command) == 1 else list(command)
    stdin = sys.stdin.buffer.read() if interactive else None

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def err(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    result = _sandbox(name).exec(cmd, cwd=cwd, env=parse_pairs(envs, "--env"), timeout=timeout,
                                    stdin=stdin, on_stdout=None if as_json else out,
                                    on_stderr=None if as_json else err)
    if as_json:
        emit_json(dataclasses.asdict(result))
    elif result.timed_out:
        click.echo(f"rewind: the command timed out after {timeout:g} s and was killed", err=True)
    sys.exit(result.exit_code)


def _guarded_exec(name: str, command: str, *, cwd: str | None, timeout: float | None, verify: str | None,
                  allow_external: bool, offline: bool, as_json: bool) -> None:
    done = _sandbox(name).guarded(command, verify=verify, allow_external=allow_external, cwd=cwd,
                                     timeout=timeout, offline=offline)
    if as_json:
        emit_json(done.to_json())
    else:
        for result in (done.result, done.verify):
            if result is not None:
                sys.stdout.write(result.stdout)
                sys.stderr.write(result.stderr)
        click.echo(f"rewind: {done.kind} -> {done.path}: {done.note} ({done.seconds:.2f} s)", err=True)
    sys.exit(0 if done.ok else (done.result.exit_code or 1) if done.result else 1)


@cli.command()
@click.argument("command", nargs=-1, required=True)
@click.option("--cwd", default=None, help="The project folder: the command's working directory.")
@click.option("--explain", is_flag=True, help="Say which rule, table entry or shell construct decided.")
@click.option("--rules", "rules_file", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Read rules from this file only (default: rewind.toml here or above, then the user's).")
@json_option
def classify(command: tuple[str, ...], cwd: str | None, explain: bool, rules_file: str | None,
             as_json: bool) -> None:
    """Say what undo COMMAND needs: none, git, fork or external (`rewind classify -- CMD`)."""
    from rewind.guard.classify import classify as classify_command
    from rewind.guard.userrules import find_rules, read_rules
    from rewind.guard.verdicts import explained

    remote, text = _remote(), " ".join(command)
    if remote is None:
        rules = read_rules(Path(rules_file)) if rules_file else find_rules()
        decision = classify_command(text, cwd=cwd, rules=rules)
    elif rules_file:
        raise InvalidArgument("--rules is a file on this host; unset REWIND_URL to use it")
    else:
        decision = remote.classify(text, cwd)  # by the server's rules
    if as_json:
        emit_json(decision.to_json())
        return
    click.echo(decision.kind)
    for reason, source in zip(decision.reasons, decision.decided_by, strict=True):
        click.echo(f"  {reason}")
        if explain:
            click.echo(f"    decided by {explained(source)}")
    if explain and decision.unknown_programs:
        click.echo(f"  a fork only because no rule or table knows: {', '.join(decision.unknown_programs)}")


@cli.command(name="try")
@click.argument("name")
@click.argument("step", nargs=-1, required=True)
@click.option("--verify", default=None, help="A check run after the step; both must exit 0 (default: none).")
@click.option("--online", is_flag=True, help="Let the copy use the network (by default it has none).")
@click.option("--cwd", default=None, help="Working directory in the guest (default /root).")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds for each command.")
@click.option("--diff", "show_diff", is_flag=True,
              help="Say what the step changed in the copy (with --json: its `diff`).")
@store_option
@json_option
def try_(name: str, step: tuple[str, ...], verify: str | None, online: bool, cwd: str | None, timeout: float,
         show_diff: bool, store_dir: str | None, as_json: bool) -> None:
    """Run STEP in a live copy of machine NAME and keep the copy only if it (and --verify) pass."""
    from rewind.sandbox import try_in_copy

    outcome = try_in_copy(_sandbox(name, store_dir), " ".join(step), verify, offline=not online,
                          cwd=cwd, timeout=timeout, diff=show_diff)
    if as_json:
        emit_json(outcome.to_json())
    else:
        sys.stdout.write(outcome.log)
        click.echo(f"rewind: {outcome.reason} ({outcome.seconds:.2f} s)", err=True)
        if show_diff:
            if outcome.diff is None:
                click.echo("rewind: what the step changed is not known (see the warning above)", err=True)
            else:
                from rewind.difftext import lines

                for line in lines(outcome.diff):
                    click.echo(line, err=True)
    sys.exit(0 if outcome.passed else 1)


@cli.command()
@click.argument("name")
@click.option("--off", is_flag=True, help="Cut the machine off the network.")
@click.option("--internet/--no-internet", default=None, help="Reach everything but --deny, or only --allow.")
@click.option("--allow", multiple=True, help="Host name, *.domain or CIDR; repeatable; replaces the list.")
@click.option("--deny", multiple=True, help="Host name, *.domain or CIDR; repeatable; replaces the list.")
@json_option
def network(name: str, off: bool, internet: bool | None, allow: tuple[str, ...], deny: tuple[str, ...],
            as_json: bool) -> None:
    """Show or change machine NAME's network rules (enforced on the host)."""
    net = _sandbox(name).network
    if off and (internet is not None or allow or deny):
        raise InvalidArgument("--off cannot be combined with other rules")
    if off:
        rules = net.off()
    elif internet is not None or allow or deny:
        current = net.get()
        rules = net.set(internet=current["internet"] if internet is None else internet,
                        allow=list(allow) if allow else current["allow"],
                        deny=list(deny) if deny else current["deny"])
    else:
        rules = net.get()
    if as_json:
        emit_json(rules)
    else:
        click.echo(f"internet: {'on' if rules['internet'] else 'off'}")
        click.echo(f"allow: {', '.join(rules['allow']) or '-'}")
        click.echo(f"deny: {', '.join(rules['deny']) or '-'}")


@cli.command()
@click.argument("name")
@click.argument("duration", required=False)
@click.option("--on-expiry", type=click.Choice(["stop", "checkpoint", "delete"]), default=None,
              help="What its time's end does to it [default: as set before, else stop].")
@click.option("--clear", is_flag=True, help="No time to live: it runs until stopped.")
@json_option
def ttl(name: str, duration: str | None, on_expiry: str | None, clear: bool, as_json: bool) -> None:
    """Show machine NAME's time to live, set or extend it to DURATION from now (30m, 2h), or
    --clear it. Once it ends, `rewind serve` (watching this home) or `rewind expire` stops the
    machine, checkpoints and stops it, or deletes it."""
    sbx = _sandbox(name)
    if clear and duration:
        raise InvalidArgument("give a DURATION or --clear, not both")
    info = sbx.set_ttl(None if clear else parse_duration(duration), on_expiry) if clear or duration \
        else sbx.info()
    if as_json:
        emit_json({"name": info.name, "expires": info.expires, "on_expiry": info.on_expiry})
    elif info.expires is None:
        click.echo(f"{name} has no time to live")
    else:
        at = time.strftime("%H:%M:%S", time.localtime(info.expires))
        click.echo(f"{name}: {info.on_expiry} in {_left(max(0, info.expires - time.time()))} (at {at})")


def _left(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 \
        else f"{seconds:.0f} s"


@cli.command()
@store_option
@json_option
def expire(store_dir: str | None, as_json: bool) -> None:
    """Do to each machine whose time to live has ended what it asked for (stop, checkpoint,
    delete): once, for cron or a timer; `rewind serve` does it every few seconds by itself."""
    _local_only("expire")
    from rewind.home import Home
    from rewind.serve.expiry import expire_due

    done = expire_due(Home.from_env(), store_dir)
    if as_json:
        emit_json([dataclasses.asdict(d) for d in done])
    for d in [] if as_json else done:
        click.echo(f"{d.machine}: {d.action}{f' (checkpoint {d.checkpoint[:12]})' if d.checkpoint else ''}")


@cli.command()
@click.argument("name")
@click.argument("guest_port", required=False, type=click.IntRange(1, 65535))
@click.option("--host-port", type=click.IntRange(1, 65535), default=None,
              help="The port on this host [default: a free one].")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The host address to listen on; another than loopback opens the service to the network.")
@click.option("--remove", is_flag=True, help="End the forward to GUEST_PORT.")
@json_option
def port(name: str, guest_port: int | None, host_port: int | None, host: str, remove: bool,
         as_json: bool) -> None:
    """Reach a service in machine NAME from this host: forward a host port to GUEST_PORT and
    print its address. Without GUEST_PORT, list NAME's forwards. A forward belongs to the
    machine: it answers again after restore, stop and start. The service must listen on
    0.0.0.0 in the guest, not only on 127.0.0.1."""
    ports = _sandbox(name).ports
    if guest_port is None:
        if remove or host_port is not None:
            raise InvalidArgument("--remove and --host-port need a GUEST_PORT")
        listed = ports.list()
        if as_json:
            emit_json([f.to_json() for f in listed])
            return
        for f in listed:
            click.echo(f"{f.host}:{f.port} -> {name}:{f.guest_port}")
        return
    forward = ports.remove(guest_port) if remove else ports.forward(guest_port, host_port, host)
    if as_json:
        emit_json(forward.to_json())
    elif remove:
        click.echo(f"removed {forward.host}:{forward.port} -> {name}:{forward.guest_port}")
    else:
        click.echo(f"{forward.host}:{forward.port}")


@cli.command()
@click.option("--quick", is_flag=True, help="Fewer rounds and smaller series (a few minutes).")
@click.option("--rounds", type=click.IntRange(min=1), default=None,
              help="Rounds per figure (default 5; with --quick 1, or 2 with --work).")
@click.option("--work", is_flag=True,
              help="Only the work an agent's steps do (Python, files, spawns, grep, tar, git, sqlite, pip, "
                   "pytest), timed on this host, in a machine and in gVisor, as ratios to the host.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write every raw sample and the machine's description to this file.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="PNG of checkpoint cost against memory in use (default: the --json file's name, .png; "
                   "none with --work).")
@click.option("--markdown", "markdown_path", default=None, type=click.Path(dir_okay=False),
              help="Also write the tables in Markdown to this file.")
def bench(quick: bool, rounds: int | None, work: bool, json_path: str | None, plot_path: str | None,
          markdown_path: str | None) -> None:
    """Measure what each step costs, beside plain QEMU and gVisor, and print the tables."""
    from rich.console import Console

    from rewind.bench import output, run, run_work

    if work and plot_path:
        raise InvalidArgument("--plot draws the checkpoint curve, which --work does not measure")
    plot = plot_path or (str(Path(json_path).with_suffix(".png")) if json_path and not work else None)
    for path in (json_path, plot, markdown_path):  # fail now, not after minutes of measuring
        if path and not Path(path).resolve().parent.is_dir():
            raise InvalidArgument(f"cannot write {path}: its folder does not exist")
    if plot:
        output.check_plotting()
    with progress(True) as report:
        result = (run_work if work else run)(quick=quick, rounds=rounds, progress=report)
    console = Console(width=200)
    for table in output.tables(result):
        console.print(table)
    if json_path:
        output.write_json(result, Path(json_path))
    if markdown_path:
        Path(markdown_path).write_text(output.markdown(result.to_json()))
    if plot:
        output.write_plot(result, Path(plot))
    click.echo(f"done in {result.seconds:.0f} s" + (f"; raw samples in {json_path}" if json_path else "")
               + (f"; plot in {plot}" if plot else ""))


def _split_remote(spec: str) -> tuple[str, str] | None:
    name, sep, path = spec.partition(":")
    if sep and name and "/" not in name and path.startswith("/"):
        return name, path
    return None


@cli.command()
@click.argument("source")
@click.argument("dest")
@click.option("-r", "--recursive", is_flag=True, help="Copy a folder (streamed as one tar).")
@json_option
def cp(source: str, dest: str, recursive: bool, as_json: bool) -> None:
    """Copy a file between this host and a machine: `cp FILE NAME:/path` or `cp NAME:/path FILE`.

    With -r, a folder, as `cp -r`: DEST is made if missing, else the folder goes inside it
    (never merged into a folder that is there). Files, empty folders, links, modes and
    mtimes are kept; the copy appears whole or not at all. --json reports files, bytes
    and seconds.
    """
    src_remote, dst_remote = _split_remote(source), _split_remote(dest)
    if bool(src_remote) == bool(dst_remote):
        raise InvalidArgument("exactly one of SOURCE and DEST must be NAME:/absolute/path")
    remote = dst_remote or src_remote
    assert remote
    files, path = _sandbox(remote[0]).files, remote[1]
    started = time.monotonic()
    report: dict[str, Any] = {}
    if recursive:
        with progress(not as_json) as step:
            copied = (files.upload_dir(source, path, progress=step) if dst_remote
                      else files.download_dir(path, dest, progress=step))
        report = copied.to_json()
    elif dst_remote:
        files.upload(source, path)
    else:
        files.download(path, dest)
    if as_json:
        emit_json({"source": source, "dest": dest, "seconds": round(time.monotonic() - started, 3), **report})


@cli.command(name="ls")
@click.option("--label", "labels", multiple=True, help="Only machines with KEY=VALUE; repeatable.")
@json_option
def ls(labels: tuple[str, ...], as_json: bool) -> None:
    """List machines and their status (running, stopped, dead)."""
    remote, wanted = _remote(), parse_pairs(labels, "--label")
    infos = [m.info() for m in (_engine().list(wanted) if remote is None else remote.list(wanted))]
    if as_json:
        emit_json([dataclasses.asdict(i) for i in infos])
        return
    from rich.console import Console
    from rich.markup import escape  # labels are the user's text, not markup
    from rich.table import Table

    table = Table(box=None)
    for column in ("NAME", "STATUS", "MEMORY", "CPUS", "PID", "TTL", "LABELS"):
        table.add_column(column)
    for i in infos:
        style = {"running": "green", "dead": "red"}.get(i.status, "")
        labels = escape(",".join(f"{k}={v}" for k, v in i.labels.items()))
        ttl = "-" if i.expires is None else f"{_left(max(0, i.expires - time.time()))} {i.on_expiry}"
        table.add_row(i.name, f"[{style}]{i.status}[/]" if style else i.status, f"{i.memory_mib}M",
                      str(i.cpus), str(i.pid or "-"), ttl, labels)
    Console().print(table)


@cli.command()
@click.argument("name")
@click.argument("pairs", nargs=-1)
@click.option("--remove", "removed", multiple=True, help="A label KEY to remove; repeatable.")
@json_option
def label(name: str, pairs: tuple[str, ...], removed: tuple[str, ...], as_json: bool) -> None:
    """Show machine NAME's labels, or add and change them (KEY=VALUE ...) and --remove KEY."""
    sbx = _sandbox(name)
    labels = sbx.set_labels({**parse_pairs(pairs, "a label"), **dict.fromkeys(removed)}) \
        if pairs or removed else sbx.labels
    if as_json:
        emit_json(labels)
    else:
        for key, value in labels.items():
            click.echo(f"{key}={value}")


@cli.command()
@click.argument("name")
@json_option
def stop(name: str, as_json: bool) -> None:
    """Stop machine NAME (its disk is kept)."""
    _sandbox(name).stop()
    if as_json:
        emit_json({"name": name, "status": "stopped"})


@cli.command()
@click.argument("names", nargs=-1, required=True)
@json_option
def rm(names: tuple[str, ...], as_json: bool) -> None:
    """Delete machines: stop them and remove all they had."""
    for name in names:
        _sandbox(name).delete()
    if as_json:
        emit_json({"removed": list(names)})


# ---- checkpoints ----------------------------------------------------------------------


def _store(store_dir: str | None) -> Store:
    """The store, with every checkpoint still being stored in it (see engine/pending.py). An
    encrypted one's password is asked for on the terminal when the environment has none."""
    from rewind.sandbox import store_of

    engine = _engine()
    engine.settle()
    return store_of(engine.home, store_dir, password=_ask_password("store password"))


def _ask_password(prompt: str, confirm: bool = False) -> Callable[[], str]:
    """A function that asks for a password on the terminal (twice with `confirm`); with no
    terminal, it says where else a password can come from."""
    def ask() -> str:
        import getpass

        from rewind.store.errors import WrongPassword

        if not sys.stdin.isatty():
            raise WrongPassword(f"no terminal to ask for the {prompt} on: set REWIND_PASSWORD_FILE "
                                "or REWIND_PASSWORD (REWIND_NEW_PASSWORD_FILE or REWIND_NEW_PASSWORD "
                                "for a new key's)")
        said = getpass.getpass(f"{prompt}: ")
        if confirm and getpass.getpass(f"{prompt} again: ") != said:
            raise InvalidArgument("the two passwords differ")
        return said
    return ask


def _new_password() -> str:
    """A new key's password: $REWIND_NEW_PASSWORD_FILE, else $REWIND_NEW_PASSWORD, else asked for."""
    path = os.environ.get("REWIND_NEW_PASSWORD_FILE")
    if path:
        return Path(path).read_text().removesuffix("\n")
    return os.environ.get("REWIND_NEW_PASSWORD") or _ask_password("new password", confirm=True)()


def _is_file(text: str) -> bool:
    """Whether `text` names a file here (a checkpoint file); a text too long for a path does not."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def _source(source: str) -> str | CheckpointManifest:
    """A checkpoint file (-o) read, a machine's last point, or a checkpoint reference as given."""
    from rewind.engine import pending
    from rewind.store import CheckpointManifest

    path = Path(source)
    if _is_file(source):
        try:
            return CheckpointManifest.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"{source} is not a checkpoint file ({e})") from e
    try:
        machine = _engine().get(source)
    except (InvalidArgument, NotFound):
        return source
    parent = pending.surviving(machine.home, machine.record.parent)
    if parent is None:
        raise NotFound(f"machine {source!r} has no checkpoint yet")
    return parent


def _point(store: Store, source: str) -> CheckpointManifest:
    """The stored checkpoint a file (-o), a machine (its last point) or a reference names."""
    found = _source(source)
    return found if not isinstance(found, str) else store.get(found)


def _checkpoint_json(c: Checkpoint) -> dict:
    return dataclasses.asdict(c)


def _print_points(points: list[Checkpoint]) -> None:
    from rich.console import Console
    from rich.markup import escape  # names and labels are the user's text, not markup
    from rich.table import Table

    table = Table(box=None)
    # A store in a bucket: which points are only on this host so far.
    bucket = any(c.uploaded is not None for c in points)
    for column in ("REF", "ID", "NAME", "CREATED", "OWN DATA", "SIGNED BY", *(["UPLOADED"] if bucket else []),
                   "LABELS"):
        table.add_column(column)
    for c in points:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.created))
        uploaded = ["yes" if c.uploaded else "not yet"] if bucket else []
        table.add_row(c.ref, c.id[:12], escape(c.name or ""), created, f"{c.own_bytes / (1 << 20):.1f} MiB",
                      escape(c.signer or ""), *uploaded,
                      escape(",".join(f"{k}={v}" for k, v in c.labels.items())))
    Console().print(table)


@cli.command()
@click.argument("name")
@click.option("--name", "point_name", default=None, help="A name for the checkpoint.")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE; repeatable.")
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False),
              help="Also write the checkpoint (its index and history) to this file.")
@click.option("--history", default=DEFAULT_HISTORY, show_default=True, type=click.IntRange(min=0),
              help="Earlier points kept inside the checkpoint.")
@click.option("--wait", is_flag=False, flag_value="uploaded", default=None,
              type=click.Choice(["uploaded", "local"]),
              help="Return once it is in the store, not once it is captured; an s3:// store's once it is "
                   "uploaded, or with --wait=local once it is stored on this host (uploading).")
@store_option
@json_option
def checkpoint(name: str, point_name: str | None, labels: tuple[str, ...], output: str | None, history: int,
               wait: str | None, store_dir: str | None, as_json: bool) -> None:
    """Save machine NAME whole (memory, processes, disk) as of now; it runs on."""
    started = time.monotonic()
    sbx = _sandbox(name, store_dir)
    if output or history != DEFAULT_HISTORY:
        _local_only("--output and --history")
    point = sbx.checkpoint(name=point_name, labels=parse_pairs(labels, "--label"),
                           wait={None: False, "uploaded": True, "local": "local"}[wait],
                           **({"history": history} if history != DEFAULT_HISTORY else {}))
    captured = round(time.monotonic() - started, 3)
    if output:
        manifest = _store(store_dir).get(point.id)
        tmp = Path(output).with_name(f".{Path(output).name}.tmp")
        tmp.write_text(json.dumps(manifest.to_json()))
        os.replace(tmp, output)
    data = {**_checkpoint_json(point), "seconds": captured}
    if as_json:
        emit_json(data)
    elif point.own_bytes is None:
        click.echo(f"checkpoint {point.id[:12]} of {name}: guest paused {point.pause_ms:.1f} ms, "
                   f"captured in {captured} s, being stored")
    else:
        where = {None: "stored", True: "uploaded", False: "stored on this host (uploading)"}[point.uploaded]
        click.echo(f"checkpoint {point.id[:12]} of {name}: guest paused {point.pause_ms:.1f} ms, {where} in "
                   f"{captured} s, {point.own_bytes / (1 << 20):.1f} MiB of new data")


@cli.command()
@click.argument("first")
@click.argument("second", required=False)
@click.option("--paths", "globs", multiple=True, help="Only paths matching this glob; repeatable.")
@click.option("--content", "content_path", default=None, help="A unified diff of this text file instead.")
@click.option("--all", "noise", is_flag=True, help="Also the noise list's paths (logs, caches, identity).")
@store_option
@json_option
def diff(first: str, second: str | None, globs: tuple[str, ...], content_path: str | None, noise: bool,
         store_dir: str | None, as_json: bool) -> None:
    """What changed: `diff NAME [REF]` from NAME's point REF (default ~0) to NAME now;
    `diff REF1 REF2` from one point to another; `diff REF` from REF's parent to REF."""
    from rewind.engine.changes import diff as engine_diff
    from rewind.engine.engine import Engine

    remote = _remote()
    if remote is not None:  # there, FIRST names a machine
        if content_path is not None:
            raise InvalidArgument("--content works on this host only; unset REWIND_URL to use it")
        _print_diff(remote.get(first).diff(second or "~0", noise=noise, paths=list(globs) or None), as_json)
        return
    store = _store(store_dir)
    engine = Engine()
    try:
        machine = engine.get(first)
    except NotFound:
        machine = None
    if machine is not None:
        machine.reload()
        before, after, relative = second or "~0", machine, machine.record.parent
    elif second is not None:
        before, after, relative = first, second, None
    else:
        point = engine.find_point(store, first).point
        if point.parent is None:
            raise InvalidArgument(f"checkpoint {point.id[:12]} has no parent to compare it with")
        before, after, relative = point.parent, point, None
    if content_path is not None:
        text = engine_diff.content(engine, store, before, after, content_path, relative_to=relative)
        emit_json({"path": content_path, "diff": text}) if as_json else sys.stdout.write(text)
        return
    result = engine_diff.diff(engine, store, before, after, relative_to=relative, include_noise=noise,
                              globs=list(globs) or None)
    _print_diff(result, as_json)


def _print_diff(result: Any, as_json: bool) -> None:
    if as_json:
        emit_json(result.to_json())
        return
    from rewind.difftext import lines

    for line in lines(result):
        click.echo(line)


@cli.command(name="log")
@click.argument("source")
@store_option
@json_option
def log_(source: str, store_dir: str | None, as_json: bool) -> None:
    """History of a machine or a checkpoint file, newest first (~0, ~1, ...)."""
    from rewind.sandbox import history_of

    if _remote() is not None and not _is_file(source):
        points = _sandbox(source, store_dir).history()
    else:
        store = _store(store_dir)
        points = history_of(_point(store, source), _engine().home, store)
    if as_json:
        emit_json([_checkpoint_json(c) for c in points])
    else:
        _print_points(points)


@cli.command()
@click.argument("name")
@click.argument("ref")
@store_option
@unsigned_option
@json_option
def restore(name: str, ref: str, store_dir: str | None, allow_unsigned: bool, as_json: bool) -> None:
    """Put machine NAME back to checkpoint REF (~N, an id prefix or a name), in place."""
    unsigned = _unsigned(allow_unsigned)
    sbx = _sandbox(name, store_dir)
    point = sbx.restore(ref) if unsigned is None else sbx.restore(ref, allow_unsigned=unsigned)
    if as_json:
        emit_json(_checkpoint_json(point))
    else:
        click.echo(f"{name} is back at {point.id[:12]}{f' ({point.name})' if point.name else ''}")


@cli.command()
@click.argument("name")
@click.option("--from", "source", required=True, help="A checkpoint file, a machine, or a checkpoint.")
@click.option("--at", default=None, help="Count back from it, such as ~2.")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE; repeatable.")
@store_option
@unsigned_option
@json_option
def create(name: str, source: str, at: str | None, labels: tuple[str, ...], store_dir: str | None,
           allow_unsigned: bool, as_json: bool) -> None:
    """Start a new machine NAME from a checkpoint."""
    from rewind.sandbox import store_of

    unsigned = _unsigned(allow_unsigned)
    remote, wanted = _remote(), parse_pairs(labels, "--label")
    if remote is not None and not _is_file(source):
        info = remote.create(name, from_checkpoint=source, at=at, labels=wanted).info()
    else:
        from rewind.engine import timeline

        engine = _engine()  # a point not yet stored runs from its capture: no settle here
        info = timeline.create_from(engine, store_of(engine.home, store_dir), _source(source), name=name,
                                    labels=wanted, at=at, allow_unsigned=unsigned).info()
    if as_json:
        emit_json(dataclasses.asdict(info))
    else:
        click.echo(f"{name} is running from {source}{f' at {at}' if at else ''}")


@cli.command()
@click.argument("source")
@click.argument("name")
@click.option("--count", default=1, show_default=True, type=click.IntRange(min=1, max=64),
              help="How many copies (named NAME-1, NAME-2, ... when more than one).")
@store_option
@json_option
def branch(source: str, name: str, count: int, store_dir: str | None, as_json: bool) -> None:
    """Copy running machine SOURCE as NAME: it pauses only briefly; each copy runs on its own."""
    names: list[str | None] = [name] if count == 1 else [f"{name}-{i}" for i in range(1, count + 1)]
    remote = _remote()
    if remote is None:
        from rewind.engine import timeline

        engine = _engine()
        made = [child.info() for child in timeline.fork(engine, engine.get(source), _store(store_dir), names)]
    else:
        made = [child.info() for child in remote.get(source).fork_many(names=names)]
    if as_json:
        emit_json([dataclasses.asdict(i) for i in made])
    else:
        for i in made:
            click.echo(f"{i.name} is running, branched from {source}")


@cli.command()
@store_option
@json_option
def checkpoints(store_dir: str | None, as_json: bool) -> None:
    """Every checkpoint in the store, oldest first."""
    from rewind.results import Checkpoint
    from rewind.sandbox import with_upload_state

    remote = _remote()
    if remote is None:
        from rewind.signers import signer_of

        home, store = _engine().home, _store(store_dir)
        signed = [Checkpoint.of(m, ref="", signer=signer_of(home, m)) for m in store.list()]
        points = with_upload_state(signed, store)
    else:
        points = remote.checkpoints()
    if as_json:
        emit_json([_checkpoint_json(c) for c in points])
    else:
        _print_points(points)


@cli.command()
@click.option("--keep-last", type=click.IntRange(min=0), default=None, help="Keep this many per machine.")
@click.option("--keep-days", type=click.FloatRange(min=0), default=None, help="Keep younger points.")
@store_option
@json_option
def prune(keep_last: int | None, keep_days: float | None, store_dir: str | None, as_json: bool) -> None:
    """Drop checkpoints past the limits (then `rewind gc` frees their data)."""
    if keep_last is None and keep_days is None:
        raise InvalidArgument("say what to keep: --keep-last N and/or --keep-days D")
    _local_only("prune")
    removed = _store(store_dir).prune(keep_last=keep_last, keep_days=keep_days)
    if as_json:
        emit_json({"removed": removed})
    else:
        click.echo(f"removed {len(removed)} checkpoint(s)")


@cli.command()
@store_option
@json_option
def gc(store_dir: str | None, as_json: bool) -> None:
    """Remove data no checkpoint references."""
    _local_only("gc")
    report = _store(store_dir).gc()
    if as_json:
        emit_json(dataclasses.asdict(report))
    else:
        freed = report.bytes_freed / (1 << 20)
        packs = report.packs_rewritten
        rewritten = f", {packs} pack(s) written again without them" if packs else ""
        click.echo(f"removed {report.chunks_removed} chunk(s){rewritten}, freed {freed:.1f} MiB")


@cli.group(name="store")
def store_group() -> None:
    """The checkpoint store."""


@store_group.command(name="init")
@click.option("--encrypt", is_flag=True,
              help="Encrypt everything it keeps (password: $REWIND_PASSWORD_FILE, $REWIND_PASSWORD, "
                   "else asked for).")
@click.option("--chunk-size", default=None, help="Default chunk size of its blobs (e.g. 256K) [256K].")
@store_option
@json_option
def store_init(encrypt: bool, chunk_size: str | None, store_dir: str | None, as_json: bool) -> None:
    """Make a checkpoint store: a folder, or s3://bucket/prefix."""
    from rewind.store import DEFAULT_CHUNK_SIZE, open_store
    from rewind.store.backends import is_remote

    _local_only("store init")
    spec = store_dir or os.environ.get("REWIND_STORE") or str(_engine().home.store)
    if not is_remote(spec) and (Path(spec) / "config.json").exists():
        raise InvalidArgument(f"there is a checkpoint store at {spec} already")
    size = DEFAULT_CHUNK_SIZE if chunk_size is None else _parse_bytes(chunk_size)
    store = open_store(spec, create=True, chunk_size=size, encrypt=encrypt,
                       password=_ask_password("password of the new store", confirm=True))
    if as_json:
        emit_json({"store": store.where, "encrypted": store.encrypted, "key": store.key_id})
    else:
        click.echo(f"made {'an encrypted' if store.encrypted else 'a'} checkpoint store at {store.where}")


def _parse_bytes(text: str) -> int:
    """'262144', '256K', '1M' -> bytes."""
    m = re.fullmatch(r"(\d+)\s*([KM]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (examples: 256K, 1M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20}[m.group(2).upper()]


@store_group.group(name="key")
def store_key() -> None:
    """The keys (passwords) of an encrypted store."""


@store_key.command(name="list")
@store_option
@json_option
def store_key_list(store_dir: str | None, as_json: bool) -> None:
    """The key files that open the store; * marks the one this password opened."""
    store = _keyed_store(store_dir)
    slots = store.key_slots()
    if as_json:
        emit_json([{"id": s.id, "created": s.created, "host": s.host, "current": s.id == store.key_id,
                    "scrypt": {"n": s.n, "r": s.r, "p": s.p}} for s in slots])
        return
    for slot in slots:
        mark = "*" if slot.id == store.key_id else " "
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(slot.created))
        click.echo(f"{mark} {slot.id}  {when}  {slot.host}")


@store_key.command(name="add")
@store_option
@json_option
def store_key_add(store_dir: str | None, as_json: bool) -> None:
    """Add a key with a new password ($REWIND_NEW_PASSWORD_FILE, $REWIND_NEW_PASSWORD, else asked for)."""
    store = _keyed_store(store_dir)
    key_id = store.add_key(_new_password())
    emit_json({"id": key_id}) if as_json else click.echo(f"added key {key_id}")


@store_key.command(name="remove")
@click.argument("key_id")
@store_option
@json_option
def store_key_remove(key_id: str, store_dir: str | None, as_json: bool) -> None:
    """Remove key KEY_ID (not the last one)."""
    store = _keyed_store(store_dir)
    store.remove_key(key_id)
    emit_json({"removed": key_id}) if as_json else click.echo(f"removed key {key_id}")


@store_key.command(name="passwd")
@store_option
@json_option
def store_key_passwd(store_dir: str | None, as_json: bool) -> None:
    """Change the password of the key this password opens (a new key is written first)."""
    store = _keyed_store(store_dir)
    old = store.key_id
    new = store.change_password(_new_password())
    if as_json:
        emit_json({"added": new, "removed": old})
    else:
        click.echo(f"password changed: key {new} replaces key {old}")


def _keyed_store(store_dir: str | None) -> Store:
    _local_only("store key")
    store = _store(store_dir)
    if not store.encrypted:
        raise InvalidArgument(f"the checkpoint store at {store.where} is not encrypted: it has no keys")
    return store


@store_group.command(name="check")
@click.option("--read-data", is_flag=True, help="Also read every chunk and verify its hash.")
@store_option
@json_option
def store_check(read_data: bool, store_dir: str | None, as_json: bool) -> None:
    """Verify every checkpoint's index (and with --read-data, every chunk)."""
    _local_only("store check")
    report = _store(store_dir).check(read_data=read_data)
    if as_json:
        emit_json({**dataclasses.asdict(report), "ok": report.ok})
    else:
        for problem in report.problems:
            click.echo(f"problem: {problem}")
        click.echo(f"{'ok' if report.ok else 'DAMAGED'}: {report.checkpoints} checkpoint(s), "
                   f"{report.chunks} chunk(s) checked")
    if not report.ok:
        sys.exit(1)


@store_group.command(name="push")
@store_option
@json_option
def store_push(store_dir: str | None, as_json: bool) -> None:
    """Upload now what this host committed to an s3:// store and has not uploaded yet."""
    from rewind.store.cache import CachedStore

    _local_only("store push")
    store = _store(store_dir)
    if not isinstance(store, CachedStore):
        raise InvalidArgument(f"{store.root} is a store on this host: there is nothing to upload")
    report = store.push()
    if as_json:
        emit_json(dataclasses.asdict(report))
    else:
        for problem in report.problems:
            click.echo(f"problem: {problem}")
        last = store.last_upload()
        if not report.points and not report.problems and last is not None:
            # Uploaded already, most often by the detached uploader right after its commit.
            ago = time.time() - float(last.get("at", 0))
            click.echo(f"nothing left to upload to {store.url}: the last checkpoint uploaded, "
                       f"{str(last.get('id'))[:12]}, was sent {ago:.0f} s ago")
            return
        meanwhile = f" ({report.meanwhile} by the upload already running)" if report.meanwhile else ""
        click.echo(f"uploaded {len(report.points)} checkpoint(s){meanwhile} to {store.url}: {report.chunks} "
                   f"chunk(s), {report.bytes / (1 << 20):.1f} MiB in {report.seconds:.2f} s; "
                   f"{len(store.queued())} still queued")
    if report.problems:
        sys.exit(1)


@cli.command(name="export")
@click.argument("ref")
@click.argument("file", type=click.Path(dir_okay=False))
@store_option
@json_option
def export_(ref: str, file: str, store_dir: str | None, as_json: bool) -> None:
    """Write checkpoint REF (a checkpoint or a machine's last point) to one portable FILE."""
    from rewind.store import export_checkpoint

    _local_only("export")
    store = _store(store_dir)
    manifest = export_checkpoint(store, _point(store, ref), file)
    if as_json:
        emit_json({"id": manifest.id, "file": file, "bytes": Path(file).stat().st_size})
    else:
        click.echo(f"exported {manifest.id[:12]} to {file}")


@cli.command(name="import")
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@store_option
@unsigned_option
@json_option
def import_(file: str, store_dir: str | None, allow_unsigned: bool, as_json: bool) -> None:
    """Add a checkpoint exported by `rewind export` (checksum and signer verified first)."""
    from rewind.signers import import_signed

    _local_only("import")
    manifest = import_signed(_engine().home, _store(store_dir), file, _unsigned(allow_unsigned))
    if as_json:
        emit_json({"id": manifest.id, "name": manifest.name})
    else:
        short = manifest.id[:12]
        click.echo(f"imported {short}; start it with `rewind create NAME --from {short}`")


@cli.group()
def key() -> None:
    """This home's signing key: it signs every checkpoint the home makes."""


@key.command(name="show")
@json_option
def key_show(as_json: bool) -> None:
    """Print the home's public key (made on first use), for other homes to `rewind trust add`."""
    from rewind.signers import signing_key
    from rewind.store.signing import fingerprint

    public = signing_key(_engine().home).public
    if as_json:
        emit_json({"key": public, "fingerprint": fingerprint(public)})
    else:
        click.echo(f"{public}  ({fingerprint(public)})")


@cli.group()
def trust() -> None:
    """The keys whose checkpoints this home runs, besides its own."""


@trust.command(name="add")
@click.argument("public_key")
@click.option("--name", default=None, help="A name to show for it (letters, digits, '-', '_', '.').")
@json_option
def trust_add(public_key: str, name: str | None, as_json: bool) -> None:
    """Trust PUBLIC_KEY (ed25519:..., as `rewind key show` prints it): restore, create --from
    and import then take the points it signed."""
    from rewind import signers

    entry = signers.trust(_engine().home, public_key, name)
    if as_json:
        emit_json({"key": entry.key, "name": entry.name, "fingerprint": entry.fingerprint})
    else:
        click.echo(f"trusting {entry.fingerprint}{f' as {entry.name}' if entry.name else ''}")


@trust.command(name="list")
@json_option
def trust_list(as_json: bool) -> None:
    """The keys this home trusts: its own first."""
    from rewind import signers
    from rewind.store.signing import fingerprint

    home = _engine().home
    own = signers.signing_key(home).public
    rows = [{"key": own, "name": "this home", "fingerprint": fingerprint(own), "added": None}] + \
        [{"key": k.key, "name": k.name, "fingerprint": k.fingerprint, "added": k.added}
         for k in signers.trust_list(home).keys]
    if as_json:
        emit_json(rows)
        return
    for row in rows:
        click.echo(f"{row['fingerprint']}  {row['name'] or '-':<16}  {row['key']}")


@trust.command(name="remove")
@click.argument("which")
@json_option
def trust_remove(which: str, as_json: bool) -> None:
    """Stop trusting a key: WHICH is its text, its name or its fingerprint."""
    from rewind.signers import distrust

    entry = distrust(_engine().home, which)
    if as_json:
        emit_json({"removed": entry.key, "name": entry.name, "fingerprint": entry.fingerprint})
    else:
        click.echo(f"no longer trusting {entry.fingerprint}{f' ({entry.name})' if entry.name else ''}")


@cli.group()
def image() -> None:
    """The guest image."""


@image.command(name="build")
@click.argument("context", required=False, type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Rebuild even if the current recipe is built.")
@click.option("--from", "source", default=None, metavar="SOURCE",
              help="An OCI or Docker image: oci-archive:PATH, docker-archive:PATH or oci:DIR (needs --name).")
@click.option("-f", "--file", "dockerfile", default=None, type=click.Path(dir_okay=False),
              help="A Dockerfile to build (with Buildah) from CONTEXT [default: its folder] (needs --name).")
@click.option("--build-arg", "build_args", multiple=True, metavar="KEY=VALUE",
              help="For the Dockerfile's ARGs; repeatable.")
@click.option("--name", default=None, help="The name of an image built --from an image or a Dockerfile.")
@json_option
def image_build(context: str | None, force: bool, source: str | None, dockerfile: str | None,
                build_args: tuple[str, ...], name: str | None, as_json: bool) -> None:
    """Build the default guest image (Debian packages) and its booted template; or, with
    --name, an image of your own: --from an OCI or Docker image, or -f a Dockerfile [CONTEXT].

    A Dockerfile's FROM names an image of yours built --from an archive, or one already in
    rewind's builder; no registry is asked."""
    if source is not None or name is not None or dockerfile is not None or context is not None:
        return _build_custom(source, dockerfile, context, parse_pairs(build_args, "--build-arg"), name,
                             force, as_json)
    from rewind.image import build_image

    engine = _engine()
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


def _build_custom(source: str | None, dockerfile: str | None, context: str | None, build_args: dict[str, str],
                  name: str | None, force: bool, as_json: bool) -> None:
    from rewind.image.custom import build_from_dockerfile, build_from_image
    from rewind.image.dockerfile import builder_for

    if (source is None) == (dockerfile is None) or name is None:
        raise InvalidArgument("an image of your own needs --name NAME and one of --from SOURCE or "
                              "-f DOCKERFILE")
    if force:
        raise InvalidArgument("--force rebuilds the default image; remove an image of your own with "
                              "`rewind image rm NAME` first")
    if context is not None and dockerfile is None:
        raise InvalidArgument("a build CONTEXT goes with -f DOCKERFILE")
    engine = _engine()
    started = time.monotonic()
    with progress(not as_json) as report:
        if dockerfile is not None:
            file = Path(dockerfile)
            built = build_from_dockerfile(engine.home.images, builder_for(engine.home.root), name, file,
                                          Path(context) if context else file.parent, report, build_args)
        else:
            assert source is not None
            built = build_from_image(engine.home.images, name, source, report)
    data = {**built.to_json(), "seconds": round(time.monotonic() - started, 1)}
    if as_json:
        emit_json(data)
    else:
        click.echo(f"image {built.id} ready ({data['size_mib']} MiB on disk); "
                   f"start a machine of it with `rewind start NAME --image {built.id}`")


@image.command(name="import")
@click.argument("name")
@click.option("--kernel", required=True, type=click.Path(dir_okay=False), help="The guest kernel.")
@click.option("--initrd", required=True, type=click.Path(dir_okay=False), help="Its initramfs.")
@click.option("--disk", required=True, type=click.Path(dir_okay=False), help="Root disk, raw or qcow2.")
@click.option("--runtime-disk", type=click.Path(dir_okay=False),
              help="A raw disk attached read-only as /dev/vdb (the default image's holds its agent).")
@json_option
def image_import(name: str, kernel: str, initrd: str, disk: str, runtime_disk: str | None,
                 as_json: bool) -> None:
    """Add an image of your own as NAME (use it with `rewind start --image NAME`).

    The guest must mount /dev/vda as its root and run rewind's guest agent as root
    (src/rewind/guest/); the default image shows how.
    """
    from rewind.image import import_image

    imported = import_image(_engine().home.images, name, Path(kernel), Path(initrd), Path(disk),
                            Path(runtime_disk) if runtime_disk else None)
    if as_json:
        emit_json({"id": imported.id, "path": str(imported.path), "disk_size_mib": imported.disk_size_mib})
    else:
        click.echo(f"image {imported.id} imported at {imported.path}")


@image.command(name="ls")
@json_option
def image_ls(as_json: bool) -> None:
    """List images; the default one is the built recipe's."""
    from rewind.image import list_images

    rows = [i.to_json() for i in list_images(_engine().home.images)]
    if as_json:
        emit_json(rows)
        return
    for row in rows:
        click.echo(f"{row['id']:20} {'default' if row['default'] else '':8} {row['size_mib']:>6} MiB  "
                   f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(row['created']))}  "
                   f"{(row['digest'] or '-')[:19]}")


@image.command(name="rm")
@click.argument("name")
@json_option
def image_rm(name: str, as_json: bool) -> None:
    """Remove image NAME; refused while a machine or a checkpoint uses it."""
    from rewind.image.custom import remove_image

    engine = _engine()
    remove_image(engine.home.images, name, _image_users(engine, name))
    if as_json:
        emit_json({"removed": name})
    else:
        click.echo(f"removed image {name}")


def _image_users(engine: Engine, name: str) -> list[str]:
    """What keeps image NAME in use: machines of it, and checkpoints of machines of it (those
    still being stored read its disk: they are waited for)."""
    users = [f"machine {m.name}" for m in engine.list() if m.record.image_id == name]
    engine.settle()
    store = _store(None)
    users += [f"checkpoint {c.id[:12]}" for c in store.list() if c.meta.get("image_id") == name]
    return users


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=7070, show_default=True, type=click.IntRange(0, 65535))
@click.option("--token-file", default=None, type=click.Path(dir_okay=False),
              help="File holding the bearer token every request must carry "
                   "[default: serve.token in the home, made if missing].")
@click.option("--no-auth", is_flag=True, help="Require no token (only on a loopback address).")
@click.option("--allow-host", multiple=True, metavar="NAME",
              help="Also answer requests whose Host header names NAME; repeatable.")
@click.option("--allow-origin", multiple=True, metavar="ORIGIN",
              help="Let web pages from ORIGIN (such as https://app.example) call the API (CORS); repeatable.")
@click.option("--max-machines", type=click.IntRange(min=1), default=None,
              help="Machines it runs at most [default: 4 per core].")
@click.option("--max-memory", default=None,
              help="Guest memory it gives at most, such as 16G [default: 3/4 of RAM].")
@click.option("--default-ttl", default=None, help="Time to live of machines made without one (30m, 2h).")
@click.option("--on-expiry", type=click.Choice(["stop", "checkpoint", "delete"]), default="stop",
              show_default=True, help="What the end of a default time to live does.")
@policy_options
@store_option
def serve(host: str, port: int, token_file: str | None, no_auth: bool, allow_host: tuple[str, ...],
          allow_origin: tuple[str, ...], max_machines: int | None, max_memory: str | None,
          default_ttl: str | None, on_expiry: str, step_policy: str, machine_policy: tuple[str, ...],
          allow_external: tuple[str, ...], store_dir: str | None) -> None:
    """Serve the HTTP API (OpenAPI at /docs, /openapi.json) and MCP at /mcp, until interrupted.

    Requests must name this server in their Host header and come from no foreign web origin,
    so a web page in a browser on this host cannot drive it."""
    from rewind.home import Home
    from rewind.serve import api
    from rewind.serve.access import AccessPolicy
    from rewind.serve.policy import Policy
    from rewind.serve.service import DaemonConfig, Service

    token, made = api.read_token(token_file, no_auth, host, Home.from_env())
    policy = AccessPolicy.for_bind(host, allow_host, allow_origin)
    config = DaemonConfig(policy=Policy.parse(step_policy, machine_policy, allow_external))
    config.change(max_machines, parse_mib(max_memory) if max_memory else None,
                  parse_duration(default_ttl) if default_ttl else None, on_expiry)
    api.serve(Service.from_env(store_dir, config), host, port, token, policy, made)


@cli.command()
@policy_options
@store_option
def mcp(step_policy: str, machine_policy: tuple[str, ...], allow_external: tuple[str, ...],
        store_dir: str | None) -> None:
    """Serve the MCP tools over stdio (for Claude Code, Claude Desktop, Cursor...)."""
    from rewind.serve.mcpserver import build_server
    from rewind.serve.policy import Policy
    from rewind.serve.service import DaemonConfig, Service

    config = DaemonConfig(policy=Policy.parse(step_policy, machine_policy, allow_external))
    build_server(Service.from_env(store_dir, config)).run("stdio")


@cli.command()
@json_option
def doctor(as_json: bool) -> None:
    """What this host gives rewind: QEMU, accelerator, image, templates."""
    from rewind.engine.checkpoint import Caches
    from rewind.engine.disk import diskchain
    from rewind.engine.memory import ramcache
    from rewind.engine.process.qemu import qemu_build
    from rewind.engine.process.template import find_template
    from rewind.errors import QemuError
    from rewind.image import find_image, recipe_id

    engine = _engine()
    report: dict[str, Any] = {"home": str(engine.home.root), "images": str(engine.home.images)}
    try:
        build = qemu_build()
        report.update(qemu=build.version_text, qemu_binary=build.binary, qemu_board=build.board)
    except QemuError as e:
        report.update(qemu=None, qemu_problem=str(e))
    report["image_recipe"] = recipe_id()
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
    report.update(_store_status(engine, as_json))
    report.update(_daemon_status(as_json))
    use = ramcache.usage(Caches.of(engine.home.root, engine.home.runtime).ram)
    report["memory_images"] = use.to_json() if as_json else (
        f"{use.images} on tmpfs, {use.bytes / (1 << 20):.0f} MiB of a {use.budget >> 20} MiB budget "
        f"({use.free >> 20} MiB free; {ramcache.BUDGET_ENV} sets the budget)")
    merged = diskchain.usage(engine.home)
    report["merged_layers"] = merged if as_json else (
        f"{merged['files']} files, {merged['mib']:.0f} MiB (frozen disk layers merged for starts; "
        "safe to delete)")
    if as_json:
        emit_json(report)
        return
    for key, value in report.items():
        click.echo(f"{key:>16}: {value}")


def _daemon_status(as_json: bool) -> dict[str, Any]:
    """The daemon at $REWIND_URL, if one is set: whether it answers, and its policy for steps."""
    remote = _remote()
    if remote is None:
        return {}
    try:
        with remote:
            health = remote.call("GET", "/health")
    except RewindError as e:
        return {"daemon": f"{remote.url} does not answer: {e}"}
    policy = health.get("policy") or {}
    if as_json:
        return {"daemon": remote.url, "policy": policy}
    shown = policy.get("default", "open") + "".join(
        f", {name}: {value}" for name, value in policy.get("machines", {}).items())
    if policy.get("allow_external"):
        shown += f" (external steps allowed for {', '.join(policy['allow_external'])})"
    return {"daemon": remote.url, "policy": shown}


def _store_status(engine: Engine, as_json: bool) -> dict[str, Any]:
    """Which store is in use, and whether it answers (doctor)."""
    from rewind.store import StoreError, WrongPassword, open_store
    from rewind.store.backends import is_remote
    from rewind.store.cache import CachedStore

    spec = os.environ.get("REWIND_STORE") or str(engine.home.store)
    if not is_remote(spec):
        made = (Path(spec) / "config.json").exists()
        encrypted = (Path(spec) / "keys").is_dir()  # format 3 (docs/format.md §2.11)
        return {"store": spec, "store_status": "a folder on this host" + (", encrypted" if encrypted else "")
                + ("" if made else ", not made yet")}
    try:
        store = open_store(spec, create=True, home=engine.home.root)
    except WrongPassword as e:
        return {"store": spec, "store_status": f"encrypted, not opened: {e}"}
    except StoreError as e:
        return {"store": spec, "store_status": f"does not answer: {e}"}
    assert isinstance(store, CachedStore)
    status = store.status()
    if as_json:
        return {"store": spec, "store_status": dataclasses.asdict(status)}
    said = "answers" if status.answers else "does not answer"
    conditional = {True: "yes", False: "no (names are claimed by look-then-write)", None: "unknown"}
    queued = f": {', '.join(i[:12] for i in status.queued_ids)}" if status.queued_ids else ""
    said += ", encrypted" if status.encrypted else ""
    return {"store": spec, "store_status": f"{said}: {status.detail}; "
            f"conditional writes: {conditional[status.conditional_writes]}",
            "store_uploads": f"{status.queued} checkpoint(s) stored on this host, not uploaded yet{queued}",
            "store_cache": status.cache}


@cli.command()
@click.option("--keep", is_flag=True, help="Leave the demo machine running afterwards.")
def demo(keep: bool) -> None:
    """Start a machine, break it, and take it back: what rewind is for, in a minute."""
    from rewind.image import build_image
    from rewind.sandbox import Sandbox

    engine = _engine()
    with progress(True) as report:
        build_image(engine.home.images, report=report)
        engine.template(DEFAULT_MEMORY_MIB, DEFAULT_CPUS, report=report)
    started = time.monotonic()
    sbx = Sandbox.create(labels={"role": "demo"})
    click.echo(f"started machine {sbx.name} in {time.monotonic() - started:.2f} s")
    try:
        _demo_steps(sbx)
    finally:
        if keep:
            click.echo(f"machine {sbx.name} is still running; `rewind rm {sbx.name}` removes it")
        else:
            sbx.delete()
            click.echo(f"deleted {sbx.name}")


# A process that keeps a count in memory only: it shows a restore brings processes back.
_DEMO_COUNTER = ("python3 -c 'import socket; s=socket.socket(); s.bind((\"127.0.0.1\", 7000)); s.listen(); "
                 "n=0\nwhile True:\n c,_=s.accept(); n+=1; c.sendall(str(n).encode()); c.close()'")
_DEMO_ASK = ("python3 -c 'import socket; "
             "print(socket.create_connection((\"127.0.0.1\", 7000)).recv(9).decode())'")


def _demo_steps(sbx: Sandbox) -> None:
    from rewind.sandbox import try_in_copy

    def say(text: str) -> None:
        click.echo(click.style(f"\n# {text}", fg="cyan"))

    def run(cmd: str) -> None:
        click.echo(click.style(f"$ {cmd}", bold=True))
        t = time.monotonic()
        r = sbx.exec(cmd, on_stdout=lambda s: click.echo(s, nl=False),
                     on_stderr=lambda s: click.echo(click.style(s, fg="red"), nl=False, err=True))
        click.echo(click.style(f"  exit {r.exit_code} in {time.monotonic() - t:.2f} s", dim=True))

    say("a real Linux machine, with an agent's work in it and a process holding state in memory")
    run("uname -srm && hostname")
    run("mkdir -p /work && cd /work && git init -q && echo 'the plan' > notes.txt && git add . && "
        "git -c user.email=a@b -c user.name=demo commit -qm first && git log --oneline")
    sbx.exec(f"nohup {_DEMO_COUNTER} >/dev/null 2>&1 &")
    run(f"for i in $(seq 50); do {_DEMO_ASK} 2>/dev/null && exit; sleep 0.1; done; exit 1")
    say("save everything: memory, disk, running processes")
    t = time.monotonic()
    point = sbx.checkpoint(name=f"{sbx.name}-before")
    click.echo(f"checkpoint {point.id[:12]} in {time.monotonic() - t:.2f} s "
               f"(guest paused {point.pause_ms or 0:.0f} ms)")
    say("a step goes wrong")
    run("rm -rf /work; pkill -f 's[.]listen'; ls /work")
    say("take it back, in place")
    t = time.monotonic()
    sbx.restore(point)
    click.echo(f"restored in {time.monotonic() - t:.2f} s")
    run(f"cat /work/notes.txt && {_DEMO_ASK}  # the work, and the process with its count")
    say("try a risky step in a copy: kept only if it passes")
    outcome = try_in_copy(sbx, "rm -rf /work && false")
    click.echo(f"{outcome.reason} ({outcome.seconds:.2f} s)")
    run("ls /work")
    say("a project edit is guarded by git: undone when its check fails")
    guarded = sbx.guarded("echo broken > notes.txt", verify="grep -q plan notes.txt", cwd="/work")
    click.echo(f"{guarded.note} ({guarded.path}, {guarded.seconds:.2f} s)")
    run("cat /work/notes.txt")
    run("echo to stderr >&2; exit 3")


def main() -> None:
    logging.basicConfig(format="rewind: %(message)s", level=logging.WARNING)
    crashpoints.arm("cli")
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("rewind: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"rewind: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except RewindError as e:
        click.echo(f"rewind: error: {e}", err=True)
        sys.exit(1)
    except OSError as e:
        where = f": {str(e.filename)[:200]}" if e.filename else ""
        click.echo(f"rewind: error: {e.strerror or e}{where}", err=True)
        sys.exit(1)
    except Exception as e:  # a bug of ours: still one line, the traceback on request
        if os.environ.get("REWIND_DEBUG"):
            raise
        click.echo(f"rewind: internal error: {type(e).__name__}: {e} (REWIND_DEBUG=1 shows where)", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("rewind: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
