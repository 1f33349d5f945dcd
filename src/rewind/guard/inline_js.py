"""Inline JavaScript (`node -e`, `node -p`, `deno eval`, `bun -e`) read as a program, with
tree-sitter-javascript: the modules it loads and the calls it makes decide, as for `python -c`
(rewind.guard.inline). Calls are known by what they resolve to through `require`, `import`,
destructuring and aliases (`const {writeFileSync: w} = require("node:fs")` makes `w(...)`
fs.writeFileSync); node also offers its built-in modules as globals in inline code (`fs`,
`child_process`), so those names are the modules unless bound to something else.

What a built-in module's function does is in the tables below; any other function of a known
module only reads. A module outside a known set, code built at run time (`eval`, `Function`,
`vm`), a member only known at run time (`fs[name]`) or a runtime API not listed is a fork.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tree_sitter
import tree_sitter_javascript

from rewind.guard.entries import PROCESSES, RUNS_CODE
from rewind.guard.inline import SOCKET, Reading, unread
from rewind.guard.verdicts import Kind, Rule

if TYPE_CHECKING:
    from rewind.guard.call import Call

_LANGUAGE = tree_sitter.Language(tree_sitter_javascript.language())

# Modules (and runtime globals) whose functions are judged here; other modules are not known.
_MODULES = frozenset({
    "fs", "path", "os", "util", "url", "querystring", "string_decoder", "events", "buffer", "assert",
    "crypto", "zlib", "timers", "perf_hooks", "readline", "dns", "stream", "console", "process",
    "child_process", "http", "https", "http2", "net", "tls", "dgram", "axios", "fetch", "Deno", "Bun"})
_RENAMED = {"node-fetch": "fetch", "bun": "Bun", "fs/promises": "fs", "dns/promises": "dns",
            "timers/promises": "timers", "stream/promises": "stream", "readline/promises": "readline"}
# Globals and modules that run code given as data, or load code the reading cannot see
_RUNS_CODE = frozenset({"eval", "Function", "vm", "worker_threads", "Worker", "inspector", "repl",
                        "cluster", "v8", "wasi", "execScript", "importScripts"})
# Names reached through a global object (globalThis.fetch is fetch)
_GLOBAL_OBJECTS = frozenset({"globalThis", "global", "window", "self", "this"})

# fs functions (without Sync, and fs.promises's alike) that change files -> their path arguments
_FS_WRITERS: dict[str, tuple[int, ...]] = {
    "writeFile": (0,), "appendFile": (0,), "mkdir": (0,), "mkdtemp": (0,), "rm": (0,), "rmdir": (0,),
    "unlink": (0,), "rename": (0, 1), "copyFile": (1,), "cp": (1,), "symlink": (1,), "link": (1,),
    "chmod": (0,), "lchmod": (0,), "chown": (0,), "lchown": (0,), "utimes": (0,), "lutimes": (0,),
    "truncate": (0,), "createWriteStream": (0,)}
_DENO_WRITERS: dict[str, tuple[int, ...]] = {
    "writeTextFile": (0,), "writeFile": (0,), "create": (0,), "mkdir": (0,), "remove": (0,), "rename": (0, 1),
    "copyFile": (1,), "symlink": (1,), "link": (1,), "chmod": (0,), "chown": (0,), "truncate": (0,),
    "utime": (0,)}
# Those that take their path away: naming the project folder takes .git too
_REMOVERS = frozenset({"rm", "rmdir", "unlink", "remove", "rename"})
# Runtime APIs that only read or compute, by their first name after Deno. or Bun.
_DENO_READS = frozenset({
    "readTextFile", "readFile", "readDir", "stat", "lstat", "realPath", "readLink", "cwd", "exit", "inspect",
    "env", "args", "version", "build", "pid", "ppid", "execPath", "hostname", "osRelease", "osUptime",
    "memoryUsage", "loadavg", "systemMemoryInfo", "uid", "gid", "errors", "noColor", "mainModule", "stdin",
    "stdout", "stderr", "isatty", "consoleSize", "chdir"})
_BUN_READS = frozenset({
    "file", "version", "revision", "env", "argv", "main", "which", "sleep", "sleepSync", "hash",
    "CryptoHasher", "inspect", "nanoseconds", "deepEquals", "escapeHTML", "stringWidth", "Glob", "password",
    "gzipSync", "gunzipSync", "deflateSync", "inflateSync", "semver", "color", "fileURLToPath",
    "pathToFileURL", "resolveSync", "stdin", "stdout", "stderr", "readableStreamToText",
    "readableStreamToJSON", "peek"})
_RUNTIME_SOCKETS = frozenset({"connect", "connectTls", "listen", "listenTls", "listenDatagram", "startTls",
                              "serve", "udpSocket"})
_SOCKET_MAKERS = frozenset({"connect", "createConnection", "createServer", "createSecureServer",
                            "createSocket", "Socket", "Server"})
_PROCESS_CHANGES = frozenset({"kill", "setuid", "setgid", "seteuid", "setegid", "setgroups", "initgroups",
                              "abort"})
_HTTP_METHODS = frozenset({"get", "head", "post", "put", "patch", "delete", "options"})
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"', "`": "`", "/": "/",
            "$": "$"}
_STANDARD_STREAMS = {"1": "/dev/stdout", "2": "/dev/stderr", "process.stdout": "/dev/stdout",
                     "process.stderr": "/dev/stderr", "Bun.stdout": "/dev/stdout",
                     "Bun.stderr": "/dev/stderr"}
# Parents whose child identifier is a name being bound, not a use of one
_BINDING_PARENTS = frozenset({"namespace_import", "import_clause", "import_specifier", "pair_pattern",
                              "formal_parameters", "array_pattern", "rest_pattern", "assignment_pattern"})
_FOLLOWING = frozenset({"variable_declarator", "assignment_expression", "member_expression",
                        "subscript_expression", "expression_statement"})
_NAMED_BINDERS = frozenset({"variable_declarator", "function_declaration", "class_declaration",
                            "method_definition", "function_expression", "generator_function_declaration"})


def inline_js(call: Call, runtime: str, code: str | None) -> list[Rule]:
    """The verdicts on inline JavaScript run by `runtime` (node, deno, bun)."""
    if code is None:
        return [unread(runtime, code)]
    root = tree_sitter.Parser(_LANGUAGE).parse(code.encode("utf-8")).root_node
    if root.has_error:
        return [unread(runtime, code)]
    reading = _JsReading(call, runtime, code)
    nodes = list(_nodes(root))
    try:
        for node in nodes:  # names are bound first: a function may use one declared below it
            reading.binds(node)
        for node in nodes:
            reading.judge(node)
    except RecursionError:  # names nested thousands deep (a.a.a...): not read
        return [unread(runtime, code)]
    return reading.verdicts("inline JavaScript")


def _nodes(root: tree_sitter.Node) -> Iterator[tree_sitter.Node]:
    pending = [root]
    while pending:
        node = pending.pop()
        yield node
        pending += reversed(node.named_children)


def _text(node: tree_sitter.Node | None) -> str | None:
    """A string literal's value (a template without substitutions too); None for anything else."""
    if node is None or node.type not in ("string", "template_string"):
        return None
    value = []
    for part in node.named_children:
        raw = (part.text or b"").decode("utf-8")
        if part.type == "string_fragment":
            value.append(raw)
        elif part.type == "escape_sequence" and raw[1:] in _ESCAPES:
            value.append(_ESCAPES[raw[1:]])
        else:  # a substitution, or an escape that could spell anything
            return None
    return "".join(value)


