"""Errors of the checkpoint store. All are StoreError, itself a RewindError; some are also
the general kinds (NotFound, Busy, ...) callers already catch."""

from __future__ import annotations

from rewind.errors import AlreadyExists, Busy, InvalidArgument, NotFound, RewindError


class StoreError(RewindError):
    """The store is missing or damaged, or could not be written (for example, out of space)."""


class CorruptChunk(StoreError):
    """A chunk is missing, unreadable, or its content does not match its hash."""


class StoreBusy(StoreError, Busy):
    """Another process held the store's lock for longer than the lock timeout."""


class UnknownCheckpoint(StoreError, NotFound):
    """A reference that matches no checkpoint, or reaches past the history kept."""


class BadRef(StoreError, InvalidArgument):
    """A reference that cannot be resolved to one checkpoint: ambiguous, or too short."""


class CheckpointExists(StoreError, AlreadyExists):
    """A checkpoint name (or an imported id) that is already taken."""


class WrongPassword(StoreError):
    """An encrypted store's password is wrong or missing: none of its keys opens with it."""


class UntrustedCheckpoint(StoreError):
    """A checkpoint that will not be run or imported: its signer is not trusted here, its
    signature does not match it, or it is unsigned where unsigned points are not allowed."""


class BadExport(StoreError):
    """An export file that is truncated, damaged, or not an export at all."""


class RemoteUnavailable(StoreError):
    """The remote store (S3) did not answer, or refused a request: what is local stays usable,
    and uploads resume once it answers again."""
