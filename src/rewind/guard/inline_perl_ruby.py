"""Inline Perl and Ruby (`perl -e`, `perl -pi -e`, `ruby -e`) read by a small, careful scan of
their text rather than a parser: no parser for either is kept up for Python, and agents'
one-liners are short. Every word that names an action counts wherever it stands, inside a
string too (a false alarm is a fork, never a missed write), and an action is judged by what
follows it only when that is written out: a string with no interpolation, a number.

- a command given to `system`, `exec`, backticks, `qx`/`%x`, a pipe `open` or `IO.popen` is
  judged as the shell judges it;
- files changed (`unlink`, `File.delete`, `FileUtils.rm_rf`, `open(..., '>')`, `File.write`)
  are judged by where they are;
- the network clients named (`LWP`, `HTTP::Tiny`, `Net::HTTP`, `open-uri`) are external;
- code run from a string or a name (`eval "..."`, `send`, `&$name`), modules outside a known
  set, and anything else that acts are a fork; a program with none of these only reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rewind.guard.entries import PROCESSES, RUNS_CODE
from rewind.guard.inline import SOCKET, Reading, unread
from rewind.guard.verdicts import Kind, Rule

if TYPE_CHECKING:
    from rewind.guard.call import Call

# A string whose value is written out: no interpolation ($, @ in Perl; #{} in Ruby), known escapes
_STRING = re.compile(r"'((?:[^'\\]|\\.)*)'" r'|"((?:[^"\\$@#]|\\[nt"\\])*)"', re.DOTALL)
_MAX_ARGUMENTS = 1024  # characters of a call's arguments read: a longer statement's last one is unknown
_MAX_ACTIONS = 200
_NUMBER = re.compile(r"-?[0-9][0-9_]*")
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "'": "'"}
_NETWORK = Rule(Kind.EXTERNAL, "uses a network client, whose requests cannot be known here")
_TEMPORARY = Rule(Kind.FORK, "makes a temporary file outside the project")


def _value(text: str) -> str | None:
    """A written-out argument's value: a literal string's, or a number as written; else None."""
    text = text.strip()
    if _NUMBER.fullmatch(text):
        return text
    found = _STRING.fullmatch(text)
    if found is None:
        return None
    body = found.group(1) if found.group(1) is not None else found.group(2)
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), "\\" + m.group(1)), body)


def _arguments(code: str, found: re.Match[str]) -> list[str | None]:
    """The arguments of the call `found` names: within its parentheses, or else to the end of
    its statement; each a written-out value or None."""
    rest = code[found.end():found.end() + _MAX_ARGUMENTS].lstrip()
    if found.group(0).endswith("("):
        rest = "(" + rest
    closing = ")" if rest.startswith("(") else None
    body = rest[1:] if closing else rest
    pieces, depth, quote, current = [], 0, "", ""
    ended = False
    for i, ch in enumerate(body):
        escaped = i > 0 and body[i - 1] == "\\"
        if quote:
            quote = "" if ch == quote and not escaped else quote
        elif ch in "'\"`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}" and depth:
            depth -= 1
        elif depth == 0 and (ch == closing or (not closing and ch in ";\n})")):
            ended = True
            break
        elif depth == 0 and ch == ",":
            pieces.append(current)
            current = ""
            continue
        current += ch
    pieces.append(re.split(r"\s(?:or|and|if|unless|do)\s|\|\||&&", current)[0] if not closing else current)
    values = [_value(piece) for piece in pieces if piece.strip()]
    cut = not ended and len(code) - found.end() > _MAX_ARGUMENTS
    return [*values, None] if cut else values  # arguments past the cut are not known


def _strings(values: list[str | None]) -> list[str | None]:
    """The arguments that may be paths: all but numbers (modes, user ids)."""
    return [value for value in values if value is None or not _NUMBER.fullmatch(value)]


def _quoted(code: str, start: int) -> str | None:
    """The text of `qx{...}`, `%x(...)` from its opening delimiter at `start`, if it interpolates nothing."""
    opening = code[start:start + 1]
    closing = {"(": ")", "{": "}", "[": "]", "<": ">"}.get(opening, opening)
    end = code.find(closing, start + 1)
    body = code[start + 1:end] if end > start else None
    return body if body is not None and not set(body) & set("$@#\\") else None


@dataclass
class _ScriptReading(Reading):
    """What one Perl or Ruby program does, from the actions its text names."""

    def scan(self, actions: _Actions) -> None:
        found = [(act, match) for pattern, act in actions for match in pattern.finditer(self.code)]
        if len(found) > _MAX_ACTIONS:  # a one-liner names a few: this many is not read, each costing a scan
            self.add(Rule(Kind.FORK, f"names more than {_MAX_ACTIONS} actions, too many to read"), "its text")
            return
        for act, match in found:
            act(self, match)

    def changes(self, found: re.Match[str], positions: tuple[int, ...] | None = None,
                removes: bool = False) -> None:
        """A call that changes the files it is given: those at `positions`, or every argument
        that is not a number."""
        values = _arguments(self.code, found)
        paths = _strings(values) if positions is None else [values[i] if i < len(values) else None
                                                            for i in positions]
        self.writes(paths, "changes", f"{found.group(0).strip('( ')}(...)", removes)

    def command(self, found: re.Match[str], values: list[str | None]) -> None:
        """system("git push"), system("git", "push"): a command given whole, or its words."""
        what = f"{found.group(0).strip('( ')}(...)"
        self.runs(values if len(values) > 1 else None, values[0] if len(values) == 1 else None, what)

    def opens(self, found: re.Match[str], mode: str | None, path: str | None) -> None:
        """A file opened in `mode` (Perl's < > >> +<, Ruby's r w a r+): one that writes, or a
        mode only known at run time, changes it."""
        if mode is None or set(mode) & set("wa+>"):
            self.writes([path], "writes", f"{found.group(0).strip('( ')}(...)")


_Actions = list[tuple[re.Pattern[str], Callable[[_ScriptReading, re.Match[str]], None]]]

# -- Perl ---------------------------------------------------------------------------------------

_PERL_MODULES = frozenset({
    "strict", "warnings", "utf8", "feature", "constant", "integer", "bigint", "bignum", "vars", "lib",
    "open", "English", "List::Util", "Scalar::Util", "Data::Dumper", "JSON::PP", "Time::Local",
    "Time::HiRes", "File::Basename", "File::Spec", "Getopt::Long", "Digest::MD5", "Digest::SHA",
    "MIME::Base64", "Encode", "Text::Wrap", "Cwd", "Term::ANSIColor", "Storable"})
_PERL_NETWORK = r"\b(?:LWP|HTTP::Tiny|HTTP::Request|Net::\w+|IO::Socket|Mojo::UserAgent|WWW::Mechanize)\b"
# Code run from a string, a file or a name, and the system's own calls
_PERL_CODE = re.compile(r"""\beval\s*[^\s{]|\bdo\s*["'$]|\brequire\s*["'$]|&\s*[{$]|->\s*\$|->\s*can\b|"""
                        r"""\*\s*\{|"""
                        r"""\bCORE::|\b__PACKAGE__\b|\bgoto\b|\bsyscall\b|\bsysopen\b|\bdbmopen\b|\btie\b|"""
                        r"""\bchroot\b|\(\?\??\{|[/}|!#][msixpodualngcer]*e[msixpodualngcer]*e[msixpodualngcr]*\b""")


def _perl_open(reading: _ScriptReading, found: re.Match[str]) -> None:
    """open(FH, MODE, PATH), open(FH, "MODE PATH"): a pipe (-|, |-, "cmd |") runs a command."""
    values = _arguments(reading.code, found)
    if len(values) >= 3 and values[1] in ("-|", "|-"):
        listed = len(values) > 3  # open(FH, "-|", "git", "log"): the command's words
        reading.runs(values[2:] if listed else None, None if listed else values[2], "open(...)")
    elif len(values) >= 3:
        reading.opens(found, values[1], values[2])
    elif len(values) == 2 and values[1] is not None and "|" in (values[1][:1], values[1][-1:]):
        reading.runs(None, values[1].strip("| "), "open(...)")
    elif len(values) == 2 and values[1] is not None:  # the mode is the path's start; none reads
        mode = re.match(r"\s*[+<>]*", values[1]).group(0)  # type: ignore[union-attr]
        reading.opens(found, mode.strip(), values[1][len(mode):].strip())
    else:
        reading.opens(found, None, None)


def _perl_use(reading: _ScriptReading, found: re.Match[str]) -> None:
    module = found.group(1)
    if module not in _PERL_MODULES and not re.fullmatch(_PERL_NETWORK, module):
        reading.add(Rule(Kind.FORK, f"loads {module}, whose effect is not known here"), f"use {module}")


_PERL: _Actions = [
    (re.compile(r"\b(?:system|exec)\b\s*\(?"), lambda r, m: r.command(m, _arguments(r.code, m))),
    (re.compile(r"`([^`]*)`"), lambda r, m: r.runs(None, _quoted(r.code, m.start()), "`...`")),
    (re.compile(r"\bqx\s*(?=[^\w\s])"), lambda r, m: r.runs(None, _quoted(r.code, m.end()), "qx(...)")),
    (re.compile(r"\bopen\b\s*\(?"), _perl_open),
    (re.compile(r"\b(?:unlink|rmdir)\b\s*\(?"), lambda r, m: r.changes(m, removes=True)),
    (re.compile(r"\b(?:mkdir|rename|chmod|chown|utime|link|symlink|truncate)\b\s*\(?"),
     lambda r, m: r.changes(m)),
    (re.compile(r"\b(?:fork|kill)\b"), lambda r, m: r.add(PROCESSES, m.group(0))),
    (re.compile(r"\b(?:socket|connect)\b"), lambda r, m: r.add(SOCKET, m.group(0))),
    (re.compile(_PERL_NETWORK), lambda r, m: r.add(_NETWORK, m.group(0))),
    (re.compile(r"(?:(?:^|[;{])\s*(?:use|no)|\brequire)\s+([A-Za-z_][\w:]*)", re.MULTILINE), _perl_use),
    (_PERL_CODE, lambda r, m: r.add(RUNS_CODE, m.group(0).strip())),
]


# -- Ruby ---------------------------------------------------------------------------------------

_RUBY_LIBRARIES = frozenset({
    "json", "set", "time", "date", "pp", "securerandom", "digest", "base64", "yaml", "psych", "csv",
    "optparse", "shellwords", "English", "bigdecimal", "pathname", "fileutils", "open3", "uri",
    "stringio", "strscan", "ostruct", "benchmark", "zlib", "rbconfig", "etc", "io/console", "prettyprint",
    "tmpdir", "tempfile", "net/http", "open-uri", "socket"})
_RUBY_NETWORK = r"\b(?:Net::\w+|open-uri|URI\.open|TCPSocket|UDPSocket|Socket|Faraday|HTTParty|RestClient)\b"
_RUBY_CODE = re.compile(r"\b(?:eval|instance_eval|class_eval|module_eval|instance_exec|class_exec|"
                        r"module_exec|public_send|__send__|define_method|const_get|const_set|binding|require_relative|"
                        r"autoload|ObjectSpace|Fiddle|syscall|instance_variable_set|reopen|sysopen|for_fd|"
                        r"chroot)\b|\bIO\.new\b|\.(?:send|method)\b|\b(?:send|method|load)\s*[(:'\"]")
# File.X and Dir.X that change files -> their path arguments (None: every one that is not a number)
_RUBY_FILE_CHANGES: dict[str, tuple[int, ...] | None] = {
    "File.write": (0,), "File.binwrite": (0,), "IO.write": (0,), "IO.binwrite": (0,), "File.rename": (0, 1),
    "File.symlink": (1,), "File.link": (1,), "File.truncate": (0,), "File.mkfifo": (0,), "File.delete": None,
    "File.unlink": None, "File.chmod": None, "File.lchmod": None, "File.chown": None, "File.lchown": None,
    "File.utime": None, "Dir.mkdir": (0,), "Dir.rmdir": (0,), "Dir.delete": (0,), "Dir.unlink": (0,)}
_FILEUTILS_READS = frozenset({"pwd", "compare_file", "cmp", "identical?", "uptodate?", "compare_stream"})
_STANDARD_OUTPUT = ("$stdout", "$stderr", "STDOUT", "STDERR")


def _ruby_file(reading: _ScriptReading, found: re.Match[str]) -> None:
    name = found.group(0).rstrip("( ")
    if name in ("File.open", "File.new", "IO.open"):
        _ruby_opens(reading, found)
    elif name in _RUBY_FILE_CHANGES:
        reading.changes(found, _RUBY_FILE_CHANGES[name], removes=name.endswith(("delete", "unlink", "rmdir")))


def _ruby_fileutils(reading: _ScriptReading, found: re.Match[str]) -> None:
    function = found.group(1)
    if function not in _FILEUTILS_READS:
        reading.changes(found, removes=function.startswith(("rm", "remove")))


def _ruby_opens(reading: _ScriptReading, found: re.Match[str]) -> None:
    """open(PATH, MODE="r"), File.open, File.new."""
    values = _arguments(reading.code, found)
    reading.opens(found, values[1] if len(values) > 1 else "r", values[0] if values else None)


def _ruby_open(reading: _ScriptReading, found: re.Match[str]) -> None:
    """Kernel#open: a path beginning with | runs a command; a mode that writes changes the file.
    File.open and URI.open are judged on their own; open on another value (a Pathname) has a
    path not followed here."""
    before = reading.code[:found.start()]
    if re.search(r"\b(?:File|IO|URI)\.\Z", before):
        return
    values = _arguments(reading.code, found)
    if before.endswith(".") and not before.endswith("Kernel."):
        if any(value is None or set(value) & set("wa+") for value in values):
            reading.writes([None], "writes", "open(...)")
    elif values and values[0] is not None and values[0].startswith("|"):
        reading.runs(None, values[0][1:], "open(...)")
    else:
        _ruby_opens(reading, found)


def _ruby_value_writes(reading: _ScriptReading, found: re.Match[str]) -> None:
    """x.write(...) on a value other than standard output: a file whose path is not followed."""
    if not reading.code[:found.start()].endswith(_STANDARD_OUTPUT) and \
            not re.search(r"\b(?:File|IO)\Z", reading.code[:found.start()]):
        reading.writes([None], "writes", f"{found.group(0)}(...)")


def _ruby_require(reading: _ScriptReading, found: re.Match[str]) -> None:
    library = found.group(1)
    if library is None:
        reading.add(RUNS_CODE, "require(...)")
    elif library not in _RUBY_LIBRARIES:
        reading.add(Rule(Kind.FORK, f"loads {library}, whose effect is not known here"),
                    f"require {library!r}")


_RUBY: _Actions = [
    (re.compile(r"\b(?:system|exec|spawn|IO\.popen|Open3\.\w+)\b\s*\(?"),
     lambda r, m: r.command(m, _arguments(r.code, m))),
    (re.compile(r"`([^`]*)`"), lambda r, m: r.runs(None, _quoted(r.code, m.start()), "`...`")),
    (re.compile(r"%x(?=[^\w\s])"), lambda r, m: r.runs(None, _quoted(r.code, m.end()), "%x(...)")),
    (re.compile(r"\b(?:File|IO|Dir)\.\w+\b\s*\(?"), _ruby_file),
    (re.compile(r"\bFileUtils\.(\w+[?!]?)\s*\(?"), _ruby_fileutils),
    (re.compile(r"\bopen\b\s*\(?"), _ruby_open),
    (re.compile(r"\.(?:write|binwrite|syswrite|rmtree|mkpath|make_symlink|make_link|truncate)\b"),
     _ruby_value_writes),
    (re.compile(r"\b(?:Tempfile|mktmpdir)\b"), lambda r, m: r.add(_TEMPORARY, m.group(0))),
    (re.compile(r"\bfork\b|\bProcess\.(?:kill|daemon|setsid|setrlimit|setpgid|setpriority|uid=|gid=)|"
                r"\bkill\b"), lambda r, m: r.add(PROCESSES, m.group(0))),
    (re.compile(_RUBY_NETWORK), lambda r, m: r.add(_NETWORK, m.group(0))),
    (re.compile(r"\brequire\b\s*\(?\s*(?:['\"]([\w/-]+)['\"])?"), _ruby_require),
    (_RUBY_CODE, lambda r, m: r.add(RUNS_CODE, m.group(0))),
]

_LANGUAGES = {"perl": ("inline Perl", _PERL), "ruby": ("inline Ruby", _RUBY)}


def inline_script(call: Call, language: str, code: str | None, modules: list[str | None]) -> list[Rule]:
    """The verdicts on `perl -e code` or `ruby -e code` (`language`), with the modules its
    flags load first (perl -MLWP::Simple, ruby -rjson)."""
    if code is None:
        return [unread(language, code)]
    loading = "\n".join(f"use {m};" if language == "perl" else f"require '{m}'" for m in modules if m)
    named, actions = _LANGUAGES[language]
    reading = _ScriptReading(call, language, f"{loading}\n{code}" if loading else code)
    if None in modules:
        reading.add(Rule(Kind.FORK, "loads a module only known at run time"), "a module flag")
    reading.scan(actions)
    return reading.verdicts(named)
