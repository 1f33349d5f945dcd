"""One surface for the faces' machine handles (rewind/handle.py): Sandbox, RemoteSandbox and
FleetSandbox offer every verb of MachineHandle with its parameters, or declare in DIFFERS,
on purpose, where they do not; and none offers a verb the others do not know of."""

from __future__ import annotations

import inspect

import pytest

from rewind.handle import MachineHandle
from rewind.sandbox import Sandbox
from rewind.serve.client import RemoteSandbox

VERBS = {name for name in vars(MachineHandle) if not name.startswith("_")}


def _faces() -> list[type]:
    faces: list[type] = [Sandbox, RemoteSandbox]
    try:
        from rewind.fleet import FleetSandbox
    except ImportError:  # Ray is an extra
        return faces
    return [*faces, FleetSandbox]


def _parameters(member: object) -> list[tuple[str, object, object]] | str:
    """A method's parameters without self (name, kind, default); "property" for a property or
    an attribute."""
    if isinstance(member, property) or not callable(member):
        return "property"
    return [(p.name, p.kind, p.default) for p in inspect.signature(member).parameters.values()
            if p.name != "self"]


def _member(face: type, verb: str) -> object | None:
    if verb in getattr(face, "__annotations__", {}):
        return property()  # an attribute, as a property reads
    try:
        return inspect.getattr_static(face, verb)
    except AttributeError:
        return None


@pytest.mark.parametrize("face", _faces(), ids=lambda face: face.__name__)
def test_a_face_offers_every_verb_or_says_why_not(face: type) -> None:
    differs: dict[str, str] = getattr(face, "DIFFERS", {})
    for verb in sorted(VERBS - set(differs)):
        mine = _member(face, verb)
        assert mine is not None, f"{face.__name__} lacks {verb}: add it, or say why in its DIFFERS"
        assert _parameters(mine) == _parameters(inspect.getattr_static(MachineHandle, verb)), \
            f"{face.__name__}.{verb} takes other parameters than MachineHandle.{verb}: align them, or say why"
    for verb, why in differs.items():  # each declaration is true, and says something
        assert why.strip(), f"{face.__name__}.DIFFERS[{verb!r}] gives no reason"
        mine = _member(face, verb)
        if verb in VERBS and mine is not None:
            assert _parameters(mine) != _parameters(inspect.getattr_static(MachineHandle, verb)), \
                f"{face.__name__}.DIFFERS[{verb!r}] is stale: it matches MachineHandle"


@pytest.mark.parametrize("face", _faces(), ids=lambda face: face.__name__)
def test_no_face_has_a_verb_the_surface_does_not_know(face: type) -> None:
    differs = set(getattr(face, "DIFFERS", {}))
    for name, member in vars(face).items():
        if name.startswith("_") or name.isupper() or isinstance(member, classmethod | staticmethod):
            continue  # private, constants, constructors (create, get, connect, list)
        if callable(member) or isinstance(member, property):
            assert name in VERBS or name in differs, \
                f"{face.__name__}.{name} is on no other face: add it to MachineHandle, or declare it"
