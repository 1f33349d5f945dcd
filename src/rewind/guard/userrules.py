"""Users' own rules: `rewind.toml` files that declare the kind of programs, their subcommands,
and writes to paths, ahead of the program table.

    [[rule]]
    program = "deploy-tool"   # a name or glob, matched against the program's base name
    subcommand = "push"       # optional: the first words after the program (globs allowed)
    kind = "external"

    [[rule]]
    path = "/srv/data/**"     # writes to what this glob matches; relative: in the project
    kind = "fork"
    reason = "the data volume is not in git"   # optional, shown in the explanation

Files are read from the project (the first `rewind.toml` found from the current folder
upward) and from the user's config folder ($XDG_CONFIG_HOME/rewind/rewind.toml, by default
~/.config/rewind/rewind.toml). The first rule that matches decides: the project's rules come
before the user's, and within a file rules apply in order.
"""

from __future__ import annotations

import os
import posixpath
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from rewind.errors import InvalidArgument
from rewind.guard.verdicts import Kind, Rule

FILE_NAME = "rewind.toml"
_FIELDS = frozenset({"program", "subcommand", "path", "kind", "reason"})


@dataclass(frozen=True)
class UserRule:
    """One [[rule]] of a file: a program (and subcommand) or a path glob, and its kind."""

    kind: Kind
    origin: str  # where it was written: "FILE:LINE #N" (FILE #N when its line cannot be told)
    program: str | None = None
    subcommand: tuple[str, ...] = ()
    path: str | None = None
    reason: str | None = None

    def verdict(self, what: str) -> Rule:
        """This rule's verdict; `what` says what the program does (a path rule's write)."""
        why = f"{what + ',' if what else 'is'} declared {self.kind} by a user's rule"
        return Rule(self.kind, f"{why}: {self.reason}" if self.reason else why, f"rule: {self.origin}")

    def matches_program(self, name: str, args: Sequence[str | None]) -> bool:
        if self.program is None:
            return False
        written = name if "/" in self.program else posixpath.basename(name)
        return fnmatchcase(written, self.program) and _has_subcommand(args, self.subcommand)

    def matches_path(self, path: str, project: str) -> bool:
        if self.path is None:
            return False
        pattern = self.path
        if not pattern.startswith(("/", "~")) and project != ".":
            pattern = posixpath.join(project, pattern)
        return _glob(pattern).fullmatch(path) is not None


def _has_subcommand(args: Sequence[str | None], words: tuple[str, ...]) -> bool:
    """Whether `args` begin with `words`, after flags (and the word after a flag, which may be
    its value: `kubectl -n prod apply`)."""
    for start in range(len(args) - len(words) + 1):
        given = args[start:start + len(words)]
        if all(arg is not None and fnmatchcase(arg, word) for arg, word in zip(given, words, strict=True)):
            return True
        arg, before = args[start] or "", (args[start - 1] or "") if start else ""
        if not (arg.startswith("-") or (before.startswith("-") and "=" not in before)):
            return False
    return not words


def _glob(pattern: str) -> re.Pattern[str]:
    """A path glob as a regular expression: `**` spans folders, `*` and `?` stay within one,
    and `DIR/**` matches DIR itself too."""
    pattern = posixpath.normpath(pattern) if pattern != "~" else pattern
    parts = re.split(r"(/\*\*$|\*\*/?|\*|\?)", pattern)
    regex = {"/**": "(/.*)?", "**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(regex.get(part, re.escape(part)) for part in parts))


@dataclass(frozen=True)
class UserRules:
    """The rules of every file read, in the order they apply."""

    rules: tuple[UserRule, ...] = ()

    def for_program(self, name: str, args: Sequence[str | None]) -> Rule | None:
        rule = next((rule for rule in self.rules if rule.matches_program(name, args)), None)
        return None if rule is None else rule.verdict("")

    def for_path(self, path: str, project: str, what: str) -> Rule | None:
        """The verdict on writing `path` (`what` says how, for the reason) if a rule matches it."""
        rule = next((rule for rule in self.rules if rule.matches_path(path, project)), None)
        return None if rule is None else rule.verdict(what)

    def declares(self, name: str) -> bool:
        """Whether a rule names the program `name` (with any subcommand)."""
        return any(rule.program is not None and fnmatchcase(name, rule.program) for rule in self.rules)


NO_RULES = UserRules()


def read_rules(*files: Path) -> UserRules:
    """The rules in `files`, in order; InvalidArgument naming the file and rule when one is wrong."""
    return UserRules(tuple(rule for file in files for rule in _read_file(file)))


def find_rules(start: Path | None = None) -> UserRules:
    """The project's rules (the first rewind.toml from `start`, by default the current folder,
    upward) and then the user's."""
    return read_rules(*[file for file in (project_file(start), user_file()) if file is not None])


def project_file(start: Path | None = None) -> Path | None:
    folder = (start or Path.cwd()).resolve()
    return next((f / FILE_NAME for f in (folder, *folder.parents) if (f / FILE_NAME).is_file()), None)


def user_file() -> Path | None:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    file = Path(config) / "rewind" / FILE_NAME
    return file if file.is_file() else None


def _read_file(file: Path) -> list[UserRule]:
    try:
        text = file.read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except (OSError, UnicodeError) as exc:
        raise InvalidArgument(f"{file}: cannot be read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{file}: not valid TOML: {exc}") from exc
    extra = set(data) - {"rule"}
    if extra:
        raise InvalidArgument(f"{file}: unknown table or key {sorted(extra)[0]!r}; rules are [[rule]] tables")
    rules = data.get("rule", [])
    if not isinstance(rules, list) or not all(isinstance(rule, dict) for rule in rules):
        raise InvalidArgument(f"{file}: `rule` must be an array of tables ([[rule]])")
    lines = [n for n, line in enumerate(text.splitlines(), 1) if re.match(r"\s*\[\[\s*rule\s*\]\]", line)]
    wheres = [f"{file}:{line}" for line in lines] if len(lines) == len(rules) else [str(file)] * len(rules)
    return [_rule(fields, where, f"{where} #{i + 1}")
            for i, (where, fields) in enumerate(zip(wheres, rules, strict=True))]


def _rule(fields: dict, where: str, origin: str) -> UserRule:
    """One [[rule]] table, checked; `where` (file and line) begins each error's message."""
    def fail(message: str) -> InvalidArgument:
        return InvalidArgument(f"{where}: rule #{origin.rpartition('#')[2]}: {message}")

    for name, value in fields.items():
        if name not in _FIELDS:
            raise fail(f"unknown field {name!r} (fields: {', '.join(sorted(_FIELDS))})")
        if not isinstance(value, str) or not value.strip():
            raise fail(f"{name} must be a non-empty string")
    kinds = ", ".join(kind.value for kind in Kind)
    if "kind" not in fields or fields["kind"] not in {kind.value for kind in Kind}:
        raise fail(f"kind must be one of {kinds}")
    if ("program" in fields) == ("path" in fields):
        raise fail("give either program or path")
    if "subcommand" in fields and "program" not in fields:
        raise fail("subcommand needs a program")
    return UserRule(Kind(fields["kind"]), origin, fields.get("program"),
                    tuple(fields.get("subcommand", "").split()), fields.get("path"), fields.get("reason"))
