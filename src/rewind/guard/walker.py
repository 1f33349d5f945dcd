"""The shell walker: parse a command with tree-sitter-bash and judge every program it runs.

Every command in the syntax tree counts (pipelines, lists, subshells, substitutions, loops,
redirections), and the strongest part decides. Each program is judged by the user's rules,
then by the program table (rewind.guard.programs); a program in neither is a fork: its
effect cannot be known.
"""

from __future__ import annotations

import contextlib
import fnmatch
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import tree_sitter
import tree_sitter_bash

from rewind.guard.call import Call, Place, Shell, node_text, snippet
from rewind.guard.entries import READS, RISKY_VARIABLES, aimed, remote_target, risky_variable, unknown
from rewind.guard.programs import PROGRAMS
from rewind.guard.userrules import UserRules
from rewind.guard.verdicts import Decision, Kind, Rule
from rewind.guard.words import (
    MAX_ALTERNATIVES,
    UNKNOWN,
    Word,
    absolute,
    braces,
    is_local,
)

_LANGUAGE = tree_sitter.Language(tree_sitter_bash.language())
_MAX_LEVEL = 100  # syntax levels and wrapped commands walked at once: bounds Python's stack on hostile input
_MAX_NESTING = 4  # shell code inside shell code (bash -c "bash -c '...'") read before giving up


_HARMLESS_FILES = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty"})


@dataclass(frozen=True)
class _Finding:
    """One part's verdict: its kind, the sentence saying why, and what decided it."""

    kind: Kind
    reason: str
    source: str
    unknown: str | None


