"""Which files differ between two disks of one lineage, read on the host from the qcow2
layers that differ between them (see qcow2.py, ext4view.py).

Two disks of one history share their lower layers; only the clusters the other layers hold
can differ. Those clusters are mapped to ext4 blocks, the blocks that are inode-table
blocks name the inodes that may have changed (any write to a file, a chmod, a rename,
an unlink changes its inode), and each changed inode's names come from an index of the
file system's directories. That index is built once by walking the whole file system for
the image's own layers (about 1.5 s here), kept in a cache by the layers' identities
(frozen layers never change; the image's in the images folder, shared by every home that
uses it), and brought up to date for any later disk by re-reading only the directories
whose inodes changed. So a diff reads what changed, plus a little.
"""

from __future__ import annotations

import bisect
import contextlib
import fnmatch
import marshal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from rewind.engine.disk.ext4view import ROOT_INO, Ext4View
from rewind.engine.disk.qcow2 import Chain, LayerId
from rewind.results import FileChange
from rewind.store.durable import replace_durably

# Paths a machine changes by itself, or that rewind changes (a copy's identity): shown only
# with `all`. /var/lib/dpkg: the packages part of a diff says what changed there.
NOISE = ("/var/log/*", "/var/cache/*", "/var/lib/apt/*", "/var/lib/dpkg/*", "/var/lib/systemd/*",
         "/var/lib/dhcp/*", "/tmp/*", "/var/tmp/*", "/root/.cache/*", "*/__pycache__/*",
         "/etc/hostname", "/etc/hosts", "/etc/machine-id", "*.rewind-tmp")
_INDEX_VERSION = 3
_BASE_LAYERS = 2
KEEP_INDEXES = 64  # the image's disk and its template's layer: shared by every machine of an image


def is_noise(path: str) -> bool:
    return any(fnmatch.fnmatchcase(path, g) for g in NOISE)


