"""Classify a shell command by the cheapest undo that covers what it can do.

- none: it only reads;
- git: it changes only files in the project folder (the command's working directory) that
  git can take back: tracked files, and untracked ones that are not ignored;
- fork: it can change anything else: packages, services, processes, system files, ignored
  files, other folders, databases, or code whose effect cannot be known;
- external: it acts outside the machine (a push, a publish, a remote API call), where no
  snapshot can take it back.

The command is parsed with tree-sitter-bash and the syntax tree is walked: every command in
it counts (pipelines, lists, subshells, substitutions, loops, redirections), and the
strongest part decides. Programs are judged by the table _PROGRAMS at the end of this file:
to teach the classifier a program, add it there (the spec kinds above the table say what
each kind of entry means). A program in no table is `fork`: its effect cannot be known.
"""

from __future__ import annotations

import enum
import fnmatch
import functools
import posixpath
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import tree_sitter
import tree_sitter_bash

from rewind.errors import InvalidArgument

MAX_COMMAND_BYTES = 64 * 1024

_LANGUAGE = tree_sitter.Language(tree_sitter_bash.language())
_MAX_LEVEL = 100  # syntax levels and wrapped commands walked at once: bounds Python's stack on hostile input
_MAX_NESTING = 4  # shell code inside shell code (bash -c "bash -c '...'") read before giving up
_MAX_ALTERNATIVES = 32  # values one word may stand for (brace expansion, loop variables) before it is unknown


class Kind(enum.StrEnum):
    """How much undo a command needs, weakest first: external > fork > git > none."""

    NONE = "none"
    GIT = "git"
    FORK = "fork"
    EXTERNAL = "external"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    # Compare by rank, not as strings, so that max() picks the strongest kind.
    def __lt__(self, other: object) -> bool:
        return self.rank < other.rank if isinstance(other, Kind) else NotImplemented

    def __le__(self, other: object) -> bool:
        return self.rank <= other.rank if isinstance(other, Kind) else NotImplemented

    def __gt__(self, other: object) -> bool:
        return self.rank > other.rank if isinstance(other, Kind) else NotImplemented

    def __ge__(self, other: object) -> bool:
        return self.rank >= other.rank if isinstance(other, Kind) else NotImplemented


_RANKS = {kind: rank for rank, kind in enumerate(Kind)}


@dataclass(frozen=True)
class Decision:
    """The kind a command needs, and sentences saying which of its parts decided it."""

    kind: Kind
    reasons: tuple[str, ...]

    def to_json(self) -> dict:
        return {"kind": self.kind.value, "reasons": list(self.reasons)}


def classify(command: str | bytes, cwd: str | None = None) -> Decision:
    """Say what undo `command` needs when run in `cwd`, the project folder.

    Without `cwd`, only relative paths are inside the project. Raises InvalidArgument for an
    empty command, one longer than MAX_COMMAND_BYTES, or one that is not valid UTF-8.
    """
    text = checked_command(command)
    project = posixpath.normpath(cwd) if cwd else "."
    walker = _Walker(project)
    walker.source(text, _Shell(here=project))
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


# ---------------------------------------------------------------------------------------------
# Words and places


@dataclass(frozen=True)
class Word:
    """A shell word after expansion: the values it can take, or None when only known at run time."""

    values: tuple[str, ...] | None

    @property
    def text(self) -> str | None:
        """The word's value when it has exactly one."""
        return self.values[0] if self.values is not None and len(self.values) == 1 else None


def _literal(text: str) -> Word:
    return Word((text,))


_UNKNOWN = Word(None)
_HERE = _literal(".")


def _unescape(word: str) -> str:
    """Remove the backslashes of an unquoted word: `\\;` is `;`."""
    return re.sub(r"\\(.)", r"\1", word.replace("\\\n", ""), flags=re.DOTALL) if "\\" in word else word


def _unescape_quoted(content: str) -> str:
    """Inside double quotes a backslash escapes only $ ` " \\ and a newline."""
    return re.sub(r'\\([$`"\\])', r"\1", content.replace("\\\n", ""))


def _braces(path: str) -> list[str] | None:
    """Bash brace expansion of comma lists (`src/{a,b}` is src/a and src/b), so each path is
    judged; None when it stands for more than _MAX_ALTERNATIVES."""
    done: list[str] = []
    pending = [path]
    while pending:
        current = pending.pop()
        group = _brace_group(current)
        if group is None:
            done.append(current)
        else:
            start, end, parts = group
            pending += [current[:start] + part + current[end + 1:] for part in parts]
        if len(done) + len(pending) > _MAX_ALTERNATIVES:
            return None
    return done


def _brace_group(text: str) -> tuple[int, int, list[str]] | None:
    """The first {a,b,...} in `text`: where it starts and ends, and its parts."""
    depth = start = 0
    for i, ch in enumerate(text):
        if ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                parts, level, begin = [], 0, start + 1
                for j in range(start + 1, i):
                    level += {"{": 1, "}": -1}.get(text[j], 0)
                    if text[j] == "," and level == 0:
                        parts.append(text[begin:j])
                        begin = j + 1
                if parts:
                    return start, i, [*parts, text[begin:i]]
    return None


class _Place(enum.IntEnum):
    """Where a written path lies, ordered by how much it matters."""

    HARMLESS = 0  # /dev/null, the terminal, a pipe
    INSIDE = 1  # in the project: git takes it back
    GIT_STORE = 2  # .git, or the whole project with it: git cannot take its own store back
    OUTSIDE = 3
    UNKNOWN = 4  # only known at run time
    REMOTE = 5  # bash's /dev/tcp/HOST/PORT: the bytes leave the machine


_HARMLESS_FILES = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty"})
_PIPE = "/dev/fd/63"  # what a process substitution >(cmd) stands for


# ---------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class Options:
    """How a program reads its flags, so that its operands (files, URLs, subcommands) are found.

    Short flags may be bundled (`-rf`, `-sSfo FILE`); a long flag's value may follow `=`.
    `aliases` gives one spelling to flags that mean the same (`--recursive` and `-r`).
    """

    short_values: str = ""  # short flags that take a value: "o" for -o FILE / -oFILE
    long_values: frozenset[str] = frozenset()  # long flags that take a value: --output FILE
    optional: str = ""  # short flags whose value can only be attached: sed -i.bak
    aliases: Mapping[str, str] = field(default_factory=dict)

    def parse(self, words: Sequence[Word], permute: bool = True) -> Parsed:
        """Split `words` into flags and operands. With permute (GNU style) flags may follow
        operands; without it (wrappers, interpreters) the first operand ends the flags."""
        parsed = Parsed([], [])
        i = 0
        while i < len(words):
            word, text = words[i], words[i].text
            i += 1
            if text is None or text == "-" or not text.startswith("-"):
                parsed.operands.append(word)
                if not permute:
                    parsed.operands += words[i:]
                    break
            elif text == "--":
                parsed.operands += words[i:]
                break
            elif text.startswith("--"):
                name, eq, value = text.partition("=")
                if eq:
                    parsed.flags.append((self.aliases.get(name, name), _literal(value)))
                elif name in self.long_values and i < len(words):
                    parsed.flags.append((self.aliases.get(name, name), words[i]))
                    i += 1
                else:
                    parsed.flags.append((self.aliases.get(name, name), None))
            else:
                for j, ch in enumerate(text[1:], start=2):
                    flag, rest = self.aliases.get("-" + ch, "-" + ch), text[j:]
                    if ch in self.short_values:
                        if rest:
                            parsed.flags.append((flag, _literal(rest)))
                        elif i < len(words):
                            parsed.flags.append((flag, words[i]))
                            i += 1
                        else:
                            parsed.flags.append((flag, None))
                        break
                    if ch in self.optional:
                        parsed.flags.append((flag, _literal(rest) if rest else None))
                        break
                    parsed.flags.append((flag, None))
        return parsed


@dataclass
class Parsed:
    flags: list[tuple[str, Word | None]]
    operands: list[Word]

    def has(self, *names: str) -> bool:
        return any(name in names for name, _ in self.flags)

    def values(self, *names: str) -> list[Word]:
        return [value for name, value in self.flags if name in names and value is not None]

    def value(self, name: str) -> str | None:
        """The last static value given to flag `name`."""
        values = self.values(name)
        return values[-1].text if values else None


_NO_OPTIONS = Options()


def _files(words: Iterable[Word]) -> list[Word]:
    """The words that name files: `-` stands for standard input or output."""
    return [word for word in words if word.text != "-"]


# ---------------------------------------------------------------------------------------------
# What a program does: the kinds of entry in _PROGRAMS. Each is called with the command (a
# _Call) and returns the rules that apply to it; rules carry the kind and the reason's words.

_Entry = Callable[["_Call"], list["Rule"]]


@dataclass(frozen=True)
class Rule:
    """A verdict: the kind, and what the program does, as the end of a sentence."""

    kind: Kind
    why: str

    def __call__(self, call: _Call) -> list[Rule]:
        return [call.locally(self)]


@dataclass(frozen=True)
class Writer:
    """A program whose effect is changing the files it names: its operands (which ones:
    `written`) and the values of `target_flags`, as in `cp -t DIR`."""

    verb: str
    options: Options = _NO_OPTIONS
    written: Literal["all", "last", "first", "second", "none"] = "all"
    target_flags: tuple[str, ...] = ()
    removes: bool = False  # it takes its files away: naming the project folder takes .git too

    def __call__(self, call: _Call) -> list[Rule]:
        parsed = self.options.parse(call.args)
        ops = parsed.operands
        chosen = {"all": ops, "last": ops[-1:], "first": ops[:1], "second": ops[1:2],
                  "none": []}[self.written]
        return [call.writes([*chosen, *parsed.values(*self.target_flags)], self.verb, self.removes)]


@dataclass(frozen=True)
class Subcommands:
    """A program whose first operand picks what it does (`apt install`, `kubectl get`).

    `verbs` maps a subcommand (or a flag acting as one, as dpkg's `-l`) to its entry, which
    may be another Subcommands; other subcommands get `default`, and no subcommand `bare`.
    Flags before the subcommand are skipped, with their value when in `value_flags`.
    """

    verbs: Mapping[str, _Entry]
    default: Rule
    bare: Rule | None = None  # None: the program alone prints its usage
    value_flags: frozenset[str] = frozenset()

    def __call__(self, call: _Call) -> list[Rule]:
        i = 0
        while i < len(call.args):
            text = call.args[i].text
            if text in self.verbs:
                return self.verbs[text](call.shifted(call.args[i + 1:]))
            if text is None or not text.startswith("-"):
                return [call.locally(self.default)]
            i += 2 if text in self.value_flags else 1
        return [call.locally(self.bare or _USAGE)]