class Walker:
    """Walks a syntax tree and collects a finding for each part."""

    def __init__(self, project: str, rules: UserRules) -> None:
        self.project = project
        self.rules = rules
        self.findings: list[_Finding] = []
        self.level = 0
        self.nesting = 0
        self.via: str | None = None  # what ran the commands being judged, if not the shell

    def decision(self, text: str) -> Decision:
        if not self.findings:
            return Decision(Kind.NONE, (f"`{snippet(text)}` runs no command (none)",), ("shell: no command",))
        kind = max(finding.kind for finding in self.findings)
        deciding = list({f.reason: f for f in self.findings if f.kind is kind}.values())
        unknown = [f.unknown for f in deciding if f.unknown]
        return Decision(kind, tuple(f.reason for f in deciding), tuple(f.source for f in deciding),
                        tuple(dict.fromkeys(unknown)) if len(unknown) == len(deciding) else ())

    def add(self, rule: Rule, subject: str) -> None:
        reason = f"`{snippet(subject)}` {rule.why} ({rule.kind})"
        source = rule.source or "shell"
        if self.via:
            source = f"{source} (via {self.via})"
        self.findings.append(_Finding(rule.kind, reason, source, rule.unknown))

    @contextlib.contextmanager
    def through(self, via: str | None) -> Iterator[None]:
        """Credit what is judged meanwhile to `via` too (the innermost one, when nested)."""
        before, self.via = self.via, via or self.via
        try:
            yield
        finally:
            self.via = before

    def source(self, text: str, shell: Shell) -> None:
        if "{" in text and max(text) > "\uffff":
            # tree-sitter-bash 0.25.1's scanner calls isdigit() on the character after a `{`: for one
            # beyond U+FFFF that reads out of bounds and can crash the process (upstream issue #337).
            # Such characters are read as U+FFFD; neither shell syntax nor paths depend on them.
            text = "".join(ch if ch <= "\uffff" else "\ufffd" for ch in text)
        root = tree_sitter.Parser(_LANGUAGE).parse(text.encode("utf-8")).root_node
        if root.has_error and not _only_misread_here_strings(root):
            # Still walk what was understood: a push next to a typo is still a push.
            self.add(_UNPARSED, text)
        self.walk(root, shell)

    def knows(self, program: str) -> bool:
        """Whether a user's rule or the table knows `program`."""
        return program_key(program) is not None or self.rules.declares(program)

    def nested(self, text: str, shell: Shell) -> None:
        if self.nesting >= _MAX_NESTING:
            self.add(Rule(Kind.FORK, "nests shell code too deeply to read", "shell: nesting"), text)
            return
        self.nesting += 1
        self.source(text, shell.copy())
        self.nesting -= 1

    def writes(self, words: Iterable[Word], verb: str, here: str | None, removes: bool = False) -> Rule:
        """The rule for changing the files `words` name, seen from the folder `here`: the
        strongest over every path they stand for (among equals, the one in the worst place)."""
        verdicts = [self.write(path, verb, here, removes)
                    for word in words for value in word.values or (None,)
                    for path in ((braces(value) or [None]) if value is not None else [None])]
        return max(verdicts, key=lambda verdict: (verdict[0].kind, verdict[1]), default=(READS,))[0]

    def write(self, path: str | None, verb: str, here: str | None, removes: bool) -> tuple[Rule, Place]:
        """The rule for changing one path, and the place it lies in; a user's path rule decides
        the paths it matches."""
        place = self.place(path, here)
        if removes and place is Place.INSIDE and absolute(path or "", here) == self.project:
            place = Place.GIT_STORE
        full = path if path is None or path.startswith("~") else absolute(path, here)
        declared = self.rules.for_path(full, self.project, f"{verb} {path}") if full else None
        return declared or _place_rule(place, verb, path), place

    def place(self, path: str | None, here: str | None) -> Place:
        if path is None:
            return Place.UNKNOWN
        if path in _HARMLESS_FILES or path.startswith("/dev/fd/"):
            return Place.HARMLESS
        if path.startswith(("/dev/tcp/", "/dev/udp/")):
            host = path.split("/")[3]
            return Place.OUTSIDE if is_local(host) else Place.REMOTE
        if path.startswith("~"):
            return Place.OUTSIDE
        full = absolute(path, here)
        if full is None:
            return Place.UNKNOWN
        if self.project == ".":
            inside = not full.startswith("/") and full != ".." and not full.startswith("../")
            rest = full
        else:
            root = self.project.rstrip("/") + "/"
            inside = full == self.project or full.startswith(root)
            rest = full[len(root):]
        if not inside:
            return Place.OUTSIDE
        # A glob such as .* matches .git too (bash globs match a leading dot only when they start with one).
        store = any(part.startswith(".") and fnmatch.fnmatchcase(".git", part) for part in rest.split("/"))
        return Place.GIT_STORE if store else Place.INSIDE

    # -- statements ------------------------------------------------------------------------

    def walk(self, node: tree_sitter.Node, shell: Shell) -> None:
        if self.level >= _MAX_LEVEL:
            self.add(Rule(Kind.FORK, "is nested too deeply to read", "shell: nesting"), node_text(node))
            return
        self.level += 1
        _STATEMENTS.get(node.type, Walker.descend)(self, node, shell)
        self.level -= 1

    def descend(self, node: tree_sitter.Node, shell: Shell) -> None:
        for child in node.children:
            self.walk(child, shell)

    def in_subshell(self, node: tree_sitter.Node, shell: Shell) -> None:
        self.descend(node, shell.copy())

    def pipeline(self, node: tree_sitter.Node, shell: Shell) -> None:
        for child in node.children:
            self.walk(child, shell.copy())  # each part of a pipeline runs in a subshell

    def list_(self, node: tree_sitter.Node, shell: Shell) -> None:
        conditional = False
        for child in node.children:
            if child.type in ("&&", "||"):
                conditional = child.type == "||"
            elif conditional:
                self.maybe(self.walk, child, shell)
            else:
                self.walk(child, shell)

    def conditional(self, node: tree_sitter.Node, shell: Shell) -> None:
        """if, while, case: their parts may or may not run."""
        self.maybe(self.descend, node, shell)

    def maybe(self, walk: Callable[[tree_sitter.Node, Shell], None], node: tree_sitter.Node,
              shell: Shell) -> None:
        """Walk a part that may or may not run: a `cd` in it leaves the folder unknown after it."""
        before = shell.here
        walk(node, shell)
        if shell.here != before:
            shell.here = None

    def for_loop(self, node: tree_sitter.Node, shell: Shell) -> None:
        variable = node.child_by_field_name("variable")
        words = [shell.expand(value) for value in node.children_by_field_name("value")]
        values = tuple(v for word in words for v in word.values or ())
        known = bool(words) and all(word.values is not None for word in words)
        if variable is not None:
            few = known and len(values) <= MAX_ALTERNATIVES
            shell.variables[node_text(variable)] = values if few else None
        self.maybe(self.descend, node, shell)

    def function(self, node: tree_sitter.Node, shell: Shell) -> None:
        name = node.child_by_field_name("name")
        if name is not None:
            shell.functions.add(node_text(name))
        self.descend(node, shell.copy())  # its body counts as if it were called

    def assignment(self, node: tree_sitter.Node, shell: Shell) -> None:
        self.assign(node, shell)
        self.add(Rule(Kind.NONE, "only sets a shell variable", "shell: assignment"), node_text(node))

    def assign(self, node: tree_sitter.Node, shell: Shell, for_command: bool = False) -> str | None:
        """NAME=value: remembered for the words that follow, unless it is only for one command.
        Returns `NAME=value` if it points clients at another machine (see remote_target)."""
        name, value = node.child_by_field_name("name"), node.child_by_field_name("value")
        target = None
        if name is not None:
            word = shell.expand(value) if value is not None else Word(("",))
            if node_text(name) in RISKY_VARIABLES:
                self.add(risky_variable(node_text(name)).sourced("shell: assignment"), node_text(node))
            target = remote_target(node_text(name), word)
            if not for_command:
                shell.variables[node_text(name)] = word.values
                shell.target = target or shell.target
        self.descend(node, shell)
        return target

    def declaration(self, node: tree_sitter.Node, shell: Shell) -> None:
        for child in node.children:
            if child.type == "variable_assignment":
                self.assign(child, shell)
            else:
                self.walk(child, shell)
        self.add(Rule(Kind.NONE, "only sets shell variables", "shell: declaration"), node_text(node))

    def unset(self, node: tree_sitter.Node, shell: Shell) -> None:
        for child in node.children:
            shell.variables.pop(node_text(child), None)
        self.add(Rule(Kind.NONE, "only unsets shell variables", "shell: unset"), node_text(node))

    def test(self, node: tree_sitter.Node, shell: Shell) -> None:
        self.descend(node, shell)
        self.add(Rule(Kind.NONE, "only tests a condition", "shell: test"), node_text(node))

    def redirected(self, node: tree_sitter.Node, shell: Shell) -> None:
        body = node.child_by_field_name("body")
        extra: list[tree_sitter.Node] = []
        for child in node.children:  # redirections are opened before the body runs
            if child != body:
                extra += self.redirect(child, shell)
        if body is not None and body.type == "command":
            self.walk_command(body, shell, extra, node_text(node))
            return
        if extra:  # bash rejects words after the redirection of a compound command
            self.add(_UNPARSED, node_text(node))
        if body is not None:
            self.walk(body, shell)

    def redirect(self, node: tree_sitter.Node, shell: Shell) -> list[tree_sitter.Node]:
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
                self.add(self.writes([target], "writes", shell.here).sourced("shell: redirection"),
                         node_text(node))
        return targets[1:]

    def walk_command(self, node: tree_sitter.Node, shell: Shell, extra: Sequence[tree_sitter.Node] = (),
                     text: str | None = None) -> None:
        words: list[Word] = []
        target = None
        for i, child in enumerate(node.children):
            field_name = node.field_name_for_child(i)
            if field_name == "redirect":
                extra = [*extra, *self.redirect(child, shell)]
            elif child.type == "variable_assignment":
                target = self.assign(child, shell, for_command=True) or target
            else:
                self.walk(child, shell)  # substitutions in the words run first
                if field_name in ("name", "argument"):
                    words.append(UNKNOWN if child.has_error else shell.expand(child))
        for word in extra:
            self.walk(word, shell)
            words.append(shell.expand(word))
        name = node.child_by_field_name("name")
        if name is not None and not name.has_error:  # a missing name is reported as a parse error
            self.run(words, text or node_text(node), shell if target is None else shell.aimed_at(target))

    def run(self, words: list[Word], text: str, shell: Shell) -> None:
        """Judge the program `words` runs; `text` is the command the reasons quote."""
        if self.level >= _MAX_LEVEL:
            self.add(Rule(Kind.FORK, "is nested too deeply to read", "shell: nesting"), text)
            return
        self.level += 1
        for rule in _judge(Call(self, words[0].text or "", words[1:], text, shell)):
            self.add(rule if shell.target is None else aimed(rule, shell.target), text)
        self.level -= 1