@dataclass
class Index:
    """A file system's directories: inode -> {name: inode}, and where each one's entries lie
    ([[first block, count]]: a directory is read again when its blocks change, even if its
    inode did not). The blocks a journal replay covered are the views' (changed_blocks)."""

    dirs: dict[int, dict[str, int]]
    runs: dict[int, list[list[int]]]
    _parents: dict[int, list[tuple[int, str]]] | None = field(default=None, repr=False)

    def dump(self) -> bytes:
        """As kept in the cache: marshal, which loads an image's index in 5 ms where JSON took
        30 (it is this host's own derived data, rebuilt if it does not load)."""
        return marshal.dumps({"version": _INDEX_VERSION, "dirs": self.dirs, "runs": self.runs})

    @classmethod
    def load(cls, raw: bytes) -> Index:
        data = marshal.loads(raw)
        if not isinstance(data, dict) or data.get("version") != _INDEX_VERSION:
            raise ValueError("not an index of this version")
        dirs, runs = data["dirs"], data["runs"]
        if not isinstance(dirs, dict) or not isinstance(runs, dict):
            raise ValueError("a damaged index")
        return cls(dirs, runs)

    def dirs_in(self, blocks: set[int]) -> set[int]:
        """The directories with entries in any of these blocks."""
        return {d for d, runs in self.runs.items()
                if any(b in blocks for start, count in runs for b in range(start, start + count))}

    def read_dir(self, view: Ext4View, ino: int) -> None:
        """Take a directory's entries (again) from a disk; forget it if it is no longer one."""
        self._unlink(ino)
        st = view.stat(ino)
        if st is not None and st.type == "dir":
            self.dirs[ino] = {name: child for name, (child, _) in view.entries(ino).items()}
            self.runs[ino] = view.runs(ino)
        else:
            self.dirs.pop(ino, None)
            self.runs.pop(ino, None)
        self._link(ino)

    def parents(self) -> dict[int, list[tuple[int, str]]]:
        """inode -> the (directory, name) entries naming it. Made once for an index, then kept
        up to date by read_dir: made whole, it was 40 ms of each side of a try's diff."""
        if self._parents is None:
            self._parents = {}
            for d in self.dirs:
                self._link(d)
        return self._parents

    def advanced(self) -> Index:
        """A copy to bring up to date with read_dir, sharing what it does not change."""
        return Index(dict(self.dirs), dict(self.runs), dict(self.parents()))

    def _link(self, d: int) -> None:
        if self._parents is not None:
            for name, child in self.dirs.get(d, {}).items():
                self._parents[child] = [*self._parents.get(child, ()), (d, name)]  # lists are shared

    def _unlink(self, d: int) -> None:
        if self._parents is not None:
            for name, child in self.dirs.get(d, {}).items():
                left = [entry for entry in self._parents.get(child, ()) if entry != (d, name)]
                if left:
                    self._parents[child] = left
                else:
                    self._parents.pop(child, None)

    def paths(self, ino: int) -> list[str]:
        """Every path naming an inode (several for hard links)."""
        if ino == ROOT_INO:
            return ["/"]
        out = []
        for d, name in self.parents().get(ino, []):
            chain, here, seen = [name], d, {ino}
            while here != ROOT_INO:
                up = self.parents().get(here)
                if not up or here in seen:
                    break  # not reachable from the root
                seen.add(here)
                here, part = up[0]
                chain.append(part)
            else:
                out.append("/" + "/".join(reversed(chain)))
        return out

    def resolve(self, path: str) -> int | None:
        ino = ROOT_INO
        for part in path.strip("/").split("/"):
            if part:
                names = self.dirs.get(ino)
                if names is None or part not in names:
                    return None
                ino = names[part]
        return ino

    def subtree(self, path: str, ino: int) -> Iterator[str]:
        """The paths below a directory."""
        stack, seen = [(path, ino)], set()
        while stack:
            base, d = stack.pop()
            if d in seen:
                continue
            seen.add(d)
            for name, child in self.dirs.get(d, {}).items():
                p = f"{base.rstrip('/')}/{name}"
                yield p
                if child in self.dirs:
                    stack.append((p, child))


# Indexes this process loaded or made, by cache file: one diff reads the same one up to three
# times (a point, a running machine's frozen layers, the same plus its top). Never changed in
# place: an index brought up to date is a new one.
_loaded: dict[Path, Index] = {}


def _remember(path: Path, index: Index) -> None:
    if len(_loaded) >= 8:
        del _loaded[next(iter(_loaded))]
    _loaded[path] = index


def _trim(folder: Path, keep: int) -> None:
    """Remove all but the `keep` newest files of a folder."""
    files = []
    for p in folder.glob("*.idx"):
        with contextlib.suppress(FileNotFoundError):
            files.append((p.stat().st_mtime_ns, p))
    for _, p in sorted(files, reverse=True)[keep:]:
        p.unlink(missing_ok=True)


def _walk(view: Ext4View) -> Index:
    index = Index({}, {})
    stack = [ROOT_INO]
    while stack:
        d = stack.pop()
        if d in index.dirs:
            continue
        entries = view.entries(d)
        index.dirs[d] = {name: child for name, (child, is_dir) in entries.items()}
        index.runs[d] = view.runs(d)
        stack.extend(child for child, is_dir in entries.values() if is_dir)
    return index


def changed_blocks(a: Ext4View, b: Ext4View, chains: list[tuple[Chain, int]]) -> set[int]:
    """The file system blocks that may differ from disk a to disk b: those in the clusters
    held by each chain's layers from the given one up, and those either side's journal replay
    covered that read differently. (A guest's journal keeps what it replays until it is
    checkpointed: 41 blocks after the agent loop's first round, 103 after its twentieth, and
    every directory with entries there was read again.)"""
    blocks = {n for n in a.replayed | b.replayed if a.block(n) != b.block(n)}
    for chain, start in chains:
        per = (1 << chain.cluster_bits) // a.block_size
        for layer in chain.layers[start:]:
            for c in layer.clusters():
                blocks.update(range(c * per, (c + 1) * per))
    return blocks


