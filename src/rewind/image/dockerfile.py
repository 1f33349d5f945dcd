"""Build a Dockerfile into an OCI archive with Buildah, from local images only.

Why Buildah: it is a Debian package (Podman would bring its whole stack for the same builder,
Docker a daemon), it needs no daemon, and `buildah build --tag oci-archive:PATH` writes the
archive directly without keeping the image in its storage.

The flags, and what was measured for them (buildah 1.28.2, Debian 12, as root):
- `--root`/`--runroot`/`--storage-driver`: the builder keeps its images and containers in
  folders of its own, never the host's /var/lib/containers. With the driver given on the command
  line, buildah also drops the driver options of the host's storage.conf (`buildah info` shows
  none), so a user's container settings do not reach rewind's builds.
- `overlay` driver: a build FROM an mmdebstrap minbase root (one RUN step) took 1.0-1.1 s,
  against 2.0-3.1 s with `vfs`, which copies the whole base into every build container. `vfs`
  remains for hosts whose file system cannot hold overlay's upper layers (an overlayfs root).
- `--pull=never`: FROM names an image that `import_root` stored as localhost/NAME. No registry
  is asked, even for names registries.conf aliases to one (debian, busybox), and an unknown
  name fails at once with "image not known".
- `--isolation chroot`: OCI isolation fails on this host: crun refuses its hybrid cgroup v1+v2
  layout ("cgroups in hybrid mode not supported"). Chroot isolation is no security boundary: a
  Dockerfile is trusted input here, like a script run as root.
- `--layers=false`: a build adds one layer and keeps no intermediate images in the storage.
- Every buildah command runs as PID 1 of its own PID and mount namespaces. Chroot isolation
  starts RUN steps in the host's PID namespace: a `RUN (daemon &)` outlived the build. Now the
  kernel kills whatever is left when buildah exits. The mount namespace keeps buildah's mounts
  off the host: run there, overlay leaves a bind mount of its folder behind, and a killed
  buildah its image mounts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rewind.errors import ImageError, InvalidArgument

Report = Callable[[str], None]

# --kill-child: should unshare be killed, buildah (and so its PID namespace) goes with it.
_NAMESPACES = ["unshare", "--mount", "--pid", "--fork", "--kill-child"]
_BUILD_FLAGS = [
    "--pull=never",
    "--isolation=chroot",
    # Chroot isolation accepts no other network than the host's: RUN steps reach what the host
    # reaches, as they would in `docker build`.
    "--network=host",
    "--layers=false",
    "--force-rm",  # the build container goes even when a step fails
    "--format=oci",  # whatever BUILDAH_FORMAT says in the caller's environment
]
# An image name as FROM takes it: a lower-case repository, and a tag if any.
_IMAGE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?")
# Lines buildah prints around a failing step that say nothing of its cause.
_NOT_OUTPUT = ("STEP ", "Error: ", "subprocess exited")
# unshare ignores SIGTERM and waits for buildah, which fails the running step and exits.
_STOP_GRACE_S = 30
_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class Builder:
    """A buildah storage of rewind's own: the images Dockerfiles start FROM."""

    root: Path  # buildah --root: images and containers
    runroot: Path  # buildah --runroot: locks and mount records, best on tmpfs (emptied at boot)
    driver: str = "overlay"  # a root made with one driver cannot be opened with another

    def build(self, dockerfile: Path, context: Path, out: Path, report: Report = lambda _: None,
              build_args: dict[str, str] | None = None) -> None:
        """Build `dockerfile` with `context` into an OCI archive at `out` (oci-archive format).

        Each line buildah prints goes to `report` and to a log next to `out` (`out` + ".log").
        The archive is written under another name and renamed, so `out` is never half written.
        """
        if not dockerfile.is_file():
            raise InvalidArgument(f"there is no Dockerfile at {dockerfile}")
        if not context.is_dir():
            raise InvalidArgument(f"the build context {context} is not a folder")
        out = out.absolute()
        if ":" in str(out):
            raise InvalidArgument(f"{out}: buildah cannot write an archive whose path has a ':'")
        partial, log = out.with_name(f".{out.name}.partial"), out.with_name(f"{out.name}.log")
        args = ["build", *_BUILD_FLAGS, f"--file={dockerfile.absolute()}",
                *(f"--build-arg={key}={value}" for key, value in (build_args or {}).items()),
                f"--tag=oci-archive:{partial}", str(context.absolute())]
        with self._session():
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                if _stream(self._command(args), log, report) != 0:
                    cause = _cause(log.read_text(encoding="utf-8"))
                    raise ImageError(f"{dockerfile} failed: {cause} (full log: {log})")
                os.replace(partial, out)
            finally:
                partial.unlink(missing_ok=True)

    def import_root(self, rootfs: Path, name: str, env: dict[str, str] | None = None) -> None:
        """Make a local image `name` from a root folder (e.g. an mmdebstrap root), so a Dockerfile
        can say FROM name without any registry. Owners, modes and file capabilities are kept."""
        if not rootfs.is_dir():
            raise InvalidArgument(f"the root {rootfs} is not a folder")
        if not _IMAGE_NAME.fullmatch(name):
            raise InvalidArgument(f"{name!r} is not an image name (lower-case letters, digits, ._-)")
        with self._session(), tempfile.TemporaryDirectory(prefix=".import-", dir=self.root) as tmp:
            layer = Path(tmp) / "root.tar"
            _pack(rootfs, layer)
            self._commit_layer(layer, f"localhost/{name}", env or {})

    def import_image(self, source: str, name: str) -> None:
        """Make a local image `name` from an OCI or Docker image (`oci-archive:PATH`,
        `docker-archive:PATH`, `oci:DIR`), so a Dockerfile can say FROM name."""
        if not _IMAGE_NAME.fullmatch(name):
            raise InvalidArgument(f"{name!r} is not an image name (lower-case letters, digits, ._-)")
        with self._session():
            pulled = self._run(["pull", "--quiet", source]).split()  # a local archive: no registry
            if not pulled:
                raise ImageError(f"buildah pull of {source} named no image")
            self._run(["tag", pulled[-1], f"localhost/{name}"])

    def export(self, name: str, out: Path) -> None:
        """Write local image `name` to `out` as an OCI archive (what `podman save --format
        oci-archive` writes)."""
        with self._session():
            self._run(["push", "--quiet", f"localhost/{name}", f"oci-archive:{out.absolute()}"])

    def remove_all(self) -> None:
        """Drop every image and container of this builder: its two folders go. Its commands mount
        nothing on the host, so nothing there holds them."""
        for folder in (self.root, self.runroot):
            if folder.exists():
                shutil.rmtree(folder)

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        """Use the builder shared with other rewind processes; tidy it if alone on it at the end."""
        if shutil.which("buildah") is None:
            raise ImageError("building from a Dockerfile needs buildah: apt-get install buildah")
        if os.geteuid() != 0:
            raise ImageError("building from a Dockerfile needs root (each build gets its own namespaces)")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # as buildah makes its own
        with (self.root / "rewind.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            try:
                yield
            finally:
                self._sweep(lock)

    def _sweep(self, lock: IO[str]) -> None:
        """When no other rewind process uses the builder, drop what none of its commands keeps:
        containers of killed buildahs (their mounts and processes went with their namespaces),
        images that an import of their name again left untagged, folders of broken imports."""
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        self._run(["rm", "--all"])
        self._run(["rmi", "--prune"])
        for folder in self.root.glob(".import-*"):
            shutil.rmtree(folder)

    def _commit_layer(self, layer: Path, image: str, env: dict[str, str]) -> None:
        # `buildah add` of a folder would make every file root's; of a tar it keeps the owners.
        container = self._run(["from", "--pull=never", "scratch"]).strip()
        try:
            self._run(["add", "--quiet", container, str(layer), "/"])
            if env:
                self._run(["config", *(f"--env={key}={value}" for key, value in env.items()), container])
            self._run(["commit", "--quiet", container, image])
        finally:
            self._run(["rm", container])

    def _command(self, args: list[str]) -> list[str]:
        return [*_NAMESPACES, "buildah", f"--root={self.root}", f"--runroot={self.runroot}",
                f"--storage-driver={self.driver}", *args]

    def _run(self, args: list[str]) -> str:
        done = subprocess.run(self._command(args), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise ImageError(f"buildah {args[0]} failed: {_cause(done.stderr or done.stdout)}")
        return done.stdout


def builder_for(home_root: Path) -> Builder:
    """The builder of a rewind home: its images under the home; buildah's run state in /run, which
    is emptied at boot as buildah expects (its records of mounts must not outlive them)."""
    tag = hashlib.sha256(os.fsencode(home_root.resolve())).hexdigest()[:12]
    return Builder(root=home_root / "builder", runroot=Path("/run") / f"rewind-builder-{tag}")


def _stream(command: list[str], log: Path, report: Report) -> int:
    """Run buildah, each line of its output to `log` and `report`; its exit status."""
    # A session of its own, so that an interruption can signal buildah and its steps, and nothing else.
    with log.open("w", encoding="utf-8") as sink, subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            encoding="utf-8", errors="replace", start_new_session=True) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                sink.write(line)
                report(line.rstrip("\n"))
        except BaseException:
            _stop(proc)
            raise
    return proc.returncode


def _stop(proc: subprocess.Popen[str]) -> None:
    """End an interrupted buildah. unshare ends last, once buildah and its PID namespace are gone;
    if buildah does not end in time, SIGKILL to unshare takes it along (--kill-child)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _pack(rootfs: Path, layer: Path) -> None:
    # --xattrs keeps file capabilities (cap_net_raw on a binary reached the built image, checked);
    # --numeric-owner: the host's user names mean nothing inside the image.
    done = subprocess.run(["tar", "--create", "--xattrs", "--numeric-owner", f"--file={layer}",
                           f"--directory={rootfs}", "."], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ImageError(f"packing {rootfs} failed: {_cause(done.stderr)}")


def _cause(output: str) -> str:
    """One line out of buildah's output: its last error, the step it failed at, and the last line
    that step printed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("Error: ") for line in lines if line.startswith("Error: ")]
    cause = errors[-1] if errors else (lines[-1] if lines else "no output")
    last_step = max((i for i, line in enumerate(lines) if line.startswith("STEP ")), default=-1)
    if last_step >= 0 and "STEP" not in cause:  # "image not known" names no step
        cause = f"{lines[last_step]}: {cause}"
    said = [line for line in lines[last_step + 1:] if not line.startswith(_NOT_OUTPUT)]
    if errors and said:  # without an error line, the cause is already the last line
        cause = f"{cause}; it printed: {said[-1]}"
    return cause if len(cause) <= _MESSAGE_CHARS else cause[:_MESSAGE_CHARS - 1] + "…"