_STATEMENTS: dict[str, Callable[[Walker, tree_sitter.Node, Shell], None]] = {
    "command": Walker.walk_command,
    "redirected_statement": Walker.redirected,
    "pipeline": Walker.pipeline,
    "list": Walker.list_,
    "subshell": Walker.in_subshell,
    "command_substitution": Walker.in_subshell,
    "process_substitution": Walker.in_subshell,
    "if_statement": Walker.conditional,
    "while_statement": Walker.conditional,
    "case_statement": Walker.conditional,
    "c_style_for_statement": Walker.conditional,
    "for_statement": Walker.for_loop,
    "function_definition": Walker.function,
    "variable_assignment": Walker.assignment,
    "declaration_command": Walker.declaration,
    "unset_command": Walker.unset,
    "test_command": Walker.test,
}


def _place_rule(place: Place, verb: str, shown: str | None) -> Rule:
    if place is Place.HARMLESS:
        return Rule(Kind.NONE, f"{verb} only {shown}")
    if place is Place.INSIDE:
        return Rule(Kind.GIT, f"{verb} {shown}, inside the project")
    if place is Place.GIT_STORE:
        return Rule(Kind.FORK, f"{verb} {shown}, which holds .git: git cannot take its own store back")
    if place is Place.OUTSIDE:
        return Rule(Kind.FORK, f"{verb} {shown}, outside the project")
    if place is Place.REMOTE:
        return Rule(Kind.EXTERNAL, f"{verb} {shown}, which sends it to another machine")
    if shown is None:
        return Rule(Kind.FORK, f"{verb} a path only known at run time")
    return Rule(Kind.FORK, f"{verb} {shown} in a folder only known at run time")