@dataclass(frozen=True)
class Wrapper:
    """A program that runs the command after its own flags (`sudo`, `env`, `xargs`): that
    command decides."""

    options: Options = _NO_OPTIONS
    leading: int = 0  # operands before the command: timeout's DURATION
    assignments: bool = False  # NAME=value words may come before the command
    dir_flags: tuple[str, ...] = ()  # flags that set the command's folder: env -C DIR
    flag_rules: Mapping[str, Rule] = field(default_factory=dict)  # flags that decide alone: sudo -e
    feeds_args: bool = False  # xargs: the command gets more arguments, only known at run time
    bare: Rule | None = None  # the wrapper alone; None: it only reads

    def __call__(self, call: _Call) -> list[Rule]:
        parsed = self.options.parse(call.args, permute=False)
        for flag, rule in self.flag_rules.items():
            if parsed.has(flag):
                return [rule]
        command = parsed.operands
        rules = []
        while self.assignments and command and _assigned(command[0]):
            if _assigned(command[0]) in _RISKY_VARIABLES:
                rules.append(_risky_variable(_assigned(command[0])))
            command = command[1:]
        command = command[self.leading:]
        if not command:
            return [*rules, self.bare or _READS]
        shell = call.shell
        for folder in parsed.values(*self.dir_flags):
            shell = shell.moved(folder)
        call.run([*command, _UNKNOWN] if self.feeds_args else command, shell)
        return rules


def _assigned(word: Word) -> str:
    """The variable a NAME=value word sets, or ''."""
    name, equals, _ = (word.text or "").partition("=")
    return name if equals and name.isidentifier() else ""


@dataclass(frozen=True)
class ReadsUnless:
    """A program that only reads unless one of `words` (a flag or an operand) is given."""

    words: frozenset[str]
    rule: Rule

    def __call__(self, call: _Call) -> list[Rule]:
        given = {word.text.partition("=")[0] for word in call.args if word.text}
        return [self.rule if given & self.words else _READS]


# ---------------------------------------------------------------------------------------------
# The walk over the syntax tree


@dataclass
class _Shell:
    """What the walk knows of the shell at a point: its folder, variables and functions."""

    here: str | None  # the current folder, normalised; None when only known at run time
    variables: dict[str, tuple[str, ...] | None] = field(default_factory=dict)
    functions: set[str] = field(default_factory=set)

    def copy(self) -> _Shell:
        return _Shell(self.here, dict(self.variables), set(self.functions))

    def moved(self, folder: Word) -> _Shell:
        """A copy of this shell whose current folder is `folder` (as `cd folder` would)."""
        moved = self.copy()
        moved.here = _folder(folder, self.here)
        return moved

    def expand(self, node: tree_sitter.Node) -> Word:
        return Word(self._values(node))

    def _values(self, node: tree_sitter.Node) -> tuple[str, ...] | None:
        kind, text = node.type, _text(node)
        if kind == "command_name" and node.child_count == 1:
            return self._values(node.children[0])
        if kind == "word":
            return (_unescape(text),)
        if kind in ("number", "brace_expression"):  # {1..3} stands for letters or numbers only
            return (text,)
        if kind == "raw_string":
            return (text[1:-1],)
        if kind == "ansi_c_string":
            return None if "\\" in text else (text[2:-1],)  # escapes could spell any path
        if kind == "string_content":
            return (_unescape_quoted(text),)
        if kind in ("simple_expansion", "expansion"):
            return self._variable(node, text)
        if kind == "process_substitution":
            return (_PIPE,)
        if kind in ("string", "concatenation"):
            parts = [child for child in node.children if child.type != '"']
            values: tuple[str, ...] = ("",)
            for part in parts:
                more = self._values(part)
                if more is None or len(values) * len(more) > _MAX_ALTERNATIVES:
                    return None
                values = tuple(a + b for a in values for b in more)
            return values
        return None

    def _variable(self, node: tree_sitter.Node, text: str) -> tuple[str, ...] | None:
        names = [child for child in node.children if child.type in ("variable_name", "special_variable_name")]
        # Only $NAME and ${NAME}; ${NAME:-x} and the like are left unknown.
        if len(names) != 1 or node.child_count > (2 if node.type == "simple_expansion" else 3):
            return None
        name = _text(names[0])
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


def _text(node: tree_sitter.Node) -> str:
    return node.text.decode("utf-8", errors="replace") if node.text is not None else ""


def _folder(word: Word, here: str | None) -> str | None:
    """The folder `word` names, seen from `here`; None when only known at run time (~ and `cd -`
    included: where they lead is not known here)."""
    text = word.text
    if text is None or text.startswith("~") or text == "-":
        return None
    return _absolute(text, here)


def _absolute(path: str, here: str | None) -> str | None:
    """`path` seen from `here`, normalised; relative to the project when the project is '.'."""
    if not path.startswith("/"):
        if here is None:
            return None
        path = posixpath.join(here, path)
    path = posixpath.normpath(path)
    return path[1:] if path.startswith("//") else path


def _snippet(text: str) -> str:
    """`text` on one line, cut to 80 characters (only its start is looked at: reasons are made
    for every part of a command, which may be 64 KiB long)."""
    flat = " ".join(text[:240].split())
    return flat if len(flat) <= 80 and len(text) <= 240 else flat[:79] + "…"


@dataclass
class _Call:
    """One program run as the walk sees it: its name, arguments and shell."""

    walker: _Walker
    name: str
    args: list[Word]
    text: str  # the whole command's source, for reasons
    shell: _Shell

    def shifted(self, args: list[Word], shell: _Shell | None = None) -> _Call:
        """The same call with other arguments (those after a subcommand), or another shell."""
        return _Call(self.walker, self.name, args, self.text, shell or self.shell)

    def run(self, words: list[Word], shell: _Shell | None = None) -> None:
        """Judge the command `words` (a wrapped one) as part of this one."""
        self.walker.run(words, self.text, shell or self.shell)

    def shell_code(self, word: Word) -> None:
        """Judge the shell code in `word` (bash -c, eval, trap), when it is known."""
        if word.text is not None:
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
        if place is _Place.INSIDE:
            return rule
        if place is _Place.UNKNOWN:
            return Rule(Kind.FORK, f"{rule.why} in a folder only known at run time")
        where = "inside .git" if place is _Place.GIT_STORE else "outside the project"
        return Rule(Kind.FORK, f"{rule.why} in {here}, {where}")


