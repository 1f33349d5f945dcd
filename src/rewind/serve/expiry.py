"""Abandoned machines: what happens to a machine whose time to live has ended.

A machine given a time to live (`ttl` on create, `rewind ttl NAME` to extend it) is, once it
ends, stopped, checkpointed and stopped, or deleted, as its record says. `rewind serve` looks
every few seconds (Reaper); without a daemon, `rewind expire` does one round (for cron or a
systemd timer). Each machine is handled once: its time to live is cleared as it is acted on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from rewind.errors import NotFound, RewindError
from rewind.home import Home
from rewind.sandbox import Sandbox

log = logging.getLogger(__name__)
EVERY_S = 5.0  # how often the daemon looks: a machine outlives its time by at most this


@dataclass(frozen=True)
class Expired:
    """What was done to one machine whose time was up: `action`, and the point it left."""

    machine: str
    action: str
    checkpoint: str | None = None


def expire_due(home: Home, store: str | None = None, now: float | None = None) -> list[Expired]:
    """Act on every running machine of `home` whose time to live has ended."""
    now = time.time() if now is None else now
    done = []
    for sbx in Sandbox.list(home=home):
        info = sbx.info()
        if info.expires is None or info.expires > now or info.status != "running":
            continue
        try:
            done.append(_act(Sandbox.get(info.name, home=home, store=store), info.on_expiry or "stop"))
        except (NotFound, RewindError) as e:  # deleted meanwhile, or it failed: the others go on
            log.warning("machine %s: its time to live ended, but %s failed: %s", info.name,
                        info.on_expiry, e)
    return done


def _act(sbx: Sandbox, action: str) -> Expired:
    sbx.set_ttl(None)  # first: a failure below is not tried again every few seconds
    if action == "delete":
        sbx.delete()
        return Expired(sbx.name, action)
    # Stored here is enough to stop it: a bucket's upload goes on, and one the bucket refuses
    # now stays queued here rather than keep the machine running.
    point = sbx.checkpoint(labels={"auto": "expiry"}, wait="local") if action == "checkpoint" else None
    sbx.stop()
    log.info("machine %s: its time to live ended: %s", sbx.name, action)
    return Expired(sbx.name, action, point.id if point else None)


class Reaper:
    """The daemon's watch: expire_due every `every` seconds on a thread of its own."""

    def __init__(self, home: Home, store: str | None, every: float = EVERY_S) -> None:
        self.home, self.store, self.every = home, store, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rewind-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                expire_due(self.home, self.store)
            except Exception:  # noqa: BLE001 - the watch goes on; the next round tries again
                log.exception("looking for expired machines failed")