def _source(node: tree_sitter.Node) -> str:
    return (node.text or b"").decode("utf-8", errors="replace")


def _shown(node: tree_sitter.Node) -> str:
    """Code as the program wrote it, on one line and cut, for sources: fs.writeFileSync."""
    return " ".join(_source(node)[:240].split())[:60]


def _arguments(node: tree_sitter.Node) -> list[tree_sitter.Node]:
    args = node.child_by_field_name("arguments")
    return [] if args is None else args.named_children if args.type == "arguments" else [args]


def _option(node: tree_sitter.Node | None, key: str) -> tuple[bool, tree_sitter.Node | None]:
    """In an object literal `{key: value}`: whether `key` may be set, and its value if written
    out. Anything but an object literal, or a spread in it, may set any key."""
    if node is None:
        return False, None
    if node.type != "object":
        return True, None
    for child in node.named_children:
        if child.type == "spread_element" or (child.type == "shorthand_property_identifier"
                                              and _source(child) == key):
            return True, None
        name = child.child_by_field_name("key") if child.type == "pair" else None
        if name is not None and key in (_source(name), _text(name)):
            return True, child.child_by_field_name("value")
    return False, None


def _followed(node: tree_sitter.Node) -> bool:
    """Whether a loaded module's value goes where its names are followed: bound to a name, or
    a member taken from it (not handed to a function or put in an array)."""
    parent = node.parent
    while parent is not None and parent.type in ("await_expression", "parenthesized_expression"):
        parent = parent.parent
    return parent is None or parent.type in _FOLLOWING


