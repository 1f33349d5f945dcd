"""The values the guard deals in: the kinds of undo, one part's verdict (Rule), and the
whole command's Decision."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rewind.guard.walker import Call


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

    def __call__(self, call: Call) -> list[Rule]:
        return [call.locally(self)]

    def sourced(self, source: str) -> Rule:
        """This verdict, credited to `source` unless something more precise decided it."""
        return self if self.source else dataclasses.replace(self, source=source)


@dataclass(frozen=True)
class Decision:
    """The kind a command needs, and sentences saying which of its parts decided it.

    `decided_by[i]` says what decided `reasons[i]`: `table: PROGRAM [SUBCOMMAND]`, `rule: FILE
    #N` (a user's rule), `shell: ...` (a construct of the shell itself) or `unknown program`.
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
