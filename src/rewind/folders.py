"""The host's side of folder copies (files.upload_dir/download_dir, `rewind cp -r`, the HTTP
tree routes): a host folder packed into a tar stream, a guest folder's stream unpacked here,
by cp -r's rule (guest/tree.py does both ends' work). Shared by the SDK and the HTTP client."""

from __future__ import annotations

import os
import posixpath
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from rewind.errors import AgentError, AlreadyExists, InvalidArgument, RewindError
from rewind.guest import tree
from rewind.guest.protocol import CHUNK

# What a copy's failure on this host is raised as, by its kind (see guest/tree.py): a place
# taken, a stream the other side got wrong, the host failing, else a path here that is unfit.
_TREE_ERRORS: dict[str, type[RewindError]] = {"exists": AlreadyExists, "bad_request": AgentError,
                                              "os_error": RewindError}


@contextmanager
def _tree_errors() -> Iterator[None]:
    try:
        yield
    except tree.TreeError as e:
        raise _TREE_ERRORS.get(e.kind, InvalidArgument)(str(e)) from e


def _reported(chunks: Iterable[bytes], counts: tree.Counts,
              progress: Callable[[str], None] | None) -> Iterator[bytes]:
    """`chunks`, telling `progress` once a second what the copy has moved."""
    due = time.monotonic() + 1.0
    for chunk in chunks:
        yield chunk
        if progress is not None and time.monotonic() >= due:
            progress(f"{counts.files} files, {counts.bytes / 2**20:.1f} MiB")
            due = time.monotonic() + 1.0


def packed(local: str | os.PathLike[str],
           progress: Callable[[str], None] | None = None) -> tuple[str | None, Iterator[bytes]]:
    """A host folder's name and its tar stream, in blocks; InvalidArgument at once if there is
    no such folder."""
    path = os.path.abspath(local)
    with _tree_errors():
        tree.source(path)
    counts = tree.Counts()

    def blocks() -> Iterator[bytes]:
        with _tree_errors():
            yield from _reported(tree.blocks(tree.pack(path, counts), CHUNK), counts, progress)
    return os.path.basename(path) or None, blocks()


def unpacked(chunks: Iterable[bytes], path: str, local: str | os.PathLike[str],
             progress: Callable[[str], None] | None = None) -> dict[str, int]:
    """Unpack the tar stream of the guest folder `path` to `local` by cp -r's rule (see
    guest/tree.py target), whole or not at all. `chunks` is asked for only once `local` is
    found fit. Files belong to the caller; setuid, setgid and sticky bits are dropped."""
    name = posixpath.basename(posixpath.normpath(path)) or None
    counts = tree.Counts()
    with _tree_errors():
        target = tree.target(os.path.abspath(local), name)
        tree.receive(target, _reported(chunks, counts, progress), 0o777, counts)
    return counts.as_dict()
