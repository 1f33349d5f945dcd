"""A diff (engine/changes/diff.py) as people read it: changed paths grouped by folder, with sizes and
what changed, coloured by kind; then packages, processes, sockets, rules, and counts."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator

import click

from rewind.results import Diff, FileChange

_MARK = {"added": ("+", "green"), "deleted": ("-", "red"), "modified": ("~", "yellow")}


def size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _what(c: FileChange) -> str:
    if c.kind == "added":
        s = c.after
        assert s is not None
        return f"{s.type}, {size_text(s.size)}" + (f" -> {s.target}" if s.target else "")
    if c.kind == "deleted":
        s = c.before
        assert s is not None
        return f"{s.type}, {size_text(s.size)}"
    a, b = c.before, c.after
    assert a is not None and b is not None
    parts = []
    if a.type != b.type:
        parts.append(f"{a.type} -> {b.type}")
    if a.size != b.size:
        parts.append(f"{size_text(a.size)} -> {size_text(b.size)}")
    elif a.mtime_ns != b.mtime_ns and a.type == b.type == "file":
        parts.append(f"content ({size_text(b.size)})")
    if a.mode != b.mode:
        parts.append(f"mode {a.mode:04o} -> {b.mode:04o}")
    if (a.uid, a.gid) != (b.uid, b.gid):
        parts.append(f"owner {a.uid}:{a.gid} -> {b.uid}:{b.gid}")
    if a.target != b.target:
        parts.append(f"target {a.target} -> {b.target}")
    return ", ".join(parts) or "replaced"


def lines(d: Diff) -> Iterator[str]:
    yield click.style(f"{d.before}  ->  {d.after}", bold=True)
    folder = None
    for c in d.files:
        parent, name = posixpath.split(c.path)
        if parent != folder:
            folder = parent
            yield click.style(parent.rstrip("/") + "/", fg="blue")
        mark, colour = _MARK[c.kind]
        noise = click.style("  (noise)", dim=True) if c.noise else ""
        yield "  " + click.style(f"{mark} {name}", fg=colour) + f"  {_what(c)}" + noise
    for p in d.packages:
        mark, colour = _MARK[{"installed": "added", "removed": "deleted"}.get(p.kind, "modified")]
        versions = p.after if p.kind == "installed" else p.before if p.kind == "removed" else \
            f"{p.before} -> {p.after}"
        yield click.style(f"package {mark} {p.name}", fg=colour) + f"  {versions}"
    for title, new, gone in (("process", d.processes_started, d.processes_ended),
                             ("listening", d.listening_opened, d.listening_closed)):
        for item in new or []:
            yield click.style(f"{title} + {item}", fg="green")
        for item in gone or []:
            yield click.style(f"{title} - {item}", fg="red")
    for title, change in (("network", d.network), ("labels", d.labels)):
        if change is not None:
            yield click.style(f"{title} ~ {change['before']} -> {change['after']}", fg="yellow")
    yield summary(d)
    for note in d.notes:
        yield click.style(f"note: {note}", dim=True)


def summary(d: Diff) -> str:
    counts = {k: sum(1 for c in d.files if c.kind == k) for k in ("added", "deleted", "modified")}
    parts = [f"{len(d.files)} paths ({counts['added']} added, {counts['deleted']} deleted, "
             f"{counts['modified']} modified)", f"{len(d.packages)} packages"]
    if d.processes_started is not None:
        opened, closed = len(d.listening_opened or []), len(d.listening_closed or [])
        parts.append(f"{len(d.processes_started)} processes started, {len(d.processes_ended or [])} ended, "
                     f"{opened} sockets opened, {closed} closed")
    else:
        parts.append("processes unknown")
    return ", ".join(parts)