def changed_inodes(a: Ext4View, b: Ext4View, blocks: set[int]) -> set[int]:
    """The inodes whose records differ between two disks, among those in `blocks`."""
    starts = a.tables
    order = sorted(range(len(starts)), key=starts.__getitem__)
    sorted_starts = [starts[g] for g in order]
    span = a.table_blocks
    changed: set[int] = set()
    per = a.block_size // a.inode_size
    for blk in sorted(blocks):
        i = bisect.bisect_right(sorted_starts, blk) - 1
        if i < 0 or blk >= sorted_starts[i] + span:
            continue
        if a.block(blk) == b.block(blk):
            continue
        first = order[i] * a.inodes_per_group + (blk - sorted_starts[i]) * per + 1
        for ino in range(first, min(first + per, a.inodes_count + 1)):
            if a.raw_inode(ino) != b.raw_inode(ino):
                changed.add(ino)
    return changed


@dataclass(frozen=True)
class IndexCache:
    """Where directory indexes are kept: those of the image's own layers apart, beside the
    image, so that every home using it finds them. `merged` gives the files that read as a
    chain of frozen layers (diskchain.reading_files: merged ones where there are)."""

    own: Path
    image: Path
    merged: Callable[[list[Path]], list[Path]] = list

    def folder(self, layers: int) -> Path:
        return self.image if layers <= _BASE_LAYERS else self.own


class Disk:
    """One side of a diff: a disk's layers, open, with its file system and directory index."""

    def __init__(self, layers: list[Path], frozen: int, cache: IndexCache) -> None:
        """`frozen`: how many of the layers (from the base) will never change again."""
        self.paths = layers
        self.ids = [LayerId.of(p) for p in layers]
        self.frozen = frozen
        self.cache = cache
        self.chain = self._chain(len(layers))
        try:
            self.view = Ext4View(self.chain)
            self.index = self._index()
        except BaseException:
            self.chain.close()
            raise

    def close(self) -> None:
        self.chain.close()

    def _chain(self, n: int) -> Chain:
        """The first n layers, open, read through merged files where there are."""
        frozen = min(n, self.frozen)
        return Chain(self.paths[:n], [*self.cache.merged(self.paths[:frozen]), *self.paths[frozen:n]])

    def _key(self, n: int) -> Path:
        return _index_path(self.ids[:n], self.cache)

    def _cached(self, n: int) -> Index | None:
        path = self._key(n)
        index = _loaded.get(path)
        if index is None:
            try:
                index = Index.load(path.read_bytes())
            except (OSError, ValueError, EOFError, TypeError, KeyError):
                return None
            _remember(path, index)
        return index

    def _keep(self, n: int, index: Index) -> None:
        """Cache the index of the first n layers (all frozen). Written whole or not at all;
        a lost race with another writer leaves an equal file. The newest KEEP_INDEXES of a
        home's points are kept (each is some 0.4 MiB)."""
        dest = self._key(n)
        dest.parent.mkdir(parents=True, exist_ok=True)
        replace_durably(dest, index.dump())
        _remember(dest, index)
        if dest.parent == self.cache.own:
            _trim(dest.parent, KEEP_INDEXES)

    def _index(self) -> Index:
        n = len(self.paths)
        for k in range(min(self.frozen, n), 0, -1):
            index = self._cached(k)
            if index is not None:
                break
        else:
            # The image's own layers, walked whole (a machine's top layer is never frozen).
            k = max(min(self.frozen, _BASE_LAYERS, n), 1)
            with self._chain(k) as prefix:
                view = self.view if k == n else Ext4View(prefix)
                index = _walk(view)
            if k <= self.frozen:
                self._keep(k, index)
        if k < n:
            index = self._advance(index, k)
            if n <= self.frozen:
                self._keep(n, index)
        return index

    def _advance(self, index: Index, k: int) -> Index:
        """The index of all layers, from that of the first k: the directories whose inodes or
        entries changed in the layers above are read again."""
        with self._chain(k) as prefix:
            below = Ext4View(prefix)
            blocks = changed_blocks(below, self.view, [(self.chain, k)])
            changed = changed_inodes(below, self.view, blocks) | index.dirs_in(blocks)
        index = index.advanced()
        for ino in changed:
            index.read_dir(self.view, ino)
        return index


