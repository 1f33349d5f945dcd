"""A daemon on a full host and with abandoned machines, against a real `rewind serve` and real
guests: its budget answers 429 with Retry-After and everything within it works; a machine's
time to live stops it, or checkpoints it into a point that runs; the thread that answers
requests runs before the machines it starts."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from conftest import rewind_cli
from invariants import wait_until
from serving import daemon_pid, home_env

from rewind import Home, Sandbox
from rewind.serve.process import serve_process

TOKEN_HEADER = "Authorization"


@pytest.fixture(scope="module")
def daemon(shared_home: Home, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx2.Client]:
    log = tmp_path_factory.mktemp("limits") / "serve.log"
    token = secrets.token_urlsafe(24)
    token_file = log.with_suffix(".token")
    token_file.write_text(token)
    args = ["--token-file", str(token_file), "--max-machines", "2", "--max-memory", "1200M"]
    with serve_process(shared_home, log, args) as url, \
            httpx2.Client(base_url=url, headers={TOKEN_HEADER: f"Bearer {token}"},
                          timeout=httpx2.Timeout(180, connect=5)) as http:
        yield http


def _created(http: httpx2.Client, **body: object) -> dict:
    r = http.post("/machines", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def _over_budget(r: httpx2.Response, what: str) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["content-type"] == "application/problem+json" and int(r.headers["retry-after"]) > 0
    assert r.json()["title"] == "OverBudget" and what in r.json()["detail"]


def test_the_budget_refuses_with_retry_after_and_all_within_it_works(daemon: httpx2.Client) -> None:
    http = daemon
    assert http.get("/config").json()["max_machines"] == 2
    first = _created(http, name="b1")["name"]
    _created(http, name="b2")
    _over_budget(http.post("/machines", json={"name": "b3"}), "at most 2 machines")
    _over_budget(http.post(f"/machines/{first}/fork", json={"count": 1}), "at most 2 machines")
    for name in ("b1", "b2"):  # the refusals touched nothing
        assert http.post(f"/machines/{name}/exec", json={"cmd": "echo fine"}).json()["stdout"] == "fine\n"
    assert http.post("/machines/b2/stop").status_code == 200
    assert http.patch("/config", json={"max_memory_mib": 600}).json()["max_memory_mib"] == 600
    _over_budget(http.post("/machines/b2/start"), "at most 600 MiB")
    assert http.patch("/config", json={"max_memory_mib": 1200}).status_code == 200
    assert http.post("/machines/b2/start").json()["status"] == "running"
    assert http.delete("/machines/b2").status_code == 204
    assert _created(http, name="b3")["status"] == "running"  # room again
    for name in ("b1", "b3"):
        assert http.delete(f"/machines/{name}").status_code == 204
    bad = http.patch("/config", json={"max_machines": 0})
    assert bad.status_code == 400 and http.get("/config").json()["max_machines"] == 2


def test_time_to_live_stops_or_checkpoints_and_the_point_restores(daemon: httpx2.Client,
                                                                   shared_home: Home) -> None:
    http = daemon
    kept = _created(http, name="kept", ttl=2, on_expiry="checkpoint")
    assert kept["expires"] is not None and kept["on_expiry"] == "checkpoint"
    http.post("/machines/kept/exec", json={"cmd": "echo work > /root/work"})
    stopped = _created(http, name="stopped", ttl=1)

    def status(name: str) -> str:
        return http.get(f"/machines/{name}").json()["status"]
    wait_until(lambda: status("kept") == "stopped" and status("stopped") == "stopped",
               "both machines stopped at the end of their time", timeout=60)
    assert http.get(f"/machines/{stopped['name']}").json()["expires"] is None  # acted on once
    points = http.get("/machines/kept/checkpoints").json()
    assert points[0]["labels"] == {"auto": "expiry"}
    copy = _created(http, name="from-expiry", from_checkpoint=points[0]["id"])
    back = http.post(f"/machines/{copy['name']}/exec", json={"cmd": "cat /root/work"}).json()
    assert back["stdout"] == "work\n", back

    # Extended, a time to live is from now; `rewind ls` shows what is left.
    http.put("/machines/from-expiry/ttl", json={"ttl": 3600, "on_expiry": "delete"})
    r = rewind_cli("ls", env={**home_env(shared_home), "REWIND_URL": str(http.base_url),
                              "REWIND_TOKEN": http.headers[TOKEN_HEADER].removeprefix("Bearer ")})
    row = next(line for line in r.stdout.decode().splitlines() if "from-expiry" in line)
    assert "delete" in row and (" h " in row or "60 min" in row), row
    for name in ("kept", "stopped", "from-expiry"):
        assert http.delete(f"/machines/{name}").status_code == 204


def test_expire_acts_once_without_a_daemon(home: Home) -> None:
    sbx = Sandbox.create("short", home=home, ttl=0.5, on_expiry="delete")
    wait_until(lambda: sbx.info().expires < time.time(), "its time to live to end", timeout=10)
    r = rewind_cli("expire", "--json", env=home_env(home))
    assert r.returncode == 0 and json.loads(r.stdout) == [{"machine": "short", "action": "delete",
                                                           "checkpoint": None}], r.stderr
    assert Sandbox.list(home=home) == []
    bad = rewind_cli("start", "x", "--ttl", "soon", env=home_env(home))
    assert bad.returncode == 2 and b"not a duration" in bad.stderr


def _policies(pid: int) -> dict[int, tuple[int, int]]:
    """The scheduling policy (without its reset-on-fork flag) and nice value of each thread
    of process `pid`, by thread id."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        policy = os.sched_getscheduler(int(task.name)) & ~os.SCHED_RESET_ON_FORK
        found[int(task.name)] = (policy, int(fields[16]))  # stat's field 19: nice
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="a real-time priority needs root or CAP_SYS_NICE")
def test_the_event_loop_runs_first_and_the_machines_it_starts_as_normal_threads(
        daemon: httpx2.Client) -> None:
    server = daemon_pid(daemon.base_url.port)
    _created(daemon, name="prio")
    try:
        qemu = daemon.get("/machines/prio").json()["pid"]
        assert daemon.post("/machines/prio/exec", json={"cmd": "true"}).status_code == 200
        threads = _policies(server)
        assert threads.pop(server)[0] == os.SCHED_RR  # the main thread runs the event loop
        assert threads and set(threads.values()) == {(os.SCHED_OTHER, 0)}  # the threadpool
        assert set(_policies(qemu).values()) == {(os.SCHED_OTHER, 0)}
    finally:
        assert daemon.delete("/machines/prio").status_code == 204
