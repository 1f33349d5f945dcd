"""What operators watch: Prometheus metrics of one daemon, served at /metrics.

Operations (create, exec, checkpoint, restore, fork, try, ...) are counted by kind and outcome
(`ok`, or the error class a caller got) with their latency, through Service, so the HTTP API
and the MCP tools count alike. What is true of the host at the moment (machines by state, the
store's bytes, memory files on /dev/shm) is read when scraped.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rewind.errors import RewindError

if TYPE_CHECKING:
    from rewind.home import Home
    from rewind.store import Store

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: an exec round trip is tens of ms here, a create under a second, a try several.
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
STORE_SIZE_EVERY_S = 60.0  # walking a big store is slow: its size is read at most this often
F = TypeVar("F", bound=Callable[..., Any])


class Observed(Protocol):
    """What the metrics read of the service they count (serve/service.py's Service)."""

    metrics: Metrics
    home: Home
    store_path: str | os.PathLike[str] | None

    def list(self) -> list[dict[str, Any]]: ...

    def store(self) -> Store: ...


class Metrics:
    def __init__(self, service: Observed) -> None:
        self.registry = CollectorRegistry()
        self.operations = Counter("rewind_operations", "Operations, by kind and outcome "
                                  "(ok or the error class)", ["kind", "outcome"], registry=self.registry)
        self.latency = Histogram("rewind_operation_seconds", "How long operations took, by kind", ["kind"],
                                 buckets=BUCKETS, registry=self.registry)
        self.registry.register(_HostState(service))

    @contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        started, outcome = time.monotonic(), "internal_error"
        try:
            yield
            outcome = "ok"
        except RewindError as e:
            outcome = type(e).__name__
            raise
        finally:
            self.operations.labels(kind, outcome).inc()
            self.latency.labels(kind).observe(time.monotonic() - started)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def measured(kind: str) -> Callable[[F], F]:
    """Count and time a Service method as an operation of `kind`."""
    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self: Observed, *args: Any, **kwargs: Any) -> Any:
            with self.metrics.measure(kind):
                return method(self, *args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap


class _HostState(Collector):
    """Read on each scrape: machines by state, the store's size, memory files on tmpfs."""

    def __init__(self, service: Observed) -> None:
        self.service = service
        self._store_size: tuple[float, int] | None = None  # (when read, bytes)
        self._store: Store | None = None
        self._lock = threading.Lock()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        machines = GaugeMetricFamily("rewind_machines", "Machines of this daemon's home, by state",
                                     labels=["state"])
        counts: dict[str, int] = dict.fromkeys(("running", "stopped", "dead", "creating"), 0)
        for info in self.service.list():
            counts[info["status"]] = counts.get(info["status"], 0) + 1
        for state, count in counts.items():
            machines.add_metric([state], count)
        yield machines
        yield GaugeMetricFamily("rewind_store_bytes", "Bytes the checkpoint store takes on disk "
                                f"(read at most every {STORE_SIZE_EVERY_S:.0f} s)", value=self._store_bytes())
        yield GaugeMetricFamily("rewind_uploads_queued", "Checkpoints stored here and not yet in the "
                                "bucket (a store in a bucket; 0 for a folder store)", value=self._queued())
        runtime = self.service.home.runtime
        yield GaugeMetricFamily("rewind_shm_bytes", "Bytes of this home's memory files on tmpfs",
                                value=tree_bytes(runtime))
        if runtime.parent.is_dir():
            usage = shutil.disk_usage(runtime.parent)
            yield GaugeMetricFamily("rewind_shm_free_bytes", "Free bytes on the tmpfs of memory files",
                                    value=usage.free)

    def _queued(self) -> int:
        if self._store is None:
            self._store = self.service.store()  # opened once: a bucket's store asks the bucket
        queued = getattr(self._store, "queued", None)
        return len(queued()) if queued is not None else 0

    def _store_bytes(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._store_size is None or now - self._store_size[0] > STORE_SIZE_EVERY_S:
                root = Path(self.service.store_path) if self.service.store_path else self.service.home.store
                self._store_size = (now, tree_bytes(root) if root.is_dir() else 0)
            return self._store_size[1]


def tree_bytes(root: Path) -> int:
    """What the files under `root` take (their blocks: memory files are sparse)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                continue  # removed while walked
    return total