class _Walker:
    """Walks a syntax tree and collects findings: (kind, reason) for each part."""

    def __init__(self, project: str) -> None:
        self.project = project
        self.findings: list[tuple[Kind, str]] = []
        self.level = 0
        self.nesting = 0

    def decision(self, text: str) -> Decision:
        if not self.findings:
            return Decision(Kind.NONE, (f"`{_snippet(text)}` runs no command (none)",))
        kind = max(kind for kind, _ in self.findings)
        return Decision(kind, tuple(dict.fromkeys(reason for k, reason in self.findings if k is kind)))

    def add(self, rule: Rule, subject: str) -> None:
        self.findings.append((rule.kind, f"`{_snippet(subject)}` {rule.why} ({rule.kind})"))

    def source(self, text: str, shell: _Shell) -> None:
        if "{" in text and max(text) > "\uffff":
            # tree-sitter-bash 0.25.1's scanner calls isdigit() on the character after a `{`: for one
            # beyond U+FFFF that reads out of bounds and can crash the process (upstream issue #337).
            # Such characters are read as U+FFFD; neither shell syntax nor paths depend on them.
            text = "".join(ch if ch <= "\uffff" else "\ufffd" for ch in text)
        root = tree_sitter.Parser(_LANGUAGE).parse(text.encode("utf-8")).root_node
        if root.has_error:
            # Still walk what was understood: a push next to a typo is still a push.
            self.add(Rule(Kind.FORK, "could not be parsed"), text)
        self.walk(root, shell)

    def nested(self, text: str, shell: _Shell) -> None:
        if self.nesting >= _MAX_NESTING:
            self.add(Rule(Kind.FORK, "nests shell code too deeply to read"), text)
            return
        self.nesting += 1
        self.source(text, shell.copy())
        self.nesting -= 1

    def writes(self, words: Iterable[Word], verb: str, here: str | None, removes: bool = False) -> Rule:
        """The rule for changing the files `words` name, seen from the folder `here`."""
        worst: _Place | None = None
        shown: str | None = None
        for word in words:
            for value in word.values or (None,):
                for path in (_braces(value) or [None]) if value is not None else [None]:
                    place = self.place(path, here)
                    if removes and place is _Place.INSIDE and _absolute(path or "", here) == self.project:
                        place = _Place.GIT_STORE
                    if worst is None or place > worst:
                        worst, shown = place, path
        if worst is None:
            return _READS
        if worst is _Place.HARMLESS:
            return Rule(Kind.NONE, f"{verb} only {shown}")
        if worst is _Place.INSIDE:
            return Rule(Kind.GIT, f"{verb} {shown}, inside the project")
        if worst is _Place.GIT_STORE:
            return Rule(Kind.FORK, f"{verb} {shown}, which holds .git: git cannot take its own store back")
        if worst is _Place.OUTSIDE:
            return Rule(Kind.FORK, f"{verb} {shown}, outside the project")
        if worst is _Place.REMOTE:
            return Rule(Kind.EXTERNAL, f"{verb} {shown}, which sends it to another machine")
        if shown is None:
            return Rule(Kind.FORK, f"{verb} a path only known at run time")
        return Rule(Kind.FORK, f"{verb} {shown} in a folder only known at run time")

    def place(self, path: str | None, here: str | None) -> _Place:
        if path is None:
            return _Place.UNKNOWN
        if path in _HARMLESS_FILES or path.startswith("/dev/fd/"):
            return _Place.HARMLESS
        if path.startswith(("/dev/tcp/", "/dev/udp/")):
            host = path.split("/")[3]
            return _Place.OUTSIDE if _is_local(host) else _Place.REMOTE
        if path.startswith("~"):
            return _Place.OUTSIDE
        full = _absolute(path, here)
        if full is None:
            return _Place.UNKNOWN
        if self.project == ".":
            inside = not full.startswith("/") and full != ".." and not full.startswith("../")
            rest = full
        else:
            root = self.project.rstrip("/") + "/"
            inside = full == self.project or full.startswith(root)
            rest = full[len(root):]
        if not inside:
            return _Place.OUTSIDE
        # A glob such as .* matches .git too (bash globs match a leading dot only when they start with one).
        store = any(part.startswith(".") and fnmatch.fnmatchcase(".git", part) for part in rest.split("/"))
        return _Place.GIT_STORE if store else _Place.INSIDE

    # -- statements ------------------------------------------------------------------------

    def walk(self, node: tree_sitter.Node, shell: _Shell) -> None:
        if self.level >= _MAX_LEVEL:
            self.add(Rule(Kind.FORK, "is nested too deeply to read"), _text(node))
            return
        self.level += 1
        _STATEMENTS.get(node.type, _Walker.descend)(self, node, shell)
        self.level -= 1

    def descend(self, node: tree_sitter.Node, shell: _Shell) -> None:
        for child in node.children:
            self.walk(child, shell)

    def in_subshell(self, node: tree_sitter.Node, shell: _Shell) -> None:
        self.descend(node, shell.copy())

    def pipeline(self, node: tree_sitter.Node, shell: _Shell) -> None:
        for child in node.children:
            self.walk(child, shell.copy())  # each part of a pipeline runs in a subshell

    def list_(self, node: tree_sitter.Node, shell: _Shell) -> None:
        conditional = False
        for child in node.children:
            if child.type in ("&&", "||"):
                conditional = child.type == "||"
            elif conditional:
                self.maybe(self.walk, child, shell)
            else:
                self.walk(child, shell)

    def conditional(self, node: tree_sitter.Node, shell: _Shell) -> None:
        """if, while, case: their parts may or may not run."""
        self.maybe(self.descend, node, shell)

    def maybe(self, walk: Callable[[tree_sitter.Node, _Shell], None], node: tree_sitter.Node,
              shell: _Shell) -> None:
        """Walk a part that may or may not run: a `cd` in it leaves the folder unknown after it."""
        before = shell.here
        walk(node, shell)
        if shell.here != before:
            shell.here = None

    def for_loop(self, node: tree_sitter.Node, shell: _Shell) -> None:
        variable = node.child_by_field_name("variable")
        words = [shell.expand(value) for value in node.children_by_field_name("value")]
        values = tuple(v for word in words for v in word.values or ())
        known = bool(words) and all(word.values is not None for word in words)
        if variable is not None:
            shell.variables[_text(variable)] = values if known and len(values) <= _MAX_ALTERNATIVES else None
        self.maybe(self.descend, node, shell)

    def function(self, node: tree_sitter.Node, shell: _Shell) -> None:
        name = node.child_by_field_name("name")
        if name is not None:
            shell.functions.add(_text(name))
        self.descend(node, shell.copy())  # its body counts as if it were called

    def assignment(self, node: tree_sitter.Node, shell: _Shell) -> None:
        self.assign(node, shell)
        self.add(Rule(Kind.NONE, "only sets a shell variable"), _text(node))

    def assign(self, node: tree_sitter.Node, shell: _Shell, for_command: bool = False) -> None:
        """NAME=value: remembered for the words that follow, unless it is only for one command."""
        name, value = node.child_by_field_name("name"), node.child_by_field_name("value")
        if name is not None:
            if _text(name) in _RISKY_VARIABLES:
                self.add(_risky_variable(_text(name)), _text(node))
            if not for_command:
                shell.variables[_text(name)] = shell.expand(value).values if value is not None else ("",)
        self.descend(node, shell)

    def declaration(self, node: tree_sitter.Node, shell: _Shell) -> None:
        for child in node.children:
            if child.type == "variable_assignment":
                self.assign(child, shell)
            else:
                self.walk(child, shell)
        self.add(Rule(Kind.NONE, "only sets shell variables"), _text(node))

    def unset(self, node: tree_sitter.Node, shell: _Shell) -> None:
        for child in node.children:
            shell.variables.pop(_text(child), None)
        self.add(Rule(Kind.NONE, "only unsets shell variables"), _text(node))

    def test(self, node: tree_sitter.Node, shell: _Shell) -> None:
        self.descend(node, shell)
        self.add(Rule(Kind.NONE, "only tests a condition"), _text(node))

    def redirected(self, node: tree_sitter.Node, shell: _Shell) -> None:
        body = node.child_by_field_name("body")
        extra: list[tree_sitter.Node] = []
        for child in node.children:  # redirections are opened before the body runs
            if child != body:
                extra += self.redirect(child, shell)
        if body is not None and body.type == "command":
            self.walk_command(body, shell, extra, _text(node))
            return
        if extra:  # bash rejects words after the redirection of a compound command
            self.add(Rule(Kind.FORK, "could not be parsed"), _text(node))
        if body is not None:
            self.walk(body, shell)

    def redirect(self, node: tree_sitter.Node, shell: _Shell) -> list[tree_sitter.Node]:
        """Judge one redirection; return the words tree-sitter put in it that are really
        arguments of the command (`rm a 2>/dev/null b` gives the redirection both /dev/null and b)."""
        if node.type != "file_redirect":
            if node.type == "heredoc_redirect":
                # It holds a redirection of its own, and what follows the heredoc's first line
                # (`cat <<EOF | sh`, `cat <<EOF > file`); the body's substitutions run too.
                return [word for child in node.children for word in self.redirect(child, shell)]
            self.walk(node, shell)
            return []
        operator = next((c.type for c in node.children if not c.is_named), "")
        targets = node.children_by_field_name("destination")
        for child in node.children:
            if child.type in ("command_substitution", "process_substitution") or child in targets[:1]:
                self.walk(child, shell)
        if ">" in operator and targets and targets[0].type not in ("number", "process_substitution"):
            target = shell.expand(targets[0])
            if not (operator in (">&", "<&") and target.text == "-"):  # >&- closes a descriptor
                self.add(self.writes([target], "writes", shell.here), _text(node))
        return targets[1:]

    def walk_command(self, node: tree_sitter.Node, shell: _Shell, extra: Sequence[tree_sitter.Node] = (),
                     text: str | None = None) -> None:
        words: list[Word] = []
        for i, child in enumerate(node.children):
            field_name = node.field_name_for_child(i)
            if field_name == "redirect":
                extra = [*extra, *self.redirect(child, shell)]
            elif child.type == "variable_assignment":
                self.assign(child, shell, for_command=True)
            else:
                self.walk(child, shell)  # substitutions in the words run first
                if field_name in ("name", "argument"):
                    words.append(_UNKNOWN if child.has_error else shell.expand(child))
        for word in extra:
            self.walk(word, shell)
            words.append(shell.expand(word))
        name = node.child_by_field_name("name")
        if name is not None and not name.has_error:  # a missing name is reported as a parse error
            self.run(words, text or _text(node), shell)

    def run(self, words: list[Word], text: str, shell: _Shell) -> None:
        """Judge the program `words` runs; `text` is the command the reasons quote."""
        if self.level >= _MAX_LEVEL:
            self.add(Rule(Kind.FORK, "is nested too deeply to read"), text)
            return
        self.level += 1
        for rule in _judge(_Call(self, words[0].text or "", words[1:], text, shell)):
            self.add(rule, text)
        self.level -= 1


_STATEMENTS: dict[str, Callable[[_Walker, tree_sitter.Node, _Shell], None]] = {
    "command": _Walker.walk_command,
    "redirected_statement": _Walker.redirected,
    "pipeline": _Walker.pipeline,
    "list": _Walker.list_,
    "subshell": _Walker.in_subshell,
    "command_substitution": _Walker.in_subshell,
    "process_substitution": _Walker.in_subshell,
    "if_statement": _Walker.conditional,
    "while_statement": _Walker.conditional,
    "case_statement": _Walker.conditional,
    "c_style_for_statement": _Walker.conditional,
    "for_statement": _Walker.for_loop,
    "function_definition": _Walker.function,
    "variable_assignment": _Walker.assignment,
    "declaration_command": _Walker.declaration,
    "unset_command": _Walker.unset,
    "test_command": _Walker.test,
}


# ---------------------------------------------------------------------------------------------
# Judging one program

_SYSTEM_BIN = frozenset({"/bin", "/sbin", "/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin"})


def _program(name: str) -> str | None:
    """The _PROGRAMS key for a command name: /usr/bin/rm is rm, python3.11 is python."""
    folder, base = posixpath.split(name)
    if folder and folder not in _SYSTEM_BIN:
        return None  # ./run.sh, .venv/bin/x: a program of its own
    if base in _PROGRAMS:
        return base
    unversioned = re.fullmatch(r"([a-z]+?)-?[0-9.]+", base)
    return unversioned.group(1) if unversioned and unversioned.group(1) in _PROGRAMS else None


def _judge(call: _Call) -> list[Rule]:
    if not call.name:
        return [Rule(Kind.FORK, "runs a command whose name is only known at run time")]
    if call.name in call.shell.functions:
        return [Rule(Kind.NONE, "calls a function the command defines (its body is judged)")]
    program = _program(call.name)
    if program is None:
        if "/" in call.name:
            return [Rule(Kind.FORK, f"runs the program {call.name}; its effect cannot be known")]
        return [Rule(Kind.FORK, "is not a known command; its effect cannot be known")]
    if [word.text for word in call.args] in (["--version"], ["--help"]):
        return [Rule(Kind.NONE, "only prints its version or help")]
    return _PROGRAMS[program](call.shifted(call.args))


# ---------------------------------------------------------------------------------------------
# Rules shared by many programs

