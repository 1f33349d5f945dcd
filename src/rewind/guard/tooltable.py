"""The table of hosted services' command-line tools (tools.toml), read once into families of
the program table (programs.FAMILIES).

The tools there act on a service outside the machine (payments, messaging, hosted databases,
registries, clouds...): most of their verbs change that service, so a row names only the verbs
that read or change this machine, and the reference page that says so. The format is in
docs/guard.md ("The table of hosted services' tools").
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from rewind.errors import InvalidArgument
from rewind.guard.entries import (
    FOLDER,
    PACKAGES,
    READS,
    RUNS_CODE,
    SETTINGS,
    Entry,
    Family,
    Given,
    Resources,
    Subcommands,
    Topics,
    Wrapper,
    word_set,
)
from rewind.guard.verdicts import Kind, Rule

if TYPE_CHECKING:
    from rewind.guard.call import Call

DATA = "tools.toml"
_LOCAL = Rule(Kind.FORK, "changes this machine outside the project")


@dataclass(frozen=True)
class _RunsCommand:
    """VERB [FLAGS] [--] COMMAND... (infisical run -- npm start): the command decides, found
    after `--` when there is one (flags' values are not known here), else after the flags."""

    def __call__(self, call: Call) -> list[Rule]:
        texts = [word.text for word in call.args]
        command = call.shifted(call.args[texts.index("--") + 1:]) if "--" in texts else call
        return _AFTER_FLAGS(command)


_AFTER_FLAGS = Wrapper(bare=RUNS_CODE)


# The verb lists a program or group may have, and their verdict (None: the program's own, external)
_LISTS: dict[str, Entry | None] = {"reads": READS, "settings": SETTINGS, "folder": FOLDER, "runs": RUNS_CODE,
                                   "local": _LOCAL, "packages": PACKAGES, "wraps": _RunsCommand(),
                                   "remote": None}
_GROUP_KEYS = frozenset({*_LISTS, "why", "default", "bare", "actions", "depth", "groups"})
_PROGRAM_KEYS = _GROUP_KEYS | {"source", "names", "style", "remote_with", "reads_with"}
_FAMILY_KEYS = frozenset({"why", "actions"})
_ACTIONS = "list ls get show describe info view status inspect logs"
_WHY = "changes a remote service"


@dataclass(frozen=True)
class _Inherited:
    """What a program or group takes from the family or program above it unless it says."""

    why: str
    actions: frozenset[str]
    remote_why: str  # what an external verb does: `why` unless that says what a local default does


def load(text: str | None = None) -> dict[str, Family]:
    """The families of tools.toml (or of `text`), by name; a malformed row is an
    InvalidArgument naming it."""
    text = files("rewind.guard").joinpath(DATA).read_text() if text is None else text
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgument(f"{DATA}: not valid TOML: {e}") from e
    families = {name: _family(name, table) for name, table in data.items()}
    _refuse_twice(families)
    return families


def _refuse_twice(families: dict[str, Family]) -> None:
    seen: set[str] = set()
    for family in families.values():
        if twice := seen & family.programs.keys():
            raise InvalidArgument(f"{DATA}: {', '.join(sorted(twice))}: defined twice")
        seen |= family.programs.keys()


def _family(name: str, table: Any) -> Family:
    if not isinstance(table, dict):
        raise InvalidArgument(f"{DATA}: {name}: a family must be a table of programs")
    fields = {key: value for key, value in table.items() if not isinstance(value, dict)}
    _check_keys(fields, _FAMILY_KEYS, name)
    why = _text(fields, "why", name) or _WHY
    inherited = _Inherited(why, word_set(_text(fields, "actions", name) or _ACTIONS), why)
    programs: dict[str, Entry] = {}
    sources: list[str] = []
    for program, row in table.items():
        if isinstance(row, dict):
            names, entry, source = _program(program, row, inherited)
            programs.update(dict.fromkeys(names, entry))
            sources.append(source)
    return Family(programs, tuple(sources))


def _program(name: str, row: dict, inherited: _Inherited) -> tuple[list[str], Entry, str]:
    _check_keys(row, _PROGRAM_KEYS, name)
    source = row.get("source")
    if not (isinstance(source, str) and source.startswith("https://")):
        raise InvalidArgument(f"{DATA}: {name}: source must be the https address of its command reference")
    style = row.get("style", "verbs")
    if style not in ("verbs", "topics"):
        raise InvalidArgument(f"{DATA}: {name}: style must be verbs or topics, not {style!r}")
    names = [name, *_text(row, "names", name).split()]
    entry = _commands(row, inherited, name, topics=style == "topics")
    if remote_with := _text(row, "remote_with", name):  # octodns-sync --doit
        remote = Rule(Kind.EXTERNAL, _own(row, inherited, name).remote_why)
        entry = Given(word_set(remote_with), remote, otherwise=entry)
    if reads_with := _text(row, "reads_with", name):  # certbot renew --dry-run
        entry = Given(word_set(reads_with), READS, otherwise=entry)
    return names, entry, source


def _commands(row: dict, inherited: _Inherited, where: str, topics: bool = False,
              group: bool = False) -> Entry:
    """The entry of a program or of one of its groups (supabase db): its own verbs, then
    RESOURCE ACTION commands (TOPIC:ACTION with style = "topics") read by their action; in a
    group, the group may be the resource (velero backup get)."""
    mine = _own(row, inherited, where)
    # an action ending in * names a prefix (Describe*: tccli cvm DescribeInstances)
    actions = frozenset(action for action in mine.actions if not action.endswith("*"))
    prefixes = tuple(action[:-1] for action in mine.actions if action.endswith("*"))
    default = _verdict(row.get("default", "external"), mine.why, f"{where}: default")
    verbs = _verbs(row, Rule(Kind.EXTERNAL, mine.remote_why), where)
    groups = row.get("groups", {})
    if not isinstance(groups, dict) or not all(isinstance(table, dict) for table in groups.values()):
        raise InvalidArgument(f"{DATA}: {where}: groups must be tables, one per verb")
    for verb, table in groups.items():
        _check_keys(table, _GROUP_KEYS, f"{where} {verb}")
        verbs[verb] = _commands(table, mine, f"{where} {verb}", group=True)
    if topics:
        return Topics(verbs, frozenset(), actions, default)
    depth = row.get("depth", 1)
    if not (isinstance(depth, int) and depth >= 1):
        raise InvalidArgument(f"{DATA}: {where}: depth must be a whole number from 1")
    bare = _verdict(row["bare"], mine.why, f"{where}: bare") if "bare" in row else None
    resources = Resources(actions, default, depth, prefixes, named=0 if group else 1)
    return Subcommands(verbs, default=resources, bare=bare)


def _own(row: dict, inherited: _Inherited, where: str) -> _Inherited:
    why = _text(row, "why", where) or inherited.why
    local = row.get("default") == "fork"  # then `why` says what the default does here, not outside
    actions = word_set(_text(row, "actions", where)) if "actions" in row else inherited.actions
    return _Inherited(why, actions, inherited.remote_why if local else why)


def _verbs(row: dict, remote: Rule, where: str) -> dict[str, Entry]:
    """The verbs a row lists, each with its list's verdict; a verb in two lists is an error."""
    verbs: dict[str, Entry] = {}
    for name, rule in _LISTS.items():
        for verb in _text(row, name, where).split():
            if verb in verbs:
                raise InvalidArgument(f"{DATA}: {where}: {verb} is in two lists")
            verbs[verb] = rule or remote
    return verbs


def _verdict(kind: Any, why: str, where: str) -> Rule:
    """The verdict a `default` or `bare` kind names: none only reads, git writes in the current
    folder, fork and external do what the row's `why` says."""
    if kind not in tuple(Kind):
        raise InvalidArgument(f"{DATA}: {where} must be one of {', '.join(Kind)}, not {kind!r}")
    return {Kind.NONE: READS, Kind.GIT: FOLDER}.get(Kind(kind), Rule(Kind(kind), why))


def _text(row: dict, key: str, where: str) -> str:
    value = row.get(key, "")
    if not isinstance(value, str):
        raise InvalidArgument(f"{DATA}: {where}: {key} must be a string (verbs: separated by blanks)")
    return value


def _check_keys(row: dict, allowed: frozenset[str], where: str) -> None:
    if unknown := sorted(row.keys() - allowed):
        raise InvalidArgument(f"{DATA}: {where}: unknown field {unknown[0]!r}")
