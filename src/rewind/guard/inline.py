"""Inline programs (`python -c CODE`) read as programs: a parser gives their calls, and what
they do decides the kind, as the shell walker's rules do for shell. Only what can be read with
certainty counts as harmless: a module outside a known set, a call on something whose origin
is not known, or code built at run time is a fork.

Agents use `python -c` mostly to read (print a field of a JSON file, a version, a path), and
the shell cannot tell that from a program that rewrites files: this can. `Reading` is what
every language's reader shares (inline_js.py: node, deno and bun; inline_perl_ruby.py); the
Python reader, on Python's own `ast`, is here.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rewind.guard.entries import READS, RUNS_CODE, request_rule
from rewind.guard.verdicts import Kind, Rule
from rewind.guard.words import UNKNOWN, literal, remote_url

if TYPE_CHECKING:
    from rewind.guard.call import Call

# Modules whose functions only compute or read (a few of their writers are listed below).
_READING_MODULES = frozenset({
    "json", "sys", "os", "os.path", "re", "math", "cmath", "datetime", "time", "collections", "itertools",
    "functools", "operator", "platform", "hashlib", "hmac", "base64", "binascii", "textwrap", "string",
    "random", "uuid", "pathlib", "csv", "tomllib", "configparser", "importlib.metadata", "sysconfig",
    "struct", "pprint", "statistics", "decimal", "fractions", "typing", "dataclasses", "enum", "shlex",
    "glob", "fnmatch", "locale", "unicodedata", "zlib", "difflib", "html", "keyword", "calendar",
    "ipaddress", "secrets", "heapq", "bisect", "array", "copy", "numbers", "inspect", "ast", "tokenize",
    "socket", "getpass", "pwd", "grp", "shutil", "subprocess", "urllib.request", "urllib.parse", "requests",
    "sqlite3",
})
# Calls that change files: (module or type, function) -> the argument positions of its paths.
_WRITERS: dict[str, tuple[int, ...]] = {
    "os.remove": (0,), "os.unlink": (0,), "os.rmdir": (0,), "os.removedirs": (0,), "os.mkdir": (0,),
    "os.makedirs": (0,), "os.rename": (0, 1), "os.replace": (0, 1), "os.chmod": (0,), "os.chown": (0,),
    "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,), "os.utime": (0,),
    "shutil.rmtree": (0,), "shutil.move": (0, 1), "shutil.copy": (1,), "shutil.copy2": (1,),
    "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.chown": (0,),
    "sqlite3.connect": (0,),  # makes the database file, and the code may write it
}
# Those that take their path away: naming the project folder takes .git with it
_REMOVERS = frozenset({"os.rmdir", "os.removedirs", "os.rename", "os.replace", "shutil.rmtree",
                       "shutil.move"})
# Path methods that change files; the ones strings share (replace) count only on a Path(...).
_PATH_WRITERS = frozenset({"write_text", "write_bytes", "touch", "mkdir", "unlink", "rmdir", "symlink_to",
                           "hardlink_to"})
_PATH_ONLY_WRITERS = frozenset({"rename", "replace", "chmod"})
_RUNNERS = frozenset({"os.system", "os.popen", "os.execv", "os.execvp", "os.execl", "os.execlp",
                      "os.spawnv", "os.spawnl", "os.fork", "os.kill", "subprocess.run", "subprocess.call",
                      "subprocess.check_call", "subprocess.check_output", "subprocess.Popen",
                      "subprocess.getoutput", "subprocess.getstatusoutput"})
_UNKNOWN_CODE = frozenset({"exec", "eval", "compile", "__import__", "breakpoint", "globals", "setattr",
                           "delattr", "input"})
_REQUESTS = {"get": "GET", "head": "HEAD", "post": "POST", "put": "PUT", "patch": "PATCH", "delete": "DELETE",
             "request": "POST"}


SOCKET = Rule(Kind.FORK, "opens a network socket")


def unread(language: str, code: str | None) -> Rule:
    """The verdict on inline code that cannot be read: built at run time, or not parsed."""
    if code is None:
        return Rule(Kind.FORK, "runs inline code that is only known at run time", f"inline: {language}: code")
    return RUNS_CODE.sourced(f"inline: {language}: syntax error")


@dataclass
class Reading:
    """What one inline program does, as far as its calls show: a verdict per call that acts,
    each credited to `inline: LANGUAGE: CALL(...)`."""

    call: Call
    language: str  # as named in sources: python, node, deno, bun, perl, ruby
    code: str
    rules: list[Rule] = field(default_factory=list)

    def __post_init__(self) -> None:
        if "chdir" in self.code:  # where it changes folder is not followed: its relative paths are unknown
            self.call = self.call.shifted(self.call.args, self.call.shell.moved(UNKNOWN))

    def at(self, what: str) -> str:
        return f"inline: {self.language}: {what}"

    def add(self, rule: Rule, what: str) -> None:
        self.rules.append(rule.sourced(self.at(what)))

    def writes(self, paths: Sequence[str | None], verb: str, what: str, removes: bool = False) -> None:
        words = [literal(p) if p is not None else UNKNOWN for p in paths] or [UNKNOWN]
        self.add(self.call.writes(words, verb, removes), what)

    def runs(self, words: Sequence[str | None] | None, command: str | None, what: str) -> None:
        """A program run with its words, or a shell command given whole, is judged as the shell
        judges it; either only known at run time is a fork."""
        if words and None not in words:
            self.call.run([literal(word or "") for word in words], via=self.at(what))
        elif command is not None:
            self.call.shell_code(literal(command), via=self.at(what))
        else:
            self.add(Rule(Kind.FORK, f"runs a program through {what}, only known at run time"), what)

    def requests(self, url: str | None, method: str | None, what: str) -> None:
        """A request: a GET reads; another method changes what it is sent to (a method only
        known at run time may be one)."""
        if method in ("GET", "HEAD"):
            self.add(READS, what)
        else:
            remote = url is None or remote_url(literal(url))
            self.add(request_rule(remote, method or "possibly non-GET"), what)

    def verdicts(self, kind: str) -> list[Rule]:
        """The verdicts; only reads if no call acts (`kind` names the code: inline Python)."""
        return self.rules or [Rule(Kind.NONE, f"runs {kind} that only reads", self.at("reads only"))]


@dataclass
class _PythonReading(Reading):
    """What one Python program does."""

    modules: dict[str, str] = field(default_factory=dict)  # local name -> module

    def visit(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                self.imports(node)
            elif isinstance(node, ast.Call):
                self.calls(node)

    def imports(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [(alias.asname or alias.name, f"{module}.{alias.name}") for alias in node.names]
        else:
            module = ""
            names = [(alias.asname or alias.name.partition(".")[0], alias.name) for alias in node.names]
        for local, full in names:
            root = module or full
            if root not in _READING_MODULES and root.partition(".")[0] not in _READING_MODULES:
                self.add(Rule(Kind.FORK, f"imports {root}, whose effect is not known here"), f"import {root}")
            self.modules[local] = full

    def calls(self, node: ast.Call) -> None:
        name = self.name_of(node.func)
        if name is None:
            if isinstance(node.func, ast.Attribute):
                path = self.path_of(node.func.value)
                if node.func.attr in _PATH_WRITERS or (node.func.attr in _PATH_ONLY_WRITERS and path):
                    self.writes([path], "writes", f"Path.{node.func.attr}(...)")
            return
        what = f"{name}(...)"
        if name in _UNKNOWN_CODE:
            self.add(RUNS_CODE, what)
        elif name == "open":
            self.opens(node)
        elif name in _WRITERS:
            paths = [self.text(node.args[i]) if i < len(node.args) else None for i in _WRITERS[name]]
            if paths != [":memory:"]:  # sqlite's database in memory
                self.writes(paths, "changes", what, name in _REMOVERS)
        elif name in _RUNNERS:
            first = node.args[0] if node.args else None
            words = [self.text(e) for e in first.elts] if isinstance(first, ast.List | ast.Tuple) else []
            self.runs(words, self.text(first) if first is not None else None, what)
        elif name.startswith("requests.") or name in ("urllib.request.urlopen", "urllib.request.Request"):
            self.requests_(name, node)
        elif name.startswith("socket."):
            self.add(SOCKET, what)

    def name_of(self, func: ast.expr) -> str | None:
        """`os.path.join` for a call of it through any import name; None for a method of a value."""
        parts = []
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if not isinstance(func, ast.Name):
            return None
        head = self.modules.get(func.id, func.id if not parts else None)
        if head is None:
            return None
        return ".".join([head, *reversed(parts)])

    def text(self, node: ast.expr) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    def path_of(self, node: ast.expr) -> str | None:
        """The path a `Path("...")` (or `pathlib.Path`) value names, if written out."""
        if isinstance(node, ast.Call) and self.name_of(node.func) in ("pathlib.Path", "Path") and node.args:
            return self.text(node.args[0])
        return None

    def opens(self, node: ast.Call) -> None:
        mode = self.text(node.args[1]) if len(node.args) > 1 else next(
            (self.text(k.value) for k in node.keywords if k.arg == "mode"), "r")
        if mode is None or set(mode) & set("wax+"):
            self.writes([self.text(node.args[0]) if node.args else None], "writes", "open(...)")

    def requests_(self, name: str, node: ast.Call) -> None:
        url = self.text(node.args[0]) if node.args else None
        method = _REQUESTS.get(name.rpartition(".")[2], "GET")
        if name.startswith("urllib") and (len(node.args) > 1 or any(k.arg == "data" for k in node.keywords)):
            method = "POST"
        self.requests(url, method, f"{name}(...)")


def inline_python(call: Call, code: str | None) -> list[Rule]:
    """The verdicts on `python -c code`: what its calls do; only reads if they only read."""
    if code is None:
        return [unread("python", code)]
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return [unread("python", code)]
    reading = _PythonReading(call, "python", code)
    reading.visit(tree)
    return reading.verdicts("inline Python")