def _host(options: tree_sitter.Node) -> str | None:
    """The host http.request's options name: localhost by default, None if only known at run time."""
    for key in ("hostname", "host"):
        written, value = _option(options, key)
        if written:
            return _text(value)
    return "localhost"


@dataclass
class _JsReading(Reading):
    """What one JavaScript program does."""

    names: dict[str, str] = field(default_factory=dict)  # local name -> what it is bound to: fs.writeFile

    # -- names ------------------------------------------------------------------------------

    def binds(self, node: tree_sitter.Node) -> None:
        """Remember what a declaration, assignment or import binds its names to."""
        if node.type == "import_statement":
            source = _text(node.child_by_field_name("source"))
            if source is not None:
                self.bind_import(node, self.module(source))
            return
        if node.type == "call_expression":  # import("fs").then(m => ...): m is fs
            callee, args = node.child_by_field_name("function"), _arguments(node)
            member = callee.child_by_field_name("property") if callee is not None and \
                callee.type == "member_expression" else None
            if member is None or _source(member) != "then" or not args or \
                    args[0].type not in ("arrow_function", "function_expression"):
                return
            promised = callee.child_by_field_name("object")
            params = args[0].child_by_field_name("parameters") or args[0].child_by_field_name("parameter")
            if params is not None and params.type == "formal_parameters":
                params = params.named_children[0] if params.named_children else None
            if promised is not None and params is not None:
                self.bind(params, self.name_of(promised))
            return
        if node.type in ("variable_declarator", "assignment_expression"):
            declared = node.type == "variable_declarator"
            value = node.child_by_field_name("value" if declared else "right")
            target = node.child_by_field_name("name" if declared else "left")
            if target is not None and value is not None:
                self.bind(target, self.name_of(value))

    def bind(self, target: tree_sitter.Node, bound: str | None) -> None:
        """Bind a name, or the names of a destructuring pattern, to what `bound` names."""
        if bound is None:
            return
        if target.type == "identifier":
            self.names[_source(target)] = bound
        elif target.type == "object_pattern":
            for part in target.named_children:
                if part.type == "shorthand_property_identifier_pattern":
                    self.names[_source(part)] = f"{bound}.{_source(part)}"
                elif part.type == "pair_pattern":
                    key, local = part.child_by_field_name("key"), part.child_by_field_name("value")
                    if key is not None and local is not None and local.type == "identifier":
                        self.names[_source(local)] = f"{bound}.{_text(key) or _source(key)}"

    def bind_import(self, node: tree_sitter.Node, module: str) -> None:
        clause = next((c for c in node.named_children if c.type == "import_clause"), None)
        for part in _nodes(clause) if clause is not None else ():
            if part.type == "identifier" and part.parent is not None and part.parent.type in (
                    "import_clause", "namespace_import"):
                self.names[_source(part)] = module
            elif part.type == "import_specifier":
                name, alias = part.child_by_field_name("name"), part.child_by_field_name("alias")
                if name is not None:
                    self.names[_source(alias or name)] = f"{module}.{_text(name) or _source(name)}"

    def module(self, name: str) -> str:
        name = name.removeprefix("node:")
        return _RENAMED.get(name, name)

    def name_of(self, node: tree_sitter.Node) -> str | None:
        """What an expression names, as `module.member...` (`fs.promises.writeFile`), through
        the names the program bound; None for a value the reading does not follow."""
        kind = node.type
        if kind == "this":
            return "this"
        if kind == "identifier":
            return self.names.get(_source(node), _source(node))
        if kind in ("member_expression", "subscript_expression"):
            parent = node.child_by_field_name("object")
            head = self.name_of(parent) if parent is not None else None
            if head is None:
                return None
            if kind == "member_expression":
                member = node.child_by_field_name("property")
                return f"{head}.{_source(member) if member is not None else '[]'}"
            index = _text(node.child_by_field_name("index"))
            return f"{head}.{index if index is not None else '[]'}"  # [] : a member only known at run time
        if kind in ("await_expression", "parenthesized_expression") and node.named_child_count == 1:
            return self.name_of(node.named_children[0])
        if kind == "call_expression":
            callee = node.child_by_field_name("function")
            args = _arguments(node)
            loads = callee is not None and (callee.type == "import" or self.canonical(callee) == "require")
            if loads and len(args) == 1 and _text(args[0]) is not None:
                return self.module(_text(args[0]) or "")
        return None

    def canonical(self, node: tree_sitter.Node) -> str | None:
        """The name an expression resolves to, as the tables know it: fs.writeFile for
        globalThis.require("node:fs").promises.writeFileSync; None if not followed."""
        name = self.name_of(node)
        if name is None:
            return None
        parts = name.split(".")
        while len(parts) > 1 and parts[0] in _GLOBAL_OBJECTS:
            parts = parts[1:]
        if parts[0] in _MODULES:  # fs.promises.writeFile and (await import("fs")).default.writeFile are fs's
            parts = [parts[0], *(part for part in parts[1:] if part not in ("promises", "default"))]
        if parts[0] in ("fs", "child_process", "Deno", "Bun") and len(parts) > 1:
            parts[-1] = parts[-1].removesuffix("Sync")
        return ".".join(parts)

    # -- judging ----------------------------------------------------------------------------

    def judge(self, node: tree_sitter.Node) -> None:
        member = node.child_by_field_name("property" if node.type == "member_expression" else "index")
        if node.type in ("member_expression", "subscript_expression") and member is not None and \
                "constructor" in (_source(member), _text(member)):  # "".constructor.constructor is Function
            self.add(RUNS_CODE, _shown(node))
        if node.type in ("call_expression", "new_expression"):
            callee = node.child_by_field_name("function" if node.type == "call_expression" else "constructor")
            if callee is not None:
                self.calls(callee, node, _arguments(node))
        elif node.type == "import_statement":
            source = _text(node.child_by_field_name("source"))
            self.loads(self.module(source) if source is not None else None, node)
        elif node.type in ("member_expression", "subscript_expression", "identifier") and self.used(node):
            name = self.canonical(node)
            if name is not None:  # fs.unlinkSync handed on, to be called with what is only known at run time
                self.acts(name, node, None)

    def used(self, node: tree_sitter.Node) -> bool:
        """Whether `node` is a name used as a value on its own: not a call's function, not part
        of a longer name, not a name being bound."""
        parent = node.parent
        if parent is None:
            return False
        if parent.type in ("call_expression", "new_expression") and node in (
                parent.child_by_field_name("function"), parent.child_by_field_name("constructor")):
            return False
        if parent.type in ("member_expression", "subscript_expression") and \
                node == parent.child_by_field_name("object"):
            return False
        if parent.type == "assignment_expression" and node == parent.child_by_field_name("left"):
            return False
        if node.type != "identifier":
            return True
        if parent.type in _BINDING_PARENTS or (parent.type in _NAMED_BINDERS and
                                               node == parent.child_by_field_name("name")):
            return False
        return _source(node) in self.names or self.canonical(node) in ("fetch", "eval", "Function")

    def calls(self, callee: tree_sitter.Node, node: tree_sitter.Node, args: list[tree_sitter.Node]) -> None:
        parts = (self.canonical(callee) or "").split(".")
        if callee.type == "import" or parts[-1] == "require":  # module.require, process.mainModule.require
            module = self.module(_text(args[0]) or "") if len(args) == 1 and _text(args[0]) else None
            self.loads(module, node)
            if module in _JUDGES and not _followed(node):
                self.add(Rule(Kind.FORK, f"hands {module} on, where its calls are not followed"),
                         _shown(node))
            return
        if "require" in parts and parts != ["require", "resolve"]:  # require.call(...): known at run time
            self.loads(None, node)
            return
        parent = callee.child_by_field_name("object") if callee.type == "member_expression" else None
        if parent is not None and parent.type == "call_expression" and self.canonical(
                parent.child_by_field_name("function") or parent) == "Bun.file":
            self.bun_file(callee, _arguments(parent))
            return
        name = self.canonical(callee)
        if name is not None:
            self.acts(name, node, args)

    def loads(self, module: str | None, node: tree_sitter.Node) -> None:
        """require(...), import(...), import ... from: a module outside the known set is a fork."""
        if module is not None and module.startswith((".", "/")) and module.endswith(".json"):
            return  # a JSON file is read, not run
        if module is None:
            self.add(Rule(Kind.FORK, "loads a module only known at run time"), _shown(node))
        elif module in _RUNS_CODE:
            self.add(RUNS_CODE, _shown(node))
        elif module not in _MODULES:
            self.add(Rule(Kind.FORK, f"loads {module}, whose effect is not known here"), _shown(node))

    def acts(self, name: str, node: tree_sitter.Node, args: list[tree_sitter.Node] | None) -> None:
        """Judge a call of `name` with `args` (None: the function is handed on, its arguments
        only known at run time)."""
        root, _, rest = name.partition(".")
        callee = node.child_by_field_name("function") or node.child_by_field_name("constructor") or node
        what = f"{_shown(callee)}(...)"
        if rest.count(".") and rest.rpartition(".")[2] in ("call", "apply", "bind"):
            rest, args = rest.rpartition(".")[0], None  # fs.writeFileSync.call(null, ...): arguments shift
        if root == "[]":
            self.add(Rule(Kind.FORK, "calls a global only known at run time"), what)
        elif root in _RUNS_CODE or (
                root in ("setTimeout", "setInterval") and args and _text(args[0]) is not None):
            self.add(RUNS_CODE, what)
        elif root in _MODULES and rest.partition(".")[0] == "[]":
            self.add(Rule(Kind.FORK, f"calls a member of {root} only known at run time"), what)
        elif root in _JUDGES:
            _JUDGES[root](self, rest, args, what)

    def paths(self, args: list[tree_sitter.Node] | None, positions: tuple[int, ...]) -> list[str | None]:
        if args is None:
            return [None]
        return [_STANDARD_STREAMS.get(_source(args[i]), _text(args[i])) if i < len(args) else None
                for i in positions]

    # -- by module --------------------------------------------------------------------------

    def fs(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        if function in _FS_WRITERS:
            self.writes(self.paths(args, _FS_WRITERS[function]), "changes", what, function in _REMOVERS)
        elif function == "open":  # its flags say whether it writes; the default, "r", reads
            flags = args[1] if args is not None and len(args) > 1 else None
            if args is None or (flags is not None and set(_text(flags) or "w") & set("wa+")):
                self.writes(self.paths(args, (0,)), "writes", what)

    def child_process(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        args = args or []
        first = _text(args[0]) if args else None
        if function == "exec":
            self.runs(None, first, what)
        elif function in ("execFile", "spawn"):
            listed = args[1].type == "array" if len(args) > 1 else False
            words = [first, *(_text(arg) for arg in args[1].named_children)] if listed else [first]
            after = args[2 if listed else 1:]
            shell, value = _option(after[0] if after else None, "shell")
            if shell and (value is None or value.type != "false"):  # the words are joined into shell code
                self.runs(None, " ".join(w for w in words if w) if None not in words else None, what)
            else:
                self.runs(words, None, what)
        elif function:  # fork() runs a JavaScript file; anything else is not known
            self.add(RUNS_CODE, what)

    def http(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        if function in ("request", "get"):
            args = args or []
            url = _text(args[0]) if args else None
            options = next((a for a in args if a.type == "object"), None)
            if url is None and options is not None:
                url = _host(options)
            self.requests(url, self.method(options, "GET"), what)
        elif function.partition(".")[0] in _SOCKET_MAKERS:
            self.add(SOCKET, what)

    def sockets(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        if function.partition(".")[0] in _SOCKET_MAKERS:
            self.add(SOCKET, what)

    def fetch(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        args = args or []
        literal = bool(args) and args[0].type in ("string", "template_string")  # not a Request with a method
        self.requests(_text(args[0]) if args else None,
                      self.method(args[1] if len(args) > 1 else None, "GET" if literal else None), what)

    def axios(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        args = args or []
        first = args[0] if args else None
        if function in _HTTP_METHODS:
            self.requests(_text(first), function.upper(), what)
        elif function in ("", "request"):  # axios(config), axios(url, config)
            config = first if first is not None and first.type == "object" else (args[1:] or [None])[0]
            url = _text(first) if _text(first) is not None else _text(_option(config, "url")[1])
            self.requests(url, self.method(config, "GET"), what)
        elif function != "create":  # an instance is made; calls on it are not followed
            self.add(Rule(Kind.FORK, "calls axios in a way not read here"), what)

    def method(self, options: tree_sitter.Node | None, default: str | None) -> str | None:
        """The HTTP method an options object gives, `default` when it gives none; None when it
        is only known at run time."""
        written, value = _option(options, "method")
        if not written:
            return default
        text = _text(value)
        return text.upper() if text is not None else None

    def web_socket(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        self.add(SOCKET, what)

    def xhr(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        self.requests(None, None, what)  # its method and URL are set by later calls, not followed

    def navigator(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        if function == "sendBeacon":  # navigator.sendBeacon(url, data): a POST
            self.requests(_text(args[0]) if args else None, "POST", what)

    def process(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        if function in _PROCESS_CHANGES:
            self.add(PROCESSES, what)
        elif function in ("binding", "_linkedBinding", "dlopen"):
            self.add(RUNS_CODE, what)

    def deno(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        first = function.partition(".")[0]
        if function in _DENO_WRITERS:
            self.writes(self.paths(args, _DENO_WRITERS[function]), "changes", what, function in _REMOVERS)
        elif function == "open":
            written = any(_option(args[1] if args and len(args) > 1 else None, key)[0]
                          for key in ("write", "append", "create", "truncate"))
            if args is None or written:
                self.writes(self.paths(args, (0,)), "writes", what)
        elif function in ("Command", "run"):  # new Deno.Command(cmd, {args}), Deno.run({cmd: [...]})
            self.runtime_runs(args, "args" if function == "Command" else "cmd", what)
        elif function == "kill":
            self.add(PROCESSES, what)
        elif first in _RUNTIME_SOCKETS:
            self.add(SOCKET, what)
        elif first not in _DENO_READS:
            self.add(Rule(Kind.FORK, f"calls Deno.{function}, whose effect is not known here"), what)

    def bun(self, function: str, args: list[tree_sitter.Node] | None, what: str) -> None:
        first = function.partition(".")[0]
        if function == "write":
            self.writes(self.paths(args, (0,)), "writes", what)
        elif function == "spawn":  # Bun.spawn(["git", "push"]) or Bun.spawn({cmd: [...]})
            self.runtime_runs(args, "cmd", what)
        elif function == "$":  # Bun.$`git status`: a tagged template of shell code
            self.runs(None, _text(args[0]) if args else None, what)
        elif first in _RUNTIME_SOCKETS:
            self.add(SOCKET, what)
        elif first not in _BUN_READS:
            self.add(Rule(Kind.FORK, f"calls Bun.{function}, whose effect is not known here"), what)

    def bun_file(self, method: tree_sitter.Node, file_args: list[tree_sitter.Node]) -> None:
        """Bun.file(path).write(...), .writer(), .delete(): they change the file."""
        member = method.child_by_field_name("property")
        name = _source(member) if member is not None else ""
        if name in ("write", "writer", "delete", "unlink"):
            self.writes(self.paths(file_args, (0,)), "changes", f"Bun.file(...).{name}(...)",
                        name in ("delete", "unlink"))

    def runtime_runs(self, args: list[tree_sitter.Node] | None, key: str, what: str) -> None:
        """A program run from a list of words: Deno.Command's program and `args`, Bun.spawn's
        or Deno.run's `cmd`."""
        args = args or []
        first = args[0] if args else None
        if first is not None and first.type == "array":
            words: list[str | None] = [_text(w) for w in first.named_children]
        elif key == "args":
            written, extra = _option(args[1] if len(args) > 1 else None, "args")
            more = [_text(w) for w in extra.named_children] if extra is not None and extra.type == "array" \
                else [None]
            words = [_text(first), *(more if written else [])]
        else:
            listed = _option(first, key)[1]
            words = [_text(w) for w in listed.named_children] if listed is not None \
                and listed.type == "array" else [None]
        self.runs(words, None, what)


_JUDGES = {"fs": _JsReading.fs, "child_process": _JsReading.child_process, "http": _JsReading.http,
           "https": _JsReading.http, "http2": _JsReading.sockets, "net": _JsReading.sockets,
           "tls": _JsReading.sockets, "dgram": _JsReading.sockets, "fetch": _JsReading.fetch,
           "axios": _JsReading.axios, "process": _JsReading.process, "Deno": _JsReading.deno,
           "Bun": _JsReading.bun, "WebSocket": _JsReading.web_socket, "XMLHttpRequest": _JsReading.xhr,
           "navigator": _JsReading.navigator}
