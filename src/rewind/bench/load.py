"""`scripts/load`: many clients on one `rewind serve`, on loopback, in a scratch home that shares
the built image. Bounded: at most MAX_CLIENTS clients and MAX_SECONDS per phase.

What it checks is what the daemon promises: every answer is a 2xx, or a 429/503 with
Retry-After (a full host says so); /health answers quickly throughout; and when the clients
are done, nothing is left (machines, QEMUs, memory files)."""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx2

from rewind.bench.ours import close_home
from rewind.home import Home
from rewind.serve.metrics import tree_bytes
from rewind.serve.process import serve_process

MAX_CLIENTS = 32
MAX_SECONDS = 600
HEALTH_EVERY_S = 0.05
OPS = ("create", "exec", "checkpoint", "restore", "delete")


@dataclass
class Phase:
    clients: int
    seconds: float
    rounds: int = 0
    statuses: Counter = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)  # answers that were neither 2xx nor 429/503 with Retry-After
    latency_ms: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    health_ms: list[float] = field(default_factory=list)
    health_in_daemon_ms: list[float] = field(default_factory=list)  # from its request log
    peak_rss_mib: float = 0.0  # the daemon and the QEMUs of its home, summed
    peak_shm_mib: float = 0.0
    left: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        def pct(values: list[float], q: float) -> float | None:
            return round(statistics.quantiles(values, n=100)[q - 1], 1) if len(values) >= 2 else None
        return {"clients": self.clients, "seconds": self.seconds, "rounds": self.rounds,
                "statuses": dict(self.statuses), "bad": self.bad[:10],
                "latency_ms": {op: {"p50": pct(v, 50), "p99": pct(v, 99), "n": len(v)}
                               for op, v in self.latency_ms.items()},
                "health_ms": _spread(self.health_ms, pct),
                "health_in_daemon_ms": _spread(self.health_in_daemon_ms, pct),
                "peak_rss_mib": round(self.peak_rss_mib), "peak_shm_mib": round(self.peak_shm_mib),
                "left": self.left}


def _call(http: httpx2.Client, phase: Phase, op: str, method: str, path: str,
          **kw: object) -> httpx2.Response:
    started = time.monotonic()
    r = http.request(method, path, **kw)
    phase.latency_ms[op].append((time.monotonic() - started) * 1000)
    phase.statuses[r.status_code] += 1
    if not (200 <= r.status_code < 300 or (r.status_code in (429, 503) and "retry-after" in r.headers)):
        phase.bad.append(f"{op} {r.status_code}: {r.text[:200]}")
    return r


def _client(url: str, token: str, n: int, phase: Phase, until: float) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx2.Client(base_url=url, headers=headers, timeout=httpx2.Timeout(300, connect=10)) as http:
        i = 0
        while time.monotonic() < until:
            name, i = f"load-{n}-{i}", i + 1
            made = _call(http, phase, "create", "POST", "/machines", json={"name": name})
            if made.status_code != 201:
                time.sleep(min(float(made.headers.get("retry-after", 1)), 2.0))  # the daemon asked to wait
                continue
            _call(http, phase, "exec", "POST", f"/machines/{name}/exec", json={"cmd": "echo 1 > /root/a"})
            point = _call(http, phase, "checkpoint", "POST", f"/machines/{name}/checkpoints", json={})
            _call(http, phase, "exec", "POST", f"/machines/{name}/exec", json={"cmd": "rm -rf /root/a"})
            if point.status_code == 201:
                ref = {"ref": point.json()["id"]}
                _call(http, phase, "restore", "POST", f"/machines/{name}/restore", json=ref)
            _call(http, phase, "delete", "DELETE", f"/machines/{name}")
            phase.rounds += 1


def _spread(values: list[float], pct: Callable[[list[float], int], float | None]) -> dict:
    return {"p50": pct(values, 50), "p99": pct(values, 99),
            "max": round(max(values), 1) if values else None, "n": len(values)}


