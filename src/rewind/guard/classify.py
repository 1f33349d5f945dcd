"""Classify a shell command by the cheapest undo that covers what it can do.

- none: it only reads;
- git: it changes only files in the project folder (the command's working directory) that
  git can take back: tracked files, and untracked ones that are not ignored;
- fork: it can change anything else: packages, services, processes, system files, ignored
  files, other folders, databases, or code whose effect cannot be known;
- external: it acts outside the machine (a push, a publish, a remote API call), where no
  snapshot can take it back.

The command is parsed with tree-sitter-bash and the syntax tree is walked
(rewind.guard.walker): every command in it counts, and the strongest part decides. Each
program is judged by the user's rules (rewind.guard.userrules: rewind.toml files), then by
the program table (rewind.guard.programs); a program in neither is `fork`.
"""

from __future__ import annotations

import posixpath

from rewind.errors import InvalidArgument
from rewind.guard.userrules import NO_RULES, UserRules
from rewind.guard.verdicts import Decision, Kind
from rewind.guard.walker import Shell, Walker

__all__ = ["MAX_COMMAND_BYTES", "Decision", "Kind", "checked_command", "classify"]

MAX_COMMAND_BYTES = 64 * 1024


def classify(command: str | bytes, cwd: str | None = None, rules: UserRules = NO_RULES) -> Decision:
    """Say what undo `command` needs when run in `cwd`, the project folder, with the user's
    `rules` ahead of the program table (none by default: see userrules.find_rules).

    Without `cwd`, only relative paths are inside the project. Raises InvalidArgument for an
    empty command, one longer than MAX_COMMAND_BYTES, or one that is not valid UTF-8.
    """
    text = checked_command(command)
    project = posixpath.normpath(cwd) if cwd else "."
    walker = Walker(project, rules)
    walker.source(text, Shell(here=project))
    return walker.decision(text)


def checked_command(command: object, what: str = "command") -> str:
    """`command` as text, or InvalidArgument if it is empty, too long or not UTF-8."""
    if not isinstance(command, str | bytes):
        raise InvalidArgument(f"{what} must be text, not {type(command).__name__}")
    try:
        text = command.decode("utf-8") if isinstance(command, bytes) else command
        data = text.encode("utf-8")  # a str from undecodable bytes holds lone surrogates: refused here
    except UnicodeError as e:
        raise InvalidArgument(f"{what} is not valid UTF-8") from e
    if len(data) > MAX_COMMAND_BYTES:
        raise InvalidArgument(f"{what} is {len(data)} bytes long; the limit is {MAX_COMMAND_BYTES} bytes")
    if not text.strip():
        raise InvalidArgument(f"{what} is empty")
    return text
