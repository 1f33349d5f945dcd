"""Errors rewind raises. Every one carries a message a person can act on.

Every error rewind raises on purpose is a RewindError; the tree below is checked against
the code by tests/test_api.py (a new error class must be placed in it):

    RewindError
    ├── InvalidArgument (also ValueError)
    │   └── store.BadRef                     a checkpoint reference that names several points
    ├── NotFound (also LookupError)
    │   └── store.UnknownCheckpoint
    ├── AlreadyExists
    │   └── store.CheckpointExists
    ├── Busy
    │   └── store.StoreBusy
    ├── MachineNotRunning
    │   └── MachineDied
    ├── ImageError
    ├── AgentError
    │   ├── AgentGone
    │   └── GuestFileError
    ├── CommandFailed                        exec(check=True) of a command that exited non-zero
    ├── PortError                            a forward could not be set up (its host port is taken)
    ├── OverBudget                           a daemon's machines or guest memory would pass its budget
    ├── store.StoreError                     BadRef, UnknownCheckpoint, CheckpointExists and
    │   ├── store.CorruptChunk               StoreBusy are StoreErrors too
    │   ├── store.BadExport
    │   ├── store.WrongPassword              an encrypted store's password is wrong or missing
    │   ├── store.UntrustedCheckpoint        a point whose signer is not trusted, or signature bad
    │   └── store.RemoteUnavailable          the bucket of an s3:// store did not answer or refused
    ├── QemuError                            QEMU would not start or run
    │   └── NeedsNewerQemu                   a point of a board this host's QEMU lacks (a newer one's)
    ├── engine.qmp.MonitorError              QEMU refused a QMP command, or its monitor is gone
    ├── engine.migstream.StreamError         a memory capture could not be written out
    ├── engine.ramcache.NoRoom               tmpfs has no room for a memory image
    ├── engine.qcow2.LayerError              a disk layer cannot be read on the host (diff)
    │   └── engine.ext4view.FsError          nor the file system on the disk
    ├── guard.gittier.GitTierError           the git tier could not save or put back a project
    ├── results.Refused                      guarded() will not run a command outside the machine
    └── fleet.NodeLost                       the Ray node that ran a machine is gone, and the machine
"""

from __future__ import annotations


class RewindError(Exception):
    """Base of every error rewind raises on purpose."""


class InvalidArgument(RewindError, ValueError):
    """A name, size, path or option that rewind cannot accept."""


class NotFound(RewindError, LookupError):
    """A machine, image or file that does not exist."""


class AlreadyExists(RewindError):
    """A name that is already taken."""


class MachineNotRunning(RewindError):
    """The operation needs a running machine."""


class MachineDied(MachineNotRunning):
    """The machine's QEMU process ended without being asked to."""


class Busy(RewindError):
    """Another rewind command holds the machine's lock."""


class ImageError(RewindError):
    """The guest image is missing, damaged, or could not be built."""


class AgentError(RewindError):
    """The guest agent is unreachable or answered with an error."""


class AgentGone(AgentError):
    """The guest agent stopped answering (it was killed, or the guest powered off)."""


class GuestFileError(AgentError):
    """A file operation in the guest failed (missing file, directory, permission)."""


class PortError(RewindError):
    """A port forward could not be set up or ended (its host port is taken, say)."""


class OverBudget(RewindError):
    """Starting this would pass the daemon's budget of machines or guest memory; try again once
    some are stopped or deleted (`retry_after` seconds is a fair wait)."""

    def __init__(self, message: str, retry_after: int = 10) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class CommandFailed(RewindError):
    """Raised by exec(check=True) when the command exits non-zero."""

    def __init__(self, message: str, result: object) -> None:
        super().__init__(message)
        self.result = result


class QemuError(RewindError):
    """QEMU could not be started."""


class NeedsNewerQemu(QemuError):
    """A saved state is of a board this host's QEMU does not have: a newer QEMU saved it."""