def _health_in_daemon(log: Path) -> list[float]:
    """Each /health's time from request to answer inside the daemon (its JSON request log)."""
    times = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, AttributeError):
            entry = json.loads(line)
            if entry.get("path") == "/health" and isinstance(entry.get("ms"), int | float):
                times.append(float(entry["ms"]))
    return times


def _probe(url: str, seconds: float, out: multiprocessing.connection.Connection) -> None:
    """In a process of its own, as a monitoring probe would be: the clients' threads share a
    GIL that would delay its own measurements. Sends back each /health time (ms; -1 when it
    could not connect)."""
    times = []
    until = time.monotonic() + seconds
    with httpx2.Client(base_url=url, timeout=10) as http:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                http.get("/health")
                times.append((time.monotonic() - started) * 1000)
            except httpx2.TransportError:
                times.append(-1.0)
            time.sleep(HEALTH_EVERY_S)
    out.send(times)


def _watch(phase: Phase, done: threading.Event, home: Home) -> None:
    """The peaks of memory (the daemon and its home's QEMUs) and of the home's /dev/shm files."""
    while not done.wait(0.5):
        phase.peak_shm_mib = max(phase.peak_shm_mib, tree_bytes(home.runtime) / (1 << 20))
        phase.peak_rss_mib = max(phase.peak_rss_mib, _rss_mib(str(home.root)))


def processes_naming(text: str) -> list[int]:
    """PIDs whose command line holds `text` (a QEMU names its home's files in its own)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _rss_mib(text: str) -> float:
    total = 0
    for pid in processes_naming(text):
        try:
            total += int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                              if line.startswith("VmRSS:")))
        except (OSError, StopIteration):
            continue
    return total / 1024


def run_phase(home: Home, clients: int, seconds: float, log: Path) -> Phase:
    phase = Phase(clients, seconds)
    token_file = log.with_suffix(".token")
    token_file.write_text("load-" + os.urandom(16).hex())
    args = ["--token-file", str(token_file)]
    token = token_file.read_text()
    with serve_process(home, log, args) as url:
        done = threading.Event()
        watcher = threading.Thread(target=_watch, args=(phase, done, home), daemon=True)
        watcher.start()
        results, sent = multiprocessing.Pipe(duplex=False)
        prober = multiprocessing.get_context("spawn").Process(target=_probe, args=(url, seconds, sent))
        prober.start()
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=_client, args=(url, token, n, phase, until))
                   for n in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        watcher.join()
        probed = results.recv()
        prober.join()
        phase.health_ms = [t for t in probed if t >= 0]
        if len(probed) > len(phase.health_ms):
            phase.statuses["health_unreachable"] += len(probed) - len(phase.health_ms)
        with httpx2.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as http:
            phase.left += [f"machine {m['name']}" for m in http.get("/machines").json()]
    phase.health_in_daemon_ms = _health_in_daemon(log)
    close_home(home)
    phase.left += [f"process {pid}" for pid in processes_naming(str(home.root))]
    if home.runtime.exists() and any(home.runtime.iterdir()):
        phase.left.append(f"files in {home.runtime}")
    return phase


def main() -> None:
    parser = argparse.ArgumentParser(prog="scripts/load", description=__doc__)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--json", type=Path, default=None, help="Write both phases' figures here.")
    args = parser.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS // 2 or not 1 <= args.seconds <= MAX_SECONDS:
        sys.exit(f"scripts/load: --clients is 1 to {MAX_CLIENTS // 2} (the second phase doubles it), "
                 f"--seconds 1 to {MAX_SECONDS}")
    phases = []
    with tempfile.TemporaryDirectory(prefix="rewind-load-") as tmp:
        for clients in (args.clients, 2 * args.clients):
            home = Home(root=Path(tmp) / f"home-{clients}", images=Home.from_env().images)
            print(f"load: {clients} clients for {args.seconds:.0f} s", file=sys.stderr, flush=True)
            phases.append(run_phase(home, clients, args.seconds, Path(tmp) / f"serve-{clients}.log"))
            print(json.dumps(phases[-1].summary(), indent=2), flush=True)
    if args.json:
        args.json.write_text(json.dumps([p.summary() for p in phases], indent=2))
    failed = [p for p in phases if p.bad or p.left]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
