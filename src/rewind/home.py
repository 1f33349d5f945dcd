"""Where rewind keeps its state: everything lives under $REWIND_HOME."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Home:
    """The state directory. `images` (built images, booted templates and the host's
    accelerator verdict) may be pointed elsewhere with REWIND_IMAGES, so that several
    homes, such as a test suite's temporary ones, share one built image."""

    root: Path
    images: Path

    @classmethod
    def from_env(cls, root: str | os.PathLike[str] | None = None) -> Home:
        base = Path(root or os.environ.get("REWIND_HOME") or Path.home() / ".local/share/rewind")
        images = os.environ.get("REWIND_IMAGES")
        return cls(root=base, images=Path(images) if images else base / "images")

    @property
    def machines(self) -> Path:
        return self.root / "machines"

    @property
    def serve_token(self) -> Path:
        """The token `rewind serve` requires when given none; the CLI on this host sends it to
        a daemon on loopback."""
        return self.root / "serve.token"

    @property
    def signing_key(self) -> Path:
        """The home's Ed25519 private key, which signs every checkpoint it commits (signers.py)."""
        return self.root / "keys" / "signing.key"

    @property
    def trust_file(self) -> Path:
        """The public keys whose checkpoints this home runs, besides its own (signers.py)."""
        return self.root / "trust.json"

    @property
    def store(self) -> Path:
        """The default checkpoint store."""
        return self.root / "store"

    @property
    def runtime(self) -> Path:
        """Guest memory files. They must be on tmpfs: QEMU can only track writes to
        (background-snapshot) memory that is anonymous or shmem. REWIND_RUNTIME overrides."""
        forced = os.environ.get("REWIND_RUNTIME")
        if forced:
            return Path(forced)
        tag = hashlib.sha256(os.fsencode(self.root.resolve())).hexdigest()[:12]
        return Path("/dev/shm") / f"rewind-{tag}"

