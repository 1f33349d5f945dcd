"""Build the default guest image from Debian packages only.

The root file system comes from mmdebstrap; the kernel and its modules from
Debian's kernel package (fetched with apt on the host); the initramfs holds
busybox and the few modules needed to mount the root disk. The guest agent runs
from a disk of its own that QEMU attaches read-only (the runtime disk, mounted
at /usr/lib/rewind): the agent's files, a copy of the guest's Python with the
libraries it loads, and its own dynamic loader. Agents remove and upgrade the
guest's Python, pip and libc all the time; rewind's channel into the guest must
keep starting whatever they do. An image is named by the hash of its recipe and
of the guest files shipped in it, so it is rebuilt exactly when one of them
changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rewind.errors import AlreadyExists, ImageError, InvalidArgument

RECIPE: dict = {
    "format": 4,  # 4: init, its inittab and the tools sysinit uses come from the runtime disk too
    "suite": "bookworm",
    "variant": "minbase",
    "packages": [
        "bash", "coreutils", "git", "python3", "python3-dulwich", "ca-certificates", "iproute2",
        "busybox-static", "kmod", "procps", "curl", "e2fsprogs",
        # What an agent reaches for first: pip and venv, Node.js and npm, a compiler, jq, unzip.
        "python3-pip", "python3-venv", "nodejs", "npm", "build-essential", "jq", "unzip", "xz-utils",
    ],
    "kernel": "linux-image-amd64",
    # All the guest needs, loaded by the initramfs: an image brings no kernel modules.
    "boot_modules": ["virtio_pci", "virtio_blk", "crc32c_generic", "ext4", "virtio_console", "virtio_net",
                     "virtio_rng"],
    "disk_size_mib": 8192,
}

_HERE = Path(__file__).parent
_GUEST = _HERE.parent / "guest"
# Files copied into the guest: source -> path on the runtime disk, or on the root disk.
RUNTIME_FILES = {
    _GUEST / "agent.py": "agent.py",
    _GUEST / "protocol.py": "protocol.py",
    _GUEST / "tree.py": "tree.py",
    _GUEST / "gittier.py": "gittier.py",
    _GUEST / "sysinit.sh": "sysinit.sh",
    _GUEST / "inittab": "inittab",
}
GUEST_FILES = list(RUNTIME_FILES)
RUNTIME_MOUNT = "usr/lib/rewind"  # where the guest mounts the runtime disk
PYTHON = "python3.11"
# Parts of the guest's Python the agent never loads, left off the runtime disk.
RUNTIME_SKIP = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
                "config-3.11-x86_64-linux-gnu")
LOADER = "ld-linux-x86-64.so.2"
INITRAMFS_INIT = _HERE / "initramfs-init.sh"
PROBE_INIT = _HERE / "probe-init.sh"

_IMAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
KERNEL_FILE = "vmlinuz"
INITRD_FILE = "initrd.img"
PROBE_INITRD_FILE = "probe-initrd.img"
DISK_FILE = "rootfs.qcow2"
RUNTIME_FILE = "runtime.img"
MANIFEST_FILE = "image.json"


def recipe_id() -> str:
    h = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode())
    for path in sorted([*GUEST_FILES, INITRAMFS_INIT, PROBE_INIT]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Image:
    """An image on disk: kernel, initramfs and root disk (built here, or imported)."""

    path: Path
    id: str
    kernel_version: str
    created: float
    disk_size_mib: int
    exec: dict = field(default_factory=dict)  # defaults of every command: {"env", "cwd", "user"}
    source: dict = field(default_factory=dict)  # where it was built from: {"kind", "path", "digest"}
    base: str | None = None  # the default image whose kernel, initramfs and runtime disk it has

    @property
    def kernel(self) -> Path:
        return self.path / KERNEL_FILE

    @property
    def initrd(self) -> Path:
        return self.path / INITRD_FILE

    @property
    def disk(self) -> Path:
        return self.path / DISK_FILE

    @property
    def runtime_disk(self) -> Path | None:
        """The agent's read-only disk; None for an imported image (its agent runs its own way)."""
        path = self.path / RUNTIME_FILE
        return path if path.is_file() else None

    def to_json(self) -> dict:
        """As `rewind image ls --json`, GET /images and the MCP tool show it."""
        return {"id": self.id, "default": self.id == recipe_id(), "kernel": self.kernel_version,
                "created": self.created, "size_mib": self.size_bytes() >> 20,
                "disk_size_mib": self.disk_size_mib, "digest": self.source.get("digest"),
                "source": self.source or None, "path": str(self.path)}

    def size_bytes(self) -> int:
        """What its root disk takes on the host (its blocks: the file is sparse). The kernel,
        initramfs and runtime disk are shared with the default image."""
        return self.disk.stat().st_blocks * 512

    @property
    def probe_initrd(self) -> Path:
        """An initramfs that only prints a marker and powers off (see engine.accel)."""
        return self.path / PROBE_INITRD_FILE

    @classmethod
    def load(cls, path: Path) -> Image:
        """Open an image directory, checking that it is whole."""
        try:
            meta = json.loads((path / MANIFEST_FILE).read_text())
            image = cls(path=path, id=meta["id"], kernel_version=meta["kernel_version"],
                        created=meta["created"], disk_size_mib=meta["disk_size_mib"],
                        exec=meta.get("exec") or {}, source=meta.get("source") or {},
                        base=meta.get("base"))
        except (OSError, ValueError, KeyError) as e:
            raise ImageError(f"image at {path} is damaged: unreadable {MANIFEST_FILE} ({e})") from e
        for f in (image.kernel, image.initrd, image.disk):
            if not f.is_file() or f.stat().st_size == 0:
                raise ImageError(f"image at {path} is damaged: {f.name} is missing or empty; "
                                 "run `rewind image build --force`")
        return image


