"""One program run, as the shell walker (walker.py) hands it to the program table's entries
(entries.py, handlers.py, the inline readers): its name, arguments and shell, and the ways
back into the walk an entry may take (a wrapped command, shell code, files it writes).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import tree_sitter

from rewind.guard.verdicts import Kind, Rule
from rewind.guard.words import MAX_ALTERNATIVES, Word, folder_of, unescape, unescape_quoted


class Walks(Protocol):
    """What a Call asks of the walk it belongs to (walker.Walker)."""

    def through(self, via: str | None) -> AbstractContextManager[None]: ...

    def run(self, words: list[Word], text: str, shell: Shell) -> None: ...

    def nested(self, text: str, shell: Shell) -> None: ...

    def writes(self, words: Iterable[Word], verb: str, here: str | None, removes: bool = False) -> Rule: ...

    def place(self, path: str | None, here: str | None) -> Place: ...

    def knows(self, program: str) -> bool: ...


class Place(enum.IntEnum):
    """Where a written path lies, ordered by how much it matters."""

    HARMLESS = 0  # /dev/null, the terminal, a pipe
    INSIDE = 1  # in the project: git takes it back
    GIT_STORE = 2  # .git, or the whole project with it: git cannot take its own store back
    OUTSIDE = 3
    UNKNOWN = 4  # only known at run time
    REMOTE = 5  # bash's /dev/tcp/HOST/PORT: the bytes leave the machine


PIPE = "/dev/fd/63"  # what a process substitution >(cmd) stands for


@dataclass
class Shell:
    """What the walk knows of the shell at a point: its folder, variables and functions."""

    here: str | None  # the current folder, normalised; None when only known at run time
    variables: dict[str, tuple[str, ...] | None] = field(default_factory=dict)
    functions: set[str] = field(default_factory=set)
    target: str | None = None  # NAME=value that points its clients at another machine

    def copy(self) -> Shell:
        return Shell(self.here, dict(self.variables), set(self.functions), self.target)

    def aimed_at(self, target: str) -> Shell:
        """This shell for one command whose environment points it at another machine."""
        aimed = self.copy()
        aimed.target = target
        return aimed

    def moved(self, folder: Word) -> Shell:
        """A copy of this shell whose current folder is `folder` (as `cd folder` would)."""
        moved = self.copy()
        moved.here = folder_of(folder, self.here)
        return moved

    def expand(self, node: tree_sitter.Node) -> Word:
        return Word(self._values(node))

    def _values(self, node: tree_sitter.Node) -> tuple[str, ...] | None:
        kind, text = node.type, node_text(node)
        if kind == "command_name" and node.child_count == 1:
            return self._values(node.children[0])
        if kind == "word":
            return (unescape(text),)
        if kind in ("number", "brace_expression"):  # {1..3} stands for letters or numbers only
            return (text,)
        if kind == "raw_string":
            return (text[1:-1],)
        if kind == "ansi_c_string":
            return None if "\\" in text else (text[2:-1],)  # escapes could spell any path
        if kind == "string_content":
            return (unescape_quoted(text),)
        if kind in ("simple_expansion", "expansion"):
            return self._variable(node, text)
        if kind == "process_substitution":
            return (PIPE,)
        if kind in ("string", "concatenation"):
            parts = [child for child in node.children if child.type != '"']
            values: tuple[str, ...] = ("",)
            for part in parts:
                more = self._values(part)
                if more is None or len(values) * len(more) > MAX_ALTERNATIVES:
                    return None
                values = tuple(a + b for a in values for b in more)
            return values
        return None

    def _variable(self, node: tree_sitter.Node, text: str) -> tuple[str, ...] | None:
        names = [child for child in node.children if child.type in ("variable_name", "special_variable_name")]
        # Only $NAME and ${NAME}; ${NAME:-x} and the like are left unknown.
        if len(names) != 1 or node.child_count > (2 if node.type == "simple_expansion" else 3):
            return None
        name = node_text(names[0])
        if name in self.variables:
            values = self.variables[name]
        elif name == "HOME":
            values = ("~",)
        elif name == "PWD" and self.here is not None:
            values = (self.here,)
        else:
            return None
        # tree-sitter puts blanks before a $ inside double quotes into the expansion's node
        prefix = text[:text.index("$")]
        return None if values is None else tuple(prefix + value for value in values)


def node_text(node: tree_sitter.Node) -> str:
    return node.text.decode("utf-8", errors="replace") if node.text is not None else ""


def snippet(text: str) -> str:
    """`text` on one line, cut to 80 characters (only its start is looked at: reasons are made
    for every part of a command, which may be 64 KiB long)."""
    flat = " ".join(text[:240].split())
    return flat if len(flat) <= 80 and len(text) <= 240 else flat[:79] + "…"


@dataclass
class Call:
    """One program run as the walk sees it: its name, arguments and shell."""

    walker: Walks
    name: str
    args: list[Word]
    text: str  # the whole command's source, for reasons
    shell: Shell
    entry: str = ""  # the table entry judging it, with its subcommands: "kubectl apply"

    def shifted(self, args: list[Word], shell: Shell | None = None, entry: str | None = None) -> Call:
        """The same call with other arguments (those after a subcommand), another shell, or
        judged by a subcommand's entry."""
        return Call(self.walker, self.name, args, self.text, shell or self.shell,
                    self.entry if entry is None else entry)

    def run(self, words: list[Word], shell: Shell | None = None, via: str | None = None) -> None:
        """Judge the command `words` (a wrapped one) as part of this one; `via` names what ran
        it when that is not the shell (an inline program's call)."""
        with self.walker.through(via):
            self.walker.run(words, self.text, shell or self.shell)

    def knows(self, program: str) -> bool:
        """Whether a user's rule or the table knows `program`."""
        return self.walker.knows(program)

    def shell_code(self, word: Word, via: str | None = None) -> None:
        """Judge the shell code in `word` (bash -c, eval, trap), when it is known; `via` as for run."""
        if word.text is not None:
            with self.walker.through(via):
                self.walker.nested(word.text, self.shell)

    def writes(self, words: Iterable[Word], verb: str, removes: bool = False) -> Rule:
        """The rule for changing the files `words` name (`removes`: taking them away, so that
        naming the project folder itself takes .git with it)."""
        return self.walker.writes(words, verb, self.shell.here, removes)

    def locally(self, rule: Rule) -> Rule:
        """`rule` for a program that changes the current folder (a git rule): git only when
        that folder is in the project."""
        if rule.kind is not Kind.GIT:
            return rule
        here = self.shell.here
        place = self.walker.place(here, here)
        if place is Place.INSIDE:
            return rule
        if place is Place.UNKNOWN:
            return Rule(Kind.FORK, f"{rule.why} in a folder only known at run time")
        where = "inside .git" if place is Place.GIT_STORE else "outside the project"
        return Rule(Kind.FORK, f"{rule.why} in {here}, {where}")