def _index_path(ids: list[LayerId], cache: IndexCache) -> Path:
    h = blake3.blake3("\n".join(i.key() for i in ids).encode()).hexdigest()[:32]
    return cache.folder(len(ids)) / f"{h}.idx"


def index_ahead(layers: list[Path], cache: IndexCache) -> None:
    """Have the index of these frozen layers cached: a running machine's is made before it is
    paused to be read, so that only its top layer is read in the pause."""
    if not _index_path([LayerId.of(p) for p in layers], cache).exists():
        Disk(layers, len(layers), cache).close()


def diff_disks(a: Disk, b: Disk, include_noise: bool = False,
               globs: list[str] | None = None) -> list[FileChange]:
    """What changed from disk a to disk b, by path (sorted)."""
    shared = 0
    while shared < min(len(a.ids), len(b.ids)) and a.ids[shared] == b.ids[shared]:
        shared += 1
    blocks = changed_blocks(a.view, b.view, [(a.chain, shared), (b.chain, shared)])
    inodes = changed_inodes(a.view, b.view, blocks) | a.index.dirs_in(blocks) | b.index.dirs_in(blocks)
    candidates: set[str] = set()
    for ino in inodes:
        candidates.update(a.index.paths(ino))
        candidates.update(b.index.paths(ino))
        before, after = a.index.dirs.get(ino), b.index.dirs.get(ino)
        if before is None and after is None:
            continue
        before, after = before or {}, after or {}
        for name in before.keys() | after.keys():
            if before.get(name) == after.get(name):
                continue
            for side, entries in ((a.index, before), (b.index, after)):
                child = entries.get(name)
                for base in side.paths(ino):
                    p = f"{base.rstrip('/')}/{name}"
                    candidates.add(p)
                    if child is not None and child in side.dirs:
                        candidates.update(side.subtree(p, child))
    changes = []
    for path in sorted(candidates):
        if globs and not any(fnmatch.fnmatchcase(path, g) for g in globs):
            continue
        noise = is_noise(path)
        if noise and not include_noise:
            continue
        change = _compare(path, a, b, noise)
        if change is not None:
            changes.append(change)
    return changes


def _compare(path: str, a: Disk, b: Disk, noise: bool) -> FileChange | None:
    ia, ib = a.index.resolve(path), b.index.resolve(path)
    sa = None if ia is None else a.view.stat(ia)
    sb = None if ib is None else b.view.stat(ib)
    if sa is None and sb is None:
        return None
    if sa is None:
        return FileChange(path, "added", None, sb, noise)
    if sb is None:
        return FileChange(path, "deleted", sa, None, noise)
    if sa.type == sb.type == "dir":
        # A directory's own change is its entries' (reported as such); only its owner and mode count.
        same = (sa.mode, sa.uid, sa.gid) == (sb.mode, sb.uid, sb.gid)
    else:
        same = ia == ib and sa == sb
    return None if same else FileChange(path, "modified", sa, sb, noise)


def file_bytes(disk: Disk, path: str, limit: int) -> bytes | None:
    """A regular file's first `limit` bytes on a disk; None if it is not one there."""
    ino = disk.index.resolve(path)
    if ino is None:
        return None
    st = disk.view.stat(ino)
    if st is None or st.type != "file":
        return None
    return disk.view.read_file(ino, limit)