def find_image(images_dir: Path, image_id: str | None = None) -> Image:
    """An image by id (an imported image's name), or the default one for the current recipe."""
    if image_id is None:
        path = images_dir / recipe_id()
        if not path.exists():
            raise ImageError("the guest image is not built yet: run `rewind image build`")
    else:
        path = images_dir / image_id
        if not _IMAGE_NAME.fullmatch(image_id) or not path.exists():
            raise ImageError(f"no image named {image_id!r} (see `rewind image ls`)")
    return Image.load(path)


def list_images(images_dir: Path) -> list[Image]:
    found = []
    for path in sorted(images_dir.iterdir()) if images_dir.is_dir() else []:
        if not path.name.startswith(".") and (path / MANIFEST_FILE).is_file():
            try:
                found.append(Image.load(path))
            except ImageError:
                continue
    return found


def import_image(images_dir: Path, name: str, kernel: Path, initrd: Path, disk: Path,
                 runtime_disk: Path | None = None) -> Image:
    """Add an image of the user's own: a kernel, an initramfs, a root disk (raw or qcow2) and,
    if given, a raw disk attached read-only as /dev/vdb (the default image keeps its agent's
    runtime there).

    The guest must mount /dev/vda as root and run rewind's agent (guest/agent.py) as root
    on the virtio-serial ports named rewind.agent.N, as the default image does.
    """
    check_image_name(name)
    final = images_dir / name
    if final.exists():
        raise AlreadyExists(f"an image named {name!r} already exists")
    given = (("kernel", kernel), ("initramfs", initrd), ("disk", disk), ("runtime disk", runtime_disk))
    for what, f in given:
        if f is not None and not Path(f).is_file():
            raise InvalidArgument(f"{what} {f} is not a file")
    images_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".import-{name}-", dir=images_dir))
    try:
        shutil.copy(kernel, staging / KERNEL_FILE)
        shutil.copy(initrd, staging / INITRD_FILE)
        if runtime_disk is not None:
            shutil.copy(runtime_disk, staging / RUNTIME_FILE)
        run_tool(["qemu-img", "convert", "-O", "qcow2", str(disk), str(staging / DISK_FILE)],
             f"reading the disk {disk}")
        info = json.loads(run_tool(["qemu-img", "info", "--output=json", str(staging / DISK_FILE)],
                               "qemu-img info"))
        _write_manifest(staging, name, "custom", info["virtual-size"] >> 20, {"imported_from": str(disk)})
        os.rename(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Image.load(final)


def check_image_name(name: str) -> None:
    if not isinstance(name, str) or not _IMAGE_NAME.fullmatch(name) or name == recipe_id():
        raise InvalidArgument(f"invalid image name {name!r}: use letters, digits, '-', '_' and '.'")


def _write_manifest(path: Path, image_id: str, kernel_version: str, disk_size_mib: int,
                    extra: dict) -> None:
    (path / MANIFEST_FILE).write_text(json.dumps(
        {"id": image_id, "kernel_version": kernel_version, "created": time.time(),
         "disk_size_mib": disk_size_mib, **extra}, indent=2))


Report = Callable[[str], None]


def run_tool(cmd: list[str], what: str, cwd: Path | None = None) -> str:
    """Run a host tool; its output, or ImageError with the last lines it printed."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        raise ImageError(f"{what}: `{cmd[0]}` is not installed") from e
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ImageError(f"{what} failed: {' / '.join(tail)}")
    return done.stdout


def build_image(images_dir: Path, force: bool = False, report: Report = lambda _: None) -> Image:
    """Build the image for the current recipe unless it is already built.

    Work happens in a staging directory renamed into place at the end, so an
    interrupted build leaves no half image behind.
    """
    image_id = recipe_id()
    final = images_dir / image_id
    if final.exists() and not force:
        return Image.load(final)
    images_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".build-{image_id}-", dir=images_dir))
    try:
        kernel_version = _build_into(staging, image_id, report)
        _write_manifest(staging, image_id, kernel_version, RECIPE["disk_size_mib"], {"recipe": RECIPE})
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Image.load(final)


def _build_into(out: Path, image_id: str, report: Report) -> str:
    work = out / "work"
    root = work / "rootfs"
    work.mkdir()
    report("installing Debian packages with mmdebstrap")
    run_tool(["mmdebstrap", "--quiet", f"--variant={RECIPE['variant']}",
          "--include=" + ",".join(RECIPE["packages"]), RECIPE["suite"], str(root)], "mmdebstrap")

    report("fetching Debian's kernel")
    kernel_dir = work / "kernel"
    kernel_version = _fetch_kernel(work, kernel_dir)
    shutil.copy(kernel_dir / "boot" / f"vmlinuz-{kernel_version}", out / KERNEL_FILE)
    modules_dst = root / "usr/lib/modules" / kernel_version
    shutil.copytree(kernel_dir / "lib/modules" / kernel_version, modules_dst, symlinks=True)
    run_tool(["depmod", "-b", str(root), kernel_version], "depmod")

    report("installing the guest agent and its runtime")
    (root / RUNTIME_MOUNT).mkdir(parents=True, exist_ok=True)
    _make_runtime_disk(root, work / "runtime", out / RUNTIME_FILE)
    (root / "etc/hostname").write_text("rewind\n")
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("nameserver 10.0.2.3\n")
    (root / "etc/fstab").write_text("# rewind: the root disk is mounted by the initramfs\n")
    (root / "etc/machine-id").write_text("")

    report("making the initramfs")
    order = _module_load_order(root, kernel_version, RECIPE["boot_modules"])
    _make_initramfs(root, kernel_version, order, INITRAMFS_INIT, work / "initramfs", out / INITRD_FILE)
    _make_initramfs(root, kernel_version, [], PROBE_INIT, work / "probe", out / PROBE_INITRD_FILE)

    report("making the root disk")
    raw = work / "rootfs.raw"
    size = f"{RECIPE['disk_size_mib']}M"
    run_tool(["mkfs.ext4", "-q", "-F", "-L", "rewind-root", "-E", "root_owner=0:0",
          "-d", str(root), str(raw), size], "mkfs.ext4")
    run_tool(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(out / DISK_FILE)],
         "qemu-img convert")
    shutil.rmtree(work)
    return kernel_version


def _copy_files(files: dict[Path, str], dest: Path) -> None:
    for src, rel in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, target)
        target.chmod(0o755 if src.suffix in (".sh", ".py") else 0o644)


def _make_runtime_disk(root: Path, staging: Path, out: Path) -> None:
    """The runtime disk: the agent's files, init's inittab and sysinit.sh; bin/busybox (static,
    PID 1 and the tools sysinit uses); bin/python3, the guest's interpreter, with its
    standard library (lib/python3.11) and packages (lib/python3/dist-packages, dulwich for the
    git tier), found there from the interpreter's own path; and in lib/ every shared library
    they load and the loader that runs them (inittab starts the agent through it)."""
    _copy_files(RUNTIME_FILES, staging)
    lib = staging / "lib"
    (staging / "bin").mkdir()
    shutil.copy(root / "usr/bin" / PYTHON, staging / "bin/python3")
    shutil.copy(root / "usr/bin/busybox", staging / "bin/busybox")  # static: init and sysinit's tools
    shutil.copytree(root / "usr/lib" / PYTHON, lib / PYTHON, symlinks=True,
                    ignore=lambda _dir, names: [n for n in names if n in RUNTIME_SKIP])
    shutil.copytree(root / "usr/lib/python3/dist-packages", lib / "python3/dist-packages", symlinks=True)
    system_libs = root / "usr/lib/x86_64-linux-gnu"
    for name in _shared_libraries(system_libs, [staging / "bin/python3", *lib.rglob("*.so")]):
        shutil.copy(system_libs / name, lib / name)  # follows the soname's symlink
    python = [str(lib / LOADER), "--library-path", str(lib), str(staging / "bin/python3"), "-I"]
    # Compiled now, and never checked against the sources: the disk is read-only in the guest.
    run_tool([*python, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
          "-s", str(staging), "-p", f"/{RUNTIME_MOUNT}", str(staging)], "compiling the agent's Python")
    entries = list(staging.rglob("*"))
    blocks = sum(-(-p.lstat().st_size // 4096) + 1 for p in entries)  # a block each at least
    run_tool(["mkfs.ext4", "-q", "-F", "-L", "rewind-runtime", "-O", "^has_journal", "-E", "root_owner=0:0",
          "-b", "4096", "-N", str(len(entries) + 1024), "-d", str(staging), str(out),
          f"{blocks * 5 // 4 // 256 + 16}M"], "mkfs.ext4 (runtime disk)")


def _shared_libraries(system_libs: Path, elves: list[Path]) -> set[str]:
    """The sonames `elves` load, found among the guest's libraries by its own loader, and it."""
    found = {LOADER}
    for elf in elves:
        listing = run_tool([str(system_libs / LOADER), "--library-path", str(system_libs), "--list",
                            str(elf)], f"listing the libraries of {elf.name}")
        for line in listing.splitlines():
            name, arrow, where = line.strip().partition(" => ")
            if arrow and where.startswith(str(system_libs)):
                found.add(Path(name).name)  # the loader is listed by its absolute path
    return found


def _fetch_kernel(work: Path, dest: Path) -> str:
    depends = run_tool(["apt-cache", "depends", "--important", RECIPE["kernel"]], "apt-cache")
    package = next((line.split(":", 1)[1].strip() for line in depends.splitlines()
                    if line.strip().startswith("Depends:") and "linux-image-" in line), None)
    if package is None:
        raise ImageError(f"cannot resolve {RECIPE['kernel']} to a kernel package (run `apt-get update`)")
    run_tool(["apt-get", "download", "-q", package], "apt-get download", cwd=work)
    deb = next(work.glob(f"{package}_*.deb"))
    run_tool(["dpkg-deb", "-x", str(deb), str(dest)], "dpkg-deb")
    deb.unlink()
    return package.removeprefix("linux-image-")


def _module_load_order(root: Path, kernel_version: str, wanted: list[str]) -> list[str]:
    """Module files (relative to the modules dir) in dependency order, from modules.dep."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (root / "usr/lib/modules" / kernel_version / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        by_name[Path(path).name.split(".ko")[0].replace("-", "_")] = path
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in deps.get(path, []):
            visit(dep)
        order.append(path)

    for name in wanted:
        if name not in by_name:
            raise ImageError(f"kernel {kernel_version} has no module {name}")
        visit(by_name[name])
    return order


def _make_initramfs(root: Path, kernel_version: str, modules: list[str], init: Path, staging: Path,
                    out: Path) -> None:
    """A newc cpio archive: static busybox, `init`, and `modules` listed in load order."""
    modules_dir = f"lib/modules/{kernel_version}"
    (staging / "bin").mkdir(parents=True)
    shutil.copy(root / "usr/bin/busybox", staging / "bin/busybox")
    shutil.copy(init, staging / "init")
    (staging / "init").chmod(0o755)
    for rel in modules:
        target = staging / modules_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / "usr" / modules_dir / rel, target)
    (staging / "modules.load").write_text("".join(f"{modules_dir}/{rel}\n" for rel in modules))
    files = subprocess.run(["find", "."], cwd=staging, capture_output=True, check=True).stdout
    with open(out, "wb") as f:
        done = subprocess.run(["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"], cwd=staging,
                              input=files, stdout=f, stderr=subprocess.PIPE, check=False)
    if done.returncode != 0:
        raise ImageError(f"cpio failed: {done.stderr.decode().strip()}")
