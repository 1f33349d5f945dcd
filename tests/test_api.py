"""The public surface, pinned (as httpx pins its exports): names and the error tree."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import rewind
import rewind.errors
from rewind.engine.engine import Engine
from rewind.engine.process.qmp import Monitor, MonitorError
from rewind.home import Home

# Changing this list changes what users may import: do it on purpose.
PUBLIC = [
    "AgentError", "AgentGone", "AlreadyExists", "Busy", "Checkpoint", "CommandFailed", "Decision",
    "ExecResult", "Files", "GuardedResult", "Home", "ImageError", "InvalidArgument", "MachineDied",
    "MachineNotRunning", "NotFound", "Outcome", "PortForward", "Refused", "RewindError", "Sandbox",
    "TreeCopy", "classify", "try_in_copy",
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


def test_errors_raised_from_another_keep_it_as_their_cause() -> None:
    """`raise X(...) from None` would hide what went wrong underneath (as qemu.qmp keeps it)."""
    hidden = []
    for path in Path(rewind.__file__).parent.rglob("*.py"):
        if "guest" in path.relative_to(Path(rewind.__file__).parent).parts:
            continue  # the guest's agent answers over the wire; its causes do not cross it
        for node in ast.walk(ast.parse(path.read_text())):
            cause = getattr(node, "cause", None)
            if isinstance(node, ast.Raise) and isinstance(cause, ast.Constant) and cause.value is None:
                hidden.append(f"{path.name}:{node.lineno}")
    assert hidden == []


def test_a_damaged_record_and_an_absent_monitor_keep_their_causes(tmp_path: Path) -> None:
    home = Home(root=tmp_path / "home", images=tmp_path / "images")
    (home.machines / "m").mkdir(parents=True)
    (home.machines / "m" / "machine.json").write_text("{not json")
    with pytest.raises(rewind.errors.RewindError, match="damaged record") as caught:
        Engine(home).get("m")
    assert isinstance(caught.value.__cause__, ValueError)
    with pytest.raises(MonitorError, match="cannot reach") as absent, Monitor(tmp_path / "x", timeout=0.1):
        pass
    assert isinstance(absent.value.__cause__, OSError)


def test_the_http_client_loads_no_engine_module() -> None:
    """A program that only talks to a daemon needs none of the engine: the results it gets
    back live in rewind.results, the ground floor."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, rewind.serve.client; "
                               "print(' '.join(m for m in sys.modules if m.startswith('rewind.engine')))"],
        capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []
