"""The public surface, pinned (as httpx pins its exports): names and the error tree."""

from __future__ import annotations

import importlib
import pkgutil

import rewind
import rewind.errors

# Changing this list changes what users may import: do it on purpose.
PUBLIC = [
    "AgentError", "AgentGone", "AlreadyExists", "Busy", "Checkpoint", "CommandFailed", "Decision",
    "ExecResult", "Files", "GuardedResult", "Home", "ImageError", "InvalidArgument", "MachineDied",
    "MachineNotRunning", "NotFound", "Outcome", "Refused", "RewindError", "Sandbox", "classify",
    "try_in_copy",
]


def test_the_exported_names_are_pinned_and_all_resolve() -> None:
    assert sorted(rewind.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(rewind, name).__name__ == name


def drawn_tree() -> dict[str, str]:
    """Each error class drawn in errors.py's docstring, mapped to the class it is drawn under."""
    parents: dict[str, str] = {}
    stack = ["RewindError"]
    for line in (rewind.errors.__doc__ or "").splitlines():
        if "── " not in line:
            continue
        depth = (line.index("── ") - 5) // 4 + 1  # "    ├── X" is one level under RewindError
        name = line.split("── ", 1)[1].split()[0].rsplit(".", 1)[-1]
        del stack[depth:]
        parents[name] = stack[-1]
        stack.append(name)
    return parents


def error_classes() -> set[type]:
    """Every RewindError subclass rewind defines (the guest's own code aside)."""
    for module in pkgutil.walk_packages(rewind.__path__, "rewind."):
        if not module.name.startswith("rewind.guest"):
            importlib.import_module(module.name)
    found, todo = set(), [rewind.errors.RewindError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("rewind.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_every_error_is_in_the_drawn_tree_under_a_class_it_derives_from() -> None:
    tree = drawn_tree()
    classes = error_classes()
    assert {cls.__name__ for cls in classes} == set(tree)
    for cls in classes:
        assert tree[cls.__name__] in {base.__name__ for base in cls.__mro__[1:]}, cls
