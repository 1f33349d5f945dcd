"""The git tier, inside the guest: record a project folder before a step, put it back after.

It runs in the agent's own (already started) Python process, because under
emulation every new process costs tens of milliseconds and git would need a dozen.
dulwich (Debian's python3-dulwich) reads the index and ignore rules and writes
git's objects, so the result is an ordinary commit git itself can read.

`save` records the repository's work tree (tracked files, and untracked ones that
are not ignored) as a commit on refs/rewind/guard, and keeps a copy of the index,
of where HEAD points and of its branches and tags. The user's branch, index and
history are not touched. `restore` brings back edited and deleted files, removes
what the step created (except ignored files), and puts HEAD, its branch, the index,
the branches and the tags back (a commit and tag of `npm version` are taken back).
A folder outside any repository gets a repository of our own under SHADOW.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import time

from dulwich.errors import NotGitRepository
from dulwich.ignore import IgnoreFilterManager
from dulwich.index import (
    UnsupportedIndexFormat,
    blob_from_path_and_stat,
    build_file_from_blob,
    cleanup_mode,
    commit_tree,
    read_index_dict,
)
from dulwich.objects import S_ISGITLINK, Commit
from dulwich.repo import Repo

GUARD_REF = b"refs/rewind/guard"
SHADOW = "/var/lib/rewind/git-tier"
IDENTITY = b"rewind <rewind@localhost>"


class GitTierError(Exception):
    """The folder cannot be recorded or restored."""


def _replace_file(path: str, data: bytes) -> None:
    # No fsync: this state is for undo while the guest runs (a crashed guest is restored
    # from a checkpoint, not from it), and under emulation each fsync costs ~10 ms.
    tmp = path + ".rewind-tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class _Objects:
    """Writes git objects as loose files, without the fsync dulwich does for each."""

    def __init__(self, repo: Repo) -> None:
        self.path = repo.object_store.path

    def add_object(self, obj) -> None:
        hexsha = obj.id.decode()
        folder = os.path.join(self.path, hexsha[:2])
        path = os.path.join(folder, hexsha[2:])
        if os.path.exists(path):
            return
        os.makedirs(folder, exist_ok=True)
        _replace_file(path, obj.as_legacy_object())


def _signature(*paths: str) -> tuple:
    """What changes when any of these files is replaced or edited."""
    sig = []
    for path in paths:
        try:
            st = os.stat(path)
            sig.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except FileNotFoundError:
            sig.append(None)
    return tuple(sig)


class Project:
    """The repository holding a folder, with its work tree and ignore rules.

    Kept between requests (the agent is a long-lived process) and rebuilt when the
    repository's config or exclude file changes: finding the repository and reading its
    configuration would otherwise be a good part of each request. The index is parsed
    again only when it changes."""

    _known: dict[str, tuple[tuple, Project]] = {}

    @classmethod
    def of(cls, folder: str) -> Project:
        folder = os.path.realpath(folder)
        if not os.path.isdir(folder):
            raise GitTierError(f"{folder} is not a folder")
        cached = cls._known.get(folder)
        if cached is not None and cached[0] == cached[1].signature():
            return cached[1]
        project = cls(folder)
        cls._known[folder] = (project.signature(), project)
        return project

    def __init__(self, folder: str) -> None:
        try:
            self.repo = Repo.discover(folder)
            self.top = os.path.realpath(self.repo.path)
            manager = IgnoreFilterManager.from_repo(self.repo)
        except NotGitRepository:
            shadow = os.path.join(SHADOW, hashlib.sha1(folder.encode()).hexdigest()[:16] + ".git")
            if not os.path.isdir(shadow):
                os.makedirs(SHADOW, exist_ok=True)
                Repo.init_bare(shadow, mkdir=True)
            self.repo = Repo(shadow)
            self.top = folder
            manager = IgnoreFilterManager(folder, [], False)
        # from_repo read the config for these; dulwich has no public way to start again from them.
        self._global_ignores, self._ignorecase = manager._global_filters, manager._ignorecase
        self.gitdir = self.repo.controldir()
        self.objects = _Objects(self.repo)
        self.index_path = os.path.join(self.gitdir, "index")
        self.state_path = os.path.join(self.gitdir, "rewind-guard.json")
        self.saved_index = os.path.join(self.gitdir, "rewind-guard.index")
        self._index: tuple[tuple, dict] | None = None

    def signature(self) -> tuple:
        return _signature(os.path.join(self.gitdir, "config"), os.path.join(self.gitdir, "info", "exclude"))

    def ignore(self) -> IgnoreFilterManager:
        """Ignore rules as the files say now (each .gitignore is read when first needed)."""
        return IgnoreFilterManager(self.top, self._global_ignores, self._ignorecase)

    def full(self, path: bytes) -> str:
        return os.path.join(self.top, os.fsdecode(path))

    def index(self) -> dict:
        signature = _signature(self.index_path)
        if self._index is not None and self._index[0] == signature:
            return self._index[1]
        try:
            with open(self.index_path, "rb") as f:
                entries = read_index_dict(f)
        except FileNotFoundError:
            entries = {}
        except UnsupportedIndexFormat as e:
            raise GitTierError(f"git index format {e.index_format_version} is not supported") from None
        self._index = (signature, entries)
        return entries

    def untracked(self, known: set[bytes]) -> list[tuple[bytes, str, os.stat_result]]:
        """Files of the work tree not in `known` and not ignored (as `git add -A` sees them)."""
        found = []
        ignore = self.ignore()
        for dirpath, dirnames, filenames in os.walk(self.top):
            rel_dir = os.path.relpath(dirpath, self.top)
            rel_dir = "" if rel_dir == "." else rel_dir
            for d in list(dirnames):
                rel = os.path.join(rel_dir, d)
                full = os.path.join(dirpath, d)
                nested_repo = os.path.exists(os.path.join(full, ".git"))
                if d == ".git" or nested_repo or ignore.is_ignored(rel + "/"):
                    dirnames.remove(d)  # git's own, another repository, or ignored
                elif os.path.islink(full):
                    dirnames.remove(d)
                    filenames.append(d)
            for name in filenames:
                rel = os.path.join(rel_dir, name)
                path = os.fsencode(rel)
                if path in known or ignore.is_ignored(rel):
                    continue
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    found.append((path, full, st))
        return found

    def blob_of(self, full: str, st: os.stat_result) -> bytes:
        blob = blob_from_path_and_stat(os.fsencode(full), st)
        self.objects.add_object(blob)
        return blob.id


def _unchanged(entry, st: os.stat_result, index_mtime: float) -> bool:
    """The index's hash still holds for this file (git's own stat check, racy files rehashed)."""
    mtime = entry.mtime if isinstance(entry.mtime, tuple) else (int(entry.mtime), 0)
    return (mtime == (int(st.st_mtime), st.st_mtime_ns % 1_000_000_000) and entry.size == st.st_size
            and entry.mode == cleanup_mode(st.st_mode) and st.st_mtime < index_mtime)


def save(folder: str) -> dict:
    project = Project.of(folder)
    index = project.index()
    try:
        index_mtime = os.stat(project.index_path).st_mtime
    except FileNotFoundError:
        index_mtime = 0.0
    entries: dict[bytes, tuple[bytes, int]] = {}
    for path, entry in index.items():
        if S_ISGITLINK(entry.mode):
            entries[path] = (entry.sha, entry.mode)
            continue
        try:
            st = os.lstat(project.full(path))
        except (FileNotFoundError, NotADirectoryError):
            continue  # deleted since: `git add -A` would drop it too
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            continue
        sha = entry.sha if _unchanged(entry, st, index_mtime) else project.blob_of(project.full(path), st)
        entries[path] = (sha, cleanup_mode(st.st_mode))
    for path, full, st in project.untracked(set(index)):
        entries[path] = (project.blob_of(full, st), cleanup_mode(st.st_mode))
    tree = commit_tree(project.objects, [(p, sha, mode) for p, (sha, mode) in entries.items()])

    refs = project.repo.refs
    chain, head = refs.follow(b"HEAD")
    branch = chain[-1] if len(chain) > 1 else None
    commit = Commit()
    commit.tree = tree
    commit.parents = [head] if head else []
    commit.author = commit.committer = IDENTITY
    commit.author_time = commit.commit_time = int(time.time())
    commit.author_timezone = commit.commit_timezone = 0
    commit.message = b"rewind: the project before a guarded step\n"
    project.objects.add_object(commit)
    ref_path = os.path.join(project.gitdir, os.fsdecode(GUARD_REF))
    os.makedirs(os.path.dirname(ref_path), exist_ok=True)
    _replace_file(ref_path, commit.id + b"\n")  # a loose ref wins over a packed one

    # A second name for the index file itself: git replaces its index by rename, never in
    # place, so this keeps today's index without copying it.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(project.saved_index)
    with contextlib.suppress(FileNotFoundError):
        os.link(project.index_path, project.saved_index)
    state = {"commit": commit.id.decode(), "head": head.decode() if head else None,
             "branch": branch.decode() if branch else None, "top": project.top,
             "refs": {name.decode(): sha.decode() for name, sha in _branches_and_tags(refs).items()}}
    _replace_file(project.state_path, json.dumps(state).encode())
    return {"commit": commit.id.decode(), "top": project.top, "files": len(entries)}


def _branches_and_tags(refs) -> dict[bytes, bytes]:
    return {prefix + name: sha for prefix in (b"refs/heads/", b"refs/tags/")
            for name, sha in refs.as_dict(prefix).items()}


def restore(folder: str) -> dict:
    project = Project.of(folder)
    try:
        with open(project.state_path) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise GitTierError(f"nothing was saved for {folder}") from None
    repo = project.repo
    commit = repo[state["commit"].encode()]
    wanted = {e.path: (e.mode, e.sha) for e in repo.object_store.iter_tree_contents(commit.tree)}

    # What the step created goes: untracked files, and files it added to the index.
    for _path, full, _ in project.untracked(set(wanted)):
        os.unlink(full)
    for path in set(project.index()) - set(wanted):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(project.full(path))

    # Edited and deleted files come back.
    for path, (mode, sha) in wanted.items():
        if S_ISGITLINK(mode):
            continue
        full = project.full(path)
        parent = os.path.dirname(full)
        if os.path.lexists(parent) and not os.path.isdir(parent):
            os.unlink(parent)
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        build_file_from_blob(repo[sha], mode, os.fsencode(full))

    # Folders the step created and left empty go too (as `git clean -d` would).
    dirs = {os.fsdecode(os.path.dirname(p)) for p in wanted}
    ignore = project.ignore()
    for dirpath, _dirnames, _files in os.walk(project.top, topdown=False):
        rel = os.path.relpath(dirpath, project.top)
        if rel != "." and ".git" not in rel.split(os.sep) and not os.listdir(dirpath) \
                and not any(d == rel or d.startswith(rel + os.sep) for d in dirs) \
                and not ignore.is_ignored(rel + "/"):
            os.rmdir(dirpath)

    # Branches and tags as they were: those the step made go, those it moved come back.
    if "refs" in state:  # saved by an older agent: it kept none
        saved = {name.encode(): sha.encode() for name, sha in state["refs"].items()}
        now = _branches_and_tags(repo.refs)
        for name in now.keys() - saved.keys():
            repo.refs.remove_if_equals(name, None)
        for name, sha in saved.items():
            if now.get(name) != sha:
                repo.refs[name] = sha

    # HEAD, its branch and the index, as they were.
    head, branch = state["head"], state["branch"]
    if branch:
        _replace_file(os.path.join(project.gitdir, "HEAD"), f"ref: {branch}\n".encode())
        if head:
            repo.refs[branch.encode()] = head.encode()
        else:
            repo.refs.remove_if_equals(branch.encode(), None)
    elif head:
        _replace_file(os.path.join(project.gitdir, "HEAD"), f"{head}\n".encode())
    if os.path.exists(project.saved_index):
        tmp = project.index_path + ".rewind-tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.link(project.saved_index, tmp)
        os.replace(tmp, project.index_path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(project.index_path)
    return {"commit": state["commit"], "top": project.top, "files": len(wanted)}