_READS = Rule(Kind.NONE, "only reads")
_USAGE = Rule(Kind.NONE, "only prints its usage")
_SHELL_STATE = Rule(Kind.NONE, "only changes the shell's own state")
_PACKAGES = Rule(Kind.FORK, "installs or removes packages")
_RUNS_CODE = Rule(Kind.FORK, "runs code whose effect cannot be known")
_SERVICES = Rule(Kind.FORK, "changes system services")
_PROCESSES = Rule(Kind.FORK, "signals or stops running processes")
_SETTINGS = Rule(Kind.FORK, "changes settings outside the project")
_SYSTEM = Rule(Kind.FORK, "changes the system's configuration")
_DATABASE = Rule(Kind.FORK, "can change a database")
_OWNERSHIP = Rule(Kind.FORK, "changes file ownership or attributes, which git does not record")
_EDITOR = Rule(Kind.FORK, "opens an editor that can change any file")
_REPO = Rule(Kind.GIT, "changes the repository or its work tree")
_FOLDER = Rule(Kind.GIT, "writes files in the current folder")
_PUBLISHES = Rule(Kind.EXTERNAL, "publishes to a remote registry")
_PUSHES = Rule(Kind.EXTERNAL, "pushes to a remote repository")
_REMOTE = Rule(Kind.EXTERNAL, "changes a remote system")
_ANOTHER_MACHINE = Rule(Kind.EXTERNAL, "acts on another machine")
_MAIL = Rule(Kind.EXTERNAL, "sends email")
_SCHEDULES = Rule(Kind.FORK, "changes scheduled jobs")


def _words(words: str) -> frozenset[str]:
    return frozenset(words.split())


def _each(words: str, entry: _Entry) -> dict[str, _Entry]:
    """`entry` for each of the blank-separated `words`: a table's rows for programs or verbs alike."""
    return dict.fromkeys(words.split(), entry)


def _verbs(reads: str, default: Rule, bare: Rule | None = None, **more: _Entry) -> Subcommands:
    """Subcommands where the verbs in `reads` only read, those in `more` are judged as given
    (run_script stands for run-script), and the others get `default`."""
    return Subcommands({**_each(reads, _READS), **{k.replace("_", "-"): v for k, v in more.items()}},
                       default=default, bare=bare)


_package_manager = functools.partial(_verbs, default=_PACKAGES)  # verbs that do not read change packages
_forge = functools.partial(_verbs, default=_REMOTE)  # verbs that do not read change the forge


# Variables that change what programs run (LD_PRELOAD, GIT_PAGER) or where they work (GIT_DIR)
_RISKY_VARIABLES = frozenset({
    "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "BASH_ENV", "ENV", "PROMPT_COMMAND", "GIT_SSH_COMMAND",
    "GIT_SSH", "GIT_PROXY_COMMAND", "GIT_EXTERNAL_DIFF", "GIT_PAGER", "PAGER", "MANPAGER", "GIT_EDITOR",
    "EDITOR", "VISUAL", "GIT_ASKPASS", "SSH_ASKPASS", "GIT_DIR", "GIT_WORK_TREE", "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_COUNT", "GIT_EXEC_PATH", "LESSOPEN", "LESSCLOSE",
    "NODE_OPTIONS", "PERL5OPT", "RUBYOPT"})


def _risky_variable(name: str) -> Rule:
    return Rule(Kind.FORK, f"sets {name}, which changes what programs run or where they work")


_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", ""})


def _is_local(host: str) -> bool:
    return host in _LOCAL_HOSTS or host.startswith(("127.", "/")) or host.endswith(".localhost")


def _remote_url(word: Word) -> bool:
    """Whether `word` (a URL, or a host:port shorthand) may name another machine."""
    if word.values is None:
        return True
    for value in word.values:
        if value.startswith("file:"):
            continue
        try:
            host = urlsplit(value if "://" in value else "http://" + value).hostname or ""
        except ValueError:
            return True
        if not _is_local(host):
            return True
    return False


def _request(remote: bool, method: str) -> Rule:
    if remote:
        return Rule(Kind.EXTERNAL, f"sends a {method} request to another machine")
    return Rule(Kind.FORK, f"sends a {method} request to a service on this machine")


# ---------------------------------------------------------------------------------------------
# Handlers: programs whose effect depends on their arguments in ways a table cannot say.


def _cd(call: _Call) -> list[Rule]:
    folders = [word for word in call.args if not (word.text or "").startswith("-") or word.text == "-"]
    call.shell.here = _folder(folders[0], call.shell.here) if folders else None  # `cd` alone goes home
    return [Rule(Kind.NONE, "changes the shell's folder")]


def _popd(call: _Call) -> list[Rule]:
    call.shell.here = None
    return [Rule(Kind.NONE, "changes the shell's folder")]


_READ_OPTIONS = Options(short_values="adinNptu")


def _read(call: _Call) -> list[Rule]:
    for word in _READ_OPTIONS.parse(call.args).operands:
        call.shell.variables[word.text or ""] = None  # its value comes from the input
    return [_SHELL_STATE]


def _trap(call: _Call) -> list[Rule]:
    operands = _NO_OPTIONS.parse(call.args).operands
    if len(operands) > 1:
        call.shell_code(operands[0])  # the action runs later, on the signal
    return [_SHELL_STATE]


_SHELL_OPTIONS = Options(short_values="oO", long_values=frozenset({"--rcfile", "--init-file"}))


def _shell(call: _Call) -> list[Rule]:
    parsed = _SHELL_OPTIONS.parse(call.args, permute=False)
    if parsed.has("-c"):
        if parsed.operands:
            call.shell_code(parsed.operands[0])
        return [Rule(Kind.FORK, "runs a string of shell code")]
    if parsed.has("-n"):
        return [Rule(Kind.NONE, "only checks a script's syntax")]
    if parsed.operands:
        return [Rule(Kind.FORK, "runs a shell script")]
    return [Rule(Kind.FORK, "runs shell commands from its input")]


def _eval(call: _Call) -> list[Rule]:
    texts = [word.text for word in call.args]
    if call.args and None not in texts:
        call.shell_code(_literal(" ".join(t for t in texts if t is not None)))
    return [Rule(Kind.FORK, "runs a string as shell code")]


_SU_OPTIONS = Options(short_values="cgGsw", long_values=frozenset({"--command", "--group", "--shell"}),
                      aliases={"--command": "-c"})


def _su(call: _Call) -> list[Rule]:
    code = _SU_OPTIONS.parse(call.args).values("-c")
    if not code:
        return [Rule(Kind.FORK, "opens a shell as another user")]
    call.shell_code(code[-1])
    return [Rule(Kind.FORK, "runs shell code as another user")]


_PYTHON_OPTIONS = Options(short_values="cmWXQ")


def _python(call: _Call) -> list[Rule]:
    parsed = _PYTHON_OPTIONS.parse(call.args, permute=False)
    module = parsed.value("-m")
    if module in ("pip", "pip3"):
        return _PROGRAMS["pip"](call.shifted(parsed.operands))
    if parsed.has("-V") and not parsed.operands and not parsed.has("-c", "-m"):
        return [Rule(Kind.NONE, "only prints its version")]
    return [_RUNS_CODE]


def _edits_in_place(call: _Call, options: Options, script_flags: tuple[str, ...]) -> list[Rule]:
    """sed -i, perl -pi, yq -i: the files after the script are edited; the script is the first
    operand unless given by one of `script_flags`."""
    parsed = options.parse(call.args)
    if not parsed.has("-i"):
        return [_READS]
    files = parsed.operands if parsed.has(*script_flags) else parsed.operands[1:]
    return [call.writes(files, "edits")]


_SED_OPTIONS = Options(short_values="efl", long_values=frozenset({"--expression", "--file", "--line-length"}),
                       optional="i", aliases={"--in-place": "-i", "--expression": "-e", "--file": "-f"})


def _sed(call: _Call) -> list[Rule]:
    return _edits_in_place(call, _SED_OPTIONS, ("-e", "-f"))


_PERL_OPTIONS = Options(short_values="eEIMm", optional="il0xCdDF")


def _perl(call: _Call) -> list[Rule]:
    parsed = _PERL_OPTIONS.parse(call.args)
    if parsed.has("-i") and parsed.has("-p", "-n") and parsed.has("-e", "-E"):
        return _edits_in_place(call, _PERL_OPTIONS, ("-e", "-E"))  # the sed-like one-liner
    return [_RUNS_CODE]


_YQ_OPTIONS = Options(short_values="pPoIe", aliases={"--inplace": "-i"})


def _yq(call: _Call) -> list[Rule]:
    return _edits_in_place(call, _YQ_OPTIONS, ())


_AWK_OPTIONS = Options(short_values="FvfiEle", long_values=frozenset({"--file", "--include", "--assign",
                                                                       "--field-separator", "--source"}),
                       aliases={"--file": "-f", "--include": "-i", "--assign": "-v", "--source": "-e"})
# print > "file", print | "cmd", "cmd" | getline, system(): an awk program that writes or runs things
_AWK_EFFECTS = re.compile(r"\bsystem\s*\(|\|\s*&?\s*getline|\bprintf?\b[^;{}]*[>|]")


def _awk(call: _Call) -> list[Rule]:
    parsed = _AWK_OPTIONS.parse(call.args)
    if parsed.has("-f"):
        return [Rule(Kind.FORK, "runs an awk program from a file")]
    programs = parsed.values("-e") or parsed.operands[:1]
    if any(p.text is None or _AWK_EFFECTS.search(p.text) for p in programs):
        return [Rule(Kind.FORK, "runs an awk program that can write files or run commands")]
    if "inplace" in (parsed.value("-i") or ""):
        return [call.writes(parsed.operands[0 if parsed.has("-e") else 1:], "edits")]
    return [_READS]


_FIND_EXEC = ("-exec", "-execdir", "-ok", "-okdir")
_FIND_WRITES = ("-fprint", "-fprint0", "-fprintf", "-fls")


