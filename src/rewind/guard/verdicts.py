"""The values the guard deals in: the kinds of undo, one part's verdict (Rule), and the
whole command's Decision."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Protocol


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


class Judged(Protocol):
    """The one thing a Rule asks of the program run it judges (call.Call)."""

    def locally(self, rule: Rule) -> Rule: ...


@dataclass(frozen=True)
class Rule:
    """A verdict: the kind, and what the program does, as the end of a sentence.

    `source` says what decided it (a table entry, a user's rule, a shell construct) when that
    is not the program's own table entry; `unknown` names the program when the verdict is a
    fork only because no table or rule knows it.
    """

    kind: Kind
    why: str
    source: str | None = None
    unknown: str | None = None

    def __call__(self, call: Judged) -> list[Rule]:
        return [call.locally(self)]

    def sourced(self, source: str) -> Rule:
        """This verdict, credited to `source` unless something more precise decided it."""
        return self if self.source else dataclasses.replace(self, source=source)


@dataclass(frozen=True)
class Decision:
    """The kind a command needs, and sentences saying which of its parts decided it.

    `decided_by[i]` says what decided `reasons[i]`: `table: PROGRAM [SUBCOMMAND]`, `rule:
    FILE:LINE #N` (a user's rule), `inline: LANGUAGE: CALL(...)` (a call of an inline program:
    node -e, python -c), `environment: NAME` (a variable that aimed a client at another machine),
    `shell: ...` (a construct of the shell itself) or `unknown program`; a command an inline
    program runs ends in `(via inline: LANGUAGE: CALL(...))`. `explained` says each in words.
    `unknown_programs` is not empty only when the verdict is a fork for no other reason than
    that these programs are in no table or rule: what they do could be watched rather than
    guessed.
    """

    kind: Kind
    reasons: tuple[str, ...]
    decided_by: tuple[str, ...] = ()
    unknown_programs: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"kind": self.kind.value, "reasons": list(self.reasons), "decided_by": list(self.decided_by),
                "unknown_programs": list(self.unknown_programs)}


# What an inline program's source names besides a call (inline.Reading)
_INLINE_WHOLE = {"reads only": "which only reads", "syntax error": "which could not be parsed",
                 "code": "only known at run time"}


def explained(source: str) -> str:
    """A `decided_by` source in words, for `rewind classify --explain`."""
    source, via, ran_by = source.partition(" (via ")
    kind, _, detail = source.partition(": ")
    if kind == "table":
        said = f"the program table's entry for `{detail}`"
    elif kind == "rule":
        said = f"the user's rule at {detail}"
    elif kind == "inline":
        language, _, call = detail.partition(": ")
        whole = _INLINE_WHOLE.get(call)
        said = f"the inline {language} program, {whole}" if whole else \
            f"the inline {language} program's call {call}"
    elif kind == "environment":
        said = f"the variable {detail}, which aims the client at another machine"
    elif kind == "shell":
        said = f"the shell itself ({detail})" if detail else "the shell itself"
    else:
        said = "no table or rule: the program is unknown" if source == "unknown program" else source
    return f"{said}, run by {explained(ran_by.removesuffix(')'))}" if via else said