_SYSTEM_BIN = frozenset({"/bin", "/sbin", "/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin"})
_PROJECT_WRAPPERS = frozenset({"gradlew", "mvnw"})  # scripts a project carries to run a known build tool
_UNPARSED = Rule(Kind.FORK, "could not be parsed", "shell: syntax")


def _only_misread_here_strings(root: tree_sitter.Node) -> bool:
    """Whether every error in the tree is tree-sitter-bash misreading a here-string after a file
    redirection (`cat > notes.txt <<< "hi"` comes out as an ERROR `<<` and a `< "hi"`): the
    command is valid, and the walk reads the `< "hi"` as the input redirection it stands for."""
    errors = []
    pending = [root]
    while pending:
        node = pending.pop()
        if node.type == "ERROR" or node.is_missing:
            errors.append(node)
        else:
            pending += [child for child in node.children if child.has_error]
    return all(node.type == "ERROR" and node.text == b"<<" and node.next_sibling is not None
               and node.next_sibling.type == "file_redirect" and node.next_sibling.text.startswith(b"<")
               and node.next_sibling.start_byte == node.end_byte for node in errors)


def program_key(name: str) -> str | None:
    """The PROGRAMS key for a command name: /usr/bin/rm is rm, python3.11 is python; a package
    a launcher runs (npx, uvx, pipx run) by its program: prettier@3 and @biomejs/biome@1.8 are
    prettier and biome, black==24.1 is black; node_modules/.bin/eslint, the project's copy of
    eslint, is eslint."""
    folder, base = posixpath.split(name)
    scoped = name.startswith("@") and name.count("/") == 1  # @scope/package
    if scoped or folder == "node_modules/.bin" or folder.endswith("/node_modules/.bin"):
        folder = ""
    if folder and folder not in _SYSTEM_BIN and base not in _PROJECT_WRAPPERS:
        return None  # ./run.sh, .venv/bin/x: a program of its own
    base = re.split(r"@|==|>=|<=|~=|!=|\[", base, maxsplit=1)[0] if not base.startswith("@") else base
    if base in PROGRAMS:
        return base
    unversioned = re.fullmatch(r"([a-z]+?)-?[0-9.]+", base)
    return unversioned.group(1) if unversioned and unversioned.group(1) in PROGRAMS else None


def _judge(call: Call) -> list[Rule]:
    if not call.name:
        return [Rule(Kind.FORK, "runs a command whose name is only known at run time", "shell: expansion")]
    if call.name in call.shell.functions:
        return [Rule(Kind.NONE, "calls a function the command defines (its body is judged)",
                     "shell: function")]
    declared = call.walker.rules.for_program(call.name, [word.text for word in call.args])
    if declared is not None:
        return [declared]
    program = program_key(call.name)
    if program is None:
        if "/" in call.name:
            return [unknown(call.name, f"runs the program {call.name}; its effect cannot be known")]
        return [unknown(call.name, "is not a known command; its effect cannot be known")]
    if [word.text for word in call.args] in (["--version"], ["--help"]):
        return [Rule(Kind.NONE, "only prints its version or help", f"table: {program}")]
    entry = call.shifted(call.args, entry=program)
    return [rule.sourced(f"table: {program}") for rule in PROGRAMS[program](entry)]