def _find(call: _Call) -> list[Rule]:
    """find [-H -L -P -D X -OX] [START...] EXPRESSION: what -exec runs, -delete and -fprint decide,
    each for the files under the starting points."""
    args = call.args
    i = 0
    while i < len(args) and (args[i].text or "")[:2] in ("-H", "-L", "-P", "-D", "-O"):
        i += 2 if args[i].text == "-D" else 1
    starts: list[Word] = []
    while i < len(args) and not (args[i].text and args[i].text[0] in "-(!),"):  # the expression begins
        starts.append(args[i])
        i += 1
    starts = starts or [_HERE]
    # {} stands for a file under one of the starting points
    under = [posixpath.join(value, "*") for start in starts for value in start.values or ("",)]
    found = _UNKNOWN if any(start.values is None for start in starts) or len(under) > _MAX_ALTERNATIVES \
        else Word(tuple(under))
    rules: list[Rule] = []
    while i < len(args):
        action = args[i].text
        if action in _FIND_EXEC:
            end = next((j for j in range(i + 1, len(args)) if args[j].text in (";", "+")), len(args))
            command = [_substitute(word, found) for word in args[i + 1:end]]
            if command and action.endswith("dir"):  # run from the found file's folder
                call.run(command, call.shell.moved(starts[0] if len(starts) == 1 else _UNKNOWN))
            elif command:
                call.run(command)
            i = end
        elif action == "-delete":
            rules.append(call.writes(starts, "deletes files under"))
        elif action in _FIND_WRITES and i + 1 < len(args):
            rules.append(call.writes(args[i + 1:i + 2], "writes"))
        i += 1
    return rules or [_READS]


def _substitute(word: Word, found: Word) -> Word:
    if word.values is None or not any("{}" in value for value in word.values):
        return word
    if found.values is None:
        return _UNKNOWN
    return Word(tuple(v.replace("{}", f) for v in word.values for f in found.values))


_CHMOD_OPTIONS = Options(long_values=frozenset({"--reference"}))


def _chmod(call: _Call) -> list[Rule]:
    """chmod MODE FILE...: the mode is the first operand, unless --reference gives it or it was
    written like a flag (chmod -x FILE)."""
    parsed = _CHMOD_OPTIONS.parse(call.args)
    mode_given = parsed.has("--reference") or \
        any(re.fullmatch(r"-[rwxXst]+", word.text or "") for word in call.args)
    return [call.writes(parsed.operands if mode_given else parsed.operands[1:], "changes the mode of")]


_TAR_OPTIONS = Options(
    short_values="fCbTXgHIKLNV",
    long_values=frozenset({"--file", "--directory", "--files-from", "--exclude-from", "--to-command",
                           "--use-compress-program", "--exclude", "--transform", "--owner", "--group"}),
    aliases={"--extract": "-x", "--get": "-x", "--create": "-c", "--append": "-r", "--update": "-u",
             "--catenate": "-A", "--concatenate": "-A", "--list": "-t", "--file": "-f", "--directory": "-C",
             "--to-stdout": "-O", "--use-compress-program": "-I"})


def _tar(call: _Call) -> list[Rule]:
    args = call.args
    first = args[0].text if args else None
    if first and not first.startswith("-"):
        args = [_literal("-" + first), *args[1:]]  # the old style: tar xzf a.tgz
    parsed = _TAR_OPTIONS.parse(args)
    if parsed.has("-I", "--to-command"):
        return [_RUNS_CODE]
    if parsed.has("-x") and not parsed.has("-O"):
        return [call.writes(parsed.values("-C")[-1:] or [_HERE], "extracts an archive into")]
    if parsed.has("-c", "-r", "-u", "-A", "--delete"):
        return [call.writes(_files(parsed.values("-f")), "writes the archive")]
    return [_READS]


_UNZIP_OPTIONS = Options(short_values="dP")


def _unzip(call: _Call) -> list[Rule]:
    parsed = _UNZIP_OPTIONS.parse(call.args)
    if parsed.has("-l", "-t", "-v", "-p", "-c", "-z", "-Z"):
        return [_READS]
    return [call.writes(parsed.values("-d") or [_HERE], "extracts an archive into")]


_COMPRESS_OPTIONS = Options(short_values="So", long_values=frozenset({"--suffix"}),
                            aliases={"--stdout": "-c", "--to-stdout": "-c", "--list": "-l", "--test": "-t"})


def _compressor(call: _Call) -> list[Rule]:
    parsed = _COMPRESS_OPTIONS.parse(call.args)
    files = _files(parsed.operands)
    if parsed.has("-c", "-l", "-t") or not files:
        return [_READS]  # standard input to standard output, or a look at an archive
    return [call.writes([*files, *parsed.values("-o")], "replaces")]


_PATCH_OPTIONS = Options(short_values="pdoiBrDFVYzg", aliases={"--directory": "-d", "--output": "-o",
                                                                  "--input": "-i"})


def _patch(call: _Call) -> list[Rule]:
    parsed = _PATCH_OPTIONS.parse(call.args)
    if parsed.has("--dry-run", "--check", "-C"):  # -C: BSD patch's --check
        return [_READS]
    # the files named in the patch, under -d DIR or here; or the file given; or -o FILE
    named = parsed.values("-o") or parsed.operands[:1] or parsed.values("-d") or [_HERE]
    return [call.writes(named, "patches")]


def _dd(call: _Call) -> list[Rule]:
    outputs = [_literal(word.text[3:]) if word.text else _UNKNOWN
               for word in call.args if word.text is None or word.text.startswith("of=")]
    return [call.writes(outputs, "writes")] if outputs else [_READS]


_CURL_OPTIONS = Options(
    short_values="AbcCdDeEFHKmoPQrTtuUwxXyYz",
    long_values=frozenset({
        "--data", "--data-raw", "--data-binary", "--data-ascii", "--data-urlencode", "--json", "--form",
        "--form-string", "--upload-file", "--request", "--output", "--output-dir", "--header", "--user",
        "--user-agent", "--url", "--cookie", "--cookie-jar", "--dump-header", "--config", "--max-time",
        "--connect-timeout", "--retry", "--retry-delay", "--retry-max-time", "--proxy", "--referer", "--cert",
        "--key", "--cacert", "--capath", "--write-out", "--range", "--resolve", "--connect-to", "--interface",
        "--limit-rate", "--trace", "--trace-ascii", "--stderr", "--etag-save", "--etag-compare",
        "--time-cond", "--continue-at", "--max-filesize", "--oauth2-bearer", "--aws-sigv4", "--variable"}),
    aliases={"--data": "-d", "--data-raw": "-d", "--data-binary": "-d", "--data-ascii": "-d",
             "--data-urlencode": "-d", "--json": "-d", "--form": "-F", "--form-string": "-F",
             "--upload-file": "-T", "--request": "-X", "--output": "-o", "--remote-name": "-O",
             "--remote-name-all": "-O", "--head": "-I", "--get": "-G", "--dump-header": "-D",
             "--cookie-jar": "-c", "--config": "-K"})


def _curl(call: _Call) -> list[Rule]:
    parsed = _CURL_OPTIONS.parse(call.args)
    if parsed.has("-K"):
        return [Rule(Kind.FORK, "reads more options from a file")]
    method = (parsed.value("-X") or "").upper()
    if not method:
        method = "POST" if parsed.has("-d", "-F") and not parsed.has("-G") else \
            "PUT" if parsed.has("-T") else "GET"
    urls = [*parsed.operands, *parsed.values("--url")]
    rules = [] if method in ("GET", "HEAD") or parsed.has("-I") else \
        [_request(any(_remote_url(url) for url in urls), method)]
    targets = _files(parsed.values("-o", "-D", "-c", "--trace", "--trace-ascii", "--stderr", "--etag-save"))
    if parsed.has("-O"):
        targets += parsed.values("--output-dir") or [_HERE]
    if targets:
        rules.append(call.writes(targets, "downloads into"))
    return rules or [Rule(Kind.NONE, "only fetches to its output")]


_WGET_OPTIONS = Options(
    short_values="oaOPtTwQeUlARDIXBi",
    long_values=frozenset({"--output-document", "--directory-prefix", "--output-file", "--append-output",
                           "--post-data", "--post-file", "--body-data", "--body-file", "--method", "--header",
                           "--user", "--password", "--user-agent", "--tries", "--timeout"}),
    aliases={"--output-document": "-O", "--directory-prefix": "-P", "--output-file": "-o",
             "--append-output": "-a"})


def _wget(call: _Call) -> list[Rule]:
    parsed = _WGET_OPTIONS.parse(call.args)
    rules = []
    method = (parsed.value("--method") or "").upper() or \
        ("POST" if parsed.has("--post-data", "--post-file", "--body-data", "--body-file") else "GET")
    if method not in ("GET", "HEAD"):
        rules.append(_request(any(_remote_url(url) for url in parsed.operands), method))
    documents = parsed.values("-O")
    if parsed.has("--spider"):
        downloads = []
    elif documents:
        downloads = _files(documents)
    else:
        downloads = parsed.values("-P") or [_HERE]
    targets = [*downloads, *_files(parsed.values("-o", "-a"))]
    if targets:
        rules.append(call.writes(targets, "downloads into"))
    return rules or [Rule(Kind.NONE, "only fetches to its output")]


_HTTPIE_OPTIONS = Options(short_values="aAo", long_values=frozenset({"--auth", "--auth-type", "--output",
                                                                     "--session", "--verify", "--cert",
                                                                     "--timeout", "--proxy"}),
                          aliases={"--output": "-o", "--download": "-d", "--form": "-f"})
_HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _httpie(call: _Call) -> list[Rule]:
    """http [METHOD] URL [ITEM...]: data items (a=b, a:=b, f@file) make it a POST."""
    parsed = _HTTPIE_OPTIONS.parse(call.args)
    operands = parsed.operands
    method = operands[0].text if operands and operands[0].text in _HTTP_METHODS else None
    if method:
        operands = operands[1:]
    items = [word.text or "=" for word in operands[1:]]
    sends = any("==" not in item and ("=" in item or "@" in item) for item in items) or parsed.has("-f")
    method = method or ("POST" if sends else "GET")
    rules = [] if method in ("GET", "HEAD") or not operands else [_request(_remote_url(operands[0]), method)]
    if parsed.has("-d", "-o"):
        rules.append(call.writes(parsed.values("-o") or [_HERE], "downloads into"))
    return rules or [Rule(Kind.NONE, "only fetches to its output")]


def _remote_path(text: str | None) -> bool:
    """scp and rsync name a remote file as [user@]host:path (a colon before any slash)."""
    if text is None:
        return True
    return "://" in text or (":" in text and "/" not in text.partition(":")[0] and not text.startswith(":"))


_SCP_OPTIONS = Options(short_values="cFiJloPS")
_RSYNC_OPTIONS = Options(
    short_values="efBT",
    long_values=frozenset({"--exclude", "--include", "--exclude-from", "--include-from", "--filter", "--rsh",
                           "--files-from", "--temp-dir", "--partial-dir", "--backup-dir", "--log-file",
                           "--password-file", "--port", "--chmod", "--chown", "--bwlimit", "--timeout",
                           "--compare-dest", "--copy-dest", "--link-dest", "--suffix", "--max-size",
                           "--min-size", "--out-format"}),
    aliases={"--dry-run": "-n", "--rsh": "-e"})


def _copier(options: Options) -> _Entry:
    """scp and rsync: to a remote destination is external; otherwise the destination is written."""
    def judge(call: _Call) -> list[Rule]:
        parsed = options.parse(call.args)
        if len(parsed.operands) < 2 or parsed.has("-n"):
            return [_READS]  # rsync with one operand lists it; -n is a dry run
        if _remote_path(parsed.operands[-1].text):
            return [Rule(Kind.EXTERNAL, "copies files to another machine")]
        return [call.writes([parsed.operands[-1], *parsed.values("--log-file")], "copies into")]
    return judge


def _hosts(args: Sequence[Word], short: str) -> list[Word]:
    """The hosts a client is pointed at: the values of `-h HOST`, `-hHOST`, `--host=HOST` (with
    `short` as the short flag) and URLs, also as a flag's value (`--dbname=postgres://db/app`)."""
    hosts = []
    for i, word in enumerate(args):
        text = word.text or ""
        if text in (short, "--host"):
            hosts.append(args[i + 1] if i + 1 < len(args) else _UNKNOWN)
        elif text.startswith("--host="):
            hosts.append(_literal(text.partition("=")[2]))
        elif text.startswith(short) and len(text) > 2:
            hosts.append(_literal(text[2:]))
        elif "://" in text:
            scheme = text.partition("://")[0]
            hosts.append(_literal(text[scheme.index("=") + 1:] if "=" in scheme else text))
    return hosts


def _database(call: _Call) -> list[Rule]:
    """A database client: a server on another machine is external; one here is a fork."""
    if any(_remote_url(host) for host in _hosts(call.args, "-h")):
        return [Rule(Kind.EXTERNAL, "can change a database on another machine")]
    return [_DATABASE]


def _docker(call: _Call) -> list[Rule]:
    """docker and podman: with -H naming another machine's daemon, what they change is there."""
    rules = _DOCKER(call)
    if any(_remote_url(host) for host in _hosts(call.args, "-H")):
        remote = Rule(Kind.EXTERNAL, "changes containers on another machine")
        return [remote if rule.kind is Kind.FORK else rule for rule in rules]
    return rules


def _service(call: _Call) -> list[Rule]:
    texts = [word.text for word in call.args]
    return [_READS if "--status-all" in texts or texts[1:2] == ["status"] else _SERVICES]


def _pacman(call: _Call) -> list[Rule]:
    operation = next((w.text for w in call.args if w.text and w.text.startswith("-")), "")
    return [_READS if operation.startswith(("-Q", "--query")) else _PACKAGES]


def _sysctl(call: _Call) -> list[Rule]:
    texts = [word.text or "=" for word in call.args]
    sets = any(t in ("-w", "-p", "--write", "--load", "--system") or "=" in t for t in texts)
    return [_SYSTEM if sets else _READS]


def _hostname(call: _Call) -> list[Rule]:
    parsed = _NO_OPTIONS.parse(call.args)
    return [Rule(Kind.FORK, "renames the machine") if parsed.operands or parsed.has("-F", "-b") else _READS]


_GH_API_OPTIONS = Options(
    short_values="XfFHpqt",
    long_values=_words("--method --field --raw-field --header --input --jq --template --preview --hostname"),
    aliases={"--method": "-X", "--field": "-F", "--raw-field": "-f", "--header": "-H"})


def _gh_api(call: _Call) -> list[Rule]:
    parsed = _GH_API_OPTIONS.parse(call.args)
    method = (parsed.value("-X") or "").upper() or \
        ("POST" if parsed.has("-f", "-F", "--input") else "GET")
    return [_READS] if method in ("GET", "HEAD") else [_request(True, method)]


_CLOUD_OPTIONS = Options(long_values=frozenset({
    "--region", "--profile", "--output", "--endpoint-url", "--query", "--color", "--ca-bundle", "--project",
    "--account", "--configuration", "--format", "--subscription", "--zone", "--exclude", "--include", "--acl",
    "--storage-class", "--content-type", "--cache-control", "--sse", "--expires"}))
_CLOUD_READ_VERBS = frozenset({"list", "ls", "describe", "show", "get", "info", "version", "help", "wait",
                               "tail", "cat", "read", "search", "status", "presign"})
_CLOUD_READ_PREFIXES = ("describe-", "list-", "get-", "show-", "batch-get-", "search-", "filter-")
_CLOUD_SETTINGS = frozenset({"configure", "config", "auth", "login", "logout", "account", "components",
                             "extension", "init", "sso"})


def _cloud(call: _Call) -> list[Rule]:
    """aws, gcloud, az: verbs that describe or list only read; settings are local; the rest
    changes cloud resources."""
    parsed = _CLOUD_OPTIONS.parse(call.args)
    words = [word.text for word in parsed.operands[:4]]
    if not words:
        return [_USAGE]
    verbs = words[1:] if call.name == "aws" else words  # aws SERVICE VERB; gcloud GROUP... VERB
    reads = any(verb in _CLOUD_READ_VERBS or verb.startswith(_CLOUD_READ_PREFIXES) for verb in verbs if verb)
    if words[0] in _CLOUD_SETTINGS:
        return [_READS if reads else _SETTINGS]
    if words[:1] == ["s3"] and words[1:2] in (["cp"], ["mv"], ["sync"]) and len(parsed.operands) >= 4:
        source, destination = parsed.operands[2:4]
        if _remote_path(destination.text) or (words[1] == "mv" and _remote_path(source.text)):
            return [Rule(Kind.EXTERNAL, "changes cloud storage")]
        return [call.writes([destination], "downloads into")]
    return [_READS if reads else Rule(Kind.EXTERNAL, "changes cloud resources")]


_GIT_OPTIONS = Options(short_values="Cc", long_values=frozenset({
    "--git-dir", "--work-tree", "--namespace", "--super-prefix", "--config-env"}))
# git -c settings (and their prefixes, and suffixes) that name a program for git to run
_GIT_PROGRAM_SETTINGS = ("alias.", "pager.", "filter.", "core.pager", "core.editor", "core.sshcommand",
                         "core.fsmonitor", "core.hookspath", "core.askpass", "core.gitproxy", "diff.external",
                         "credential.helper", "sequence.editor", "gpg.program", "uploadpack.packobjectshook")
_GIT_PROGRAM_SUFFIXES = (".command", ".cmd", ".textconv", ".tool", ".helper")


def _git(call: _Call) -> list[Rule]:
    """git [-C DIR]... SUBCOMMAND: the repository is the folder -C, --work-tree or --git-dir name."""
    parsed = _GIT_OPTIONS.parse(call.args, permute=False)
    here = call.shell.here
    rules = []
    for name, value in parsed.flags:
        if name in ("-C", "--work-tree") and value is not None:
            here = _folder(value, here)
        elif name == "--git-dir" and value is not None:
            git_dir = _folder(value, here)
            here = posixpath.dirname(git_dir) if git_dir else None
        elif name == "--exec-path" and value is not None:
            rules.append(Rule(Kind.FORK, "sets where git finds its programs"))
        elif name in ("-c", "--config-env") and value is not None:
            key = (value.text or "").partition("=")[0].lower()
            if not key or key.startswith(_GIT_PROGRAM_SETTINGS) or key.endswith(_GIT_PROGRAM_SUFFIXES):
                rules.append(Rule(Kind.FORK, f"sets the git setting {key or 'only known at run time'}, "
                                             "which can name a program to run"))
    shell = call.shell.copy()
    shell.here = here
    return [*rules, *_GIT_COMMANDS(call.shifted(parsed.operands, shell))]


def _git_push(call: _Call) -> list[Rule]:
    return [_READS] if _NO_OPTIONS.parse(call.args).has("-n", "--dry-run") else [_PUSHES]


# git branch and git tag: -u, -m and -F take a value (the upstream, a message, a message file)
_REF_OPTIONS = Options(short_values="umF", long_values=_words(
    """--contains --no-contains --merged --no-merged --points-at --sort --format --set-upstream-to --message
       --file"""))


def _git_refs(changes: str, lists: str) -> _Entry:
    """git branch and git tag: they list, unless given a name or a flag of `changes` (create, delete,
    move); with a flag of `lists`, names are patterns to list."""
    def judge(call: _Call) -> list[Rule]:
        parsed = _REF_OPTIONS.parse(call.args)
        if parsed.has(*changes.split()) or (parsed.operands and not parsed.has(*lists.split())):
            return [call.locally(_REPO)]
        return [_READS]
    return judge


_GIT_CLEAN_OPTIONS = Options(short_values="e", aliases={"--dry-run": "-n"})


def _git_clean(call: _Call) -> list[Rule]:
    parsed = _GIT_CLEAN_OPTIONS.parse(call.args)
    if parsed.has("-n"):
        return [_READS]
    if parsed.has("-x", "-X"):
        return [Rule(Kind.FORK, "removes ignored files, which git cannot take back")]
    return [call.locally(Rule(Kind.GIT, "removes untracked files"))]


_GIT_CONFIG_OPTIONS = Options(short_values="f", long_values=frozenset({"--file", "--blob", "--type",
                                                                       "--default", "--comment"}))
_GIT_CONFIG_READS = ("--get", "--get-all", "--get-regexp", "--get-urlmatch", "--get-color", "--get-colorbool",
                     "-l", "--list")


def _git_config(call: _Call) -> list[Rule]:
    parsed = _GIT_CONFIG_OPTIONS.parse(call.args)
    first = parsed.operands[0].text if parsed.operands else None
    if parsed.has(*_GIT_CONFIG_READS) or first in ("get", "list") or \
            (len(parsed.operands) == 1 and first not in ("set", "unset", "edit", "rename-section",
                                                          "remove-section") and not parsed.has("--unset")):
        return [_READS]
    if parsed.has("--global", "--system", "-f", "--file"):
        return [Rule(Kind.FORK, "changes git settings outside the project")]
    return [call.locally(Rule(Kind.GIT, "changes the repository's settings"))]


_GIT_CLONE_OPTIONS = Options(short_values="bocujd", long_values=frozenset({
    "--branch", "--origin", "--config", "--upload-pack", "--jobs", "--depth", "--reference", "--template",
    "--separate-git-dir", "--filter", "--shallow-since", "--shallow-exclude", "--initial-branch",
    "--object-format"}))


def _git_creates(skip: int) -> _Entry:
    """git clone URL [DIR] (skip 1), git init [DIR] (skip 0): the new repository's folder is written."""
    def judge(call: _Call) -> list[Rule]:
        folder = _GIT_CLONE_OPTIONS.parse(call.args).operands[skip:skip + 1]
        return [call.writes(folder or [_HERE], "creates a repository in")]
    return judge


_GIT_OUTPUT_OPTIONS = Options(short_values="o", aliases={"--output": "-o", "--output-directory": "-o"})


def _git_writes(default: Word | None) -> _Entry:
    """git archive (to its output) and git format-patch (into the current folder): or -o FILE."""
    def judge(call: _Call) -> list[Rule]:
        parsed = _GIT_OUTPUT_OPTIONS.parse(call.args)
        written = parsed.values("-o") or ([default] if default and not parsed.has("--stdout") else [])
        return [call.writes(written, "writes")]
    return judge


_LOSES_HISTORY = Rule(Kind.FORK, "can drop objects git needs to take changes back")

_GIT_COMMANDS = Subcommands(
    {
        **_each("""status log diff show blame annotate grep describe shortlog ls-files ls-tree ls-remote
                   rev-parse rev-list cat-file show-ref for-each-ref show-branch whatchanged name-rev
                   merge-base count-objects fsck check-ignore check-attr check-ref-format version help var
                   cherry range-diff diff-tree diff-files diff-index verify-commit verify-tag verify-pack
                   difftool request-pull""", _READS),
        **_each("""add commit checkout switch restore reset merge rebase cherry-pick revert mv rm apply am
                   pull fetch bisect mergetool update-index update-ref symbolic-ref read-tree checkout-index
                   commit-tree write-tree hash-object sparse-checkout replace""", _REPO),
        **_each("gc prune repack maintenance", _LOSES_HISTORY),
        **_each("filter-branch filter-repo", Rule(Kind.FORK, "rewrites the whole history")),
        "push": _git_push,
        "send-email": _MAIL,
        "svn": Rule(Kind.EXTERNAL, "talks to a Subversion server"),
        "hook": _RUNS_CODE,
        "branch": _git_refs("-d -D --delete -m -M --move -c -C --copy -u --set-upstream-to --unset-upstream "
                            "--edit-description -f --force",
                            "-l --list -a --all -r --remotes --show-current -v --verbose --contains "
                            "--no-contains --merged --no-merged --points-at -n"),
        "tag": _git_refs("-d --delete -a --annotate -s --sign -u -m --message -F --file -f --force",
                         "-l --list -n --contains --no-contains --merged --no-merged --points-at -v "
                         "--verify"),
        "clean": _git_clean,
        "config": _git_config,
        "clone": _git_creates(1),
        "init": _git_creates(0),
        "archive": _git_writes(None),
        "format-patch": _git_writes(_HERE),
        "stash": _verbs("list show", default=_REPO, bare=_REPO),
        "remote": _verbs("show get-url", default=_REPO, bare=_READS),
        "notes": _verbs("list show", default=_REPO, bare=_READS),
        "worktree": _verbs("list", default=_REPO, add=_git_creates(0)),
        "submodule": _verbs("status summary", default=_REPO, bare=_READS, foreach=_RUNS_CODE),
        "reflog": _verbs("", default=_READS, bare=_READS, expire=_LOSES_HISTORY, delete=_LOSES_HISTORY),
        "bundle": _verbs("", default=_READS, create=Writer("writes", written="first"), unbundle=_REPO),
        "lfs": _verbs("ls-files status env version logs", default=_REPO, push=_PUSHES, install=_SETTINGS,
                      uninstall=_SETTINGS),
    },
    default=Rule(Kind.FORK, "is not a git command rewind knows (it may be an alias that runs anything)"),
)


# ---------------------------------------------------------------------------------------------
# Programs with many subcommands

_NPM = _verbs(
    "ls list ll la view info show v outdated search help whoami ping explain why fund root prefix bin doctor",
    default=_RUNS_CODE,  # run, test, start, exec, and scripts run by name (yarn build)
    **_each("install i ci add uninstall remove rm un update up upgrade link ln prune dedupe rebuild",
            _PACKAGES),
    **_each("publish unpublish deprecate dist-tag owner access team star unstar", _PUBLISHES),
    audit=_verbs("", default=_READS, bare=_READS, fix=_PACKAGES),
    config=_verbs("get list ls", default=_SETTINGS),
)
_YARN = Subcommands(_NPM.verbs, default=_RUNS_CODE, bare=_PACKAGES)  # yarn alone installs

_PIP = _package_manager("list show freeze check search help index inspect debug hash",
                        config=_verbs("list get debug", default=_SETTINGS),
                        cache=_verbs("list dir info", default=_SETTINGS))

_CARGO = _verbs(
    "metadata tree search version help locate-project pkgid read-manifest verify-project",
    default=Rule(Kind.FORK, "builds or runs code (build scripts run too)"),
    **_each("install uninstall add remove rm update fetch vendor", _PACKAGES),
    **_each("publish yank owner login", _PUBLISHES),
    **_each("fmt new init", _FOLDER),
)

_GEM = _package_manager(
    "list search info query specification contents environment help which outdated dependency",
    **_each("push yank owner", _PUBLISHES))

_GO = _verbs("vet list version env doc help", default=Rule(Kind.FORK, "builds or runs code"),
             **_each("install get mod work clean", _PACKAGES), fmt=_FOLDER)

_CONTAINERS = Rule(Kind.FORK, "changes containers or images on this machine")
_DOCKER_OBJECT = _verbs("ls list inspect history", default=_CONTAINERS, push=_PUBLISHES)
_DOCKER = Subcommands(
    {**_each("ps images inspect logs version info history search top stats port diff events", _READS),
     **_each("image container volume network context buildx plugin system", _DOCKER_OBJECT),
     **_each("login logout", _SETTINGS),
     "push": _PUBLISHES,
     "compose": _verbs("ps logs config ls top images version port", default=_CONTAINERS, push=_PUBLISHES)},
    default=_CONTAINERS,
    value_flags=frozenset({"-H", "--host", "--context", "--config", "-c", "--log-level"}),
)

_KUBECTL = Subcommands(
    {**_each("""get describe logs top explain version api-resources api-versions cluster-info diff auth wait
                events completion plugin options help""", _READS),
     "config": _verbs("view get-contexts current-context get-clusters get-users", default=_SETTINGS)},
    default=Rule(Kind.EXTERNAL, "changes a remote cluster"),
    value_flags=frozenset({"-n", "--namespace", "--context", "--kubeconfig", "--cluster", "--user", "-s",
                           "--server", "--token"}),
)

_HELM = Subcommands(
    {**_each("list ls status get history show inspect template search version lint env verify help "
             "completion", _READS),
     **_each("plugin registry dependency dep pull fetch package create", _SETTINGS),
     "repo": _verbs("list ls", default=_SETTINGS)},
    default=Rule(Kind.EXTERNAL, "changes a remote cluster"),
    value_flags=frozenset({"-n", "--namespace", "--kube-context", "--kubeconfig"}),
)

_INFRASTRUCTURE = Rule(Kind.EXTERNAL, "changes real infrastructure")
_TERRAFORM = _verbs(
    "plan show output validate version providers graph console help",
    default=_INFRASTRUCTURE,
    **_each("init get login logout", _SETTINGS),
    fmt=_FOLDER,
    state=_verbs("list show pull", default=_REMOTE),
    workspace=_verbs("list show", default=_REMOTE, select=_SETTINGS),
)

_PULUMI = _verbs("preview whoami version about logs help", default=_INFRASTRUCTURE,
                 **_each("login logout plugin install config", _SETTINGS),
                 stack=_verbs("ls output history export select", default=_REMOTE))

_GH = Subcommands(
    {
        "pr": _forge("list view status diff checks", checkout=_REPO),
        "repo": _forge("view list", clone=Rule(Kind.GIT, "clones a repository into the current folder")),
        "release": _forge("list view", download=_FOLDER),
        "run": _forge("list view watch", download=_FOLDER),
        **_each("issue workflow gist label secret variable ruleset cache project codespace org ssh-key "
                "gpg-key", _forge("list view status")),
        **_each("auth config extension ext alias", _verbs("status token get list ls", default=_SETTINGS)),
        **_each("browse status search completion help version", _READS),
        "api": _gh_api,
    },
    default=_REMOTE,
    value_flags=frozenset({"-R", "--repo"}),
)

_SYSTEMCTL = _verbs("""status show cat list-units list-unit-files list-timers list-sockets list-dependencies
                       list-jobs is-active is-enabled is-failed is-system-running get-default help""",
                    default=_SERVICES, bare=_READS)


# ---------------------------------------------------------------------------------------------
# The programs. Every entry is called with the command (a _Call) and returns the rules that apply.

_READ_ONLY = """
    ls ll dir vdir cat tac nl head tail less more most grep egrep fgrep zgrep rg ag ack wc cut tr paste join
    comm column fold fmt rev expand unexpand echo printf pwd which whereis type whatis apropos man info help
    ps pgrep pidof top pstree uptime free vmstat iostat mpstat lsof df du stat file tree namei
    lsattr diff diff3 sdiff cmp md5sum sha1sum sha224sum sha256sum sha384sum sha512sum b2sum cksum sum cal
    whoami id groups who w last users uname arch nproc lscpu lsblk lspci lsusb lsmod getconf locale tty
    printenv getent jq basename dirname realpath readlink test true false sleep seq yes expr bc dc factor
    numfmt shuf od hexdump strings base32 base64 basenc ping dig nslookup host whois traceroute tracepath ss
    netstat zcat bzcat xzcat zstdcat zless zmore zdiff nm objdump readelf ldd tput clear dirs jobs
"""
_SHELL_BUILTINS = """
    : exit return break continue shift set shopt ulimit umask alias unalias wait fg bg disown hash history
    let getopts mapfile readarray caller complete compgen
"""
_TARGET_DIRECTORY = Options(short_values="tS", long_values=frozenset({"--target-directory"}),
                            aliases={"--target-directory": "-t"})

