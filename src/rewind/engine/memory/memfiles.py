"""Guest memory files on tmpfs, mapped copy-on-write by machines.

Machines map a memory file privately: pages they never write stay shared (in
the page cache) with every other machine mapping the same file. The file must
live on tmpfs, because QEMU's background snapshot can only write-protect
anonymous or shmem memory; copies on disk (templates) are brought over once.
"""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from rewind.engine.locks import file_lock
from rewind.errors import RewindError

_BLOCK = 4 << 20


def sparse_copy(src: Path, dest: Path) -> None:
    """Copy only the data extents of `src` (holes stay holes), then rename into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd_in = os.open(src, os.O_RDONLY)
    tmp_fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")  # 0600
    try:
        size = os.fstat(fd_in).st_size
        os.ftruncate(tmp_fd, size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd_in, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            end = os.lseek(fd_in, start, os.SEEK_HOLE)
            for at in range(start, end, _BLOCK):
                os.pwrite(tmp_fd, os.pread(fd_in, min(_BLOCK, end - at), at), at)
            pos = end
        os.rename(tmp, dest)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd_in)
        os.close(tmp_fd)


def private_runtime(runtime: Path) -> Path:
    """The runtime folder, made if missing and only ever this user's. Its name in /dev/shm is
    predictable, so another local user could make it first (refused then) or read guest
    memory in it (so it is 0700, and the files in it 0600)."""
    runtime.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(runtime, 0o700)
    except FileExistsError as e:
        st = os.lstat(runtime)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise RewindError(f"{runtime} is not a folder of this user's: remove it, or set "
                              f"REWIND_RUNTIME to a folder on tmpfs") from e
        if st.st_mode & 0o077:
            os.chmod(runtime, 0o700)
    return runtime


def on_tmpfs(runtime: Path, name: str, source: Path) -> Path:
    """The tmpfs copy of `source` named `name`, made on first use."""
    dest = private_runtime(runtime) / "ram" / name
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(runtime / "ram" / ".lock", timeout=120, what="the memory files"):
            if not dest.exists():
                sparse_copy(source, dest)
    return dest


def blank_layer(runtime: Path, size_mib: int) -> Path:
    """An empty qcow2 of `size_mib`, with no backing file named inside: machines copy it as
    a new top layer and give its backing on QEMU's command line."""
    path = runtime / f"blank-{size_mib}m.qcow2"
    if not path.exists():
        private_runtime(runtime)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")  # see NextQemu
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(tmp), f"{size_mib}M"],
                       check=True, capture_output=True)
        os.replace(tmp, path)
    return path
