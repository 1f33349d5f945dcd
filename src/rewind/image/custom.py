"""Images of the user's own: an OCI or Docker image (an archive, a layout folder, or built
from a Dockerfile) made into a rewind image.

The image's layers are applied into a folder (oci.py), which becomes the root disk. The
kernel, initramfs and runtime disk are the default image's (an OCI image has no kernel), so
the guest's PID 1 (busybox init), its sysinit and the agent all come from the runtime disk:
an image without Python, init, a shell or even glibc runs. The image's `Env`, `WorkingDir`
and `User` become the defaults of every command (see engine.agent.ExecDefaults).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rewind.errors import AlreadyExists, ImageError, InvalidArgument
from rewind.image import oci
from rewind.image.build import (
    DISK_FILE,
    INITRD_FILE,
    KERNEL_FILE,
    MANIFEST_FILE,
    PROBE_INITRD_FILE,
    RECIPE,
    RUNTIME_FILE,
    RUNTIME_MOUNT,
    Image,
    build_image,
    check_image_name,
    run_tool,
)
from rewind.image.dockerfile import Builder

Report = Callable[[str], None]
# The root disk's size, as the guest sees it: the default image's, or twice what the image
# holds if that is more. The file is sparse, so free room costs nothing on the host.
MIN_DISK_MIB = RECIPE["disk_size_mib"]


def build_from_image(images_dir: Path, name: str, source: str, report: Report = lambda _: None) -> Image:
    """Make image `name` from an OCI or Docker image (`oci-archive:PATH`, `docker-archive:PATH`,
    `oci:DIR`). Nothing is left behind on failure."""
    _check_new_name(images_dir, name)
    kind, path = oci.parse_source(source)
    if not path.exists():
        raise InvalidArgument(f"{source}: no such {'folder' if kind == 'oci' else 'file'}")
    with _staging(images_dir, name) as staging:
        root = staging / "work" / "rootfs"
        root.mkdir(parents=True)
        config = oci.unpack(source, root, report)
        defaults = {"env": config.env, "cwd": config.working_dir, "user": config.user}
        return _finish(images_dir, name, staging, root, defaults,
                       {"kind": kind, "path": str(path.resolve()), "digest": config.digest}, report)


def build_from_dockerfile(images_dir: Path, builder: Builder, name: str, dockerfile: Path, context: Path,
                          report: Report = lambda _: None, build_args: dict[str, str] | None = None) -> Image:
    """Make image `name` from a Dockerfile, built by `builder` (Buildah, see dockerfile.py).
    FROM may name an image the builder holds, or an image of rewind's made --from an archive
    that is still there (it is handed to the builder first)."""
    _check_new_name(images_dir, name)
    for base in from_names(dockerfile):
        _offer_base(images_dir, builder, base)
    with _staging(images_dir, name) as staging:
        archive = staging / "work" / "image.tar"
        try:
            builder.build(dockerfile, context, archive, report, build_args)
        except ImageError as e:  # the log would go with the staging folder: keep it
            log = archive.with_name(f"{archive.name}.log")
            kept = images_dir / ".logs" / f"{name}.log"
            if not log.is_file():
                raise
            kept.parent.mkdir(exist_ok=True)
            os.replace(log, kept)
            raise ImageError(str(e).replace(str(log), str(kept))) from e
        root = staging / "work" / "rootfs"
        root.mkdir()
        config = oci.unpack(f"oci-archive:{archive}", root, report)
        archive.unlink()
        defaults = {"env": config.env, "cwd": config.working_dir, "user": config.user}
        source = {"kind": "dockerfile", "path": str(dockerfile.resolve()), "context": str(context.resolve()),
                  "digest": config.digest}
        return _finish(images_dir, name, staging, root, defaults, source, report)


def from_names(dockerfile: Path) -> list[str]:
    """The images a Dockerfile's FROM lines name (not `scratch`, nor its own stages)."""
    try:
        lines = dockerfile.read_text().splitlines()
    except OSError as e:
        raise InvalidArgument(f"cannot read the Dockerfile {dockerfile}: {e.strerror}") from e
    names, stages = [], set()
    for line in lines:
        words = [w for w in line.split() if not w.startswith("--")]
        if len(words) >= 2 and words[0].upper() == "FROM":
            if words[1] != "scratch" and words[1] not in stages:
                names.append(words[1])
            if len(words) >= 4 and words[2].upper() == "AS":
                stages.add(words[3])
    return names


def _offer_base(images_dir: Path, builder: Builder, base: str) -> None:
    path = images_dir / base
    if not base.islower() or not (path / MANIFEST_FILE).is_file():
        return
    source = Image.load(path).source
    if source.get("kind") in ("oci-archive", "docker-archive", "oci") and Path(source["path"]).exists():
        builder.import_image(f"{source['kind']}:{source['path']}", base)


class _staging:
    """A staging folder beside the images, renamed into place by _finish or removed."""

    def __init__(self, images_dir: Path, name: str) -> None:
        _check_new_name(images_dir, name)
        images_dir.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=images_dir))

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _check_new_name(images_dir: Path, name: str) -> None:
    check_image_name(name)
    if (images_dir / name).exists():
        raise AlreadyExists(f"an image named {name!r} already exists (rewind image rm {name})")


def _finish(images_dir: Path, name: str, staging: Path, root: Path, defaults: dict, source: dict,
            report: Report) -> Image:
    base = build_image(images_dir, report=report)
    report("preparing the root for rewind")
    _prepare_root(root)
    report("making the root disk")
    disk_mib = max(MIN_DISK_MIB, 2 * _tree_mib(root) + 256)
    raw = staging / "work" / "rootfs.raw"
    run_tool(["mkfs.ext4", "-q", "-F", "-L", "rewind-root", "-E", "root_owner=0:0", "-d", str(root),
              str(raw), f"{disk_mib}M"], "mkfs.ext4")
    run_tool(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(staging / DISK_FILE)],
             "qemu-img convert")
    shutil.rmtree(staging / "work")
    for shared in (KERNEL_FILE, INITRD_FILE, PROBE_INITRD_FILE, RUNTIME_FILE):
        _link_or_copy(base.path / shared, staging / shared)
    (staging / MANIFEST_FILE).write_text(json.dumps(
        {"id": name, "kernel_version": base.kernel_version, "created": time.time(), "disk_size_mib": disk_mib,
         "exec": defaults, "source": source, "base": base.id}, indent=2))
    final = images_dir / name
    try:
        os.rename(staging, final)
    except OSError as e:
        raise AlreadyExists(f"an image named {name!r} was made meanwhile") from e
    return Image.load(final)


def _prepare_root(root: Path) -> None:
    """What rewind's guest needs in any root: a place to mount the runtime disk, an
    /etc/inittab for init's to be bound over, and DNS through the machine's filter."""
    for folder in (RUNTIME_MOUNT, "etc", "tmp", "root", "proc", "sys", "dev", "run"):
        _inside(root, folder).mkdir(parents=True, exist_ok=True)
    for rel, text in (("etc/resolv.conf", "nameserver 10.0.2.3\n"), ("etc/hostname", "rewind\n")):
        target = _inside(root, rel)
        if target.is_symlink() or target.exists():
            target.unlink()  # a link into /run (systemd-resolved) would dangle
        target.write_text(text)
    inittab = _inside(root, "etc/inittab")
    if not inittab.exists() and not inittab.is_symlink():
        inittab.touch()
    _inside(root, "tmp").chmod(0o1777)


def _inside(root: Path, rel: str) -> Path:
    """`root/rel`, refusing a path whose folders leave `root` through a symlink the image
    holds (the last part may be a link: it is replaced, not followed)."""
    path = root / rel
    if not path.parent.resolve().is_relative_to(root.resolve()):
        raise ImageError(f"the image's /{rel} leads outside its root (through a symbolic link)")
    return path


def _tree_mib(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for f in files:
            total += os.lstat(os.path.join(folder, f)).st_size
    return total >> 20


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy(src, dest)


def remove_image(images_dir: Path, name: str, users: list[str]) -> None:
    """Remove image `name`, unless `users` (what still runs on it or was saved from it) say
    it is in use. The default image is rebuilt by `rewind image build`, not removed here."""
    from rewind.image.build import find_image, recipe_id

    if name == recipe_id():
        raise InvalidArgument("the default image is not removed (its recipe's build is reused)")
    image = find_image(images_dir, name)
    if users:
        more = f" and {len(users) - 3} more" if len(users) > 3 else ""
        raise InvalidArgument(f"image {name!r} is in use by {', '.join(users[:3])}{more}: remove those first")
    # Renamed aside first: a machine started meanwhile finds no half-removed image.
    doomed = Path(tempfile.mkdtemp(prefix=f".rm-{name}-", dir=images_dir))
    os.rename(image.path, doomed / name)
    shutil.rmtree(doomed)
