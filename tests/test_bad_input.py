"""Bad input: a clear error naming the problem, and nothing left half-made."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rewind import AlreadyExists, Home, ImageError, InvalidArgument, MachineNotRunning, NotFound, Sandbox
from rewind.image import recipe_id


@pytest.mark.parametrize("name", ["a/b", "..", "../x", "has space", "", "x" * 64, "-lead", ".hidden"])
def test_bad_names_are_refused_before_anything_is_made(home: Home, name: str) -> None:
    with pytest.raises(InvalidArgument, match="name"):
        Sandbox.create(name, home=home)
    assert not home.machines.exists() or not any(home.machines.iterdir())


def test_longest_name_is_accepted(home: Home) -> None:
    name = "n" * 63
    sbx = Sandbox.create(name, home=home)
    assert sbx.exec("hostname").stdout.strip() == name


def test_taken_name(home: Home) -> None:
    Sandbox.create("dup", home=home)
    with pytest.raises(AlreadyExists, match="'dup' already exists"):
        Sandbox.create("dup", home=home)
    assert Sandbox.get("dup", home=home).exec("true").ok, "the first machine was harmed"


def test_exec_on_missing_and_stopped_machines(home: Home) -> None:
    with pytest.raises(NotFound, match="no machine named 'ghost'"):
        Sandbox.get("ghost", home=home)
    sbx = Sandbox.create("halted", home=home)
    sbx.stop()
    with pytest.raises(MachineNotRunning, match="'halted' is stopped"):
        sbx.exec("true")
    with pytest.raises(MachineNotRunning):
        sbx.files.read("/etc/hostname")


@pytest.mark.parametrize("memory", [0, 64, 191])
def test_memory_below_what_the_image_needs(home: Home, memory: int) -> None:
    with pytest.raises(InvalidArgument, match="memory must be at least"):
        Sandbox.create("small", memory=memory, home=home)
    assert not (home.machines / "small").exists()


@pytest.mark.parametrize("kwargs", [{"cpus": 0}, {"cpus": 1000}, {"disk": 100}, {"labels": {"bad key": "v"}}])
def test_other_bad_settings(home: Home, kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        Sandbox.create("odd", home=home, **kwargs)
    assert not (home.machines / "odd").exists()


def test_missing_image(tmp_path: Path) -> None:
    home = Home(root=tmp_path / "home", images=tmp_path / "no-images")
    with pytest.raises(ImageError, match="not built yet"):
        Sandbox.create("x", home=home)
    assert not (home.machines / "x").exists()


@pytest.mark.parametrize("damage", ["truncate-kernel", "delete-disk", "garble-manifest"])
def test_damaged_image(tmp_path: Path, images_dir: Path, damage: str) -> None:
    src = images_dir / recipe_id()
    copy = tmp_path / "images" / recipe_id()
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("templates"))
    if damage == "truncate-kernel":
        (copy / "vmlinuz").write_bytes(b"")
    elif damage == "delete-disk":
        (copy / "rootfs.qcow2").unlink()
    else:
        (copy / "image.json").write_text("{not json")
    home = Home(root=tmp_path / "home", images=tmp_path / "images")
    with pytest.raises(ImageError, match="damaged"):
        Sandbox.create("x", home=home)
    assert not (home.machines / "x").exists()
