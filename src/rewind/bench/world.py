"""Your own environment in a machine: an image built from a 300 MiB OCI archive (made by
Buildah, as a container tool writes one), its first and later starts, and what a point of
it adds to a store that holds a point of the default image already."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rewind.bench.model import Report
from rewind.bench.ours import Progress, du_mib, timed
from rewind.engine.engine import Engine
from rewind.home import Home
from rewind.image.custom import build_from_image, remove_image
from rewind.image.dockerfile import Builder
from rewind.sandbox import Sandbox

IMAGE_MIB = 300
QUICK_IMAGE_MIB = 30  # --quick, as the test suite runs it
FILE_KIB = 300  # files of random bytes: nothing for zstd to shrink


def own_image(home: Home, report: Report, quick: bool, progress: Progress) -> None:
    """Skipped, with a line, where Buildah or busybox is missing."""
    mib = QUICK_IMAGE_MIB if quick else IMAGE_MIB
    if not Path("/bin/busybox").is_file():
        progress("own image: skipped (no /bin/busybox to make an image of)")
        return
    work = home.root / "own-image"
    builder = Builder(root=work / "builder", runroot=Path("/run") / f"rewind-bench-{os.getpid()}")
    archive = work / "image.tar"
    try:
        progress(f"own image: making a {mib} MiB OCI archive with Buildah (not measured)")
        _make_archive(builder, work / "root", archive, mib)
        peer = timed(lambda: builder.import_image(f"oci-archive:{archive}", "bench-pulled"))
        progress("own image: build, first start, next start, store")
        build = timed(lambda: build_from_image(home.images, "bench-own", f"oci-archive:{archive}"))
        first = timed(lambda: Sandbox.create("own-1", image="bench-own", home=home).exec(["true"]))
        later = timed(lambda: Sandbox.create("own-2", image="bench-own", home=home).exec(["true"]))
        default = Sandbox.create("own-default", home=home)
        default.checkpoint(wait=True)
        before = du_mib(home.store)
        Sandbox.get("own-1", home=home).checkpoint(wait=True)
        extra = du_mib(home.store) - before
        built = report.add("own_image_build_s", f"image from a {mib} MiB OCI archive", "s", [build])
        built.peers["buildah"] = [peer]  # `buildah pull` of the same archive: a container engine's import
        report.peers.setdefault("buildah", "ok")
        report.add("own_image_first_start_s", "its first machine until its first exec (boots it once)", "s",
                   [first])
        report.add("own_image_start_s", "its next machine until its first exec", "s", [later])
        report.add("own_image_store_mib", "what its first point adds to a store holding a default one",
                   "MiB", [extra])
    except FileNotFoundError as e:
        progress(f"own image: skipped ({e})")
    finally:
        for name in ("own-1", "own-2", "own-default"):
            if (home.machines / name).exists():
                Sandbox.get(name, home=home).delete()
        Engine(home).settle()
        if (home.images / "bench-own").exists():
            remove_image(home.images, "bench-own", [])
        if builder.root.exists():
            builder.remove_all()


def _make_archive(builder: Builder, root: Path, out: Path, mib: int) -> None:
    (root / "bin").mkdir(parents=True)
    subprocess.run(["cp", "/bin/busybox", str(root / "bin/busybox")], check=True)
    (root / "bin/sh").symlink_to("busybox")
    data = root / "data"
    data.mkdir()
    for i in range(mib * 1024 // FILE_KIB):
        (data / f"{i:04d}.bin").write_bytes(os.urandom(FILE_KIB * 1024))
    builder.import_root(root, "bench-own")
    builder.export("bench-own", out)
