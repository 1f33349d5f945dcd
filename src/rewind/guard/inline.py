"""Inline Python (`python -c CODE`) read as a program: Python's own parser (`ast`) gives its
calls, and what they do decides the kind, as the shell walker's rules do for shell. Only what
can be read with certainty counts as harmless: a module outside a known set, a call on
something whose origin is not known, or code built at run time is a fork.

Agents use `python -c` mostly to read (print a field of a JSON file, a version, a path), and
the shell cannot tell that from a program that rewrites files: this can.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rewind.guard.entries import READS, RUNS_CODE, request_rule
from rewind.guard.verdicts import Kind, Rule
from rewind.guard.words import Word, literal, remote_url

if TYPE_CHECKING:
    from rewind.guard.walker import Call

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


@dataclass
class _Reading:
    """What one inline program does, as far as its calls show."""

    call: Call
    modules: dict[str, str] = field(default_factory=dict)  # local name -> module
    rules: list[Rule] = field(default_factory=list)

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
                self.rules.append(Rule(Kind.FORK, f"imports {root}, whose effect is not known here"))
            self.modules[local] = full

    def calls(self, node: ast.Call) -> None:
        name = self.name_of(node.func)
        if name is None:
            if isinstance(node.func, ast.Attribute):
                path = self.path_of(node.func.value)
                if node.func.attr in _PATH_WRITERS or (node.func.attr in _PATH_ONLY_WRITERS and path):
                    self.rules.append(self.writes(path, "writes"))
            return
        if name in _UNKNOWN_CODE:
            self.rules.append(RUNS_CODE)
        elif name == "open":
            self.opens(node)
        elif name in _WRITERS:
            paths = [self.text(node.args[i]) if i < len(node.args) else None for i in _WRITERS[name]]
            if paths != [":memory:"]:  # sqlite's database in memory
                self.rules.append(self.writes(paths, "changes"))
        elif name in _RUNNERS:
            self.runs(name, node)
        elif name.startswith("requests.") or name in ("urllib.request.urlopen", "urllib.request.Request"):
            self.requests(name, node)
        elif name.startswith("socket."):
            self.rules.append(Rule(Kind.FORK, "opens a network socket"))

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

    def writes(self, paths: list[str | None] | str | None, verb: str) -> Rule:
        paths = paths if isinstance(paths, list) else [paths]
        return self.call.writes([literal(p) if p is not None else Word(None) for p in paths], verb)

    def opens(self, node: ast.Call) -> None:
        mode = self.text(node.args[1]) if len(node.args) > 1 else next(
            (self.text(k.value) for k in node.keywords if k.arg == "mode"), "r")
        if mode is None or set(mode) & set("wax+"):
            path = self.text(node.args[0]) if node.args else None
            self.rules.append(self.writes(path, "writes"))

    def runs(self, name: str, node: ast.Call) -> None:
        """A command given whole is judged as the shell judges it; else it cannot be known."""
        argument = node.args[0] if node.args else None
        words = [self.text(e) for e in argument.elts] if isinstance(argument, ast.List | ast.Tuple) else []
        command = self.text(argument) if argument is not None else None
        if words and None not in words:
            self.call.run([literal(word or "") for word in words])
        elif command is not None:
            self.call.shell_code(literal(command))
        else:
            self.rules.append(Rule(Kind.FORK, f"runs a program through {name}, only known at run time"))

    def requests(self, name: str, node: ast.Call) -> None:
        url = self.text(node.args[0]) if node.args else None
        method = _REQUESTS.get(name.rpartition(".")[2], "GET")
        if name.startswith("urllib") and (len(node.args) > 1 or any(k.arg == "data" for k in node.keywords)):
            method = "POST"
        if method in ("GET", "HEAD"):
            self.rules.append(READS)
        else:
            self.rules.append(request_rule(url is None or remote_url(literal(url)), method))


def inline_python(call: Call, code: str | None) -> list[Rule]:
    """The verdicts on `python -c code`: what its calls do; only reads if they only read."""
    if code is None:
        return [Rule(Kind.FORK, "runs inline code that is only known at run time")]
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return [RUNS_CODE]
    reading = _Reading(call)
    reading.visit(tree)
    return reading.rules or [Rule(Kind.NONE, "runs inline Python that only reads")]
