"""Shell words after expansion, the flags programs read from them, and hosts they name."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MAX_ALTERNATIVES = 32  # values one word may stand for (brace expansion, loop variables) before it is unknown


@dataclass(frozen=True)
class Word:
    """A shell word after expansion: the values it can take, or None when only known at run time."""

    values: tuple[str, ...] | None

    @property
    def text(self) -> str | None:
        """The word's value when it has exactly one."""
        return self.values[0] if self.values is not None and len(self.values) == 1 else None


def literal(text: str) -> Word:
    return Word((text,))


UNKNOWN = Word(None)
HERE = literal(".")


def unescape(word: str) -> str:
    """Remove the backslashes of an unquoted word: `\\;` is `;`."""
    return re.sub(r"\\(.)", r"\1", word.replace("\\\n", ""), flags=re.DOTALL) if "\\" in word else word


def unescape_quoted(content: str) -> str:
    """Inside double quotes a backslash escapes only $ ` " \\ and a newline."""
    return re.sub(r'\\([$`"\\])', r"\1", content.replace("\\\n", ""))


def braces(path: str) -> list[str] | None:
    """Bash brace expansion of comma lists (`src/{a,b}` is src/a and src/b), so each path is
    judged; None when it stands for more than MAX_ALTERNATIVES."""
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
        if len(done) + len(pending) > MAX_ALTERNATIVES:
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
                    parsed.flags.append((self.aliases.get(name, name), literal(value)))
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
                            parsed.flags.append((flag, literal(rest)))
                        elif i < len(words):
                            parsed.flags.append((flag, words[i]))
                            i += 1
                        else:
                            parsed.flags.append((flag, None))
                        break
                    if ch in self.optional:
                        parsed.flags.append((flag, literal(rest) if rest else None))
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


NO_OPTIONS = Options()


def file_words(words: Iterable[Word]) -> list[Word]:
    """The words that name files: `-` stands for standard input or output."""
    return [word for word in words if word.text != "-"]


_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", ""})


def is_local(host: str) -> bool:
    return host in _LOCAL_HOSTS or host.startswith(("127.", "/")) or host.endswith(".localhost")


def remote_url(word: Word) -> bool:
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
        if not is_local(host):
            return True
    return False


def remote_path(text: str | None) -> bool:
    """scp and rsync name a remote file as [user@]host:path (a colon before any slash)."""
    if text is None:
        return True
    return "://" in text or (":" in text and "/" not in text.partition(":")[0] and not text.startswith(":"))


def hosts(args: Sequence[Word], short: str) -> list[Word]:
    """The hosts a client is pointed at: the values of `-h HOST`, `-hHOST`, `--host=HOST` (with
    `short` as the short flag) and URLs, also as a flag's value (`--dbname=postgres://db/app`)."""
    hosts = []
    for i, word in enumerate(args):
        text = word.text or ""
        if text in (short, "--host"):
            hosts.append(args[i + 1] if i + 1 < len(args) else UNKNOWN)
        elif text.startswith("--host="):
            hosts.append(literal(text.partition("=")[2]))
        elif text.startswith(short) and len(text) > 2:
            hosts.append(literal(text[2:]))
        elif "://" in text:
            scheme = text.partition("://")[0]
            hosts.append(literal(text[scheme.index("=") + 1:] if "=" in scheme else text))
    return hosts


def folder_of(word: Word, here: str | None) -> str | None:
    """The folder `word` names, seen from `here`; None when only known at run time (~ and `cd -`
    included: where they lead is not known here)."""
    text = word.text
    if text is None or text.startswith("~") or text == "-":
        return None
    return absolute(text, here)


def absolute(path: str, here: str | None) -> str | None:
    """`path` seen from `here`, normalised; relative to the project when the project is '.'."""
    if not path.startswith("/"):
        if here is None:
            return None
        path = posixpath.join(here, path)
    path = posixpath.normpath(path)
    return path[1:] if path.startswith("//") else path