_PROGRAMS: dict[str, _Entry] = {
    **_each(_READ_ONLY, _READS),
    **_each(_SHELL_BUILTINS, _SHELL_STATE),

    # The shell's own state
    "cd": _cd, "pushd": _cd, "popd": _popd, "read": _read, "trap": _trap,

    # Programs that run another command: that command decides
    "sudo": Wrapper(
        Options(short_values="ugpChDrtTU",
                long_values=_words("""--user --group --prompt --close-from --chdir --role --type
                                      --command-timeout --other-user --host"""),
                aliases={"--chdir": "-D", "--edit": "-e", "--list": "-l"}),
        assignments=True, dir_flags=("-D",), bare=Rule(Kind.FORK, "opens a root shell"),
        flag_rules={"-e": Rule(Kind.FORK, "edits files as root"), "-l": _READS, "-v": _READS, "-k": _READS,
                    "-K": _READS}),
    "doas": Wrapper(Options(short_values="uC"), bare=Rule(Kind.FORK, "opens a root shell")),
    "env": Wrapper(Options(short_values="uCS", long_values=_words("--unset --chdir --split-string"),
                           aliases={"--chdir": "-C", "--split-string": "-S"}),
                   assignments=True, dir_flags=("-C",),
                   flag_rules={"-S": Rule(Kind.FORK, "runs a command line given as one string")}),
    **_each("nohup builtin setsid", Wrapper()),
    "time": Wrapper(Options(short_values="fo")),
    "nice": Wrapper(Options(short_values="n", long_values=frozenset({"--adjustment"}))),
    "ionice": Wrapper(Options(short_values="cnp"), flag_rules={"-p": _PROCESSES}),
    "stdbuf": Wrapper(Options(short_values="ioe", long_values=frozenset({"--input", "--output", "--error"}))),
    "timeout": Wrapper(Options(short_values="sk", long_values=frozenset({"--signal", "--kill-after"})),
                       leading=1),
    "command": Wrapper(flag_rules={"-v": _READS, "-V": _READS}),
    "exec": Wrapper(Options(short_values="a"), bare=_SHELL_STATE),
    "xargs": Wrapper(Options(short_values="adEILnPs", optional="eil", long_values=frozenset({
        "--arg-file", "--delimiter", "--max-args", "--max-procs", "--max-chars", "--process-slot-var"})),
        feeds_args=True),

    # Files named on the command line
    **_each("rm rmdir unlink", Writer("removes", removes=True)),
    "mkdir": Writer("creates", Options(short_values="m")),
    "touch": Writer("touches", Options(short_values="dtr", long_values=frozenset({"--date", "--reference"}))),
    "chmod": _chmod,
    "cp": Writer("copies into", _TARGET_DIRECTORY, written="last", target_flags=("-t",)),
    "mv": Writer("moves", _TARGET_DIRECTORY, target_flags=("-t",), removes=True),
    "ln": Writer("links", _TARGET_DIRECTORY, written="last", target_flags=("-t",)),
    "install": Writer("installs", Options(short_values="mogtS", aliases={"--target-directory": "-t"}),
                      target_flags=("-t",)),
    **_each("tee sponge", Writer("writes")),
    "truncate": Writer("truncates", Options(short_values="sr",
                                            long_values=frozenset({"--size", "--reference"}))),
    "shred": Writer("shreds", Options(short_values="ns", long_values=frozenset({"--iterations", "--size"}))),
    "mkfifo": Writer("creates", Options(short_values="m")),
    "sort": Writer("writes", Options(short_values="kotST", long_values=frozenset({
        "--key", "--field-separator", "--output", "--buffer-size", "--temporary-directory", "--files0-from"}),
        aliases={"--output": "-o"}), written="none", target_flags=("-o",)),
    "uniq": Writer("writes", Options(short_values="fsw"), written="second"),
    "xxd": Writer("writes", Options(short_values="cglso"), written="second"),
    "zip": Writer("writes the archive", Options(short_values="bntP"), written="first"),
    "dd": _dd, "tar": _tar, "unzip": _unzip, "patch": _patch,
    **_each("gzip gunzip bzip2 bunzip2 xz unxz zstd unzstd lz4 compress uncompress", _compressor),
    "sed": _sed, "perl": _perl, "yq": _yq,
    **_each("awk gawk mawk nawk", _awk),
    "find": _find,
    **_each("chown chgrp chattr setfacl", _OWNERSHIP),
    **_each("vi vim nvim nano emacs ed code", _EDITOR),
    "mktemp": Rule(Kind.FORK, "creates a file in the temporary folder"),

    # The network
    "curl": _curl, "wget": _wget,
    **_each("http https xh", _httpie),
    "scp": _copier(_SCP_OPTIONS), "rsync": _copier(_RSYNC_OPTIONS),
    **_each("ssh mosh sftp ftp lftp telnet nc ncat netcat ssh-copy-id", _ANOTHER_MACHINE),
    **_each("sendmail mail mailx mutt msmtp swaks", _MAIL),

    # Git and forges
    "git": _git,
    "gh": _GH,

    # Code whose effect cannot be known
    **_each("bash sh zsh dash ksh ash fish", _shell),
    "eval": _eval, "su": _su,
    **_each("source .", Rule(Kind.FORK, "runs a script in the current shell")),
    **_each("python pypy", _python),
    **_each("""node nodejs ruby php deno bun lua luajit Rscript julia java npx pnpx bunx uvx make gmake cmake
               ninja gradle gradlew mvn ant bazel meson scons rake pytest tox nox jest vitest mocha pre-commit
               django-admin flask rails""", _RUNS_CODE),

    # Packages
    "pip": _PIP,
    **_each("npm pnpm", _NPM), "yarn": _YARN,
    "cargo": _CARGO, "gem": _GEM, "go": _GO,
    "twine": _verbs("check", default=_PUBLISHES),
    "apt": _package_manager("list search show policy depends rdepends changelog"),
    "apt-get": _package_manager("check changelog source"),
    **_each("apt-cache dpkg-query", _READS),
    "aptitude": _package_manager("search show why why-not"),
    "dpkg": _package_manager("""-l -L -s -S -c -I -p --list --listfiles --status --search --contents --info
                                --print-avail --get-selections --print-architecture --compare-versions""",
                             bare=_PACKAGES),
    **_each("yum dnf microdnf", _package_manager("list info search provides repolist check-update history")),
    "zypper": _package_manager("search se info if list-updates lu repos lr"),
    "apk": _package_manager("info search list policy stats"),
    "pacman": _pacman,
    "snap": _package_manager("list info find version"),
    "flatpak": _package_manager("list info search remotes"),
    "brew": _package_manager("list ls info search outdated deps uses config doctor --prefix leaves"),
    **_each("conda mamba micromamba", _package_manager("list info search")),
    "pipx": _package_manager("list", run=_RUNS_CODE),
    "bundle": _package_manager("list show outdated check info", bare=_PACKAGES, exec=_RUNS_CODE),
    "composer": _package_manager("show outdated validate licenses search", run_script=_RUNS_CODE,
                                 exec=_RUNS_CODE),
    "poetry": _package_manager("show check version search", publish=_PUBLISHES, run=_RUNS_CODE,
                               shell=_RUNS_CODE),
    "uv": _package_manager("tree version help", pip=_PIP, run=_RUNS_CODE, publish=_PUBLISHES),

    # Services, processes, the system
    "systemctl": _SYSTEMCTL, "service": _service,
    "journalctl": ReadsUnless(_words("""--vacuum-size --vacuum-time --vacuum-files --rotate --flush --sync
                                        --relinquish-var --setup-keys"""), _SYSTEM),
    "dmesg": ReadsUnless(_words("-c -C --clear --read-clear -n --console-level"), _SYSTEM),
    "date": ReadsUnless(_words("-s --set"), Rule(Kind.FORK, "sets the system clock")),
    "ip": ReadsUnless(_words("add del delete set change replace flush append"), _SYSTEM),
    "sysctl": _sysctl, "hostname": _hostname,
    **_each("hostnamectl timedatectl localectl",
            _verbs("status show list-timezones list-locales", default=_SYSTEM, bare=_READS)),
    "mount": Subcommands(_each("-a --all", _SYSTEM), default=_SYSTEM, bare=_READS,
                         value_flags=_words("-t -o")),
    **_each("iptables ip6tables", Subcommands(_each("-L -S --list --list-rules", _READS), default=_SYSTEM,
                                              bare=_SYSTEM, value_flags=_words("-t --table"))),
    "ufw": _verbs("status", default=_SYSTEM),
    "nft": _verbs("list", default=_SYSTEM),
    **_each("""umount useradd userdel usermod groupadd groupdel groupmod adduser deluser passwd chpasswd
               visudo modprobe insmod rmmod swapon swapoff mkfs fdisk parted wipefs mkswap ldconfig
               update-alternatives update-grub locale-gen reboot shutdown poweroff halt""", _SYSTEM),
    **_each("kill pkill killall renice", _PROCESSES),
    "crontab": Subcommands({"-l": _READS}, default=_SCHEDULES, bare=_SCHEDULES, value_flags=_words("-u")),
    **_each("at batch", _SCHEDULES),
    **_each("ssh-keygen ssh-add gpg", Rule(Kind.FORK, "changes keys outside the project")),

    # Databases: a fork when the server is on this machine, external when it is not
    **_each("""psql mysql mariadb mongo mongosh redis-cli clickhouse-client cqlsh pg_restore mysqladmin dropdb
               createdb""", _database),
    "sqlite3": _DATABASE,
    "alembic": _verbs("current history heads branches show check",
                      default=Rule(Kind.FORK, "migrates a database")),

    # Clouds and clusters
    **_each("kubectl oc", _KUBECTL),
    "helm": _HELM,
    **_each("terraform tofu", _TERRAFORM),
    "pulumi": _PULUMI,
    **_each("docker podman", _docker),
    **_each("aws gcloud az", _cloud),
}
